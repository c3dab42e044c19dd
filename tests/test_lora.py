"""--lora-rank (rlvr_utils/extras/lora.py, PEFT): only the adapters train; the reference is the same model with its
adapters off (no copy); checkpoints hold the adapters and a resumed run ends as an uninterrupted one; --save-model
writes a merged model or (--save-adapter) an adapter that load the standard way; the vLLM engine's weights are the
merged ones; the flags' bad values and --fsdp are one line."""

import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
from conftest import ROOT, TINY_MODEL
from helpers import run_dir, run_script

import common
from rlvr_utils.extras import lora

pytest.importorskip("peft")

FAST = ["--num-eval", "4", "--eval-every", "2", "--prompts-per-step", "2", "--num-generations", "4", "--threads", "1"]


def _args(**kw):
    base = dict(lora_rank=4, lora_alpha=None, lora_dropout=0.0, lora_target_modules=())
    return types.SimpleNamespace(**{**base, **kw})


def _policy():
    return common.load_policy(str(TINY_MODEL), torch.device("cpu"))


def _logp(model, tok, text="Solve: 12+3-4\n12+3=15\n15-4=11\n#### 11"):
    ids = torch.tensor([tok(text).input_ids])
    return common.token_logprobs(model, ids, torch.ones_like(ids), 8)[0]


def _nudge(model, seed=0):
    """Move every adapter off its zero start (B = 0), as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def test_only_the_adapters_train_and_start_as_the_base():
    model, tok = _policy()
    base = _logp(model, tok).detach()
    wrapped = common.with_lora(model, _args())
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n or "embed" in n for n in trainable)  # the blocks' linear layers only
    assert torch.equal(_logp(wrapped, tok).detach(), base)  # B = 0: the base's outputs exactly


def test_the_reference_is_the_base_with_adapters_off_not_a_copy():
    model, tok = _policy()
    base = _logp(model, tok).detach()
    wrapped = common.with_lora(model, _args())
    ref = common.reference(wrapped, _args())
    assert list(ref.parameters()) == []  # no second copy of the weights
    _nudge(wrapped)
    with torch.no_grad():
        moved, off = _logp(wrapped, tok), _logp(ref, tok)
    assert not torch.allclose(moved, base)  # the policy moved
    assert torch.equal(off, base)  # the reference did not
    assert torch.allclose(_logp(wrapped, tok).detach(), moved)  # and the adapters are back on after it


def test_full_fine_tuning_keeps_a_frozen_copy():
    model, _ = _policy()
    ref = common.reference(model, _args(lora_rank=0))
    assert ref is not model and not any(p.requires_grad for p in ref.parameters())


def test_merged_weights_are_the_merged_model_s():
    model, tok = _policy()
    wrapped = lora.wrap(model, _args())
    _nudge(wrapped, seed=1)
    want = _logp(wrapped, tok).detach()
    merged = dict(lora.iter_merged_weights(wrapped))
    fresh, _ = _policy()
    missing, unexpected = fresh.load_state_dict(merged, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # lm_head: tied
    assert torch.allclose(_logp(fresh, tok).detach(), want, atol=1e-5)


def test_a_checkpoint_s_adapters_load_back_and_a_wrong_one_is_named():
    model, _ = _policy()
    wrapped = lora.wrap(model, _args())
    _nudge(wrapped, seed=2)
    state = lora.adapter_state(wrapped)
    other = lora.wrap(_policy()[0], _args())
    assert lora.load_adapter_state(other, state) == []
    assert all(torch.equal(a, b) for a, b in zip(lora.adapter_state(other).values(), state.values()))
    smaller = lora.wrap(_policy()[0], _args(lora_rank=2))
    assert lora.load_adapter_state(smaller, {k + "x": v for k, v in state.items()})  # names that do not fit


@pytest.mark.slow
def test_a_resumed_lora_run_ends_as_an_uninterrupted_one(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    flags = [*FAST, "--lora-rank", "4", "--beta", "0.01"]
    out = run_script("grpo.py", "--total-steps", "3", "--output-dir", str(whole), "--save-model", *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_script("grpo.py", "--total-steps", "2", "--save-every", "2", "--output-dir", str(part), *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    d = run_dir(part)
    assert (d / "checkpoint" / "model" / "adapter_config.json").is_file()  # the adapters, not the base
    out = run_script("grpo.py", "--resume", str(d), "--total-steps", "3", "--save-model")
    assert out.returncode == 0, out.stderr[-3000:]
    strip = lambda p: [  # noqa: E731
        {k: v for k, v in json.loads(line).items() if not k.startswith("time") and k != "tokens_per_second"}
        for line in (p / "metrics.jsonl").open()
    ]
    assert strip(run_dir(whole)) == strip(d)
    wa = common.load_policy(str(run_dir(whole) / "model"), torch.device("cpu"))[0].state_dict()
    wb = common.load_policy(str(d / "model"), torch.device("cpu"))[0].state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [False, True])
def test_the_saved_model_loads_the_standard_way(tmp_path, adapter):
    flags = [*FAST, "--lora-rank", "4", "--total-steps", "2", "--save-model", "--output-dir", str(tmp_path)]
    out = run_script("grpo.py", *flags, *(["--save-adapter"] if adapter else []))
    assert out.returncode == 0, out.stderr[-3000:]
    saved = run_dir(tmp_path) / "model"
    card = (saved / "README.md").read_text()
    if adapter:
        from peft import AutoPeftModelForCausalLM

        here = os.getcwd()
        os.chdir(ROOT)  # a clone's root: the base is found by the path adapter_config.json gives, assets/tiny-arith
        try:
            model = AutoPeftModelForCausalLM.from_pretrained(str(saved))
        finally:
            os.chdir(here)
        assert (saved / "adapter_config.json").is_file() and "adapter" in card.lower()
        base = json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert base == "assets/tiny-arith" and str(ROOT) not in (saved / "adapter_config.json").read_text()
        assert "\nlibrary_name: peft\n" in card and "\nbase_model: assets/tiny-arith\n" in card  # PEFT's cards' keys
        assert "its base_model assets/tiny-arith is a local path" in out.stdout  # the save line says so too
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(saved))
        assert not (saved / "adapter_config.json").exists() and "merged" in card.lower()
    tok = common.load_tokenizer(str(saved))
    base, _ = _policy()
    assert not torch.allclose(_logp(model, tok).detach(), _logp(base, tok).detach())  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("script", ["sc_grpo.py", "grpo_lambda.py", "ep_grpo.py", "srpo.py"])
def test_every_method_trains_under_lora(tmp_path, script):
    out = run_script(script, *FAST, "--lora-rank", "4", "--total-steps", "2", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "metrics.jsonl").open()]
    assert all(r["grad_norm"] >= 0 for r in rows[1:]) and any(r["grad_norm"] > 0 for r in rows[1:])


def _one_line(args, env=None):
    r = subprocess.run(
        [sys.executable, "grpo.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )  # fmt: skip
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
        (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0"),
        (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
        (["--save-model", "--save-adapter"], "--save-adapter needs --lora-rank"),
        (["--lora-rank", "4", "--lora-target-modules", "embed_tokens"], "ties its input and output embeddings"),
        (["--lora-rank", "4", "--lora-target-modules", "lm_head"], "ties its input and output embeddings"),
        (["--lora-rank", "4", "--lora-target-modules", "foo_proj"], "--lora-target-modules foo_proj: Target modules"),
    ],
)
def test_bad_lora_flags_are_one_line(flags, words, tmp_path):
    assert words in _one_line([*flags, "--output-dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # no run directory left behind


def test_ep_grpo_s_moving_anchor_is_refused_under_lora():
    """--process-anchor ema/lagged copy the whole model, which LoRA is there to avoid."""
    r = subprocess.run(
        [sys.executable, "ep_grpo.py", "--lora-rank", "4", "--process-anchor", "ema"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "not with --lora-rank" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_a_lora_run_resumes_only_on_its_own_base(tmp_path):
    """The checkpoint holds only the adapters: a resume with --model naming other weights is one line; a byte-equal
    copy in another directory resumes (and --save-adapter may be added on resume)."""
    flags = [*FAST, "--lora-rank", "4", "--eval-every", "0"]
    out = run_script("grpo.py", "--total-steps", "1", "--save-every", "1", "--output-dir", str(tmp_path / "r"), *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    d = run_dir(tmp_path / "r")
    other = tmp_path / "other"  # the same shapes, other weights
    model, tok = _policy()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    model.save_pretrained(other)
    tok.save_pretrained(other)
    out = run_script("grpo.py", "--resume", str(d), "--total-steps", "2", "--model", str(other))
    assert out.returncode == 2 and "not the base the run" in out.stderr, out.stderr[-2000:]
    copy = tmp_path / "copy"
    shutil.copytree(TINY_MODEL, copy)
    args = ["--resume", str(d), "--total-steps", "2", "--model", str(copy), "--save-model", "--save-adapter"]
    out = run_script("grpo.py", *args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (d / "model" / "adapter_config.json").is_file()
    card = (d / "model" / "README.md").read_text()  # the flags as the run ended, not as it started
    assert "AutoPeftModelForCausalLM" in card and "--total-steps 2" in card and "--total-steps 1" not in card


def test_lora_with_fsdp_is_refused_before_anything_loads():
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert "--lora-rank with --fsdp is not supported" in _one_line(["--fsdp", "--lora-rank", "4"], env)


def test_missing_peft_is_one_line(monkeypatch, capsys):
    import importlib.util

    from rlvr_utils.core import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--lora-rank", "4"])
    with pytest.raises(SystemExit) as e:
        cli.parse(cli.BaseArgs)
    assert e.value.code == 2 and "--lora-rank needs peft" in capsys.readouterr().err


def test_the_default_alpha_is_the_rank_a_scale_of_one():
    """--lora-alpha's default is r (alpha / r = 1, the official SRPO code's), not PEFT's or 2r: each adapted layer's
    scaling is 1, and alpha 8 at rank 4 gives 2. A hand check of the adapter's output: W x + scale * B A x."""
    from peft.tuners.lora import LoraLayer

    for alpha, scale in ((None, 1.0), (8.0, 2.0)):
        wrapped = lora.wrap(_policy()[0], _args(lora_alpha=alpha))
        layers = [m for m in wrapped.modules() if isinstance(m, LoraLayer)]
        assert layers and {m.scaling["default"] for m in layers} == {scale}
        layer = layers[0]
        _nudge(wrapped)
        x = torch.randn(3, layer.in_features)
        want = layer.base_layer(x) + scale * layer.lora_B["default"](layer.lora_A["default"](x))
        assert torch.allclose(layer(x), want, atol=1e-6)


def test_a_lora_run_starts_without_a_warning():
    """peft's PeftModel reads transformers' deprecated is_gradient_checkpointing: its FutureWarning began every LoRA
    run; lora.wrap silences that one warning (and only it)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lora.wrap(_policy()[0], _args())


def test_an_adapter_names_its_base_as_the_user_gave_it(tmp_path):
    """adapter_config.json's base_model_name_or_path: the bundled model by its path in a clone (assets/tiny-arith), not
    this machine's absolute path; a hub id as such."""
    from rlvr_utils.extras.save import model_card

    assert model_card.base_as_given(str(TINY_MODEL)) == "assets/tiny-arith"
    assert model_card.base_as_given("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert model_card.base_as_given(str(snapshot)) == "Qwen/Qwen2.5-0.5B"  # a copy of the hub's cache: its id
    assert model_card.base_as_given("./my-base") == "./my-base"  # a local path, as given
    wrapped = lora.wrap(_policy()[0], _args())
    with lora.saved_as(wrapped, True, model_card.base_as_given(str(TINY_MODEL))) as saved:
        saved.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "assets/tiny-arith"

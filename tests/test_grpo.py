"""grpo.py through its real entry point on the bundled tiny model."""

import json

import pytest
import torch
from conftest import TINY_MODEL
from helpers import read_metrics, run_dir, run_inprocess, run_script

FAST = ["--num-eval", "16", "--eval-every", "0", "--prompts-per-step", "4", "--num-generations", "4"]


@pytest.mark.slow
def test_grpo_two_steps_subprocess(tmp_path):
    out = run_script("grpo.py", "--total-steps", "2", "--output-dir", str(tmp_path), "--save-model", *FAST)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "logs in" in out.stdout and "saved model to" in out.stdout
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "frac_groups_unsolved",
        "completions/mean_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "entropy",
        "policy_loss",
        "grad_norm",
        "learning_rate",
        "tokens_per_second",
        "time/generation",
        "time/logprobs",
        "time/update",
        "clip_ratio/region_mean",
    ):
        assert key in rows[1], key
    assert "kl" not in rows[1]  # beta = 0: no reference model, no kl metric
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2]
    # every trainable parameter changed, and the checkpoint loads back with from_pretrained
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(TINY_MODEL).state_dict()
    after = AutoModelForCausalLM.from_pretrained(run_dir(tmp_path) / "model").state_dict()
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged
    assert list(run_dir(tmp_path).glob("events.out.tfevents*"))  # tensorboard


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ["--beta", "0.04", "--num-iterations", "2", "--loss-agg", "token-mean", "--epsilon-high", "0.28"],
        ["--loss-agg", "seq-mean-token-sum-norm", "--scale-rewards", "none", "--micro-batch-size", "5"],
        ["--scale-rewards", "batch", "--eval-temperature", "1.0"],
    ],
)
def test_grpo_variants_run(tmp_path, flags):
    run_inprocess("grpo.py", "--total-steps", "1", "--output-dir", str(tmp_path), *FAST, *flags)
    rows = read_metrics(tmp_path)
    assert all(all(isinstance(v, (int, float)) and v == v for v in r.values()) for r in rows)  # no NaN
    if "--beta" in flags:
        assert rows[1]["kl"] >= 0.0
    cfg = json.loads((run_dir(tmp_path) / "config.json").read_text())
    assert cfg["epsilon_high"] is not None


@pytest.mark.slow
def test_grpo_help_lists_every_flag():
    out = run_script("grpo.py", "--help")
    assert out.returncode == 0
    for flag in (
        "--num-iterations",
        "--epsilon-high",
        "--beta",
        "--loss-agg",
        "--scale-rewards",
        "--save-model",
        "--track",
        "--model",
        "--task",
        "--data-path",
        "--eval-every",
        "--arith-steps",
    ):
        assert flag in out.stdout, flag


@pytest.mark.slow
def test_grpo_nan_loss_stops_without_checkpoint(tmp_path, monkeypatch):
    """A NaN loss (here: the aggregated loss made NaN; a NaN reward is TRL's "not scored", left out, so it cannot
    serve) stops the run at that step, before the update, and writes no model."""
    import common

    real = common.aggregate_loss
    monkeypatch.setattr(common, "aggregate_loss", lambda *a, **k: real(*a, **k) * float("nan"))
    with pytest.raises(SystemExit, match="non-finite loss .* at step 1"):
        run_inprocess("grpo.py", "--total-steps", "2", "--output-dir", str(tmp_path), "--save-model", *FAST)
    assert not (run_dir(tmp_path) / "model").exists()


def test_the_run_line_comes_before_the_model_loads_its_paths_relative(tmp_path, monkeypatch, capsys):
    """The first minute: the run line (its directory, the tensorboard command, what loads) is out before the
    tokenizer, task and model load; a path under the working directory is printed relative to it."""
    import common

    def loading(*args, **kwargs):
        raise RuntimeError("the tokenizer loads here")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "load_tokenizer", loading)
    with pytest.raises(RuntimeError, match="the tokenizer loads here"):
        run_inprocess("grpo.py", "--output-dir", "out", *FAST)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("run arith__grpo__1__") and " logs in out/arith__grpo__1__" in line, line
    assert "(tensorboard --logdir out); loading " in line and line.endswith(" and the arith task"), line
    assert not (tmp_path / "out").exists()  # the run directory is made once the task and model have loaded

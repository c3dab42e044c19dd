"""Several processes under torchrun (gloo on CPU, 2 ranks): DDP and FSDP2 step exactly like one process with
the whole batch, ranks stay identical, only rank 0 writes, and bad setups fail fast with a clear message."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DRIVER = str(ROOT / "tests" / "dist_driver.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # what the torchrun command runs, without relying on PATH
FIXED = [
    "--total-steps",
    "1",
    "--prompts-per-step",
    "4",
    "--num-generations",
    "4",
    "--micro-batch-size",
    "3",
    "--eval-every",
    "0",
    "--num-eval",
    "4",
    "--loss-agg",
    "token-mean",
]


def launch(
    out: Path, *args: str, nproc: int = 2, env: dict | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    cmd = ([*TORCHRUN, "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]) + [
        DRIVER,
        str(out),
        *args,
    ]
    e = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **(env or {}))  # gloo on CPU, even on a GPU host
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=e)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    r = launch(out, "--fixed", "grpo.py", *FIXED, "--output-dir", str(out / "runs"), nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out / "world1_rank0.pt")


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_with_half_the_batch_step_like_one_with_all(one_process, tmp_path, mode):
    flags = ["--fsdp"] if mode == "fsdp" else []
    r = launch(tmp_path, "--fixed", "grpo.py", *FIXED, *flags, "--output-dir", str(tmp_path / "runs"), "--save-model")
    assert r.returncode == 0, r.stderr[-3000:]
    r0, r1 = torch.load(tmp_path / "world2_rank0.pt"), torch.load(tmp_path / "world2_rank1.pt")
    assert max_diff(r0["params"], r1["params"]) == 0.0  # the ranks hold the same model
    assert one_process["fused"] and r0["fused"] == (mode == "ddp")  # DDP: fused lm_head log-probs; FSDP: logits
    assert max_diff(one_process["grads"], r0["grads"]) < 1e-6  # the gradient the optimizer saw (~0.05 at most)
    assert max_diff(one_process["params"], r0["params"]) < 1e-5
    from transformers import AutoModelForCausalLM

    import common

    start = AutoModelForCausalLM.from_pretrained(common.DEFAULT_MODEL).state_dict()
    assert max_diff(start, r0["params"]) > 5e-5  # it did train (one AdamW step moves weights by about lr = 1e-4)
    (run,) = (tmp_path / "runs").iterdir()  # only rank 0 wrote a run directory, with the metrics and the model
    saved = AutoModelForCausalLM.from_pretrained(run / "model").state_dict()
    assert max_diff(saved, r0["params"]) == 0.0


def test_global_token_normalization_is_what_makes_them_equal(one_process, tmp_path):
    """The same comparison fails when each rank normalizes by its own token count (the assertion above can fail)."""
    r = launch(
        tmp_path, "--fixed", "grpo.py", *FIXED, "--output-dir", str(tmp_path / "runs"), env={"DRIVER_LOCAL_COUNTS": "1"}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert max_diff(one_process["grads"], torch.load(tmp_path / "world2_rank0.pt")["grads"]) > 1e-5


@pytest.mark.parametrize("script, extra", [("grpo.py", []), ("srpo.py", ["--reset", "self"])])
def test_scripts_train_two_steps_under_torchrun(tmp_path, script, extra):
    r = launch(
        tmp_path,
        script,
        "--total-steps",
        "2",
        "--prompts-per-step",
        "4",
        "--eval-every",
        "0",
        "--num-eval",
        "8",
        "--output-dir",
        str(tmp_path / "runs"),
        *extra,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r0, r1 = torch.load(tmp_path / "world2_rank0.pt"), torch.load(tmp_path / "world2_rank1.pt")
    assert max_diff(r0["params"], r1["params"]) == 0.0
    (run,) = (tmp_path / "runs").iterdir()
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3  # steps 0, 1, 2, written once (by rank 0)


def test_bad_setups_fail_fast_with_a_clear_message(tmp_path):
    r = launch(tmp_path, "grpo.py", "--total-steps", "1", "--prompts-per-step", "3", "--output-dir", str(tmp_path))
    assert r.returncode != 0 and "must be divisible by the world size 2" in r.stderr
    r = launch(
        tmp_path,
        "grpo.py",
        "--total-steps",
        "1",
        "--prompts-per-step",
        "4",
        "--output-dir",
        str(tmp_path),
        env={"DRIVER_BAD_FLAGS": "1"},
    )
    assert r.returncode != 0 and "different flags" in r.stderr and "learning_rate" in r.stderr
    t0 = time.time()  # a rank that dies: the other one does not wait for it
    r = launch(
        tmp_path,
        "grpo.py",
        "--total-steps",
        "5",
        "--prompts-per-step",
        "4",
        "--output-dir",
        str(tmp_path),
        "--dist-timeout",
        "60",
        env={"DRIVER_DIE_AT_STEP": "1"},
    )
    assert r.returncode != 0 and time.time() - t0 < 60

"""Resumable runs (checkpoints.py): a run stopped and resumed matches an uninterrupted one bit for bit on CPU in
float32; Ctrl-C saves a checkpoint and exits with one line; the run's flags come back with --resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT
from helpers import run_dir, run_script

import common
from rlvr_utils.core import checkpoints, runtime

FAST = ["--num-eval", "8", "--eval-every", "2", "--prompts-per-step", "2", "--num-generations", "4", "--threads", "1"]
SCRIPTS = [
    ("grpo.py", ["--num-minibatches", "2"]),
    ("sc_grpo.py", []),
    ("srpo.py", ["--reset", "random"]),
    ("ep_grpo.py", ["--process-anchor", "ema"]),
    ("grpo_lambda.py", []),
]


def _metrics(path):
    rows = [json.loads(line) for line in (path / "metrics.jsonl").open()]
    return [{k: v for k, v in r.items() if not k.startswith("time") and k != "tokens_per_second"} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("script, flags", SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_resumed_run_matches_an_uninterrupted_one(tmp_path, script, flags):
    whole, part = tmp_path / "whole", tmp_path / "part"
    out = run_script(script, "--total-steps", "3", "--output-dir", str(whole), "--save-model", *FAST, *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_script(script, "--total-steps", "2", "--save-every", "2", "--output-dir", str(part), *FAST, *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    d = run_dir(part)
    assert (d / "checkpoint" / "trainer.pt").exists() and (d / "checkpoint" / "model" / "config.json").exists()
    out = run_script(script, "--resume", str(d), "--total-steps", "3", "--save-model")  # the run's own flags come back
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed after step 2" in out.stdout
    a, b = _metrics(run_dir(whole)), _metrics(d)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert a == b  # every logged metric of every step, not only the final accuracy
    wa = common.load_policy(str(run_dir(whole) / "model"), torch.device("cpu"))[0].state_dict()
    wb = common.load_policy(str(d / "model"), torch.device("cpu"))[0].state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_resume_refuses_a_changed_flag_and_keeps_the_runs_flags(tmp_path):
    out = run_script("grpo.py", "--total-steps", "1", "--save-every", "1", "--output-dir", str(tmp_path), *FAST)
    assert out.returncode == 0, out.stderr[-3000:]
    d = run_dir(tmp_path)
    out = run_script("grpo.py", "--resume", str(d), "--learning-rate", "0.5")
    assert out.returncode == 2 and out.stderr.strip().startswith("error: --learning-rate 0.5")
    assert "was started with 0.0001" in out.stderr


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_with_one_line(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "grpo.py"), "--total-steps", "500", "--output-dir", str(tmp_path), *FAST],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.time() + 240
    while time.time() < deadline:  # wait for the first trained step
        runs = list(tmp_path.iterdir())
        if (
            runs
            and (runs[0] / "metrics.jsonl").exists()
            and len((runs[0] / "metrics.jsonl").read_text().splitlines()) >= 2
        ):
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert [ln for ln in stdout.splitlines() if ln.startswith("stopped after step")], stdout[-2000:]
    d = run_dir(tmp_path)
    step = torch.load(d / "checkpoint" / "trainer.pt", weights_only=True)["step"]
    rows = [json.loads(line) for line in (d / "metrics.jsonl").open()]
    assert rows[-1]["step"] == step >= 1  # the logs were closed after the saved step
    out = run_script("grpo.py", "--resume", str(d), "--total-steps", str(step + 1))
    assert out.returncode == 0, out.stderr[-3000:]


def test_logger_resume_drops_rows_after_the_checkpoint(tmp_path):
    log = runtime.Logger(tmp_path, {"a": 1})
    for step in range(5):
        log.log({"reward": float(step), **({"eval/accuracy": step / 10} if step % 2 == 0 else {})}, step)
    log.close()
    log = runtime.Logger(tmp_path, {"a": 1}, resume_step=3)
    assert log.last_eval == {"eval/accuracy": 0.2}
    log.log({"reward": 9.0}, 4)
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["reward"] == 9.0


def test_counting_batches_skip_to_the_same_place():
    stream = checkpoints.CountingBatches(lambda: common.prompt_batches(list(range(10)), 3, seed=1))
    first = [next(stream) for _ in range(5)]
    stream.skip_to(2)
    assert stream.drawn == 2 and [next(stream) for _ in range(3)] == first[2:]


def test_checkpoint_is_atomic_and_keeps_only_the_last(tmp_path, tiny):
    model, tok = tiny
    opt = torch.optim.AdamW(model.parameters())
    stream = checkpoints.CountingBatches(lambda: common.prompt_batches(list(range(4)), 2, seed=0))
    ck = checkpoints.Checkpointer(tmp_path, every=1)
    ck.save(1, model, tok, opt, stream)
    ck.save(2, model, tok, opt, stream)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]  # no temporary or old copies left
    assert torch.load(tmp_path / "checkpoint" / "trainer.pt", weights_only=True)["step"] == 2

"""Hostile and careless input, second round, through the scripts' entry points: run paths and names, non-finite
flags, the seed, float16, data that yields nothing, the hub when it cannot be reached, method flags out of range,
concurrent runs with the same name, resume that checks the run's script, files and step, SIGTERM, interrupts while
loading, and a kill at any instant of a checkpoint save."""

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY_MODEL
from helpers import read_metrics, run_dir, run_inprocess

from rlvr_utils.core import checkpoints
from rlvr_utils.extras.save import saving

TINY = ["--num-eval", "4", "--eval-every", "0", "--prompts-per-step", "2", "--num-generations", "2"]
TINY += ["--max-new-tokens", "16", "--threads", "1"]


def _run(script, *args, env=None, timeout=300):
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def _one_line(out, *words, code=2):
    assert out.returncode == code, (out.returncode, out.stderr[-2000:])
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _gsm8k(path, n, answer="#### 2"):
    path.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": answer}) + "\n" for i in range(n)))
    return path


CASES = [  # (script, flags, words of the one line)
    ("grpo.py", ["--exp-name", "../../escape"], ["--exp-name", "one short path component"]),
    ("grpo.py", ["--exp-name", "a/b"], ["--exp-name", "one short path component"]),
    ("grpo.py", ["--exp-name", "/abs"], ["--exp-name", "one short path component"]),
    ("grpo.py", ["--exp-name", "x" * 300], ["--exp-name", "at most 64"]),
    ("grpo.py", ["--dtype", "float16"], ["--dtype float16", "bfloat16", "float32"]),
    ("grpo.py", ["--learning-rate", "inf"], ["--learning-rate", "finite"]),
    ("grpo.py", ["--max-grad-norm", "nan"], ["--max-grad-norm", "finite"]),
    ("grpo.py", ["--seed", "-1"], ["--seed", "[0, 2**32-1]"]),
    ("grpo.py", ["--seed", "99999999999999999999"], ["--seed", "[0, 2**32-1]"]),
    ("grpo.py", ["--arith-steps", "1", "--arith-max-value", "1", "--arith-max-operand", "1"], ["training problems"]),
    ("grpo_lambda.py", ["--lam", "-1", "--gamma", "-1"], ["--lam", "[0, 1]"]),
    ("grpo_lambda.py", ["--lam", "2"], ["--lam", "[0, 1]"]),
    ("grpo_lambda.py", ["--gamma", "-1"], ["--gamma", "[0, 1]"]),
    ("sc_grpo.py", ["--kl-loss-coef", "-1"], ["--kl-loss-coef", ">= 0"]),
    ("sc_grpo.py", ["--alpha", "-1"], ["--alpha", ">= 0"]),
    ("sc_grpo.py", ["--weighted-groups"], ["--weighted-groups"]),
    ("ep_grpo.py", ["--gate-alpha", "-5"], ["--gate-alpha", ">= 0"]),
    ("ep_grpo.py", ["--process-coef", "-1"], ["--process-coef", ">= 0"]),
    ("srpo.py", ["--localization-max-new-tokens", "0"], ["--localization-max-new-tokens", ">= 1"]),
    ("srpo.py", ["--localization-max-new-tokens", "-5"], ["--localization-max-new-tokens", ">= 1"]),
]


@pytest.mark.parametrize("script, flags, words", CASES, ids=[f"{c[0]}:{' '.join(c[1])[:40]}" for c in CASES])
def test_bad_flag_is_one_line_before_anything_loads(tmp_path, script, flags, words):
    out_dir = tmp_path / "runs"
    t0 = time.time()
    _one_line(_run(script, *flags, "--output-dir", str(out_dir), timeout=120), *words)
    assert time.time() - t0 < 60 and not out_dir.exists()  # nothing loaded, no run directory


def test_output_dir_that_is_a_file_empty_model_dir_and_missing_vllm(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    _one_line(_run("grpo.py", "--output-dir", str(f)), "--output-dir", "not a directory")
    empty = tmp_path / "empty_model"
    empty.mkdir()
    _one_line(_run("grpo.py", "--model", str(empty), "--output-dir", str(tmp_path / "r")), "holds no model")
    if importlib.util.find_spec("vllm") is None:
        _one_line(_run("grpo.py", "--engine", "vllm", "--output-dir", str(tmp_path / "r")), "--engine vllm", "vllm")


def test_hub_that_cannot_be_reached_is_one_line_at_once(tmp_path):
    """No weights or datasets can be downloaded: a hub id that is not cached, or a hub dataset, ends at once with one
    line naming --data-path / a local directory, instead of minutes of retries and a traceback."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    t0 = time.time()
    _one_line(_run("grpo.py", "--task", "gsm8k", env=env), "openai/gsm8k", "--data-path")
    _one_line(
        _run("grpo.py", "--model", "Qwen/Qwen2.5-0.5B-Instruct", env=env),
        "--model Qwen/Qwen2.5-0.5B-Instruct",
        "local directory",
    )
    assert time.time() - t0 < 60


def test_data_that_yields_nothing_is_one_line_naming_file_and_count(tmp_path):
    out = tmp_path / "runs"
    few = _gsm8k(tmp_path / "few.jsonl", 3)
    _one_line(
        _run("grpo.py", "--task", "gsm8k", "--data-path", str(few), "--output-dir", str(out)),
        "3 rows",
        "--num-eval 200",
    )
    bad = _gsm8k(tmp_path / "bad.jsonl", 12, answer="no final answer here")
    line = _one_line(
        _run("grpo.py", "--task", "gsm8k", "--data-path", str(bad), "--num-eval", "2", "--output-dir", str(out)),
        str(bad),
    )
    assert "unparsable_gold" in line
    ok = _gsm8k(tmp_path / "ok.jsonl", 12)
    line = _one_line(
        _run(
            "grpo.py",
            "--task",
            "gsm8k",
            "--data-path",
            str(ok),
            "--num-eval",
            "2",
            "--max-prompt-length",
            "1",
            "--output-dir",
            str(out),
        ),
        str(ok),
    )
    assert "prompt_too_long" in line
    pq = tmp_path / "rows.parquet"
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"question": "1+1?"}] * 5), pq)
    _one_line(_run("grpo.py", "--task", "gsm8k", "--data-path", str(pq), "--output-dir", str(out)), "answer")
    assert not out.exists()


@pytest.mark.slow
def test_runs_started_together_get_a_directory_each_and_paths_expand(tmp_path):
    """Three runs with the same task, name and seed started at once (a sweep in a shell loop): each its own
    directory. `--output-dir=~/runs` (no shell expansion) lands in $HOME/runs; --fsdp without torchrun warns; the
    saved weights have the umask's mode, not 0600."""
    env = dict(os.environ, HOME=str(tmp_path), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        str(ROOT / "grpo.py"),
        "--total-steps",
        "1",
        "--exp-name",
        "sweep",
        "--output-dir=~/runs",
        *TINY,
    ]
    procs = [
        subprocess.Popen(
            [*cmd, *(["--fsdp", "--save-model"] if i == 0 else [])],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1500:] for o in outs]
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 3 and not (ROOT / "~").exists()
    for r in runs:
        assert [json.loads(line)["step"] for line in (r / "metrics.jsonl").open()] == [0, 1]
    assert "warning: --fsdp" in outs[0][1]
    weights = next(tmp_path.glob("runs/*/model/*.safetensors"))
    assert weights.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _copy(saved, tmp_path) -> Path:
    d = tmp_path / saved.name
    shutil.copytree(saved, d)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ep_grpo.py", "sc_grpo.py"])
def test_another_scripts_run_is_refused(saved, tmp_path, script):
    d = _copy(saved, tmp_path)
    _one_line(_run(script, "--resume", str(d), "--total-steps", "2"), "made by grpo.py", script)


def _damage(d: Path, what: str) -> str:
    ck = d / "checkpoint"
    if what == "truncated trainer.pt":
        p = ck / "trainer.pt"
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    elif what == "empty trainer.pt":
        (p := ck / "trainer.pt").write_bytes(b"")
    elif what == "truncated weights":
        p = next((ck / "model").glob("*.safetensors"))
        p.write_bytes(p.read_bytes()[:100])
    elif what == "half config.json":
        p = d / "config.json"
        p.write_text(p.read_text()[: len(p.read_text()) // 2])
    elif what == "no model directory":
        shutil.rmtree(p := ck / "model")
    return p.name


@pytest.mark.slow
@pytest.mark.parametrize(
    "what", ["truncated trainer.pt", "empty trainer.pt", "truncated weights", "half config.json", "no model directory"]
)
def test_damaged_run_files_are_one_line_naming_the_file(saved, tmp_path, what):
    d = _copy(saved, tmp_path)
    name = _damage(d, what)
    _one_line(_run("grpo.py", "--resume", str(d), "--total-steps", "2"), name)


@pytest.mark.slow
def test_resume_drops_a_partial_metrics_line_takes_another_model_copy_and_refuses_a_finished_run(saved, tmp_path):
    d = _copy(saved, tmp_path)
    _one_line(_run("grpo.py", "--resume", str(d), "--total-steps", "1"), "already at step 1", "--total-steps")
    with (d / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "rew')  # a kill while writing
    other = tmp_path / "model_copy"  # the same weights under another path (a run made in another clone)
    shutil.copytree(TINY_MODEL, other)
    out = _run("grpo.py", "--resume", str(d), "--total-steps", "2", "--model", str(other))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "partial last line" in out.stderr
    assert [json.loads(line)["step"] for line in (d / "metrics.jsonl").open()] == [0, 1, 2]


@pytest.mark.slow
def test_sigterm_saves_and_names_the_resume_command(tmp_path):
    out = tmp_path / "runs"
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "grpo.py"), "--total-steps", "200", "--output-dir", str(out), *TINY],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    deadline = time.time() + 300
    while time.time() < deadline and not any(out.glob("*/metrics.jsonl")):
        time.sleep(0.2)
    while time.time() < deadline and len((next(out.glob("*/metrics.jsonl"))).read_text().splitlines()) < 2:
        time.sleep(0.2)  # a step is done: the run is training
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    assert "SIGTERM" in stderr and "--resume" in stdout
    d = run_dir(out)
    assert (d / "checkpoint" / checkpoints.COMPLETE).is_file()


@pytest.mark.slow
def _interrupt_while_loading(tmp_path, signals: int = 1) -> None:
    """SIGINT (`signals` times, 50 ms apart) while the run loads (its tokenizer, task and model): exit code 130, no
    traceback. The signal goes as soon as Run() has set its handlers, seen in /proc/<pid>/status: SIGTERM, which
    Python leaves alone, is then caught (SigCgt); the first step is seconds away."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux) to see when the run has set its signal handlers")
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "grpo.py"), "--output-dir", str(tmp_path / "r"), *TINY],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )

    def caught() -> int:
        with contextlib.suppress(OSError, StopIteration):
            status = Path(f"/proc/{p.pid}/status").read_text().splitlines()
            return int(next(x for x in status if x.startswith("SigCgt:")).split()[1], 16)
        return 0

    while not caught() & (1 << (signal.SIGTERM - 1)) and p.poll() is None:
        time.sleep(0.01)
    for k in range(signals):
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            time.sleep(0.05)
    out, stderr = p.communicate(timeout=300)
    made = list((tmp_path / "r").glob("*")) if (tmp_path / "r").exists() else []
    assert not made, (made, out)  # stopped before its run directory was made (the run line may be out already)
    assert p.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    assert "before the first step: stopped, nothing was saved" in stderr, stderr[-2000:]


def test_an_interrupt_while_loading_is_one_line(tmp_path):
    _interrupt_while_loading(tmp_path)


class _Killed(BaseException):
    """A kill -9: nothing after it runs (no except, no cleanup)."""


@pytest.mark.slow
def test_a_kill_at_any_point_of_a_save_loses_and_repeats_no_step(tmp_path, monkeypatch):
    """Kill the run at each write of its 2nd and 3rd checkpoint saves (each directory flushed to disk, each rename,
    trainer.pt): --resume then continues from the newest complete checkpoint, and metrics.jsonl ends with one row
    per step, the same rows as an uninterrupted run."""
    flags = ["--total-steps", "3", "--save-every", "1", *TINY]
    run_inprocess("grpo.py", "--output-dir", str(tmp_path / "whole"), *flags)
    whole = read_metrics(tmp_path / "whole")
    real = {
        "rename": os.rename,
        "save": torch.save,
        "fsync_tree": saving._fsync_tree,
        "rmtree": saving.shutil.rmtree,
    }
    for k in range(6, 18):  # the 1st save makes 5 of these writes (nothing to resume after them), the others 6
        count = [0]

        def killer(name):
            def f(*a, **kw):
                count[0] += 1
                if count[0] == k:
                    monkeypatch.setattr(saving.shutil, "rmtree", lambda *a, **kw: None)  # no cleanup after -9
                    raise _Killed
                return real[name](*a, **kw)

            return f

        monkeypatch.setattr(saving.os, "rename", killer("rename"))
        monkeypatch.setattr(saving.torch, "save", killer("save"))
        monkeypatch.setattr(saving, "_fsync_tree", killer("fsync_tree"))
        out = tmp_path / f"k{k}"
        with pytest.raises(_Killed):
            run_inprocess("grpo.py", "--output-dir", str(out), *flags)
        monkeypatch.undo()
        newest = checkpoints.Checkpointer(run_dir(out), 0).copies()[0][0]
        if newest == 3:  # killed after the last checkpoint was complete: the run is done, and says so
            with pytest.raises(SystemExit) as e:
                run_inprocess("grpo.py", "--resume", str(run_dir(out)), "--total-steps", "3")
            assert e.value.code == 2
        else:
            run_inprocess("grpo.py", "--resume", str(run_dir(out)), "--total-steps", "3")
        rows = read_metrics(out)
        assert [r["step"] for r in rows] == [0, 1, 2, 3], k
        for a, b in zip(rows, whole):
            assert {x: v for x, v in a.items() if not x.startswith(("time/", "tokens_per"))} == {
                x: v for x, v in b.items() if not x.startswith(("time/", "tokens_per"))
            }, (k, a["step"])
        if newest < 3:
            assert not list(run_dir(out).glob(".checkpoint.*")), k  # leftovers removed by the resume


def test_an_oversized_evaluation_is_announced():
    """--num-eval 100000 would generate 100000 completions at every evaluation: a warning says so (here the run
    then stops on a bad method flag, so nothing loads)."""
    out = _run("grpo_lambda.py", "--num-eval", "100000", "--lam", "2")
    _one_line(out, "--lam")
    assert "warning: --num-eval 100000" in out.stderr

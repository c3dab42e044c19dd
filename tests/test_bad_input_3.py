"""Hostile and careless input, third round: half-copied model directories, flags whose meaning breaks (a success
threshold at or below 0, a non-ASCII run name, a completion budget that leaves no room for a prompt), a closed stdout
at the end of a run, SIGHUP. Each is one line (exit code 2 for bad input) with no traceback and, before anything loads,
no run directory left behind."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, TINY_MODEL
from test_bad_input import TINY, _one_line, _run


def _copy_model(tmp_path, name="m"):
    d = tmp_path / name
    shutil.copytree(TINY_MODEL, d)
    return d


@pytest.mark.parametrize(
    "damage, words",
    [
        ("no_tokenizer", ["holds no tokenizer", "tokenizer.json"]),
        ("truncated_weights", ["model.safetensors is truncated"]),
        ("cut_header", ["model.safetensors is damaged or truncated"]),
        ("vocab_mismatch", ["vocab_size 120 does not match", "99 embedding rows"]),
        ("bad_config", ["config.json cannot be read as JSON"]),
    ],
)
def test_a_half_copied_model_directory_is_one_line_before_the_run_directory_exists(tmp_path, damage, words):
    d = _copy_model(tmp_path)
    weights = d / "model.safetensors"
    if damage == "no_tokenizer":
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (d / f).unlink()
    elif damage == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "cut_header":
        weights.write_bytes(weights.read_bytes()[:20])
    elif damage == "vocab_mismatch":
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(dict(config, vocab_size=120)))
    else:
        (d / "config.json").write_text('{"model_type": "qwen2", ')
    out = tmp_path / "runs"
    _one_line(_run("grpo.py", "--model", str(d), "--output-dir", str(out), timeout=120), f"--model {d}", *words)
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--success-threshold", "-1"], ["--success-threshold must be > 0", "every completion"]),
        (["--success-threshold", "0"], ["--success-threshold must be > 0"]),
        (["--exp-name", "rün"], ["--exp-name", "ASCII letters"]),
        (["--max-new-tokens", "600"], ["--max-new-tokens 600 leaves no room for a prompt", "512 positions"]),
        (["--vllm-is-min", "3", "--vllm-is-cap", "2"], ["--vllm-is-min must be below --vllm-is-cap"]),
        (["--thought-reserve", "-1"], ["--thought-reserve must be >= 0"]),
    ],
)
def test_flags_whose_meaning_breaks_are_one_line(tmp_path, flags, words):
    script = "srpo.py" if "--thought-reserve" in flags else "grpo.py"
    out = tmp_path / "runs"
    _one_line(_run(script, *flags, "--output-dir", str(out), timeout=120), *words)
    assert not out.exists()


def test_a_prompt_limit_over_the_models_positions_is_lowered_and_said(tmp_path):
    """--max-prompt-length 2000 with the bundled model's 512 positions: the run trains, prompts over 512 - 16 tokens
    would be skipped, and one note says so."""
    out = _run("grpo.py", *TINY, "--total-steps", "1", "--max-prompt-length", "2000", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "prompts over 496 tokens are skipped" in out.stderr


def test_a_closed_stdout_keeps_the_saved_model(tmp_path):
    """`python grpo.py --save-model ... | head -1`: the pipe closes after the first line; the run still trains, saves
    its model and ends without a traceback."""
    cmd = f"{sys.executable} {ROOT / 'grpo.py'} {' '.join(TINY)} --total-steps 1 --save-model --output-dir {tmp_path}"
    proc = subprocess.run(
        f"{cmd} | head -1",
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (run / "model" / "model.safetensors").is_file() and (run / "model" / "config.json").is_file()


def test_sighup_stops_like_sigterm(tmp_path):
    """A closed terminal or ssh session sends SIGHUP: the run saves a checkpoint after the step and names --resume."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "grpo.py"), *TINY, "--total-steps", "200", "--output-dir", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
    )
    deadline = time.time() + 240
    while time.time() < deadline:  # wait for the first step's metrics
        runs = [p for p in tmp_path.iterdir() if p.is_dir()]
        if (
            runs
            and (runs[0] / "metrics.jsonl").exists()
            and len((runs[0] / "metrics.jsonl").read_text().splitlines()) > 1
        ):
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "--resume" in out and "SIGHUP" in err
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (run / "checkpoint" / "complete.json").is_file()


@pytest.mark.parametrize("task", ["custom", "code"])
def test_a_truncated_gzip_data_file_is_one_line(tmp_path, task):
    import gzip

    if task == "code":
        row = {"task_id": "t/0", "prompt": "def f(x):\n", "canonical_solution": "    return x\n"}
        row |= {"test": "def check(c):\n    assert c(1) == 1\n", "entry_point": "f"}
    else:
        row = {"prompt": "say 1", "x": 1}
    data = gzip.compress("".join(json.dumps(row) + "\n" for _ in range(200)).encode())
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])  # an interrupted download
    reward = tmp_path / "reward.py"
    reward.write_text("def r(prompts, completions, **kw):\n    return [0.0 for _ in completions]\n")
    extra = ["--reward-fn", f"{reward}:r"] if task == "custom" else []
    out = _run("grpo.py", "--task", task, "--data-path", str(path), *extra, "--output-dir", str(tmp_path / "runs"))
    _one_line(out, f"--data-path {path}", "cut short")
    assert not (tmp_path / "runs").exists()

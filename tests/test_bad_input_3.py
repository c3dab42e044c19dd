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
from test_bad_input import TINY, _interrupt_while_loading, _one_line, _run


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
        (["--vllm-is-min", "3", "--vllm-is-cap", "2", "--vllm-is-mode", "token-mask"], ["--vllm-is-min must be below"]),
        (["--vllm-is-min", "0.5"], ["--vllm-is-min acts only with a mask mode", "token-truncate"]),
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


def test_damaged_compressed_data_is_a_data_file_error_naming_the_file(tmp_path):
    """A .gz whose deflate stream is damaged raises zlib.error, not OSError: it too is one DataFileError naming the
    file (the scripts print it as one line), not a traceback."""
    import gzip

    from rlvr_utils.extras.data import datafiles

    data = bytearray(gzip.compress("".join(json.dumps({"prompt": "p", "i": i}) + "\n" for i in range(500)).encode()))
    data[12] ^= 0xFF  # inside the deflate stream, just past gzip's 10-byte header
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(datafiles.DataFileError, match="rows.jsonl.gz: the compressed data is damaged"):
        datafiles.read_rows(path)


def _copy_run(saved, tmp_path):
    d = tmp_path / saved.name
    shutil.copytree(saved, d)
    return d


@pytest.mark.parametrize(
    "damage, words",
    [
        ("no_metrics", ["metrics.jsonl is missing"]),
        ("no_step", ["metrics.jsonl:2: not a metrics row"]),
        ("list_line", ["metrics.jsonl:2: not a metrics row"]),
        ("wrong_type", ["config.json: num_generations is 'eight'", "--num-generations"]),
        ("bad_choice", ["config.json: loss_agg is 'mean'", "token-mean"]),
        ("bad_optional", ["config.json: data_path is 7", "--data-path"]),
    ],
)
def test_resume_checks_what_the_run_files_hold(saved, tmp_path, damage, words):
    d = _copy_run(saved, tmp_path)
    metrics = d / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    if damage == "no_metrics":
        metrics.unlink()
    elif damage in ("no_step", "list_line"):
        rows[1] = json.dumps({"reward": 0.5}) if damage == "no_step" else "[]"
        metrics.write_text("\n".join(rows) + "\n")
    else:
        config = json.loads((d / "config.json").read_text())
        bad = {"wrong_type": {"num_generations": "eight"}, "bad_choice": {"loss_agg": "mean"}}
        config |= bad.get(damage, {"data_path": 7})
        (d / "config.json").write_text(json.dumps(config))
    _one_line(_run("grpo.py", "--resume", str(d), "--total-steps", "2", timeout=120), *words)


def test_two_writers_of_one_run_directory_are_refused(saved, tmp_path):
    """A resume beside the live run (here: a process holding the run's lock) stops with one line naming the holder,
    and writes nothing."""
    d = _copy_run(saved, tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, '.'); from rlvr_utils.core import checkpoints; "
         f"checkpoints.lock_run_dir('{d}'); print('held', flush=True); time.sleep(60)"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        before = (d / "metrics.jsonl").read_text()
        _one_line(_run("grpo.py", "--resume", str(d), "--total-steps", "2", timeout=120), "is in use by pid")
        assert (d / "metrics.jsonl").read_text() == before
    finally:
        holder.kill()
    out = _run("grpo.py", "--resume", str(d), "--total-steps", "2")  # the holder is gone: the lock went with it
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_save_that_cannot_be_written_is_one_line_and_the_last_checkpoint_stays(saved, tmp_path):
    """A file-size limit during the save (the checkpoint does not fit): one line naming the path and the cause, the
    step-1 checkpoint intact; a resume after lifting the limit continues from it with no step lost or repeated."""
    d = _copy_run(saved, tmp_path)
    limit = "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (200000, 200000)); "
    limit += f"sys.argv = ['grpo.py', '--resume', '{d}', '--total-steps', '2']; "
    limit += "runpy.run_path('grpo.py', run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", limit], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(lines) == 1 and "saving step 2" in lines[0] and "checkpoint of step 1 is intact" in lines[0], lines
    assert json.loads((d / "checkpoint" / "complete.json").read_text())["step"] == 1
    out = _run("grpo.py", "--resume", str(d), "--total-steps", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert [json.loads(line)["step"] for line in (d / "metrics.jsonl").open()] == [0, 1, 2]


def test_two_ctrl_c_while_loading_are_one_line(tmp_path):
    """A second Ctrl-C right after the first (while the process exits) prints no traceback."""
    _interrupt_while_loading(tmp_path, signals=2)


def test_a_byte_order_mark_at_the_start_of_a_json_file_is_read_past(tmp_path):
    """Windows tools write UTF-8 with a BOM: a .jsonl and a .json array read as without it (it was refused, and a
    BOM'd array was read as JSON lines)."""
    from rlvr_utils.extras.data import datafiles

    rows = [{"prompt": "p", "i": i} for i in range(3)]
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    (tmp_path / "b.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(rows, indent=1).encode())
    assert datafiles.read_rows(tmp_path / "a.jsonl")[0] == rows
    assert datafiles.read_rows(tmp_path / "b.json")[0] == rows


def test_an_mbpp_test_list_given_as_one_string_is_refused_naming_the_field():
    """A CSV/TSV cell makes test_list one string, which became a list of its characters (every row then scored 0)."""
    from rlvr_utils.extras.data import data_tasks

    row = {"text": "write f", "test_list": "['assert f(1) == 1']"}
    assert "test_list must be a list of assert lines" in data_tasks.row_problem("code", row)
    assert data_tasks.row_problem("code", row | {"test_list": ["assert f(1) == 1"]}) is None


def test_a_stop_while_loading_whose_exception_was_swallowed_stops_where_loading_ends(capsys):
    """The loading-time handler raises StopNow; run while Python is inside a __del__ or a callback, that exception is
    printed as ignored and the loading goes on (a suite run under load then trained to the end). GracefulStop, built
    where loading ends, stops the run there; a later run in the same process starts afresh."""
    from rlvr_utils.core import runtime

    saved = {sig: signal.getsignal(sig) for sig in runtime.SIGNALS}
    try:
        runtime.stop_while_loading()
        handler = signal.getsignal(signal.SIGTERM)
        try:  # what a __del__ does with it
            handler(signal.SIGTERM, None)
        except runtime.StopNow:
            pass
        assert "SIGTERM before the first step: stopped" in capsys.readouterr().err
        with pytest.raises(runtime.StopNow) as stop:
            runtime.GracefulStop()
        assert stop.value.code == 130
        runtime.stop_while_loading()  # the next run
        assert not runtime.GracefulStop().flag
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)

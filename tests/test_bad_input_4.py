"""Hostile and careless input, fourth round (issue #53): the run lock on real file systems (no locks, a read-only or
full disk, `.lock` a directory, a link or deleted under a live run), every exception a reward's code can raise, a
generator reward under --reward-timeout, a reward that changes the working directory, model directories whose
config.json lies about the weights, JSON nested too deep, a full disk while writing the model or completions.jsonl,
--threads beyond the machine and WORLD_SIZE without torchrun. Each is one line (exit code 2 for what the user passed, 1
for what failed while running), no traceback, nothing lost."""

import asyncio
import errno
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import ROOT, TINY_MODEL
from test_bad_input import TINY, _one_line, _run
from test_trl_rewards import _examples

from rlvr_utils.core import checkpoints, cli, runtime
from rlvr_utils.extras.data import data_tasks, datafiles
from rlvr_utils.extras.reward_fns import custom, reward_calls


def _lock_in_process(path, capsys):
    """checkpoints.lock_run_dir(path) here: (exit code or None, stderr)."""
    checkpoints._LOCKS.pop(str(path.absolute()), None)
    try:
        checkpoints.lock_run_dir(path)
        code = None
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


# --- 1. the run lock on real file systems ---------------------------------------------------------------------------
def test_a_lock_that_is_a_directory_or_a_link_is_one_line_and_touches_nothing(tmp_path, capsys):
    (tmp_path / "a" / ".lock").mkdir(parents=True)
    code, err = _lock_in_process(tmp_path / "a", capsys)
    assert code == 2 and err.count("\n") == 1 and f"{tmp_path / 'a' / '.lock'}: cannot lock" in err, err
    assert "is a directory" in err
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / ".lock").symlink_to(target)  # a link: never followed, never truncated
    code, err = _lock_in_process(tmp_path / "b", capsys)
    assert code == 2 and "symbolic link" in err and target.read_text() == "keep me", err


@pytest.mark.parametrize(
    "where, err_no, code, words",
    [
        ("open", errno.EROFS, 2, ["read-only file system"]),
        ("open", errno.EACCES, 2, ["permission denied"]),
        ("write", errno.ENOSPC, 1, ["the disk is full"]),
    ],
)
def test_a_read_only_or_full_run_directory_is_one_line(tmp_path, capsys, monkeypatch, where, err_no, code, words):
    real_open, real_write = os.open, os.pwrite

    def failing_open(path, *a, **k):
        if str(path).endswith(".lock"):
            raise OSError(err_no, os.strerror(err_no), str(path))
        return real_open(path, *a, **k)

    def failing_write(*a, **k):
        raise OSError(err_no, os.strerror(err_no))

    monkeypatch.setattr(os, "open", failing_open if where == "open" else real_open)
    monkeypatch.setattr(os, "pwrite", failing_write if where == "write" else real_write)
    got, err = _lock_in_process(tmp_path, capsys)
    assert got == code and err.startswith(f"error: {tmp_path / '.lock'}: cannot lock") and err.count("\n") == 1, err
    assert all(w in err for w in words), err


def test_a_file_system_without_locks_warns_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    code, err = _lock_in_process(tmp_path, capsys)
    assert code is None and err.startswith("warning: ") and "no working locks" in err, err
    assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} ")


def test_a_directory_that_cannot_be_locked_locks_its_lock_file(tmp_path, capsys, monkeypatch):
    """NFS: flock on a directory fails (EBADF), on a file it works: `.lock` is locked instead."""
    import fcntl

    real = fcntl.flock
    dirs = []

    def nfs(fd, op):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            dirs.append(fd)
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", nfs)
    code, err = _lock_in_process(tmp_path, capsys)
    assert code is None and err == "" and dirs, err


def test_deleting_the_lock_file_of_a_live_run_does_not_let_a_second_writer_in(tmp_path, capsys):
    """The lock is on the run directory itself: a user who deletes `.lock` (the message named a process they thought
    dead) is still refused, and the message names the live holder."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, '.'); from rlvr_utils.core import checkpoints; "
         f"checkpoints.lock_run_dir({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / ".lock").unlink()
        code, err = _lock_in_process(tmp_path, capsys)
        assert code == 2 and f"is in use by pid {holder.pid} " in err, err
    finally:
        holder.kill()
        holder.wait()
    code, err = _lock_in_process(tmp_path, capsys)  # the holder is gone: the lock went with it
    assert code is None, err


def test_resume_into_a_run_whose_lock_is_a_directory_is_one_line_before_anything_loads(saved, tmp_path):
    d = tmp_path / saved.name
    shutil.copytree(saved, d)
    (d / ".lock").unlink(missing_ok=True)
    (d / ".lock").mkdir()
    t0 = time.time()
    _one_line(_run("grpo.py", "--resume", str(d), "--total-steps", "2", timeout=120), ".lock: cannot lock")
    assert time.time() - t0 < 60


# --- 3. every exception from the user's code ------------------------------------------------------------------------
class Failed(BaseException):  # what pytest.fail / pytest.skip raise: an OutcomeException, a BaseException
    pass


def _sync(exc):
    def reward(prompts, completions, **kw):
        raise exc

    return reward


def _async(exc):
    async def reward(prompts, completions, **kw):
        raise exc

    return reward


@pytest.mark.parametrize("exc", [Failed("not ready"), asyncio.CancelledError(), GeneratorExit()], ids=type)
@pytest.mark.parametrize("make", [_sync, _async], ids=["sync", "async"])
def test_a_base_exception_from_a_reward_is_one_line(capsys, exc, make):
    with pytest.raises(SystemExit) as e:
        reward_calls.RewardFunctions([("my.py:r", make(exc))])(["x"], _examples(1))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith("error: --reward-fn my.py:r raised " + type(exc).__name__) and "f.jsonl:1" in err[0], err


def test_a_base_exception_while_importing_a_reward_is_refused(tmp_path):
    (tmp_path / "r.py").write_text("class Skipped(BaseException):\n    pass\n\nraise Skipped('needs a GPU')\n")
    custom.load_reward_fn.cache_clear()
    with pytest.raises(custom.RewardFnError, match=r"cannot import .*\(Skipped: needs a GPU\)"):
        custom.load_reward_fn(f"{tmp_path / 'r.py'}:f")


# --- 4. log_metric("step", ...) -------------------------------------------------------------------------------------
def test_a_metric_named_step_cannot_replace_the_rows_step(tmp_path):
    logger = runtime.Logger(tmp_path, {}, enabled=True)
    logger.log({"step": 99.0, "reward": 0.5, "bad": math.nan}, 3)
    logger.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row == {"step": 3, "reward": 0.5, "bad": None}  # NaN is not JSON: null
    assert runtime.metrics_rows(tmp_path / "metrics.jsonl")[0]["step"] == 3


# --- 5. a generator reward under --reward-timeout --------------------------------------------------------------------
def test_a_generator_reward_is_drained_under_the_timeout_and_stopped_at_one_more(capsys):
    pulled = []

    def endless(prompts, completions, **kw):  # as good as endless: it is stopped at the third value
        for i in range(10**5):
            pulled.append(i)
            yield 1.0

    with pytest.raises(SystemExit) as e:
        reward_calls.RewardFunctions([("my.py:endless", endless)])(["x", "y"], _examples(2))
    err = capsys.readouterr().err
    assert e.value.code == 1 and "returned more than 2 values for 2 completions" in err and len(pulled) == 3, err

    def slow(prompts, completions, **kw):
        for _ in completions:
            time.sleep(1.0)
            yield 1.0

    t0 = time.time()
    with pytest.raises(SystemExit):
        reward_calls.RewardFunctions([("my.py:slow", slow)], timeout=0.3)(["x", "y", "z"], _examples(3))
    assert "did not return within 0.3 s (--reward-timeout)" in capsys.readouterr().err
    assert time.time() - t0 < 2.5


# --- 6. a reward that changes the working directory ------------------------------------------------------------------
@pytest.mark.slow
def test_a_reward_that_changes_directory_does_not_move_the_run(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "cd.py").write_text(
        f"import os\n\ndef r(prompts, completions, **kw):\n    os.chdir({str(elsewhere)!r})\n"
        "    return [float('####' in c) for c in completions]\n"
    )
    here = tmp_path / "here"
    here.mkdir()
    flags = [*TINY, "--total-steps", "2", "--save-every", "1", "--save-model", "--output-dir", "runs"]
    cmd = [sys.executable, str(ROOT / "grpo.py"), *flags, "--reward-fn", f"{tmp_path / 'cd.py'}:r"]
    out = subprocess.run(cmd, cwd=here, capture_output=True, text=True, timeout=600, env=dict(os.environ,
                         OMP_NUM_THREADS="1"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (here / "runs").iterdir()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()] == [0, 1, 2]
    assert (run / "checkpoint" / "complete.json").is_file() and (run / "model" / "model.safetensors").is_file()
    assert list(elsewhere.iterdir()) == []  # nothing of the run followed the reward there


# --- 7. model directories whose config.json lies ---------------------------------------------------------------------
def _lying_model(tmp_path, case):
    d = tmp_path / case
    shutil.copytree(TINY_MODEL, d)
    config = json.loads((d / "config.json").read_text())
    if case in ("fewer_layers", "more_layers", "bin_weights"):
        n = 3 if case == "fewer_layers" else 5
        config |= {"num_hidden_layers": n, "layer_types": ["full_attention"] * n}
    elif case == "hidden_size":
        config["hidden_size"] = 64
    elif case == "architecture":
        config |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (d / "config.json").write_text(json.dumps(config))
    if case == "bin_weights":  # the same lie beside .bin weights (not read by the safetensors header check)
        import torch
        from safetensors.torch import load_file

        torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
        (d / "model.safetensors").unlink()
    if case == "tokenizer":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(d)
        tok.add_tokens(["<extra_a>", "<extra_b>"])  # ids 99 and 100: beyond the 99 embedding rows
        tok.save_pretrained(d)
    return d


@pytest.mark.parametrize(
    "case, words",
    [
        ("fewer_layers", ["does not describe its weights", "unexpected (model.layers.3."]),
        ("more_layers", ["does not describe its weights", "missing (model.layers.4."]),
        ("hidden_size", ["does not describe its weights", "[99, 128] in the weights, [99, 64] by config.json"]),
        ("architecture", ["does not describe its weights", "unexpected", "bias"]),
        ("bin_weights", ["does not describe its weights", "missing (model.layers.4."]),
        ("tokenizer", ["the tokenizer has ids up to 100", "99 rows"]),
    ],
)
def test_a_model_directory_whose_config_lies_is_one_line_before_the_run_directory(tmp_path, case, words):
    d = _lying_model(tmp_path, case)
    out = tmp_path / "runs"
    _one_line(_run("grpo.py", *TINY, "--total-steps", "1", "--model", str(d), "--output-dir", str(out)), *words)
    assert not out.exists() or not any(out.iterdir())


# --- 8. JSON nested too deep ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json"])
def test_json_nested_too_deep_is_one_line_naming_the_line(tmp_path, capsys, name):
    deep = '{"prompt": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (tmp_path / name).write_text('{"prompt": "b"}\n' + deep + "\n" if name.endswith("l") else f"[{deep}]")
    with pytest.raises(SystemExit) as e:
        data_tasks.check_data("custom", str(tmp_path / name), "--data-path")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "nested too deep" in err[0], err
    assert f"{name}:{2 if name.endswith('l') else 1}:" in err[0], err


# --- 9. a full disk while writing the model or completions.jsonl ---------------------------------------------------
@pytest.mark.slow
def test_save_model_on_a_full_disk_is_one_line_and_leaves_no_partial_copy(tmp_path):
    limit = "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (300000, 300000)); "
    limit += (
        f"sys.argv = ['grpo.py', *{[*TINY, '--total-steps', '1', '--save-model', '--output-dir', str(tmp_path)]}]; "
    )
    limit += "runpy.run_path('grpo.py', run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", limit], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(lines) == 1 and "--save-model: writing" in lines[0] and "a file-size limit" in lines[0], lines
    assert "the run saved no checkpoint" in lines[0]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert not (run / "model").exists() and not list(run.glob(".model.*"))
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()] == [0, 1]  # the metrics are kept


def test_completions_jsonl_that_cannot_be_written_is_one_line(tmp_path, capsys):
    def logs(prompts, completions, log_extra, **kw):
        log_extra("n", [1] * len(completions))
        return [1.0] * len(completions)

    (tmp_path / "completions.jsonl").mkdir()  # as a full disk would: the write fails
    rf = reward_calls.RewardFunctions([("my.py:logs", logs)])
    rf.begin(tmp_path, 0, 0, 2, 1, 4)
    rf(["x"], _examples(1))
    with pytest.raises(SystemExit) as e:
        rf.metrics(1)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and "completions.jsonl failed" in err[0], err


# --- 12. --threads beyond the machine; 13. WORLD_SIZE without torchrun ----------------------------------------------
def test_threads_beyond_a_few_per_core_are_refused_before_anything_starts(monkeypatch, capsys):
    import grpo

    monkeypatch.setattr(sys, "argv", ["grpo.py", "--threads", "1000000"])
    with pytest.raises(SystemExit) as e:
        cli.parse(grpo.Args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--threads must be at most 4 per CPU core" in err and "1000000" in err, err


@pytest.mark.parametrize(
    "env, words",
    [
        ({"WORLD_SIZE": "2"}, ["WORLD_SIZE=2 is set without RANK", "torchrun", "unset WORLD_SIZE"]),
        ({"WORLD_SIZE": "two"}, ["WORLD_SIZE='two'", "torchrun"]),
        ({"WORLD_SIZE": "2", "RANK": "5", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"}, ["RANK='5'"]),
    ],
)
def test_world_size_without_torchrun_is_one_line(tmp_path, env, words):
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "grpo.py"), "--output-dir", str(tmp_path / "runs")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=clean | env,
    )  # fmt: skip
    _one_line(proc, *words)
    assert not (tmp_path / "runs").exists()


# --- minor items ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--output-dir", ""], ["--output-dir must name a directory"]),
        (["--success-threshold", "0"], ["--success-threshold must be > 0"]),  # built-in rewards: 0 or more
    ],
)
def test_minor_flags_are_one_line(monkeypatch, capsys, flags, words):
    import grpo

    monkeypatch.setattr(sys, "argv", ["grpo.py", *flags])
    with pytest.raises(SystemExit) as e:
        cli.parse(grpo.Args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(w in err for w in words), err


def test_a_penalty_reward_may_set_a_threshold_of_zero(monkeypatch, tmp_path):
    import grpo

    (tmp_path / "p.py").write_text("def r(prompts, completions, **kw):\n    return [0.0 for _ in completions]\n")
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--success-threshold", "0", "--reward-fn", f"{tmp_path}/p.py:r"])
    assert cli.parse(grpo.Args).success_threshold == 0


@pytest.mark.parametrize(
    "name, make, words",
    [
        ("rows.json", lambda p: p.write_text("[]"), ["holds no rows"]),
        (
            "rows.jsonl",
            lambda p: p.write_text('{"prompt": "a", "prompt": "b"}\n'),
            ["rows.jsonl:1", "'prompt'", "twice"],
        ),
        ("rows.csv", lambda p: p.write_text("prompt,x,x\na,1,2\n"), ["rows.csv:1", "'x' appears twice"]),
        ("fifo.jsonl", lambda p: os.mkfifo(p), ["not a regular file"]),
        ("rows.parquet", None, ["holds no rows"]),
    ],
)
def test_minor_data_files_are_one_line(tmp_path, capsys, name, make, words):
    path = tmp_path / name
    if make is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    else:
        make(path)
    with pytest.raises(SystemExit) as e:
        data_tasks.check_data("custom", str(path), "--data-path")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and all(w in err[0] for w in words), err


@pytest.mark.parametrize("name", ["", None, "3.5"])
def test_a_log_metric_name_that_is_no_name_is_one_line(capsys, name):
    def r(prompts, completions, log_metric, **kw):
        log_metric(name, 1.0)
        return [1.0]

    with pytest.raises(SystemExit):
        reward_calls.RewardFunctions([("my.py:r", r)])(["x"], _examples(1))
    assert "a metric's name must be a non-empty string, not a number" in capsys.readouterr().err


def test_a_garbage_complete_json_is_called_damaged_not_missing(saved, tmp_path):
    d = tmp_path / saved.name
    shutil.copytree(saved, d)
    (d / "checkpoint" / "complete.json").write_text("{garbage")
    _one_line(_run("grpo.py", "--resume", str(d), "--total-steps", "2", timeout=120), "complete.json is damaged")


def test_datafiles_json_arrays_keep_each_rows_line(tmp_path):
    (tmp_path / "a.json").write_text('[\n {"prompt": "a"},\n\n  {"prompt": "b",\n "x": 1}, {"prompt": "c"}\n]\n')
    rows, where = datafiles.read_rows(tmp_path / "a.json")
    assert [r["prompt"] for r in rows] == ["a", "b", "c"] and [w.rsplit(":", 1)[1] for w in where] == ["2", "4", "5"]


@pytest.mark.parametrize(
    "text, line, says",
    [
        ('[\n {"prompt": "a"},\n {"prompt": "b", "x": NaN}\n]\n', 3, "NaN is not a JSON value"),
        ('[\n {"prompt": "a"},\n\n {"prompt": "b",\n "prompt": "c"}\n]\n', 4, "appears twice"),
        ('[{"prompt": "a"},\n{"prompt": "b", "x": 1e999}]', 2, "too large for a float"),
        ('[\n{"prompt": "a"},\n{"p": ' + "[" * 100000 + "]" * 100000 + "}]", 3, "nested too deep"),
        ('[\n {"prompt": "a"},\n {"prompt": "b" "x": 1}\n]\n', 3, "Expecting ','"),
        # a syntax error between rows comes first: a bad value after it is not what is reported
        ('[\n {"prompt": "a"}\n {"prompt": "b"},\n {"x": NaN}\n]\n', 3, "Expecting ','"),
        ('[\n {"prompt": "a"},,\n {"prompt": "b"},\n {"x": NaN}\n]\n', 2, "Expecting value"),
    ],
)
def test_a_bad_value_in_a_json_array_names_its_rows_line(tmp_path, text, line, says):
    """A NaN, a key twice, a float too large or nesting too deep inside a .json array was reported at line 1 (the
    array's); now at the line of the row that holds it, as a syntax error and a JSON-lines file are."""
    (tmp_path / "a.json").write_text(text)
    with pytest.raises(datafiles.DataFileError) as e:
        datafiles.read_rows(tmp_path / "a.json")
    assert f"a.json:{line}: " in str(e.value) and says in str(e.value), str(e.value)


def test_sigusr1_stops_after_the_step_as_sigterm_does_also_beside_the_watchdog():
    """Slurm's --signal sends SIGUSR1 before a time limit: its default ended the run silently. It now asks for a stop
    after the step (as SIGTERM), also while a --reward-timeout watchdog, which uses SIGUSR1 itself, is installed."""
    import signal

    from rlvr_utils.extras.reward_fns import watchdog

    saved = {s: signal.getsignal(s) for s in runtime.SIGNALS}
    previous = watchdog.Watchdog._previous
    try:
        stop = runtime.GracefulStop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.flag
        stop = runtime.GracefulStop()
        with watchdog.Watchdog(30.0, "a reward"):
            os.kill(os.getpid(), signal.SIGUSR1)  # not the watchdog's own: no RewardTimeout, the run's stop
            time.sleep(0.1)
        assert stop.flag
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        watchdog.Watchdog._previous = previous


def test_a_prompt_of_megabytes_is_skipped_without_being_tokenized(tiny):
    from rlvr_utils.core import tasks

    b = tasks.TaskBuilder("custom", tiny[1], 1, None, None, 64)
    t0 = time.time()
    assert b.example(0, "q", "", "Solve: 1+1\n" * 500_000, "Solve: 1+1\n" * 500_000) is None
    assert time.time() - t0 < 1.0 and b.skipped["prompt_too_long"] == 1
    assert b.example(1, "q", "", "Solve: 1+1\n", "Solve: 1+1\n") is not None

"""Hostile and careless input, fifth round (issue #62): a run directory from someone else never runs its code on
--resume (trainer.pt and a sharded checkpoint are read as tensors, numbers and lists), a reward cannot change what the
next call or the run sees (its rows, chat prompts, torch's global state, trainer_state.log_history), a reward's
failure is one line whatever its objects do, paths with `~user`, the credit page never writes over a run's files, a
LoRA rank beyond the layers, and the code sandbox's writes through sqlite3. Each is one line (exit code 2 for what the
user passed, 1 for what failed while running), no traceback, nothing run that the user did not ask for."""

import dataclasses
import json
import math
import os
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY_MODEL
from helpers import random_model
from test_bad_input import TINY, _one_line, _run
from test_trl_rewards import _examples

import common
from rlvr_utils.core import cli, runtime, tasks
from rlvr_utils.extras.data import data_tasks
from rlvr_utils.extras.reward_fns import custom, reward_calls
from rlvr_utils.extras.save import resume, saving


class _Planted:
    """What a hostile trainer.pt holds: unpickling it runs a shell command that touches `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# --- 1. --resume reads tensors, numbers and lists, never code ---------------------------------------------------------
@pytest.mark.slow
def test_resume_refuses_a_trainer_pt_that_would_run_code(saved, tmp_path):
    d = tmp_path / saved.name
    shutil.copytree(saved, d)
    marker = tmp_path / "ran"
    state = torch.load(d / "checkpoint" / "trainer.pt", weights_only=False)  # the test's own file
    torch.save({**state, "extra": {"x": _Planted(marker)}}, d / "checkpoint" / "trainer.pt")
    line = _one_line(_run("grpo.py", "--resume", str(d), "--total-steps", "2"), "trainer.pt is refused", "system")
    assert not marker.exists(), line


@pytest.mark.slow
def test_resume_imports_no_reward_file_from_the_run_directory_unless_named_again(saved, tmp_path, monkeypatch):
    """A run directory's config.json naming a --reward-fn file inside that directory (a planted one) is not imported on
    --resume unless the command line names it."""
    d = tmp_path / saved.name
    shutil.copytree(saved, d)
    marker = tmp_path / "ran"
    (d / "r.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n\n\ndef f(**kw):\n    pass\n")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"reward_fn": [f"{d / 'r.py'}:f"]}))
    line = _one_line(_run("grpo.py", "--resume", str(d), "--total-steps", "2"), "inside the run directory")
    assert not marker.exists(), line
    import grpo

    monkeypatch.setattr(
        sys, "argv", ["grpo.py", "--resume", str(d), "--total-steps", "2", "--reward-fn", f"{d}/r.py:f"]
    )
    assert cli.parse(grpo.Args).reward_fn == (f"{d}/r.py:f",) and marker.exists()  # asked for: imported


def test_trainer_pt_loads_weights_only_and_an_older_one_with_numpy_arrays_still_loads(tmp_path, capsys):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    before = np.random.get_state()
    state = {"step": 1, "batches_drawn": 0, "optimizer": opt.state_dict(), "numpy": saving.numpy_state()}
    torch.save(state, tmp_path / "new.pt")
    new = torch.load(tmp_path / "new.pt", weights_only=True)  # the format itself: no safe globals needed
    np.random.set_state(new["numpy"])
    a = np.random.rand(3)
    torch.save({**state, "numpy": before}, tmp_path / "old.pt")  # as saved before issue #62: an array
    old = resume._load(tmp_path / "old.pt", tmp_path)
    np.random.set_state(old["numpy"])
    assert (a == np.random.rand(3)).all()
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(SystemExit) as e:
        resume._load(tmp_path / "list.pt", tmp_path)
    assert e.value.code == 2 and "list.pt is not a checkpoint" in capsys.readouterr().err


def _dcp_checkpoint(path: Path, optimizer_value=None):
    """A one-process DCP checkpoint of a small model and its AdamW state, as sharded.save writes under --fsdp."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    if optimizer_value is not None:
        osd = {**osd, "param_groups": [dict(g, lr=optimizer_value) for g in osd["param_groups"]]}
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(path))
    return model, opt


@pytest.mark.filterwarnings("ignore")  # DCP warns that no process group is initialized
def test_a_sharded_checkpoint_that_would_run_code_is_refused(tmp_path, capsys):
    from rlvr_utils.extras.save import sharded

    marker = tmp_path / "ran"
    model, _ = _dcp_checkpoint(tmp_path / "good")
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    sharded.restore(tmp_path / "good", other, torch.optim.AdamW(other.parameters(), lr=1e-3), tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    _dcp_checkpoint(tmp_path / "value", optimizer_value=_Planted(marker))  # a planted non-tensor value
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))  # a planted index
    for bad, words in [("value", "value optimizer.param_groups"), ("index", ".metadata is refused")]:
        with pytest.raises(SystemExit) as e:
            sharded.restore(tmp_path / bad, other, torch.optim.AdamW(other.parameters()), tmp_path)
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and err.count("\n") == 1 and not marker.exists(), err


# --- 2-5. a reward call cannot change what the next call or the run sees ---------------------------------------------
def _chat_examples(columns):
    """Custom chat rows with their own columns, as data_tasks builds them."""
    return [
        tasks.Example(i, "q", "", "p", [1], meta={"prompt": [{"role": "user", "content": f"p{i}"}], "chat": True,
                                                  "columns": c, "where": f"f.jsonl:{i + 1}"})
        for i, c in enumerate(columns)
    ]  # fmt: skip


def test_a_rewards_in_place_edits_reach_neither_the_next_call_nor_the_rows():
    rows = [{"tags": ["a"]}, {"tags": ["b"]}]
    examples, seen = _chat_examples(rows), []

    def editing(prompts, completions, completion_ids, tags, **kw):
        ids = [list(c) for c in completion_ids]
        seen.append(([list(t) for t in tags], prompts[0][0]["content"], completions[0][0]["content"], ids))
        for t in tags:
            t.append("x")
        prompts[0][0]["content"] = "edited"
        completions[0][0]["content"] = "edited"
        completion_ids[0].append(99)
        return [1.0, 0.0]

    rf = reward_calls.RewardFunctions([("r.py:editing", editing), ("r.py:editing", editing)])
    for _ in range(2):  # two functions in a batch, then another batch (an evaluation of the same rows)
        rf(["x", "y"], examples, completion_ids=[[1], [2]])
    assert all(s == ([["a"], ["b"]], "p0", "x", [[1], [2]]) for s in seen) and len(seen) == 4, seen
    assert rows == [{"tags": ["a"]}, {"tags": ["b"]}] and examples[0].meta["prompt"][0]["content"] == "p0"


def test_torch_state_a_reward_changes_is_restored_with_one_warning(capsys):
    def careless(prompts, completions, **kw):
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        return [1.0]

    rf = reward_calls.RewardFunctions([("r.py:careless", careless)])
    try:
        for _ in range(3):
            rf(["x"], _examples(1))
            assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32
    finally:
        torch.set_grad_enabled(True)
        torch.set_default_dtype(torch.float32)
    err = capsys.readouterr().err
    assert err.count("warning: --reward-fn r.py:careless changed torch's grad mode") == 1, err
    assert err.count("default dtype") == 1, err


def test_trainer_state_log_history_stays_the_runs(tmp_path):
    def junk(prompts, completions, trainer_state, **kw):
        if trainer_state.log_history:
            trainer_state.log_history[0]["step"] = "nonsense"
        trainer_state.log_history.append("junk")
        trainer_state.global_step = -5
        return [1.0]

    def replaces(prompts, completions, trainer_state, **kw):
        trainer_state.log_history = None
        return [1.0]

    rf = reward_calls.RewardFunctions([("r.py:junk", junk), ("r.py:replaces", replaces)])
    rf.begin(tmp_path, 0, 0, 3, 1, 4)
    for step in (1, 2):
        rf(["x"], _examples(1))
        rf.merged_into({"reward": 1.0}, step)
    assert [r["step"] for r in rf.state.log_history] == [1, 2] and rf.state.global_step == 2


def test_a_reward_whose_objects_fail_to_print_is_still_one_line(capsys):
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no str")

    class NoRepr:
        def __repr__(self):
            raise RuntimeError("no repr")

    def raises(prompts, completions, **kw):
        raise Unprintable()

    def exits(prompts, completions, **kw):
        raise SystemExit(NoRepr())

    in_a_list, alone = (lambda prompts, completions, **kw: [NoRepr()]), (lambda prompts, completions, **kw: NoRepr())
    for fn, words in [(raises, "Unprintable"), (in_a_list, "<NoRepr>"), (alone, "<NoRepr>"), (exits, "(<NoRepr>)")]:
        with pytest.raises(SystemExit) as e:
            reward_calls.RewardFunctions([("r.py:f", fn)])(["x"], _examples(1))
        err = capsys.readouterr().err
        assert e.value.code == 1 and err.strip().count("\n") == 0 and words in err, err


# --- 6. a reward whose signature cannot be read ----------------------------------------------------------------------
def test_a_reward_without_a_readable_signature_is_one_line(tmp_path):
    (tmp_path / "sig.py").write_text(
        "import functools\n\npartial_max = functools.partial(max, 1)\n\n\nclass Lying:\n    @property\n"
        "    def __signature__(self):\n        raise RuntimeError('no')\n\n    def __call__(self, *a, **k):\n"
        "        return [1.0]\n\n\nlying = Lying()\n"
    )
    for spec in ["builtins:dict", "builtins:max", f"{tmp_path / 'sig.py'}:partial_max", f"{tmp_path / 'sig.py'}:lying"]:
        with pytest.raises(custom.RewardFnError, match="has no signature to read") as e:
            custom.load_reward_fn(spec)
        assert str(e.value).startswith(f"--reward-fn {spec}: ") and "\n" not in str(e.value)


# --- minor: what a reward returns, raises or leaves behind ----------------------------------------------------------
def test_a_set_is_refused_and_a_masked_entry_is_unscored(capsys):
    with pytest.raises(SystemExit) as e:
        reward_calls.RewardFunctions([("r.py:f", lambda prompts, completions, **kw: {1.0, 0.0})])(
            ["x", "y"], _examples(2)
        )
    assert e.value.code == 1 and "r.py:f returned a set, which has no order" in capsys.readouterr().err
    masked = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    for out in (masked, [0.5, np.ma.masked]):  # numpy's own tolist() gives None where masked
        got = reward_calls.RewardFunctions([("r.py:f", lambda prompts, completions, out=out, **kw: out)])(
            ["x", "y"], _examples(2)
        )
        assert got[0] in (1.0, 0.5) and math.isnan(got[1]), got


def test_a_rewards_own_stop_now_is_one_line(capsys):
    """StopNow is the run's stop on a signal (test_trl_rewards: a signal's still stops at once); one a reward raises
    itself stopped the run silently."""

    def raises_its_own(prompts, completions, **kw):
        raise runtime.StopNow(130)

    with pytest.raises(SystemExit) as e:
        reward_calls.RewardFunctions([("r.py:f", raises_its_own)])(["x"], _examples(1))
    assert e.value.code == 1 and "r.py:f raised the run's own StopNow" in capsys.readouterr().err


def test_an_alarm_and_a_thread_a_reward_leaves_are_cancelled_or_named(capsys):
    stop = threading.Event()

    def leaves(prompts, completions, **kw):
        signal.alarm(30)
        threading.Thread(target=stop.wait, name="left-behind").start()
        return [1.0]

    try:
        reward_calls.RewardFunctions([("r.py:leaves", leaves)])(["x"], _examples(1))
        assert signal.alarm(0) == 0  # cancelled: it would have fired in the middle of the update
    finally:
        stop.set()
    err = capsys.readouterr().err
    assert "r.py:leaves left an alarm pending" in err and "left a thread running ('left-behind'" in err, err


def test_a_forked_child_that_returns_into_the_run_ends_there(tmp_path):
    """os.fork in a reward: the child returns the function's value into the run's code; it must not go on training
    beside the run (in a child process: before the fix the forked copy would run the rest of the caller)."""
    code = (
        "import os, sys\n"
        "from rlvr_utils.core import tasks; from rlvr_utils.extras.reward_fns import reward_calls\n"
        "ex = [tasks.Example(0, 'q', '', 'p', [1], meta={'prompt': 'p', 'columns': {}, 'where': 'f.jsonl:1'})]\n"
        "def forks(prompts, completions, **kw):\n"
        "    os.environ['CHILD'] = str(os.fork())\n"
        "    return [1.0]\n"
        "reward_calls.RewardFunctions([('r.py:forks', forks)])(['x'], ex)\n"
        "child = int(os.environ['CHILD'])\n"
        "print('went on in', 'the child' if child == 0 else 'the parent', flush=True)\n"
        "if child:\n"
        "    print('child exit', os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.splitlines() == ["went on in the parent", "child exit 1"], r
    assert "error: --reward-fn r.py:forks: a process it forked returned into the run" in r.stderr, r.stderr


def test_a_fifo_or_a_directory_as_the_reward_file_and_an_import_that_changes_directory(tmp_path, monkeypatch, capsys):
    os.mkfifo(tmp_path / "fifo.py")
    (tmp_path / "dir.py").mkdir()
    for name in ("fifo.py", "dir.py"):
        with pytest.raises(custom.RewardFnError, match=f"{name} is not a regular file"):
            custom.load_reward_fn(f"{tmp_path / name}:f")
    (tmp_path / "moves.py").write_text(
        f"import os\nos.chdir({str(tmp_path / 'dir.py')!r})\n\n\ndef f(**kw):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    custom.load_reward_fn(f"{tmp_path / 'moves.py'}:f")
    assert os.getcwd() == str(tmp_path) and "importing it changed the working directory" in capsys.readouterr().err


# --- 7. ~user that names no user -------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--data-path", "--eval-data-path", "--output-dir", "--model", "--resume"])
def test_a_tilde_that_names_no_user_is_one_line(monkeypatch, capsys, flag):
    import grpo

    extra = ["--task", "gsm8k"] if "data" in flag else []
    monkeypatch.setattr(sys, "argv", ["grpo.py", *extra, flag, "~no_such_user_62/x"])
    with pytest.raises(SystemExit) as e:
        cli.parse(grpo.Args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: {flag} ~no_such_user_62/x: ~no_such_user_62 names no user to expand\n"


def test_a_local_path_that_starts_with_a_tilde_is_read_once_and_absolute(monkeypatch, tmp_path):
    """`./~rows/x.jsonl` is a local path that pathlib shortens to `~rows/x.jsonl`, which Path.expanduser then raises
    on (no such user): it is made absolute once, so nothing expands it again; --reward-fn's file likewise."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "~rows").mkdir()
    (tmp_path / "~rows" / "x.jsonl").write_text('{"prompt": "1+1?"}\n' * 30)
    (tmp_path / "~rows" / "r.py").write_text(
        "def f(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    args = cli.expand_paths(dataclasses.replace(cli.BaseArgs(), data_path="./~rows/x.jsonl"))
    assert args.data_path == str(tmp_path / "~rows" / "x.jsonl")
    assert data_tasks.file_hashes(dataclasses.replace(args, reward_fn=("./~rows/r.py:f",))).keys() == {
        "--data-path",
        "--reward-fn 1",
    }
    custom.load_reward_fn("./~rows/r.py:f")


# --- 10. a LoRA rank beyond the layers -------------------------------------------------------------------------------
def test_a_lora_rank_above_the_layers_is_one_line_before_and_after_the_model_loads(monkeypatch, capsys):
    import grpo
    from rlvr_utils.extras import lora

    for rank in ("129", str(2**40)):  # the bundled model's smallest layer dimension is 128 (hidden_size)
        monkeypatch.setattr(sys, "argv", ["grpo.py", "--lora-rank", rank])
        with pytest.raises(SystemExit) as e:
            cli.parse(grpo.Args)
        err = capsys.readouterr().err
        assert (
            e.value.code == 2
            and err.startswith(f"error: --lora-rank {rank}: above 128, the smallest")
            and (err.count("\n") == 1)
        ), err
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--lora-rank", "128", "--lora-target-modules", "q_proj"])
    assert cli.parse(grpo.Args).lora_rank == 128
    model = random_model()  # hidden 32: a config that could not be read before loading is checked in wrap
    args = dataclasses.replace(cli.BaseArgs(), lora_rank=33, lora_target_modules=("q_proj", "v_proj"))
    with pytest.raises(SystemExit) as e:
        lora.wrap(model, args)
    assert e.value.code == 2 and "--lora-rank 33: above 16, the smallest" in capsys.readouterr().err


# --- minor: the model card, config.json that is not a file, the eval file's name, tensorboard's line ------------------
def test_the_cards_title_escapes_html_and_its_example_runs_outside_the_bmp(tmp_path, monkeypatch):
    from rlvr_utils.extras.save import model_card

    base = tmp_path / "<img src=x onerror=alert(1)>"
    base.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"script": "grpo.py", "model": str(base), "task": "arith"}))
    monkeypatch.setattr(sys, "argv", [str(ROOT / "grpo.py")])
    text = model_card.model_card(run, "Solve: 😀 é\n")
    (title,) = [ln for ln in text.splitlines() if ln.startswith("# ")]
    assert title.startswith("# &lt;img src=x onerror=alert(1)&gt; trained with"), title  # elsewhere: in `code`
    (line,) = [ln for ln in text.splitlines() if ln.startswith("prompt = ")]
    scope = {}
    exec(line, scope)  # the card's example, pasted
    assert scope["prompt"] == "Solve: 😀 é\n" and scope["prompt"].encode()


@pytest.mark.parametrize("what", ["fifo", "directory"])
def test_a_config_json_that_is_not_a_file_is_not_called_missing(tmp_path, monkeypatch, capsys, what):
    from rlvr_utils.extras import model_checks

    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json") if what == "fifo" else (model / "config.json").mkdir()
    with pytest.raises(SystemExit) as e:
        model_checks.check_model(str(model))
    assert e.value.code == 2 and "config.json is not a regular file" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--resume", str(model)])
    with pytest.raises(SystemExit) as e:
        import grpo

        cli.parse(grpo.Args)
    assert e.value.code == 2 and "config.json is not a regular file" in capsys.readouterr().err


def test_an_eval_file_with_no_usable_prompt_is_named_and_the_same_file_twice_warns(tmp_path, capsys):
    train, too_long = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text('{"prompt": "1+1?"}\n' * 10)
    too_long.write_text(json.dumps({"prompt": "1+1? " * 400}) + "\n")
    tokenizer = common.load_tokenizer(str(TINY_MODEL))
    with pytest.raises(SystemExit) as e:
        tasks.load_task("custom", tokenizer, data_path=str(train), eval_data_path=str(too_long), max_prompt_length=64)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: --eval-data-path {too_long}: no usable eval prompts"), err
    task = tasks.load_task("custom", tokenizer, data_path=str(train), eval_data_path=f"{tmp_path}/./train.jsonl")
    err = capsys.readouterr().err
    assert "is the --data-path file: the run is evaluated on the rows it trains on" in err and err.count("\n") == 1
    assert len(task.eval) == 10  # a warning, not a refusal: the rows it trains on, as asked


@pytest.mark.slow
def test_the_printed_tensorboard_command_is_one_quoted_word(tmp_path):
    out = tmp_path / "runs $(touch pwned)"
    r = _run("grpo.py", *TINY, "--total-steps", "1", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    command = r.stdout.split("(tensorboard --logdir ", 1)[1].split("); ", 1)[0]
    assert shlex.split(command) == [str(out)], command  # pasted into a shell: the directory, nothing run

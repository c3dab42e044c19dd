"""Your own task: rows with a `prompt` and any columns, rewards in TRL's convention from a file outside the
repository, in every script; bad reward functions and rows; the README's example as written; and a script copied with
common.py and rlvr_utils/ into an empty folder outside the repository."""

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY_MODEL
from helpers import read_metrics, run_dir

from rlvr_utils.core import tasks
from rlvr_utils.extras.reward_fns import custom

SCRIPTS = ["grpo.py", "sc_grpo.py", "grpo_lambda.py", "ep_grpo.py", "srpo.py"]
SHORT = [
    "--total-steps",
    "2",
    "--eval-every",
    "0",
    "--prompts-per-step",
    "4",
    "--num-generations",
    "4",
    "--threads",
    "1",
    "--max-new-tokens",
    "32",
]
REWARD = """
import re


def correct_sum(prompts, completions, answer, **kwargs):
    out = []
    for completion, gold in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        found = re.findall(r"####\\s*(-?\\d+)", text)
        out.append(1.0 if found and found[-1] == str(gold) else 0.0)
    return out


def quarter(prompts, completions, **kwargs):
    return [0.25] * len(completions)


def positional_only(x, y):
    return [0.0]


def raises(prompts, completions, **kwargs):
    raise RuntimeError("the grader is down")


def short(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def inf(prompts, completions, **kwargs):  # NaN reads as None (TRL); inf stays an error
    return [float("inf")] * len(completions)


def none(prompts, completions, **kwargs):
    return [None] * len(completions)


def word(prompts, completions, **kwargs):
    return ["good"] * len(completions)


CALLS = [0]


def fails_later(prompts, completions, **kwargs):
    CALLS[0] += 1
    if CALLS[0] > 3:  # step-0 evaluation, step 1, step 1's evaluation... then it breaks
        raise ValueError("broke at call " + str(CALLS[0]))
    return [0.0] * len(completions)
"""
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A user's folder outside the repository: the reward file, string-prompt rows, chat-prompt rows, and a copy of
    the tiny model whose tokenizer has a chat template."""
    d = tmp_path_factory.mktemp("user")
    (d / "my_reward.py").write_text(REWARD)
    rng, rows = random.Random(0), []
    for _ in range(24):
        p = tasks.make_arith_problem(rng, steps=3)
        rows.append({"prompt": tasks.arith_prompt(p), "answer": p.answer, "level": "easy"})
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat = [
        {
            "prompt": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": r["prompt"]}],
            "answer": r["answer"],
        }
        for r in rows
    ]
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    shutil.copytree(TINY_MODEL, d / "chat_model")
    cfg = json.loads((d / "chat_model" / "tokenizer_config.json").read_text())
    (d / "chat_model" / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHAT_TEMPLATE}))
    return d


def _run(args, cwd=ROOT, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _one_line(out, *words, code=2):
    assert out.returncode == code, (out.returncode, out.stderr[-2000:])
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_trains_on_rows_and_a_trl_reward_from_outside(user, tmp_path, script):
    for rows, model in (("rows.jsonl", TINY_MODEL), ("chat.jsonl", user / "chat_model")):
        out_dir = tmp_path / rows
        out = _run(
            [
                str(ROOT / script),
                "--task",
                "custom",
                "--data-path",
                str(user / rows),
                "--reward-fn",
                f"{user / 'my_reward.py'}:correct_sum",
                "--num-eval",
                "4",
                "--model",
                str(model),
                "--output-dir",
                str(out_dir),
                *SHORT,
            ]
        )
        assert out.returncode == 0, out.stderr[-3000:]
        m = read_metrics(out_dir)
        assert [r["step"] for r in m] == [0, 1, 2] and "reward" in m[1] and 0 <= m[2]["eval/accuracy"] <= 1
        assert "eval/reward" in m[2]
        if rows == "rows.jsonl" and script == "grpo.py":
            assert m[1]["reward"] > 0  # the tiny model solves some of these: the reward really ran


def test_reward_fn_loading_and_rows_are_checked_before_anything_loads(user, tmp_path):
    base = [
        str(ROOT / "grpo.py"),
        "--task",
        "custom",
        "--data-path",
        str(user / "rows.jsonl"),
        "--output-dir",
        str(tmp_path / "r"),
    ]
    rf = str(user / "my_reward.py")
    _one_line(_run([*base, "--reward-fn", f"{user}/nope.py:f"]), "--reward-fn", "no such file")
    _one_line(_run([*base, "--reward-fn", f"{rf}:missing"]), "--reward-fn", "no function missing")
    _one_line(_run([*base, "--reward-fn", f"{rf}:positional_only"]), "positional_only", "takes none of the expected")
    _one_line(_run([*base]), "--task custom needs --reward-fn")
    _one_line(_run([str(ROOT / "grpo.py"), "--task", "custom", "--reward-fn", f"{rf}:quarter"]), "needs --data-path")
    _one_line(
        _run([*base, "--reward-fn", f"{rf}:quarter", "--reward-weights", "1", "--reward-weights", "2"]),
        "--reward-weights",
        "2",
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?"}) + "\n")
    out = _run([str(ROOT / "grpo.py"), "--task", "custom", "--data-path", str(bad), "--reward-fn", f"{rf}:quarter"])
    _one_line(out, "bad.jsonl", "row 1", "'prompt'")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, words",
    [
        ("raises", ["raises", "RuntimeError", "the grader is down"]),
        ("short", ["short", "returned 3 values for 4 completions"]),
        ("inf", ["inf", "completion 0", "rows.jsonl:", "finite number"]),
        ("word", ["word", "'good'"]),
    ],
)
def test_a_bad_reward_mid_run_is_one_line_naming_the_function(user, tmp_path, name, words):
    out = _run(
        [
            str(ROOT / "grpo.py"),
            "--task",
            "custom",
            "--data-path",
            str(user / "rows.jsonl"),
            "--reward-fn",
            f"{user / 'my_reward.py'}:{name}",
            "--num-eval",
            "4",
            "--output-dir",
            str(tmp_path),
            *SHORT,
        ]
    )
    _one_line(out, f"--reward-fn {user / 'my_reward.py'}:{name}", *words, code=1)


@pytest.mark.slow
def test_a_reward_that_breaks_later_leaves_the_last_checkpoint_intact(user, tmp_path):
    out = _run(
        [
            str(ROOT / "grpo.py"),
            "--task",
            "custom",
            "--data-path",
            str(user / "rows.jsonl"),
            "--reward-fn",
            f"{user / 'my_reward.py'}:fails_later",
            "--num-eval",
            "4",
            "--save-every",
            "1",
            "--output-dir",
            str(tmp_path),
            *SHORT[:2],
            "--eval-every",
            "1",
            *SHORT[4:],
        ]
    )
    _one_line(out, "fails_later", "broke at call 4", code=1)
    complete = run_dir(tmp_path) / "checkpoint" / "complete.json"
    assert json.loads(complete.read_text())["step"] == 1


@pytest.mark.slow
def test_reward_fn_replaces_a_builtin_reward_and_several_sum_with_weights(user, tmp_path):
    rf = user / "my_reward.py"
    out = _run(
        [
            str(ROOT / "grpo.py"),
            "--reward-fn",
            f"{rf}:quarter",
            "--reward-fn",
            f"{rf}:quarter",
            "--reward-weights",
            "1",
            "--reward-weights",
            "2",
            "--num-eval",
            "4",
            "--output-dir",
            str(tmp_path),
            *SHORT,
        ]
    )
    assert out.returncode == 0, out.stderr[-2000:]
    m = read_metrics(tmp_path)
    assert m[1]["reward"] == pytest.approx(0.75) and m[2]["eval/reward"] == pytest.approx(0.75)
    assert m[2]["eval/accuracy"] == 0.0  # 0.75 < --success-threshold 1.0


def test_module_form_and_the_calling_convention(user, monkeypatch):
    monkeypatch.syspath_prepend(str(user))
    fn = custom.load_reward_fn("my_reward:correct_sum")
    assert fn(prompts=["p"], completions=["1+1=2\n#### 2"], answer=[2]) == [1.0]

    class E:  # an Example with a chat prompt
        id, prompt, question, gold = 7, "x", "q", "g"
        meta = {"prompt": [{"role": "user", "content": "q"}], "chat": True, "columns": {"answer": 3, "level": "a"}}

    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, **columns)
        return [0.5]

    monkeypatch.setattr(custom, "load_reward_fn", lambda spec: spy)
    assert custom.reward_batch(["spy"], [2.0])(["#### 3"], [E()]) == [1.0]
    assert seen["completions"] == [[{"role": "assistant", "content": "#### 3"}]]
    assert seen["prompts"] == [E.meta["prompt"]] and seen["answer"] == [3] and seen["level"] == ["a"]


@pytest.mark.slow
def test_the_readme_example_runs_as_written(tmp_path):
    """The README's reward file, rows and command (plus flags that keep it short and write into a temporary folder)."""
    text = (ROOT / "README.md").read_text().split("## Your own task", 1)[1]
    (tmp_path / "my_reward.py").write_text(re.search(r"```python\n(.*?)```", text, re.S).group(1))
    (tmp_path / "rows.jsonl").write_text(re.search(r"```json\n(.*?)```", text, re.S).group(1))
    command = re.search(r"```bash\n(.*?)```", text, re.S).group(1).replace("\\\n", " ").split()
    assert command[:2] == ["python", "sc_grpo.py"]
    out = _run(
        [
            str(ROOT / command[1]),
            *command[2:],
            "--total-steps",
            "2",
            "--eval-every",
            "0",
            "--output-dir",
            str(tmp_path / "runs"),
            "--num-generations",
            "2",
            "--threads",
            "1",
        ],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "runs")] == [0, 1, 2]


@pytest.mark.slow
def test_a_copied_script_runs_with_only_common_and_the_package(user, tmp_path):
    """Copy sc_grpo.py, common.py and rlvr_utils/ into an empty folder outside the repository and train there: whatever
    else it needs is a bug."""
    here = tmp_path / "mine"
    here.mkdir()
    shutil.copy(ROOT / "sc_grpo.py", here)
    shutil.copy(ROOT / "common.py", here)
    shutil.copytree(ROOT / "rlvr_utils", here / "rlvr_utils", ignore=shutil.ignore_patterns("__pycache__"))
    out = _run(["sc_grpo.py", "--help"], cwd=here)
    assert out.returncode == 0 and "--reward-fn" in out.stdout, out.stderr[-2000:]
    out = _run(
        [
            "sc_grpo.py",
            "--task",
            "custom",
            "--data-path",
            str(user / "rows.jsonl"),
            "--reward-fn",
            f"{user / 'my_reward.py'}:correct_sum",
            "--model",
            str(TINY_MODEL),
            "--num-eval",
            "4",
            *SHORT,
        ],
        cwd=here,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert list(Path(here, "runs").glob("*/metrics.jsonl"))


def test_none_means_not_this_functions_row_and_numpy_outputs_work(monkeypatch):
    """TRL's convention: a function returns None for the rows it does not score; numpy arrays and bools are fine."""
    import numpy as np

    fns = {
        "a": lambda prompts, completions, **k: [None, 1.0],
        "b": lambda prompts, completions, **k: np.array([0.5, True]),
    }
    monkeypatch.setattr(custom, "load_reward_fn", lambda spec: fns[spec])

    class E:
        id, prompt, question, gold, meta = 1, "p", "q", "g", {}

    assert custom.reward_batch(["a", "b"], [])(["x", "y"], [E(), E()]) == [0.5, 2.0]


def test_a_run_with_data_files_resumes_and_warns_when_a_file_changed(user, tmp_path):
    """--resume of a run made with --data-path and --reward-fn: the files' hashes are compared with the run's
    (config.json's file_hashes); a changed file is a warning, and the run continues."""
    data = tmp_path / "rows.jsonl"
    data.write_text((user / "rows.jsonl").read_text())
    flags = ["--task", "custom", "--data-path", str(data), "--reward-fn", f"{user / 'my_reward.py'}:correct_sum"]
    out_dir = tmp_path / "runs"
    first = [str(ROOT / "grpo.py"), *flags, "--num-eval", "4", "--output-dir", str(out_dir), *SHORT]
    out = _run([*first, "--total-steps", "1", "--save-every", "1"])
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = out_dir.iterdir()
    # a held-out file the run did not have would move its held-out rows into training: refused, before anything loads
    extra = tmp_path / "eval.jsonl"
    extra.write_text(data.read_text().splitlines()[0] + "\n")
    out = _run([str(ROOT / "grpo.py"), "--resume", str(run), "--total-steps", "2", "--eval-data-path", str(extra)])
    assert out.returncode == 2 and "started without --eval-data-path, and this resume gives one" in out.stderr
    data.write_text(data.read_text() + data.read_text().splitlines()[0] + "\n")  # one row more
    out = _run([str(ROOT / "grpo.py"), "--resume", str(run), "--total-steps", "2"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the file changed since the run started" in out.stderr
    assert [r["step"] for r in read_metrics(out_dir)] == [0, 1, 2]


def test_a_data_path_under_home_written_with_a_tilde_is_read(tmp_path, monkeypatch):
    """bash leaves `--data-path=~/rows.jsonl` unexpanded; the checks read it as the loader does (not "no such file")."""
    from rlvr_utils.extras.data import data_tasks

    monkeypatch.setenv("HOME", str(tmp_path))
    rows = [{"prompt": f"say {i}", "x": i} for i in range(20)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data_tasks.check_data("custom", "~/rows.jsonl", "--data-path")  # no SystemExit
    args = {"data_path": "~/rows.jsonl", "num_eval": 4, "prompts_per_step": 8}
    data_tasks.check_rows_left(args)
    assert data_tasks.read_rows("~/rows.jsonl", "--data-path") == rows
    with pytest.raises(SystemExit):  # 20 rows, 4 held out: too few for batches of 32 (the check did run)
        data_tasks.check_rows_left(args | {"prompts_per_step": 32})


def test_the_data_digest_streams_and_stays_the_digest_runs_recorded(tmp_path):
    """_digest hashes 16 MB at a time; the digest is the one older runs recorded in config.json (a file: sha256 of
    its bytes; a directory: of each data file's name, a NUL and its bytes, in name order), so a resume of such a run
    does not warn of a change that did not happen."""
    import hashlib

    from rlvr_utils.extras.data import data_tasks

    (tmp_path / "a.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "b.jsonl").write_bytes(b'{"prompt": "y"}\n' * 1_200_000)  # 19 MB: more than one chunk
    whole = hashlib.sha256((tmp_path / "b.jsonl").read_bytes()).hexdigest()
    assert data_tasks._digest(tmp_path / "b.jsonl") == whole
    names_and_bytes = b"".join(n.encode() + b"\0" + (tmp_path / n).read_bytes() for n in ("a.jsonl", "b.jsonl"))
    assert data_tasks._digest(tmp_path) == hashlib.sha256(names_and_bytes).hexdigest()

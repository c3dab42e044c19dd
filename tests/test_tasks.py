"""Task loading (tasks.py): the built-in task, local GSM8K / MATH / code files, skipped rows, clear errors, and the
scripts running on a local code problem file."""

import json
from pathlib import Path

import pytest
from conftest import shared_file
from helpers import read_metrics, run_script

from rlvr_utils.core import tasks
from rlvr_utils.extras.data import data_tasks, sandbox


# --- task loading ---------------------------------------------------------------------------
class _PlainTok:
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        class E:
            input_ids = [ord(c) % 97 for c in text]

        return E()


def test_load_arith_task_disjoint_and_seeded():
    t1 = tasks.load_task("arith", _PlainTok(), seed=3, num_eval=50, arith_num_train=500)
    t2 = tasks.load_task("arith", _PlainTok(), seed=3, num_eval=50, arith_num_train=500)
    assert [e.question for e in t1.train] == [e.question for e in t2.train]
    assert not {e.question for e in t1.train} & {e.question for e in t1.eval}
    assert len({e.id for e in t1.train + t1.eval}) == len(t1.train) + len(t1.eval)
    ex = t1.eval[0]
    assert ex.prompt == f"Solve: {ex.question}\n"
    assert t1.reward_fn(tasks.parse_arith_problem(ex.question).solution(), ex) == 1.0


def test_load_task_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        tasks.load_task("chess", _PlainTok())
    with pytest.raises(FileNotFoundError, match="no such file"):
        tasks.load_task("gsm8k", _PlainTok(), data_path=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(KeyError, match="answer"):
        tasks.load_task("gsm8k", _PlainTok(), data_path=str(bad), num_eval=0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"question": "q", "answer": "#### many"}) + "\n")
    with pytest.raises(ValueError, match="no usable"):
        tasks.load_task("gsm8k", _PlainTok(), data_path=str(empty), num_eval=0)


def test_load_gsm8k_local_skips_unparsable(tmp_path):
    rows = [{"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(6)]
    rows.append({"question": "broken", "answer": "#### lots"})
    f = tmp_path / "g.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    t = tasks.load_task("gsm8k", _PlainTok(), data_path=str(f), num_eval=2)
    assert len(t.eval) == 2 and len(t.train) == 4
    assert t.skipped["unparsable_gold"] == 1
    assert t.reward_fn("so #### 6", t.train[-1]) == 1.0
    assert "\\boxed{}" in t.train[0].prompt


def test_load_math_local_skips_unparsable(tmp_path):
    rows = [
        {"problem": "Half of one?", "answer": "\\frac{1}{2}"},
        {"problem": "Two?", "answer": "2"},
        {"problem": "bad", "answer": "\\frac{"},
    ]
    f = tmp_path / "m.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    t = tasks.load_task("math", _PlainTok(), data_path=str(f), num_eval=1)
    assert t.skipped["unparsable_gold"] == 1
    assert t.reward_fn("\\boxed{0.5}", t.eval[0]) == 1.0
    assert t.reward_fn("\\boxed{2}", t.train[0]) == 1.0


MBPP_ROWS = [
    {
        "text": "Write a function to add two numbers.",
        "code": "def add(a, b):\n    return a + b",
        "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
    },
    {
        "text": "Write a function to double a number.",
        "code": "def double(x):\n    return 2 * x",
        "test_list": ["assert double(2) == 4", "assert double(0) == 0"],
    },
    {
        "text": "Write a function to negate a number.",
        "code": "def neg(x):\n    return -x",
        "test_list": ["assert neg(2) == -2", "assert neg(-1) == 1"],
    },
    {
        "text": "Write a function returning the first item.",
        "code": "def first(xs):\n    return xs[0]",
        "test_list": ["assert first([1, 2]) == 1", "assert first('ab') == 'a'"],
    },
    {
        "text": "Write a function returning the last item.",
        "code": "def last(xs):\n    return xs[-1]",
        "test_list": ["assert last([1, 2]) == 2", "assert last('ab') == 'b'"],
    },
    {"text": "No tests here.", "code": "", "test_list": []},
]


CODE_SANDBOX = "bwrap" if sandbox.isolation_problem() is None else "audit-hook"  # the task's plumbing: either


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_code_task_mbpp_format_and_rewards(tiny, tmp_path):
    _, tok = tiny
    rows = str(write_jsonl(tmp_path / "mbpp.jsonl", MBPP_ROWS))
    task = tasks.load_task("code", tok, data_path=rows, num_eval=2, code_sandbox=CODE_SANDBOX)
    assert task.skipped["no_tests_or_entry_point"] == 1
    assert len(task.train) + len(task.eval) == 5 and task.eval
    ex = {e.meta["entry_point"]: e for e in task.train + task.eval}
    assert set(ex) == {"add", "double", "neg", "first", "last"}
    add = ex["add"]
    assert add.prompt.startswith('"""\nWrite a function to add') and "assert add(1, 2) == 3" in add.prompt
    texts = ["```python\ndef add(a, b):\n    return a + b\n```", "def add(a, b):\n    return a * b\n", "nonsense"]
    assert task.rewards(texts, [add] * 3) == [1.0, 0.5, 0.0]  # fraction of tests passed (0 * 0 == 0 passes)
    assert task.reward_fn(texts[0], add) == 1.0


def test_code_task_timeout_reaches_the_sandbox(tiny, tmp_path):
    """load_task's code_timeout (the scripts' --code-timeout) bounds each program's run."""
    _, tok = tiny
    data = str(write_jsonl(tmp_path / "mbpp.jsonl", MBPP_ROWS))
    slow = "import time\ndef add(a, b):\n    time.sleep(1.5)\n    return a + b\n"
    ex = lambda task: next(e for e in task.train + task.eval if e.meta["entry_point"] == "add")  # noqa: E731
    short = tasks.load_task("code", tok, data_path=data, num_eval=2, code_timeout=0.5, code_sandbox=CODE_SANDBOX)
    assert short.reward_fn(slow, ex(short)) == 0.0
    long = tasks.load_task("code", tok, data_path=data, num_eval=2, code_timeout=10.0, code_sandbox=CODE_SANDBOX)
    assert long.reward_fn(slow, ex(long)) == 1.0
    with pytest.raises(ValueError, match="code-timeout"):
        tasks.load_task("code", tok, data_path=data, code_timeout=0)


def test_code_task_humaneval_file(tiny):
    _, tok = tiny
    task = tasks.load_task(
        "code",
        tok,
        data_path=str(shared_file("HumanEval.jsonl.gz")),
        num_eval=20,
        max_prompt_length=100_000,
        code_sandbox=CODE_SANDBOX,
    )
    assert (len(task.train), len(task.eval)) == (144, 20)
    e = task.eval[0]
    assert e.prompt == e.meta["prompt_code"] and e.user.startswith(sandbox.CODE_INSTRUCTION)
    assert task.rewards([e.gold, "    pass\n"], [e, e]) == [1.0, 0.0]


def test_code_task_missing_field_is_named(tiny, tmp_path):
    _, tok = tiny
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "def f():\n", "test": "def check(c):\n    pass\n"}] * 10)
    with pytest.raises(KeyError, match="entry_point"):
        tasks.load_task("code", tok, data_path=str(bad), code_sandbox=CODE_SANDBOX)
    bad = write_jsonl(tmp_path / "bad2.jsonl", [{"description": "x", "test_list": ["assert f() == 1"]}] * 10)
    with pytest.raises(KeyError, match=r"text \(or prompt\)"):
        tasks.load_task("code", tok, data_path=str(bad), code_sandbox=CODE_SANDBOX)


@pytest.mark.parametrize(
    "task, row, missing",
    [
        ("gsm8k", {"question": "q"}, "answer"),
        ("gsm8k", {"question": "q", "answer": "#### 1"}, None),
        ("math", {"problem": "p"}, "answer (or solution)"),
        ("math", {"problem": "p", "solution": "\\boxed{1}"}, None),
        ("code", {"prompt": "def f():", "test": "t"}, "entry_point"),
        ("code", {"test_list": ["assert f()"]}, "text (or prompt)"),
        ("code", {"text": "x", "test_list": []}, None),
        ("arith", {}, None),
    ],
)
def test_row_problem_names_the_missing_field(task, row, missing):
    got = data_tasks.row_problem(task, row)
    assert (got is None) if missing is None else (missing in got and str(sorted(row)) in got)


@pytest.mark.parametrize(
    "script, extra", [("srpo.py", ["--reset", "random"]), ("sc_grpo.py", ["--code-sandbox", "audit-hook"])]
)
def test_scripts_run_on_the_code_task(script, extra, tmp_path):
    """srpo.py in bubblewrap (skipped, saying why, where it cannot start), sc_grpo.py in the weaker sandbox."""
    if "--code-sandbox" not in extra and (why := sandbox.isolation_problem()) is not None:
        pytest.skip(f"bubblewrap cannot start here: {why}")
    data = write_jsonl(tmp_path / "mbpp.jsonl", MBPP_ROWS[:5] * 4)
    out = run_script(
        script,
        "--task",
        "code",
        "--data-path",
        str(data),
        "--total-steps",
        "2",
        "--num-eval",
        "4",
        "--eval-every",
        "0",
        "--prompts-per-step",
        "2",
        "--num-generations",
        "4",
        "--max-new-tokens",
        "48",
        "--code-timeout",
        "3",
        "--output-dir",
        str(tmp_path / "runs"),
        *extra,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    weak = "warning: --code-sandbox audit-hook: programs run without OS isolation"
    assert (weak in out.stderr) == ("audit-hook" in extra), out.stderr[-2000:]  # the weaker sandbox says what it is
    rows = read_metrics(tmp_path / "runs")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0.0 <= r.get("reward", 0.0) <= 1.0 for r in rows)

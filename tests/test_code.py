"""The code task: extraction, program assembly, the sandboxed runner (real HumanEval, hostile programs,
fake-pass tricks), task loading, and srpo.py / sc_grpo.py running on a local code problem file."""
import gzip
import json
import os
import time
from pathlib import Path

import pytest

import common
from helpers import read_metrics, run_script

HUMANEVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "HumanEval.jsonl.gz"
ADD = "def add(a, b):\n    return a + b\n"
ADD_TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"


def humaneval_rows():
    if not HUMANEVAL.exists():
        pytest.skip(f"{HUMANEVAL} is absent (the real HumanEval file is not part of the repository)")
    with gzip.open(HUMANEVAL, "rt") as f:
        return [json.loads(line) for line in f]


# --- extraction and program assembly ------------------------------------------------------------
@pytest.mark.parametrize("completion, want", [
    ("Here:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1\n"),
    ("```\nx = 1\n```", "x = 1\n"),
    ("```py\na = 1\n```\ntext\n```python\nb = 2\n```", "b = 2\n"),  # the last block
    ("```python\nb = 2\n```\n```python\n```", "b = 2\n"),  # an empty last block is not the answer
    ("```python\nunclosed = 1\n", "unclosed = 1\n"),  # an unclosed fence runs to the end
    ("    return a + b\n", "    return a + b\n"),  # raw text: a base model's continuation
])
def test_extract_code(completion, want):
    assert common.extract_code(completion) == want


def test_code_program_standalone_and_continuation():
    prompt = "from typing import List\nimport math\n\ndef add(a: int, b: int) -> int:\n    \"\"\"Add.\"\"\"\n"
    full = "```python\ndef add(a, b):\n    return a + b\n```"
    assert common.code_program(prompt, full, "add") == "from typing import List\nimport math\ndef add(a, b):\n    return a + b\n"
    body = "    return a + b\n\ndef unrelated():\n    pass\n"  # cut at the next top-level def, as HumanEval does
    assert common.code_program(prompt, body, "add") == prompt + "    return a + b\n"
    assert common.code_program(prompt, "    return a + b\nprint(add(1, 2))\n", "add") == prompt + "    return a + b"


# --- the runner ---------------------------------------------------------------------------------
def test_runner_pass_fail_and_fraction():
    assert common.code_reward(ADD, ADD_TEST, "add") == 1.0
    assert common.code_reward("def add(a, b):\n    return a - b\n", ADD_TEST, "add") == 0.0
    assert common.code_reward("def add(a, b) return\n", ADD_TEST, "add") == 0.0  # syntax error
    assert common.code_reward(ADD, ADD_TEST, "plus") == 0.0  # the entry point is missing
    mbpp = ["assert add(1, 2) == 3", "assert add(1, 1) == 3", "assert add(2, 2) == 4"]
    r = common.run_code_tests(ADD, mbpp, "add")
    assert (r.passed, r.total, r.status) == (2, 3, "ok") and r.reward == pytest.approx(2 / 3)
    assert common.run_code_tests(ADD, ["assert add(1, 2) == K"], "add", setup="K = 3").reward == 1.0
    assert common.code_rewards([ADD, "def add(a, b):\n    return 0\n"], [ADD_TEST, mbpp], ["add", "add"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="programs"):
        common.code_rewards([ADD], [ADD_TEST, ADD_TEST], ["add"])


def test_runner_accepts_plain_nested_values_and_rejects_lookalikes():
    """Returned values must be exact builtin types all the way down; equal plain values pass as before."""
    nested = "def f(x):\n    return [(1, 'a'), {'k': {2.5, None}}, frozenset({b'x'}), True, 1j]\n"
    want = "assert f(0) == [(1, 'a'), {'k': {2.5, None}}, frozenset({b'x'}), True, 1j]"
    assert common.run_code_tests(nested, [want], "f").reward == 1.0
    cyclic = "def f(x):\n    a = []\n    a.append(a)\n    return a\n"
    assert common.run_code_tests(cyclic, ["r = f(0)\nassert r[0] is r"], "f").reward == 0.0
    nested_hack = ("class E:\n    __eq__ = lambda s, o: True\ndef f(x):\n    return [E()]\n"
                   "import builtins\nbuiltins.type = lambda x: int\n")  # and the check's own type() patched
    assert common.run_code_tests(nested_hack, ["assert f(0) == [5]"], "f").reward == 0.0
    rebind = ("class E:\n    __eq__ = lambda s, o: True\ndef cheat(a, b):\n    return E()\n"
              "def add(a, b):\n    globals()['add'] = globals()['candidate'] = cheat\n    return a + b\n")
    r = common.run_code_tests(rebind, ["assert add(1, 2) == 3", "assert add(1, 1) == 7", "assert candidate(0, 0) == 5"], "add")
    assert r.passed == 1  # the first call is honest; rebinding its own globals does not reach the tests' names
    shared = "def f(n):\n    return [[0] * n] * n\n"  # the same row object n times is not a cycle
    assert common.run_code_tests(shared, ["assert f(3) == [[0, 0, 0]] * 3"], "f").reward == 1.0
    recursive = "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\n"
    assert common.run_code_tests(recursive, ["assert fact(5) == 120", "assert candidate(4) == 24"], "fact").reward == 1.0


def test_runner_is_isolated_where_the_os_allows():
    """What the harness reports about itself: network namespace and user where available."""
    probe = ADD + "import os\nCWD = os.getcwd()\n"
    r = common.run_code_tests(probe, ["assert CWD.startswith(os.environ['TMPDIR'])", "import socket\nsocket.socket()"], "add")
    assert r.passed == 1  # it runs in its own temporary directory; creating a socket is refused
    assert r.status == "ok" and r.uid >= 0


def test_humaneval_canonical_solutions_pass_and_empty_bodies_fail():
    rows = humaneval_rows()
    tests, entries = [r["test"] for r in rows], [r["entry_point"] for r in rows]
    canonical = common.code_rewards([r["prompt"] + r["canonical_solution"] for r in rows], tests, entries)
    assert [r["task_id"] for r, x in zip(rows, canonical) if x != 1.0] == []
    empty = common.code_rewards([r["prompt"] + "    pass\n" for r in rows], tests, entries)
    assert [r["task_id"] for r, x in zip(rows, empty) if x != 0.0] == []


def _group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) processes still in the run's process group."""
    alive = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(d.name))
    return alive


OUTSIDE = "/tmp/rlvr_sandbox_escape_test"
HOSTILE = {
    "infinite loop": "while True:\n    pass\n",
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "subprocess": "import subprocess\nsubprocess.Popen(['sleep', '100'])\n",
    "huge allocation": "x = bytearray(8 << 30)\n",
    "huge file": "with open('big', 'wb') as f:\n    while True:\n        f.write(b'0' * (1 << 20))\n",
    "write outside": f"open({OUTSIDE!r}, 'w').write('x')\n",
    "sleep with buffered output": "import time\nprint('x' * 100)\ntime.sleep(60)\n",
    # fake-pass tricks: none of them defines a working add
    "exit(0)": "exit(0)\n",
    "sys.exit in the function": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "os._exit(0)": "import os\nos._exit(0)\n",
    "raise SystemExit": "raise SystemExit(0)\n",
    "patched builtins": "import builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\nbuiltins.exit = lambda *a: None\n"
                        "def add(a, b):\n    return 0\n",
    "fake marker on every fd": "import os\nfor fd in range(1, 64):\n    try:\n        os.write(fd, b'0' * 32 + b':pass:0\\n')\n"
                               "    except OSError:\n        pass\ndef add(a, b):\n    return 0\n",
    "printed marker at exit": "import atexit\natexit.register(lambda: print(':pass:0'))\ndef add(a, b):\n    return 0\n",
    # stealing the harness's nonce and marker pipe, then writing a real-looking marker
    "nonce from the harness frame": "import os, sys\nv = sys._getframe(1).f_locals\n"
                                    "os.write(v['out'], (v['nonce'] + ':pass:0\\n').encode())\n",
    "nonce from a traceback frame": "import os\ntry:\n    raise ValueError\nexcept ValueError as e:\n"
                                    "    v = e.__traceback__.tb_frame.f_back.f_locals\n"
                                    "os.write(v['out'], (v['nonce'] + ':pass:0\\n').encode())\n",
    "nonce from gc": "import gc, os\nfor o in gc.get_objects():\n    if isinstance(o, dict) and 'nonce' in o and 'fd' in o:\n"
                     "        os.write(o['fd'], (o['nonce'] + ':pass:0\\n').encode())\n",
    "reading its own memory": "open('/proc/self/mem', 'rb')\n",
    # values that compare equal to anything (the always-equal reward hack), bare, as a builtin subclass, nested
    "always-equal object": "class E:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return E()\n",
    "always-equal int subclass": "class I(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
                                 "def add(a, b):\n    return I(0)\n",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_programs_score_zero_end_in_time_and_leave_nothing(name):
    if os.path.exists(OUTSIDE):
        os.remove(OUTSIDE)
    timeout = 2.0
    t0 = time.time()
    r = common.run_code_tests(HOSTILE[name], ADD_TEST, "add", timeout=timeout)
    assert r.reward == 0.0, r
    assert time.time() - t0 < timeout + 2.0
    assert _group_alive(r.pid) == []
    assert not os.path.exists(OUTSIDE)


# --- the task ----------------------------------------------------------------------------------
MBPP_ROWS = [
    {"text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
     "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]},
    {"text": "Write a function to double a number.", "code": "def double(x):\n    return 2 * x",
     "test_list": ["assert double(2) == 4", "assert double(0) == 0"]},
    {"text": "Write a function to negate a number.", "code": "def neg(x):\n    return -x",
     "test_list": ["assert neg(2) == -2", "assert neg(-1) == 1"]},
    {"text": "Write a function returning the first item.", "code": "def first(xs):\n    return xs[0]",
     "test_list": ["assert first([1, 2]) == 1", "assert first('ab') == 'a'"]},
    {"text": "Write a function returning the last item.", "code": "def last(xs):\n    return xs[-1]",
     "test_list": ["assert last([1, 2]) == 2", "assert last('ab') == 'b'"]},
    {"text": "No tests here.", "code": "", "test_list": []},
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_code_task_mbpp_format_and_rewards(tiny, tmp_path):
    _, tok = tiny
    task = common.load_task("code", tok, data_path=str(write_jsonl(tmp_path / "mbpp.jsonl", MBPP_ROWS)), num_eval=2)
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
    short = common.load_task("code", tok, data_path=data, num_eval=2, code_timeout=0.5)
    assert short.reward_fn(slow, ex(short)) == 0.0
    long = common.load_task("code", tok, data_path=data, num_eval=2, code_timeout=10.0)
    assert long.reward_fn(slow, ex(long)) == 1.0
    with pytest.raises(ValueError, match="code-timeout"):
        common.load_task("code", tok, data_path=data, code_timeout=0)


def test_code_task_humaneval_file(tiny):
    humaneval_rows()  # skips when absent
    _, tok = tiny
    task = common.load_task("code", tok, data_path=str(HUMANEVAL), num_eval=20, max_prompt_length=100_000)
    assert (len(task.train), len(task.eval)) == (144, 20)
    e = task.eval[0]
    assert e.prompt == e.meta["prompt_code"] and e.user.startswith(common.CODE_INSTRUCTION)
    assert task.rewards([e.gold, "    pass\n"], [e, e]) == [1.0, 0.0]


def test_code_task_missing_field_is_named(tiny, tmp_path):
    _, tok = tiny
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "def f():\n", "test": "def check(c):\n    pass\n"}] * 10)
    with pytest.raises(KeyError, match="entry_point"):
        common.load_task("code", tok, data_path=str(bad))
    bad = write_jsonl(tmp_path / "bad2.jsonl", [{"description": "x", "test_list": ["assert f() == 1"]}] * 10)
    with pytest.raises(KeyError, match="'text'"):
        common.load_task("code", tok, data_path=str(bad))


@pytest.mark.parametrize("script, extra", [("srpo.py", ["--reset", "random"]), ("sc_grpo.py", [])])
def test_scripts_run_on_the_code_task(script, extra, tmp_path):
    data = write_jsonl(tmp_path / "mbpp.jsonl", MBPP_ROWS[:5] * 4)
    out = run_script(script, "--task", "code", "--data-path", str(data), "--total-steps", "2", "--num-eval", "4",
                     "--eval-every", "0", "--prompts-per-step", "2", "--num-generations", "4", "--max-new-tokens", "48",
                     "--code-timeout", "3", "--output-dir", str(tmp_path / "runs"), *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0.0 <= r.get("reward", 0.0) <= 1.0 for r in rows)

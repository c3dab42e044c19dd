"""The code task's sandbox (sandbox.py, sandbox_harness.py): extraction, program assembly, the sandboxed runner (real
HumanEval, hostile programs, fake-pass tricks, what crosses between the program and its tests), in both sandboxes
(bwrap skipped, saying why, where it cannot start). What the OS isolation adds: tests/test_isolation.py."""

import functools
import gzip
import json
import math
import os
import time
from pathlib import Path

import pytest
from conftest import shared_file

from rlvr_utils.extras.data import sandbox, sandbox_harness

ADD = "def add(a, b):\n    return a + b\n"
ADD_TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"


@pytest.fixture(params=sandbox.SANDBOXES)
def box(request):
    """Each sandbox: bubblewrap (skipped, saying why, where it cannot start) and the audit hook alone."""
    if request.param == "bwrap" and (why := sandbox.isolation_problem("bwrap")) is not None:
        pytest.skip(f"bubblewrap cannot start here: {why}")
    return request.param


def humaneval_rows():
    with gzip.open(shared_file("HumanEval.jsonl.gz"), "rt") as f:
        return [json.loads(line) for line in f]


# --- extraction and program assembly ------------------------------------------------------------
@pytest.mark.parametrize(
    "completion, want",
    [
        ("Here:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1\n"),
        ("```\nx = 1\n```", "x = 1\n"),
        ("```py\na = 1\n```\ntext\n```python\nb = 2\n```", "b = 2\n"),  # the last block
        ("```python\nb = 2\n```\n```python\n```", "b = 2\n"),  # an empty last block is not the answer
        ("```python\nunclosed = 1\n", "unclosed = 1\n"),  # an unclosed fence runs to the end
        ("    return a + b\n", "    return a + b\n"),  # raw text: a base model's continuation
    ],
)
def test_extract_code(completion, want):
    assert sandbox.extract_code(completion) == want


def test_code_program_standalone_and_continuation():
    prompt = 'from typing import List\nimport math\n\ndef add(a: int, b: int) -> int:\n    """Add."""\n'
    full = "```python\ndef add(a, b):\n    return a + b\n```"
    assert (
        sandbox.code_program(prompt, full, "add")
        == "from typing import List\nimport math\ndef add(a, b):\n    return a + b\n"
    )
    body = "    return a + b\n\ndef unrelated():\n    pass\n"  # cut at the next top-level def, as HumanEval does
    assert sandbox.code_program(prompt, body, "add") == prompt + "    return a + b\n"
    assert sandbox.code_program(prompt, "    return a + b\nprint(add(1, 2))\n", "add") == prompt + "    return a + b"


# --- the runner ---------------------------------------------------------------------------------
def test_runner_pass_fail_and_fraction(box):
    run = functools.partial(sandbox.run_code_tests, sandbox=box)
    assert run(ADD, ADD_TEST, "add").reward == 1.0
    assert run("def add(a, b):\n    return a - b\n", ADD_TEST, "add").reward == 0.0
    assert run("def add(a, b) return\n", ADD_TEST, "add").reward == 0.0  # syntax error
    assert run(ADD, ADD_TEST, "plus").reward == 0.0  # the entry point is missing
    mbpp = ["assert add(1, 2) == 3", "assert add(1, 1) == 3", "assert add(2, 2) == 4"]
    r = run(ADD, mbpp, "add")
    assert (r.passed, r.total, r.status, r.sandbox) == (2, 3, "ok", box) and r.reward == pytest.approx(2 / 3)
    assert run(ADD, ["assert add(1, 2) == K"], "add", setup="K = 3").reward == 1.0
    assert run(ADD, ["assert add(1, 2) == 3", "assert add(", "assert add(2, 2) == 4"], "add").passed == 2  # one typo
    two = sandbox.code_rewards([ADD, "def add(a, b):\n    return 0\n"], [ADD_TEST, mbpp], ["add", "add"], sandbox=box)
    assert two == [1.0, 0.0]
    with pytest.raises(ValueError, match="programs"):
        sandbox.code_rewards([ADD], [ADD_TEST, ADD_TEST], ["add"])


def test_runner_accepts_plain_nested_values_and_rejects_lookalikes(box):
    """Returned values must be exact builtin types all the way down; equal plain values pass as before."""
    run = functools.partial(sandbox.run_code_tests, sandbox=box)
    nested = "def f(x):\n    return [(1, 'a'), {'k': {2.5, None}}, frozenset({b'x'}), True, 1j]\n"
    want = "assert f(0) == [(1, 'a'), {'k': {2.5, None}}, frozenset({b'x'}), True, 1j]"
    assert run(nested, [want], "f").reward == 1.0
    cyclic = "def f(x):\n    a = []\n    a.append(a)\n    return a\n"
    assert run(cyclic, ["r = f(0)\nassert r[0] is r"], "f").reward == 0.0
    nested_hack = (
        "class E:\n    __eq__ = lambda s, o: True\ndef f(x):\n    return [E()]\n"
        "import builtins\nbuiltins.type = lambda x: int\n"
    )  # and the check's own type() patched
    assert run(nested_hack, ["assert f(0) == [5]"], "f").reward == 0.0
    rebind = (
        "class E:\n    __eq__ = lambda s, o: True\ndef cheat(a, b):\n    return E()\n"
        "def add(a, b):\n    globals()['add'] = globals()['candidate'] = cheat\n    return a + b\n"
    )
    r = run(rebind, ["assert add(1, 2) == 3", "assert add(1, 1) == 7", "assert candidate(0, 0) == 5"], "add")
    assert r.passed == 1  # the first call is honest; rebinding its own globals does not reach the tests' names
    shared = "def f(n):\n    return [[0] * n] * n\n"  # the same row object n times is not a cycle
    assert run(shared, ["assert f(3) == [[0, 0, 0]] * 3"], "f").reward == 1.0
    recursive = "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\n"
    assert run(recursive, ["assert fact(5) == 120", "assert candidate(4) == 24"], "fact").reward == 1.0


def test_runner_is_isolated_where_the_os_allows(box):
    """What the tests' side reports about itself: network namespace and user where available; the program runs in a
    directory of its own (bwrap: its private /tmp) and cannot make a socket (the audit hook)."""
    probe = ADD + "import os, socket\nCWD, TMP = os.getcwd(), os.environ['TMPDIR']\ntry:\n    socket.socket()\n"
    probe += "    SOCKET = True\nexcept OSError:\n    SOCKET = False\n"
    r = sandbox.run_code_tests(probe, ["assert CWD == TMP", "assert SOCKET is False"], "add", sandbox=box)
    assert r.passed == 2, r
    assert r.status == "ok" and r.uid >= 0
    if box == "bwrap":
        assert r.network_isolated and r.uid != 0


def test_humaneval_canonical_solutions_pass_and_empty_bodies_fail(box):
    rows = humaneval_rows()
    tests, entries = [r["test"] for r in rows], [r["entry_point"] for r in rows]
    programs = [r["prompt"] + r["canonical_solution"] for r in rows]
    canonical = sandbox.code_rewards(programs, tests, entries, sandbox=box)
    assert [r["task_id"] for r, x in zip(rows, canonical) if x != 1.0] == []
    empty = sandbox.code_rewards([r["prompt"] + "    pass\n" for r in rows], tests, entries, sandbox=box)
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
            fields = stat[stat.rindex(")") + 2 :].split()
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
    # writes outside under an audit event the old block-list did not name (issue #62): a working add, so only the
    # refusal scores 0; the allow-list refuses every event it does not name
    "sqlite3 outside": f"import sqlite3\nsqlite3.connect({OUTSIDE!r}).execute('create table t (x)')\n"
    "def add(a, b):\n    return a + b\n",
    "sqlite3 attach": "import sqlite3\nc = sqlite3.connect(':memory:')\n"
    f"c.execute(\"attach database {OUTSIDE!r} as e\")\nc.execute('create table e.t (x)')\n"
    "def add(a, b):\n    return a + b\n",
    "an event nobody listed": "import sys\nsys.audit('made.up.event')\ndef add(a, b):\n    return a + b\n",
    "sleep with buffered output": "import time\nprint('x' * 100)\ntime.sleep(60)\n",
    # fake-pass tricks: none of them defines a working add
    "exit(0)": "exit(0)\n",
    "sys.exit in the function": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "os._exit(0)": "import os\nos._exit(0)\n",
    "raise SystemExit": "raise SystemExit(0)\n",
    "patched builtins": "import builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\n"
    "builtins.exit = lambda *a: None\ndef add(a, b):\n    return 0\n",
    "fake marker on every fd": "import os\nfor fd in range(1, 64):\n    try:\n"
    "        os.write(fd, b'0' * 32 + b':pass:0\\n')\n    except OSError:\n        pass\n"
    "def add(a, b):\n    return 0\n",
    "printed marker at exit": "import atexit\natexit.register(lambda: print(':pass:0'))\n"
    "def add(a, b):\n    return 0\n",
    # stealing the harness's nonce and marker pipe, then writing a real-looking marker
    "nonce from the harness frame": "import os, sys\nv = sys._getframe(1).f_locals\n"
    "os.write(v['out'], (v['nonce'] + ':pass:0\\n').encode())\n",
    "nonce from a traceback frame": "import os\ntry:\n    raise ValueError\nexcept ValueError as e:\n"
    "    v = e.__traceback__.tb_frame.f_back.f_locals\n"
    "os.write(v['out'], (v['nonce'] + ':pass:0\\n').encode())\n",
    "nonce from gc": "import gc, os\nfor o in gc.get_objects():\n"
    "    if isinstance(o, dict) and 'nonce' in o and 'fd' in o:\n"
    "        os.write(o['fd'], (o['nonce'] + ':pass:0\\n').encode())\n",
    "reading its own memory": "open('/proc/self/mem', 'rb')\n",
    # values that compare equal to anything (the always-equal reward hack), bare, as a builtin subclass, nested
    "always-equal object": "class E:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return E()\n",
    "always-equal int subclass": "class I(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
    "def add(a, b):\n    return I(0)\n",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_programs_score_zero_end_in_time_and_leave_nothing(name, box):
    if os.path.exists(OUTSIDE):
        os.remove(OUTSIDE)
    timeout = 2.0
    t0 = time.time()
    r = sandbox.run_code_tests(HOSTILE[name], ADD_TEST, "add", timeout=timeout, sandbox=box)
    assert r.reward == 0.0, r
    assert time.time() - t0 < timeout + 2.0
    assert _group_alive(r.pid) == []
    assert not os.path.exists(OUTSIDE)


def test_the_allowed_events_let_ordinary_programs_pass(box):
    """The allow-list's other side: imports, namedtuples, enums, dataclasses, threads, warnings, the environment and
    temporary files in the working directory (TMPDIR) are allowed."""
    program = (
        "import collections, dataclasses, enum, os, shutil, tempfile, threading, warnings\n"
        "P = collections.namedtuple('P', 'a b')\nclass C(enum.Enum):\n    A = 1\n"
        "@dataclasses.dataclass\nclass D:\n    x: int = 1\n"
        "t = threading.Thread(target=lambda: None)\nt.start()\nt.join()\nwarnings.warn('x')\nos.environ['A'] = '1'\n"
        "fd, p = tempfile.mkstemp()\nos.write(fd, b'x')\nos.close(fd)\nos.remove(p)\n"
        "shutil.rmtree(tempfile.mkdtemp())\n"
        "def add(a, b):\n    return P(a, b).a + b + D().x - 1\n"
    )
    assert sandbox.run_code_tests(program, ADD_TEST, "add", sandbox=box).reward == 1.0


def test_the_program_and_its_tests_import_what_is_installed(box):
    """site-packages (the interpreter's, a venv's) are on the path of both sides, though their .pth files do not run
    (python -S): numpy imports, as it did before the OS sandbox (it imports ctypes, which the harness loads first)."""
    pytest.importorskip("numpy")
    program = "import numpy as np\ndef add(a, b):\n    return int(np.add(a, b))\n"
    tests = ["assert add(1, 2) == 3", "import numpy\nassert numpy.arange(3).sum() == 3"]
    assert sandbox.run_code_tests(program, tests, "add", sandbox=box).reward == 1.0


# --- the task ----------------------------------------------------------------------------------


# --- what crosses between the program and its tests ---------------------------------------------
PLAIN = [
    None, True, False, 0, -(10**40), 1.5, -0.0, math.inf, 1 + 2j, "é\n\\", b"\x00\xff", [], (), [1, (2, [3])],
    {(1, "a"): frozenset({2, b"x"}), None: {3.5}}, set(), frozenset(),
]  # fmt: skip


def test_values_cross_exactly_and_nothing_else_crosses_as_a_value():
    """encode/decoder (sandbox_harness.py) against Python's own ==, type by type all the way down; a non-builtin
    type (a subclass of int included) stays a reference; cycles and unknown tags are refused."""
    refs = []
    ref = lambda x: refs.append(x) or {"r": len(refs) - 1}  # noqa: E731

    def types(x):
        inner = x.items() if type(x) is dict else x if type(x) in (list, tuple, set, frozenset) else ()
        return (type(x), sorted(map(repr, (types(v) for kv in inner for v in (kv if type(x) is dict else [kv])))))

    for value in PLAIN:
        back = json.loads(json.dumps(sandbox_harness.encode(value, ref)), object_hook=sandbox_harness.decoder(None))
        assert back == value and types(back) == types(value), value
    nan = json.loads(json.dumps(sandbox_harness.encode(math.nan, ref)))
    assert math.isnan(nan)
    assert refs == []

    class Int(int):
        pass

    assert sandbox_harness.encode([Int(3), print], ref) == [{"r": 0}, {"r": 1}] and refs == [Int(3), print]
    cycle = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="cyclic"):
        sandbox_harness.encode(cycle, ref)
    with pytest.raises(ValueError, match="10\\*\\*6"):
        sandbox_harness.encode([0] * 10**6, ref)
    for bad in ['{"x": 1}', '{"t": 1}', '{"d": [[1]]}', '{"b": 1, "t": []}', '{"c": [1]}']:
        with pytest.raises(ValueError):
            json.loads(bad, object_hook=sandbox_harness.decoder(None))


def test_the_tests_reach_the_programs_objects_only_as_references(box):
    """Objects of the program's own classes (MBPP's Pair, a tree's Node) are built, passed back, read and set by the
    tests; they compare equal to nothing but themselves and have no truth value, so a test cannot be passed by an
    object of the program's."""
    program = (
        "class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
        "def total(pairs):\n    return sum(p.a + p.b for p in pairs)\n"
        "class Node:\n    def __init__(self, v):\n        self.v, self.left = v, None\n"
        "def depth(n):\n    return 0 if n is None else 1 + depth(n.left)\n"
        "class Yes:\n    def __eq__(self, o):\n        return True\n    def __bool__(self):\n        return True\n"
        "def yes(x):\n    return Yes()\n"
    )
    tests = [
        "assert total([Pair(1, 2), Pair(3, 4)]) == 10",
        "root = Node(1)\nroot.left = Node(2)\nassert depth(root) == 2 and root.left.v == 2",
        "p = Pair(1, 2)\nassert p == p and p != Pair(1, 2)",
        "assert yes(0) == 5",
        "assert yes(0)",
        "assert not (yes(0) != 5)",
    ]
    r = sandbox.run_code_tests(program, tests, "yes", sandbox=box)
    assert r.passed == 3, r


def test_the_program_cannot_rebind_what_the_tests_take_from_python(box):
    """The tests see the program's top-level names except builtins, and its modules as the tests' own copies: a
    program's own `all`, `abs` or `math` does not answer for Python's."""
    cheats = [
        "def all(x):\n    return True\n",
        "def abs(x):\n    return 0\n",
        "class math:\n    isclose = staticmethod(lambda *a, **k: True)\n",
        "import math\nmath.isclose = lambda *a, **k: True\n",
    ]
    tests = ["assert all([add(1, 2) == 4])", "assert abs(add(1, 2) - 4) < 1e-9", "assert math.isclose(add(1, 2), 4)"]
    wrong = "def add(a, b):\n    return a + b\n"
    for cheat in cheats:
        r = sandbox.run_code_tests(cheat + wrong, tests, "add", sandbox=box)
        assert r.passed == 0, (cheat, r)
    honest = sandbox.run_code_tests("import math\n" + ADD, ["assert math.isclose(add(1, 2), 3)"], "add", sandbox=box)
    assert honest.reward == 1.0  # MBPP's tests use the program's `import math`


def test_an_exception_of_the_program_is_the_same_builtin_one_in_the_tests_but_never_stopiteration(box):
    """A ValueError raised by the program is a ValueError where the test catches it; a StopIteration is not one (it
    would end the test's loop over map(candidate, ...) early, passing the asserts it skips)."""
    tests = [
        "try:\n    add(1, 2)\n    raise AssertionError\nexcept ValueError:\n    pass",
        "for r in map(lambda a: add(a, 1), [1, 2]):\n    assert r == 7",
    ]
    raises = "def add(a, b):\n    raise ValueError('no') if a == 1 and b == 2 else StopIteration\n"
    r = sandbox.run_code_tests(raises, tests, "add", sandbox=box)
    assert (r.passed, r.total) == (1, 2), r

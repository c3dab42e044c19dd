"""The code verifier's OS isolation (sandbox.py under bubblewrap): what a program that gets past the audit hook can
still do. Each hostile program runs code without the hook (a process started by `_posixsubprocess.fork_exec`, which
raises no audit event) and gets its test's honest result, with nothing written outside its sandbox and nothing left
running. Where bubblewrap cannot start, these tests are skipped, saying why; the refusal itself is tested here too."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT

from rlvr_utils.extras.data import sandbox

PROBLEM = sandbox.isolation_problem("bwrap")
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"bubblewrap cannot start here: {PROBLEM}")
ADD = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def token():
    """A word in the argv of every process a hostile program starts, to find any left behind (by process id, after
    the test, so a failure leaves nothing running either)."""
    word = f"rlvr-hostile-{os.getpid()}-{time.monotonic_ns()}"
    yield word
    for pid in running(word):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def running(word: str) -> list[int]:
    """Live (non-zombie) processes whose command line holds `word`."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if word.encode() in (d / "cmdline").read_bytes():
                    stat = (d / "stat").read_text()
                    if stat[stat.rindex(")") + 2] != "Z":
                        found.append(int(d.name))
            except (OSError, ValueError):
                continue
    return found


def unhooked(code: str, word: str, session: bool = True, keep_fds: bool = False, wait: int = 300) -> str:
    """Program text that starts `python -c code word` past the audit hook (fork_exec raises no event: issue #69), in
    a session of its own, and waits up to `wait` x 10 ms for the file `done` it may write in the working directory;
    `result()` reads that file. `code` writes it with `report(text)` (whole, by a rename)."""
    code = REPORT + code
    return textwrap.dedent(f"""\
        import _posixsubprocess, os, sys, time
        r, w = os.pipe()
        args = [sys.executable.encode(), b"-c", {code!r}.encode(), {word!r}.encode()]
        _posixsubprocess.fork_exec(args, [args[0]], {not keep_fds}, (), None, None, -1, -1, -1, -1, -1, -1, r, w,
                                   True, {session}, -1, None, None, None, -1, None, False)
        for _ in range({wait}):
            if os.path.exists("done"):
                break
            time.sleep(0.01)
        def result():
            try:
                return open("done").read()
            except OSError:
                return None
        """)


# the report's page is written first, so that it still fits when the program has filled its disk
REPORT = "import os\nopen('done.part', 'w').write(' ' * 4096)\n"
REPORT += "def report(x):\n    with open('done.part', 'r+') as f:\n        f.write(x)\n        f.truncate()\n"
REPORT += "    os.rename('done.part', 'done')\n"


@needs_bwrap
def test_a_shell_past_the_hook_writes_nothing_outside_and_does_not_outlive_the_sandbox(tmp_path, token):
    """The issue's first escape: a shell started by fork_exec in a new session made a file outside and wrote a marker
    after the sandbox returned. Under bwrap the program scores what its code deserves (a correct add: 1.0)."""
    targets = [tmp_path / "outside", ROOT / "tests" / f".{token}", Path(sandbox.SITE[0]) / f".{token}"]
    writes = "; ".join(f"echo x > {t}" for t in targets)
    shell = f"import os\nos.execv('/bin/sh', ['/bin/sh', '-c', {writes + '; sleep 1.5; ' + writes!r}, {token!r}])"
    try:
        r = sandbox.run_code_tests(unhooked(shell, token, wait=0) + ADD, ["assert add(1, 2) == 3"], "add", timeout=3)
        assert r.reward == 1.0 and r.sandbox == "bwrap", r
        assert running(token) == []
        time.sleep(2.0)  # past the shell's second round of writes
        assert [t for t in targets if t.exists()] == []
        assert running(token) == []
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


FORGE = """\
import os, re
found = []
for path in ("/dev/fd/../../self/maps", "/proc/self/maps"):  # the issue's second escape: the harness's own memory
    try:
        maps = open(path).read().splitlines()
        mem = open(path.replace("maps", "mem"), "rb", 0)
    except OSError:
        continue
    for line in maps:
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        try:
            mem.seek(lo)
            found += re.findall(rb'"nonce": "([0-9a-f]{32})"', mem.read(hi - lo))
        except (OSError, OverflowError, ValueError):
            pass
lines = [b"pass 0\\n", b"start 1 0\\npass 0\\n"] + [n + b":pass:0\\n" for n in found]
for fd in range(1024):  # every verdict line there ever was, on every descriptor the program holds
    for line in lines:
        try:
            os.write(fd, line)
        except OSError:
            pass
"""


@pytest.mark.parametrize("box", ["bwrap", "audit-hook"])
def test_no_write_of_a_pass_marker_counts(box, token):
    """The issue's second escape (a nonce read from /dev/fd/../../self/mem, then `<nonce>:pass:0` written): the
    verdict now comes from the tests' own sandbox, whose pipe the program never holds, so the program and a child
    past the hook that inherits all its descriptors write every marker in vain: a wrong add scores 0."""
    if box == "bwrap" and PROBLEM is not None:
        pytest.skip(f"bubblewrap cannot start here: {PROBLEM}")
    wrong = "def add(a, b):\n    return 0\n"
    child = unhooked(FORGE + "report('x')\n", token, session=False, keep_fds=True)
    for program in (FORGE + wrong, child + wrong):
        r = sandbox.run_code_tests(program, ["assert add(1, 2) == 3"], "add", timeout=4, sandbox=box)
        assert r.reward == 0.0 and r.status == "ok", r
    assert running(token) == []


@needs_bwrap
def test_a_fork_bomb_past_the_hook_is_bounded_and_ends_with_the_sandbox(token):
    bomb = (
        "import os, time\nn = 0\nfor i in range(300):\n    try:\n        pid = os.fork()\n    except OSError:\n"
        "        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\n"
        "report(str(n))\ntime.sleep(30)\n"
    )
    program = unhooked(bomb, token) + "FORKS = int(result())\n" + ADD
    r = sandbox.run_code_tests(program, ["assert add(1, 2) == 3", "assert FORKS < 16"], "add", timeout=6)
    assert r.reward == 1.0, r  # fewer than RLIMIT_NPROC (16 tasks of the sandbox's user) were made
    assert running(token) == []


@needs_bwrap
def test_writing_a_gibibyte_stops_at_the_sandbox_disk_and_leaves_nothing_on_the_host(token):
    """1 GiB in 16 MiB files, from the program and from a child past the hook (in /tmp, /dev/shm and the working
    directory): the private tmpfs holds 64 MiB (disk_mb) and nothing reaches the host's disks."""
    fill = (
        "import os\nn = 0\nfor where in ('.', '/tmp', '/dev/shm', '/var/tmp'):\n    for i in range(64):\n        try:\n"
        f"            with open(os.path.join(where, '{token}-%s-%d' % (WHO, i)), 'wb') as f:\n"
        "                for _ in range(16):\n                    f.write(b'0' * (1 << 20))\n"
        "                    n += 1 << 20\n        except OSError:\n            break\n"
    )
    used = "s = os.statvfs('.')\nUSED = (s.f_blocks - s.f_bfree) * s.f_frsize\n"  # the tmpfs, full
    program = unhooked("WHO = 'child'\n" + fill + "report(str(n))\n", token) + "CHILD = int(result())\n"
    program += "WHO = 'own'\n" + fill + "OWN = n\n" + used + ADD  # distinct names: no file is written twice
    tests = ["assert add(1, 2) == 3", "assert CHILD >= 60 << 20", "assert USED <= 64 << 20"]
    t0 = time.time()
    r = sandbox.run_code_tests(program, tests, "add", timeout=15)
    assert r.reward == 1.0, r
    assert time.time() - t0 < 15
    for where in ("/tmp", "/dev/shm", "/var/tmp", os.getcwd()):
        assert not [p for p in Path(where).glob(f"{token}*")], where
    assert running(token) == []


@needs_bwrap
def test_no_read_of_proc_dev_fd_or_host_files(tmp_path, token):
    """/proc (no host /proc: none at all), /dev/fd/../.. (its route to /proc), a world-readable host file and the
    trainer's own process, read by the program and by a child past the hook: nothing is found."""
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    paths = [
        "/proc/self/mem", "/proc/self/environ", "/proc/1/environ", f"/proc/{os.getpid()}/cmdline",
        "/dev/fd/../../self/mem", f"/dev/fd/../../{os.getpid()}/environ", str(secret), "/etc/passwd", "/root",
        str(ROOT / "README.md"),
    ]  # fmt: skip
    probe = f"found = []\nfor p in {paths!r}:\n    try:\n        with open(p, 'rb') as f:\n            f.read(1)\n"
    probe += "        found.append(p)\n    except OSError:\n        pass\n"
    program = unhooked(probe + "report(repr(found))\n", token) + "CHILD = result()\n"
    program += probe.replace("except OSError", "except Exception") + "OWN = found\n"
    r = sandbox.run_code_tests(program, ["assert CHILD == '[]'", "assert OWN == []"], None, timeout=5)
    assert r.reward == 1.0, r


@needs_bwrap
def test_no_network_connection_even_past_the_hook(token):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    connect = (
        f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    got = 'yes'\n"
        "except OSError:\n    got = 'no'\n"
    )
    program = unhooked(connect + "report(got)\n", token) + "CHILD = result()\n"
    r = sandbox.run_code_tests(program, ["assert CHILD == 'no'"], None, timeout=5)
    assert r.reward == 1.0, r
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


@needs_bwrap
def test_a_sleep_past_the_timeout_and_its_children_end_at_the_deadline(token):
    program = unhooked("import time\ntime.sleep(60)\n", token, wait=0) + "time.sleep(60)\n" + ADD
    t0 = time.time()
    r = sandbox.run_code_tests(program, ["assert add(1, 2) == 3"], "add", timeout=2)
    assert (r.reward, r.status) == (0.0, "timeout")
    assert time.time() - t0 < 2 + 2
    assert running(token) == []


@needs_bwrap
def test_a_process_left_behind_in_a_session_of_its_own_ends_before_the_run_returns(token):
    """A double fork into a new session (so neither the program's process group nor its session holds it): killing
    the sandbox's init ends its whole pid namespace, and run_code_tests returns only after that."""
    left = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(30)\n"
    left += "report('x')\ntime.sleep(30)\n"
    program = unhooked(left, token) + "assert result() == 'x'\n" + ADD
    for _ in range(3):
        r = sandbox.run_code_tests(program, ["assert add(1, 2) == 3"], "add", timeout=5)
        assert r.reward == 1.0, r
        assert running(token) == []  # at once, not eventually


@needs_bwrap
def test_the_sandbox_dies_with_the_trainer(token):
    """--die-with-parent: a trainer killed by SIGKILL (no clean-up of its own runs) takes every sandbox with it."""
    program = unhooked("import time\nreport('x')\ntime.sleep(60)\n", token) + "time.sleep(60)\n"
    run = "import sys\nfrom rlvr_utils.extras.data import sandbox\n"
    run += "sandbox.run_code_tests(sys.stdin.read(), ['1'], None, 120)"
    trainer = subprocess.Popen([sys.executable, "-c", run], cwd=ROOT, stdin=subprocess.PIPE, text=True)
    trainer.stdin.write(program)  # not in its argv: only the sandbox's child has the token there
    trainer.stdin.close()
    for _ in range(200):
        if running(token):
            break
        time.sleep(0.05)
    assert running(token), "the sandboxed child never started"
    trainer.kill()
    trainer.wait()
    for _ in range(60):
        if not running(token):
            break
        time.sleep(0.05)
    assert running(token) == []


def test_a_missing_bubblewrap_is_one_line_naming_it_and_how_to_install_it(tmp_path):
    """Without bwrap on PATH (or with one that cannot make namespaces) the code task refuses, in one line that names
    what is missing, how to get it, and the flag that accepts the weaker sandbox."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "bwrap").write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the kernel does not allow "
        "non-privileged user namespaces.' >&2\nexit 1\n"
    )
    (fake / "bwrap").chmod(0o755)
    ask = "from rlvr_utils.extras.data import sandbox\nprint(sandbox.isolation_problem('bwrap'))"
    for path, want in [(str(tmp_path), "not installed: apt-get install bubblewrap"), (str(fake), "No permissions")]:
        out = subprocess.run(
            [sys.executable, "-c", ask], cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PATH=path)
        )
        line = out.stdout.strip()
        assert out.returncode == 0 and len(line.splitlines()) == 1, out
        assert want in line and "--code-sandbox audit-hook" in line, line
    assert sandbox.isolation_problem("audit-hook") is None
    if os.geteuid() == 0 and shutil.which("setpriv") and PROBLEM is None:  # root in a container without CAP_SYS_ADMIN
        no_admin = ["setpriv", "--bounding-set=-sys_admin", sys.executable, "-c", ask]
        line = subprocess.run(no_admin, cwd=ROOT, capture_output=True, text=True).stdout.strip()
        assert "Creating new namespace failed" in line and "CAP_SYS_ADMIN" in line and "audit-hook" in line, line


def test_the_code_task_refuses_to_start_without_isolation_unless_the_weaker_sandbox_is_accepted(tmp_path):
    rows = tmp_path / "mbpp.jsonl"
    rows.write_text('{"text": "add", "test_list": ["assert add(1, 2) == 3"]}\n' * 20)
    args = [sys.executable, "grpo.py", "--task", "code", "--data-path", str(rows), "--output-dir", str(tmp_path)]
    env = dict(os.environ, PATH=str(tmp_path))  # no bwrap
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert "bubblewrap" in line and "apt-get install bubblewrap" in line and "--code-sandbox audit-hook" in line
    assert not any(tmp_path.glob("*/metrics.jsonl"))  # before anything loaded
    help_text = subprocess.run([sys.executable, "grpo.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    words = " ".join(help_text.replace("│", " ").split())  # the help box wraps its rows
    assert "--code-sandbox" in words and "NOT a security boundary" in words, help_text


def nobody_python() -> str | None:
    """A Python that user nobody can run (this one, or the system's), or None."""
    for python in (sys.executable, "/usr/bin/python3"):
        path = Path(python).resolve()
        if path.exists() and all(p.stat().st_mode & 0o005 == 0o005 for p in [path, *path.parents]):
            return python
    return None


AS_USER = """\
import json, sys, types
runtime = types.ModuleType("rlvr_utils.core.runtime")  # the runner without torch (the system's Python may not have it)
runtime.usage_error = sys.exit
sys.modules["rlvr_utils.core.runtime"] = runtime
from rlvr_utils.extras.data import sandbox, sandbox_bwrap
runs = json.load(sys.stdin)
results = [sandbox.run_code_tests(p, t, e, timeout=6) for p, t, e in runs]
print(json.dumps([sandbox_bwrap.command(), [(r.reward, r.status, r.uid) for r in results]]))
"""


@needs_bwrap
def test_as_an_unprivileged_user_in_a_user_namespace_of_its_own(token):
    """Run as root, the suite's other tests take bwrap's root path (no user namespace; a user id per sandbox). This one
    takes the path of everyone else, as user nobody: the shell past the hook, the fork bomb and the process left
    behind, each with its honest result and nothing left running."""
    if os.geteuid() != 0:
        pytest.skip("not root: every other test here already runs in a user namespace")
    python = nobody_python()
    if python is None:
        pytest.skip("no Python that user nobody can read (this one lives under a private directory)")
    bomb = "import os, time\nn = 0\nfor i in range(300):\n    try:\n        pid = os.fork()\n    except OSError:\n"
    bomb += "        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\n"
    bomb += "report(str(n))\ntime.sleep(30)\n"
    left = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\nreport('x')\ntime.sleep(30)\n"
    shell = f"import os\nos.execv('/bin/sh', ['/bin/sh', '-c', 'echo x > /tmp/{token}; sleep 30', {token!r}])"
    runs = [
        (
            unhooked(bomb, token) + "FORKS = int(result())\n" + ADD,
            ["assert add(1, 2) == 3", "assert FORKS < 16"],
            "add",
        ),
        (unhooked(left, token) + "assert result() == 'x'\n" + ADD, ["assert add(1, 2) == 3"], "add"),
        (unhooked(shell, token, wait=0) + ADD, ["assert add(1, 2) == 4"], "add"),
    ]
    out = subprocess.run(
        [python, "-c", AS_USER], cwd=ROOT, input=json.dumps(runs), capture_output=True, text=True, timeout=120,
        user=65534, group=65534, extra_groups=[],
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    command, results = json.loads(out.stdout)
    assert "--unshare-user" in command
    assert [r[:2] for r in results] == [[1.0, "ok"], [1.0, "ok"], [0.0, "ok"]]
    assert {r[2] for r in results} == {65534}
    assert running(token) == [] and not Path(f"/tmp/{token}").exists()

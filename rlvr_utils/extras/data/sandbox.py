"""The code task's verifier: extract the program from a completion and run it against unit tests in OS isolation.

Each program runs in bubblewrap (Debian's `bubblewrap`, https://github.com/containers/bubblewrap): its own pid,
network, mount, IPC and UTS namespaces, a read-only view of /usr and the interpreter's prefixes and nothing else of
the host (no /proc, /etc, /home or working tree), a private tmpfs of bounded size as the only writable place, a user
id of its own (as root) or a user namespace of its own (otherwise), no capabilities, its own session; killing the
sandbox kills everything it started, and it dies with the trainer. The tests run in a second sandbox of the same
kind, which calls the program's functions over a pipe and alone writes the verdict (sandbox_harness.py): nothing the
program does can write a pass. The harness's audit hook and rlimits are a second layer. Where bwrap cannot start,
the code task refuses to run (`isolation_problem`) unless `--code-sandbox audit-hook` accepts the weaker sandbox
without OS isolation, which is not a security boundary (docs/code_task.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import select
import signal
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from rlvr_utils.core.runtime import usage_error
from rlvr_utils.extras.data import sandbox_bwrap

CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in one ```python code block."
)
CODE_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\nassert ")  # base-model continuation stops
_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def extract_code(completion: str) -> str:
    """The code in a completion: the last fenced block that is not empty (an unclosed fence runs to the
    end), else the raw text."""
    blocks = [b for b in _FENCE_RE.findall(completion) if b.strip()]
    return blocks[-1] if blocks else completion


def code_program(prompt_code: str, completion: str, entry_point: str) -> str:
    """The full program to test: when the extracted code defines `entry_point` it stands alone (the
    prompt's imports put before it); otherwise it continues `prompt_code` (a base model's completion,
    cut at the first top-level def/class/if __name__/print/assert as HumanEval's harness does)."""
    code = extract_code(completion)
    if re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.M):
        imports = [ln for ln in prompt_code.splitlines() if re.match(r"(from\s+\S+\s+)?import\s", ln)]
        return "\n".join(imports + [code])
    cut = min([i for i in (code.find(s) for s in CODE_STOP) if i >= 0], default=len(code))
    return prompt_code + code[:cut]


try:  # the harness program, run with python -I -S -c
    HARNESS = (Path(__file__).resolve().parent / "sandbox_harness.py").read_text()
except FileNotFoundError:  # a copy of the minimal core with sandbox.py alone
    usage_error(
        "--task code needs rlvr_utils/extras/data/sandbox_harness.py, which this copy does not have: copy it from the "
        "repository to the same path (README: Copy one method)"
    )


SANDBOXES = ("bwrap", "audit-hook")  # --code-sandbox: bubblewrap's namespaces, or the audit hook and rlimits alone
WEAK = (
    "programs run without OS isolation, under a Python audit hook and rlimits alone: not a security boundary (a "
    "program that gets past the hook can write where this run can, outlive it and read its files; docs/code_task.md)"
)


@dataclasses.dataclass
class CodeResult:
    """What one sandboxed run reached. `reward` = passed / total; `status`: ok, timeout, or error (the tests'
    sandbox never started: no tests counted). `uid`, `network_isolated`: what the tests' side reports of itself."""

    passed: int
    total: int
    status: str
    seconds: float
    network_isolated: bool = False
    uid: int = -1
    pid: int = -1  # the program's sandbox: its bwrap (or harness) process id = its process group id
    sandbox: str = "bwrap"

    @property
    def reward(self) -> float:
        return self.passed / self.total if self.total else 0.0


def isolation_problem(sandbox: str = "bwrap") -> str | None:
    """None when programs can run in `sandbox` here; else one line naming what is missing and how to get it (bwrap:
    sandbox_bwrap.problem, which runs bubblewrap once)."""
    if sandbox not in SANDBOXES:
        return f"--code-sandbox {sandbox}: choose one of {', '.join(SANDBOXES)}"
    return sandbox_bwrap.problem() if sandbox == "bwrap" else None


class IsolationError(RuntimeError):
    """The sandbox cannot start here (isolation_problem's line): no program is run and no reward is made up."""


# -S: no site module, so no .pth file runs at start-up (on this project's machine python -I takes 118 ms to start and
# python -I -S 25 ms); the harness puts the interpreter's site-packages on sys.path itself (SITE), so the program
# imports what is installed as before
PYTHON = (sys.executable, "-I", "-S", "-c", HARNESS)
SITE = [p for p in site.getsitepackages() if os.path.isdir(p)]  # a venv's (and its base's, when it includes them)


@dataclasses.dataclass
class _Sandbox:
    proc: subprocess.Popen
    info: int | None = None  # the pipe of bwrap's --info-fd, until read
    init: int | None = None  # a pidfd of the sandbox's init (bwrap's pid 1), when known


def _start(request: dict, fds: tuple[int, ...], stdout, sandbox: str, disk_mb: int, stack) -> tuple:
    """One harness (sandbox_harness.py), its request on stdin from an unlinked file (never a blocked write).
    Returns the process and, under bwrap, the pipe on which bwrap says its init's pid (--info-fd)."""
    payload = stack.enter_context(tempfile.TemporaryFile())
    payload.write(json.dumps(request).encode())
    payload.seek(0)
    info = None
    if sandbox == "bwrap":
        info = os.pipe()
        fds = (*fds, info[1])
        cmd, cwd = [*sandbox_bwrap.command(disk_mb)[:-1], "--info-fd", str(info[1]), "--", *PYTHON], None
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # bwrap clears it for the program (--clearenv)
    else:
        cwd = stack.enter_context(tempfile.TemporaryDirectory(prefix="rlvr-code-"))
        os.chmod(cwd, 0o777)  # the program may run as nobody
        cmd = list(PYTHON)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=payload,
            stdout=stdout if stdout is not None else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=cwd,
            env=env,
            pass_fds=fds,
            start_new_session=True,
        )
    finally:
        if info is not None:
            os.close(info[1])
    return proc, None if info is None else info[0]


def _kill(box: _Sandbox) -> None:
    """End a sandbox and everything it started before returning: SIGKILL its init (the kernel then ends each process
    of its pid namespace, a child in a session of its own too) and wait for it, then its process group."""
    if box.info is not None:
        os.close(box.info)
    if box.init is not None:
        sandbox_bwrap.kill_init(box.init)
    _kill_group(box.proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group, reap the leader, then repeat the kill a few times for any member
    that was mid-fork (a process with a pending SIGKILL cannot fork again). A bwrap leader takes its sandbox with
    it (--die-with-parent: its init gets SIGKILL, and the kernel ends every process of a pid namespace whose init
    ended)."""
    for attempt in range(6):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        if attempt == 0:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        else:
            time.sleep(0.002)
    if proc.returncode is None:
        proc.poll()


def run_code_tests(
    program: str,
    tests: str | Sequence[str],
    entry_point: str | None,
    timeout: float = 5.0,
    setup: str = "",
    memory_mb: int = 1024,
    max_file_mb: int = 16,
    output_cap: int = 1 << 16,
    sandbox: str = "bwrap",
    disk_mb: int = 64,
    processes: int = 16,
) -> CodeResult:
    """Run `program` in one sandbox and its tests in another (see the module docstring).

    `tests` is either a HumanEval test (a string defining `check(candidate)`: one test, run as
    `check(candidate)`) or a list of MBPP-style statements (`assert f(1) == 2`), each one test. A test counts as
    passed only when the tests' sandbox writes `pass <i>` after it returned; the program's sandbox holds no end of
    that pipe. The wall-clock `timeout` covers the whole run; tests that passed before it still count. Limits: each
    sandbox's tmpfs `disk_mb`, each process's `memory_mb` of address space and `max_file_mb` a file, `processes`
    tasks (threads count) of the sandbox's user (each sandbox has its own; with audit-hook as root, nobody's, all
    sandboxes together). An `IsolationError`
    when `sandbox` cannot start here."""
    if isinstance(tests, str):
        setup, tests = setup + "\n" + tests, ["check(candidate)"]
    tests = list(tests)
    problem = isolation_problem(sandbox)
    if problem is not None:
        raise IsolationError(problem)
    limits = {
        "RLIMIT_CPU": int(timeout) + 1,
        "RLIMIT_AS": memory_mb << 20,
        "RLIMIT_FSIZE": max_file_mb << 20,
        "RLIMIT_NPROC": processes,
        "RLIMIT_CORE": 0,
    }
    common = dict(limits=limits, isolated=sandbox == "bwrap", path=SITE)
    t0 = time.time()
    boxes: list[_Sandbox] = []
    out, status = bytearray(), "ok"
    with contextlib.ExitStack() as stack:  # on the way out: each sandbox killed, then its files removed
        calls, answers, verdict = os.pipe(), os.pipe(), os.pipe()  # tests -> program, program -> tests, tests -> us
        r = verdict[0]
        stack.callback(os.close, r)
        roles = [("program", (calls[0], answers[1]), None, dict(program=program))]
        roles += [
            ("tests", (calls[1], answers[0]), verdict[1], dict(setup=setup, tests=tests, entry_point=entry_point))
        ]
        try:
            for role, ends, stdout, fields in roles:
                request = dict(common, role=role, requests=ends[0], replies=ends[1], **fields)
                request["uid"] = sandbox_bwrap.sandbox_uid() if sandbox == "bwrap" and os.geteuid() == 0 else 65534
                boxes.append(_Sandbox(*_start(request, ends, stdout, sandbox, disk_mb, stack)))
                stack.callback(_kill, boxes[-1])
        finally:
            for fd in (*calls, *answers, verdict[1]):
                os.close(fd)
        for box in boxes:
            if box.info is not None:
                box.init = sandbox_bwrap.init_pidfd(box.proc, box.info)
                box.info = None
        os.set_blocking(r, False)
        deadline = t0 + timeout
        while True:
            ready, _, _ = select.select([r], [], [], max(0.0, min(0.05, deadline - time.time())))
            if ready:
                chunk = os.read(r, 1 << 16)
                if not chunk:  # the tests' sandbox ended
                    break
                if len(out) < output_cap:
                    out += chunk[: output_cap - len(out)]
            elif time.time() >= deadline:
                status = "timeout"
                break
    seconds = time.time() - t0
    lines = bytes(out).decode(errors="replace").splitlines()
    start = [ln.split() for ln in lines if ln.startswith("start ")]
    passed = {ln.split()[1] for ln in lines if ln.startswith("pass ")}
    n = sum(str(i) in passed for i in range(len(tests)))
    pid = boxes[0].proc.pid
    if not start:
        return CodeResult(0, len(tests), "error", seconds, pid=pid, sandbox=sandbox)
    return CodeResult(n, len(tests), status, seconds, start[0][1] == "1", int(start[0][2]), pid, sandbox)


def code_rewards(
    programs: Sequence[str],
    tests: Sequence[str | Sequence[str]],
    entry_points: Sequence[str | None],
    timeout: float = 5.0,
    workers: int | None = None,
    setups: Sequence[str] | None = None,
    sandbox: str = "bwrap",
) -> list[float]:
    """Batched `run_code_tests(...).reward`: `workers` programs at a time (default: the CPU count), each in a pair
    of sandboxes (so the processes of all of them are bounded by workers x 2 x `processes`)."""
    from concurrent.futures import ThreadPoolExecutor

    setups = [""] * len(programs) if setups is None else setups
    if not (len(programs) == len(tests) == len(entry_points) == len(setups)):
        raise ValueError(
            f"code_rewards: {len(programs)} programs, {len(tests)} tests, {len(entry_points)} entry points, "
            f"{len(setups)} setups"
        )
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(
            pool.map(
                lambda a: run_code_tests(a[0], a[1], a[2], timeout, a[3], sandbox=sandbox).reward,
                zip(programs, tests, entry_points, setups),
            )
        )

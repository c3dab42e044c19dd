"""The code task's verifier: extract the program from a completion and run it against unit tests in a sandbox.

NOT A SECURITY BOUNDARY. Each program runs in its own `python -I` subprocess and process group, in a
fresh temporary directory, stdin closed, under rlimits (CPU, address space, file size, processes),
without network (a new network namespace where the kernel allows it), as user `nobody` when started
as root and the standard library is world-readable, with a Python audit hook that allows a list of events and refuses
every other (fork/exec/subprocess, sockets, ctypes, sqlite3, writes outside its directory, /proc, frame/gc
introspection, ...; the harness that does all this is sandbox_harness.py); the whole group is killed at the end.
Native code or a Python-level exploit can still get out: run untrusted model output inside a container or VM
(docs/code_task.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from rlvr_utils.runtime import usage_error

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


try:  # the harness program, run with python -I -c
    HARNESS = (Path(__file__).resolve().parent / "sandbox_harness.py").read_text()
except FileNotFoundError:  # a copy of the minimal core with sandbox.py alone
    usage_error(
        "--task code needs rlvr_utils/sandbox_harness.py, which this copy does not have: copy it from the repository "
        "into rlvr_utils/ (README: Copy one method)"
    )


@dataclasses.dataclass
class CodeResult:
    """What one sandboxed run reached. `reward` = passed / total; `status`: ok, timeout, or error
    (the harness never started: no tests counted)."""

    passed: int
    total: int
    status: str
    seconds: float
    network_isolated: bool = False
    uid: int = -1
    pid: int = -1  # the run's process id = its process group id (all of it is killed before returning)

    @property
    def reward(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group, reap the leader, then repeat the kill a few times for any member
    that was mid-fork (a process with a pending SIGKILL cannot fork again)."""
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
) -> CodeResult:
    """Run `program` in the sandbox (see the section comment), then each test.

    `tests` is either a HumanEval test (a string defining `check(candidate)`: one test, run as
    `check(candidate)`) or a list of MBPP-style statements (`assert f(1) == 2`), each one test. A test
    counts as passed only when the harness writes `<nonce>:pass:<i>` after it returned, where the nonce
    is random per run and sent over stdin (closed before the program runs) and the marker goes to a
    private pipe; exit(0), os._exit, SystemExit, a patched builtin or printed text cannot fake one.
    The wall-clock `timeout` covers the whole run; tests that passed before it still count."""
    if isinstance(tests, str):
        setup, tests = setup + "\n" + tests, ["check(candidate)"]
    tests = list(tests)
    nonce = secrets.token_hex(16)
    limits = {
        "RLIMIT_CPU": int(timeout) + 1,
        "RLIMIT_AS": memory_mb << 20,
        "RLIMIT_FSIZE": max_file_mb << 20,
        "RLIMIT_NPROC": 512,
        "RLIMIT_CORE": 0,
    }
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rlvr-code-") as work:
        os.chmod(work, 0o777)  # the program may run as nobody
        r, w = os.pipe()
        payload = json.dumps(
            dict(nonce=nonce, fd=w, program=program, setup=setup, tests=tests, entry_point=entry_point, limits=limits)
        ).encode()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", HARNESS],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=work,
                env=env,
                pass_fds=(w,),
                start_new_session=True,
            )
        finally:
            os.close(w)
        out, status = bytearray(), "ok"
        try:
            try:
                proc.stdin.write(payload)
                proc.stdin.close()
            except BrokenPipeError:
                pass
            os.set_blocking(r, False)
            deadline = t0 + timeout
            while True:
                ready, _, _ = select.select([r], [], [], max(0.0, min(0.05, deadline - time.time())))
                if ready:
                    chunk = os.read(r, 1 << 16)
                    if not chunk:  # every writer closed: the run is over
                        break
                    if len(out) < output_cap:
                        out += chunk[: output_cap - len(out)]
                elif time.time() >= deadline:
                    status = "timeout"
                    break
        finally:
            os.close(r)
            _kill_group(proc)
    seconds = time.time() - t0
    lines = bytes(out).decode(errors="replace").splitlines()
    start = [ln.split(":") for ln in lines if ln.startswith(nonce + ":start:")]
    passed = {ln.rsplit(":", 1)[1] for ln in lines if ln.startswith(nonce + ":pass:")}
    n = sum(str(i) in passed for i in range(len(tests)))
    if not start:
        return CodeResult(0, len(tests), "error", seconds, pid=proc.pid)
    return CodeResult(n, len(tests), status, seconds, start[0][2] == "1", int(start[0][3]), proc.pid)


def code_rewards(
    programs: Sequence[str],
    tests: Sequence[str | Sequence[str]],
    entry_points: Sequence[str | None],
    timeout: float = 5.0,
    workers: int | None = None,
    setups: Sequence[str] | None = None,
) -> list[float]:
    """Batched `run_code_tests(...).reward`: `workers` sandboxes at a time (default: the CPU count)."""
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
                lambda a: run_code_tests(a[0], a[1], a[2], timeout, a[3]).reward,
                zip(programs, tests, entry_points, setups),
            )
        )

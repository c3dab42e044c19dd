"""What one --reward-fn call may change, and what it may leave behind (an extra, loaded by reward_calls.py).

TRL's GRPOTrainer builds each batch's arguments anew from the dataset, so a reward that edits them in place changes
nothing the next call sees; here the rows live for the whole run, so each call gets its own copies (`own_copies`): the
columns, prompts, completions and ids deep-copied, and `trainer_state` a copy whose `log_history` is a copy of the
run's rows (the run keeps its own). Around each call (`CallGuard.call`) the process-wide state a reward could leave
changed is put back, with one warning per function and kind naming it:
- torch's global state the update depends on: grad mode, the default dtype and device, the CPU threads (the run's
  --threads and its floating-point order), float32 matmul precision, deterministic algorithms;
- an alarm (signal.alarm / setitimer) still pending: cancelled (it would fire later, in the middle of the update);
- a forked process that returns from the function into the run (it would train beside the run, in its directory):
  it ends at once, with one line; a child process or a non-daemon thread still running: named (a non-daemon thread
  keeps the process from exiting when the run ends).
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import sys
import threading
from pathlib import Path

import torch

from rlvr_utils.core import runtime
from rlvr_utils.core.runtime import StopNow

HOOKS = ("log_extra", "log_metric")  # the run's own callables, passed as they are
IDS = "completion_ids"

TORCH_STATE = {  # what is compared and restored: (read, write)
    "grad mode (torch.set_grad_enabled)": (torch.is_grad_enabled, torch.set_grad_enabled),
    "default dtype (torch.set_default_dtype)": (torch.get_default_dtype, torch.set_default_dtype),
    "default device (torch.set_default_device)": (
        torch.get_default_device,
        lambda d: torch.set_default_device(None if d == torch.device("cpu") else d),
    ),
    "CPU threads (torch.set_num_threads)": (torch.get_num_threads, torch.set_num_threads),
    "float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "deterministic algorithms (torch.use_deterministic_algorithms)": (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda s: torch.use_deterministic_algorithms(s[0], warn_only=s[1]),
    ),
}


def own_copies(kwargs: dict) -> dict:
    """One call's own arguments: the columns, prompts and completions deep-copied, `completion_ids` row by row (ints),
    `trainer_state` a shallow copy with its own `log_history` (the run's rows, each copied: their values are numbers),
    the logging hooks as they are."""
    out = {k: v if k in HOOKS or k == "trainer_state" else copy.deepcopy(v) for k, v in kwargs.items() if k != IDS}
    if IDS in kwargs:  # row by row: deepcopy of a large batch's ids takes a good part of a second
        out[IDS] = None if kwargs[IDS] is None else [list(c) for c in kwargs[IDS]]
    if "trainer_state" in out:
        state = out["trainer_state"] = copy.copy(kwargs["trainer_state"])
        state.log_history = [dict(row) for row in kwargs["trainer_state"].log_history]
    return out


_FORKS = [0]  # os.fork calls in this process (multiprocessing's too; subprocess's exec does not count)
os.register_at_fork(before=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))


def _children() -> set[int]:
    """The pids of this process's live children (Linux /proc; elsewhere none are seen)."""
    found = set()
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            state, ppid = d.joinpath("stat").read_text().rsplit(")", 1)[1].split()[:2]
            if int(ppid) == os.getpid() and state not in ("Z", "X"):  # a zombie has ended, only not been reaped
                found.add(int(d.name))
    return found


def text(v, show=repr) -> str:
    """repr (or str) of the user's object, which runs the user's code: when that raises, the type's name."""
    try:
        return str(show(v))
    except BaseException as e:
        if isinstance(e, StopNow) and from_signal(e):
            raise
        return f"<{type(v).__name__}>"


def from_signal(e: StopNow) -> bool:
    """Whether a StopNow was raised by the run's own signal handlers (runtime.py), not by a reward's code."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename == runtime.__file__


def _pool_workers() -> set:
    """concurrent.futures' worker threads (asyncio's run_in_executor): not daemons, but ended when the process exits."""
    from concurrent.futures import thread

    return set(getattr(thread, "_threads_queues", {}))


class CallGuard:
    """`with guard.call(spec):` around one reward call (or a batch's async calls, named together)."""

    def __init__(self):
        self.pid, self.warned, self.known = os.getpid(), set(), None  # known: the children before the first call

    @contextlib.contextmanager
    def call(self, spec: str):
        before = {name: read() for name, (read, _) in TORCH_STATE.items()}
        self.known = _children() if self.known is None else self.known
        threads, forks = set(threading.enumerate()), _FORKS[0]
        try:
            yield
        finally:
            self._after(spec, before, threads, forks)

    def _after(self, spec: str, before: dict, threads: set, forks: int) -> None:
        if os.getpid() != self.pid:  # a fork's child came back from the function: it must not train beside the run
            what = (
                "a process it forked returned into the run; that process ends here (a forked child ends with os._exit)"
            )
            print(f"\nerror: --reward-fn {spec}: {what}", file=sys.stderr, flush=True)
            os._exit(1)
        for name, (read, write) in TORCH_STATE.items():
            if read() != before[name]:
                write(before[name])
                self._warn(spec, name, f"changed torch's {name}: it is restored after each of its calls")
        main = threading.current_thread() is threading.main_thread()
        if main and hasattr(signal, "setitimer") and signal.setitimer(signal.ITIMER_REAL, 0)[0] > 0:
            what = "left an alarm pending (signal.alarm or setitimer): it is cancelled after each of its calls"
            self._warn(spec, "alarm", what)
        for t in set(threading.enumerate()) - threads - _pool_workers():
            if t.is_alive() and not t.daemon:
                why = "the run cannot exit while it runs (join it, or start it with daemon=True)"
                self._warn(spec, "thread", f"left a thread running ({t.name!r}, not a daemon): {why}")
        left = sorted(_children() - self.known) if _FORKS[0] != forks else []  # /proc is read after a fork only
        if left:
            self.known |= set(left)
            self._warn(spec, "child", f"left a forked process running (pid {left[0]}): wait for it before returning")

    def _warn(self, spec: str, kind: str, what: str) -> None:
        if (spec, kind) not in self.warned:
            self.warned.add((spec, kind))
            print(f"\nwarning: --reward-fn {spec} {what}", file=sys.stderr, flush=True)

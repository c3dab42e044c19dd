"""Stopping on request: Ctrl-C (SIGINT), SIGTERM, what a cluster scheduler (and torchrun, which forwards it to every
rank) sends before it preempts a job, or SIGHUP, what a closing terminal or ssh session sends. Before the first step
the run ends with one line; afterwards it stops after the step in progress with a checkpoint (checkpoints.py), every
rank at the same step. `Watchdog`: a call that runs too long (--reward-timeout) is stopped the same way, from a signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


class StopNow(SystemExit):
    """The exit a signal asks for at once (exit code 130): raised from a signal handler, wherever the main thread is
    (a reward function's code included, which must let it through)."""


# Ctrl-C, a scheduler's preemption, and SIGHUP: a closed terminal or ssh session (where the platform has it)
SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def _ignore_further_signals() -> None:
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stop_while_loading() -> None:
    """Until the run's first step (GracefulStop then takes over), Ctrl-C or SIGTERM ends the process with one line,
    not a traceback from inside the model loading: nothing has been trained, so nothing is saved."""

    def handler(signum, frame):
        _ignore_further_signals()  # a second Ctrl-C must not interrupt the exit itself (an atexit traceback)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n{name} before the first step: stopped, nothing was saved", file=sys.stderr, flush=True)
        raise StopNow(130)

    for sig in SIGNALS:
        try:
            signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass


class GracefulStop:
    """The first Ctrl-C (SIGINT) or SIGTERM (what a cluster scheduler sends before it preempts a job) asks the run to
    stop after the step in progress: the script then saves a checkpoint, closes its logs and exits with one line
    naming the --resume command (exit code 130). A second signal stops at once, with one line and no traceback. Under
    torchrun every rank must agree on the step: `requested(dist)` all-reduces the flag."""

    def __init__(self):
        self.flag = False
        for sig in SIGNALS:
            try:
                signal.signal(sig, self._handler)
            except ValueError:  # not the main thread (e.g. a test runner): the signal keeps its default
                pass

    def _handler(self, signum, frame):
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.flag:
            _ignore_further_signals()  # a third signal must not interrupt the exit itself
            print(f"\n{name} again: stopping now, without a checkpoint of this step", file=sys.stderr, flush=True)
            raise StopNow(130)
        self.flag = True
        print(
            f"\n{name}: the run stops after this step and saves a checkpoint (a second signal stops at once)",
            file=sys.stderr,
            flush=True,
        )

    def requested(self, dist=None) -> bool:
        if dist is not None and dist.world > 1:
            return dist.sum([float(self.flag)])[0] > 0
        return self.flag


GRACE = 10.0  # seconds a timed-out call gets to unwind before the process ends at once


class RewardTimeout(BaseException):
    """Raised in the main thread when a reward call runs past --reward-timeout (a BaseException: a reward's own
    `except Exception` does not swallow it)."""


class Watchdog:
    """`with Watchdog(seconds, what):` raise RewardTimeout in the main thread when the block runs longer (a signal
    wakes a blocking call); a block that still has not returned GRACE seconds later ends the process with one line.
    A thread and SIGUSR1 rather than an alarm: reward libraries (math-verify) set and cancel SIGALRM themselves."""

    _installed = False
    _firing = False

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = seconds, what

    @classmethod
    def _handler(cls, signum, frame):
        if cls._firing:
            cls._firing = False
            raise RewardTimeout

    def __enter__(self):
        if not self.seconds:
            return self
        self.main = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_kill")
        if self.main and not Watchdog._installed:
            signal.signal(signal.SIGUSR1, Watchdog._handler)
            Watchdog._installed = True
        self.lock, self.done = threading.Lock(), threading.Event()
        threading.Thread(target=self._watch, args=(threading.get_ident(),), daemon=True).start()
        return self

    def _watch(self, ident: int) -> None:
        if self.done.wait(self.seconds):
            return
        with self.lock:
            if self.done.is_set():
                return
            if self.main:
                Watchdog._firing = True
                signal.pthread_kill(ident, signal.SIGUSR1)
        if self.done.wait(GRACE):
            return
        print(f"\nerror: {self.what} did not return within {self.seconds:g} s (--reward-timeout)", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)

    def __exit__(self, *exc):
        if self.seconds:
            self.done.set()  # first: a signal that lands while the lock is awaited must not leave the watcher armed
            with self.lock:
                Watchdog._firing = False
        return False

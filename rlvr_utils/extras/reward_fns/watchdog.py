"""--reward-timeout: a reward call that runs too long is stopped from a signal (`Watchdog`), with one line naming it.
An extra: loaded by reward_calls.py, with --reward-fn."""

from __future__ import annotations

import os
import signal
import sys
import threading

GRACE = 10.0  # seconds a timed-out call gets to unwind before the process ends at once


class RewardTimeout(BaseException):
    """Raised in the main thread when a reward call runs past --reward-timeout (a BaseException: a reward's own
    `except Exception` does not swallow it)."""


class Watchdog:
    """`with Watchdog(seconds, what):` raise RewardTimeout in the main thread when the block runs longer (a signal
    wakes a blocking call); a block that still has not returned GRACE seconds later ends the process with one line.
    A thread and SIGUSR1 rather than an alarm: reward libraries (math-verify) set and cancel SIGALRM themselves."""

    _firing = False
    _previous = None  # SIGUSR1's handler before ours (runtime.GracefulStop: a user's SIGUSR1 stops the run)

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = seconds, what

    @classmethod
    def _handler(cls, signum, frame):
        if cls._firing:
            cls._firing = False
            raise RewardTimeout
        if callable(cls._previous):  # not ours: a SIGUSR1 sent to the run
            cls._previous(signum, frame)

    def __enter__(self):
        if not self.seconds:
            return self
        self.main = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_kill")
        # (re)installed whenever SIGUSR1 is not ours: a later run in this process (its GracefulStop) replaces it, and
        # the watchdog's signal would then ask that run to stop while the hung call goes on
        if self.main and signal.getsignal(signal.SIGUSR1) != Watchdog._handler:
            Watchdog._previous = signal.signal(signal.SIGUSR1, Watchdog._handler)
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

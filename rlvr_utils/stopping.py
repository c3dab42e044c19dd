"""Stopping on request: Ctrl-C (SIGINT), SIGTERM, what a cluster scheduler (and torchrun, which forwards it to every
rank) sends before it preempts a job, or SIGHUP, what a closing terminal or ssh session sends. Before the first step
the run ends with one line; afterwards it stops after the step in progress with a checkpoint (checkpoints.py), every
rank at the same step.
"""

from __future__ import annotations

import signal
import sys

# Ctrl-C, a scheduler's preemption, and SIGHUP: a closed terminal or ssh session (where the platform has it)
SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def stop_while_loading() -> None:
    """Until the run's first step (GracefulStop then takes over), Ctrl-C or SIGTERM ends the process with one line,
    not a traceback from inside the model loading: nothing has been trained, so nothing is saved."""

    def handler(signum, frame):
        for sig in SIGNALS:  # a second Ctrl-C must not interrupt the exit itself (an atexit traceback)
            signal.signal(sig, signal.SIG_IGN)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n{name} before the first step: stopped, nothing was saved", file=sys.stderr, flush=True)
        raise SystemExit(130)

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
            for sig in SIGNALS:  # a third signal must not interrupt the exit itself
                signal.signal(sig, signal.SIG_IGN)
            print(f"\n{name} again: stopping now, without a checkpoint of this step", file=sys.stderr, flush=True)
            raise SystemExit(130)
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

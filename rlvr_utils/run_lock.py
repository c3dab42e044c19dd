"""One writer per run directory: a second process that would write into a live run (a resume beside it, two resumes
at once) stops with one line naming the holder, before it loads or writes anything."""

from __future__ import annotations

import os
from pathlib import Path

from rlvr_utils.errors import usage_error


def lock_run_dir(run_dir: Path):
    """One writer per run directory: an exclusive lock on <run_dir>/.lock, held for the process's life (the kernel
    drops it when the process ends, however it ends), whose text names the holder. A second process (a resume beside
    the live run, two resumes at once) stops with one line before it writes anything. Returns the open lock file."""
    import fcntl
    import socket

    key = str(Path(run_dir).resolve())
    if key in _LOCKS:  # this process holds it already (taken on --resume before the model loaded)
        return _LOCKS[key]
    f = open(Path(run_dir) / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        usage_error(
            f"{run_dir} is in use by {holder}: a run directory has one writer at a time (wait for it, or stop it)"
        )
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _LOCKS[key] = f
    return f


_LOCKS: dict = {}  # run directory -> its open, locked .lock file (kept open for the process's life)

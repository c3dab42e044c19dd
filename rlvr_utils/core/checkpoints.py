"""Checkpoints: `--save-model`, `--save-every N`, and the one a clean Ctrl-C writes (saving.py writes them, resume.py
reads them back); here what every run has: the run directory (its name and place checked before anything loads), its
one-writer lock, the counted prompt stream.

A training checkpoint is the directory <run_dir>/checkpoint/, written into a temporary sibling and renamed over the
previous one (only the last is kept, and a crash never leaves a half-written one):
  model/       the policy and its tokenizer (save_pretrained, safetensors): loads with from_pretrained
  trainer.pt   the step, the optimizer state, every random-number state (Python, NumPy, torch CPU and CUDA, the
               script's own generators), the number of prompt batches drawn so far, and method state (EP-GRPO's
               moving anchor); under torchrun one trainer_rank<r>.pt per rank (each rank samples with its own seed);
               only tensors, numbers, strings and containers of them: --resume loads it with weights_only=True
Under --fsdp the policy and the optimizer state are written sharded instead, by every rank at once, with
torch.distributed.checkpoint (DCP; sharded.py): sharded/ replaces model/ and trainer.pt holds no optimizer state
(docs/scaling.md). `--save-model` writes one Hugging Face folder, with a model card (model_card.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import NoReturn

from rlvr_utils.core import runtime


def io_cause(e: BaseException) -> str:
    """What stopped a write, in words: the disk is full, permission denied, ... and the error's own first line."""
    code = getattr(e, "errno", None) or int((re.findall(r"os error (\d+)", str(e)) or [0])[0])
    cause = IO_CAUSES.get(code, "" if isinstance(e, OSError) else "the file could not be written")
    first = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{cause}: {type(e).__name__}: {first}" if cause else f"{type(e).__name__}: {first}"


IO_CAUSES = {28: "the disk is full", 122: "the disk quota is exceeded", 13: "permission denied", 1: "permission denied"}
IO_CAUSES |= {30: "a read-only file system", 27: "a file-size limit", 5: "an I/O error", 21: "it is a directory"}
IO_CAUSES |= {40: "it is a symbolic link (remove it)", 37: "this file system has no working locks"}


def is_io_error(e: BaseException) -> bool:
    """An error of the disk or the file system (full, read-only, no permission, a size limit), as OSError or as the
    safetensors writer's own error type; anything else is a bug and keeps its traceback."""
    return isinstance(e, (OSError, RuntimeError)) or type(e).__name__ == "SafetensorError"


def write_failed(message: str) -> NoReturn:
    """A write the run needs failed while it ran (a full disk, ...): one line, exit code 1."""
    print(f"\nerror: {message}", file=sys.stderr, flush=True)  # a new line: a progress bar may be mid-line
    raise SystemExit(1)


class CountingBatches:
    """An endless prompt-batch iterator that counts its draws, so a resumed run can skip to the same place."""

    def __init__(self, make_iterator):
        self.make_iterator, self.it, self.drawn = make_iterator, make_iterator(), 0

    def __iter__(self):
        return self

    def __next__(self):
        self.drawn += 1
        return next(self.it)

    def skip_to(self, drawn: int) -> None:
        """Restart the stream and draw `drawn` batches (the stream is seeded: the same batches come back)."""
        self.it, self.drawn = self.make_iterator(), 0
        for _ in range(drawn):
            next(self)


def masters_of(*objects) -> contextlib.ExitStack:
    """One context in which each object with fp32 masters under bf16 compute (its `_rlvr_precision`: the policy,
    EP-GRPO's ema anchor) holds them, so a checkpoint writes and reads fp32 weights (precision.py)."""
    stack = contextlib.ExitStack()
    for obj in objects:
        if (mixed := getattr(obj, "_rlvr_precision", None)) is not None:
            stack.enter_context(mixed.masters())
    return stack


class Checkpointer:
    """<run_dir>/checkpoint/: when a save is due (every `every` steps, 0: never), its copies; saving.py writes it.
    `extra`: the script's own stateful objects by name (torch.Generator, random.Random, or anything with
    state_dict/load_state_dict, e.g. EP-GRPO's anchor model)."""

    def __init__(self, run_dir: str | os.PathLike, every: int, dist=None):
        self.path, self.every, self.dist = Path(run_dir) / "checkpoint", every, dist
        self.rank = dist.rank if dist is not None else 0

    def due(self, step: int, total_steps: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == total_steps)

    def save(self, step: int, model, tokenizer, optimizer, batches: CountingBatches, extra: dict | None = None) -> Path:
        """The checkpoint of the state after `step`, by saving.py (--fsdp: sharded.py): an extra that a run which never
        saves never loads. Mixed precision: the fp32 masters (`masters_of`)."""
        if self.sharded:
            writer = runtime.extra("sharded", "--fsdp")  # it writes the rest with saving.py's functions
        else:
            writer = runtime.extra("saving", "a checkpoint (--save-every, Ctrl-C)")
        with masters_of(model, *(extra or {}).values()):
            return writer.save(self, step, model, tokenizer, optimizer, batches, extra)

    @property
    def sharded(self) -> bool:
        return self.dist is not None and self.dist.world > 1 and self.dist.fsdp

    def copies(self) -> list[tuple[int, Path]]:
        """(step, directory) of every complete copy of the checkpoint, newest first: the checkpoint itself and any
        copy a kill left under a hidden name during a save."""
        found = []
        for d in [
            self.path,
            *self.path.parent.glob(f".{self.path.name}.tmp-*"),
            *self.path.parent.glob(f".{self.path.name}.old-*"),
        ]:
            try:
                found.append((int(json.loads((d / COMPLETE).read_text())["step"]), d))
            except (OSError, ValueError, KeyError, TypeError):
                if d == self.path and (d / "trainer.pt").is_file() and not (d / COMPLETE).exists():
                    found.append((-1, d))  # saved before the marker existed: complete, its step unknown here
        return sorted(found, key=lambda c: (c[0], c[1] == self.path), reverse=True)

    def clean_leftovers(self) -> None:
        """Remove the hidden copies a killed save left beside the checkpoint (rank 0, after a save or a resume)."""
        for d in [
            *self.path.parent.glob(f".{self.path.name}.tmp-*"),
            *self.path.parent.glob(f".{self.path.name}.old-*"),
        ]:
            shutil.rmtree(d, ignore_errors=True)


RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # --exp-name: one short path component


def check_run_dir(name: str, output_dir: str, resume: str | None) -> None:
    """--exp-name and --output-dir, checked before anything loads (cli.parse): one line naming the flag, exit code 2."""
    ok = not name or (RUN_NAME.fullmatch(name) is not None and name not in (".", ".."))
    runtime.need(ok, f"--exp-name {name!r}: a run name is one short path component: ASCII letters, digits, '.', '_' "
                 "or '-', at most 64 characters, no '/' or '\\'")  # fmt: skip
    runtime.need(bool(output_dir.strip()), "--output-dir must name a directory (default: runs), got ''")
    out = Path(output_dir).expanduser()
    parent = next(p for p in [out, *out.parents] if p.exists())
    if not resume:  # a resumed run writes into its own directory
        runtime.need(not out.exists() or out.is_dir(), f"--output-dir {output_dir}: exists and is not a directory")
        ok = parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)
        runtime.need(ok, f"--output-dir {output_dir}: {parent} is not a writable directory")


COMPLETE = "complete.json"  # written last into a checkpoint copy: {"step": N}


def shown(path: str | os.PathLike) -> str:
    """A path as the run's lines print it: relative to the working directory where it is under it, else as given."""
    p = Path(path)
    with contextlib.suppress(ValueError, OSError):
        return str(p.relative_to(Path.cwd())) if p.is_absolute() else str(p)
    return str(p)


def new_run_dir(output_dir: str | os.PathLike, name: str) -> Path:
    """<output_dir>/<name>, created exclusively; when another run holds that name (two runs started in the same second
    with the same task, name and seed), <name>-2, <name>-3, ... A run directory is never shared by two runs."""
    for k in range(1, 10_000):
        path = Path(output_dir).absolute() / (name if k == 1 else f"{name}-{k}")
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            continue
        except OSError as e:  # a full disk, a directory made read-only since the checks
            write_failed(f"--output-dir {output_dir}: cannot make the run directory {path.name} ({io_cause(e)})")
    raise RuntimeError(f"{output_dir}: no free run directory named {name}-N")


# ----------------------------------------------------------------------------------------------
# one writer per run directory: a second process that would write into a live run (a resume beside it, two resumes
# at once) stops with one line naming the holder, before it loads or writes anything
# ----------------------------------------------------------------------------------------------
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF}  # a file system without flock


def lock_run_dir(run_dir) -> None:
    """One writer per run directory: an exclusive lock on the run directory itself (flock on its own descriptor, so
    deleting or replacing `.lock` cannot undo it), held for the process's life (the kernel drops it when the process
    ends, however it ends). `.lock`, opened without following a link, names the holder for people. A second process
    (a resume beside the live run, two resumes at once) stops with one line naming the live holder (/proc/locks where
    it can be read), before it writes anything. A file system that cannot lock a directory (NFS): `.lock` itself is
    locked; one that cannot lock at all (ENOLCK, EOPNOTSUPP): a warning; the run goes on unguarded (docs/running.md).
    Any other failure (a read-only directory, `.lock` a directory or a link, a full disk): one line naming `.lock` and
    the cause, exit code 2 (1 for a full disk or an I/O error)."""
    import fcntl
    import socket

    run_dir = Path(run_dir).absolute()
    if str(run_dir) in _LOCKS:  # this process holds it already (taken on --resume before the model loaded)
        return
    lock = run_dir / ".lock"
    try:
        fds = [os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        fds.append(os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
        for fd in fds:  # the directory; where it cannot be locked, .lock itself
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                runtime.usage_error(
                    f"{run_dir} is in use by {_holder(run_dir, fds[-1])}: a run directory has one writer at a time "
                    "(wait for it, or stop it)"
                )
            except OSError as e:
                if e.errno not in NO_LOCKS:
                    raise
                why = e.strerror
        else:
            print(f"warning: {lock}: this file system has no working locks ({why}): nothing stops a "
                  "second process from writing into the run directory beside this run", file=sys.stderr)  # fmt: skip
        os.ftruncate(fds[-1], 0)
        os.pwrite(fds[-1], f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except OSError as e:
        print(f"error: {lock}: cannot lock the run directory ({io_cause(e)})", file=sys.stderr, flush=True)
        raise SystemExit(1 if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO) else 2) from None
    _LOCKS[str(run_dir)] = fds  # kept open for the process's life


_LOCKS: dict = {}  # run directory -> its open descriptors (the directory, .lock), one of them locked


def unlock_run_dir(run_dir) -> None:
    """A clean finish: `.lock` removed, then the lock released (meanwhile a second process still finds the directory
    locked), so that a finished run leaves no `.lock`. A process that does not hold it (a rank > 0): nothing."""
    fds = _LOCKS.pop(str(Path(run_dir).absolute()), [])
    if fds:
        with contextlib.suppress(FileNotFoundError):  # removed by hand meanwhile
            os.unlink(Path(run_dir).absolute() / ".lock")
    for fd in fds:
        os.close(fd)


def _holder(run_dir: Path, lock_fd: int) -> str:
    """Who holds the lock: the live process /proc/locks names for the directory (or .lock), else `.lock`'s text."""
    ids = set()
    for path in (run_dir, run_dir / ".lock"):
        with contextlib.suppress(OSError):
            st = os.stat(path, follow_symlinks=False)
            ids.add(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}")
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] in ids and fields[4].isdigit():
                pid = int(fields[4])
                with contextlib.suppress(OSError):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    return f"pid {pid} ({' '.join(cmd.split())[:80]})"
    text = os.pread(lock_fd, 200, 0).decode(errors="replace").strip()
    return text or "another process"

"""Checkpoints: `--save-model`, `--save-every N`, and the one a clean Ctrl-C writes (resume.py reads them back).

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
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from rlvr_utils import runtime


def save_model_atomic(
    model, tokenizer, path: str | os.PathLike, state_dict: dict | None = None, card: str | None = None
) -> Path:
    """`save_pretrained` model and tokenizer into a temporary sibling directory, then rename it
    over `path`, so a crash never leaves a half-written checkpoint. Refuses non-finite weights.
    `state_dict`: the weights to write instead of the model's own (FSDP's gathered full state); `card`: the
    README.md written beside them (the model card)."""
    named = state_dict.items() if state_dict is not None else model.named_parameters()
    bad = [n for n, p in named if torch.is_floating_point(p) and not torch.isfinite(p).all()]
    if bad:
        raise ValueError(f"refusing to save a checkpoint with non-finite weights in {bad[:3]}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _atomic_dir(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        if card is not None:
            (tmp / "README.md").write_text(card)
    return path


class _atomic_dir:
    """`with _atomic_dir(path) as tmp:` fill `tmp`; on success its files are flushed to disk (fsync) and it replaces
    `path` by two renames (path -> .<name>.old-<pid>, tmp -> path; then the old copy is removed); on failure it is
    removed. A kill between the two renames leaves both copies complete under hidden names: `Checkpointer.restore`
    finds the newest complete one."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def __enter__(self) -> Path:
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)  # mkdtemp makes it private; a checkpoint is an ordinary directory
        return self.tmp

    def __exit__(self, exc_type, *_):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        umask = os.umask(0)
        os.umask(umask)
        for dirpath, _, files in os.walk(self.tmp):  # safetensors writes 0600: give every file the umask's mode
            for name in files:
                os.chmod(os.path.join(dirpath, name), 0o666 & ~umask)
        _fsync_tree(self.tmp)
        old = None
        if self.path.exists():
            old = self.path.parent / f".{self.path.name}.old-{os.getpid()}"
            os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file under `root`, then every directory, on disk before the rename makes them visible."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


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


def numpy_state() -> tuple:
    """NumPy's global random state with its key as a list of ints (np.random.set_state takes it back as it is)."""
    name, key, *rest = np.random.get_state()
    return (name, key.tolist(), *rest)


def _is_rng(obj) -> bool:
    return isinstance(obj, (torch.Generator, random.Random))


def _state_of(obj):
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, random.Random):
        return obj.getstate()
    return obj.state_dict()


def load_into(obj, state) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif isinstance(obj, random.Random):
        obj.setstate(state)
    else:
        obj.load_state_dict(state)


class Checkpointer:
    """Saves <run_dir>/checkpoint/ every `every` steps (0: never) and when asked (Ctrl-C), and restores it.
    `extra`: the script's own stateful objects by name (torch.Generator, random.Random, or anything with
    state_dict/load_state_dict, e.g. EP-GRPO's anchor model)."""

    def __init__(self, run_dir: str | os.PathLike, every: int, dist=None):
        self.path, self.every, self.dist = Path(run_dir) / "checkpoint", every, dist
        self.rank = dist.rank if dist is not None else 0

    def due(self, step: int, total_steps: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == total_steps)

    def save(self, step: int, model, tokenizer, optimizer, batches: CountingBatches, extra: dict | None = None) -> Path:
        """Write the checkpoint of the state after `step` (rank 0 writes the model; every rank its RNG states)."""
        state = {
            "step": step,
            "batches_drawn": batches.drawn,
            "optimizer": None if self.sharded else optimizer.state_dict(),  # FSDP: in the shards (sharded.save)
            "python": random.getstate(),
            "numpy": numpy_state(),  # plain numbers: resume.py loads trainer.pt with weights_only=True
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "extra": {k: _state_of(v) for k, v in (extra or {}).items()},
        }
        # each rank's own streams: the script's generators too (SC-GRPO's routing draws differ per rank)
        state["extra_rng"] = {k: state["extra"][k] for k, v in (extra or {}).items() if _is_rng(v)}
        world = self.dist.world if self.dist is not None else 1
        states = [None] * world
        if world > 1:
            keys = ("python", "numpy", "torch", "cuda", "extra_rng")
            torch.distributed.all_gather_object(states, {k: state[k] for k in keys})
        if self.sharded:
            return runtime.extra("sharded", "--fsdp").save(self, step, model, optimizer, state, states)
        if self.rank == 0:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.new_copy() as tmp:
                    save_model_atomic(model, tokenizer, tmp / "model")
                    self.write_state(tmp, step, state, states)
            except Exception as e:  # a full disk, a read-only directory, a file-size limit (OSError or the writer's)
                if not is_io_error(e):
                    raise  # not an I/O failure: a bug keeps its traceback
                self.failed(step, e)
            self.clean_leftovers()
        if self.dist is not None:
            self.dist.barrier()
        return self.path

    def new_copy(self) -> _atomic_dir:
        """`with ckpt.new_copy() as tmp:` a temporary copy that replaces the checkpoint once it is filled."""
        return _atomic_dir(self.path)

    def write_state(self, tmp: Path, step: int, state: dict, states: list, **marker) -> None:
        """A copy's files besides the weights (rank 0): trainer.pt, the other ranks' sampling streams `states[1:]`,
        and last the marker {"step": step, **marker} that says the copy is whole."""
        torch.save(state, tmp / "trainer.pt")
        for r in range(1, len(states)):
            torch.save(states[r], tmp / f"trainer_rank{r}.pt")
        (tmp / COMPLETE).write_text(json.dumps({"step": step, **marker}))

    def failed(self, step: int, e: BaseException) -> NoReturn:
        """A save that could not be written: one line naming the directory, the cause and the checkpoint that is still
        whole (the atomic copy never replaced it), then exit code 1."""
        kept = self.copies()
        left = f"the checkpoint of step {kept[0][0]} is intact" if kept else "no earlier checkpoint exists"
        write_failed(f"saving step {step} to {self.path} failed ({io_cause(e)}); {left}")

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


COMPLETE = "complete.json"  # written last into a checkpoint copy: {"step": N}


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
    locked; one that cannot lock at all (ENOLCK, EOPNOTSUPP): a warning, and the run goes on unguarded (README). Any
    other failure (a read-only directory, `.lock` a directory or a link, a full disk): one line naming `.lock` and
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

"""Writing checkpoints (an extra: --save-every, --save-model, and the checkpoint a Ctrl-C asks for; checkpoints.py
holds what a run has without them: the run directory, its lock, the counted prompt stream and where copies are).

save_model_atomic   a Hugging Face folder written into a temporary sibling, flushed, then renamed over the old one
save                <run_dir>/checkpoint/: the policy, trainer.pt (optimizer, every random stream, data position,
                    method state) and last complete.json, as one atomic copy (its layout: checkpoints.py)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from rlvr_utils.core.checkpoints import COMPLETE, io_cause, is_io_error, write_failed


def save(ckpt, step: int, model, tokenizer, optimizer, batches, extra: dict | None = None) -> Path:
    """Write `ckpt`'s (a checkpoints.Checkpointer) checkpoint of the state after `step` (rank 0 writes the model;
    every rank its RNG states). Under --fsdp the Checkpointer calls sharded.save instead, with the same arguments."""
    state, states = run_state(ckpt, step, optimizer, batches, extra)
    if ckpt.rank == 0:
        try:
            ckpt.path.parent.mkdir(parents=True, exist_ok=True)
            with new_copy(ckpt) as tmp:
                save_model_atomic(model, tokenizer, tmp / "model")
                write_state(ckpt, tmp, step, state, states)
        except Exception as e:  # a full disk, a read-only directory, a file-size limit (OSError or the writer's)
            if not is_io_error(e):
                raise  # not an I/O failure: a bug keeps its traceback
            failed(ckpt, step, e)
        ckpt.clean_leftovers()
    if ckpt.dist is not None:
        ckpt.dist.barrier()
    return ckpt.path


def run_state(ckpt, step: int, optimizer, batches, extra: dict | None = None) -> tuple[dict, list]:
    """trainer.pt's dict after `step`, and every rank's random streams (gathered to all under torchrun: `states`)."""
    state = {
        "step": step,
        "batches_drawn": batches.drawn,
        "optimizer": None if ckpt.sharded else optimizer.state_dict(),  # FSDP: in the shards (sharded.save)
        "python": random.getstate(),
        "numpy": numpy_state(),  # plain numbers: resume.py loads trainer.pt with weights_only=True
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "extra": {k: _state_of(v) for k, v in (extra or {}).items()},
    }
    # each rank's own streams: the script's generators too (SC-GRPO's routing draws differ per rank)
    state["extra_rng"] = {k: state["extra"][k] for k, v in (extra or {}).items() if _is_rng(v)}
    world = ckpt.dist.world if ckpt.dist is not None else 1
    states = [None] * world
    if world > 1:
        keys = ("python", "numpy", "torch", "cuda", "extra_rng")
        torch.distributed.all_gather_object(states, {k: state[k] for k in keys})
    return state, states


def new_copy(ckpt) -> _atomic_dir:
    """`with new_copy(ckpt) as tmp:` a temporary copy that replaces the checkpoint once it is filled."""
    return _atomic_dir(ckpt.path)


def write_state(ckpt, tmp: Path, step: int, state: dict, states: list, **marker) -> None:
    """A copy's files besides the weights (rank 0): trainer.pt, the other ranks' sampling streams `states[1:]`,
    and last the marker {"step": step, **marker} that says the copy is whole."""
    _save(state, tmp / "trainer.pt")
    for r in range(1, len(states)):
        _save(states[r], tmp / f"trainer_rank{r}.pt")
    (tmp / COMPLETE).write_text(json.dumps({"step": step, **marker}))


def _save(obj, path: Path) -> None:
    """torch.save through a Python file, so that a full disk is the OSError it is (errno ENOSPC: "the disk is full"),
    not the `unexpected pos` RuntimeError of torch's own writer, which loses the cause."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def failed(ckpt, step: int, e: BaseException) -> NoReturn:
    """A save that could not be written: one line naming the directory, the cause and the checkpoint that is still
    whole (the atomic copy never replaced it), then exit code 1."""
    kept = ckpt.copies()
    left = f"the checkpoint of step {kept[0][0]} is intact" if kept else "no earlier checkpoint exists"
    write_failed(f"saving step {step} to {ckpt.path} failed ({io_cause(e)}); {left}")


def save_model_atomic(
    model, tokenizer, path: str | os.PathLike, state_dict: dict | None = None, card: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:  # fmt: skip
    """`save_pretrained` model and tokenizer into a temporary sibling directory, then rename it
    over `path`, so a crash never leaves a half-written checkpoint. Refuses non-finite weights.
    `state_dict`: the weights to write instead of the model's own (FSDP's gathered full state); `card`: the
    README.md written beside them (the model card); `dtype`: the floating-point weights cast to it (--save-dtype),
    which config.json then names."""
    if dtype is not None:
        state_dict = cast_state(model.state_dict() if state_dict is None else state_dict, dtype)
    named = state_dict.items() if state_dict is not None else model.named_parameters()
    bad = [n for n, p in named if torch.is_floating_point(p) and not torch.isfinite(p).all()]
    if bad:
        raise ValueError(f"refusing to save a checkpoint with non-finite weights in {bad[:3]}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _atomic_dir(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        if dtype is not None:  # save_pretrained names the model's own dtype
            config = json.loads((tmp / "config.json").read_text())
            for key in {"dtype", "torch_dtype"} & set(config) or {"dtype"}:  # transformers 5's name, 4.x's
                config[key] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(tmp)
        if card is not None:
            (tmp / "README.md").write_text(card)
    return path


def cast_state(state: dict, dtype: torch.dtype) -> dict:
    """A state dict with its floating-point tensors cast to `dtype`; tensors that share storage (tied embeddings) stay
    one tensor."""
    out, cast = {}, {}
    for k, v in state.items():
        if torch.is_floating_point(v) and v.dtype != dtype:
            key = (v.data_ptr(), v.shape)
            cast[key] = cast[key] if key in cast else v.to(dtype)
            v = cast[key]
        out[k] = v
    return out


class _atomic_dir:
    """`with _atomic_dir(path) as tmp:` fill `tmp`; on success its files are flushed to disk (fsync) and it replaces
    `path` by two renames (path -> .<name>.old-<pid>, tmp -> path; then the old copy is removed); on failure it is
    removed. A kill between the two renames leaves both copies complete under hidden names: `resume.recover`
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

"""Checkpoints and resumable runs: `--save-model`, `--save-every N`, `--resume RUN_DIR`, and a clean Ctrl-C.

A training checkpoint is the directory <run_dir>/checkpoint/, written into a temporary sibling and renamed over the
previous one (only the last is kept, and a crash never leaves a half-written one):
  model/       the policy and its tokenizer (save_pretrained, safetensors): loads with from_pretrained
  trainer.pt   the step, the optimizer state, every random-number state (Python, NumPy, torch CPU and CUDA, the
               script's own generators), the number of prompt batches drawn so far, and method state (EP-GRPO's
               moving anchor); under torchrun one trainer_rank<r>.pt per rank (each rank samples with its own seed)
`--resume RUN_DIR` restores all of it after the script has built its model, optimizer and task, so the run goes on
exactly as if it had not stopped (tests/test_checkpoints.py checks this bit for bit on CPU).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch


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
    with _atomic_dir(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
    return path


class _atomic_dir:
    """`with _atomic_dir(path) as tmp:` fill `tmp`; on success it replaces `path` (rename), on failure it is removed."""

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
        old = None
        if self.path.exists():
            old = self.path.parent / f".{self.path.name}.old-{os.getpid()}"
            os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False


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


def _state_of(obj):
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, random.Random):
        return obj.getstate()
    return obj.state_dict()


def _load_into(obj, state) -> None:
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
            "optimizer": optimizer.state_dict(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "extra": {k: _state_of(v) for k, v in (extra or {}).items()},
        }
        world = self.dist.world if self.dist is not None else 1
        states = [None] * world
        if world > 1:
            torch.distributed.all_gather_object(states, {k: state[k] for k in ("python", "numpy", "torch", "cuda")})
        if self.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _atomic_dir(self.path) as tmp:
                save_model_atomic(model, tokenizer, tmp / "model")
                torch.save(state, tmp / "trainer.pt")
                for r in range(1, world):  # other ranks' sampling streams
                    torch.save(states[r], tmp / f"trainer_rank{r}.pt")
        if self.dist is not None:
            self.dist.barrier()
        return self.path

    def restore(self, model, optimizer, batches: CountingBatches, extra: dict | None = None) -> int:
        """Load the checkpoint into the objects the script has built; returns the step it was taken after."""
        from safetensors.torch import load_file

        if not (self.path / "trainer.pt").exists():
            raise SystemExit(
                f"--resume {self.path.parent}: no checkpoint there (runs save one with --save-every N or on Ctrl-C)"
            )
        weights = {}
        for f in sorted((self.path / "model").glob("*.safetensors")):
            weights.update(load_file(str(f)))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if k not in _tied(model)]
        if missing or unexpected:
            raise SystemExit(
                f"--resume {self.path.parent}: the checkpoint does not fit the model (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]})"
            )
        state = torch.load(self.path / "trainer.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        batches.skip_to(state["batches_drawn"])
        for k, v in (extra or {}).items():
            _load_into(v, state["extra"][k])
        rng = state if self.rank == 0 else torch.load(self.path / f"trainer_rank{self.rank}.pt", weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        return int(state["step"])


def _tied(model) -> set:
    """Parameter names safetensors leaves out because they share storage with another (tied embeddings)."""
    seen, tied = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape)
        if key in seen:
            tied.add(name)
        seen.setdefault(key, name)
    return tied | {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else tied


class GracefulStop:
    """The first Ctrl-C asks the run to stop after the step in progress (the script then saves a checkpoint, closes
    its logs and exits with one line); a second Ctrl-C stops at once. Under torchrun every rank must agree on the
    step: `requested(dist)` all-reduces the flag."""

    def __init__(self):
        self.flag = False
        try:
            signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread (e.g. a test runner): Ctrl-C keeps its default
            pass

    def _handler(self, signum, frame):
        if self.flag:
            raise KeyboardInterrupt
        self.flag = True
        print(
            "\nCtrl-C: the run stops after this step and saves a checkpoint (Ctrl-C again stops at once)",
            file=sys.stderr,
            flush=True,
        )

    def requested(self, dist=None) -> bool:
        if dist is not None and dist.world > 1:
            return dist.sum([float(self.flag)])[0] > 0
        return self.flag

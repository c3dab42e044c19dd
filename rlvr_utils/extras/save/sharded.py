"""Sharded checkpoints under --fsdp: torch.distributed.checkpoint (DCP) writes every rank's shards of the policy and
of the optimizer state at once, and reshards them on load onto any number of ranks, with or without FSDP. The rest of
a checkpoint (step, random streams, data position, method state) and its atomic replacement are saving.py's.
See docs/scaling.md ("Checkpoints across world sizes").
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
from pathlib import Path

import torch

from rlvr_utils.core.runtime import extra, usage_error
from rlvr_utils.extras.save import saving


def save(ckpt, step: int, model, tokenizer, optimizer, batches, extra: dict | None = None) -> Path:
    """saving.save under FSDP (`ckpt`, a checkpoints.Checkpointer, calls this instead): every rank writes its shards
    into the same temporary copy (sharded/), rank 0 the rest (trainer.pt without the optimizer; the ranks' random
    streams); the copy becomes the checkpoint by one rename once every rank's shards are on disk. Non-finite weights on
    any rank: none. What a copy is and holds besides the shards is the Checkpointer's (this module does not import
    it); sharded/ replaces model/, so the tokenizer is not written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state, states = saving.run_state(ckpt, step, optimizer, batches, extra)
    dist, main = ckpt.dist, ckpt.rank == 0
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    if dist.sum([float(not all(torch.isfinite(p).all() for p in local))])[0] > 0:
        raise ValueError("refusing to save a checkpoint with non-finite weights")
    ctx = saving.new_copy(ckpt) if main else None
    if main:
        ckpt.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(dist.broadcast(str(ctx.__enter__()) if main else None))  # one temporary copy, named by rank 0
    try:
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp / "sharded"))  # every rank: its shards
        dist.barrier()
        if main:
            saving.write_state(ckpt, tmp, step, {**state, "sharded": True}, states, world=dist.world)
    except BaseException as e:
        if main:
            ctx.__exit__(type(e), e, None)  # the temporary copy goes; the previous checkpoint stays
        raise
    if main:
        ctx.__exit__(None, None, None)
        ckpt.clean_leftovers()
    dist.barrier()
    return ckpt.path


def restore(path: Path, model, optimizer, run: Path, mixed=None) -> None:
    """Load a sharded checkpoint's policy and optimizer state into this run's layout (FSDP on any number of ranks,
    DDP, or one process): DCP reads each rank's part from whichever shards hold it. `mixed` (fp32 masters under bf16
    compute): bf16 shards, from a run before them, are upcast, with one line saying so."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: a rank's failures
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)  # this run's layout (DCP sets up AdamW's state with one 0-lr step)
    state = {"model": msd, "optimizer": osd}
    _check_metadata(path / ".metadata", run)
    try:
        dcp.load(state, checkpoint_id=str(path), planner=_weights_only_planner())
    except (Exception, CheckpointException) as e:  # a missing or damaged shard, another model's checkpoint
        e = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
        if isinstance(e, _Refused):
            usage_error(f"--resume {run}: {path} is refused: its value {e} holds more than tensors, numbers and lists "
                        "(unpickling a file made or changed elsewhere can run code)")  # fmt: skip
        reason = str(e).splitlines()[0][:200] if str(e) else "empty"
        usage_error(f"--resume {run}: {path} cannot be read ({type(e).__name__}: {reason})")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if mixed is not None:  # what the shards held (the index was read safely above)
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        dtypes = {m.properties.dtype for k, m in stored.items() if k.startswith("model.") and hasattr(m, "properties")}
        extra("precision", "--dtype bfloat16 (mixed precision)").upcast_note(dtypes, run)


class _MetadataCheck(pickle.Unpickler):
    """DCP reads .metadata with pickle.load: read it first with only what DCP writes there (its dataclasses and enums,
    torch.Size, dtypes, layouts, the checkpoint's path), so a planted one is refused before DCP runs it."""

    def find_class(self, module: str, name: str):
        obj = super().find_class(module, name) if module.split(".")[0] in ("torch", "pathlib") else None
        dcp_type = module.startswith("torch.distributed.checkpoint") and getattr(obj, "__module__", "") == module
        ok = dcp_type and (dataclasses.is_dataclass(obj) or isinstance(obj, enum.EnumMeta))
        ok = ok or isinstance(obj, torch.dtype) or f"{module}.{name}" in METADATA_GLOBALS
        if not ok:
            raise _Refused(f"{module}.{name}")
        return obj


class _Refused(pickle.UnpicklingError):
    pass


METADATA_GLOBALS = ("torch.Size", "torch.serialization._get_layout", "pathlib.PosixPath", "pathlib.PurePosixPath")


def _check_metadata(path: Path, run: Path) -> None:
    try:
        with path.open("rb") as f:
            _MetadataCheck(f).load()
    except _Refused as e:
        usage_error(f"--resume {run}: {path} is refused: loading it would import {e}, not a sharded checkpoint's index "
                    "(unpickling a file made or changed elsewhere can run code)")  # fmt: skip
    except Exception as e:  # truncated, empty, not a pickle
        usage_error(f"--resume {run}: {path} cannot be read ({type(e).__name__})")


def _weights_only_planner():
    """DCP's load planner, with each non-tensor value (AdamW's hyperparameters) read by torch.load(weights_only=True)
    before DCP's own torch.load(weights_only=False) reads the same bytes: a value that names code is refused."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                if "Weights only load failed" not in str(e):
                    raise
                raise _Refused(".".join(map(str, read_item.dest_index.fqn.split(".")[:4]))) from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return WeightsOnly()


def restore_full(model, optimizer, weights: dict, optim: dict, run: Path) -> None:
    """A DDP or one-process checkpoint (full weights, AdamW's index-keyed state) into an FSDP run: each rank keeps
    its shard of both."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, strict=False)
    names = [n for n, _ in model.named_parameters()]  # the optimizer was built from model.parameters(), in order
    if len(names) != sum(len(g["params"]) for g in optim["param_groups"]):
        usage_error(f"--resume {run}: the checkpoint's optimizer does not fit the model: was it another --model?")
    optim = {  # index-keyed, as optimizer.state_dict() writes it, to parameter names, as DCP's full state dict is
        "state": {names[i]: v for i, v in optim["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]],
    }
    missing, unexpected = set_model_state_dict(model, weights, options=full)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if [k for k in missing if k not in tied] or unexpected:
        usage_error(f"--resume {run}: the checkpoint does not fit the model (missing {list(missing)[:3]}, "
                    f"unexpected {list(unexpected)[:3]}): was the run started with another --model?")  # fmt: skip
    set_optimizer_state_dict(model, optimizer, optim, options=full)

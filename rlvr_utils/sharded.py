"""Sharded checkpoints under --fsdp: torch.distributed.checkpoint (DCP) writes every rank's shards of the policy and
of the optimizer state at once, and reshards them on load onto any number of ranks, with or without FSDP. The rest of
a checkpoint (step, random streams, data position, method state) and its atomic replacement are checkpoints.py's.
See docs/scaling.md ("Checkpoints across world sizes").
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlvr_utils.runtime import usage_error


def save(ckpt, step: int, model, optimizer, state: dict, states: list) -> Path:
    """`ckpt` (a checkpoints.Checkpointer under FSDP, which calls this): every rank writes its shards into the same
    temporary copy (sharded/), rank 0 the rest (trainer.pt without the optimizer; the ranks' random streams `states`);
    the copy becomes the checkpoint by one rename once every rank's shards are on disk. Non-finite weights on any rank:
    none. What a copy is and holds besides the shards is the Checkpointer's (this module does not import it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist, main = ckpt.dist, ckpt.rank == 0
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    if dist.sum([float(not all(torch.isfinite(p).all() for p in local))])[0] > 0:
        raise ValueError("refusing to save a checkpoint with non-finite weights")
    ctx = ckpt.new_copy() if main else None
    if main:
        ckpt.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(dist.broadcast(str(ctx.__enter__()) if main else None))  # one temporary copy, named by rank 0
    try:
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp / "sharded"))  # every rank: its shards
        dist.barrier()
        if main:
            ckpt.write_state(tmp, step, {**state, "sharded": True}, states, world=dist.world)
    except BaseException as e:
        if main:
            ctx.__exit__(type(e), e, None)  # the temporary copy goes; the previous checkpoint stays
        raise
    if main:
        ctx.__exit__(None, None, None)
        ckpt.clean_leftovers()
    dist.barrier()
    return ckpt.path


def restore(path: Path, model, optimizer, run: Path) -> None:
    """Load a sharded checkpoint's policy and optimizer state into this run's layout (FSDP on any number of ranks,
    DDP, or one process): DCP reads each rank's part from whichever shards hold it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)  # this run's layout (DCP sets up AdamW's state with one 0-lr step)
    state = {"model": msd, "optimizer": osd}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # a missing or damaged shard, or another model's checkpoint
        reason = str(e).splitlines()[0][:200] if str(e) else "empty"
        usage_error(f"--resume {run}: {path} cannot be read ({type(e).__name__}: {reason})")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


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

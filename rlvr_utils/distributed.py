"""Several processes (torchrun): one per GPU (gloo on CPU), prompts sharded by rank, DDP or FSDP2.

Without torchrun every script runs in a world of 1 and every method of `Dist` is a no-op. See docs/scaling.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from pathlib import Path
from typing import Sequence

import torch

from rlvr_utils import checkpoints, cli


@dataclasses.dataclass
class Dist:
    """This process's place in a torchrun job; world 1 (every method a no-op) without torchrun.

    `--prompts-per-step` is the global batch: each rank takes every world-th prompt of it with all of
    its G completions, so groups never span ranks and each algorithm's credit assignment runs locally.
    Losses are normalized by the global token / sequence counts (`loss_counts`), so W ranks with half
    the batch each step exactly like 1 rank with all of it."""

    rank: int = 0
    world: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))  # for collectives
    fsdp: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t.tolist()

    def shard(self, examples: Sequence) -> list:
        """This rank's prompts of a global batch (every world-th one)."""
        return list(examples[self.rank :: self.world])

    def loss_counts(self, mask: torch.Tensor, num_seqs: int | None = None) -> tuple[float, float]:
        """(tokens, sequences) to normalize this rank's loss by: the global counts / world, because DDP
        and FSDP average gradients over ranks."""
        tokens, seqs = self.sum([mask.sum().item(), len(mask) if num_seqs is None else num_seqs])
        return tokens / self.world, seqs / self.world

    def wrap(self, model, ref_model=None):
        """The module to run the loss forward through: DDP by default, FSDP2 `fully_shard` (each
        decoder layer, then the root; the reference too) with `fsdp`. Generation and saving use `model`."""
        if self.world == 1:
            return model
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            for m in (model, ref_model) if ref_model is not None else (model,):
                for layer in getattr(getattr(m, "model", m), "layers", []):
                    fully_shard(layer)
                fully_shard(m)
            model._rlvr_synced_gpus = True  # generate() must keep every rank stepping until all are done
            return model
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None
        )

    def sync_grads(self, train_model, enabled: bool) -> None:
        """Whether the next backward all-reduces gradients: only the last micro-batch of a pass does, so
        ranks with different numbers of micro-batches (SRPO) still meet once per optimizer step."""
        if self.world == 1:
            return
        if self.fsdp:
            train_model.set_requires_gradient_sync(enabled)
        else:
            train_model.require_backward_grad_sync = enabled

    def reduce_metrics(
        self, metrics: dict, sum_keys: Sequence[str] = ("num_tokens", "tokens_per_second", "sampling/generated_tokens")
    ) -> dict:
        """Mean over the ranks that report each metric (`sum_keys`: sum over ranks)."""
        if self.world == 1:
            return metrics
        gathered = [None] * self.world
        torch.distributed.all_gather_object(gathered, {k: float(v) for k, v in metrics.items()})
        out = {}
        for k in dict.fromkeys(k for g in gathered for k in g):
            vals = [g[k] for g in gathered if k in g]
            out[k] = sum(vals) if k in sum_keys else sum(vals) / len(vals)
        return out

    def save(self, model, tokenizer, path) -> Path | None:
        """`save_model_atomic` on rank 0 (FSDP: the full state dict is gathered from every rank first)."""
        state = None
        if self.world > 1 and self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out = checkpoints.save_model_atomic(model, tokenizer, path, state) if self.main else None
        self.barrier()
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (a picklable object; world 1: `obj` itself)."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def print(self, *a, **k) -> None:
        """print on rank 0 only"""
        if self.main:
            print(*a, **k)

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        """Every rank reaches the same barrier before the process group goes: a rank that tears it down while another
        still talks to it aborts (SIGABRT, "terminate called without an active exception") and fails the job."""
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def pick_device(device: str = "auto") -> torch.device:
    """auto: cuda when available, else cpu; otherwise the device named."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def init_distributed(
    device: str, args: dict, prompts_per_step: int, timeout_s: int = 1800, fsdp: bool = False
) -> tuple[Dist, torch.device]:
    """Join the torchrun job when there is one (WORLD_SIZE > 1), else a world of 1. Checks that every
    rank got the same flags and that the world size divides `prompts_per_step`. Collectives time out
    after `timeout_s`, so a rank that died makes the others exit with an error instead of hanging."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = pick_device(device)
    if world == 1:
        return Dist(device=dev), dev
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        if local >= torch.cuda.device_count():
            cli.usage_error(
                f"torchrun rank {rank} asks for cuda:{local}, but {torch.cuda.device_count()} GPU(s) are visible: "
                f"start at most that many ranks per node (--nproc_per_node), or use --device cpu (gloo)"
            )
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    torch.distributed.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
    )
    d = Dist(rank, world, dev if dev.type == "cuda" else torch.device("cpu"), fsdp)
    flags = [None] * world
    torch.distributed.all_gather_object(flags, {k: str(v) for k, v in args.items()})
    diff = sorted(k for f in flags for k in set(f) | set(flags[0]) if f.get(k) != flags[0].get(k))
    if diff:
        d.close()
        raise ValueError(
            f"ranks were started with different flags: {sorted(set(diff))} (rank 0 has "
            f"{ {k: flags[0].get(k) for k in sorted(set(diff))} })"
        )
    if prompts_per_step % world:
        d.close()
        raise ValueError(
            f"--prompts-per-step {prompts_per_step} is the global batch: it must be divisible by the "
            f"world size {world} (each rank takes whole groups)"
        )
    return d, dev

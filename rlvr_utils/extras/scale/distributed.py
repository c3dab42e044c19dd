"""Several processes (torchrun): one per GPU (gloo on CPU), prompts sharded by rank, DDP or FSDP2. An extra: loaded
by runtime.init_distributed when WORLD_SIZE > 1 (without torchrun every script runs in runtime.Dist's world of 1).
See docs/scaling.md.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import sys
from typing import Sequence

import torch

from rlvr_utils.core.logprob_kernels import ROWS_PER_FORWARD
from rlvr_utils.core.runtime import TORCHRUN, Dist, extra, need, pick_device, usage_error


def check_env(world: int) -> None:
    """With WORLD_SIZE > 1 (runtime.world_size), the RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT torchrun sets beside
    it, each as torchrun would have set it: one line naming the first that is not, exit code 2 (cli.check_common)."""
    env = os.environ
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        need(bool(env.get(name, "").strip()), f"WORLD_SIZE={world} is set without {name}: {TORCHRUN}")
        ok = name.endswith("ADDR") or env[name].strip().isascii() and env[name].strip().isdigit()
        need(ok and (not name.endswith("RANK") or int(env[name]) < world), f"{name}={env[name]!r} with "
             f"WORLD_SIZE={world}: not what torchrun sets; {TORCHRUN}")  # fmt: skip


class TorchrunDist(Dist):
    """This process's place in a torchrun job (WORLD_SIZE > 1): the collectives of runtime.Dist's methods.

    `--prompts-per-step` is the global batch: each rank takes every world-th prompt of it with all of its G completions,
    so groups never span ranks; what a method defines over "the batch" (a std, a quantile) is taken over every rank's
    rows (`over_global_batch`). Losses are normalized by the global token / sequence counts (`loss_counts`), so W ranks
    with half the batch each step exactly like 1 rank with all of it."""

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return t.tolist()

    def over_global_batch(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) over the global batch, for what a method defines over "the batch" (a quantile, a std):
        every tensor argument with this rank's row count n as its first dimension is gathered from every rank (rank
        order; 2-D ones right-padded with 0 to the widest), fn runs on the whole batch on every rank, and each tensor
        of its result (also inside a tuple or dict) with the global row count as its first dimension comes back as
        this rank's rows (2-D ones trimmed to this rank's width). Row order does not matter to per-group statistics,
        so the rows get what one process with the whole batch gives them. A result that is not per row must not have
        the global row count as its first dimension (EP-GRPO's per-cell counts are [groups, windows])."""
        n = next(a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)).shape[0]
        rowwise = lambda a: isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == n  # noqa: E731
        widths = [a.shape[1] for a in [*args, *kwargs.values()] if rowwise(a) and a.dim() == 2]
        width = max(widths) if widths else None  # this rank's T: 2-D results are trimmed back to it
        keys = [i for i, a in enumerate(args) if rowwise(a)] + [k for k, a in kwargs.items() if rowwise(a)]
        mine = [(args[k] if isinstance(k, int) else kwargs[k]).detach().cpu() for k in keys]
        everyone = [None] * self.world
        torch.distributed.all_gather_object(everyone, (n, mine))
        start, total = sum(e[0] for e in everyone[: self.rank]), sum(e[0] for e in everyone)
        args, kwargs = list(args), dict(kwargs)
        for j, k in enumerate(keys):
            parts = [e[1][j] for e in everyone]
            if parts[0].dim() == 2:
                w = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, w - p.shape[1])) for p in parts]
            whole = torch.cat(parts).to((args[k] if isinstance(k, int) else kwargs[k]).device)
            if isinstance(k, int):
                args[k] = whole
            else:
                kwargs[k] = whole

        def own(x):
            if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == total:
                x = x[start : start + n]
                return x[:, :width] if x.dim() == 2 and width is not None else x
            if isinstance(x, tuple):
                return tuple(own(v) for v in x)
            if isinstance(x, dict):
                return {k: own(v) for k, v in x.items()}
            return x

        return own(fn(*args, **kwargs))

    def wrap(self, model, ref_model=None):
        """The module to run the loss forward through: DDP by default, FSDP2 `fully_shard` (each
        decoder layer, then the root; the reference too) with `fsdp`. Generation and saving use `model`.
        Mixed precision (`mixed`, the weights loaded in fp32): under FSDP the fp32 shards are the masters and
        MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) gathers bf16 copies to compute with and reduces the
        gradients in fp32; without it no DDP module (DDP reduces in the weights' dtype): the model computes on bf16
        copies (precision.py) and `micro_batches` all-reduces the fp32 gradients."""
        if self.fsdp:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=self.mixed, reduce_dtype=torch.float32) if self.mixed else None
            for m in (model, ref_model) if ref_model is not None else (model,):
                how = dict(mp_policy=policy) if policy is not None and m is model else {}  # the reference: bf16
                for layer in getattr(getattr(m, "model", m), "layers", []):
                    fully_shard(layer, **how)
                fully_shard(m, **how)
            model._rlvr_gathered = self.gathered  # generation runs on the gathered weights (no collective per token)
            return model
        if self.mixed is not None:  # every rank starts from rank 0's weights, as DDP's own broadcast makes them
            for t in [*model.parameters(), *model.buffers()]:
                torch.distributed.broadcast(t.data, src=0)
            extra("precision", "--dtype bfloat16 (mixed precision)").MixedPrecision(model, self.mixed)
            return model
        # broadcast_buffers off: a causal LM's buffers are constants (rotary frequencies), and the broadcast is a
        # collective in every forward, so ranks running different numbers of forwards (SC-GRPO's teacher) would hang
        ddp = torch.nn.parallel.DistributedDataParallel
        sync = (
            "forward_sync_buffers"
            if "forward_sync_buffers" in inspect.signature(ddp).parameters
            else "broadcast_buffers"
        )
        return ddp(model, device_ids=[self.device.index] if self.device.type == "cuda" else None, **{sync: False})

    @contextlib.contextmanager
    def gathered(self, *models):
        """FSDP: the full weights of `models` on every rank for the block (one all-gather per sharded module on entry,
        on every rank), so ranks may run different numbers of forwards inside it (generation, SRPO's sampling rounds,
        the no-gradient passes): no collective runs there. No gradient may be taken inside. Reentrant; under DDP a
        no-op. Costs one unsharded copy of each model per GPU for the block, as a colocated vLLM engine does."""
        from torch.distributed.fsdp import FSDPModule

        mods = [m for model in models if model is not None for m in model.modules() if isinstance(m, FSDPModule)]
        if not self.fsdp or getattr(self, "_gathered", False) or not mods:
            yield
            return
        self._gathered = True
        try:
            for m in mods:  # roots first (model.modules() order): a root's lazy init must precede its layers' unshard
                m.set_reshard_after_forward(False, recurse=False)
                m.unshard()
            yield
        finally:
            self._gathered = False
            for m in mods:
                m.reshard()
                is_root = any(
                    m is model for model in models
                )  # FSDP's default: the root keeps its weights after forward
                m.set_reshard_after_forward(not is_root, recurse=False)

    def same_count(self, n: int) -> int:
        """FSDP: the largest `n` over ranks (every rank must run as many forwards and backwards: the ranks with
        fewer run idle passes, see `idle_pass`); DDP: `n` (each rank's all-reduce meets once per step)."""
        if not self.fsdp:
            return n
        t = torch.tensor([n], dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def idle_forward(self, busy: bool, forward) -> None:
        """FSDP: an optional forward (SC-GRPO's teacher) runs on every rank when it runs on any: where this rank has
        none (`busy` False) and another has one, `forward()` here, under no_grad, its output discarded."""
        if self.fsdp and self.sum([float(busy)])[0] > 0 and not busy:  # the collective on every rank
            with torch.no_grad():
                forward()

    def micro_batches(self, train_model, micro: list):
        """Each micro-batch in turn; only the last one's backward all-reduces, so ranks with different numbers of
        micro-batches still meet once per optimizer step. FSDP with `uneven` rows (SRPO's): micro-batches of at most
        ROWS_PER_FORWARD rows (one forward each), as many on every rank as on the rank with most, the missing ones
        idle passes."""
        if self.fsdp and self.uneven and any(len(m) > ROWS_PER_FORWARD for m in micro):
            micro = list(torch.cat(micro).split(ROWS_PER_FORWARD))
        n = self.same_count(len(micro))
        for k in range(n):
            self.sync_grads(train_model, k == n - 1)  # all-reduce once per optimizer step
            if k < len(micro):
                yield micro[k]
            else:  # FSDP: an idle pass keeps the collectives matched
                self.idle_pass(train_model)
        if (mixed := getattr(train_model, "_rlvr_precision", None)) is not None:  # no DDP: the fp32 gradients here
            mixed.gradients_ready()
            grads = [p.grad for p in mixed.params if p.grad is not None]
            for work in [torch.distributed.all_reduce(g, async_op=True) for g in grads]:
                work.wait()
            for g in grads:
                g.div_(self.world)  # the mean over ranks, as DDP's

    def idle_pass(self, train_model) -> None:
        """A forward and backward that changes nothing (its loss times 0), on a dummy row of two tokens through the
        whole model (every parameter, the lm_head's too, gets a zero gradient): keeps this rank's FSDP collectives
        matched with a rank that has one more micro-batch."""
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        logits = train_model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        (logits.float().sum() * 0.0).backward()

    def sync_grads(self, train_model, enabled: bool) -> None:
        """Whether the next backward all-reduces gradients: only the last micro-batch of a pass does, so
        ranks with different numbers of micro-batches (SRPO) still meet once per optimizer step."""
        if self.fsdp:
            train_model.set_requires_gradient_sync(enabled)
        elif self.mixed is None:  # DDP (mixed precision has none: micro_batches reduces)
            train_model.require_backward_grad_sync = enabled

    def reduce_metrics(
        self, metrics: dict, sum_keys: Sequence[str] = ("num_tokens", "tokens_per_second", "sampling/generated_tokens")
    ) -> dict:
        """Mean over the ranks that report each metric (`sum_keys`: sum over ranks)."""
        gathered = [None] * self.world
        torch.distributed.all_gather_object(gathered, {k: float(v) for k, v in metrics.items()})
        out = {}
        for k in dict.fromkeys(k for g in gathered for k in g):
            vals = [g[k] for g in gathered if k in g]
            out[k] = sum(vals) if k in sum_keys else sum(vals) / len(vals)
        return out

    def full_state_dict(self, model) -> dict | None:
        """FSDP: the full weights gathered from every rank (to CPU) for --save-model; DDP: None, the model's own."""
        if not self.fsdp:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (a picklable object)."""
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        torch.distributed.barrier()

    def close(self, then_exit: bool = False, code: int = 0) -> None:
        """Every rank reaches the same barrier before the process group goes: a rank that tears it down while another
        still talks to it aborts (SIGABRT, "terminate called without an active exception") and fails the job.
        `then_exit` (the end of a run, or a stop on SIGTERM): under torchrun the process then exits (`code`) at once,
        without the interpreter's teardown, where objects still holding the process group (DDP's reducer) are
        destroyed with gloo's threads and aborted about 1 run in 60 (benchmarks/torchrun_exits.py). Logs are closed
        and flushed before."""
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
            if then_exit:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)


def init_torchrun(
    device: str, args: dict, prompts_per_step: int, timeout_s: int = 1800, fsdp: bool = False
) -> tuple[TorchrunDist, torch.device]:
    """Join the torchrun job (WORLD_SIZE > 1). Checks that every rank got the same flags and that the world size
    divides `prompts_per_step`. Collectives time out after `timeout_s`, so a rank that died makes the others exit
    with an error instead of hanging."""
    world = int(os.environ["WORLD_SIZE"])
    dev = pick_device(device)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        if local >= torch.cuda.device_count():
            usage_error(
                f"torchrun rank {rank} asks for cuda:{local}, but {torch.cuda.device_count()} GPU(s) are visible: "
                f"start at most that many ranks per node (--nproc_per_node), or use --device cpu (gloo)"
            )
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    torch.distributed.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
    )
    d = TorchrunDist(rank, world, dev if dev.type == "cuda" else torch.device("cpu"), fsdp)
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

"""Mixed precision, an extra (loaded where --dtype bfloat16 is handled; --dtype auto is bfloat16 on a GPU): fp32 master
weights and fp32 AdamW state under bf16 compute, as TRL (fp32 weights under bf16 autocast) and FSDP2's
MixedPrecisionPolicy (fp32 sharded parameters, bf16 copies to compute with) keep them. bf16 holds 8 significant bits:
an update below about |w| * 2**-9 rounds away, so AdamW on bf16 weights at --learning-rate 1e-6 leaves almost all of
them as they were (docs/scaling.md: Precision, with the measurements).

  MixedPrecision  each trained weight's two storages; its Parameter holds one of them at a time:
                  - its bf16 compute copy, for every forward and backward (the update, the old and reference log-probs,
                    SC-GRPO's teacher), generation (the static decoder, generate) and vLLM's weight sync. Each
                    micro-batch's bf16 gradient is added into an fp32 one as the backward makes it, then freed;
                  - its fp32 master, from the last micro-batch's backward to the end of the optimizer step
                    (`gradients_ready`, from Dist.micro_batches: the clip and AdamW see fp32 weights and gradients, so
                    AdamW's state is fp32), and while a checkpoint or the model is written or read (`masters()`).
                  After each optimizer step the compute copies are the masters rounded to nearest, written in place (a
                  CUDA graph of the decoder keeps their addresses). Under torchrun the fp32 gradients are all-reduced
                  (distributed.py; DDP would reduce bf16 buckets); --fsdp keeps fp32 shards and FSDP2's
                  MixedPrecisionPolicy makes the bf16 copies (no MixedPrecision object then).
  check           the bf16 flags, before anything loads: this CPU's bf16 kernels, --pure-bf16, --save-dtype
  kahan_adamw     --pure-bf16 kahan: optimi's AdamW on the bf16 weights themselves, with Kahan summation

Why bf16 copies and not autocast over the fp32 weights (TRL's way): the copies compute exactly what a bf16 model does
(the sampler's weights are the trainer's, every no-gradient pass is plain bf16), without a cast per forward, and on
this project's CPU the step measured at least as fast (docs/scaling.md: Precision).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch

from rlvr_utils.core.models import compute_dtype
from rlvr_utils.core.runtime import need, pick_device


class MixedPrecision:
    """fp32 masters of `model`'s fp32 parameters, whose Parameters are made to hold bf16 (`dtype`) copies of them (one
    process, or DDP's ranks). The object is `model._rlvr_precision`: Dist.micro_batches calls `gradients_ready`,
    common.Run.start `attach`, checkpoints and --save-model take `masters()`. Memory: 4 bytes per parameter for the
    master, 2 for the copy, 4 for the fp32 gradient (from the first backward of a step to its end) and 8 for AdamW's
    fp32 moments: 18, against 8 for bf16 weights under a plain AdamW (--pure-bf16 plain)."""

    def __init__(self, model, dtype: torch.dtype = torch.bfloat16):
        self.dtype, self.params, self.fp32, self.copies = dtype, [], [], []
        self.grads: dict[int, torch.Tensor] = {}  # id(param) -> its fp32 gradient, summed over the micro-batches
        self.stepping, self.held = False, 0  # from gradients_ready to the step's end; masters() blocks open
        for p in model.parameters():
            if p.dtype != torch.float32:
                continue
            self.params.append(p)
            self.fp32.append(p.data)
            self.copies.append(p.data.to(dtype))
            p.data = self.copies[-1]
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulate)
        model._rlvr_precision = self

    def _accumulate(self, p) -> None:
        """A bf16 gradient the backward has just made, into the fp32 sum of the step; the bf16 one freed."""
        total = self.grads.get(id(p))
        if total is None:
            self.grads[id(p)] = p.grad.float()
        else:
            total.add_(p.grad)
        p.grad = None

    def _hold_masters(self) -> None:
        for p, master in zip(self.params, self.fp32):
            p.data = master

    def _hold_copies(self) -> None:
        """The compute copies refreshed from the masters (rounded to nearest, in place) and in the Parameters."""
        with torch.no_grad():
            for p, master, copy in zip(self.params, self.fp32, self.copies):
                p.grad = None
                copy.copy_(master)
                p.data = copy

    def gradients_ready(self) -> None:
        """After the last micro-batch's backward: each Parameter holds its fp32 master, with the fp32 gradient summed
        over the micro-batches (the clip and the optimizer step read them)."""
        self._hold_masters()
        for p in self.params:
            p.grad = self.grads.pop(id(p), None)
        self.stepping = True

    def after_step(self, *_) -> None:
        """After the optimizer step: the gradients freed and the compute copies refreshed and held again, unless a
        masters() block is open (torch.distributed.checkpoint's set-up steps inside one): then when it closes."""
        self.stepping = False
        if self.held:
            for p in self.params:
                p.grad = None
        else:
            self._hold_copies()

    def _before_step(self, optimizer, *_) -> None:
        if not (self.stepping or self.held):
            raise RuntimeError(
                "mixed precision: optimizer.step() before the fp32 gradients were made ready: a loop of its own calls "
                "model._rlvr_precision.gradients_ready() after its last backward (Dist.micro_batches does)"
            )

    def attach(self, optimizer) -> None:
        """Refresh the compute copies after every step of `optimizer` (built over the model's Parameters): registered
        before vLLM's sync hook (common.Run.start), so the engine loads the new copies."""
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self.after_step)

    def upcast_note(self, weights: dict, run) -> None:
        upcast_note({v.dtype for v in weights.values()}, run)

    @contextlib.contextmanager
    def masters(self):
        """The fp32 masters in the Parameters for the block (a checkpoint written or read, the model saved, EP-GRPO's
        moving anchor following the policy); then the compute copies again, refreshed from them (a resume has
        loaded new ones). Reentrant; inside a step (between gradients_ready and its end) the masters stay."""
        outer = not (self.held or self.stepping)
        if outer:
            self._hold_masters()
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            if outer:
                self._hold_copies()


def upcast_note(dtypes, run) -> None:
    """--resume of a mixed-precision run from a checkpoint whose weights are bf16 (written before this project kept fp32
    masters; `dtypes`: its weights'): one line saying that they, and the AdamW state, are upcast into the masters."""
    low = sorted({str(d).removeprefix("torch.") for d in dtypes if d != torch.float32})
    if low and os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 says it
        print(f"note: --resume {run}: the checkpoint's weights are {', '.join(low)} (written before fp32 master "
              "weights): upcast to the float32 masters, its AdamW state with them", file=sys.stderr)  # fmt: skip


def cpu_bf16() -> bool:
    """Whether torch runs bf16 on this CPU in oneDNN's bf16 kernels (x86: AVX-512; arm: its bf16 instructions), rather
    than in its generic fallback."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported()) if supported is not None else torch.backends.cpu.get_cpu_capability() == "AVX512"


def check(a: dict) -> None:
    """--dtype bfloat16 on this CPU, --pure-bf16 and --save-dtype, before anything loads (cli.check_common): one line
    naming the flags."""
    device = pick_device(a["device"])
    no_bf16 = "this CPU has no bf16 kernels in torch (oneDNN's need AVX-512, or an ARM CPU's bf16 instructions)"
    ok = a["dtype"] != "bfloat16" or device.type == "cuda" or cpu_bf16()
    need(ok, f"--dtype bfloat16 --device {a['device']}: {no_bf16}: use --dtype float32, or a GPU")
    pure, float32 = a["pure_bf16"], compute_dtype(a["dtype"], device) == torch.float32
    what = f"--pure-bf16 {pure} trains bf16 weights: it needs --dtype bfloat16"
    need(pure == "off" or not float32, f"{what} (--dtype {a['dtype']} computes in float32 here)")
    lora = "the adapters train in fp32 (PEFT) over the frozen bf16 base"
    need(pure == "off" or not a["lora_rank"], f"{what} in full fine-tuning: under --lora-rank {lora}")
    optimi = "--pure-bf16 kahan uses optimi's AdamW, which is not installed: pip install torch-optimi"
    need(pure != "kahan" or importlib.util.find_spec("optimi") is not None, f"{optimi} (or --pure-bf16 plain)")
    save, what = a["save_dtype"], "the dtype of the saved model"
    need(save == "auto" or a["save_model"], f"--save-dtype {save} needs --save-model ({what})")
    need(save == "auto" or not a["save_adapter"], f"--save-dtype {save}: --save-adapter saves the adapter as trained")


def kahan_adamw(params, args):
    """--pure-bf16 kahan: optimi's AdamW over the bf16 weights with Kahan summation (a bf16 compensation buffer per
    weight carries what the rounding of each update lost into the next), with torch's AdamW defaults (betas 0.9,
    0.999, eps 1e-8; optimi's own are 0.9, 0.99 and 1e-6) and --learning-rate, --weight-decay (decoupled, as torch's).
    optimi: https://optimi.benjaminwarner.dev (pip install torch-optimi)."""
    import optimi

    lr, decay = args.learning_rate, args.weight_decay
    return optimi.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=decay, kahan_sum=True)

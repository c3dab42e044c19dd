"""Benchmark: one update step (token log-probs forward and backward over micro-batches, the clip, AdamW) and one
generation (the static decoder) under the ways to train with bf16 compute, side by side in one process, rounds
alternating the variants:

  bf16 weights       AdamW on the bf16 weights themselves (the code before mixed precision; --pure-bf16 plain)
  bf16 copies        fp32 masters, the model computing on bf16 copies of them (rlvr_utils/extras/scale/precision.py:
                     what --dtype bfloat16 runs)
  fp32 + autocast    fp32 weights, every forward under torch.autocast(bf16) (TRL's way); the fused lm_head kernel gets
                     its hidden states and weight cast to bf16, as an autocast-aware kernel would
  fp32               float32 throughout (--dtype float32, the CPU default)

on a random-init Qwen2 of the bundled model's shape (--shape tiny) or a wider one at the real vocabulary (--shape
wide: hidden 256, 4 layers, 151,936 tokens), --rows sequences of --prompt + --completion tokens, --micro micro-batches;
generation: --rows prompts, --completion new tokens each (sampled, no stop token). Times are this process's CPU seconds
(one thread: what the step computes, and little of what other processes on the machine do) and wall seconds. Prints a
markdown table (medians, x bf16 weights); writes benchmarks/out/precision_speed_<shape>.json.

    python benchmarks/precision_speed.py --shape tiny
    python benchmarks/precision_speed.py --shape wide --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from rlvr_utils.core import logprob_kernels, models, rollouts  # noqa: E402
from rlvr_utils.extras.scale import precision  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, vocab_size=99),
    "wide": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, vocab_size=151936),
}
BF16 = torch.bfloat16
_fused = logprob_kernels.FusedLinearLogProb.apply


def fused_under_autocast(hidden, weight, bias, *rest):
    """The fused kernel as an autocast run would call it: bf16 inputs (its own matmuls are outside autocast)."""
    if torch.is_autocast_enabled("cpu"):
        hidden, weight = hidden.to(BF16), weight.to(BF16)
        bias = bias.to(BF16) if bias is not None else None
    return _fused(hidden, weight, bias, *rest)


def make(variant: str, base):
    """(model, optimizer, the forward's context) of one variant."""
    model = copy.deepcopy(base)
    if variant == "bf16 weights":
        models.cast_weights(model, BF16)
    elif variant == "bf16 copies":
        precision.MixedPrecision(model, BF16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    if variant == "bf16 copies":
        model._rlvr_precision.attach(optimizer)
    autocast = variant == "fp32 + autocast"
    return model, optimizer, (lambda: torch.autocast("cpu", dtype=BF16)) if autocast else contextlib.nullcontext


def step(model, optimizer, forward, batches, T: int) -> float:
    optimizer.zero_grad(set_to_none=True)
    for ids in batches:
        with forward():
            logp, _ = common.token_logprobs(model, ids, torch.ones_like(ids), T)
        (-logp.mean() / len(batches)).backward()
    if (mixed := getattr(model, "_rlvr_precision", None)) is not None:
        mixed.gradients_ready()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def generate(model, prompts, new_tokens: int) -> None:
    """The static decoder's sampling, as a rollout runs it (fp32 + autocast: generation would read a bf16 copy)."""
    torch.manual_seed(0)
    mask = torch.ones_like(prompts)
    rollouts.StaticDecoder(model).generate(prompts, mask, new_tokens, 1.0, 1.0, 0, True, [-1], 0)


def timed(fn, *args) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of fn(*args)."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn(*args)
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--completion", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = SHAPES[a.shape]
    base = Qwen2ForCausalLM(Qwen2Config(**shape, num_key_value_heads=4, tie_word_embeddings=True)).eval()
    logprob_kernels.FusedLinearLogProb.apply = fused_under_autocast
    ids = torch.randint(1, shape["vocab_size"], (a.rows, a.prompt + a.completion), generator=torch.Generator())
    batches = list(ids.split(-(-a.rows // a.micro)))
    variants = {v: make(v, base) for v in ("bf16 weights", "bf16 copies", "fp32 + autocast", "fp32")}
    prompts = ids[:, : a.prompt]
    times = {v: {"step": [], "generation": []} for v in variants}
    for r in range(a.rounds + 1):  # round 0 warms every variant up and is dropped
        for v in list(variants) if r % 2 == 0 else list(reversed(variants)):
            s = timed(step, *variants[v], batches, a.completion)
            g = timed(generate, variants[v][0], prompts, a.completion) if v != "fp32 + autocast" else None
            if r:
                times[v]["step"].append(s)
                times[v]["generation"].append(g)
    med = {v: {k: [statistics.median(x[i] for x in t[k]) if t[k][0] else None for i in (0, 1)] for k in t}
           for v, t in times.items()}  # fmt: skip
    ms = 1e3 / (a.rows * a.completion)  # generation: ms per generated token
    ref = med["bf16 weights"]
    lines = ["| variant | update step, CPU s | × | wall s | generation, CPU ms/token | × | wall ms/token |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for v, m in med.items():
        (sc, sw), (gc, gw) = m["step"], m["generation"]
        gen = f"{gc * ms:.3f} | {gc / ref['generation'][0]:.2f} | {gw * ms:.3f}" if gc else "(a bf16 copy's) | | "
        lines.append(f"| {v} | {sc:.3f} | {sc / ref['step'][0]:.2f} | {sw:.3f} | {gen} |")
    print("\n".join(lines))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    params = sum(p.numel() for p in base.parameters())
    result = dict(vars(a), params=params, machine=f"{platform.machine()}, torch {torch.__version__}", seconds=times)
    (out / f"precision_speed_{a.shape}.json").write_text(json.dumps(result | {"median": med, "table": lines}, indent=1))


if __name__ == "__main__":
    main()

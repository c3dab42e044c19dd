"""Peak memory and time of per-token log-probs, forward + backward: common.token_logprobs against a naive
full log_softmax + gather, and against a selective log-softmax in the style TRL uses (gather minus a
row-by-row logsumexp over the full logits).

A random-weight model with Qwen2.5-0.5B's real config (vocab 151,936, width 896), cut to --layers
decoder layers (the log-prob path is the lm_head and what follows it; layers only add activations
common to all three). Only the final norm's weight requires a gradient, so the backward runs through
the lm_head and the log-prob path without the [V, H] embedding gradient every method shares. Each
(method, B, T) runs in a fresh subprocess. Peak memory: CUDA's max_memory_allocated on a GPU; on CPU the
process's peak RSS (Linux VmHWM, reset before the measurement through /proc/self/clear_refs) minus its RSS
just before. Prompt length --prompt 128.

    python benchmarks/logprob_memory.py                       # CPU, sizes (2,256) (4,512) (4,1024)
    python benchmarks/logprob_memory.py --device cuda --sizes 4x512 8x1024 16x2048
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def hwm_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(method: str, B: int, T: int, prompt: int, layers: int, device: str) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT))
    import common

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **QWEN25_05B)).to(device=device, dtype=dtype)
    # gradients flow through the lm_head into the hidden states (to the final norm's weight), but the
    # [V, H] embedding gradient, which is the same for every method, is not computed
    model.requires_grad_(False)
    model.model.norm.weight.requires_grad_(True)
    L = prompt + T
    ids = torch.randint(0, QWEN25_05B["vocab_size"], (B, L), device=device)
    mask = torch.ones_like(ids)

    def run():
        if method == "ours":
            logp = common.token_logprobs(model, ids, mask, T)[0]
        else:
            logits = (
                model(input_ids=ids, attention_mask=mask).logits[:, -T - 1 : -1].float()
            )  # every position, then sliced
            target = ids[:, -T:]
            if method == "naive":
                logp = torch.log_softmax(logits, -1).gather(-1, target[..., None]).squeeze(-1)
            else:  # selective: gather, minus a logsumexp computed one row at a time
                picked = logits.gather(-1, target[..., None]).squeeze(-1)
                logp = picked - torch.stack([torch.logsumexp(row, -1) for row in logits])
        logp.sum().backward()

    run()  # warm-up (allocator, kernels)
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        import gc

        gc.collect()
        base = rss_mb()
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM := current RSS
    t0 = time.perf_counter()
    run()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else hwm_mb() - base
    return dict(
        method=method,
        B=B,
        T=T,
        prompt=prompt,
        layers=layers,
        device=device,
        peak_mb=round(peak, 1),
        seconds=round(seconds, 3),
        logits_mb_fp32=round(B * T * QWEN25_05B["vocab_size"] * 4 / 2**20, 1),
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["2x256", "4x512", "4x1024"], help="BxT completion sizes")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--methods", nargs="+", default=["ours", "selective", "naive"])
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # method B T, in the child process
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), int(a.one[2]), a.prompt, a.layers, a.device)))
        sys.exit(0)
    rows = []
    for size in a.sizes:
        B, T = map(int, size.split("x"))
        for method in a.methods:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                method,
                str(B),
                str(T),
                "--prompt",
                str(a.prompt),
                "--layers",
                str(a.layers),
                "--device",
                a.device,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                rows.append(dict(method=method, B=B, T=T, error=out.stderr.strip().splitlines()[-1][:200]))
            else:
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| B x T | fp32 [B,T,V] MB | ours peak MB (s) | selective peak MB (s) | naive peak MB (s) | ours / naive |")
    print("|---|---|---|---|---|---|")
    for size in a.sizes:
        B, T = map(int, size.split("x"))
        r = {x["method"]: x for x in rows if x["B"] == B and x["T"] == T}
        if len(r) < 3:
            continue
        cell = {m: f"{x['peak_mb']:.0f} ({x['seconds']:.2f})" if "peak_mb" in x else x["error"] for m, x in r.items()}
        ratio = (
            f"{r['ours']['peak_mb'] / r['naive']['peak_mb']:.2f}"
            if "peak_mb" in r["ours"] and "peak_mb" in r["naive"]
            else "-"
        )
        fp32 = next((x["logits_mb_fp32"] for x in r.values() if "logits_mb_fp32" in x), "-")
        print(f"| {B} x {T} | {fp32} | {cell['ours']} | {cell['selective']} | {cell['naive']} | {ratio} |")
    Path(ROOT / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    (
        ROOT
        / "benchmarks"
        / "out"
        / f"logprob_memory_{a.device}{'' if len(a.methods) == 3 else '_' + '_'.join(a.methods)}.json"
    ).write_text(json.dumps(rows, indent=1))

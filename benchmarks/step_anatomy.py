"""Benchmark: where one grpo.py step's time goes on this machine, each part beside its bound.

On the bundled model and the default batch (8 prompts x 8 completions, 48 new tokens), in one process, --rounds times
each, medians: the prefill, the decode loop (per token step), the rest of the rollouts (texts, masks, rewards), the
update's forward + backward and its optimizer step, for the static decoder and for transformers' generate (--engine
hf). Bounds: the matmul FLOPs of each part over the matmul rate this machine reaches (measured here: a square matmul),
and for decoding also the bytes a token step reads (the weights and the KV cache) over the memory bandwidth measured
here (a large copy). The ratio part / bound says how far from the machine's limit each part runs.

    python benchmarks/step_anatomy.py [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from rlvr_utils.core import rollouts, tasks  # noqa: E402

PROMPTS, G, NEW = 8, 8, 48


def machine_rates() -> dict:
    """This machine's matmul rate (FLOP/s, fp32, a 1024^3 matmul) and copy bandwidth (bytes/s, a 256 MB copy)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    flops = 20 * 2 * 1024**3 / (time.perf_counter() - t0)
    x = torch.empty(64 * 2**20)
    y = torch.empty_like(x)
    y.copy_(x)
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    bandwidth = 5 * 2 * x.numel() * 4 / (time.perf_counter() - t0)  # read + write
    return {"matmul_flop_s": flops, "copy_bytes_s": bandwidth}


def timed(fn, rounds: int) -> float:
    out = []
    for r in range(rounds):
        torch.manual_seed(r)
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rates = machine_rates()
    model, tok = common.load_policy(common.DEFAULT_MODEL, torch.device("cpu"))
    task = tasks.load_task("arith", tok, seed=1, num_eval=8)
    examples = task.train[:PROMPTS]
    prompts, ids = [e.prompt_ids for e in examples], [e.id for e in examples]
    params = sum(p.numel() for p in model.parameters())
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    out = {"machine": rates, "params": params, "threads": torch.get_num_threads()}
    for engine in ("static", "hf"):
        model._rlvr_hf_generate = engine == "hf"
        dec = rollouts.static_decoder(model)
        torch.manual_seed(0)  # the batch counted below: the same draw under both engines
        ro = common.generate_rollouts(model, tok, prompts, ids, G, NEW)
        steps = ro.completion_ids.shape[1]
        parts = {"rollouts": timed(lambda: common.generate_rollouts(model, tok, prompts, ids, G, NEW), a.rounds)}
        batch, mask = common.pad_left([p for p in prompts for _ in range(G)], tok.pad_token_id)
        if dec is not None:
            parts["prefill"] = timed(lambda: dec.prefill(batch, mask), a.rounds)
        owners = [e for e in examples for _ in range(G)]
        parts["rewards"] = timed(lambda: task.rewards(ro.texts, owners, ro.completion_lists()), a.rounds)
        out[engine] = {"parts": parts, "decode_steps": steps, "generated_tokens": int(ro.completion_mask.sum())}
    model._rlvr_hf_generate = False
    T = ro.completion_ids.shape[1]
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the weights stay as loaded

    def update():
        opt.zero_grad(set_to_none=True)
        for mb in torch.arange(len(ro)).split(16):
            logp, _ = common.token_logprobs(model, ro.input_ids[mb], ro.attention_mask[mb], T, with_entropy=True)
            (-(logp * ro.completion_mask[mb]).sum() / ro.completion_mask.sum()).backward()
        opt.step()

    update_s = timed(update, a.rounds)
    B, L = ro.input_ids.shape
    s = out["static"]
    decode_s = s["parts"]["rollouts"] - s["parts"].get("prefill", 0) - s["parts"]["rewards"]
    decode_flop = 2 * matmul_params * B  # per token step: each weight once per row
    kv_bytes = 2 * len(model.model.layers) * B * L * model.config.hidden_size * 4 / 2  # the cache, half full on average
    step_bytes = params * 4 + kv_bytes
    per_step = decode_s / max(1, s["decode_steps"] - 1)
    out["bounds"] = {
        "decode_step_s": per_step,
        "decode_step_flop_bound_s": decode_flop / rates["matmul_flop_s"],
        "decode_step_bytes_bound_s": step_bytes / rates["copy_bytes_s"],
        "update_s": update_s,
        "update_flop_bound_s": 6 * matmul_params * B * L / rates["matmul_flop_s"],  # forward 2, backward 4 per weight
    }
    print(json.dumps(out, indent=1))
    b = out["bounds"]
    print("\n| part | time | bound | time / bound |")
    print("|---|---|---|---|")
    bound = max(b["decode_step_flop_bound_s"], b["decode_step_bytes_bound_s"])
    print(f"| a decode step (64 rows) | {per_step * 1e3:.2f} ms | {bound * 1e3:.3f} ms | {per_step / bound:.0f}x |")
    print(f"| update (fwd + bwd + AdamW) | {update_s:.3f} s | {b['update_flop_bound_s']:.3f} s | "
          f"{update_s / b['update_flop_bound_s']:.1f}x |")  # fmt: skip
    for engine in ("static", "hf"):
        p = out[engine]["parts"]
        print(f"{engine}: rollouts {p['rollouts']:.3f} s ({out[engine]['generated_tokens']} tokens), "
              f"prefill {p.get('prefill', float('nan')):.3f} s, rewards {p['rewards']:.3f} s")  # fmt: skip
    (ROOT / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    (ROOT / "benchmarks" / "out" / "step_anatomy.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

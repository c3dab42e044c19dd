"""Where generation time goes: HF `generate` against a bare decode loop over the same model forward.

Why it exists: grpo.py and TRL's GRPOTrainer both spend about half of a step in HF `generate`, so how far
grpo.py can get below TRL's step time is bounded by how much of `generate` is overhead around the model's
forward. This times, on the bundled model, 8 prompts x 8 completions, 48 new tokens (speed_vs_trl.py's work):

- `generate`: `common.generate_rollouts` (HF generate, sampling, KV cache, EOS stop);
- `bare loop`: prefill + 48 single-token forwards with a DynamicCache and argmax (no logits processors,
  no stopping criteria, no early stop) - the floor for any loop built on the model's forward;
- `bare loop, static cache`: the same with a preallocated StaticCache (no per-step KV concatenation).

Alternating, --rounds rounds, medians. `--compile` adds HF generate over `torch.compile(model.forward)`
(its compile time is reported separately; it needs a C++ compiler on CPU).

    python benchmarks/generation_overhead.py [--rounds 5] [--compile]
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
from rlvr_utils.core import tasks  # noqa: E402

PROMPTS, G, MAX_NEW = 8, 8, 48


def bare_loop(model, ids, mask, static: bool) -> None:
    from transformers import DynamicCache, StaticCache

    L = ids.shape[1]
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=L + MAX_NEW) if static else DynamicCache()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        full = torch.cat([mask, torch.zeros(mask.shape[0], MAX_NEW, dtype=mask.dtype)], 1)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            cache_position=torch.arange(L),
        )
        nxt, p = out.logits[:, -1:].argmax(-1), pos[:, -1:]
        for i in range(MAX_NEW - 1):
            p = p + 1
            full[:, L + i] = 1
            m = full if static else full[:, : L + i + 1]
            out = model(
                input_ids=nxt,
                attention_mask=m,
                position_ids=p,
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.tensor([L + i]),
            )
            nxt = out.logits[:, -1:].argmax(-1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    model, tok = common.load_policy(common.DEFAULT_MODEL, torch.device("cpu"))
    task = tasks.load_task("arith", tok, seed=1, num_eval=8)
    ex = task.train[:PROMPTS]
    prompts = [e.prompt_ids for e in ex]
    ids, mask = common.pad_left([p for p in prompts for _ in range(G)], tok.pad_token_id)
    runs = {
        "generate": lambda: common.generate_rollouts(model, tok, prompts, [e.id for e in ex], G, MAX_NEW, 1.0),
        "bare loop": lambda: bare_loop(model, ids, mask, static=False),
        "bare loop, static cache": lambda: bare_loop(model, ids, mask, static=True),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(a.rounds):
        for k, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in times.items()}
    if a.compile:
        model.forward = torch.compile(model.forward, dynamic=True)
        t0 = time.perf_counter()
        runs["generate"]()
        out["compile seconds (first call)"] = time.perf_counter() - t0
        ts = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            runs["generate"]()
            ts.append(time.perf_counter() - t0)
        out["generate, torch.compile"] = statistics.median(ts)
    print(json.dumps({k: round(v, 3) for k, v in out.items()}))
    print(f"\n| {PROMPTS} prompts x {G}, {MAX_NEW} new tokens | seconds (median of {a.rounds}) | x generate |")
    print("|---|---|---|")
    for k, v in out.items():
        ratio = "" if k.startswith("compile") else f"{v / out['generate']:.2f}"
        print(f"| {k} | {v:.3f} | {ratio} |")
    (ROOT / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    (ROOT / "benchmarks" / "out" / "generation_overhead.json").write_text(json.dumps(out, indent=1))

"""Generation tokens/s of each rollout engine on the bundled model: HF generate against the colocated vLLM
engine, same prompts (64 held-out arith prompts x G), same sampling (temperature 1, max 48 new tokens).
Engine start-up is reported apart. Needs vLLM for the second row (docs/vllm.md).

    python benchmarks/engine_speed.py [--num-generations 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

import common  # noqa: E402
from rlvr_utils.core import runtime, tasks  # noqa: E402
from rlvr_utils.extras.scale import engines  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=common.DEFAULT_MODEL)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.1)
    a = ap.parse_args()
    device = runtime.pick_device("auto")
    model, tok = common.load_policy(a.model, device)
    prompts = [e.prompt_ids for e in tasks.load_task("arith", tok, num_eval=64).eval]
    out = {"device": str(device)}
    engines = ["hf"] + (["vllm"] if engines.vllm_available() else [])
    for name in engines:
        t0 = time.time()
        if name == "vllm":
            engines.attach_engine(
                "vllm", model, torch.optim.SGD(model.parameters(), lr=0.0), a.model, a.vllm_gpu_memory_utilization
            )
        startup = time.time() - t0
        rates = []
        for r in range(a.rounds + 1):
            t0 = time.time()
            ro = common.generate_rollouts(
                model, tok, prompts, list(range(len(prompts))), a.num_generations, 48, temperature=1.0
            )
            if r:  # the first round is warm-up
                rates.append(ro.completion_mask.sum().item() / (time.time() - t0))
        out[name] = dict(tokens_per_second=statistics.median(rates), rounds=rates, startup_seconds=round(startup, 1))
        print(name, json.dumps(out[name]), flush=True)
    if "vllm" in out:
        out["speedup"] = out["vllm"]["tokens_per_second"] / out["hf"]["tokens_per_second"]
        print(f"vLLM / HF: {out['speedup']:.2f}x")
    (ROOT / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    (ROOT / "benchmarks" / "out" / "engine_speed.json").write_text(json.dumps(out, indent=1))

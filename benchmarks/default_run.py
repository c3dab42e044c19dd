"""Benchmark: `python grpo.py` with its defaults (bundled tiny model, built-in task) on this machine.

Runs the script as a user would (a subprocess), then reports wall time, peak memory (the child's own
peak RSS), the split of step time between generation, log-probs and update, and the eval
accuracy curve. Writes benchmarks/out/default_run.json and prints a markdown table.

    python benchmarks/default_run.py                 # ~10 min on 2 CPU cores
    python benchmarks/default_run.py --script srpo.py --extra "--reset random"
"""

import argparse
import json
import os
import platform
from pathlib import Path

from harness import run_script

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--script", default="grpo.py")
    ap.add_argument("--extra", default="", help="extra flags for the script, one string")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    a = ap.parse_args()

    res = run_script([a.script, *a.extra.split()]).check()
    wall, peak_mb, rows = res.wall_s, res.peak_rss_mb, res.rows

    steps = [r for r in rows if "time/step" in r]
    total = {k: sum(r[k] for r in steps) for k in ("time/generation", "time/logprobs", "time/update", "time/step")}
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    result = {
        "command": "python " + " ".join([a.script, *a.extra.split()]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "wall_seconds": round(wall, 1),
        "steps": len(steps),
        "seconds_per_step": round(total["time/step"] / len(steps), 3),
        "share_generation": round(total["time/generation"] / total["time/step"], 3),
        "share_logprobs": round(total["time/logprobs"] / total["time/step"], 3),
        "share_update": round(total["time/update"] / total["time/step"], 3),
        "peak_rss_mb": round(peak_mb, 1),
        "tokens_per_second": round(sum(r["num_tokens"] for r in steps) / total["time/step"], 1),
        "eval_accuracy": evals,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(a.script).stem + ("_" + "_".join(a.extra.replace("-", "").split()) if a.extra else "")
    (out / f"default_run_{name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print("\n| command | wall | s/step | generation | log-probs | update | peak RSS | eval acc (first → last) |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| `{result['command']}` | {wall / 60:.1f} min | {result['seconds_per_step']} | "
        f"{result['share_generation']:.0%} | {result['share_logprobs']:.0%} | {result['share_update']:.0%} | "
        f"{peak_mb:.0f} MB | {evals[0][1]:.3f} → {evals[-1][1]:.3f} |"
    )


if __name__ == "__main__":
    main()

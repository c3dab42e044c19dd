"""Benchmark: each algorithm's step time and generated tokens against grpo.py at equal settings.

Every script runs the same number of steps with the same prompts per step, group size, completion
length and seed on the bundled model and the built-in task (no evaluation in between). Scripts run
in alternating rounds so machine noise hits all of them alike. Reported: the median over steps and
rounds of `time/step` (steps after the first of each run), its ratio to grpo.py's, the split into
generation / log-probs / update, generated tokens per step (srpo.py counts fresh chains,
localization and suffixes), and peak RSS. Writes benchmarks/out/step_time.json and a markdown table.

    python benchmarks/step_time.py                    # ~15 min on 2 CPU cores
    python benchmarks/step_time.py --steps 4 --rounds 1 --scripts grpo.py srpo.py
"""

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

from harness import run_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "grpo.py": [],
    "sc_grpo.py": [],
    "grpo_lambda.py": [],
    "ep_grpo.py": [],
    "srpo.py": [],
    "srpo.py --reset random": ["--reset", "random"],
    "srpo.py --reset oracle": ["--reset", "oracle"],
}


def run_once(script: str, extra: list[str], steps: int, seed: int) -> dict:
    flags = ["--total-steps", str(steps), "--eval-every", "0", "--num-eval", "8", "--seed", str(seed), *extra]
    res = run_script([script, *flags]).check(f"{script} {' '.join(extra)}")
    return {"rows": res.steps[1:], "peak_rss_mb": res.peak_rss_mb}  # the first step includes warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--scripts", nargs="*", default=None, help="script names (with flags, quoted) from the default list"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    a = ap.parse_args()
    names = [n for n in SCRIPTS if a.scripts is None or n in a.scripts or n.split()[0] in a.scripts]
    names = [n for n in names if (ROOT / n.split()[0]).exists()]
    collected = {n: {"rows": [], "peak_rss_mb": 0.0} for n in names}
    for r in range(a.rounds):
        for n in names:
            res = run_once(n.split()[0], SCRIPTS[n], a.steps, seed=1 + r)
            collected[n]["rows"] += res["rows"]
            collected[n]["peak_rss_mb"] = max(collected[n]["peak_rss_mb"], res["peak_rss_mb"])
            print(f"round {r + 1}: {n} done", flush=True)
    table = {}
    for n, c in collected.items():
        rows = c["rows"]
        med = lambda k: statistics.median(x[k] for x in rows)  # noqa: E731
        table[n] = {
            "seconds_per_step": round(med("time/step"), 3),
            "generation": round(med("time/generation"), 3),
            "logprobs": round(med("time/logprobs"), 3),
            "update": round(med("time/update"), 3),
            "generated_tokens": round(
                statistics.median(x.get("reset/generated_tokens", x["num_tokens"]) for x in rows)
            ),
            "trained_tokens": round(med("num_tokens")),
            "peak_rss_mb": round(c["peak_rss_mb"]),
            "steps_measured": len(rows),
        }
    base = table.get("grpo.py", {}).get("seconds_per_step")
    for v in table.values():
        v["ratio_to_grpo"] = round(v["seconds_per_step"] / base, 2) if base else None
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads default",
        "settings": f"{a.steps} steps x {a.rounds} rounds, defaults of each script (8 prompts x 8)",
        "table": table,
    }
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "step_time.json").write_text(json.dumps(result, indent=1))
    print("\n| script | s/step | × grpo.py | generation | log-probs | update | generated tokens/step | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for n, v in table.items():
        print(
            f"| `{n}` | {v['seconds_per_step']} | {v['ratio_to_grpo']} | {v['generation']} | {v['logprobs']} | "
            f"{v['update']} | {v['generated_tokens']} | {v['peak_rss_mb']} MB |"
        )


if __name__ == "__main__":
    main()

"""Benchmark: eval accuracy of every method against step and generated tokens on the built-in task.

Each method runs as a user would run it (a subprocess with its defaults: bundled tiny model, 8
prompts x 8 trained trajectories per step), for --steps steps and each seed, with an evaluation every
--eval-every steps. Writes benchmarks/out/learning_curves.json and .csv and prints a markdown table of
eval accuracy (mean ± standard error over seeds) at the start and at the end, the step at which each
method first reaches GRPO's final accuracy, and generated tokens per step.

    python benchmarks/learning_curves.py --quick                    # a few minutes: 1 seed, 20 steps, 100 eval prompts
    python benchmarks/learning_curves.py                            # 3 seeds, 150 steps (about 2 hours on 2 CPU cores)

Also writes benchmarks/out/learning_curves.png (eval accuracy against step and against generated tokens,
mean ± standard error bands; needs matplotlib: pip install -r benchmarks/requirements.txt) and
benchmarks/out/learning_curves.md (the table).
"""

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = {
    "grpo": ["grpo.py"],
    "sc_grpo": ["sc_grpo.py"],
    "grpo_lambda": ["grpo_lambda.py"],
    "ep_grpo": ["ep_grpo.py"],
    "srpo": ["srpo.py", "--reset", "self"],
    "rrpo": ["srpo.py", "--reset", "random"],
    "srpo_oracle": ["srpo.py", "--reset", "oracle"],
}


def run(method: str, steps: int, eval_every: int, seed: int, extra: list[str]) -> list[dict]:
    script, *flags = METHODS[method]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / script), *flags, "--total-steps", str(steps), "--eval-every", str(eval_every),
               "--seed", str(seed), "--output-dir", tmp, *extra]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        if out.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
        (run_dir,) = [p for p in Path(tmp).iterdir() if p.is_dir()]
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else 0.0
    return m, se


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--methods", nargs="*", default=list(METHODS))
    ap.add_argument("--extra", default="", help="extra flags for every script, one string")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    ap.add_argument("--quick", action="store_true", help="1 seed, 20 steps, eval every 10 on 100 prompts")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.eval_every, a.seeds, a.extra = 20, 10, 1, (a.extra + " --num-eval 100").strip()
    curves = {}  # method -> seed -> [(step, generated tokens so far, eval accuracy)]
    for seed in range(1, a.seeds + 1):
        for m in a.methods:
            rows = run(m, a.steps, a.eval_every, seed, a.extra.split())
            tokens, points = 0, []
            for r in rows:
                tokens += r.get("reset/generated_tokens", r.get("num_tokens", 0))
                if "eval/accuracy" in r:
                    points.append((r["step"], tokens, r["eval/accuracy"]))
            curves.setdefault(m, {})[seed] = points
            print(f"seed {seed} {m}: " + " ".join(f"{s}:{acc:.3f}" for s, _, acc in points), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning_curves.json").write_text(json.dumps({"args": vars(a), "curves": curves}, indent=1))
    with open(out / "learning_curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "seed", "step", "generated_tokens", "eval_accuracy"])
        for m, by_seed in curves.items():
            for seed, pts in by_seed.items():
                w.writerows([m, seed, *p] for p in pts)
    grpo_final = mean_se([pts[-1][2] for pts in curves["grpo"].values()])[0] if "grpo" in curves else None
    lines = [f"| method | eval acc at step 0 | at step {a.steps} (mean ± SE, {a.seeds} seed(s)) | first step ≥ GRPO's final | generated tokens / step |",
             "|---|---|---|---|---|"]
    bands = {}
    for m, by_seed in curves.items():
        s0 = mean_se([pts[0][2] for pts in by_seed.values()])
        s1 = mean_se([pts[-1][2] for pts in by_seed.values()])
        steps = sorted({p[0] for pts in by_seed.values() for p in pts})
        at = {s: mean_se([p[2] for pts in by_seed.values() for p in pts if p[0] == s]) for s in steps}
        toks = {s: mean_se([p[1] for pts in by_seed.values() for p in pts if p[0] == s])[0] for s in steps}
        bands[m] = [(s, toks[s], *at[s]) for s in steps]
        reach = next((s for s in steps if grpo_final is not None and at[s][0] >= grpo_final), None)
        tok = mean_se([pts[-1][1] / a.steps for pts in by_seed.values()])[0]
        lines.append(f"| {m} | {s0[0]:.3f} ± {s0[1]:.3f} | {s1[0]:.3f} ± {s1[1]:.3f} | {reach if reach is not None else '–'} | {tok:.0f} |")
    table = "\n".join(lines)
    print("\n" + table)
    (out / "learning_curves.md").write_text(f"`python benchmarks/learning_curves.py {' '.join(sys.argv[1:])}`\n\n{table}\n")
    plot(bands, out / "learning_curves.png", f"{a.seeds} seed(s), {a.steps} steps, mean ± SE")


def plot(bands: dict, path: Path, title: str) -> None:
    """Eval accuracy against step and against generated tokens, with standard-error bands."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -r benchmarks/requirements.txt)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for m, pts in bands.items():
        step, tok, mean, se = (list(x) for x in zip(*pts))
        for ax, x in zip(axes, (step, tok)):
            ax.plot(x, mean, marker="o", ms=3, label=m)
            ax.fill_between(x, [u - e for u, e in zip(mean, se)], [u + e for u, e in zip(mean, se)], alpha=0.2)
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("generated tokens")
    for ax in axes:
        ax.set_ylabel("eval accuracy (greedy pass@1)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Built-in arith task, bundled tiny model: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()

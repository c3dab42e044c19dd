"""Benchmark: this tree against a worktree of an earlier commit, side by side in one run (rounds alternate the two, so
machine noise hits both alike). Per script: the median step over the steps after the first --drop of each run, the
generation time per generated token, the update time, and each ratio new / base; with --default-run, the wall time of
the whole default run (150 steps and its evaluations). CPU seconds (user + sys of the run's process) are reported
beside wall seconds: on a shared machine they move less with other load.

    git worktree add /tmp/base a1f0471
    python benchmarks/speed_vs_base.py --base /tmp/base                       # every script, 10 steps x 3 rounds
    python benchmarks/speed_vs_base.py --base /tmp/base --scripts grpo.py srpo.py --steps 8 --rounds 5
    python benchmarks/speed_vs_base.py --base /tmp/base --default-run --rounds 2   # the 150-step run, ~3 min each
    python benchmarks/speed_vs_base.py --base /tmp/base --flags=--dtype=bfloat16   # both trees in bf16, a GPU dtype

Writes benchmarks/out/speed_vs_base.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
from pathlib import Path

from harness import run_script
from step_time import SCRIPTS  # the scripts and flags step_time.py times

ROOT = Path(__file__).resolve().parent.parent


def commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return out.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")


def timed(args: list[str], tree: Path, threads: int | None):
    """(the run's Result, its CPU seconds: user + sys of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = run_script(args, cwd=tree, threads=threads).check(f"{tree}: {' '.join(args)}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return res, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def generated(row: dict) -> float:
    """Tokens the step generated (SRPO: every call's, localization included)."""
    return row.get("reset/generated_tokens", row.get("sampling/generated_tokens", row["num_tokens"]))


def summarize(rows: list[dict]) -> dict:
    med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
    return {
        "step_s": med(lambda r: r["time/step"]),
        "generation_s": med(lambda r: r["time/generation"]),
        "generation_ms_per_token": med(lambda r: 1e3 * r["time/generation"] / generated(r)),
        "update_s": med(lambda r: r["time/update"]),
        "generated_tokens": med(generated),
        "steps": len(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="a worktree of the earlier commit (git worktree add DIR COMMIT)")
    ap.add_argument("--scripts", nargs="*", default=None, help="names from the default list (with flags, quoted)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--drop", type=int, default=2, help="warm-up steps of each run left out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the runs (default: torch's)")
    ap.add_argument("--default-run", action="store_true", help="also time the whole default run (grpo.py, 150 steps)")
    ap.add_argument("--flags", default="", help="flags added to every run of both trees, e.g. --flags=--dtype=bfloat16")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    a = ap.parse_args()
    trees = {"base": Path(a.base).resolve(), "new": ROOT}
    names = [n for n in SCRIPTS if a.scripts is None or n in a.scripts or n.split()[0] in a.scripts]
    rows = {(t, n): [] for t in trees for n in names}
    cpu = {(t, n): [] for t in trees for n in names}
    walls = {t: [] for t in trees}
    for r in range(a.rounds):
        for n in names:
            for t, tree in trees.items() if r % 2 == 0 else reversed(trees.items()):
                flags = ["--total-steps", str(a.steps), "--eval-every", "0", "--num-eval", "8", "--seed", str(r + 1)]
                res, cpu_s = timed([n.split()[0], *flags, *SCRIPTS[n], *a.flags.split()], tree, a.threads)
                rows[(t, n)] += res.steps[a.drop :]
                cpu[(t, n)].append(cpu_s / a.steps)
                print(f"round {r + 1}: {t} {n} done", flush=True)
        if a.default_run:
            for t, tree in trees.items() if r % 2 == 0 else reversed(trees.items()):
                res, cpu_s = timed(["grpo.py", "--seed", str(r + 1), *a.flags.split()], tree, a.threads)
                walls[t].append({"wall_s": res.wall_s, "cpu_s": cpu_s, "final": res.rows[-1].get("eval/accuracy")})
                print(f"round {r + 1}: default run {t} {res.wall_s:.0f} s", flush=True)
    table = {}
    for n in names:
        base, new = summarize(rows[("base", n)]), summarize(rows[("new", n)])
        ratio = {k: round(new[k] / base[k], 3) for k in ("step_s", "generation_ms_per_token", "update_s")}
        cpu_ratio = round(statistics.median(cpu[("new", n)]) / statistics.median(cpu[("base", n)]), 3)
        table[n] = {"base": base, "new": new, "ratio": ratio | {"cpu_s_per_step": cpu_ratio}}
    grpo = table.get("grpo.py")
    for n, v in table.items():  # each script's generation cost per token against grpo.py's, in the same run
        if grpo:
            for t in trees:
                v[t]["per_token_vs_grpo"] = round(
                    v[t]["generation_ms_per_token"] / grpo[t]["generation_ms_per_token"], 3
                )
    result = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, torch threads {a.threads or 'default'}",
        "commits": {t: commit(tree) for t, tree in trees.items()},
        "settings": f"{a.steps} steps (first {a.drop} dropped) x {a.rounds} rounds, alternating, script defaults"
        + (f" and {a.flags}" if a.flags else ""),
        "table": table,
    }
    if a.default_run:
        med = {t: statistics.median(w["wall_s"] for w in walls[t]) for t in trees}
        result["default_run"] = {"runs": walls, "wall_ratio": round(med["new"] / med["base"], 3)}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "speed_vs_base.json").write_text(json.dumps(result, indent=1))
    print(f"\nbase {result['commits']['base']}, new {result['commits']['new']}; {result['settings']}")
    print("| script | step s (base → new) | × | generation ms/token | × | update s | × | CPU s/step × |")
    print("|---|---|---|---|---|---|---|---|")
    for n, v in table.items():
        b, w, x = v["base"], v["new"], v["ratio"]
        print(
            f"| `{n}` | {b['step_s']:.3f} → {w['step_s']:.3f} | {x['step_s']} | {b['generation_ms_per_token']:.3f} → "
            f"{w['generation_ms_per_token']:.3f} | {x['generation_ms_per_token']} | {b['update_s']:.3f} → "
            f"{w['update_s']:.3f} | {x['update_s']} | {x['cpu_s_per_step']} |"
        )
    if a.default_run:
        print(f"default run wall time × {result['default_run']['wall_ratio']}: {walls}")


if __name__ == "__main__":
    main()

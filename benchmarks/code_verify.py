"""What the code task's sandbox costs: the 164 canonical HumanEval solutions verified in each sandbox, side by side.

python benchmarks/code_verify.py [--data ../shared/data/HumanEval.jsonl.gz] [--workers 2] [--rounds 3]
    [--sandboxes bwrap audit-hook] [--baseline DIR]

Each round verifies every solution once in each sandbox, in turn (so a machine's load falls on all of them alike):
`bwrap` (the default: bubblewrap's namespaces), `audit-hook` (--code-sandbox audit-hook: the same two processes
without OS isolation) and, with `--baseline DIR`, the sandbox of another checkout of this repository (for instance a
worktree of a commit with the package in folders; docs/code_task.md's baseline row, 86719d2's in-process harness
before bubblewrap, was measured before the folders, when this benchmark read the flat layout's sandbox module). Reports,
per sandbox, the median over rounds of the wall time per program with `--workers` in parallel and of one program alone
(the first 20 run one at a time), and checks that every canonical solution passes. Writes
benchmarks/out/code_verify.json.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
from rlvr_utils.extras.data import sandbox

ALONE = 20  # programs timed one at a time each round


def baseline_runner(directory: str):
    """run_code_tests of another checkout's rlvr_utils/extras/data/sandbox.py (its own harness beside it; a checkout
    with the package in folders, as this one: its imports are this checkout's modules)."""
    path = Path(directory) / "rlvr_utils" / "extras" / "data" / "sandbox.py"
    spec = importlib.util.spec_from_file_location("baseline_sandbox", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_code_tests


def verify(run, rows, workers: int) -> tuple[float, float, list[float]]:
    """(seconds per program with `workers` at a time, seconds per program alone, rewards)."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        rewards = list(
            pool.map(lambda r: run(r["prompt"] + r["canonical_solution"], r["test"], r["entry_point"]), rows)
        )
    parallel = (time.perf_counter() - t0) / len(rows)
    t0 = time.perf_counter()
    for r in rows[:ALONE]:
        run(r["prompt"] + r["canonical_solution"], r["test"], r["entry_point"])
    alone = (time.perf_counter() - t0) / ALONE
    return parallel, alone, [x.reward for x in rewards]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data",
        default=str(Path(common.DEFAULT_MODEL).parent.parent.parent / "shared" / "data" / "HumanEval.jsonl.gz"),
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sandboxes", nargs="+", choices=sandbox.SANDBOXES, default=list(sandbox.SANDBOXES))
    ap.add_argument("--baseline", help="another checkout of this repository, whose sandbox is timed beside these")
    a = ap.parse_args()
    if not Path(a.data).exists():
        sys.exit(f"{a.data}: no such file (HumanEval.jsonl.gz from openai/human-eval)")
    for name in a.sandboxes:
        if (problem := sandbox.isolation_problem(name)) is not None:
            sys.exit(problem)
    with gzip.open(a.data, "rt") as f:
        rows = [json.loads(line) for line in f]
    runs = {name: lambda p, t, e, name=name: sandbox.run_code_tests(p, t, e, sandbox=name) for name in a.sandboxes}
    if a.baseline:
        runs["baseline"] = baseline_runner(a.baseline)
    times: dict[str, dict[str, list[float]]] = {name: {"parallel": [], "alone": []} for name in runs}
    for _ in range(a.rounds):
        for name, run in runs.items():
            parallel, alone, rewards = verify(run, rows, a.workers)
            assert sum(rewards) == len(rows), f"{name}: only {sum(rewards)} of {len(rows)} canonical solutions passed"
            times[name]["parallel"].append(parallel)
            times[name]["alone"].append(alone)
    out = dict(
        completions=len(rows),
        workers=a.workers,
        cpus=os.cpu_count(),
        load_average=os.getloadavg(),
        baseline=a.baseline,
        ms_per_program={
            name: {k: round(1000 * statistics.median(v), 1) for k, v in t.items()} for name, t in times.items()
        },
        rounds={name: {k: [round(1000 * x, 1) for x in v] for k, v in t.items()} for name, t in times.items()},
    )
    print(json.dumps(out))
    Path("benchmarks/out").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/out/code_verify.json").write_text(json.dumps(out, indent=1))

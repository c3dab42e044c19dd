"""Completions verified per second by the code sandbox: the 164 canonical HumanEval solutions.

python benchmarks/code_verify.py [--data ../shared/data/HumanEval.jsonl.gz] [--workers 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
from rlvr_utils import sandbox

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--data",
        default=str(Path(common.DEFAULT_MODEL).parent.parent.parent / "shared" / "data" / "HumanEval.jsonl.gz"),
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if not Path(a.data).exists():
        sys.exit(f"{a.data}: no such file (HumanEval.jsonl.gz from openai/human-eval)")
    with gzip.open(a.data, "rt") as f:
        rows = [json.loads(line) for line in f]
    progs = [r["prompt"] + r["canonical_solution"] for r in rows]
    rates = []
    for _ in range(a.rounds):
        t0 = time.time()
        rewards = sandbox.code_rewards(
            progs, [r["test"] for r in rows], [r["entry_point"] for r in rows], workers=a.workers
        )
        rates.append(len(rows) / (time.time() - t0))
        assert sum(rewards) == len(rows), f"only {sum(rewards)} of {len(rows)} canonical solutions passed"
    probe = sandbox.run_code_tests(progs[0], rows[0]["test"], rows[0]["entry_point"])
    out = dict(
        completions=len(rows),
        workers=a.workers,
        cpus=os.cpu_count(),
        per_second=rates,
        median_per_second=statistics.median(rates),
        network_isolated=probe.network_isolated,
        uid=probe.uid,
    )
    print(json.dumps(out))
    Path("benchmarks/out").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/out/code_verify.json").write_text(json.dumps(out, indent=1))

"""Benchmark: the MATH verifier (rewards.math_reward) on real reference solutions.

For every row of a MATH-style jsonl (problem, solution, and answer; without an answer field the solution's last
\\boxed{} is the answer): the reference solution must score 1 against its own answer, and 0 against another
problem's answer (the next row whose answer differs as a string after normalization). Prints both shares, the
failures, and writes benchmarks/out/verify_math.json. Targets: >= 99.5% and >= 98%.

    python benchmarks/verify_math.py --data-path math_test.jsonl [--no-normalize]
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlvr_utils.extras.data import rewards  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data-path", required=True, help="MATH-style jsonl: problem, solution (with \\boxed{}), optional answer"
    )
    ap.add_argument("--no-normalize", action="store_true", help="measure math-verify without rewards.normalize_latex")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "verify_math.json"))
    a = ap.parse_args()
    if a.no_normalize:
        rewards.normalize_latex = lambda s: s
    rows = [json.loads(line) for line in open(a.data_path) if line.strip()]
    golds = [str(r["answer"]) if "answer" in r else rewards.last_boxed(r["solution"]) for r in rows]
    keys = [rewards.normalize_latex(g) if g is not None else None for g in golds]
    own_ok, other_ok, own_fail, other_fail, n_other, t0 = 0, 0, [], [], 0, time.time()
    for i, (row, gold) in enumerate(zip(rows, golds)):
        if gold is None:
            own_fail.append((i, "no answer"))
            continue
        try:
            own = rewards.math_reward(row["solution"], gold)
        except ValueError:  # an unparsable gold: the task loader would skip the row
            own = None
        own_ok += own == 1.0
        if own != 1.0:
            own_fail.append((i, gold))
        j = next(
            (j % len(rows) for j in range(i + 1, i + len(rows)) if keys[j % len(rows)] not in (None, keys[i])), None
        )
        if j is None:
            continue
        n_other += 1
        try:
            other = rewards.math_reward(row["solution"], golds[j])
        except ValueError:
            other = 0.0
        other_ok += other == 0.0
        if other != 0.0:
            other_fail.append((i, gold, golds[j]))
    res = dict(
        file=a.data_path,
        rows=len(rows),
        normalized=not a.no_normalize,
        own_answer_scores_1=own_ok / len(rows),
        other_answer_scores_0=other_ok / max(n_other, 1),
        seconds=time.time() - t0,
        own_failures=own_fail,
        other_failures=other_fail,
    )
    print(
        f"{len(rows)} reference solutions ({'with' if not a.no_normalize else 'without'} normalize_latex): "
        f"{res['own_answer_scores_1']:.2%} score 1 against their own answer (target >= 99.5%), "
        f"{res['other_answer_scores_0']:.2%} score 0 against another problem's (target >= 98%); {res['seconds']:.0f} s"
    )
    for f in own_fail[:30]:
        print("own   ", f)
    for f in other_fail[:30]:
        print("other ", f)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

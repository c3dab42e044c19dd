"""Benchmark: does each method's credit land on the error? Blame against the built-in task's ground truth.

Every method here claims a better token-level credit than GRPO's uniform one. The built-in arith task knows where a
failed completion went wrong (`arith_first_error`: its first wrong line), and `--log-credit` records each token's
effective credit as the loss's own gradient gives it (rlvr_utils/extras/credit.py). This script measures the one against
the other:

    python benchmarks/credit_accuracy.py run --setting long --seeds 1 2 3 4 5     # the runs (learning_curves.py's)
    python benchmarks/credit_accuracy.py report RUN_DIR_OR_FILE ...               # one JSON line per run
    python benchmarks/credit_accuracy.py table --setting long                     # docs/benchmarks.md's table

`run` is learning_curves.py's `run` with `--log-credit` on every row of every evaluation step's batch: the same runs
give the learning table (`learning_curves.py report`) and this one; the credit is kept as
benchmarks/results/<setting>/<method>/seed<k>.credit.jsonl.gz.

`report` reads credit records alone (a run directory holding credit.jsonl, or a .jsonl / .jsonl.gz file) and prints
one JSON line per run: `run`, `auc`, `lift`, `completions` (and the same per recorded step under `by_step`).
Definition, for each recorded completion with reward below 1 whose first wrong line k (1-based over its non-empty
lines, as `arith_first_error` counts them) comes after at least one correct line (k >= 2) and holds a token:
  - a token belongs to the line it starts on (so a newline token to the line it ends); tokens as recorded;
  - blame_t = -credit_t;
  - AUC = the probability that a token of line k has more blame than a token of a line before it, ties counting 1/2;
    `auc` is the mean over those completions (a completion whose credit is 0 everywhere, e.g. in a group whose
    rewards are all equal, counts 0.5: its update blames nothing; `auc_nonzero` leaves those out);
  - lift = (the share of the completion's total |credit| on line k) / (line k's share of the completion's tokens);
    `lift` is the mean over the completions with some credit (0/0 is left out; `lift_completions` counts them).
GRPO gives auc 0.5 and lift 1.0 by construction (one credit per completion): the measure's own check.

`table` builds, per method, auc and lift early (the first third of the recorded steps) and late (the last third) in
training, each a mean over seeds with its 95% Student-t interval over seeds, beside SRPO's reset placement (the share of
reset points exactly at, before and after the first wrong line, from its logged reset/oracle_* metrics over every
training step of the first and the last third of the run), and writes benchmarks/results/<setting>/credit_accuracy.md.
`calibrate --setting NAME` prints the setting's calibration from GRPO's runs (step-0 greedy accuracy, completion
length, mixed groups, the median first wrong line of its failed completions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import learning_curves as lc  # noqa: E402  (benchmarks/ is the script's own directory)
from credit_view import BadInput, read_records  # noqa: E402  (tools/: the one reader and check of credit records)

from rlvr_utils.core.runtime import metrics_rows, usage_error  # noqa: E402  (a damaged metrics line: an error)
from rlvr_utils.extras.credit import first_wrong_line, token_lines  # noqa: E402  (the definition's rules)

MEASURED = ("step", "prompt", "reward", "tokens", "credit")  # the keys of a credit record the measure reads


# ----------------------------------------------------------------------------------------------
# the measure
# ----------------------------------------------------------------------------------------------
def pairwise_auc(wrong: np.ndarray, right: np.ndarray) -> float:
    """P(a blame from `wrong` > a blame from `right`), ties 1/2 (the Mann-Whitney U over all pairs)."""
    diff = wrong[:, None] - right[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def completion_scores(row: dict) -> dict | None:
    """auc and lift of one recorded completion (None when the definition leaves it out)."""
    if row["reward"] >= 1:
        return None
    k = first_wrong_line(row)  # None: not an arith prompt, or no wrong line
    tokens, credit = row["tokens"], np.asarray(row["credit"], dtype=np.float64)
    lines = np.asarray(token_lines(tokens))
    if k is None or k < 2 or not (lines == k).any():
        return None
    blame = -credit
    out = {"auc": pairwise_auc(blame[lines == k], blame[(lines >= 1) & (lines < k)]), "nonzero": bool(credit.any())}
    total = np.abs(credit).sum()
    if total > 0:
        out["lift"] = float((np.abs(credit[lines == k]).sum() / total) / ((lines == k).sum() / len(tokens)))
    return out


def summarize(scores: list[dict]) -> dict:
    """Means over completions: auc (all), auc_nonzero, lift (those with some credit), and the counts."""
    mean = lambda xs: float(np.mean(xs)) if xs else None  # noqa: E731
    lifts = [s["lift"] for s in scores if "lift" in s]
    return {
        "auc": mean([s["auc"] for s in scores]),
        "lift": mean(lifts),
        "completions": len(scores),
        "auc_nonzero": mean([s["auc"] for s in scores if s["nonzero"]]),
        "lift_completions": len(lifts),
    }


def read_credit(path: Path) -> list[dict]:
    """The rows of a credit.jsonl: `path` is a run directory holding it, a .jsonl file or a .jsonl.gz file. Read and
    checked by tools/credit_view.py's reader, so both tools refuse the same damage with the same line (BadInput)."""
    return read_records(path, MEASURED)


METRICS_USED = ("eval/accuracy", "completions/mean_length", "frac_reward_zero_std", "reset/num_parents")
METRICS_USED += ("reset/oracle_exact", "reset/oracle_after")


def read_metrics(path: Path) -> list[dict]:
    """A run's metrics rows (rlvr_utils.core.runtime.metrics_rows: each a JSON object with an integer step; [] for no
    file), each metric `table` and `calibrate` read a number: a damaged file is a BadInput naming it, not a
    traceback."""
    try:
        rows = metrics_rows(path)
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read it as metrics ({getattr(e, 'strerror', None) or e})") from None
    for r in rows:
        bad = next((k for k in METRICS_USED if k in r and type(r[k]) not in (int, float)), None)  # bool: not one
        if bad:
            raise BadInput(f"{path}: not a metrics row (step {r['step']}: {bad!r} is not a number)")
    return rows


def score_run(rows: list[dict], steps: set[int] | None = None) -> dict:
    """The run's summary over its recorded rows (or those of `steps`), with the same per recorded step."""
    per_step: dict[int, list[dict]] = {}
    for row in rows:
        s = completion_scores(row)
        if s is not None:
            per_step.setdefault(row["step"], []).append(s)
    chosen = [s for step, ss in per_step.items() if steps is None or step in steps for s in ss]
    return {**summarize(chosen), "by_step": {str(k): summarize(v) for k, v in sorted(per_step.items())}}


def run_name(path: Path) -> str:
    if path.is_dir():
        return path.name
    name = path.name.split(".")[0]  # seed<k>.credit.jsonl.gz -> seed<k>; credit.jsonl -> credit
    return f"{path.parent.name}/{name}" if name.startswith("seed") or name == "credit" else name


def cmd_report(a) -> None:
    for p in map(Path, a.runs):
        out = {"run": run_name(p), **score_run(read_credit(p))}
        if not a.by_step:
            out.pop("by_step")
        print(json.dumps(out))


# ----------------------------------------------------------------------------------------------
# run and table
# ----------------------------------------------------------------------------------------------
def cmd_run(a) -> None:
    """learning_curves.py's run, recording every row's credit at every evaluation step."""
    for flag, value in (("--workers", a.workers), ("--threads", a.threads)):
        if value < 1:  # a pool of 0 workers is a ValueError traceback; 0 torch threads fails every run
            usage_error(f"{flag} {value}: must be >= 1")
    if a.extra and not a.tag:
        usage_error("--extra changes the runs: give them a --tag so they do not mix with the defaults")
    lc.cmd_run(a)


def thirds(steps: list[int]) -> tuple[set[int], set[int]]:
    """The first and the last third of a run's recorded steps (at least one each)."""
    n = max(1, len(steps) // 3)
    return set(steps[:n]), set(steps[-n:])


def placement(metrics: list[dict], steps: set[int]) -> tuple[float, float, float] | None:
    """SRPO's reset points against the first wrong line over `steps`' batches: (exact, before, after) shares."""
    rows = [r for r in metrics if r.get("step") in steps and "reset/oracle_exact" in r and r.get("reset/num_parents")]
    if not rows:
        return None
    exact = float(np.mean([r["reset/oracle_exact"] for r in rows]))
    after = float(np.mean([r["reset/oracle_after"] for r in rows]))
    return exact, 1 - exact - after, after


def cmd_table(a) -> None:
    root = Path(a.results) / a.setting
    files = sorted(root.glob("*/seed*.credit.jsonl.gz"))
    if not files:
        usage_error(f"no credit records under {root}: run `credit_accuracy.py run --setting {a.setting}` first")
    per: dict[str, dict[str, list]] = {}  # method -> column -> values over seeds
    for f in files:
        metrics_file = f.with_name(f.name.replace(".credit.jsonl.gz", ".jsonl"))
        metrics = read_metrics(metrics_file)
        if not metrics or "eval/accuracy" not in metrics[-1]:  # learning_curves.complete: ends with an evaluation
            print(f"skipped {f}: its run did not finish")
            continue
        rows = read_credit(f)
        early, late = thirds(sorted({r["step"] for r in rows}))
        cols = per.setdefault(f.parent.name, {})
        for when, steps in (("early", early), ("late", late)):
            s = score_run(rows, steps)
            for key in ("auc", "lift", "auc_nonzero"):
                if s[key] is not None:
                    cols.setdefault(f"{key} {when}", []).append(s[key])
            cols.setdefault(f"n {when}", []).append(s["completions"])
            cols.setdefault(f"steps {when}", []).append(f"{min(steps)}-{max(steps)}")
            last = max(r["step"] for r in metrics)  # placement: every training step of that third of the run
            third = set(range(1, last // 3 + 1)) if when == "early" else set(range(last - last // 3 + 1, last + 1))
            place = placement(metrics, third)
            if place is not None:
                cols.setdefault(f"reset {when}", []).append(place)
    ci = lambda xs: lc.fmt_ci(lc.t_interval(xs)) if xs else "–"  # noqa: E731
    recorded = len(sorted({r["step"] for r in read_credit(files[0])}))
    lines = [
        f"Setting `{a.setting}`; every row of the batch at each evaluation step; mean over seeds and its 95% Student-t "
        f"interval over seeds (seeds: the column); early/late: the first/last third of the {recorded} recorded steps "
        f"({max(1, recorded // 3)} step(s) each; reset placement: of every training step in that third). auc and lift "
        "count the failed completions whose first wrong line is line 2 or later (a completion wrong at line 1 has no "
        "correct line to compare with and is left out).",
        "",
        "| method | seeds | steps early / late | completions per seed | auc early | auc late | lift early | lift late "
        "| auc late, rows with credit | reset at / before / after the first wrong line (early; late) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in sorted(per, key=lambda x: (x != "grpo", "@" in x, x)):
        c = per[m]
        fmt = lambda rs: " / ".join(f"{np.mean([r[i] for r in rs]):.2f}" for i in range(3))  # noqa: E731
        place = f"{fmt(c['reset early'])}; {fmt(c['reset late'])}" if c.get("reset late") else "–"
        lines.append(
            f"| {m} | {len(c['n late'])} | {c['steps early'][0]} / {c['steps late'][0]} | "
            f"{np.mean(c['n early']):.0f} / {np.mean(c['n late']):.0f} | {ci(c.get('auc early'))} | "
            f"{ci(c.get('auc late'))} | {ci(c.get('lift early'))} | {ci(c.get('lift late'))} | "
            f"{ci(c.get('auc_nonzero late'))} | {place} |"
        )
    table = "\n".join(lines)
    print(table)
    try:
        (root / "credit_accuracy.md").write_text(
            f"`python benchmarks/credit_accuracy.py table --setting {a.setting}`\n\n{table}\n"
        )
    except OSError as e:
        usage_error(f"{root / 'credit_accuracy.md'}: cannot write the table ({e.strerror or e})")
    print(f"table: {root / 'credit_accuracy.md'}")


def cmd_calibrate(a) -> None:
    """The setting's calibration from GRPO's runs: step-0 greedy accuracy, mean completion length and share of mixed
    groups over the first 10 steps, and the median first wrong line of the failed completions it recorded."""
    root = Path(a.results) / a.setting / "grpo"
    runs = sorted(root.glob("seed*.jsonl"))
    if not runs:
        usage_error(
            f"no GRPO runs under {root}: run `credit_accuracy.py run --setting {a.setting} --methods grpo` first"
        )
    step0, lengths, mixed, first = [], [], [], []
    for f in runs:
        rows = read_metrics(f)
        step0 += [r["eval/accuracy"] for r in rows if r["step"] == 0 and "eval/accuracy" in r]
        early = [r for r in rows if 1 <= r["step"] <= 10 and "completions/mean_length" in r]
        lengths += [r["completions/mean_length"] for r in early]
        mixed += [1 - r["frac_reward_zero_std"] for r in early if "frac_reward_zero_std" in r]
        gz = f.with_name(f.name.replace(".jsonl", ".credit.jsonl.gz"))
        for row in read_credit(gz) if gz.exists() else []:
            k = first_wrong_line(row) if row["reward"] < 1 else None
            first += [k] if k is not None else []
    mean = lambda xs: float(np.mean(xs)) if xs else None  # noqa: E731  (none logged: null, not NaN, in the JSON)
    out = {
        "setting": a.setting,
        "seeds": len(runs),
        "step0_greedy_accuracy": mean(step0),
        "mean_completion_tokens_steps_1_10": mean(lengths),
        "mixed_group_share_steps_1_10": mean(mixed),
        "median_first_wrong_line": float(np.median(first)) if first else None,
        "failed_completions": len(first),
    }
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the learning-curve runs, recording every row's credit at each evaluation step")
    r.add_argument("--setting", choices=list(lc.SETTINGS), default="long")
    r.add_argument("--methods", nargs="*", help=f"default: all of {list(lc.METHODS)}")
    r.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    r.add_argument("--steps", type=int, default=150)
    r.add_argument("--eval-every", type=int, default=10)
    r.add_argument("--workers", type=int, default=1, help="runs at a time")
    r.add_argument("--threads", type=int, default=1, help="torch threads per run (results depend on it)")
    r.add_argument("--log-credit", type=int, default=100_000, help="rows recorded per evaluation step (all of them)")
    r.add_argument("--extra", default="", help="extra flags for every script, one string (with --tag: an ablation)")
    r.add_argument("--tag", default="", help="results go to <method>@<tag>/ (e.g. sc_grpo@logratio)")
    r.add_argument("--results", default=str(lc.RESULTS))
    p = sub.add_parser("report", help="one JSON line per run, from its credit records alone")
    p.add_argument("runs", nargs="+", help="run directories (holding credit.jsonl) or credit .jsonl / .jsonl.gz files")
    p.add_argument("--by-step", action="store_true", help="also each recorded step's figures")
    t = sub.add_parser("table", help="the per-method table over seeds (docs/benchmarks.md)")
    t.add_argument("--setting", default="long")
    t.add_argument("--results", default=str(lc.RESULTS))
    c = sub.add_parser("calibrate", help="the setting's calibration, from GRPO's runs")
    c.add_argument("--setting", default="long")
    c.add_argument("--results", default=str(lc.RESULTS))
    a = ap.parse_args()
    try:
        {"run": cmd_run, "report": cmd_report, "table": cmd_table, "calibrate": cmd_calibrate}[a.cmd](a)
    except BadInput as e:  # a damaged or empty credit or metrics file: one line naming it, exit code 2
        usage_error(str(e))


if __name__ == "__main__":
    main()

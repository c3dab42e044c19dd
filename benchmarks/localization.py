"""Benchmark: masking versus localization in the reset methods, and what kind of line a completion first gets wrong.

SRPO (`srpo`: the policy names the first wrong line of a failed parent), RRPO (`rrpo`: a uniformly random line) and
the oracle (`srpo_oracle`: the task's true first wrong line) all resample a suffix after a kept prefix and train the
suffix only (the prefix is masked). Whether SRPO's gains come from *where* it resets (localization) or from masking
a prefix at all, RRPO is the control. Three measures, from the runs learning_curves.py / credit_accuracy.py `run`
keep under benchmarks/results/<setting>/<method>/ (seed<k>.jsonl and seed<k>.credit.jsonl.gz):

    python benchmarks/localization.py --setting long            # prints and writes results/long/localization.md
    python benchmarks/localization.py --setting long --json     # one JSON line per figure; writes nothing

(a) Localization (`localization_share`): over a run's training steps, the share of reset points placed at or before
    the parent's first wrong line, i.e. whose kept prefix holds no error: 1 - reset/oracle_after, each step weighted
    by its reset/num_parents (srpo.py logs both for every step, from arith's oracle:
    rlvr_utils/methods/chains.reset_metrics; the oracle line is clipped to the parent's lines). `exact` is the same
    weighting of reset/oracle_exact. Per seed, then the mean over seeds with a 95% Student-t interval, and each
    self-localizing method minus RRPO, paired by seed (the seeds both finished), with the t-interval of the per-seed
    differences.
(b) Reset-row credit AUC (`reset_row_auc`): credit_accuracy.py's AUC (the probability that a token of the first wrong
    line gets more blame than a token of an earlier line; its definition, `completion_scores`) over the recorded
    rows whose trained suffix starts after the first response token (signals.reset_at > 0), every recorded step
    pooled per seed; mean over seeds with a t-interval, and minus RRPO paired by seed. `scored` counts the reset rows
    the AUC is defined on (failed, first wrong line >= 2 and holding a token) of `reset_rows`. Masking alone already
    puts zero blame on the prefix, so RRPO's figure is what masking buys; the difference is what placement adds.
(c) First-wrong-line classes (`first_error_class`, rules in its docstring): over every recorded completion of every
    method (seeds and steps pooled), the shares of slip / wrong_value / skipped_or_reordered / foreign / other among
    the failed completions, and among the correct ones (reward 1) that still hold a wrong line (an operation done
    out of order still sums to the right answer), with the share of correct completions that do. The reset methods'
    rows are split into fresh (reset_at = 0: whole samples of the policy, comparable with the other methods) and
    reset rows (a kept prefix, a sampled suffix).

Only finished runs count (the metrics end with an evaluation, as learning_curves.py's report requires).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import credit_accuracy as ca  # noqa: E402  (benchmarks/ is the script's own directory)
import learning_curves as lc  # noqa: E402
from harness import read_metrics  # noqa: E402

from rlvr_utils.core import tasks  # noqa: E402
from rlvr_utils.extras.credit import ARITH_PROMPT, SPECIAL  # noqa: E402  (how a recorded row is read)

CLASSES = ("slip", "wrong_value", "skipped_or_reordered", "foreign", "other")
RANDOM = "rrpo"  # the control: resets at a uniformly random line


# ----------------------------------------------------------------------------------------------
# the measures
# ----------------------------------------------------------------------------------------------
def localization_share(metrics: list[dict]) -> dict | None:
    """(a) over the training steps that logged reset placement: at_or_before = sum_s P_s * (1 - after_s) / sum_s P_s
    and exact = sum_s P_s * exact_s / sum_s P_s, with P_s = reset/num_parents, after_s = reset/oracle_after and
    exact_s = reset/oracle_exact of step s; `parents` = sum_s P_s. None when no step logged a reset."""
    rows = [r for r in metrics if "reset/oracle_after" in r and r.get("reset/num_parents")]
    parents = sum(r["reset/num_parents"] for r in rows)
    if not parents:
        return None
    before = sum(r["reset/num_parents"] * (1 - r["reset/oracle_after"]) for r in rows) / parents
    exact = sum(r["reset/num_parents"] * r["reset/oracle_exact"] for r in rows) / parents
    return {"at_or_before": before, "exact": exact, "parents": parents}


def is_reset_row(row: dict) -> bool:
    """A recorded row whose trained suffix starts after the first response token (a kept, masked prefix)."""
    return row.get("signals", {}).get("reset_at", 0) > 0


def reset_row_auc(rows: list[dict]) -> dict:
    """(b) credit_accuracy's summary (auc, auc_nonzero, ...) over the reset rows among `rows`, with `reset_rows` (how
    many there are) and `scored` (how many the AUC is defined on)."""
    resets = [r for r in rows if is_reset_row(r)]
    scores = [s for s in map(ca.completion_scores, resets) if s is not None]
    return {**ca.summarize(scores), "scored": len(scores), "reset_rows": len(resets)}


def first_error_class(problem: tasks.ArithProblem | str, completion: str) -> tuple[int, str, str] | None:
    """(c) The completion's first wrong line k (tasks.arith_first_error: 1-based over its non-empty lines), its class
    and a detail; None when no line is wrong.

    The problem is a start v_0 and operations o_1..o_n, o_i = (op_i, b_i); v_i is the running value after o_i, and a
    right line i <= n reads `v_{i-1}<op_i>b_i=v_i` (tasks.ARITH_STEP_RE: `a<op>b=c`, spaces allowed), line n + 1
    `#### v_n`. Lines 1..k-1 are right, so the operations still to do at line k are o_k..o_n (none when k = n + 1).
    Line L = the completion's k-th non-empty line:
      other                 L is absent (the completion stopped; detail `missing`) or does not match `a<op>b=c`:
                            a `####` line (an answer where an operation is due, or a wrong answer at k = n + 1;
                            detail `answer`) or anything else (two operations on one line, `96=15`; detail `garbled`);
    otherwise L = `a<op>b=c` with its operation (op, b):
      slip                  (op, b) = o_k and a = v_{k-1}: the next operation on the right running value, with a wrong
                            result (c != v_k: were it right the line would be right);
      wrong_value           (op, b) = o_k and a != v_{k-1}: the next operation on a value other than the running one
                            (a copy error such as `876+1=86` after a line ending in 87), whatever c is;
      skipped_or_reordered  (op, b) = o_j for some j > k: an operation of the problem still to do, but not the next
                            one (skipped ahead or out of order), whatever a and c are;
      foreign               (op, b) is none of o_k..o_n: an operation already done, a flipped sign, an operand the
                            problem does not have, or any operation line once all n are done (k = n + 1).
    The detail is `arith_ok` / `arith_bad` (c = a<op>b or not) for the four operation classes.
    With 16 operations drawn from 18 (sign, operand) pairs, a wrong operation often matches a later one by chance:
    skipped_or_reordered is an upper bound on deliberate skips."""
    if isinstance(problem, str):
        problem = tasks.parse_arith_problem(problem)
    k = tasks.arith_first_error(problem, completion)
    if k is None:
        return None
    lines = [ln for ln in completion.split("\n") if ln.strip()]
    if k > len(lines):
        return k, "other", "missing"
    m = tasks.ARITH_STEP_RE.match(lines[k - 1])
    if not m:
        return k, "other", "answer" if tasks.ANSWER_LINE_RE.match(lines[k - 1]) else "garbled"
    a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
    detail = "arith_ok" if c == (a + b if op == "+" else a - b) else "arith_bad"
    remaining = problem.ops[k - 1 :]  # o_k..o_n (empty at k = n + 1)
    if remaining and (op, b) == remaining[0]:
        running = ([problem.start] + problem.values())[k - 1]
        return k, "slip" if a == running else "wrong_value", detail
    return k, "skipped_or_reordered" if (op, b) in remaining[1:] else "foreign", detail


def classify_row(row: dict) -> tuple[int, str, str] | None:
    """first_error_class of a recorded row: its problem from the prompt, its text as the verifier saw it (the recorded
    tokens without special tokens, as rlvr_utils.extras.credit.first_wrong_line reads them). None: not an arith prompt,
    or no wrong line."""
    m = ARITH_PROMPT.search(row["prompt"])
    if m is None:
        return None
    text = "".join(t for t in row["tokens"] if not SPECIAL.fullmatch(t))
    return first_error_class(m.group(1), text)


def class_shares(rows: list[dict]) -> dict:
    """(c) over `rows`: `failed` (reward < 1) and `correct` (reward 1) counts; for each of the two sets the class
    shares of its first wrong lines (`failed_shares`, `correct_shares`: over the completions of the set that hold a
    wrong line) and the share of `other` lines that are `####` lines (`*_other_answer`); `correct_with_wrong_line`
    (the count) and its share of `correct`; `failed_without_wrong_line` (a failure arith_first_error finds no wrong
    line in: expected 0)."""
    out: dict = {}
    for name, chosen in (
        ("failed", [r for r in rows if r["reward"] < 1]),
        ("correct", [r for r in rows if r["reward"] >= 1]),
    ):
        found = [c for c in map(classify_row, chosen) if c is not None]
        out[name] = len(chosen)
        out[f"{name}_shares"] = {k: sum(c[1] == k for c in found) / len(found) if found else None for k in CLASSES}
        other = [c for c in found if c[1] == "other"]
        out[f"{name}_other_answer"] = sum(c[2] == "answer" for c in other) / len(other) if other else None
        out[f"{name}_classified"] = len(found)
    out["correct_with_wrong_line"] = out.pop("correct_classified")
    out["correct_with_wrong_line_share"] = out["correct_with_wrong_line"] / out["correct"] if out["correct"] else None
    out["failed_without_wrong_line"] = out["failed"] - out.pop("failed_classified")
    return out


def paired_diff(a: dict[int, float], b: dict[int, float]) -> tuple[int, tuple]:
    """(n, t_interval of a[k] - b[k]) over the n seeds k in both; (0, (None, None, None)) when none is."""
    shared = sorted(set(a) & set(b))
    return len(shared), lc.t_interval([a[k] - b[k] for k in shared]) if shared else (None, None, None)


# ----------------------------------------------------------------------------------------------
# reading the runs
# ----------------------------------------------------------------------------------------------
def reset_kind(method_dir: Path) -> str | None:
    """The run's --reset (self / random / oracle) from its meta.json command, else from learning_curves.METHODS by
    the name before any @tag; None for a method without resets."""
    meta = method_dir / "meta.json"
    cmd = json.loads(meta.read_text()).get("command", []) if meta.is_file() else []
    cmd = cmd or lc.METHODS.get(method_dir.name.split("@")[0], [])
    return cmd[cmd.index("--reset") + 1] if "--reset" in cmd[:-1] else None


def finished_runs(method_dir: Path) -> dict[int, Path]:
    """seed -> metrics file of the runs that finished (the last row holds an evaluation)."""
    out = {}
    for f in sorted(method_dir.glob("seed*.jsonl")):
        rows = read_metrics(f)
        if rows and "eval/accuracy" in rows[-1]:
            out[int(f.stem[4:])] = f
    return out


def collect(root: Path) -> dict:
    """method -> {"reset": kind, "loc": {seed: localization_share}, "auc": {seed: reset_row_auc},
    "rows": {"all" | "fresh" | "reset": recorded rows, seeds pooled}}."""
    out = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        runs = finished_runs(d)
        if not runs:
            continue
        kind = reset_kind(d)
        m = out[d.name] = {"reset": kind, "loc": {}, "auc": {}, "rows": {}}
        for seed, f in runs.items():
            if kind is not None:
                loc = localization_share(read_metrics(f))
                if loc is not None:
                    m["loc"][seed] = loc
            credit = lc.credit_path(f)
            if not credit.is_file():
                continue
            rows = ca.read_credit(credit)
            if kind is None:
                m["rows"].setdefault("all", []).extend(rows)
                continue
            m["auc"][seed] = reset_row_auc(rows)
            for r in rows:
                m["rows"].setdefault("reset" if is_reset_row(r) else "fresh", []).append(r)
    return out


# ----------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------
def records(data: dict) -> list[dict]:
    """The report's figures, one dict per table row (the --json lines)."""
    out = []
    resets = [m for m in sorted(data, key=lambda x: ("@" in x, x)) if data[m]["reset"] is not None]
    control = data.get(RANDOM, {})
    for m in resets:
        loc, auc = data[m]["loc"], data[m]["auc"]
        before = {k: v["at_or_before"] for k, v in loc.items()}
        if before:
            n, d = paired_diff(before, {k: v["at_or_before"] for k, v in control.get("loc", {}).items()})
            out.append(
                dict(
                    table="localization",
                    method=m,
                    reset=data[m]["reset"],
                    seeds=sorted(loc),
                    per_seed=[round(loc[k]["at_or_before"], 4) for k in sorted(loc)],
                    at_or_before=lc.t_interval(list(before.values())),
                    exact=lc.t_interval([v["exact"] for v in loc.values()]),
                    parents_per_seed=[loc[k]["parents"] for k in sorted(loc)],
                    minus_random_n=n if m != RANDOM else 0,
                    minus_random=d if m != RANDOM else (None, None, None),
                )
            )
        scored = {k: v["auc"] for k, v in auc.items() if v["auc"] is not None}
        if auc:
            n, d = paired_diff(scored, {k: v["auc"] for k, v in control.get("auc", {}).items() if v["auc"] is not None})
            nonzero = [v["auc_nonzero"] for v in auc.values() if v["auc_nonzero"] is not None]
            out.append(
                dict(
                    table="reset_row_auc",
                    method=m,
                    seeds=sorted(auc),
                    per_seed=[round(auc[k]["auc"], 4) if auc[k]["auc"] is not None else None for k in sorted(auc)],
                    scored_per_seed=[auc[k]["scored"] for k in sorted(auc)],
                    reset_rows_per_seed=[auc[k]["reset_rows"] for k in sorted(auc)],
                    auc=lc.t_interval(list(scored.values())) if scored else (None, None, None),
                    auc_nonzero=lc.t_interval(nonzero) if nonzero else (None, None, None),
                    minus_random_n=n if m != RANDOM else 0,
                    minus_random=d if m != RANDOM else (None, None, None),
                )
            )
    for m in sorted(data, key=lambda x: ("@" in x, x != "grpo", x)):
        for kind, rows in sorted(data[m]["rows"].items(), key=lambda kv: kv[0] == "reset"):
            out.append(dict(table="first_error", method=m, rows=kind, **class_shares(rows)))
    return out


def minus_text(r: dict, ci) -> str:
    """The paired difference from RRPO with its seed count: `+0.016 [-0.132, +0.163] (n=3)`, `+0.057 (one seed)`."""
    n = r["minus_random_n"]
    return "–" if not n else ci(r["minus_random"], "+") + (f" (n={n})" if n > 1 else "")


def markdown(recs: list[dict], setting: str) -> str:
    ci = lambda t, sign="": lc.fmt_ci(t, sign) if t[0] is not None else "–"  # noqa: E731
    loc = [r for r in recs if r["table"] == "localization"]
    auc = [r for r in recs if r["table"] == "reset_row_auc"]
    cls = [r for r in recs if r["table"] == "first_error"]
    out = [
        f"`python benchmarks/localization.py --setting {setting}`",
        "",
        "Masking versus localization (benchmarks/localization.py's docstring defines each figure). Mean over seeds "
        "with its 95% Student-t interval over seeds; minus RRPO: paired by seed (n seeds both finished), the "
        "t-interval of the per-seed differences.",
        "",
        "(a) Reset points at or before the parent's first wrong line (the kept prefix holds no error), every training "
        "step, weighted by its number of parents:",
        "",
        "| method | reset | seeds | per seed | at or before, 95% t | exactly at, 95% t | minus RRPO, paired 95% t "
        "| parents per seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in loc:
        minus = minus_text(r, ci)
        out.append(
            f"| {r['method']} | {r['reset']} | {len(r['seeds'])} | {', '.join(f'{x:.3f}' for x in r['per_seed'])} | "
            f"{ci(r['at_or_before'])} | {ci(r['exact'])} | {minus} | {', '.join(map(str, r['parents_per_seed']))} |"
        )
    out += [
        "",
        "(b) Credit AUC (credit_accuracy.py's) on the reset rows only (reset_at > 0), recorded steps pooled per seed; "
        "RRPO is the control (masking alone):",
        "",
        "| method | seeds | per seed | AUC, 95% t | AUC, rows with credit, 95% t | minus RRPO, paired 95% t "
        "| scored reset rows per seed (of reset rows) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in auc:
        minus = minus_text(r, ci)
        per = ", ".join("–" if x is None else f"{x:.3f}" for x in r["per_seed"])
        counts = ", ".join(f"{s} ({t})" for s, t in zip(r["scored_per_seed"], r["reset_rows_per_seed"]))
        out.append(
            f"| {r['method']} | {len(r['seeds'])} | {per} | {ci(r['auc'])} | {ci(r['auc_nonzero'])} | {minus} | "
            f"{counts} |"
        )
    out += [
        "",
        "(c) The first wrong line of the recorded completions (every evaluation step's batch, seeds pooled), by class "
        "(rules: `first_error_class`); failed completions, and correct ones (reward 1) that still hold a wrong line. "
        "rows: all (methods without resets), fresh (reset_at = 0) or reset rows.",
        "",
        "| method | rows | completions | slip | wrong_value | skipped_or_reordered | foreign | other (of which ####) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    pct = lambda x: "–" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    for r in cls:
        for name in ("failed", "correct"):
            s = r[f"{name}_shares"]
            what = f"{r['correct_with_wrong_line']} of {r['correct']} correct"
            what = (
                f"{r['failed']} failed" if name == "failed" else f"{what} ({pct(r['correct_with_wrong_line_share'])})"
            )
            out.append(
                f"| {r['method']} | {r['rows']} | {what} | {pct(s['slip'])} | {pct(s['wrong_value'])} | "
                f"{pct(s['skipped_or_reordered'])} | {pct(s['foreign'])} | {pct(s['other'])} "
                f"({pct(r[f'{name}_other_answer'])}) |"
            )
    missing = sum(r["failed_without_wrong_line"] for r in cls)
    if missing:
        out += ["", f"{missing} failed completions hold no wrong line by arith_first_error (left out of the shares)."]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", default="long")
    ap.add_argument("--results", default=str(lc.RESULTS))
    ap.add_argument("--json", action="store_true", help="one JSON line per table row; writes nothing")
    ap.add_argument("--out", help="where the markdown goes (default: results/<setting>/localization.md)")
    a = ap.parse_args()
    root = Path(a.results) / a.setting
    if not root.is_dir():
        sys.exit(f"no results under {root}")
    recs = records(collect(root))
    if not recs:
        sys.exit(f"no finished runs under {root}")
    if a.json:
        for r in recs:
            print(json.dumps(r))
        return
    text = markdown(recs, a.setting)
    print(text)
    out = Path(a.out) if a.out else root / "localization.md"
    out.write_text(text + "\n")
    print(f"report: {out}")


if __name__ == "__main__":
    main()

"""benchmarks/localization.py: reset placement, the reset-row credit AUC and the first-wrong-line classes, each against
hand-computed values, and its CLI on a small results tree."""

import gzip
import json
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def loc():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import localization

        yield localization
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


PROBLEM = "5+3+2-4"  # running values 8, 10, 6; answer 6
RIGHT = "5+3=8\n8+2=10\n10-4=6\n#### 6"


@pytest.mark.parametrize(
    "completion, expected",
    [
        (RIGHT, None),
        ("5+3=8\n8+2=11\n11-4=7\n#### 7", (2, "slip", "arith_bad")),  # next operation, right value, wrong sum
        ("5+3=8\n9+2=11\n11-4=7\n#### 7", (2, "wrong_value", "arith_ok")),  # next operation on 9, not 8
        ("6+3=9\n9+2=11\n11-4=7\n#### 7", (1, "wrong_value", "arith_ok")),  # the start copied wrong
        ("5+3=8\n8-4=4\n4+2=6\n#### 6", (2, "skipped_or_reordered", "arith_ok")),  # -4 before +2: right answer
        ("5+3=8\n9-4=4\n4+2=6\n#### 6", (2, "skipped_or_reordered", "arith_bad")),  # a later one, a and c aside
        ("5+3=8\n8+3=11\n11-4=7\n#### 7", (2, "foreign", "arith_ok")),  # +3 again: already done
        ("5+3=8\n8-2=6\n6-4=2\n#### 2", (2, "foreign", "arith_ok")),  # the sign flipped
        ("5+3=8\n8+7=15\n15-4=11\n#### 11", (2, "foreign", "arith_ok")),  # an operand the problem lacks
        ("5+3=8\n8+2=10\n10-4=6\n6-4=2\n#### 2", (4, "foreign", "arith_ok")),  # an operation after all three
        ("5+3=8\n#### 8", (2, "other", "answer")),  # an answer where an operation is due
        ("5+3=8\n8+2=10\n10-4=6\n#### 7", (4, "other", "answer")),  # a wrong answer line
        ("5+3=8\n8+2-4=6\n#### 6", (2, "other", "garbled")),  # two operations on one line
        ("5+3=8\n8+2=10", (3, "other", "missing")),  # stopped before line 3
    ],
)
def test_first_error_class_by_hand(loc, completion, expected):
    assert loc.first_error_class(PROBLEM, completion) == expected


def test_the_next_operation_wins_over_an_equal_later_one(loc):
    # 5+2+2: a wrong sum on the second +2 is a slip (the next operation), not a skip to the third
    assert loc.first_error_class("5+2+2", "5+2=7\n7+2=8\n8+2=10\n#### 10") == (2, "slip", "arith_bad")
    # blank lines do not count and spaces are allowed (arith_first_error's numbering and ARITH_STEP_RE)
    assert loc.first_error_class("5+2+2", " 5 + 2 = 7\n\n7+2 = 8\n8+2=10\n#### 10") == (2, "slip", "arith_bad")
    # one operation more than the problem has, right arithmetic: foreign at line n + 1
    assert loc.first_error_class("5+2+2", "5+2=7\n7+2=9\n9+2=11\n#### 11") == (3, "foreign", "arith_ok")


def row(text: str, credit: list[float] | None = None, reward: float = 0.0, reset_at: int = 0, step: int = 10) -> dict:
    """A credit.jsonl row of a character-level completion (one token per character, as the tiny model's)."""
    credit = credit if credit is not None else [0.0] * len(text)
    assert len(credit) == len(text)
    out = {"step": step, "prompt": f"Solve: {PROBLEM}\n", "reward": reward, "tokens": list(text), "credit": credit}
    return out | {"signals": {"reset_at": float(reset_at)}}


def test_classify_row_reads_the_prompt_and_drops_special_tokens(loc):
    r = row("5+3=8\n8+2=11\n11-4=7\n#### 7")
    r["tokens"] = [*r["tokens"], "<eos>"]
    assert loc.classify_row(r) == (2, "slip", "arith_bad")
    assert loc.classify_row(r | {"prompt": "What is 2+2?"}) is None  # not an arith prompt


def test_class_shares_by_hand(loc):
    rows = [
        row("5+3=8\n8+2=11\n11-4=7\n#### 7"),  # failed: slip
        row("5+3=8\n9+2=11\n11-4=8\n#### 8"),  # failed: wrong_value
        row("5+3=8\n#### 8"),  # failed: other (answer)
        row("5+3=8\n8+2-4=6\n#### 6"),  # failed: other (garbled)
        row("5+3=8\n8-4=4\n4+2=6\n#### 6", reward=1.0),  # correct with a reordered line
        row(RIGHT, reward=1.0),  # correct throughout
    ]
    s = loc.class_shares(rows)
    assert (s["failed"], s["correct"], s["correct_with_wrong_line"], s["failed_without_wrong_line"]) == (4, 2, 1, 0)
    assert s["failed_shares"] == {
        "slip": 0.25,
        "wrong_value": 0.25,
        "skipped_or_reordered": 0.0,
        "foreign": 0.0,
        "other": 0.5,
    }
    assert s["failed_other_answer"] == 0.5 and s["correct_other_answer"] is None
    assert s["correct_shares"]["skipped_or_reordered"] == 1.0 and s["correct_with_wrong_line_share"] == 0.5


def test_localization_share_weights_steps_by_their_parents(loc):
    metrics = [
        {"step": 0, "eval/accuracy": 0.3},  # no reset logged
        {"step": 1, "reset/num_parents": 8, "reset/oracle_exact": 0.375, "reset/oracle_after": 0.5},
        {"step": 2, "reset/num_parents": 2, "reset/oracle_exact": 0.5, "reset/oracle_after": 0.0},
        {"step": 3, "reset/num_parents": 0, "reset/oracle_exact": 0.0, "reset/oracle_after": 1.0},  # no parents
    ]
    s = loc.localization_share(metrics)
    # at or before: (8 * 0.5 + 2 * 1) / 10; exact: (8 * 0.375 + 2 * 0.5) / 10 (a plain mean of steps would give 0.75)
    assert s == pytest.approx({"at_or_before": 0.6, "exact": 0.4, "parents": 10})
    assert loc.localization_share(metrics[:1]) is None


WRONG = "5+3=8\n8+2=11\n11-4=7\n#### 7"  # first wrong line 2; line 1 holds 6 tokens, line 2 holds 7


def test_reset_row_auc_keeps_the_reset_rows_only(loc):
    masked = row(WRONG, [0.0] * 6 + [-1.0] * (len(WRONG) - 6), reset_at=6)  # prefix = line 1, masked: AUC 1
    half = row(WRONG, [0.0] * 3 + [-1.0] * (len(WRONG) - 3), reset_at=3)  # prefix = half of line 1: 3 of 6 below
    fresh = row(WRONG, [-1.0] * len(WRONG))  # uniform credit: 0.5, but not a reset row
    zero = row(WRONG, reset_at=6)  # an all-equal group: no credit anywhere, counts 0.5
    solved = row(RIGHT, [1.0] * len(RIGHT), reward=1.0, reset_at=6)  # a reset row the AUC is not defined on
    s = loc.reset_row_auc([masked, half, fresh, zero, solved])
    # line-2 blame 1 against line-1 blames (0,0,0,0,0,0) -> 1; against (0,0,0,1,1,1) -> (3 + 3/2) / 6 = 0.75
    assert s["auc"] == pytest.approx((1 + 0.75 + 0.5) / 3) and s["auc_nonzero"] == pytest.approx((1 + 0.75) / 2)
    assert (s["scored"], s["reset_rows"]) == (3, 4)


def test_paired_diff_uses_the_shared_seeds(loc):
    n, (m, lo, hi) = loc.paired_diff({1: 0.8, 2: 0.7, 3: 0.9}, {1: 0.6, 2: 0.7, 4: 0.1})
    # seeds 1 and 2: differences 0.2 and 0.0; mean 0.1, sd 0.1414, half-width 12.706 * 0.1414 / sqrt(2) = 1.2706
    assert n == 2 and m == pytest.approx(0.1) and (lo, hi) == pytest.approx((0.1 - 1.27062, 0.1 + 1.27062), abs=1e-4)
    assert loc.paired_diff({1: 0.5}, {2: 0.5}) == (0, (None, None, None))


def write_run(d, seed, placements, credit_rows, finished=True):
    """A run's metrics (step 0 evaluation, one training step per (num_parents, oracle_after), the final evaluation)
    and its credit records."""
    d.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "eval/accuracy": 0.3}]
    rows += [
        {"step": i, "reset/num_parents": p, "reset/oracle_exact": 0.0, "reset/oracle_after": a}
        for i, (p, a) in enumerate(placements, 1)
    ]
    if finished:
        rows.append({"step": len(placements) + 1, "eval/accuracy": 0.4})
    (d / f"seed{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / f"seed{seed}.credit.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in credit_rows).encode())
    )


def test_cli_on_a_small_results_tree(tmp_path):
    root = tmp_path / "long"
    masked = row(WRONG, [0.0] * 6 + [-1.0] * (len(WRONG) - 6), reset_at=6)  # reset-row AUC 1
    zero = row(WRONG, reset_at=6)  # reset-row AUC 0.5
    slip = row(WRONG)  # a fresh failed row: slip at line 2
    write_run(root / "srpo", 1, [(4, 0.5), (4, 0.0)], [masked, slip])  # at or before: (2 + 4) / 8 = 0.75
    write_run(root / "srpo", 2, [(2, 0.0)], [masked])  # 1.0
    write_run(root / "srpo", 3, [(2, 1.0)], [zero], finished=False)  # unfinished: left out
    write_run(root / "rrpo", 1, [(4, 0.5)], [zero])  # 0.5
    write_run(root / "rrpo", 2, [(4, 0.25)], [zero, zero])  # 0.75
    (root / "srpo@x").mkdir()
    (root / "srpo@x" / "meta.json").write_text(json.dumps({"command": ["srpo.py", "--reset", "self", "--y"]}))
    write_run(root / "srpo@x", 2, [(1, 0.0)], [masked])
    write_run(root / "grpo", 1, [], [slip, row("5+3=8\n8-4=4\n4+2=6\n#### 6", reward=1.0), row(RIGHT, reward=1.0)])
    cmd = [sys.executable, "benchmarks/localization.py", "--setting", "long", "--results", str(tmp_path)]
    js = subprocess.run([*cmd, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert js.returncode == 0, js.stderr
    recs = [json.loads(line) for line in js.stdout.splitlines()]
    assert not (root / "localization.md").exists()  # --json writes nothing
    by = {(r["table"], r["method"], r.get("rows")): r for r in recs}
    s = by["localization", "srpo", None]
    assert s["reset"] == "self" and s["seeds"] == [1, 2] and s["per_seed"] == [0.75, 1.0]
    assert s["at_or_before"][0] == pytest.approx(0.875) and s["minus_random_n"] == 2
    assert s["minus_random"][0] == pytest.approx(((0.75 - 0.5) + (1.0 - 0.75)) / 2)  # paired by seed: 0.25, 0.25
    assert s["minus_random"][1] == pytest.approx(0.25) and s["minus_random"][2] == pytest.approx(0.25)
    assert by["localization", "rrpo", None]["minus_random_n"] == 0
    x = by["localization", "srpo@x", None]
    assert x["reset"] == "self" and x["minus_random_n"] == 1 and x["minus_random"][1] is None  # one seed
    a = by["reset_row_auc", "srpo", None]
    assert a["per_seed"] == [1.0, 1.0] and a["scored_per_seed"] == [1, 1] and a["minus_random"][0] == pytest.approx(0.5)
    assert by["reset_row_auc", "rrpo", None]["reset_rows_per_seed"] == [1, 2]
    g = by["first_error", "grpo", "all"]
    assert (g["failed"], g["correct"], g["correct_with_wrong_line"]) == (1, 2, 1) and g["failed_shares"]["slip"] == 1.0
    f = by["first_error", "srpo", "fresh"]
    assert f["failed"] == 1 and by["first_error", "srpo", "reset"]["failed"] == 2
    md = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert md.returncode == 0, md.stderr
    text = (root / "localization.md").read_text()
    assert "| srpo | self | 2 | 0.750, 1.000 | 0.875 [" in text and "| +0.250 [+0.250, +0.250] (n=2) | 8, 2 |" in text
    assert "| srpo@x | self | 1 | 1.000 | 1.000 (one seed) | 0.000 (one seed) | +0.250 (one seed) | 1 |" in text
    assert "| grpo | all | 1 of 2 correct (50.0%) | 0.0% | 0.0% | 100.0% |" in text
    assert "| grpo | all | 1 failed | 100.0% |" in text

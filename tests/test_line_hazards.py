"""benchmarks/line_hazards.py: each figure against a hand-computed value, the best problem against a brute force over
every problem, the per-line rates against a plain forward pass of the bundled model, and the script's entry point."""

import itertools
import json
import math
import random
import sys

import pytest
import torch
from conftest import TINY_MODEL
from helpers import ROOT, run_script

import common
from rlvr_utils.core import tasks

sys.path.insert(0, str(ROOT / "benchmarks"))
import line_hazards as lh  # noqa: E402
import premises  # noqa: E402


def test_line_rates_and_first_error_by_hand():
    h = lh.line_rates([-0.1, -0.2, -0.3, -0.4], [1, 1, 2, 3], 3)
    assert h == pytest.approx([1 - math.exp(-0.3), 1 - math.exp(-0.3), 1 - math.exp(-0.4)])
    assert lh.first_error([0.5, 0.2, 1.0]) == pytest.approx([0.5, 0.1, 0.4])  # 0.5; 0.5 * 0.2; 0.5 * 0.8 * 1
    f = lh.predicted([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.2]])  # L = 4: line 1 alone is the first quarter
    # row 1: P(k) = .5, .25 (fails .75, early .5); row 2: P(4) = .2 (fails .2, early 0)
    assert f["early"] == pytest.approx(0.5 / 0.95) and f["exact"] == pytest.approx((0.25 + 0.8) / 2)
    assert f["position"] == pytest.approx((0.5 * 0 + 0.25 * 0.25 + 0.2 * 0.75) / 0.95)


def test_quarter_is_premises_first_quarter():
    assert [lh.quarter(k, 7) for k in range(1, 8)] == [0, 0, 1, 1, 2, 2, 3]
    for n in range(2, 40):
        for k in range(1, n + 1):
            assert (lh.quarter(k, n) == 0) == (premises.first_quarter([k], [n])["early"] == 1.0)
            assert 0 <= lh.quarter(k, n) <= 3


@pytest.mark.parametrize(
    "a, op, c, kind",
    [(7, "+", 15, "+ 1->2"), (5, "-", 2, "- 1->1"), (12, "-", 4, "- 2->1"), (23, "-", 18, "- 2->2 <20"),
     (45, "+", 52, "+ 2->2 20-49"), (60, "-", 55, "- 2->2 >=50"), (99, "+", 104, "+ 2->3")],
)  # fmt: skip
def test_line_kind_by_hand(a, op, c, kind):
    assert lh.line_kind(a, op, c) == kind


def _share(rates, p, answer):
    """A problem's first-quarter share of failures from its lines' rates, written out directly."""
    a = [p.start, *p.values()]
    L = len(p.ops) + 1
    h = [rates[(lh.quarter(k, L), lh.line_kind(a[k - 1], op, a[k]))] for k, (op, _) in enumerate(p.ops, 1)]
    prob = lh.first_error([*h, answer])
    return sum(x for k, x in enumerate(prob, 1) if lh.quarter(k, L) == 0) / sum(prob)


def test_best_problem_is_the_brute_force_maximum():
    """Every problem of 4 steps, values in [0, 12], operands in [1, 3], under random rates with some kinds missing (no
    problem may use them): the dynamic program's share is the largest, and its problem has it."""
    problems = []
    for start in range(13):
        for ops in itertools.product([(op, b) for op in "+-" for b in (1, 2, 3)], repeat=4):
            p = tasks.ArithProblem(start, ops)
            if all(0 <= v <= 12 for v in p.values()):
                problems.append(p)
    kinds = {lh.line_kind(v, op, v + b if op == "+" else v - b) for v in range(13) for op in "+-" for b in (1, 2, 3)}
    for seed in range(6):
        rng = random.Random(seed)
        rates = {(q, k): rng.uniform(0.01, 0.6) for q in range(4) for k in sorted(kinds)}
        for key in rng.sample(sorted(rates), 3):
            del rates[key]
        shares = []
        for p in problems:
            a = [p.start, *p.values()]
            lines = [(lh.quarter(k, 5), lh.line_kind(a[k - 1], op, a[k])) for k, (op, _) in enumerate(p.ops, 1)]
            if all(x in rates for x in lines):
                shares.append(_share(rates, p, 0.05))
        got = lh.best_problem(rates, 4, 0.05, max_value=12, max_operand=3)
        assert len(shares) > 1000 and got["share"] == pytest.approx(max(shares))
        assert _share(rates, tasks.parse_arith_problem(got["problem"]), 0.05) == pytest.approx(max(shares))
    assert lh.best_problem({}, 4, 0.05, max_value=12, max_operand=3) is None  # no measured kind: no problem


def test_solution_rates_are_the_model_s_own_line_probabilities():
    """One problem's rates against a plain forward pass of the bundled (character-level) model: line k's tokens are its
    characters and its newline, the answer line's its characters and the stop token."""
    tok = common.load_tokenizer(str(TINY_MODEL))
    model = common.load_model(str(TINY_MODEL), torch.device("cpu"), "float32", False).eval()
    task = tasks.load_task("arith", tok, seed=2, num_eval=2, arith_num_train=10)
    e = task.eval[1]
    sol = tasks.parse_arith_problem(e.question).solution()
    ids = tok(sol, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert len(ids) == len(sol) + 1
    with torch.no_grad():
        got = lh.solution_rates(model, tok, task.eval, 4.0)[1]  # hot: the stop token's probability counts
        x = torch.tensor([e.prompt_ids + ids])
        logits = model(x).logits[0, len(e.prompt_ids) - 1 : -1].double() / 4.0
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    want, pos = [], 0
    for line in sol.split("\n"):
        want.append(1 - math.exp(lp[pos : pos + len(line) + 1].sum()))
        pos += len(line) + 1
    assert got == pytest.approx(want, abs=1e-5) and len(got) == sol.count("\n") + 1


def test_line_hazards_runs_and_writes_its_figures(tmp_path):
    out = tmp_path / "h.json"
    flags = ["--setting", "default", "--problems", "8", "--sample", "16", "--min-lines", "1", "--out", str(out)]
    r = run_script("benchmarks/line_hazards.py", *flags)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["meta"]["problems"] == 8 and len(res["profile"]) == 5  # 4 steps and the answer line
    assert 0 <= res["predicted"]["early"] <= 1 and 0 <= res["best"]["share"] <= 1
    assert res["best"]["sampled"]["samples"] == 16 and "best problem" in r.stdout

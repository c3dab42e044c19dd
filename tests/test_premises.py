"""benchmarks/premises.py: each premise's figure against a hand-computed value, its gate at the thresholds, the
departure token and its probability on the bundled model, and the script through its entry point."""

import json
import sys

import numpy as np
import pytest
import torch
from helpers import ROOT, run_script

import common
from rlvr_utils.core import rollouts, tasks
from rlvr_utils.methods.trace_diagnostics import trace_multipliers

sys.path.insert(0, str(ROOT / "benchmarks"))
import premises  # noqa: E402

SOLUTION = "23+7=30\n30-5=25\n#### 25"  # tasks.parse_arith_problem("23+7-5").solution()


def test_departure_is_the_first_character_that_differs_from_the_solution():
    assert tasks.parse_arith_problem("23+7-5").solution() == SOLUTION
    assert premises.departure_offset("23+7=30\n30-5=24\n#### 24", SOLUTION) == len("23+7=30\n30-5=2")
    assert premises.departure_offset("23+7=30", SOLUTION) == len("23+7=30")  # stopped early: at its end (the stop)
    assert premises.departure_offset("24+7=31", SOLUTION) == 1
    assert premises.departure_offset(SOLUTION, SOLUTION) is None
    assert premises.departure_offset(SOLUTION + "\nmore", SOLUTION) is None  # the whole solution is there


def test_localization_figures_by_hand():
    # named, true first wrong line, lines per parent
    f = premises.localization_figures([2, 1, 3, 4], [2, 2, 3, 1], [4, 4, 3, 2])
    assert f["rows"] == 4
    assert f["exact"] == pytest.approx(2 / 4)  # rows 0 and 2
    assert f["uniform"] == pytest.approx((1 / 4 + 1 / 4 + 1 / 3 + 1 / 2) / 4)
    # constant c (clamped to each row's lines): c=1 hits row 3; c=2 rows 0, 1; c=3 row 2; c=4 -> 4, 4, 3, 2: row 2
    assert (f["best_line"], f["best_constant"]) == (2, pytest.approx(2 / 4))
    assert f["at_or_before"] == pytest.approx(3 / 4)  # 2<=2, 1<=2, 3<=3; not 4<=1
    assert premises.localization_figures([], [], []) == {"rows": 0}


def test_srpo_gate_at_its_thresholds():
    ok = dict(rows=10, exact=0.5, uniform=0.25, best_constant=0.4, at_or_before=0.85, over_positions=0.0)
    assert premises.srpo_pass(ok)
    assert not premises.srpo_pass(ok | {"uniform": 0.2501})  # under 2x a uniform line
    assert not premises.srpo_pass(ok | {"best_constant": 0.5})  # not above the best constant guess
    assert not premises.srpo_pass(ok | {"at_or_before": 0.849})
    assert not premises.srpo_pass(ok | {"over_positions": 0.01})


def test_line_auc_by_hand():
    D = np.array([0.1, 0.2, 0.05, 0.9, 0.2, 0.3])
    lines = np.array([1, 1, 2, 2, 3, 3])
    auc, top, chance, at = premises.line_auc(D, lines, 2, departure=2)
    assert auc == pytest.approx(2 / 4)  # 0.05 beats neither 0.1 nor 0.2; 0.9 beats both
    assert top and chance == pytest.approx(2 / 4)  # the max over lines 1-2 (0.9) is on line 2, which is 2 of 4 tokens
    assert at == 0 and premises.line_auc(D, lines, 2, departure=3)[3] == 1  # the departure token alone: 0.05, 0.9
    assert premises.line_auc(D, lines, 2)[3] is None
    auc, top, _, _ = premises.line_auc(np.array([0.3, 0.2, 0.2, 0.9]), np.array([1, 2, 2, 3]), 2)
    assert auc == 0 and not top  # line 3 (after k) is not compared: the max over lines 1-2 is line 1's 0.3
    assert premises.line_auc(np.array([0.2, 0.2]), np.array([1, 2]), 2)[0] == 0.5  # a tie counts 1/2
    assert premises.line_auc(D, lines, 1) is None  # nothing before line 1
    assert premises.line_auc(D, lines, 4) is None  # line 4 has no token


def test_sc_grpo_gate_at_its_thresholds():
    ok = dict(greedy_with_solution=0.9, greedy_without=0.7, raised_rows=5, raised=0.8, anchor_raised=0.5)
    ok |= dict(auc_rows=5, d_auc=0.65)
    assert premises.sc_grpo_pass(ok)
    assert not premises.sc_grpo_pass(ok | {"greedy_with_solution": 0.89})
    assert not premises.sc_grpo_pass(ok | {"greedy_without": 0.71})  # less than 0.2 above without
    assert not premises.sc_grpo_pass(ok | {"raised": 0.79})
    assert not premises.sc_grpo_pass(ok | {"anchor_raised": 0.51})
    assert not premises.sc_grpo_pass(ok | {"d_auc": 0.64})


def test_top_entropy_share_by_hand():
    H = torch.tensor([[0.1, 0.5, 0.2, 0.9, 0.3], [0.1, 0.5, 0.2, 0.9, 99.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    # row 0: sorted 0.1 0.2 0.3 0.5 0.9, rank 0.8 * 4 = 3.2 -> 0.5 + 0.2 * 0.4 = 0.58; row 1 (4 valid): 2.4 -> 0.66
    assert premises.in_top_share(H, mask, torch.tensor([3, 3])).tolist() == [True, True]
    assert premises.in_top_share(H, mask, torch.tensor([1, 1])).tolist() == [False, False]
    H, mask = torch.tensor([[0.6, 0.1, 0.5, 0.2, 0.3, 0.4]]), torch.ones(1, 6)  # rank 0.8 * 5 = 4: the pivot is 0.5
    assert premises.in_top_share(H, mask, torch.tensor([2])).tolist() == [True]  # at the pivot: in
    assert premises.in_top_share(H, mask, torch.tensor([5])).tolist() == [False]


def test_first_quarter_by_hand():
    f = premises.first_quarter([1, 2, 5, 9], [8, 8, 8, 8])  # positions 0, 1/8, 4/8, 8/8
    assert f["early"] == pytest.approx(0.5) and f["position"] == pytest.approx((0 + 0.125 + 0.5 + 1) / 4)


def test_prefix_blame_by_hand():
    c = torch.tensor([[4.0, 3.0, 2.0, 1.0], [2.0, 2.0, 1.0, 0.0]])
    trace, uniform = premises.prefix_blame(c, [2, 1], [4, 3])
    assert trace == pytest.approx((7 / 10 + 2 / 5) / 2) and uniform == pytest.approx((2 / 4 + 1 / 3) / 2)
    # the multipliers the script takes: "recent", a = 0.5, L = 3: c = 1 + .5 + .25, 1 + .5, 1
    c = trace_multipliers(torch.tensor([3]), 0.5, 1.0, "recent", dtype=torch.float64)
    assert premises.prefix_blame(c, [1], [3])[0] == pytest.approx(1.75 / 4.25)


def test_line_span_and_value_drop_by_hand():
    text = "a\n\nbb\nc"
    assert premises.line_span(text, 2) == (3, 6) and text[3:6] == "bb\n"  # the 2nd non-empty line and its newline
    assert premises.line_span(text, 3) == (6, 7)  # the last line: up to the text's end
    f = premises.value_drop([[1, 1, 0, 1], [0, 0, 0, 0]], [[0, 0, 0, 0], [0, 1, 0, 0]])
    assert f["rows"] == 2 and f["continuations"] == 4
    assert f["drop"] == pytest.approx((0.75 - 0.25) / 2)
    half = 12.7062047 * np.std([0.75, -0.25], ddof=1) / np.sqrt(2)  # t_{0.975, 1}
    assert (f["drop_lo"], f["drop_hi"]) == (pytest.approx(0.25 - half), pytest.approx(0.25 + half))
    assert (f["v_before"], f["v_after"]) == (pytest.approx(0.375), pytest.approx(0.125))
    ok = dict(rows=40, continuations=8, drop=0.2)
    assert premises.control_pass(ok)
    assert not premises.control_pass(ok | {"rows": 39}) and not premises.control_pass(ok | {"continuations": 7})
    assert not premises.control_pass(ok | {"drop": 0.199})


def rows_of(texts, question="23+7-5"):
    """premises.Rows over hand-written completions of one problem (the bundled tokenizer, each with its stop)."""
    tok = common.load_tokenizer(common.DEFAULT_MODEL)
    task = tasks.load_task("arith", tok, num_eval=4)
    e = tasks.Example(id=3, question=question, gold="25", prompt="", prompt_ids=tok("Solve: 23+7-5\n").input_ids)
    ids = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]
    ro = rollouts.make_rollouts(tok, [e.prompt_ids] * len(texts), ids, [3] * len(texts), [tok.eos_token_id])
    return premises.Rows(ro, {3: e}, task, tok, 1.0), tok


def test_rows_find_the_wrong_line_the_departure_token_and_the_right_token():
    rows, tok = rows_of([SOLUTION, "23+7=30\n30-5=24\n#### 24", "23+7=30", "24+7=31\n31-5=26\n#### 26"])
    assert rows.failed.tolist() == [False, True, True, True]
    assert rows.with_wrong_line() == [1, 3]  # row 2 stopped early: its first wrong line (2) is not in it
    j, right = rows.departure(1)
    assert tok.decode(rows.ids[1][:j]) == "23+7=30\n30-5=2" and right == tok("5", add_special_tokens=False).input_ids[0]
    assert rows.departure(3) == (1, tok("3", add_special_tokens=False).input_ids[0])
    assert rows.departure(2) == (len("23+7=30"), tok("\n", add_special_tokens=False).input_ids[0])  # the stop departs


def test_p_token_at_is_the_models_probability_of_that_token_at_that_position():
    rows, tok = rows_of(["23+7=30\n30-5=24\n#### 24"])
    model = common.load_model(common.DEFAULT_MODEL, torch.device("cpu"), "float32")
    j, right = rows.departure(0)
    prompt = rows.examples[0].prompt_ids
    got = premises.p_token_at(model, tok, [prompt, prompt], [rows.ids[0][:j] + [right], rows.ids[0]], [j, 2], 0.7)
    with torch.no_grad():
        for n, (pos, token) in enumerate(((j, right), (2, rows.ids[0][2]))):
            logits = model(torch.tensor([prompt + rows.ids[0][:pos]])).logits[0, -1]
            want = torch.softmax(logits / 0.7, -1)[token]
            assert got[n].item() == pytest.approx(want.item(), rel=1e-4)
    assert 0.05 < got[1] < 1  # not a degenerate probability: the check can fail


def test_premises_runs_and_prints_one_object_per_method():
    sizes = ["--problems", "6", "--eval-problems", "8", "--mc-rows", "3", "--mc-continuations", "2"]
    flags = ["--setting", "default", *sizes, "--reference", common.DEFAULT_MODEL, "--json"]
    r = run_script("benchmarks/premises.py", "measure", *flags)
    assert r.returncode == 0, r.stderr[-2000:]
    out = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [o["method"] for o in out] == list(premises.METHODS)
    assert all(isinstance(o["pass"], bool) and o["gate"] == premises.GATES[o["method"]] for o in out)
    by = {o["method"]: o for o in out}
    assert 0 <= by["srpo"]["exact"] <= 1 and by["srpo"]["rows"] > 0
    assert by["grpo_lambda"]["mixed_rows"] <= by["grpo_lambda"]["rows"]  # failed rows of groups with a success
    assert by["ep_grpo"]["process_share"] == pytest.approx(0.0, abs=1e-6)  # the policy is its own reference: P = 0
    assert by["control"]["rows"] == 3 and by["control"]["continuations"] == 2
    assert not by["control"]["pass"]  # 3 rows x 2 continuations are below the gate's sizes, whatever the drop


def test_the_table_names_the_setting_and_what_a_measurement_added():
    flags = ["--model", "assets/tiny-arith-long", "--arith-steps", "16", "--max-new-tokens", "180"]
    flags += ["--arith-steps", "12", "--model", "m", "--seed", "1", "--num-generations", "8"]
    meta = {"setting": "long", "flags": flags, "label": "x"}
    assert premises.setting_text(meta) == "long + `--arith-steps 12`"  # the policy column names the model
    assert (
        premises.setting_text({"setting": "default", "flags": ["--seed", "3", "--num-generations", "8"]}) == "default"
    )
    r = {"method": "ep_grpo", "pass": True, "gate": premises.GATES["ep_grpo"], "rows": 3, "top20": 0.95}
    row = premises.table([{"meta": meta, "methods": [r]}]).splitlines()[-1]
    assert row.startswith("| long + `--arith-steps 12` | x | ep_grpo | yes | top 20% 0.950")
    assert row.endswith(f"| {premises.GATES['ep_grpo']} |")


def test_in_mixed_groups_by_hand():
    # groups 7 (rows 0-2: one success), 8 (rows 3-4: all failed), 9 (row 5: failed, alone)
    groups, failed = [7, 7, 7, 8, 8, 9], [True, False, True, True, True, True]
    assert premises.in_mixed_groups([0, 2, 3, 4, 5], groups, failed) == [0, 2]
    assert premises.in_mixed_groups([3, 5], groups, failed) == []

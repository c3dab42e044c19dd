"""GSM8K and MATH rewards (rewards.py): answer extraction, normalization and verification."""

import json
import random
import threading

import pytest
from conftest import shared_file

from rlvr_utils.extras.data import rewards


@pytest.mark.parametrize(
    "completion,gold,expected",
    [
        ("so the answer is\n#### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### $1,234.00", "... #### 1234", 1.0),
        ("The total is $18.", "#### 18", 1.0),
        ("#### 18.0", "18", 1.0),
        ("3.50 dollars", "3.5", 1.0),
        ("#### 5\nwait, #### 7", "7", 1.0),  # last #### wins
        ("#### 5\nwait, #### 7", "5", 0.0),
        ("\\boxed{42} and then 17", "42", 1.0),  # boxed beats a later stray number
        ("#### 3 \\boxed{4}", "3", 1.0),  # #### beats boxed
        ("\\boxed{\\$1,000}", "1000", 1.0),
        ("\\boxed{-4}", "-4", 1.0),
        ("I got -4", "4", 0.0),
        ("no number here", "3", 0.0),
        ("", "3", 0.0),
        ("12 apples then 0.5", "0.5", 1.0),
        ("#### 72.5", "72", 0.0),
        ("#### 720", "72", 0.0),
    ],
)
def test_gsm8k_reward_tricky(completion, gold, expected):
    assert rewards.gsm8k_reward(completion, gold) == expected


def test_gsm8k_unparsable_gold_raises():
    with pytest.raises(ValueError, match="not a number"):
        rewards.gsm8k_reward("#### 3", "#### three")


def test_gsm8k_real_file_self_consistency():
    path = shared_file("gsm8k_test.jsonl")
    rows = [json.loads(line) for line in path.open()]
    assert len(rows) > 1000
    golds = [rewards.gsm8k_gold(r["answer"]) for r in rows]
    for r, g in zip(rows, golds):
        assert rewards.gsm8k_reward(r["answer"], r["answer"]) == 1.0, r["answer"]
        assert rewards.gsm8k_reward(r["answer"], g) == 1.0
    # against another question's answer (skip the rare pairs that share an answer)
    rng = random.Random(0)
    wrong = 0
    for i, r in enumerate(rows):
        j = rng.randrange(len(rows))
        if golds[j] != golds[i]:
            assert rewards.gsm8k_reward(r["answer"], rows[j]["answer"]) == 0.0
            wrong += 1
    assert wrong > 0.9 * len(rows)


@pytest.mark.parametrize(
    "completion,gold,expected",
    [
        ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac12", 1.0),
        ("\\boxed{3}", "\\frac{1}{2}", 0.0),
        ("the answer is 1/2", "\\frac{1}{2}", 0.0),  # no \boxed{}: not rewarded
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("first \\boxed{1} then \\boxed{2}", "2", 1.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt 2", 1.0),
    ],
)
def test_math_reward(completion, gold, expected):
    assert rewards.math_reward(completion, gold) == expected


def test_math_unparsable_gold_is_an_error_never_a_reward():
    for gold in ("", "\\frac{}{"):
        with pytest.raises(ValueError, match="cannot be parsed"):
            rewards.math_reward("\\boxed{" + gold + "}", gold)


def test_math_reward_off_main_thread():
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", rewards.math_reward("\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join(30)
    assert out.get("r") == 1.0


def test_last_boxed_nested():
    assert rewards.last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert rewards.last_boxed("\\boxed{1} \\boxed{2") is None  # unbalanced last box
    assert rewards.last_boxed("nothing") is None


SHORTHAND = [  # (class, gold, the same answer written another way, a different value)
    ("brace-less fraction", "\\frac43", "\\frac{4}{3}", "\\frac{3}{4}"),
    ("brace-less fraction, spaced", "\\frac 59", "\\dfrac{5}{9}", "\\frac{5}{8}"),
    ("half-braced fraction", "\\frac7{12}", "\\frac{7}{12}", "\\frac{7}{13}"),
    ("half-braced fraction", "\\frac{150}7", "\\frac{150}{7}", "\\frac{150}{8}"),
    ("brace-less root", "5\\sqrt3", "5\\sqrt{3}", "5\\sqrt{2}"),
    ("dollars", "\\$45", "45", "46"),
    ("dollars and cents", "\\$12.50", "12.5", "12.05"),
    ("dollars, thin space", "\\$12,\\!500", "12500", "12,600"),
    ("fraction with a unit", "\\frac{150}7\\text{ degrees}", "\\frac{150}{7}", "\\frac{151}{7}\\text{ degrees}"),
    ("degrees", "90^\\circ", "90", "80^{\\circ}"),
    ("left/right", "\\left(-\\tfrac52, 1\\right)", "(-\\frac{5}{2}, 1)", "(-\\frac{5}{2}, 2)"),
    ("percent (already fine)", "10\\%", "10\\%", "11\\%"),
    ("a choice (already fine)", "\\text{(C)}", "\\text{(C)}", "\\text{(D)}"),
    ("thousands (already fine)", "1,\\!000", "1000", "1,\\!001"),
]


@pytest.mark.parametrize("kind, gold, same, different", SHORTHAND, ids=[f"{c[0]}:{c[1]}" for c in SHORTHAND])
def test_math_shorthand_latex_verifies_both_ways_and_a_different_value_does_not(kind, gold, same, different):
    box = lambda s: "so the answer is $\\boxed{" + s + "}$."  # noqa: E731
    assert rewards.math_reward(box(gold), gold) == 1.0  # character for character the gold
    assert rewards.math_reward(box(same), gold) == 1.0  # an equivalent form
    assert rewards.math_reward(box(gold), same) == 1.0  # ... both ways
    assert rewards.math_reward(box(different), gold) == 0.0  # a different value never passes
    assert rewards.math_reward(box(gold), different) == 0.0


def test_normalize_latex_leaves_other_commands_alone():
    assert rewards.normalize_latex("\\leftarrow \\rightarrow \\left(x\\right)") == "\\leftarrow \\rightarrow (x)"
    assert rewards.normalize_latex("\\sqrt[3]2 + \\frac{\\sqrt3}{2}") == "\\sqrt[3]{2} + \\frac{\\sqrt{3}}{2}"
    assert rewards.normalize_latex("\\text{(C)}") == "\\text{(C)}"

"""The built-in arith task (tasks.py): problems, solutions, the reward and the first-wrong-step oracle."""

import random

import pytest

from rlvr_utils.core import tasks


def test_arith_problem_and_solution():
    p = tasks.ArithProblem(23, (("+", 7), ("-", 5), ("+", 9)))
    assert p.text == "23+7-5+9"
    assert p.solution() == "23+7=30\n30-5=25\n25+9=34\n#### 34"
    assert tasks.parse_arith_problem("23+7-5+9") == p
    assert tasks.arith_reward(p.solution(), "34") == 1.0
    assert tasks.arith_reward("23+7=30\n#### 33", "34") == 0.0


def test_arith_generator_ranges_and_seed():
    a = [tasks.make_arith_problem(random.Random(5), steps=6, max_value=20, max_operand=3) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    rng = random.Random(0)
    for _ in range(500):
        p = tasks.make_arith_problem(rng, steps=6, max_value=20, max_operand=3)
        assert len(p.ops) == 6 and all(1 <= b <= 3 for _, b in p.ops)
        assert all(0 <= v <= 20 for v in [p.start] + p.values())
    with pytest.raises(ValueError):
        tasks.make_arith_problem(rng, steps=0)


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("23+7=30\n30-5=25\n25+9=34\n#### 34", None),
        ("23+7=31\n31-5=26\n26+9=35\n#### 35", 1),  # wrong result
        ("23+7=30\n30-6=24\n24+9=33\n#### 33", 2),  # wrong operand
        ("23+7=30\n30+5=35\n35+9=44\n#### 44", 2),  # wrong operator
        ("23+7=30\n31-5=26\n26+9=35\n#### 35", 2),  # wrong carried value
        ("23+7=30\n30-5=25\n25+9=34\n#### 35", 4),  # wrong answer line
        ("23+7=30\n30-5=25", 3),  # stopped early: first missing line
        ("", 1),
        ("23+7=30\n\n30-5=25\n25+9=34\n#### 34\n", None),  # blank lines ignored
        ("23+7=30\nhmm\n25+9=34\n#### 34", 2),  # malformed line
        ("23+7=30\n30-5=25\n25+9=34\n#### 34\nextra", None),
    ],
)
def test_arith_first_error_hand_cases(completion, expected):
    assert tasks.arith_first_error("23+7-5+9", completion) == expected


def test_arith_first_error_is_consistent_with_reward():
    """A completion with no wrong line is always rewarded; the first error is a real error."""
    rng = random.Random(1)
    for _ in range(300):
        p = tasks.make_arith_problem(rng)
        lines = p.solution().split("\n")
        k = rng.randint(1, len(lines))
        bad = list(lines)
        bad[k - 1] = bad[k - 1][:-1] + str((int(bad[k - 1][-1]) + 1) % 10)  # change the last digit
        assert tasks.arith_first_error(p, "\n".join(bad)) == k
        assert tasks.arith_first_error(p, p.solution()) is None
        assert tasks.arith_reward(p.solution(), str(p.answer)) == 1.0

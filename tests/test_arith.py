"""The built-in arith task (tasks.py): problems, solutions, the reward and the first-wrong-step oracle."""

import random

import pytest

from rlvr_utils.core import tasks
from rlvr_utils.extras.data import arith_variants


def rising(rng, *a, **kw):
    return tasks.ArithProblem(*arith_variants.rising(rng, *a, **kw))


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


def test_rising_variant_draws_what_its_docstring_says():
    """--arith-variant rising: a start in [0, 9], additions, the first quarter's operands from [5, 9]; an addition past
    max_value subtracts. The first quarter counted by brute force, as premises.py's first_quarter counts it."""
    rng = random.Random(3)
    for steps in (1, 3, 4, 6, 7, 12, 16):
        lines = steps + 1  # the operations and the answer line
        quarter = sum((k - 1) / lines < 0.25 for k in range(1, lines + 1))
        low_seen = False
        for _ in range(300):
            p = rising(rng, steps=steps)
            assert 0 <= p.start <= 9 and len(p.ops) == steps
            v = p.start
            for i, (op, b) in enumerate(p.ops):
                assert (op == "+") == (v + b <= 99)  # adds unless that passes max_value
                assert 5 <= b <= 9 if i < quarter else 1 <= b <= 9
                low_seen |= i == quarter and b < 5
                v = v + b if op == "+" else v - b
                assert 0 <= v <= 99
        assert low_seen or steps == quarter  # the operand after the quarter is drawn from [1, 9]
    assert [rising(random.Random(5), 6) for _ in range(2)] == [rising(random.Random(5), 6)] * 2
    with pytest.raises(ValueError):
        rising(rng, steps=0)


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("7+8=15\n15+6=21\n21+9=30\n30-4=26\n#### 26", None),
        ("7+8=14\n14+6=20\n20+9=29\n29-4=25\n#### 25", 1),  # the carry into two digits missed
        ("7+8=15\n15+6=22\n22+9=31\n31-4=27\n#### 27", 2),  # wrong result
        ("7+8=15\n15+6=21\n21+9=30\n30+4=34\n#### 34", 4),  # added where the problem subtracts (past max_value)
        ("7+8=15\n15+6=21\n21+9=30\n#### 30", 4),  # the last operation skipped
        ("7+8=15\n15+6=21\n21+9=30\n30-4=26\n#### 62", 5),  # wrong answer line
        ("7+8=15\n15+6=21", 3),  # stopped early: the first missing line
    ],
)
def test_arith_first_error_on_a_rising_problem(completion, expected):
    """The oracle on a problem of the rising variant with max_value 30 (its last addition would pass 30: it subtracts),
    each case's first wrong line marked by hand."""
    p = tasks.ArithProblem(7, (("+", 8), ("+", 6), ("+", 9), ("-", 4)))
    assert p.text == "7+8+6+9-4" and tasks.parse_arith_problem(p.text) == p
    assert tasks.arith_first_error(p.text, completion) == expected
    assert (tasks.arith_reward(completion, str(p.answer)) == 1.0) == (expected is None)


def test_rising_problem_oracle_on_drawn_problems():
    """On drawn rising problems (max_value 30, so some additions subtract): the solution has no wrong line, and a
    digit changed on line k makes k the first wrong line."""
    rng = random.Random(2)
    flipped = 0
    for _ in range(300):
        p = rising(rng, steps=6, max_value=30)
        flipped += any(op == "-" for op, _ in p.ops)
        assert tasks.arith_first_error(p.text, p.solution()) is None
        lines = p.solution().split("\n")
        k = rng.randint(1, len(lines))
        lines[k - 1] = lines[k - 1][:-1] + str((int(lines[k - 1][-1]) + 1) % 10)
        assert tasks.arith_first_error(p.text, "\n".join(lines)) == k
    assert flipped > 0


def test_arith_variant_leaves_the_default_task_alone():
    """The default variant is make_arith_problem's stream, draw for draw; an unknown variant is refused."""
    train, evals = tasks.arith_problems(4, 50, 10, 6, 150, 9)
    assert (train, evals) == tasks.arith_problems(4, 50, 10, 6, 150, 9, "default")
    eval_rng = random.Random(10_000_019 + 4)
    assert evals == [tasks.make_arith_problem(eval_rng, 6, 150, 9) for _ in range(10)]
    rising = tasks.arith_problems(4, 50, 10, 6, 150, 9, "rising")[1]
    assert rising != evals and all(op == "+" for p in rising for op, _ in p.ops)
    with pytest.raises(ValueError, match="unknown arith variant"):
        tasks.load_task("arith", None, arith_variant="falling")


def test_arith_variant_flag_reaches_the_task(monkeypatch, capsys):
    """--arith-variant through a script's own parser and common.load_task: rising prompts, the default's unchanged;
    a name it does not know is one line, exit code 2."""
    import sys

    from conftest import TINY_MODEL

    import common
    import grpo
    from rlvr_utils.core import cli

    tok = common.load_tokenizer(TINY_MODEL)
    made = {}
    for variant in ("default", "rising"):
        monkeypatch.setattr(sys, "argv", ["grpo.py", "--arith-steps", "6", "--arith-variant", variant])
        args = cli.parse(grpo.Args)
        made[variant] = common.load_task(args, tok).eval
    want = tasks.arith_problems(args.seed, 0, args.num_eval, 6)[1]
    assert [e.question for e in made["default"]] == [p.text for p in want]
    assert [e.prompt for e in made["default"]] == [tasks.arith_prompt(p) for p in want]
    rising = [tasks.parse_arith_problem(e.question) for e in made["rising"]]
    assert all(p.start <= 9 and all(op == "+" for op, _ in p.ops) for p in rising)
    # the prompt the policy was trained on, as the default's
    assert all(e.prompt == tasks.arith_prompt(p) for e, p in zip(made["rising"], rising))
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--arith-variant", "falling"])
    with pytest.raises(SystemExit) as e:
        cli.parse(grpo.Args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--arith-variant" in err and "falling" in err, err

"""Reward functions, answer extraction and the arith task's first-error oracle."""
import json
import random
import threading

import pytest

import common
from conftest import SHARED_DATA


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
    assert common.gsm8k_reward(completion, gold) == expected


def test_gsm8k_unparsable_gold_raises():
    with pytest.raises(ValueError, match="not a number"):
        common.gsm8k_reward("#### 3", "#### three")


def test_gsm8k_real_file_self_consistency():
    path = SHARED_DATA / "gsm8k_test.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present (real GSM8K data lives in ../shared/data)")
    rows = [json.loads(line) for line in path.open()]
    assert len(rows) > 1000
    golds = [common.gsm8k_gold(r["answer"]) for r in rows]
    for r, g in zip(rows, golds):
        assert common.gsm8k_reward(r["answer"], r["answer"]) == 1.0, r["answer"]
        assert common.gsm8k_reward(r["answer"], g) == 1.0
    # against another question's answer (skip the rare pairs that share an answer)
    rng = random.Random(0)
    wrong = 0
    for i, r in enumerate(rows):
        j = rng.randrange(len(rows))
        if golds[j] != golds[i]:
            assert common.gsm8k_reward(r["answer"], rows[j]["answer"]) == 0.0
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
    assert common.math_reward(completion, gold) == expected


def test_math_unparsable_gold_never_rewarded():
    before = common.GOLD_PARSE_FAILURES["math"]
    assert common.math_reward("\\boxed{}", "") == 0.0
    assert common.math_reward("\\boxed{\\frac{}{", "\\frac{}{") == 0.0
    assert common.GOLD_PARSE_FAILURES["math"] >= before + 1


def test_math_reward_off_main_thread():
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", common.math_reward("\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join(30)
    assert out.get("r") == 1.0


def test_last_boxed_nested():
    assert common.last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert common.last_boxed("\\boxed{1} \\boxed{2") is None  # unbalanced last box
    assert common.last_boxed("nothing") is None


# --- the built-in arith task ------------------------------------------------------------------
def test_arith_problem_and_solution():
    p = common.ArithProblem(23, (("+", 7), ("-", 5), ("+", 9)))
    assert p.text == "23+7-5+9"
    assert p.solution() == "23+7=30\n30-5=25\n25+9=34\n#### 34"
    assert common.parse_arith_problem("23+7-5+9") == p
    assert common.arith_reward(p.solution(), "34") == 1.0
    assert common.arith_reward("23+7=30\n#### 33", "34") == 0.0


def test_arith_generator_ranges_and_seed():
    a = [common.make_arith_problem(random.Random(5), steps=6, max_value=20, max_operand=3) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    rng = random.Random(0)
    for _ in range(500):
        p = common.make_arith_problem(rng, steps=6, max_value=20, max_operand=3)
        assert len(p.ops) == 6 and all(1 <= b <= 3 for _, b in p.ops)
        assert all(0 <= v <= 20 for v in [p.start] + p.values())
    with pytest.raises(ValueError):
        common.make_arith_problem(rng, steps=0)


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
    assert common.arith_first_error("23+7-5+9", completion) == expected


def test_arith_first_error_is_consistent_with_reward():
    """A completion with no wrong line is always rewarded; the first error is a real error."""
    rng = random.Random(1)
    for _ in range(300):
        p = common.make_arith_problem(rng)
        lines = p.solution().split("\n")
        k = rng.randint(1, len(lines))
        bad = list(lines)
        bad[k - 1] = bad[k - 1][:-1] + str((int(bad[k - 1][-1]) + 1) % 10)  # change the last digit
        assert common.arith_first_error(p, "\n".join(bad)) == k
        assert common.arith_first_error(p, p.solution()) is None
        assert common.arith_reward(p.solution(), str(p.answer)) == 1.0


@pytest.mark.parametrize(
    "given, expected",
    [
        (["23+7=30", "30-5=24", "24+9=33", "#### 33"], "Step 1: 23+7=30\nStep 2: 30-5=2? wrong\n\\boxed{2}"),
        (["23+7=30", "30+5=35", "35+9=44", "#### 44"], "Step 1: 23+7=30\nStep 2: 30? wrong\n\\boxed{2}"),
        (["23+7=3", "3-5=-2"], "Step 1: 23+7=3? wrong\n\\boxed{1}"),  # a line ending early
        (["23+7=300", "300-5=295"], "Step 1: 23+7=30? wrong\n\\boxed{1}"),  # a line running on
        (["23+7=30", "30-5=25"], "Step 1: 23+7=30\nStep 2: 30-5=25\nStep 3: ? wrong\n\\boxed{3}"),  # missing line
        ([" 23+7=30 ", "30-5=25", "25+9=34", "#### 34"],
         "Step 1: 23+7=30\nStep 2: 30-5=25\nStep 3: 25+9=34\nStep 4: #### 34\n\\boxed{0}"),
    ],
)
def test_arith_localization_target_hand_cases(given, expected):
    assert common.arith_localization_target(common.parse_arith_problem("23+7-5+9"), given) == expected


def test_arith_localization_target_names_the_first_error():
    """The boxed step of the training reply is arith_first_error's answer, and the reply is the given
    solution's text up to the first character that differs from the correct solution."""
    rng = random.Random(2)
    for _ in range(500):
        p = common.make_arith_problem(rng, steps=rng.randint(1, 6))
        lines = p.solution().split("\n")
        k = rng.randint(1, len(lines))
        bad = list(lines)
        a, rest = bad[k - 1].split("=") if k <= len(p.ops) else (bad[k - 1], "")
        if rest:  # a wrong result, operand or operator, as a sampler would write
            bad[k - 1] = rng.choice([f"{a}={int(rest) + rng.choice([-11, -1, 1, 10])}",
                                     a.replace("+", "#").replace("-", "+").replace("#", "-") + "=" + rest,
                                     a[:-1] + str(int(a[-1]) % 9 + 1) + "=" + rest])
        else:
            bad[k - 1] = f"#### {p.answer + rng.choice([-3, 1, 20])}"
        first = common.arith_first_error(p, "\n".join(bad))
        reply = common.arith_localization_target(p, bad)
        assert common.last_boxed(reply) == str(first)
        body = reply.rsplit("\n", 1)[0].split("? wrong")[0]
        copied = "\n".join(ln.split(": ", 1)[1] for ln in body.split("\n"))
        assert "\n".join(bad).startswith(copied) and "\n".join(lines).startswith(copied)
        nxt = len(copied)
        assert "\n".join(bad)[nxt:nxt + 1] != "\n".join(lines)[nxt:nxt + 1]
        assert common.arith_localization_target(p, lines).endswith("\\boxed{0}")


# --- task loading ---------------------------------------------------------------------------
class _PlainTok:
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        class E:
            input_ids = [ord(c) % 97 for c in text]

        return E()


def test_load_arith_task_disjoint_and_seeded():
    t1 = common.load_task("arith", _PlainTok(), seed=3, num_eval=50, arith_num_train=500)
    t2 = common.load_task("arith", _PlainTok(), seed=3, num_eval=50, arith_num_train=500)
    assert [e.question for e in t1.train] == [e.question for e in t2.train]
    assert not {e.question for e in t1.train} & {e.question for e in t1.eval}
    assert len({e.id for e in t1.train + t1.eval}) == len(t1.train) + len(t1.eval)
    ex = t1.eval[0]
    assert ex.prompt == f"Solve: {ex.question}\n"
    assert t1.reward_fn(common.parse_arith_problem(ex.question).solution(), ex) == 1.0


def test_load_task_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        common.load_task("chess", _PlainTok())
    with pytest.raises(FileNotFoundError, match="no such file"):
        common.load_task("gsm8k", _PlainTok(), data_path=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(KeyError, match="answer"):
        common.load_task("gsm8k", _PlainTok(), data_path=str(bad), num_eval=0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"question": "q", "answer": "#### many"}) + "\n")
    with pytest.raises(ValueError, match="no usable"):
        common.load_task("gsm8k", _PlainTok(), data_path=str(empty), num_eval=0)


def test_load_gsm8k_local_skips_unparsable(tmp_path):
    rows = [{"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(6)]
    rows.append({"question": "broken", "answer": "#### lots"})
    f = tmp_path / "g.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    t = common.load_task("gsm8k", _PlainTok(), data_path=str(f), num_eval=2)
    assert len(t.eval) == 2 and len(t.train) == 4
    assert t.skipped["unparsable_gold"] == 1
    assert t.reward_fn("so #### 6", t.train[-1]) == 1.0
    assert "\\boxed{}" in t.train[0].prompt


def test_load_math_local_skips_unparsable(tmp_path):
    rows = [{"problem": "Half of one?", "answer": "\\frac{1}{2}"}, {"problem": "Two?", "answer": "2"},
            {"problem": "bad", "answer": "\\frac{"}]
    f = tmp_path / "m.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    t = common.load_task("math", _PlainTok(), data_path=str(f), num_eval=1)
    assert t.skipped["unparsable_gold"] == 1
    assert t.reward_fn("\\boxed{0.5}", t.eval[0]) == 1.0
    assert t.reward_fn("\\boxed{2}", t.train[0]) == 1.0

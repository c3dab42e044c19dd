"""The positive control (benchmarks/perfect_credit.py): only a failed completion's first wrong line and what follows
keep its advantage, by hand on the built-in task's problems."""

import sys
from types import SimpleNamespace

import torch
from helpers import ROOT, run_script

import common
from rlvr_utils.core import tasks

sys.path.insert(0, str(ROOT / "benchmarks"))
import perfect_credit  # noqa: E402

PROBLEM = tasks.Example(id=7, question="17-2-2-8+7", gold="12", prompt="", prompt_ids=[])
RIGHT = "17-2=15\n15-2=13\n13-8=5\n5+7=12\n#### 12"


def test_blame_starts_at_the_first_wrong_line_and_spares_the_prefix():
    tok = common.load_tokenizer(common.DEFAULT_MODEL)
    wrong_at_3 = "17-2=15\n15-2=13\n13-8=6\n6+7=13\n#### 13"
    stopped_early = "17-2=15\n15-2=13"
    for text, want_cut in ((wrong_at_3, len("17-2=15\n15-2=13\n")), (stopped_early, len(stopped_early))):
        ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
        start = perfect_credit.blame_from(tok, PROBLEM, ids, text)
        assert tok.decode(ids[:start]) == text[:want_cut], text  # the spared prefix is exactly the correct lines
        assert start < len(ids)  # something is blamed: the wrong line on, or the stop token of a short completion


def test_a_right_completion_is_blamed_from_its_first_token():
    tok = common.load_tokenizer(common.DEFAULT_MODEL)
    assert perfect_credit.blame_from(tok, PROBLEM, tok(RIGHT).input_ids, RIGHT) == 0


def test_perfect_credit_zeroes_only_failed_prefixes():
    tok = common.load_tokenizer(common.DEFAULT_MODEL)
    texts = [RIGHT, "17-2=15\n15-2=12\n12-8=4\n4+7=11\n#### 11"]  # right; wrong at line 2
    ids = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]
    T = max(map(len, ids))
    ro = SimpleNamespace(
        completion_ids=torch.tensor([x + [0] * (T - len(x)) for x in ids]),
        completion_mask=torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in ids]),
        group_ids=torch.tensor([7, 7]),
        texts=texts,
    )
    adv = torch.tensor([0.7, -0.7])
    got = perfect_credit.perfect_credit(adv, ro, torch.tensor([True, False]), {7: PROBLEM}, tok)
    spared = len("17-2=15\n")
    assert (got[0] == 0.7).all()  # a correct completion: GRPO's
    assert (got[1, :spared] == 0).all() and (got[1, spared:] == -0.7).all()


def test_the_control_trains_and_logs_its_spared_share(tmp_path):
    r = run_script("benchmarks/perfect_credit.py", "--total-steps", "2", "--eval-every", "0", "--num-eval", "8",
                   "--output-dir", str(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [__import__("json").loads(line) for line in next(tmp_path.glob("*/metrics.jsonl")).open()]
    assert all(0 <= r["control/spared_token_share"] < 1 for r in rows[1:])


def rollouts_of(tok, texts):
    ids = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]
    T = max(map(len, ids))
    return SimpleNamespace(
        completion_ids=torch.tensor([x + [0] * (T - len(x)) for x in ids]),
        completion_mask=torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in ids]),
        group_ids=torch.tensor([7] * len(texts)),
        texts=texts,
    )


def test_the_placebo_spreads_the_controls_blame_evenly_over_each_failed_row():
    tok = common.load_tokenizer(common.DEFAULT_MODEL)
    wrong_at_2 = "17-2=15\n15-2=12\n12-8=4\n4+7=11\n#### 11"
    stopped_early = "17-2=15\n15-2=13"
    ro = rollouts_of(tok, [RIGHT, wrong_at_2, stopped_early])
    adv, success = torch.tensor([0.9, -0.6, -0.3]), torch.tensor([True, False, False])
    got = perfect_credit.placebo_credit(adv, ro, success, {7: PROBLEM}, tok)
    n1, n2 = len(wrong_at_2) + 1, len(stopped_early) + 1  # one token per character, and the stop token
    assert (got[0] == 0.9).all()  # a correct completion: GRPO's
    # by hand: the control spares "17-2=15\n" (8 tokens) of row 1 and all but the stop token of row 2
    assert torch.allclose(got[1, :n1], torch.full((n1,), -0.6 * (n1 - 8) / n1))
    assert torch.allclose(got[2, :n2], torch.full((n2,), -0.3 * 1 / n2))
    control = perfect_credit.perfect_credit(adv, ro, success, {7: PROBLEM}, tok)
    m = ro.completion_mask.bool()
    per_row = lambda a: (a.abs() * m).sum(1)  # noqa: E731
    assert torch.allclose(per_row(got), per_row(control))  # the same |advantage| per row: mass-matched
    assert not torch.allclose(got[1, :n1], control[1, :n1])  # but not where it lands


def test_the_placebo_trains(tmp_path):
    r = run_script("benchmarks/perfect_credit.py", "--placebo", "--total-steps", "2", "--eval-every", "0",
                   "--num-eval", "8", "--output-dir", str(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [__import__("json").loads(line) for line in next(tmp_path.glob("*/metrics.jsonl")).open()]
    assert json_config(tmp_path)["placebo"] is True and len(rows) == 3


def json_config(tmp_path):
    return __import__("json").loads(next(tmp_path.glob("*/config.json")).read_text())

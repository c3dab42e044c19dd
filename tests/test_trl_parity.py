"""TRL parity in the corners (issue #52): a completion no reward function scores (None, or NaN as TRL reads it) is left
out of its group's mean and std and gets advantage 0 in every script and in --log-credit's record; a reward's own
log_metric names are kept under a name of their own; rewards/<fn>/* describe the rows `reward` describes (SRPO's search
and dynamic sampling's dropped groups left out); trainer_state counts completions and keeps the logged rows; the model
card is built with huggingface_hub and carries no path of the training machine."""

import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
from conftest import ROOT, TINY_MODEL
from test_trl_rewards import _examples

import common
import ep_grpo
import sc_grpo
import srpo
from rlvr_utils.core import runtime, tasks
from rlvr_utils.extras.reward_fns import reward_calls
from rlvr_utils.extras.save import model_card

NAN = math.nan


# --- 1-2. None and NaN ------------------------------------------------------------------------------------------------
def test_an_unscored_completion_is_left_out_of_its_group_as_trl_does():
    """The issue's example: rewards [1, None, 0, 0] give TRL's +1.155 / 0 / -0.577 / -0.577 (not +1.5 / -0.5 x 3)."""
    adv = common.group_advantages(torch.tensor([1.0, NAN, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), 4)
    assert adv[:4].tolist() == pytest.approx([1.1545, 0.0, -0.5773, -0.5773], abs=1e-4)
    assert adv[4:].tolist() == pytest.approx([1.4997, -0.4999, -0.4999, -0.4999], abs=1e-4)  # its neighbour: as ever
    assert common.group_advantages(torch.full((4,), NAN), 4).tolist() == [0.0] * 4  # nothing scored: nothing learnt
    batch = common.group_advantages(torch.tensor([NAN, 1.0, 1.0, 0.0]), 4, "batch")
    assert batch[0] == 0 and batch[1:].tolist() == pytest.approx(
        common.group_advantages(torch.tensor([1.0, 1.0, 0.0]), None, "batch", group_ids=torch.zeros(3)).tolist()
    )
    pop = srpo.srpo_advantages(torch.tensor([1.0, NAN, 0.0, 0.0]), torch.zeros(4, dtype=torch.long))
    assert pop.tolist() == pytest.approx([2**0.5, 0.0, -(2**-0.5), -(2**-0.5)], abs=1e-5)  # population std, no eps


def test_nan_from_a_reward_reads_as_none_and_an_all_none_completion_has_no_reward(capsys):
    fns = [("a", lambda prompts, completions, **k: [float("nan"), 1.0, None]), ("b", lambda **k: [None, 0.5, None])]
    got = reward_calls.RewardFunctions(fns)(["x", "y", "z"], _examples(3))
    assert math.isnan(got[0]) and got[1] == 1.5 and math.isnan(got[2])
    assert "returned None for 2 of 3 completions" in capsys.readouterr().err


def test_ep_grpo_and_sc_grpo_give_an_unscored_row_nothing():
    B, T = 4, 5
    torch.manual_seed(0)
    H, old, ref = torch.rand(B, T), -torch.rand(B, T), -torch.rand(B, T)
    A = ep_grpo.ep_advantages(H, old, ref, torch.ones(B, T), torch.tensor([1.0, NAN, 0.0, 0.0]), 4)
    assert A[1].abs().sum() == 0 and torch.isfinite(A).all() and A[0].abs().sum() > 0
    # SC-GRPO: a graded solve-none group [0.5, None, 0.2, 0.2] stays plain GRPO (the None row does not hide the spread)
    scores = torch.tensor([0.5, NAN, 0.2, 0.2])
    modes, _ = sc_grpo.route_groups(scores >= 1.0, 4, torch.Generator().manual_seed(0), scores=scores)
    assert modes == ["plain"]


def test_completion_metrics_leave_unscored_completions_out():
    ro = types.SimpleNamespace(
        completion_mask=torch.ones(4, 2), group_ids=torch.zeros(4), truncated=torch.zeros(4), scores=None
    )
    m = runtime.completion_metrics(ro, torch.tensor([1.0, 1.0, NAN, 1.0]), 4)
    assert m["reward"] == 1.0 and m["reward_std"] == 0.0 and m["frac_reward_zero_std"] == 1.0
    assert m["frac_groups_unsolved"] == 0.0


NONE_REWARD = """
def sometimes(prompts, completions, answer, **kwargs):
    # every third completion of a batch is not this function's (TRL's None); the others: the answer's last line
    pairs = enumerate(zip(completions, answer))
    return [None if i % 3 == 1 else float(c.strip().endswith(str(a))) for i, (c, a) in pairs]
"""


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo.py", "sc_grpo.py", "grpo_lambda.py", "ep_grpo.py", "srpo.py"])
def test_every_script_gives_an_unscored_completion_no_credit(tmp_path, script):
    """A reward that returns None for some completions: every script trains, the credit record's reward is null and
    its credit 0 (the first step: the policy is its own reference, so no KL part either), and rewards/<fn>/mean
    describes the rows `reward` describes (SRPO: the trained rows, not its search)."""
    problems = tasks.arith_problems(3, 40, 0, 4, 99, 9)[0]
    rows = [{"prompt": tasks.arith_prompt(p), "answer": p.answer} for p in problems]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "r.py").write_text(NONE_REWARD)
    flags = [
        "--task",
        "custom",
        "--data-path",
        str(tmp_path / "rows.jsonl"),
        "--reward-fn",
        f"{tmp_path}/r.py:sometimes",
    ]
    flags += ["--total-steps", "2", "--eval-every", "1", "--num-eval", "4", "--prompts-per-step", "2"]
    flags += ["--num-generations", "4", "--max-new-tokens", "40", "--threads", "1", "--log-credit", "32"]
    out = subprocess.run(
        [sys.executable, str(ROOT / script), *flags, "--output-dir", str(tmp_path / "runs")],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    records = [json.loads(line) for line in (run / "credit.jsonl").open()]
    unscored = [r for r in records if r["reward"] is None]
    assert unscored and any(r["reward"] is not None for r in records)
    assert all(abs(c) < 1e-6 for r in unscored if r["step"] == 1 for c in r["credit"]), script
    for row in (json.loads(line) for line in (run / "metrics.jsonl").open()):
        if "reward" in row:
            assert row["rewards/sometimes/mean"] == pytest.approx(row["reward"], abs=1e-6), (script, row["step"])


# --- 3-5. a reward's own metrics, per-function metrics of the trained rows, trainer_state ----------------------------
class _Trained:
    """The trained rows of a step, as common.Rollouts holds them (prompt tokens left-padded)."""

    def __init__(self, prompts, completions):
        P = max(map(len, prompts))
        self.prompt_ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
        self.prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
        self.completions = completions

    def completion_lists(self):
        return self.completions


def test_per_function_metrics_describe_the_trained_rows(tmp_path):
    """SRPO scores its search chains and its continuations in two calls and trains on some of them: rewards/<fn>/*
    are over the trained ones (`reward`'s rows), not over every completion scored in the step."""
    scores = {(5,): 0.0, (6,): 0.0, (7,): 1.0, (8,): 1.0}

    def f(completion_ids, **k):
        return [scores[tuple(c)] for c in completion_ids]

    rf = reward_calls.RewardFunctions([("f", f)])
    rf.begin(tmp_path, 0, 0, 2, 1, 4)
    ex = _examples(1) * 2
    rf(["a", "b"], ex, [[5], [6]])  # the search: two failed chains, one of them trained
    rf(["c", "d"], ex, [[7], [8]])  # the continuations, trained
    trained = (_Trained([[1]] * 3, [[5], [7], [8]]), torch.tensor([0.0, 1.0, 1.0]))
    got = rf.merged_into({"reward": 2 / 3}, 1, rows=trained)
    assert got["rewards/f/mean"] == pytest.approx(2 / 3) and got["reward"] == pytest.approx(2 / 3)


def test_a_log_metric_in_an_evaluation_keeps_the_users_number_and_trainer_state_keeps_the_rows(tmp_path):
    def judge(prompts, completions, log_metric, **k):
        log_metric("accuracy", 0.75)  # TRL's documented example
        return [1.0] * len(completions)

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.1}\n{"step": 1, "reward": 0.2}\n')
    rf = reward_calls.RewardFunctions([("judge", judge)])
    rf.begin(tmp_path, 0, 1, 4, 2, 8, completions=16)
    assert rf.state.train_batch_size == 16 and [r["step"] for r in rf.state.log_history] == [0, 1]  # resumed
    rf(["x", "y"], _examples(2))
    train = rf.merged_into({"reward": 1.0}, 2)
    rf(["x"], _examples(1), mode="eval")
    evals = rf.merged_into({"eval/accuracy": 0.5}, mode="eval")
    assert train["accuracy"] == 0.75  # in training no name of ours clashes: as TRL logs it
    assert evals["eval/accuracy"] == 0.5 and evals["eval/log_metric/accuracy"] == 0.75
    assert rf.state.log_history[-1] == {"step": 2, **train, **evals}  # the step's row, its evaluation joined


# --- 6. the model card ------------------------------------------------------------------------------------------------
def test_the_model_card_is_portable_and_names_the_license_the_paper_and_a_prompt(tmp_path, monkeypatch):
    from huggingface_hub import ModelCard

    base = tmp_path / "my-base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\n# base\n")
    run = tmp_path / "run"
    run.mkdir()
    config = {"script": "srpo.py", "model": str(base), "task": "custom", "data_path": str(tmp_path / "rows.jsonl")}
    config |= {"reward_fn": [f"{tmp_path}/r.py:score"], "num_eval": 4, "eval_temperature": 0.0, "total_steps": 3}
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.25}\n{"step": 3, "eval/accuracy": 0.5}\n')
    monkeypatch.setattr(sys, "argv", [str(ROOT / "srpo.py")])
    text = model_card.model_card(run, "Solve: 1+2\n")
    card = ModelCard(text)
    assert card.data.base_model is None and card.data.license == "apache-2.0"  # a local base: no hub id to name
    assert card.data.library_name == "transformers" and "srpo" in card.data.tags
    assert str(tmp_path) not in text and "`rows.jsonl`" in text and "r.py:score" in text  # names, not paths
    assert "arxiv.org/abs/2605.25507" in text and '"Solve: 1+2\\n"' in text and "# my-base trained with SRPO" in text
    config["model"] = str(TINY_MODEL)  # a base whose card names no license: other, and a line saying to set it
    (run / "config.json").write_text(json.dumps(config))
    text = model_card.model_card(run)
    assert ModelCard(text).data.license == "other" and "set `license:`" in text
    # a LoRA run started with --save-model, resumed with --save-adapter: the card tells how to load what was saved
    (run / "config.json").write_text(json.dumps(config | {"lora_rank": 16, "save_model": True}))
    merged, adapter = model_card.model_card(run), model_card.model_card(run, flags_now={"save_adapter": True})
    assert "AutoModelForCausalLM.from_pretrained" in merged and "AutoPeftModelForCausalLM" not in merged
    assert "AutoPeftModelForCausalLM" in adapter and "--save-adapter" in adapter
    # resumed with --total-steps 9 (a runtime flag): the card gives the flags the model was trained with at the end
    assert "--total-steps 3" in merged and "--total-steps 9" in model_card.model_card(run, None, {"total_steps": 9})


@pytest.mark.parametrize("value", ["\n\n", "my data.jsonl", "it's", "plain", "a\tb\\c'", "ü ß", "é\n", "😀\n\x85"])
def test_the_model_cards_command_gives_each_value_as_one_bash_word(value):
    """SRPO's --thought-delimiter "\\n\\n" and a path with a space: the card's command pastes into bash as written."""
    line = model_card.flags({"thought_delimiter": value})[0]
    assert line.startswith("--thought-delimiter ") and "\n" not in line
    got = subprocess.run(["bash", "-c", f"printf %s {line.split(' ', 1)[1]}"], capture_output=True, text=True)
    assert got.stdout == value

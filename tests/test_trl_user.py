"""A TRL GRPOTrainer user's corners, third round (issue #61): a flag that cannot act is one line before anything
loads (the LoRA settings without --lora-rank; --save-adapter implies the save); --resume refuses a flag given anew that
differs from the run's even at its default value; TRL's sampled evaluation (--eval-num-generations) beside the greedy
pass@1, its metrics against hand values, the first evaluation's warning computed as the logged eval/accuracy; data
files read as `datasets.load_dataset` reads them (the rows compared on JSON, JSONL, CSV and parquet); a card and an
adapter that name the base portably; a finished run directory without `.lock`."""

import json
import math
import shutil
import sys
import types

import pytest
import torch
from conftest import ROOT, TINY_MODEL
from helpers import read_metrics, run_dir, run_inprocess

import common
import grpo
from rlvr_utils.core import checkpoints, cli, tasks
from rlvr_utils.extras import trl_eval
from rlvr_utils.extras.data import datafiles
from rlvr_utils.extras.reward_fns import reward_calls
from rlvr_utils.extras.save import model_card, resume

NAN = math.nan


def _parse(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["grpo.py", *argv])
    return cli.parse(grpo.Args)


def _refused(monkeypatch, capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        _parse(monkeypatch, *argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# --- 1. flags that cannot act ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags",
    [["--lora-alpha", "16"], ["--lora-dropout", "0.1"], ["--lora-target-modules", "q_proj"], ["--save-adapter"]],
)
def test_a_lora_setting_without_lora_rank_is_one_line(flags, monkeypatch, capsys, tmp_path):
    line = _refused(monkeypatch, capsys, *flags, "--output-dir", str(tmp_path))
    assert line.startswith(f"error: {flags[0]} needs --lora-rank") and "no adapter" in line
    assert not any(tmp_path.iterdir())


def test_save_adapter_implies_the_save(monkeypatch):
    """`--lora-rank 8 --save-adapter` used to train, exit 0 and save nothing (the adapter needed --save-model too)."""
    assert _parse(monkeypatch, "--lora-rank", "8", "--save-adapter").save_model
    assert not _parse(monkeypatch, "--lora-rank", "8").save_model


def test_lora_dropout_acts_in_every_forward_of_the_adapted_policy_but_generations():
    """--lora-dropout's help: PEFT leaves the policy in train mode, so the dropout acts in the update and in the
    no-grad passes that score its rollouts (not only with --gradient-checkpointing, as the help said); generation runs
    in eval mode."""
    from rlvr_utils.extras import lora

    flags = types.SimpleNamespace(lora_rank=4, lora_alpha=None, lora_dropout=0.5, lora_target_modules=())
    model, tok = common.load_policy(str(TINY_MODEL), torch.device("cpu"))
    model = lora.wrap(model, flags)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    ids = torch.tensor([tok("Solve: 1+2\n1+2=3").input_ids])
    with torch.no_grad():
        a, b = (common.token_logprobs(model, ids, torch.ones_like(ids), 4)[0] for _ in range(2))
    assert model.training and not torch.equal(a, b)
    common.generate_rollouts(model, tok, [ids[0, :4].tolist()], [0], 2, 4)
    assert model.training  # generation puts it in eval mode and back


def test_given_flags_are_read_as_tyro_reads_them():
    argv = ["--lora-rank", "0", "--learning_rate=1e-4", "--no-save-model", "--reward-fn", "--x.py:f", "--seed=1"]
    assert resume.given_flags(grpo.Args, argv) == {"lora_rank", "learning_rate", "save_model", "reward_fn", "seed"}


@pytest.fixture
def lora_run(saved, tmp_path):
    """A copy of a 1-step run with a checkpoint, its config.json saying it trained LoRA adapters at rank 4 and lr
    0.001 (the parse-time checks read config.json only)."""
    d = tmp_path / saved.name
    shutil.copytree(saved, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"lora_rank": 4, "learning_rate": 0.001}))
    return d


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--lora-rank", "0"], "--lora-rank 0: the run in"),  # at its default value: given, and refused
        (["--learning-rate", "0.0001"], "--learning-rate 0.0001: the run in"),
        (["--lora-rank=0"], "--lora-rank 0"),
    ],
)
def test_resume_refuses_a_flag_given_anew_even_at_its_default(lora_run, flags, words, monkeypatch, capsys):
    line = _refused(monkeypatch, capsys, "--resume", str(lora_run), "--total-steps", "2", *flags)
    assert words in line and "was started with" in line


def test_resume_keeps_the_runs_flags_where_none_is_given(lora_run, monkeypatch):
    args = _parse(monkeypatch, "--resume", str(lora_run), "--total-steps", "2", "--lora-rank", "4")
    assert args.lora_rank == 4 and args.learning_rate == 0.001 and args.total_steps == 2
    checkpoints.unlock_run_dir(lora_run)  # taken by --resume's checks, in this process


# --- 2. TRL's evaluation ---------------------------------------------------------------------------------------------
class _Task:
    def with_reward_metrics(self, out, mode):
        return out


def _samples(lengths, truncated):
    return types.SimpleNamespace(completion_mask=torch.tensor(lengths)[:, None], truncated=torch.tensor(truncated))


def test_the_sampled_evaluations_metrics_are_the_training_metrics_by_hand():
    """Two prompts x 3 samples, rewards [1, 0, None | 1, 1, 1], lengths [3, 5, 2 | 4, 4, 6], one clipped: reward over
    the five scored 0.8, its unbiased std sqrt(0.2), one group of two with equal rewards, no group unsolved, lengths
    4 / 6 / 2, clipped 1/6, accuracy 4 of 6 samples (the unscored one is no success)."""
    ro = _samples([3, 5, 2, 4, 4, 6], [False, True, False, False, False, False])
    out = trl_eval.metrics(_Task(), ro, [1.0, 0.0, NAN, 1.0, 1.0, 1.0], 3, 1.0, None, 2)
    want = {"eval/reward": 0.8, "eval/reward_std": 0.2**0.5, "eval/frac_reward_zero_std": 0.5}
    want |= {"eval/frac_groups_unsolved": 0.0, "eval/completions/mean_length": 4.0, "eval/completions/max_length": 6.0}
    want |= {"eval/completions/min_length": 2.0, "eval/completions/clipped_ratio": 1 / 6, "eval/accuracy": 4 / 6}
    assert out == pytest.approx(want)


def test_under_torchrun_each_rank_computes_the_figures_of_every_sample():
    """Each rank places its rows in one vector of every sample and sums it with the others': ranks of 1 prompt each
    (the last one's slice padded: its padding rows are not counted) give the one-process figures."""
    ro = _samples([3, 5, 2, 4, 4, 6], [False, True, False, False, False, False])
    rewards = [1.0, 0.0, NAN, 1.0, 1.0, 1.0]
    whole = trl_eval.metrics(_Task(), ro, rewards, 3, 1.0, None, 2)
    sent = {}

    class Rank:
        def __init__(self, rank):
            self.rank, self.world = rank, 2

        def sum(self, values):
            sent[self.rank] = torch.tensor(values, dtype=torch.float64)
            return values if len(sent) < 2 else (sent[0] + sent[1]).tolist()

    trl_eval.metrics(_Task(), _samples([3, 5, 2], [False, True, False]), rewards[:3], 3, 1.0, Rank(0), 2)
    second = _samples([4, 4, 6], [False] * 3)
    assert trl_eval.metrics(_Task(), second, rewards[3:], 3, 1.0, Rank(1), 2) == pytest.approx(whole, nan_ok=True)


def test_the_sampled_evaluation_scores_g_samples_per_prompt(tiny):
    model, tok = tiny
    task = tasks.load_task("arith", tok, seed=0, num_eval=3, arith_num_train=20)
    seen = []
    task.reward_fn = lambda completion, ex: seen.append(ex.id) or float(len(seen) % 2)
    out = common.evaluate(model, tok, task, 8, 64, 1.0, None, 1.0, num_generations=4)
    assert sorted(seen) == sorted([e.id for e in task.eval] * 4)  # 4 samples of each prompt scored
    assert out["eval/reward"] == pytest.approx(6 / 12) and out["eval/accuracy"] == pytest.approx(6 / 12)
    assert {"eval/reward_std", "eval/frac_reward_zero_std", "eval/completions/mean_length"} <= set(out)
    greedy = common.evaluate(model, tok, task, 8, 64, 0.0, None, 1.0)  # the default: the greedy pass@1, as before
    assert set(greedy) == {"eval/accuracy", "eval/reward", "eval/mean_length"}


@pytest.mark.parametrize(
    "outs, warned",
    [
        ([1.0, None, 1.0, 1.0], False),  # logged eval/accuracy 0.75: no warning (it said 1.000: scored rows only)
        ([1.0, 1.0, 1.0, 1.0], True),
        ([0.0, None, 0.5, 0.2], True),
    ],
)
def test_the_first_evaluations_warning_is_the_logged_accuracy(outs, warned, tmp_path, capsys):
    from test_trl_rewards import _examples

    rf = reward_calls.RewardFunctions([("f", lambda prompts, completions, o=outs, **k: o)], success_threshold=1.0)
    rf.begin(tmp_path, 0, 0, 2, 2, 4)
    totals = rf(list("abcd"), _examples(4), mode="eval")
    logged = sum(t >= 1.0 for t in totals) / len(totals)  # common.evaluate's eval/accuracy of them (NaN: no success)
    rf.metrics(mode="eval")
    err = capsys.readouterr().err
    assert ("at the first evaluation" in err) == warned
    assert not warned or f"eval/accuracy {logged:.3f} at the first evaluation" in err


def test_a_run_evaluates_as_trl_and_leaves_no_lock(tmp_path):
    """--eval-num-generations 2: every evaluation logs the sampled metrics under eval/; --eval-temperature 0 there
    means --temperature. A clean finish removes `.lock` (a second process found it in every finished run)."""
    flags = ["--total-steps", "1", "--eval-every", "0", "--num-eval", "2", "--prompts-per-step", "2"]
    flags += ["--num-generations", "2", "--max-new-tokens", "8", "--threads", "1", "--output-dir", str(tmp_path)]
    run_inprocess("grpo.py", *flags, "--eval-num-generations", "2")
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1]
    assert all(0 <= rows[i]["eval/reward_std"] and rows[i]["eval/completions/mean_length"] > 0 for i in (0, 1))
    assert not (run_dir(tmp_path) / ".lock").exists()


def test_unlock_releases_the_lock_after_removing_lock_file(tmp_path):
    import fcntl
    import os

    checkpoints.lock_run_dir(tmp_path)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):  # held: one writer
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        checkpoints.unlock_run_dir(tmp_path)
        assert not (tmp_path / ".lock").exists()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    finally:
        os.close(fd)
    checkpoints.unlock_run_dir(tmp_path)  # not held: nothing


# --- 3. data files as TRL's users read them --------------------------------------------------------------------------
ROWS = [
    {"prompt": "Solve: 3+4\n", "answer": 7, "tag": "a"},
    {"prompt": "Solve: 1+1.5\n", "answer": 2.5, "tag": "b"},
    {"prompt": "Solve: 3+4\n", "answer": "007"},
]


def _write(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif path.suffix == ".csv":
        path.write_text(
            "prompt,answer,tag\n" + "".join(f'"{r["prompt"]}",{r["answer"]},{r.get("tag", "")}\n' for r in rows)
        )
    else:
        from datasets import Dataset

        Dataset.from_list([{**r, "answer": float(r["answer"])} for r in rows]).to_parquet(str(path))
    return path


@pytest.mark.parametrize("name", ["rows.json", "rows.jsonl", "rows.csv", "rows.parquet"])
def test_rows_are_what_datasets_load_dataset_gives(tmp_path, name):
    """The issue's answers 7, 2.5 and "007" in one column: `datasets` (what a TRL user loads the file with) gives
    [7, 2.5, 7] from JSON (7.0 / 2.5 where they are all numbers), pandas' types from CSV; the rows are those."""
    from datasets import load_dataset

    path = _write(tmp_path / name, ROWS)
    kind = {"rows.json": "json", "rows.jsonl": "json", "rows.csv": "csv", "rows.parquet": "parquet"}[name]
    rows, wheres = datafiles.read_rows(path)
    assert rows == list(load_dataset(kind, data_files=str(path), split="train"))
    assert [type(r["answer"]) for r in rows] == [
        type(r["answer"]) for r in load_dataset(kind, data_files=str(path))["train"]
    ]
    if kind == "json":
        assert [r["answer"] for r in rows] == [7, 2.5, 7] and rows[2]["tag"] is None
        two = _write(tmp_path / "two.jsonl", ROWS[:2])
        assert [r["answer"] for r in datafiles.read_rows(two)[0]] == [7.0, 2.5]
    assert len(wheres) == 3 and all(w.startswith(str(path)) for w in wheres)


def test_a_directorys_files_share_one_schema_as_one_load_dataset_call_gives(tmp_path):
    from datasets import load_dataset

    d = tmp_path / "d"
    d.mkdir()
    _write(d / "a.jsonl", ROWS[:2])
    _write(d / "b.jsonl", ROWS[2:])
    rows, wheres = datafiles.read_rows(d)
    together = load_dataset("json", data_files=[str(d / "a.jsonl"), str(d / "b.jsonl")], split="train")
    assert rows == list(together) and [w.rsplit("/", 1)[1] for w in wheres] == ["a.jsonl:1", "a.jsonl:2", "b.jsonl:1"]


def test_a_bad_line_is_still_named(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", answer: 2}\n')
    with pytest.raises(datafiles.DataFileError, match=r"rows.jsonl:2: not a JSON object"):
        datafiles.read_rows(tmp_path / "rows.jsonl")


def test_a_reward_sees_the_types_trl_would_give_it(tmp_path, tiny):
    _, tok = tiny
    data = _write(tmp_path / "rows.jsonl", ROWS)
    seen = tmp_path / "seen.txt"
    (tmp_path / "r.py").write_text(
        f"def r(prompts, completions, answer, **kw):\n    open({str(seen)!r}, 'a').write(repr(answer) + '\\n')\n"
        "    return [0.0] * len(completions)\n"
    )
    task = tasks.load_task("custom", tok, data_path=str(data), num_eval=1, reward_fn=[f"{tmp_path / 'r.py'}:r"])
    examples = task.train + task.eval
    task.rewards(["x"] * len(examples), examples)
    got = sorted(seen.read_text().strip()[1:-1].split(", "))  # the held-out row first: the order is the task's
    assert got == ["2.5", "7", "7"]  # what GRPOTrainer passes from the same file ("007" as 7, 7 an int)


# --- 4. a portable card ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "base, hub", [(str(TINY_MODEL), None), ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct")]
)
@pytest.mark.parametrize("adapter", [True, False])
def test_the_card_names_a_hub_id_or_no_base_links_the_project_and_gives_versions(
    tmp_path, monkeypatch, base, hub, adapter
):
    """A merged model's card names its base by hub id only; an adapter's says `library_name: peft` and names its base
    as its adapter_config.json does (PEFT's own cards), and says so where that path would read as a hub id."""
    from huggingface_hub import ModelCard

    run = tmp_path / "run"
    run.mkdir()
    config = {"script": "grpo.py", "model": base, "task": "arith", "num_eval": 4, "lora_rank": 4}
    config |= {"save_adapter": adapter, "eval_num_generations": 8, "temperature": 1.0}
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.25}\n')
    monkeypatch.setattr(sys, "argv", [str(ROOT / "grpo.py")])
    text = model_card.model_card(run)
    (tmp_path / "README.md").write_text(text)
    card = ModelCard.load(tmp_path / "README.md")
    given = hub or "assets/tiny-arith"  # the adapter's base_model_name_or_path
    assert card.data.base_model == (given if adapter else hub)  # merged: never "tiny-arith", nothing the hub resolves
    assert card.data.library_name == ("peft" if adapter else "transformers")
    assert (f"base_model:adapter:{given}" in card.data.tags) == adapter and ("lora" in card.data.tags) == adapter
    warned = "which would read it as the hub id `assets/tiny-arith`"
    assert (warned in text) == (adapter and hub is None), text
    line = model_card.saved_line(run / "model", config)
    assert ("the hub would read as the hub id assets/tiny-arith" in line) == (adapter and hub is None), line
    assert "Trained with credit-rlvr" in text and "github.com/credit-rlvr" not in text  # named; no invented address
    assert f"- torch: {torch.__version__}" in text and "- transformers: " in text and "- peft: " in text
    assert str(ROOT) not in text and str(tmp_path) not in text  # no path of this machine
    assert "8 samples (temperature 1.0)" in text  # the sampled evaluation says what eval/accuracy is

"""tools/train_tiny_model.py and the bundled model it made: training-data weights, a few optimizer
steps of the trainer itself, and the bundled model's localization measured (not read from its report)."""

import json
import random
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from rlvr_utils.core import tasks
from rlvr_utils.extras.data import rewards

sys.path.insert(0, str(ROOT / "tools"))
import train_tiny_model as ttm  # noqa: E402


def test_completion_weights_mark_the_decisions():
    reply = ttm.arith_localization_target(tasks.parse_arith_problem("23+7-5+9"), ["23+7=30", "30-5=24"])
    w = ttm.completion_weights(reply, 5.0)
    heavy = [reply[i] if i < len(reply) else "<eos>" for i, x in enumerate(w) if x == 5.0]
    assert heavy == ["?", "2"] and len(w) == len(reply) + 1
    solution = tasks.parse_arith_problem("23+7").solution()
    assert ttm.completion_weights(solution, 5.0) == [1.0] * (len(solution) + 1)


def test_localization_examples_match_the_oracle():
    """Every localization example the trainer draws boxes arith_first_error's step (0 when none)."""
    rng, args = random.Random(0), ttm.Args()
    seen = {0: 0, 1: 0}
    for _ in range(400):
        prompt, target, kind = ttm.sample_example(rng, args)
        if kind != 1:
            continue
        problem = tasks.parse_arith_problem(prompt.split("\n")[0].removeprefix("Problem: "))
        lines = [ln.split(": ", 1)[1] for ln in prompt.split("\n") if ln.startswith("Step ")]
        first = tasks.arith_first_error(problem, "\n".join(lines))
        assert rewards.last_boxed(target) == str(first or 0)
        seen[first is None] += 1
    assert seen[0] > 50 and seen[1] > 3  # both wrong and (about 10%) correct solutions are shown


def test_bundled_model_localizes_above_chance(tiny):
    """Greedy first-wrong-step localization on synthetic wrong solutions, measured here on 100 problems
    the training report did not use: clearly above a uniform guess (the target of issue 2)."""
    model, tok = tiny
    problems = [tasks.make_arith_problem(random.Random(50_000 + i), steps=4) for i in range(100)]
    ev = ttm.evaluate(model, tok, problems, rng_seed=3, own=False)
    assert ev["localization"] >= 1.5 * ev["localization_chance"], ev


@pytest.mark.slow
def test_trainer_runs_and_saves(tmp_path):
    """A few steps of the real trainer from scratch, then a warm start with --anchor-solve: both write
    a loadable model directory and a report with the evaluation."""
    out, script = tmp_path / "m", str(ROOT / "tools" / "train_tiny_model.py")
    small = [
        "--hidden-size",
        "32",
        "--num-layers",
        "1",
        "--num-heads",
        "2",
        "--intermediate-size",
        "64",
        "--batch-size",
        "4",
        "--num-eval",
        "4",
        "--threads",
        "1",
    ]
    cmd = [sys.executable, script, *small, "--out-dir", str(out), "--max-steps", "3", "--eval-every", "3"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((out / "training_report.json").read_text())
    assert report["step"] == 3 and 0.0 <= report["localization"] <= 1.0
    warm = [
        sys.executable,
        script,
        *small,
        "--init-from",
        str(out),
        "--anchor-solve",
        "--max-steps",
        "2",
        "--eval-every",
        "2",
        "--out-dir",
        str(tmp_path / "m2"),
    ]
    r = subprocess.run(warm, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "m2" / "training_report.json").read_text())["init_from_report"]["step"] == 3


@pytest.mark.parametrize(
    "given, expected",
    [
        (["23+7=30", "30-5=24", "24+9=33", "#### 33"], "Step 1: 23+7=30\nStep 2: 30-5=2? wrong\n\\boxed{2}"),
        (["23+7=30", "30+5=35", "35+9=44", "#### 44"], "Step 1: 23+7=30\nStep 2: 30? wrong\n\\boxed{2}"),
        (["23+7=3", "3-5=-2"], "Step 1: 23+7=3? wrong\n\\boxed{1}"),  # a line ending early
        (["23+7=300", "300-5=295"], "Step 1: 23+7=30? wrong\n\\boxed{1}"),  # a line running on
        (["23+7=30", "30-5=25"], "Step 1: 23+7=30\nStep 2: 30-5=25\nStep 3: ? wrong\n\\boxed{3}"),  # missing line
        (
            [" 23+7=30 ", "30-5=25", "25+9=34", "#### 34"],
            "Step 1: 23+7=30\nStep 2: 30-5=25\nStep 3: 25+9=34\nStep 4: #### 34\n\\boxed{0}",
        ),
    ],
)
def test_arith_localization_target_hand_cases(given, expected):
    assert ttm.arith_localization_target(tasks.parse_arith_problem("23+7-5+9"), given) == expected


def test_arith_localization_target_names_the_first_error():
    """The boxed step of the training reply is arith_first_error's answer, and the reply is the given
    solution's text up to the first character that differs from the correct solution."""
    rng = random.Random(2)
    for _ in range(500):
        p = tasks.make_arith_problem(rng, steps=rng.randint(1, 6))
        lines = p.solution().split("\n")
        k = rng.randint(1, len(lines))
        bad = list(lines)
        a, rest = bad[k - 1].split("=") if k <= len(p.ops) else (bad[k - 1], "")
        if rest:  # a wrong result, operand or operator, as a sampler would write
            bad[k - 1] = rng.choice(
                [
                    f"{a}={int(rest) + rng.choice([-11, -1, 1, 10])}",
                    a.replace("+", "#").replace("-", "+").replace("#", "-") + "=" + rest,
                    a[:-1] + str(int(a[-1]) % 9 + 1) + "=" + rest,
                ]
            )
        else:
            bad[k - 1] = f"#### {p.answer + rng.choice([-3, 1, 20])}"
        first = tasks.arith_first_error(p, "\n".join(bad))
        reply = ttm.arith_localization_target(p, bad)
        assert rewards.last_boxed(reply) == str(first)
        body = reply.rsplit("\n", 1)[0].split("? wrong")[0]
        copied = "\n".join(ln.split(": ", 1)[1] for ln in body.split("\n"))
        assert "\n".join(bad).startswith(copied) and "\n".join(lines).startswith(copied)
        nxt = len(copied)
        assert "\n".join(bad)[nxt : nxt + 1] != "\n".join(lines)[nxt : nxt + 1]
        assert ttm.arith_localization_target(p, lines).endswith("\\boxed{0}")


@pytest.mark.parametrize("kind", ttm.POLICY_ERRORS)
def test_policy_errors_are_of_their_kind_and_match_the_oracle(kind):
    """Each wrong-solution kind of --error-mix: its first wrong line is arith_first_error's, and localization.py's
    classifier puts it in its class (the kinds a policy's own failures take)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from localization import first_error_class

    want = {"slip": {"slip"}, "wrong_value": {"wrong_value"}, "skip": {"skipped_or_reordered"}}
    want |= {"reorder": {"skipped_or_reordered"}, "foreign": {"foreign"}, "early_answer": {"other"}}
    want |= {"answer": {"other"}, "operand": {"skipped_or_reordered", "foreign"}}
    want |= {"operator": {"skipped_or_reordered", "foreign"}}
    rng, made = random.Random(5), 0
    for _ in range(300):
        p = tasks.make_arith_problem(rng, steps=rng.randint(2, 16))
        got = ttm.policy_error(p, rng, kind)
        if got is None:
            continue
        lines, k = got
        made += 1
        text = "\n".join(lines)
        assert tasks.arith_first_error(p, text) == k
        assert first_error_class(p, text)[1] in want[kind], (kind, p.text, text)
        reply = ttm.arith_localization_target(p, lines)
        assert rewards.last_boxed(reply) == str(k)
    assert made > 150  # most problems take every kind


def test_the_default_data_stream_is_the_bundled_models():
    """Without the new flags, sample_example draws exactly what it drew when the bundled models were trained: the same
    examples from the same random calls (a reference example draws nothing more)."""
    args = ttm.Args()
    for seed in range(40):
        rng, mine = random.Random(seed), random.Random(seed)
        got = ttm.sample_example(rng, args)
        problem = tasks.make_arith_problem(mine, steps=mine.randint(args.min_steps_task, args.max_steps_task))
        kind = mine.choices(range(3), weights=args.mix)[0]
        if kind == 0:
            want = (tasks.arith_prompt(problem), problem.solution(), 0)
        elif kind == 1:
            correct = mine.random() < args.loc_correct_frac
            lines = problem.solution().split("\n") if correct else ttm.corrupt_solution(problem, mine)[0]
            want = (ttm.arith_localization_prompt(problem, lines), ttm.arith_localization_target(problem, lines), 1)
        else:
            want = (ttm.arith_reference_prompt(problem, problem.solution()), problem.solution(), 2)
        assert got == want and rng.getstate() == mine.getstate()


def test_a_checked_reference_is_wrong_and_its_target_is_right():
    args = ttm.Args(mix=(0.0, 0.0, 1.0), reference_error_frac=1.0, error_mix=(1.0,) * len(ttm.POLICY_ERRORS))
    rng = random.Random(3)
    for _ in range(50):
        prompt, target, kind = ttm.sample_example(rng, args)
        reference = prompt.split("Reference solution:\n", 1)[1].split("\nSolve: ")[0]
        problem = tasks.parse_arith_problem(prompt.rsplit("Solve: ", 1)[1].strip())
        assert kind == 2 and target == problem.solution() and tasks.arith_first_error(problem, reference) is not None


@pytest.mark.slow
def test_a_resumed_run_ends_where_an_unbroken_one_does(tmp_path):
    """Training stopped after step 2 and resumed (--resume, its state written at the evaluation) gives the same
    weights at step 4 as one run of 4 steps, and a state of other flags is refused."""
    from safetensors.torch import load_file

    script = str(ROOT / "tools" / "train_tiny_model.py")
    small = ["--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--intermediate-size", "64"]
    small += ["--batch-size", "4", "--num-eval", "2", "--threads", "1", "--max-steps", "4", "--eval-every", "2"]
    small += ["--min-steps", "10", "--max-positions", "1024", "--error-mix", *["1"] * len(ttm.POLICY_ERRORS)]
    run = lambda out, *more: subprocess.run(  # noqa: E731
        [sys.executable, script, *small, "--out-dir", str(out), *more], cwd=ROOT, capture_output=True, text=True
    )
    r = run(tmp_path / "whole")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run(tmp_path / "broken", "--checkpoint-minutes", "1000", "--stop-step", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "broken.resume.pt").exists()
    r = run(tmp_path / "broken", "--checkpoint-minutes", "1000", "--resume")
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-2000:]
    whole, broken = (load_file(tmp_path / d / "model.safetensors") for d in ("whole", "broken"))
    assert whole.keys() == broken.keys() and all(torch.equal(whole[k], broken[k]) for k in whole)
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["max_position_embeddings"] == 1024
    r = run(tmp_path / "broken", "--resume", "--lr", "1e-3")
    assert r.returncode != 0 and "other flags (lr)" in r.stderr

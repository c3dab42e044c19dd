"""A TRL user's rewards and data, unchanged: --reward-fn called as TRL's GRPOTrainer calls it (completion_ids,
trainer_state, log_extra / log_metric, typed columns, async functions awaited together, None as "not this row"), the
per-function metrics, every reward failure as one line, the data formats read as `datasets` reads them (as TRL's
users do), reward models, and the Hugging Face round trip (the bundled tokenizers through AutoTokenizer,
--save-model's folder and its model card)."""

import asyncio
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY_MODEL
from helpers import read_metrics, run_dir

import common
from rlvr_utils.core import runtime, tasks
from rlvr_utils.extras.data import data_tasks, datafiles
from rlvr_utils.extras.reward_fns import custom, reward_calls, reward_logs

SCRIPTS = ["grpo.py", "sc_grpo.py", "grpo_lambda.py", "ep_grpo.py", "srpo.py"]
SHORT = "--total-steps 2 --eval-every 0 --prompts-per-step 4 --num-generations 4 --threads 1 --max-new-tokens 32"
REWARDS = '''
import asyncio, json, os, re, sys, time


def _text(c):
    return c if isinstance(c, str) else c[0]["content"]


def recording(prompts, completions, completion_ids, trainer_state, answer, code, mixed, log_extra, log_metric,
              **kwargs):
    """TRL's keywords and the typed columns, recorded; 1.0 when the last '#### N' is the answer."""
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps({
            "step": trainer_state.global_step, "max_steps": trainer_state.max_steps, "ids": completion_ids,
            "texts": [_text(c) for c in completions], "code": code, "mixed": mixed,
            "types": [[type(v).__name__ for v in row] for row in zip(answer, code, mixed)],
        }) + "\\n")
    log_extra("chars", [len(_text(c)) for c in completions])
    log_metric("custom/calls", 1.0)
    found = [re.findall(r"####\\s*(-?\\d+)", _text(c))[-1:] for c in completions]
    return [1.0 if f == [str(a)] else 0.0 for f, a in zip(found, answer)]


async def judge(prompts, completions, **kwargs):
    await asyncio.sleep(0.05)
    return [0.5] * len(completions)


def sometimes(prompts, completions, **kwargs):
    return [None if i % 2 else 0.25 for i in range(len(completions))]


def one_float(prompts, completions, **kwargs):
    return 0.5


def exits(prompts, completions, **kwargs):
    sys.exit(0)


def interrupts(prompts, completions, **kwargs):
    raise KeyboardInterrupt


def hangs(prompts, completions, **kwargs):
    time.sleep(600)
'''


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """Rows with typed columns ("007" among ints, one float among ints) and the reward file."""
    d = tmp_path_factory.mktemp("trl_user")
    (d / "rewards.py").write_text(REWARDS)
    (d / "exit_at_import.py").write_text("import sys\nsys.exit(0)\n")
    (d / "interrupt_at_import.py").write_text("raise KeyboardInterrupt\n")
    rng, rows = random.Random(0), []
    for i in range(24):
        p = tasks.make_arith_problem(rng, steps=3)
        code = "007" if i % 3 == 0 else i
        rows.append({"prompt": tasks.arith_prompt(p), "answer": p.answer, "code": code, "mixed": i})
    rows[5]["mixed"] = 1.5
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _run(script, *args, env=None, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, str(ROOT / script), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _custom(user, *fns):
    flags = ["--task", "custom", "--data-path", str(user / "rows.jsonl"), "--num-eval", "4"]
    return flags + [x for fn in fns for x in ("--reward-fn", f"{user / 'rewards.py'}:{fn}")]


def _one_line(out, *words, code):
    assert out.returncode == code, (out.returncode, out.stderr[-2000:])
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert all(w in lines[0] for w in words), (words, lines[0])
    return lines[0]


# --- every script, the whole contract at once (the real entry point) -----------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_calls_rewards_as_trl_does(user, tmp_path, tiny, script):
    log = tmp_path / "calls.jsonl"
    out = _run(
        script,
        *_custom(user, "recording", "judge", "sometimes"),
        "--output-dir",
        str(tmp_path / "runs"),
        *SHORT.split(),
        env={"REWARD_LOG": str(log)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    m = read_metrics(tmp_path / "runs")
    assert [r["step"] for r in m] == [0, 1, 2]
    for name in ("recording", "judge", "sometimes"):  # TRL's per-function metrics, in training and evaluation
        assert all(f"rewards/{name}/{s}" in m[k] for k in (1, 2) for s in ("mean", "std")), m[1]
        assert f"eval/rewards/{name}/mean" in m[0] and f"eval/rewards/{name}/std" in m[2]
    assert m[1]["rewards/judge/mean"] == 0.5 and m[1]["rewards/sometimes/mean"] == 0.25  # None rows left out
    assert m[1]["custom/calls"] == 1.0 and m[0]["eval/custom/calls"] == 1.0  # log_metric
    extra = [json.loads(line) for line in (run_dir(tmp_path / "runs") / "completions.jsonl").open()]
    assert {r["step"] for r in extra} == {0, 1, 2} and all(r["chars"] == len(r["completion"]) for r in extra)
    assert all(r["row"].startswith(str(user / "rows.jsonl") + ":") for r in extra)  # log_extra, with the file line
    calls = [json.loads(line) for line in log.open()]
    steps = [c["step"] for c in calls]
    assert steps == sorted(steps) and {0, 1, 2} <= set(steps) and {c["max_steps"] for c in calls} == {2}
    tok = tiny[1]
    for c in calls:  # the completion ids are the completion's tokens; the columns as datasets reads the file (TRL)
        assert [tok.decode(ids, skip_special_tokens=True) for ids in c["ids"]] == c["texts"]
        for types in c["types"]:  # "007" among ints decodes to 7; one float makes the column floats
            assert types == ["int", "int", "float"], types
    if script != "srpo.py":  # the sampled ids, stop token included, in training (16 rows) as in evaluation (4 rows)
        for c in calls:  # (srpo.py's calls do not pass the sampled ids yet: its texts are re-encoded, no stop token)
            assert any(ids and ids[-1] == tok.eos_token_id for ids in c["ids"]), c


# --- the failures, through the real entry point ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "fn, flags, code, words",
    [
        ("one_float", [], 1, ["one_float", "returned 0.5 (float) for 4 completions"]),
        ("interrupts", [], 130, ["interrupts", "KeyboardInterrupt", "stopping now"]),
        ("hangs", ["--reward-timeout", "1"], 1, ["hangs", "did not return within 1 s", "--reward-timeout"]),
    ],
)
def test_a_reward_failing_mid_run_is_one_line_and_never_exit_0(user, tmp_path, fn, flags, code, words):
    t0 = time.time()
    out = _run("grpo.py", *_custom(user, fn), *flags, "--output-dir", str(tmp_path), *SHORT.split())
    _one_line(out, *words, code=code)
    assert time.time() - t0 < 120


@pytest.mark.parametrize("module, words", [("exit_at_import", ["sys.exit(0)"]), ("interrupt_at_import", ["Keyboard"])])
def test_a_reward_module_exiting_at_import_is_one_line_exit_2(user, tmp_path, module, words):
    spec = f"{user / module}.py:r"
    out = _run(
        "grpo.py",
        "--task",
        "custom",
        "--data-path",
        str(user / "rows.jsonl"),
        "--reward-fn",
        spec,
        "--output-dir",
        str(tmp_path / "r"),
    )
    _one_line(out, f"--reward-fn {spec}", *words, code=2)
    assert not (tmp_path / "r").exists()


# --- the calling convention, in process ------------------------------------------------------------------------------
def _examples(n, columns=None):
    return [
        tasks.Example(
            i, "q", "", "p", [1], meta={"prompt": f"p{i}", "columns": (columns or {}), "where": f"f.jsonl:{i + 1}"}
        )
        for i in range(n)
    ]


def test_kwargs_trainer_state_and_metrics(tmp_path):
    seen = []

    def spy(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, level, **kwargs):
        seen.append(dict(ids=completion_ids, step=trainer_state.global_step, epoch=trainer_state.epoch, level=level))
        log_extra("note", ["a", "b"])
        log_metric("m", 3.0)
        return [1.0, 0.0]

    def positional(prompts, completions):  # no **kwargs: gets only what it names
        return [0.5, 0.5]

    rf = reward_calls.RewardFunctions([("s.py:spy", spy), ("s.py:positional", positional)], [1.0, 2.0])
    rf.begin(tmp_path, 0, 0, total_steps=4, prompts_per_step=2, num_train=8)
    assert rf(["x", "y"], _examples(2, {"level": 3}), [[5, 1], [6]]) == [2.0, 1.0]
    out = rf.metrics(1)
    assert seen[0] == dict(ids=[[5, 1], [6]], step=0, epoch=0.0, level=[3, 3])
    assert out == {
        "rewards/spy/mean": 0.5,
        "rewards/spy/std": pytest.approx(2**-0.5),
        "rewards/positional/mean": 0.5,
        "rewards/positional/std": 0.0,
        "m": 3.0,
    }
    rf(["x", "y"], _examples(2, {"level": 1}), mode="eval")
    assert seen[1]["step"] == 1 and seen[1]["epoch"] == 0.25 and rf.state.max_steps == 4
    assert rf.metrics(mode="eval")["eval/m"] == 3.0
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").open()]
    assert [(r["step"], r["mode"], r["note"], r["row"]) for r in rows] == [
        (1, "train", "a", "f.jsonl:1"),
        (1, "train", "b", "f.jsonl:2"),
        (1, "eval", "a", "f.jsonl:1"),
        (1, "eval", "b", "f.jsonl:2"),
    ]


def test_log_extra_nan_is_written_as_json_null(tmp_path):
    """json.dumps writes a float NaN as `NaN`, which JSON readers other than Python's refuse: completions.jsonl holds
    null there, as metrics.jsonl does, inside a list too."""

    def f(prompts, completions, log_extra, **kwargs):
        log_extra("x", [float("nan"), 1.5])
        log_extra("v", [[float("inf"), 2.0], {"a": -float("inf")}])
        log_extra("np", np.array([np.nan, 0.5], dtype=np.float32))  # numpy values: numbers, not str(value)
        log_extra("t", [torch.tensor([1.0, float("nan")]), torch.tensor(2.0)])
        return [1.0, 0.0]

    rf = reward_calls.RewardFunctions([("s.py:f", f)])
    rf.begin(tmp_path, 0, 0, total_steps=4, prompts_per_step=2, num_train=8)
    rf(["x", "y"], _examples(2), [[5, 1], [6]])
    rf.metrics(1)

    def strict(constant):
        raise ValueError(f"{constant} is not JSON")

    rows = [json.loads(line, parse_constant=strict) for line in (tmp_path / "completions.jsonl").open()]
    assert [(r["x"], r["v"]) for r in rows] == [(None, [None, 2.0]), (1.5, {"a": None})]
    assert [(r["np"], r["t"]) for r in rows] == [(None, [1.0, None]), (0.5, 2.0)]


def test_a_resumed_run_drops_the_completions_of_the_steps_it_trains_again(tmp_path):
    """--resume after step 1 of a run killed during step 3: completions.jsonl keeps steps 0-1 (steps 2-3 are trained
    again and logged again) and loses a line the kill cut short, as metrics.jsonl does."""
    rows = [{"step": k, "mode": "train", "completion": str(k)} for k in (1, 1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "mo'
    (tmp_path / "completions.jsonl").write_text(text)
    (tmp_path / "completions_rank1.jsonl").write_text(text)
    rf = reward_calls.RewardFunctions([("s.py:f", lambda prompts, completions, **k: [1.0] * len(completions))])
    rf.begin(tmp_path, 0, 1, total_steps=4, prompts_per_step=2, num_train=8)
    kept = [json.loads(line) for line in (tmp_path / "completions.jsonl").open()]
    assert [r["step"] for r in kept] == [1, 1]
    assert (tmp_path / "completions_rank1.jsonl").read_text() == text  # rank 1 trims its own file
    assert not list(tmp_path.glob("*.tmp"))


def test_async_rewards_are_awaited_together():
    spans = {}

    async def a(prompts, completions, **kw):
        spans["a"] = [time.time()]
        await asyncio.sleep(0.4)
        spans["a"].append(time.time())
        return [1.0] * len(completions)

    class B:  # an async callable object, as TRL's is_async_callable allows
        async def __call__(self, prompts, completions, **kw):
            spans["b"] = [time.time()]
            await asyncio.sleep(0.4)
            spans["b"].append(time.time())
            return [2.0] * len(completions)

    def returns_a_coroutine(prompts, completions, **kw):
        return a(prompts, completions)

    rf = reward_calls.RewardFunctions([("a", a), ("b", B()), ("c", returns_a_coroutine)])
    t0 = time.time()
    assert rf(["x"], _examples(1)) == [4.0]
    assert time.time() - t0 < 0.75 and spans["b"][0] < spans["a"][1]  # concurrently, not one after the other
    assert rf.names == ["a", "B", "returns_a_coroutine"]


def test_functions_of_the_same_name_log_under_names_no_other_function_has():
    def f(prompts, completions, **k):
        return [1.0] * len(completions)

    def g(prompts, completions, **k):
        return [2.0] * len(completions)

    g.__name__ = "f_2"  # a function whose own name is the suffix a repeated `f` would get
    rf = reward_calls.RewardFunctions([("a", f), ("b", f), ("c", g)])
    rf(["x"], _examples(1))
    assert rf.names == ["f", "f_3", "f_2"]
    means = {k: v for k, v in rf.metrics(1).items() if k.endswith("/mean")}
    assert means == {"rewards/f/mean": 1.0, "rewards/f_3/mean": 1.0, "rewards/f_2/mean": 2.0}  # none mixed


def test_none_is_not_this_functions_row_and_an_all_none_row_warns(capsys):
    fns = [
        ("a", lambda prompts, completions, **k: [None, 1.0, None]),
        ("b", lambda prompts, completions, **k: [0.5, None, None]),
    ]
    rf = reward_calls.RewardFunctions(fns, [2.0, 1.0])
    got = rf(["x", "y", "z"], _examples(3))  # the weighted sum of the numbers (TRL's nansum); none: NaN, no reward
    assert got[:2] == [0.5, 2.0] and math.isnan(got[2])
    err = capsys.readouterr().err
    assert "warning: every --reward-fn returned None for 1 of 3 completions" in err and "f.jsonl:3" in err
    assert "advantage 0" in err
    assert rf.metrics(1) == {
        "rewards/<lambda>/mean": 1.0,
        "rewards/<lambda>/std": 0.0,
        "rewards/<lambda>_2/mean": 0.5,
        "rewards/<lambda>_2/std": 0.0,
    }


@pytest.mark.parametrize(
    "value, words",
    [
        (0.5, ["returned 0.5 (float) for 2 completions"]),
        (object(), ["(object) for 2 completions"]),
        ("11", ["'11' (str)"]),
        ({"a": 1}, ["(dict)"]),
        ([1.0], ["returned 1 values for 2 completions"]),
        ([1.0, "x"], ["'x' (str) for completion 1", "f.jsonl:2"]),
        ([10**400, 1.0], ["int too large for a float", "completion 0", "f.jsonl:1"]),
        ([1.0, float("inf")], ["inf", "f.jsonl:2", "finite number"]),
        ([1e300, 1.0], ["1e+300", "f.jsonl:1", "at most 1e+18"]),
        (torch.zeros(2, device="meta"), ["Tensor that cannot be read"]),
    ],
)
def test_every_bad_return_is_one_line_naming_the_function(capsys, value, words):
    rf = reward_calls.RewardFunctions([("my.py:bad", lambda prompts, completions, **k: value)])
    with pytest.raises(SystemExit) as e:
        rf(["x", "y"], _examples(2))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and err[0].startswith("error: --reward-fn my.py:bad"), err
    assert all(w in err[0] for w in words), (words, err)


def test_log_metric_with_a_non_number_is_one_line_naming_the_function(capsys):
    def bad(prompts, completions, log_metric, **k):
        log_metric("m", "high")
        return [1.0]

    with pytest.raises(SystemExit):
        reward_calls.RewardFunctions([("my.py:bad", bad)])(["x"], _examples(1))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--reward-fn my.py:bad raised ValueError: log_metric('m', 'high')" in err[0], err


def test_good_returns_tensors_numpy_and_bools():
    import numpy as np

    for value in (torch.tensor([0.5, 1.0]), np.array([0.5, 1.0]), [np.float32(0.5), True], (x for x in (0.5, 1))):
        rf = reward_calls.RewardFunctions([("ok", lambda prompts, completions, value=value, **k: value)])
        assert rf(["x", "y"], _examples(2)) == [0.5, 1.0]


def _hang(prompts, completions, **kw):
    time.sleep(60)


async def _ahang(prompts, completions, **kw):
    await asyncio.sleep(60)


def _busy(prompts, completions, **kw):
    while True:
        pass


@pytest.mark.parametrize("fn", [_hang, _ahang, _busy])
def test_reward_timeout_stops_a_hung_call(capsys, fn):
    rf = reward_calls.RewardFunctions([("my.py:slow", fn)], timeout=0.5)
    t0 = time.time()
    with pytest.raises(SystemExit) as e:
        rf(["x"], _examples(1))
    assert e.value.code == 1 and time.time() - t0 < 5
    assert "error: --reward-fn my.py:slow did not return within 0.5 s (--reward-timeout)" in capsys.readouterr().err
    time.sleep(0.6)  # nothing fires after the call is over


def test_reward_timeout_still_fires_after_a_later_run_took_sigusr1():
    """The watchdog's signal is SIGUSR1, which each run's GracefulStop also takes (Slurm's warning). A second run in
    the same process (a notebook, a test runner) replaced the watchdog's handler: a hung reward then asked the run to
    stop, went on, and 10 s later the process ended at once (os._exit: a pytest run died silently). In a child
    process, since the old behaviour ends whatever process it runs in."""
    code = (
        "import time, sys\n"
        "from rlvr_utils.core import runtime, tasks; from rlvr_utils.extras.reward_fns import reward_calls\n"
        "ex = [tasks.Example(0, 'q', '', 'p', [1], meta={'prompt': 'p', 'columns': {}, 'where': 'f.jsonl:1'})]\n"
        "ok = lambda prompts, completions, **k: [1.0]\n"
        "reward_calls.RewardFunctions([('ok', ok)], timeout=5.0)(['x'], ex)  # installs the watchdog\n"
        "runtime.GracefulStop()  # a later run's handlers\n"
        "t0 = time.time()\n"
        "try:\n"
        "    reward_calls.RewardFunctions([('my.py:slow', lambda *a, **k: time.sleep(60))], timeout=0.5)(['x'], ex)\n"
        "except SystemExit as e:\n"
        "    print('stopped', e.code, round(time.time() - t0))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[:2] == ["stopped", "1"], (r.returncode, r.stdout, r.stderr[-500:])
    assert int(r.stdout.split()[2]) < 5 and "SIGUSR1" not in r.stderr, r.stderr[-500:]


def test_exits_and_interrupts_from_a_reward(capsys):
    def raises(exc):
        def fn(prompts, completions, **kw):
            raise exc

        return fn

    for exc, code in ((SystemExit(0), 1), (SystemExit(3), 1), (KeyboardInterrupt(), 130)):
        with pytest.raises(SystemExit) as e:
            reward_calls.RewardFunctions([("my.py:f", raises(exc))])(["x"], _examples(1))
        assert e.value.code == code and capsys.readouterr().err.count("error: --reward-fn my.py:f") == 1

    def interrupted(prompts, completions, **kw):  # as runtime's handler raises it on a second Ctrl-C
        exec(compile("raise StopNow(130)", runtime.__file__, "exec"), {"StopNow": runtime.StopNow})

    with pytest.raises(runtime.StopNow):  # a second Ctrl-C while a reward runs: the run's own stop, untouched
        reward_calls.RewardFunctions([("my.py:f", interrupted)])(["x"], _examples(1))
    assert "error" not in capsys.readouterr().err


def test_first_evaluation_warns_when_the_threshold_says_nothing(tmp_path, capsys):
    rf = reward_calls.RewardFunctions([("sum", lambda prompts, completions, **k: [1.5, 2.0])], success_threshold=1.0)
    rf.begin(tmp_path, 0, 0, 2, 2, 4)
    rf(["x", "y"], _examples(2), mode="eval")
    rf.metrics(mode="eval")
    err = capsys.readouterr().err
    assert "eval/accuracy 1.000 at the first evaluation" in err and "--success-threshold 1" in err
    rf(["x", "y"], _examples(2), mode="eval")
    rf.metrics(mode="eval")
    assert "warning" not in capsys.readouterr().err  # once


def test_reserved_columns_and_reward_models_are_refused_with_a_pointer(tmp_path):
    assert "trainer_state" in custom.prompt_problem({"prompt": "p", "trainer_state": 1})
    model_dir = tmp_path / "rm"
    model_dir.mkdir()
    for spec in (str(model_dir), "OpenAssistant/reward-model-deberta-v3-large-v2"):
        with pytest.raises(custom.RewardFnError, match="RewardModel"):
            custom.load_reward_fn(spec)


def test_reward_model_wrapper_scores_as_trl(tmp_path):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cfg.num_labels, cfg.pad_token_id = 1, 0
    Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(tmp_path / "rm")
    (tmp_path / "my_rm.py").write_text(
        f"from rlvr_utils.extras.reward_fns.custom import RewardModel\nscore = RewardModel({str(tmp_path / 'rm')!r})\n"
    )
    score = custom.load_reward_fn(f"{tmp_path / 'my_rm.py'}:score")
    got = reward_calls.RewardFunctions([("rm", score)])(["1+1=2", "1+1=3 and more"], _examples(2))
    assert len(got) == 2 and got[0] != got[1]
    model = score.model
    with torch.no_grad():
        alone = model(**score.tokenizer(["p0" + "1+1=2"], return_tensors="pt", add_special_tokens=False)).logits[0, 0]
    assert got[0] == pytest.approx(float(alone), abs=1e-5)  # right padding: a row's score does not depend on the batch


# --- data as datasets reads it (as TRL's users do) ------------------------------------------------------------------
def test_data_formats_are_read_as_datasets_reads_them(tmp_path, tiny):
    rows = [
        {"prompt": "Solve: 1+2\n", "answer": 3, "code": "007"},
        {"prompt": "Solve: 2+2\n", "answer": 4.5, "code": 12},
    ]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.JSONL").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "d" / "b.json").write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    (tmp_path / "d" / "c.csv").write_text('prompt,answer\n"Solve: 1+2\n",3\nSolve: 5+5,10\n')
    (tmp_path / "d" / "e.tsv").write_text("prompt\tanswer\nSolve: 1+2\t3\n")
    (tmp_path / "d" / "notes.txt").write_text("not data")
    got, wheres = datafiles.read_rows(tmp_path / "d")
    typed = [{**r, "answer": float(r["answer"]), "code": int(r["code"])} for r in rows]  # one float: all floats
    assert got[:4] == typed + typed and type(got[0]["answer"]) is float and got[0]["code"] == 7
    assert got[4:] == [
        {"prompt": "Solve: 1+2\n", "answer": 3},
        {"prompt": "Solve: 5+5", "answer": 10},
        {"prompt": "Solve: 1+2", "answer": 3},
    ]
    assert [w.rsplit("/", 1)[1] for w in wheres] == [
        "a.JSONL:1",
        "a.JSONL:2",
        "b.json:2",
        "b.json:3",
        "c.csv:2",
        "c.csv:4",
        "e.tsv:2",
    ]
    reward = tmp_path / "r.py"
    reward.write_text("def r(prompts, completions, answer, **kw):\n    return [0.0] * len(completions)\n")
    task = tasks.load_task(
        "custom",
        tiny[1],
        data_path=str(tmp_path / "d" / "a.JSONL"),
        eval_data_path=str(tmp_path / "d" / "b.json"),
        num_eval=2,
        reward_fn=[f"{reward}:r"],
    )
    assert [e.meta["columns"]["answer"] for e in task.train] == [3.0, 4.5] and task.eval[1].meta["where"].endswith(
        "b.json:3"
    )


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"prompt": "a", "x": 1}\n{"prompt": "b", "x": NaN}\n', ["rows.jsonl:2", "NaN is not a JSON value"]),
        ('{"prompt": "a", "x": Infinity}\n', ["rows.jsonl:1", "Infinity"]),
        ('{"prompt": "a"}\n{"prompt": ""}\n', ["rows.jsonl: row 2 (line 2)", "empty"]),
    ],
)
def test_bad_data_is_one_line_naming_the_file_line(tmp_path, capsys, text, words):
    (tmp_path / "rows.jsonl").write_text(text)
    with pytest.raises(SystemExit) as e:
        data_tasks.check_data("custom", str(tmp_path / "rows.jsonl"), "--data-path")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and all(w in err[0] for w in words), err


def test_the_readme_reward_scores_an_int_column_with_one_float(tmp_path, tiny):
    """The README's reward on rows whose answers are ints but one: `datasets` reads them all as floats, as TRL's users
    get them (44.0), and the reward compares numbers, so it scores them right under both trainers."""
    model, tok = tiny
    rng, rows = random.Random(0), []
    for _ in range(8):
        p = tasks.make_arith_problem(rng, steps=3)
        rows.append({"prompt": tasks.arith_prompt(p), "answer": p.answer})
    rows[-1]["answer"] = 0.5
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    readme = (ROOT / "README.md").read_text().split("## Your own task", 1)[1].split("```python\n", 1)[1].split("```")[0]
    (tmp_path / "my_reward.py").write_text(readme)
    task = tasks.load_task(
        "custom",
        tok,
        data_path=str(tmp_path / "rows.jsonl"),
        eval_data_path=str(tmp_path / "rows.jsonl"),
        num_eval=4,
        reward_fn=[f"{tmp_path / 'my_reward.py'}:correct_sum"],
    )
    assert common.evaluate(model, tok, task, 40)["eval/accuracy"] >= 0.5


# --- the Hugging Face round trip -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-arith", "tiny-arith-long"])
def test_bundled_tokenizer_round_trips_through_autotokenizer(name):
    from transformers import AutoTokenizer

    auto, ours = (
        AutoTokenizer.from_pretrained(ROOT / "assets" / name),
        common.load_tokenizer(str(ROOT / "assets" / name)),
    )
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(32, 127)] + ["\n"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        ids = ours(text).input_ids
        assert auto(text).input_ids == ids and auto.decode(ids) == text == ours.decode(ids)
    assert (auto.eos_token_id, auto.pad_token_id) == (ours.eos_token_id, ours.pad_token_id) == (1, 0)


def test_tiny_models_greedy_answers_are_the_same_through_autotokenizer(tiny):
    from transformers import AutoTokenizer

    model, ours = tiny
    auto = AutoTokenizer.from_pretrained(TINY_MODEL)
    rng = random.Random(3)
    prompts = [tasks.arith_prompt(tasks.make_arith_problem(rng, steps=4)) for _ in range(6)]
    answers = []
    for tok in (auto, ours):  # one batched greedy call each, left-padded as the tokenizer says
        enc = tok(prompts, return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=48, do_sample=False, pad_token_id=0)
        answers.append(tok.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True))
    assert answers[0] == answers[1] and all("####" in a for a in answers[0])


def test_the_docs_chat_template_keeps_the_prompt_the_model_was_trained_on(tmp_path, monkeypatch):
    text = (
        (ROOT / "docs" / "tasks.md")
        .read_text()
        .split("**Adding a chat template", 1)[1]
        .split("```python\n", 1)[1]
        .split("```")[0]
    )
    monkeypatch.chdir(tmp_path)
    shutil.copytree(TINY_MODEL, tmp_path / "assets" / "tiny-arith")
    exec(compile(text, "README", "exec"), {})
    tok = common.load_tokenizer(str(tmp_path / "my-model"))
    plain = "Solve: 49+7-5-7\n"
    rendered, user, chat = custom.render(tok, [{"role": "user", "content": plain}])
    assert (
        chat
        and rendered == plain
        and tasks.encode_prompt(tok, rendered) == common.load_tokenizer(str(TINY_MODEL))(plain).input_ids
    )


@pytest.mark.slow
def test_save_model_writes_a_card_and_loads_with_the_auto_classes(tmp_path, tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _run(
        "grpo.py",
        "--save-model",
        "--num-eval",
        "4",
        "--output-dir",
        str(tmp_path),
        *SHORT.split()[:2],
        *SHORT.split()[4:],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    folder = run_dir(tmp_path) / "model"
    card = (folder / "README.md").read_text()
    final = read_metrics(tmp_path)[-1]["eval/accuracy"]
    assert "grpo.py" in card and "GRPO: group-relative policy optimization" in card and "--total-steps 2" in card
    assert f"Final accuracy **{final:.3f}** after step 2" in card and "\nlibrary_name: transformers\n" in card
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ours_model, ours_tok = common.load_policy(str(folder), torch.device("cpu"))
    prompt = "Solve: 49+7-5-7\n"
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids.tolist() == ours_tok(prompt, return_tensors="pt").input_ids.tolist()
    a = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False, pad_token_id=0)
    b = ours_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False, pad_token_id=0
    )
    assert tok.decode(a[0], skip_special_tokens=True) == ours_tok.decode(b[0], skip_special_tokens=True)


# --- review fixes ---------------------------------------------------------------------------------------------------
def test_a_log_metric_name_of_ours_keeps_ours_and_the_functions_under_its_own_name(capsys):
    """TRL's documented log_metric("accuracy", ...) in an evaluation: eval/accuracy stays the run's success share and
    the function's number is kept as eval/log_metric/accuracy (it was dropped); "step" can never replace a row's."""
    builtin = {"reward": 1.0, "eval/accuracy": 0.5}
    got = reward_logs.merged(builtin, {"reward": 42.0, "my/metric": 2.0, "eval/accuracy": 0.9, "step": 7.0})
    assert got == builtin | {"log_metric/reward": 42.0, "my/metric": 2.0, "eval/log_metric/accuracy": 0.9,
                             "log_metric/step": 7.0}  # fmt: skip
    assert capsys.readouterr().err.count("'reward'") == 1
    assert reward_logs.merged({"reward": 1.0}, {"reward": 7.0}) == {"reward": 1.0, "log_metric/reward": 7.0}
    assert "warning" not in capsys.readouterr().err  # once per name


def test_a_generator_reward_that_raises_is_one_line(capsys):
    def lazy(prompts, completions, **kw):
        return (float(int(c)) for c in completions)  # int("x") raises while the list is built

    with pytest.raises(SystemExit) as e:
        reward_calls.RewardFunctions([("my.py:lazy", lazy)])(["x"], _examples(1))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and "my.py:lazy raised ValueError" in err[0], err


def test_an_async_reward_s_own_timeout_error_is_not_our_timeout(capsys):
    async def upstream(prompts, completions, **kw):
        raise TimeoutError("the judge did not answer")

    for timeout in (0.0, 5.0):
        with pytest.raises(SystemExit):
            reward_calls.RewardFunctions([("my.py:judge", upstream)], timeout=timeout)(["x"], _examples(1))
        err = capsys.readouterr().err
        assert "raised TimeoutError: the judge did not answer" in err and "--reward-timeout" not in err, err


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("rows.jsonl", '{"prompt": "a", "x": 1e400}\n', ["rows.jsonl:1", "too large"]),
        ("rows.json", '[{"prompt": "a"} {"prompt": "b"}]', ["rows.json:1", "not a JSON object"]),
        ("rows.json", '[{"prompt": "a"},\n{"prompt": "b"}', ["rows.json"]),
    ],
)
def test_values_and_arrays_json_refuses(tmp_path, capsys, name, text, words):
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as e:
        data_tasks.check_data("custom", str(tmp_path / name), "--data-path")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and all(w in err[0] for w in words), err


def test_a_line_separator_inside_a_json_string_is_not_a_new_row(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "a\u2028b", "x": 1}, ensure_ascii=False) + "\n")
    rows, where = datafiles.read_rows(tmp_path / "rows.jsonl")
    assert rows == [{"prompt": "a\u2028b", "x": 1}] and where[0].endswith("rows.jsonl:1")


def test_a_directory_of_split_files_is_refused(tmp_path):
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text('{"prompt": "a"}\n')
    with pytest.raises(datafiles.DataFileError, match="--eval-data-path"):
        datafiles.read_rows(tmp_path)
    (tmp_path / "test.jsonl").unlink()
    (tmp_path / "more.jsonl").write_text('{"prompt": "b"}\n')
    assert len(datafiles.read_rows(tmp_path)[0]) == 2  # shards of one split are read in name order


def test_the_first_evaluation_does_not_warn_on_a_hard_task_at_zero(tmp_path, capsys):
    for outs, warns in (([0.0, 0.0], False), ([0.2, 0.5], True)):
        rf = reward_calls.RewardFunctions([("f", lambda prompts, completions, o=outs, **k: o)], success_threshold=1.0)
        rf.begin(tmp_path, 0, 0, 2, 2, 4)
        rf(["x", "y"], _examples(2), mode="eval")
        rf.metrics(mode="eval")
        assert ("eval/accuracy 0.000 at the first evaluation" in capsys.readouterr().err) == warns

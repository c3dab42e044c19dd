"""Bad input ends with one line naming the flag or file and what is allowed, exit code 2, no traceback, before
anything loads and before the run directory exists (cli.py and each script's validate)."""

import gzip
import importlib.util
import json
import re
import time

import pytest
from helpers import run_script

from rlvr_utils.core import models
from rlvr_utils.extras.data import data_tasks

CASES = [  # (script, flags, words the one line must hold)
    ("grpo.py", ["--num-generations", "1"], ["--num-generations", ">= 2"]),
    ("grpo.py", ["--num-generations", "0"], ["--num-generations", ">= 2"]),
    ("srpo.py", ["--num-generations", "1"], ["--num-generations", ">= 2"]),
    ("srpo.py", ["--num-generations", "3"], ["--num-generations", "multiple of 2"]),
    ("srpo.py", ["--dynamic-sampling"], ["--dynamic-sampling", "does not apply to srpo.py"]),
    ("srpo.py", ["--scale-rewards", "none"], ["--scale-rewards", "does not apply to srpo.py", "population std"]),
    ("srpo.py", ["--overlong-buffer", "8"], ["--overlong-buffer", "does not apply to srpo.py"]),
    ("grpo.py", ["--prompts-per-step", "0"], ["--prompts-per-step", ">= 1"]),
    ("grpo.py", ["--prompts-per-step", "-3"], ["--prompts-per-step", ">= 1"]),
    ("grpo.py", ["--loss-agg", "sum"], ["--loss-agg", "token-mean", "seq-mean-token-sum-norm"]),
    ("grpo.py", ["--scale-rewards", "x"], ["--scale-rewards", "group", "batch", "none"]),
    ("grpo.py", ["--dtype", "fp32"], ["--dtype", "float32", "bfloat16"]),
    ("grpo.py", ["--temperature", "0"], ["--temperature", "> 0"]),
    ("grpo.py", ["--micro-batch-size", "0"], ["--micro-batch-size", ">= 1"]),
    ("grpo.py", ["--model", "assets/tiny-arth"], ["--model assets/tiny-arth", "no such directory"]),
    ("grpo.py", ["--num-minibatches", "3"], ["--num-minibatches 3", "divide", "--prompts-per-step 8"]),
    ("sc_grpo.py", ["--percentile", "120"], ["--percentile"]),
    ("grpo_lambda.py", ["--adv-clamp", "0.5"], ["--adv-clamp", "<= 0"]),
    (
        "srpo.py",
        ["--reset", "oracle", "--task", "gsm8k", "--data-path", "DATA", "--eval-data-path", "DATA"],
        ["--reset oracle", "arith"],
    ),
    ("grpo.py", ["--device", "tpu"], ["--device tpu", "cuda:N"]),
    ("grpo.py", ["--resume", "no/such/run"], ["--resume no/such/run", "not a run directory"]),
    # the ablation flags (rlvr_utils/methods/<method>_ablations.py): checked as the method's, once given
    ("srpo.py", ["--split", "2x4", "--num-generations", "6"], ["--num-generations", "multiple of 4", "--split 2x4"]),
    (
        "sc_grpo.py",
        ["--divergence", "sampled-logratio", "--kl-loss-coef", "0.1"],
        ["--kl-loss-coef", "--divergence kl"],
    ),
    ("sc_grpo.py", ["--divergence", "l2"], ["--divergence", "kl", "sampled-logratio"]),
    ("ep_grpo.py", ["--anchor-lag", "0"], ["--anchor-lag", ">= 1"]),
    ("ep_grpo.py", ["--gate-gamma", "0"], ["--gate-gamma", "> 0"]),
    ("grpo_lambda.py", ["--trace-apply", "both"], ["--trace-apply", "trace", "weight"]),
    ("sc_grpo.py", ["--percentil", "50"], ["--percentil"]),  # a mistake, not an ablation: tyro names it
]


def _check_one_line(out, words, output_dir):
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not any(output_dir.iterdir()), "a run directory was created for a run that never started"


@pytest.mark.parametrize("script, flags, words", CASES, ids=[f"{c[0]}:{' '.join(c[1])}" for c in CASES])
def test_bad_flag_is_one_clear_line(tmp_path, script, flags, words):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    out_dir = tmp_path / "runs"
    out_dir.mkdir()
    flags = [str(data) if f == "DATA" else f for f in flags]
    t0 = time.time()
    out = run_script(script, *flags, "--output-dir", str(out_dir), timeout=120)
    _check_one_line(out, words, out_dir)
    assert time.time() - t0 < 60  # before anything loads: no hub retries, no model


def _data(tmp_path, name, text):
    p = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(p, "wt") as f:
            f.write(text)
    else:
        p.write_text(text)
    return p


@pytest.mark.parametrize(
    "name, text, task, words",
    [
        (
            "bad.jsonl",
            '{"question": "a", "answer": "#### 1"}\n{"question": "b", "answer": \n',
            "gsm8k",
            ["bad.jsonl:2:", "not a JSON object"],
        ),
        ("empty.jsonl", "\n\n", "gsm8k", ["empty.jsonl", "empty"]),
        ("list.jsonl", "[1, 2]\n", "gsm8k", ["list.jsonl:1:", "expected a JSON object"]),
        ("missing.jsonl", '{"question": "a"}\n', "gsm8k", ["missing.jsonl: row 1", "answer"]),
        ("code.jsonl.gz", '{"prompt": "def f():", "test": "t"}\n', "code", ["row 1", "entry_point"]),
        ("x.txt", "a,b\n", "gsm8k", ["x.txt", ".jsonl"]),
        ("x.csv", "a,b\n", "gsm8k", ["x.csv", "no rows"]),
    ],
)
def test_bad_data_file_is_one_clear_line(tmp_path, name, text, task, words):
    path = _data(tmp_path, name, text)
    out_dir = tmp_path / "runs"
    out_dir.mkdir()
    out = run_script("grpo.py", "--task", task, "--data-path", str(path), "--output-dir", str(out_dir), timeout=120)
    _check_one_line(out, words, out_dir)


def test_data_path_the_task_ignores_is_an_error(tmp_path):
    data = _data(tmp_path, "x.jsonl", '{"question": "a", "answer": "#### 1"}\n')
    out_dir = tmp_path / "runs"
    out_dir.mkdir()
    out = run_script("grpo.py", "--task", "arith", "--data-path", str(data), "--output-dir", str(out_dir), timeout=120)
    _check_one_line(out, ["--data-path", "arith", "reads no data file"], out_dir)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here: --track would work")
def test_track_without_wandb_says_how_to_install_it(tmp_path):
    out = run_script("grpo.py", "--track", "--output-dir", str(tmp_path), timeout=120)
    _check_one_line(out, ["--track", "pip install wandb"], tmp_path)


def test_read_rows_accepts_jsonl_gz_and_json_arrays(tmp_path):
    assert data_tasks.read_rows(str(_data(tmp_path, "a.jsonl.gz", '{"x": 1}\n\n{"x": 2}\n')), "--data-path") == [
        {"x": 1},
        {"x": 2},
    ]
    assert data_tasks.read_rows(str(_data(tmp_path, "b.json", '[{"x": 1}]')), "--data-path") == [{"x": 1}]


@pytest.mark.parametrize(
    "name, local",
    [
        ("assets/tiny-arth", True),
        ("./model", True),
        ("/abs/dir", True),
        ("a/b/c", True),
        ("Qwen/Qwen2.5-0.5B", False),
        ("gpt2", False),
    ],
)
def test_looks_like_path(name, local):
    assert models.looks_like_path(name) is local


ABLATION_FLAGS = {  # each method's ablation flags (rlvr_utils/methods/<method>_ablations.py), one lists them all
    "sc_grpo.py": ["--divergence", "--weighted-groups", "--kl-threshold-scope"],
    "ep_grpo.py": ["--gate", "--pivot-scope", "--process-granularity", "--anchor-form", "--advantage-form"],
    "srpo.py": ["--split", "--no-mask", "--clip"],
    "grpo_lambda.py": ["--trace-apply"],
}


@pytest.mark.parametrize("script", sorted(ABLATION_FLAGS))
def test_help_shows_the_method_and_an_ablation_flag_shows_the_ablations(script):
    """One variant per file: a script's --help lists its method's flags and none of its ablations'; with one ablation
    flag on the line, --help lists them all (they join the script's flags where one is given, cli.parse)."""
    plain = run_script(script, "--help", timeout=120)
    assert plain.returncode == 0 and "--beta" in plain.stdout, plain.stderr[-2000:]
    listed = lambda text, flag: re.search(rf"│ {re.escape(flag)}[ ,]", text)  # noqa: E731  (an option's row)
    assert not [f for f in ABLATION_FLAGS[script] if listed(plain.stdout, f)], plain.stdout
    first = ABLATION_FLAGS[script][0]
    value = {"--no-mask": [], "--clip": []}.get(first, [{"--divergence": "kl", "--gate": "soft"}.get(first, "1x4")])
    value = ["trace"] if script == "grpo_lambda.py" else value
    more = run_script(script, first, *value, "--help", timeout=120)
    assert more.returncode == 0, more.stderr[-2000:]
    assert all(listed(more.stdout, f) for f in ABLATION_FLAGS[script]), more.stdout


@pytest.mark.slow
def test_a_run_started_with_an_ablation_flag_resumes_with_it(tmp_path, monkeypatch):
    """--resume reads the run's config.json: a run started with --trace-apply weight continues with it, the flag not
    given again (cli.parse adds the ablation's flags when the run had them)."""
    import sys

    import grpo_lambda
    from rlvr_utils.core import cli
    from rlvr_utils.methods import lambda_ablations

    tiny = ["--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "8", "--num-eval", "2"]
    tiny += ["--eval-every", "0", "--threads", "1", "--output-dir", str(tmp_path)]
    first = run_script("grpo_lambda.py", *tiny, "--trace-apply", "weight", "--total-steps", "1", "--save-every", "1")
    assert first.returncode == 0, first.stderr[-2000:]
    (run,) = tmp_path.iterdir()
    again = run_script("grpo_lambda.py", "--resume", str(run), "--total-steps", "2", timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in lines] == [0, 1, 2]
    monkeypatch.setattr(sys, "argv", ["grpo_lambda.py", "--resume", str(run), "--total-steps", "3"])
    args = cli.parse(grpo_lambda.Args, grpo_lambda.validate, "lambda_ablations")  # what the resume ran with
    assert args.trace_apply == "weight" and args.ablation_module is lambda_ablations


def test_a_gpu_run_names_the_extras_it_loads_before_anything_loads(monkeypatch):
    """On a GPU a default run computes in bf16 over fp32 masters (precision.py) and its static decoder captures CUDA
    graphs (cuda_graphs.py), and --engine auto takes vLLM where it is installed (engines.py): a minimal copy without
    them stops at parsing with their names, not after the model has loaded. --engine hf needs no graphs; a CPU run
    none of them."""
    import torch

    from rlvr_utils.core import cli

    flags = vars(cli.BaseArgs())
    assert not {m for m, _ in cli.needed_extras(flags)} & {"precision", "cuda_graphs", "engines"}
    monkeypatch.setattr(cli, "pick_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --engine auto's vLLM check (cli.auto_vllm)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object())
    assert {"precision", "cuda_graphs"} <= {m for m, _ in cli.needed_extras(flags)}
    assert "engines" not in {m for m, _ in cli.needed_extras(flags)}
    assert "cuda_graphs" not in {m for m, _ in cli.needed_extras(flags | {"engine": "hf"})}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert ("engines", "--engine auto on a GPU with vLLM installed") in cli.needed_extras(flags)

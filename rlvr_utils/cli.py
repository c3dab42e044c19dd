"""The command line every script shares: the flag checks that run before anything loads, `--resume`'s flags, threads.

A user error (a flag out of range, a missing model directory or data file, a malformed data line, a flag the task
would ignore, `--track` without wandb) ends the run with one line that names the flag or file and what is allowed,
and exit code 2, before any model or data is loaded and before the run directory exists. Choice flags are `Literal`
types in each script's Args, so tyro lists and checks them. Each script's own flags are checked in its `validate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import importlib.util
import io
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from rlvr_utils import tasks


def usage_error(message: str) -> NoReturn:
    """One line on stderr, exit code 2 (as for tyro's own parse errors)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse(args_type):
    """`tyro.cli(args_type)`, with tyro's parse errors (a framed panel) turned into the same one line as ours."""
    import tyro

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return tyro.cli(args_type)
    except SystemExit as e:
        text = captured.getvalue()
        if e.code in (0, None):
            sys.stderr.write(text)
            raise
        inner = [line.strip().strip("│").strip() for line in text.splitlines() if line.strip().startswith("│")]
        usage_error(" ".join(x for x in inner if x and not x.startswith(("─", "For full helptext"))) or text.strip())


def need(ok: bool, message: str) -> None:
    if not ok:
        usage_error(message)


def looks_like_path(name: str) -> bool:
    """A --model that is a path rather than a hub id "org/name": it starts with . / ~, has more than one /, or its
    first component is a local directory (assets/tiny-arth is a typo of a path, not a hub id)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or ("/" in name and Path(name.split("/")[0]).is_dir())


def read_rows(path: str, flag: str) -> list[dict]:
    """Every row of a local .jsonl / .jsonl.gz / .json file, with `file:line: reason` for a line that is not a JSON
    object, and a clear error for a missing or empty file. (.parquet is only checked for existence.)"""
    p = Path(path)
    need(p.is_file(), f"{flag} {path}: no such file")
    if p.suffix == ".parquet":
        return []
    need(p.suffix in (".jsonl", ".json", ".gz"), f"{flag} {path}: expected a .jsonl, .jsonl.gz, .json or .parquet file")
    try:
        with (gzip.open(p, "rt", encoding="utf-8") if p.suffix == ".gz" else p.open(encoding="utf-8")) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        usage_error(f"{path}: cannot be read ({type(e).__name__}: {e})")
    if not text.strip():
        usage_error(f"{path}: the file is empty (expected one JSON object per line)")
    if p.suffix == ".json" and text.lstrip().startswith("["):  # a JSON array of rows
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            usage_error(f"{path}:{e.lineno}: not valid JSON ({e.msg})")
        need(all(isinstance(r, dict) for r in rows), f"{path}: the JSON array must hold one object per row")
        return rows
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            usage_error(f"{path}:{lineno}: not a JSON object ({e.msg} at column {e.colno})")
        need(isinstance(row, dict), f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def check_data(task: str, path: str | None, flag: str) -> None:
    if path is None:
        return
    need(task != "arith", f"{flag} {path}: --task arith is built in and reads no data file (use --task gsm8k, math or code)")
    for i, row in enumerate(read_rows(path, flag), 1):
        problem = tasks.row_problem(task, row)
        need(problem is None, f"{path}: row {i}: {problem}")


def check_common(args) -> None:
    """The checks every script shares (fields that a script does not have are skipped)."""
    a = {f: getattr(args, f) for f in vars(args)}
    positive = ["total_steps", "prompts_per_step", "max_new_tokens", "gen_batch_size", "micro_batch_size", "num_eval",
                "max_prompt_length", "num_iterations", "num_minibatches", "arith_steps", "arith_max_operand",
                "dist_timeout", "max_sampling_rounds"]
    for name in positive:
        if name in a:
            need(isinstance(a[name], int) and a[name] >= 1, f"--{name.replace('_', '-')} must be an integer >= 1, got {a[name]}")
    for name in ("eval_every", "save_every", "threads", "top_k", "overlong_buffer"):
        if name in a:
            need(a[name] >= 0, f"--{name.replace('_', '-')} must be >= 0, got {a[name]}")
    for name in ("learning_rate", "max_grad_norm", "code_timeout"):
        need(a[name] > 0, f"--{name.replace('_', '-')} must be > 0, got {a[name]}")
    for name in ("weight_decay", "beta", "vllm_is_cap", "eval_temperature", "overlong_penalty_factor"):
        if name in a:
            need(a[name] >= 0, f"--{name.replace('_', '-')} must be >= 0, got {a[name]}")
    need(a["temperature"] > 0, f"--temperature must be > 0 (training samples; greedy evaluation is --eval-temperature 0), "
         f"got {a['temperature']}")
    need(0 < a["top_p"] <= 1, f"--top-p must be in (0, 1], got {a['top_p']}")
    need(0 < a["epsilon"] < 1, f"--epsilon must be in (0, 1), got {a['epsilon']}")
    need(a["epsilon_high"] is None or a["epsilon_high"] > 0, f"--epsilon-high must be > 0, got {a['epsilon_high']}")
    need(0 < a["vllm_gpu_memory_utilization"] <= 1, f"--vllm-gpu-memory-utilization must be in (0, 1], got {a['vllm_gpu_memory_utilization']}")
    need(a["arith_max_value"] >= a["arith_max_operand"], f"--arith-max-value ({a['arith_max_value']}) must be >= "
         f"--arith-max-operand ({a['arith_max_operand']})")
    if a.get("overlong_buffer"):
        need(a["overlong_buffer"] < a["max_new_tokens"], f"--overlong-buffer ({a['overlong_buffer']}) must be smaller than "
             f"--max-new-tokens ({a['max_new_tokens']})")
    if "num_minibatches" in a:
        need(a["prompts_per_step"] % a["num_minibatches"] == 0, f"--num-minibatches {a['num_minibatches']} must divide "
             f"--prompts-per-step {a['prompts_per_step']} (each mini-batch holds whole prompts)")
    dev = a["device"]
    need(dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()),
         f"--device {dev}: choose auto, cpu, cuda or cuda:N")
    if dev.startswith("cuda"):
        import torch

        need(torch.cuda.is_available(), f"--device {dev}: no CUDA GPU is visible (use --device cpu)")
    if looks_like_path(a["model"]):
        need(Path(a["model"]).expanduser().is_dir(), f"--model {a['model']}: no such directory")
    check_data(a["task"], a["data_path"], "--data-path")
    check_data(a["task"], a["eval_data_path"], "--eval-data-path")
    if a["track"]:
        need(importlib.util.find_spec("wandb") is not None, "--track logs to Weights & Biases, which is not installed: "
             "pip install wandb (then wandb login), or leave out --track")
    if a.get("fsdp") and (a.get("save_every") or a.get("resume")):
        usage_error("--save-every and --resume do not support --fsdp yet (use DDP, the default under torchrun)")


RUNTIME_FLAGS = ("resume", "total_steps", "save_every", "save_model", "threads", "track", "wandb_project", "eval_every",
                 "device", "dist_timeout")  # may differ between a run and its resumption


def resume_args(args, args_type):
    """`--resume RUN_DIR` continues a run with the flags it was started with (its config.json). A flag given on this
    command line that differs from the run's is an error, except the runtime flags above, which may be given anew
    (e.g. --total-steps to extend a run; --threads changes the floating-point order, so a bit-for-bit continuation
    keeps the run's). Returns the merged args."""
    run_dir = Path(args.resume)
    need((run_dir / "config.json").is_file(), f"--resume {args.resume}: not a run directory (no config.json)")
    need((run_dir / "checkpoint" / "trainer.pt").is_file(), f"--resume {args.resume}: no checkpoint in it "
         "(a run saves one with --save-every N, and on Ctrl-C)")
    saved, defaults = json.loads((run_dir / "config.json").read_text()), args_type()
    merged = {}
    for f in dataclasses.fields(args_type):
        given, default = getattr(args, f.name), getattr(defaults, f.name)
        if f.name not in saved:
            merged[f.name] = given
            continue
        old = tuple(saved[f.name]) if isinstance(default, tuple) and isinstance(saved[f.name], list) else saved[f.name]
        if f.name in RUNTIME_FLAGS:  # given on this command line, or else the run's own
            merged[f.name] = given if given != default or f.name == "resume" else old
            continue
        need(given == default or given == old, f"--{f.name.replace('_', '-')} {given}: the run in {run_dir} was started "
             f"with {old}; a resumed run keeps its flags (only {', '.join('--' + f.replace('_', '-') for f in RUNTIME_FLAGS[1:])} may change)")
        merged[f.name] = old
    return dataclasses.replace(args, **merged)


def set_threads(threads: int) -> None:
    """--threads N: torch's CPU threads (0: torch's default, one per core). Timings in the docs assume idle cores."""
    if threads:
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)

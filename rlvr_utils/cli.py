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
from typing import Literal, NoReturn

from rlvr_utils import tasks

DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "tiny-arith")  # the bundled tiny policy


@dataclasses.dataclass
class BaseArgs:
    """The flags every script shares (run, model, task, sampling, optimizer, evaluation, engine, torchrun). A script's
    `Args(BaseArgs)` adds its method's flags and redeclares the defaults it changes; tyro reads the docstring under each
    field as its --help text."""

    exp_name: str = ""
    """name of this experiment (part of the run name; default: the script's name)"""
    seed: int = 1
    """seed of the experiment (prompts, sampling, initialization)"""
    track: bool = False
    """log to Weights & Biases as well as TensorBoard (needs pip install wandb)"""
    wandb_project: str = "credit-rlvr"
    """wandb project name (with --track)"""
    output_dir: str = "runs"
    """logs, metrics.jsonl and checkpoints go to <output-dir>/<run-name>/"""
    save_model: bool = False
    """save the final policy as a Hugging Face directory <output-dir>/<run-name>/model (atomic write)"""
    save_every: int = 0
    """write a resumable checkpoint (<run-dir>/checkpoint: model, optimizer, RNG states, data position) every this
    many steps and at the end; 0: only when the run is stopped with Ctrl-C"""
    resume: str | None = None
    """continue the run in this run directory from its checkpoint, with the flags it was started with (--total-steps
    may grow)"""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype: auto is bfloat16 on cuda, float32 on cpu"""
    threads: int = 0
    """torch CPU threads (0: torch's default, one per core)"""

    # model and task
    model: str = DEFAULT_MODEL
    """Hugging Face hub id or local directory of the policy; the default is the bundled tiny model"""
    task: Literal["arith", "gsm8k", "math", "code"] = "arith"
    """arith (built in), gsm8k, math, or code (HumanEval-style unit tests run in a sandbox; reward = fraction passed)"""
    data_path: str | None = None
    """local jsonl/json/parquet training file instead of the hub dataset (gsm8k, math, code; code also .jsonl.gz)"""
    eval_data_path: str | None = None
    """local eval file; without it the first --num-eval training rows are held out"""
    arith_steps: int = 4
    """arith: operations per problem"""
    arith_max_value: int = 99
    """arith: running values stay in [0, this]"""
    arith_max_operand: int = 9
    """arith: operands are drawn from [1, this]"""
    code_timeout: float = 5.0
    """code task: wall-clock seconds for one program's whole test run (also its CPU-time limit)"""
    max_prompt_length: int = 1024
    """prompts longer than this (tokens) are skipped and counted"""

    # rollouts
    total_steps: int = 150
    """training steps; each samples a new batch of prompts and makes num-iterations x num-minibatches optimizer steps"""
    prompts_per_step: int = 8
    """prompts per step (the global batch: across all torchrun ranks, divisible by their number); each gets
    --num-generations completions"""
    num_generations: int = 8
    """G: completions per prompt (the group; at least 2)"""
    max_new_tokens: int = 48
    """completion length cap (tokens); completions that hit it count as clipped"""
    temperature: float = 1.0
    """sampling temperature; log-probs use the same temperature"""
    top_p: float = 1.0
    """nucleus sampling (1.0 = off; truncated sampling biases the ratio)"""
    top_k: int = 0
    """top-k sampling (0 = off)"""
    gen_batch_size: int = 64
    """sequences per generate() call"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts until the batch is full again"""
    max_sampling_rounds: int = 3
    """with --dynamic-sampling: at most this many sampling rounds per step (then groups that were dropped fill the
    batch)"""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: a completion longer than max-new-tokens minus this loses reward linearly, up to
    --overlong-penalty-factor at max-new-tokens (0: off)"""
    overlong_penalty_factor: float = 1.0
    """the largest overlong penalty (with --overlong-buffer)"""
    mask_truncated_completions: bool = False
    """completions that hit --max-new-tokens get no loss (DAPO's overlong filtering)"""

    # optimization
    learning_rate: float = 1e-4
    """AdamW learning rate (constant). The default suits the tiny model; use ~1e-6 for 1B+ models"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_iterations: int = 1
    """mu: passes over each batch (with one mini-batch and mu = 1 the update is on-policy: the ratio is exactly 1)"""
    num_minibatches: int = 1
    """each pass splits the batch into this many mini-batches of whole prompts, one optimizer step each (CleanRL's
    name; DAPO/verl: 4); only the first step is on-policy, so the ratio leaves 1 and clipping acts"""
    epsilon: float = 0.2
    """lower clip: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: float | None = None
    """upper clip (DAPO's clip-higher uses 0.28); default: same as --epsilon"""
    beta: float = 0.0
    """k3 KL coefficient to the frozen initial policy (0: no reference model is loaded)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """token-mean (DAPO), seq-mean-token-mean (original GRPO), seq-mean-token-sum-norm (Dr. GRPO)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantage scaling: group std (GRPO), batch std (Lite PPO) or none (Dr. GRPO)"""
    micro_batch_size: int = 16
    """sequences per forward/backward (gradient accumulation; the loss is normalized over the whole mini-batch)"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer's activations in the backward (non-reentrant) instead of storing them: trades
    about a third more update time for much less GPU memory on long completions (the README's GPU commands use it)"""

    # evaluation
    eval_every: int = 25
    """steps between evaluations (0 = only at the start and end)"""
    num_eval: int = 200
    """held-out prompts per evaluation"""
    eval_temperature: float = 0.0
    """0 = greedy pass@1"""

    # rollout engine
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """hf (transformers generate), vllm (a colocated vLLM engine synced after every optimizer step), or auto:
    vllm when it is importable and a GPU is present, else hf"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (on CPU: of host memory)"""
    vllm_is_cap: float = 2.0
    """with --engine vllm: each token's loss times min(pi_old / pi_vllm, cap), truncated importance sampling toward
    the engine's sampling distribution (TRL's and verl's practice); 0 = off. Measured on CPU the engines agree (ratio
    <= 1.00001: no effect); bf16 on a GPU is where they differ (docs/vllm.md)"""

    # several processes: torchrun --nproc_per_node N <script> ... (docs/scaling.md)
    fsdp: bool = False
    """under torchrun: shard the policy (and reference) with FSDP2 fully_shard instead of DDP"""
    dist_timeout: int = 1800
    """seconds a collective waits for the other ranks before the run stops with an error"""


def usage_error(message: str) -> NoReturn:
    """One line on stderr, exit code 2 (as for tyro's own parse errors)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse(args_type, validate=None):
    """The command line, checked before anything loads: `tyro.cli(args_type)` (its parse errors, a framed panel, turned
    into the same one line as ours), --resume's flags, the shared checks, then the script's own `validate(args)`
    (one-line errors; it returns the args, with any field it derives). --epsilon-high defaults to --epsilon and
    --exp-name to the script's name."""
    args = _tyro(args_type)
    args = resume_args(args, args_type) if args.resume else args
    check_common(args)
    args = validate(args) if validate is not None else args
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    return dataclasses.replace(args, epsilon_high=eps_high, exp_name=args.exp_name or Path(sys.argv[0]).stem)


def _tyro(args_type):
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
    return (
        name.startswith((".", "/", "~")) or name.count("/") > 1 or ("/" in name and Path(name.split("/")[0]).is_dir())
    )


def read_rows(path: str, flag: str) -> list[dict]:
    """Every row of a local .jsonl / .jsonl.gz / .json file, with `file:line: reason` for a line that is not a JSON
    object, and a clear error for a missing or empty file. (.parquet is only checked for existence.)"""
    p = Path(path)
    need(p.is_file(), f"{flag} {path}: no such file")
    if p.suffix == ".parquet":
        return []
    need(p.suffix in (".jsonl", ".json", ".gz"), f"{flag} {path}: expected a .jsonl, .jsonl.gz, .json or .parquet file")
    try:
        with gzip.open(p, "rt", encoding="utf-8") if p.suffix == ".gz" else p.open(encoding="utf-8") as f:
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
    need(
        task != "arith",
        f"{flag} {path}: --task arith is built in and reads no data file (use --task gsm8k, math or code)",
    )
    for i, row in enumerate(read_rows(path, flag), 1):
        problem = tasks.row_problem(task, row)
        need(problem is None, f"{path}: row {i}: {problem}")


def check_common(args) -> None:
    """The checks every script shares (fields that a script does not have are skipped)."""
    a = {f: getattr(args, f) for f in vars(args)}
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
    for name in ("eval_every", "save_every", "threads", "top_k", "overlong_buffer"):
        if name in a:
            need(a[name] >= 0, f"--{name.replace('_', '-')} must be >= 0, got {a[name]}")
    for name in ("learning_rate", "max_grad_norm", "code_timeout"):
        need(a[name] > 0, f"--{name.replace('_', '-')} must be > 0, got {a[name]}")
    for name in ("weight_decay", "beta", "vllm_is_cap", "eval_temperature", "overlong_penalty_factor"):
        if name in a:
            need(a[name] >= 0, f"--{name.replace('_', '-')} must be >= 0, got {a[name]}")
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
    if looks_like_path(a["model"]):
        need(Path(a["model"]).expanduser().is_dir(), f"--model {a['model']}: no such directory")
    check_data(a["task"], a["data_path"], "--data-path")
    check_data(a["task"], a["eval_data_path"], "--eval-data-path")
    if a["track"]:
        need(
            importlib.util.find_spec("wandb") is not None,
            "--track logs to Weights & Biases, which is not installed: "
            "pip install wandb (then wandb login), or leave out --track",
        )
    if a.get("fsdp") and (a.get("save_every") or a.get("resume")):
        usage_error("--save-every and --resume do not support --fsdp yet (use DDP, the default under torchrun)")


RUNTIME_FLAGS = (
    "resume",
    "total_steps",
    "save_every",
    "save_model",
    "threads",
    "track",
    "wandb_project",
    "eval_every",
    "device",
    "dist_timeout",
)  # may differ between a run and its resumption


def resume_args(args, args_type):
    """`--resume RUN_DIR` continues a run with the flags it was started with (its config.json). A flag given on this
    command line that differs from the run's is an error, except the runtime flags above, which may be given anew
    (e.g. --total-steps to extend a run; --threads changes the floating-point order, so a bit-for-bit continuation
    keeps the run's). Returns the merged args."""
    run_dir = Path(args.resume)
    need((run_dir / "config.json").is_file(), f"--resume {args.resume}: not a run directory (no config.json)")
    need(
        (run_dir / "checkpoint" / "trainer.pt").is_file(),
        f"--resume {args.resume}: no checkpoint in it (a run saves one with --save-every N, and on Ctrl-C)",
    )
    saved, defaults = json.loads((run_dir / "config.json").read_text()), args_type()
    merged = {}
    runtime = ", ".join("--" + f.replace("_", "-") for f in RUNTIME_FLAGS[1:])
    for f in dataclasses.fields(args_type):
        given, default = getattr(args, f.name), getattr(defaults, f.name)
        if f.name not in saved:
            merged[f.name] = given
            continue
        old = tuple(saved[f.name]) if isinstance(default, tuple) and isinstance(saved[f.name], list) else saved[f.name]
        if f.name in RUNTIME_FLAGS:  # given on this command line, or else the run's own
            merged[f.name] = given if given != default or f.name == "resume" else old
            continue
        need(
            given == default or given == old,
            f"--{f.name.replace('_', '-')} {given}: the run in {run_dir} was started "
            f"with {old}; a resumed run keeps its flags (only {runtime} may change)",
        )
        merged[f.name] = old
    return dataclasses.replace(args, **merged)


def set_threads(threads: int) -> None:
    """--threads N: torch's CPU threads (0: torch's default, one per core). Timings in the docs assume idle cores."""
    if threads:
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)

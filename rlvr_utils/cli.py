"""The command line every script shares: `BaseArgs` (every shared flag, with its --help text), `parse` (tyro, then
every check before anything loads: rlvr_utils/checks.py and the script's own `validate`), `--resume`'s flags, threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Literal

import tyro

from rlvr_utils import checkpoints, datafiles, run_lock, tracking
from rlvr_utils.checks import check_common
from rlvr_utils.checks import need_ranges as need_ranges
from rlvr_utils.errors import need as need
from rlvr_utils.errors import usage_error as usage_error

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
    task: Literal["arith", "gsm8k", "math", "code", "custom"] = "arith"
    """arith (built in), gsm8k, math, code (HumanEval-style unit tests run in a sandbox; reward = fraction passed), or
    custom (your rows, each with a `prompt`, scored by --reward-fn)"""
    data_path: str | None = None
    """local training data instead of the hub dataset: a .jsonl/.json (also .gz), .csv, .tsv, .parquet or .arrow file
    or a directory of them (JSON rows read as written); custom: also a hub dataset id"""
    reward_fn: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """PATH.py:NAME or package.module:NAME: a reward in TRL's convention, NAME(prompts, completions, completion_ids,
    trainer_state, **columns) -> one float (or None) per completion, async def too; repeat the flag for several (they
    sum); with a built-in task it replaces the task's reward (README: Your own task). A reward model: wrap it with
    rlvr_utils.custom.RewardModel (README: Reward models)"""
    reward_weights: Annotated[tuple[float, ...], tyro.conf.UseAppendAction] = ()
    """one weight per --reward-fn, the flag repeated in the same order (default: 1 each)"""
    reward_timeout: float = 0.0
    """seconds one call of a --reward-fn may take (the async ones of a batch: together); a call that runs longer stops
    the run with one line naming it, exit code 1 (0: no limit)"""
    success_threshold: float = 1.0
    """a completion whose reward reaches this is a success: SC-GRPO's verified solutions, SRPO's failed parents,
    EP-GRPO's outcome polarity, eval/accuracy (1.0: the built-in tasks' full score; with summed --reward-fn: the sum a
    correct completion gets)"""
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
    log_credit: int = 0
    """record N training rollouts' per-token credit (the loss's gradient on each token's log-prob, in advantage units)
    at each evaluation step, to <run-dir>/credit.jsonl and TensorBoard; draw them with tools/credit_view.py; 0 = off"""

    # rollout engine
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """hf (transformers generate), vllm (a colocated vLLM engine synced after every optimizer step), or auto:
    vllm when it is importable and a GPU is present, else hf"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (on CPU: of host memory)"""
    vllm_is_cap: float = 2.0
    """with --engine vllm: the cap C of the importance weight pi_old / pi_vllm toward the engine's sampling distribution
    (--vllm-is-mode says how it applies); 0 = off. Measured on CPU the engines agree (ratio <= 1.00001: no effect);
    bf16 on a GPU is where they differ (docs/vllm.md)"""
    vllm_is_mode: Literal["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"] = "token-truncate"
    """how the weight applies: per token (the ratio of each token) or per sequence (exp of the sum of the row's token
    log-ratios, one weight for the row); truncate: min(ratio, C); mask: 0 where the ratio exceeds C (TRL's current
    default: sequence-mask, C = 3; verl and OpenRLHF leave the correction off). token-truncate is ours: a sequence
    ratio compounds over long completions, so a small per-token gap drops or shrinks whole rollouts (docs/vllm.md)"""
    vllm_is_min: float = 0.0
    """with a mask mode: also 0 where the ratio is below this (a lower bound, as TRL offers); 0 = none"""

    # several processes: torchrun --nproc_per_node N <script> ... (docs/scaling.md)
    fsdp: bool = False
    """under torchrun: shard the policy (and reference) with FSDP2 fully_shard instead of DDP"""
    dist_timeout: int = 1800
    """seconds a collective waits for the other ranks before the run stops with an error"""


def parse(args_type, validate=None):
    """The command line, checked before anything loads: `tyro.cli(args_type)` (its parse errors, a framed panel, turned
    into the same one line as ours), --resume's flags, the shared checks, then the script's own `validate(args)`
    (one-line errors; it returns the args, with any field it derives). --epsilon-high defaults to --epsilon and
    --exp-name to the script's name."""
    args = expand_paths(_tyro(args_type))
    args = resume_args(args, args_type) if args.resume else args
    check_common(args)
    args = validate(args) if validate is not None else args
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    return dataclasses.replace(args, epsilon_high=eps_high, exp_name=args.exp_name or Path(sys.argv[0]).stem)


def expand_paths(args):
    """`~` in the path flags, as a shell would have done for an unquoted `--flag ~/x` (not for `--flag=~/x`)."""
    paths = {
        k: os.path.expanduser(getattr(args, k))
        for k in ("output_dir", "data_path", "eval_data_path", "resume")
        if getattr(args, k, None)
    }
    if args.model.startswith("~"):
        paths["model"] = os.path.expanduser(args.model)
    return dataclasses.replace(args, **paths)


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
    "fsdp",  # the same maths sharded or not: a run moves between DDP and FSDP through its checkpoint
    "model",  # the weights come from the checkpoint: a run made in another clone names its own copy of the model
    "output_dir",  # a resumed run writes into its own directory, wherever it has been moved
    "data_path",  # a data file that moved (its contents are compared with the run's: file_hashes)
    "eval_data_path",
    "reward_timeout",  # a reward service that got slower
)  # may differ between a run and its resumption


def file_hashes(args) -> dict:
    """sha256 of the run's data (a file or a directory) and reward files by role (--data-path, --eval-data-path, each
    --reward-fn file), recorded in config.json: a resume warns when one changed, also when it moved and is given
    anew."""
    files = {"--data-path": getattr(args, "data_path", None), "--eval-data-path": getattr(args, "eval_data_path", None)}
    for i, spec in enumerate(getattr(args, "reward_fn", ()) or ()):
        files[f"--reward-fn {i + 1}"] = spec.rsplit(":", 1)[0]
    return {role: _digest(Path(p).expanduser()) for role, p in files.items() if p and Path(p).expanduser().exists()}


def _digest(path: Path) -> str:
    """sha256 of a file's bytes; of a data directory: of each data file's name and bytes, in name order."""
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    h = hashlib.sha256()
    try:
        for f in datafiles.data_files(path):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    except (datafiles.DataFileError, OSError):  # no data file in it: the checks say so
        pass
    return h.hexdigest()


def _fits(kind, value) -> bool:
    """Whether a config.json value is one the flag of type `kind` takes (Literal choices, X | None, tuples of them)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_fits(k, value) for k in args)
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(_fits(args[0], v) for v in value) if args else True
    if kind is bool:
        return isinstance(value, bool)
    if kind in (int, float):
        return isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    return isinstance(value, kind) if kind is str else True  # anything else is not checked here


def resume_args(args, args_type):
    """`--resume RUN_DIR` continues a run with the flags it was started with (its config.json). A flag given on this
    command line that differs from the run's is an error, except the runtime flags above, which may be given anew
    (e.g. --total-steps to extend a run; --threads changes the floating-point order, so a bit-for-bit continuation
    keeps the run's). The run must be this script's and hold a complete checkpoint before --total-steps. Returns the
    merged args."""
    run_dir, script = Path(args.resume), Path(sys.argv[0]).name
    need((run_dir / "config.json").is_file(), f"--resume {args.resume}: not a run directory (no config.json)")
    try:
        saved = json.loads((run_dir / "config.json").read_text())
        assert isinstance(saved, dict)
    except (ValueError, AssertionError, OSError) as e:
        usage_error(f"--resume {args.resume}: {run_dir / 'config.json'} cannot be read ({type(e).__name__})")
    made_by = saved.get("script")
    need(
        made_by in (None, script),
        f"--resume {args.resume}: the run was made by {made_by}, not {script} (a run "
        "continues with the script that started it)",
    )
    copies = checkpoints.Checkpointer(run_dir, 0).copies()
    need(
        bool(copies),
        f"--resume {args.resume}: no checkpoint in it (a run saves one with --save-every N, on Ctrl-C and on SIGTERM)",
    )
    problem = checkpoints.damaged(copies[0][1])
    need(problem is None, f"--resume {args.resume}: {problem}")
    if os.environ.get("RANK", "0") == "0":  # one writer per run directory, before anything loads
        run_lock.lock_run_dir(run_dir)
    metrics = run_dir / "metrics.jsonl"
    need(
        metrics.is_file(),
        f"--resume {args.resume}: {metrics} is missing (a resumed run appends to it): restore it, or start a new run",
    )
    tracking.read_rows(metrics)  # every line a JSON object with its step (one line naming the line otherwise)
    defaults, merged = args_type(), {}
    hints = typing.get_type_hints(args_type)
    for f in dataclasses.fields(args_type):  # a hand-edited config.json: one line naming the key, not a traceback
        if f.name in saved:
            kind = hints[f.name]  # the Literal choices, also inside X | None or a tuple, for the message
            choices = [c for k in (kind, *typing.get_args(kind)) if typing.get_origin(k) is Literal for c in k.__args__]
            need(
                _fits(kind, saved[f.name]),
                f"--resume {args.resume}: {run_dir / 'config.json'}: {f.name} is {saved[f.name]!r}, not a value of "
                f"--{f.name.replace('_', '-')}" + (f" (one of {', '.join(map(str, choices))})" if choices else ""),
            )
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
    step = copies[0][0]
    need(
        step < 0 or merged["total_steps"] > step,
        f"--resume {args.resume}: the run is already at step {step} "
        f"(--total-steps {merged['total_steps']}): give a larger --total-steps to extend it",
    )
    out = dataclasses.replace(args, **merged)
    now, then = file_hashes(out), saved.get("file_hashes", {})
    for role in (r for r in then if now.get(r, then[r]) != then[r]):
        warning = f"warning: {role}: the file changed since the run started; the resumed run reads it as it is now"
        print(warning, file=sys.stderr)
    return out


def set_threads(threads: int) -> None:
    """--threads N: torch's CPU threads (0: torch's default, one per core). Timings in the docs assume idle cores."""
    if threads:
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)

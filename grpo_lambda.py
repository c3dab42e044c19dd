"""GRPO-λ: λ-return credit assignment for GRPO, through eligibility traces over token log-probs.

GRPO gives every token of a completion the same group-normalized advantage. GRPO-λ reads that advantage
as a critic-free TD error and gives each token t a *traced* importance ratio exp(Σ_{k≤t} w(t,k)·log-ratio_k),
w = (γλ)^(t−k) ("recent") or max((γλ)^(t−k), (γλ)^k) ("both"), inside GRPO's clipped surrogate. On-policy
this is GRPO with token k's advantage times c_k = Σ_{t≥k} w(t,k): early tokens get up to 1/(1−γλ) (= 100)
times the credit, so the gradient is tens of times GRPO's. Negative advantages are clamped at −0.1.
Paper: Parthasarathi et al. 2025, GRPO-λ: Credit Assignment improves LLM Reasoning (arXiv 2510.00194).
Docs: docs/grpo_lambda.md. Where the paper is silent (ε-weight's g, the ±20 log-ratio clamp, token-mean)
the defaults are this project's choices, marked "(project default)" below.

    python grpo_lambda.py                                       # bundled tiny model, built-in task, CPU
    python grpo_lambda.py --trace-style recent --lam 0.95       # the classic accumulating trace
"""

import copy
import dataclasses
import time
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from tqdm import trange

import common
from rlvr_utils import checkpoints, cli, distributed, engines, tasks


@dataclasses.dataclass
class Args:
    exp_name: str = "grpo_lambda"
    """name of this experiment (part of the run name)"""
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
    """continue the run in this run directory from its checkpoint, with the flags it was started with (--total-steps may grow)"""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype: auto is bfloat16 on cuda, float32 on cpu"""
    threads: int = 0
    """torch CPU threads (0: torch's default, one per core)"""

    # model and task
    model: str = common.DEFAULT_MODEL
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
    """prompts per step (the global batch: across all torchrun ranks, divisible by their number); each gets --num-generations completions"""
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
    """with --dynamic-sampling: at most this many sampling rounds per step (then groups that were dropped fill the batch)"""
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
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """token-mean (DAPO; default here, project default), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO)"""
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
    vllm_is_cap: float = 0.0
    """truncated importance-sampling correction min(pi_old / pi_vllm, cap) per token; 0 = off"""

    # several processes: torchrun --nproc_per_node N <script> ... (docs/scaling.md)
    fsdp: bool = False
    """under torchrun: shard the policy (and reference) with FSDP2 fully_shard instead of DDP"""
    dist_timeout: int = 1800
    """seconds a collective waits for the other ranks before the run stops with an error"""

    # ALGO LOGIC: GRPO-λ
    lam: float = 0.99
    """λ of the λ-return: the trace decays by γλ per token (paper: 0.99; 0 with --trace-style recent is GRPO)"""
    gamma: float = 1.0
    """γ: per-token discount (1, as the co-author's code)"""
    trace_style: Literal["recent", "both"] = "both"
    """recent: w(t,k) = (γλ)^(t−k); both: max((γλ)^(t−k), (γλ)^k), first tokens keep weight ~1 (reviewers: best)"""
    trace_apply: Literal["trace", "weight"] = "trace"
    """trace: ϵ-trace, the traced log-ratio inside the clipped ratio (main); weight: ϵ-weight (g: project default)"""
    adv_clamp: str = "-0.1"
    """floor on negative advantages (paper: -0.1); `none` disables the clamp"""
    max_log_ratio: float = 20.0
    """the traced log-ratio is clamped to ±this before exp, against overflow (project default)"""


# ALGO LOGIC: GRPO-λ's own functions (pure tensor functions)
TRACE_STYLES = ("recent", "both")


def _decay(lam: float, gamma: float, style: str) -> float:
    """a = γλ, the trace's decay per token; checks a ∈ [0, 1] and the style."""
    if style not in TRACE_STYLES:
        raise ValueError(f"unknown trace style {style!r}: choose one of {TRACE_STYLES}")
    if not 0.0 <= gamma * lam <= 1.0:
        raise ValueError(f"gamma * lam must be in [0, 1], got {gamma * lam}")
    return gamma * lam


def _recent_trace(x: torch.Tensor, a: float, chunk: int = 64) -> torch.Tensor:
    """z_t = x_t + a·z_{t−1} (z_{−1} = 0) along dim 1 of x [B, T], the accumulating eligibility trace.
    Unrolled `chunk` steps at a time: inside a chunk, x times a fixed [chunk, chunk] matrix of a^(t−k); then
    each chunk adds a^(i+1)·(the trace at the end of the chunk before), the same recurrence over chunk ends
    with decay a^chunk. Time O(B·T·chunk), memory O(B·T), no Python loop over T, no overflowing a^(−k)."""
    B, T = x.shape
    C = max(1, min(chunk, T))
    n = -(-T // C)
    i = torch.arange(C, device=x.device)
    lag = (i[:, None] - i[None, :]).double()  # [C, C]: t − k
    W = torch.where(lag >= 0, a ** lag.clamp(min=0), 0.0).to(x.dtype)
    z = F.pad(x, (0, n * C - T)).view(B, n, C) @ W.T  # [B, n, C]: the trace within each chunk
    if n > 1:
        ends = _recent_trace(z[:, :, -1], a**C, chunk)  # [B, n]: the whole trace at each chunk's last token
        carry = F.pad(ends[:, :-1], (1, 0))  # the trace just before each chunk
        z = z + carry[:, :, None] * (a ** (i + 1).double()).to(x.dtype)
    return z.reshape(B, n * C)[:, :T]


def trace_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, lam: float, gamma: float = 1.0, style: str = "both", chunk: int = 64
) -> torch.Tensor:
    """Traced log-ratio z_t = Σ_{k≤t} w(t,k)·x_k of each row, the exponent of GRPO-λ's ratio (paper §3.2, Eq. 2).

    log_ratio x: [B, T] log π_θ − log π_old per token (nats; any per-token quantity can be traced).
    mask: [B, T] completion mask, right-padded. Masked positions contribute nothing and get z = 0 (all-padding
    rows: all 0); t, k count from the row's first token, so a row's trace never depends on the batch's T.
    w(t,k) = a^(t−k) ("recent") or max(a^(t−k), a^k) ("both") for k ≤ t, a = γλ ∈ [0, 1]; w(t,t) = 1.
    Returns z [B, T] in float32 (float64 for float64 input), differentiable, unclamped (clamp before exp).
    O(B·T) time and memory, never the [T, T] weights: "recent" is the recurrence z_t = x_t + a·z_{t−1}; "both"
    splits at m = ceil(t/2) (a^k ≥ a^(t−k) iff k ≤ t/2): z_t = z^rec_t − a^(t−m+1)·z^rec_(m−1) + Σ_{k<m} a^k·x_k.
    """
    a = _decay(lam, gamma, style)
    valid = mask.bool()
    x = torch.where(valid, log_ratio.to(torch.promote_types(log_ratio.dtype, torch.float32)), 0.0)
    z = _recent_trace(x, a, chunk)
    if style == "both":
        t = torch.arange(x.shape[1], device=x.device)
        m = (t + 1) // 2  # ceil(t/2): k < m takes the early weight a^k, k ≥ m the recent a^(t−k)
        early = F.pad(torch.cumsum(x * (a ** t.double()).to(x.dtype), 1), (1, 0))  # [:, m] = Σ_{k<m} a^k x_k
        z_before = F.pad(z, (1, 0))[:, m]  # z^rec_(m−1), 0 at m = 0
        z = z - (a ** (t - m + 1).double()).to(x.dtype) * z_before + early[:, m]
    return torch.where(valid, z, 0.0)


def trace_multipliers(
    lengths: torch.Tensor,
    lam: float,
    gamma: float = 1.0,
    style: str = "both",
    T: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """On-policy per-token advantage multipliers c_k = Σ_{t=k}^{L−1} w(t,k) (docs/grpo_lambda.md): at θ = θ_old the
    GRPO-λ gradient is exactly GRPO's with token k's advantage times c_k. lengths: [B] tokens per row (L).
    Returns c [B, T] (T: longest row by default), 0 past each row's end. With S(n) = Σ_{j<n} a^j:
      recent: c_k = S(L − k)                                   (last token 1, early ones → 1/(1 − a))
      both:   c_k = S(min(k, L−1−k) + 1) + a^k·max(0, L−1−2k)  (c_0 = L: the first token is in every row)"""
    a = _decay(lam, gamma, style)
    L = lengths.to(torch.float64)[:, None]
    T = int(lengths.max()) if T is None and len(lengths) else (T or 0)
    k = torch.arange(T, dtype=torch.float64, device=lengths.device)[None, :]
    S = (lambda n: n) if a == 1.0 else (lambda n: (1 - a**n) / (1 - a))
    c = S(L - k) if style == "recent" else S(torch.minimum(k, L - 1 - k) + 1) + a**k * (L - 1 - 2 * k).clamp(min=0)
    return torch.where(k < L, c, 0.0).to(dtype)


def clamp_negative_advantages(adv: torch.Tensor, floor: float | None) -> torch.Tensor:
    """Â^c = max(Â, floor), floor ≤ 0 (paper: −0.1), any shape: negative advantages times the large c_k
    destabilize training; positive ones are untouched (paper, as its reviews report). floor None: no clamp (a copy)."""
    if floor is not None and floor > 0:
        raise ValueError(f"adv_clamp must be <= 0 (it only limits negative advantages), got {floor}")
    return adv.clone() if floor is None else adv.clamp(min=floor)


def grpo_lambda_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    lam: float,
    gamma: float = 1.0,
    style: str = "both",
    apply: str = "trace",
    epsilon: float = 0.2,
    epsilon_high: float = 0.2,
    max_log_ratio: float = 20.0,
):
    """GRPO-λ's per-token policy loss [B, T] before aggregation and KL (paper §3.2, Eq. 2; docs/grpo_lambda.md). logp, old_logp: [B, T]
    log-probs of the completion tokens (nats); adv: [B, T] clamped advantage (the critic-free TD error).
    "trace" (ϵ-trace): ρ̃_t = exp(clamp(trace_log_ratio(logp − old_logp), ±max_log_ratio)),
      loss_t = −min(ρ̃_t·A, clip(ρ̃_t, 1−ε, 1+ε_high)·A).
    "weight" (ϵ-weight): GRPO's clipped loss of the plain ratio times E_t = Σ_{k≤t} w(t,k)·g(logp_k),
      g(x) = 1 + sigmoid(x − 1), not detached (the co-author's code; the paper's g is unknown).
    Returns (loss [B, T], the ratio the clip acts on [B, T], the traced log-ratio z [B, T] (no grad for "weight"))."""
    if apply not in ("trace", "weight"):
        raise ValueError(f"unknown trace application {apply!r}: choose trace or weight")
    x = logp - old_logp
    z = trace_log_ratio(x if apply == "trace" else x.detach(), mask, lam, gamma, style)  # Eq. 2
    ratio = (
        torch.exp(z.clamp(-max_log_ratio, max_log_ratio))
        if apply == "trace"
        else torch.exp(x.clamp(-max_log_ratio, max_log_ratio))
    )
    loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * adv)
    if apply == "weight":
        loss = loss * trace_log_ratio(1 + torch.sigmoid(logp - 1), mask, lam, gamma, style)
    return loss, ratio, z


def validate(args: Args) -> Args:
    """Every flag checked before anything loads: a user error ends with one line naming the flag, exit code 2."""
    args = cli.resume_args(args, Args) if args.resume else args
    cli.check_common(args)
    cli.need(
        args.num_generations >= 2,
        f"--num-generations must be >= 2 (GRPO compares the completions of a prompt), got {args.num_generations}",
    )
    cli.need(
        0.0 <= args.gamma * args.lam <= 1.0, f"--gamma x --lam must be in [0, 1], got {args.gamma * args.lam}"
    )  # ALGO LOGIC
    cli.need(
        args.adv_clamp.lower() == "none" or _is_float(args.adv_clamp) and float(args.adv_clamp) <= 0,
        f"--adv-clamp must be a number <= 0 or none, got {args.adv_clamp}",
    )
    cli.need(args.max_log_ratio > 0, f"--max-log-ratio must be > 0, got {args.max_log_ratio}")
    return dataclasses.replace(args, epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    args = validate(cli.parse(Args))  # tyro.cli(Args), its errors on one line
    cli.set_threads(args.threads)
    adv_floor = None if args.adv_clamp.lower() == "none" else float(args.adv_clamp)  # ALGO LOGIC
    run_dir = Path(
        args.resume or Path(args.output_dir) / f"{args.task}__{args.exp_name}__{args.seed}__{int(time.time())}"
    )

    # seeding, model, task; a resumed run then restores its checkpoint into them
    dist, device = distributed.init_distributed(
        args.device, vars(args), args.prompts_per_step, args.dist_timeout, args.fsdp
    )
    common.seed_everything(args.seed + dist.rank)  # per-rank sampling; every rank draws the same global prompt batches
    model, tokenizer = common.load_policy(args.model, device, args.dtype, args.gradient_checkpointing)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.beta > 0 else None
    train_model = dist.wrap(model, ref_model)  # DDP / FSDP2 under torchrun; the model itself otherwise
    task = tasks.load_task(
        args.task,
        tokenizer,
        seed=args.seed,
        num_eval=args.num_eval,
        data_path=args.data_path,
        eval_data_path=args.eval_data_path,
        max_prompt_length=args.max_prompt_length,
        arith_steps=args.arith_steps,
        arith_max_value=args.arith_max_value,
        arith_max_operand=args.arith_max_operand,
        code_timeout=args.code_timeout,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    batches = checkpoints.CountingBatches(lambda: common.prompt_batches(task.train, args.prompts_per_step, args.seed))
    ckpt, stop = checkpoints.Checkpointer(run_dir, args.save_every, dist), checkpoints.GracefulStop()
    start = ckpt.restore(model, optimizer, batches) if args.resume else 0
    engines.attach_engine(
        args.engine, model, optimizer, args.model, args.vllm_gpu_memory_utilization, seed=args.seed + dist.rank
    )
    logger = common.Logger(run_dir, vars(args), args.track, args.wandb_project, enabled=dist.main, resume_step=start)
    dist.print(
        f"run {run_dir.name}: logs in {run_dir}/ (tensorboard --logdir {run_dir.parent}); {len(task.train)} train / "
        f"{len(task.eval)} eval prompts; skipped {task.skipped}" + (f"; resumed after step {start}" if start else "")
    )
    G = args.num_generations

    if not start:  # a resumed run has its evaluations in its metrics.jsonl already
        logger.log(
            common.evaluate(
                model, tokenizer, task, args.max_new_tokens, args.gen_batch_size, args.eval_temperature, dist
            ),
            0,
        )
    eval_metrics = metrics = logger.last_eval
    bar = trange(
        start + 1,
        args.total_steps + 1,
        initial=start,
        total=args.total_steps,
        desc="grpo_lambda",
        dynamic_ncols=True,
        disable=not dist.main,
    )
    for step in bar:
        # 1-2. rollouts: G completions per prompt, and one reward per completion (the verifier sees the decoded text);
        #      DAPO's dynamic sampling and overlong penalty when asked
        t0 = time.time()
        common.reset_peak_memory(device)
        ro, rewards, sampling = common.rollouts_with_rewards(model, tokenizer, task, batches, dist, args)
        mask = ro.completion_mask * ~ro.truncated[:, None] if args.mask_truncated_completions else ro.completion_mask
        T = mask.shape[1]
        t_gen = time.time() - t0

        # 3. ALGO LOGIC: credit assignment. GRPO's group advantage is the critic-free TD error, its negative
        #    values clamped; the trace inside the ratio (step 5) carries it back to earlier tokens.
        advantages = common.group_advantages(rewards, G, args.scale_rewards, group_ids=ro.group_ids.cpu()).to(device)
        advantages = clamp_negative_advantages(advantages, adv_floor)
        token_adv = advantages[:, None].expand(-1, T)  # [N, T]

        # 4. old and reference log-probs (no gradient). On-policy (one pass, one mini-batch) the old log-probs are the
        #    current ones detached; otherwise only the first optimizer step is on-policy and they need this pass.
        t0 = time.time()
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad():
            on_policy = args.num_iterations == 1 and args.num_minibatches == 1
            old_logp = None if on_policy else common.token_logprobs(model, input_ids, attn, T, args.temperature)[0]
            ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0] if ref_model else None
        t_logp = time.time() - t0

        # 5. update: mu passes; each splits the batch into mini-batches of whole prompts, one optimizer step each,
        #    computed in micro-batches (the loss is normalized over the mini-batch, so accumulation changes nothing)
        t0 = time.time()
        stats = common.UpdateStats(mask, args.num_iterations)
        trace = {
            "trace/log_ratio_mean": 0.0,
            "trace/log_ratio_max": 0.0,
            "trace/clamped_frac": 0.0,
            "credit": 0.0,
            "adv": 0.0,
        }  # ALGO LOGIC
        for it in range(args.num_iterations):
            for rows in common.minibatches(ro.group_ids, args.num_minibatches):
                optimizer.zero_grad(set_to_none=True)
                num_tokens, num_seqs = dist.loss_counts(mask[rows])  # global counts / world size
                micro = rows.split(args.micro_batch_size)
                for k, mb in enumerate(micro):
                    dist.sync_grads(train_model, k == len(micro) - 1)  # all-reduce once per optimizer step
                    m = mask[mb].float()
                    logp, entropy = common.token_logprobs(
                        train_model, input_ids[mb], attn[mb], T, args.temperature, with_entropy=it == 0
                    )
                    old = old_logp[mb] if old_logp is not None else logp.detach()
                    # ALGO LOGIC: PPO-clipped surrogate of the traced ratio (ϵ-trace) or eligibility-weighted (ϵ-weight)
                    A = token_adv[mb]
                    per_token_loss, ratio, z = grpo_lambda_token_loss(
                        logp,
                        old,
                        A,
                        m,
                        args.lam,
                        args.gamma,
                        args.trace_style,
                        args.trace_apply,
                        args.epsilon,
                        args.epsilon_high,
                        args.max_log_ratio,
                    )
                    if it == 0:  # ALGO LOGIC: c_k = -(d loss / d log p_k) / A_k, the credit the loss gives each token
                        g = torch.autograd.grad(per_token_loss.sum(), logp, retain_graph=True)[0]
                        has_adv = (A != 0) * m
                        trace["credit"] += (-g / torch.where(A != 0, A, 1.0) * has_adv).sum().item()
                        trace["adv"] += has_adv.sum().item()
                    per_token_loss = per_token_loss * engines.engine_correction(
                        ro, mb, old, m, args.vllm_is_cap, stats.engine(it), stats.tokens
                    )  # vLLM: truncated IS
                    kl = (
                        common.k3_kl(logp, ref_logp[mb]) if ref_logp is not None else None
                    )  # KL(pi || pi_ref), k3 estimator
                    if kl is not None:
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = common.aggregate_loss(
                        per_token_loss, m, args.loss_agg, args.max_new_tokens, num_tokens, num_seqs
                    )
                    common.stop_if_nonfinite(loss, "loss", step, metrics)
                    loss.backward()
                    stats.add(m, ratio, A, args.epsilon, args.epsilon_high, entropy, kl, loss)  # diagnostics
                    z = z.detach()  # ALGO LOGIC: traced log-ratio diagnostics (max = largest |z|)
                    trace["trace/log_ratio_mean"] += (z * m).sum().item() / (stats.tokens * args.num_iterations)
                    trace["trace/log_ratio_max"] = max(trace["trace/log_ratio_max"], (z.abs() * m).max().item())
                    trace["trace/clamped_frac"] += ((z.abs() > args.max_log_ratio) * m).sum().item() / (
                        stats.tokens * args.num_iterations
                    )
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                common.stop_if_nonfinite(grad_norm, "gradient norm", step, metrics)
                optimizer.step()
                stats.step(grad_norm)
        t_update = time.time() - t0

        # 6. logging, evaluation, checkpoints
        step_time = t_gen + t_logp + t_update
        metrics = {
            **common.completion_metrics(ro, rewards, G),
            **sampling,
            **stats.metrics(),
            "learning_rate": optimizer.param_groups[0]["lr"],
            # ALGO LOGIC: the traced log-ratio, and the mean credit multiplier c_k measured on the loss over the tokens with an
            # advantage (GRPO: 1; on-policy GRPO-λ: trace_multipliers, up to 1/(1 - γλ) early in a completion)
            **{k: v for k, v in trace.items() if k.startswith("trace/")},
            "trace/multiplier_mean": trace["credit"] / trace["adv"] if trace["adv"] else 0.0,
            "tokens_per_second": sampling["num_tokens"] / step_time,
            "time/generation": t_gen,
            "time/logprobs": t_logp,
            "time/update": t_update,
            "time/step": step_time,
            **common.peak_memory(device),
        }
        if step == args.total_steps or (args.eval_every and step % args.eval_every == 0):
            eval_metrics = common.evaluate(
                model, tokenizer, task, args.max_new_tokens, args.gen_batch_size, args.eval_temperature, dist
            )
            metrics.update(eval_metrics)
        metrics = dist.reduce_metrics(metrics)  # eval metrics are already the same on every rank
        logger.log(metrics, step)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", eval_acc=f"{eval_metrics['eval/accuracy']:.3f}")
        stopping = stop.requested(dist)  # Ctrl-C: save and leave after this step
        if ckpt.due(step, args.total_steps) or stopping:
            ckpt.save(step, model, tokenizer, optimizer, batches)
        if stopping:
            logger.close()
            dist.print(
                f"stopped after step {step}; checkpoint in {run_dir}/checkpoint: continue with --resume {run_dir}"
            )
            raise SystemExit(130)

    logger.close()
    dist.print(f"final eval accuracy {eval_metrics['eval/accuracy']:.3f}; metrics in {run_dir}/metrics.jsonl")
    if args.save_model:
        dist.print(f"saved model to {dist.save(model, tokenizer, run_dir / 'model')}")  # every rank joins the save
    dist.close()

"""GRPO-λ: λ-return credit assignment for GRPO, through eligibility traces over token log-probs.

GRPO gives every token of a completion the same group-normalized advantage. GRPO-λ reads that
advantage as a critic-free TD error and gives each token t a *traced* importance ratio
exp(Σ_{k≤t} w(t,k)·log-ratio_k), w = (γλ)^(t−k) ("recent") or max((γλ)^(t−k), (γλ)^k) ("both"),
inside GRPO's clipped surrogate. On-policy this is GRPO with token k's advantage times
c_k = Σ_{t≥k} w(t,k): early tokens get up to 1/(1−γλ) (= 100) times the credit, so the gradient is
tens of times GRPO's. Negative advantages are clamped at −0.1.
Paper: Parthasarathi et al. 2025, GRPO-λ: Credit Assignment improves LLM Reasoning
(arXiv 2510.00194). Docs: docs/grpo_lambda.md. Where the paper is silent (ϵ-weight's g, the ±20
log-ratio clamp, token-mean) the defaults are this project's, marked "(project default)" below.

Differences from grpo.py:
  1. step 3 clamps negative advantages (--adv-clamp −0.1); step 5's clipped ratio is the traced
     one (ϵ-trace; the ϵ-weight variant, an ablation: rlvr_utils/methods/lambda_ablations.py).
  2. the trace/* metrics (rlvr_utils/methods/trace_diagnostics.py: one extra autograd.grad of the
     loss with respect to the log-probs, not of the model; and c_k's closed form,
     trace_multipliers).
  3. default --loss-agg token-mean (grpo.py: seq-mean-token-mean).

    python grpo_lambda.py                                   # tiny model, built-in task, CPU
    python grpo_lambda.py --trace-style recent --lam 0.95   # the classic accumulating trace
"""

import collections
import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F

import common
from rlvr_utils.core import cli
from rlvr_utils.methods.trace_diagnostics import TraceStats


@dataclasses.dataclass
class Args(cli.BaseArgs):
    """GRPO-λ: the shared flags (rlvr_utils/core/cli.py), the trace's flags, and token-mean."""

    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """token-mean (DAPO; default here, project default: the co-author's verl port),
    seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO)"""

    # ALGO LOGIC: GRPO-λ
    lam: float = 0.99
    """λ in [0, 1]: the trace decays by γλ per token (paper: 0.99; 0 with --trace-style recent is
    GRPO)"""
    gamma: float = 1.0
    """γ in [0, 1]: per-token discount (1, as the co-author's code)"""
    trace_style: Literal["recent", "both"] = "both"
    """recent: w(t,k) = (γλ)^(t−k); both: max((γλ)^(t−k), (γλ)^k), first tokens keep weight ~1
    (reviewers: best)"""
    adv_clamp: str = "-0.1"
    """floor on negative advantages (paper: -0.1); `none` disables the clamp"""
    max_log_ratio: float = 20.0
    """the traced log-ratio is clamped to ±this before exp, against overflow (project default)"""


# ALGO LOGIC: GRPO-λ's equations (the paper's §3.2, Eq. 2, known from a third-party reimplementation's
# quote: docs/grpo_lambda.md), pure tensor functions: copy these
def trace_log_ratio(log_ratio, mask, lam: float, gamma=1.0, style="both", chunk=64) -> torch.Tensor:
    """Traced log-ratio z_t = Σ_{k≤t} w(t,k)·x_k of each row, the exponent of GRPO-λ's ratio
    (paper §3.2, Eq. 2).

    log_ratio x: [B, T] log π_θ − log π_old per token (nats; any per-token quantity can be traced).
    mask: [B, T] completion mask, right-padded. Masked positions contribute nothing and get z = 0
    (all-padding rows: all 0); t, k count from the row's first token, so a row's trace never
    depends on the batch's T. w(t,k) = a^(t−k) ("recent") or max(a^(t−k), a^k) ("both") for k ≤ t,
    a = γλ ∈ [0, 1]; w(t,t) = 1. Returns z [B, T] in float32 (float64 for float64 input),
    differentiable, unclamped (clamp before exp).
    O(B·T) time and memory, never the [T, T] weights: "recent" is the recurrence
    z_t = x_t + a·z_{t−1}; "both" splits at m = ceil(t/2) (a^k ≥ a^(t−k) iff k ≤ t/2):
    z_t = z^rec_t − a^(t−m+1)·z^rec_(m−1) + Σ_{k<m} a^k·x_k."""
    a = _decay(lam, gamma, style)
    valid = mask.bool()
    x = torch.where(valid, log_ratio.to(torch.promote_types(log_ratio.dtype, torch.float32)), 0.0)
    z = _recent_trace(x, a, chunk)
    if style == "both":
        t = torch.arange(x.shape[1], device=x.device)
        m = (t + 1) // 2  # ceil(t/2): k < m takes the early weight a^k, k ≥ m the recent a^(t−k)
        early = F.pad(torch.cumsum(x * (a ** t.double()).to(x.dtype), 1), (1, 0))  # Σ_{k<m} a^k x_k
        z_before = F.pad(z, (1, 0))[:, m]  # z^rec_(m−1), 0 at m = 0
        z = z - (a ** (t - m + 1).double()).to(x.dtype) * z_before + early[:, m]
    return torch.where(valid, z, 0.0)


@dataclasses.dataclass(frozen=True)
class LambdaConfig:
    """GRPO-λ's settings (paper §3.2, Eq. 2) at the flags' defaults: Args repeats them as flags
    (their --help), LambdaConfig.of(args) takes a run's."""

    lam: float = 0.99
    gamma: float = 1.0
    style: str = "both"  # or "recent"
    adv_floor: float | None = -0.1  # the clamp of negative advantages (--adv-clamp); None: none
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    max_log_ratio: float = 20.0  # (project default)

    @classmethod
    def of(cls, args) -> "LambdaConfig":
        floor = None if args.adv_clamp.lower() == "none" else float(args.adv_clamp)
        eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
        clip = (args.epsilon, eps_high, args.max_log_ratio)
        return cls(args.lam, args.gamma, args.trace_style, floor, *clip)


LambdaLoss = collections.namedtuple("LambdaLoss", "loss ratio z")  # each [B, T]


def grpo_lambda_token_loss(
    logp, old_logp, adv, mask, cfg: LambdaConfig = LambdaConfig()
) -> LambdaLoss:
    """GRPO-λ's per-token policy loss [B, T] before aggregation and KL (paper §3.2, Eq. 2;
    docs/grpo_lambda.md), ϵ-trace: the traced ratio inside GRPO's clipped surrogate.
    logp, old_logp: [B, T] log-probs of the completion tokens (nats); adv: [B, T] clamped advantage
    (the critic-free TD error). ρ̃_t = exp(clamp(trace_log_ratio(logp − old_logp), ±max_log_ratio)),
    loss_t = −min(ρ̃_t·A, clip(ρ̃_t, 1−ε, 1+ε_high)·A). Returns LambdaLoss(loss [B, T], the ratio the
    clip acts on [B, T], the traced log-ratio z [B, T]). cfg: λ, γ, the style, ε (LambdaConfig).
    The ϵ-weight variant: rlvr_utils/methods/lambda_ablations.py.

    >>> logp, A = torch.zeros(1, 3, requires_grad=True), torch.ones(1, 3)  # on-policy; mask = A = 1
    >>> out = grpo_lambda_token_loss(logp, logp.detach(), A, A, LambdaConfig(0.5, style="recent"))
    >>> torch.autograd.grad(out.loss.sum(), logp)[0]  # -c_k: 1 + .5 + .25, 1 + .5, 1 (both: -3)
    tensor([[-1.7500, -1.5000, -1.0000]])
    """
    z = trace_log_ratio(logp - old_logp, mask, cfg.lam, cfg.gamma, cfg.style)  # Eq. 2
    ratio = torch.exp(z.clamp(-cfg.max_log_ratio, cfg.max_log_ratio))  # ρ̃_t
    clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
    return LambdaLoss(-torch.min(ratio * adv, clipped * adv), ratio, z)


def clamp_negative_advantages(adv: torch.Tensor, floor: float | None) -> torch.Tensor:
    """Â^c = max(Â, floor), floor ≤ 0 (paper: −0.1), any shape: negative advantages times the
    large c_k destabilize training; positive ones are untouched (paper, as its reviews report).
    floor None: no clamp (a copy)."""
    if floor is not None and floor > 0:
        raise ValueError(
            f"adv_clamp must be <= 0 (it only limits negative advantages), got {floor}"
        )
    return adv.clone() if floor is None else adv.clamp(min=floor)


TRACE_STYLES = ("recent", "both")


def _decay(lam: float, gamma: float, style: str) -> float:
    """a = γλ, the trace's decay per token; checks a ∈ [0, 1] and the style."""
    if style not in TRACE_STYLES:
        raise ValueError(f"unknown trace style {style!r}: choose one of {TRACE_STYLES}")
    if not 0.0 <= gamma * lam <= 1.0:
        raise ValueError(f"gamma * lam must be in [0, 1], got {gamma * lam}")
    return gamma * lam


def _recent_trace(x: torch.Tensor, a: float, chunk: int = 64) -> torch.Tensor:
    """z_t = x_t + a·z_{t−1} (z_{−1} = 0) along dim 1 of x [B, T], the accumulating eligibility
    trace. Unrolled `chunk` steps at a time: inside a chunk, x times a fixed [chunk, chunk] matrix
    of a^(t−k); then each chunk adds a^(i+1)·(the trace at the end of the chunk before), the same
    recurrence over chunk ends with decay a^chunk. Time O(B·T·chunk), memory O(B·T), no Python
    loop over T, no overflowing a^(−k)."""
    B, T = x.shape
    C = max(1, min(chunk, T))
    n = -(-T // C)
    i = torch.arange(C, device=x.device)
    lag = (i[:, None] - i[None, :]).double()  # [C, C]: t − k
    W = torch.where(lag >= 0, a ** lag.clamp(min=0), 0.0).to(x.dtype)
    z = F.pad(x, (0, n * C - T)).view(B, n, C) @ W.T  # [B, n, C]: the trace within each chunk
    if n > 1:
        ends = _recent_trace(z[:, :, -1], a**C, chunk)  # [B, n]: the trace at each chunk's end
        carry = F.pad(ends[:, :-1], (1, 0))  # the trace just before each chunk
        z = z + carry[:, :, None] * (a ** (i + 1).double()).to(x.dtype)
    return z.reshape(B, n * C)[:, :T]


def validate(args: Args) -> Args:
    """GRPO-λ's own flag checks (one-line errors, exit code 2); the shared ones run in cli.parse."""
    cli.need_ranges(args, lam="[0, 1]", gamma="[0, 1]", max_log_ratio="> 0")
    text = args.adv_clamp
    ok = text.lower() == "none" or (_is_float(text) and float(text) <= 0)
    cli.need(ok, f"--adv-clamp must be a number <= 0 or none, got {text}")
    return args


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    # TRY NOT TO MODIFY: flags, torchrun, seeding; the task, the model, its reference, the optimizer
    args = cli.parse(Args, validate, "lambda_ablations")  # tyro.cli(Args), every check first
    run = common.Run(args)
    tokenizer = common.load_tokenizer(args.model)
    task = common.load_task(args, tokenizer)  # before the model: an empty task stops at once
    model = common.load_model(args.model, run.device, run.dtype, args.gradient_checkpointing)
    model = common.with_lora(model, args)  # --lora-rank: LoRA adapters train, the base is frozen
    ref_model = common.reference(model, args) if args.beta > 0 else None  # LoRA: adapters off
    train_model = run.dist.wrap(model, ref_model)  # DDP / FSDP2; bf16: fp32 masters (precision.py)
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = common.adamw(params, args)  # mixed precision: it steps the fp32 masters
    run.start(model, tokenizer, optimizer, task)  # batches, --resume, vLLM, logs, step-0 eval
    dist = run.dist
    G = args.num_generations
    cfg = LambdaConfig.of(args)  # ALGO LOGIC: Eq. 2's flags and the clamp's floor
    token_loss = grpo_lambda_token_loss  # ALGO LOGIC: ϵ-trace
    ablation = args.ablation_module  # its flag given: methods/lambda_ablations.py (--trace-apply)
    if ablation is not None:
        token_loss = ablation.token_loss(args, grpo_lambda_token_loss, trace_log_ratio)

    for step in run.steps():
        # 1-2. rollouts: G completions per prompt, one reward per completion (the verifier sees the
        #      decoded text); DAPO's dynamic sampling and overlong penalty when asked
        ro, rewards, sampling = common.rollouts_with_rewards(
            model, tokenizer, task, run.batches, dist, args
        )
        mask = ro.completion_mask  # [N, T]
        if args.mask_truncated_completions:  # DAPO's overlong filtering
            mask = mask * ~ro.truncated[:, None]
        T = mask.shape[1]
        run.lap("generation")

        # 3. ALGO LOGIC: credit assignment. GRPO's group advantage is the critic-free TD error, its
        #    negative values clamped (paper: at -0.1). The trace that carries it back to earlier
        #    tokens is over the *current* policy's log-ratios, so it acts inside the loss, in step 5
        #    (grpo_lambda_token_loss, paper §3.2, Eq. 2). torchrun: over the global batch.
        gid = ro.group_ids.cpu()
        advantages = dist.over_global_batch(
            common.group_advantages, rewards, G, args.scale_rewards, group_ids=gid
        )  # [N]
        advantages = clamp_negative_advantages(advantages, cfg.adv_floor)  # [N]
        run.credit_signals(advantage=advantages)  # LOGS: credit / advantage: the multiplier c_k
        token_adv = advantages.to(run.device)[:, None].expand(-1, T)  # [N, T]

        # 4. old and reference log-probs (no gradient). On-policy (one pass, one mini-batch) the
        #    old log-probs are the current ones, detached; otherwise this pass makes them.
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad(), dist.gathered_if_uneven(model, ref_model):  # FSDP, uneven rows
            on_policy = args.num_iterations == 1 and args.num_minibatches == 1
            old_logp = None
            if not on_policy:
                old_logp = common.token_logprobs(model, input_ids, attn, T, args.temperature)[0]
            ref_logp = None
            if ref_model is not None:
                ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0]
        run.lap("logprobs")

        # 5. update: mu passes; each splits the batch into mini-batches of whole prompts, one
        #    optimizer step each, in micro-batches (the loss is normalized over the mini-batch)
        stats = common.UpdateStats(mask, args.num_iterations)
        trace_log = TraceStats(args.max_log_ratio, args.num_iterations, stats.tokens)  # LOGS
        for it in range(args.num_iterations):
            for rows in common.minibatches(ro.group_ids, args.num_minibatches):
                optimizer.zero_grad(set_to_none=True)
                num_tokens, num_seqs = dist.loss_counts(mask[rows])  # global counts / world size
                agg = (args.loss_agg, args.max_new_tokens, num_tokens, num_seqs)
                micro = rows.split(args.micro_batch_size)
                for mb in dist.micro_batches(train_model, micro):  # all-reduce in the last
                    m = mask[mb].float()
                    batch = (input_ids[mb], attn[mb], T, args.temperature)
                    logp, entropy = common.token_logprobs(train_model, *batch, with_entropy=it == 0)
                    run.watch_credit(logp, mb, m, num_tokens, num_seqs)  # LOGS: --log-credit
                    old = old_logp[mb] if old_logp is not None else logp.detach()
                    # ALGO LOGIC: PPO-clipped surrogate of the traced ratio exp(z_t) (Eq. 2)
                    A = token_adv[mb]
                    per_token_loss, ratio, z = token_loss(logp, old, A, m, cfg)
                    trace_log.add(per_token_loss, logp, A, m, z, it == 0)  # LOGS: trace/*
                    # vLLM rollouts: importance weights toward the engine's sampling (HF: 1)
                    engine_w = common.engine_correction(ro, mb, old, m, args, stats, it)
                    per_token_loss = per_token_loss * engine_w
                    kl = None  # KL(pi || pi_ref), k3, with --beta > 0
                    if ref_logp is not None:
                        kl = common.k3_kl(logp, ref_logp[mb])
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = common.aggregate_loss(per_token_loss, m, *agg)
                    run.stop_if_nonfinite(loss, "loss")
                    loss.backward()
                    stats.add(m, ratio, A, args.epsilon, args.epsilon_high, entropy, kl, loss)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                run.stop_if_nonfinite(grad_norm, "gradient norm")
                optimizer.step()
                stats.step(grad_norm)
        run.lap("update")

        # 6. TRY NOT TO MODIFY: metrics, evaluation, logging, checkpoint, Ctrl-C
        run.end_step(step, ro, rewards, stats, sampling | trace_log.metrics())  # LOGS: + trace/*

    run.finish()

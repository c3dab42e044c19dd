"""EP-GRPO: entropy-progress aligned GRPO with implicit process guidance (a RECONSTRUCTION).

Each token gets its own advantage A = g_hat * (A_out + lambda * d * P): GRPO's advantage A_out plus an implicit process
signal P (delta = log pi_old - log pi_ref, z-scored over the group's tokens in the same window of cumulative-entropy
progress), signed by the outcome polarity d (sign(A_out); +1 / -1 where a group's rewards are all equal and reach /
miss --success-threshold, so such groups still train), times an entropy gate g_hat that favours high-entropy
"decision pivots". Each flag says if it is (a) the authors' formula as reported second-hand, (b) the abstract's or (c)
ours. Paper: Yu, Li, Zhao, Yang 2026, EP-GRPO (arXiv 2605.04960). Docs: docs/ep_grpo.md. Differences from grpo.py:
  1. per-token advantages (ep_advantages, step 3) from a no-grad pass of the policy (log pi_old, rollout entropy) that
     runs even on-policy, and from the reference, loaded even at --beta 0 (or a moving anchor, --process-anchor);
  2. defaults: --beta 1e-3, --loss-agg token-mean, --outcome-std population (std + 1e-6; grpo.py: unbiased + 1e-4);
  3. the ep/* diagnostics (rlvr_utils/ep_diagnostics.py); the flags' ablation forms are in rlvr_utils/ep_ablations.py.
With --gate-alpha 0 --process-coef 0 --outcome-std unbiased it is grpo.py --beta 0.001 --loss-agg token-mean.
"""

import copy
import dataclasses
import os
from typing import Literal, get_args

import torch

import common
from rlvr_utils import cli, ep_ablations, ep_diagnostics

Gate = Literal[
    "soft", "hard", "gtpo", "zsig", "none"
]  # the flags with choices, by name (Args and ep_advantages)
PivotScope = Literal["batch", "group", "response"]
GateNorm = Literal["response", "none"]
Granularity = Literal["window", "token", "cumulative"]
Polarity = Literal["outcome", "none"]
AnchorForm = Literal["additive", "multiplicative"]
Progress = Literal["entropy", "position"]
AdvantageForm = Literal["A", "B"]
OutcomeStd = Literal["population", "unbiased"]


@dataclasses.dataclass
class Args(cli.BaseArgs):
    """EP-GRPO (arXiv 2605.04960), reconstructed; each flag: (a) the authors' formula, (b) the abstract's, (c) ours."""

    beta: float = 1e-3
    """(c) k3 KL coefficient to the frozen initial policy (loaded for delta anyway): small, as verl's GRPO; grpo.py 0"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """(c) token-mean (DAPO), seq-mean-token-mean (original GRPO; grpo.py's), seq-mean-token-sum-norm (Dr. GRPO)"""
    outcome_std: OutcomeStd = "population"
    """(c) std of the outcome advantage: population + 1e-6 (ours; verl: unbiased + 1e-6) or unbiased + 1e-4 (grpo.py,
    TRL)"""
    # ALGO LOGIC: EP-GRPO's own flags, at the defaults the method runs with; each reaches ep_advantages by name
    gate: Gate = "soft"
    """(c) soft 1 + alpha*sigmoid((H - pivot)/gate-temp); hard 1[H > pivot]; gtpo H; none 1; (a) zsig sigmoid(g*z(H))"""
    pivot_quantile: float = 0.8
    """(b) pivots, (c) 0.8: the pivot threshold is this quantile (in [0, 1]) of the token entropies"""
    pivot_scope: PivotScope = "batch"
    """(c) batch, (a) group: over which tokens the pivot threshold (or zsig's z-score) is taken"""
    gate_alpha: float = 1.0
    """(c) alpha >= 0: extra weight of a pivot under the soft gate (0 turns the gate off)"""
    gate_temp: float = 0.1
    """(c) T_g: softness of the soft gate (nats, > 0)"""
    gate_norm: GateNorm = "response"
    """(c) response: the gate over its mean per response (each keeps its advantage mass); (a) none"""
    process_granularity: Granularity = "token"
    """(a) token: delta z-scored over the group's tokens in its window; (c) window: window sums; (c) prefix sums"""
    process_polarity: Polarity = "outcome"
    """(a) outcome: P times d = sign(A_out); in all-equal groups +1 if r >= --success-threshold, else -1; none: 1"""
    process_coef: float = 0.2
    """(c) lambda >= 0 (the authors' eta): weight of P in groups with mixed rewards (0 turns it off)"""
    process_coef_zero_var: float | None = None
    """(b) lambda_0: weight of P in groups whose rewards are all equal (default: --process-coef)"""
    process_clip: float = 3.0
    """(c) c: P is clipped to [-c, c] (> 0)"""
    process_std_min: float = 1e-3
    """(c) sigma_min: a (group, window) cell whose std is below this (>= 0) gets P = 0"""
    progress: Progress = "entropy"
    """progress coordinate: (a) cumulative entropy share, (c) taken at the token's midpoint (C_t - H_t/2) / C_T
    (the recovered form is S_t / S_T) (entropy), or (c) token share (position)"""
    num_buckets: int = 10
    """(a) the number of progress windows (>= 1; the authors' K)"""
    process_anchor: Literal["ref", "ema", "lagged"] = "ref"
    """delta = log pi_old - log pi_anchor against (a) ref, the frozen initial policy, or (c) ema, lagged (ablations)"""
    # Ablations (docs/ep_grpo.md, Ablations): the other forms, in rlvr_utils/ep_ablations.py
    gate_gamma: float = 1.0
    """(c) gamma of --gate zsig, > 0 (the authors' value is not known)"""
    anchor_form: AnchorForm = "additive"
    """(a) additive gate*(A_out + lambda*d*P); (c) multiplicative gate*A_out*(1 + lambda*tanh(sign(A_out)*P))"""
    advantage_form: AdvantageForm = "A"
    """(a) A: gate * (A_out + lambda * d * P); (c) B: gate * z-score of r + implicit-beta * cumsum(delta) per cell"""
    implicit_beta: float = 0.05
    """(c) beta of the implicit reward in --advantage-form B (no effect in form A)"""
    anchor_ema_decay: float = 0.99
    """(c) --process-anchor ema: anchor <- decay * anchor + (1 - decay) * policy after every step (in [0, 1])"""
    anchor_lag: int = 10
    """(c) --process-anchor lagged: the anchor is reset to the policy every this many steps (>= 1)"""


# ALGO LOGIC: EP-GRPO's credit assignment at its defaults, as pure tensor functions (docs/ep_grpo.md, each equation)
def row_quantile(x: torch.Tensor, valid: torch.Tensor, q: float) -> torch.Tensor:
    """The gate's pivot threshold: the q-quantile (linear interpolation, as torch.quantile) of each row's valid
    entries; x, valid: [R, L] -> [R]. Rows without valid entries give 0. Sort-based, so it has no size limit."""
    s = (
        x.float().masked_fill(~valid, float("inf")).sort(dim=1).values
    )  # valid entries first, ascending
    n = valid.sum(1)
    pos = q * (n - 1).clamp(min=0).float()  # the quantile's fractional rank
    lo, hi = pos.floor().long()[:, None], pos.ceil().long()[:, None]
    val = s.gather(1, lo) + (pos[:, None] - lo) * (s.gather(1, hi) - s.gather(1, lo))
    return torch.where(n > 0, val.squeeze(1), torch.zeros_like(pos))


def cell_zscore(
    x, valid, cell, num_cells, clip=3.0, std_min=1e-3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The process signal's normalization: z = (x - mean_cell) / std_cell within cells (population std), clipped to
    [-clip, clip]. x, valid, cell: same shape (cell: long ids < num_cells, a cell is a (group, window) pair). Entries
    that are not valid, or whose cell has fewer than 2 members or a std below std_min, get 0. Returns (z like x,
    members per cell [num_cells], ok [num_cells])."""
    v = valid.float()
    c, xv = cell.reshape(-1), (x.float() * v).reshape(-1)
    zeros = torch.zeros(num_cells, device=x.device)
    n = zeros.index_add(0, c, v.reshape(-1))  # members per cell
    mean = zeros.index_add(0, c, xv) / n.clamp(min=1)
    dev = (x.float() - mean[cell]) * v
    std = (zeros.index_add(0, c, (dev**2).reshape(-1)) / n.clamp(min=1)).sqrt()
    ok = (n >= 2) & (std > 0) & (std >= std_min)
    z = (dev / torch.where(ok, std, torch.ones_like(std))[cell]).clamp(-clip, clip)
    return torch.where(ok[cell] & valid, z, torch.zeros_like(z)), n, ok


def entropy_gate(
    entropy, mask, pivot, gate="soft", alpha=1.0, temp=0.1, norm="response", eps=1e-6
) -> torch.Tensor:
    """Token weights g_hat [B, T] = g / (g's mean over the response), g = 1 + alpha * sigmoid((H - pivot) / temp): each
    response keeps its mean weight 1 (all ~0: 1), pads get 0. entropy: [B, T], pivot (a scalar or [B, 1]): nats."""
    m, H = mask.float(), entropy.float()
    soft = gate == "soft"  # the other gates: ablations
    g = (
        1 + alpha * torch.sigmoid((H - pivot) / temp)
        if soft
        else ep_ablations.gate_weights(H, pivot, temp, gate)
    )
    g = g * m
    mean = g.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    return g if norm == "none" else torch.where(mean > eps, g / mean.clamp(min=eps), m)


def progress_windows(
    entropy, mask, num_buckets=10, progress="entropy", eps=1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window b = min(n - 1, floor(n * u)) [B, T] of each token (n = num_buckets; pads: 0), u = (C_t - H_t/2) / C_T
    (ours: the authors' coordinate S_t / S_T taken at the token's midpoint), C the cumulative entropy [B, T] (nats);
    zero_entropy [B]: C_T <= eps, where (as with --progress position) u = (t - 1/2) / T."""
    m, H = mask.float(), entropy.float().clamp(min=0) * mask.float()
    pos = (m.cumsum(1) - 0.5) / m.sum(1, keepdim=True).clamp(min=1)
    C = H.cumsum(1)
    total = C[:, -1:]
    u = (
        torch.where(total > eps, (C - 0.5 * H) / total.clamp(min=eps), pos)
        if progress == "entropy"
        else pos
    )
    b = (u * num_buckets).floor().long().clamp(0, num_buckets - 1) * mask.long()
    return b, total.squeeze(1) <= eps


def ep_advantages(
    entropy, logp_old, logp_ref, mask, rewards, group_size, group_ids=None, *,
    scale_rewards="group", outcome_std="population",  # A_out
    gate="soft", pivot_quantile=0.8, pivot_scope="batch", gate_alpha=1.0, gate_temp=0.1, gate_norm="response",  # g_hat
    gate_gamma=1.0, process_granularity="token", process_polarity="outcome", success_threshold=1.0,  # g_hat; P, d
    anchor_form="additive", process_coef=0.2, process_coef_zero_var=None, process_clip=3.0, process_std_min=1e-3,
    progress="entropy", num_buckets=10, advantage_form="A", implicit_beta=0.05, return_parts=False,  # windows, form B
    scores=None,  # d's verifier scores [B] (the rewards before any overlong shaping; default: rewards)
):  # fmt: skip
    """EP-GRPO token advantages A [B, T] = g_hat * (A_out + lambda_g * d * P), 0 at pads (the authors' Eq. 18-25 as
    reported second-hand; docs/ep_grpo.md). entropy: [B, T] rollout entropy (nats); logp_old, logp_ref: [B, T] log-probs
    of the sampled tokens under pi_old and the anchor; mask: [B, T]; rewards: [B]; groups: rows sharing group_ids
    (default: blocks of group_size). Keywords: the flags of the same names. Pure. return_parts: also the pieces."""
    chosen = dict(
        gate=(gate, Gate), pivot_scope=(pivot_scope, PivotScope), gate_norm=(gate_norm, GateNorm)
    )
    chosen |= dict(
        process_granularity=(process_granularity, Granularity), progress=(progress, Progress)
    )
    chosen |= dict(
        process_polarity=(process_polarity, Polarity), anchor_form=(anchor_form, AnchorForm)
    )
    chosen |= dict(
        advantage_form=(advantage_form, AdvantageForm), outcome_std=(outcome_std, OutcomeStd)
    )
    bad = [
        f"{k}={v!r} (one of {get_args(t)})" for k, (v, t) in chosen.items() if v not in get_args(t)
    ]
    if bad or num_buckets < 1 or not 0 <= pivot_quantile <= 1:
        raise ValueError(
            f"{bad}; need num_buckets >= 1, pivot_quantile in [0, 1]: {num_buckets}, {pivot_quantile}"
        )
    B, dev, valid, m, H = mask.shape[0], entropy.device, mask.bool(), mask.float(), entropy.float()
    gid = torch.arange(B) // group_size if group_ids is None else group_ids.cpu()
    _, inv = torch.unique(gid, return_inverse=True)
    unbiased = (
        outcome_std == "unbiased"
    )  # A_out: population: (r - mean) / (std_pop + 1e-6); unbiased: grpo.py's
    a_out = common.group_advantages(
        rewards.float().cpu(),
        group_size,
        scale_rewards,
        1e-4 if unbiased else 1e-6,
        group_ids=gid,
        unbiased=unbiased,
    ).to(dev)
    inv, r, n_groups, n_win = inv.to(dev), rewards.float().to(dev), int(inv.max()) + 1, num_buckets
    zero_var = common.constant_groups(r, inv)[1][inv]  # all-equal-reward groups
    # outcome polarity d: the verifier signs the process credit (all-wrong groups: -1, back towards the reference)
    solved = (
        r if scores is None else scores.float().to(dev)
    ) >= success_threshold  # [B] the verifier's success
    polarity = torch.where(zero_var, torch.where(solved, 1.0, -1.0), torch.sign(a_out))
    polarity = polarity if process_polarity == "outcome" else torch.ones_like(r)
    # entropy gate around the pivot threshold, the rho-quantile of the token entropies [B, 1] (others: ablations)
    pivot, temp = (
        row_quantile(H.reshape(1, -1), valid.reshape(1, -1), pivot_quantile).repeat(B, 1),
        gate_temp,
    )
    if pivot_scope != "batch" or gate == "zsig":
        pivot, temp = ep_ablations.pooled_threshold(H, mask, inv, pivot_scope, pivot_quantile, gate, temp, gate_gamma,
                                                  quantile=row_quantile)  # fmt: skip
    g_hat = entropy_gate(H, mask, pivot, gate, gate_alpha, temp, gate_norm)
    # process signal P: delta, the implicit-PRM log-ratio per token, z-scored over the group's tokens in each window
    b, zero_entropy = progress_windows(H, mask, n_win, progress)
    delta = (logp_old.float() - logp_ref.float()) * m
    P, n_cell, ok = cell_zscore(
        delta, valid, inv[:, None] * n_win + b, n_groups * n_win, process_clip, process_std_min
    )
    if (
        process_granularity != "token"
    ):  # ablations: window sums or prefix sums of delta, z-scored per cell
        P, n_cell, ok = ep_ablations.window_process(
            delta,
            b,
            inv,
            mask,
            n_win,
            process_granularity,
            process_clip,
            process_std_min,
            zscore=cell_zscore,
        )
    lam0 = process_coef if process_coef_zero_var is None else process_coef_zero_var
    lam = torch.where(zero_var, lam0, process_coef)[:, None]
    A = g_hat * (a_out[:, None] + lam * polarity[:, None] * P) * m
    if (
        anchor_form != "additive" or advantage_form != "A"
    ):  # ablations: the multiplicative form, form B
        A, P, n_cell, ok = ep_ablations.other_forms(
            g_hat, a_out, lam, P, n_cell, ok, r, delta, b, inv, mask, advantage_form, n_win, implicit_beta,
            process_clip, process_std_min, zscore=cell_zscore,
        )  # fmt: skip
    parts = dict(
        outcome=a_out,
        gate=g_hat,
        process=P,
        windows=b,
        pivot=pivot,
        zero_var=zero_var,
        group_index=inv,
    )
    parts.update(
        zero_entropy=zero_entropy, cell_members=n_cell, cell_ok=ok, polarity=polarity, delta=delta
    )
    return (A, dict(parts, above_threshold=solved)) if return_parts else A


def validate(a: Args) -> Args:
    """EP-GRPO's own checks (cli.parse runs the shared ones): one line naming the flag and what is allowed, exit 2."""
    ranges = dict(
        anchor_lag=">= 1",
        num_buckets=">= 1",
        anchor_ema_decay="[0, 1]",
        gate_gamma="> 0",
        gate_temp="> 0",
    )
    ranges |= dict(
        pivot_quantile="[0, 1]", process_clip="> 0", process_std_min=">= 0", gate_alpha=">= 0"
    )
    ranges |= dict(process_coef=">= 0", process_coef_zero_var=">= 0", implicit_beta="> 0")
    cli.need_ranges(a, **ranges)
    sharded = a.fsdp and int(os.environ.get("WORLD_SIZE", "1")) > 1
    cli.need(
        not sharded or a.process_anchor == "ref",
        "--process-anchor ema/lagged do not support --fsdp: use ref",
    )
    return a


if __name__ == "__main__":
    # TRY NOT TO MODIFY: flags, torchrun, seeding; the task, the model, its reference and the optimizer
    args = cli.parse(
        Args, validate
    )  # tyro.cli(Args), every check before anything loads (one-line errors)
    run = common.Run(args)
    tokenizer = common.load_tokenizer(args.model)
    task = common.load_task(
        args, tokenizer
    )  # before the model: a task that yields nothing stops at once
    model = common.load_model(args.model, run.device, args.dtype, args.gradient_checkpointing)
    need_ref = (
        args.process_anchor == "ref" or args.beta > 0
    )  # ALGO LOGIC: delta needs it even at --beta 0
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if need_ref else None
    train_model = run.dist.wrap(
        model, ref_model
    )  # DDP / FSDP2 under torchrun; the model itself otherwise
    anchor = (
        ref_model
        if args.process_anchor == "ref"
        else copy.deepcopy(model).eval().requires_grad_(False)
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
    )
    run.start(
        model, tokenizer, optimizer, task, state={} if anchor is ref_model else {"anchor": anchor}
    )
    dist, G = run.dist, args.num_generations
    flags = dict(
        scale_rewards=args.scale_rewards, outcome_std=args.outcome_std, gate=args.gate
    )  # ALGO LOGIC: by name
    flags |= dict(
        pivot_quantile=args.pivot_quantile, pivot_scope=args.pivot_scope, gate_alpha=args.gate_alpha
    )
    flags |= dict(gate_temp=args.gate_temp, gate_norm=args.gate_norm, gate_gamma=args.gate_gamma)
    flags |= dict(
        process_granularity=args.process_granularity, process_polarity=args.process_polarity
    )
    flags |= dict(success_threshold=args.success_threshold, anchor_form=args.anchor_form)
    flags |= dict(process_coef=args.process_coef, process_coef_zero_var=args.process_coef_zero_var)
    flags |= dict(
        process_clip=args.process_clip, process_std_min=args.process_std_min, progress=args.progress
    )
    flags |= dict(
        num_buckets=args.num_buckets,
        advantage_form=args.advantage_form,
        implicit_beta=args.implicit_beta,
    )

    for step in run.steps():
        # 1-2. rollouts: G completions per prompt, and one reward per completion (the verifier sees the decoded text);
        #      DAPO's dynamic sampling and overlong penalty when asked
        ro, rewards, sampling = common.rollouts_with_rewards(
            model, tokenizer, task, run.batches, dist, args
        )
        mask = (
            ro.completion_mask * ~ro.truncated[:, None]
            if args.mask_truncated_completions
            else ro.completion_mask
        )
        T = mask.shape[1]
        run.lap("generation")

        # 4. ALGO LOGIC, before step 3 which needs them (even on-policy): log pi_old, entropy old_H, log pi_anchor
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad():
            old_logp, old_H = common.token_logprobs(
                model, input_ids, attn, T, args.temperature, with_entropy=True
            )
            ref_logp = (
                common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0]
                if ref_model
                else None
            )
            moving = anchor is not ref_model  # --process-anchor ema / lagged: its own pass
            anchor_logp = (
                common.token_logprobs(anchor, input_ids, attn, T, args.temperature)[0]
                if moving
                else ref_logp
            )
        run.lap("logprobs")

        # 3. ALGO LOGIC: credit assignment, per token [N, T]: A = gate * (A_out + lambda * d * P), every flag by name
        gid, scores = (
            ro.group_ids,
            ro.scores,
        )  # d's success is the verifier's (rewards: shaped by --overlong-buffer)
        #    torchrun: over the global batch (the pivot is the whole batch's entropy quantile), each rank its rows
        token_adv, parts = dist.over_global_batch(
            ep_advantages, old_H, old_logp, anchor_logp, mask, rewards, G, gid, **flags, scores=scores,
            return_parts=True, keep_whole=("cell_members", "cell_ok"),  # per (group, window) cell: all for the metrics
        )  # fmt: skip
        parts["group_index"] = torch.unique(gid.cpu(), return_inverse=True)[1].to(
            token_adv.device
        )  # this rank's
        ep_stats = ep_diagnostics.ep_metrics(
            token_adv, parts, old_H, mask
        )  # LOGS: the ep/* metrics, from its pieces
        signals = dict(
            outcome=parts["outcome"],
            gate=parts["gate"],
            P=parts["process"],
            window=parts["windows"],
        )
        run.credit_signals(
            **signals
        )  # LOGS: --log-credit's outcome advantage, gate, process signal and window
        run.lap("advantages")

        # 5. update: mu passes; each splits the batch into mini-batches of whole prompts, one optimizer step each,
        #    computed in micro-batches (the loss is normalized over the mini-batch, so accumulation changes nothing)
        stats = common.UpdateStats(mask, args.num_iterations)
        for it in range(args.num_iterations):
            for rows in common.minibatches(ro.group_ids, args.num_minibatches):
                optimizer.zero_grad(set_to_none=True)
                num_tokens, num_seqs = dist.loss_counts(mask[rows])  # global counts / world size
                micro = rows.split(args.micro_batch_size)
                for k, mb in enumerate(micro):
                    dist.sync_grads(
                        train_model, k == len(micro) - 1
                    )  # all-reduce once per optimizer step
                    m = mask[mb].float()
                    logp, entropy = common.token_logprobs(
                        train_model,
                        input_ids[mb],
                        attn[mb],
                        T,
                        args.temperature,
                        with_entropy=it == 0,
                    )
                    run.watch_credit(
                        logp, mb, m, num_tokens, num_seqs
                    )  # LOGS: --log-credit records dL/dlog p
                    old = old_logp[mb] if old_logp is not None else logp.detach()
                    # ALGO LOGIC: PPO-clipped surrogate of the per-token advantage
                    log_ratio = torch.clamp(
                        logp - old, -common.MAX_LOG_RATIO, common.MAX_LOG_RATIO
                    )  # fp32, as verl
                    ratio = torch.exp(log_ratio)
                    A = token_adv[mb]
                    surrogate = torch.min(
                        ratio * A, torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high) * A
                    )
                    per_token_loss = -surrogate
                    # vLLM rollouts: importance weights toward the engine's distribution (--vllm-is-mode; 1 with HF)
                    per_token_loss = per_token_loss * common.engine_correction(
                        ro, mb, old, m, args, stats.engine(it), stats.tokens
                    )
                    kl = (
                        common.k3_kl(logp, ref_logp[mb]) if ref_logp is not None else None
                    )  # KL(pi || pi_ref), k3
                    if kl is not None:
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = common.aggregate_loss(
                        per_token_loss, m, args.loss_agg, args.max_new_tokens, num_tokens, num_seqs
                    )
                    run.stop_if_nonfinite(loss, "loss")
                    loss.backward()
                    stats.add(
                        m, ratio, A, args.epsilon, args.epsilon_high, entropy, kl, loss
                    )  # LOGS: diagnostics
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                run.stop_if_nonfinite(grad_norm, "gradient norm")
                optimizer.step()
                stats.step(grad_norm)
        run.lap("update")
        ep_ablations.follow_policy(
            anchor, model, step, args
        )  # ALGO LOGIC: a moving anchor follows the policy

        # 6. TRY NOT TO MODIFY: metrics, evaluation, logging, checkpoint, Ctrl-C
        run.end_step(step, ro, rewards, stats, {**sampling, **ep_stats})

    run.finish()

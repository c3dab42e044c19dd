"""EP-GRPO: entropy-progress aligned GRPO with implicit process guidance (a RECONSTRUCTION).

Each token gets its own advantage A = g_hat * (A_out + lambda * d * P): GRPO's advantage A_out plus
an implicit process signal P (delta = log pi_old - log pi_ref, z-scored over the group's tokens in
the same window of cumulative-entropy progress), signed by the outcome polarity d (sign(A_out);
+1 / -1 where a group's rewards are all equal and reach / miss --success-threshold, so such groups
still train), times an entropy gate g_hat that favours high-entropy "decision pivots". Each flag
says if it is (a) the authors' formula as reported second-hand, (b) the abstract's or (c) ours.
Paper: Yu, Li, Zhao, Yang 2026, EP-GRPO (arXiv 2605.04960). Docs: docs/ep_grpo.md.

Differences from grpo.py:
  1. per-token advantages (ep_advantages, step 3) from a no-grad pass of the policy (log pi_old, the
     rollout entropy) that runs even on-policy, and from the reference, loaded even at --beta 0 (or
     a moving anchor, --process-anchor);
  2. defaults: --beta 1e-3, --loss-agg token-mean, --outcome-std population (std + 1e-6; grpo.py:
     unbiased + 1e-4);
  3. the ep/* diagnostics (rlvr_utils/methods/ep_diagnostics.py); the ablation flags' other forms
     are in rlvr_utils/methods/ep_ablations.py (an extra, loaded when one is asked for).
With --gate-alpha 0 --process-coef 0 --outcome-std unbiased it is grpo.py --beta 0.001
--loss-agg token-mean.
"""

import collections
import dataclasses
from typing import Literal

import torch

import common
from rlvr_utils.core import cli
from rlvr_utils.methods import ep_diagnostics

GateNorm = Literal["response", "none"]  # the flags with choices, by name
Polarity = Literal["outcome", "none"]
Progress = Literal["entropy", "position"]
OutcomeStd = Literal["population", "unbiased"]


@dataclasses.dataclass
class Args(cli.BaseArgs):
    """EP-GRPO (arXiv 2605.04960), reconstructed; each flag: (a) the authors' formula, (b) the
    abstract's, (c) ours. Its ablation flags (the other forms, moving anchors): docs/ep_grpo.md."""

    beta: float = 1e-3
    """(c) k3 KL coefficient to the frozen initial policy (loaded for delta anyway): small, as
    verl's GRPO; grpo.py 0"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """(c) token-mean (DAPO), seq-mean-token-mean (original GRPO; grpo.py's),
    seq-mean-token-sum-norm (Dr. GRPO)"""
    outcome_std: OutcomeStd = "population"
    """(c) std of the outcome advantage: population + 1e-6 (ours; verl: unbiased + 1e-6) or
    unbiased + 1e-4 (grpo.py, TRL)"""
    # ALGO LOGIC: EP-GRPO's own flags, at the defaults the method runs with
    pivot_quantile: float = 0.8
    """(b) pivots, (c) 0.8: the pivot threshold is this quantile (in [0, 1]) of the batch's token
    entropies"""
    gate_alpha: float = 1.0
    """(c) alpha >= 0: extra weight of a pivot under the soft gate (0 turns the gate off)"""
    gate_temp: float = 0.1
    """(c) T_g: softness of the soft gate (nats, > 0)"""
    gate_norm: GateNorm = "response"
    """(c) response: the gate over its mean per response (each keeps its advantage mass);
    (a) none"""
    process_polarity: Polarity = "outcome"
    """(a) outcome: P times d = sign(A_out); in all-equal groups +1 if r >= --success-threshold,
    else -1; none: 1"""
    process_coef: float = 0.2
    """(c) lambda >= 0 (the authors' eta): weight of P in groups with mixed rewards (0: off)"""
    process_coef_zero_var: float | None = None
    """(b) lambda_0: weight of P in groups whose rewards are all equal (default: --process-coef)"""
    process_clip: float = 3.0
    """(c) c: P is clipped to [-c, c] (> 0)"""
    process_std_min: float = 1e-3
    """(c) sigma_min: a (group, window) cell whose std is below this (>= 0) gets P = 0"""
    progress: Progress = "entropy"
    """progress coordinate: (a) cumulative entropy share, (c) taken at the token's midpoint
    (C_t - H_t/2) / C_T (the recovered form is S_t / S_T) (entropy), or (c) token share (position)"""
    num_buckets: int = 10
    """(a) the number of progress windows (>= 1; the authors' K)"""


@dataclasses.dataclass(frozen=True)
class EPConfig:
    """The settings ep_advantages reads, by name, at the flags' defaults: the method's own (Args
    repeats them as flags: their --help) and two shared ones. EPConfig.of(args) takes a run's."""

    outcome_std: str = "population"
    scale_rewards: str = "group"
    success_threshold: float = 1.0
    pivot_quantile: float = 0.8
    gate_alpha: float = 1.0
    gate_temp: float = 0.1
    gate_norm: str = "response"
    process_polarity: str = "outcome"
    process_coef: float = 0.2
    process_coef_zero_var: float | None = None
    process_clip: float = 3.0
    process_std_min: float = 1e-3
    progress: str = "entropy"
    num_buckets: int = 10

    @classmethod
    def of(cls, args) -> "EPConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


EPCredit = collections.namedtuple("EPCredit", "advantages parts")  # [B, T], a dict of the pieces


# ALGO LOGIC: EP-GRPO's credit assignment (the authors' Eq. 18-25 as reported second-hand,
# docs/ep_grpo.md, each equation), pure tensor functions: the token advantage first, its parts below
def ep_advantages(entropy, logp_old, logp_ref, mask, rewards, group_size, group_ids=None,
                  cfg: EPConfig = EPConfig(), scores=None, return_parts=False):  # fmt: skip
    """EP-GRPO token advantages A [B, T] = g_hat * (A_out + lambda_g * d * P), 0 at pads.

    entropy: [B, T] rollout entropy (nats); logp_old, logp_ref: [B, T] log-probs of the sampled
    tokens under pi_old and the reference; mask: [B, T]; rewards: [B]; groups: rows sharing
    group_ids (default: blocks of group_size). cfg: what it reads (EPConfig; default: the flags'
    defaults), checked when parsed. scores: d's verifier scores [B] (the rewards before any
    overlong shaping; default: rewards). return_parts: EPCredit(A, the pieces: outcome, gate,
    process, windows, ...). Its ablations' other forms wrap it (rlvr_utils/methods/ep_ablations.py).

    >>> H, zero, on = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.zeros(2, 2), torch.ones(2, 2)
    >>> rewards = torch.tensor([1.0, 0.0])  # one group: A_out = +1, -1; delta = 0, so P = 0
    >>> ep_advantages(H, zero, zero, on, rewards, 2)  # the gate: 1.2 at a pivot, 0.8 elsewhere
    tensor([[ 1.2000,  0.8000],
            [-0.8000, -1.2000]])
    """
    f = cfg
    B, dev, valid, m, H = mask.shape[0], entropy.device, mask.bool(), mask.float(), entropy.float()
    gid = torch.arange(B) // group_size if group_ids is None else group_ids.cpu()
    _, inv = torch.unique(gid, return_inverse=True)
    # A_out: population: (r - mean) / (std_pop + 1e-6); unbiased: grpo.py's
    unbiased = f.outcome_std == "unbiased"
    eps = 1e-4 if unbiased else 1e-6
    r_cpu = rewards.float().cpu()
    a_out = common.group_advantages(r_cpu, group_size, f.scale_rewards, eps, gid, unbiased).to(dev)
    inv, r = inv.to(dev), rewards.float().to(dev)
    n_groups, n_win = int(inv.max()) + 1, f.num_buckets
    zero_var = common.constant_groups(r, inv)[1][inv]  # all-equal-reward groups
    # outcome polarity d: the verifier signs the process credit (all-wrong groups: -1, back toward
    # the reference)
    solved = (r if scores is None else scores.float().to(dev)) >= f.success_threshold  # [B]
    polarity = torch.where(zero_var, torch.where(solved, 1.0, -1.0), torch.sign(a_out))
    polarity = polarity if f.process_polarity == "outcome" else torch.ones_like(r)
    # the entropy gate around the pivot threshold, the rho-quantile of the token entropies [B, 1]
    pivot = row_quantile(H.reshape(1, -1), valid.reshape(1, -1), f.pivot_quantile).repeat(B, 1)
    g_hat = entropy_gate(H, mask, pivot, f.gate_alpha, f.gate_temp, f.gate_norm)
    # process signal P: delta, the implicit-PRM log-ratio per token, z-scored over the group's
    # tokens in each window; an unscored rollout (reward NaN, TRL's None) is not in its group
    b, zero_entropy = progress_windows(H, mask, n_win, f.progress)
    scored = mask * ~r.isnan()[:, None]  # [B, T] the tokens of the scored rollouts
    delta = (logp_old.float() - logp_ref.float()) * scored
    cells = inv[:, None] * n_win + b  # a cell: (group, window)
    cut = (f.process_clip, f.process_std_min)
    P, n_cell, ok = cell_zscore(delta, scored.bool(), cells, n_groups * n_win, *cut)
    lam0 = f.process_coef if f.process_coef_zero_var is None else f.process_coef_zero_var
    lam = torch.where(zero_var, lam0, f.process_coef)[:, None]
    A = g_hat * (a_out[:, None] + lam * polarity[:, None] * P) * m
    if r.isnan().any():  # a completion no reward function scored (TRL's None): advantage 0
        A = A.masked_fill(r.isnan()[:, None], 0.0)
    if not return_parts:
        return A
    parts = dict(outcome=a_out, gate=g_hat, process=P, windows=b, pivot=pivot, zero_var=zero_var)
    cell_members, cell_ok = (
        n_cell.view(n_groups, n_win),
        ok.view(n_groups, n_win),
    )  # per cell, not row
    parts |= dict(
        group_index=inv, zero_entropy=zero_entropy, cell_members=cell_members, cell_ok=cell_ok
    )
    parts |= dict(polarity=polarity, delta=delta, above_threshold=solved, coef=lam)
    return EPCredit(A, parts)


def entropy_gate(entropy, mask, pivot, alpha=1.0, temp=0.1, norm="response"):
    """Token weights g_hat [B, T] = g / (g's mean over the response),
    g = 1 + alpha * sigmoid((H - pivot) / temp): each response keeps its mean weight 1 (all ~0: 1),
    pads get 0. entropy: [B, T], pivot (a scalar or [B, 1]): nats. The other gates: ablations."""
    return mean_one(1 + alpha * torch.sigmoid((entropy.float() - pivot) / temp), mask, norm)


def mean_one(g, mask, norm="response", eps=1e-6):
    """Token weights g [B, T] over their mean per response (norm response; none: as they are),
    0 at pads; a response whose weights are all ~0 gets 1 on its tokens."""
    m = mask.float()
    g = g * m
    mean = g.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    return g if norm == "none" else torch.where(mean > eps, g / mean.clamp(min=eps), m)


def progress_windows(entropy, mask, num_buckets=10, progress="entropy", eps=1e-6):
    """Window b = min(n - 1, floor(n * u)) [B, T] of each token (n = num_buckets; pads: 0),
    u = (C_t - H_t/2) / C_T (ours: the authors' coordinate S_t / S_T taken at the token's
    midpoint), C the cumulative entropy [B, T] (nats); zero_entropy [B]: C_T <= eps, where (as with
    --progress position) u = (t - 1/2) / T."""
    m, H = mask.float(), entropy.float().clamp(min=0) * mask.float()
    pos = (m.cumsum(1) - 0.5) / m.sum(1, keepdim=True).clamp(min=1)
    C = H.cumsum(1)
    total = C[:, -1:]
    u = torch.where(total > eps, (C - 0.5 * H) / total.clamp(min=eps), pos)
    u = u if progress == "entropy" else pos
    b = (u * num_buckets).floor().long().clamp(0, num_buckets - 1) * mask.long()
    return b, total.squeeze(1) <= eps


def cell_zscore(x, valid, cell, num_cells, clip=3.0, std_min=1e-3):
    """The process signal's normalization: z = (x - mean_cell) / std_cell within cells (population
    std), clipped to [-clip, clip]. x, valid, cell: same shape (cell: long ids < num_cells, a cell
    is a (group, window) pair). Entries that are not valid, or whose cell has fewer than 2 members
    or a std below std_min, get 0. Returns (z like x, members per cell [num_cells], ok
    [num_cells])."""
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


def row_quantile(x: torch.Tensor, valid: torch.Tensor, q: float) -> torch.Tensor:
    """The gate's pivot threshold: the q-quantile (linear interpolation, as torch.quantile) of each
    row's valid entries; x, valid: [R, L] -> [R]. Rows without valid entries give 0. Sort-based, so
    it has no size limit."""
    s = x.float().masked_fill(~valid, float("inf")).sort(dim=1).values  # valid first, ascending
    n = valid.sum(1)
    pos = q * (n - 1).clamp(min=0).float()  # the quantile's fractional rank
    lo, hi = pos.floor().long()[:, None], pos.ceil().long()[:, None]
    val = s.gather(1, lo) + (pos[:, None] - lo) * (s.gather(1, hi) - s.gather(1, lo))
    return torch.where(n > 0, val.squeeze(1), torch.zeros_like(pos))


def validate(a: Args) -> Args:
    """EP-GRPO's own checks (cli.parse runs the shared ones, tyro the choices): one line naming the
    flag and what is allowed, exit 2."""
    ranges = dict(num_buckets=">= 1", gate_temp="> 0", pivot_quantile="[0, 1]")
    ranges |= dict(process_clip="> 0", process_std_min=">= 0", gate_alpha=">= 0")
    cli.need_ranges(a, **ranges, process_coef=">= 0", process_coef_zero_var=">= 0")
    return a


if __name__ == "__main__":
    # TRY NOT TO MODIFY: flags, torchrun, seeding; the task, the model, its reference, the optimizer
    args = cli.parse(Args, validate, "ep_ablations")  # tyro.cli(Args), every check before loading
    run = common.Run(args)
    tokenizer = common.load_tokenizer(args.model)
    task = common.load_task(args, tokenizer)  # before the model: an empty task stops at once
    model = common.load_model(args.model, run.device, run.dtype, args.gradient_checkpointing)
    model = common.with_lora(model, args)  # --lora-rank: LoRA adapters train, the base is frozen
    ablation = args.ablation_module  # its flags given: methods/ep_ablations.py (docs/ep_grpo.md)
    anchor = ablation.moving_anchor(args, model) if ablation else None  # ablation: a moving anchor
    need_ref = anchor is None or args.beta > 0  # ALGO LOGIC: delta needs it
    ref_model = common.reference(model, args) if need_ref else None  # LoRA: adapters off
    train_model = run.dist.wrap(model, ref_model)  # DDP / FSDP2; bf16: fp32 masters (precision.py)
    anchor = ref_model if anchor is None else anchor  # ALGO LOGIC: delta = log pi_old - log pi_ref
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = common.adamw(params, args)  # mixed precision: it steps the fp32 masters
    run.start(
        model, tokenizer, optimizer, task, state={} if anchor is ref_model else {"anchor": anchor}
    )
    dist = run.dist
    G = args.num_generations
    cfg = EPConfig.of(args)  # ALGO LOGIC: what ep_advantages reads; ablations: their forms wrap it
    credit = ep_advantages if ablation is None else ablation.wrap(args, globals())  # by name

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

        # 4. ALGO LOGIC, before step 3, which needs them (even on-policy): log pi_old, the entropy
        #    old_H, log pi_anchor
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad(), dist.gathered_if_uneven(model, ref_model):  # FSDP, uneven rows
            batch = (input_ids, attn, T, args.temperature)
            old_logp, old_H = common.token_logprobs(model, *batch, with_entropy=True)
            ref_logp = None
            if ref_model is not None:
                ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0]
            anchor_logp = ref_logp
            if anchor is not ref_model:  # --process-anchor ema / lagged: its own pass
                anchor_logp = common.token_logprobs(anchor, *batch)[0]
        run.lap("logprobs")

        # 3. ALGO LOGIC: credit assignment, per token [N, T]: A = gate * (A_out + lambda * d * P).
        #    d's success is the verifier's (the rewards may be shaped by --overlong-buffer);
        #    torchrun: over the global batch (the pivot is the batch's entropy quantile)
        gid, scores = ro.group_ids, ro.scores
        token_adv, parts = dist.over_global_batch(
            credit,
            old_H,
            old_logp,
            anchor_logp,
            mask,
            rewards,
            G,
            gid,
            cfg,
            scores,
            return_parts=True,
        )
        parts["group_index"] = torch.unique(gid.cpu(), return_inverse=True)[1].to(token_adv.device)
        ep_stats = ep_diagnostics.ep_metrics(
            token_adv, parts, old_H, mask
        )  # LOGS: the ep/* metrics
        signals = dict(outcome=parts["outcome"], gate=parts["gate"], P=parts["process"])
        run.credit_signals(**signals, window=parts["windows"])  # LOGS: --log-credit's signals
        run.lap("advantages")

        # 5. update: mu passes; each splits the batch into mini-batches of whole prompts, one
        #    optimizer step each, in micro-batches (the loss is normalized over the mini-batch)
        stats = common.UpdateStats(mask, args.num_iterations)
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
                    # ALGO LOGIC: PPO-clipped surrogate of the per-token advantage
                    log_ratio = (logp - old).clamp(-common.MAX_LOG_RATIO, common.MAX_LOG_RATIO)
                    ratio = torch.exp(log_ratio)
                    A = token_adv[mb]
                    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)
                    surrogate = torch.min(ratio * A, clipped * A)
                    per_token_loss = -surrogate
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
        if anchor is not ref_model:  # ablation: a moving anchor follows the policy
            ablation.follow_policy(anchor, model, step, args)

        # 6. TRY NOT TO MODIFY: metrics, evaluation, logging, checkpoint, Ctrl-C
        run.end_step(step, ro, rewards, stats, sampling | ep_stats)

    run.finish()

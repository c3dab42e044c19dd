"""EP-GRPO: entropy-progress aligned GRPO with implicit process guidance (a RECONSTRUCTION).

Every token gets its own advantage A = gate * (A_out + lambda * d * P): GRPO's advantage A_out plus an implicit process
signal P (delta = log pi_old - log pi_ref per token, z-scored over the group's tokens in the same progress window, the
windows holding equal shares of a response's cumulative entropy), signed by the outcome polarity d (sign(A_out), or
sign(r - 0.5) in a group whose rewards are all equal: such groups still train), times an entropy gate that gives
high-entropy "decision pivots" more of the advantage. The paper's full text and code were not reachable: each flag
names its source as docs/ep_grpo.md does: (a) the authors' formula as reported second-hand, (b) the abstract, (c) ours.
Paper: Yu, Li, Zhao, Yang 2026, EP-GRPO (arXiv 2605.04960). Docs: docs/ep_grpo.md.

Differences from grpo.py:
  1. a per-token advantage (ep_advantages, step 3) built from a no-grad pass of the policy (log pi_old and the rollout
     entropy) that runs even on-policy, and from the reference, loaded even at --beta 0 (delta needs it), or a moving
     anchor (--process-anchor ema / lagged: its own copy, updated after every step, held in the checkpoint);
  2. defaults: --beta 1e-3, --loss-agg token-mean, --outcome-std population (std + 1e-6; grpo.py: unbiased + 1e-4);
  3. the ep/* diagnostics (rlvr_utils/ep_diagnostics.py) and time/advantages are logged.
With --gate-alpha 0 --process-coef 0 --outcome-std unbiased it is grpo.py --beta 0.001 --loss-agg token-mean.

    python ep_grpo.py                                           # bundled tiny model, built-in task, CPU
"""

import copy
import dataclasses
import inspect
import typing
from typing import Literal

import torch

import common
from rlvr_utils import cli, engines, ep_diagnostics


@dataclasses.dataclass
class Args(cli.BaseArgs):
    """EP-GRPO (arXiv 2605.04960), RECONSTRUCTED: each flag says whether it is (a) the authors' formula as reported
    second-hand, (b) the abstract's words or (c) this project's choice (docs/ep_grpo.md, the defaults table)."""

    # ALGO LOGIC: the shared defaults EP-GRPO changes (c): as verl's GRPO, a small KL (the reference is there for delta)
    beta: float = 1e-3
    """(c) k3 KL coefficient to the frozen initial policy (grpo.py: 0; with --process-anchor ref it is loaded at 0)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """(c) token-mean (DAPO), seq-mean-token-mean (original GRPO; grpo.py's), seq-mean-token-sum-norm (Dr. GRPO)"""
    outcome_std: Literal["population", "unbiased"] = "population"
    """(c) std of the outcome advantage: population + 1e-6 (verl-style) or unbiased + 1e-4 (grpo.py, TRL)"""

    # ALGO LOGIC: EP-GRPO's own flags; every one but the anchor's reaches ep_advantages under its own name
    gate: Literal["soft", "hard", "gtpo", "zsig", "none"] = "soft"
    """(c) soft, (a) zsig. Entropy gate: soft 1+alpha*sigmoid((H-tau)/gate-temp), hard 1[H>tau] (80/20 mask), gtpo H,
    none 1, or zsig sigmoid(gate-gamma * z-score of H over the --pivot-scope pool): the authors' form, with
    --pivot-scope group --gate-norm none their W in (0, 1)"""
    gate_gamma: float = 1.0
    """(c) gamma of --gate zsig (the authors' value is not known)"""
    pivot_quantile: float = 0.8
    """(b) pivots, (c) 0.8. rho: the pivot threshold tau is this quantile of the token entropies (top 20% pivots)"""
    pivot_scope: Literal["batch", "group", "response"] = "batch"
    """(c) batch, (a) group (the authors' z-score). Over which tokens the pivot quantile (or zsig's z-score) is taken"""
    gate_alpha: float = 1.0
    """(c) alpha: extra weight of a pivot under the soft gate (0 turns the gate off)"""
    gate_temp: float = 0.1
    """(c) T_g: softness of the soft gate (nats)"""
    gate_norm: Literal["response", "none"] = "response"
    """(c) response: divide the gate by its mean over each response (each keeps its advantage mass); (a) none"""
    process_anchor: Literal["ref", "ema", "lagged"] = "ref"
    """delta = log pi_old - log pi_anchor against: (a) ref, the frozen initial policy; (c) ema or lagged (ablations)"""
    anchor_ema_decay: float = 0.99
    """(c) --process-anchor ema: anchor <- decay * anchor + (1 - decay) * policy after every step"""
    anchor_lag: int = 10
    """(c) --process-anchor lagged: the anchor is reset to the policy every this many steps"""
    process_granularity: Literal["window", "token", "cumulative"] = "token"
    """(a) token. What is z-scored per (group, window): single tokens' delta over the group's tokens in the window (the
    authors' form), window sums of delta across the group's responses, or prefix sums up to the window"""
    process_polarity: Literal["outcome", "none"] = "outcome"
    """(a) outcome: P is multiplied by d_i = sign(A_out) in mixed groups and sign(r_i - reward-threshold) in all-equal
    groups (the authors' outcome anchoring): drift is reinforced only where the verifier agrees, and an all-wrong group
    pulls its tokens back to the reference. none: no sign (the first reconstruction; it collapses, docs/ep_grpo.md)"""
    reward_threshold: float = 0.5
    """(c) theta_reward: an all-equal group's polarity is sign(r - this) (0.5: all-correct +1, all-wrong -1)"""
    anchor_form: Literal["additive", "multiplicative"] = "additive"
    """(a) additive gate*(A_out + lambda*P); multiplicative gate*A_out*(1 + lambda*tanh(sign(A_out)*P)), 0 at A_out 0"""
    process_coef: float = 0.2
    """(c) lambda (the authors' eta): weight of the process signal P in groups with mixed rewards (0 turns it off); 0.2
    is the value of a public reimplementation of the authors' earlier ERPO, the paper's own is not known"""
    process_coef_zero_var: float | None = None
    """(b) lambda_0: weight of P in groups whose rewards are all equal (default: --process-coef); with
    --process-polarity none, set it to 0: there unsigned P is the only gradient and runs away (docs/ep_grpo.md)"""
    process_clip: float = 3.0
    """(c) c: P is clipped to [-c, c]"""
    process_std_min: float = 1e-3
    """(c) sigma_min: a (group, window) whose std is below this gets P = 0 (e.g. step 1, when pi_old = pi_ref)"""
    progress: Literal["entropy", "position"] = "entropy"
    """(a) progress coordinate: cumulative entropy share (position when a response's entropy is ~0), or token share"""
    num_buckets: int = 10
    """(a) K: number of progress windows"""
    advantage_form: Literal["A", "B"] = "A"
    """(a) A: the form above; B (ablation): gate * the group's per-window token z-score of r + beta*cumsum(delta)"""
    implicit_beta: float = 0.05
    """(c) beta of the implicit reward in --advantage-form B (form A: no effect, the z-score cancels it)"""


# ALGO LOGIC: EP-GRPO's credit assignment, as pure tensor functions (docs/ep_grpo.md has each equation).
CHOICES = {f.name: typing.get_args(f.type) for f in dataclasses.fields(Args) if typing.get_origin(f.type) is Literal}


def row_quantile(x: torch.Tensor, valid: torch.Tensor, q: float) -> torch.Tensor:
    """q-quantile (linear interpolation, as torch.quantile) of each row's valid entries; x, valid: [R, L] -> [R].
    Rows without valid entries give 0. Sort-based, so it has no size limit."""
    s = x.float().masked_fill(~valid, float("inf")).sort(dim=1).values
    n = valid.sum(1)
    pos = q * (n - 1).clamp(min=0).float()
    lo, hi = pos.floor().long()[:, None], pos.ceil().long()[:, None]
    val = s.gather(1, lo) + (pos[:, None] - lo) * (s.gather(1, hi) - s.gather(1, lo))
    return torch.where(n > 0, val.squeeze(1), torch.zeros_like(pos))


def entropy_gate(entropy, mask, tau, gate="soft", alpha=1.0, temp=0.1, norm="response", eps=1e-6) -> torch.Tensor:
    """Token weights g_hat [B, T] from the rollout entropy (the entropy gate; the authors' Eq. 18-19 is zsig).

    entropy: [B, T] nats; mask: [B, T] completion mask; tau: pivot threshold, a scalar or [B, 1] (nats).
    soft: 1 + alpha*sigmoid((H - tau)/temp); hard: 1[H > tau]; gtpo: H; none: 1; zsig: sigmoid((H - tau)/temp) with
    tau the pool's mean entropy and temp its std / gamma (a tensor [B, 1]), the authors' W = sigmoid(gamma * z(H)),
    which ep_advantages passes. With norm "response" the weights are divided by their mean over the response's tokens,
    so each response's mean weight is 1 (a response whose weights are all ~0 keeps weight 1). Padded positions are 0.
    """
    m, H = mask.float(), entropy.float()
    if gate == "soft":
        if temp <= 0:
            raise ValueError(f"gate temperature must be > 0, got {temp}")
        g = 1 + alpha * torch.sigmoid((H - tau) / temp)
    elif gate == "zsig":
        g = torch.sigmoid((H - tau) / temp)
    else:  # hard: the 80/20 mask; gtpo: the entropy itself; none: 1
        g = {"hard": (H > tau).float(), "gtpo": H.clamp(min=0), "none": torch.ones_like(H)}[gate]
    g = g * m
    if norm == "none":
        return g
    mean = g.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    return torch.where(mean > eps, g / mean.clamp(min=eps), m)


def progress_windows(entropy, mask, num_buckets=10, progress="entropy", eps=1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Progress window b(i,t) in {0..K-1} of every token (cumulative-entropy progress, the authors' Eq. 20-25 as
    reported); returns (b [B, T] long, zero_entropy [B] bool).

    entropy: [B, T] nats; mask: [B, T]. Progress u = (C_t - H_t/2) / C_T with C the cumulative entropy, so each
    window holds 1/K of the response's entropy; a response whose total entropy is <= eps (zero_entropy) and
    --progress position use the token-index share (t - 1/2)/T instead. b = min(K-1, floor(K*u)); pads get 0.
    """
    m = mask.float()
    H = entropy.float().clamp(min=0) * m
    pos = (m.cumsum(1) - 0.5) / m.sum(1, keepdim=True).clamp(min=1)
    C = H.cumsum(1)
    total = C[:, -1:]
    u = torch.where(total > eps, (C - 0.5 * H) / total.clamp(min=eps), pos) if progress == "entropy" else pos
    b = (u * num_buckets).floor().long().clamp(0, num_buckets - 1) * mask.long()
    return b, total.squeeze(1) <= eps


def cell_zscore(x, valid, cell, num_cells, clip=3.0, std_min=1e-3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z-score of x within cells (population std), clipped to [-clip, clip] (the process signal's normalization).

    x, valid, cell: same shape (cell: long ids < num_cells). Entries that are not valid, or whose cell has fewer
    than 2 members or a std below std_min, get 0. Returns (z like x, members per cell [num_cells], ok [num_cells]).
    """
    v = valid.float()
    c, xv = cell.reshape(-1), (x.float() * v).reshape(-1)
    zeros = torch.zeros(num_cells, device=x.device)
    n = zeros.index_add(0, c, v.reshape(-1))
    mean = zeros.index_add(0, c, xv) / n.clamp(min=1)
    dev = (x.float() - mean[cell]) * v
    std = (zeros.index_add(0, c, (dev**2).reshape(-1)) / n.clamp(min=1)).sqrt()
    ok = (n >= 2) & (std > 0) & (std >= std_min)
    z = (dev / torch.where(ok, std, torch.ones_like(std))[cell]).clamp(-clip, clip)
    return torch.where(ok[cell] & valid, z, torch.zeros_like(z)), n, ok


def ep_advantages(
    entropy,
    logp_old,
    logp_ref,
    mask,
    rewards,
    group_size,
    group_ids=None,
    *,
    scale_rewards="group",
    outcome_std="population",
    gate="soft",
    pivot_quantile=0.8,
    pivot_scope="batch",
    gate_alpha=1.0,
    gate_temp=0.1,
    gate_norm="response",
    gate_gamma=1.0,
    process_granularity="token",
    process_polarity="outcome",
    reward_threshold=0.5,
    anchor_form="additive",
    process_coef=0.2,
    process_coef_zero_var=None,
    process_clip=3.0,
    process_std_min=1e-3,
    progress="entropy",
    num_buckets=10,
    advantage_form="A",
    implicit_beta=0.05,
    return_parts=False,
):
    """EP-GRPO token advantages A [B, T] = g_hat * (A_out + lambda_g * d * P) (0 at padded positions).

    The authors' Eq. 18-25 as reported second-hand (docs/ep_grpo.md, "The equations, next to the code"). d [B] is the
    outcome polarity (process_polarity "outcome"): sign(A_out) in mixed groups, sign(r - reward_threshold) in all-equal
    groups; 1 with "none". In an all-equal group d is one sign and P sums to 0 over each (group, window) cell, so the
    process credit there is zero-sum per window and bounded by lambda_0 * process_clip * max gate.

    entropy: [B, T] rollout-policy entropy (nats); logp_old, logp_ref: [B, T] log-probs of the sampled tokens under
    pi_old and the anchor (the reference by default; nats); mask: [B, T]; rewards: [B]; groups: rows sharing group_ids
    (the prompt id; default consecutive blocks of group_size). A_out is GRPO's advantage (common.group_advantages, 0
    in all-equal groups) with population std + 1e-6 (outcome_std "unbiased": grpo.py's unbiased + 1e-4); lambda_g is
    process_coef_zero_var (default process_coef) in all-equal groups. The keyword flags are the script's (see Args).
    Pure: no state, no gradient needed. return_parts: also return a dict of the pieces (outcome [B], gate, process P,
    windows [B, T], ...) for rlvr_utils/ep_diagnostics.ep_metrics.
    """
    flags = locals()  # every choice flag is one of its Literal's values in Args
    for name in [k for k in CHOICES if k in flags and flags[k] not in CHOICES[k]]:
        raise ValueError(f"{name}={flags[name]!r}: choose one of {CHOICES[name]}")
    if num_buckets < 1 or not 0 <= pivot_quantile <= 1:
        raise ValueError(
            f"need num_buckets >= 1 (got {num_buckets}) and pivot_quantile in [0, 1] (got {pivot_quantile})"
        )
    B, T = mask.shape
    dev, valid, m = entropy.device, mask.bool(), mask.float()
    gid = torch.arange(B) // group_size if group_ids is None else group_ids.cpu()
    _, inv = torch.unique(gid, return_inverse=True)
    unbiased = outcome_std == "unbiased"  # population: (r - mean) / (std_pop + 1e-6); unbiased: grpo.py's
    a_out = common.group_advantages(
        rewards.float().cpu(), group_size, scale_rewards, 1e-4 if unbiased else 1e-6, group_ids=gid, unbiased=unbiased
    ).to(dev)
    inv, r, n_groups, K = inv.to(dev), rewards.float().to(dev), int(inv.max()) + 1, num_buckets
    zero_var = common.constant_groups(r, inv)[1][inv]  # all-equal-reward groups
    # outcome polarity d: the verifier decides the direction of the process credit; all-wrong groups get -1, so there
    # the credit pulls drifted tokens back towards the reference instead of rewarding the drift
    polarity = torch.where(zero_var, torch.sign(r - reward_threshold), torch.sign(a_out))
    polarity = polarity if process_polarity == "outcome" else torch.ones_like(r)
    # entropy gate around the rho-quantile of the batch's (group's, response's) token entropies
    H = entropy.float()
    pools_of = {"batch": torch.zeros_like(inv), "group": inv, "response": torch.arange(B, device=dev)}
    owner = pools_of[pivot_scope]  # which pool each row's threshold comes from
    order = torch.argsort(owner, stable=True)
    pools = int(owner.max()) + 1
    tau = row_quantile(H[order].reshape(pools, -1), valid[order].reshape(pools, -1), pivot_quantile)[owner][:, None]
    temp = gate_temp
    if gate == "zsig":  # W = sigmoid(gamma * (H - mean) / std), mean and population std over the pool's tokens
        n = torch.zeros(pools, device=dev).index_add(0, owner, m.sum(1)).clamp(min=1)
        tau = (torch.zeros(pools, device=dev).index_add(0, owner, (H * m).sum(1)) / n)[owner][:, None]
        var = torch.zeros(pools, device=dev).index_add(0, owner, (((H - tau) * m) ** 2).sum(1)) / n
        temp = (var.sqrt()[owner][:, None] / gate_gamma).clamp(min=1e-6)
    g_hat = entropy_gate(H, mask, tau, gate, gate_alpha, temp, gate_norm)
    # cumulative-entropy progress windows; cells are (group, window) pairs
    b, zero_entropy = progress_windows(H, mask, K, progress)
    delta = (logp_old.float() - logp_ref.float()) * m  # implicit process signal: the implicit-PRM log-ratio per token
    if advantage_form == "B":  # SPRO-style: dense reward r + beta*cumulative delta, z-scored over tokens per cell
        R = r[:, None] + implicit_beta * delta.cumsum(1)
        P, n_cell, ok = cell_zscore(R, valid, inv[:, None] * K + b, n_groups * K, process_clip, process_std_min)
        A = g_hat * P
    else:
        if process_granularity == "token":
            P, n_cell, ok = cell_zscore(delta, valid, inv[:, None] * K + b, n_groups * K, process_clip, process_std_min)
        else:  # window form: S[i, k] = sum of delta over window k, z-scored across the group's responses in window k
            S = torch.zeros(B, K, device=dev).scatter_add_(1, b, delta)
            present = torch.zeros(B, K, device=dev).scatter_add_(1, b, m) > 0
            if process_granularity == "cumulative":
                S, present = S.cumsum(1), valid.any(1, keepdim=True).expand(-1, K)
            cells = inv[:, None] * K + torch.arange(K, device=dev)
            P_win, n_cell, ok = cell_zscore(S, present, cells, n_groups * K, process_clip, process_std_min)
            P = P_win.gather(1, b) * m
        lam0 = process_coef if process_coef_zero_var is None else process_coef_zero_var
        lam = torch.where(zero_var, lam0, process_coef)[:, None]
        if anchor_form == "additive":  # (the multiplicative form carries its own sign: sign(A_out) inside the tanh)
            A = g_hat * (a_out[:, None] + lam * polarity[:, None] * P)
        else:
            A = g_hat * a_out[:, None] * (1 + lam * torch.tanh(torch.sign(a_out)[:, None] * P))
    A = A * m
    if not return_parts:
        return A
    parts = dict(outcome=a_out, gate=g_hat, process=P, windows=b, tau=tau, zero_var=zero_var, group_index=inv)
    parts.update(zero_entropy=zero_entropy, cell_members=n_cell, cell_ok=ok, polarity=polarity, delta=delta)
    return A, dict(parts, above_threshold=r > reward_threshold)


def validate(args: Args) -> Args:
    """EP-GRPO's own flag checks (cli.parse runs the shared ones): one line naming the flag, exit code 2."""
    cli.need(args.anchor_lag >= 1, f"--anchor-lag must be >= 1, got {args.anchor_lag}")
    cli.need(0 <= args.anchor_ema_decay <= 1, f"--anchor-ema-decay must be in [0, 1], got {args.anchor_ema_decay}")
    cli.need(args.num_buckets >= 1, f"--num-buckets must be >= 1, got {args.num_buckets}")
    cli.need(0 <= args.pivot_quantile <= 1, f"--pivot-quantile must be in [0, 1], got {args.pivot_quantile}")
    cli.need(args.gate_gamma > 0, f"--gate-gamma must be > 0, got {args.gate_gamma}")
    cli.need(args.gate_temp > 0, f"--gate-temp must be > 0, got {args.gate_temp}")
    cli.need(args.process_clip > 0, f"--process-clip must be > 0, got {args.process_clip}")
    cli.need(args.process_std_min >= 0, f"--process-std-min must be >= 0, got {args.process_std_min}")
    return args


if __name__ == "__main__":
    # TRY NOT TO MODIFY: flags, run directory, torchrun, seeding; the model, reference, task and optimizer
    args = cli.parse(Args, validate)  # tyro.cli(Args), every check before anything loads (one-line errors)
    run = common.Run(args)
    model, tokenizer = common.load_policy(args.model, run.device, args.dtype, args.gradient_checkpointing)
    # ALGO LOGIC: the reference is loaded even at --beta 0: delta = log pi_old - log pi_ref needs it. A moving anchor
    # (--process-anchor ema / lagged) is its own copy, held in the checkpoint; then the reference serves only the KL.
    need_ref = args.process_anchor == "ref" or args.beta > 0
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if need_ref else None
    train_model = run.dist.wrap(model, ref_model)  # DDP / FSDP2 under torchrun; the model itself otherwise
    anchor = ref_model if args.process_anchor == "ref" else copy.deepcopy(model).eval().requires_grad_(False)
    task = common.load_task(args, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    run.start(model, tokenizer, optimizer, task, state={} if anchor is ref_model else {"anchor": anchor})
    dist, G = run.dist, args.num_generations
    # ALGO LOGIC: every EP-GRPO flag goes to ep_advantages under its own name (--gate -> gate=..., and so on)
    ep_flags = {k: getattr(args, k) for k in inspect.signature(ep_advantages).parameters if hasattr(args, k)}

    for step in run.steps():
        # 1-2. rollouts: G completions per prompt, and one reward per completion (the verifier sees the decoded text);
        #      DAPO's dynamic sampling and overlong penalty when asked
        ro, rewards, sampling = common.rollouts_with_rewards(model, tokenizer, task, run.batches, dist, args)
        mask = ro.completion_mask * ~ro.truncated[:, None] if args.mask_truncated_completions else ro.completion_mask
        T = mask.shape[1]
        run.lap("generation")

        # 4. ALGO LOGIC, before step 3, which needs them (so even on-policy): old log-probs and the rollout entropy
        #    old_H (nats; one no-grad pass, both from the same logits; [N, T] each), the reference's and the anchor's.
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad():
            old_logp, old_H = common.token_logprobs(model, input_ids, attn, T, args.temperature, with_entropy=True)
            ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0] if ref_model else None
            anchor_logp = ref_logp
            if anchor is not ref_model:  # --process-anchor ema / lagged
                anchor_logp = common.token_logprobs(anchor, input_ids, attn, T, args.temperature)[0]
        run.lap("logprobs")

        # 3. ALGO LOGIC: credit assignment, per token: A = gate * (GRPO advantage + lambda * d * P), and its diagnostics
        token_adv, parts = ep_advantages(
            old_H, old_logp, anchor_logp, mask, rewards, G, ro.group_ids, **ep_flags, return_parts=True
        )  # [N, T]
        ep_stats = ep_diagnostics.ep_metrics(token_adv, parts, old_H, mask)  # the ep/* metrics
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
                    dist.sync_grads(train_model, k == len(micro) - 1)  # all-reduce once per optimizer step
                    m = mask[mb].float()
                    logp, entropy = common.token_logprobs(
                        train_model, input_ids[mb], attn[mb], T, args.temperature, with_entropy=it == 0
                    )
                    old = old_logp[mb]
                    # ALGO LOGIC: PPO-clipped surrogate of the per-token advantage
                    log_ratio = torch.clamp(logp - old, -common.MAX_LOG_RATIO, common.MAX_LOG_RATIO)  # fp32, as verl
                    ratio = torch.exp(log_ratio)
                    A = token_adv[mb]
                    surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high) * A)
                    per_token_loss = -surrogate
                    # vLLM rollouts: truncated importance sampling toward the engine's distribution (1 with HF)
                    per_token_loss = per_token_loss * engines.engine_correction(
                        ro, mb, old, m, args.vllm_is_cap, stats.engine(it), stats.tokens
                    )
                    kl = common.k3_kl(logp, ref_logp[mb]) if ref_logp is not None else None  # KL(pi || pi_ref), k3
                    if kl is not None:
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = common.aggregate_loss(
                        per_token_loss, m, args.loss_agg, args.max_new_tokens, num_tokens, num_seqs
                    )
                    run.stop_if_nonfinite(loss, "loss")
                    loss.backward()
                    stats.add(m, ratio, A, args.epsilon, args.epsilon_high, entropy, kl, loss)  # diagnostics
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                run.stop_if_nonfinite(grad_norm, "gradient norm")
                optimizer.step()
                stats.step(grad_norm)
        run.lap("update")
        # ALGO LOGIC: a moving process anchor follows the policy (--process-anchor ema / lagged; not timed, as before)
        if args.process_anchor == "ema":
            with torch.no_grad():
                for p_anchor, p in zip(anchor.parameters(), model.parameters()):
                    p_anchor.lerp_(p, 1 - args.anchor_ema_decay)
        elif args.process_anchor == "lagged" and step % args.anchor_lag == 0:
            anchor.load_state_dict(model.state_dict())

        # 6. TRY NOT TO MODIFY: metrics, evaluation, logging, checkpoint, Ctrl-C (with EP-GRPO's ep/* metrics)
        run.end_step(step, ro, rewards, stats, {**sampling, **ep_stats})

    run.finish()

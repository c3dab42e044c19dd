"""EP-GRPO: entropy-progress aligned GRPO with implicit process guidance (a RECONSTRUCTION).

1. Entropy gate: each token's weight grows with its rollout entropy (soft step at the batch's 80% quantile),
   normalized so every response's mean weight is 1: high-entropy "decision pivots" get more of the advantage.
2. Implicit process signal: delta = log pi_old - log pi_ref per token (the implicit-PRM log-ratio), z-scored over
   the group's tokens in the same progress window (P).
3. Progress windows: K windows holding equal shares of a response's cumulative entropy, so responses are compared
   at the same progress.
4. Outcome polarity d: sign(A_out) in mixed groups, sign(r - 0.5) in all-equal groups (all-wrong -1, all-correct +1).
5. A = gate * (GRPO advantage + lambda * d * P): groups whose rewards are all equal still get a gradient, signed by
   the verifier; PPO-clipped surrogate, token-mean, k3 KL to the frozen reference.
RECONSTRUCTION: the paper's full text and code were not reachable. Items 2-4 follow the authors' formulas as
secondary sources that had the text report them; the gate form, lambda, the clip and the loss are this project's
choices, each a flag below. docs/ep_grpo.md marks which is which.
Paper: Yu, Li, Zhao, Yang 2026, EP-GRPO (arXiv 2605.04960). Docs: docs/ep_grpo.md.
Differences from grpo.py at the defaults: token advantages (above), --beta 1e-3, token-mean, population std + 1e-6
for A_out (grpo.py: unbiased + 1e-4), and the reference model is always loaded (delta needs it).

    python ep_grpo.py                                           # bundled tiny model, built-in task, CPU
    python ep_grpo.py --gate-alpha 0 --process-coef 0 --outcome-std unbiased  # = grpo.py --beta 0.001 --loss-agg token-mean
"""

import copy
import dataclasses
import inspect
import math
import time
import typing
from pathlib import Path
from typing import Literal

import torch
from tqdm import trange

import common
from rlvr_utils import checkpoints, cli, distributed, engines, tasks


@dataclasses.dataclass
class Args:
    """EP-GRPO (arXiv 2605.04960), RECONSTRUCTED: docs/ep_grpo.md says which flag follows the authors' text and which is a guess."""

    exp_name: str = "ep_grpo"
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
    # ALGO LOGIC: EP-GRPO's loss defaults (guessed, verl's GRPO): k3 KL 1e-3, token-mean
    beta: float = 1e-3
    """k3 KL coefficient to the frozen initial policy (with --process-anchor ref the reference is loaded even at 0: delta needs it)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """token-mean (DAPO), seq-mean-token-mean (original GRPO), seq-mean-token-sum-norm (Dr. GRPO)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantage scaling: group std (GRPO), batch std (Lite PPO) or none (Dr. GRPO)"""
    outcome_std: Literal["population", "unbiased"] = "population"
    """std of the outcome advantage: population + 1e-6 (verl-style) or unbiased + 1e-4 (grpo.py, TRL)"""
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

    # ALGO LOGIC: EP-GRPO. docs/ep_grpo.md marks each field below: (a) the authors' text as reported second-hand,
    # (b) the abstract, or (c) this project's choice.
    gate: Literal["soft", "hard", "gtpo", "zsig", "none"] = "soft"
    """entropy gate: soft 1+alpha*sigmoid((H-tau)/gate-temp), hard 1[H>tau] (80/20 mask), gtpo H itself, none 1, or
    zsig sigmoid(gate-gamma * z-score of H over the --pivot-scope pool) (the authors' form, reported second-hand; with
    --pivot-scope group --gate-norm none it is their W in (0, 1); docs/ep_grpo.md)"""
    gate_gamma: float = 1.0
    """gamma of --gate zsig (the authors' value is not known; 1.0 is this project's choice)"""
    pivot_quantile: float = 0.8
    """rho: the pivot threshold tau is this quantile of the token entropies (0.8: the top 20% are pivots)"""
    pivot_scope: Literal["batch", "group", "response"] = "batch"
    """over which tokens the pivot quantile is taken"""
    gate_alpha: float = 1.0
    """alpha: extra weight of a pivot under the soft gate (0 turns the gate off)"""
    gate_temp: float = 0.1
    """T_g: softness of the soft gate (nats)"""
    gate_norm: Literal["response", "none"] = "response"
    """response: divide the gate by its mean over each response (each response keeps its advantage mass); none"""
    process_anchor: Literal["ref", "ema", "lagged"] = "ref"
    """delta = log pi_old - log pi_anchor against: ref (frozen initial policy), ema or lagged (copies that follow the policy)"""
    anchor_ema_decay: float = 0.99
    """--process-anchor ema: anchor <- decay * anchor + (1 - decay) * policy after every step"""
    anchor_lag: int = 10
    """--process-anchor lagged: the anchor is reset to the policy every this many steps"""
    process_granularity: Literal["window", "token", "cumulative"] = "token"
    """what is z-scored per (group, window): single tokens' delta over the group's tokens in the window (the authors'
    form, reported second-hand), window sums of delta across the group's responses, or prefix sums up to the window"""
    process_polarity: Literal["outcome", "none"] = "outcome"
    """outcome: P is multiplied by d_i = sign(A_out) in mixed groups and sign(r_i - reward-threshold) in all-equal
    groups (the authors' outcome anchoring, reported second-hand): drift is reinforced only where the verifier
    agrees, and an all-wrong group pulls its tokens back to the reference. none: no sign (the first
    reconstruction; it collapses on the headroom benchmark, docs/ep_grpo.md)"""
    reward_threshold: float = 0.5
    """theta_reward: an all-equal group's polarity is sign(r - this) (0.5: all-correct +1, all-wrong -1 for 0/1 rewards)"""
    anchor_form: Literal["additive", "multiplicative"] = "additive"
    """additive gate*(A_out + lambda*P); multiplicative gate*A_out*(1 + lambda*tanh(sign(A_out)*P)) (0 when A_out = 0)"""
    process_coef: float = 0.2
    """lambda (the authors' eta): weight of the process signal P in groups with mixed rewards (0 turns it off); 0.2
    is the value of a public reimplementation of the authors' earlier ERPO, the paper's own is not known"""
    process_coef_zero_var: float | None = None
    """lambda_0: weight of P in groups whose rewards are all equal (default: --process-coef); with --process-polarity
    none, set it to 0: there unsigned P is the only gradient and runs away (docs/ep_grpo.md, Results)"""
    process_clip: float = 3.0
    """c: P is clipped to [-c, c]"""
    process_std_min: float = 1e-3
    """sigma_min: a (group, window) whose std is below this gets P = 0 (e.g. step 1, when pi_old = pi_ref)"""
    progress: Literal["entropy", "position"] = "entropy"
    """progress coordinate: cumulative entropy share (position when a response's entropy is ~0) or token-index share"""
    num_buckets: int = 10
    """K: number of progress windows"""
    advantage_form: Literal["A", "B"] = "A"
    """A: the form above; B (ablation): gate * z-score over the group's tokens per window of r + implicit_beta*cumsum(delta)"""
    implicit_beta: float = 0.05
    """beta of the implicit reward in --advantage-form B (form A: no effect, the z-score cancels it)"""


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
    """Token weights g_hat [B, T] from the rollout entropy (the entropy gate).

    entropy: [B, T] nats; mask: [B, T] completion mask; tau: pivot threshold, a scalar or [B, 1] (nats).
    soft: 1 + alpha*sigmoid((H - tau)/temp); hard: 1[H > tau]; gtpo: H; none: 1; zsig: sigmoid((H - tau)/temp) with
    tau the pool's mean entropy and temp its std / gamma (a tensor [B, 1]), the authors' W = sigmoid(gamma * z(H)),
    which ep_advantages passes. With norm "response" the
    weights are divided by their mean over the response's tokens, so each response's mean weight is 1
    (a response whose weights are all ~0 keeps weight 1). Padded positions are 0.
    """
    m, H = mask.float(), entropy.float()
    if gate == "soft":
        if temp <= 0:
            raise ValueError(f"gate temperature must be > 0, got {temp}")
        g = 1 + alpha * torch.sigmoid((H - tau) / temp)
    elif gate == "zsig":
        g = torch.sigmoid((H - tau) / temp)
    else:
        g = {"hard": lambda: (H > tau).float(), "gtpo": lambda: H.clamp(min=0), "none": lambda: torch.ones_like(H)}[
            gate
        ]()
    g = g * m
    if norm == "none":
        return g
    mean = g.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    return torch.where(mean > eps, g / mean.clamp(min=eps), m)


def progress_windows(entropy, mask, num_buckets=10, progress="entropy", eps=1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Progress window b(i,t) in {0..K-1} of every token (cumulative-entropy progress); returns (b [B, T] long, zero_entropy [B] bool).

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

    d [B] is the outcome polarity (process_polarity "outcome"): sign(A_out) in mixed groups, sign(r - reward_threshold)
    in all-equal groups; 1 with "none". In an all-equal group d is one sign and P sums to 0 over each (group, window)
    cell, so the process credit there is zero-sum per window and bounded by lambda_0 * process_clip * max gate.

    entropy: [B, T] rollout-policy entropy (nats); logp_old, logp_ref: [B, T] log-probs of the sampled tokens
    under pi_old and the reference (nats); mask: [B, T]; rewards: [B]; groups: rows sharing group_ids (the
    prompt id; default consecutive blocks of group_size). A_out is GRPO's advantage (common.group_advantages, 0 in
    all-equal groups) with population std + 1e-6 (outcome_std "unbiased": grpo.py's unbiased + 1e-4); lambda_g is process_coef_zero_var (default process_coef) in all-equal groups.
    The keyword flags are the script's (see Args). Pure: no state, no gradient needed.
    return_parts: also return a dict of the pieces (outcome [B], gate, process P, windows [B, T], ...) for ep_metrics.
    """
    choices = dict(
        outcome_std=outcome_std,
        gate=gate,
        pivot_scope=pivot_scope,
        gate_norm=gate_norm,
        process_granularity=process_granularity,
        process_polarity=process_polarity,
        anchor_form=anchor_form,
        progress=progress,
        advantage_form=advantage_form,
    )
    for name in [k for k, v in choices.items() if v not in CHOICES[k]]:
        raise ValueError(f"{name}={choices[name]!r}: choose one of {CHOICES[name]}")
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
    rows = {
        "batch": lambda: torch.zeros_like(inv),
        "group": lambda: inv,
        "response": lambda: torch.arange(B, device=dev),
    }
    owner = rows[pivot_scope]()  # which pool each row's threshold comes from
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
    parts = dict(
        outcome=a_out,
        gate=g_hat,
        process=P,
        windows=b,
        tau=tau,
        zero_var=zero_var,
        group_index=inv,
        zero_entropy=zero_entropy,
        cell_members=n_cell,
        cell_ok=ok,
        polarity=polarity,
        delta=delta,
        above_threshold=r > reward_threshold,
    )
    return A, parts


def ep_metrics(adv, parts, entropy, mask) -> dict:
    """Diagnostics of the three GRPO failures EP-GRPO targets, as floats (0.0 where a ratio has no denominator).

    adv: [B, T] from ep_advantages; parts: its return_parts dict; entropy: [B, T] nats; mask: [B, T].
    """
    valid, m = mask.bool(), mask.float()

    def ratio(a, b):
        return float(a) / float(b) if float(b) > 0 else 0.0

    H, inv, zv = entropy.float()[valid], parts["group_index"], parts["zero_var"]
    top = H.topk(max(1, math.ceil(0.2 * H.numel()))).values.sum() if H.numel() else 0.0
    n_groups = int(inv.max()) + 1
    zv_g = torch.zeros(n_groups, device=inv.device).scatter_reduce(0, inv, zv.float(), "amax")
    grad_g = torch.zeros(n_groups, device=inv.device).scatter_reduce(
        0, inv, ((adv.abs() * m).sum(1) > 0).float(), "amax"
    )
    a_out, P, n, ok = parts["outcome"][:, None], parts["process"].abs() * m, parts["cell_members"], parts["cell_ok"]
    right_g = torch.zeros(n_groups, device=inv.device).scatter_reduce(0, inv, parts["above_threshold"].float(), "amax")
    return {
        "ep/frac_zero_var_groups": zv_g.mean().item(),  # waste: groups GRPO gives no gradient
        "ep/zero_var_groups_with_grad": ratio((zv_g * grad_g).sum(), zv_g.sum()),  # ... that EP-GRPO still trains
        "ep/entropy_top20_share": ratio(top, H.sum()),  # non-uniformity: entropy mass of the top-20% tokens
        "ep/pivot_frac": ratio(((entropy.float() > parts["tau"]) & valid).sum(), valid.sum()),
        "ep/pivot_threshold": parts["tau"].float().mean().item(),
        "ep/polarity_flip_rate": ratio(((adv * a_out < 0) & valid).sum(), (valid & (a_out != 0)).sum()),
        "ep/process_abs_mixed": ratio(P[~zv].sum(), m[~zv].sum()),
        "ep/process_abs_zero_var": ratio(P[zv].sum(), m[zv].sum()),
        "ep/adv_abs_mean": ratio((adv.abs() * m).sum(), m.sum()),
        "ep/gate_max": (parts["gate"] * m).max().item() if valid.any() else 0.0,
        "ep/frac_zero_entropy_responses": parts["zero_entropy"].float().mean().item(),  # positional fallback
        "ep/frac_singleton_windows": ratio((n == 1).sum(), (n > 0).sum()),  # (group, window) cells with one member
        "ep/frac_flat_windows": ratio(((n >= 2) & ~ok).sum(), (n > 0).sum()),  # std < sigma_min (identical responses)
        # drift, visible before the accuracy falls: mean delta = log pi_old - log pi_ref over the sampled tokens (a
        # k1 estimate of KL(pi_old || pi_ref)), and the share of the advantage's weight that comes from all-equal groups
        "ep/delta_mean": ratio((parts["delta"] * m).sum(), m.sum()),
        "ep/zero_var_adv_share": ratio((adv.abs() * m)[zv].sum(), (adv.abs() * m).sum()),
        "ep/frac_zero_var_all_correct": ratio((zv_g * right_g).sum(), n_groups),  # all-equal and above the threshold
    }


def validate(args: Args) -> Args:
    """Every flag checked before anything loads: a user error ends with one line naming the flag, exit code 2."""
    args = cli.resume_args(args, Args) if args.resume else args
    cli.check_common(args)
    cli.need(
        args.num_generations >= 2,
        f"--num-generations must be >= 2 (GRPO compares the completions of a prompt), got {args.num_generations}",
    )
    cli.need(
        args.anchor_lag >= 1 and 0 <= args.anchor_ema_decay <= 1,
        f"need --anchor-lag >= 1 (got {args.anchor_lag}) and "  # ALGO LOGIC
        f"--anchor-ema-decay in [0, 1] (got {args.anchor_ema_decay})",
    )
    cli.need(
        args.num_buckets >= 1 and 0 <= args.pivot_quantile <= 1,
        f"need --num-buckets >= 1 (got {args.num_buckets}) and --pivot-quantile in [0, 1] (got {args.pivot_quantile})",
    )
    cli.need(args.gate_gamma > 0, f"--gate-gamma must be > 0, got {args.gate_gamma}")
    cli.need(
        args.gate_temp > 0 and args.process_clip > 0 and args.process_std_min >= 0,
        "need --gate-temp > 0, --process-clip > 0 "
        f"and --process-std-min >= 0 (got {args.gate_temp}, {args.process_clip}, {args.process_std_min})",
    )
    return dataclasses.replace(args, epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high)


if __name__ == "__main__":
    args = validate(cli.parse(Args))  # tyro.cli(Args), its errors on one line
    cli.set_threads(args.threads)
    run_dir = Path(
        args.resume or Path(args.output_dir) / f"{args.task}__{args.exp_name}__{args.seed}__{int(time.time())}"
    )

    # seeding, model, task; a resumed run then restores its checkpoint into them
    dist, device = distributed.init_distributed(
        args.device, vars(args), args.prompts_per_step, args.dist_timeout, args.fsdp
    )
    common.seed_everything(args.seed + dist.rank)  # per-rank sampling; every rank draws the same global prompt batches
    model, tokenizer = common.load_policy(args.model, device, args.dtype, args.gradient_checkpointing)
    # ALGO LOGIC: the frozen reference is loaded even at --beta 0: delta = log pi_old - log pi_ref needs it. A moving
    # anchor (--process-anchor ema / lagged) is its own copy; then the reference is needed only for the KL term.
    ref_model = (
        copy.deepcopy(model).eval().requires_grad_(False) if args.process_anchor == "ref" or args.beta > 0 else None
    )
    train_model = dist.wrap(model, ref_model)  # DDP / FSDP2 under torchrun; the model itself otherwise
    anchor = ref_model if args.process_anchor == "ref" else copy.deepcopy(model).eval().requires_grad_(False)
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
    moving = {} if anchor is ref_model else {"anchor": anchor}  # ALGO LOGIC: a moving anchor is part of the checkpoint
    start = ckpt.restore(model, optimizer, batches, moving) if args.resume else 0
    engines.attach_engine(
        args.engine, model, optimizer, args.model, args.vllm_gpu_memory_utilization, seed=args.seed + dist.rank
    )
    logger = common.Logger(run_dir, vars(args), args.track, args.wandb_project, enabled=dist.main, resume_step=start)
    dist.print(
        f"run {run_dir.name}: logs in {run_dir}/ (tensorboard --logdir {run_dir.parent}); {len(task.train)} train / "
        f"{len(task.eval)} eval prompts; skipped {task.skipped}" + (f"; resumed after step {start}" if start else "")
    )
    G = args.num_generations
    # ALGO LOGIC: every EP-GRPO flag goes to ep_advantages under its own name (--gate -> gate=..., and so on)
    ep_flags = {k: getattr(args, k) for k in inspect.signature(ep_advantages).parameters if hasattr(args, k)}
    ep_flags["return_parts"] = True

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
        desc="ep_grpo",
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

        # 3. ALGO LOGIC: old log-probs and the rollout entropy (one no-grad pass: both from the same logits), and the
        #    reference's (and the anchor's) log-probs. Credit assignment needs them, so this pass runs even on-policy.
        t0 = time.time()
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad():
            old_logp, old_entropy = common.token_logprobs(
                model, input_ids, attn, T, args.temperature, with_entropy=True
            )
            ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0] if ref_model else None
            anchor_logp = (
                ref_logp
                if anchor is ref_model
                else common.token_logprobs(anchor, input_ids, attn, T, args.temperature)[0]
            )
        t_logp = time.time() - t0

        # 4. ALGO LOGIC: credit assignment. A = gate * (GRPO advantage + lambda * d * P), per token.
        t0 = time.time()
        token_adv, parts = ep_advantages(old_entropy, old_logp, anchor_logp, mask, rewards, G, ro.group_ids, **ep_flags)
        ep_stats = ep_metrics(token_adv, parts, old_entropy, mask)
        t_adv = time.time() - t0

        # 5. update: mu passes; each splits the batch into mini-batches of whole prompts, one optimizer step each,
        #    computed in micro-batches (the loss is normalized over the mini-batch, so accumulation changes nothing)
        t0 = time.time()
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
                    ratio = torch.exp(
                        torch.clamp(logp - old, -common.MAX_LOG_RATIO, common.MAX_LOG_RATIO)
                    )  # fp32; clamped as verl
                    A = token_adv[mb]
                    surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high) * A)
                    per_token_loss = -surrogate * engines.engine_correction(
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
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                common.stop_if_nonfinite(grad_norm, "gradient norm", step, metrics)
                optimizer.step()
                stats.step(grad_norm)
        t_update = time.time() - t0
        # ALGO LOGIC: a moving process anchor follows the policy (--process-anchor ema / lagged)
        if args.process_anchor == "ema":
            with torch.no_grad():
                for p_anchor, p in zip(anchor.parameters(), model.parameters()):
                    p_anchor.lerp_(p, 1 - args.anchor_ema_decay)
        elif args.process_anchor == "lagged" and step % args.anchor_lag == 0:
            anchor.load_state_dict(model.state_dict())

        # 6. logging, evaluation, checkpoints
        step_time = t_gen + t_logp + t_adv + t_update  # ALGO LOGIC: + credit assignment time and EP-GRPO's logs
        metrics = {
            **common.completion_metrics(ro, rewards, G),
            **sampling,
            **stats.metrics(),
            **ep_stats,
            "time/advantages": t_adv,
            "learning_rate": optimizer.param_groups[0]["lr"],
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
            ckpt.save(step, model, tokenizer, optimizer, batches, moving)
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

"""EP-GRPO's ablations: the other forms of its credit and a moving anchor (docs/ep_grpo.md, Ablations), an extra. Their
flags join ep_grpo.py's when one is given (cli.parse; `--help` with one of them lists them all); ep_grpo.py writes the
method out at its defaults (soft gate around the batch's entropy quantile, per-token z-score of delta, additive form A,
the reference as anchor) and, with one of these flags, calls `wrap`'s advantages in place of ep_advantages and
`moving_anchor` / `follow_policy` for --process-anchor ema / lagged. Each docstring names its source as docs/ep_grpo.md
does: (a) the authors' formula as reported second-hand, (c) this project's choice."""

import copy
import dataclasses
import os
from typing import Literal

import torch

from rlvr_utils.core import checkpoints, cli, models, runtime


@dataclasses.dataclass
class Ablations:
    """EP-GRPO's ablation flags (docs/ep_grpo.md, Ablations)."""

    gate: Literal["soft", "hard", "gtpo", "zsig", "none"] = "soft"
    """(c) soft 1 + alpha*sigmoid((H - pivot)/gate-temp) (the method's); hard 1[H > pivot]; gtpo H;
    none 1; (a) zsig sigmoid(g*z(H))"""
    gate_gamma: float = 1.0
    """(c) gamma of --gate zsig, > 0 (the authors' value is not known)"""
    pivot_scope: Literal["batch", "group", "response"] = "batch"
    """(c) batch (the method's), (a) group, response: over which tokens the pivot threshold (or zsig's
    z-score) is taken"""
    process_granularity: Literal["window", "token", "cumulative"] = "token"
    """(a) token (the method's): delta z-scored over the group's tokens in its window; (c) window:
    window sums; (c) cumulative: prefix sums"""
    anchor_form: Literal["additive", "multiplicative"] = "additive"
    """(a) additive gate*(A_out + lambda*d*P) (the method's); (c) multiplicative
    gate*A_out*(1 + lambda*tanh(sign(A_out)*P))"""
    advantage_form: Literal["A", "B"] = "A"
    """(a) A: gate * (A_out + lambda * d * P) (the method's); (c) B: gate * z-score of r +
    implicit-beta * cumsum(delta) per cell"""
    implicit_beta: float = 0.05
    """(c) beta of the implicit reward in --advantage-form B (no effect in form A)"""
    process_anchor: Literal["ref", "ema", "lagged"] = "ref"
    """delta = log pi_old - log pi_anchor against (a) ref, the frozen initial policy (the method's),
    or (c) ema, lagged"""
    anchor_ema_decay: float = 0.99
    """(c) --process-anchor ema: anchor <- decay * anchor + (1 - decay) * policy after every step
    (in [0, 1])"""
    anchor_lag: int = 10
    """(c) --process-anchor lagged: the anchor is reset to the policy every this many steps (>= 1)"""


def validate(a):
    """The ablation flags' checks (cli.parse, after ep_grpo.validate): one line naming the flag, exit code 2."""
    cli.need_ranges(a, anchor_lag=">= 1", anchor_ema_decay="[0, 1]", gate_gamma="> 0", implicit_beta="> 0")
    sharded = a.fsdp and int(os.environ.get("WORLD_SIZE", "1")) > 1
    cli.need(not sharded or a.process_anchor == "ref", "--process-anchor ema/lagged do not support --fsdp: use ref")
    no_lora = "--process-anchor ema/lagged copy the whole model: not with --lora-rank (use ref)"
    cli.need(not a.lora_rank or a.process_anchor == "ref", no_lora)
    return a


def wrap(args, method: dict):
    """ep_grpo.ep_advantages (same arguments) under the ablation flags `args` holds: the method's advantages and
    parts, then each flag's other form in place of the method's: the threshold (--pivot-scope, --gate zsig), the
    gate's weights (--gate), the process signal (--process-granularity), the combination (--anchor-form,
    --advantage-form). method: ep_grpo.py's functions and records by name (ep_advantages, entropy_gate, mean_one,
    row_quantile, cell_zscore, EPConfig, EPCredit; the package does not import a script)."""
    quantile, zscore = method["row_quantile"], method["cell_zscore"]

    def advantages(entropy, logp_old, logp_ref, mask, rewards, group_size, group_ids=None, cfg=None, scores=None,
                   return_parts=False):  # fmt: skip
        cfg = method["EPConfig"]() if cfg is None else cfg  # its default: the flags' (ep_grpo.EPConfig)
        A, p = method["ep_advantages"](entropy, logp_old, logp_ref, mask, rewards, group_size, group_ids, cfg,
                                       scores, return_parts=True)  # fmt: skip
        f, H, m, inv, r = cfg, entropy.float(), mask.float(), p["group_index"], rewards.float().to(mask.device)
        cut, scored, n_win = (f.process_clip, f.process_std_min), mask * ~r.isnan()[:, None], f.num_buckets
        pivot, temp = p["pivot"], f.gate_temp
        if args.pivot_scope != "batch" or args.gate == "zsig":  # a pool per group or response; zsig's mean and std
            scope = (args.pivot_scope, f.pivot_quantile, args.gate, temp, args.gate_gamma)
            pivot, temp = pooled_threshold(H, mask, inv, *scope, quantile=quantile)
        if args.gate == "soft":
            g_hat = method["entropy_gate"](H, mask, pivot, f.gate_alpha, temp, f.gate_norm)
        else:  # the other gates' weights, over their mean per response as the soft gate's
            g_hat = method["mean_one"](gate_weights(H, pivot, temp, args.gate), mask, f.gate_norm)
        P, n_cell, ok = p["process"], p["cell_members"].flatten(), p["cell_ok"].flatten()
        if args.process_granularity != "token":  # window sums or prefix sums, per cell
            how = (n_win, args.process_granularity, *cut)
            P, n_cell, ok = window_process(p["delta"], p["windows"], inv, scored, *how, zscore=zscore)
        lam, d, a_out = p["coef"], p["polarity"][:, None], p["outcome"]
        A = g_hat * (a_out[:, None] + lam * d * P) * m  # the method's form A with these pieces
        if args.anchor_form != "additive" or args.advantage_form != "A":  # multiplicative, form B
            form = (args.advantage_form, n_win, args.implicit_beta, *cut)
            A, P, n_cell, ok = other_forms(
                g_hat, a_out, lam, P, n_cell, ok, r.nan_to_num(), p["delta"], p["windows"], inv, scored, *form,
                zscore=zscore,
            )  # fmt: skip
        A = A.masked_fill(r.isnan()[:, None], 0.0)  # a completion no reward function scored: advantage 0
        if not return_parts:
            return A
        cells = dict(cell_members=n_cell.view(p["cell_members"].shape), cell_ok=ok.view(p["cell_ok"].shape))
        return method["EPCredit"](A, p | dict(gate=g_hat, process=P, pivot=pivot) | cells)

    return advantages


def moving_anchor(args, model):
    """--process-anchor ema / lagged (c): a copy of the policy that follows it (follow_policy), delta's anchor in place
    of the reference; ref: None (the method's). Under mixed precision its pass runs in bf16: lagged is a bf16 copy
    (reset to the policy's own bf16 copies), ema keeps fp32 masters of its average (precision.py), so that (1 - decay)
    times a small step of the policy is not rounded away."""
    if args.process_anchor == "ref":
        return None
    anchor = copy.deepcopy(model).eval().requires_grad_(False)
    mixed = models.mixed_precision(args, next(model.parameters()).device)
    if mixed is not None and args.process_anchor == "ema":
        runtime.extra("precision", "--dtype bfloat16 (mixed precision)").MixedPrecision(anchor, mixed)
    return models.cast_weights(anchor, mixed) if mixed is not None else anchor


def pooled_threshold(
    H, mask, inv, scope, q, gate, temp, gamma, *, quantile
) -> tuple[torch.Tensor, float | torch.Tensor]:
    """The gate's threshold pivot [B, 1] (nats) and temperature, per pool of rows: --pivot-scope batch (one pool), group
    (rows with the same inv; equal group sizes) or response (each row). pivot is the q-quantile of the pool's token
    entropies; with --gate zsig (a) it is their mean and the temperature their population std / gamma, so that
    sigmoid((H - pivot) / temp) is the authors' W = sigmoid(gamma * z(H)) (EP-GRPO Eq. 18-19). H, mask: [B, T].
    quantile: ep_grpo.row_quantile."""
    B, dev, m = H.shape[0], H.device, mask.float()
    owner = {"batch": torch.zeros_like(inv), "group": inv, "response": torch.arange(B, device=dev)}[scope]
    pools = int(owner.max()) + 1
    if gate != "zsig":
        order = torch.argsort(owner, stable=True)  # rows of a pool together
        valid = mask.bool()
        return quantile(H[order].reshape(pools, -1), valid[order].reshape(pools, -1), q)[owner][:, None], temp
    n = torch.zeros(pools, device=dev).index_add(0, owner, m.sum(1)).clamp(min=1)
    pivot = (torch.zeros(pools, device=dev).index_add(0, owner, (H * m).sum(1)) / n)[owner][:, None]
    var = torch.zeros(pools, device=dev).index_add(0, owner, (((H - pivot) * m) ** 2).sum(1)) / n
    return pivot, (var.sqrt()[owner][:, None] / gamma).clamp(min=1e-6)


def gate_weights(H, pivot, temp, gate) -> torch.Tensor:
    """Token weights [B, T] of the gates other than soft, before the mask and the per-response normalization: hard
    1[H > pivot] (c: the 80/20 mask), gtpo H (c: GTPO's entropy weight), none 1, zsig sigmoid((H - pivot) / temp)
    (a: with pooled_threshold's pivot and temp, the authors' W)."""
    if gate == "zsig":
        return torch.sigmoid((H - pivot) / temp)
    return {"hard": (H > pivot).float(), "gtpo": H.clamp(min=0), "none": torch.ones_like(H)}[gate]


def window_process(
    delta, windows, inv, mask, num_buckets, process_granularity, process_clip, process_std_min, *, zscore
):
    """--process-granularity window (c: the first reconstruction's form) and cumulative (c: SPRO-like). window: S[i, k]
    = the sum of delta over response i's window k, z-scored across the group's responses that reach window k;
    cumulative: the prefix sums S[i, 0..k], every response counted in every window. Each token gets its window's
    value. delta, windows, mask: [B, T]; inv: [B] group index; the others: ep_advantages' flags of the same names;
    zscore: ep_grpo.cell_zscore. Returns (P [B, T], members per cell, ok per cell) as cell_zscore."""
    B, n_win, m = delta.shape[0], num_buckets, mask.float()
    S = torch.zeros(B, n_win, device=delta.device).scatter_add_(1, windows, delta)
    present = torch.zeros(B, n_win, device=delta.device).scatter_add_(1, windows, m) > 0
    if process_granularity == "cumulative":
        S, present = S.cumsum(1), mask.bool().any(1, keepdim=True).expand(-1, n_win)
    cells = inv[:, None] * n_win + torch.arange(n_win, device=delta.device)
    P_win, n_cell, ok = zscore(S, present, cells, (int(inv.max()) + 1) * n_win, process_clip, process_std_min)
    return P_win.gather(1, windows) * m, n_cell, ok


def other_forms(
    g_hat, a_out, lam, P, n_cell, ok, r, delta, windows, inv, mask, advantage_form, num_buckets, implicit_beta,
    process_clip, process_std_min, *, zscore,
):  # fmt: skip
    """The token advantage A [B, T] (0 at pads) of --advantage-form B or --anchor-form multiplicative, with the process
    signal and cells it used: (A, P, members per cell, ok per cell). g_hat, P, delta, windows: [B, T]; a_out, r, inv:
    [B]; lam: [B, 1]; the others: ep_advantages' flags of the same names; zscore: ep_grpo.cell_zscore.

    B (c: the alternative reading, SPRO's Masked Step Advantage over entropy progress): the dense token reward
    R = r + implicit_beta * cumsum(delta), z-scored over the tokens of each (group, window) cell, times g_hat; no
    lambda, no --anchor-form. multiplicative (c): g_hat * A_out * (1 + lambda * tanh(sign(A_out) * P)), which carries
    its own sign (no outcome polarity), never flips a token's sign and is 0 where A_out is 0 (all-equal groups)."""
    m = mask.float()
    if advantage_form == "B":
        n_win = num_buckets
        R = r[:, None] + implicit_beta * delta.cumsum(1)
        cells, n_cells = inv[:, None] * n_win + windows, (int(inv.max()) + 1) * n_win
        P, n_cell, ok = zscore(R, mask.bool(), cells, n_cells, process_clip, process_std_min)
        return g_hat * P * m, P, n_cell, ok
    return g_hat * a_out[:, None] * (1 + lam * torch.tanh(torch.sign(a_out)[:, None] * P)) * m, P, n_cell, ok


@torch.no_grad()
def follow_policy(anchor, model, step, args) -> None:
    """A moving process anchor (c) follows the policy after each step: --process-anchor ema: anchor <- decay * anchor +
    (1 - decay) * policy (--anchor-ema-decay); lagged: the anchor is reset to the policy every --anchor-lag steps.
    ref (the default, the frozen reference): nothing. args: ep_grpo.py's Args."""
    if args.process_anchor == "ema":
        with checkpoints.masters_of(anchor, model):  # mixed precision: fp32, the policy's masters
            for p_anchor, p in zip(anchor.parameters(), model.parameters()):
                p_anchor.lerp_(p, 1 - args.anchor_ema_decay)
    elif args.process_anchor == "lagged" and step % args.anchor_lag == 0:
        anchor.load_state_dict(model.state_dict())

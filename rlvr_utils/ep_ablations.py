"""EP-GRPO's alternative forms, for the ablations on docs/ep_grpo.md. ep_grpo.py writes the method out at its defaults
(soft gate around the batch's entropy quantile, per-token z-score of delta, additive form A, the reference as anchor)
and calls these for the other values of its flags: --pivot-scope group / response and --gate zsig (the threshold),
--gate hard / gtpo / none / zsig (the weights), --process-granularity window / cumulative, --advantage-form B,
--anchor-form multiplicative, --process-anchor ema / lagged. Each docstring names its source as docs/ep_grpo.md does:
(a) the authors' formula as reported second-hand, (c) this project's choice."""

import torch


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
        for p_anchor, p in zip(anchor.parameters(), model.parameters()):
            p_anchor.lerp_(p, 1 - args.anchor_ema_decay)
    elif args.process_anchor == "lagged" and step % args.anchor_lag == 0:
        anchor.load_state_dict(model.state_dict())

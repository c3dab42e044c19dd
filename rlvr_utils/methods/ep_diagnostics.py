"""EP-GRPO's diagnostics (ep_grpo.py logs them as ep/*; docs/ep_grpo.md, Logs): how much of the three GRPO failures the
method targets (zero-variance waste, uniform token weight, uniform polarity) is left in a batch, and the drift that
precedes a collapse. Plumbing: nothing here changes the advantages or the loss."""

import math

import torch


def ep_metrics(adv, parts, entropy, mask) -> dict:
    """Diagnostics of the three GRPO failures EP-GRPO targets, as floats (0.0 where a ratio has no denominator).

    adv: [B, T] from ep_grpo.ep_advantages; parts: its return_parts dict; entropy: [B, T] nats; mask: [B, T].
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
        "ep/pivot_frac": ratio(((entropy.float() > parts["pivot"]) & valid).sum(), valid.sum()),
        "ep/pivot_threshold": parts["pivot"].float().mean().item(),
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

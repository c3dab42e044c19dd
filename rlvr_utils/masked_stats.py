"""Statistics over the valid entries of padded tensors, for ep_grpo.py's credit assignment (docs/ep_grpo.md): a
quantile per row (the entropy gate's pivot threshold) and a clipped z-score within cells (the process signal, z-scored
per (group, progress window))."""

import torch


def row_quantile(x: torch.Tensor, valid: torch.Tensor, q: float) -> torch.Tensor:
    """q-quantile (linear interpolation, as torch.quantile) of each row's valid entries; x, valid: [R, L] -> [R].
    Rows without valid entries give 0. Sort-based, so it has no size limit."""
    s = x.float().masked_fill(~valid, float("inf")).sort(dim=1).values
    n = valid.sum(1)
    pos = q * (n - 1).clamp(min=0).float()
    lo, hi = pos.floor().long()[:, None], pos.ceil().long()[:, None]
    val = s.gather(1, lo) + (pos[:, None] - lo) * (s.gather(1, hi) - s.gather(1, lo))
    return torch.where(n > 0, val.squeeze(1), torch.zeros_like(pos))


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

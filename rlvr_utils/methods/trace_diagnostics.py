"""GRPO-λ's trace/* metrics (grpo_lambda.py, docs/grpo_lambda.md "Logs"): what the traced ratio did in one step,
and trace_multipliers, the closed form the credit multiplier takes on-policy (the tests check one against the other).

trace/multiplier_mean   the credit the loss actually gives a token: c_k = −(∂loss_k'/∂log p_k) / A_k summed over
                        the completion, averaged over the first pass's tokens with a non-zero advantage (GRPO: 1;
                        on-policy GRPO-λ: trace_multipliers below, up to 1/(1 − γλ) early in a completion)
trace/log_ratio_mean    mean traced log-ratio z over valid tokens and passes (0 on-policy)
trace/log_ratio_max     largest |z| over valid tokens
trace/clamped_frac      share of valid tokens whose |z| exceeds --max-log-ratio (their ratio is clamped)
"""

import torch


def trace_multipliers(
    lengths: torch.Tensor,
    lam: float,
    gamma: float = 1.0,
    style: str = "both",
    T: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """On-policy per-token advantage multipliers c_k = Σ_{t=k}^{L−1} w(t,k) of grpo_lambda.trace_log_ratio's weights
    (docs/grpo_lambda.md, "On-policy identity"): at θ = θ_old the GRPO-λ gradient is exactly GRPO's with token k's
    advantage times c_k. lengths: [B] tokens per row (L); a = γλ ∈ [0, 1].
    Returns c [B, T] (T: longest row by default), 0 past each row's end. With S(n) = Σ_{j<n} a^j:
      recent: c_k = S(L − k)                                   (last token 1, early ones → 1/(1 − a))
      both:   c_k = S(min(k, L−1−k) + 1) + a^k·max(0, L−1−2k)  (c_0 = L: the first token is in every row)"""
    if style not in ("recent", "both"):
        raise ValueError(f"unknown trace style {style!r}: choose one of {('recent', 'both')}")
    if not 0.0 <= gamma * lam <= 1.0:
        raise ValueError(f"gamma * lam must be in [0, 1], got {gamma * lam}")
    a = gamma * lam
    L = lengths.to(torch.float64)[:, None]
    T = int(lengths.max()) if T is None and len(lengths) else (T or 0)
    k = torch.arange(T, dtype=torch.float64, device=lengths.device)[None, :]
    S = (lambda n: n) if a == 1.0 else (lambda n: (1 - a**n) / (1 - a))
    c = S(L - k) if style == "recent" else S(torch.minimum(k, L - 1 - k) + 1) + a**k * (L - 1 - 2 * k).clamp(min=0)
    return torch.where(k < L, c, 0.0).to(dtype)


class TraceStats:
    """One step's trace diagnostics, accumulated micro-batch by micro-batch (diagnostics only: no gradient).
    passes: --num-iterations; tokens: the batch's valid tokens (UpdateStats.tokens)."""

    def __init__(self, max_log_ratio: float, passes: int, tokens: float):
        self.max_log_ratio, self.norm = max_log_ratio, tokens * passes
        self.sums = {"trace/log_ratio_mean": 0.0, "trace/log_ratio_max": 0.0, "trace/clamped_frac": 0.0}
        self.credit = self.with_adv = 0.0

    def add(self, per_token_loss, logp, A, m, z, measure_credit: bool) -> None:
        """One micro-batch, before its backward (the graph is kept). per_token_loss: [n, T] GRPO-λ's loss before the
        engine correction and the KL; logp: [n, T] the log-probs it was computed from; A: [n, T] the advantage;
        m: [n, T] float mask; z: [n, T] traced log-ratio. measure_credit (the first pass): c_k = −(∂ Σ loss / ∂ log p_k)
        / A_k over the tokens with a non-zero advantage (one more backward through the loss only, not the model)."""
        if measure_credit:
            g = torch.autograd.grad(per_token_loss.sum(), logp, retain_graph=True)[0]
            has_adv = (A != 0) * m
            self.credit += (-g / torch.where(A != 0, A, 1.0) * has_adv).sum().item()
            self.with_adv += has_adv.sum().item()
        z, s = z.detach(), self.sums
        s["trace/log_ratio_mean"] += (z * m).sum().item() / self.norm
        s["trace/log_ratio_max"] = max(s["trace/log_ratio_max"], (z.abs() * m).max().item())
        s["trace/clamped_frac"] += ((z.abs() > self.max_log_ratio) * m).sum().item() / self.norm

    def metrics(self) -> dict:
        multiplier = self.credit / self.with_adv if self.with_adv else 0.0
        return {**self.sums, "trace/multiplier_mean": multiplier}

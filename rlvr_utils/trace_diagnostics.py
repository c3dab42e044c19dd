"""GRPO-λ's trace/* metrics (grpo_lambda.py, docs/grpo_lambda.md "Logs"): what the traced ratio did in one step.

    trace/multiplier_mean   the credit the loss actually gives a token: c_k = −(∂loss_k'/∂log p_k) / A_k summed over
                            the completion, averaged over the first pass's tokens with a non-zero advantage (GRPO: 1;
                            on-policy GRPO-λ: grpo_lambda.trace_multipliers, up to 1/(1 − γλ) early in a completion)
    trace/log_ratio_mean    mean traced log-ratio z over valid tokens and passes (0 on-policy)
    trace/log_ratio_max     largest |z| over valid tokens
    trace/clamped_frac      share of valid tokens whose |z| exceeds --max-log-ratio (their ratio is clamped)
"""

import torch


class TraceStats:
    """One step's trace diagnostics, accumulated micro-batch by micro-batch (diagnostics only: no gradient)."""

    def __init__(self, max_log_ratio: float, passes: int):
        self.max_log_ratio, self.passes = max_log_ratio, passes
        self.sums = {"trace/log_ratio_mean": 0.0, "trace/log_ratio_max": 0.0, "trace/clamped_frac": 0.0}
        self.credit = self.with_adv = 0.0

    def measure_credit(self, per_token_loss: torch.Tensor, logp: torch.Tensor, A: torch.Tensor, m: torch.Tensor):
        """c_k = −(∂ Σ loss / ∂ log p_k) / A_k over the tokens with an advantage (call before backward: the graph is
        kept). per_token_loss, logp, A, m: [n, T] (the loss before the engine correction and the KL)."""
        g = torch.autograd.grad(per_token_loss.sum(), logp, retain_graph=True)[0]
        has_adv = (A != 0) * m
        self.credit += (-g / torch.where(A != 0, A, 1.0) * has_adv).sum().item()
        self.with_adv += has_adv.sum().item()

    def add(self, z: torch.Tensor, m: torch.Tensor, tokens: float) -> None:
        """z: [n, T] traced log-ratio of a micro-batch, m: [n, T] its float mask; tokens: valid tokens in the batch."""
        z = z.detach()
        s = self.sums
        s["trace/log_ratio_mean"] += (z * m).sum().item() / (tokens * self.passes)
        s["trace/log_ratio_max"] = max(s["trace/log_ratio_max"], (z.abs() * m).max().item())
        s["trace/clamped_frac"] += ((z.abs() > self.max_log_ratio) * m).sum().item() / (tokens * self.passes)

    def metrics(self) -> dict:
        multiplier = self.credit / self.with_adv if self.with_adv else 0.0
        return {**self.sums, "trace/multiplier_mean": multiplier}

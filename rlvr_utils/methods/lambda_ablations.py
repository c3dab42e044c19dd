"""GRPO-λ's ablation (docs/grpo_lambda.md, Ablations), an extra: --trace-apply joins grpo_lambda.py's flags when given
(cli.parse; `--help` with it lists it), and grpo_lambda.py then calls `token_loss`'s loss in place of its ϵ-trace."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch


@dataclasses.dataclass
class Ablations:
    """GRPO-λ's ablation flag (docs/grpo_lambda.md, Ablations)."""

    trace_apply: Literal["trace", "weight"] = "trace"
    """trace: ϵ-trace, the traced log-ratio inside the clipped ratio (the method's); weight: ϵ-weight
    (g: project default)"""


def validate(args):
    """--trace-apply's choices are tyro's: nothing more to check."""
    return args


def token_loss(args, method_loss, trace_log_ratio):
    """grpo_lambda.py's per-token loss under --trace-apply: trace, the method's own (`method_loss`,
    grpo_lambda_token_loss); weight (ϵ-weight): GRPO's clipped loss of the plain ratio times the eligibility
    E_t = Σ_{k≤t} w(t,k)·g(logp_k), g(x) = 1 + sigmoid(x − 1), not detached (the co-author's code; the paper's g is
    unknown). Same arguments (cfg: a LambdaConfig) and returns as grpo_lambda_token_loss (z: the trace of the
    log-ratio, no gradient).
    trace_log_ratio: grpo_lambda.py's (the package does not import a script)."""
    if args.trace_apply == "trace":
        return method_loss

    def weighted(logp, old_logp, adv, mask, cfg):
        trace = (mask, cfg.lam, cfg.gamma, cfg.style)
        x = logp - old_logp
        z = trace_log_ratio(x.detach(), *trace)
        ratio = torch.exp(x.clamp(-cfg.max_log_ratio, cfg.max_log_ratio))  # GRPO's ratio
        clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
        loss = -torch.min(ratio * adv, clipped * adv)
        return loss * trace_log_ratio(1 + torch.sigmoid(logp - 1), *trace), ratio, z

    return weighted

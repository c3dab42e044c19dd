"""SC-GRPO's ablation of ours (not the paper's), an extra loaded with --divergence sampled-logratio: D from the sampled
token, the teacher's log-prob minus the student's, signed by the row's advantage, as on-policy distillation uses, in
place of the paper's KL over the vocabulary (docs/sc_grpo.md, Ablations: the results rate it below the KL). The sc/kl_*
metrics then describe the unsigned log-ratio (the sign is applied where f is made, `signed_first`)."""

from __future__ import annotations

import torch

from rlvr_utils.logprob_kernels import FusedLinearLogProb


def sampled_logratio(teacher_out, targets, student_logp, lm, temperature: float, positions: int) -> torch.Tensor:
    """delta [r, T] = log pi_teacher(o_t) - log pi(o_t) of the sampled tokens `targets` [r, T], no gradient: the
    teacher's final hidden states through the lm_head `lm` (fused), or its logits (lm None); student_logp [r, T], the
    student's log-probs (detached). teacher.logprobs_and_kl's `divergence`."""
    with torch.no_grad():
        if lm is not None:
            flat = (teacher_out.flatten(0, 1), lm.weight, lm.bias, targets.flatten())
            lt = FusedLinearLogProb.apply(*flat, temperature, positions, False)[0].view(targets.shape)
        else:
            zt = teacher_out.float() / temperature
            lt = zt.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(zt, dim=-1)
        return lt - student_logp


def signed_logratio(delta: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """D = relu(sign(A) * delta), delta [n, T] = log pi_teacher(o_t) - log pi(o_t), adv [n] the rows' GRPO advantages:
    A < 0 weighs the tokens the teacher finds less likely than the student (where a failed rollout left the verified
    path), A > 0 the more likely, A = 0 (solve-none) |delta|. Returns [n, T] >= 0."""
    sign = torch.sign(adv).to(delta)[:, None]
    return torch.where(sign == 0, delta.abs(), torch.relu(sign * delta))


def signed_first(f_and_bonus):
    """sc_grpo.py's f_and_bonus(D, active, role, group_ids, adv) on D = signed_logratio(D, A), A the rows' advantages
    (adv [n, T] holds each row's GRPO advantage in every column before the bonus is added)."""

    def signed(D, active, role, group_ids, adv):
        return f_and_bonus(signed_logratio(D, adv[:, 0]), active, role, group_ids, adv)

    return signed

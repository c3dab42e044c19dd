"""Token log-probs from the model's own logits, for a model whose logits are not lm_head(final hidden states)
(soft-capped or scaled, e.g. Gemma-2's; logprob_kernels.fused_logprobs_ok decides): the fallback of
common.token_logprobs and SC-GRPO's teacher, imported only for such a model. The lm_head runs on the completion
positions only (`logits_to_keep`), and log p(y) = z[y]/tau - logsumexp(z/tau) is taken in fp32 a few positions at a
time.

  logprobs            common.token_logprobs' unfused path for one chunk of rows
  completion_logits   the model's logits [b, T, V] at the positions predicting the completion
  SelectedLogProb     log-probs from those logits (any dtype) without autograd's fp32 copies
  entropy_from_logits per-position entropy, a few positions at a time
  logits_kl           SC-GRPO's D = KL(teacher || student) from both sides' logits, a few positions at a time
"""

from __future__ import annotations

import torch

from rlvr_utils.core.logprob_kernels import right_padded


def logprobs(model, ids, mask, T: int, temperature: float, with_entropy: bool, entropy_chunk: int = 128, keep=None):
    """log p [b, T] of each row's last T tokens and, with `with_entropy`, the entropy [b, T] (else None); `keep`: a
    list that gets the logits [b, T, V] (with their gradient: the student's side of SC-GRPO's D)."""
    logits = completion_logits(model, ids, mask, T)  # [b, T, V]
    if keep is not None:
        keep.append(logits)
    chunk = max(1, 2**24 // (logits.shape[0] * logits.shape[2]))  # fp32 temporaries ~64 MB
    logp = SelectedLogProb.apply(logits, ids[:, -T:], temperature, chunk)
    return logp, entropy_from_logits(logits, entropy_chunk, temperature) if with_entropy else None


class SelectedLogProb(torch.autograd.Function):
    """log p(y_t) = z_t[y_t]/tau - logsumexp(z_t/tau) from logits z [b, T, V] in any dtype, computed in fp32
    `chunk` positions at a time. It keeps only z (the model's own output, in its dtype) and the [b, T]
    logsumexp for the backward, which rebuilds softmax chunk by chunk: d log p / d z_j = (1[j = y] - p_j) / tau.
    Autograd's gather - logsumexp would keep an fp32 copy of z per op instead."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, temperature: float, chunk: int) -> torch.Tensor:
        b, T, _ = logits.shape
        out = torch.empty(b, T, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for t in range(0, T, chunk):
            z = logits[:, t : t + chunk].float() / temperature
            lse[:, t : t + chunk] = torch.logsumexp(z, -1)
            out[:, t : t + chunk] = z.gather(-1, target[:, t : t + chunk, None]).squeeze(-1) - lse[:, t : t + chunk]
        ctx.save_for_backward(logits, target, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for t in range(0, logits.shape[1], chunk):
            g_out = grad_out[:, t : t + chunk, None].float()
            g = torch.exp(logits[:, t : t + chunk].float() / tau - lse[:, t : t + chunk, None]).mul_(-g_out)
            g.scatter_add_(-1, target[:, t : t + chunk, None], g_out)
            grad[:, t : t + chunk] = g.div_(tau).to(grad.dtype)
        return grad, None, None, None


def completion_logits(model, ids: torch.Tensor, mask: torch.Tensor, T: int) -> torch.Tensor:
    """Logits [b, T, V] (model dtype) predicting the last T tokens of each row (rows laid out by
    `right_padded`): the lm_head runs only on the columns from the first to the last kept one
    (`logits_to_keep`; exactly T columns when the rows' prompts have the same length, as within a group)."""
    ids, mask, pos, keep = right_padded(ids, mask, T)
    lo, hi = int(keep[:, 0].min()), int(keep[:, -1].max()) + 1
    window = torch.arange(lo, hi, device=ids.device)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=window).logits
    if hi - lo == T:  # every row's window starts at the same column: no copy
        return logits
    return logits.gather(1, (keep - lo)[:, :, None].expand(-1, -1, logits.shape[-1]))


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, chunk: int = 128, temperature: float = 1.0) -> torch.Tensor:
    """Entropy [b, T] (nats, no gradient) of softmax(logits [b, T, V] / temperature) in fp32, `chunk`
    positions at a time so only a [b, chunk, V] softmax exists at once."""
    out = []
    for t in range(0, logits.shape[1], chunk):
        z = logits[:, t : t + chunk].detach().float() / temperature
        out.append(torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1))
    return torch.cat(out, dim=1)


def logits_kl(zs, zt, targets, lm, temperature: float, chunk: int = 128) -> torch.Tensor:
    """SC-GRPO's D [r, T] = KL(softmax(zt / tau) || softmax(zs / tau)) per position from the student's and the teacher's
    logits [r, T, V] (teacher.teacher_kl on such a model; targets, lm: unused), in fp32 `chunk` positions at a time:
    sc_grpo.token_kl's equation, with its gradient toward the student where zs has one."""
    out = []
    for t in range(0, zs.shape[1], chunk):
        lt = torch.log_softmax(zt[:, t : t + chunk].float() / temperature, -1)
        ls = torch.log_softmax(zs[:, t : t + chunk].float() / temperature, -1)
        out.append((lt.exp() * (lt - ls)).sum(-1))
    return torch.cat(out, 1)

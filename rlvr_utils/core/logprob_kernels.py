"""What `common.token_logprobs` is built on: log p(y) = z[y]/tau - logsumexp(z/tau) in fp32 without the [B, T, V]
fp32 tensors autograd would keep, on a padded batch laid out so that attention never sees an all-padding row.

  right_padded        the training forward's layout: each row's left padding rotated to its end
  completion_hidden   final hidden states at the positions that predict the completion (the fused path's input)
  FusedLinearLogProb  straight from the final hidden states and the lm_head weight: no [B, T, V] logits at all
  fused_logprobs_ok   whether a model may take the fused path (checked once per model against its own logits)
  (models whose logits are not lm_head(h), e.g. soft-capped: rlvr_utils/extras/unfused.py, from the model's own logits)
  MAX_LOG_RATIO       the clamp of log pi - log pi_old before exp (the scripts' ratio, the vLLM correction)
"""

from __future__ import annotations

import torch

MAX_LOG_RATIO = 20.0  # log pi - log pi_old is clamped to +-this (fp32) before exp, as verl and OpenRLHF do
ROWS_PER_FORWARD = 8  # rows per forward where [b, T, V] logits exist (the unfused path; FSDP's even forwards)
TOKENS_PER_FORWARD = 2**14  # the fused path's forwards: as many rows as fit this many tokens (one launch-bound pass
# per micro-batch instead of one per 8 rows: the update's matmuls get large enough to run near the device's peak)


def rows_per_forward(shape: torch.Size, fused: bool) -> int:
    """Rows of a [B, L] batch per model forward in the log-prob passes: ROWS_PER_FORWARD where logits exist, else
    TOKENS_PER_FORWARD // L, never fewer (so a micro-batch of at most ROWS_PER_FORWARD rows is one forward). With a
    gradient the micro-batch's activations live until its backward anyway: this bounds the no-grad passes' temporaries
    (old and reference log-probs)."""
    return max(ROWS_PER_FORWARD, TOKENS_PER_FORWARD // shape[1]) if fused else ROWS_PER_FORWARD


def add_linear_grads(g, h, weight, start: int, grad_h, grad_w, grad_b) -> None:
    """Back through z = W h (+ b) for one chunk of positions: given dL/dz g [n, V] (fp32) and the chunk's h [n, H],
    write dL/dh into grad_h[start : start + n] and add dL/dW, dL/db into grad_w, grad_b (each None when not needed)."""
    if grad_h is not None:
        grad_h[start : start + g.shape[0]] = g.to(weight.dtype) @ weight
    if grad_w is not None:
        grad_w.addmm_(g.t(), h.float())
    if grad_b is not None:
        grad_b += g.sum(0)


class FusedLinearLogProb(torch.autograd.Function):
    """log p(y_n) = z_n[y_n]/tau - logsumexp(z_n/tau) with z_n = W h_n (+ b), computed straight from the final
    hidden states h [N, H] and the lm_head W [V, H], `chunk` positions at a time: no [N, V] logits tensor
    ever exists, forward or backward (only a [chunk, V] one). The backward recomputes each chunk's logits
    (one extra lm_head matmul) and forms dz = (1[j = y] - p_j) g / tau, then dh = dz W and dW += dz^T h
    (accumulated in fp32). Optionally returns each position's entropy (no gradient) from the same logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, temperature: float, chunk: int, with_entropy: bool):
        N = hidden.shape[0]
        out = torch.empty(N, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        ent = torch.empty_like(out) if with_entropy else out.new_empty(0)
        for s in range(0, N, chunk):
            z = torch.nn.functional.linear(hidden[s : s + chunk], weight, bias).float().div_(temperature)
            lse[s : s + chunk] = torch.logsumexp(z, -1)
            out[s : s + chunk] = z.gather(-1, target[s : s + chunk, None]).squeeze(-1) - lse[s : s + chunk]
            if with_entropy:
                p = torch.exp(z - lse[s : s + chunk, None])
                ent[s : s + chunk] = lse[s : s + chunk] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_ent):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h, g_out = hidden[s : s + chunk], grad_out[s : s + chunk, None].float()
            z = torch.nn.functional.linear(h, weight, bias).float().div_(tau)
            g = z.sub_(lse[s : s + chunk, None]).exp_().mul_(-g_out)  # in place: -p g
            g.scatter_add_(-1, target[s : s + chunk, None], g_out).div_(tau)  # (1[j = y] - p) g / tau
            add_linear_grads(g, h, weight, s, grad_h, grad_w, grad_b)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def unwrap(model):
    return getattr(model, "module", model)  # DistributedDataParallel keeps the model in .module


def fused_logprobs_ok(model) -> bool:
    """Whether `token_logprobs` may use `FusedLinearLogProb` for this model: its output embedding is a plain
    Linear whose output *is* the logits. Checked once per model against the model's own logits on a short
    random sequence (this catches soft-capped or scaled logits, e.g. Gemma-2's). The answer is cached on the model.
    Under FSDP too: the root's weights (lm_head's among them) stay gathered from its forward until its backward, and
    the kernels read `lm.weight` only after the forward, so they get the whole matrix and its gradient is sharded
    with the root's (tests/test_dist.py, tied and untied embeddings)."""
    inner = unwrap(model)
    cached = getattr(inner, "_rlvr_fused_ok", None)
    if cached is not None:
        return cached
    ok = False
    lm = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if isinstance(lm, torch.nn.Linear):
        ids = torch.randint(0, lm.out_features, (1, 12), generator=torch.Generator().manual_seed(0)).to(
            lm.weight.device
        )
        try:  # e.g. a quantized Linear subclass whose weight F.linear cannot use: the unfused path
            with torch.no_grad():
                out = inner(input_ids=ids, output_hidden_states=True)
                want = out.logits[0].float()
                got = torch.nn.functional.linear(out.hidden_states[-1][0], lm.weight, lm.bias).float()
            ok = got.shape == want.shape and bool(
                torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item() + 1e-6)
            )
        except (RuntimeError, TypeError, ValueError, IndexError):
            ok = False
    inner._rlvr_fused_ok = ok
    return ok


def right_padded(
    ids: torch.Tensor, mask: torch.Tensor, T: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training-forward layout of a left-padded batch: each row rotated so that its left padding moves to
    the end (prompt + completion first, then every pad), and columns that are padding in every row dropped.

    Why: a left-pad position is a query row that may attend to no key at all (causal mask + padding mask).
    Fused attention kernels may return NaN for such a row in bf16/fp16 (cuDNN's backward did, at some
    lengths), and a NaN at a pad position reaches the real ones through the next layer's values. After the
    rotation every query row sees at least the row's first token, whatever the attention implementation.
    Position ids come from the mask, so every real token keeps the position `generate` gave it.

    ids, mask: [b, L], each row [left pads][tokens, possibly followed by pads]. Returns ids and mask [b, L'],
    position ids [b, L'] and keep [b, T]: the columns whose outputs predict each row's last T tokens of the
    original layout (the last prompt token and completion tokens 0..T-2)."""
    L = ids.shape[1]
    shift = (mask.long().cumsum(1) == 0).sum(1)  # [b] leading pads
    if bool((shift == L).any()):
        raise ValueError("a row of the batch has no token (its attention mask is all 0)")
    cols = torch.arange(L, device=ids.device)
    idx = (cols[None, :] + shift[:, None]) % L  # rotate left by the row's number of leading pads
    width = L - int(shift.min())  # the longest row: later columns are padding in every row
    ids, mask = ids.gather(1, idx)[:, :width], mask.gather(1, idx)[:, :width]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    keep = (L - T - 1 - shift)[:, None] + cols[None, :T]
    return ids, mask, pos, keep


def completion_hidden(model, ids: torch.Tensor, mask: torch.Tensor, T: int) -> torch.Tensor:
    """Final (normed) hidden states [b, T, H] at the positions predicting the last T tokens of each row
    (rows laid out by `right_padded`); the lm_head runs on no position at all."""
    ids, mask, pos, keep = right_padded(ids, mask, T)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True, use_cache=False,
                logits_to_keep=keep[0, :0])  # fmt: skip
    h = out.hidden_states[-1]
    return h.gather(1, keep[:, :, None].expand(-1, -1, h.shape[-1]))

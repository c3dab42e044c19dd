"""The plumbing of SC-GRPO's self-conditioned teacher (sc_grpo.py holds its prompt, its roles and the per-token KL;
docs/sc_grpo.md; arXiv 2606.18810).

fit_reference           the first reference whose teacher prompt fits the context, else one with its middle cut
logprobs_and_kl         the student's log-probs with D = KL(teacher || student) per token from one extra no-grad forward
                        (memory-bounded: fused through the lm_head, or sc_grpo.token_kl a few positions at a time)
micro_batches_of_groups whole groups per micro-batch (c is a micro-batch's percentile, paper §5.1)
TeacherLog              the step's D, f, teacher time and memory, as the sc/* metrics
FusedLinearKL           KL(teacher || student) per position from both sides' final hidden states: no [b, T, V]
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from rlvr_utils import logprob_kernels, runtime
from rlvr_utils.rollouts import pad_left


class FusedLinearKL(torch.autograd.Function):
    """D_n = KL(p^T_n || p^S_n) = sum_v p^T (log p^T - log p^S) over the full vocabulary,
    p = softmax(W h_n (+ b) / tau),
    straight from the student's and the teacher's final hidden states [N, H] (the same positions of the same tokens)
    and the lm_head W [V, H], `chunk` positions at a time: only [chunk, V] temporaries exist, forward or backward.
    The teacher is a constant (stop-gradient: nothing reaches its hidden states, nor W through its side). The
    backward recomputes both chunks' log-softmaxes and forms dD/dz^S = (p^S - p^T) / tau, then dh^S = dz W and
    dW += dz^T h^S (accumulated in fp32). Under no_grad it is a chunked, no-gradient KL (SC-GRPO's weights)."""

    @staticmethod
    def log_softmax(hidden, weight, bias, temperature: float) -> torch.Tensor:
        """log softmax(W h (+ b) / tau) over the vocabulary, fp32, for a chunk of positions h [n, H]: [n, V]."""
        return torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias).float().div_(temperature), -1)

    @staticmethod
    def forward(ctx, student, teacher, weight, bias, temperature: float, chunk: int):
        out = torch.empty(student.shape[0], dtype=torch.float32, device=student.device)
        for s in range(0, student.shape[0], chunk):
            ls = FusedLinearKL.log_softmax(student[s : s + chunk], weight, bias, temperature)
            lt = FusedLinearKL.log_softmax(teacher[s : s + chunk], weight, bias, temperature)
            pt = lt.exp()
            out[s : s + chunk] = (pt * lt.sub_(ls)).sum(-1)
        ctx.save_for_backward(student, teacher, weight, bias)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        student, teacher, weight, bias = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        need_h, _, need_w, need_b = ctx.needs_input_grad[:4]
        grad_h = torch.empty_like(student) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for s in range(0, student.shape[0], chunk):
            h = student[s : s + chunk]
            g = FusedLinearKL.log_softmax(h, weight, bias, tau).exp_()
            g.sub_(FusedLinearKL.log_softmax(teacher[s : s + chunk], weight, bias, tau).exp_()).mul_(
                grad_out[s : s + chunk, None].float() / tau
            )
            logprob_kernels.add_linear_grads(g, h, weight, s, grad_h, grad_w, grad_b)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, None, grad_w, grad_b, None, None


def fit_reference(tokenizer, make_prompt: Callable, taus: list[str], limit: int, max_ref_tokens: int):
    """(teacher prompt ids or None, what happened) for the first reference in `taus` whose prompt, make_prompt(tau),
    has at most `limit` tokens and which itself has at most `max_ref_tokens`: "drawn" (the first one), "tau_resampled"
    (another); else the first one with its middle cut to fit ("tau_truncated", 8 tokens spare for the "..." marker),
    or None ("no_reference") when even that does not fit."""
    n_tok = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    for k, tau in enumerate(taus):
        ids = make_prompt(tau)
        if len(ids) <= limit and n_tok(tau) <= max_ref_tokens:
            return ids, "tau_resampled" if k else "drawn"
    tau = tokenizer(taus[0], add_special_tokens=False).input_ids  # nothing fits: keep the head and tail of the first
    keep = min(max_ref_tokens, len(tau) - max(len(make_prompt(taus[0])) - limit, 0)) - 8
    cut = tokenizer.decode(tau[: keep // 2]) + "\n...\n" + tokenizer.decode(tau[len(tau) - (keep - keep // 2) :])
    ids = make_prompt(cut) if keep > 0 else None
    return (ids, "tau_truncated") if ids is not None and len(ids) <= limit else (None, "no_reference")


def micro_batches_of_groups(
    rows: torch.Tensor, group_ids: torch.Tensor, group_size: int, micro_batch_size: int, whole_groups: bool = True
) -> list[torch.Tensor]:
    """Micro-batches of a mini-batch's rows (in order): whole groups, micro_batch_size // G of them per micro-batch
    (c is a micro-batch's percentile and a solve-none group is z-scored together); whole_groups False: grpo.py's."""
    if not whole_groups:
        return list(rows.split(micro_batch_size))
    ids = group_ids[rows.cpu()].tolist()
    units = [rows[[i for i, g in enumerate(ids) if g == u]] for u in dict.fromkeys(ids)]
    per = max(1, micro_batch_size // group_size)
    return [torch.cat(units[u : u + per]) for u in range(0, len(units), per)]


def logprobs_and_kl(
    model, input_ids, attention_mask, T: int, temperature: float = 1.0, teacher_prompts=None, pad_id: int = 0,
    with_entropy: bool = False, kl_grad: bool = False, chunk_size: int | None = None,
    time_chunk: int = 128, fused: bool | None = None, dist=None, divergence: Callable | None = None,
    kl_fn: Callable | None = None,
):  # fmt: skip
    """common.token_logprobs (the same operations on the same row chunks, so the same numbers) that also returns
    D [B, T], KL(teacher || student) at each completion position, for the rows with a `teacher_prompts[i]` (ids;
    elsewhere 0). The teacher is the same model under no_grad fed teacher_prompts[i] + the row's completion; the
    student side is this forward's own output (detached unless `kl_grad`): the only extra work is the teacher forward.
    fused (default: logprob_kernels.fused_logprobs_ok(model)): no [b, T, V] tensor exists. The student's final hidden
    states feed FusedLinearLogProb, and the same states and the teacher's go through the lm_head a few positions at
    a time in FusedLinearKL (extra memory O(positions x V); with `kl_grad` its backward recomputes them the same way).
    fused=False: the fp32 logits [b, T, V] of each row chunk, with gradient, and the teacher's, through `kl_fn`
    (sc_grpo.token_kl: D from logits) `time_chunk` positions at a time (models whose logits are not lm_head(h)).
    `dist` (FSDP): a chunk where any rank has a teacher row runs a teacher forward on every rank (an idle one,
    discarded, where it has none). Returns logp, entropy (or None), D, and the teacher pass's {"seconds",
    "peak_bytes": the step's peak GPU memory so far when the last teacher pass ended (CUDA; 0 on CPU)}. `divergence`
    (an ablation's, sc_ablations.sampled_logratio): D = divergence(teacher's output, targets, student's log-probs,
    lm_head or None, temperature, positions), under no_grad, instead of the KL.
    """
    fused = logprob_kernels.fused_logprobs_ok(model) if fused is None else fused
    unfused = None if fused else runtime.extra("unfused", "a model whose logits are not lm_head(h)")
    chunk_size = chunk_size or logprob_kernels.rows_per_forward(input_ids.shape, fused)
    lm = logprob_kernels.unwrap(model).get_output_embeddings() if fused else None
    positions = max(1, 2**25 // lm.out_features) if fused else 0  # as common.token_logprobs: [positions, V] fp32
    logps, ents, kls, cost = [], [], [], {"seconds": 0.0, "peak_bytes": 0}
    for s in range(0, input_ids.shape[0], chunk_size):
        ids, mask = input_ids[s : s + chunk_size], attention_mask[s : s + chunk_size]
        if fused:
            out = logprob_kernels.completion_hidden(model, ids, mask, T)  # [b, T, H], with gradient
            lp, ent = logprob_kernels.FusedLinearLogProb.apply(
                out.flatten(0, 1), lm.weight, lm.bias, ids[:, -T:].flatten(), temperature, positions, with_entropy
            )
            logps.append(lp.view(ids.shape[0], T))
            ents.extend([ent.view(ids.shape[0], T)] if with_entropy else [])
        else:
            out = unfused.completion_logits(model, ids, mask, T).float() / temperature  # [b, T, V] fp32, grad
            logps.append(out.gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(out, dim=-1))
            ents.extend([unfused.entropy_from_logits(out)] if with_entropy else [])
        D = torch.zeros(ids.shape[0], T, device=ids.device)
        rows = [r for r in range(ids.shape[0]) if teacher_prompts is not None and teacher_prompts[s + r] is not None]
        teacher = logprob_kernels.completion_hidden if fused else unfused.completion_logits
        if dist is not None and dist.any(bool(rows)) and not rows:
            with torch.no_grad():  # FSDP: another rank runs its teacher on this chunk; this one an idle forward
                teacher(model, ids[:1], mask[:1], T)
        if rows:
            t0 = time.time()
            tp, tm = pad_left([teacher_prompts[s + r] for r in rows], pad_id, ids.device)
            tids, tmask = torch.cat([tp, ids[rows, -T:]], 1), torch.cat([tm, mask[rows, -T:]], 1)
            with torch.no_grad():  # the teacher: stop-gradient
                zt = teacher(model, tids, tmask, T)  # [r, T, H] or [r, T, V]
            idx = torch.tensor(rows, device=ids.device)
            zs = out[idx] if kl_grad else out.detach()[idx]
            with torch.set_grad_enabled(kl_grad and torch.is_grad_enabled()):
                if divergence is not None:  # an ablation's D (no gradient)
                    with torch.no_grad():
                        student = logps[-1].detach()[idx]
                        kl = divergence(zt, ids[rows, -T:], student, lm if fused else None, temperature, positions)
                elif fused:  # [positions, V] fp32 temporaries of about 64 MB
                    both, kl_positions = (zs.flatten(0, 1), zt.flatten(0, 1)), max(1, 2**24 // lm.out_features)
                    kl = FusedLinearKL.apply(*both, lm.weight, lm.bias, temperature, kl_positions).view(len(rows), T)
                else:
                    if kl_fn is None:
                        raise ValueError("logprobs_and_kl: the unfused path needs kl_fn (sc_grpo.token_kl)")
                    cuts = [slice(t, t + time_chunk) for t in range(0, T, time_chunk)]
                    kl = torch.cat([kl_fn(zt[:, c].float() / temperature, zs[:, c]) for c in cuts], 1)
                D = D.index_put((idx,), kl)
            del zt
            cost["seconds"] += time.time() - t0
            cost["peak_bytes"] = max(cost["peak_bytes"], torch.cuda.max_memory_allocated() if ids.is_cuda else 0)
        kls.append(D)
        del out
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None), torch.cat(kls), cost


class TeacherLog:
    """The step's D and f over its weighted tokens, in the order they were computed, and the teacher pass's seconds and
    CUDA peak: the sc/* metrics (docs/sc_grpo.md, Logs). All are 0 in a step with no weighted token."""

    def __init__(self):
        self.kl, self.f, self.seconds, self.peak = [], [], 0.0, 0

    def add(self, D=None, f=None, active=None, cost: dict | None = None) -> None:
        """D, f [n, T] of some rows (None: not computed there) on `active` [n, T], their weighted tokens; cost: a
        teacher pass's {"seconds", "peak_bytes"} (logprobs_and_kl's)."""
        self.kl += [D.detach()[active.bool()].cpu()] if D is not None else []
        self.f += [f[active.bool()].cpu()] if f is not None else []
        if cost is not None:
            self.seconds, self.peak = self.seconds + cost["seconds"], max(self.peak, cost["peak_bytes"])

    def metrics(self, modes: list[str], bad: dict, texts: list[str], device: torch.device) -> dict:
        """D's mean, P75 and P95 and f's mean, each group mode's share, the teacher's time (and CUDA peak), the
        bad-input counts of build_teachers and the empty completions."""
        kl, f = torch.cat(self.kl + [torch.zeros(0)]), torch.cat(self.f + [torch.zeros(0)])
        q = np.percentile(kl.numpy(), [75, 95]).tolist() if len(kl) else [0.0, 0.0]  # (no 2^24 size limit)
        out = {
            "sc/kl_mean": kl.mean().item() if len(kl) else 0.0,
            "sc/kl_p75": q[0],
            "sc/kl_p95": q[1],
            "sc/weight_mean": f.mean().item() if len(f) else 0.0,
            "time/teacher": self.seconds,
            **{f"sc/groups_{k}": modes.count(k) / len(modes) for k in ("partial", "none", "single", "all", "plain")},
            **bad,
            "sc/empty_completions": sum(not t.strip() for t in texts),
        }
        return out | ({"memory/teacher_peak_gb": self.peak / 2**30} if device.type == "cuda" else {})

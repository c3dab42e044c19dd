"""SC-GRPO's teacher and its plumbing (sc_grpo.py holds its prompt, its roles and the per-token KL; docs/sc_grpo.md;
arXiv 2606.18810).

teacher_kl              D = KL(teacher || student) per token: the student's side from the loss's own forward
                        (common.token_logprobs' `keep`), the teacher's from one no-grad forward, through the lm_head
FusedLinearKL           that KL from both sides' final hidden states, a few positions at a time: no [b, T, V] tensor
TeacherLog              the step's D, f, teacher time and memory, as the sc/* metrics
default_system_message  what a chat template adds when a conversation has no system message: the teacher keeps it
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from rlvr_utils.core import logprob_kernels, runtime, tasks


def default_system_message(tokenizer) -> str:
    """The system message a chat template puts in front of a conversation that has none (Qwen2.5's "You are Qwen,
    created by Alibaba Cloud. ..."), '' when it adds none: the template rendered with a probe system message and
    without one differs exactly there; '' for a tokenizer without a chat template."""
    if not tasks.has_chat_template(tokenizer):
        return ""
    probe, user = "\u2063sc-grpo-probe\u2063", [{"role": "user", "content": "x"}]
    plain = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    with_probe = tokenizer.apply_chat_template(
        [{"role": "system", "content": probe}] + user, add_generation_prompt=True, tokenize=False
    )
    head = len(os.path.commonprefix([plain, with_probe]))
    tail = len(os.path.commonprefix([plain[head:][::-1], with_probe[head:][::-1]]))
    return plain[head : len(plain) - tail] if with_probe[head : len(with_probe) - tail] == probe else ""


def teacher_kl(model, student: list, input_ids, attention_mask, T: int, teacher_prompts: list, temperature: float = 1.0,
               pad_id: int = 0, kl_grad: bool = False, dist=None, divergence: Callable | None = None):  # fmt: skip
    """D [B, T] = KL(teacher || student) at each completion position of the rows with a `teacher_prompts[i]` (ids;
    None: no teacher, D = 0), and the teacher pass's {"seconds", "peak_bytes": the step's CUDA peak so far}.
    student: common.token_logprobs' `keep` for these rows, each row chunk's final hidden states [b, T, H], with their
    gradient (`kl_grad`: D's gradient reaches the student only). The teacher is the same model under no_grad fed
    teacher_prompts[i] + the row's completion; both sides go through the lm_head a few positions at a time
    (FusedLinearKL). A model whose logits are not lm_head(h): its logits (unfused.logits_kl). `divergence(zs, zt,
    targets, lm, temperature)`: an ablation's D instead (sc_ablations.sampled_logratio). `dist` (FSDP): a rank with
    no teacher row where another has one runs an idle teacher forward (distributed.py)."""
    fused = logprob_kernels.fused_logprobs_ok(model)
    unfused = None if fused else runtime.extra("unfused", "a model whose logits are not lm_head(h)")
    lm = logprob_kernels.unwrap(model).get_output_embeddings() if fused else None
    forward = logprob_kernels.completion_hidden if fused else unfused.completion_logits  # [r, T, H] or [r, T, V]
    divergence = divergence or (FusedLinearKL.of if fused else unfused.logits_kl)
    out, cost, start = [], {"seconds": 0.0, "peak_bytes": 0}, 0
    for zs in student:  # common.token_logprobs' row chunks
        ids, mask = input_ids[start : start + len(zs)], attention_mask[start : start + len(zs)]
        prompts = teacher_prompts[start : start + len(zs)]
        rows, start = [r for r, p in enumerate(prompts) if p is not None], start + len(zs)
        out.append(torch.zeros(len(zs), T, device=ids.device))  # [b, T], 0 on a row with no teacher
        if dist is not None:
            dist.idle_forward(bool(rows), lambda: forward(model, ids[:1], mask[:1], T))
        if not rows:
            continue
        t0 = time.time()
        tp = [torch.tensor(prompts[r], device=ids.device) for r in rows]  # the teacher prompts, left-padded
        tm = pad_sequence([torch.ones_like(p) for p in tp], batch_first=True, padding_side="left")
        tp = pad_sequence(tp, batch_first=True, padding_value=pad_id, padding_side="left")
        with torch.no_grad():  # the teacher: stop-gradient
            zt = forward(model, torch.cat([tp, ids[rows, -T:]], 1), torch.cat([tm, mask[rows, -T:]], 1), T)
        with torch.set_grad_enabled(kl_grad and torch.is_grad_enabled()):
            zr = zs[rows] if kl_grad else zs.detach()[rows]
            idx = torch.tensor(rows, device=ids.device)
            out[-1] = out[-1].index_put((idx,), divergence(zr, zt, ids[rows, -T:], lm, temperature))
        cost["seconds"] += time.time() - t0
        cost["peak_bytes"] = max(cost["peak_bytes"], torch.cuda.max_memory_allocated() if ids.is_cuda else 0)
    return torch.cat(out), cost


class FusedLinearKL(torch.autograd.Function):
    """D_n = KL(p^T_n || p^S_n) = sum_v p^T (log p^T - log p^S) over the full vocabulary,
    p = softmax(W h_n (+ b) / tau),
    straight from the student's and the teacher's final hidden states [N, H] (the same positions of the same tokens)
    and the lm_head W [V, H], `chunk` positions at a time: only [chunk, V] temporaries exist, forward or backward.
    The teacher is a constant (stop-gradient: nothing reaches its hidden states, nor W through its side). The
    backward recomputes both chunks' log-softmaxes and forms dD/dz^S = (p^S - p^T) / tau, then dh^S = dz W and
    dW += dz^T h^S (accumulated in fp32). Under no_grad it is a chunked, no-gradient KL (SC-GRPO's weights)."""

    @staticmethod
    def of(zs, zt, targets, lm, temperature: float) -> torch.Tensor:
        """D [r, T] from the student's and the teacher's final hidden states [r, T, H] through the lm_head `lm`, with
        [positions, V] fp32 temporaries of about 64 MB (teacher_kl's default `divergence`)."""
        both, positions = (zs.flatten(0, 1), zt.flatten(0, 1)), max(1, 2**24 // lm.out_features)
        return FusedLinearKL.apply(*both, lm.weight, lm.bias, temperature, positions).view(targets.shape)

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


class TeacherLog:
    """The step's D and f over its weighted tokens, in the order they were computed, and the teacher pass's seconds and
    CUDA peak: the sc/* metrics (docs/sc_grpo.md, Logs). All are 0 in a step with no weighted token."""

    def __init__(self):
        self.kl, self.f, self.seconds, self.peak = [], [], 0.0, 0

    def add(self, D=None, f=None, active=None, cost: dict | None = None) -> None:
        """D, f [n, T] of some rows (None: not computed there) on `active` [n, T], their weighted tokens; cost: a
        teacher pass's {"seconds", "peak_bytes"} (teacher_kl's)."""
        self.kl += [D.detach()[active.bool()].cpu()] if D is not None else []
        self.f += [f[active.bool()].cpu()] if f is not None else []
        if cost is not None:
            self.seconds, self.peak = self.seconds + cost["seconds"], max(self.peak, cost["peak_bytes"])

    def metrics(self, modes: list[str], bad: dict, texts: list[str], device: torch.device) -> dict:
        """D's mean, P75 and P95 and f's mean, each group mode's share, the teacher's time (and CUDA peak), the
        bad-input counts of build_teachers and the empty completions."""
        kl, f = torch.cat(self.kl + [torch.zeros(0)]), torch.cat(self.f + [torch.zeros(0)])
        p75, p95 = np.percentile(kl.numpy(), [75, 95]).tolist() if len(kl) else [0.0, 0.0]  # (no 2^24 limit)
        out = {"sc/kl_mean": kl.mean().item() if len(kl) else 0.0, "sc/kl_p75": p75, "sc/kl_p95": p95}
        out |= {"sc/weight_mean": f.mean().item() if len(f) else 0.0, "time/teacher": self.seconds}
        out |= {f"sc/groups_{k}": modes.count(k) / len(modes) for k in ("partial", "none", "single", "all", "plain")}
        out |= {**bad, "sc/empty_completions": sum(not t.strip() for t in texts)}
        return out | ({"memory/teacher_peak_gb": self.peak / 2**30} if device.type == "cuda" else {})

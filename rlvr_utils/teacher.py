"""SC-GRPO's self-conditioned teacher: its prompt and its forward (sc_grpo.py; docs/sc_grpo.md; arXiv 2606.18810).

Role                    what a row's teacher does to its loss: PLAIN, WEIGHTED, DIVERSITY (solve-none), REFERENCE (o_r)
GUIDE, teacher_prompt   the teacher's prompt: the student's context plus a verified solution tau (paper §1.2, App. E.1)
build_teachers          each routed row's teacher prompt, role and weighted length; bad references resampled or cut
logprobs_and_kl         the student's log-probs with D = KL(teacher || student) per token from one extra no-grad forward
kl_of_every_row         D of the whole batch before the update (--kl-threshold-scope batch)
micro_batches_of_groups whole groups per micro-batch (c is a micro-batch's percentile, paper §5.1)
TeacherLog              the step's D, f, teacher time and memory, as the sc/* metrics
"""

from __future__ import annotations

import enum
import os
import time

import numpy as np
import torch

from rlvr_utils import arith, logprob_kernels, tasks
from rlvr_utils.rollouts import Rollouts, pad_left


class Role(enum.IntEnum):
    """How a row's teacher enters its loss (build_teachers sets it; sc_grpo.weights_and_advantages reads it)."""

    PLAIN = 0  # no teacher: plain GRPO, weight f = 1
    WEIGHTED = 1  # partial-solve (and the single / all ablations): f = D / (D + c) times the GRPO surrogate
    DIVERSITY = 2  # solve-none: weighted as above, plus the bonus alpha * zscore(mean f) on its advantage
    REFERENCE = 3  # solve-none's reference o_r: no loss (weight 0, advantage 0)


GUIDE = (
    "Below is a verified correct solution to this problem. Use it as a reference when reasoning about "
    "the problem.\n\nReference solution:\n"
)  # chat models: the teacher's system message, then tau (docs/sc_grpo.md)


def default_system_message(tokenizer) -> str:
    """The system message a chat template puts in front of a conversation that has none (Qwen2.5's "You are Qwen,
    created by Alibaba Cloud. ..."), '' when it adds none: the template rendered with a probe system message and
    without one differs exactly there."""
    probe, user = "\u2063sc-grpo-probe\u2063", [{"role": "user", "content": "x"}]
    plain = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    with_probe = tokenizer.apply_chat_template(
        [{"role": "system", "content": probe}] + user, add_generation_prompt=True, tokenize=False
    )
    head = len(os.path.commonprefix([plain, with_probe]))
    tail = len(os.path.commonprefix([plain[head:][::-1], with_probe[head:][::-1]]))
    return plain[head : len(plain) - tail] if with_probe[head : len(with_probe) - tail] == probe else ""


def teacher_prompt(tokenizer, task: str, example: tasks.Example, tau: str) -> list[int]:
    """Token ids of the teacher's prompt: the student's full context plus the reference tau (paper §1.2). Chat models:
    the system message is the student's base system message (the template's default, if it has one) + GUIDE + tau,
    and the user turn is the student's. Plain text: "Reference solution:\\n<tau>\\n" + the student's prompt (for
    arith, arith_reference_prompt: the block the tiny model was trained on). A custom task's chat prompt keeps its own
    messages, its system message (or the template's default) followed by GUIDE + tau."""
    tau = tau.strip()
    if example.meta.get("chat"):  # a custom task's messages: the guide and tau join its own system message
        msgs = list(example.meta["prompt"])
        own = msgs.pop(0)["content"] + "\n\n" if msgs[0]["role"] == "system" else ""
        base = own or (default_system_message(tokenizer) + "\n\n" if default_system_message(tokenizer) else "")
        system = [{"role": "system", "content": base + GUIDE + tau}]
        text = tokenizer.apply_chat_template(system + msgs, add_generation_prompt=True, tokenize=False)
    elif "chat" in example.meta:  # a custom task's plain string prompt, seen as it is
        text = f"Reference solution:\n{tau}\n{example.prompt}"
    elif tasks.has_chat_template(tokenizer):
        if not example.user:
            raise ValueError(
                f"example {example.id} has no user turn (Example.user): the chat teacher repeats the student's"
            )
        base = default_system_message(tokenizer)
        text = tasks.render_prompt(
            tokenizer, example.user, example.prompt, system=(base + "\n\n" if base else "") + GUIDE + tau
        )
    elif task == "arith":
        text = arith.arith_reference_prompt(arith.parse_arith_problem(example.question), tau)
    else:
        text = f"Reference solution:\n{tau}\n{example.prompt}"
    return tasks.encode_prompt(tokenizer, text)


def build_teachers(
    tokenizer,
    task: str,
    ro: Rollouts,
    examples,
    correct,
    ref,
    limit: int,
    max_ref_tokens: int,
    generator: torch.Generator,
):
    """Each row's teacher prompt ids (None: no teacher), role, weighted length, and the bad-input counts.
    examples: each group's Example, by group id (Example.id); ref [N]: each row's reference (sc_grpo.route_groups).

    A reference whose teacher prompt exceeds `limit` tokens (the context window minus the completions) or that has
    more than `max_ref_tokens` tokens is replaced by another correct sibling that fits (never the row itself), drawn
    uniformly; failing that, its middle is cut; a row that still does not fit gets no teacher (plain GRPO).
    role [N] (Role): PLAIN (f = 1), WEIGHTED, DIVERSITY (weighted + the solve-none bonus), REFERENCE (o_r: no loss).
    wlen [N]: how many tokens get a weight, |o_i|, or min(|o_i|, |o_r|) in solve-none groups (later tokens get 0).
    role and wlen are on the completions' device.
    """
    n_tok = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    lengths, gids = ro.completion_mask.sum(1).cpu(), ro.group_ids.cpu()
    counts = {"sc/tau_resampled": 0, "sc/tau_truncated": 0, "sc/no_reference": 0}
    prompts, role, wlen = [None] * len(ro), torch.zeros(len(ro), dtype=torch.long), lengths.clone()
    role[(ref < 0) & ~correct & torch.isin(torch.arange(len(ro)), ref)] = Role.REFERENCE  # the solve-none o_r
    for i in (ref >= 0).nonzero().flatten().tolist():
        j = int(ref[i])
        sibs = [
            k for k in (gids == gids[i]).nonzero().flatten().tolist() if correct[j] and correct[k] and k not in (i, j)
        ]
        for k in [j] + [sibs[p] for p in torch.randperm(len(sibs), generator=generator).tolist()]:
            ids = teacher_prompt(tokenizer, task, examples[int(gids[i])], ro.texts[k])
            if len(ids) <= limit and n_tok(ro.texts[k]) <= max_ref_tokens:
                prompts[i] = ids
                counts["sc/tau_resampled"] += k != j
                break
        else:  # nothing fits: keep the head and tail of the drawn reference (8 tokens spare for the "..." marker)
            tau = tokenizer(ro.texts[j], add_special_tokens=False).input_ids
            over = len(teacher_prompt(tokenizer, task, examples[int(gids[i])], ro.texts[j])) - limit
            keep = min(max_ref_tokens, len(tau) - max(over, 0)) - 8
            cut = (
                tokenizer.decode(tau[: keep // 2]) + "\n...\n" + tokenizer.decode(tau[len(tau) - (keep - keep // 2) :])
            )
            ids = teacher_prompt(tokenizer, task, examples[int(gids[i])], cut) if keep > 0 else None
            prompts[i] = ids if ids is not None and len(ids) <= limit else None
            counts["sc/tau_truncated" if prompts[i] is not None else "sc/no_reference"] += 1
        if prompts[i] is not None and correct[j]:  # weighted over all its tokens (wlen = |o_i|)
            role[i] = Role.WEIGHTED
        elif prompts[i] is not None:  # solve-none: weighted over its first min(|o_i|, |o_r|) tokens
            role[i], wlen[i] = Role.DIVERSITY, min(lengths[i], lengths[j])
    return prompts, role.to(ro.completion_mask.device), wlen.to(ro.completion_mask.device), counts


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


def token_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """D = KL(softmax(teacher) || softmax(student)) = sum_v p_T (log p_T - log p_S) over the full vocabulary, fp32.
    Logits [.., V] already divided by the temperature; returns [..]."""
    lt, ls = torch.log_softmax(teacher_logits.float(), -1), torch.log_softmax(student_logits.float(), -1)
    return (lt.exp() * (lt - ls)).sum(-1)


def logprobs_and_kl(
    model,
    input_ids,
    attention_mask,
    T: int,
    temperature: float = 1.0,
    teacher_prompts=None,
    pad_id: int = 0,
    with_entropy: bool = False,
    kl_grad: bool = False,
    chunk_size: int = logprob_kernels.ROWS_PER_FORWARD,
    time_chunk: int = 128,
    fused: bool | None = None,
    dist=None,
    sampled: bool = False,
):
    """common.token_logprobs (the same operations on the same row chunks, so the same numbers) that also returns
    D [B, T], KL(teacher || student) at each completion position, for the rows with a `teacher_prompts[i]` (ids;
    elsewhere 0). The teacher is the same model under no_grad fed teacher_prompts[i] + the row's completion; the
    student side is this forward's own output (detached unless `kl_grad`): the only extra work is the teacher forward.
    fused (default: logprob_kernels.fused_logprobs_ok(model)): no [b, T, V] tensor exists. The student's final hidden
    states feed FusedLinearLogProb, and the same states and the teacher's go through the lm_head a few positions at
    a time in FusedLinearKL (extra memory O(positions x V); with `kl_grad` its backward recomputes them the same way).
    fused=False: the fp32 logits [b, T, V] of each row chunk, with gradient, and the teacher's, log-softmaxed
    `time_chunk` positions at a time (models whose logits are not lm_head(h)). `dist` (FSDP): a chunk where any
    rank has a teacher row runs a teacher forward on every rank (an idle one, discarded, where it has none). Returns
    logp, entropy (or None), D, and the teacher pass's {"seconds", "peak_bytes": the step's peak GPU memory so far
    when the last teacher pass ended (CUDA; 0 on CPU)}. `sampled` (sc_grpo.py's --divergence sampled-logratio, an
    ablation): D is instead the sampled token's log pi_teacher(o_t) - log pi(o_t), detached (no KL is computed).
    """
    fused = logprob_kernels.fused_logprobs_ok(model) if fused is None else fused
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
            out = logprob_kernels.completion_logits(model, ids, mask, T).float() / temperature  # [b, T, V] fp32, grad
            logps.append(out.gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(out, dim=-1))
            ents.extend([logprob_kernels.entropy_from_logits(out)] if with_entropy else [])
        D = torch.zeros(ids.shape[0], T, device=ids.device)
        rows = [r for r in range(ids.shape[0]) if teacher_prompts is not None and teacher_prompts[s + r] is not None]
        teacher = logprob_kernels.completion_hidden if fused else logprob_kernels.completion_logits
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
                if sampled:  # the teacher's log-prob of the sampled token minus the student's, no gradient
                    with torch.no_grad():
                        tgt = ids[rows, -T:]
                        if fused:
                            lt = logprob_kernels.FusedLinearLogProb.apply(
                                zt.flatten(0, 1), lm.weight, lm.bias, tgt.flatten(), temperature, positions, False
                            )[0].view(len(rows), T)
                        else:
                            zt = zt.float() / temperature
                            lt = zt.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(zt, dim=-1)
                        kl = lt - logps[-1].detach()[idx]
                elif fused:  # [positions, V] fp32 temporaries of about 64 MB
                    kl = logprob_kernels.FusedLinearKL.apply(
                        zs.flatten(0, 1),
                        zt.flatten(0, 1),
                        lm.weight,
                        lm.bias,
                        temperature,
                        max(1, 2**24 // lm.out_features),
                    )
                    kl = kl.view(len(rows), T)
                else:
                    kl = torch.cat(
                        [
                            token_kl(zt[:, t : t + time_chunk].float() / temperature, zs[:, t : t + time_chunk])
                            for t in range(0, T, time_chunk)
                        ],
                        1,
                    )
                D = D.index_put((idx,), kl)
            del zt
            cost["seconds"] += time.time() - t0
            cost["peak_bytes"] = max(cost["peak_bytes"], torch.cuda.max_memory_allocated() if ids.is_cuda else 0)
        kls.append(D)
        del out
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None), torch.cat(kls), cost


def kl_of_every_row(
    model,
    ro: Rollouts,
    teachers,
    temperature: float,
    pad_id: int,
    G: int,
    micro_batch_size: int,
    log: TeacherLog,
    sampled: bool = False,
) -> torch.Tensor:
    """D [N, T] of every row under torch.no_grad (--kl-threshold-scope batch: before the update, so that c can be
    taken over the whole batch), in micro-batches of whole groups as the update's; the teacher's cost goes to `log`.
    `sampled`: the sampled token's teacher-minus-student log-prob instead (logprobs_and_kl)."""
    device, T = ro.completion_mask.device, ro.completion_mask.shape[1]
    D, rows = torch.zeros(len(ro), T, device=device), torch.arange(len(ro), device=device)  # D: [N, T]
    with torch.no_grad():
        for mb in micro_batches_of_groups(rows, ro.group_ids.cpu(), G, micro_batch_size):
            prompts = [teachers[i] for i in mb.tolist()]
            _, _, D[mb], cost = logprobs_and_kl(
                model, ro.input_ids[mb], ro.attention_mask[mb], T, temperature, prompts, pad_id, sampled=sampled
            )
            log.add(cost=cost)
    return D


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

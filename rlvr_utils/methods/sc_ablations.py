"""SC-GRPO's ablations (ours, not the paper's method; docs/sc_grpo.md, Ablations), an extra: their flags join
sc_grpo.py's when one is given (cli.parse; `--help` with one of them lists them all), and sc_grpo.py then calls
`set_up` and, with --kl-threshold-scope batch, `f_over_batch` in its step 4.

  --divergence sampled-logratio   D from the sampled token: the teacher's log-prob minus the student's, signed by the
                                  row's advantage (as on-policy distillation), in place of the KL over the vocabulary;
                                  the results rate it below the KL. The sc/kl_* metrics then describe the unsigned
                                  log-ratio (the sign is applied where f is made, `signed_first`)
  --weighted-groups               the groups with a teacher, by n_c: the paper's partial and none, or single / all too
  --kl-threshold-scope batch      c's percentile over the step's weighted tokens (every rank's), not a micro-batch's:
                                  f independent of --micro-batch-size, for one extra no-grad pass of students and
                                  teachers
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import torch

from rlvr_utils.core import cli
from rlvr_utils.core.logprob_kernels import FusedLinearLogProb


@dataclasses.dataclass
class Ablations:
    """SC-GRPO's ablation flags (docs/sc_grpo.md, Ablations)."""

    weighted_groups: tuple[Literal["partial", "none", "single", "all"], ...] = ("partial", "none")
    """groups with a teacher, by n_c correct of G: partial (2 <= n_c < G), none (0), single (1),
    all (G); the paper's: partial none"""
    kl_threshold_scope: Literal["micro-batch", "batch"] = "micro-batch"
    """c's percentile is over the weighted tokens of: micro-batch (the paper's: --micro-batch-size //
    G groups, so that size changes f) or batch (the step's, all ranks' under torchrun: f
    independent of the micro-batch size, for one extra no-grad pass of students and teachers)"""
    divergence: Literal["kl", "sampled-logratio"] = "kl"
    """D per token: kl (the paper's: KL(teacher || student) over the vocabulary) or
    sampled-logratio (ours: the sampled token's teacher-minus-student log-prob, signed by the row's
    advantage)"""


def validate(args):
    """The ablation flags' checks (cli.parse, after sc_grpo.validate): one line naming the flag, exit code 2."""
    cli.need(len(args.weighted_groups) > 0, "--weighted-groups needs at least one of partial, none, single, all")
    no_grad = "--kl-loss-coef needs --divergence kl (the sampled log-ratio has no gradient)"
    cli.need(args.divergence == "kl" or args.kl_loss_coef == 0, no_grad)
    return args


def set_up(args, f_and_bonus, teacher_kl):
    """sc_grpo.py's f_and_bonus(D, active, role, group_ids, adv) and teacher_kl under the flags `args` holds, the
    groups with a teacher, and whether f is made over the batch in step 4 (--kl-threshold-scope batch)."""
    if args.divergence == "sampled-logratio":
        f_and_bonus = signed_first(f_and_bonus)
        teacher_kl = functools.partial(teacher_kl, divergence=sampled_logratio)
    per_batch = args.kl_threshold_scope == "batch" and args.weight_mode == "multiply"
    return f_and_bonus, teacher_kl, args.weighted_groups, per_batch


def f_over_batch(args, model, ro, T, teachers, active, adv, logprobs, teacher_kl, f_and_bonus, micro_batches, dist,
                 log):  # fmt: skip
    """--kl-threshold-scope batch, in sc_grpo.py's step 4 (no gradient): D of every routed row, a micro-batch of whole
    groups at a time, then f and the solve-none bonus with c over the whole batch (every rank's rows). Returns the
    weights [N, T] and the advantages [N, T]. logprobs: common.token_logprobs; teacher_kl, f_and_bonus,
    micro_batches (of whole groups): sc_grpo.py's; teachers (its Teachers: prompts, role), active, adv: its step 3's;
    log: its TeacherLog. FSDP: the passes run on the full weights (their number varies by rank)."""
    gid, D = ro.group_ids.cpu(), torch.zeros(len(ro), T, device=active.device)  # [N, T]
    every_row = torch.arange(len(ro), device=active.device)
    with dist.gathered(model):
        for mb in micro_batches(every_row, gid, args.num_generations, args.micro_batch_size):
            student = []  # this pass's final hidden states: the student's side of D
            batch = (ro.input_ids[mb], ro.attention_mask[mb], T, args.temperature)
            logprobs(model, *batch, keep=student)
            D[mb], cost = teacher_kl(model, student, *batch[:3], [teachers.prompts[i] for i in mb.tolist()])
            log.add(cost=cost)  # LOGS: the teacher's time
    weights, adv, f = dist.over_global_batch(f_and_bonus, D, active, teachers.role, gid, adv)  # [N, T] each
    log.add(D, f, active)  # LOGS
    return weights, adv


def sampled_logratio(zs, zt, targets, lm, temperature: float) -> torch.Tensor:
    """delta [r, T] = log pi_teacher(o_t) - log pi(o_t) of the sampled tokens `targets` [r, T], no gradient, from the
    student's and the teacher's final hidden states through the lm_head `lm` (fused), or their logits (lm None).
    teacher.teacher_kl's `divergence`."""
    with torch.no_grad():
        return _logprobs(zt, targets, lm, temperature) - _logprobs(zs, targets, lm, temperature)


def _logprobs(out, targets, lm, temperature: float) -> torch.Tensor:
    """log-probs [r, T] of `targets` from final hidden states through `lm` (as common.token_logprobs), or logits."""
    if lm is not None:
        positions = max(1, 2**25 // lm.out_features)
        flat = (out.flatten(0, 1), lm.weight, lm.bias, targets.flatten())
        return FusedLinearLogProb.apply(*flat, temperature, positions, False)[0].view(targets.shape)
    z = out.float() / temperature
    return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


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

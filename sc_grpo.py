"""SC-GRPO: Self-Conditioned GRPO. The model, shown one of its own verified solutions, says which
tokens matter.

Groups are routed by n_c, their number of correct rollouts. Partial-solve groups (2 <= n_c < G): a
teacher, the current policy (no gradient) shown tau, a correct sibling, before the problem,
re-scores each rollout; f = D / (D + c), D = KL(teacher || student) per token,
c = max(P75 of D, 1e-4), multiplies each token's clipped surrogate (the reward sets the direction,
f the magnitude). Solve-none groups (n_c = 0): one rollout is everyone's reference, the others add
alpha * zscore(mean f) to their advantage.
Paper: Shan et al. 2026, Learning from Own Solutions (arXiv 2606.18810; no official code).
Docs: docs/sc_grpo.md. The teacher's memory-bounded forward: rlvr_utils/methods/teacher.py.

Differences from grpo.py:
1. step 3 routes the groups and builds each routed row's teacher prompt (teacher_prompt)
2. step 5: micro-batches of whole groups (--micro-batch-size enters the algorithm); the update's
   forward also gives the student's side of D (teacher_kl adds the teacher's), then f and the
   solve-none bonus per micro-batch; the clipped surrogate times f
3. the advantage's std: population + 1e-6 (--outcome-std; grpo.py's: unbiased + 1e-4)
Ablations of ours (other D, other groups, c over the batch): rlvr_utils/methods/sc_ablations.py.

    python sc_grpo.py                                            # tiny model, built-in task, CPU
    python sc_grpo.py --weight-mode none --outcome-std unbiased  # exactly grpo.py
    python sc_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --learning-rate 1e-6 \\
        --max-new-tokens 512 --gradient-checkpointing
"""

import collections
import dataclasses
import enum
import functools
from typing import Literal

import torch

import common
from rlvr_utils.core import cli, tasks
from rlvr_utils.methods import teacher


@dataclasses.dataclass
class Args(cli.BaseArgs):
    """SC-GRPO: the shared flags (rlvr_utils/core/cli.py) and the method's own, at the paper's
    values (docs/sc_grpo.md). Its ablation flags (ours): docs/sc_grpo.md, Ablations."""

    weight_mode: Literal["multiply", "none"] = "multiply"
    """multiply: the clipped surrogate times f(D); none: f = 1, no teacher (with --outcome-std
    unbiased: grpo.py)"""
    percentile: float = 75.0
    """c = max(this percentile of D over the micro-batch's weighted tokens, --c-min); the micro-batch:
    --micro-batch-size // G whole groups"""
    c_min: float = 1e-4
    """floor of the scale c in f = D / (D + c)"""
    alpha: float = 0.1
    """scale (>= 0) of the solve-none diversity pseudo-advantage alpha * zscore(s_i)"""
    outcome_std: Literal["population", "unbiased"] = "population"
    """the std of the GRPO advantage and the solve-none z-score: population + 1e-6 (ours; verl:
    unbiased + 1e-6; the paper writes one std for both) or unbiased + 1e-4 (grpo.py's, TRL's); one
    for both, so their ratio does not move with G (docs/sc_grpo.md)"""
    kl_loss_coef: float = 0.0
    """the additive distillation baseline (>= 0; 0 = off): add this times D, with its gradient, to
    the loss"""
    max_reference_tokens: int = 8192
    """a reference longer than this (or than the context window allows) is resampled, else its
    middle is cut"""


# ALGO LOGIC: the paper's equations (§5.1), pure tensor functions (docs/sc_grpo.md, each equation)
def token_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """D = KL(softmax(teacher) || softmax(student)) = sum_v p_T (log p_T - log p_S) over the full
    vocabulary, fp32 (paper §5.1). Logits [.., V] already divided by the temperature; returns [..].
    The training path computes it fused through the lm_head (teacher.FusedLinearKL), never as
    [b, T, V] logits: tests/test_sc_grpo.py::test_fused_path_gives_the_unfused_d_f_and_gradient_in_float64."""
    lt = torch.log_softmax(teacher_logits.float(), -1)
    ls = torch.log_softmax(student_logits.float(), -1)
    return (lt.exp() * (lt - ls)).sum(-1)


def kl_weights(kl: torch.Tensor, mask: torch.Tensor, percentile=75.0, c_min=1e-4) -> torch.Tensor:
    """The per-token weight f = D / (D + c), c = max(percentile of D over the active tokens, c_min)
    (paper §5.1). kl, mask [B, T] (mask: the active, weighted, tokens). Returns f [B, T], detached,
    in [0, 1), 0 where mask is 0. A NaN D counts as 0 and +inf as 1e6 (both left out of the
    percentile), so f is never NaN."""
    kl = kl.detach().float()
    D = torch.nan_to_num(kl, nan=0.0, posinf=1e6, neginf=0.0).clamp(min=0)
    ok = mask.bool() & torch.isfinite(kl)
    c = max(torch.quantile(D[ok], percentile / 100).item(), c_min) if ok.any() else c_min
    return torch.where(mask.bool(), D / (D + c), torch.zeros_like(D))


def diversity_advantage(scores, group_ids, alpha=0.1, eps=1e-6, unbiased=False) -> torch.Tensor:
    """Solve-none pseudo-advantage alpha * (s_i - mean s) / (std s + eps) within each group,
    population std unless `unbiased` (paper §5.1, ablation A3). scores, group_ids [n]:
    s_i = mean f over o_i's first min(|o_i|, |o_r|) tokens."""
    out = torch.zeros_like(scores)
    for g in group_ids.unique():
        rows = (group_ids == g).to(scores.device)
        s = scores[rows]
        out[rows] = alpha * (s - s.mean()) / (s.std(unbiased=unbiased) + eps)
    return out


class Role(enum.IntEnum):
    """How a row's teacher enters its loss (build_teachers sets it; paper §5.1)."""

    PLAIN = 0  # no teacher: plain GRPO, weight f = 1
    WEIGHTED = 1  # partial-solve (and the single / all ablations): f times the GRPO surrogate
    DIVERSITY = 2  # solve-none: weighted as above, plus alpha * zscore(mean f) on its advantage
    REFERENCE = 3  # solve-none's reference o_r: no loss (weight 0, advantage 0)


@dataclasses.dataclass(frozen=True)
class SCConfig:
    """SC-GRPO's credit settings (paper §5.1) at the flags' defaults: Args repeats them as flags
    (their --help), SCConfig.of(args) takes a run's."""

    percentile: float = 75.0  # c = max(this percentile of D over the weighted tokens, c_min)
    c_min: float = 1e-4
    alpha: float = 0.1  # the solve-none bonus alpha * zscore(mean f)
    unbiased: bool = False  # the std of A and the z-score: population + 1e-6, or unbiased + 1e-4

    @classmethod
    def of(cls, args) -> "SCConfig":
        return cls(args.percentile, args.c_min, args.alpha, args.outcome_std == "unbiased")


def weights_and_advantages(kl, active, role, group_ids, adv, cfg: SCConfig = SCConfig()):
    """SC-GRPO's credit (paper §5.1) over a micro-batch (the paper's scope of c) or the batch.
    kl, active, adv [n, T]: D, the weighted tokens, the rows' token advantages; role [n] (Role);
    group_ids [n]. Returns the weights [n, T] (1 on PLAIN rows, else f = kl_weights(kl, active)),
    the advantages [n, T] (DIVERSITY rows + alpha * zscore of s_i = mean f over their weighted
    tokens; REFERENCE rows: 0) and f. cfg: c's percentile and floor, alpha, the std (SCConfig).

    >>> D, on = torch.tensor([[0.0, 1.0, 3.0]]), torch.ones(1, 3)  # D per token; c = P75 of D = 2
    >>> role, group = torch.tensor([Role.WEIGHTED]), torch.tensor([0])
    >>> weights_and_advantages(D, on, role, group, on)[0]  # the weights f = D / (D + c)
    tensor([[0.0000, 0.3333, 0.6000]])
    """
    f = kl_weights(kl, active, cfg.percentile, cfg.c_min)  # c from these rows' weighted tokens
    weights = torch.where((role == Role.PLAIN)[:, None], 1.0, f)  # [n, T]
    adv = adv.clone()
    div = role == Role.DIVERSITY
    if div.any():
        s = (f * active).sum(-1) / active.sum(-1).clamp(min=1)  # [n] mean f over weighted tokens
        eps = 1e-4 if cfg.unbiased else 1e-6
        bonus = diversity_advantage(s[div], group_ids[div.cpu()], cfg.alpha, eps, cfg.unbiased)
        adv[div] = adv[div] + bonus[:, None]
    adv[role == Role.REFERENCE] = 0.0
    return weights, adv, f


def weighted_tokens(mask: torch.Tensor, role: torch.Tensor, wlen: torch.Tensor) -> torch.Tensor:
    """The tokens f weighs, and c's percentile is over: a WEIGHTED or DIVERSITY row's first wlen
    tokens (wlen: |o_i|, or min(|o_i|, |o_r|) in a solve-none group, paper §5.1), within the mask.
    mask [N, T], role, wlen [N]; returns [N, T]."""
    span = torch.arange(mask.shape[1], device=mask.device) < wlen.to(mask.device)[:, None]
    routed = ((role == Role.WEIGHTED) | (role == Role.DIVERSITY)).to(mask.device)[:, None]
    return mask * (span & routed).float()


def micro_batches_of_groups(rows, group_ids, group_size: int, micro_batch_size: int, whole=True):
    """Micro-batches of a mini-batch's rows [n] (in order): whole groups, micro_batch_size // G of
    them per micro-batch (c is a micro-batch's percentile, paper §5.1, and a solve-none group is
    z-scored together); `whole` False: grpo.py's. Returns a list of row tensors."""
    if not whole:
        return list(rows.split(micro_batch_size))
    ids = group_ids[rows.cpu()].tolist()
    units = [rows[[i for i, g in enumerate(ids) if g == u]] for u in dict.fromkeys(ids)]
    per = max(1, micro_batch_size // group_size)
    return [torch.cat(units[u : u + per]) for u in range(0, len(units), per)]


# ALGO LOGIC: who gets a teacher, and what the teacher sees (paper §5.1 and App. E.1)
def route_groups(correct, group_size: int, generator, group_ids=None, weighted=("partial", "none"),
                 scores=None):  # fmt: skip
    """Each group's mode by n_c, its number of correct rollouts, and each rollout's reference row
    tau_row [N] (-1: no teacher). correct [N] bool; groups share a group_ids value (default: blocks
    of group_size); modes: one per group, in order of first appearance.
    partial (2 <= n_c < G): each rollout draws a correct one other than itself, uniformly.
    none (n_c = 0, all scores equal): one rollout o_r, drawn uniformly, is the others' reference.
    Plain (f = 1): a group with n_c = 0 whose graded `scores` differ (the code task), a kind not in
    `weighted` (single: n_c = 1 and all: n_c = G are ablations that follow the partial rule), a
    group of one. An unscored rollout (score NaN: no reward function scored it, TRL's None) is
    neither a success nor a failure: G and n_c count the scored ones, it gets no teacher and is
    never o_r (a group with none scored is plain). Draws come from `generator` only."""
    correct, modes = correct.bool().cpu(), []
    gids = torch.arange(len(correct)) // group_size if group_ids is None else group_ids.cpu()
    scores = correct.float() if scores is None else scores.float().cpu()
    tau_row = torch.full((len(correct),), -1, dtype=torch.long)
    ids = gids.tolist()
    for u in dict.fromkeys(ids):  # the groups in order of first appearance
        rows = torch.tensor([i for i, g in enumerate(ids) if g == u])
        if len(rows) != group_size:
            raise ValueError(f"every group must have {group_size} completions, got {len(rows)}")
        rows = rows[~scores[rows].isnan()]  # the scored rollouts: an unscored one takes no part
        nc = int(correct[rows].sum())
        kind = (
            "none" if nc == 0 else "all" if nc == len(rows) else "single" if nc == 1 else "partial"
        )
        s = scores[rows]
        graded = kind == "none" and len(s) > 0 and bool(s.max() > s.min())  # partial credit
        modes.append(kind if kind in weighted and len(rows) > 1 and not graded else "plain")
        if modes[-1] == "none":
            r = rows[torch.randint(len(rows), (1,), generator=generator)]
            tau_row[rows] = r
            tau_row[r] = -1
        elif modes[-1] != "plain":
            good = rows[correct[rows]]
            for i in rows.tolist():
                if len(others := good[good != i]):
                    tau_row[i] = others[torch.randint(len(others), (1,), generator=generator)]
    return modes, tau_row


GUIDE = (
    "Below is a verified correct solution to this problem. Use it as a reference when reasoning "
    "about the problem.\n\nReference solution:\n"
)  # chat models: the teacher's system message, then tau (paper App. E.1; docs/sc_grpo.md)


def teacher_prompt(tokenizer, task: str, example: tasks.Example, tau: str) -> list[int]:
    """Token ids of the teacher's prompt: the student's context plus the reference tau (paper App.
    E.1). Chat: the system message is the student's own (or the template's default) + GUIDE + tau,
    the user turns the student's. Plain text: "Reference solution:\\n<tau>\\n" + the student's
    prompt (the block the bundled tiny model was trained on: tools/train_tiny_model.py)."""
    tau = tau.strip()
    default = teacher.default_system_message(tokenizer)  # "" without a chat template
    if example.meta.get("chat"):  # a custom task's messages: the guide and tau join its system turn
        msgs = list(example.meta["prompt"])
        own = msgs.pop(0)["content"] + "\n\n" if msgs[0]["role"] == "system" else ""
        base = own or (default + "\n\n" if default else "")
        system = [{"role": "system", "content": base + GUIDE + tau}]
        text = tokenizer.apply_chat_template(
            system + msgs, add_generation_prompt=True, tokenize=False
        )
    elif tasks.has_chat_template(tokenizer) and "chat" not in example.meta:  # a built-in task
        if not example.user:
            raise ValueError(f"example {example.id} has no user turn: the chat teacher repeats it")
        system = (default + "\n\n" if default else "") + GUIDE + tau
        text = tasks.render_prompt(tokenizer, example.user, example.prompt, system=system)
    else:  # plain text (a custom task's string prompt is seen as it is)
        text = f"Reference solution:\n{tau}\n{example.prompt}"
    return tasks.encode_prompt(tokenizer, text)


def fit_reference(tokenizer, make_prompt, taus: list[str], limit: int, max_ref_tokens: int):
    """(teacher prompt ids or None, what happened) for the first reference in `taus` whose prompt,
    make_prompt(tau), has at most `limit` tokens and which itself has at most `max_ref_tokens`:
    "drawn" (the first one), "tau_resampled" (another); else the first one with its middle cut to
    fit ("tau_truncated", 8 tokens spare for the "..." marker), or None ("no_reference") when even
    that does not fit (ours: the paper is silent on references that do not fit)."""
    n_tok = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    for k, tau in enumerate(taus):
        ids = make_prompt(tau)
        if len(ids) <= limit and n_tok(tau) <= max_ref_tokens:
            return ids, "tau_resampled" if k else "drawn"
    tau = tokenizer(taus[0], add_special_tokens=False).input_ids  # none fits: the first's ends
    keep = min(max_ref_tokens, len(tau) - max(len(make_prompt(taus[0])) - limit, 0)) - 8
    head, tail = tau[: keep // 2], tau[len(tau) - (keep - keep // 2) :]
    cut = tokenizer.decode(head) + "\n...\n" + tokenizer.decode(tail)
    ids = make_prompt(cut) if keep > 0 else None
    return (
        (ids, "tau_truncated") if ids is not None and len(ids) <= limit else (None, "no_reference")
    )


Teachers = collections.namedtuple("Teachers", "prompts role wlen bad")  # build_teachers' record


def build_teachers(tokenizer, make_prompt, texts: list[str], completion_mask, group_ids, correct,
                   tau_row, limit: int, max_ref_tokens: int, generator) -> Teachers:  # fmt: skip
    """Teachers(prompts: each row's teacher prompt ids or None (no teacher), role [N] (Role),
    wlen [N] the weighted length, bad: the bad-input counts) (paper §5.1). make_prompt(i, tau):
    row i's teacher prompt ids given the reference text tau (the script: teacher_prompt); texts
    [N] the completions; tau_row [N]: each row's tau / o_r (route_groups). A tau whose prompt
    exceeds `limit` tokens (the context minus the completions) or `max_ref_tokens` is replaced by
    another correct sibling (never the row itself), drawn uniformly, else its middle is cut, else
    the row is PLAIN (fit_reference). wlen: |o_i|, or min(|o_i|, |o_r|) in solve-none groups.
    role, wlen on completion_mask's device."""
    lengths, gids = completion_mask.sum(1).cpu(), group_ids.cpu()
    counts = {"sc/tau_resampled": 0, "sc/tau_truncated": 0, "sc/no_reference": 0}
    prompts = [None] * len(texts)
    role = torch.zeros(len(texts), dtype=torch.long)
    wlen = lengths.clone()
    is_reference = (tau_row < 0) & ~correct & torch.isin(torch.arange(len(texts)), tau_row)
    role[is_reference] = Role.REFERENCE  # solve-none's o_r
    for i in (tau_row >= 0).nonzero().flatten().tolist():
        j = int(tau_row[i])
        same = (gids == gids[i]).nonzero().flatten().tolist()
        sibs = [k for k in same if correct[j] and correct[k] and k not in (i, j)]  # other taus
        order = torch.randperm(len(sibs), generator=generator).tolist()
        taus = [texts[k] for k in [j] + [sibs[p] for p in order]]
        make = functools.partial(make_prompt, i)  # row i's prompt for a tau
        prompts[i], how = fit_reference(tokenizer, make, taus, limit, max_ref_tokens)
        if how != "drawn":  # resampled, truncated or none fits
            counts[f"sc/{how}"] += 1
        if prompts[i] is not None and correct[j]:  # weighted over all its tokens (wlen = |o_i|)
            role[i] = Role.WEIGHTED
        elif prompts[i] is not None:  # solve-none: weighted over its first min(|o_i|, |o_r|)
            role[i] = Role.DIVERSITY
            wlen[i] = min(lengths[i], lengths[j])
    device = completion_mask.device
    return Teachers(prompts, role.to(device), wlen.to(device), counts)


def validate(args: Args) -> Args:
    """SC-GRPO's own checks (cli.parse has run the shared ones): one line naming the flag, exit 2."""
    ranges = dict(percentile="[0, 100]", c_min="> 0", alpha=">= 0", kl_loss_coef=">= 0")
    cli.need_ranges(args, **ranges, max_reference_tokens=">= 1")
    return args


if __name__ == "__main__":
    # TRY NOT TO MODIFY: flags, torchrun, seeding; the task, the model, its reference, the optimizer
    args = cli.parse(Args, validate, "sc_ablations")  # tyro.cli(Args), every check before loading
    run = common.Run(args)
    tokenizer = common.load_tokenizer(args.model)
    task = common.load_task(args, tokenizer)  # before the model: an empty task stops at once
    model = common.load_model(args.model, run.device, run.dtype, args.gradient_checkpointing)
    model = common.with_lora(model, args)  # --lora-rank: LoRA adapters train, the base is frozen
    ref_model = common.reference(model, args) if args.beta > 0 else None  # LoRA: adapters off
    train_model = run.dist.wrap(model, ref_model)  # DDP / FSDP2; bf16: fp32 masters (precision.py)
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = common.adamw(params, args)  # mixed precision: it steps the fp32 masters
    routing = torch.Generator().manual_seed(args.seed)  # ALGO LOGIC: its own RNG, checkpointed
    run.start(model, tokenizer, optimizer, task, state={"routing": routing})
    dist = run.dist
    G = args.num_generations
    # ALGO LOGIC: the set-up of the method. When the teacher runs:
    #   default                     step 5, first pass: D of each micro-batch, then its f and bonus
    #   --kl-loss-coef > 0          step 5, every pass as well: D with its gradient (additive term)
    #   --weight-mode none          never (f = 1), unless --kl-loss-coef
    f_per_micro_batch = args.weight_mode == "multiply"
    kl_grad = args.kl_loss_coef > 0
    cfg = SCConfig.of(args)  # c's percentile and floor, alpha, the std (--outcome-std)
    unbiased = cfg.unbiased
    eps = 1e-4 if unbiased else 1e-6  # the std of A and of the solve-none z-score (--outcome-std)
    f_and_bonus = functools.partial(weights_and_advantages, cfg=cfg)  # f and the solve-none bonus
    teach = dict(temperature=args.temperature, pad_id=tokenizer.pad_token_id, kl_grad=kl_grad)
    teacher_kl = functools.partial(teacher.teacher_kl, **teach, dist=dist)  # D, fused (§5.1)
    weighted, f_per_batch = ("partial", "none"), False  # the groups with a teacher (§5.1)
    ablation = args.ablation_module  # its flags given: methods/sc_ablations.py (docs/sc_grpo.md)
    if ablation is not None:
        f_and_bonus, teacher_kl, weighted, f_per_batch = ablation.set_up(
            args, f_and_bonus, teacher_kl
        )
        f_per_micro_batch = f_per_micro_batch and not f_per_batch
    context = getattr(model.config, "max_position_embeddings", None) or 10**9  # the teacher's room
    examples = {e.id: e for e in task.train}  # each row's example, by its group id
    keep = None  # DAPO's dynamic sampling keeps the solve-none groups (they get the bonus)
    if "none" in weighted:
        keep = lambda s: bool((s < args.success_threshold).all())  # noqa: E731

    for step in run.steps():
        # 1-2. rollouts: G completions per prompt, one reward per completion (the verifier sees the
        #      decoded text); DAPO's dynamic sampling and overlong penalty when asked
        ro, rewards, sampling = common.rollouts_with_rewards(
            model, tokenizer, task, run.batches, dist, args, keep
        )
        mask = ro.completion_mask  # [N, T]
        if args.mask_truncated_completions:  # DAPO's overlong filtering
            mask = mask * ~ro.truncated[:, None]
        T = mask.shape[1]
        run.lap("generation")

        # 3. ALGO LOGIC: credit assignment. The GRPO advantage; the groups routed by n_c; each routed
        #    row's teacher prompt (§5.1). f and the bonus need D: made in step 5 per micro-batch
        #    (c: the micro-batch's percentile, §5.1) from the update's own forward.
        gid = ro.group_ids.cpu()
        advantages = dist.over_global_batch(
            common.group_advantages, rewards, G, args.scale_rewards, eps, gid, unbiased
        )  # [N]
        token_adv = advantages.to(run.device)[:, None].expand(-1, T).clone()  # [N, T] + the bonus
        correct = ro.scores >= args.success_threshold  # a verified success (not the shaped reward)
        modes, tau_row = route_groups(correct, G, routing, gid, weighted, ro.scores)
        limit = context - T  # the teacher prompt's room beside the completion
        max_ref = args.max_reference_tokens
        make = lambda i, tau: teacher_prompt(  # noqa: E731  row i's teacher prompt for a reference
            tokenizer, args.task, examples[int(gid[i])], tau
        )
        refs = (correct, tau_row, limit, max_ref, routing)
        teachers = build_teachers(tokenizer, make, ro.texts, ro.completion_mask, gid, *refs)
        active = weighted_tokens(mask, teachers.role, teachers.wlen)  # [N, T] the tokens f weighs
        weights = torch.ones_like(mask, dtype=torch.float)  # [N, T] f, 1 on plain rows
        sc_log = teacher.TeacherLog()  # LOGS: D, f and the teacher's cost, the sc/* metrics

        # 4. old and reference log-probs (no gradient). On-policy (one pass, one mini-batch) the
        #    old log-probs are the current ones, detached; otherwise this pass makes them.
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad(), dist.gathered_if_uneven(model, ref_model):  # FSDP, uneven rows
            on_policy = args.num_iterations == 1 and args.num_minibatches == 1
            old_logp = None
            if not on_policy:
                old_logp = common.token_logprobs(model, input_ids, attn, T, args.temperature)[0]
            ref_logp = None
            if ref_model is not None:
                ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0]
            if f_per_batch:  # ablation: D of every row, then f with c over the whole batch
                step3 = (ro, T, teachers, active, token_adv)
                fns = (common.token_logprobs, teacher_kl, f_and_bonus, micro_batches_of_groups)
                weights, token_adv = ablation.f_over_batch(args, model, *step3, *fns, dist, sc_log)
        run.lap("logprobs")

        # 5. update: mu passes; each splits the batch into mini-batches of whole prompts, one
        #    optimizer step each, in micro-batches (the loss is normalized over the mini-batch)
        stats = common.UpdateStats(mask, args.num_iterations)
        for it in range(args.num_iterations):
            for rows in common.minibatches(ro.group_ids, args.num_minibatches):
                optimizer.zero_grad(set_to_none=True)
                num_tokens, num_seqs = dist.loss_counts(mask[rows])  # global counts / world size
                agg = (args.loss_agg, args.max_new_tokens, num_tokens, num_seqs)
                # ALGO LOGIC: micro-batches of whole groups (c: a micro-batch's percentile, §5.1)
                size = args.micro_batch_size
                micro = micro_batches_of_groups(rows, gid, G, size, args.weight_mode == "multiply")
                for mb in dist.micro_batches(train_model, micro):  # all-reduce in the last
                    m = mask[mb].float()
                    batch = (input_ids[mb], attn[mb], T, args.temperature)
                    student = []  # ALGO LOGIC: this forward's final hidden states, D's student side
                    logp, entropy = common.token_logprobs(
                        train_model, *batch, with_entropy=it == 0, keep=student
                    )
                    f_here = it == 0 and f_per_micro_batch  # f from pass 1 (the current policy)
                    D = cost = None
                    if f_here or kl_grad:  # ALGO LOGIC: D = KL(teacher || student) per token (§5.1)
                        prompts = [teachers.prompts[i] for i in mb.tolist()]
                        D, cost = teacher_kl(train_model, student, *batch[:3], prompts)
                    if f_here:  # f with c from this micro-batch's weighted tokens; the bonus
                        A0 = token_adv[mb]
                        weights[mb], token_adv[mb], f = f_and_bonus(
                            D, active[mb], teachers.role[mb], gid[mb.cpu()], A0
                        )
                    logged = it == 0 and (f_here or kl_grad) and not f_per_batch  # LOGS: D once
                    sc_log.add(
                        D if logged else None, f if f_here else None, active[mb], cost
                    )  # LOGS
                    run.watch_credit(logp, mb, m, num_tokens, num_seqs)  # LOGS: --log-credit
                    old = old_logp[mb] if old_logp is not None else logp.detach()
                    # ALGO LOGIC: PPO-clipped surrogate of the per-token advantage
                    log_ratio = (logp - old).clamp(-common.MAX_LOG_RATIO, common.MAX_LOG_RATIO)
                    ratio = torch.exp(log_ratio)
                    A = token_adv[mb]
                    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)
                    surrogate = torch.min(ratio * A, clipped * A)
                    per_token_loss = -surrogate * weights[mb]  # ALGO LOGIC: times the weight f
                    # vLLM rollouts: importance weights toward the engine's sampling (HF: 1)
                    engine_w = common.engine_correction(ro, mb, old, m, args, stats, it)
                    per_token_loss = per_token_loss * engine_w
                    if kl_grad:  # ALGO LOGIC: the additive baseline: distill toward the teacher
                        per_token_loss = per_token_loss + args.kl_loss_coef * D * active[mb]
                    kl = None  # KL(pi || pi_ref), k3, with --beta > 0
                    if ref_logp is not None:
                        kl = common.k3_kl(logp, ref_logp[mb])
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = common.aggregate_loss(per_token_loss, m, *agg)
                    run.stop_if_nonfinite(loss, "loss")
                    loss.backward()
                    stats.add(m, ratio, A, args.epsilon, args.epsilon_high, entropy, kl, loss)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                run.stop_if_nonfinite(grad_norm, "gradient norm")
                optimizer.step()
                stats.step(grad_norm)
        run.lap("update")

        # 6. TRY NOT TO MODIFY: metrics, evaluation, logging, checkpoint, Ctrl-C
        run.credit_signals(f=weights, role=teachers.role)  # LOGS: --log-credit's weight f, row role
        sc_metrics = sc_log.metrics(modes, teachers.bad, ro.texts, run.device)  # LOGS: sc/* metrics
        run.end_step(step, ro, rewards, stats, sampling | sc_metrics)

    run.finish()

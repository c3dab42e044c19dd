"""SC-GRPO: Self-Conditioned GRPO. The model, shown one of its own verified solutions, says which tokens matter.

1. Route each group by n_c, its number of correct rollouts: partial-solve (2 <= n_c < G) scores every rollout
   against a reference tau, a correct sibling other than itself; n_c in {1, G} stays plain GRPO.
2. Teacher = the current policy (no gradient) re-scoring the same response with tau placed before the problem.
3. D = KL(teacher || student) per token over the full vocabulary; f = D / (D + c), c = max(P75 of D over the
   micro-batch's weighted tokens, 1e-4): --micro-batch-size enters the algorithm (--kl-threshold-scope batch: the step's).
4. f (detached) multiplies each token's clipped surrogate: the reward sets the direction, f the magnitude.
5. Solve-none groups (n_c = 0): one rollout is everyone's reference; the rest add alpha * zscore(mean f) to their
   advantage (0 there unless --overlong-buffer shaped the rewards).
Paper: Shan et al. 2026, Learning from Own Solutions (arXiv 2606.18810; no official code). Docs: docs/sc_grpo.md.

    python sc_grpo.py                                           # bundled tiny model, built-in task, CPU
    python sc_grpo.py --weight-mode none --outcome-std unbiased # exactly grpo.py
    python sc_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --learning-rate 1e-6 --max-new-tokens 512
"""

import copy
import dataclasses
import os
import time
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tqdm import trange

import common
from rlvr_utils import arith, checkpoints, cli, distributed, engines, logprob_kernels, tasks


@dataclasses.dataclass
class Args:
    exp_name: str = "sc_grpo"
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment (prompts, sampling, initialization)"""
    track: bool = False
    """log to Weights & Biases as well as TensorBoard (needs pip install wandb)"""
    wandb_project: str = "credit-rlvr"
    """wandb project name (with --track)"""
    output_dir: str = "runs"
    """logs, metrics.jsonl and checkpoints go to <output-dir>/<run-name>/"""
    save_model: bool = False
    """save the final policy as a Hugging Face directory <output-dir>/<run-name>/model (atomic write)"""
    save_every: int = 0
    """write a resumable checkpoint (<run-dir>/checkpoint: model, optimizer, RNG states, data position) every this
    many steps and at the end; 0: only when the run is stopped with Ctrl-C"""
    resume: str | None = None
    """continue the run in this run directory from its checkpoint, with the flags it was started with (--total-steps may grow)"""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype: auto is bfloat16 on cuda, float32 on cpu"""
    threads: int = 0
    """torch CPU threads (0: torch's default, one per core)"""

    # model and task
    model: str = common.DEFAULT_MODEL
    """Hugging Face hub id or local directory of the policy; the default is the bundled tiny model"""
    task: Literal["arith", "gsm8k", "math", "code"] = "arith"
    """arith (built in), gsm8k, math, or code (HumanEval-style unit tests run in a sandbox; reward = fraction passed)"""
    data_path: str | None = None
    """local jsonl/json/parquet training file instead of the hub dataset (gsm8k, math, code; code also .jsonl.gz)"""
    eval_data_path: str | None = None
    """local eval file; without it the first --num-eval training rows are held out"""
    arith_steps: int = 4
    """arith: operations per problem"""
    arith_max_value: int = 99
    """arith: running values stay in [0, this]"""
    arith_max_operand: int = 9
    """arith: operands are drawn from [1, this]"""
    code_timeout: float = 5.0
    """code task: wall-clock seconds for one program's whole test run (also its CPU-time limit)"""
    max_prompt_length: int = 1024
    """prompts longer than this (tokens) are skipped and counted"""

    # rollouts
    total_steps: int = 150
    """training steps; each samples a new batch of prompts and makes num-iterations x num-minibatches optimizer steps"""
    prompts_per_step: int = 8
    """prompts per step (the global batch: across all torchrun ranks, divisible by their number); each gets --num-generations completions"""
    num_generations: int = 8
    """G: completions per prompt (the group; at least 2)"""
    max_new_tokens: int = 48
    """completion length cap (tokens); completions that hit it count as clipped"""
    temperature: float = 1.0
    """sampling temperature; log-probs use the same temperature"""
    top_p: float = 1.0
    """nucleus sampling (1.0 = off; truncated sampling biases the ratio)"""
    top_k: int = 0
    """top-k sampling (0 = off)"""
    gen_batch_size: int = 64
    """sequences per generate() call"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts until the batch is full again"""
    max_sampling_rounds: int = 3
    """with --dynamic-sampling: at most this many sampling rounds per step (then groups that were dropped fill the batch)"""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: a completion longer than max-new-tokens minus this loses reward linearly, up to
    --overlong-penalty-factor at max-new-tokens (0: off)"""
    overlong_penalty_factor: float = 1.0
    """the largest overlong penalty (with --overlong-buffer)"""
    mask_truncated_completions: bool = False
    """completions that hit --max-new-tokens get no loss (DAPO's overlong filtering)"""

    # optimization
    learning_rate: float = 1e-4
    """AdamW learning rate (constant). The default suits the tiny model; use ~1e-6 for 1B+ models"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_iterations: int = 1
    """mu: passes over each batch (with one mini-batch and mu = 1 the update is on-policy: the ratio is exactly 1)"""
    num_minibatches: int = 1
    """each pass splits the batch into this many mini-batches of whole prompts, one optimizer step each (CleanRL's
    name; DAPO/verl: 4); only the first step is on-policy, so the ratio leaves 1 and clipping acts"""
    epsilon: float = 0.2
    """lower clip: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: float | None = None
    """upper clip (DAPO's clip-higher uses 0.28); default: same as --epsilon"""
    beta: float = 0.0
    """k3 KL coefficient to the frozen initial policy (0: no reference model is loaded)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """token-mean (DAPO), seq-mean-token-mean (original GRPO), seq-mean-token-sum-norm (Dr. GRPO)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantage scaling: group std (GRPO), batch std (Lite PPO) or none (Dr. GRPO)"""
    micro_batch_size: int = 16
    """sequences per forward/backward (gradient accumulation; the loss is normalized over the whole mini-batch). In
    SC-GRPO it also sets the tokens c is taken over (the paper's micro-batch: --micro-batch-size // G whole groups;
    see --kl-threshold-scope), so it enters the algorithm"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer's activations in the backward (non-reentrant) instead of storing them: trades
    about a third more update time for much less GPU memory on long completions (the README's GPU commands use it)"""

    # evaluation
    eval_every: int = 25
    """steps between evaluations (0 = only at the start and end)"""
    num_eval: int = 200
    """held-out prompts per evaluation"""
    eval_temperature: float = 0.0
    """0 = greedy pass@1"""

    # rollout engine
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """hf (transformers generate), vllm (a colocated vLLM engine synced after every optimizer step), or auto:
    vllm when it is importable and a GPU is present, else hf"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (on CPU: of host memory)"""
    vllm_is_cap: float = 0.0
    """truncated importance-sampling correction min(pi_old / pi_vllm, cap) per token; 0 = off"""

    # several processes: torchrun --nproc_per_node N <script> ... (docs/scaling.md)
    fsdp: bool = False
    """under torchrun: shard the policy (and reference) with FSDP2 fully_shard instead of DDP"""
    dist_timeout: int = 1800
    """seconds a collective waits for the other ranks before the run stops with an error"""

    # SC-GRPO (paper defaults)
    weight_mode: Literal["multiply", "none"] = "multiply"
    """multiply: each token's clipped surrogate times f(D); none: weight 1 and no teacher (with --outcome-std unbiased:
    exactly grpo.py)"""
    weighted_groups: tuple[Literal["partial", "none", "single", "all"], ...] = ("partial", "none")
    """groups scored against a teacher, by n_c correct of G: partial (2 <= n_c < G), none (n_c = 0), single (1), all (G)"""
    percentile: float = 75.0
    """c = max(this percentile of D over the micro-batch's weighted tokens, --c-min)"""
    kl_threshold_scope: Literal["micro-batch", "batch"] = "micro-batch"
    """the weighted tokens c's percentile is taken over: micro-batch (the paper's: each micro-batch of
    --micro-batch-size // G groups gets its own c, so the micro-batch size changes f) or batch (every weighted token of
    the step: the same f whatever the micro-batch size, at the cost of one extra no-grad pass of the students and
    teachers before the update)"""
    c_min: float = 1e-4
    """floor of the scale c in f = D / (D + c)"""
    alpha: float = 0.1
    """scale of the solve-none diversity pseudo-advantage alpha * zscore(s_i)"""
    outcome_std: Literal["population", "unbiased"] = "population"
    """the std of both z-scores, the GRPO advantage and the solve-none pseudo-advantage: population + 1e-6 (verl's; the
    paper writes one std for both) or unbiased + 1e-4 (grpo.py's, TRL's). One convention for both, so the ratio of the
    two signals does not move with G (docs/sc_grpo.md)"""
    kl_loss_coef: float = 0.0
    """> 0: add this times D (gradient through the student) to the loss: the additive distillation baseline"""
    max_reference_tokens: int = 8192
    """a reference longer than this (or than the context window allows) is resampled, else its middle is cut"""


# ----------------------------------------------------------------------------------------------
# ALGO LOGIC: SC-GRPO's own functions (pure; the equations are in docs/sc_grpo.md, the paper's section 5)
# ----------------------------------------------------------------------------------------------
GUIDE = (
    "Below is a verified correct solution to this problem. Use it as a reference when reasoning about "
    "the problem.\n\nReference solution:\n"
)  # chat models: the teacher's system message, then tau (docs/sc_grpo.md)


def group_rows(group_ids: torch.Tensor) -> list[torch.Tensor]:
    """Row indices of each group (the rows sharing a group id), groups in order of first appearance."""
    ids = group_ids.tolist()
    return [torch.tensor([i for i, g in enumerate(ids) if g == u]) for u in dict.fromkeys(ids)]


def route_groups(
    correct: torch.Tensor,
    group_size: int,
    generator: torch.Generator,
    group_ids: torch.Tensor | None = None,
    weighted: tuple[str, ...] = ("partial", "none"),
    scores: torch.Tensor | None = None,
) -> tuple[list[str], torch.Tensor]:
    """Each group's mode, by n_c = its number of correct rollouts, and each rollout's reference (paper §5.1).

    correct: [N] bool; groups share a `group_ids` value (default: consecutive blocks of `group_size`).
    Returns modes (one per group, first-appearance order) and ref [N] long: the row whose text conditions the
    rollout's teacher, -1 for none. partial (2 <= n_c < G): every rollout, correct or not, draws a correct rollout
    other than itself uniformly. none (n_c = 0 and every score equal, the groups GRPO gets nothing from): one rollout
    o_r, drawn uniformly, is every other one's reference (ref[o_r] = -1; it gets no loss). With graded rewards
    (`scores`, e.g. the code task's fraction of tests passed) a group with n_c = 0 whose scores differ is "plain": its
    GRPO advantages carry the partial credit. single (n_c = 1) and all (n_c = G), ablations, follow the partial rule. A
    kind not in `weighted`, or a group of one, is "plain" (GRPO, f = 1). Random draws come from `generator` only.
    """
    correct, modes = correct.bool().cpu(), []
    gids = torch.arange(len(correct)) // group_size if group_ids is None else group_ids.cpu()
    scores = correct.float() if scores is None else scores.float().cpu()
    ref = torch.full((len(correct),), -1, dtype=torch.long)
    for rows in group_rows(gids):
        if len(rows) != group_size:
            raise ValueError(f"every group must have {group_size} completions, got {len(rows)}")
        nc = int(correct[rows].sum())
        kind = "none" if nc == 0 else "all" if nc == len(rows) else "single" if nc == 1 else "partial"
        graded = kind == "none" and bool(scores[rows].max() > scores[rows].min())  # partial credit: GRPO advantages
        modes.append(kind if kind in weighted and len(rows) > 1 and not graded else "plain")
        if modes[-1] == "none":
            r = rows[torch.randint(len(rows), (1,), generator=generator)]
            ref[rows], ref[r] = r, -1
        elif modes[-1] != "plain":
            good = rows[correct[rows]]
            for i in rows.tolist():
                if len(others := good[good != i]):
                    ref[i] = others[torch.randint(len(others), (1,), generator=generator)]
    return modes, ref


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
    arith, arith_reference_prompt: the block the tiny model was trained on)."""
    tau = tau.strip()
    if tasks.has_chat_template(tokenizer):
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
    ro: common.Rollouts,
    row_examples,
    correct,
    ref,
    limit: int,
    max_ref_tokens: int,
    generator: torch.Generator,
):
    """Each row's teacher prompt ids (None: no teacher), role, weighted length, and the bad-input counts.

    A reference whose teacher prompt exceeds `limit` tokens (the context window minus the completions) or that has
    more than `max_ref_tokens` tokens is replaced by another correct sibling that fits (never the row itself), drawn
    uniformly; failing that, its middle is cut; a row that still does not fit gets no teacher (plain GRPO).
    role [N]: 0 plain (f = 1), 1 weighted, 2 weighted + diversity advantage (solve-none), 3 no loss (o_r).
    wlen [N]: how many tokens get a weight, |o_i|, or min(|o_i|, |o_r|) in solve-none groups (later tokens get 0).
    """
    n_tok = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    lengths, gids = ro.completion_mask.sum(1).cpu(), ro.group_ids.cpu()
    counts = {"sc/tau_resampled": 0, "sc/tau_truncated": 0, "sc/no_reference": 0}
    prompts, role, wlen = [None] * len(ro), torch.zeros(len(ro), dtype=torch.long), lengths.clone()
    role[(ref < 0) & ~correct & torch.isin(torch.arange(len(ro)), ref)] = 3  # the solve-none reference o_r
    for i in (ref >= 0).nonzero().flatten().tolist():
        j = int(ref[i])
        sibs = [
            k for k in (gids == gids[i]).nonzero().flatten().tolist() if correct[j] and correct[k] and k not in (i, j)
        ]
        for k in [j] + [sibs[p] for p in torch.randperm(len(sibs), generator=generator).tolist()]:
            ids = teacher_prompt(tokenizer, task, row_examples[i], ro.texts[k])
            if len(ids) <= limit and n_tok(ro.texts[k]) <= max_ref_tokens:
                prompts[i] = ids
                counts["sc/tau_resampled"] += k != j
                break
        else:  # nothing fits: keep the head and tail of the drawn reference (8 tokens spare for the "..." marker)
            tau = tokenizer(ro.texts[j], add_special_tokens=False).input_ids
            over = len(teacher_prompt(tokenizer, task, row_examples[i], ro.texts[j])) - limit
            keep = min(max_ref_tokens, len(tau) - max(over, 0)) - 8
            cut = (
                tokenizer.decode(tau[: keep // 2]) + "\n...\n" + tokenizer.decode(tau[len(tau) - (keep - keep // 2) :])
            )
            ids = teacher_prompt(tokenizer, task, row_examples[i], cut) if keep > 0 else None
            prompts[i] = ids if ids is not None and len(ids) <= limit else None
            counts["sc/tau_truncated" if prompts[i] is not None else "sc/no_reference"] += 1
        if prompts[i] is not None:
            role[i], wlen[i] = (1, lengths[i]) if correct[j] else (2, min(lengths[i], lengths[j]))
    return prompts, role, wlen, counts


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
    chunk_size: int = 8,
    time_chunk: int = 128,
    fused: bool | None = None,
):
    """common.token_logprobs (the same operations on the same row chunks, so the same numbers) that also returns
    D [B, T], KL(teacher || student) at each completion position, for the rows with a `teacher_prompts[i]` (ids;
    elsewhere 0). The teacher is the same model under no_grad fed teacher_prompts[i] + the row's completion; the
    student side is this forward's own output (detached unless `kl_grad`): the only extra work is the teacher forward.
    fused (default: logprob_kernels.fused_logprobs_ok(model)): no [b, T, V] tensor exists. The student's final hidden
    states feed FusedLinearLogProb, and the same states and the teacher's go through the lm_head a few positions at
    a time in FusedLinearKL (extra memory O(positions x V); with `kl_grad` its backward recomputes them the same way).
    fused=False: the fp32 logits [b, T, V] of each row chunk, with gradient, and the teacher's, log-softmaxed
    `time_chunk` positions at a time (models whose logits are not lm_head(h)). Returns logp, entropy (or None), D,
    and the teacher pass's {"seconds", "peak_bytes": the step's peak GPU memory so far when the last teacher pass
    ended (CUDA; 0 on CPU)}.
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
        if rows:
            t0 = time.time()
            tp, tm = common.pad_left([teacher_prompts[s + r] for r in rows], pad_id, ids.device)
            tids, tmask = torch.cat([tp, ids[rows, -T:]], 1), torch.cat([tm, mask[rows, -T:]], 1)
            with torch.no_grad():  # the teacher: stop-gradient
                teacher = logprob_kernels.completion_hidden if fused else logprob_kernels.completion_logits
                zt = teacher(model, tids, tmask, T)  # [r, T, H] or [r, T, V]
            idx = torch.tensor(rows, device=ids.device)
            zs = out[idx] if kl_grad else out.detach()[idx]
            with torch.set_grad_enabled(kl_grad and torch.is_grad_enabled()):
                if fused:  # [positions, V] fp32 temporaries of about 64 MB
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


def kl_weights(kl: torch.Tensor, mask: torch.Tensor, percentile: float = 75.0, c_min: float = 1e-4) -> torch.Tensor:
    """The per-token weight f = D / (D + c), c = max(percentile of D over the active tokens, c_min) (paper §5.1).

    kl, mask: [B, T]; mask marks the active (weighted) tokens. Returns f [B, T], detached, in [0, 1), 0 where the
    mask is 0 (all 0 when no token is active). A NaN D counts as 0 and +inf as 1e6 (both left out of the
    percentile), so f is never NaN.
    """
    kl = kl.detach().float()
    D, ok = torch.nan_to_num(kl, nan=0.0, posinf=1e6, neginf=0.0).clamp(min=0), mask.bool() & torch.isfinite(kl)
    c = max(torch.quantile(D[ok], percentile / 100).item(), c_min) if ok.any() else c_min
    active = mask.bool()
    return torch.where(active, D / (D + c), torch.zeros_like(D))


def diversity_advantage(
    scores: torch.Tensor, group_ids: torch.Tensor, alpha: float = 0.1, eps: float = 1e-6, unbiased: bool = False
) -> torch.Tensor:
    """Solve-none pseudo-advantage alpha * (s_i - mean s) / (std s + eps) within each group (population std unless
    `unbiased`), from scores [n]: s_i = mean f over a rollout's first min(|o_i|, |o_r|) tokens. group_ids: [n].
    Returns [n]."""
    out = torch.zeros_like(scores)
    for rows in group_rows(group_ids):
        s = scores[rows.to(scores.device)]
        out[rows.to(scores.device)] = alpha * (s - s.mean()) / (s.std(unbiased=unbiased) + eps)
    return out


def weights_and_advantages(kl, active, role, group_ids, adv, percentile=75.0, c_min=1e-4, alpha=0.1, unbiased=False):
    """f and the advantages of one set of rows: a micro-batch (the paper's scope of c) or the whole batch (paper §5.1).

    kl, active, adv: [n, T] (D, the weighted tokens, GRPO's advantages); role [n] (build_teachers'); group_ids [n].
    Returns weights [n, T] (1 on plain rows, f = kl_weights(kl, active) elsewhere: 0 on o_r and past L_i), the
    advantages [n, T] (solve-none rows: their GRPO advantage + alpha * zscore of s_i = mean f over the first L_i
    tokens, the GRPO part 0 unless --overlong-buffer shaped the rewards; o_r: 0) and f. `unbiased`: the z-score's
    std convention (unbiased + 1e-4, else population + 1e-6), the same as the GRPO advantage's."""
    f = kl_weights(kl, active, percentile, c_min)  # c from these rows' weighted tokens
    weights, adv, div = torch.where((role == 0)[:, None], 1.0, f), adv.clone(), role == 2
    if div.any():
        s_div = (f * active).sum(-1) / active.sum(-1).clamp(min=1)
        eps = 1e-4 if unbiased else 1e-6
        adv[div] = adv[div] + diversity_advantage(s_div[div], group_ids[div.cpu()], alpha, eps, unbiased)[:, None]
    adv[role == 3] = 0.0
    return weights, adv, f


def validate(args: Args) -> Args:
    """Every flag checked before anything loads: a user error ends with one line naming the flag, exit code 2."""
    args = cli.resume_args(args, Args) if args.resume else args
    cli.check_common(args)
    cli.need(
        args.num_generations >= 2,
        f"--num-generations must be >= 2 (GRPO compares the completions of a prompt), got {args.num_generations}",
    )
    cli.need(
        0 <= args.percentile <= 100 and args.c_min > 0 and args.max_reference_tokens > 0,  # ALGO LOGIC
        f"need 0 <= --percentile <= 100 (got {args.percentile}), --c-min > 0 (got {args.c_min}) and "
        f"--max-reference-tokens > 0 (got {args.max_reference_tokens})",
    )
    cli.need(
        not (args.fsdp and int(os.environ.get("WORLD_SIZE", "1")) > 1),
        "sc_grpo.py does not support --fsdp yet "
        "(its teacher passes differ in size per rank): use DDP, the default under torchrun",
    )
    return dataclasses.replace(args, epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high)


if __name__ == "__main__":
    args = validate(cli.parse(Args))  # tyro.cli(Args), its errors on one line
    cli.set_threads(args.threads)
    run_dir = Path(
        args.resume or Path(args.output_dir) / f"{args.task}__{args.exp_name}__{args.seed}__{int(time.time())}"
    )

    # seeding, model, task; a resumed run then restores its checkpoint into them
    dist, device = distributed.init_distributed(
        args.device, vars(args), args.prompts_per_step, args.dist_timeout, args.fsdp
    )
    common.seed_everything(args.seed + dist.rank)  # per-rank sampling; every rank draws the same global prompt batches
    model, tokenizer = common.load_policy(args.model, device, args.dtype, args.gradient_checkpointing)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.beta > 0 else None
    train_model = dist.wrap(model, ref_model)  # DDP / FSDP2 under torchrun; the model itself otherwise
    task = tasks.load_task(
        args.task,
        tokenizer,
        seed=args.seed,
        num_eval=args.num_eval,
        data_path=args.data_path,
        eval_data_path=args.eval_data_path,
        max_prompt_length=args.max_prompt_length,
        arith_steps=args.arith_steps,
        arith_max_value=args.arith_max_value,
        arith_max_operand=args.arith_max_operand,
        code_timeout=args.code_timeout,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    G = args.num_generations
    # ALGO LOGIC: routing draws from its own generator (the sampling RNG stays grpo.py's); the teacher's context window
    route_gen = torch.Generator().manual_seed(args.seed)
    context = getattr(model.config, "max_position_embeddings", None) or 10**9
    solve_none = (
        (lambda s: bool((s < 1.0).all())) if "none" in args.weighted_groups else None
    )  # dynamic sampling keeps them
    task_examples = {e.id: e for e in task.train}  # ALGO LOGIC: a row's example, by its group id
    batches = checkpoints.CountingBatches(lambda: common.prompt_batches(task.train, args.prompts_per_step, args.seed))
    ckpt, stop = checkpoints.Checkpointer(run_dir, args.save_every, dist), checkpoints.GracefulStop()
    start = ckpt.restore(model, optimizer, batches, {"routing": route_gen}) if args.resume else 0
    engines.attach_engine(
        args.engine, model, optimizer, args.model, args.vllm_gpu_memory_utilization, seed=args.seed + dist.rank
    )
    logger = common.Logger(run_dir, vars(args), args.track, args.wandb_project, enabled=dist.main, resume_step=start)
    dist.print(
        f"run {run_dir.name}: logs in {run_dir}/ (tensorboard --logdir {run_dir.parent}); {len(task.train)} train / "
        f"{len(task.eval)} eval prompts; skipped {task.skipped}" + (f"; resumed after step {start}" if start else "")
    )

    if not start:  # a resumed run has its evaluations in its metrics.jsonl already
        logger.log(
            common.evaluate(
                model, tokenizer, task, args.max_new_tokens, args.gen_batch_size, args.eval_temperature, dist
            ),
            0,
        )
    eval_metrics = metrics = logger.last_eval
    bar = trange(
        start + 1,
        args.total_steps + 1,
        initial=start,
        total=args.total_steps,
        desc="sc_grpo",
        dynamic_ncols=True,
        disable=not dist.main,
    )
    for step in bar:
        # 1-2. rollouts: G completions per prompt, and one reward per completion (the verifier sees the decoded text);
        #      DAPO's dynamic sampling and overlong penalty when asked
        t0 = time.time()
        common.reset_peak_memory(device)
        ro, rewards, sampling = common.rollouts_with_rewards(model, tokenizer, task, batches, dist, args, solve_none)
        mask = ro.completion_mask * ~ro.truncated[:, None] if args.mask_truncated_completions else ro.completion_mask
        T = mask.shape[1]
        t_gen = time.time() - t0

        # 3. ALGO LOGIC: credit assignment. The GRPO advantage sets each token's direction. Each group is routed by its
        #    number of correct rollouts, and each routed rollout gets a teacher prompt: its reference tau before the problem.
        #    f = D / (D + c) needs D, from the student's forward: step 5 sets it per micro-batch (c is the micro-batch's
        #    percentile, paper §5.1), step 4 for the whole batch with --kl-threshold-scope batch.
        unbiased = args.outcome_std == "unbiased"  # one std convention for A and the solve-none z-score
        advantages = common.group_advantages(
            rewards, G, args.scale_rewards, 1e-4 if unbiased else 1e-6, group_ids=ro.group_ids.cpu(), unbiased=unbiased
        ).to(device)
        token_adv = advantages[:, None].expand(-1, T)  # [N, T]
        gid, correct = ro.group_ids.cpu(), ro.scores >= 1.0  # correct: full verifier score (not the shaped reward)
        modes, ref = route_groups(correct, G, route_gen, gid, args.weighted_groups, ro.scores)
        row_examples = [task_examples[int(i)] for i in gid]
        teacher_prompts, role, wlen, bad = build_teachers(
            tokenizer, args.task, ro, row_examples, correct, ref, context - T, args.max_reference_tokens, route_gen
        )
        role, wlen = role.to(device), wlen.to(device)
        weighted = ((role == 1) | (role == 2))[:, None] & (torch.arange(T, device=device) < wlen[:, None])
        active = mask * weighted.float()  # [N, T] the weighted tokens (c's percentile is over them)
        weights, adv = torch.ones_like(mask, dtype=torch.float), token_adv.clone()  # f and A, filled per micro-batch
        kl_seen, f_seen, t_teacher, peak = [], [], 0.0, 0
        per_batch = args.weight_mode == "multiply" and args.kl_threshold_scope == "batch"  # else f is set in step 5

        # 4. old and reference log-probs (no gradient). On-policy (one pass, one mini-batch) the old log-probs are the
        #    current ones detached; otherwise only the first optimizer step is on-policy and they need this pass.
        t0 = time.time()
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad():
            on_policy = args.num_iterations == 1 and args.num_minibatches == 1
            old_logp = None if on_policy else common.token_logprobs(model, input_ids, attn, T, args.temperature)[0]
            ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0] if ref_model else None
            if per_batch:  # ALGO LOGIC: --kl-threshold-scope batch: D of every row first, then f with c over the batch
                D = torch.zeros_like(weights)
                for mb in micro_batches_of_groups(torch.arange(len(ro), device=device), gid, G, args.micro_batch_size):
                    prompts = [teacher_prompts[i] for i in mb.tolist()]
                    _, _, D[mb], tstat = logprobs_and_kl(
                        model, input_ids[mb], attn[mb], T, args.temperature, prompts, tokenizer.pad_token_id
                    )
                    t_teacher, peak = t_teacher + tstat["seconds"], max(peak, tstat["peak_bytes"])
                weights, adv, f = weights_and_advantages(
                    D, active, role, gid, adv, args.percentile, args.c_min, args.alpha, unbiased
                )
                kl_seen, f_seen = [D[active.bool()].cpu()], [f[active.bool()].cpu()]
        t_logp = time.time() - t0

        # 5. update: mu passes; each splits the batch into mini-batches of whole prompts, one optimizer step each,
        #    computed in micro-batches (the loss is normalized over the mini-batch, so accumulation changes nothing)
        t0 = time.time()
        stats = common.UpdateStats(mask, args.num_iterations)
        for it in range(args.num_iterations):
            for rows in common.minibatches(ro.group_ids, args.num_minibatches):
                optimizer.zero_grad(set_to_none=True)
                num_tokens, num_seqs = dist.loss_counts(mask[rows])  # global counts / world size
                micro = micro_batches_of_groups(
                    rows, gid, G, args.micro_batch_size, args.weight_mode == "multiply"
                )  # ALGO LOGIC
                for k, mb in enumerate(micro):
                    dist.sync_grads(train_model, k == len(micro) - 1)  # all-reduce once per optimizer step
                    m = mask[mb].float()
                    # ALGO LOGIC: the student forward also gives D against each routed row's teacher (one no-grad forward).
                    #    f and the solve-none advantages come from the first pass (the teacher is then the current policy).
                    first = it == 0 and args.weight_mode == "multiply" and not per_batch
                    prompts = [teacher_prompts[i] for i in mb.tolist()] if first or args.kl_loss_coef > 0 else None
                    logp, entropy, D, tstat = logprobs_and_kl(
                        train_model,
                        input_ids[mb],
                        attn[mb],
                        T,
                        args.temperature,
                        prompts,
                        tokenizer.pad_token_id,
                        with_entropy=it == 0,
                        kl_grad=args.kl_loss_coef > 0,
                    )
                    act = active[mb]  # the weighted tokens
                    if first:  # f with c from this micro-batch's weighted tokens; solve-none: alpha * zscore(s)
                        weights[mb], adv[mb], f = weights_and_advantages(
                            D, act, role[mb], gid[mb.cpu()], adv[mb], args.percentile, args.c_min, args.alpha, unbiased
                        )
                        f_seen.append(f[act.bool()].cpu())
                    if it == 0 and prompts is not None and not per_batch:
                        kl_seen.append(D.detach()[act.bool()].cpu())
                    t_teacher, peak = t_teacher + tstat["seconds"], max(peak, tstat["peak_bytes"])
                    old = old_logp[mb] if old_logp is not None else logp.detach()
                    # ALGO LOGIC: PPO-clipped surrogate of the per-token advantage, times the per-token weight f
                    ratio = torch.exp(
                        torch.clamp(logp - old, -common.MAX_LOG_RATIO, common.MAX_LOG_RATIO)
                    )  # fp32; clamped as verl
                    A = adv[mb]
                    surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high) * A)
                    per_token_loss = (
                        -surrogate
                        * weights[mb]
                        * engines.engine_correction(ro, mb, old, m, args.vllm_is_cap, stats.engine(it), stats.tokens)
                    )  # vLLM: truncated IS
                    if args.kl_loss_coef > 0:  # the additive baseline: distill toward the teacher on the routed tokens
                        per_token_loss = per_token_loss + args.kl_loss_coef * D * act
                    kl = (
                        common.k3_kl(logp, ref_logp[mb]) if ref_logp is not None else None
                    )  # KL(pi || pi_ref), k3 estimator
                    if kl is not None:
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = common.aggregate_loss(
                        per_token_loss, m, args.loss_agg, args.max_new_tokens, num_tokens, num_seqs
                    )
                    common.stop_if_nonfinite(loss, "loss", step, metrics)
                    loss.backward()
                    stats.add(m, ratio, A, args.epsilon, args.epsilon_high, entropy, kl, loss)  # diagnostics
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                common.stop_if_nonfinite(grad_norm, "gradient norm", step, metrics)
                optimizer.step()
                stats.step(grad_norm)
        t_update = time.time() - t0

        # 6. logging, evaluation, checkpoints
        step_time = t_gen + t_logp + t_update
        metrics = {
            **common.completion_metrics(ro, rewards, G),
            **sampling,
            **stats.metrics(),
            "learning_rate": optimizer.param_groups[0]["lr"],
            "tokens_per_second": sampling["num_tokens"] / step_time,
            "time/generation": t_gen,
            "time/logprobs": t_logp,
            "time/update": t_update,
            "time/step": step_time,
            **common.peak_memory(device),
        }
        # ALGO LOGIC: D and f over this step's weighted tokens (0 when none), group routing, teacher cost, bad inputs
        kl_all, f_all = torch.cat(kl_seen + [torch.zeros(0)]), torch.cat(f_seen + [torch.zeros(0)])
        q = np.percentile(kl_all.numpy(), [75, 95]).tolist() if len(kl_all) else [0.0, 0.0]  # (no 2^24 size limit)
        metrics.update(
            {
                "sc/kl_mean": kl_all.mean().item() if len(kl_all) else 0.0,
                "sc/kl_p75": q[0],
                "sc/kl_p95": q[1],
                "sc/weight_mean": f_all.mean().item() if len(f_all) else 0.0,
                "time/teacher": t_teacher,
                **{
                    f"sc/groups_{k}": modes.count(k) / len(modes) for k in ("partial", "none", "single", "all", "plain")
                },
                **bad,
                "sc/empty_completions": sum(not t.strip() for t in ro.texts),
            }
        )
        if device.type == "cuda":
            metrics["memory/teacher_peak_gb"] = peak / 2**30
        if step == args.total_steps or (args.eval_every and step % args.eval_every == 0):
            eval_metrics = common.evaluate(
                model, tokenizer, task, args.max_new_tokens, args.gen_batch_size, args.eval_temperature, dist
            )
            metrics.update(eval_metrics)
        metrics = dist.reduce_metrics(metrics)  # eval metrics are already the same on every rank
        logger.log(metrics, step)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", eval_acc=f"{eval_metrics['eval/accuracy']:.3f}")
        stopping = stop.requested(dist)  # Ctrl-C: save and leave after this step
        if ckpt.due(step, args.total_steps) or stopping:
            ckpt.save(step, model, tokenizer, optimizer, batches, {"routing": route_gen})
        if stopping:
            logger.close()
            dist.print(
                f"stopped after step {step}; checkpoint in {run_dir}/checkpoint: continue with --resume {run_dir}"
            )
            raise SystemExit(130)

    logger.close()
    dist.print(f"final eval accuracy {eval_metrics['eval/accuracy']:.3f}; metrics in {run_dir}/metrics.jsonl")
    if args.save_model:
        dist.print(f"saved model to {dist.save(model, tokenizer, run_dir / 'model')}")  # every rank joins the save
    dist.close()

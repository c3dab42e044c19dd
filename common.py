"""What every algorithm script uses, in the order a step uses it: prompt batches, rollouts and their
rewards, token log-probs, group advantages, losses and mini-batches, evaluation, and the run's
plumbing (`Run`: set-up and the end of a step, one call each).

Nothing here is an algorithm: each `<algo>.py` keeps its credit assignment and loss inline, so
`diff grpo.py <algo>.py` shows the method. What is neither lives in rlvr_utils/ (its __init__
lists the modules): a default run loads its core; each extra loads where its flag is handled.

Sections: 1. prompt batches, rollouts, rewards  2. token log-probs  3. advantages and losses
4. evaluation  5. the run (TRY NOT TO MODIFY)
"""

from __future__ import annotations

import copy
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from tqdm import tqdm

from rlvr_utils.core import checkpoints, cli, logprob_kernels, models, rollouts, runtime, tasks
from rlvr_utils.core.cli import DEFAULT_MODEL as DEFAULT_MODEL
from rlvr_utils.core.logprob_kernels import MAX_LOG_RATIO as MAX_LOG_RATIO
from rlvr_utils.core.logprob_kernels import ROWS_PER_FORWARD as ROWS_PER_FORWARD
from rlvr_utils.core.models import load_model as load_model
from rlvr_utils.core.models import load_policy as load_policy
from rlvr_utils.core.models import load_tokenizer as load_tokenizer
from rlvr_utils.core.rollouts import Rollouts as Rollouts
from rlvr_utils.core.rollouts import generate_rollouts as generate_rollouts
from rlvr_utils.core.rollouts import make_rollouts as make_rollouts
from rlvr_utils.core.rollouts import pad_left as pad_left
from rlvr_utils.core.rollouts import stop_token_ids as stop_token_ids
from rlvr_utils.core.runtime import UpdateStats as UpdateStats

if TYPE_CHECKING:
    from rlvr_utils.core.runtime import Dist
    from rlvr_utils.core.tasks import Example, Task


# ----------------------------------------------------------------------------------------------
# 1. Prompt batches, rollouts and their rewards
# ----------------------------------------------------------------------------------------------
def with_lora(model, args):
    """--lora-rank: `model` with LoRA adapters on its blocks' linear layers, only they train
    (rlvr_utils/extras/lora.py, PEFT); full fine-tuning (0): `model` itself."""
    if not args.lora_rank:
        return model
    return runtime.extra("lora", "--lora-rank").wrap(model, args)


def reference(model, args):
    """The frozen reference policy (the KL term, EP-GRPO's delta): a copy of `model` as it starts, in
    --dtype (bf16's passes), or under LoRA the same model with its adapters off (lora.AdaptersOff)."""
    if args.lora_rank:
        return runtime.extra("lora", "--lora-rank").AdaptersOff(model)
    dtype = models.compute_dtype(getattr(args, "dtype", "auto"), next(model.parameters()).device)
    return models.cast_weights(copy.deepcopy(model).eval().requires_grad_(False), dtype)


def adamw(params, args) -> torch.optim.Optimizer:
    """torch's AdamW over `params` (fused on CUDA; mixed precision: it steps fp32 masters, its
    state fp32: rlvr_utils/extras/scale/precision.py), or --pure-bf16 kahan's: optimi's, with Kahan
    summation."""
    if args.pure_bf16 == "kahan":
        return runtime.extra("precision", "--pure-bf16 kahan").kahan_adamw(params, args)
    lr, decay, fused = args.learning_rate, args.weight_decay, bool(params) and params[0].is_cuda
    return torch.optim.AdamW(params, lr=lr, weight_decay=decay, fused=fused)  # fused: CUDA


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def prompt_batches(examples: Sequence[Example], n: int, seed: int):
    """Endless stream of `n`-prompt batches, reshuffled every epoch (seeded)."""
    if not 1 <= n <= len(examples):
        k = len(examples)
        raise ValueError(f"need 1 to {k} distinct prompts per batch ({k} prompts), got {n}")
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        batch, taken, later = [], set(), []
        while len(batch) < n:
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            i = order.pop()
            if i in taken:  # a new epoch began inside this batch: a prompt appears once per batch
                later.append(i)
                continue
            taken.add(i)
            batch.append(examples[i])
        order[:0] = later  # drawn later in the epoch
        yield batch


def rollouts_with_rewards(model, tokenizer, task: Task, batches, dist: Dist, args, keep_group=None):
    """Steps 1-2 of the GRPO-style scripts: the next prompt batch (this rank's share),
    `args.num_generations` completions per prompt, and their rewards.

    --dynamic-sampling (DAPO): groups whose verifier scores are all equal are dropped (unless
    `keep_group(scores)`) and more batches are sampled, for at most --max-sampling-rounds rounds;
    surplus groups are cut and, if the rounds run out, dropped groups fill the batch (they carry no
    advantage). --overlong-buffer > 0 subtracts DAPO's overlong penalty from the reward.
    Returns the Rollouts (`.scores`: the verifier's rewards), the rewards [N] to train on, and the
    sampling metrics."""
    G = args.num_generations
    want = args.prompts_per_step // dist.world  # the groups this rank trains on
    rounds = args.max_sampling_rounds if args.dynamic_sampling else 1
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    sampling["batch_size"] = args.gen_batch_size
    kept, dropped, drawn, generated = [], [], 0, 0
    for rnd in range(rounds):
        examples = dist.shard(next(batches))
        prompts, ids = [e.prompt_ids for e in examples], [e.id for e in examples]
        ro = generate_rollouts(model, tokenizer, prompts, ids, G, args.max_new_tokens, **sampling)
        owners = [e for e in examples for _ in range(G)]
        scores = task.rewards(ro.texts, owners, ro.completion_lists())  # TRL's completion_ids too
        ro.scores = torch.tensor(scores, dtype=torch.float32)
        drawn += len(examples)
        generated += int(ro.completion_mask.sum())
        for rows in torch.arange(len(ro)).split(G):
            s = ro.scores[rows]
            s = s[~s.isnan()] if s.isnan().any() else s  # NaN: no reward (TRL's None), left out
            mixed = len(s) and s.max() > s.min() or (keep_group is not None and keep_group(s))
            (kept if mixed or not args.dynamic_sampling else dropped).append((ro, rows))
        if dist.sum([float(len(kept) < want)])[0] == 0:  # every rank's batch is full (a collective)
            break
    if args.dynamic_sampling:  # one batch of the groups, re-padded
        ro = rollouts.regroup((kept + dropped)[:want], tokenizer, stop_token_ids(model, tokenizer))
    out = {"num_tokens": float(ro.completion_mask.sum())}
    out["sampling/generated_tokens"] = float(generated)
    if args.dynamic_sampling:
        out["sampling/prompts_drawn"] = drawn
        out["sampling/rounds"] = rnd + 1
        out["sampling/groups_kept"] = min(len(kept), want) / want
    rewards = ro.scores.clone()
    if args.overlong_buffer:  # DAPO's soft penalty: 0 up to max - buffer tokens, then to -factor
        lengths = ro.completion_mask.sum(1).cpu().float()
        penalty = (args.max_new_tokens - args.overlong_buffer - lengths) / args.overlong_buffer
        rewards = rewards + penalty.clamp(-1.0, 0.0) * args.overlong_penalty_factor
        out["reward/overlong_penalty"] = (rewards - ro.scores).nan_to_num().mean().item()
    return ro, rewards, out


# ----------------------------------------------------------------------------------------------
# 2. Token log-probs (memory-bounded kernels: rlvr_utils/core/logprob_kernels.py)
# ----------------------------------------------------------------------------------------------
def token_logprobs(
    model, input_ids, attention_mask, num_completion_tokens: int, temperature: float = 1.0,
    chunk_size: int | None = None, with_entropy: bool = False, entropy_chunk: int = 128,
    fused: bool | None = None, keep: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Per-token log-probs of the last `num_completion_tokens` tokens of each row.

    input_ids, attention_mask: [B, L] (prompt left-padded, completion right-padded). Returns logp
    [B, T] and, with `with_entropy`, the per-token entropy [B, T] (nats, no gradient) of the same
    distribution, else None. Padded completion positions are finite but meaningless: mask them.
    Memory: rows go `chunk_size` at a time (default: logprob_kernels.rows_per_forward); no [B, T, V]
    log-softmax or fp32 logits exist, forward or backward. `fused` (default: fused_logprobs_ok):
    FusedLinearLogProb applies the lm_head to the final hidden states a few positions at a time, so
    not even the [b, T, V] logits exist; else (logits that are not lm_head(h))
    rlvr_utils/extras/unfused.py takes z[y] - logsumexp(z) from the model's own logits in fp32 a few
    positions at a time. Both
    compute the same function (logits over the sampling temperature). `keep`: a list that gets each
    row chunk's final hidden states (unfused: its logits), with their gradient (SC-GRPO's D)."""
    T = num_completion_tokens
    fused = logprob_kernels.fused_logprobs_ok(model) if fused is None else fused
    chunk_size = chunk_size or logprob_kernels.rows_per_forward(input_ids.shape, fused)
    if fused:
        lm = logprob_kernels.unwrap(model).get_output_embeddings()
        positions = max(1, 2**25 // lm.out_features)  # fp32 [positions, V] temporaries of ~128 MB
    logps, ents = [], []
    for s in range(0, input_ids.shape[0], chunk_size):
        ids, mask = input_ids[s : s + chunk_size], attention_mask[s : s + chunk_size]
        target = ids[:, -T:]
        if fused:
            h = logprob_kernels.completion_hidden(model, ids, mask, T)  # [b, T, H]
            if keep is not None:  # the student's side of SC-GRPO's D
                keep.append(h)
            flat = (h.reshape(-1, h.shape[-1]), lm.weight, lm.bias, target.reshape(-1))
            lp, ent = logprob_kernels.FusedLinearLogProb.apply(
                *flat, temperature, positions, with_entropy
            )
            logps.append(lp.view(ids.shape[0], T))
            ents += [ent.view(ids.shape[0], T)] if with_entropy else []
        else:  # logits that are not lm_head(h): the model's own (rlvr_utils/extras/unfused.py)
            unfused = runtime.extra("unfused", "a model whose logits are not lm_head(h)")
            out = unfused.logprobs(
                model, ids, mask, T, temperature, with_entropy, entropy_chunk, keep
            )
            logps.append(out[0])
            ents += [out[1]] if with_entropy else []
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


# ----------------------------------------------------------------------------------------------
# 3. Advantages and losses
# ----------------------------------------------------------------------------------------------
def constant_groups(rewards: torch.Tensor, group_ids: torch.Tensor):
    """Group index [N] of each completion (0..G-1, in sorted id order) and, per group, whether all
    its rewards are equal [G] (the groups plain GRPO gets no gradient from; a NaN reward, which no
    reward function gave, is left out)."""
    r = rewards.float()
    _, inv = torch.unique(group_ids.to(r.device), return_inverse=True)
    G = int(inv.max()) + 1
    hi, lo = (r, r) if not r.isnan().any() else (r.nan_to_num(v) for v in (-math.inf, math.inf))
    gmax = torch.full((G,), -float("inf"), device=r.device).scatter_reduce(0, inv, hi, "amax")
    gmin = torch.full((G,), float("inf"), device=r.device).scatter_reduce(0, inv, lo, "amin")
    return inv, gmax == gmin


def group_advantages(
    rewards: torch.Tensor, group_size: int | None, scale: str = "group", eps: float = 1e-4,
    group_ids: torch.Tensor | None = None, unbiased: bool = True,
) -> torch.Tensor:  # fmt: skip
    """GRPO's outcome advantage per completion: reward minus its group's mean, scaled.

    rewards: [N]. Groups: the completions sharing a `group_ids` value (the prompt id); without
    `group_ids`, consecutive blocks of `group_size`. Every group has `group_size` members
    (group_size=None with group_ids allows any sizes). scale: "group" divides by the group's std
    (original GRPO), "batch" by the batch's (Lite PPO), "none" not at all (Dr. GRPO). The std is
    unbiased (Bessel, as TRL and verl; `unbiased=False`: the population std), then
    (r - mean) / (std + eps), eps = 1e-4 as TRL. A group whose rewards are all equal gets exactly 0
    (never NaN). A NaN reward (every --reward-fn returned None) is left out of its group's mean
    and std (and the batch's) and gets 0, as in TRL. Returns [N] float32.

    >>> rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # two groups of 2, each of mean 0.5
    >>> rewards[:2].std()  # a group's std (unbiased)
    tensor(0.7071)
    >>> group_advantages(rewards, 2)  # (r - mean) / (std + 1e-4)
    tensor([ 0.7070, -0.7070, -0.7070,  0.7070])
    """
    r = rewards.float()
    N = r.shape[0]
    if group_ids is None:
        if not group_size or N % group_size:
            raise ValueError(f"{N} rewards are not a whole number of groups of {group_size}")
        group_ids = torch.arange(N, device=r.device) // group_size
    inv, constant_g = constant_groups(r, group_ids)
    counts = torch.bincount(inv)
    if group_size is not None and (counts != group_size).any():
        sizes = sorted(set(counts.tolist()))
        raise ValueError(f"every group must have {group_size} completions, got sizes {sizes}")
    if (unscored := r.isnan()).any():  # the scored rows alone (none: all 0)
        keep, adv, gid = ~unscored, torch.zeros_like(r), group_ids.to(r.device)[~unscored]
        adv[keep] = group_advantages(r[keep], None, scale, eps, gid, unbiased) if gid.numel() else 0
        return adv
    G = counts.shape[0]
    n = counts.float()
    mean = torch.zeros(G, device=r.device).index_add_(0, inv, r) / n
    centered = r - mean[inv]
    sq = torch.zeros(G, device=r.device).index_add_(0, inv, centered**2)
    std = (sq / ((n - 1).clamp(min=1) if unbiased else n)).sqrt()
    constant = constant_g[inv]
    if scale == "group":
        adv = centered / (std[inv] + eps)
    elif scale == "batch":
        adv = centered / (r.std() + eps if N > 1 else 1.0)
    elif scale == "none":
        adv = centered
    else:
        raise ValueError(f"unknown scale {scale!r}: choose group, batch or none")
    return torch.where(constant, torch.zeros_like(adv), adv)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) (Schulman): exp(d) - d - 1 with
    d = log pi_ref - log pi, in fp32. d is clamped to +-MAX_LOG_RATIO before exp and the estimate
    to [0, 10], as verl's low_var_kl, so tokens whose log-probs drifted far apart cannot overflow.
    0 where they agree."""
    d = (ref_logp.float() - logp.float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (torch.exp(d) - d - 1).clamp(max=10.0)


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate_loss(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_completion_length: int | None = None,
    num_tokens: float | None = None, num_seqs: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Reduce a [B, T] per-token loss to a scalar (verl's names; TRL's in brackets).

    token-mean               sum over all tokens / number of tokens        (DAPO, TRL "dapo"/"bnpo")
    seq-mean-token-mean      each sequence's token mean, mean over rows    (original GRPO, "grpo")
    seq-mean-token-sum-norm  sum over tokens / (rows x max_completion_length)  (Dr. GRPO, "dr_grpo")
    Micro-batches: pass the whole mini-batch's `num_tokens` (active tokens) and `num_seqs` (rows),
    so the micro-batch losses add up to its loss and accumulation does not change the step.
    Rows without tokens contribute 0."""
    m = mask.to(per_token.dtype)
    rows = num_seqs if num_seqs is not None else per_token.shape[0]
    if mode == "token-mean":
        denom = num_tokens if num_tokens is not None else m.sum()
        return (per_token * m).sum() / max(float(denom), 1.0)
    if mode == "seq-mean-token-mean":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).sum() / max(float(rows), 1.0)
    if mode == "seq-mean-token-sum-norm":
        if not max_completion_length:
            raise ValueError("seq-mean-token-sum-norm needs max_completion_length")
        return (per_token * m).sum() / (max(float(rows), 1.0) * max_completion_length)
    raise ValueError(f"unknown loss aggregation {mode!r}: choose one of {LOSS_AGG_MODES}")


def engine_correction(ro, rows, old_logp, mask, args, stats: UpdateStats, it: int):
    """--engine vllm: importance weights toward the engine's sampling distribution, and on the first
    pass (`it` 0) the engine-trainer mismatch into `stats` (engines.engine_correction: --vllm-is-mode,
    --vllm-is-cap); 1.0 with Hugging Face generate (the trainer sampled the rollouts itself)."""
    if ro.engine_logp is None:
        return 1.0
    engines = runtime.extra("engines", "--engine vllm")
    return engines.engine_correction(ro, rows, old_logp, mask, args, stats.engine(it), stats.tokens)


def minibatches(group_ids: torch.Tensor, num_minibatches: int) -> list[torch.Tensor]:
    """Row indices [n] of each mini-batch: the groups (prompts) in order of first appearance, split
    into `num_minibatches` runs of equally many whole groups (one optimizer step each)."""
    ids = group_ids.tolist()
    groups = list(dict.fromkeys(ids))
    if len(groups) % num_minibatches:
        what = f"the {len(groups)} prompts of this rank's batch"
        raise ValueError(f"--num-minibatches {num_minibatches} must divide {what}")
    per = len(groups) // num_minibatches
    where = {g: i // per for i, g in enumerate(groups)}
    rows = [[r for r, g in enumerate(ids) if where[g] == k] for k in range(num_minibatches)]
    return [torch.tensor(r, device=group_ids.device) for r in rows]


def stop_if_nonfinite(value: torch.Tensor | float, what: str, step: int, last_metrics: dict):
    """Stop the run (exit code 1) with the step and the last metrics when `value` is NaN or inf.
    Called before the optimizer step: no update and no checkpoint is made from NaN weights."""
    v = float(value.detach()) if torch.is_tensor(value) else float(value)
    if not math.isfinite(v):
        shown = {k: round(x, 4) if isinstance(x, float) else x for k, x in last_metrics.items()}
        raise SystemExit(
            f"non-finite {what} ({v}) at step {step}; stopping without an update or a checkpoint. "
            f"Last metrics: {json.dumps(shown)}"
        )


# ----------------------------------------------------------------------------------------------
# 4. Evaluation
# ----------------------------------------------------------------------------------------------
def evaluate(
    model, tokenizer, task: Task, max_new_tokens: int, batch_size: int = 64,
    temperature: float = 0.0, dist: Dist | None = None, success_threshold: float = 1.0, num_generations=0,
) -> dict:  # fmt: skip
    """pass@1 on the task's held-out prompts: greedy when temperature == 0 (default), else one
    sample at that temperature. Returns {"eval/accuracy": the share of prompts whose reward reaches
    `success_threshold`, "eval/reward": the mean reward, "eval/mean_length"}. Under torchrun each
    rank evaluates an equal slice (the last one padded with repeats that are not counted) and the
    sums are all-reduced, so every rank returns the same figures. num_generations > 0: TRL's
    evaluation, samples and their training metrics (rlvr_utils/extras/trl_eval.py)."""
    ex, rank, world = task.eval, (dist.rank if dist else 0), (dist.world if dist else 1)
    n = -(-len(ex) // world)
    mine = ex[rank * n : (rank + 1) * n]
    counted, G = len(mine), max(num_generations, 1)
    mine = mine + [ex[0]] * (n - counted)  # equal slices: FSDP ranks run the same generate calls
    greedy = dict(temperature=max(temperature, 1e-5), do_sample=temperature > 0)
    prompts, ids = [e.prompt_ids for e in mine], [e.id for e in mine]
    ro = generate_rollouts(
        model, tokenizer, prompts, ids, G, max_new_tokens, **greedy, batch_size=batch_size
    )
    k, owners = counted * G, [e for e in mine[:counted] for _ in range(G)]
    r = task.rewards(ro.texts[:k], owners, ro.completion_lists()[:k], mode="eval")
    if num_generations:  # TRL's evaluation: the samples' training metrics, under eval/
        trl_eval = runtime.extra("trl_eval", "--eval-num-generations")
        return trl_eval.metrics(task, ro, r, G, success_threshold, dist, len(ex))
    r = [x for x in r if x == x]  # NaN: no reward function scored it (TRL's None): left out
    correct, total, n = sum(x >= success_threshold for x in r), sum(r), len(r)
    length = ro.completion_mask[:counted].sum().item()
    if dist is not None:
        correct, total, length, n = dist.sum([correct, total, length, n])
    out = {"eval/accuracy": correct / len(ex), "eval/reward": total / n if n else math.nan}
    out["eval/mean_length"] = length / len(ex)
    return task.with_reward_metrics(out, mode="eval")  # --reward-fn: eval/rewards/<name>/mean, ...


# ----------------------------------------------------------------------------------------------
# 5. The run (TRY NOT TO MODIFY): what every script does around its algorithm, one call each
# ----------------------------------------------------------------------------------------------
TASK_FLAGS = (  # what tasks.load_task takes
    "seed num_eval data_path eval_data_path max_prompt_length arith_steps arith_max_value arith_max_operand "
    "arith_variant code_timeout code_sandbox reward_fn reward_weights reward_timeout success_threshold"
).split()


def load_task(args, tokenizer) -> Task:
    """The task named by --task, built with the shared task flags (tasks.load_task). The scripts
    build it before the model loads, so a task that yields nothing (every prompt too long, every
    gold unparsable, a dataset that cannot be fetched) ends the run at once: one line, exit 2."""
    flags = {k: getattr(args, k) for k in TASK_FLAGS}  # a prompt fits beside a whole completion:
    limit = models.prompt_limit(args.model, args.max_prompt_length, args.max_new_tokens)
    flags["max_prompt_length"] = limit
    try:
        task = tasks.load_task(args.task, tokenizer, **flags)
    except SystemExit:
        raise
    except Exception as e:  # a dataset that cannot be fetched or read, a template that refuses, ...
        source = args.data_path or tasks.HUB_DATASETS.get(args.task, ("the built-in task",))[0]
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        cli.usage_error(f"--task {args.task} ({source}): {why}")
    n = args.prompts_per_step
    cli.need(
        len(task.train) >= n,
        f"--prompts-per-step {n}: the task has {len(task.train)} training prompts (a batch holds "
        f"distinct prompts; skipped: {task.skipped})",
    )
    return task


class Run:
    """The plumbing of a run, so that a script's loop shows only rollouts, rewards, credit, loss
    and update:  run = Run(args)  (threads, torchrun: run.dist, run.device, seeding; run.dtype, what
    the policy loads in: float32 for mixed precision's masters); then the script loads its task and
    model and builds its optimizer; run.start(model, tokenizer, optimizer, task) (the run directory,
    prompt batches, --resume, the vLLM engine, logging, the step-0 evaluation); `for step in
    run.steps():` (a progress bar; each step's clock and peak memory start there); run.lap(
    "generation") (seconds since the last lap: time/generation); run.end_step(...) (metrics,
    evaluation, logging, checkpoint, Ctrl-C); run.finish() (the final accuracy, --save-model, the
    process group). `state`: objects (RNGs, models) a checkpoint holds besides the policy,
    optimizer and data position."""

    def __init__(self, args):
        cli.set_threads(args.threads)
        runtime.stop_while_loading()  # Ctrl-C or SIGTERM before the first step: one line, exit 130
        self.args, self.state, self.metrics, self.times = args, {}, {}, {}
        flags, n = vars(args), args.prompts_per_step
        self.dist, self.device = runtime.init_distributed(
            args.device, flags, n, args.dist_timeout, args.fsdp
        )
        self.dist.mixed = models.mixed_precision(args, self.device)  # bf16 compute, fp32 masters
        self.dtype = "float32" if self.dist.mixed else args.dtype  # the policy's weights load so
        seed_everything((args.seed + self.dist.rank) % 2**32)  # per-rank sampling, the same batches
        self.dir = Path(args.resume).absolute() if args.resume else None  # a reward may chdir
        self.credit = None  # --log-credit's record (rlvr_utils/extras/credit.py)
        name = f"{args.task}__{args.exp_name}__{args.seed}__{int(time.time())}"  # its own directory
        self.name = self.dir.name if self.dir else name  # made in start(), once the task loads
        where = self.dir or Path(args.output_dir).absolute() / name
        board = f"tensorboard --logdir {shlex.quote(checkpoints.shown(where.parent))}"  # one word
        self.dist.print(f"run {self.name}: logs in {checkpoints.shown(where)}/ ({board}); loading "
                        f"{checkpoints.shown(args.model)} and the {args.task} task")  # fmt: skip

    def start(self, model, tokenizer, optimizer, task, state: dict | None = None) -> None:
        a, dist = self.args, self.dist
        self.model, self.tokenizer, self.optimizer, self.task = model, tokenizer, optimizer, task
        self.state = state or {}
        if (mixed := getattr(model, "_rlvr_precision", None)) is not None:  # fp32 masters:
            mixed.attach(optimizer)  # bf16 copies refreshed after each step, before vLLM's sync
        models.check_vocab(a.model, model, tokenizer)  # before the run directory exists
        self.stop = runtime.GracefulStop()  # a stop asked while loading, its StopNow lost: here
        if self.dir is None:  # its own directory, made exclusively on rank 0 (taken: a suffix)
            made = checkpoints.new_run_dir(a.output_dir, self.name) if dist.main else None
            self.dir = Path(dist.broadcast(str(made) if made else None))
        if dist.main:  # one writer per run directory
            checkpoints.lock_run_dir(self.dir)
        self.batches = checkpoints.CountingBatches(
            lambda: prompt_batches(task.train, a.prompts_per_step, a.seed)
        )
        self.ckpt = checkpoints.Checkpointer(self.dir, a.save_every, dist)
        self.first = 1
        if a.resume:  # the checkpoint into the model, optimizer, prompt stream and RNGs just built
            resume = runtime.extra("resume", "--resume")
            with checkpoints.masters_of(model, *self.state.values()):  # mixed precision: fp32
                step = resume.restore(self.ckpt, model, optimizer, self.batches, self.state)
            self.first = step + 1
        if a.log_credit and dist.main:  # --log-credit: each token's credit, from the gradient
            credit = runtime.extra("credit", "--log-credit")
            self.credit = credit.CreditLog(self.dir / "credit.jsonl", a.log_credit)
        if a.engine == "vllm" or cli.auto_vllm(vars(a)):  # auto: vLLM importable and a GPU present
            runtime.extra("engines", "--engine vllm").attach_run_engine(model, optimizer, a, dist)
        model._rlvr_hf_generate = a.engine == "hf"  # else rollouts.StaticDecoder
        hashes = {}
        if a.data_path or a.eval_data_path or a.reward_fn:  # their hashes, for --resume to compare
            hashes = runtime.extra("data_tasks", "--data-path or --reward-fn").file_hashes(a)
        resumed = self.first - 1
        task.begin(self.dir, dist.rank, resumed, a)  # --reward-fn: trainer_state, log_extra's file
        config = {**vars(a), "script": Path(sys.argv[0]).name, "file_hashes": hashes}
        reported = (*a.report_to, *["wandb"] * a.track)  # --track: the old --report-to wandb
        logs = (self.dir, config, reported, a.wandb_project, dist.main, resumed)
        self.logger = runtime.Logger(*logs)  # TensorBoard, metrics.jsonl, --report-to's trackers
        taken = self.dir.name != self.name  # two runs in the same second: a suffix
        taken = f"run directory {self.dir.name} ({self.name} was taken); " if taken else ""
        dist.print(f"{taken}{len(task.train)} train / {len(task.eval)} eval prompts; skipped "
                   f"{task.skipped}" + (f"; resumed after step {resumed}" if resumed else ""))  # fmt: skip
        if not resumed:  # a resumed run has its evaluations in its metrics.jsonl already
            self.logger.log(self.evaluate(), 0)
        self.metrics = self.logger.last_eval

    def evaluate(self) -> dict:
        a = self.args  # --eval-num-generations: --eval-temperature, else --temperature (TRL)
        temp = a.eval_temperature or (a.temperature if a.eval_num_generations else 0.0)
        flags = (a.max_new_tokens, a.gen_batch_size, temp, self.dist, a.success_threshold)
        return evaluate(self.model, self.tokenizer, self.task, *flags, a.eval_num_generations)

    def steps(self):
        """The steps still to run, with a progress bar; each starts a new peak-memory measurement
        and clock."""
        a = self.args
        todo = range(self.first, a.total_steps + 1)
        bar = dict(initial=self.first - 1, total=a.total_steps, desc=Path(sys.argv[0]).stem)
        self.bar = tqdm(todo, **bar, dynamic_ncols=True, disable=not self.dist.main)
        for step in self.bar:
            runtime.reset_peak_memory(self.device)
            self.step, self.times, self.clock = step, {}, time.time()
            if self.credit is not None:  # --log-credit: at the evaluation steps
                self.credit.start(self.eval_due(step))
            yield step

    def eval_due(self, step: int) -> bool:
        every = self.args.eval_every
        return step == self.args.total_steps or bool(every and step % every == 0)

    @property
    def crediting(self) -> bool:
        """--log-credit records this step (an evaluation step)."""
        return self.credit is not None and self.credit.active

    def watch_credit(self, logp, rows, mask, num_tokens, num_seqs) -> None:
        """--log-credit: keep the gradient of these rows' log-probs [b, T], with each token's
        aggregation weight (the loss's aggregate_loss call, on ones), to record
        -dL/dlog p / weight after the update."""
        if not self.crediting:
            return
        a = self.args
        ones = torch.ones_like(mask, dtype=torch.float, requires_grad=True)
        agg = aggregate_loss(ones, mask, a.loss_agg, a.max_new_tokens, num_tokens, num_seqs)
        self.credit.watch(logp, rows, torch.autograd.grad(agg, ones)[0])

    def credit_signals(self, **signals) -> None:
        """--log-credit: the method's own per-row or per-token signals, recorded beside the credit."""
        if self.crediting:
            self.credit.signals(**signals)

    def lap(self, name: str) -> float:
        """Seconds since the step or the last lap began, logged as time/<name>."""
        now = time.time()
        self.times[name], self.clock = now - self.clock, now
        return self.times[name]

    def stop_if_nonfinite(self, value, what: str) -> None:
        stop_if_nonfinite(value, what, self.step, self.metrics)
        if what == "loss" and self.crediting:  # the backward follows: record its gradient only
            self.credit.before_backward()

    def end_step(self, step: int, ro: Rollouts, rewards, stats: UpdateStats, extra: dict) -> None:
        """The step's metrics (TRL's names; `extra`: the sampling metrics and the method's own), the
        evaluation when due, logging, the checkpoint when due, and Ctrl-C: save and leave after
        this step (exit code 130)."""
        a, dist = self.args, self.dist
        step_time = sum(self.times.values())
        num_tokens = extra.get("num_tokens", float(ro.completion_mask.sum()))
        metrics = runtime.completion_metrics(ro, rewards, a.num_generations, a.success_threshold)
        metrics |= {"num_tokens": num_tokens, **extra, **stats.metrics()}
        metrics["learning_rate"] = self.optimizer.param_groups[0]["lr"]
        metrics["tokens_per_second"] = num_tokens / step_time
        metrics |= {f"time/{k}": v for k, v in self.times.items()}
        metrics["time/step"] = step_time
        metrics |= runtime.peak_memory(self.device)
        # --reward-fn: rewards/<name>/mean, ... over the rows trained on (their unshaped rewards)
        trained = (ro, rewards if ro.scores is None else ro.scores)
        metrics = self.task.with_reward_metrics(metrics, step, rows=trained)
        if self.crediting:
            name, mask = Path(sys.argv[0]).name, ro.completion_mask
            rows = self.credit.write(step, name, ro, rewards, self.tokenizer, mask)
            self.logger.text("credit", runtime.extra("credit", "--log-credit").as_text(rows), step)
        if self.eval_due(step):
            metrics.update(self.evaluate())
        self.metrics = metrics = dist.reduce_metrics(metrics)  # eval: the same on every rank
        self.logger.log(metrics, step)
        acc = self.logger.last_eval["eval/accuracy"]
        self.bar.set_postfix(reward=f"{metrics['reward']:.3f}", eval_acc=f"{acc:.3f}")
        stopping = self.stop.requested(dist)
        if self.ckpt.due(step, a.total_steps) or stopping:
            self.ckpt.save(
                step, self.model, self.tokenizer, self.optimizer, self.batches, self.state
            )
        if stopping:
            self.logger.close()
            here = checkpoints.shown(self.dir)
            dist.print(f"stopped after step {step}; checkpoint in {here}/checkpoint: continue with "
                       f"--resume {shlex.quote(here)}")  # fmt: skip
            dist.close(then_exit=True, code=130)  # torchrun: every rank exits 130 here
            raise SystemExit(130)

    def finish(self) -> None:
        self.logger.close()
        saved = None
        if self.args.save_model:  # --save-model: a Hugging Face folder with its model card
            card = runtime.extra("model_card", "--save-model")  # its example: an eval prompt
            out = (self.dir / "model", self.task.eval[0].prompt, vars(self.args))
            saved = card.save_final_model(self.dist, self.model, self.tokenizer, *out)
        acc = self.logger.last_eval["eval/accuracy"]
        here = checkpoints.shown(self.dir)
        self.dist.print(f"final eval accuracy {acc:.3f}; metrics in {here}/metrics.jsonl")
        if saved is not None:  # after the save (rank 0): a closed stdout cannot lose the model
            self.dist.print(card.saved_line(saved, vars(self.args)))
        checkpoints.unlock_run_dir(self.dir)  # a clean finish: .lock goes (rank 0 holds it)
        self.dist.close(then_exit=True)  # torchrun: every rank exits 0 here

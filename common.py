"""What every algorithm script uses: seeding, model loading, prompt batches, rollouts and their rewards (with DAPO's
dynamic sampling and overlong penalty), token log-probs, group advantages, mini-batches, loss aggregation, update
diagnostics, evaluation, logging, the non-finite guard and metrics.

Nothing here is an algorithm: each `<algo>.py` keeps its credit assignment and loss inline, so
`diff grpo.py <algo>.py` shows only the method. Everything else lives in a sibling module named for its topic:
  tasks.py            prompts and rewards of a task (load_task), built on:
    arith.py            the built-in arithmetic task, its verifier and first-wrong-step oracle
    rewards.py          GSM8K and MATH (math-verify) rewards
    sandbox.py          the code task: running programs against unit tests (harness: sandbox_harness.py)
  logprob_kernels.py  what token_logprobs is built on: the padded batch's layout, the fused and unfused kernels
  checkpoints.py      atomic model saves, resumable checkpoints (--save-every, --resume), Ctrl-C
  cli.py              flag checks before anything loads (one-line errors), --resume's flags, --threads
  distributed.py      torchrun: DDP / FSDP2, sharded prompts, global loss normalization
  engines.py          the colocated vLLM rollout engine

Sections: 1. seeding  2. models  3. prompt batches and rollouts  4. token log-probs  5. advantages and losses
6. evaluation, logging, metrics
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from rlvr_utils.logprob_kernels import MAX_LOG_RATIO, FusedLinearLogProb, SelectedLogProb, completion_hidden, \
    completion_logits, entropy_from_logits, fused_logprobs_ok, unwrap

if TYPE_CHECKING:
    from rlvr_utils.distributed import Dist
    from rlvr_utils.tasks import Example, Task

REPO_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = str(REPO_DIR / "assets" / "tiny-arith")


# ----------------------------------------------------------------------------------------------
# 1. Seeding (checkpoints and resumable runs: checkpoints.py)
# ----------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# ----------------------------------------------------------------------------------------------
# 2. Models
# ----------------------------------------------------------------------------------------------
def _load_tokenizer(name_or_path: str):
    """AutoTokenizer, except for a tokenizer saved with the generic class (the bundled character
    tokenizer): AutoTokenizer would rebuild it from config.json's model type (Qwen2Tokenizer) and
    silently drop its spaces and newlines, so it is loaded as exactly what was saved."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg = Path(name_or_path).expanduser() / "tokenizer_config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(name_or_path)
    return AutoTokenizer.from_pretrained(name_or_path)


def load_policy(name_or_path: str, device: torch.device, dtype: str = "auto", gradient_checkpointing: bool = False):
    """`from_pretrained` a causal LM and its tokenizer (left padding for generation). dtype "auto": bfloat16 on CUDA,
    float32 on CPU. A missing local path or an unreachable hub id is a clear error that names it. Dropout is off
    (log-probs must be the sampling distribution's). `gradient_checkpointing`: each decoder layer is recomputed in
    the backward (non-reentrant); the model is then kept in train mode, which that needs (generation switches to
    eval mode and back)."""
    from transformers import AutoModelForCausalLM

    looks_local = name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/").split("/", 2)[-1]
    if looks_local and not Path(name_or_path).expanduser().exists():
        raise SystemExit(f"--model {name_or_path}: no such directory")
    torch_dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
                   "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    try:
        tokenizer = _load_tokenizer(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype).to(device)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"--model {name_or_path}: cannot load it ({type(e).__name__}: {str(e).splitlines()[0]}). "
            "Pass a local Hugging Face directory, or a hub id on a machine with internet access."
        ) from e
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    disable_dropout(model)
    if gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # transformers checkpoints a layer only in train mode
    return model, tokenizer


def disable_dropout(model) -> None:
    """Every dropout of the model to 0: nn.Dropout modules and the attention-dropout floats attention layers keep."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory measurement (CUDA; nothing on CPU)."""
    torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" else None


def peak_memory(device: torch.device) -> dict:
    """{"memory/peak_gb": peak GPU memory allocated since `reset_peak_memory`} on CUDA, {} on CPU."""
    return {"memory/peak_gb": torch.cuda.max_memory_allocated(device) / 2**30} if device.type == "cuda" else {}


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion (generation config's EOS ids and the tokenizer's)."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


# ----------------------------------------------------------------------------------------------
# 3. Prompt batches and rollouts
# ----------------------------------------------------------------------------------------------
def prompt_batches(examples: Sequence[Example], n: int, seed: int):
    """Endless stream of `n`-prompt batches, reshuffled every epoch (seeded)."""
    if n < 1 or not examples:
        raise ValueError(f"need at least one prompt per batch and a non-empty prompt set (n={n}, {len(examples)} prompts)")
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        batch = []
        while len(batch) < n:
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch.append(examples[order.pop()])
        yield batch


@dataclasses.dataclass
class Rollouts:
    """N = prompts x G completions. Prompts left-padded to P tokens, completions right-padded to T."""

    prompt_ids: torch.Tensor  # [N, P]
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T]
    completion_mask: torch.Tensor  # [N, T] 1 up to and including the stop token
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without a stop token
    group_ids: torch.Tensor  # [N] long: the prompt's Example.id
    texts: list[str]  # decoded completions, special tokens removed
    engine_logp: torch.Tensor | None = None  # [N, T] the vLLM engine's log-probs of the sampled tokens (None with HF)
    scores: torch.Tensor | None = None  # [N] the verifier's rewards (before any shaping), from rollouts_with_rewards
    engine_released_gb: float = 0.0  # GPU memory the engine released by sleeping after this generation

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def __len__(self) -> int:
        return self.completion_ids.shape[0]


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention mask [n, P] of token-id lists, left-padded to the longest."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, P - len(s):] = torch.tensor(list(s))
            mask[i, P - len(s):] = 1
    return ids.to(device), mask.to(device)


def completion_mask_from_ids(completion_ids: torch.Tensor, stop_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask = 1 up to and including the first stop token; truncated = no stop token in the row."""
    is_stop = torch.isin(completion_ids, torch.tensor(list(stop_ids), device=completion_ids.device))
    after_stop = (is_stop.long().cumsum(1) - is_stop.long()) > 0  # strictly after the first stop
    mask = (~after_stop).long()
    return mask, ~is_stop.any(1)


def make_rollouts(tokenizer, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                  group_ids: Sequence[int], stop_ids: Sequence[int], device=None) -> Rollouts:
    """Assemble a Rollouts batch from token-id lists: prompts left-padded, completions right-padded,
    completion mask 1 over each completion's own tokens, truncated = no stop token in it. For
    trajectories not sampled in one generate() call (SRPO's prefix + suffix continuations)."""
    p_ids, p_mask = pad_left(prompts, tokenizer.pad_token_id, device)
    T = max(max((len(c) for c in completions), default=0), 1)
    c_ids = torch.full((len(completions), T), tokenizer.pad_token_id, dtype=torch.long)
    c_mask = torch.zeros((len(completions), T), dtype=torch.long)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        c_mask[i, : len(c)] = 1
    truncated = ~(torch.isin(c_ids, torch.tensor(list(stop_ids))) & c_mask.bool()).any(1)
    texts = tokenizer.batch_decode([list(c) for c in completions], skip_special_tokens=True)
    return Rollouts(p_ids, p_mask, c_ids.to(device), c_mask.to(device), truncated.to(device),
                    torch.tensor(list(group_ids), device=device), texts)


@torch.no_grad()
def generate_rollouts(model, tokenizer, prompts: Sequence[Sequence[int]], group_ids: Sequence[int], num_generations: int,
                      max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                      do_sample: bool = True, batch_size: int = 64) -> Rollouts:
    """Sample `num_generations` completions per prompt with batched `model.generate` (KV cache,
    left padding, stop at EOS). Sampling is plain temperature sampling (top-p 1, top-k off) unless
    asked, so it matches the distribution `token_logprobs(..., temperature)` scores.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt (no tokens)")
    device = next(model.parameters()).device
    stops = stop_token_ids(model, tokenizer)
    flat = [(list(p), g) for p, g in zip(prompts, group_ids) for _ in range(num_generations)]
    engine = getattr(model, "_rlvr_engine", None)
    if engine is not None:  # vLLM: same sampling settings, token ids in and out, plus its log-probs
        comps, logps = engine.generate(prompts, num_generations, max_new_tokens, temperature, top_p, top_k, do_sample, stops)
        ro = make_rollouts(tokenizer, [p for p, _ in flat], comps, [g for _, g in flat], stops, device)
        T = ro.completion_ids.shape[1]
        ro.engine_logp = torch.tensor([lp + [0.0] * (T - len(lp)) for lp in logps], dtype=torch.float32, device=device)
        engine.sleep()  # GPU: weights and KV cache released while the trainer works (woken by the next call or sync)
        ro.engine_released_gb = engine.released_gb
        return ro
    was_training = model.training
    model.eval()
    completions: list[list[int]] = []
    for s in range(0, len(flat), batch_size):
        chunk = [p for p, _ in flat[s : s + batch_size]]
        ids, mask = pad_left(chunk, tokenizer.pad_token_id, device)
        kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else dict(do_sample=False)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stops, synced_gpus=getattr(model, "_rlvr_synced_gpus", False), **kw,
        )
        completions.extend(out[:, ids.shape[1]:].tolist())
    model.train(was_training)
    T = max(len(c) for c in completions)
    raw = torch.full((len(completions), T), tokenizer.pad_token_id, dtype=torch.long)
    for i, c in enumerate(completions):
        raw[i, : len(c)] = torch.tensor(c)
    kept = completion_mask_from_ids(raw, stops)[0].sum(1).tolist()  # tokens up to and including the stop
    return make_rollouts(tokenizer, [p for p, _ in flat], [c[:n] for c, n in zip(completions, kept)],
                         [g for _, g in flat], stops, device)


def rollouts_with_rewards(model, tokenizer, task: Task, batches, dist: Dist, args, keep_group=None):
    """Steps 1-2 of the GRPO-style scripts: the next prompt batch (this rank's share), `args.num_generations`
    completions per prompt, and their rewards. `args.dynamic_sampling` (DAPO): groups whose verifier scores are all
    equal are dropped (unless `keep_group(scores)`) and more batches are sampled, for at most `args.max_sampling_rounds`
    rounds; surplus groups are cut and, if the rounds run out, dropped groups fill the batch (they carry no
    advantage). `args.overlong_buffer` > 0 subtracts DAPO's overlong penalty from the reward.
    Returns the Rollouts (`.scores`: the verifier's rewards), the rewards [N] to train on, and sampling metrics."""
    G, want, kept, dropped, drawn, generated = args.num_generations, args.prompts_per_step // dist.world, [], [], 0, 0
    for rnd in range(args.max_sampling_rounds if args.dynamic_sampling else 1):
        examples = dist.shard(next(batches))
        ro = generate_rollouts(model, tokenizer, [e.prompt_ids for e in examples], [e.id for e in examples], G,
                               args.max_new_tokens, args.temperature, args.top_p, args.top_k, batch_size=args.gen_batch_size)
        ro.scores = torch.tensor(task.rewards(ro.texts, [e for e in examples for _ in range(G)]), dtype=torch.float32)
        drawn, generated = drawn + len(examples), generated + int(ro.completion_mask.sum())
        for rows in torch.arange(len(ro)).split(G):
            s = ro.scores[rows]
            useful = not args.dynamic_sampling or s.max() > s.min() or (keep_group is not None and keep_group(s))
            (kept if useful else dropped).append((ro, rows))
        if dist.sum([float(len(kept) < want)])[0] == 0:  # every rank's batch is full (a collective: ranks stay in step)
            break
    if args.dynamic_sampling:  # one batch of the groups, re-padded
        groups = (kept + dropped)[:want]
        ids = [(r, int(i)) for r, rows in groups for i in rows]
        ro = make_rollouts(tokenizer, [r.prompt_ids[i][r.prompt_mask[i].bool()].tolist() for r, i in ids],
                           [r.completion_ids[i][r.completion_mask[i].bool()].tolist() for r, i in ids],
                           [int(r.group_ids[i]) for r, i in ids], stop_token_ids(model, tokenizer), ro.completion_ids.device)
        ro.truncated, ro.scores = torch.stack([r.truncated[i] for r, i in ids]), torch.stack([r.scores[i] for r, i in ids])
        if groups[0][0].engine_logp is not None:
            T = ro.completion_ids.shape[1]
            ro.engine_logp = torch.stack([torch.nn.functional.pad(r.engine_logp[i, :T], (0, T - min(T, r.engine_logp.shape[1])))
                                          for r, i in ids])
    out = {"num_tokens": float(ro.completion_mask.sum()), "sampling/generated_tokens": float(generated)}
    if args.dynamic_sampling:
        out.update({"sampling/prompts_drawn": drawn, "sampling/rounds": rnd + 1, "sampling/groups_kept": min(len(kept), want) / want})
    rewards = ro.scores.clone()
    if args.overlong_buffer:  # DAPO's soft overlong punishment: 0 up to max - buffer tokens, then linearly down to -factor
        penalty = ((args.max_new_tokens - args.overlong_buffer - ro.completion_mask.sum(1).cpu().float()) / args.overlong_buffer)
        rewards = rewards + penalty.clamp(-1.0, 0.0) * args.overlong_penalty_factor
        out["reward/overlong_penalty"] = (rewards - ro.scores).mean().item()
    return ro, rewards, out


# ----------------------------------------------------------------------------------------------
# 4. Token log-probs (the layout and kernels: logprob_kernels.py)
# ----------------------------------------------------------------------------------------------
def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int,
                   temperature: float = 1.0, chunk_size: int = 8, with_entropy: bool = False, entropy_chunk: int = 128,
                   fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the last `num_completion_tokens` tokens of each row.

    input_ids, attention_mask: [B, L] (prompt left-padded, completion right-padded). Returns logp [B, T] and, when
    `with_entropy`, the per-token entropy [B, T] (nats, no gradient) of the same distribution, else None. Values at
    padded completion positions are finite but meaningless: multiply by the completion mask.
    Memory: rows are processed `chunk_size` at a time, and no [B, T, V] log-softmax or fp32 copy of the logits
    exists, forward or backward. `fused` (default: when `fused_logprobs_ok(model)`): the model returns its final
    hidden states with no logits at all and `FusedLinearLogProb` applies the lm_head a few positions at a time, so
    not even the [b, T, V] logits exist. `fused=False`: the lm_head produces logits for completion positions only
    (`logits_to_keep`) and `SelectedLogProb` computes log p = z[y] - logsumexp(z) in fp32 a few positions at a
    time (logits over the sampling temperature). Both are the same function. Rows are rotated so that no attention
    query sees only padding (`right_padded`); position ids come from the attention mask, so every token keeps the
    position `generate` gave it.
    """
    T = num_completion_tokens
    fused = fused_logprobs_ok(model) if fused is None else fused
    if fused:
        lm = unwrap(model).get_output_embeddings()
        positions = max(1, 2**25 // lm.out_features)  # fp32 [positions, V] temporaries of about 128 MB
    logps, ents = [], []
    for s in range(0, input_ids.shape[0], chunk_size):
        ids, mask = input_ids[s : s + chunk_size], attention_mask[s : s + chunk_size]
        if fused:
            h = completion_hidden(model, ids, mask, T)  # [b, T, H]
            lp, ent = FusedLinearLogProb.apply(h.reshape(-1, h.shape[-1]), lm.weight, lm.bias,
                                               ids[:, -T:].reshape(-1), temperature, positions, with_entropy)
            logps.append(lp.view(ids.shape[0], T))
            if with_entropy:
                ents.append(ent.view(ids.shape[0], T))
        else:
            logits = completion_logits(model, ids, mask, T)  # [b, T, V] in the model's dtype
            chunk = max(1, 2**24 // (logits.shape[0] * logits.shape[2]))  # fp32 temporaries of about 64 MB
            logps.append(SelectedLogProb.apply(logits, ids[:, -T:], temperature, chunk))
            if with_entropy:
                ents.append(entropy_from_logits(logits, entropy_chunk, temperature))
            del logits
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


# ----------------------------------------------------------------------------------------------
# 5. Advantages and losses
# ----------------------------------------------------------------------------------------------
def constant_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group index [N] of each completion (0..G-1, in sorted id order) and, per group, whether all
    its rewards are equal [G] (the groups plain GRPO gets no gradient from)."""
    r = rewards.float()
    _, inv = torch.unique(group_ids.to(r.device), return_inverse=True)
    G = int(inv.max()) + 1
    gmax = torch.full((G,), -float("inf"), device=r.device).scatter_reduce(0, inv, r, "amax")
    gmin = torch.full((G,), float("inf"), device=r.device).scatter_reduce(0, inv, r, "amin")
    return inv, gmax == gmin


def group_advantages(rewards: torch.Tensor, group_size: int | None, scale: str = "group", eps: float = 1e-4,
                     group_ids: torch.Tensor | None = None, unbiased: bool = True) -> torch.Tensor:
    """GRPO's outcome advantage per completion: reward minus its group's mean, scaled.

    rewards: [N]. Groups are the completions sharing a `group_ids` value (the prompt id); without `group_ids`,
    consecutive blocks of `group_size`. Every group must have `group_size` members (group_size=None with group_ids
    allows groups of different sizes). scale: "group" divides by the group's std (original GRPO), "batch" by the
    std of all rewards in the batch (Lite PPO), "none" does not divide (Dr. GRPO). Std convention: unbiased
    (Bessel-corrected, as TRL and verl; `unbiased=False` for the population std), then (r - mean) / (std + eps),
    eps = 1e-4 as TRL. A group whose rewards are all equal gets exactly 0 (never NaN). Returns [N] float32.
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
        raise ValueError(f"every group must have {group_size} completions, got sizes {sorted(set(counts.tolist()))}")
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
    """Per-token k3 estimator of KL(pi || pi_ref) (Schulman): exp(d) - d - 1 with d = log pi_ref - log pi, in fp32.
    d is clamped to +-MAX_LOG_RATIO before exp and the estimate to [0, 10], as verl's low_var_kl, so a token whose
    log-probs have drifted far apart cannot overflow. >= 0; 0 where the two log-probs are equal."""
    d = (ref_logp.float() - logp.float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (torch.exp(d) - d - 1).clamp(max=10.0)


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_completion_length: int | None = None,
                   num_tokens: float | None = None, num_seqs: float | None = None) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar (verl's names; TRL's in brackets).

    token-mean               sum over all tokens / number of tokens           (DAPO, TRL "dapo"/"bnpo")
    seq-mean-token-mean      mean over each sequence's tokens, mean over rows (original GRPO, TRL "grpo")
    seq-mean-token-sum-norm  sum over all tokens / (rows x max_completion_length) (Dr. GRPO, "dr_grpo")
    For micro-batches, pass the whole batch's `num_tokens` (active tokens) and `num_seqs` (rows):
    the micro-batch losses then add up to the whole batch's loss, so gradient accumulation does
    not change the effective learning rate. Rows without tokens contribute 0.
    """
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


def minibatches(group_ids: torch.Tensor, num_minibatches: int) -> list[torch.Tensor]:
    """Row indices [n] of each mini-batch: the groups (prompts) in order of first appearance, split into
    `num_minibatches` runs of equally many whole groups (one optimizer step each)."""
    ids = group_ids.tolist()
    groups = list(dict.fromkeys(ids))
    if len(groups) % num_minibatches:
        raise ValueError(f"--num-minibatches {num_minibatches} must divide the {len(groups)} prompts of this rank's batch")
    per = len(groups) // num_minibatches
    where = {g: i // per for i, g in enumerate(groups)}
    return [torch.tensor([r for r, g in enumerate(ids) if where[g] == k], device=group_ids.device) for k in range(num_minibatches)]


class UpdateStats:
    """The update's diagnostics, TRL's names: clip fractions and kl as token means over every pass, entropy over the
    first pass, policy_loss and grad_norm as means over optimizer steps, and the vLLM engine's mismatch (`engine`)."""

    def __init__(self, mask: torch.Tensor, passes: int):
        self.tokens, self.passes = max(float(mask.sum()), 1.0), passes
        self.sums, self.losses, self.norms, self.loss, self.engine_stats = defaultdict(float), [], [], 0.0, {}

    def engine(self, it: int) -> dict | None:
        return self.engine_stats if it == 0 else None  # the engine metrics describe the rollouts: once

    def add(self, m, ratio, adv, eps_low, eps_high, entropy=None, kl=None, loss=None) -> None:
        low, high = ((ratio < 1 - eps_low) & (adv < 0)).float() * m, ((ratio > 1 + eps_high) & (adv > 0)).float() * m
        self.sums["clip_ratio/low_mean"] += low.sum().item()
        self.sums["clip_ratio/high_mean"] += high.sum().item()
        self.sums["clip_ratio/region_mean"] += (low + high).sum().item()
        if entropy is not None:
            self.sums["entropy"] += (entropy * m).sum().item()
        if kl is not None:
            self.sums["kl"] += (kl.detach() * m).sum().item()
        self.loss += loss.item() if loss is not None else 0.0

    def step(self, grad_norm) -> None:
        """After each optimizer step: the mini-batch's loss and gradient norm."""
        self.losses.append(self.loss)
        self.norms.append(float(grad_norm))
        self.loss = 0.0

    def metrics(self) -> dict:
        out = {k: v / (self.tokens * (1 if k == "entropy" else self.passes)) for k, v in self.sums.items()}
        out.update(self.engine_stats, policy_loss=sum(self.losses) / len(self.losses), grad_norm=sum(self.norms) / len(self.norms))
        return out


# ----------------------------------------------------------------------------------------------
# 6. Evaluation, logging, metrics
# ----------------------------------------------------------------------------------------------
def evaluate(model, tokenizer, task: Task, max_new_tokens: int, batch_size: int = 64, temperature: float = 0.0,
             dist: Dist | None = None) -> dict:
    """pass@1 on the task's held-out prompts: greedy when temperature == 0 (default), else one
    sample at that temperature. Returns {"eval/accuracy", "eval/mean_length"}. Under torchrun each
    rank evaluates an equal slice (the last one padded with repeats that are not counted) and the
    sums are all-reduced, so every rank returns the same figures."""
    ex, rank, world = task.eval, (dist.rank if dist else 0), (dist.world if dist else 1)
    n = -(-len(ex) // world)
    mine = ex[rank * n : (rank + 1) * n]
    counted = len(mine)
    mine = mine + [ex[0]] * (n - counted)  # equal slices: FSDP ranks must run the same generate calls
    ro = generate_rollouts(
        model, tokenizer, [e.prompt_ids for e in mine], [e.id for e in mine], 1, max_new_tokens,
        temperature=max(temperature, 1e-5), do_sample=temperature > 0, batch_size=batch_size,
    )
    correct = sum(task.rewards(ro.texts[:counted], mine[:counted]))
    length = ro.completion_mask[:counted].sum().item()
    if dist is not None:
        correct, length = dist.sum([correct, length])
    return {"eval/accuracy": correct / len(ex), "eval/mean_length": length / len(ex)}


class Logger:
    """Metrics to TensorBoard (`<run_dir>/`), `<run_dir>/metrics.jsonl`, and wandb with `track`. `resume_step` k > 0
    (--resume): the rows after step k are dropped from metrics.jsonl and TensorBoard before the run goes on.
    `last_eval`: the latest evaluation metrics logged (or read back from metrics.jsonl when resuming)."""

    def __init__(self, run_dir: str | os.PathLike, config: dict, track: bool = False, wandb_project: str = "credit-rlvr",
                 enabled: bool = True, resume_step: int = 0):
        self.enabled, self.run_dir, self.last_eval = enabled, Path(run_dir), None  # enabled: False on torchrun ranks > 0
        if resume_step:
            rows = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").open() if line.strip()]
            rows = [r for r in rows if r["step"] <= resume_step]
            self.last_eval = {k: v for r in rows if "eval/accuracy" in r for k, v in r.items() if k.startswith("eval/")}
            if enabled:
                tmp = self.run_dir / "metrics.jsonl.tmp"
                tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
                os.replace(tmp, self.run_dir / "metrics.jsonl")
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.run_dir), purge_step=resume_step + 1 if resume_step else None)
        if not resume_step:
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in config.items()))
            (self.run_dir / "config.json").write_text(json.dumps(config, indent=1, default=str))
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self.wandb = None
        if track:
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=self.run_dir.name, id=self.run_dir.name, resume="allow",
                                    config=config, dir=str(self.run_dir))

    def log(self, metrics: dict, step: int) -> None:
        if "eval/accuracy" in metrics:
            self.last_eval = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if not self.enabled:
            return
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.writer.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


def stop_if_nonfinite(value: torch.Tensor | float, what: str, step: int, last_metrics: dict) -> None:
    """Stop the run (exit code 1) with the step and the last metrics when `value` is NaN/inf.
    Called before the optimizer step, so no update and no checkpoint is made from NaN weights."""
    v = float(value.detach()) if torch.is_tensor(value) else float(value)
    if not math.isfinite(v):
        shown = {k: round(x, 4) if isinstance(x, float) else x for k, x in last_metrics.items()}
        raise SystemExit(f"non-finite {what} ({v}) at step {step}; stopping without an update or a checkpoint. "
                         f"Last metrics: {json.dumps(shown)}")


def completion_metrics(ro: Rollouts, rewards: torch.Tensor, group_size: int) -> dict:
    """TRL-named rollout metrics: reward, reward_std, frac_reward_zero_std, completion lengths."""
    lengths = ro.completion_mask.sum(1).float()
    r = rewards.float().cpu()
    constant = constant_groups(r, ro.group_ids.cpu())[1]
    return {
        "reward": r.mean().item(),
        "reward_std": r.std().item() if len(r) > 1 else 0.0,
        "frac_reward_zero_std": constant.float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/max_length": lengths.max().item(),
        "completions/min_length": lengths.min().item(),
        "completions/clipped_ratio": ro.truncated.float().mean().item(),
    }

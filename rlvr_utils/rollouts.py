"""Rollouts: the batch of prompts x G completions that every script trains on, and how it is sampled.

Rollouts           the batch: prompts left-padded, completions right-padded, masks, group ids, texts, engine log-probs
generate_rollouts  G completions per prompt with batched `model.generate`, or the vLLM engine when one is attached
make_rollouts      a batch from token-id lists (SRPO's prefix + suffix continuations, DAPO's re-padded groups)
pad_left, completion_mask_from_ids, stop_token_ids   padding, the completion mask, the ids that end a completion
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import torch


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion (generation config's EOS ids and the tokenizer's)."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


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

    def completion_lists(self) -> list[list[int]]:
        """Each completion's token ids as a list, its stop token included (what TRL passes as `completion_ids`)."""
        return [c[m.bool()].tolist() for c, m in zip(self.completion_ids.cpu(), self.completion_mask.cpu())]


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention mask [n, P] of token-id lists, left-padded to the longest."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, P - len(s) :] = torch.tensor(list(s))
            mask[i, P - len(s) :] = 1
    return ids.to(device), mask.to(device)


def completion_mask_from_ids(
    completion_ids: torch.Tensor, stop_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask = 1 up to and including the first stop token; truncated = no stop token in the row."""
    is_stop = torch.isin(completion_ids, torch.tensor(list(stop_ids), device=completion_ids.device))
    after_stop = (is_stop.long().cumsum(1) - is_stop.long()) > 0  # strictly after the first stop
    mask = (~after_stop).long()
    return mask, ~is_stop.any(1)


def make_rollouts(
    tokenizer,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    group_ids: Sequence[int],
    stop_ids: Sequence[int],
    device=None,
) -> Rollouts:
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
    completion = (c_ids.to(device), c_mask.to(device), truncated.to(device))
    return Rollouts(p_ids, p_mask, *completion, torch.tensor(list(group_ids), device=device), texts)


@torch.no_grad()
def generate_rollouts(
    model, tokenizer, prompts: Sequence[Sequence[int]], group_ids: Sequence[int], num_generations: int,
    max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, do_sample: bool = True,
    batch_size: int = 64,
) -> Rollouts:  # fmt: skip
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
        comps, logps = engine.generate(
            prompts, num_generations, max_new_tokens, temperature, top_p, top_k, do_sample, stops
        )
        ro = make_rollouts(tokenizer, [p for p, _ in flat], comps, [g for _, g in flat], stops, device)
        T = ro.completion_ids.shape[1]
        ro.engine_logp = torch.tensor([lp + [0.0] * (T - len(lp)) for lp in logps], dtype=torch.float32, device=device)
        engine.sleep()  # GPU: weights and KV cache released while the trainer works (woken by the next call or sync)
        ro.engine_released_gb = engine.released_gb
        return ro
    was_training = model.training
    model.eval()
    completions: list[list[int]] = []
    gathered = getattr(model, "_rlvr_gathered", None)  # FSDP: generate on the full weights, no collective per token
    with gathered(model) if gathered is not None else contextlib.nullcontext():
        for s in range(0, len(flat), batch_size):
            chunk = [p for p, _ in flat[s : s + batch_size]]
            ids, mask = pad_left(chunk, tokenizer.pad_token_id, device)
            kw = (
                dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
                if do_sample
                else dict(do_sample=False)
            )
            # synced_gpus off: transformers' default turns it on for FSDP modules; here the weights are gathered
            stop = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=stops, synced_gpus=False)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, **stop, **kw)
            completions.extend(out[:, ids.shape[1] :].tolist())
    model.train(was_training)
    T = max(len(c) for c in completions)
    raw = torch.full((len(completions), T), tokenizer.pad_token_id, dtype=torch.long)
    for i, c in enumerate(completions):
        raw[i, : len(c)] = torch.tensor(c)
    kept = completion_mask_from_ids(raw, stops)[0].sum(1).tolist()  # tokens up to and including the stop
    return make_rollouts(
        tokenizer, [p for p, _ in flat], [c[:n] for c, n in zip(completions, kept)], [g for _, g in flat], stops, device
    )

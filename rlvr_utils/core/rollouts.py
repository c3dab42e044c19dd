"""Rollouts: the batch of prompts x G completions that every script trains on, and how it is sampled.

Rollouts           the batch: prompts left-padded, completions right-padded, masks, group ids, texts, engine log-probs
generate_rollouts  G completions per prompt: the static decoder (the default), HF `model.generate` (--engine hf) or
                   the vLLM engine when one is attached (--engine vllm)
StaticDecoder      sampling without `generate`: a preallocated KV cache, the model's own weights, CUDA graphs on a GPU
make_rollouts      a batch from token-id lists (SRPO's prefix + suffix continuations); regroup: DAPO's kept groups
pad_left, completion_mask_from_ids, stop_token_ids   padding, the completion mask, the ids that end a completion
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import weakref
from typing import Sequence

import torch
import torch.nn.functional as F

from rlvr_utils.core.models import attention_window, run_flags_only
from rlvr_utils.core.runtime import extra


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
    sample_logp: torch.Tensor | None = None  # [N, T] the static decoder's log-probs of its tokens (diagnostics only)
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


def regroup(groups: list, tokenizer, stops: list[int]) -> Rollouts:
    """One Rollouts batch of `groups`, (Rollouts, its rows) pairs from several generate calls."""
    ids = [(r, int(i)) for r, rows in groups for i in rows]
    prompts = [r.prompt_ids[i][r.prompt_mask[i].bool()].tolist() for r, i in ids]
    completions = [r.completion_ids[i][r.completion_mask[i].bool()].tolist() for r, i in ids]
    group_ids = [int(r.group_ids[i]) for r, i in ids]
    device = groups[0][0].completion_ids.device
    ro = make_rollouts(tokenizer, prompts, completions, group_ids, stops, device)
    ro.truncated = torch.stack([r.truncated[i] for r, i in ids])
    ro.scores = torch.stack([r.scores[i] for r, i in ids])
    if groups[0][0].engine_logp is not None:  # --engine vllm: its log-probs, to the new width T
        T = ro.completion_ids.shape[1]
        pad = [(r.engine_logp[i, :T], T - min(T, r.engine_logp.shape[1])) for r, i in ids]
        ro.engine_logp = torch.stack([F.pad(lp, (0, n)) for lp, n in pad])
    return ro


# ----------------------------------------------------------------------------------------------
# The static decoder (the default engine): the model's own weights, one token at a time, no `generate`
# ----------------------------------------------------------------------------------------------
LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")  # the decoders whose layer the loop repeats op for op


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm module's arithmetic (weight * x / sqrt(mean(x^2) + eps), in fp32), fewer temporaries."""
    x32 = x.float()
    return norm.weight * (x32 * x32.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon).rsqrt_()).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (transformers' apply_rotary_pos_emb) for x [B, heads, D], cos/sin [B, 1, D]."""
    half = x.shape[-1] // 2
    return (x * cos).add_(torch.cat((-x[..., half:], x[..., :half]), -1).mul_(sin))


def linear_of(lin) -> tuple | None:
    """(weight, bias, PEFT LoRA layer or None) of a block's nn.Linear or LoRA-wrapped nn.Linear; None: neither."""
    if type(lin) is torch.nn.Linear:
        return lin.weight, lin.bias, None
    base, adapters = getattr(lin, "base_layer", None), list(getattr(lin, "active_adapters", ()))
    if type(base) is torch.nn.Linear and adapters == ["default"] and not lin.use_dora["default"] and not lin.merged:
        return base.weight, base.bias, lin
    return None


def unsupported(model) -> str | None:
    """Why the static decoder cannot decode `model` (None: it can)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    c = lm.config
    if c.model_type not in LLAMA_FAMILY:
        return f"model type {c.model_type} (it decodes {', '.join(LLAMA_FAMILY)})"
    if any(t not in ("full_attention", "sliding_attention") for t in getattr(c, "layer_types", None) or ()):
        return f"attention layers of types {sorted(set(c.layer_types))}"  # a window: static_decoder's length
    if c.hidden_act != "silu":
        return f"activation {c.hidden_act}"
    for layer in lm.model.layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            if linear_of(lin) is None:
                return f"{type(lin).__name__} layers (it reads nn.Linear and PEFT LoRA ones)"
    return None


class StaticDecoder:
    """Sampling without transformers' `generate`, whose per-token work at RL batch sizes is mostly overhead (a KV
    cache grown by torch.cat, masks rebuilt, logits processors). The prompts go through the model's own forward
    (the prefill, once per distinct prompt), then each new token through the decoder layers' own weights in a short
    loop, its keys and values written into a preallocated cache. The arithmetic is the model's op for op: on CPU the
    tokens are `generate`'s bitwise, greedy or sampled from the same seed (tests/test_decode.py). On CUDA each token's
    forward is a CUDA graph (rlvr_utils/extras/scale/cuda_graphs.py). Under LoRA the loop reads decode-only copies with
    the adapters merged (W + s B A): the trained weights are never touched. After gpt-fast (generate.py) and nanochat
    (engine.py). Llama-family decoders only (`unsupported` says why another model samples with `generate`)."""

    def __init__(self, model):
        self.lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # *ForCausalLM
        self.body = self.lm.model
        self.H, self.Hkv = self.lm.config.num_attention_heads, self.lm.config.num_key_value_heads
        self.D = self.body.layers[0].self_attn.head_dim
        self.window = attention_window(self.lm.config)  # None: full attention (else static_decoder's length)
        self.copies: dict = {}  # decode-only weights, refreshed in place (a CUDA graph keeps their addresses)
        self.graphs: dict = {}  # (B, cache length) -> a captured step (cuda_graphs.py)
        self.use_graphs = next(model.parameters()).is_cuda
        self.whole_cache = False  # eager, the CUDA graph's arithmetic (the whole cache read under the mask): tests
        self.cache_arg = "cache" if "cache" in inspect.signature(self.lm.forward).parameters else "past_key_values"

    def weights(self) -> list[tuple]:
        """Per layer ((qkv weight, bias), o, gate, up, down), each (weight, bias), from the current parameters: q, k
        and v as one matrix (a copy: one matmul, the same dot products), LoRA layers as merged copies (W + s B A in
        fp32). Copies are refreshed in place each call: the optimizer has changed the weights."""
        out = []
        for i, layer in enumerate(self.body.layers):
            a, m = layer.self_attn, layer.mlp
            lins = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            ws = []
            for j, (w, b, lora) in enumerate(map(linear_of, lins)):
                if lora is not None:
                    w = self.copy((i, j), (w.float() + lora.get_delta_weight("default").float()).to(w.dtype))
                ws.append((w, b))
            qkv_b = None if ws[0][1] is None else self.copy((i, "qkv_b"), torch.cat([b for _, b in ws[:3]]))
            out.append(((self.copy((i, "qkv"), torch.cat([w for w, _ in ws[:3]])), qkv_b), *ws[3:]))
        return out

    def copy(self, key, value: torch.Tensor) -> torch.Tensor:
        if key not in self.copies or self.copies[key].shape != value.shape:
            self.copies[key] = value.clone()
        return self.copies[key].copy_(value)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The prompts [B, P] through the model's own forward, each distinct one once (a group's G copies share it):
        the last position's logits [B, V] and each layer's (keys, values) [B, Hkv, P, D]."""
        from transformers import DynamicCache

        distinct, row = torch.unique(torch.cat([ids, mask], 1), dim=0, return_inverse=True)
        d_ids, d_mask = distinct.split(ids.shape[1], dim=1)
        pos = (d_mask.cumsum(-1) - 1).masked_fill(d_mask == 0, 0)  # generate's position ids
        cache = DynamicCache()  # transformers 5 calls the argument cache, 4.x past_key_values
        kw = dict(attention_mask=d_mask, position_ids=pos, use_cache=True, logits_to_keep=1, **{self.cache_arg: cache})
        logits = self.lm(input_ids=d_ids, **kw).logits[row, -1]
        layers = cache.layers if hasattr(cache, "layers") else cache  # 4.x: (keys, values) per layer
        return logits, [(x.keys[row], x.values[row]) if hasattr(x, "keys") else (x[0][row], x[1][row]) for x in layers]

    def forward(self, w, kv, tok, cos, sin, slot, mask, length=None) -> torch.Tensor:
        """One token per row through the decoder: tok [B] at rotary cos/sin [B, 1, D], its keys and values written at
        cache slot `slot` of kv [layers, 2, B, Hkv, L, D]; the attention reads the first `length` slots (eager), or
        with length None all L under the additive mask [B, 1, 1, L], `slot` a [1] tensor (a CUDA graph). Returns the
        logits [B, V]."""
        B, H, Hkv, D = tok.shape[0], self.H, self.Hkv, self.D
        h = self.body.embed_tokens(tok)  # [B, E]
        m = mask if length is None else mask[..., :length]
        for layer, (qkv_w, o, gate, up, down), cache in zip(self.body.layers, w, kv):
            a = layer.self_attn
            qkv = F.linear(rms_norm(layer.input_layernorm, h), *qkv_w).view(B, H + 2 * Hkv, D)
            qk, v = qkv[:, : H + Hkv], qkv[:, H + Hkv :]
            if hasattr(a, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
                qk = torch.cat([rms_norm(a.q_norm, qk[:, :H]), rms_norm(a.k_norm, qk[:, H:])], 1)
            qk = rope(qk, cos, sin)
            if length is None:
                cache[0].index_copy_(2, slot, qk[:, H:, None])
                cache[1].index_copy_(2, slot, v[:, :, None])
            else:
                cache[0, :, :, slot], cache[1, :, :, slot] = qk[:, H:], v
            keys, values = (
                (cache[0], cache[1]) if length is None else (cache[0, ..., :length, :], cache[1, ..., :length, :])
            )
            q = qk[:, :H].reshape(B, Hkv, H // Hkv, D)  # transformers' pack_gqa: a KV head's queries side by side
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=m, scale=a.scaling)
            h = F.linear(att.reshape(B, H * D), *o).add_(h)
            x = rms_norm(layer.post_attention_layernorm, h)
            h = F.linear(F.silu(F.linear(x, *gate)).mul_(F.linear(x, *up)), *down).add_(h)
        return self.lm.lm_head(rms_norm(self.body.norm, h))

    @torch.inference_mode()
    def generate(
        self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float,
        top_k: int, do_sample: bool, stops: Sequence[int], pad_id: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """ids, mask: [B, P] left-padded prompts. Returns the new ids [B, T], T <= max_new_tokens (after a row's stop
        token: pad_id, as `generate`), and each token's log-prob [B, T] under softmax(logits / temperature), the
        distribution token_logprobs scores (0 after the stop). Sampling: `generate`'s warpers and torch.multinomial
        on the same fp32 logits (the same random stream), or argmax when not do_sample."""
        from transformers.generation import logits_process as lp

        B, P = ids.shape
        w = self.weights()
        logits, prompt_kv = self.prefill(ids, mask)
        if self.use_graphs or self.whole_cache:  # the whole cache under a mask; a CUDA graph on a GPU
            cuda_graphs = extra("cuda_graphs", "decoding on a GPU (--engine static)")

            length = -(-(P + max_new_tokens) // 64) * 64  # one graph per 64 slots of cache
            step, kv, bias = cuda_graphs.decode_step(self, w, B, length, logits.dtype, capture=self.use_graphs)
        else:
            kv = logits.new_empty(len(w), 2, B, self.Hkv, P + max_new_tokens, self.D)
            bias = logits.new_empty(B, 1, 1, P + max_new_tokens)

            def step(tok, cos, sin, slot):
                return self.forward(w, kv, tok, cos, sin, slot, bias, length=slot + 1)

        for i, (keys, values) in enumerate(prompt_kv):
            kv[i, 0, :, :, :P], kv[i, 1, :, :, :P] = keys, values
        bias.fill_(-torch.inf)  # additive attention mask: 0 where a row attends (its prompt, then its new tokens)
        bias[:, 0, 0, :P].masked_fill_(mask.bool(), 0.0)
        positions = mask.sum(-1, keepdim=True) + torch.arange(max_new_tokens - 1, device=ids.device)
        cos, sin = self.body.rotary_emb(logits, positions)  # [B, max_new_tokens - 1, D]
        warp = lp.LogitsProcessorList()  # generate's, in its order
        warp += [lp.TemperatureLogitsWarper(temperature)] if do_sample and temperature != 1.0 else []
        warp += [lp.TopKLogitsWarper(top_k)] if do_sample and top_k else []
        warp += [lp.TopPLogitsWarper(top_p)] if do_sample and top_p < 1.0 else []
        stop_ids = torch.tensor(list(stops), device=ids.device)
        unfinished = torch.ones(B, dtype=torch.long, device=ids.device)
        every = 8 if ids.is_cuda else 1  # steps between "has every row stopped?" (a sync on CUDA)
        # Each token and log-prob is written into these, not kept as a small tensor of its own per step: on CPU,
        # glibc places such survivors inside the freed [B, V] temporaries of the step, which it then cannot reuse
        # or return (after an update, the heap holds them): about one [B, V] fp32 block per token (docs/benchmarks.md)
        toks = torch.empty(B, max_new_tokens, dtype=torch.long, device=ids.device)
        logps = torch.empty(B, max_new_tokens, device=ids.device)
        for t in range(max_new_tokens):
            z = logits.float()
            tok = torch.multinomial(F.softmax(warp(None, z), -1), 1)[:, 0] if do_sample else z.argmax(-1)
            logps[:, t] = (z / temperature).log_softmax(-1).gather(1, tok[:, None])[:, 0] * unfinished
            tok = tok * unfinished + pad_id * (1 - unfinished)
            toks[:, t] = tok
            unfinished = unfinished & ~torch.isin(tok, stop_ids)
            if t == max_new_tokens - 1 or (t % every == every - 1 and not unfinished.any()):
                break
            bias[:, 0, 0, P + t] = 0.0
            logits = step(tok, cos[:, t, None], sin[:, t, None], P + t)
        return toks[:, : t + 1], logps[:, : t + 1]


def static_decoder(model, length: int = 0) -> StaticDecoder | None:
    """`model`'s StaticDecoder (made once per model), or None when `model` samples with `generate`: --engine hf
    (`model._rlvr_hf_generate`), an architecture the loop does not decode, or `length` tokens (prompt + new) past its
    sliding window, where the loop's full attention is not the model's (each said once)."""
    if getattr(model, "_rlvr_hf_generate", False):
        return None
    if model not in _DECODERS:
        why = unsupported(model)
        if why is not None:
            print(f"note: sampling with transformers' generate: the static decoder does not handle {why}",
                  file=sys.stderr)  # fmt: skip
        _DECODERS[model] = None if why else StaticDecoder(model)
    decoder = _DECODERS[model]
    if decoder is not None and (decoder.window or length) < length:  # the loop's full attention is not the model's
        print(f"note: sampling with transformers' generate: the static decoder does not handle a {decoder.window}-"
              f"token sliding window (prompt + --max-new-tokens: {length})", file=sys.stderr)  # fmt: skip
        _DECODERS[model] = None  # said once: the model samples with generate from now on
    return _DECODERS[model]


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its StaticDecoder (None: generate)


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
    if engine is not None:  # vLLM (rlvr_utils/extras/scale/engines.py): the same sampling settings, plus its log-probs
        sampling = (num_generations, max_new_tokens, temperature, top_p, top_k, do_sample, stops)
        return engine.rollouts(tokenizer, prompts, group_ids, *sampling, device)
    was_training = model.training
    model.eval()
    outs, logps = [], []
    gathered = getattr(model, "_rlvr_gathered", None)  # FSDP: generate on the full weights, no collective per token
    with gathered(model) if gathered is not None else contextlib.nullcontext():
        decoder = static_decoder(model, max(map(len, prompts)) + max_new_tokens)  # None: --engine hf, or generate's
        if decoder is not None and gathered is not None:
            decoder.use_graphs = False  # FSDP: the gathered weights move between calls; a CUDA graph would not see it
        for s in range(0, len(flat), batch_size):
            chunk = [p for p, _ in flat[s : s + batch_size]]
            ids, mask = pad_left(chunk, tokenizer.pad_token_id, device)
            if decoder is not None:
                sampling = (temperature, top_p, top_k, do_sample, stops, tokenizer.pad_token_id)
                out, lp = decoder.generate(ids, mask, max_new_tokens, *sampling)
                outs.append(out)
                logps.append(lp)
                continue
            kw = (
                dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
                if do_sample
                else dict(do_sample=False)
            )
            # synced_gpus off: transformers' default turns it on for FSDP modules; here the weights are gathered
            stop = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=stops, synced_gpus=False)
            with run_flags_only(model):  # not the checkpoint's repetition_penalty, no_repeat_ngram_size, ...
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, **stop, **kw)
            outs.append(out[:, ids.shape[1] :])
    model.train(was_training)
    T = max(o.shape[1] for o in outs)
    raw = torch.cat([F.pad(o, (0, T - o.shape[1]), value=tokenizer.pad_token_id) for o in outs]).cpu()
    kept = completion_mask_from_ids(raw, stops)[0].sum(1).tolist()  # tokens up to and including the stop
    completions = [c[:n] for c, n in zip(raw.tolist(), kept)]
    ro = make_rollouts(tokenizer, [p for p, _ in flat], completions, [g for _, g in flat], stops, device)
    if logps:  # the static decoder's log-probs, to the batch's width
        T = ro.completion_ids.shape[1]
        ro.sample_logp = torch.cat([F.pad(x, (0, max(0, T - x.shape[1])))[:, :T] for x in logps]).float()
    return ro

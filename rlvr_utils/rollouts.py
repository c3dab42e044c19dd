"""Rollouts: the batch of prompts x G completions that every script trains on, and how it is sampled.

Rollouts           the batch: prompts left-padded, completions right-padded, masks, group ids, texts, engine log-probs
generate_rollouts  G completions per prompt: the static decoder (the default), HF `model.generate` (--engine hf) or
                   the vLLM engine when one is attached (--engine vllm)
StaticDecoder      sampling without `generate`: a preallocated KV cache, the model's own weights, CUDA graphs on a GPU
make_rollouts      a batch from token-id lists (SRPO's prefix + suffix continuations, DAPO's re-padded groups)
pad_left, completion_mask_from_ids, stop_token_ids   padding, the completion mask, the ids that end a completion
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import warnings
import weakref
from typing import Sequence

import torch
import torch.nn.functional as F


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


# ----------------------------------------------------------------------------------------------
# The static decoder (the default engine): the model's own forward, one token at a time, no `generate`
# ----------------------------------------------------------------------------------------------
LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")  # the decoders whose layer the loop repeats op for op


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm (Llama, Qwen2/3, Mistral): weight * (x / sqrt(mean(x^2) + eps)) in fp32, fewer temporaries."""
    x32 = x.float()
    return norm.weight * (x32 * x32.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon).rsqrt_()).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin: transformers' apply_rotary_pos_emb, for x [B, heads, D], cos/sin [B, 1, D]."""
    half = x.shape[-1] // 2
    return (x * cos).add_(torch.cat((-x[..., half:], x[..., :half]), -1).mul_(sin))


class StaticDecoder:
    """Sampling without transformers' `generate`, whose per-token work is mostly overhead at RL batch sizes (a KV cache
    grown by torch.cat, masks rebuilt, logits processors): the prompt goes through the model's own forward (the
    prefill), then each new token goes through the decoder layers' own weights and modules in a short loop, its keys
    and values written into a preallocated cache. The arithmetic is the model's, op for op: on CPU in fp32 the tokens
    are `generate`'s, bitwise, greedy or sampled from the same seed (tests/test_decode.py). On CUDA each token's
    forward is captured once per batch shape as a CUDA graph and replayed (one launch instead of hundreds; the
    attention then reads the whole cache under a mask). Under LoRA the loop reads decode-only copies of the layers
    with the adapters merged (W + s B A): the trained weights are never touched. gpt-fast's generate.py and
    nanochat's engine.py are the references. Llama-family decoders (LLAMA_FAMILY, full attention, SiLU MLP);
    `unsupported` says why another model samples with `generate`."""

    GRAPHS = 4  # CUDA graphs kept (one per batch size and cache length); the oldest is dropped

    @staticmethod
    def unsupported(model) -> str | None:
        """Why the loop cannot decode `model` (None: it can)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        c = base.config
        if c.model_type not in LLAMA_FAMILY:
            return f"model type {c.model_type} (the loop decodes {', '.join(LLAMA_FAMILY)})"
        if any(t != "full_attention" for t in getattr(c, "layer_types", None) or ()):
            return "sliding-window layers"
        if c.hidden_act != "silu" or not hasattr(base.model, "rotary_emb"):
            return f"activation {c.hidden_act}"
        for layer in base.model.layers:
            a, m = layer.self_attn, layer.mlp
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
                if StaticDecoder.weight_of(lin) is None:
                    return f"a {type(lin).__name__} layer (neither nn.Linear nor a LoRA one)"
        return None

    @staticmethod
    def weight_of(lin) -> tuple | None:
        """(weight, bias, LoRA layer or None) of a block's linear layer: nn.Linear, or PEFT's LoRA Linear around one."""
        if type(lin) is torch.nn.Linear:
            return lin.weight, lin.bias, None
        base = getattr(lin, "base_layer", None)
        plain = type(base) is torch.nn.Linear and list(getattr(lin, "active_adapters", ())) == ["default"]
        if plain and not lin.use_dora.get("default") and not getattr(lin, "merged", False):
            return base.weight, base.bias, lin
        return None

    def __init__(self, model):
        self.lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # *ForCausalLM
        self.body = self.lm.model
        self.H, self.Hkv = self.lm.config.num_attention_heads, self.lm.config.num_key_value_heads
        self.D = self.body.layers[0].self_attn.head_dim
        self.copies: dict = {}  # decode-only weights, refreshed in place each call (CUDA graphs keep their addresses)
        self.graphs: dict = {}  # (B, cache length) -> (graph, its inputs and output, its cache)
        self.use_graphs = torch.cuda.is_available() and next(model.parameters()).is_cuda
        self.whole_cache = False  # eager, read the whole cache under the mask as a CUDA graph does (tests, on CPU)
        self.cache_arg = "cache" if "cache" in inspect.signature(self.lm.forward).parameters else "past_key_values"

    def weights(self) -> list[tuple]:
        """Per layer (qkv weight, qkv bias, o, gate, up, down), each (weight, bias): the current parameters. q, k and
        v are one matrix (a copy, so one matmul; its rows are each the same dot products); LoRA layers are merged
        copies, W + s B A computed in fp32. Copies are refreshed in place: the optimizer changed the weights."""
        out = []
        for i, layer in enumerate(self.body.layers):
            a, m = layer.self_attn, layer.mlp
            lins = [self.weight_of(x) for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj)]
            lins.append(self.weight_of(m.down_proj))
            ws = []
            for j, (w, b, lora) in enumerate(lins):
                if lora is not None:
                    delta = lora.get_delta_weight("default").float()
                    w = self.refreshed((i, j), (w.float() + delta).to(w.dtype))
                ws.append((w, b))
            qkv_w = self.refreshed((i, "qkv"), torch.cat([w for w, _ in ws[:3]]))
            no_bias = ws[0][1] is None
            qkv_b = None if no_bias else self.refreshed((i, "qkv_b"), torch.cat([b for _, b in ws[:3]]))
            out.append(((qkv_w, qkv_b), *ws[3:]))
        return out

    def refreshed(self, key, value: torch.Tensor) -> torch.Tensor:
        if key not in self.copies or self.copies[key].shape != value.shape:
            self.copies[key] = value.clone()
        return self.copies[key].copy_(value)

    def forward(self, w, kv, tok, cos, sin, slot, mask, length=None) -> torch.Tensor:
        """One token per row through the decoder: tok [B], its rotary cos/sin [B, 1, D]; its keys and values are
        written at cache slot `slot` ([1]) of kv [layers, 2, B, Hkv, L, D]; the attention reads the cache's first
        `length` slots (eager) or all L under `mask` [B, 1, 1, L] (a CUDA graph). Returns the logits [B, V]."""
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
            if length is None:  # a CUDA graph: the slot is a tensor, the whole cache is read under the mask
                cache[0].index_copy_(2, slot, qk[:, H:, None])
                cache[1].index_copy_(2, slot, v[:, :, None])
                keys, values = cache[0], cache[1]
            else:
                cache[0, :, :, slot], cache[1, :, :, slot] = qk[:, H:], v
                keys, values = cache[0, :, :, :length], cache[1, :, :, :length]
            q = qk[:, :H].reshape(B, Hkv, H // Hkv, D)  # transformers' pack_gqa: a KV head's queries side by side
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=m, scale=a.scaling)
            h = F.linear(att.reshape(B, H * D), *o).add_(h)
            x = rms_norm(layer.post_attention_layernorm, h)
            h = F.linear(F.silu(F.linear(x, *gate)).mul_(F.linear(x, *up)), *down).add_(h)
        return self.lm.lm_head(rms_norm(self.body.norm, h))

    def graph(self, w, B: int, L: int, dtype, device):
        """The CUDA graph of `forward` for B rows and a cache of L slots, captured on first use (then its self-check:
        a replay against the eager forward); None where capture failed (the loop stays eager, said once)."""
        if (B, L) in self.graphs:
            return self.graphs[(B, L)]
        while len(self.graphs) >= self.GRAPHS:
            self.graphs.pop(next(iter(self.graphs)))
        kv = torch.zeros(len(w), 2, B, self.Hkv, L, self.D, dtype=dtype, device=device)  # finite where masked
        io = dict(tok=torch.zeros(B, dtype=torch.long, device=device), slot=torch.zeros(1, dtype=torch.long, device=device))
        io |= dict(cos=torch.zeros(B, 1, self.D, dtype=dtype, device=device), mask=torch.zeros(B, 1, 1, L, dtype=dtype, device=device))
        io["sin"] = io["cos"].clone()
        args = (w, kv, io["tok"], io["cos"], io["sin"], io["slot"], io["mask"])
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up (writes slot 0: the prompt is copied in after the capture)
                    self.forward(*args)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                io["logits"] = self.forward(*args)
            g.replay()
            eager = self.forward(*args)
            ok = torch.allclose(io["logits"].float(), eager.float(), rtol=0.02, atol=0.02 * float(eager.abs().max()))
        except RuntimeError as e:
            ok, why = False, str(e).splitlines()[0]
        else:
            why = "its replay disagrees with the eager forward"
        if not ok:
            warnings.warn(f"static decoder: no CUDA graph ({why}); decoding eagerly", stacklevel=2)
            self.use_graphs = False
            return None
        self.graphs[(B, L)] = (g, io, kv)
        return self.graphs[(B, L)]

    @torch.inference_mode()
    def generate(
        self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float,
        top_k: int, do_sample: bool, stops: Sequence[int], pad_id: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """ids, mask: [B, P] left-padded prompts. Returns the sampled ids [B, T], T <= max_new_tokens (after a row's
        stop token: pad_id, as `generate`), and each token's log-prob [B, T] under softmax(logits / temperature),
        the distribution token_logprobs scores. Sampling: `generate`'s warpers (temperature, top-k, top-p) and
        torch.multinomial, or argmax when not do_sample."""
        from transformers import DynamicCache
        from transformers.generation import logits_process as lp

        B, P = ids.shape
        w = self.weights()
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate's position ids
        prefill = DynamicCache()
        cache_kw = {self.cache_arg: prefill}  # transformers 5 calls it cache, 4.x past_key_values
        out = self.lm(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **cache_kw)
        logits = out.logits[:, -1]
        L = P + max_new_tokens
        graph = None
        if self.use_graphs:
            graph = self.graph(w, B, -(-L // 64) * 64, logits.dtype, ids.device)  # cache lengths in steps of 64
        whole = graph is not None or self.whole_cache
        if graph is not None:
            _, io, kv = graph
        else:  # the whole cache is read under the mask: finite everywhere (0 x NaN would be NaN)
            kv = (logits.new_zeros if whole else logits.new_empty)(len(w), 2, B, self.Hkv, L, self.D)
            io = dict(mask=logits.new_empty(B, 1, 1, L))
        layers = prefill.layers if hasattr(prefill, "layers") else prefill  # 4.x: (keys, values) per layer
        for i, layer in enumerate(layers):
            kv[i, 0, :, :, :P], kv[i, 1, :, :, :P] = (layer.keys, layer.values) if hasattr(layer, "keys") else layer
        io["mask"].fill_(-torch.inf)  # additive: 0 where a row attends (its prompt, then each new token), else -inf
        io["mask"][:, 0, 0, :P].masked_fill_(mask.bool(), 0.0)
        positions = pos[:, -1:] + torch.arange(1, max_new_tokens, device=ids.device)  # [B, max_new_tokens - 1]
        cos_all, sin_all = self.body.rotary_emb(logits, positions)  # [B, max_new_tokens - 1, D]
        warp = lp.LogitsProcessorList()
        if do_sample and temperature != 1.0:
            warp.append(lp.TemperatureLogitsWarper(temperature))
        if do_sample and top_k:
            warp.append(lp.TopKLogitsWarper(top_k))
        if do_sample and top_p < 1.0:
            warp.append(lp.TopPLogitsWarper(top_p))
        stop_ids = torch.tensor(list(stops), device=ids.device)
        unfinished = torch.ones(B, dtype=torch.long, device=ids.device)
        every = 8 if ids.is_cuda else 1  # how often the loop asks whether every row has stopped (a sync on CUDA)
        toks, logps = [], []
        for t in range(max_new_tokens):
            scores = logits.float()
            if do_sample:
                tok = torch.multinomial(F.softmax(warp(None, scores), dim=-1), num_samples=1).squeeze(1)
            else:
                tok = scores.argmax(-1)
            logps.append((scores / temperature).log_softmax(-1).gather(1, tok[:, None])[:, 0] * unfinished)
            tok = tok * unfinished + pad_id * (1 - unfinished)
            toks.append(tok)
            unfinished = unfinished & ~torch.isin(tok, stop_ids)
            if t == max_new_tokens - 1 or (t % every == every - 1 and not unfinished.any()):
                break
            slot = P + t
            io["mask"][:, 0, 0, slot] = 0.0
            step = (tok, cos_all[:, t, None], sin_all[:, t, None])
            if graph is None and whole:
                logits = self.forward(w, kv, *step, torch.tensor([slot], device=ids.device), io["mask"])
            elif graph is None:
                logits = self.forward(w, kv, *step, slot, io["mask"], length=slot + 1)
            else:
                for name, value in zip(("tok", "cos", "sin"), step):
                    io[name].copy_(value)
                io["slot"].fill_(slot)
                graph[0].replay()
                logits = io["logits"]
        return torch.stack(toks, 1), torch.stack(logps, 1)


def static_decoder(model) -> StaticDecoder | None:
    """`model`'s StaticDecoder (made once per model), or None when `model` samples with `generate`: --engine hf
    (`model._rlvr_hf_generate`), or an architecture the loop does not decode (said once)."""
    if getattr(model, "_rlvr_hf_generate", False):
        return None
    if model not in _DECODERS:
        why = StaticDecoder.unsupported(model)
        if why is not None:
            print(f"note: sampling with transformers' generate: the static decoder does not handle {why}",
                  file=sys.stderr)  # fmt: skip
        _DECODERS[model] = None if why else StaticDecoder(model)
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
    outs, logps = [], []
    gathered = getattr(model, "_rlvr_gathered", None)  # FSDP: generate on the full weights, no collective per token
    with gathered(model) if gathered is not None else contextlib.nullcontext():
        decoder = static_decoder(model)  # None: --engine hf, or a model the loop does not decode
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

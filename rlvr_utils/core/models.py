"""The policy: --model loaded with `from_pretrained` (hub id or local directory), clear errors, dropout off; its context
window bounds the prompts kept; its attention window; `generate` with the run's flags alone. A --model you give is
checked before it loads by rlvr_utils/extras/model_checks.py (an extra: the bundled default needs only
`check_default`)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from rlvr_utils.core.runtime import need, pick_device, usage_error


def looks_like_path(name: str) -> bool:
    """A --model that is a path rather than a hub id "org/name": it starts with . / ~, has more than one /, or its
    first component is a local directory (assets/tiny-arth is a typo of a path, not a hub id)."""
    return (
        name.startswith((".", "/", "~")) or name.count("/") > 1 or ("/" in name and Path(name.split("/")[0]).is_dir())
    )


def check_default(model: str) -> None:
    """The bundled default --model (cli.DEFAULT_MODEL) is where it belongs, e.g. beside a copied script."""
    need(Path(model).is_dir(), f"--model {model}: no such directory (the default --model is the bundled tiny policy, "
         "assets/tiny-arith beside the script): pass a Hugging Face model id or directory, e.g. --model "
         "Qwen/Qwen2.5-0.5B-Instruct, or copy assets/tiny-arith beside the script")  # fmt: skip


def model_positions(model: str) -> int | None:
    """The positions a prompt and its completion may fill (None: unknown), from a local or cached hub config.json:
    max_position_embeddings, a longrope model's original length. Past them transformers rescales the rotary frequencies
    to each call's length (dynamic NTK, longrope): no engine's tokens are then what the loss's fresh forward scores."""
    try:
        if looks_like_path(model):
            path = Path(model).expanduser() / "config.json"
        else:
            from huggingface_hub import try_to_load_from_cache

            path = Path(try_to_load_from_cache(model, "config.json"))  # not cached: a TypeError, not a str
        config = json.loads(path.read_text())
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}  # transformers 5 / 4's name
        n = config.get("max_position_embeddings")
        if rope.get("rope_type", rope.get("type")) == "longrope":
            n = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings") or n
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return n if isinstance(n, int) and n > 0 else None


def attention_window(config) -> int | None:
    """How far back a windowed layer attends (None: no layer has a window): sliding_window where a layer uses it:
    Mistral's every layer, Qwen2/3's under use_sliding_window from max_window_layers on, `sliding_attention` types."""
    types = getattr(config, "layer_types", None)  # transformers 5 (Qwen2/3 derive it from use_sliding_window)
    older = getattr(config, "use_sliding_window", True)  # Mistral has no switch: a window it sets is used
    older = older and getattr(config, "max_window_layers", 0) < config.num_hidden_layers
    windowed = "sliding_attention" in types if types is not None else older
    return getattr(config, "sliding_window", None) if windowed else None


@contextlib.contextmanager
def run_flags_only(model):
    """`model.generate` with the run's flags alone: it fills what a call leaves out from the checkpoint's
    generation_config.json (Qwen2.5-Instruct's repetition_penalty 1.05, ...), logits processors the loss does not
    score. During the call the config is blank, every processor off; then the checkpoint's again (docs/trl.md)."""
    from transformers import GenerationConfig

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT generates with the base's
    saved, lm.generation_config = lm.generation_config, GenerationConfig()
    try:
        yield
    finally:
        lm.generation_config = saved


def prompt_limit(model: str, max_prompt_length: int, max_new_tokens: int) -> int:
    """The longest prompt (tokens) the task keeps: --max-prompt-length, lowered so that a prompt and a whole completion
    fit the model's positions (`model_positions`); said when the flag was set above that. --max-new-tokens
    that leaves no room at all: one line."""
    positions = model_positions(model)
    if not positions or max_prompt_length + max_new_tokens <= positions:
        return max_prompt_length
    need(max_new_tokens < positions, f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in --model's "
         f"{positions} positions")  # fmt: skip
    limit = positions - max_new_tokens
    if max_prompt_length != 1024:  # the flag was set (1024: BaseArgs' default)
        print(
            f"note: --max-prompt-length {max_prompt_length} + --max-new-tokens {max_new_tokens} exceed --model's "
            f"{positions} positions (model_positions): prompts over {limit} tokens are skipped",
            file=sys.stderr,
        )
    return limit


def load_tokenizer(name_or_path: str):
    """The policy's tokenizer, left-padded for generation, with a pad token (its EOS when it has none). AutoTokenizer,
    except for a tokenizer saved with the generic class: AutoTokenizer rebuilds a qwen2 model's tokenizer as
    Qwen2Tokenizer (byte-level) whatever the file says, which drops the spaces and newlines of a tokenizer that is not
    byte-level, so it is loaded as exactly what was saved. The bundled tokenizers are byte-level (tools/
    train_tiny_model.py): both ways read the same ids, so a saved run loads the standard way too."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg = Path(name_or_path).expanduser() / "tokenizer_config.json"
    try:
        generic = cfg.exists() and json.loads(cfg.read_text()).get("tokenizer_class") in (
            "TokenizersBackend",
            "PreTrainedTokenizerFast",
        )
        tokenizer = (PreTrainedTokenizerFast if generic else AutoTokenizer).from_pretrained(name_or_path)
    except Exception as e:  # a damaged file, a class the library does not know, ...
        usage_error(f"--model {name_or_path}: cannot load its tokenizer ({_first_line(e)})")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(name_or_path: str, device: torch.device, dtype: str = "auto", gradient_checkpointing: bool = False):
    """`load_model` and `load_tokenizer` together: (model, tokenizer)."""
    return load_model(name_or_path, device, dtype, gradient_checkpointing), load_tokenizer(name_or_path)


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """--dtype as a torch dtype: auto is bfloat16 on CUDA, float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def mixed_precision(flags, device: torch.device | None = None) -> torch.dtype | None:
    """The compute dtype when the policy trains fp32 masters under it (precision.py): --dtype bfloat16 (auto on CUDA),
    full fine-tuning, no --pure-bf16; None under float32, --pure-bf16, LoRA (PEFT's adapters are fp32)."""
    a = flags if isinstance(flags, dict) else vars(flags)
    dtype = compute_dtype(a["dtype"], device or pick_device(a["device"]))
    mixed = dtype != torch.float32 and a.get("pure_bf16", "off") == "off" and not a.get("lora_rank")
    return dtype if mixed else None


def cast_weights(model, dtype: torch.dtype):
    """`model`'s parameters cast to `dtype` in place, its buffers left (the rotary frequencies stay fp32, as
    from_pretrained leaves them: the cast model computes bitwise as one loaded in `dtype`)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def load_model(name_or_path: str, device: torch.device, dtype: str = "auto", gradient_checkpointing: bool = False):
    """`from_pretrained` a causal LM. dtype "auto": bfloat16 on CUDA, float32 on CPU (the scripts pass float32 for
    mixed precision: the fp32 masters, from which precision.py makes the bf16 copies). A missing local path or an
    unreachable hub id is a clear error that names it. Dropout is off (log-probs must be the sampling distribution's).
    `gradient_checkpointing`: each decoder layer is recomputed in the backward (non-reentrant); the model is then kept
    in train mode, which that needs (generation switches to eval mode and back)."""
    from transformers import AutoModelForCausalLM

    looks_local = name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/").split("/", 2)[-1]
    need(not looks_local or Path(name_or_path).expanduser().exists(), f"--model {name_or_path}: no such directory")
    torch_dtype = compute_dtype(dtype, device)
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its many-line load report: what matters is the one line below
    if not sys.stderr.isatty():  # a log file or a pipe: no progress bar lines before the first of ours
        hf_logging.disable_progress_bar()
    try:
        how = dict(dtype=torch_dtype, output_loading_info=True, ignore_mismatched_sizes=True)  # refused below
        model, info = AutoModelForCausalLM.from_pretrained(name_or_path, **how)
    except Exception as e:  # a damaged file, an architecture the library does not know, ...
        usage_error(f"--model {name_or_path}: cannot load it ({_first_line(e)}): pass a local Hugging Face "
                    "directory, or a hub id on a machine with internet access")  # fmt: skip
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar() if bar else None
    check_weights(name_or_path, info)
    model = model.to(device)
    disable_dropout(model)
    if gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # transformers checkpoints a layer only in train mode
    return model


def check_weights(name: str, info: dict) -> None:
    """Every weight the config's model has, and no other, each of its shape: a config.json that lies about the layers,
    the sizes or the architecture would train (and save) another model, partly random. One line naming the first."""
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    shapes = [f"{k}: {list(a)} in the weights, {list(b)} by config.json" for k, a, b in sorted(info["mismatched_keys"])]
    found = [(f"{len(missing)} missing", missing), (f"{len(unexpected)} unexpected", unexpected)]
    found = [f"{what} ({', '.join(keys[:2])}{', ...' if len(keys) > 2 else ''})" for what, keys in found if keys]
    found += [f"{len(shapes)} of another shape ({shapes[0]})"] if shapes else []
    need(not found, f"--model {name}: config.json does not describe its weights: {'; '.join(found)} (a config.json "
         "of another model or size beside these weights?)")  # fmt: skip


def check_vocab(name: str, model, tokenizer) -> None:
    """The tokenizer's ids all have an embedding row (an id beyond them fails inside the model's forward)."""
    emb = model.get_input_embeddings()
    rows = getattr(emb, "base_layer", emb).num_embeddings  # --lora-rank on the embedding: PEFT's wrapper
    top = max(tokenizer.get_vocab().values(), default=0)
    need(top < rows, f"--model {name}: the tokenizer has ids up to {top}, the model's embedding {rows} rows: the "
         "tokenizer of another model beside these weights?")  # fmt: skip


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}" if str(e).strip() else type(e).__name__


def disable_dropout(model) -> None:
    """Every dropout of the model to 0: nn.Dropout modules and the attention-dropout floats attention layers keep."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)

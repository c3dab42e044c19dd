"""Loading the policy: `from_pretrained` for a hub id or a local directory, with clear errors, dropout off."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def load_tokenizer(name_or_path: str):
    """The policy's tokenizer, left-padded for generation, with a pad token (its EOS when it has none). AutoTokenizer,
    except for a tokenizer saved with the generic class: AutoTokenizer rebuilds a qwen2 model's tokenizer as
    Qwen2Tokenizer (byte-level) whatever the file says, which drops the spaces and newlines of a tokenizer that is not
    byte-level, so it is loaded as exactly what was saved. The bundled tokenizers are byte-level (tools/
    train_tiny_model.py): both ways read the same ids, so a saved run loads the standard way too."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg = Path(name_or_path).expanduser() / "tokenizer_config.json"
    generic = cfg.exists() and json.loads(cfg.read_text()).get("tokenizer_class") in (
        "TokenizersBackend",
        "PreTrainedTokenizerFast",
    )
    try:
        tokenizer = (PreTrainedTokenizerFast if generic else AutoTokenizer).from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"--model {name_or_path}: cannot load its tokenizer ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from e
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(name_or_path: str, device: torch.device, dtype: str = "auto", gradient_checkpointing: bool = False):
    """`load_model` and `load_tokenizer` together: (model, tokenizer)."""
    return load_model(name_or_path, device, dtype, gradient_checkpointing), load_tokenizer(name_or_path)


def load_model(name_or_path: str, device: torch.device, dtype: str = "auto", gradient_checkpointing: bool = False):
    """`from_pretrained` a causal LM. dtype "auto": bfloat16 on CUDA, float32 on CPU. A missing local path or an
    unreachable hub id is a clear error that names it. Dropout is off (log-probs must be the sampling distribution's).
    `gradient_checkpointing`: each decoder layer is recomputed in the backward (non-reentrant); the model is then kept
    in train mode, which that needs (generation switches to eval mode and back)."""
    from transformers import AutoModelForCausalLM

    looks_local = name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/").split("/", 2)[-1]
    if looks_local and not Path(name_or_path).expanduser().exists():
        raise SystemExit(f"--model {name_or_path}: no such directory")
    torch_dtype = {
        "auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype).to(device)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"--model {name_or_path}: cannot load it ({type(e).__name__}: {str(e).splitlines()[0]}). "
            "Pass a local Hugging Face directory, or a hub id on a machine with internet access."
        ) from e
    disable_dropout(model)
    if gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # transformers checkpoints a layer only in train mode
    return model


def disable_dropout(model) -> None:
    """Every dropout of the model to 0: nn.Dropout modules and the attention-dropout floats attention layers keep."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)

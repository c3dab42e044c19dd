"""--lora-rank: LoRA through PEFT, an extra (loaded where the flag is handled). The policy trains low-rank adapters on
the linear layers of its blocks; the frozen base with the adapters switched off is the reference (the KL term,
EP-GRPO's delta), so no second copy of the model exists; SC-GRPO's teacher is the policy itself, adapters on.
Checkpoints hold the adapters and the optimizer state (the base is --model's, loaded again on --resume);
--save-model writes the merged model (AutoModelForCausalLM), or with --save-adapter the adapter
(AutoPeftModelForCausalLM); the vLLM engine gets the merged weights after every optimizer step.
"""

from __future__ import annotations

import contextlib
import warnings

import torch


def wrap(model, args):
    """`model` with LoRA adapters (rank --lora-rank, scale --lora-alpha / rank, --lora-dropout) on
    --lora-target-modules (default: every linear layer of the blocks, PEFT's "all-linear", the lm_head left out);
    only the adapters train. The adapters start at B = 0, so the wrapped model computes exactly the base's outputs."""
    from peft import LoraConfig

    from rlvr_utils.core.runtime import need, usage_error

    targets = list(args.lora_target_modules) or "all-linear"
    problem = rank_problem(model, args.lora_rank, args.lora_target_modules)  # a config that could not be read before
    need(problem is None, problem)
    alpha = args.lora_alpha if args.lora_alpha is not None else args.lora_rank
    config = LoraConfig(
        r=args.lora_rank, lora_alpha=alpha, lora_dropout=args.lora_dropout, target_modules=targets,
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    if targets == "all-linear":
        return _peft_model(model, config)
    embeddings = (model.get_input_embeddings(), model.get_output_embeddings())
    ends = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if any(m is e for e in embeddings)}
    tied = sorted(ends & set(targets)) if getattr(model.config, "tie_word_embeddings", False) else []
    need(not tied, f"--lora-target-modules {' '.join(tied)}: this model ties its input and output embeddings, so an "
         "adapter there changes both (and a merged save or vLLM keeps one): adapt the blocks' layers")  # fmt: skip
    try:
        return _peft_model(model, config)
    except ValueError as e:  # no module of that name, a module PEFT cannot adapt
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        usage_error(f"--lora-target-modules {' '.join(targets)}: {why}")


def _peft_model(model, config):
    """get_peft_model, without the FutureWarning every LoRA run began with: PeftModel's constructor (peft 0.21) reads
    transformers' deprecated `is_gradient_checkpointing` (transformers 5: `is_activation_checkpointing`)."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def rank_problem(model, rank: int, targets=()) -> str | None:
    """A rank above the smallest dimension of a layer it adapts (the linear layers PEFT's all-linear takes, or those
    named by --lora-target-modules), or None: an adapter's update B A has rank at most min(in, out), so more is memory
    for nothing, and a huge rank is an out-of-memory kill (https://arxiv.org/abs/2106.09685, section 4)."""
    out = model.get_output_embeddings()
    named = [(n, m) for n, m in model.named_modules() if any(n == t or n.endswith("." + t) for t in targets)]
    linear = [(n, m) for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D") and m is not out]
    dims = [
        (min(m.weight.shape), n) for n, m in (named if targets else linear) if getattr(m, "weight", None) is not None
    ]
    if not dims or rank <= min(dims)[0]:
        return None
    smallest, name = min(dims)
    return (f"--lora-rank {rank}: above {smallest}, the smallest dimension of the layers it adapts ({name}); an "
            f"adapter's update has rank at most that: use --lora-rank {smallest} or less")  # fmt: skip


def check(a: dict) -> None:
    """--lora-rank's checks before the model loads: peft installed, no --fsdp under torchrun, and `rank_problem` against
    a skeleton of --model built from its config on the meta device (no weights; a config that cannot be read here, not
    cached or custom code, is checked after loading, in `wrap`)."""
    import importlib.util
    import os

    from rlvr_utils.core.runtime import need

    torchrun = os.environ.get("WORLD_SIZE", "1") != "1"
    need(not (a["fsdp"] and torchrun), "--lora-rank with --fsdp is not supported: the adapters are small, use DDP")
    need(importlib.util.find_spec("peft") is not None, "--lora-rank needs peft, not installed here: pip install peft")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(a["model"], local_files_only=True)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception:  # read again when the model loads
        return
    problem = rank_problem(skeleton, a["lora_rank"], a["lora_target_modules"])
    need(problem is None, problem)


def is_lora(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class AdaptersOff(torch.nn.Module):
    """The reference policy under LoRA: the same model called with its adapters disabled (no copy). It answers the
    calls common.token_logprobs makes of a model (a forward, get_output_embeddings, config) and is used without a
    gradient. The wrapped model is held outside the module tree, so it adds no parameters."""

    def __init__(self, model):
        super().__init__()
        self.__dict__["policy"] = model  # not a submodule: .parameters() stays empty

    def forward(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)

    def get_output_embeddings(self):
        return self.policy.get_output_embeddings()

    @property
    def config(self):
        return self.policy.config


def adapter_state(model) -> dict:
    """The adapters' weights, as a checkpoint holds them (PEFT's names)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_adapter_state(model, weights: dict) -> list[str]:
    """Load a checkpoint's adapter weights into `model`; returns the adapter weights it lacked or did not expect."""
    from peft import set_peft_model_state_dict

    want = set(adapter_state(model))
    problems = sorted(want.symmetric_difference(weights))
    if not problems:
        set_peft_model_state_dict(model, weights)
    return problems


def iter_merged_weights(model):
    """(name, weight) of the base model with the adapters merged in (W + scale * B A per adapted layer), under the
    base's own names, one at a time and without changing the model: what the vLLM engine loads after each step (a
    merged layer exists only while the engine reads it: no second copy of the model)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {f"{name}.base_layer.weight": m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        if key in layers:
            with torch.no_grad():
                value = value + layers[key].get_delta_weight("default").to(value.dtype)
        yield key.replace(".base_layer.", "."), value


@contextlib.contextmanager
def saved_as(model, adapter: bool, base: str):
    """--save-model under LoRA: the object to `save_pretrained`: the adapter (`adapter`: a PeftModel directory with
    adapter_config.json naming its base `base`, as the user gave it: model_card.base_as_given) or a merged model (the
    adapters merged into a copy-free unloaded base; the run ends after)."""
    if adapter:  # not the absolute path of this machine's copy: a hub id, or the path the user gave
        model.peft_config["default"].base_model_name_or_path = base
        yield model
    else:
        yield model.merge_and_unload()

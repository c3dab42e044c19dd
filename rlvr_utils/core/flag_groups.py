"""The command line in groups, the method's flags first (`--help`): tyro parses a dataclass of groups, each group a
nested dataclass whose flags keep their names (tyro.conf.OmitArgPrefixes) and whose box is titled with what it is for,
and `parse` turns the parsed groups back into the flat Args every script reads. The flat dataclasses (cli.BaseArgs and
a script's Args) stay the one definition of every flag: a group holds their fields with the type, the default and the
docstring each already has (one line of help each; the docstring under a field, as tyro reads it).

Order: the method (the fields its script's Args declares: its own flags and the shared ones whose defaults it
changes), its ablation flags when one is given, then the shared flags by GROUPS. A shared flag not in GROUPS joins the
group of the flag declared before it.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import io
import os
import sys
import textwrap
import typing
from typing import Annotated

import tyro

from rlvr_utils.core.runtime import usage_error

# each shared group: the title of its box (tyro adds " options") and what it is for
TITLES = {
    "run": "the run: its name and seed, where its logs, trackers, checkpoints and saved model go, resuming, threads",
    "model": "the policy: which model, on which device and in which dtype, LoRA adapters, gradient checkpointing",
    "task": "what it trains on and how it is rewarded: the task, data files, reward functions, prompt limits",
    "sampling": "the rollouts: steps, prompts per step, completions per prompt, how they are sampled (DAPO's options)",
    "optimizer": "the update: AdamW, clipping, the KL to the reference, loss aggregation, advantage scaling, batching",
    "evaluation": "held-out evaluation (greedy pass@1, or TRL's samples) and --log-credit's credit records",
    "engine": "the rollout engine: this project's decoder, transformers' generate, or vLLM and its importance weights",
    "torchrun": "several processes: torchrun --nproc_per_node N <script> ... (DDP, or FSDP2; docs/scaling.md)",
}
GROUPS = {
    "run": "exp_name seed track wandb_project report_to output_dir save_model save_every resume threads",
    "model": "device dtype model gradient_checkpointing lora_rank lora_alpha lora_dropout lora_target_modules "
    "save_adapter",
    "task": "task data_path eval_data_path reward_fn reward_weights reward_timeout success_threshold arith_steps "
    "arith_max_value arith_max_operand code_timeout max_prompt_length",
    "sampling": "total_steps prompts_per_step num_generations max_new_tokens temperature top_p top_k gen_batch_size "
    "dynamic_sampling max_sampling_rounds overlong_buffer overlong_penalty_factor mask_truncated_completions",
    "optimizer": "learning_rate weight_decay max_grad_norm num_iterations num_minibatches epsilon epsilon_high beta "
    "loss_agg scale_rewards micro_batch_size",
    "evaluation": "eval_every num_eval eval_temperature eval_num_generations log_credit",
    "engine": "engine vllm_gpu_memory_utilization vllm_is_cap vllm_is_mode vllm_is_min",
    "torchrun": "fsdp dist_timeout",
}
GROUP_OF = {name: group for group, names in GROUPS.items() for name in names.split()}
CONFIG_HELP = "a YAML, TOML or JSON file of flags by name, the command line over it (docs/running.md)"


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of `cls` and its bases (the most derived class's first), on one line."""
    docs = {}
    for klass in cls.__mro__:
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, SyntaxError, IndexError, AttributeError):  # a made class, or `object`
            continue
        for node, after in zip(body, body[1:]):
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(doc, str):
                docs.setdefault(node.target.id, " ".join(doc.split()))
    return docs


def layout(args_type) -> dict[str, tuple[str, list[str]]]:
    """{group name: (what it is for, its fields)}, in --help's order: the method's, its ablations', then GROUPS'."""
    base = next((k for k in args_type.__mro__ if k.__name__ == "BaseArgs"), None)  # cli.BaseArgs
    module = getattr(args_type, "ablation_module", None)
    ablations = getattr(module, "Ablations", None)
    defined = next(k for k in args_type.__mro__ if k.__module__ != "types" and k is not ablations)  # the script's
    script = sys.modules.get(defined.__module__)
    method = (getattr(script, "__doc__", None) or args_type.__name__).split(":")[0].strip()
    out = {method: ("the method's own flags, and the shared flags whose defaults it changes", [])}
    if ablations is not None:
        out["ablations"] = (" ".join((ablations.__doc__ or "").split()) + " (ours)", [])
    out |= {g: (TITLES[g], []) for g in GROUPS}
    group = "run"
    for f in dataclasses.fields(args_type):
        owner = next(k for k in args_type.__mro__ if f.name in vars(k).get("__annotations__", {}))
        if owner is base:
            group = GROUP_OF.get(f.name, group)  # a shared flag not listed: its predecessor's group
        box = group if owner is base else "ablations" if owner is ablations else method
        out[box][1].append(f.name)
    return {name: (what, names) for name, (what, names) in out.items() if names}


def parse(args_type, argv: list[str], on_error=usage_error):
    """The command line `argv` parsed by tyro in --help's groups (`grouped`): the flat args_type instance; tyro's
    complaint as one line, `on_error(line)` (default: runtime.usage_error, exit code 2); --help: the help, exit 0."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return grouped(args_type, argv)
    except BrokenPipeError:  # `--help | head`: the rest of the help goes nowhere, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None
    except SystemExit as e:
        text = captured.getvalue()
        if e.code in (0, None):
            sys.stderr.write(text)
            raise
        rows = [r.strip().strip("│").strip() for r in text.splitlines()[1:]]  # the box's title first; ASCII: no box
        rows = [r for r in rows if r and set(r) - set("─-╰╯")]  # rules and the box's bottom out
        cut = next((i for i, r in enumerate(rows) if r.startswith("For full helptext")), len(rows))
        line = " ".join(rows[:cut]) or text.strip()
        if on_error is not usage_error:
            raise on_error(line) from None
        usage_error(line)


def grouped(args_type, argv: list[str]):
    """tyro.cli over the groups of `args_type` (its defaults: `args_type()`'s), `argv` the command line; returns the
    flat args_type instance, its fields filled from every group."""
    hints, docs = typing.get_type_hints(args_type, include_extras=True), field_docs(args_type)
    defaults, groups = args_type(), layout(args_type)
    fields, instance = [], {}
    for i, (name, (what, names)) in enumerate(groups.items()):
        flags = [(n, Annotated[hints[n], tyro.conf.arg(help=docs.get(n, ""))]) for n in names]
        box = dataclasses.make_dataclass(f"Group{i}", flags, namespace={"__doc__": what})
        fields.append((f"g{i}", Annotated[box, tyro.conf.OmitArgPrefixes, tyro.conf.arg(name=name)]))
        instance[f"g{i}"] = box(**{n: getattr(defaults, n) for n in names})
    config = Annotated[str | None, tyro.conf.arg(help=CONFIG_HELP, metavar="FILE")]  # cli.parse reads it first
    groups = dataclasses.make_dataclass(args_type.__name__, fields + [("config", config, None)])
    groups.__doc__ = args_type.__doc__
    parsed = tyro.cli(groups, args=argv, default=groups(**instance, config=None))
    return args_type(**{n: v for g in instance for n, v in vars(getattr(parsed, g)).items()})

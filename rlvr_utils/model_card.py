"""The model card `--save-model` writes beside the weights (README.md, Hugging Face's format): what the model is, the
method that trained it, the run's flags and its final accuracy, read from the run directory (config.json,
metrics.jsonl) so that it says what the run did."""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
from pathlib import Path

from rlvr_utils.cli import BaseArgs
from rlvr_utils.models import looks_like_path

HIDDEN = ("script", "file_hashes", "output_dir", "resume", "exp_name", "track", "wandb_project", "threads", "device")


def method_summary(script: str) -> str:
    """The first paragraph of the training script's docstring (the script that is running, when it is `script`)."""
    path = Path(sys.argv[0])
    if path.name != script or not path.is_file():
        return f"`{script}`"
    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except (OSError, SyntaxError, ValueError):
        return f"`{script}`"
    prose = [p for p in doc.split("\n\n") if p.strip() and not p.startswith(" ")][:2]  # its title and what it does
    return "\n\n".join(" ".join(p.split()) for p in prose) or f"`{script}`"


def flags(config: dict) -> list[str]:
    """The command-line flags of the run that differ from the shared defaults (a method's own flags: all of them)."""
    defaults = {f.name: f.default for f in dataclasses.fields(BaseArgs)}
    out = []
    for k, v in config.items():
        if k in HIDDEN or (k in defaults and (v == defaults[k] or (isinstance(v, list) and tuple(v) == defaults[k]))):
            continue
        if k == "epsilon_high" and v == config.get("epsilon"):  # filled in from --epsilon
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out += [flag] if v else [f"--no-{k.replace('_', '-')}"]
        elif isinstance(v, list):
            out += [f"{flag} {x}" for x in v]
        elif v is not None:
            out.append(f"{flag} {v}")
    return out


def model_card(run_dir: Path) -> str | None:
    """README.md for `<run_dir>/model`, or None when the run directory has no config.json."""
    run_dir = Path(run_dir)
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    rows = []
    if (run_dir / "metrics.jsonl").is_file():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    evals = [r for r in rows if "eval/accuracy" in r]
    script, base = config.get("script", "the training script"), str(config.get("model", ""))
    hub = base and not looks_like_path(base) and not Path(base).expanduser().exists()
    shown = "the bundled tiny arithmetic model" if Path(base).name == "tiny-arith" else f"`{base}`"
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    front += [f"base_model: {base}"] if hub else []
    front += ["tags:", "- credit-rlvr", "- rlvr", f"- {Path(script).stem.replace('_', '-')}", "---"]
    lines = [*front, "", f"# {run_dir.name}", ""]
    lines += [
        f"A causal language model trained from {shown} with reinforcement learning from verifiable rewards by "
        f"credit-rlvr's `{script}` on `--task {config.get('task')}`"
        + (f" (data: `{config['data_path']}`)" if config.get("data_path") else "")
        + (f", rewarded by `{'`, `'.join(config['reward_fn'])}`" if config.get("reward_fn") else "")
        + ".",
        "",
        "## Method",
        "",
        method_summary(script),
        "",
        "## Training flags",
        "",
        "```bash",
        " \\\n    ".join([f"python {script}", *flags(config)]),
        "```",
        "",
        "## Results",
        "",
    ]
    if evals:
        last, first = evals[-1], evals[0]
        lines += [
            "| step | eval/accuracy | eval/reward |",
            "|---|---|---|",
            *{
                f"| {r['step']} | {r['eval/accuracy']:.3f} | {r.get('eval/reward', float('nan')):.3f} |": None
                for r in (first, last)
            },
            "",
            f"Final accuracy **{last['eval/accuracy']:.3f}** after step {last['step']}: the share of "
            f"{config.get('num_eval')} held-out prompts whose completion (pass@1, temperature "
            f"{config.get('eval_temperature')}) gets a reward of at least {config.get('success_threshold')} "
            "(`--success-threshold`).",
        ]
    else:
        lines.append("No evaluation was logged.")
    rank, adapter = config.get("lora_rank") or 0, bool(config.get("save_adapter"))
    loader = "AutoPeftModelForCausalLM" if adapter else "AutoModelForCausalLM"
    if rank:  # --lora-rank: what the folder holds
        what = "a LoRA adapter, loaded over its base" if adapter else "the model with its LoRA adapters merged"
        lines += ["", f"Trained with LoRA (rank {rank}); this folder holds {what}."]
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoTokenizer",
        f"from {'peft' if adapter else 'transformers'} import {loader}",
        "",
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")',
        f'model = {loader}.from_pretrained("path/to/this/folder")',
        "```",
        "",
        "Prompts are written as in training: the task's plain prompt (or the row's `prompt` string), or the chat "
        "template's rendering when the tokenizer has one.",
        "",
    ]
    return "\n".join(lines)

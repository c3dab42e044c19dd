"""The model card `--save-model` writes beside the weights (README.md), built with huggingface_hub's ModelCard and
ModelCardData so that the hub reads its metadata: base_model (the base's hub id, where it has one), library_name,
the pipeline, tags with the method, the license (the base model's where its card names one, else `other` with a line
telling the user to set it), the datasets of the hub tasks; then the method and its paper to cite, the run's flags, its
evaluations, an example prompt, this project's name and the library versions it trained with. Read from the run
directory (config.json, metrics.jsonl) so that it says what the run did; local paths (the model, data files, reward
files) are reduced to their names, so no path of the training machine goes to the hub. `save_final_model` writes the
model and its card (Run.finish); an adapter names its base as the user gave it (`base_as_given`).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import html
import importlib.metadata
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import torch

from rlvr_utils.core import checkpoints
from rlvr_utils.core.cli import DEFAULT_MODEL, BaseArgs
from rlvr_utils.core.models import looks_like_path
from rlvr_utils.core.runtime import extra
from rlvr_utils.core.tasks import HUB_DATASETS
from rlvr_utils.extras.save import saving

HIDDEN = tuple("script file_hashes output_dir resume exp_name track wandb_project report_to threads device".split())
PATH_FLAGS = ("model", "data_path", "eval_data_path")  # a local one is shown by its name
# the project, named on each card; the tree records no public address for it, so none is invented here: a published
# copy adds its link to this line
PROJECT = "credit-rlvr (one readable script per credit-assignment RLVR method)"
BUNDLED = "assets/tiny-arith"  # the bundled model, as a clone of the project names it


def script_doc(script: str) -> str:
    """The training script's docstring (the script that is running, when it is `script`), or ''."""
    path = Path(sys.argv[0])
    if path.name != script or not path.is_file():
        return ""
    try:
        return ast.get_docstring(ast.parse(path.read_text())) or ""
    except (OSError, SyntaxError, ValueError):
        return ""


def method_summary(doc: str, script: str) -> str:
    """The first paragraphs of the script's docstring: its title and what the method does."""
    prose = [p for p in doc.split("\n\n") if p.strip() and not p.startswith(" ")][:2]
    return "\n\n".join(" ".join(p.split()).split(" Paper: ")[0] for p in prose) or f"`{script}`"


def paper(doc: str) -> tuple[str, str | None]:
    """The method's paper as the docstring cites it (`Paper: ...`), and its arXiv id when it names one."""
    text = " ".join(doc.split())
    cited = re.search(r"Paper: (.+?)(?: Docs:|$)", text)
    if cited is None:
        return "", None
    arxiv = re.search(r"arXiv (\d{4}\.\d{4,5})", cited.group(1))
    return cited.group(1).strip().rstrip("."), arxiv.group(1) if arxiv else None


def local(value: str) -> bool:
    return looks_like_path(value) or Path(value).expanduser().exists()


def hub_id(model: str) -> str | None:
    """The base model's hub id: --model itself when it is one, a snapshot in the hub's cache (`.../models--ORG--NAME/
    snapshots/REV`) by its id; None for a local model of its own (the bundled one included)."""
    if not local(model):
        return model
    found = re.search(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$", str(Path(model).expanduser()))
    return f"{found.group(1)}/{found.group(2)}" if found else None


def base_as_given(model: str) -> str:
    """The base as an adapter's `base_model_name_or_path` names it: its hub id where it has one, the bundled model as
    `assets/tiny-arith` (a clone's path, not this machine's), else --model as the user gave it."""
    if (hub := hub_id(model)) is not None:
        return hub
    return BUNDLED if Path(model).expanduser().resolve() == Path(DEFAULT_MODEL).resolve() else model


def hub_like(model: str) -> bool:
    """Whether an adapter's base as given (`base_as_given`) is a local path that the hub would read as a hub id
    (`assets/tiny-arith`: ORG/NAME), another model than the one it was trained on."""
    given = base_as_given(model)
    return hub_id(model) is None and re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", given) is not None


def saved_line(path, flags_now: dict) -> str:
    """The line that ends a run with --save-model: where the folder went and, for an adapter whose base is a local path
    the hub would take for a hub id, that it is one."""
    line = f"saved model to {checkpoints.shown(path)}"
    if flags_now.get("save_adapter") and hub_like(flags_now["model"]):
        given = base_as_given(flags_now["model"])
        line += (f" (an adapter: its base_model {given} is a local path, which the hub would read as the hub id "
                 f"{given}; set it to the base's hub id before you share the adapter)")  # fmt: skip
    return line


def versions(adapter: bool) -> list[str]:
    """The card's framework versions (TRL's cards list theirs): torch, transformers, datasets and, for LoRA, peft."""
    names = ["torch", "transformers", "datasets"] + (["peft"] if adapter else [])
    out = []
    for name in names:
        try:
            out.append(f"- {name}: {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def portable(key: str, value):
    """A flag's value as the card shows it: a local path by its name (a reward file: its name and function)."""
    if key in PATH_FLAGS and isinstance(value, str) and local(value):
        return Path(value.rstrip("/")).name
    if key == "reward_fn" and isinstance(value, list):
        return [f"{Path(s.rpartition(':')[0]).name}:{s.rpartition(':')[2]}" if ".py:" in s else s for s in value]
    return value


def flags(config: dict) -> list[str]:
    """The command-line flags of the run that differ from the shared defaults (a method's own flags: all of them)."""
    defaults = {f.name: f.default for f in dataclasses.fields(BaseArgs)}
    out = []
    for k, v in config.items():
        if k in HIDDEN or (k in defaults and (v == defaults[k] or (isinstance(v, list) and tuple(v) == defaults[k]))):
            continue
        if k == "epsilon_high" and v == config.get("epsilon"):  # filled in from --epsilon
            continue
        flag, v = "--" + k.replace("_", "-"), portable(k, v)
        if isinstance(v, bool):
            out += [flag] if v else [f"--no-{k.replace('_', '-')}"]
        elif isinstance(v, list):
            out += [f"{flag} {shell_word(x)}" for x in v]
        elif v is not None:
            out.append(f"{flag} {shell_word(v)}")
    return out


def shell_word(value) -> str:
    """A value as one bash word: quoted where it holds a space or a quote, as $'...' where it holds a newline or a tab
    (SRPO's --thought-delimiter "\n\n"), so the card's command can be pasted. In $'...' only what is not printable is
    escaped (bash's \\n, \\t, \\xHH, \\uHHHH, \\UHHHHHHHH): a printable é or 😀 stays itself, since bash reads \\xe9 as
    one byte, not the character."""
    text = str(value)
    if text.isprintable():
        return shlex.quote(text)
    return "$'" + "".join(_bash_char(c) for c in text) + "'"


def _bash_char(c: str) -> str:
    if c in "\\'":
        return "\\" + c
    if c.isprintable():
        return c
    named = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
    n = ord(c)
    return named.get(c) or ("\\x%02x" % n if n < 0x80 else "\\u%04x" % n if n <= 0xFFFF else "\\U%08x" % n)


def base_license(base: str) -> str | None:
    """The license the base model's own card names: a local directory's README.md, or a hub id's cached one (no
    network); None when there is none."""
    from huggingface_hub import ModelCard, try_to_load_from_cache

    try:
        readme = Path(base).expanduser() / "README.md" if local(base) else try_to_load_from_cache(base, "README.md")
        if not isinstance(readme, (str, Path)) or not Path(readme).is_file():
            return None
        data = ModelCard.load(readme, ignore_metadata_errors=True).data
    except Exception:  # no card, or one that cannot be read: the user is told to set the license
        return None
    return data.license if isinstance(data.license, str) else None


def model_card(
    run_dir: Path, example: str | None = None, flags_now: dict | None = None, weights: str | None = None
) -> str | None:
    """README.md for `<run_dir>/model`, or None when the run directory has no config.json. `example`: a prompt as the
    model saw it in training. `flags_now`: the run's flags as it ends (vars(args)), which a resumed run's runtime flags
    (--total-steps, --save-adapter, ...) may have changed since config.json was written; None: config.json's.
    `weights`: what the folder's weights are (their dtype and where it comes from: `weights_line`)."""
    from huggingface_hub import ModelCard, ModelCardData

    run_dir = Path(run_dir)
    try:
        config = json.loads((run_dir / "config.json").read_text())
        assert isinstance(config, dict)
    except (OSError, ValueError, AssertionError, RecursionError):
        return None
    if flags_now is not None:  # as config.json holds them (JSON's lists, paths as text)
        config |= json.loads(json.dumps(flags_now, default=str))
    rows = []
    if (run_dir / "metrics.jsonl").is_file():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    evals = [r for r in rows if isinstance(r, dict) and isinstance(r.get("eval/accuracy"), (int, float))]
    script, base, task = config.get("script", "the training script"), str(config.get("model", "")), config.get("task")
    doc = script_doc(script)
    title, (cited, arxiv) = method_summary(doc, script).split("\n\n")[0].split(":")[0], paper(doc)
    name = portable("model", base)
    shown = "the bundled tiny arithmetic model" if name == "tiny-arith" else f"`{name}`"
    license = base_license(base)
    data = portable("data_path", config.get("data_path") or "")
    hub_data = data if task == "custom" and data and not local(config["data_path"]) else None
    rank, adapter = config.get("lora_rank") or 0, bool(config.get("save_adapter"))
    given = base_as_given(base) if adapter and base else None  # an adapter: its base as PEFT's cards name it
    given = None if given is None or Path(given).is_absolute() else given  # never a path of this machine
    tags = ["credit-rlvr", "rlvr", "reinforcement-learning", Path(script).stem.replace("_", "-")]
    card = ModelCardData(
        base_model=given if adapter else hub_id(base) if base else None,  # merged: a hub id or nothing
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        license=license or "other",
        tags=tags + (["lora", "transformers"] + [f"base_model:adapter:{given}"] * bool(given) if adapter else []),
        datasets=[hub_data or HUB_DATASETS[task][0]] if hub_data or (task in HUB_DATASETS and not data) else None,
    )
    rewarded = [f"`{s}`" for s in portable("reward_fn", config.get("reward_fn") or [])]
    lines = [f"# {html.escape(name or 'A model')} trained with {title}", ""]  # a directory's name may hold HTML
    lines += [
        f"A causal language model trained from {shown} with reinforcement learning from verifiable rewards by "
        f"credit-rlvr's `{script}` on `--task {task}`"
        + (f" (data: `{data}`)" if data else "")
        + (f", rewarded by {', '.join(rewarded)}" if rewarded else "")
        + ".",
        "",
    ]
    if not license:
        lines += [
            "**License:** not known here (the base model's card names none): set `license:` above to the base "
            "model's license before you share this model.",
            "",
        ]
    lines += ["## Method", "", method_summary(doc, script), "", "## Training flags", "", "```bash"]
    lines += [" \\\n    ".join([f"python {script}", *flags(config)]), "```", "", "## Results", ""]
    if evals:
        last, first = evals[-1], evals[0]
        table = [f"| {r['step']} | {r['eval/accuracy']:.3f} | {_num(r.get('eval/reward'))} |" for r in (first, last)]
        lines += ["| step | eval/accuracy | eval/reward |", "|---|---|---|", *dict.fromkeys(table), ""]
        n, temp = config.get("eval_num_generations") or 0, config.get("eval_temperature")
        what = f"{config.get('num_eval')} held-out prompts whose completion (pass@1, temperature {temp})"
        if n:  # --eval-num-generations: TRL's sampled evaluation
            temp = temp or config.get("temperature")
            what = f"{n} samples (temperature {temp}) of each of {config.get('num_eval')} held-out prompts that"
        lines.append(
            f"Final accuracy **{last['eval/accuracy']:.3f}** after step {last['step']}: the share of {what} "
            f"gets a reward of at least {config.get('success_threshold')} (`--success-threshold`)."
        )
    else:
        lines.append("No evaluation was logged.")
    loader = "AutoPeftModelForCausalLM" if adapter else "AutoModelForCausalLM"
    if rank:  # --lora-rank: what the folder holds
        what = "a LoRA adapter, loaded over its base" if adapter else "the model with its LoRA adapters merged"
        lines += ["", f"Trained with LoRA (rank {rank}); this folder holds {what}."]
        if adapter and hub_id(base) is None:  # adapter_config.json names a local base as the user gave it
            where = "in a clone of credit-rlvr" if base_as_given(base) == BUNDLED else f"`{name}` as given to --model"
            lines[-1] += (f" Its `adapter_config.json` names the base by its local path ({where}): elsewhere, set "
                          "`base_model_name_or_path` to the base's hub id or local copy.")  # fmt: skip
            if hub_like(base):  # ORG/NAME: the hub would link another model
                lines[-1] += (f" `base_model: {given}` above is that local path, not a model on the hub, which would "
                              f"read it as the hub id `{given}`: set both to the base's hub id before you share this "
                              "adapter.")  # fmt: skip
    lines += ["", "## Use", "", *([weights, ""] if weights else [])]
    lines += ["```python", "from transformers import AutoTokenizer"]
    lines += [f"from {'peft' if adapter else 'transformers'} import {loader}", ""]
    lines += [
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")',
        f'model = {loader}.from_pretrained("path/to/this/folder")',
    ]
    if example is not None:  # a training prompt, as the model saw it (the chat template already applied)
        # ensure_ascii=False: a character outside the BMP as itself (escaped, it is two lone surrogates in Python)
        lines += [
            f"prompt = {json.dumps(example, ensure_ascii=False)}",
            'ids = tokenizer(prompt, return_tensors="pt").input_ids',
        ]
        lines += ["print(tokenizer.decode(model.generate(ids, max_new_tokens=64)[0][ids.shape[1]:]))"]
    lines += ["```", "", "Prompts are written as in training (the example above): the task's prompt, or the chat "]
    lines[-1] += "template's rendering when the tokenizer has one."
    lines += ["", "## Framework versions", "", f"Trained with {PROJECT}.", "", *versions(bool(rank))]
    if cited:
        lines += ["", "## Citation", "", f"The method: {cited}" + (f", https://arxiv.org/abs/{arxiv}" if arxiv else "")]
    return str(ModelCard(f"---\n{card.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"))


def _num(v) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) else "-"


def weights_line(written: torch.dtype, mixed: bool, save_dtype: str) -> str:
    """The card's line on the weights: their dtype, and whether they are the fp32 masters of mixed precision (the
    weights that trained) or a cast of them (--save-dtype)."""
    trained = "the fp32 master weights the run trained under bf16 compute" if mixed else "the weights the run trained"
    how = trained if save_dtype == "auto" else f"{trained}, cast by `--save-dtype {save_dtype}`"
    half = " (`from_pretrained(..., dtype=torch.bfloat16)` loads them in bf16, for inference)"
    half = half if mixed and written == torch.float32 else ""
    return f"The weights are {str(written).removeprefix('torch.')}: {how}{half}."


def save_final_model(dist, model, tokenizer, path, example: str | None, flags_now: dict) -> Path | None:
    """--save-model: `save_model_atomic` on rank 0 (FSDP: the full state dict gathered from every rank first), with a
    model card (README.md, `model_card`: `example`, a prompt as the model saw it in training) made from the run
    directory `path` is in and the run's flags as it ends (`flags_now`). Under LoRA the model with its adapters merged,
    or with --save-adapter the adapter alone. Mixed precision: the fp32 masters, or with --save-dtype bfloat16 the
    bf16 copies the run computed with (the masters rounded to nearest). Every rank returns together. A save that
    cannot be written (a full disk): one line naming the directory, the cause and the checkpoint that is left, exit
    code 1; no hidden copy is left beside it."""
    save_dtype = flags_now.get("save_dtype", "auto")
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[save_dtype]
    with checkpoints.masters_of(model) if dtype != torch.bfloat16 else contextlib.nullcontext():
        return _save_final_model(dist, model, tokenizer, Path(path), example, flags_now, dtype)


def _save_final_model(dist, model, tokenizer, path: Path, example, flags_now: dict, dtype) -> Path | None:
    state = dist.full_state_dict(model)
    mixed = getattr(dist, "mixed", None) is not None  # fp32 masters (LoRA has none)
    written = dtype or next(model.parameters()).dtype
    weights = weights_line(written, mixed, flags_now.get("save_dtype", "auto"))
    card = model_card(path.parent, example, flags_now, weights) if dist.main else None
    adapter = bool(flags_now.get("save_adapter"))
    out = None
    if dist.main:
        try:
            if hasattr(model, "peft_config"):  # --lora-rank
                with extra("lora", "--lora-rank").saved_as(model, adapter, base_as_given(flags_now["model"])) as saved:
                    out = saving.save_model_atomic(saved, tokenizer, path, None, card, dtype)
            else:
                out = saving.save_model_atomic(model, tokenizer, path, state, card, dtype)
        except Exception as e:
            if not checkpoints.is_io_error(e):
                raise  # not an I/O failure: a bug keeps its traceback
            kept = checkpoints.Checkpointer(path.parent, 0).copies()
            left = f"the checkpoint of step {kept[0][0]} is intact" if kept else "the run saved no checkpoint"
            checkpoints.write_failed(f"--save-model: writing {path} failed ({checkpoints.io_cause(e)}); {left}")
        finally:  # a kill between the atomic save's two renames, in an earlier save, leaves an old copy hidden
            for d in path.parent.glob(f".{path.name}.old-*"):
                shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    return out

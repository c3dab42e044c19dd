"""--resume RUN_DIR, an extra: the run's own flags (its config.json) merged with this command line's and checked
before anything loads (`resume_args`, from cli.parse), then the checkpoint (checkpoints.py) restored into the model,
optimizer, prompt stream and random-number states the script has built (`restore`, from common.Run.start), so the run
goes on exactly as if it had not stopped (tests/test_checkpoints.py checks this bit for bit on CPU; tests/test_dist.py
the sharded checkpoints and world-size changes). A damaged file ends the run with one line naming it (exit code 2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import sys
import types
import typing
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from rlvr_utils.core import runtime
from rlvr_utils.core.checkpoints import COMPLETE, Checkpointer, CountingBatches, lock_run_dir
from rlvr_utils.core.runtime import need, usage_error

RUNTIME_FLAGS = (
    "resume",
    "total_steps",
    "save_every",
    "save_model",
    "save_adapter",  # --save-model's form, chosen at the end
    "threads",
    "track",
    "wandb_project",
    "report_to",
    "eval_every",
    "device",
    "dist_timeout",
    "fsdp",  # the same maths sharded or not: a run moves between DDP and FSDP through its checkpoint
    "model",  # the weights come from the checkpoint: a run made in another clone names its own copy of the model
    "output_dir",  # a resumed run writes into its own directory, wherever it has been moved
    "data_path",  # a data file that moved (its contents are compared with the run's: file_hashes)
    "eval_data_path",
    "reward_timeout",  # a reward service that got slower
)  # may differ between a run and its resumption


def _fits(kind, value) -> bool:
    """Whether a config.json value is one the flag of type `kind` takes (Literal choices, X | None, tuples of them)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_fits(k, value) for k in args)
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(_fits(args[0], v) for v in value) if args else True
    if kind is bool:
        return isinstance(value, bool)
    if kind in (int, float):
        return isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    return isinstance(value, kind) if kind is str else True  # anything else is not checked here


def resume_args(args, args_type, ablations: str | None = None):
    """`--resume RUN_DIR` continues a run with the flags it was started with (its config.json). A flag given on this
    command line that differs from the run's is an error, except the runtime flags above, which may be given anew
    (e.g. --total-steps to extend a run; --threads changes the floating-point order, so a bit-for-bit continuation
    keeps the run's). The run must be this script's and hold a complete checkpoint before --total-steps. Returns the
    merged args (with the `ablations` module's flags when the run was started with one of them: cli.parse)."""
    run_dir, script = Path(args.resume), Path(sys.argv[0]).name
    cfg = run_dir / "config.json"  # a FIFO, a device or a directory of that name: not "no config.json"
    what = f"{cfg} is not a regular file" if cfg.exists() else "not a run directory (no config.json)"
    need(cfg.is_file(), f"--resume {args.resume}: {what}")
    try:
        saved = json.loads((run_dir / "config.json").read_text())
        assert isinstance(saved, dict)
    except (ValueError, AssertionError, OSError, RecursionError) as e:
        usage_error(f"--resume {args.resume}: {run_dir / 'config.json'} cannot be read ({type(e).__name__})")
    more = sorted(set(saved) - {f.name for f in dataclasses.fields(args_type)} - {"script", "file_hashes"})
    if more and args_type.ablation_module is None:  # a run started with an ablation flag: its flags
        args_type = runtime.ablated(args_type, ablations, more[0])
        args = args_type(**vars(args))  # its flags at their defaults, then the run's
    made_by = saved.get("script")
    need(
        made_by in (None, script),
        f"--resume {args.resume}: the run was made by {made_by}, not {script} (a run "
        "continues with the script that started it)",
    )
    copies = Checkpointer(run_dir, 0).copies()
    marker = run_dir / "checkpoint" / COMPLETE
    need(bool(copies) or not marker.exists(), f'--resume {args.resume}: {marker} is damaged (not {{"step": N}})')
    need(
        bool(copies),
        f"--resume {args.resume}: no checkpoint in it (a run saves one with --save-every N, on Ctrl-C and on SIGTERM)",
    )
    problem = damaged(copies[0][1])
    need(problem is None, f"--resume {args.resume}: {problem}")
    if os.environ.get("RANK", "0") == "0":  # one writer per run directory, before anything loads
        lock_run_dir(run_dir)
    metrics = run_dir / "metrics.jsonl"
    need(
        metrics.is_file(),
        f"--resume {args.resume}: {metrics} is missing (a resumed run appends to it): restore it, or start a new run",
    )
    runtime.metrics_rows(metrics)  # every line a JSON object with its step (one line naming the line otherwise)
    defaults, merged = args_type(), {}
    hints = typing.get_type_hints(args_type)
    for f in dataclasses.fields(args_type):  # a hand-edited config.json: one line naming the key, not a traceback
        if f.name in saved:
            kind = hints[f.name]  # the Literal choices, also inside X | None or a tuple, for the message
            choices = [c for k in (kind, *typing.get_args(kind)) if typing.get_origin(k) is Literal for c in k.__args__]
            need(
                _fits(kind, saved[f.name]),
                f"--resume {args.resume}: {run_dir / 'config.json'}: {f.name} is {saved[f.name]!r}, not a value of "
                f"--{f.name.replace('_', '-')}" + (f" (one of {', '.join(map(str, choices))})" if choices else ""),
            )
    changeable = ", ".join("--" + f.replace("_", "-") for f in RUNTIME_FLAGS[1:])
    named = given_flags(args_type)  # a flag given at its default value is given too (--lora-rank 0)
    for f in dataclasses.fields(args_type):
        given, default = getattr(args, f.name), getattr(defaults, f.name)
        if f.name not in saved:
            merged[f.name] = given
            continue
        old = tuple(saved[f.name]) if isinstance(default, tuple) and isinstance(saved[f.name], list) else saved[f.name]
        if f.name in RUNTIME_FLAGS:  # given on this command line, or else the run's own
            merged[f.name] = given if f.name in named else old
            if f.name == "model" and saved.get("lora_rank") and merged["model"] != old:
                _same_base(run_dir, old, merged["model"])
            continue
        need(
            f.name not in named or given == old,
            f"--{f.name.replace('_', '-')} {given}: the run in {run_dir} was started "
            f"with {old}; a resumed run keeps its flags (only {changeable} may change)",
        )
        merged[f.name] = old
    step = copies[0][0]
    need(
        step < 0 or merged["total_steps"] > step,
        f"--resume {args.resume}: the run is already at step {step} "
        f"(--total-steps {merged['total_steps']}): give a larger --total-steps to extend it",
    )
    out = dataclasses.replace(args, **merged)
    planted = [] if args.reward_fn else [s for s in out.reward_fn if _in_run(run_dir, s)]  # given again: asked for
    need(
        not planted,
        f"--resume {args.resume}: its config.json names --reward-fn {', '.join(planted)}, inside the run directory: a "
        "resumed run imports no code from its run directory unless this command line names it (give --reward-fn again)",
    )
    then = saved.get("file_hashes", {})
    data_given = "file_hashes" in saved and (out.data_path or out.eval_data_path)  # config.json of an older run: none
    now = {}
    if then or data_given:
        now = runtime.extra("data_tasks", "--resume of a run with data files").file_hashes(out)
    for role in ("--data-path", "--eval-data-path"):  # added or dropped: other rows to train on, or to hold out
        need(
            "file_hashes" not in saved or (role in then) == (role in now),
            f"--resume {args.resume}: the run started with{'' if role in then else 'out'} {role}, and this resume "
            + ("does not find its file (one that moved is given anew)" if role in then else "gives one")
            + ": a resumed run trains and evaluates on the same rows",
        )
    for role in (r for r in then if now.get(r, then[r]) != then[r]):
        warning = f"warning: {role}: the file changed since the run started; the resumed run reads it as it is now"
        print(warning, file=sys.stderr)
    return out


def given_flags(args_type, argv: list[str] | None = None) -> set[str]:
    """The fields this command line names, as tyro reads them (`--flag V`, `--flag=V`, `--flag_name`, `--no-flag`),
    whatever their values: a flag given at its default value is given."""
    names, out = {f.name for f in dataclasses.fields(args_type)}, set()
    for word in sys.argv[1:] if argv is None else argv:
        name = word[2:].split("=", 1)[0].replace("-", "_") if word.startswith("--") else ""
        out |= {n for n in (name, name.removeprefix("no_")) if n in names}
    return out


def _in_run(run_dir: Path, spec: str) -> bool:
    """Whether a --reward-fn PATH.py:NAME names a file inside the run directory."""
    where = spec.rpartition(":")[0]
    path = Path(os.path.expanduser(where)).resolve()
    return where.endswith(".py") and path.is_relative_to(run_dir.resolve())


def _digest(directory: str, name: str) -> str:
    datafiles = runtime.extra("datafiles", "--resume of a LoRA run under another --model path")
    return datafiles.sha256_file(Path(os.path.expanduser(directory)) / name).hexdigest()


def _same_base(run_dir: Path, old: str, new: str) -> None:
    """--lora-rank: the checkpoint holds only the adapters, so a resume under another --model path must load the same
    base weights: config.json and every weight file byte for byte (a copy in another clone); else one line."""

    def files(path: str) -> dict | None:  # name -> size: files of another size differ without being read
        p = Path(os.path.expanduser(path))
        if not p.is_dir():
            return None
        names = ["config.json", *(f.name for f in p.glob("*.safetensors")), *(f.name for f in p.glob("*.bin"))]
        return {n: (p / n).stat().st_size for n in names if (p / n).is_file()}

    a, b = files(old), files(new)
    same = a is not None and a == b
    same = same and all(_digest(old, n) == _digest(new, n) for n in a)
    need(
        same,
        f"--model {new}: not the base the run in {run_dir} trained its LoRA adapters on ({old}"
        + (", not a directory to compare" if a is None else ": other files")
        + "); its checkpoint holds only the adapters",
    )


def recover(ckpt) -> int | None:
    """Make the newest complete copy the checkpoint (a kill during a save can leave it under a hidden name) and
    return its step; None when there is none."""
    found = ckpt.copies()
    if not found:
        return None
    step, best = found[0]
    if best != ckpt.path and ckpt.rank == 0:
        if ckpt.path.exists():
            shutil.rmtree(ckpt.path)
        os.rename(best, ckpt.path)
    return step


def load_into(obj, state) -> None:
    """A script's stateful object (saving.py's _state_of) back from its saved state."""
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif isinstance(obj, random.Random):
        obj.setstate(state)
    else:
        obj.load_state_dict(state)


def restore(ckpt, model, optimizer, batches: CountingBatches, objects: dict | None = None) -> int:
    """Load the checkpoint `ckpt` (a checkpoints.Checkpointer) into the objects the script has built (`objects`: its
    own stateful ones by name, as saved); returns the step it was taken after. A damaged file ends the run with one
    line naming it (exit code 2). Mixed precision: into the fp32 masters (Run.start holds them; bf16 weights: said)."""
    from safetensors.torch import load_file

    run = ckpt.path.parent
    found = recover(ckpt) if ckpt.rank == 0 else None  # rank 0 alone moves a kill's copy into place
    if ckpt.dist is not None:
        ckpt.dist.barrier()
        found = ckpt.dist.broadcast(found)
    if found is None:
        usage_error(
            f"--resume {run}: no complete checkpoint there (runs save one with --save-every N, on Ctrl-C and "
            "on SIGTERM)"
        )
    state = _load(ckpt.path / "trainer.pt", run)
    if state.get("sharded"):  # an FSDP run's: DCP reshards onto this run's ranks (or one process)
        sharded = runtime.extra("sharded", "--resume of an --fsdp run")
        sharded.restore(ckpt.path / "sharded", model, optimizer, run, getattr(ckpt.dist, "mixed", None))
    else:
        files = sorted((ckpt.path / "model").glob("*.safetensors"))
        if not files:
            usage_error(f"--resume {run}: {ckpt.path / 'model'} holds no weights (*.safetensors)")
        weights = {}
        for f in files:
            try:
                weights.update(load_file(str(f)))
            except Exception as e:  # safetensors raises its own error types for a truncated or corrupt file
                usage_error(f"--resume {run}: {f} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        if hasattr(model, "peft_config"):  # --lora-rank: the adapters (the base is --model's)
            problems = runtime.extra("lora", "--lora-rank").load_adapter_state(model, weights)
            if problems:
                usage_error(f"--resume {run}: the checkpoint's adapters do not fit the model ({problems[:3]})")
            optimizer.load_state_dict(state["optimizer"])
        elif ckpt.sharded:  # a DDP or one-process checkpoint into FSDP: each rank keeps its shard of the full state
            runtime.extra("sharded", "--fsdp").restore_full(model, optimizer, weights, state["optimizer"], run)
        else:
            if (mixed := getattr(model, "_rlvr_precision", None)) is not None:  # fp32 masters from bf16 weights: said
                mixed.upcast_note(weights, run)
            missing, unexpected = model.load_state_dict(weights, strict=False)
            missing = [k for k in missing if k not in _tied(model)]
            if missing or unexpected:
                usage_error(
                    f"--resume {run}: the checkpoint does not fit the model (missing {missing[:3]}, unexpected "
                    f"{unexpected[:3]}): was the run started with another --model?"
                )
            optimizer.load_state_dict(state["optimizer"])
    batches.skip_to(state["batches_drawn"])
    for k, v in (objects or {}).items():
        if k not in state["extra"]:
            usage_error(f"--resume {run}: the checkpoint holds no '{k}' state: it was made by another script")
        load_into(v, state["extra"][k])
    own = ckpt.path / f"trainer_rank{ckpt.rank}.pt"
    if ckpt.rank > 0 and not own.is_file():  # more ranks than the run had: a new stream per rank and step
        seed = (torch.initial_seed() + 1_000_003 * int(state["step"])) % 2**32
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        return int(state["step"])
    rng = state if ckpt.rank == 0 else _load(own, run)
    for k, v in rng.get("extra_rng", {}).items():  # this rank's own generator states (older checkpoints: rank 0's)
        if k in (objects or {}):
            load_into(objects[k], v)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if ckpt.rank == 0:
        ckpt.clean_leftovers()
    return int(state["step"])


def damaged(copy: Path) -> str | None:
    """What is wrong with a checkpoint copy, read cheaply before any model loads (safetensors headers, the zip
    directory of trainer.pt), or None."""
    import zipfile

    from safetensors import safe_open

    if (copy / "sharded").is_dir():  # an FSDP run's (DCP): its index is read on load
        weights = [copy / "sharded" / ".metadata"]
    else:
        weights = sorted((copy / "model").glob("*.safetensors"))
    if not weights:
        return f"{copy / 'model'} holds no weights (*.safetensors)"
    for f in [*weights, copy / "trainer.pt"]:
        if f.name == ".metadata":
            if not f.is_file() or f.stat().st_size == 0:
                return f"{f} is missing or empty (an unfinished sharded save)"
            continue
        try:
            if f.suffix == ".safetensors":
                with safe_open(str(f), "pt") as w:
                    w.keys()
            else:
                zipfile.ZipFile(f).close()
        except Exception as e:  # missing, empty, truncated or not the right format
            return f"{f} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else 'empty'})"
    return None


def _load(path: Path, run: Path) -> dict:
    """trainer.pt with torch.load(weights_only=True): tensors, numbers, strings and containers of them, never code (a
    run directory may come from someone else: https://pytorch.org/docs/stable/notes/serialization.html). Older
    checkpoints hold NumPy's random key as an array: NumPy's array types alone are allowed for them. Anything else is
    refused in one line naming the file and what it would have imported."""
    try:
        with _numpy_arrays_allowed():
            state = torch.load(path, weights_only=True, map_location="cpu")  # not every rank onto the saver's GPU
    except Exception as e:  # truncated, empty, not a torch file, or a pickle that names code
        if "Weights only load failed" in str(e):
            names = _unsafe_names(path)
            usage_error(
                f"--resume {run}: {path} is refused: it holds more than tensors, numbers and lists"
                + (f" (loading it would import {', '.join(names[:3])})" if names else "")
                + ", and unpickling a file made or changed elsewhere can run code"
            )
        reason = str(e).splitlines()[0][:200] if str(e) else "empty or truncated"
        usage_error(f"--resume {run}: {path} cannot be read ({type(e).__name__}: {reason})")
    need(isinstance(state, dict), f"--resume {run}: {path} is not a checkpoint (a dict of its state)")
    return state


NUMPY_ARRAYS = (
    "numpy.ndarray",
    "numpy.dtype",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
)


def _numpy_arrays_allowed():
    """Where torch.load(weights_only=True) also takes np.random.get_state()'s uint32 array, as an older trainer.pt holds
    it (now a list of ints); torch < 2.5 has no such context: there they are allowed for the process."""
    rebuild = (getattr(np, "_core", None) or np.core).multiarray._reconstruct
    types = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    if not hasattr(torch.serialization, "safe_globals"):
        torch.serialization.add_safe_globals([rebuild, *types])
        return contextlib.nullcontext()
    return torch.serialization.safe_globals([(rebuild, NUMPY_ARRAYS[2]), (rebuild, NUMPY_ARRAYS[3]), *types])


def _unsafe_names(path: Path) -> list[str]:
    """The globals a pickle names beyond weights_only's own and NumPy's arrays (read, not run)."""
    try:
        return [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(path) if not n.startswith(NUMPY_ARRAYS)]
    except Exception:  # not a zip, truncated, torch < 2.5: nothing to name
        return []


def _tied(model) -> set:
    """Parameter names safetensors leaves out because they share storage with another (tied embeddings)."""
    seen, tied = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape)
        if key in seen:
            tied.add(name)
        seen.setdefault(key, name)
    return tied | {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else tied

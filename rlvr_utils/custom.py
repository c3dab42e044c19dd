"""Your own task, with no edit to the project: rows with a `prompt` (a string, or a list of chat messages) and any
other columns, scored by reward functions written in TRL's convention, so a reward written for TRL's GRPOTrainer
works unchanged:

    def my_reward(prompts, completions, **columns) -> list[float]   # one float per completion

`prompts` are the rows' prompts as given; `completions` are strings for string prompts and
`[{"role": "assistant", "content": text}]` for chat prompts; every other column of the rows comes as a keyword list.
`--reward-fn PATH.py:NAME` (or `package.module:NAME`) names it; several sum, weighted by `--reward-weights`. A
completion counts as a success when its reward reaches `--success-threshold` (SC-GRPO's verified solutions, SRPO's
failed parents, EP-GRPO's outcome polarity, eval/accuracy).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from pathlib import Path
from typing import Callable, Sequence


class RewardFnError(ValueError):
    """A --reward-fn that cannot be loaded or called as TRL's convention says."""


@functools.lru_cache(maxsize=None)  # the user's file runs once, however often it is named
def load_reward_fn(spec: str) -> Callable:
    """`PATH.py:NAME` (a file anywhere) or `package.module:NAME` (importable) -> the function, checked to take
    `prompts` and `completions` as keywords (or **kwargs)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise RewardFnError(f"--reward-fn {spec}: expected PATH.py:NAME or package.module:NAME")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise RewardFnError(f"--reward-fn {spec}: no such file {path}")
            mod_spec = importlib.util.spec_from_file_location(f"_reward_{path.stem}_{abs(hash(str(path)))}", path)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[mod_spec.name] = module  # dataclasses, pickling and relative lookups need it registered
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RewardFnError:
        raise
    except Exception as e:  # a syntax error or an import error in the user's file
        raise RewardFnError(f"--reward-fn {spec}: cannot import {where} ({type(e).__name__}: {e})") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFnError(f"--reward-fn {spec}: {where} has no function {name}")
    params = inspect.signature(fn).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not ({"prompts", "completions"} <= named or any(p.kind == p.VAR_KEYWORD for p in params)):
        raise RewardFnError(
            f"--reward-fn {spec}: {name}{inspect.signature(fn)} takes none of the expected arguments: "
            "def NAME(prompts, completions, **columns) -> list[float] (TRL's convention)"
        )
    return fn


def prompt_problem(row: dict) -> str | None:
    """What is wrong with a custom row's prompt, or None."""
    if "prompt" not in row:
        return f"custom rows need a 'prompt' column; this row has {sorted(row)}"
    if {"prompts", "completions"} & set(row):
        return "the columns 'prompts' and 'completions' are the reward function's own arguments: rename them"
    p = row["prompt"]
    if isinstance(p, str):
        return None if p.strip() else "the prompt is empty"
    ok = isinstance(p, list) and p and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in p)
    return None if ok else "the prompt must be a string or a list of chat messages {'role': ..., 'content': ...}"


def render(tokenizer, prompt) -> tuple[str, str, bool]:
    """(the text the model sees, its user turn, whether it is a chat prompt): a string as it is (TRL's standard
    format), a message list through the tokenizer's chat template with the generation prompt."""
    if isinstance(prompt, str):
        return prompt, prompt, False
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat-message prompts need a tokenizer with a chat template (this --model has none)")
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return (
        tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False),
        users[-1] if users else "",
        True,
    )


def reward_batch(specs: Sequence[str], weights: Sequence[float]) -> Callable:
    """The batch reward of a task: sum_k weight_k * fn_k(prompts=..., completions=..., **columns), each output
    checked (a list of one finite number per completion); a bad output stops the run with one line naming the
    function and the row."""
    fns = [(spec, load_reward_fn(spec)) for spec in specs]
    weights = list(weights) or [1.0] * len(fns)

    def batch(texts: Sequence[str], examples) -> list[float]:
        if not texts:  # nothing to score (SRPO's step without continuations): the functions are not called
            return []
        prompts = [e.meta.get("prompt", e.prompt) for e in examples]
        completions = [
            [{"role": "assistant", "content": t}] if e.meta.get("chat") else t for t, e in zip(texts, examples)
        ]
        keys = dict.fromkeys(k for e in examples for k in _columns(e))
        columns = {k: [_columns(e).get(k) for e in examples] for k in keys}
        total, scored = [0.0] * len(texts), [False] * len(texts)
        for (spec, fn), w in zip(fns, weights):
            params = inspect.signature(fn).parameters.values()
            kw = (
                columns
                if any(p.kind == p.VAR_KEYWORD for p in params)
                else {k: v for k, v in columns.items() if k in {p.name for p in params}}
            )
            try:
                out = fn(prompts=prompts, completions=completions, **kw)
            except Exception as e:
                _stop(f"--reward-fn {spec} raised {type(e).__name__}: {e}")
            out = out.tolist() if hasattr(out, "tolist") else out  # numpy arrays, torch tensors
            out = list(out) if out is not None and not isinstance(out, (str, bytes, dict)) else out
            if not isinstance(out, list) or len(out) != len(texts):
                got = f"{len(out)} values" if isinstance(out, list) else repr(out)[:80]
                _stop(f"--reward-fn {spec} returned {got} for {len(texts)} completions (one float each)")
            for i, v in enumerate(out):
                if v is None:  # TRL's "this function does not apply to this row"
                    continue
                if not (isinstance(v, numbers.Real) and math.isfinite(float(v))):
                    _stop(
                        f"--reward-fn {spec} returned {v!r} for row {i} of the batch (prompt id {examples[i].id}): "
                        "a reward must be a finite number (or None: not this function's row)"
                    )
                total[i], scored[i] = total[i] + w * float(v), True
        if not all(scored):
            i = scored.index(False)
            _stop(f"every --reward-fn returned None for row {i} of the batch (prompt id {examples[i].id}): no reward")
        return total

    return batch


def _columns(e) -> dict:
    """The columns a reward function gets besides prompts and completions: a custom row's own, or a built-in
    task's question and gold answer."""
    return e.meta["columns"] if "columns" in e.meta else {"question": e.question, "answer": e.gold}


def _stop(message: str):
    print(f"\nerror: {message}", file=sys.stderr, flush=True)  # a new line: a progress bar may be mid-line
    raise SystemExit(1)

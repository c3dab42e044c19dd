"""Your own task, with no edit to the project: rows with a `prompt` (a string, or a list of chat messages) and any
other columns, scored by reward functions written in TRL's convention, so a reward written for TRL's GRPOTrainer
works unchanged:

    def my_reward(prompts, completions, completion_ids, trainer_state, **columns) -> list[float | None]

`prompts` are the rows' prompts as given; `completions` are strings for string prompts and
`[{"role": "assistant", "content": text}]` for chat prompts; `completion_ids`, `trainer_state`, `log_extra`,
`log_metric` and every other column of the rows come as keywords, `async def` is awaited, None is "not this function's
row" (reward_calls.py: the whole contract). `--reward-fn PATH.py:NAME` (or `package.module:NAME`) names it; several
sum, weighted by `--reward-weights`. A completion counts as a success when its reward reaches `--success-threshold`
(SC-GRPO's verified solutions, SRPO's failed parents, EP-GRPO's outcome polarity, eval/accuracy). A reward model is
not a function: `RewardModel` wraps one (a sequence-classification model scoring prompt + completion, as TRL does).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from rlvr_utils.extras.reward_fns import reward_calls
from rlvr_utils.extras.reward_fns.reward_isolation import from_signal, text


class RewardFnError(ValueError):
    """A --reward-fn that cannot be loaded or called as TRL's convention says."""


@functools.lru_cache(maxsize=None)  # the user's file runs once, however often it is named
def load_reward_fn(spec: str) -> Callable:
    """`PATH.py:NAME` (a file anywhere) or `package.module:NAME` (importable) -> the function, checked to take
    `prompts` and `completions` as keywords (or **kwargs)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        model = Path(os.path.expanduser(spec)).is_dir() or (spec.count("/") == 1 and not spec.endswith(".py"))
        raise RewardFnError(
            f"--reward-fn {spec}: a reward model is not a function: wrap it with "
            "rlvr_utils.extras.reward_fns.custom.RewardModel in a file and name that (docs/tasks.md: Reward models)"
            if model
            else f"--reward-fn {spec}: expected PATH.py:NAME or package.module:NAME"
        )
    cwd = _cwd()
    try:
        if where.endswith(".py"):
            path = Path(os.path.expanduser(where))
            if not path.is_file():
                odd = f"{path} is not a regular file (a directory, a FIFO or a device)"
                raise RewardFnError(f"--reward-fn {spec}: {odd if path.exists() else f'no such file {path}'}")
            mod_spec = importlib.util.spec_from_file_location(f"_reward_{path.stem}_{abs(hash(str(path)))}", path)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[mod_spec.name] = module  # dataclasses, pickling and relative lookups need it registered
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except BaseException as e:  # a syntax error, an import error, sys.exit, pytest.skip, ... in the user's file
        _unless_ours(e)
        if isinstance(e, SystemExit):  # sys.exit() at import: the user's module must not end the run
            raise RewardFnError(f"--reward-fn {spec}: importing {where} called sys.exit({text(e.code)})") from None
        first = (text(e, str).strip().splitlines() or [""])[0]
        why = f"{type(e).__name__}: {first}" if first else type(e).__name__
        raise RewardFnError(f"--reward-fn {spec}: cannot import {where} ({why})") from None
    finally:
        _back_to(cwd, spec)
    expected = "def NAME(prompts, completions, **columns) -> list[float] (TRL's convention)"
    try:  # the module's __getattr__, the callable's __signature__: the user's code
        fn = getattr(module, name, None)
        signature = inspect.signature(fn) if callable(fn) else None
    except BaseException as e:  # a builtin (dict, max) or a partial of one: no signature to check
        _unless_ours(e)
        raise RewardFnError(
            f"--reward-fn {spec}: {name} has no signature to read ({type(e).__name__}): {expected}"
        ) from None
    if signature is None:
        raise RewardFnError(f"--reward-fn {spec}: {where} has no function {name}")
    params = signature.parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not ({"prompts", "completions"} <= named or any(p.kind == p.VAR_KEYWORD for p in params)):
        raise RewardFnError(f"--reward-fn {spec}: {name}{text(signature, str)} takes none of the expected arguments: "
                            f"{expected}")  # fmt: skip
    return fn


def _unless_ours(e: BaseException) -> None:
    """Re-raise the run's own stop (a signal while the user's code ran, or a RewardFnError); anything else is the
    user's code failing, for one line."""
    if isinstance(e, RewardFnError) or isinstance(e, reward_calls.StopNow) and from_signal(e):
        raise e


def _cwd() -> str | None:
    with contextlib.suppress(OSError):  # a working directory removed under the process
        return os.getcwd()
    return None


def _back_to(cwd: str | None, spec: str) -> None:
    """The working directory the run started in, if importing the user's module changed it (the run's relative paths,
    checked after the import, are the user's)."""
    if cwd is not None and _cwd() != cwd:
        with contextlib.suppress(OSError):
            os.chdir(cwd)
            print(f"warning: --reward-fn {spec}: importing it changed the working directory; the run goes on in "
                  f"{cwd}", file=sys.stderr)  # fmt: skip


def prompt_problem(row: dict) -> str | None:
    """What is wrong with a custom row's prompt, or None."""
    if "prompt" not in row:
        return f"custom rows need a 'prompt' column; this row has {sorted(row)}"
    taken = {"prompts", "completions", *reward_calls.RESERVED} & set(row)
    if taken:
        return f"the column(s) {sorted(taken)} are the reward function's own arguments (TRL's): rename them"
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


def reward_batch(
    specs: Sequence[str], weights: Sequence[float], tokenizer=None, timeout: float = 0.0, success_threshold: float = 1.0
) -> reward_calls.RewardFunctions:
    """The batch reward of a task: sum_k weight_k * fn_k(prompts=..., completions=..., completion_ids=...,
    trainer_state=..., log_extra=..., log_metric=..., **columns), called as TRL does (reward_calls.py); a bad output
    stops the run with one line naming the function and the row's file line."""
    fns = [(spec, load_reward_fn(spec)) for spec in specs]
    return reward_calls.RewardFunctions(fns, weights, tokenizer, timeout, success_threshold)


class RewardModel:
    """A sequence-classification reward model as a reward function, scored as TRL scores one it is given: the prompt
    and the completion as one text (chat prompts through the reward tokenizer's chat template), right-padded, and
    logit 0 as the reward. In a file of yours, `score = RewardModel("OpenAssistant/reward-model-deberta-v3-large-v2")`,
    then `--reward-fn that_file.py:score`. `device` (default: cuda when available), `batch_size` texts per forward."""

    def __init__(self, name_or_path: str, device: str | None = None, batch_size: int = 16, dtype=None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        rank = int(os.environ.get("LOCAL_RANK", "0"))  # torchrun: each rank's own GPU (loaded before set_device)
        self.device = device or (f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(name_or_path, num_labels=1, dtype=dtype)
        self.model.to(self.device).eval()
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.__name__ = batch_size, Path(name_or_path.rstrip("/")).name

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        import torch

        if isinstance(prompts[0], list):  # chat: the messages and the reply through the chat template
            texts = [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        out = []
        for s in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[s : s + self.batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(self.model.device)
            with torch.inference_mode():
                out += self.model(**enc).logits[:, 0].float().cpu().tolist()
        return out

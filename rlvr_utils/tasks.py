"""Tasks: the prompts an RL run trains and evaluates on, and their reward functions.

`load_task(name, tokenizer, ...)` builds a `Task` (train and eval `Example`s and a reward function) with one small
builder per task: `arith` (built in, arith.py), `gsm8k` and `math` (rewards.py), `code` (sandbox.py), and `custom`
(custom.py: the user's rows and reward functions). Real datasets: the hub dataset through `datasets.load_dataset` by
default, or a local file or directory with `data_path`, read as written (datafiles.py: JSON rows keep their JSON types;
csv/tsv/parquet/arrow through `datasets`); custom: a file, a directory or a hub id. The optional parts (arith, the code
sandbox) are imported only when a run uses them.
Rows whose gold answer cannot be parsed (code: without tests or entry point) and prompts longer than
`max_prompt_length` are skipped and counted in `Task.skipped`, never rewarded.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable, Sequence

from rlvr_utils import custom, datafiles, reward_calls, rewards

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
HUB_DATASETS = {
    "gsm8k": ("openai/gsm8k", "main", "train", "test"),
    "math": ("HuggingFaceH4/MATH-500", None, "test", None),
    "code": ("openai/openai_humaneval", None, "test", None),
}
TASKS = ("arith", "gsm8k", "math", "code", "custom")


@dataclasses.dataclass
class Example:
    """One prompt of a task. `id` keys its group of completions (never its position in a batch)."""

    id: int
    question: str  # the raw problem text
    gold: str  # the gold answer the reward compares with
    prompt: str  # the rendered prompt (chat template applied when the tokenizer has one)
    prompt_ids: list[int]
    user: str = ""  # the user turn a chat model sees (SC-GRPO's teacher keeps it and adds the reference)
    meta: dict = dataclasses.field(default_factory=dict)  # code: prompt_code, tests, setup, entry_point


@dataclasses.dataclass
class Task:
    name: str
    train: list[Example]
    eval: list[Example]
    reward_fn: Callable[[str, Example], float]  # (completion text, example) -> reward in [0, 1]
    skipped: dict  # why examples were dropped at load time -> count (never rewarded)
    batch_reward_fn: Callable[[Sequence[str], Sequence[Example]], list[float]] | None = None

    def rewards(self, texts: Sequence[str], examples: Sequence[Example], completion_ids=None, mode="train") -> list:
        """Rewards of completions against their examples (code: verified in parallel sandboxes). --reward-fn functions
        (custom.py) also get `completion_ids` (each completion's sampled token ids; default: its text re-encoded) and
        log what they score under `mode` ("train", or "eval" for an evaluation)."""
        if len(texts) != len(examples):
            raise ValueError(f"{len(texts)} completions for {len(examples)} examples")
        if isinstance(self.batch_reward_fn, reward_calls.RewardFunctions):
            return self.batch_reward_fn(texts, examples, completion_ids, mode)
        if self.batch_reward_fn is not None:
            return self.batch_reward_fn(texts, examples)
        return [self.reward_fn(t, e) for t, e in zip(texts, examples)]

    def begin(self, run_dir, rank: int, steps_done: int, args) -> None:
        """The run, for --reward-fn functions: their trainer_state (args.total_steps, args.prompts_per_step), where
        log_extra writes, and the steps already done."""
        if isinstance(self.batch_reward_fn, reward_calls.RewardFunctions):
            fns, n = self.batch_reward_fn, len(self.train)
            fns.begin(run_dir, rank, steps_done, args.total_steps, args.prompts_per_step, n)

    def reward_metrics(self, step: int | None = None, mode: str = "train") -> dict:
        """What --reward-fn functions logged since the last call (TRL's names: rewards/<name>/mean and /std, their
        log_metric names; under eval/ for an evaluation); after a training step (`step`), their trainer_state moves
        on. {} for a built-in reward."""
        if isinstance(self.batch_reward_fn, reward_calls.RewardFunctions):
            return self.batch_reward_fn.metrics(step, mode)
        return {}


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, user: str, plain: str, system: str | None = None) -> str:
    """The chat template (system + user turn, generation prompt) when the tokenizer has one,
    else the `plain` text (which the bundled tiny model was trained on)."""
    if not has_chat_template(tokenizer):
        return plain
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered prompt (a chat template already holds its special tokens)."""
    return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer)).input_ids


def _load_rows(task: str, data_path: str | None, split_kind: str) -> tuple[list[dict], list[str]]:
    """Rows of a local data file or directory (`data_path`, read as written: datafiles.py) or of the task's hub
    dataset, and where each row came from (`file:line`, `dataset[split] row N`)."""
    if data_path and task == "custom" and not Path(data_path).exists():  # a hub dataset id
        name, config, split = data_path, None, "train" if split_kind == "train" else "test"
    elif data_path:
        return datafiles.read_rows(data_path)
    else:
        name, config, train_split, eval_split = HUB_DATASETS[task]
        split = train_split if split_kind == "train" else eval_split
    from datasets import load_dataset

    rows = list(load_dataset(name, config, split=split))
    return rows, [f"{name}[{split}] row {i}" for i in range(1, len(rows) + 1)]


def row_problem(task: str, row: dict) -> str | None:
    """What is wrong with a data row for `task` (a missing field, named), or None. Checked for every row of a
    local file before anything loads (cli.py), and again while building the task (hub datasets)."""
    if task == "gsm8k":
        need = [f for f in ("question", "answer") if f not in row]
    elif task == "math":
        need = [f for f in ("problem",) if f not in row] + (
            [] if "answer" in row or "solution" in row else ["answer (or solution)"]
        )
    elif task == "code" and "test_list" in row:  # MBPP-like
        need = [] if "text" in row or "prompt" in row else ["text (or prompt)"]
    elif task == "code":  # HumanEval-like
        need = [f for f in ("prompt", "test", "entry_point") if f not in row]
    else:
        return None
    return f"{task} rows need the field(s) {need}; this row has {sorted(row)}" if need else None


def _require(row: dict, where: str, task: str) -> None:
    problem = row_problem(task, row)
    if problem:
        raise KeyError(f"{where}: {problem}")


class _Builder:
    """What every task builder shares: rendering and length-checking prompts, skip counts, train/eval splits."""

    def __init__(self, name, tokenizer, num_eval, data_path, eval_data_path, max_prompt_length):
        self.name, self.tokenizer, self.num_eval = name, tokenizer, num_eval
        self.data_path, self.eval_data_path, self.max_prompt_length = data_path, eval_data_path, max_prompt_length
        self.skipped = {"unparsable_gold": 0, "prompt_too_long": 0}

    def example(
        self, i: int, question: str, gold: str, user: str, plain: str, meta: dict | None = None
    ) -> Example | None:
        """An Example with its rendered, encoded prompt; None (counted) when the prompt is too long."""
        prompt = render_prompt(self.tokenizer, user, plain)
        ids = encode_prompt(self.tokenizer, prompt)
        if len(ids) > self.max_prompt_length:
            self.skipped["prompt_too_long"] += 1
            return None
        return Example(i, question, gold, prompt, ids, user, meta or {})

    def from_rows(self, convert) -> tuple[list[Example], list[Example]]:
        """Train and eval examples of the hub dataset or local files, `convert(rows, wheres, id_offset)` row by row.
        Eval: `eval_data_path`, else the hub's eval split, else the first `num_eval` rows of the one file (at most a
        fifth of a file smaller than 2 * num_eval)."""
        rows, wheres = _load_rows(self.name, self.data_path, "train")
        if self.eval_data_path or (not self.data_path and HUB_DATASETS.get(self.name, (0, 0, 0, None))[3]):
            eval_rows, eval_wheres = _load_rows(self.name, self.eval_data_path, "eval")
            return convert(rows, wheres, 0), convert(eval_rows, eval_wheres, 10**9)[: self.num_eval]
        k = self.num_eval if len(rows) >= 2 * self.num_eval else len(rows) // 5
        return convert(rows[k:], wheres[k:], 0), convert(rows[:k], wheres[:k], 10**9)


def _arith_task(b: _Builder, seed: int, steps: int, max_value: int, max_operand: int, num_train: int):
    from rlvr_utils import arith

    train, evals = arith.arith_problems(seed, num_train, b.num_eval, steps, max_value, max_operand)

    def build(problems, offset):
        return [
            b.example(offset + i, p.text, str(p.answer), arith.ARITH_INSTRUCTION + p.text, arith.arith_prompt(p))
            for i, p in enumerate(problems)
        ]

    return build(train, 0), build(evals, 10**9), lambda completion, ex: arith.arith_reward(completion, ex.gold), None


def _text_task(b: _Builder):
    """gsm8k (question, answer with `#### N`) or math (problem, answer or solution with \\boxed{})."""

    def convert(rows, wheres, offset):
        out = []
        for i, (row, where) in enumerate(zip(rows, wheres)):
            _require(row, where, b.name)
            if b.name == "gsm8k":
                q, gold = row["question"], rewards.gsm8k_gold(str(row["answer"]))
                ok = gold is not None
            else:
                q = row["problem"]
                gold = str(row["answer"]) if "answer" in row else rewards.last_boxed(str(row["solution"]))
                ok = gold is not None and bool(rewards.parse_math_gold(gold))
            if not ok:
                b.skipped["unparsable_gold"] += 1
                continue
            ex = b.example(
                offset + i, q, gold, f"{q}\n{MATH_INSTRUCTION}", f"Question: {q}\n{MATH_INSTRUCTION}\nAnswer:"
            )
            if ex is not None:
                out.append(ex)
        return out

    reward = rewards.gsm8k_reward if b.name == "gsm8k" else rewards.math_reward
    return *b.from_rows(convert), lambda completion, ex: reward(completion, ex.gold), None


def _code_task(b: _Builder, timeout: float):
    """HumanEval's format (prompt, test, entry_point) or an MBPP-like one (text or prompt, test_list, optional
    test_setup_code); reward = fraction of tests passed in the sandbox."""
    b.skipped["no_tests_or_entry_point"] = 0
    from rlvr_utils import sandbox

    def convert(rows, wheres, offset):
        out = []
        for i, (row, where) in enumerate(zip(rows, wheres)):
            _require(row, where, b.name)
            if "test_list" in row:  # MBPP-like: the model writes the whole function
                text = row.get("text", row.get("prompt"))
                tests = [str(t) for t in row["test_list"] or []]
                m = (
                    re.search(r"assert\s+(?:not\s+)?\(?\s*(?:set\()?\s*([A-Za-z_]\w*)\s*\(", tests[0])
                    if tests
                    else None
                )
                entry = row.get("entry_point") or (m.group(1) if m else None)
                shown = "\n".join(tests)
                user = (
                    f"{text}\nYour code should pass these tests:\n{shown}\n"
                    "Reply with the code in one ```python code block."
                )
                plain = f'"""\n{text}\n{shown}\n"""\n'
                meta = dict(prompt_code="", tests=tests, setup=str(row.get("test_setup_code") or ""), entry_point=entry)
                gold, q = str(row.get("code", "")), text
            else:
                q, entry = row["prompt"], row["entry_point"]
                user, plain = f"{sandbox.CODE_INSTRUCTION}\n```python\n{q}```", q
                meta = dict(prompt_code=q, tests=str(row["test"]), setup="", entry_point=entry)
                gold = str(row.get("canonical_solution", ""))
            if not meta["tests"] or not entry:
                b.skipped["no_tests_or_entry_point"] += 1
                continue
            ex = b.example(offset + i, q, gold, user, plain, meta)
            if ex is not None:
                out.append(ex)
        return out

    def code_batch(texts, examples):
        programs = [
            sandbox.code_program(e.meta["prompt_code"], t, e.meta["entry_point"]) for t, e in zip(texts, examples)
        ]
        return sandbox.code_rewards(
            programs,
            [e.meta["tests"] for e in examples],
            [e.meta["entry_point"] for e in examples],
            timeout,
            setups=[e.meta["setup"] for e in examples],
        )

    return *b.from_rows(convert), lambda completion, ex: code_batch([completion], [ex])[0], code_batch


def _custom_task(b: _Builder):
    """The user's rows (custom.py): `prompt` a string or chat messages, every other column for the reward."""

    def convert(rows, wheres, offset):
        out = []
        for i, (row, where) in enumerate(zip(rows, wheres)):
            problem = custom.prompt_problem(row)
            if problem:
                raise KeyError(f"{where}: {problem}")
            text, user, chat = custom.render(b.tokenizer, row["prompt"])
            ids = encode_prompt(b.tokenizer, text)
            if len(ids) > b.max_prompt_length:
                b.skipped["prompt_too_long"] += 1
                continue
            columns = {k: v for k, v in row.items() if k != "prompt"}
            meta = {"prompt": row["prompt"], "chat": chat, "columns": columns, "where": where}
            out.append(Example(offset + i, user, "", text, ids, user if chat else "", meta))
        return out

    return *b.from_rows(convert), None, None


def load_task(
    name: str,
    tokenizer,
    seed: int = 0,
    num_eval: int = 200,
    data_path: str | None = None,
    eval_data_path: str | None = None,
    max_prompt_length: int = 1024,
    arith_steps: int = 4,
    arith_max_value: int = 99,
    arith_max_operand: int = 9,
    arith_num_train: int = 20000,
    code_timeout: float = 5.0,
    reward_fn: Sequence[str] = (),
    reward_weights: Sequence[float] = (),
    reward_timeout: float = 0.0,
    success_threshold: float = 1.0,
) -> Task:
    """Build a task's train and eval prompts and its reward function (see the module docstring).

    arith: seeded synthetic problems (train and eval disjoint); gsm8k/math: the hub dataset or a local file via
    `data_path` (eval from `eval_data_path`, else held out from the same source); code: HumanEval or a local
    jsonl/jsonl.gz in HumanEval's or an MBPP-like format, each program run in a sandbox for `code_timeout` seconds;
    custom: `data_path` rows scored by `reward_fn` (custom.py). `reward_fn` given with a built-in task replaces its
    reward (the functions then get the columns `question` and `answer`, the gold); `reward_timeout`: seconds a call
    of one may take (0: no limit); `success_threshold`: what their first evaluation is checked against.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASKS)}")
    if not code_timeout > 0:
        raise ValueError(f"--code-timeout must be a positive number of seconds, got {code_timeout}")
    b = _Builder(name, tokenizer, num_eval, data_path, eval_data_path, max_prompt_length)
    if name == "arith":
        train, evals, reward, batch_fn = _arith_task(
            b, seed, arith_steps, arith_max_value, arith_max_operand, arith_num_train
        )
    elif name == "code":
        train, evals, reward, batch_fn = _code_task(b, code_timeout)
    elif name == "custom":
        train, evals, reward, batch_fn = _custom_task(b)
    else:
        train, evals, reward, batch_fn = _text_task(b)
    if reward_fn:  # the user's reward functions, in TRL's convention
        batch_fn = custom.reward_batch(reward_fn, reward_weights, tokenizer, reward_timeout, success_threshold)
    train, evals = [e for e in train if e is not None], [e for e in evals if e is not None]
    if not train:
        raise ValueError(f"task {name!r} has no usable training prompts (skipped: {b.skipped})")
    if not evals:
        raise ValueError(f"task {name!r} has no usable eval prompts (skipped: {b.skipped})")
    return Task(name, train, evals, reward, b.skipped, batch_fn)

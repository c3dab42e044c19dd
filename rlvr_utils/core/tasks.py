"""Tasks: the prompts an RL run trains and evaluates on, their rewards, and the built-in one.

`load_task(name, tokenizer, ...)` builds a `Task` (train and eval `Example`s and a reward function). The built-in task
`arith` lives here whole (below); `gsm8k`, `math`, `code` and `custom` read data (hub datasets through
`datasets.load_dataset`, or local files) and are built by the extra data_tasks.py, loaded when one is asked for.
Rows whose gold answer cannot be parsed (code: without tests or entry point) and prompts longer than
`max_prompt_length` are skipped and counted in `Task.skipped`, never rewarded.

The built-in task `arith`: seeded multi-step arithmetic written one step per line, with an exact verifier and an exact
first-wrong-step oracle (the ground truth for SRPO's oracle resets and for measuring self-localization). A problem is a
start value and a list of (+|-, operand) operations, written "23+7-5+9". Its solution is one line per operation, then
the answer line:
    23+7=30
    30-5=25
    25+9=34
    #### 34
Running values stay in [0, max_value]: an operation that would leave the range flips its sign. `--arith-variant rising`
draws the problems otherwise (the extra arith_variants.py); the prompt, solution format, verifier and oracle stay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import re
import weakref
from typing import Callable, Sequence

from rlvr_utils.core import runtime

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
    reward_fn: Callable[[str, Example], float] | None  # (completion text, example) -> reward in [0, 1]
    skipped: dict  # why examples were dropped at load time -> count (never rewarded)
    batch_reward_fn: Callable[[Sequence[str], Sequence[Example]], list[float]] | None = None
    user_rewards: object | None = None  # --reward-fn: reward_calls.RewardFunctions (TRL's convention), else None

    def rewards(self, texts: Sequence[str], examples: Sequence[Example], completion_ids=None, mode="train") -> list:
        """Rewards of completions against their examples (code: verified in parallel sandboxes). --reward-fn functions
        (custom.py) also get `completion_ids` (each completion's sampled token ids; default: its text re-encoded) and
        log what they score under `mode` ("train", or "eval" for an evaluation)."""
        if len(texts) != len(examples):
            raise ValueError(f"{len(texts)} completions for {len(examples)} examples")
        if self.user_rewards is not None:
            return self.user_rewards(texts, examples, completion_ids, mode)
        if self.batch_reward_fn is not None:
            return self.batch_reward_fn(texts, examples)
        return [self.reward_fn(t, e) for t, e in zip(texts, examples)]

    def begin(self, run_dir, rank: int, steps_done: int, args) -> None:
        """The run, for --reward-fn functions: their trainer_state (args.total_steps, args.prompts_per_step; its batch
        size counts this rank's completions, as TRL's), where log_extra writes, and the steps already done."""
        if self.user_rewards is not None:
            n, world = len(self.train), runtime.world_size()
            per_rank = args.prompts_per_step // world * args.num_generations
            self.user_rewards.begin(run_dir, rank, steps_done, args.total_steps, args.prompts_per_step, n, per_rank)

    def with_reward_metrics(self, metrics: dict, step: int | None = None, mode: str = "train", rows=None) -> dict:
        """`metrics` and what --reward-fn functions logged since the last call (TRL's names: rewards/<name>/mean and
        /std over the completions trained on, `rows` (Rollouts, their rewards); their log_metric names; under eval/;
        a name of the run's own keeps the run's value, the function's goes under log_metric/); after a training step
        (`step`), their trainer_state moves on. A built-in reward: `metrics` as they are."""
        if self.user_rewards is None:
            return metrics
        return self.user_rewards.merged_into(metrics, step, mode, rows)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, user: str, plain: str, system: str | None = None) -> str:
    """The chat template (system + user turn, generation prompt) when the tokenizer has one,
    else the `plain` text (which the bundled tiny model was trained on)."""
    if not has_chat_template(tokenizer):
        return plain
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompt(tokenizer, text: str, limit: int | None = None) -> list[int] | None:
    """Token ids of a rendered prompt (a chat template already holds its special tokens). With `limit`: None for a
    prompt that surely has more tokens, told from its length before it is tokenized (more characters than 4 x limit of
    the tokenizer's longest tokens: a 30 MB line is skipped at once, not tokenized for minutes)."""
    if limit is not None and len(text) > 4 * limit * _longest_token(tokenizer):
        return None
    return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer)).input_ids


def _longest_token(tokenizer) -> float:
    """The tokenizer's longest token, in characters (inf without a vocabulary to read: no early skip)."""
    try:
        return _LONGEST[tokenizer]
    except (KeyError, TypeError):  # not seen yet, or not weakly referable (then computed each time)
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        longest = max(map(len, vocab), default=0) or float("inf")
        with contextlib.suppress(TypeError):
            _LONGEST[tokenizer] = longest
        return longest


_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its longest token


# ----------------------------------------------------------------------------------------------
# answers: numbers and \boxed{} (the arith reward's; data_tasks' GSM8K and MATH rewards use them too)
# ----------------------------------------------------------------------------------------------
NUMBER_RE = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def normalize_number(s: str) -> str | None:
    """'$1,234.00' -> '1234'; '-3.50' -> '-3.5'; '.5' -> '0.5'; None when not a number."""
    s = s.strip().replace(",", "").replace("$", "").replace(" ", "")
    s = s.rstrip(".")  # a sentence's full stop: "is 72."
    if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
        return None
    neg = s.startswith("-")
    s = s.lstrip("-")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    s = s.lstrip("0") or "0"
    if s.startswith("."):
        s = "0" + s
    return ("-" + s) if neg and s != "0" else s


def extract_hash_answer(text: str) -> str | None:
    """The normalized number after the last `####` in `text`, or None."""
    hits = re.findall(r"####\s*([^\n]*)", text)
    for h in reversed(hits):
        m = NUMBER_RE.search(h)
        if m:
            return normalize_number(m.group(0))
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (brace-balanced) or `\\boxed x`, or None."""
    idx = text.rfind("\\boxed")
    if idx < 0:
        return None
    i = idx + len("\\boxed")
    if i < len(text) and text[i] == " ":
        m = re.match(r" ([^\s$]+)", text[i:])
        return m.group(1) if m else None
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None  # unbalanced


# ----------------------------------------------------------------------------------------------
# the built-in task: arith
# ----------------------------------------------------------------------------------------------
ARITH_STEP_RE = re.compile(r"^\s*(-?\d+)\s*([+-])\s*(\d+)\s*=\s*(-?\d+)\s*$")
ANSWER_LINE_RE = re.compile(r"^\s*####\s*(.*?)\s*$")


@dataclasses.dataclass(frozen=True)
class ArithProblem:
    start: int
    ops: tuple[tuple[str, int], ...]  # ((op, operand), ...), op in {"+", "-"}

    @property
    def text(self) -> str:
        return str(self.start) + "".join(f"{op}{b}" for op, b in self.ops)

    def values(self) -> list[int]:
        """Running values after each operation (len == number of steps)."""
        out, v = [], self.start
        for op, b in self.ops:
            v = v + b if op == "+" else v - b
            out.append(v)
        return out

    @property
    def answer(self) -> int:
        return self.values()[-1]

    def solution(self) -> str:
        """The reference step-by-step solution (no trailing newline)."""
        lines, v = [], self.start
        for (op, b), nv in zip(self.ops, self.values()):
            lines.append(f"{v}{op}{b}={nv}")
            v = nv
        lines.append(f"#### {v}")
        return "\n".join(lines)


def make_arith_problem(rng: random.Random, steps: int = 4, max_value: int = 99, max_operand: int = 9) -> ArithProblem:
    """Draw one problem: start in [0, max_value], `steps` operations with operands in [1, max_operand]."""
    if steps < 1 or max_operand < 1 or max_value < max_operand:
        raise ValueError(f"bad arith settings: steps={steps}, max_value={max_value}, max_operand={max_operand}")
    v = rng.randint(0, max_value)
    start, ops = v, []
    for _ in range(steps):
        b = rng.randint(1, max_operand)
        op = rng.choice("+-")
        if op == "+" and v + b > max_value:
            op = "-"
        elif op == "-" and v - b < 0:
            op = "+"
        v = v + b if op == "+" else v - b
        ops.append((op, b))
    return ArithProblem(start, tuple(ops))


ARITH_VARIANTS = ("default", "rising")  # --arith-variant: make_arith_problem's draws, or arith_variants.<name>


def parse_arith_problem(text: str) -> ArithProblem:
    """Inverse of `ArithProblem.text`: "23+7-5+9" -> ArithProblem(23, (("+",7), ("-",5), ("+",9)))."""
    m = re.fullmatch(r"\s*(\d+)((?:\s*[+-]\s*\d+)+)\s*", text)
    if not m:
        raise ValueError(f"not an arith problem: {text!r}")
    ops = tuple((op, int(b)) for op, b in re.findall(r"([+-])\s*(\d+)", m.group(2)))
    return ArithProblem(int(m.group(1)), ops)


def arith_prompt(problem: ArithProblem) -> str:
    """Plain-text prompt the bundled tiny model was trained with."""
    return f"Solve: {problem.text}\n"


def arith_first_error(problem: ArithProblem | str, completion: str) -> int | None:
    """Ground-truth first wrong step of a completion, 1-based over its non-empty lines.

    Line i (i <= number of operations) must be the i-th step `a<op>b=c` with a the correct running
    value, the problem's i-th operation and c = a<op>b; line steps+1 must be `#### <answer>`.
    Returns the index of the first line that breaks this, or None when every line is right.
    A completion that stops early (all its lines right, some missing) returns the index of the
    first missing line (one past its last line): resetting there keeps every correct line.
    Lines after the answer line are ignored (they do not change what was computed).
    """
    if isinstance(problem, str):
        problem = parse_arith_problem(problem)
    lines = [ln for ln in completion.split("\n") if ln.strip()]
    v = problem.start
    for i, ((op, b), nv) in enumerate(zip(problem.ops, problem.values()), 1):
        if i > len(lines):
            return i
        m = ARITH_STEP_RE.match(lines[i - 1])
        if not m or int(m.group(1)) != v or m.group(2) != op or int(m.group(3)) != b or int(m.group(4)) != nv:
            return i
        v = nv
    i = len(problem.ops) + 1
    if i > len(lines):
        return i
    m = ANSWER_LINE_RE.match(lines[i - 1])
    if not m or normalize_number(m.group(1)) != str(problem.answer):
        return i
    return None


def arith_reward(completion: str, gold: str) -> float:
    """1.0 when the completion's final answer (last `#### N`) equals the gold integer, else 0.0."""
    pred = extract_hash_answer(completion)
    return 1.0 if pred is not None and pred == normalize_number(gold) else 0.0


ARITH_INSTRUCTION = (
    "Compute the expression step by step, one operation per line (for example 17+5=22), "
    "then give the final answer on its own line as '#### <number>'.\n"
)


def arith_problems(
    seed: int, num_train: int, num_eval: int, steps: int = 4, max_value: int = 99, max_operand: int = 9,
    variant: str = "default",
) -> tuple[list[ArithProblem], list[ArithProblem]]:  # fmt: skip
    """Seeded train and eval problems, disjoint: eval problems (distinct) come from their own stream, and train
    draws that equal an eval problem are dropped. `variant`: the generator, one of ARITH_VARIANTS."""
    rng, eval_rng = random.Random(seed), random.Random(10_000_019 + seed)
    kw = dict(steps=steps, max_value=max_value, max_operand=max_operand)
    make = make_arith_problem
    if variant != "default":  # another way to draw them (--arith-variant; arith_variants.py)
        draw = getattr(runtime.extra("arith_variants", f"--arith-variant {variant}"), variant)
        make = lambda r, **k: ArithProblem(*draw(r, **k))  # noqa: E731
    evals = list({p.text: p for p in (make(eval_rng, **kw) for _ in range(num_eval))}.values())
    held = {p.text for p in evals}
    train = [p for p in (make(rng, **kw) for _ in range(num_train)) if p.text not in held]
    return train, evals


# ----------------------------------------------------------------------------------------------
# building a task
# ----------------------------------------------------------------------------------------------
class TaskBuilder:
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
        ids = encode_prompt(self.tokenizer, prompt, self.max_prompt_length)
        if ids is None or len(ids) > self.max_prompt_length:
            self.skipped["prompt_too_long"] += 1
            return None
        return Example(i, question, gold, prompt, ids, user, meta or {})


def _arith_task(b: TaskBuilder, seed: int, steps: int, max_value: int, max_operand: int, num_train: int, variant: str):
    train, evals = arith_problems(seed, num_train, b.num_eval, steps, max_value, max_operand, variant)

    def build(problems, offset):
        return [
            b.example(offset + i, p.text, str(p.answer), ARITH_INSTRUCTION + p.text, arith_prompt(p))
            for i, p in enumerate(problems)
        ]

    return build(train, 0), build(evals, 10**9), lambda completion, ex: arith_reward(completion, ex.gold), None


def load_task(
    name: str, tokenizer, seed: int = 0, num_eval: int = 200, data_path: str | None = None,
    eval_data_path: str | None = None, max_prompt_length: int = 1024, arith_steps: int = 4, arith_max_value: int = 99,
    arith_max_operand: int = 9, arith_num_train: int = 20000, code_timeout: float = 5.0, code_sandbox: str = "bwrap",
    reward_fn: Sequence[str] = (), reward_weights: Sequence[float] = (), reward_timeout: float = 0.0,
    success_threshold: float = 1.0, arith_variant: str = "default",
) -> Task:  # fmt: skip
    """Build a task's train and eval prompts and its reward function (see the module docstring).

    arith: seeded synthetic problems (train and eval disjoint), drawn by the `arith_variant` generator (ARITH_VARIANTS);
    gsm8k/math: the hub dataset or a local file via `data_path` (eval from `eval_data_path`, else held out from the
    same source); code: HumanEval or a local
    jsonl/jsonl.gz in HumanEval's or an MBPP-like format, each program run in `code_sandbox` (sandbox.py) for
    `code_timeout` seconds;
    custom: `data_path` rows scored by `reward_fn` (custom.py). `reward_fn` given with a built-in task replaces its
    reward (the functions then get the columns `question` and `answer`, the gold); `reward_timeout`: seconds a call
    of one may take (0: no limit); `success_threshold`: what their first evaluation is checked against.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASKS)}")
    if arith_variant not in ARITH_VARIANTS:
        raise ValueError(f"unknown arith variant {arith_variant!r}: choose one of {', '.join(ARITH_VARIANTS)}")
    if not code_timeout > 0:
        raise ValueError(f"--code-timeout must be a positive number of seconds, got {code_timeout}")
    b = TaskBuilder(name, tokenizer, num_eval, data_path, eval_data_path, max_prompt_length)
    if name == "arith":
        train, evals, reward, batch_fn = _arith_task(
            b, seed, arith_steps, arith_max_value, arith_max_operand, arith_num_train, arith_variant
        )
    else:  # the tasks that read data
        data_tasks = runtime.extra("data_tasks", f"--task {name}")
        train, evals, reward, batch_fn = data_tasks.build(b, code_timeout, code_sandbox)
    user = None
    if reward_fn:  # the user's reward functions, in TRL's convention
        custom = runtime.extra("custom", "--reward-fn")
        user = custom.reward_batch(reward_fn, reward_weights, tokenizer, reward_timeout, success_threshold)
    train, evals = [e for e in train if e is not None], [e for e in evals if e is not None]
    if not train:
        raise ValueError(f"task {name!r} has no usable training prompts (skipped: {b.skipped})")
    if not evals and eval_data_path:  # its own file's name (common.load_task names the training data's)
        runtime.usage_error(f"--eval-data-path {eval_data_path}: no usable eval prompts in it (skipped: {b.skipped})")
    if not evals:
        raise ValueError(f"task {name!r} has no usable eval prompts (skipped: {b.skipped})")
    return Task(name, train, evals, reward, b.skipped, batch_fn, user)

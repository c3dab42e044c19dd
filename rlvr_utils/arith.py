"""The built-in task `arith`: seeded multi-step arithmetic written one step per line, with an exact verifier and
an exact first-wrong-step oracle (the ground truth for SRPO's oracle resets and for measuring self-localization).

A problem is a start value and a list of (+|-, operand) operations, written "23+7-5+9".
Its solution is one line per operation, then the answer line:
    23+7=30
    30-5=25
    25+9=34
    #### 34
Running values stay in [0, max_value]: an operation that would leave the range flips its sign.
"""

from __future__ import annotations

import dataclasses
import random
import re

from rlvr_utils.rewards import _normalize_number, extract_hash_answer

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
    if not m or _normalize_number(m.group(1)) != str(problem.answer):
        return i
    return None


def arith_reward(completion: str, gold: str) -> float:
    """1.0 when the completion's final answer (last `#### N`) equals the gold integer, else 0.0."""
    pred = extract_hash_answer(completion)
    return 1.0 if pred is not None and pred == _normalize_number(gold) else 0.0


ARITH_INSTRUCTION = (
    "Compute the expression step by step, one operation per line (for example 17+5=22), "
    "then give the final answer on its own line as '#### <number>'.\n"
)


def arith_problems(
    seed: int, num_train: int, num_eval: int, steps: int = 4, max_value: int = 99, max_operand: int = 9
) -> tuple[list[ArithProblem], list[ArithProblem]]:
    """Seeded train and eval problems, disjoint: eval problems (distinct) come from their own stream, and train
    draws that equal an eval problem are dropped."""
    rng, eval_rng = random.Random(seed), random.Random(10_000_019 + seed)
    kw = dict(steps=steps, max_value=max_value, max_operand=max_operand)
    evals = list({p.text: p for p in (make_arith_problem(eval_rng, **kw) for _ in range(num_eval))}.values())
    held = {p.text for p in evals}
    train = [p for p in (make_arith_problem(rng, **kw) for _ in range(num_train)) if p.text not in held]
    return train, evals


# The prompt formats the bundled tiny model was trained on (tools/train_tiny_model.py) besides solving:
def arith_reference_prompt(problem: ArithProblem, reference: str) -> str:
    """SC-GRPO's teacher prompt on the built-in task for a model without a chat template: the verified reference
    before the problem."""
    return f"Reference solution:\n{reference.strip()}\nSolve: {problem.text}\n"


def arith_localization_prompt(problem: ArithProblem, thoughts: list[str]) -> str:
    """SRPO's localization prompt on the built-in task for a model without a chat template: the failed solution one
    step per line, answered with `\\boxed{N}`."""
    steps = "".join(f"Step {i}: {t.strip()}\n" for i, t in enumerate(thoughts, 1))
    return f"Problem: {problem.text}\nYour incorrect solution:\n{steps}Find the first wrong step.\n"

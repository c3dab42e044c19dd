"""Other ways to draw the built-in arith task's problems (--arith-variant; tasks.arith_problems imports this file).

A variant draws (start, ops) as tasks.make_arith_problem does, from its own rule; the prompt, the solution's format, the
verifier and the first-wrong-step oracle (tasks.arith_first_error) are the default task's, so a variant changes which
problems a run sees and nothing else.
"""

from __future__ import annotations

import random


def rising(rng: random.Random, steps: int = 4, max_value: int = 99, max_operand: int = 9) -> tuple[int, tuple]:
    """--arith-variant rising: (start, ((op, operand), ...)) with a start in [0, 9] and additions, the operations of the
    solution's first quarter of lines (the lines k with (k - 1) / (steps + 1) < 1/4, the answer line counted, as
    benchmarks/premises.py counts them) with operands from the upper half [max_operand // 2 + 1, max_operand], the later
    ones from [1, max_operand]; an addition that would pass max_value subtracts instead.

    Why: GRPO-λ assumes that a chain's early tokens decide its outcome. assets/tiny-arith errs most on lines with a
    one-digit number; here the first lines carry a one-digit start into two digits and the rest add to two-digit
    values, so at 6 operations 60-68% of its failed chains go wrong in their first quarter (39-43% on the default
    problems; docs/benchmarks.md, "Premises", which also shows why no such variant exists for tiny-arith-long)."""
    if steps < 1 or max_operand < 1 or max_value < max_operand:
        raise ValueError(f"bad arith settings: steps={steps}, max_value={max_value}, max_operand={max_operand}")
    v = rng.randint(0, min(9, max_value))
    start, ops = v, []
    for i in range(steps):
        low = max_operand // 2 + 1 if i < (steps + 4) // 4 else 1  # (steps + 4) // 4: the first quarter's lines
        b = rng.randint(low, max_operand)
        op = "+" if v + b <= max_value else "-"
        v = v + b if op == "+" else v - b
        ops.append((op, b))
    return start, tuple(ops)

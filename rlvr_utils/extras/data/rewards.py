"""Rewards of the text tasks: GSM8K (numbers) and MATH (LaTeX answers through math-verify).

A reward is 1.0 or 0.0 for a completion against its gold answer. A gold answer that cannot be parsed is an error
(ValueError), never a reward: the task loaders skip and count such rows before training (data_tasks.py). An extra,
loaded with --task gsm8k or math. The number helpers and the built-in arith task's reward are in tasks.py; the code
task's sandbox in sandbox.py.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Callable

from rlvr_utils.core.tasks import NUMBER_RE, extract_hash_answer, last_boxed, normalize_number


# ----------------------------------------------------------------------------------------------
# GSM8K: the last `#### N`, else the last \boxed{}, else the last number
# ----------------------------------------------------------------------------------------------
def gsm8k_gold(answer_field: str) -> str | None:
    """The gold number of a GSM8K answer field (`... #### 72`) or of a bare number; None if none."""
    if "####" in answer_field:
        return extract_hash_answer(answer_field)
    return normalize_number(answer_field)


def gsm8k_extract(completion: str) -> str | None:
    """The completion's final answer: last `#### N`, else last `\\boxed{}`, else last number."""
    ans = extract_hash_answer(completion)
    if ans is not None:
        return ans
    boxed = last_boxed(completion)
    if boxed is not None:
        boxed = re.sub(r"\\(?:text|mathrm)\{[^}]*\}|\\!|\\,|\\\$|\\%|%", "", boxed)
        m = NUMBER_RE.findall(boxed)
        return normalize_number(m[-1]) if m else None
    nums = NUMBER_RE.findall(completion)
    return normalize_number(nums[-1]) if nums else None


def gsm8k_reward(completion: str, gold: str) -> float:
    """1.0 when the completion's final answer equals the gold number, else 0.0.

    `gold` is a whole GSM8K answer field (`... #### 72`) or the bare number. The completion's answer
    is its last `#### N`, else its last `\\boxed{}`, else its last number; commas, `$` and trailing
    `.0`/`.00` are normalized. A gold that is not a number raises ValueError (never rewarded).
    """
    g = gsm8k_gold(gold)
    if g is None:
        raise ValueError(f"GSM8K gold answer is not a number: {gold!r}")
    pred = gsm8k_extract(completion)
    if pred is None:
        return 0.0
    try:  # 3.50 == 3.5; 1e-9 tolerance for decimals written differently
        return 1.0 if abs(float(pred) - float(g)) < 1e-9 else 0.0
    except ValueError:
        return 0.0


# ----------------------------------------------------------------------------------------------
# MATH: math-verify on the last \boxed{}
# ----------------------------------------------------------------------------------------------
def _run_with_timeout(fn: Callable, timeout: float):
    """Run fn() in a daemon thread and give up after `timeout` seconds (works off the main thread,
    unlike math-verify's signal.alarm)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001 - reported to the caller below
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"math-verify took more than {timeout}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


_BRACED = ("\\frac", "\\dfrac", "\\tfrac", "\\sqrt")  # commands whose arguments may come without braces: \frac43
_UNIT_RE = re.compile(
    r"\\(?:text|textbf|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .]*\}\s*$"
)  # a trailing unit: \text{ degrees}


def _argument(s: str, i: int) -> tuple[str, int]:
    """The TeX argument at s[i:] (spaces skipped): a {...} group (returned without its braces), a \\command, or one
    character; and the index after it."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return "", i
    if s[i] == "{":
        depth = 0
        for j in range(i, len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                return s[i + 1 : j], j + 1
        return s[i + 1 :], len(s)
    if s[i] == "\\":
        m = re.match(r"\\[A-Za-z]+|\\.", s[i:])
        return m.group(0), i + len(m.group(0))
    return s[i], i + 1


def normalize_latex(s: str) -> str:
    """The one normalization applied to a MATH gold answer and to a boxed prediction before math-verify: arguments of
    \\frac, \\dfrac, \\tfrac and \\sqrt braced (\\frac43 -> \\frac{4}{3}, 5\\sqrt3 -> 5\\sqrt{3}); \\$, \\! and
    \\left / \\right dropped; ^\\circ and ^{\\circ} dropped; a unit in a trailing \\text{...} after a value dropped
    (\\frac{150}7\\text{ degrees}); an answer that is only \\text{(C)} is kept."""
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s.replace("\\$", "").replace("\\!", ""))
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s)
    stripped = _UNIT_RE.sub("", s).strip()
    if stripped and stripped != s.strip():
        s = stripped
    out, i = [], 0
    while i < len(s):
        cmd = next((c for c in _BRACED if s.startswith(c, i) and not s[i + len(c) : i + len(c) + 1].isalpha()), None)
        if cmd is None:
            out.append(s[i])
            i += 1
            continue
        i += len(cmd)
        out.append(cmd)
        if cmd == "\\sqrt" and s[i : i + 1] == "[":  # \sqrt[3]{x}: the index stays, the radicand is braced
            j = s.index("]", i) + 1 if "]" in s[i:] else len(s)
            out.append(s[i:j])
            i = j
        for _ in range(1 if cmd == "\\sqrt" else 2):
            arg, i = _argument(s, i)
            out.append("{" + normalize_latex(arg) + "}")
    return "".join(out).strip()


@functools.lru_cache(maxsize=65536)
def parse_math_gold(gold: str, timeout: float = 5.0):
    """math-verify parse of a LaTeX gold answer; [] when it cannot be parsed. Cached: a gold answer is parsed once
    (at load time, by the task loader's check), not at every reward."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # we enforce the timeout ourselves
    gold = normalize_latex(gold)
    text = gold if "\\boxed" in gold or "$" in gold else f"${gold}$"
    try:
        parsed = _run_with_timeout(
            lambda: parse(
                text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None
            ),
            timeout,
        )
    except Exception:  # noqa: BLE001 - an unparsable gold is counted by the caller
        return []
    # math-verify falls back to the raw string as its only candidate when nothing parses: accept
    # that only for plain text answers (non-empty, balanced braces), never for broken LaTeX.
    if parsed and all(isinstance(x, str) for x in parsed):
        depth_ok = gold.count("{") == gold.count("}") and gold.strip() and not gold.rstrip().endswith(("\\", "^", "_"))
        if not depth_ok or re.search(r"\\(frac|sqrt|dfrac)\b", gold):
            return []
    return parsed


def math_reward(completion: str, gold: str, timeout: float = 5.0) -> float:
    """math-verify on the completion's last `\\boxed{}` against the LaTeX gold (gold first).

    A gold that cannot be parsed raises ValueError (never a reward; tasks.py skips and counts such rows at load
    time). The timeout is enforced by a thread, so it works outside the main thread. A completion with no
    `\\boxed{}` scores 0.0.
    """
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.parser import NormalizationConfig

    gold_parsed = parse_math_gold(gold, timeout)
    if not gold_parsed:
        raise ValueError(f"MATH gold answer cannot be parsed: {gold!r}")
    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    boxed = normalize_latex(boxed)
    cfg = LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0)
    try:
        pred = _run_with_timeout(
            lambda: parse(f"\\boxed{{{boxed}}}", extraction_config=[cfg], parsing_timeout=None), timeout
        )
        if not pred:
            return 0.0
        ok = _run_with_timeout(lambda: verify(gold_parsed, pred, timeout_seconds=None), timeout)
    except Exception:  # noqa: BLE001 - a timeout or a parser crash is a wrong answer, not a crash
        return 0.0
    return 1.0 if ok else 0.0

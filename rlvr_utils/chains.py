"""SRPO's chain protocol: thoughts, the official stopping rules, the localization prompt and its reply.

The plumbing of srpo.py (SRPO / RRPO, arXiv 2605.25507; docs/srpo.md, "The chain protocol"): a chain is a list of
thoughts separated by a delimiter; the official chain ends after the thought that holds `\\boxed{` and after 20
thoughts (a continuation's kept prefix included). Here each response is generated in one call and the official stops
are applied after the fact (`protocol_cut`), cutting the sampled token ids, never re-tokenizing them. `Sampler` makes
a step's generate calls under these rules and counts what SRPO logs.
"""

from __future__ import annotations

import re
import time

from rlvr_utils import arith, rollouts, tasks
from rlvr_utils.rewards import last_boxed

COUNTS = (
    "loc_empty loc_no_error loc_out_of_range loc_unparsable loc_truncated parent_one_thought prefix_overflow "
    "generated_tokens fresh_chains long_thoughts oracle_early_stop generate_calls"
).split()  # a step's counters (srpo.py logs them as reset/<name>)
MAX_THOUGHTS, THOUGHT_TOKENS = 20, 256  # the official chain: at most 20 thoughts; thoughts over 256 tokens are counted
LOCALIZATION_PROMPT = (
    "Your task is to localize the first erroneous step in your own previous solution to a problem.\n\n"
    "Problem: {question}\n\nYour incorrect reasoning chain:\n{steps}\n\n"
    "The final answer of this chain is incorrect, so at least one step is wrong. Find the step where the error "
    "originates, not the step where the failure becomes visible: misreadings, unjustified assumptions and logical "
    "flaws can look fine for several steps. A step is erroneous if its claims cannot be justified from the problem "
    "statement and the earlier steps alone.\nDo not re-solve the problem; your only task is the step number.\n"
    "Requirements: commit to exactly one step number between 1 and {n}; stop at the first step you cannot justify; "
    "end your response with \\boxed{{N}} on its own line, where N is the step number (not the problem's answer), "
    "with nothing after it."
)


def split_thoughts(text: str, delimiter: str) -> list[str]:
    """The thoughts of a response: pieces between delimiters, whitespace-stripped, empty ones dropped."""
    if not delimiter:
        raise ValueError("the thought delimiter must be a non-empty string")
    return [piece.strip() for piece in text.split(delimiter) if piece.strip()]


def thought_starts(text: str, delimiter: str) -> list[int]:
    """Character offset where each thought of `split_thoughts(text, delimiter)` starts."""
    starts, pos = [], 0
    for piece in text.split(delimiter):
        if piece.strip():
            starts.append(pos + len(piece) - len(piece.lstrip()))
        pos += len(piece) + len(delimiter)
    return starts


def parse_error_step(text: str, num_thoughts: int) -> int:
    """The 1-based first wrong step named by a localization reply, always in [1, num_thoughts].

    The last `\\boxed{N}` when N is in 1..num_thoughts; else the last "Step N" when N is in range;
    else 1 (a reset to the start). A boxed 0 ("no error") also gives 1, as in the official code.
    """
    if num_thoughts < 1:
        raise ValueError("a parent needs at least one thought")
    text = text or ""
    boxed = last_boxed(text)
    if boxed is not None and re.fullmatch(r"\s*\d+\s*", boxed):
        v = int(boxed)
        if 1 <= v <= num_thoughts:
            return v
        if v == 0:
            return 1
    steps = re.findall(r"[Ss]tep\s+(\d+)", text)
    if steps and 1 <= int(steps[-1]) <= num_thoughts:
        return int(steps[-1])
    return 1


def localization_reply_kind(text: str, num_thoughts: int) -> str:
    """For the logs: ok, empty, no_error (boxed 0), out_of_range or unparsable."""
    if not (text or "").strip():
        return "empty"
    boxed = last_boxed(text)
    if boxed is not None and re.fullmatch(r"\s*\d+\s*", boxed):
        v = int(boxed)
        return "ok" if 1 <= v <= num_thoughts else "no_error" if v == 0 else "out_of_range"
    return "unparsable"


def localization_prompt(tokenizer, task_name: str, question: str, thoughts: list[str]) -> list[int]:
    """The prompt ids asking the policy for the first wrong thought of its own chain: the official code's
    "originating step" prompt (in the chat template when the tokenizer has one); on arith without a chat template,
    the format the bundled tiny model was trained to answer (arith.arith_localization_prompt)."""
    if task_name == "arith" and not tasks.has_chat_template(tokenizer):
        plain = arith.arith_localization_prompt(arith.parse_arith_problem(question), thoughts)
    else:
        steps = "\n".join(f"Step {i}: {t}" for i, t in enumerate(thoughts, 1))
        plain = LOCALIZATION_PROMPT.format(question=question, steps=steps, n=len(thoughts))
    return tasks.encode_prompt(tokenizer, tasks.render_prompt(tokenizer, plain, plain))


def tokens_before(tokenizer, ids: list[int], cut: int) -> int:
    """The longest token prefix of `ids` whose decoded text ends at or before character `cut` (a token straddling
    the cut is left out). Token ids are never re-tokenized, so kept prefixes are exactly what was sampled."""
    lo, hi = 0, len(ids)
    while lo < hi:  # largest i with len(decode(ids[:i])) <= cut
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) <= cut:
            lo = mid
        else:
            hi = mid - 1
    return lo


def prefix_token_count(tokenizer, ids: list[int], text: str, k: int, delimiter: str) -> int:
    """Tokens of `ids` that lie before thought k (k >= 2; 0 for k = 1 or a k past the last thought)."""
    starts = thought_starts(text, delimiter)
    return tokens_before(tokenizer, ids, starts[k - 1]) if 2 <= k <= len(starts) else 0


def protocol_cut(
    tokenizer,
    ids: list[int],
    text: str,
    delimiter: str,
    max_thoughts: int = MAX_THOUGHTS,
    budget: int | None = None,
    reserve: int = 0,
    truncated: bool = False,
    continuation: bool = False,
) -> list[int]:
    """The official chain's stopping rules applied to a response generated in one call (docs/srpo.md, "The chain
    protocol"): it ends after the first thought that contains `\\boxed{`, after `max_thoughts` thoughts, and before
    the first thought that would start with fewer than `reserve` tokens of the response's token `budget` left (the
    official loop stops when len(response) + 256 > response_length); a thought the budget or the generation cap
    (`truncated`) cut short is dropped, back to the last whole thought (the official safety truncation). When no whole
    thought fits, a `continuation` (its prefix spent the budget) adds nothing and a fresh chain keeps its first
    `budget` tokens. Returns the kept token ids."""
    starts = thought_starts(text, delimiter)
    ends = [text.find(delimiter, s) if text.find(delimiter, s) >= 0 else len(text) for s in starts]
    last = next((i for i, (s, e) in enumerate(zip(starts, ends)) if "\\boxed{" in text[s:e]), len(starts) - 1)
    last = min(last, max_thoughts - 1)
    over = budget is not None and len(ids) > budget
    if budget is not None:
        room = len(tokenizer.decode(ids[:budget], skip_special_tokens=True)) if over else len(text)
        whole = [(e < len(text) or not truncated) and e <= room for e in ends]  # ended by a delimiter or EOS, in budget
        opens = [tokens_before(tokenizer, ids, s) + reserve <= budget for s in starts]  # a prefix counts (budget)
        last = min(last, next((k - 1 for k in range(len(starts)) if not (whole[k] and opens[k])), len(starts) - 1))
        if last < 0 and starts:  # nothing whole fits: a continuation adds nothing (official); a fresh chain keeps
            return [] if continuation else ids[:budget]  # its first `budget` tokens (a response is never empty)
    if last < 0 or (last == len(starts) - 1 and not over):
        return ids  # nothing after the last kept thought but its own end
    return ids[: tokens_before(tokenizer, ids, ends[last])]


class Sampler:
    """One step's generate calls (one completion per prompt, the run's sampling flags) under the chain protocol. `info`
    holds the step's counts (COUNTS; srpo.py's stages add theirs): here generated_tokens and generate_calls (every
    call, localization included), long_thoughts (thoughts over THOUGHT_TOKENS, which the official loop would have
    closed), loc_truncated (cut-off localization replies) and time_localization (seconds)."""

    def __init__(self, model, tokenizer, task, args):
        self.model, self.tokenizer, self.task, self.args = model, tokenizer, task, args
        self.delimiter = args.thought_delimiter
        # a new thought needs this many tokens of the budget left (default: the official ratio 256 / 5120, at most 256)
        reserve = getattr(args, "thought_reserve", None)
        self.reserve = min(THOUGHT_TOKENS, args.max_new_tokens // 20) if reserve is None else reserve
        self.info = dict.fromkeys(COUNTS, 0) | {"time_localization": 0.0}

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> rollouts.Rollouts:
        a = self.args
        ro = rollouts.generate_rollouts(
            self.model,
            self.tokenizer,
            prompts,
            list(range(len(prompts))),
            1,
            max_new_tokens,
            temperature,
            a.top_p,
            a.top_k,
            batch_size=a.gen_batch_size,
        )
        self.info["generated_tokens"] += int(ro.completion_mask.sum())
        self.info["generate_calls"] += 1
        return ro

    def sample(
        self, prompts: list[list[int]], budgets: list[tuple[int, int]] | None = None
    ) -> list[tuple[list[int], str]]:
        """(kept token ids, text) per prompt, each response cut by `protocol_cut` (no call for no prompts).
        budgets: (thoughts, tokens) each response may still add (default `budget([])`: 20 thoughts, --max-new-tokens;
        a continuation's prefix counts against both)."""
        if not prompts:
            return []
        budgets = budgets or [self.budget([])] * len(prompts)
        ro = self.generate(prompts, self.args.max_new_tokens, self.args.temperature)
        out, tok = [], self.tokenizer
        for i in range(len(ro)):
            ids = ro.completion_ids[i][ro.completion_mask[i].bool()].tolist()
            thoughts, tokens = budgets[i]
            truncated = bool(ro.truncated[i])
            more = tokens < self.args.max_new_tokens  # a continuation: its prefix took part of the budget
            cut = protocol_cut(tok, ids, ro.texts[i], self.delimiter, thoughts, tokens, self.reserve, truncated, more)
            out.append((cut, ro.texts[i] if len(cut) == len(ids) else tok.decode(cut, skip_special_tokens=True)))
            if len(ids) > THOUGHT_TOKENS:  # the official loop closes a thought at 256 tokens; here they are counted
                self.info["long_thoughts"] += sum(
                    len(tok(t, add_special_tokens=False).input_ids) > THOUGHT_TOKENS
                    for t in split_thoughts(out[-1][1], self.delimiter)
                )
        return out

    def scored(self, chains: list[tuple[list[int], str]], owners: list) -> list[tuple[list[int], str, float]]:
        """(ids, text, reward) per chain; owners: the example of each chain."""
        return [(ids, text, r) for (ids, text), r in zip(chains, self.task.rewards([c[1] for c in chains], owners))]

    def budget(self, prefix_ids: list[int]) -> tuple[int, int]:
        """(thoughts, tokens) a continuation may add: the official chain stops at 20 thoughts and at the response's
        token budget (--max-new-tokens), the kept prefix's included."""
        prefix = self.tokenizer.decode(prefix_ids, skip_special_tokens=True)
        thoughts = max(MAX_THOUGHTS - len(split_thoughts(prefix, self.delimiter)), 1)
        return thoughts, max(self.args.max_new_tokens - len(prefix_ids), 1)

    def localize(self, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> list[str]:
        """The localization replies, one generate call (their tokens are never trained on)."""
        t0 = time.time()
        ro = self.generate(prompts, max_new_tokens, temperature)
        self.info["loc_truncated"] = int(ro.truncated.sum())  # a cut-off reply usually parses to step 1
        self.info["time_localization"] = time.time() - t0
        return ro.texts

"""The generate calls of srpo.py under its chain protocol (SRPO / RRPO, arXiv 2605.25507; docs/srpo.md, "The chain
protocol"): each response is generated in one call and srpo.py's stopping rules (protocol_cut) are applied after the
fact, cutting the sampled token ids, never re-tokenizing them. `Sampler` makes a step's generate calls and counts what
SRPO logs (`reset_metrics`: the rest); `tokens_before` aligns a character offset with the sampled tokens.
"""

from __future__ import annotations

import time
from typing import Callable

from rlvr_utils.core import rollouts

COUNTS = "loc_truncated generated_tokens long_thoughts generate_calls".split()  # the Sampler's (srpo: reset/<name>)


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


def reset_metrics(cuts, rows, examples, tried: int, solved: float) -> dict:
    """The reset/* metrics of a step (docs/srpo.md, Logs) from srpo.py's records, counted here and nowhere else: cuts
    (Reset: k, n, oracle, reply, early, overflow), rows (Row: example, kind, parent, reward), the step's examples, the
    fresh chains drawn (`tried`) and the success threshold."""
    ks, oracle_ks = [(c.k, c.n) for c in cuts], [c.oracle for c in cuts if c.oracle is not None]
    reset_rows = [r for r in rows if r.kind == "reset" and r.reward == r.reward]  # NaN: no reward (None)
    groups = {(r.example.id, r.parent) for r in reset_rows}  # each parent's continuations
    best = {g: max(r.reward for r in reset_rows if (r.example.id, r.parent) == g) for g in groups}
    fallback = {r.example.id for r in rows if r.kind == "fresh"}
    out = dict(
        normalized_position=sum((k - 1) / n for k, n in ks) / len(ks) if ks else 0.0,
        correction_rate=sum(r.reward for r in reset_rows) / len(reset_rows) if reset_rows else 0.0,
        suffix_pass_at_k=sum(b >= solved for b in best.values()) / max(1, len(cuts)),
        fallback_share=sum(e.id in fallback for e in examples) / len(examples),
        num_parents=len(cuts),
        fresh_chains=tried,
        parent_one_thought=sum(c.n == 1 for c in cuts),
        prefix_overflow=sum(c.overflow for c in cuts),
        oracle_early_stop=sum(c.early for c in cuts),  # the chain stopped before the task's first error
    )
    out |= {f"loc_{k}": sum(c.reply == k for c in cuts) for k in ("empty", "no_error", "out_of_range", "unparsable")}
    if oracle_ks:
        out["oracle_exact"] = sum(k == o for (k, _), o in zip(ks, oracle_ks)) / len(ks)
        out["oracle_within_1"] = sum(abs(k - o) <= 1 for (k, _), o in zip(ks, oracle_ks)) / len(ks)
        out["oracle_after"] = sum(k > o for (k, _), o in zip(ks, oracle_ks)) / len(ks)  # the prefix holds the error
    return out


class Sampler:
    """One step's generate calls (one completion per prompt, the run's sampling flags) under the chain protocol:
    `cut(ids, text, budget, truncated)` (srpo.protocol_cut) keeps a response's token ids, `split(text)` gives its
    thoughts. `info` holds the step's counts (COUNTS; srpo.py's stages add theirs): here generated_tokens and
    generate_calls (every call, localization included), long_thoughts (thoughts over `thought_tokens`, which the
    official loop would have closed), loc_truncated (cut-off localization replies) and time_localization (seconds)."""

    def __init__(self, model, tokenizer, task, args, cut: Callable, split: Callable, thought_tokens: int):
        self.model, self.tokenizer, self.task, self.args = model, tokenizer, task, args
        self.cut, self.split, self.thought_tokens = cut, split, thought_tokens
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

    def sample(self, prompts: list[list[int]], budgets: list[tuple[int, int]]) -> list[tuple[list[int], str]]:
        """(kept token ids, text) per prompt, each response cut by `cut` (no call for no prompts). budgets: (thoughts,
        tokens) each response may still add (srpo.thought_budget; a continuation's prefix counts against both)."""
        if not prompts:
            return []
        ro = self.generate(prompts, self.args.max_new_tokens, self.args.temperature)
        out, tok = [], self.tokenizer
        for i in range(len(ro)):
            ids = ro.completion_ids[i][ro.completion_mask[i].bool()].tolist()
            cut = self.cut(ids, ro.texts[i], budgets[i], bool(ro.truncated[i]))
            out.append((cut, ro.texts[i] if len(cut) == len(ids) else tok.decode(cut, skip_special_tokens=True)))
            if len(ids) > self.thought_tokens:  # the official loop closes a long thought; here they are counted
                self.info["long_thoughts"] += sum(
                    len(tok(t, add_special_tokens=False).input_ids) > self.thought_tokens
                    for t in self.split(out[-1][1])
                )
        return out

    def scored(self, chains: list[tuple[list[int], str]], owners: list) -> list[tuple[list[int], str, float]]:
        """(ids, text, reward) per chain; owners: the example of each chain."""
        rewards = self.task.rewards([text for _, text in chains], owners, [ids for ids, _ in chains])
        return [(ids, text, r) for (ids, text), r in zip(chains, rewards)]

    def localize(self, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> list[str]:
        """The localization replies, one generate call (their tokens are never trained on)."""
        t0 = time.time()
        ro = self.generate(prompts, max_new_tokens, temperature)
        self.info["loc_truncated"] = int(ro.truncated.sum())  # a cut-off reply usually parses to step 1
        self.info["time_localization"] = time.time() - t0
        return ro.texts

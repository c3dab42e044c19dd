"""SRPO / RRPO: reset a failed rollout at its first wrong step and learn from resampled suffixes.

Of each prompt's 8 trajectories, 4 are fresh chains (the base group); the other 4 continue a failed
"parent" chain from just before its first erroneous thought. SRPO asks the policy itself which
thought was first wrong (`--reset self`), RRPO picks it uniformly (`--reset random`), and
`--reset oracle` uses the task's exact first wrong step (the built-in arith task has one). Each
group is z-scored on its own; the loss is REINFORCE on suffix tokens only (the prefix is masked).
Paper: Samanta et al. 2026, arXiv 2605.25507. Docs: docs/srpo.md. Generate calls:
rlvr_utils/methods/chains.py.

Differences from grpo.py:
  1. Rollouts: fresh chains, a parent search, reset points (self / random / oracle) and
     continuations, in at most four generate calls per step (collect_rollouts); parents never train.
  2. Advantages: each normalization group (base, each reset group, or the fallback group) z-scored
     with its population std and no epsilon; continuations are trained on their suffix only.
  3. Loss: REINFORCE (no ratio, no clip).
  4. No dynamic sampling, overlong shaping or --scale-rewards; --num-generations is the budget,
     half fresh chains and half one parent's continuations.
  5. Defaults: the shared ones but --learning-rate 3e-5 (grpo.py: 1e-4), where the tiny long-chain
     model does not collapse (docs/srpo.md, "Defaults: paper versus this project").

Ablations (--split, --no-mask, --clip): rlvr_utils/methods/srpo_ablations.py (docs/srpo.md,
Ablations).

    python srpo.py                  # SRPO on the bundled tiny model and the built-in task
    python srpo.py --reset random   # RRPO
"""

import collections
import dataclasses
import functools
import random
import re
from typing import Literal

import torch

import common
from rlvr_utils.core import cli, tasks
from rlvr_utils.methods import chains


@dataclasses.dataclass
class Args(cli.BaseArgs):
    """SRPO / RRPO: the shared flags (rlvr_utils/core/cli.py) and the resets'. --num-generations is
    the paper's budget of 8 trained trajectories per prompt, half fresh chains and half one parent's
    continuations; --max-new-tokens caps a continuation's response, its kept prefix included;
    --epsilon and --epsilon-high act only with the ablation --clip (docs/srpo.md, Ablations)."""

    learning_rate: float = 3e-5
    """AdamW learning rate (constant): 3e-5 here, grpo.py's 1e-4 / 3.3. On the bundled long-chain
    model SRPO's suffix-only REINFORCE collapsed at 1e-4 in 2 of 10 runs (5 seeds, with its
    seq-mean-token-mean and with token-mean), in none of 5 at 3e-5 (docs/srpo.md, "Defaults");
    `--learning-rate 1e-4` gives the shared default. Use ~1e-6 for full fine-tuning of 1B+ models"""

    # ALGO LOGIC: resets
    reset: Literal["self", "random", "oracle"] = "self"
    """where to reset a failed parent: self (SRPO, the policy localizes), random (RRPO), oracle (the
    task's first error)"""
    max_fresh_attempts: int = 12
    """fresh chains sampled per prompt while looking for failed parents; none found: plain GRPO on
    fresh chains"""
    thought_reserve: int | None = None
    """a new thought starts only while at least this many tokens (>= 0) of the --max-new-tokens
    budget are left, and a thought the budget cuts short is dropped (the official code: 256, its
    per-thought cap, of a 5120-token budget; default: min(256, max-new-tokens // 20), that ratio)"""
    thought_delimiter: str | None = None
    """string that ends a thought (default: a newline for arith, a blank line for gsm8k/math)"""
    localization_temperature: float = 0.3
    """sampling temperature of the self-localization call (the official code's; the paper is
    silent)"""
    localization_max_new_tokens: int | None = None
    """token cap (>= 1) of the localization reply (default: 4096; arith: max(192, 20 x (operations +
    2)))"""


# ALGO LOGIC: the resets' rules (docs/srpo.md): where a parent is reset, which tokens train, and
# how each group is normalized; the loss itself is in step 5 (REINFORCE on the suffix)
def reset_index(mode: str, num_thoughts: int, rng=None, reply=None, oracle_step=None) -> int:
    """1-based index k of the thought to resample from (the prefix keeps thoughts 1..k-1; the
    paper's reset state s_k): self: parse_reply(reply) (SRPO); random: uniform on 1..num_thoughts
    (RRPO); oracle: the task's first wrong step (None, no wrong thought found: the last thought).
    Clamped to [1, num_thoughts]."""
    if mode == "self":
        return parse_reply(reply or "", num_thoughts)[0]
    if mode == "random":
        return (rng or random).randint(1, num_thoughts)
    if mode == "oracle":
        k = oracle_step if oracle_step is not None else num_thoughts
        return min(max(k, 1), num_thoughts)
    raise ValueError(f"unknown reset mode {mode!r}: choose self, random or oracle")


def suffix_mask(completion_mask: torch.Tensor, suffix_start: torch.Tensor) -> torch.Tensor:
    """completion_mask [B, T] restricted to t >= suffix_start[b] (the trained suffix U_i).

    >>> completion_mask = torch.ones(2, 4)
    >>> suffix_start = torch.tensor([0, 2])  # row 1 kept a 2-token prefix from its parent
    >>> suffix_mask(completion_mask, suffix_start)
    tensor([[1., 1., 1., 1.],
            [0., 0., 1., 1.]])
    """
    T = completion_mask.shape[1]
    after = torch.arange(T, device=completion_mask.device)[None, :] >= suffix_start[:, None]
    return completion_mask * after


def srpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = (r_i - mean_g r) / std_g r over each normalization group g (the base chains, each
    reset group, the fallback group), with the population std and no epsilon as the official code;
    0 where a group's rewards are all equal. rewards, group_ids [N] (groups of any size); [N].

    >>> rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    >>> group_ids = torch.tensor([0, 0, 1, 1])  # group 0: mean .5, std_pop .5; group 1: all equal
    >>> srpo_advantages(rewards, group_ids)
    tensor([ 1., -1.,  0.,  0.])
    """
    return common.group_advantages(rewards, None, eps=0.0, group_ids=group_ids, unbiased=False)


# ALGO LOGIC: the chain protocol (docs/srpo.md, "The chain protocol"): a chain is a list of thoughts
# separated by a delimiter; it ends after the thought that holds `\boxed{` and after 20 thoughts
# (a continuation's prefix included); thoughts over 256 tokens are counted
MAX_THOUGHTS = 20
THOUGHT_TOKENS = 256


def split_thoughts(text: str, delimiter: str) -> list[str]:
    """The thoughts of a response: pieces between delimiters, whitespace-stripped, empty ones
    dropped."""
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


def protocol_cut(tokenizer, ids, text, delimiter, max_thoughts=MAX_THOUGHTS, budget=None, reserve=0,
                 truncated=False, continuation=False) -> list[int]:  # fmt: skip
    """The official chain's stops applied after the fact: the chain ends after the first thought
    holding `\\boxed{`, after `max_thoughts` thoughts, and before a thought that would start with
    fewer than `reserve` of the `budget` tokens left; a thought the budget or the cap (`truncated`)
    cut short is dropped (the official safety truncation). No whole thought fits: a `continuation`
    adds nothing, a fresh chain keeps its first `budget` tokens. Returns the kept token ids, a
    prefix of `ids` (never re-tokenized).

    A worked example, one token per character, delimiter "\\n":
      text "ab\\ncd \\boxed{1}\\nef"                -> "ab\\ncd \\boxed{1}" (the boxed thought ends it)
      text "ab\\ncd\\nefgh", budget 8, reserve 0    -> "ab\\ncd" (thought 3 ends past the budget)
      text "ab\\ncd\\nefgh", budget 12, reserve 7   -> "ab\\ncd" (thought 3 starts at token 6, and
                                                     6 + 7 > 12 tokens: it may not open)
      text "abcdefgh", budget 4                    -> "abcd" (a fresh chain; a continuation: "")"""
    starts = thought_starts(text, delimiter)
    ends = [text.find(delimiter, s) if text.find(delimiter, s) >= 0 else len(text) for s in starts]
    boxed = (i for i, (s, e) in enumerate(zip(starts, ends)) if "\\boxed{" in text[s:e])
    last = min(next(boxed, len(starts) - 1), max_thoughts - 1)  # the last thought kept
    over = budget is not None and len(ids) > budget
    if budget is not None:
        room = len(tokenizer.decode(ids[:budget], skip_special_tokens=True)) if over else len(text)
        # a thought is whole when a delimiter or the end of the text ends it, within the budget
        whole = [(e < len(text) or not truncated) and e <= room for e in ends]
        # it may open while `reserve` tokens are left (a continuation's prefix counts)
        opens = [chains.tokens_before(tokenizer, ids, s) + reserve <= budget for s in starts]
        fits = (k - 1 for k in range(len(starts)) if not (whole[k] and opens[k]))
        last = min(last, next(fits, len(starts) - 1))
        if last < 0 and starts:  # nothing whole fits: a continuation adds nothing (official),
            return [] if continuation else ids[:budget]  # a fresh chain keeps its first tokens
    if last < 0 or (last == len(starts) - 1 and not over):
        return ids  # nothing after the last kept thought but its own end
    return ids[: chains.tokens_before(tokenizer, ids, ends[last])]


def thought_budget(tokenizer, prefix_ids: list[int], args) -> tuple[int, int]:
    """(thoughts, tokens) a response may add after `prefix_ids` (a continuation's kept prefix; []
    for a fresh chain): the official chain stops at 20 thoughts and at --max-new-tokens, the
    response's budget, the prefix's included."""
    prefix = tokenizer.decode(prefix_ids, skip_special_tokens=True)
    thoughts = max(MAX_THOUGHTS - len(split_thoughts(prefix, args.thought_delimiter)), 1)
    return thoughts, max(args.max_new_tokens - len(prefix_ids), 1)


# ALGO LOGIC: self-localization (SRPO): the policy is asked for the first wrong thought of its own
# failed chain; its reply is parsed as the official code does (docs/srpo.md, self-localization)
LOCALIZATION_PROMPT = (
    "Your task is to localize the first erroneous step in your own previous solution to a "
    "problem.\n\nProblem: {question}\n\nYour incorrect reasoning chain:\n{steps}\n\n"
    "The final answer of this chain is incorrect, so at least one step is wrong. Find the step "
    "where the error originates, not the step where the failure becomes visible: misreadings, "
    "unjustified assumptions and logical flaws can look fine for several steps. A step is "
    "erroneous if its claims cannot be justified from the problem statement and the earlier "
    "steps alone.\nDo not re-solve the problem; your only task is the step number.\n"
    "Requirements: commit to exactly one step number between 1 and {n}; stop at the first step "
    "you cannot justify; end your response with \\boxed{{N}} on its own line, where N is the step "
    "number (not the problem's answer), with nothing after it."
)  # the official code's "originating step" prompt
ARITH_LOCALIZATION = (
    "Problem: {problem}\nYour incorrect solution:\n{steps}Find the first wrong step.\n"
)
# ^ the built-in task's, for a model without a chat template (the tiny model was trained on it)


def localization_prompt(tokenizer, task_name: str, question: str, thoughts: list[str]) -> list[int]:
    """The prompt ids asking the policy for the first wrong thought of its own chain:
    LOCALIZATION_PROMPT (in the chat template when the tokenizer has one); on arith without a chat
    template, the format the bundled tiny model was trained to answer (ARITH_LOCALIZATION)."""
    if task_name == "arith" and not tasks.has_chat_template(tokenizer):
        steps = "".join(f"Step {i}: {t.strip()}\n" for i, t in enumerate(thoughts, 1))
        plain = ARITH_LOCALIZATION.format(problem=question, steps=steps)
    else:
        steps = "\n".join(f"Step {i}: {t}" for i, t in enumerate(thoughts, 1))
        plain = LOCALIZATION_PROMPT.format(question=question, steps=steps, n=len(thoughts))
    return tasks.encode_prompt(tokenizer, tasks.render_prompt(tokenizer, plain, plain))


def parse_reply(text: str, num_thoughts: int) -> tuple[int, str]:
    """The 1-based first wrong step a localization reply names, in [1, num_thoughts], and the
    reply's kind (ok, empty, no_error, out_of_range, unparsable; for the logs): the last
    `\\boxed{N}` with N in range, else the last "Step N" in range, else 1 (a reset to the start). A
    boxed 0 ("no error") also gives 1, as in the official code."""
    if num_thoughts < 1:
        raise ValueError("a parent needs at least one thought")
    text = text or ""
    boxed = tasks.last_boxed(text)
    v = int(boxed) if boxed is not None and re.fullmatch(r"\s*\d+\s*", boxed) else None
    if v is None:
        kind = "unparsable"
    elif 1 <= v <= num_thoughts:
        kind = "ok"
    else:
        kind = "no_error" if v == 0 else "out_of_range"
    kind = "empty" if not text.strip() else kind
    if kind == "ok":
        return v, kind
    steps = [int(n) for n in re.findall(r"[Ss]tep\s+(\d+)", text)]
    named = v != 0 and steps and 1 <= steps[-1] <= num_thoughts
    return (steps[-1] if named else 1), kind


# The search and the step's rollouts: the records passed from stage to stage, by name
Chain = collections.namedtuple("Chain", "ids text reward")  # a response: kept ids, not re-tokenized
Reset = collections.namedtuple("Reset", "example parent prefix k n oracle reply early overflow")
# ^ a parent cut before thought k of n; for the logs (chains.reset_metrics): the task's k (arith), the
# localization reply's kind, whether the chain stopped before the oracle's k, whether the prefix
# would have filled the context (then k = 1)
Row = collections.namedtuple("Row", "example ids suffix_start kind parent reward")  # a trained row
# a Row's kind: reset (a parent's continuation), base (a fresh chain), fresh (the fallback group)
ResetRollouts = collections.namedtuple(
    "ResetRollouts", "rollouts rewards suffix_start prompt_of_row info"
)  # a step's trained rows, from settle to the loss: common.Rollouts (group_ids: normalization
# groups, never a parent), rewards [N], suffix_start [N] (response tokens kept from the parent; 0:
# a fresh chain), prompt_of_row [N] (example ids: mini-batches hold whole prompts), info (reset/*)


@dataclasses.dataclass
class Search:
    """A prompt's parent search: parents, base chains, every chain assigned (seen), spares, tries."""

    parents: list = dataclasses.field(default_factory=list)
    base: list = dataclasses.field(default_factory=list)
    seen: list = dataclasses.field(default_factory=list)
    spare: list = dataclasses.field(default_factory=list)
    tried: int = 0


def split_sizes(args) -> tuple[int, int, int]:
    """(parents, K continuations per parent, base chains) per prompt: the budget G split 1x4, one
    parent's G/2 continuations and G/2 base chains (--split: an ablation's other splits)."""
    if args.ablation_module is not None:
        return args.ablation_module.split_sizes(args)
    K = args.num_generations // 2
    return 1, K, args.num_generations - K


def assign(st: Search, found: list[Chain], args) -> None:
    """The official order: a failed chain with >= 1 thought is a parent while parents are missing,
    any other chain fills the base group while it has room; one drawn after the prompt is settled
    is surplus."""
    n_parents, _, n_base = split_sizes(args)
    for chain in found:
        settled = len(st.parents) == n_parents and len(st.base) == n_base
        if settled or st.tried >= args.max_fresh_attempts:
            break
        st.tried += 1
        st.seen.append(chain)
        failed = chain.reward < args.success_threshold  # a parent's reward is below the threshold
        if (
            split_thoughts(chain.text, args.thought_delimiter)
            and failed
            and len(st.parents) < n_parents
        ):
            st.parents.append(chain)
        elif len(st.base) < n_base:
            st.base.append(chain)


def more_search(sampler, search: dict[int, Search], examples, args, riders) -> list:
    """One generate call: the remaining attempts of the prompts still missing parents, plus the
    spare chains their fallback groups may need, and `riders` (continuations' prompts and budgets,
    sampled in the same call and returned)."""
    n_parents, _, n_base = split_sizes(args)
    spare = args.num_generations - n_base  # a fallback's need
    left = {e.id: args.max_fresh_attempts - search[e.id].tried for e in examples}  # attempts left
    pending = [e for e in examples if len(search[e.id].parents) < n_parents and left[e.id] > 0]
    counts = {e.id: (left[e.id], spare) for e in pending}
    return sample_chains(sampler, search, examples, counts, args, riders)


def sample_chains(sampler, search, examples, counts: dict, args, riders=([], [])) -> list:
    """Sample `counts[id]` = (search, spare) fresh chains per prompt beside the riders in one call;
    the search chains are assigned in sampling order, the spares kept. Returns the riders'."""
    prompts, budgets = riders
    owners = [e for e in examples if e.id in counts for _ in range(sum(counts[e.id]))]
    fresh = thought_budget(sampler.tokenizer, [], args)
    out = sampler.sample(prompts + [e.prompt_ids for e in owners], budgets + [fresh] * len(owners))
    found = [Chain(*c) for c in sampler.scored(out[len(prompts) :], owners)]
    for e in (e for e in examples if e.id in counts):
        n_search, n_spare = counts[e.id]
        assign(search[e.id], found[:n_search], args)
        search[e.id].spare = found[n_search : n_search + n_spare]
        found = found[n_search + n_spare :]
    return out[: len(prompts)]


def reset_points(
    sampler, task, search: dict[int, Search], examples, args, rng, max_pos
) -> list[Reset]:
    """The parents of every prompt of `examples` that has found all of them, each cut just before
    its reset thought k: SRPO asks the policy which thought was first wrong (one generate call for
    all of them), RRPO draws it uniformly, the oracle takes the task's first wrong step. A parent
    keeps thoughts 1..k-1 as its first tokens (the sampled ids, never re-tokenized); a prefix that
    would fill the context window resets to the start (k = 1)."""
    tok, delimiter = sampler.tokenizer, args.thought_delimiter
    n_parents = split_sizes(args)[0]
    settled = [e for e in examples if len(search[e.id].parents) == n_parents]
    todo = [(e, j, parent) for e in settled for j, parent in enumerate(search[e.id].parents)]
    thoughts = [split_thoughts(parent.text, delimiter) for _, _, parent in todo]
    replies = [None] * len(todo)
    if args.reset == "self" and todo:  # the localization call
        cap = max(192, 20 * (args.arith_steps + 2)) if task.name == "arith" else 4096
        cap = args.localization_max_new_tokens or cap
        asks = [
            localization_prompt(tok, task.name, e.question, th)
            for (e, _, _), th in zip(todo, thoughts)
        ]
        replies = sampler.localize(asks, cap, max(args.localization_temperature, 1e-5))
    cuts = []
    for (e, j, parent), th, reply in zip(todo, thoughts, replies):
        oracle = tasks.arith_first_error(e.question, parent.text) if task.name == "arith" else None
        k = reset_index(args.reset, len(th), rng, reply, oracle)
        starts = thought_starts(parent.text, delimiter)  # the prefix keeps thoughts 1..k-1
        n_prefix = 0
        if 2 <= k <= len(starts):
            n_prefix = chains.tokens_before(tok, parent.ids, starts[k - 1])
        overflow = len(e.prompt_ids) + n_prefix >= max_pos - 1
        if overflow:
            k, n_prefix = 1, 0
        known = min(max(oracle or len(th), 1), len(th)) if task.name == "arith" else None
        kind = parse_reply(reply, len(th))[1] if reply is not None else "ok"  # for the logs
        early = oracle is not None and oracle > len(th)  # the chain stopped before its first error
        cuts.append(Reset(e, j, parent.ids[:n_prefix], k, len(th), known, kind, early, overflow))
    return cuts


def suffixes(sampler, cuts: list[Reset], K: int, args) -> tuple[list, list]:
    """The continuations' requests: K copies of prompt + kept prefix per reset parent (the run's
    sampling settings), each with the thoughts and tokens it may still add (thought_budget)."""
    prompts = [c.example.prompt_ids + c.prefix for c in cuts for _ in range(K)]
    return prompts, [
        thought_budget(sampler.tokenizer, c.prefix, args) for c in cuts for _ in range(K)
    ]


def settle(model, sampler, task, examples, search: dict[int, Search], cuts: list[Reset], sfx, args):
    """The trained batch: K continuations per reset parent (prefix + suffix, cut to the response
    budget, trained from suffix_start on), then per prompt its base chains, or, with no parents
    found, the official fallback group (1x4: the base chains, 2x4: the failures found, 1x8: the
    chains sampled so far; topped up with spare fresh chains). One group id per normalization
    group; each prompt's rows together. Returns the ResetRollouts (info empty) and the Rows."""
    tok, max_new = sampler.tokenizer, args.max_new_tokens
    n_parents, K, n_base = split_sizes(args)
    new = []  # the continuations: kept prefix + suffix, in their parent's reset group
    for i, c in enumerate(cuts):
        for ids, _ in sfx[i * K : (i + 1) * K]:
            full = c.prefix + ids[: max(max_new - len(c.prefix), 1)]
            new.append(Row(c.example, full, len(c.prefix), "reset", c.parent, 0.0))
    texts = [tok.decode(r.ids, skip_special_tokens=True) for r in new]
    scores = task.rewards(texts, [r.example for r in new], [r.ids for r in new])  # prefix + suffix
    rows = [r._replace(reward=x) for r, x in zip(new, scores)]
    for e in examples:
        st = search[e.id]
        if len(st.parents) == n_parents:
            rows += [Row(e, c.ids, 0, "base", None, c.reward) for c in st.base]
            continue
        kept = st.base[:n_base]  # the base chains (--split: an ablation's other fallbacks)
        if args.ablation_module is not None:
            kept = args.ablation_module.fallback(st, args)
        kept = kept + st.spare[: args.num_generations - len(kept)]
        rows += [Row(e, c.ids, 0, "fresh", None, c.reward) for c in kept]
    order = [e.id for e in examples]
    rows.sort(key=lambda r: order.index(r.example.id))  # each prompt's rows together (stable)
    keys = {}  # one group per prompt and kind (and parent, for a reset group)
    group_ids = [keys.setdefault((r.example.id, r.kind, r.parent), len(keys)) for r in rows]
    device = next(model.parameters()).device
    stops = common.stop_token_ids(model, tok)
    ro = common.make_rollouts(tok, [r.example.prompt_ids for r in rows], [r.ids for r in rows],
                              group_ids, stops, device)  # fmt: skip
    rewards = torch.tensor([r.reward for r in rows], dtype=torch.float32)
    suffix_start = torch.tensor([r.suffix_start for r in rows], device=device)
    prompt_of_row = torch.tensor([r.example.id for r in rows], device=device)
    return ResetRollouts(ro, rewards, suffix_start, prompt_of_row, {}), rows


def collect_rollouts(model, tokenizer, task, batches, dist, args, rng: random.Random):
    """Steps 1-2 of srpo.py: the next prompt batch (this rank's share) and its trajectories in at
    most four generate calls, each batched over the step's prompts (docs/srpo.md, "Batched
    stages"): (1) the first fresh chains; (2) the remaining search with (random, oracle: reset
    points need no model call) the continuations of the parents found so far; (3) SRPO's
    localization; (4) the other continuations. Returns the trained rows as ResetRollouts
    (rollouts, rewards, suffix_start, prompt_of_row, info: the reset/* metrics). FSDP: on the full
    weights, so ranks may make different numbers of generate calls."""
    examples = dist.shard(next(batches))
    delim, max_new = args.thought_delimiter, args.max_new_tokens
    reserve = (
        min(THOUGHT_TOKENS, max_new // 20) if args.thought_reserve is None else args.thought_reserve
    )

    def cut(ids, text, budget, truncated):  # the official stops, after the fact
        continuation = budget[1] < max_new
        return protocol_cut(tokenizer, ids, text, delim, *budget, reserve, truncated, continuation)

    split = functools.partial(split_thoughts, delimiter=delim)
    sampler = chains.Sampler(model, tokenizer, task, args, cut, split, THOUGHT_TOKENS)
    max_pos = getattr(model.config, "max_position_embeddings", None) or 10**9
    search = {e.id: Search() for e in examples}
    n_parents, K, n_base = split_sizes(args)
    first = {e.id: (n_parents + n_base, 0) for e in examples}  # (1) the first parents and bases
    with dist.gathered(model):  # FSDP: full weights, so ranks may sample different rounds
        sample_chains(sampler, search, examples, first, args)
        early = []  # random, oracle: reset points need no model call
        if args.reset != "self":
            early = reset_points(sampler, task, search, examples, args, rng, max_pos)
        sfx = more_search(sampler, search, examples, args, suffixes(sampler, early, K, args))  # (2)
        rest = [e for e in examples if all(e is not c.example for c in early)]
        later = reset_points(sampler, task, search, rest, args, rng, max_pos)  # (3) --reset self
        sfx += sampler.sample(*suffixes(sampler, later, K, args))  # (4)
        resets, rows = settle(model, sampler, task, examples, search, early + later, sfx, args)
    tried, cuts = sum(st.tried for st in search.values()), early + later  # LOGS: reset/*
    logs = chains.reset_metrics(cuts, rows, examples, tried, args.success_threshold)  # LOGS
    return resets._replace(info=sampler.info | logs)


def validate(args: Args) -> Args:
    """SRPO's own checks (cli.parse runs the shared ones): one line naming the flag, exit code 2.
    Fills the task's default --thought-delimiter."""
    unused = dict.fromkeys(
        ["dynamic_sampling", "max_sampling_rounds"], "its groups come from resets"
    )
    shaping = "its rewards are the task's (no shaping)"
    unused |= dict.fromkeys(["overlong_buffer", "overlong_penalty_factor"], shaping)
    unused["scale_rewards"] = "it z-scores each normalization group with its population std, no eps"
    for name, why in unused.items():
        flag = "--" + name.replace("_", "-")
        cli.need(
            getattr(args, name) == getattr(cli.BaseArgs, name),
            f"{flag} does not apply to srpo.py: {why}",
        )
    g = args.num_generations  # ALGO LOGIC: half fresh chains, half continuations, each >= 1
    cli.need(
        g >= 2 and g % 2 == 0, f"--num-generations must be a multiple of 2 (at least 2), got {g}"
    )
    ranges = dict(max_fresh_attempts=">= 1", localization_temperature=">= 0")
    cli.need_ranges(args, **ranges, localization_max_new_tokens=">= 1", thought_reserve=">= 0")
    cli.need(args.thought_delimiter != "", "--thought-delimiter must not be empty")
    no_oracle = f"--reset oracle needs a task with a first-wrong-step oracle (arith), not --task {args.task}"
    cli.need(args.reset != "oracle" or args.task == "arith", no_oracle)
    default = "\n" if args.task == "arith" else "\n\n"
    return dataclasses.replace(args, thought_delimiter=args.thought_delimiter or default)


if __name__ == "__main__":
    # TRY NOT TO MODIFY: flags, torchrun, seeding; the task, the model, its reference, the optimizer
    args = cli.parse(Args, validate, "srpo_ablations")  # tyro.cli(Args), every check before loading
    run = common.Run(args)
    tokenizer = common.load_tokenizer(args.model)
    task = common.load_task(args, tokenizer)  # before the model: an empty task stops at once
    model = common.load_model(args.model, run.device, run.dtype, args.gradient_checkpointing)
    model = common.with_lora(model, args)  # --lora-rank: LoRA adapters train, the base is frozen
    ref_model = common.reference(model, args) if args.beta > 0 else None  # LoRA: adapters off
    train_model = run.dist.wrap(model, ref_model)  # DDP / FSDP2; bf16: fp32 masters (precision.py)
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = common.adamw(params, args)  # mixed precision: it steps the fp32 masters
    rng = random.Random(args.seed)  # ALGO LOGIC: RRPO's reset draws (checkpointed as "resets")
    run.start(model, tokenizer, optimizer, task, state={"resets": rng})
    dist = run.dist
    dist.uneven = True  # torchrun: a rank's rows are its prompts' resets (FSDP evens the passes)
    ablation = args.ablation_module  # its flags given: methods/srpo_ablations.py (docs/srpo.md)

    for step in run.steps():
        # 1-2. ALGO LOGIC: rollouts with resets (fresh chains, parent search, localization,
        #      suffixes) and their rewards
        resets = collect_rollouts(model, tokenizer, task, run.batches, dist, args, rng)
        ro, rewards = resets.rollouts, resets.rewards  # ResetRollouts: the rest by name below
        mask = ro.completion_mask  # [N, T]
        if args.mask_truncated_completions:  # DAPO's overlong filtering
            mask = mask * ~ro.truncated[:, None]
        T = mask.shape[1]
        run.lap("generation")

        # 3. ALGO LOGIC: credit assignment. Each normalization group z-scored alone (population
        #    std); the kept prefixes masked (only the resampled suffix trains).
        advantages = srpo_advantages(rewards, ro.group_ids.cpu())  # [N]
        token_adv = advantages.to(run.device)[:, None].expand(-1, T)  # [N, T]
        suffix = suffix_mask(mask, resets.suffix_start)  # [N, T]
        mask = suffix if ablation is None else ablation.trained(args, mask, suffix)  # --no-mask
        run.credit_signals(reset_at=resets.suffix_start, prompt_ids=resets.prompt_of_row)  # LOGS

        # 4. old and reference log-probs (no gradient). On-policy (one pass, one mini-batch) the
        #    old log-probs are the current ones, detached; otherwise this pass makes them.
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad(), dist.gathered_if_uneven(model, ref_model):  # FSDP, uneven rows
            on_policy = args.num_iterations == 1 and args.num_minibatches == 1
            old_logp = None
            if not on_policy:
                old_logp = common.token_logprobs(model, input_ids, attn, T, args.temperature)[0]
            ref_logp = None
            if ref_model is not None:
                ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0]
        run.lap("logprobs")

        # 5. update: mu passes; each splits the batch into mini-batches of whole prompts, one
        #    optimizer step each, in micro-batches (the loss is normalized over the mini-batch)
        stats = common.UpdateStats(mask, args.num_iterations)
        for it in range(args.num_iterations):
            for rows in common.minibatches(resets.prompt_of_row, args.num_minibatches):  # prompts
                optimizer.zero_grad(set_to_none=True)
                num_tokens, num_seqs = dist.loss_counts(mask[rows])  # global counts / world size
                agg = (args.loss_agg, args.max_new_tokens, num_tokens, num_seqs)
                micro = rows.split(args.micro_batch_size)
                for mb in dist.micro_batches(train_model, micro):  # all-reduce in the last
                    m = mask[mb].float()
                    batch = (input_ids[mb], attn[mb], T, args.temperature)
                    logp, entropy = common.token_logprobs(train_model, *batch, with_entropy=it == 0)
                    run.watch_credit(logp, mb, m, num_tokens, num_seqs)  # LOGS: --log-credit
                    old = old_logp[mb] if old_logp is not None else logp.detach()
                    # ALGO LOGIC: REINFORCE on the suffix (no ratio, no clip)
                    log_ratio = (logp - old).clamp(-common.MAX_LOG_RATIO, common.MAX_LOG_RATIO)
                    ratio = torch.exp(log_ratio)  # 1 on-policy (the clip fractions read it)
                    A = token_adv[mb]
                    surrogate = logp * A
                    if ablation is not None:  # --clip: PPO's clipped surrogate, verl's dual clip
                        surrogate = ablation.surrogate(args, surrogate, ratio, A)
                    per_token_loss = -surrogate
                    # vLLM rollouts: importance weights toward the engine's sampling (HF: 1)
                    engine_w = common.engine_correction(ro, mb, old, m, args, stats, it)
                    per_token_loss = per_token_loss * engine_w
                    kl = None  # KL(pi || pi_ref), k3, with --beta > 0
                    if ref_logp is not None:
                        kl = common.k3_kl(logp, ref_logp[mb])
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = common.aggregate_loss(per_token_loss, m, *agg)
                    run.stop_if_nonfinite(loss, "loss")
                    loss.backward()
                    stats.add(m, ratio, A, args.epsilon, args.epsilon_high, entropy, kl, loss)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                run.stop_if_nonfinite(grad_norm, "gradient norm")
                optimizer.step()
                stats.step(grad_norm)
        run.lap("update")

        # 6. TRY NOT TO MODIFY: metrics, evaluation, logging, checkpoint, Ctrl-C; LOGS: reset/*
        info = resets.info
        extra = {f"reset/{k}": v for k, v in info.items() if k != "time_localization"}
        extra["time/localization"] = info["time_localization"]
        extra["sampling/generated_tokens"] = info["generated_tokens"]
        run.end_step(step, ro, rewards, stats, extra)

    run.finish()

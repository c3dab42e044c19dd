"""SRPO / RRPO: reset a failed rollout at its first wrong step and learn from resampled suffixes.

Of each prompt's 8 trajectories, 4 are fresh chains (the base group); the other 4 continue a failed
"parent" chain from just before its first erroneous thought. SRPO asks the policy itself which
thought was first wrong (`--reset self`), RRPO picks it uniformly (`--reset random`), and
`--reset oracle` uses the task's exact first wrong step (the built-in arith task has one). Each group
is z-scored on its own; the loss is REINFORCE on suffix tokens only (the shared prefix is masked).
Paper: Samanta et al. 2026, arXiv 2605.25507. Docs: docs/srpo.md.

Project simplification: thought boundaries are found by splitting each fully generated response on
`--thought-delimiter` and applying the official chain's stops after the fact (cut after the thought holding
`\\boxed{`, at most 20 thoughts): the same sampling distribution as one call per thought as long as no thought
runs past the official 256-token cap (such thoughts are counted in reset/long_thoughts, not split).

    python srpo.py                        # SRPO on the bundled tiny model and the built-in task
    python srpo.py --reset random         # RRPO
"""

import copy
import dataclasses
import os
import random
import re
import time
from pathlib import Path
from typing import Literal

import torch
from tqdm import trange

import common
from rlvr_utils import arith, checkpoints, cli, distributed, engines, tasks
from rlvr_utils.rewards import last_boxed


@dataclasses.dataclass
class Args:
    exp_name: str = "srpo"
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment (prompts, sampling, initialization)"""
    track: bool = False
    """log to Weights & Biases as well as TensorBoard (needs pip install wandb)"""
    wandb_project: str = "credit-rlvr"
    """wandb project name (with --track)"""
    output_dir: str = "runs"
    """logs, metrics.jsonl and checkpoints go to <output-dir>/<run-name>/"""
    save_model: bool = False
    """save the final policy as a Hugging Face directory <output-dir>/<run-name>/model (atomic write)"""
    save_every: int = 0
    """write a resumable checkpoint (<run-dir>/checkpoint: model, optimizer, RNG states, data position) every this
    many steps and at the end; 0: only when the run is stopped with Ctrl-C"""
    resume: str | None = None
    """continue the run in this run directory from its checkpoint, with the flags it was started with (--total-steps may grow)"""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype: auto is bfloat16 on cuda, float32 on cpu"""
    threads: int = 0
    """torch CPU threads (0: torch's default, one per core)"""

    # model and task
    model: str = common.DEFAULT_MODEL
    """Hugging Face hub id or local directory of the policy; the default is the bundled tiny model"""
    task: Literal["arith", "gsm8k", "math", "code"] = "arith"
    """arith (built in), gsm8k, math, or code (HumanEval-style unit tests run in a sandbox; reward = fraction passed)"""
    data_path: str | None = None
    """local jsonl/json/parquet training file instead of the hub dataset (gsm8k, math, code; code also .jsonl.gz)"""
    eval_data_path: str | None = None
    """local eval file; without it the first --num-eval training rows are held out"""
    arith_steps: int = 4
    """arith: operations per problem"""
    arith_max_value: int = 99
    """arith: running values stay in [0, this]"""
    arith_max_operand: int = 9
    """arith: operands are drawn from [1, this]"""
    code_timeout: float = 5.0
    """code task: wall-clock seconds for one program's whole test run (also its CPU-time limit)"""
    max_prompt_length: int = 1024
    """prompts longer than this (tokens) are skipped and counted"""

    # rollouts
    total_steps: int = 150
    """training steps; each samples a new batch of prompts and makes num-iterations x num-minibatches optimizer steps"""
    prompts_per_step: int = 8
    """prompts per step (the global batch: across all torchrun ranks, divisible by their number); each gets --num-generations trained trajectories"""
    num_generations: int = 8
    """trained trajectories per prompt (the paper's budget of 8), split as --split says"""
    max_new_tokens: int = 48
    """response length cap (tokens), prefix included for continuations"""
    temperature: float = 1.0
    """sampling temperature; log-probs use the same temperature"""
    top_p: float = 1.0
    """nucleus sampling (1.0 = off; truncated sampling biases the ratio)"""
    top_k: int = 0
    """top-k sampling (0 = off)"""
    gen_batch_size: int = 64
    """sequences per generate() call"""
    mask_truncated_completions: bool = False
    """completions that hit --max-new-tokens get no loss (DAPO's overlong filtering)"""

    # ALGO LOGIC: resets
    reset: Literal["self", "random", "oracle"] = "self"
    """where to reset a failed parent: self (SRPO, the policy localizes), random (RRPO), oracle (task's first error)"""
    split: Literal["1x4", "2x4", "1x8"] = "1x4"
    """1x4: 4 fresh + 4 suffixes of one parent; 2x4: 2 parents x 4 suffixes; 1x8: 1 parent x 8 suffixes"""
    max_fresh_attempts: int = 12
    """fresh chains sampled per prompt while looking for failed parents; none found: plain GRPO on fresh chains"""
    thought_delimiter: str | None = None
    """string that ends a thought (default: a newline for arith, a blank line for gsm8k/math)"""
    localization_temperature: float = 0.3
    """sampling temperature of the self-localization call (the paper's default)"""
    localization_max_new_tokens: int | None = None
    """token cap of the localization reply (default: 192 for arith, enough for the tiny model's reply to 6 steps; 4096 otherwise)"""
    clip: bool = False
    """ablation: PPO-clipped surrogate with dual-clip 3 instead of plain REINFORCE; the official ablation also used
    --loss-agg token-mean --num-minibatches 4 (several optimizer steps per batch, so the ratio leaves 1)"""
    no_mask: bool = False
    """ablation: train continuations on prefix tokens too (unmasked)"""

    # optimization
    learning_rate: float = 1e-4
    """AdamW learning rate (constant). The default suits the tiny model; use ~1e-6 for 1B+ models"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_iterations: int = 1
    """mu: passes over each batch (with one mini-batch and mu = 1 the update is on-policy: the ratio is exactly 1)"""
    num_minibatches: int = 1
    """each pass splits the batch into this many mini-batches of whole prompts, one optimizer step each (CleanRL's
    name; DAPO/verl: 4); only the first step is on-policy, so the ratio leaves 1 and clipping acts"""
    epsilon: float = 0.2
    """lower clip (with --clip): the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: float | None = None
    """upper clip (with --clip); default: same as --epsilon"""
    beta: float = 0.0
    """k3 KL coefficient to the frozen initial policy (0: no reference model is loaded; the paper uses 0)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """token-mean (DAPO), seq-mean-token-mean (the paper's), seq-mean-token-sum-norm (Dr. GRPO)"""
    micro_batch_size: int = 16
    """sequences per forward/backward (gradient accumulation; the loss is normalized over the whole mini-batch)"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer's activations in the backward (non-reentrant) instead of storing them: trades
    about a third more update time for much less GPU memory on long completions (the README's GPU commands use it)"""

    # evaluation
    eval_every: int = 25
    """steps between evaluations (0 = only at the start and end)"""
    num_eval: int = 200
    """held-out prompts per evaluation"""
    eval_temperature: float = 0.0
    """0 = greedy pass@1"""

    # rollout engine
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """hf (transformers generate), vllm (a colocated vLLM engine synced after every optimizer step), or auto:
    vllm when it is importable and a GPU is present, else hf"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (on CPU: of host memory)"""
    vllm_is_cap: float = 0.0
    """truncated importance-sampling correction min(pi_old / pi_vllm, cap) per token; 0 = off"""

    # several processes: torchrun --nproc_per_node N <script> ... (docs/scaling.md)
    fsdp: bool = False
    """under torchrun: shard the policy (and reference) with FSDP2 fully_shard instead of DDP"""
    dist_timeout: int = 1800
    """seconds a collective waits for the other ranks before the run stops with an error"""


MAX_THOUGHTS, THOUGHT_TOKENS = 20, 256  # the official chain: at most 20 thoughts; thoughts over 256 tokens are counted
DUAL_CLIP = (
    3.0  # --clip: verl's dual-clip constant in the official srpo_clip loss (a negative-advantage token's loss <= 3|A|)
)
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


def reset_index(
    mode: str,
    num_thoughts: int,
    rng: random.Random | None = None,
    reply: str | None = None,
    oracle_step: int | None = None,
) -> int:
    """1-based index k of the thought to resample from (the prefix keeps thoughts 1..k-1).

    self: parse_error_step(reply); random: uniform on 1..num_thoughts (RRPO); oracle: the task's first
    wrong step (None, i.e. no wrong thought found, gives the last thought). Clamped to [1, num_thoughts].
    """
    if mode == "self":
        return parse_error_step(reply or "", num_thoughts)
    if mode == "random":
        return (rng or random).randint(1, num_thoughts)
    if mode == "oracle":
        return min(max(oracle_step if oracle_step is not None else num_thoughts, 1), num_thoughts)
    raise ValueError(f"unknown reset mode {mode!r}: choose self, random or oracle")


def suffix_mask(completion_mask: torch.Tensor, suffix_start: torch.Tensor) -> torch.Tensor:
    """completion_mask [B, T] restricted to positions t >= suffix_start[b] (the trained suffix)."""
    T = completion_mask.shape[1]
    return completion_mask * (torch.arange(T, device=completion_mask.device)[None, :] >= suffix_start[:, None])


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


def protocol_cut(tokenizer, ids: list[int], text: str, delimiter: str, max_thoughts: int = MAX_THOUGHTS) -> list[int]:
    """The official chain's stopping rules applied to a response generated in one call (the official code's protocol, docs/srpo.md): it ends after
    the first thought that contains `\\boxed{` and after `max_thoughts` thoughts. Returns the kept token ids."""
    starts = thought_starts(text, delimiter)
    ends = [text.find(delimiter, s) if text.find(delimiter, s) >= 0 else len(text) for s in starts]
    last = next((i for i, (s, e) in enumerate(zip(starts, ends)) if "\\boxed{" in text[s:e]), len(starts) - 1)
    last = min(last, max_thoughts - 1)
    if last < 0 or last == len(starts) - 1:
        return ids  # nothing after the last kept thought but its own end
    return ids[: tokens_before(tokenizer, ids, ends[last])]


def collect_rollouts(model, tokenizer, task, examples, args, rng: random.Random):
    """Fresh chains, parent search, localization and suffix sampling for one step, each stage batched over the step's
    prompts, in at most four generate calls: (1) the first fresh chains of every prompt; (2) for the prompts still
    without their parents, every remaining attempt plus the fresh chains a fallback group would need, and (random and
    oracle resets) the continuations of the parents found so far; (3) SRPO's localization of every parent; (4) the
    continuations not sampled yet. Chains are used in sampling order, so the result is the sequential protocol's;
    chains drawn after a prompt was settled are surplus (counted in the generated tokens, never trained on).

    Returns common.Rollouts of the trained trajectories (group_ids = normalization groups), rewards [N], suffix_start
    [N] in response-token coordinates, prompt_of_row [N] (the example id of each row) and an info dict for the logs.
    Parents are never among the returned trajectories.
    """
    n_parents = 2 if args.split == "2x4" else 1
    K = args.num_generations if args.split == "1x8" else args.num_generations // 2  # suffixes per parent
    n_base = args.num_generations - n_parents * K
    delim, max_new = args.thought_delimiter, args.max_new_tokens
    info = {
        k: 0
        for k in (
            "loc_empty",
            "loc_no_error",
            "loc_out_of_range",
            "loc_unparsable",
            "loc_truncated",
            "parent_one_thought",
            "prefix_overflow",
            "generated_tokens",
            "fresh_chains",
            "long_thoughts",
            "oracle_early_stop",
            "generate_calls",
        )
    }
    max_pos = getattr(model.config, "max_position_embeddings", None) or 10**9

    def sample(prompts, max_new_tokens, temperature=args.temperature, budgets=None):
        """One generate call, one completion per prompt; each response cut by the protocol, with its text and reward.
        budgets: thoughts each response may still add (default MAX_THOUGHTS; a continuation's prefix counts)."""
        if not prompts:
            return []
        budgets = budgets or [MAX_THOUGHTS] * len(prompts)
        ro = common.generate_rollouts(
            model,
            tokenizer,
            prompts,
            list(range(len(prompts))),
            1,
            max_new_tokens,
            temperature,
            args.top_p,
            args.top_k,
            batch_size=args.gen_batch_size,
        )
        info["generated_tokens"] += int(ro.completion_mask.sum())
        info["generate_calls"] += 1
        out = []
        for i in range(len(ro)):
            ids = ro.completion_ids[i][ro.completion_mask[i].bool()].tolist()
            cut = protocol_cut(tokenizer, ids, ro.texts[i], delim, budgets[i])
            out.append((cut, ro.texts[i] if len(cut) == len(ids) else tokenizer.decode(cut, skip_special_tokens=True)))
            if len(ids) > THOUGHT_TOKENS:  # the official loop closes a thought at 256 tokens; here they are counted
                info["long_thoughts"] += sum(
                    len(tokenizer(t, add_special_tokens=False).input_ids) > THOUGHT_TOKENS
                    for t in split_thoughts(out[-1][1], delim)
                )
        return out

    def budget(prefix_ids):  # the official chain stops at 20 thoughts in all, the kept prefix's included
        return max(MAX_THOUGHTS - len(split_thoughts(tokenizer.decode(prefix_ids, skip_special_tokens=True), delim)), 1)

    def scored(chains, owners):
        return [(ids, text, r) for (ids, text), r in zip(chains, task.rewards([c[1] for c in chains], owners))]

    def assign(st, chains) -> None:
        """The official order: a failed chain with >= 1 thought is a parent while parents are missing, any other chain
        fills the base group while it has room; a chain drawn after the prompt is settled is surplus."""
        for ids, text, r in chains:
            if len(st["parents"]) == n_parents and len(st["base"]) == n_base or st["tried"] >= args.max_fresh_attempts:
                break
            st["tried"] += 1
            st["seen"].append((ids, text, r))
            if split_thoughts(text, delim) and r < 1.0 and len(st["parents"]) < n_parents:
                st["parents"].append((ids, text, r))
            elif len(st["base"]) < n_base:
                st["base"].append((ids, text, r))

    def reset_point(e, parent, reply=None):
        """(k, thoughts, prefix ids) of a parent; the oracle's k is logged against whatever chose it."""
        th = split_thoughts(parent[1], delim)
        oracle = arith.arith_first_error(e.question, parent[1]) if task.name == "arith" else None
        if reply is not None:
            kind = localization_reply_kind(reply, len(th))
            if kind != "ok":
                info["loc_" + kind] += 1
        k = reset_index(args.reset, len(th), rng, reply, oracle)
        n_prefix = prefix_token_count(tokenizer, parent[0], parent[1], k, delim)
        if len(e.prompt_ids) + n_prefix >= max_pos - 1:  # the prefix fills the context window: reset to the start
            info["prefix_overflow"] += 1
            k, n_prefix = 1, 0
        info["parent_one_thought"] += len(th) == 1
        if task.name == "arith":
            info["oracle_early_stop"] += oracle is not None and oracle > len(th)  # every line right, stopped early
            resets.append((k, len(th), min(max(oracle or len(th), 1), len(th))))
        else:
            resets.append((k, len(th), None))
        return parent[0][:n_prefix]

    # 1. the first fresh chains of every prompt
    state = {e.id: {"parents": [], "base": [], "tried": 0, "seen": []} for e in examples}
    first = n_parents + n_base
    chains = scored(
        sample([e.prompt_ids for e in examples for _ in range(first)], max_new),
        [e for e in examples for _ in range(first)],
    )
    for i, e in enumerate(examples):
        assign(state[e.id], chains[i * first : (i + 1) * first])
    settled = lambda e: len(state[e.id]["parents"]) == n_parents  # noqa: E731
    pending = [e for e in examples if not settled(e) and state[e.id]["tried"] < args.max_fresh_attempts]

    # 2. the pending prompts' remaining attempts and spare fresh chains for their fallback groups, together with the
    #    continuations of the parents found so far when the reset point needs no model call (random, oracle)
    resets, continued = [], []  # (k, thoughts, oracle k) per parent; (example, parent index, prefix) with suffixes
    t_loc = 0.0
    if args.reset != "self":
        continued = [
            (e, j, reset_point(e, p)) for e in examples if settled(e) for j, p in enumerate(state[e.id]["parents"])
        ]
    spare = args.num_generations - (n_base if args.split == "1x4" else 0)  # what a fallback group may need
    extra = {e.id: (args.max_fresh_attempts - state[e.id]["tried"], spare) for e in pending}
    cont_prompts = [e.prompt_ids + pre for e, _, pre in continued for _ in range(K)]
    search = [e for e in pending for _ in range(sum(extra[e.id]))]
    cont_budgets = [budget(pre) for _, _, pre in continued for _ in range(K)]
    chains = sample(
        cont_prompts + [e.prompt_ids for e in search], max_new, budgets=cont_budgets + [MAX_THOUGHTS] * len(search)
    )
    suffixes = chains[: len(cont_prompts)]
    found = scored(chains[len(cont_prompts) :], search)
    for e in pending:
        n_search, n_spare = extra[e.id]
        assign(state[e.id], found[:n_search])
        state[e.id]["spare"], found = found[n_search : n_search + n_spare], found[n_search + n_spare :]
    info["fresh_chains"] = sum(st["tried"] for st in state.values())

    # 3. reset points of the remaining parents: SRPO's self-localization, one call for all of them
    todo = [
        (e, j, p)
        for e in examples
        if settled(e)
        for j, p in enumerate(state[e.id]["parents"])
        if not any(c[0] is e and c[1] == j for c in continued)
    ]
    replies = [None] * len(todo)
    if args.reset == "self" and todo:
        t0 = time.time()
        loc_prompts = []
        for e, _, p in todo:
            th = split_thoughts(p[1], delim)
            if task.name == "arith" and not tasks.has_chat_template(tokenizer):
                plain = arith.arith_localization_prompt(arith.parse_arith_problem(e.question), th)
            else:
                steps = "\n".join(f"Step {i}: {t}" for i, t in enumerate(th, 1))
                plain = LOCALIZATION_PROMPT.format(question=e.question, steps=steps, n=len(th))
            loc_prompts.append(tasks.encode_prompt(tokenizer, tasks.render_prompt(tokenizer, plain, plain)))
        cap = args.localization_max_new_tokens or (192 if task.name == "arith" else 4096)
        ro = common.generate_rollouts(
            model,
            tokenizer,
            loc_prompts,
            list(range(len(loc_prompts))),
            1,
            cap,
            max(args.localization_temperature, 1e-5),
            args.top_p,
            args.top_k,
            batch_size=args.gen_batch_size,
        )
        info["generated_tokens"] += int(ro.completion_mask.sum())
        info["generate_calls"] += 1
        replies, info["loc_truncated"] = ro.texts, int(ro.truncated.sum())  # a cut-off reply usually parses to step 1
        t_loc = time.time() - t0
    info["time_localization"] = t_loc
    later = [(e, j, reset_point(e, p, reply)) for (e, j, p), reply in zip(todo, replies)]

    # 4. the remaining continuations (prompt + prefix, same sampling settings), then the training rows: base chains,
    #    K continuations per parent (cut to the response budget, prefix included), or a fallback group
    suffixes += sample(
        [e.prompt_ids + pre for e, _, pre in later for _ in range(K)],
        max_new,
        budgets=[budget(pre) for _, _, pre in later for _ in range(K)],
    )
    rows = []  # (example, response ids, suffix_start, group key, reward)
    new = [
        (e, pre + s[0][: max(max_new - len(pre), 1)], len(pre), (e.id, "reset", j))
        for i, (e, j, pre) in enumerate(continued + later)
        for s in suffixes[i * K : (i + 1) * K]
    ]
    texts = [tokenizer.decode(r[1], skip_special_tokens=True) for r in new]
    rows += [r + (reward,) for r, reward in zip(new, task.rewards(texts, [r[0] for r in new]))]
    for e in examples:
        st = state[e.id]
        if settled(e):
            rows += [(e, c[0], 0, (e.id, "base"), c[2]) for c in st["base"]]
            continue
        if args.split == "1x8":  # official 1x8 fallback: GRPO on the chains sampled so far (then fresh ones if short)
            kept = st["seen"][: args.num_generations]
        else:  # official fallback: the base chains (1x4) or the failures found (2x4), topped up with fresh chains
            kept = st["base"][:n_base] if args.split == "1x4" else st["parents"]
        kept = kept + st.get("spare", [])[: args.num_generations - len(kept)]
        rows += [(e, c[0], 0, (e.id, "fresh"), c[2]) for c in kept]
    parents = continued + later
    ks = [(k, n) for k, n, _ in resets]
    oracle_ks = [o for _, _, o in resets if o is not None]

    # 4. the trained batch, one group id per normalization group (base, each reset group, or the fallback)
    keys, device = {}, next(model.parameters()).device
    rows.sort(key=lambda r: [e.id for e in examples].index(r[0].id))  # each prompt's rows together (stable)
    ro = common.make_rollouts(
        tokenizer,
        [r[0].prompt_ids for r in rows],
        [r[1] for r in rows],
        [keys.setdefault(r[3], len(keys)) for r in rows],
        common.stop_token_ids(model, tokenizer),
        device,
    )
    rewards = torch.tensor([r[4] for r in rows], dtype=torch.float32)
    suffix_start = torch.tensor([r[2] for r in rows], device=device)
    prompt_of_row = torch.tensor([r[0].id for r in rows], device=device)
    reset_rewards = [r[4] for r in rows if r[3][1] == "reset"]
    info.update(
        normalized_position=sum((k - 1) / n for k, n in ks) / len(ks) if ks else 0.0,
        correction_rate=sum(reset_rewards) / len(reset_rewards) if reset_rewards else 0.0,
        suffix_pass_at_k=(
            sum(max(r[4] for r in rows if r[3] == key) >= 1.0 for key in keys if key[1] == "reset")
            / max(1, len(parents))
        ),
        fallback_share=sum(any(r[3] == (e.id, "fresh") for r in rows) for e in examples) / len(examples),
        num_parents=len(parents),
    )
    if oracle_ks:
        info["oracle_exact"] = sum(k == o for (k, _), o in zip(ks, oracle_ks)) / len(ks)
        info["oracle_within_1"] = sum(abs(k - o) <= 1 for (k, _), o in zip(ks, oracle_ks)) / len(ks)
        info["oracle_after"] = sum(k > o for (k, _), o in zip(ks, oracle_ks)) / len(
            ks
        )  # the kept prefix holds the error
    return ro, rewards, suffix_start, prompt_of_row, info


def validate(args: Args) -> Args:
    """Every flag checked before anything loads: a user error ends with one line naming the flag, exit code 2."""
    args = cli.resume_args(args, Args) if args.resume else args
    cli.check_common(args)
    need_g = {"1x4": 2, "2x4": 4, "1x8": 2}[
        args.split
    ]  # ALGO LOGIC: the split's groups must each hold >= 2 trajectories
    cli.need(
        args.num_generations >= need_g and args.num_generations % need_g == 0,
        f"--num-generations must be a multiple of "
        f"{need_g} (at least {need_g}) for --split {args.split}, got {args.num_generations}",
    )
    cli.need(
        args.max_fresh_attempts >= 1 and args.localization_temperature >= 0,
        f"need --max-fresh-attempts >= 1 (got "
        f"{args.max_fresh_attempts}) and --localization-temperature >= 0 (got {args.localization_temperature})",
    )
    cli.need(args.thought_delimiter != "", "--thought-delimiter must not be empty")
    cli.need(
        not (args.fsdp and int(os.environ.get("WORLD_SIZE", "1")) > 1),
        "srpo.py does not support --fsdp yet (its sampling "
        "rounds differ in size per rank): use DDP, the default under torchrun",
    )
    cli.need(
        args.reset != "oracle" or args.task == "arith",
        f"--reset oracle needs a task with a first-wrong-step oracle (arith), not --task {args.task}",
    )
    delimiter = (
        args.thought_delimiter if args.thought_delimiter is not None else "\n" if args.task == "arith" else "\n\n"
    )
    return dataclasses.replace(
        args, epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high, thought_delimiter=delimiter
    )


if __name__ == "__main__":
    args = validate(cli.parse(Args))  # tyro.cli(Args), its errors on one line
    cli.set_threads(args.threads)
    run_dir = Path(
        args.resume or Path(args.output_dir) / f"{args.task}__{args.exp_name}__{args.seed}__{int(time.time())}"
    )

    # seeding, model, task; a resumed run then restores its checkpoint into them
    dist, device = distributed.init_distributed(
        args.device, vars(args), args.prompts_per_step, args.dist_timeout, args.fsdp
    )
    common.seed_everything(args.seed + dist.rank)  # per-rank sampling; every rank draws the same global prompt batches
    rng = random.Random(args.seed)  # ALGO LOGIC: RRPO's reset draws
    model, tokenizer = common.load_policy(args.model, device, args.dtype, args.gradient_checkpointing)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.beta > 0 else None
    train_model = dist.wrap(model, ref_model)  # DDP / FSDP2 under torchrun; the model itself otherwise
    task = tasks.load_task(
        args.task,
        tokenizer,
        seed=args.seed,
        num_eval=args.num_eval,
        data_path=args.data_path,
        eval_data_path=args.eval_data_path,
        max_prompt_length=args.max_prompt_length,
        arith_steps=args.arith_steps,
        arith_max_value=args.arith_max_value,
        arith_max_operand=args.arith_max_operand,
        code_timeout=args.code_timeout,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    batches = checkpoints.CountingBatches(lambda: common.prompt_batches(task.train, args.prompts_per_step, args.seed))
    ckpt, stop = checkpoints.Checkpointer(run_dir, args.save_every, dist), checkpoints.GracefulStop()
    start = ckpt.restore(model, optimizer, batches, {"resets": rng}) if args.resume else 0
    engines.attach_engine(
        args.engine, model, optimizer, args.model, args.vllm_gpu_memory_utilization, seed=args.seed + dist.rank
    )
    logger = common.Logger(run_dir, vars(args), args.track, args.wandb_project, enabled=dist.main, resume_step=start)
    dist.print(
        f"run {run_dir.name}: logs in {run_dir}/ (tensorboard --logdir {run_dir.parent}); {len(task.train)} train / "
        f"{len(task.eval)} eval prompts; skipped {task.skipped}" + (f"; resumed after step {start}" if start else "")
    )
    G = args.num_generations

    if not start:  # a resumed run has its evaluations in its metrics.jsonl already
        logger.log(
            common.evaluate(
                model, tokenizer, task, args.max_new_tokens, args.gen_batch_size, args.eval_temperature, dist
            ),
            0,
        )
    eval_metrics = metrics = logger.last_eval
    bar = trange(
        start + 1,
        args.total_steps + 1,
        initial=start,
        total=args.total_steps,
        desc=f"srpo[{args.reset}]",
        dynamic_ncols=True,
        disable=not dist.main,
    )
    for step in bar:
        # 1-2. ALGO LOGIC: rollouts with resets (fresh chains, parent search, localization, suffixes) and rewards
        t0 = time.time()
        common.reset_peak_memory(device)
        examples = dist.shard(next(batches))
        ro, rewards, suffix_start, prompt_of_row, reset_info = collect_rollouts(
            model, tokenizer, task, examples, args, rng
        )
        mask = ro.completion_mask * ~ro.truncated[:, None] if args.mask_truncated_completions else ro.completion_mask
        T = mask.shape[1]
        t_gen = time.time() - t0

        # 3. ALGO LOGIC: credit assignment. Each normalization group (base, each reset group, or the fallback
        #    group) is z-scored on its own with the population std; the shared prefix is masked out.
        advantages = common.group_advantages(
            rewards, None, "group", eps=0.0, group_ids=ro.group_ids.cpu(), unbiased=False
        ).to(device)
        token_adv = advantages[:, None].expand(-1, T)  # [N, T]
        mask = mask if args.no_mask else suffix_mask(mask, suffix_start)

        # 4. old and reference log-probs (no gradient). On-policy (one pass, one mini-batch) the old log-probs are the
        #    current ones detached; otherwise only the first optimizer step is on-policy and they need this pass.
        t0 = time.time()
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad():
            on_policy = args.num_iterations == 1 and args.num_minibatches == 1
            old_logp = None if on_policy else common.token_logprobs(model, input_ids, attn, T, args.temperature)[0]
            ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0] if ref_model else None
        t_logp = time.time() - t0

        # 5. update: mu passes; each splits the batch into mini-batches of whole prompts, one optimizer step each,
        #    computed in micro-batches (the loss is normalized over the mini-batch, so accumulation changes nothing)
        t0 = time.time()
        stats = common.UpdateStats(mask, args.num_iterations)
        for it in range(args.num_iterations):
            for rows in common.minibatches(
                prompt_of_row, args.num_minibatches
            ):  # ALGO LOGIC: mini-batches of whole prompts
                optimizer.zero_grad(set_to_none=True)
                num_tokens, num_seqs = dist.loss_counts(mask[rows])  # global counts / world size
                micro = rows.split(args.micro_batch_size)
                for k, mb in enumerate(micro):
                    dist.sync_grads(train_model, k == len(micro) - 1)  # all-reduce once per optimizer step
                    m = mask[mb].float()
                    logp, entropy = common.token_logprobs(
                        train_model, input_ids[mb], attn[mb], T, args.temperature, with_entropy=it == 0
                    )
                    old = old_logp[mb] if old_logp is not None else logp.detach()
                    # ALGO LOGIC: REINFORCE (no ratio, no clip); --clip: the PPO-clipped surrogate with dual-clip 3 (verl's)
                    ratio = torch.exp(
                        torch.clamp(logp - old, -common.MAX_LOG_RATIO, common.MAX_LOG_RATIO)
                    )  # fp32; clamped as verl
                    A = token_adv[mb]
                    if args.clip:
                        surrogate = torch.min(
                            ratio * A, torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high) * A
                        )
                        surrogate = torch.where(
                            A < 0, torch.max(surrogate, DUAL_CLIP * A), surrogate
                        )  # dual-clip: loss <= -3A
                    else:
                        surrogate = logp * A
                    per_token_loss = -surrogate * engines.engine_correction(
                        ro, mb, old, m, args.vllm_is_cap, stats.engine(it), stats.tokens
                    )  # vLLM: truncated IS
                    kl = (
                        common.k3_kl(logp, ref_logp[mb]) if ref_logp is not None else None
                    )  # KL(pi || pi_ref), k3 estimator
                    if kl is not None:
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = common.aggregate_loss(
                        per_token_loss, m, args.loss_agg, args.max_new_tokens, num_tokens, num_seqs
                    )
                    common.stop_if_nonfinite(loss, "loss", step, metrics)
                    loss.backward()
                    stats.add(m, ratio, A, args.epsilon, args.epsilon_high, entropy, kl, loss)  # diagnostics
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                common.stop_if_nonfinite(grad_norm, "gradient norm", step, metrics)
                optimizer.step()
                stats.step(grad_norm)
        t_update = time.time() - t0

        # 6. logging, evaluation, checkpoints
        step_time = t_gen + t_logp + t_update
        metrics = {
            **common.completion_metrics(ro, rewards, G),
            **stats.metrics(),
            "learning_rate": optimizer.param_groups[0]["lr"],
            "num_tokens": float(ro.completion_mask.sum()),
            "tokens_per_second": float(ro.completion_mask.sum()) / step_time,
            "time/generation": t_gen,
            "time/logprobs": t_logp,
            "time/update": t_update,
            "time/step": step_time,
            **common.peak_memory(device),
            **{f"reset/{k}": v for k, v in reset_info.items() if k != "time_localization"},
            "time/localization": reset_info["time_localization"],
            "sampling/generated_tokens": reset_info["generated_tokens"],
        }
        if step == args.total_steps or (args.eval_every and step % args.eval_every == 0):
            eval_metrics = common.evaluate(
                model, tokenizer, task, args.max_new_tokens, args.gen_batch_size, args.eval_temperature, dist
            )
            metrics.update(eval_metrics)
        metrics = dist.reduce_metrics(metrics)  # eval metrics are already the same on every rank
        logger.log(metrics, step)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", eval_acc=f"{eval_metrics['eval/accuracy']:.3f}")
        stopping = stop.requested(dist)  # Ctrl-C: save and leave after this step
        if ckpt.due(step, args.total_steps) or stopping:
            ckpt.save(step, model, tokenizer, optimizer, batches, {"resets": rng})
        if stopping:
            logger.close()
            dist.print(
                f"stopped after step {step}; checkpoint in {run_dir}/checkpoint: continue with --resume {run_dir}"
            )
            raise SystemExit(130)

    logger.close()
    dist.print(f"final eval accuracy {eval_metrics['eval/accuracy']:.3f}; metrics in {run_dir}/metrics.jsonl")
    if args.save_model:
        dist.print(f"saved model to {dist.save(model, tokenizer, run_dir / 'model')}")  # every rank joins the save
    dist.close()

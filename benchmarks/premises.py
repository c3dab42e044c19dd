"""Benchmark: does the property each method works through hold for a policy? Measured before any RL run (issue #67).

Each credit-assignment method leans on a property of the policy it trains. Where that property fails, a learning table
cannot tell a method that does not help from a method that was never given its premise. This script measures each
premise with the scripts' own functions, prompts, parsers and temperatures, on held-out problems of the built-in arith
task, and prints per method its figures, its gate and pass or fail:

  srpo         the policy names its own first wrong line (srpo.localization_prompt, parse_reply, the localization
               temperature and cap; parents cut by srpo.protocol_cut): exact share >= 2x a uniform line (RRPO) and above
               the best constant guess; the kept prefix error-free (named line at or before the true one) >= 0.85; no
               localization prompt + reply past the model's positions.
  sc_grpo      the policy uses a verified solution in context (sc_grpo.teacher_prompt): greedy accuracy with the
               problem's solution in context >= 0.9 and >= 0.2 above without; at the departure token the teacher raises
               p(correct token) in >= 80% of failed rows, against <= 50% for a content-free anchor (another problem's
               solution); D = KL(teacher || student) (teacher.teacher_kl, with a correct sibling as the reference, as
               sc_grpo.route_groups and build_teachers draw it) has a token AUC >= 0.65 for the first wrong line over
               the correct prefix.
  ep_grpo      entropy marks the decision tokens: the departure token is in its row's top 20% of entropy
               (common.token_logprobs' entropy at the sampling temperature) in >= 90% of failed rows. With --reference
               (the starting policy, for a trained one) the process signal's share of ep_advantages' |A| is reported.
  grpo_lambda  early tokens decide the outcome: >= 50% of failed rows' first wrong lines in the first quarter of the
               solution's lines (reported also over the failed rows of groups with a success, the only ones a
               group-relative advantage blames); the share of a failed row's blame the default trace puts on its
               correct prefix (trace_diagnostics.trace_multipliers) is reported beside GRPO's uniform share.
  control      blame at the first wrong line is blame where the value drops: the Monte-Carlo value of the prefix before
               the first wrong line minus after it, >= 0.2 (>= 8 continuations from each of >= 40 failed rows).

Definitions shared by the figures (each a pure function below, tested on hand-made cases in tests/test_premises.py):
the rollouts are --rollouts samples per problem at the training temperature; a failed row has a reward below the
success threshold; its first wrong line k is tasks.arith_first_error's (1-based over the non-empty lines) and "has a
first wrong line" means line k is in the text (a completion that stopped early is left out); its departure is the first
character where the completion differs from the problem's canonical solution (ArithProblem.solution, the format the
bundled models write), and the departure token the sampled token holding that character (chains.tokens_before); the
correct token is the first token of the solution's text from where the departure token starts.

    python benchmarks/premises.py measure --setting long --out benchmarks/results/premises/long_step0.json
    python benchmarks/premises.py measure --setting long --model runs/<run>/model --reference assets/tiny-arith-long \\
        --out benchmarks/results/premises/long_grpo40.json      # a GRPO checkpoint of the same setting
    python benchmarks/premises.py measure --setting long --json  # one JSON object per method on stdout, nothing written
    python benchmarks/premises.py table benchmarks/results/premises/*.json   # the gates' table (markdown)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import learning_curves as lc  # noqa: E402  (benchmarks/ is the script's own directory)
from credit_accuracy import pairwise_auc  # noqa: E402
from perfect_credit import blame_from  # noqa: E402

import common  # noqa: E402
import ep_grpo  # noqa: E402
import grpo_lambda  # noqa: E402
import sc_grpo  # noqa: E402
import srpo  # noqa: E402
from rlvr_utils.core import cli, rollouts, tasks  # noqa: E402
from rlvr_utils.extras.credit import token_lines  # noqa: E402
from rlvr_utils.methods import chains, teacher  # noqa: E402
from rlvr_utils.methods.trace_diagnostics import trace_multipliers  # noqa: E402

METHODS = ("srpo", "sc_grpo", "ep_grpo", "grpo_lambda", "control")
GATES = {  # the thresholds of issue #67; change one only with a measured reason written beside it
    "srpo": "exact >= 2 x uniform and > best constant; at or before the true line >= 0.85; no prompt + reply over the "
    "positions",
    "sc_grpo": "greedy with the solution >= 0.9 and >= without + 0.2; teacher raises p(correct) >= 0.8 and the anchor "
    "<= 0.5; D's AUC >= 0.65",
    "ep_grpo": "departure token in its row's top 20% entropy >= 0.9",
    "grpo_lambda": "first wrong line in the first quarter >= 0.5",
    "control": "V(before) - V(after) >= 0.2 over >= 40 rows x >= 8 continuations",
}


# ----------------------------------------------------------------------------------------------
# the figures: pure functions of what was sampled (tests/test_premises.py computes each by hand)
# ----------------------------------------------------------------------------------------------
def departure_offset(text: str, solution: str) -> int | None:
    """The first character offset where `text` differs from `solution` (a text that stops early departs at its end);
    None when `text` starts with the whole solution (nothing departs)."""
    n = len(os.path.commonprefix([text, solution]))
    return None if n == len(solution) else n


def localization_figures(named: list[int], true: list[int], lines: list[int]) -> dict:
    """SRPO's figures over failed rows: named (the line the policy named, srpo.reset_index), true (the first wrong
    line), lines (the thoughts the parent has; both lines are in 1..lines).
    exact: share named == true; uniform: mean 1/lines (a uniform line, RRPO's reset); best_constant: the highest exact
    share of one line number c for every row (c clamped to the row's lines, as reset_index clamps), with best_line = c;
    at_or_before: share named <= true (the kept prefix holds no error)."""
    n = len(true)
    if n == 0:
        return {"rows": 0}
    hits = {c: sum(min(c, m) == k for k, m in zip(true, lines)) / n for c in range(1, max(lines) + 1)}
    best = max(hits, key=lambda c: (hits[c], -c))
    return {
        "rows": n,
        "exact": sum(a == k for a, k in zip(named, true)) / n,
        "uniform": sum(1 / m for m in lines) / n,
        "best_constant": hits[best],
        "best_line": best,
        "at_or_before": sum(a <= k for a, k in zip(named, true)) / n,
    }


def srpo_pass(f: dict) -> bool:
    exact = f["rows"] > 0 and f["exact"] >= 2 * f["uniform"] and f["exact"] > f["best_constant"]
    return bool(exact and f["at_or_before"] >= 0.85 and f["over_positions"] == 0)


def line_auc(D: np.ndarray, lines: np.ndarray, k: int, departure: int | None = None) -> tuple | None:
    """For one failed row: (AUC of D on line k's tokens over the tokens of lines 1..k-1, ties 1/2; whether D's maximum
    over lines 1..k is on line k; line k's share of those tokens, the chance of the latter; the AUC of D at the
    `departure` token alone over the same tokens, None without one). None when line k has no token or no line precedes
    it (k < 2). D, lines [T]: the row's tokens (lines: rlvr_utils.extras.credit.token_lines)."""
    wrong, before = lines == k, (lines >= 1) & (lines < k)
    if k < 2 or not wrong.any() or not before.any():
        return None
    upto = wrong | before
    top = int(np.flatnonzero(upto)[np.argmax(D[upto])])
    at = pairwise_auc(D[[departure]], D[before]) if departure is not None else None
    return pairwise_auc(D[wrong], D[before]), bool(wrong[top]), float(wrong.sum() / upto.sum()), at


def sc_grpo_pass(f: dict) -> bool:
    acc = f["greedy_with_solution"] >= 0.9 and f["greedy_with_solution"] - f["greedy_without"] >= 0.2
    raised = f["raised_rows"] > 0 and f["raised"] >= 0.8 and f["anchor_raised"] <= 0.5
    return bool(acc and raised and f["auc_rows"] > 0 and f["d_auc"] >= 0.65)


def in_top_share(H: torch.Tensor, mask: torch.Tensor, j: torch.Tensor, q: float = 0.8) -> torch.Tensor:
    """[R] bool: whether token j[r] of row r has an entropy at or above the q-quantile of its row's valid tokens
    (ep_grpo.row_quantile, linear interpolation). H, mask [R, T]; j [R] token indices."""
    pivot = ep_grpo.row_quantile(H, mask.bool(), q)  # [R]
    return H.gather(1, j[:, None])[:, 0] >= pivot


def first_quarter(true: list[int], solution_lines: list[int]) -> dict:
    """GRPO-λ's position figures: each failed row's first wrong line k at relative position (k - 1) / L of the
    solution's L lines (its operations and the answer line); early: that position < 0.25."""
    pos = [(k - 1) / n for k, n in zip(true, solution_lines)]
    n = len(pos)
    return {
        "rows": n,
        "early": sum(p < 0.25 for p in pos) / n if n else None,
        "position": float(np.mean(pos)) if n else None,
    }


def in_mixed_groups(picked: list[int], group_ids: list[int], failed: list[bool]) -> list[int]:
    """The rows of `picked` whose group has a success: the failed rows a group-relative advantage blames (a group that
    fails throughout has no advantage, so no credit of any method reaches its rows)."""
    solved = {g for g, f in zip(group_ids, failed) if not f}
    return [i for i in picked if group_ids[i] in solved]


def prefix_blame(c: torch.Tensor, start: list[int], lengths: list[int]) -> tuple[float, float]:
    """The mean, over failed rows, of the share of a row's blame on its correct prefix (tokens before `start`, the
    first wrong line's first token): under the multipliers c [R, T] (GRPO-λ's on-policy c_k: the advantage is one
    number per row, so blame_t is proportional to c_t) and under GRPO's uniform credit (start / length)."""
    shares = [float(c[r, :s].sum() / c[r, :n].sum()) for r, (s, n) in enumerate(zip(start, lengths))]
    return float(np.mean(shares)), float(np.mean([s / n for s, n in zip(start, lengths)]))


def line_span(text: str, k: int) -> tuple[int, int]:
    """(its first character, one past its newline or the text's end) of `text`'s k-th non-empty line (1-based, as
    tasks.arith_first_error counts them)."""
    raw = text.split("\n")
    r = [n for n, line in enumerate(raw) if line.strip()][k - 1]
    start = sum(len(x) + 1 for x in raw[:r])
    return start, min(start + len(raw[r]) + 1, len(text))


def value_drop(before: list[list[float]], after: list[list[float]]) -> dict:
    """The control's figure: per row, the mean reward of its continuations from before the first wrong line minus from
    after it; the mean over rows with its 95% t-interval (learning_curves.t_interval), and both values' means."""
    drops = [float(np.mean(b) - np.mean(a)) for b, a in zip(before, after)]
    m, lo, hi = lc.t_interval(drops) if drops else (None, None, None)
    return {
        "rows": len(drops),
        "continuations": min((len(b) for b in before + after), default=0),
        "v_before": float(np.mean([np.mean(b) for b in before])) if before else None,
        "v_after": float(np.mean([np.mean(a) for a in after])) if after else None,
        "drop": m,
        "drop_lo": lo,
        "drop_hi": hi,
    }


def control_pass(f: dict) -> bool:
    return bool(f["rows"] >= 40 and f["continuations"] >= 8 and f["drop"] is not None and f["drop"] >= 0.2)


# ----------------------------------------------------------------------------------------------
# the measurements: the scripts' own functions on the policy
# ----------------------------------------------------------------------------------------------
class Rows:
    """The sampled rollouts of the held-out problems and, per row, what the figures read."""

    def __init__(self, ro, examples, task, tok, threshold: float):
        self.ro, self.tok = ro, tok
        self.examples = [examples[int(g)] for g in ro.group_ids]
        self.scores = torch.tensor(task.rewards(ro.texts, self.examples), dtype=torch.float32)
        self.failed = self.scores < threshold
        self.ids = [ro.completion_ids[i][ro.completion_mask[i].bool()].tolist() for i in range(len(ro))]
        self.problems = [tasks.parse_arith_problem(e.question) for e in self.examples]
        self.k = [tasks.arith_first_error(p, t) for p, t in zip(self.problems, ro.texts)]
        self.lines = [sum(bool(x.strip()) for x in t.split("\n")) for t in ro.texts]

    def with_wrong_line(self) -> list[int]:
        """Failed rows whose first wrong line is in the text."""
        return [
            i for i in range(len(self.ids)) if self.failed[i] and self.k[i] is not None and self.k[i] <= self.lines[i]
        ]

    def departure(self, i: int) -> tuple[int, int] | None:
        """(departure token index, the correct token's id) of row i, None when the row does not depart from the
        solution within its sampled tokens."""
        solution = self.problems[i].solution()
        off = departure_offset(self.ro.texts[i], solution)
        if off is None:
            return None
        ids = self.ids[i]
        j = chains.tokens_before(self.tok, ids, off)  # the token holding character `off`
        if off >= len(self.ro.texts[i]):  # stopped early: its stop token departs (cut at the cap: none does)
            j = len(ids) - 1 if ids and ids[-1] in self.tok.all_special_ids else len(ids)
        if j >= len(ids):
            return None
        start = len(self.tok.decode(ids[:j], skip_special_tokens=True))
        rest = self.tok(solution[start:], add_special_tokens=False).input_ids
        return j, (rest[0] if rest else self.tok.eos_token_id)


def p_token_at(model, tok, prompts, completions, positions, temperature: float) -> torch.Tensor:
    """[R] probability of completions[r][positions[r]] after prompts[r] + completions[r][:positions[r]], at the sampling
    temperature (common.token_logprobs on a batch built by rollouts.make_rollouts)."""
    out = []
    stops = common.stop_token_ids(model, tok)
    for s in range(0, len(prompts), 32):
        part = prompts[s : s + 32]
        ro = rollouts.make_rollouts(tok, part, completions[s : s + 32], list(range(len(part))), stops)
        T = ro.completion_ids.shape[1]
        logp = common.token_logprobs(model, ro.input_ids, ro.attention_mask, T, temperature)[0]
        j = torch.tensor(positions[s : s + 32])
        out.append(logp.gather(1, j[:, None])[:, 0].exp())
    return torch.cat(out)


def measure_srpo(model, tok, task, rows: Rows, a) -> dict:
    """SRPO's self-localization on its own failed rows, each cut as srpo.py cuts a parent (protocol_cut)."""
    reserve = min(srpo.THOUGHT_TOKENS, a.max_new_tokens // 20) if a.thought_reserve is None else a.thought_reserve
    budget = srpo.thought_budget(tok, [], a)
    asks, true, n_lines = [], [], []
    for i in torch.nonzero(rows.failed).flatten().tolist():
        truncated = bool(rows.ro.truncated[i])
        cut = srpo.protocol_cut(tok, rows.ids[i], rows.ro.texts[i], a.thought_delimiter, *budget, reserve, truncated)
        text = rows.ro.texts[i] if len(cut) == len(rows.ids[i]) else tok.decode(cut, skip_special_tokens=True)
        thoughts = srpo.split_thoughts(text, a.thought_delimiter)
        k = tasks.arith_first_error(rows.problems[i], text)
        if not thoughts or k is None or k > len(thoughts):  # no parent, or no wrong line in it (stopped early)
            continue
        asks.append(srpo.localization_prompt(tok, task.name, rows.examples[i].question, thoughts))
        true.append(k)
        n_lines.append(len(thoughts))
    cap = a.localization_max_new_tokens or max(192, 20 * (a.arith_steps + 2))
    sampler = chains.Sampler(model, tok, task, a, None, None, srpo.THOUGHT_TOKENS)
    named, over, truncated = [], 0, 0
    max_pos = getattr(model.config, "max_position_embeddings", None) or 10**9
    if asks:
        lro = sampler.generate(asks, cap, max(a.localization_temperature, 1e-5))
        named = [srpo.reset_index("self", n, reply=r) for n, r in zip(n_lines, lro.texts)]
        lengths = lro.completion_mask.sum(1).tolist()
        over = sum(len(p) + n > max_pos for p, n in zip(asks, lengths))
        truncated = int(lro.truncated.sum())
    f = localization_figures(named, true, n_lines)
    f |= {"over_positions": over / len(asks) if asks else 0.0, "replies_cut_at_cap": truncated, "positions": max_pos}
    f["prompt_tokens_mean"] = float(np.mean([len(p) for p in asks])) if asks else None
    return f | {"pass": srpo_pass(f)}


def greedy_accuracy(model, tok, task, prompts, examples, a) -> float:
    """Greedy pass@1 (common.evaluate's sampling) of prompts against their examples."""
    ids, greedy = [e.id for e in examples], dict(do_sample=False, batch_size=a.gen_batch_size)
    ro = common.generate_rollouts(model, tok, prompts, ids, 1, a.max_new_tokens, 1e-5, **greedy)
    r = task.rewards(ro.texts, examples, mode="eval")
    return sum(x >= a.success_threshold for x in r) / len(r)


def measure_sc_grpo(model, tok, task, rows: Rows, evals, a, seed: int) -> dict:
    """SC-GRPO's teacher: accuracy with the problem's solution in context, p(correct) at the departure token under the
    teacher and a content-free anchor, and D's token AUC with a correct sibling as the reference."""
    prompt = lambda e, tau: sc_grpo.teacher_prompt(tok, a.task, e, tau)  # noqa: E731
    solution = lambda e: tasks.parse_arith_problem(e.question).solution()  # noqa: E731
    f = {"greedy_without": greedy_accuracy(model, tok, task, [e.prompt_ids for e in evals], evals, a)}
    f["greedy_with_solution"] = greedy_accuracy(model, tok, task, [prompt(e, solution(e)) for e in evals], evals, a)
    f["greedy_problems"] = len(evals)
    # (2) p(correct token) at the departure: student, teacher with this problem's solution, anchor with another's
    others = {e.id: evals[(n + 1) % len(evals)] for n, e in enumerate(evals)}
    stu, tea, anc, comp, pos = [], [], [], [], []
    for i in rows.with_wrong_line():
        dep = rows.departure(i)
        if dep is None:
            continue
        j, right = dep
        e = rows.examples[i]
        stu.append(e.prompt_ids)
        tea.append(prompt(e, solution(e)))
        anc.append(prompt(e, solution(others[e.id])))
        comp.append(rows.ids[i][:j] + [right])
        pos.append(j)
    f["raised_rows"] = len(pos)
    if pos:
        p_s, p_t, p_a = (p_token_at(model, tok, p, comp, pos, a.temperature) for p in (stu, tea, anc))
        f["raised"] = float((p_t > p_s).float().mean())
        f["anchor_raised"] = float((p_a > p_s).float().mean())
        f |= {"p_student": float(p_s.mean()), "p_teacher": float(p_t.mean()), "p_anchor": float(p_a.mean())}
    # (3) D's AUC on failed partial-group rows, with a correct sibling as tau (route_groups + build_teachers)
    ro, G = rows.ro, a.num_generations
    correct = ~rows.failed
    gen = torch.Generator().manual_seed(seed)
    _, tau_row = sc_grpo.route_groups(correct, G, gen, ro.group_ids, ("partial",), rows.scores)
    context = getattr(model.config, "max_position_embeddings", None) or 10**9
    T = ro.completion_ids.shape[1]
    by_id = {e.id: e for e in rows.examples}
    make = lambda i, tau: sc_grpo.teacher_prompt(tok, a.task, by_id[int(ro.group_ids[i])], tau)  # noqa: E731
    refs = (correct, tau_row, context - T, a.max_reference_tokens, gen)
    teachers, role, _, _ = sc_grpo.build_teachers(tok, make, ro.texts, ro.completion_mask, ro.group_ids, *refs)
    scored = [i for i in rows.with_wrong_line() if role[i] == sc_grpo.Role.WEIGHTED and rows.k[i] >= 2]
    aucs, tops, chance, at_departure = [], [], [], []
    if scored:
        idx = torch.tensor(scored)
        ids, attn = ro.input_ids[idx], ro.attention_mask[idx]
        student = []
        common.token_logprobs(model, ids, attn, T, a.temperature, keep=student)
        D, _ = teacher.teacher_kl(model, student, ids, attn, T, [teachers[i] for i in scored], a.temperature,
                                  tok.pad_token_id)  # fmt: skip
        for r, i in enumerate(scored):
            n = len(rows.ids[i])
            lines = np.asarray(token_lines([tok.decode([t]) for t in rows.ids[i]]))
            dep = rows.departure(i)
            got = line_auc(D[r, :n].numpy(), lines, rows.k[i], dep[0] if dep else None)
            if got is not None:
                aucs.append(got[0])
                tops.append(got[1])
                chance.append(got[2])
                at_departure += [got[3]] if got[3] is not None else []
    f["auc_rows"] = len(aucs)
    if aucs:
        f |= {
            "d_auc": float(np.mean(aucs)),
            "d_max_on_line": float(np.mean(tops)),
            "d_max_chance": float(np.mean(chance)),
            "d_departure_auc": float(np.mean(at_departure)) if at_departure else None,  # the departure token alone
        }
    return f | {"pass": sc_grpo_pass(f) if pos and aucs else False}


def measure_ep_grpo(model, tok, rows: Rows, a, reference=None) -> dict:
    """EP-GRPO's entropy at the departure token, and with a reference its process signal's share of |A|."""
    ro, T = rows.ro, rows.ro.completion_ids.shape[1]
    mask = ro.completion_mask
    logp, H = common.token_logprobs(model, ro.input_ids, ro.attention_mask, T, a.temperature, with_entropy=True)
    picked = [(i, rows.departure(i)) for i in rows.with_wrong_line()]
    picked = [(i, d[0]) for i, d in picked if d is not None]
    f = {"rows": len(picked)}
    if picked:
        idx, j = torch.tensor([i for i, _ in picked]), torch.tensor([d for _, d in picked])
        f["top20"] = float(in_top_share(H[idx], mask[idx], j).float().mean())
        batch_pivot = ep_grpo.row_quantile(H.reshape(1, -1), mask.reshape(1, -1).bool(), a.pivot_quantile)
        f["above_batch_pivot"] = float((H[idx, j] >= batch_pivot).float().mean())  # the gate's own pivot (the batch's)
    if reference is not None:  # the process signal against the starting policy
        ref_logp = common.token_logprobs(reference, ro.input_ids, ro.attention_mask, T, a.temperature)[0]
        cfg = ep_grpo.EPConfig.of(a)
        _, parts = ep_grpo.ep_advantages(H, logp, ref_logp, mask, rows.scores, a.num_generations, ro.group_ids, cfg,
                                         rows.scores, return_parts=True)  # fmt: skip
        m = mask.float()
        outcome = (parts["gate"] * parts["outcome"][:, None]).abs() * m
        process = (parts["gate"] * parts["coef"] * parts["polarity"][:, None] * parts["process"]).abs() * m
        f["process_share"] = float(process.sum() / (outcome.sum() + process.sum()).clamp(min=1e-12))
    return f | {"pass": bool(picked) and f["top20"] >= 0.9}


def measure_grpo_lambda(tok, rows: Rows, a) -> dict:
    """GRPO-λ: where failed rows go wrong, and the blame share its trace puts on their correct prefix."""
    picked = rows.with_wrong_line()
    f = first_quarter([rows.k[i] for i in picked], [len(rows.problems[i].ops) + 1 for i in picked])
    mixed = in_mixed_groups(picked, rows.ro.group_ids.tolist(), rows.failed.tolist())
    lines = [len(rows.problems[i].ops) + 1 for i in mixed]
    f |= {"early_mixed": first_quarter([rows.k[i] for i in mixed], lines)["early"], "mixed_rows": len(mixed)}
    if picked:
        lengths = [len(rows.ids[i]) for i in picked]
        start = [blame_from(tok, rows.examples[i], rows.ids[i], rows.ro.texts[i]) for i in picked]
        c = trace_multipliers(torch.tensor(lengths), a.lam, a.gamma, a.trace_style, dtype=torch.float64)
        f["trace_prefix_share"], f["uniform_prefix_share"] = prefix_blame(c, start, lengths)
    return f | {"pass": bool(picked) and f["early"] >= 0.5}


def measure_control(model, tok, task, rows: Rows, a, n_rows: int, m: int, seed: int) -> dict:
    """The control's premise: m continuations from just before and just after the first wrong line of n_rows failed
    rows (a seeded draw), scored by the task's reward over prefix + continuation."""
    picked = rows.with_wrong_line()
    random.Random(seed).shuffle(picked)
    picked = picked[:n_rows]
    prompts, prefixes, owners = [], [], []
    for i in picked:
        for off in line_span(rows.ro.texts[i], rows.k[i]):  # before line k, and after it
            prefix = rows.ids[i][: chains.tokens_before(tok, rows.ids[i], off)]
            prefix = prefix[:-1] if prefix and prefix[-1] in tok.all_special_ids else prefix  # never past its stop
            prompts.append(rows.examples[i].prompt_ids + prefix)
            prefixes.append(prefix)
            owners.append(rows.examples[i])
    if not picked:
        return value_drop([], []) | {"pass": False}
    budget = a.max_new_tokens - min(len(p) for p in prefixes)
    ro = common.generate_rollouts(model, tok, prompts, list(range(len(prompts))), m, max(budget, 1), a.temperature,
                                  a.top_p, a.top_k, batch_size=a.gen_batch_size)  # fmt: skip
    texts, examples = [], []
    for r in range(len(ro)):
        p = prefixes[r // m]
        cont = ro.completion_ids[r][ro.completion_mask[r].bool()].tolist()[: max(a.max_new_tokens - len(p), 1)]
        texts.append(tok.decode(p + cont, skip_special_tokens=True))
        examples.append(owners[r // m])
    scores = task.rewards(texts, examples)
    per = [scores[q * m : (q + 1) * m] for q in range(len(prompts))]
    f = value_drop(per[0::2], per[1::2])
    return f | {"pass": control_pass(f)}


def script_args(args_type, flags: list[str], validate=None):
    """A script's Args for the setting's flags (tyro, as the script parses them; its own validate fills defaults)."""
    a = tyro.cli(args_type, args=flags)
    return validate(a) if validate is not None else a


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def cmd_measure(o) -> None:
    flags = [*lc.SETTINGS[o.setting], *o.flags.split()] + (["--model", o.model] if o.model else [])
    flags += ["--seed", str(o.seed), "--num-generations", str(o.rollouts)]
    cli.set_threads(o.threads)
    t0 = time.time()
    a_srpo = script_args(srpo.Args, flags, srpo.validate)
    a_sc, a_ep = script_args(sc_grpo.Args, flags), script_args(ep_grpo.Args, flags)
    a_lam = script_args(grpo_lambda.Args, flags)
    a = a_sc  # the shared flags (every script's Args has them)
    common.seed_everything(o.seed)
    tok = common.load_tokenizer(a.model)
    task = common.load_task(a, tok)
    model = common.load_model(a.model, torch.device("cpu"), "float32", False).eval()
    reference = None
    if o.reference:
        reference = common.load_model(o.reference, torch.device("cpu"), "float32", False).eval()
    examples = task.eval[: o.problems]
    by_id = {e.id: e for e in task.eval}
    results = {}
    with torch.no_grad():
        prompts, ids, sampling = [e.prompt_ids for e in examples], [e.id for e in examples], (a.top_p, a.top_k)
        ro = common.generate_rollouts(model, tok, prompts, ids, o.rollouts, a.max_new_tokens, a.temperature, *sampling,
                                      batch_size=a.gen_batch_size)  # fmt: skip
        rows = Rows(ro, by_id, task, tok, a.success_threshold)
        base = {"failed": int(rows.failed.sum()), "with_wrong_line": len(rows.with_wrong_line()), "rows": len(ro)}
        base["pass_at_1_sampled"] = float((~rows.failed).float().mean())
        todo = o.methods or list(METHODS)
        if "srpo" in todo:
            results["srpo"] = measure_srpo(model, tok, task, rows, a_srpo)
        if "sc_grpo" in todo:
            results["sc_grpo"] = measure_sc_grpo(model, tok, task, rows, task.eval[: o.eval_problems], a_sc, o.seed)
        if "ep_grpo" in todo:
            results["ep_grpo"] = measure_ep_grpo(model, tok, rows, a_ep, reference)
        if "grpo_lambda" in todo:
            results["grpo_lambda"] = measure_grpo_lambda(tok, rows, a_lam)
        if "control" in todo:
            results["control"] = measure_control(model, tok, task, rows, a, o.mc_rows, o.mc_continuations, o.seed)
    out = [{"method": m, "pass": f.pop("pass"), "gate": GATES[m], **f} for m, f in results.items()]
    meta = {
        "setting": o.setting,
        "flags": flags,
        "model": a.model,
        "reference": o.reference,
        "problems": len(examples),
        "rollouts": o.rollouts,
        "seed": o.seed,
        "label": o.label or Path(a.model).name,
        "sampled": base,
        "commit": git_commit(),
        "uncommitted": bool(
            subprocess.run(
                ["git", "status", "--porcelain", "-uno"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
        ),  # fmt: skip
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {lc.cpu_name()}",
        "threads": o.threads,
        "torch": torch.__version__,
        "seconds": round(time.time() - t0, 1),
    }
    if o.json:
        for r in out:
            print(json.dumps(r))
        return
    if o.out:
        Path(o.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(o.out).with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "methods": out}, indent=1))
        os.replace(tmp, o.out)
    print(table([{"meta": meta, "methods": out}]))


def fmt(x, digits: int = 3) -> str:
    return "–" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def figures_text(r: dict) -> str:
    """One method's figures, in a table cell."""
    m = r["method"]
    if m == "srpo":
        return (
            f"exact {fmt(r.get('exact'))} (uniform {fmt(r.get('uniform'))}, best constant "
            f"{fmt(r.get('best_constant'))} = line {r.get('best_line', '–')}); at or before "
            f"{fmt(r.get('at_or_before'))}; over positions {fmt(r['over_positions'])}; {r['rows']} rows"
        )
    if m == "sc_grpo":
        return (f"greedy {fmt(r['greedy_without'])} → {fmt(r['greedy_with_solution'])} with the solution; raised "
                f"{fmt(r.get('raised'))} (anchor {fmt(r.get('anchor_raised'))}; {r['raised_rows']} rows); D's AUC "
                f"{fmt(r.get('d_auc'))}, max on the line {fmt(r.get('d_max_on_line'))} (chance "
                f"{fmt(r.get('d_max_chance'))}; {r['auc_rows']} rows; the departure token's AUC "
                f"{fmt(r.get('d_departure_auc'))})")  # fmt: skip
    if m == "ep_grpo":
        share = f"; process share of \\|A\\| {fmt(r['process_share'])}" if "process_share" in r else ""
        pivot = fmt(r.get("above_batch_pivot"))
        return f"top 20% {fmt(r.get('top20'))} (above the batch pivot {pivot}); {r['rows']} rows{share}"
    if m == "grpo_lambda":
        return (
            f"first quarter {fmt(r.get('early'))} (in groups with a success {fmt(r.get('early_mixed'))}, "
            f"{r.get('mixed_rows', '–')} rows); position {fmt(r.get('position'))}; prefix blame: trace "
            f"{fmt(r.get('trace_prefix_share'))}, uniform {fmt(r.get('uniform_prefix_share'))}; {r['rows']} rows"
        )
    return (f"V {fmt(r['v_before'])} → {fmt(r['v_after'])}, drop {fmt(r['drop'])} [{fmt(r['drop_lo'])}, "
            f"{fmt(r['drop_hi'])}]; {r['rows']} rows × {r['continuations']}")  # fmt: skip


def headline(r: dict) -> str:
    """A method's gated figures, short (the compact table's cell)."""
    m, f2 = r["method"], fmt
    if m == "srpo":
        return (f"exact {f2(r.get('exact'))} (uniform {f2(r.get('uniform'))}, constant {f2(r.get('best_constant'))}); "
                f"at or before {f2(r.get('at_or_before'))}; over positions {f2(r['over_positions'])}")  # fmt: skip
    if m == "sc_grpo":
        return (f"greedy {f2(r['greedy_without'])} → {f2(r['greedy_with_solution'])}; raised {f2(r.get('raised'))} "
                f"(anchor {f2(r.get('anchor_raised'))}); AUC {f2(r.get('d_auc'))}")  # fmt: skip
    if m == "ep_grpo":
        return f"top 20% {f2(r.get('top20'))}"
    if m == "grpo_lambda":
        return f"first quarter {f2(r.get('early'))}"
    return f"drop {f2(r['drop'])} [{f2(r['drop_lo'])}, {f2(r['drop_hi'])}]"


def compact(results: list[dict]) -> str:
    """One row per result file, one column per method: pass or fail and its gated figures."""
    lines = ["| setting | policy | " + " | ".join(METHODS) + " |", "|---|---|" + "---|" * len(METHODS)]
    for res in results:
        by = {r["method"]: r for r in res["methods"]}
        cells = [(("**yes**" if by[m]["pass"] else "no") + ": " + headline(by[m])) if m in by else "–" for m in METHODS]
        lines.append(f"| {setting_text(res['meta'])} | {res['meta']['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def setting_text(meta: dict) -> str:
    """The setting's name and the flags a measurement added to it (--flags; not the model, which the policy column
    names, nor the seed or group size)."""
    flags, extra = meta["flags"][len(lc.SETTINGS[meta["setting"]]) :], []
    while flags:
        name, value, flags = flags[0], flags[1:2], flags[2:]
        extra += [] if name in ("--seed", "--num-generations", "--model") else [name, *value]
    return meta["setting"] + (f" + `{' '.join(extra)}`" if extra else "")


def table(results: list[dict], gates: bool = True) -> str:
    """The gates' table: one row per (result file, method); `gates`: a column with each gate's thresholds."""
    lines = ["| setting | policy | method | pass | figures |" + (" gate |" if gates else "")]
    lines += ["|---|---|---|---|---|" + ("---|" if gates else "")]
    for res in results:
        meta = res["meta"]
        for r in res["methods"]:
            gate = f" {r['gate']} |" if gates else ""
            lines.append(f"| {setting_text(meta)} | {meta['label']} | {r['method']} | {'yes' if r['pass'] else 'no'} | "
                         f"{figures_text(r)} |{gate}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="measure every premise for a model in a setting")
    m.add_argument("--setting", choices=list(lc.SETTINGS), default="long")
    m.add_argument("--flags", default="", help="more script flags, one string (after the setting's)")
    m.add_argument("--model", default=None, help="the policy (default: the setting's)")
    m.add_argument("--reference", default=None, help="the starting policy: EP-GRPO's process share against it")
    m.add_argument("--label", default="", help="the policy's name in the table (default: the model folder's)")
    m.add_argument("--methods", nargs="*", choices=METHODS)
    m.add_argument("--seed", type=int, default=1, help="the task's seed (held-out problems) and the sampling's")
    m.add_argument("--problems", type=int, default=48, help="held-out problems the rollouts are drawn for")
    m.add_argument("--rollouts", type=int, default=8, help="rollouts per problem (a group)")
    m.add_argument("--eval-problems", type=int, default=200, help="problems of the greedy accuracies")
    m.add_argument("--mc-rows", type=int, default=40, help="failed rows of the control's value drop")
    m.add_argument("--mc-continuations", type=int, default=8, help="continuations from each of the two prefixes")
    m.add_argument("--threads", type=int, default=1)
    m.add_argument("--json", action="store_true", help="one JSON object per method on stdout; nothing written")
    m.add_argument("--out", default=None, help="write the results (JSON, with their provenance) here")
    t = sub.add_parser("table", help="the gates' table from result files")
    t.add_argument("files", nargs="+")
    t.add_argument("--no-gates", action="store_true", help="leave out the column of each gate's thresholds")
    t.add_argument("--compact", action="store_true", help="one row per file, one column per method")
    o = ap.parse_args()
    if o.cmd == "measure":
        cmd_measure(o)
    else:
        results = [json.loads(Path(f).read_text()) for f in o.files]
        print(compact(results) if o.compact else table(results, gates=not o.no_gates))


if __name__ == "__main__":
    main()

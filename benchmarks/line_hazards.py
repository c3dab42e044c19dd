"""Benchmark: where does a policy's chain go wrong, line by line? Why GRPO-λ's premise holds or fails (issue #67).

GRPO-λ assumes that a chain's early tokens decide its outcome; benchmarks/premises.py measures it as the share of failed
rows whose first wrong line is in the first quarter of the solution's lines. This script says why that share is what it
is, and how far a task variant drawn from the same kinds of lines could move it. For held-out problems of a setting it
teacher-forces the canonical solution (ArithProblem.solution, the format the bundled models write) after the task's
prompt and reads each line's error rate given a correct prefix, at the sampling temperature:

    h_k = 1 - p(line k exactly, with its newline (the answer line: with the stop token) | prompt, lines 1..k-1)

the chance that a sample leaves the solution on line k once it has written lines 1..k-1 right. From these:

  predicted    P(first wrong line = k) = h_k prod_{j<k} (1 - h_j); the first-quarter share of premises.py's GRPO-λ
               figure predicted from it (the sampled one also drops rows whose wrong line still gives the right answer
               and reads " 30" as "30"), the chance of an exact solution, the mean relative position of a first error.
  profile      the mean h of each line number.
  kinds        the mean h by the line's quarter of the chain (quarter q: 4 (k - 1) / L in [q, q + 1), L the lines, the
               answer line counted, as premises.first_quarter counts them) and its kind: the operation and how many
               digits its running value a and its result c have (1->2: a one-digit value carried into two digits), the
               two-digit lines also by the smaller of a and c (<20, 20-49, >=50).
  best         the largest first-quarter share any problem made of these kinds of lines could have, if a line's error
               rate depended on its quarter and kind only (best_problem: exact, by dynamic programming over the running
               value; kinds seen on fewer than --min-lines lines are left out, and kinds wrong more often than
               --max-rate, lines the policy cannot write: a variant made of them has no successes), and that
               problem. A mixture of problems has at most its best problem's share, so no variant drawn from these
               lines does better, unless its context changes the rates themselves: --sample draws that problem from
               the policy and measures it as premises.py does (a variant is measured by premises.py, not by this).

    python benchmarks/line_hazards.py --setting long --out benchmarks/results/premises/hazards/long.json
    python benchmarks/line_hazards.py --setting rising       # a variant: its predicted share beside the sampled one
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import learning_curves as lc  # noqa: E402  (benchmarks/ is the script's own directory)

import common  # noqa: E402
import grpo  # noqa: E402
from rlvr_utils.core import cli, rollouts, tasks  # noqa: E402
from rlvr_utils.extras.credit import token_lines  # noqa: E402


# ----------------------------------------------------------------------------------------------
# the figures: pure functions of the per-line error rates (tests/test_line_hazards.py computes each by hand)
# ----------------------------------------------------------------------------------------------
def line_rates(logp: list[float], lines: list[int], n_lines: int) -> list[float]:
    """h_k = 1 - exp(sum of the log-probs of line k's tokens), k = 1..n_lines. logp, lines: per token of the solution
    (lines: 1-based, rlvr_utils.extras.credit.token_lines)."""
    total = [0.0] * n_lines
    for lp, k in zip(logp, lines):
        total[k - 1] += lp
    return [1.0 - math.exp(t) for t in total]


def quarter(k: int, n_lines: int) -> int:
    """The quarter of the chain line k (1-based) is in: q with 4 (k - 1) / n_lines in [q, q + 1) (0: premises.py's
    first quarter, (k - 1) / n_lines < 1/4)."""
    return 4 * (k - 1) // n_lines


def first_error(h: list[float]) -> list[float]:
    """P(the first wrong line is k), k = 1..len(h); 1 - their sum is the chance of no wrong line."""
    out, right = [], 1.0
    for x in h:
        out.append(right * x)
        right *= 1.0 - x
    return out


def predicted(rates: list[list[float]]) -> dict:
    """Over problems (each its h per line): the predicted share of failures whose first wrong line is in the first
    quarter, the chance of an exact solution, and the mean relative position (k - 1) / L of a first error."""
    early = fail = pos = 0.0
    exact = []
    for h in rates:
        p = first_error(h)
        fail += sum(p)
        early += sum(x for k, x in enumerate(p, 1) if quarter(k, len(h)) == 0)
        pos += sum(x * (k - 1) / len(h) for k, x in enumerate(p, 1))
        exact.append(1.0 - sum(p))
    return {"early": early / fail, "exact": float(np.mean(exact)), "position": pos / fail}


def line_kind(a: int, op: str, c: int) -> str:
    """A step line `a<op>b=c`'s kind: the operation, the digits of a and of c, and for two digits on both sides the band
    of the smaller (<20, 20-49, >=50)."""
    kind = f"{op} {len(str(a))}->{len(str(c))}"
    if len(str(a)) == len(str(c)) == 2:
        low = min(a, c)
        kind += " <20" if low < 20 else (" 20-49" if low < 50 else " >=50")
    return kind


def best_problem(rates: dict, n_steps: int, answer_rate: float, max_value: int = 99, max_operand: int = 9) -> dict:
    """The largest first-quarter share of failures over every problem of n_steps operations (a start in
    [0, max_value], each step +/- an operand in [1, max_operand] with the running value kept in [0, max_value]) whose
    step lines are of measured kinds, if a line's error rate were rates[(its quarter, its kind)] (line_kind) and the
    answer line's answer_rate. A mixture of problems has a share at most its best problem's (a ratio of sums), so this
    bounds every variant built from these lines. Exact by dynamic programming over the running value: the share is
    P_E / (P_E + (1 - P_E) P_L), P_E the chance of a wrong line in the first quarter and P_L of one later given none
    there, so for each value v after the first quarter the best path into v maximizes P_E and the best path out of v
    minimizes P_L. Returns the share, P_E, P_L and the problem (ArithProblem.text); None where no problem is made of
    measured kinds."""
    L = n_steps + 1
    early_steps = sum(quarter(k, L) == 0 for k in range(1, n_steps + 1))
    moves = [(op, b) for op in "+-" for b in range(1, max_operand + 1)]

    def step(k, v):  # the lines k can be from value v: (log(1 - h), the move, the next value)
        for op, b in moves:
            w = v + b if op == "+" else v - b
            h = rates.get((quarter(k, L), line_kind(v, op, w))) if 0 <= w <= max_value else None
            if h is not None and h < 1:
                yield math.log1p(-h), (op, b), w

    # into[v]: (the lowest log-survival of the first quarter's lines ending at v, its start and moves)
    into = {v: (0.0, v, ()) for v in range(max_value + 1)}
    for k in range(1, early_steps + 1):
        nxt = {}
        for v, (s, start, path) in into.items():
            for ls, move, w in step(k, v):
                if w not in nxt or s + ls < nxt[w][0]:
                    nxt[w] = (s + ls, start, path + (move,))
        into = nxt
    # out[v]: (the highest log-survival of the later lines and the answer line from v, their moves)
    out = {v: (math.log1p(-answer_rate), ()) for v in range(max_value + 1)}
    for k in range(n_steps, early_steps, -1):
        prev = {}
        for v in range(max_value + 1):
            for ls, move, w in step(k, v):
                if w in out and (v not in prev or ls + out[w][0] > prev[v][0]):
                    prev[v] = (ls + out[w][0], (move,) + out[w][1])
        out = prev
    best = None
    for v in into.keys() & out.keys():
        p_e, p_l = 1 - math.exp(into[v][0]), 1 - math.exp(out[v][0])
        share = p_e / (p_e + (1 - p_e) * p_l) if p_e + p_l > 0 else 0.0
        if best is None or share > best["share"]:
            problem = tasks.ArithProblem(into[v][1], into[v][2] + out[v][1])
            best = {"share": share, "p_early": p_e, "p_later": p_l, "problem": problem.text}
    return best


# ----------------------------------------------------------------------------------------------
# the measurement: teacher-forced passes of the policy over the solutions
# ----------------------------------------------------------------------------------------------
def solution_rates(model, tok, examples, temperature: float, batch: int = 32) -> list[list[float]]:
    """Each example's h per line of its canonical solution (common.token_logprobs at `temperature`)."""
    stops = common.stop_token_ids(model, tok)
    out = []
    for s in range(0, len(examples), batch):
        part = examples[s : s + batch]
        sols = [tasks.parse_arith_problem(e.question).solution() for e in part]
        ids = [tok(x, add_special_tokens=False).input_ids + [tok.eos_token_id] for x in sols]
        ro = rollouts.make_rollouts(tok, [e.prompt_ids for e in part], ids, list(range(len(part))), stops)
        T = ro.completion_ids.shape[1]
        logp = common.token_logprobs(model, ro.input_ids, ro.attention_mask, T, temperature)[0]
        for r, (x, c) in enumerate(zip(sols, ids)):
            lines = token_lines([tok.decode([t]) for t in c[:-1]]) + [x.count("\n") + 1]  # the stop ends the answer
            out.append(line_rates(logp[r, : len(c)].double().tolist(), lines, x.count("\n") + 1))
    return out


def sampled_share(model, tok, text: str, n: int, a) -> dict:
    """The best problem on the policy: n samples of it at the run's temperature (common.generate_rollouts, the task's
    prompt), the share of the failed ones with a first wrong line (tasks.arith_first_error, in the text) in the first
    quarter, as premises.py counts it, and the share rewarded."""
    p = tasks.parse_arith_problem(text)
    ids = tasks.encode_prompt(tok, tasks.render_prompt(tok, tasks.ARITH_INSTRUCTION + p.text, tasks.arith_prompt(p)))
    ro = common.generate_rollouts(model, tok, [ids], [0], n, a.max_new_tokens, a.temperature, a.top_p, a.top_k,
                                  batch_size=a.gen_batch_size)  # fmt: skip
    solved = [tasks.arith_reward(t, str(p.answer)) >= a.success_threshold for t in ro.texts]
    first = [tasks.arith_first_error(p, t) for t, ok in zip(ro.texts, solved) if not ok]
    lines = [sum(bool(x.strip()) for x in t.split("\n")) for t, ok in zip(ro.texts, solved) if not ok]
    k = [x for x, m in zip(first, lines) if x is not None and x <= m]
    early = sum(quarter(x, len(p.ops) + 1) == 0 for x in k) / len(k) if k else None
    return {"samples": n, "solved": sum(solved) / n, "rows": len(k), "early": early}


def kinds_table(examples, rates) -> tuple[dict, list[float]]:
    """(quarter, kind) -> the rates of those step lines; and the answer lines' rates."""
    cells, answer = defaultdict(list), []
    for e, h in zip(examples, rates):
        p = tasks.parse_arith_problem(e.question)
        a = [p.start, *p.values()]
        for k, (op, _) in enumerate(p.ops, 1):
            cells[(quarter(k, len(h)), line_kind(a[k - 1], op, a[k]))].append(h[k - 1])
        answer.append(h[-1])
    return cells, answer


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", choices=list(lc.SETTINGS), default="long")
    ap.add_argument("--flags", default="", help="more script flags, one string (after the setting's)")
    ap.add_argument("--model", default=None, help="the policy (default: the setting's)")
    ap.add_argument("--seed", type=int, default=1, help="the task's seed (held-out problems) and the sampling's")
    ap.add_argument("--problems", type=int, default=512, help="held-out problems")
    ap.add_argument("--min-lines", type=int, default=30, help="the fewest lines a kind needs to enter the best problem")
    ap.add_argument("--max-rate", type=float, default=0.5, help="kinds wrong more often are not lines the policy reads")
    ap.add_argument("--sample", type=int, default=384, help="samples of the best problem on the policy (0: none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the results (JSON, with their provenance) here")
    o = ap.parse_args()
    flags = [*lc.SETTINGS[o.setting], *o.flags.split()] + (["--model", o.model] if o.model else [])
    flags += ["--seed", str(o.seed), "--num-eval", str(o.problems)]
    cli.set_threads(o.threads)
    t0 = time.time()
    a = tyro.cli(grpo.Args, args=flags)
    tok = common.load_tokenizer(a.model)
    examples = common.load_task(a, tok).eval
    model = common.load_model(a.model, torch.device("cpu"), "float32", False).eval()
    with torch.no_grad():
        rates = solution_rates(model, tok, examples, a.temperature)
    cells, answer = kinds_table(examples, rates)
    steps = len(tasks.parse_arith_problem(examples[0].question).ops)
    res = {
        "meta": {
            "setting": o.setting, "flags": flags, "model": a.model, "problems": len(examples),
            "temperature": a.temperature, "commit": git_commit(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {lc.cpu_name()}", "threads": o.threads,
            "torch": torch.__version__, "seconds": round(time.time() - t0, 1),
        },
        "predicted": predicted(rates),
        "profile": np.mean(rates, axis=0).tolist(),
        "kinds": {f"q{q} {k}": [len(v), float(np.mean(v))] for (q, k), v in sorted(cells.items())},
        "answer_rate": float(np.mean(answer)),
        "best": best_problem(
            {c: float(np.mean(v)) for c, v in cells.items() if len(v) >= o.min_lines and np.mean(v) <= o.max_rate},
            steps, float(np.mean(answer)), a.arith_max_value, a.arith_max_operand,
        ),
    }  # fmt: skip
    if res["best"] is not None and o.sample:
        common.seed_everything(o.seed)
        with torch.no_grad():
            res["best"]["sampled"] = sampled_share(model, tok, res["best"]["problem"], o.sample, a)
    res["meta"]["seconds"] = round(time.time() - t0, 1)
    print(report(res))
    if o.out:
        Path(o.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(o.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, o.out)


def report(res: dict) -> str:
    """The figures as text: the prediction, the profile, the kinds by quarter, the best problem."""
    p = res["predicted"]
    out = [
        f"{res['meta']['setting']} {' '.join(res['meta']['flags'])}: {res['meta']['problems']} problems",
        f"predicted: first quarter {p['early']:.3f}; exact solution {p['exact']:.3f}; position {p['position']:.3f}",
        "h by line: " + " ".join(f"{x:.3f}" for x in res["profile"]),
        "| kind | q0 | q1 | q2 | q3 |",
        "|---|---|---|---|---|",
    ]
    kinds = sorted({k.split(" ", 1)[1] for k in res["kinds"]})
    for kind in kinds:
        cells = [res["kinds"].get(f"q{q} {kind}") for q in range(4)]
        out.append(f"| {kind} | " + " | ".join(f"{c[1]:.3f} ({c[0]})" if c else "–" for c in cells) + " |")
    out.append(f"answer line {res['answer_rate']:.3f}")
    b = res["best"]
    if b is None:
        out.append("best problem: none is made of measured kinds")
    else:
        out.append(f"best problem: first quarter {b['share']:.3f} ({b['problem']}: a wrong line in the first quarter "
                   f"{b['p_early']:.3f}, later {b['p_later']:.3f})")  # fmt: skip
        if "sampled" in b:
            x = b["sampled"]
            early = "–" if x["early"] is None else f"{x['early']:.3f}"
            out.append(f"  sampled on the policy: first quarter {early} ({x['rows']} failed rows of {x['samples']}); "
                       f"solved {x['solved']:.3f}")  # fmt: skip
    return "\n".join(out)


if __name__ == "__main__":
    main()

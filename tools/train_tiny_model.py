"""Train the bundled tiny policy `assets/tiny-arith/` from scratch (seeded, CPU, < 1 hour on 2 cores).

A character-level Qwen2 model (transformers' Qwen2ForCausalLM, tokenizer built with `tokenizers`)
learns three formats of the built-in arith task (see common.py):
  (a) solve:     "Solve: 23+7-5+9\n"                       -> "23+7=30\n30-5=25\n25+9=34\n#### 34"
  (b) localize:  "Problem: ...\nYour incorrect solution:\nStep 1: ...\nFind the first wrong step.\n"
          -> "Step 1: 23+7=30\nStep 2: 30-5=2? wrong\n\\boxed{2}"  (srpo.py asks this; the reply copies
             the given lines while they agree with the correct ones and writes "?" at the first
             character that differs, see arith_localization_target)
  (c) reference: "Reference solution:\n<solution>\nSolve: ...\n" -> the solution  (sc_grpo.py's teacher)
The loss covers completion tokens only. Training stops at the first evaluation where pass@1 at
temperature 1.0 on the default task (4 steps) reaches --target-pass-at-1 and localization is at least
twice chance, so that RL has room to improve (target band 20-60%), or at --max-steps. It prints what it
reached and writes it to <out-dir>/training_report.json. The bundled checkpoint is two commands:

    python tools/train_tiny_model.py --threads 2 --out-dir /tmp/tiny-stage1            # ~17 min: stops at step 1500
    python tools/train_tiny_model.py --threads 2 --init-from /tmp/tiny-stage1 --anchor-solve \
        --mix 0.3 0.6 0.1 --lr 1e-3 --warmup-steps 50 --max-steps 750 --min-steps 750
        # ~13 min: localization 0.475 -> 0.965
    python tools/train_tiny_model.py --eval-only                                       # re-measure assets/tiny-arith

The second bundled model, assets/tiny-arith-long (benchmarks' `long` setting: 16 operations, ~130-token solutions),
continues the first on 2-16 operations; it is the step-450 copy of this run (~12 min on 2 cores to that point; the
run went on to 600). That copy was chosen by hand, among the kept copies (one every 150 steps), for its greedy
accuracy on 16-operation problems: 0.31 (the `long` setting's step-0 evaluation on its first 3 seeds' held-out
problems), inside the band that setting asks for (0.05-0.45), where the run's end was past it. That figure comes
from the benchmark's evaluation, not from this script: training_report.json holds only the 4-operation evaluation
printed here. The choice set the starting point only, the same for every method compared on it:

    python tools/train_tiny_model.py --threads 2 --init-from assets/tiny-arith --out-dir /tmp/tiny-arith-long \
        --min-steps-task 2 --max-steps-task 16 --lr 1e-3 --warmup-steps 50 --max-steps 600 --min-steps 600 \
        --eval-every 150 --keep-evals        # then: cp -r /tmp/tiny-arith-long-step450 assets/tiny-arith-long
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import string
import sys
import time
from pathlib import Path

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
from rlvr_utils.core import tasks  # noqa: E402
from rlvr_utils.extras.data import rewards  # noqa: E402
from rlvr_utils.extras.save import saving  # noqa: E402
from srpo import ARITH_LOCALIZATION, parse_reply  # noqa: E402  (format (b): what SRPO's self-localization asks)


def arith_localization_prompt(problem: tasks.ArithProblem, thoughts: list[str]) -> str:
    """Format (b): srpo.localization_prompt on the built-in task without a chat template, the failed solution one step
    per line."""
    steps = "".join(f"Step {i}: {t.strip()}\n" for i, t in enumerate(thoughts, 1))
    return ARITH_LOCALIZATION.format(problem=problem.text, steps=steps)


def arith_reference_prompt(problem: tasks.ArithProblem, reference: str) -> str:
    """Format (c): what SC-GRPO's teacher sees on the built-in task without a chat template (sc_grpo.teacher_prompt's
    plain form: the verified reference before the student's prompt)."""
    return f"Reference solution:\n{reference.strip()}\n{tasks.arith_prompt(problem)}"


@dataclasses.dataclass
class Args:
    out_dir: str = common.DEFAULT_MODEL
    """where the Hugging Face model directory is written (atomically)"""
    seed: int = 1
    """seed for data, initialization and sampling"""
    hidden_size: int = 128
    """model width"""
    num_layers: int = 4
    """transformer blocks"""
    num_heads: int = 4
    """attention heads"""
    intermediate_size: int = 384
    """MLP width"""
    batch_size: int = 32
    """sequences per optimizer step"""
    lr: float = 2e-3
    """peak AdamW learning rate (linear warmup, cosine decay to 10% over --max-steps)"""
    max_steps: int = 8000
    """hard cap on optimizer steps"""
    min_steps: int = 500
    """no early stop before this many steps"""
    eval_every: int = 250
    """steps between evaluations"""
    num_eval: int = 200
    """problems per evaluation"""
    target_pass_at_1: float = 0.40
    """stop at the first evaluation whose pass@1 at T=1 reaches this (and localization > 2x chance)"""
    min_steps_task: int = 2
    """fewest operations in a training problem"""
    max_steps_task: int = 6
    """most operations in a training problem"""
    mix: tuple[float, float, float] = (0.4, 0.35, 0.25)
    """sampling weights of formats (a) solve, (b) localize, (c) solve with reference"""
    threads: int = 2
    """torch CPU threads (results are reproducible for a given thread count)"""
    stop_step: int | None = None
    """end after this step's evaluation whatever it reached (the schedule still follows --max-steps)"""
    init_from: str | None = None
    """continue training this model directory (warm start; the architecture flags are then ignored)"""
    warmup_steps: int = 200
    """linear learning-rate warmup"""
    decision_weight: float = 5.0
    """loss weight of the localization chain's decision tokens (each line's ok/wrong and the boxed step)
    against 1 for every other token: they are a few characters among many copied ones"""
    anchor_solve: bool = False
    """warm start only: on solving examples (a) and (c), replace cross-entropy on the gold solution by
    KL(initial model || model) on it, so solving stays where it was while localization trains"""
    loc_correct_frac: float = 0.1
    """fraction of localization examples (b) that show a fully correct solution (reply \\boxed{0}), so that
    the model learns to compare rather than to expect exactly one wrong line"""
    eval_only: bool = False
    """evaluate --init-from (the bundled model when not given) on the held-out problems, print, write nothing"""
    keep_evals: bool = False
    """also keep a copy of the model at every evaluation in <out-dir>-step<N>"""
    max_positions: int = 512
    """the model's positions (max_position_embeddings; from scratch only): SRPO's localization prompt and reply on
    16 operations need about 800"""
    eval_steps_task: int = 4
    """operations of the evaluation problems (and their new-token budget, 12 per operation)"""
    error_mix: tuple[float, ...] = ()
    """weights of the wrong-solution kinds shown to localization examples (b), in POLICY_ERRORS' order (slip,
    operand, operator, answer, wrong_value, skip, reorder, foreign, early_answer): the kinds a policy's own failures
    take (benchmarks/localization.py); default (): corrupt_solution's synthetic ones (the bundled models')"""
    reference_error_frac: float = 0.0
    """share of reference examples (c) whose reference has a wrong line (error_mix's kinds) while the target stays the
    correct solution: the model must check the reference against its own computation, not copy it"""
    checkpoint_minutes: float = 0.0
    """> 0: every this many minutes (and at each evaluation) write a resumable state (weights, optimizer, schedule,
    RNGs, step, history) to <out-dir>.resume.pt, atomically"""
    resume: bool = False
    """continue from <out-dir>.resume.pt (its flags must equal these but --resume, --stop-step, --threads)"""


def arith_localization_target(problem: tasks.ArithProblem, thoughts: list[str]) -> str:
    """The reply the tiny model is trained to give to `arith_localization_prompt`: it copies the given
    solution line by line (`Step i: <line>`) for as long as the copy agrees, character by character,
    with the correct solution; at the first character where they differ it writes `? wrong` instead
    and ends with `\\boxed{i}`:

        Step 1: 23+7=30
        Step 2: 30-5=2? wrong        <- given "30-5=24", correct "30-5=25"
        \\boxed{2}

    Each check is local: the next character of the given line (copied from the prompt) against the
    next character of the correct line (computed, as when solving), the end of a line included, so a
    tiny model can learn it (an earlier chain that rewrote each correct line and marked it `ok` or
    `wrong` stayed at chance: the whole-line comparison with a distant prompt line was never learned).
    Lines are compared with the canonical step format `a+b=c` / `#### N` (no spaces); a missing line
    is wrong at its first character. A given solution with no wrong line gets `\\boxed{0}`."""
    out = []
    for i, line in enumerate(problem.solution().split("\n"), 1):
        given = thoughts[i - 1].strip() if i <= len(thoughts) else ""  # a missing line: "" (a line is never empty)
        if given == line:
            out.append(f"Step {i}: {line}")
            continue
        out.append(f"Step {i}: {os.path.commonprefix([given, line])}? wrong")
        return "\n".join(out) + f"\n\\boxed{{{i}}}"
    return "\n".join(out) + "\n\\boxed{0}"


def build_tokenizer():
    """Character-level tokenizer: printable ASCII + newline, plus <pad>, <eos>, <unk>. Written in byte-level form
    (space and newline are the vocabulary entries 'Ġ' and 'Ċ', with a ByteLevel pre-tokenizer and decoder, no merges),
    so that AutoTokenizer, which rebuilds a qwen2 model's tokenizer as Qwen2Tokenizer (byte-level), reads the same
    ids and decodes the same text; a character outside the vocabulary is dropped by both."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["<pad>", "<eos>", "<unk>"] + list(string.printable[:95]) + ["\n"]
    vocab = {{" ": "\u0120", "\n": "\u010a"}.get(c, c): i for i, c in enumerate(dict.fromkeys(chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )


def corrupt_solution(problem: tasks.ArithProblem, rng: random.Random) -> tuple[list[str], int]:
    """A wrong solution and the 1-based index of its first wrong line. Errors are what a sampler
    makes: a wrong result, a wrong operand or operator, or a wrong answer line; later steps then
    continue correctly from the wrong value."""
    n = len(problem.ops)
    k = rng.randint(1, n + 1)
    lines, v = [], problem.start
    for i, (op, b) in enumerate(problem.ops, 1):
        if i == k:
            kind = rng.random()
            if kind < 0.6:  # wrong result
                nv = (v + b if op == "+" else v - b) + rng.choice([-1, 1]) * rng.randint(1, 10)
            elif kind < 0.8:  # wrong operand
                b = rng.choice([x for x in range(1, 10) if x != b])
                nv = v + b if op == "+" else v - b
            else:  # wrong operator
                op = "-" if op == "+" else "+"
                nv = v + b if op == "+" else v - b
        else:
            nv = v + b if op == "+" else v - b
        lines.append(f"{v}{op}{b}={nv}")
        v = nv
    ans = v
    if k == n + 1:
        ans = v + rng.choice([-1, 1]) * rng.randint(1, 10)
    lines.append(f"#### {ans}")
    assert tasks.arith_first_error(problem, "\n".join(lines)) == k
    return lines, k


POLICY_ERRORS = ("slip", "operand", "operator", "answer", "wrong_value", "skip", "reorder", "foreign", "early_answer")


def policy_error(problem: tasks.ArithProblem, rng: random.Random, kind: str) -> tuple[list[str], int] | None:
    """A wrong solution of `kind` (POLICY_ERRORS) and the 1-based index of its first wrong line (tasks.arith_first_error
    agrees), or None when `problem` cannot take that kind (e.g. a reorder of two equal operations). The line
    classes of benchmarks/localization.py's first_error_class: slip, operand, operator (a wrong result, operand or
    sign; corrupt_solution's), answer (a wrong #### line), wrong_value (the next operation on a miscopied running
    value), skip (an operation left out: the next ones follow from there), reorder (operations k and k + 1 swapped),
    foreign (an operation already done or with an operand the problem lacks, in place of the next one), early_answer
    (the #### line written after k - 1 operations). Lines after the error continue correctly from what was written."""
    ops, n = list(problem.ops), len(problem.ops)
    apply = lambda v, op, b: v + b if op == "+" else v - b  # noqa: E731
    k = rng.randint(1, n)
    if kind == "answer":
        k = n + 1
    elif kind == "reorder":
        if n < 2:
            return None
        k = rng.randint(1, n - 1)
        if ops[k - 1] == ops[k]:
            return None
        ops[k - 1], ops[k] = ops[k], ops[k - 1]
    elif kind == "skip":
        if k == n or ops[k - 1] == ops[k]:  # the last one left out is an early answer; an equal next one, no error
            return None
        del ops[k - 1]
    elif kind == "foreign":
        done = [o for o in problem.ops[: k - 1] if o not in problem.ops[k - 1 :]]
        absent = [(op, b) for op in "+-" for b in range(1, 10) if (op, b) not in problem.ops]
        pool = done + absent
        if not pool:
            return None
        ops[k - 1] = rng.choice(pool)
    elif kind == "early_answer":
        ops = ops[: k - 1]
    lines, v = [], problem.start
    for i, (op, b) in enumerate(ops, 1):
        a = v
        if i == k and kind == "wrong_value":
            a = v + rng.choice([-1, 1]) * rng.randint(1, 10)
        if i == k and kind in ("slip", "operand", "operator"):
            if kind == "operand":
                b = rng.choice([x for x in range(1, 10) if x != b])
            elif kind == "operator":
                op = "-" if op == "+" else "+"
            nv = apply(a, op, b) + (rng.choice([-1, 1]) * rng.randint(1, 10) if kind == "slip" else 0)
        else:
            nv = apply(a, op, b)
        lines.append(f"{a}{op}{b}={nv}")
        v = nv
    answer = v + (rng.choice([-1, 1]) * rng.randint(1, 10) if kind == "answer" else 0)
    lines.append(f"#### {answer}")
    if tasks.arith_first_error(problem, "\n".join(lines)) != k:  # e.g. a flipped sign that undoes itself
        return None
    return lines, k


def wrong_solution(problem: tasks.ArithProblem, rng: random.Random, args: Args) -> list[str]:
    """A wrong solution for a localization example or a checked reference: corrupt_solution's by default, else a kind
    drawn by --error-mix (redrawn until the problem takes it)."""
    if not args.error_mix:
        return corrupt_solution(problem, rng)[0]
    while True:
        got = policy_error(problem, rng, rng.choices(POLICY_ERRORS, weights=args.error_mix)[0])
        if got is not None:
            return got[0]


def sample_example(rng: random.Random, args: Args) -> tuple[str, str, int]:
    """(prompt, target, kind) with kind 0 solve, 1 localize, 2 solve with reference."""
    problem = tasks.make_arith_problem(rng, steps=rng.randint(args.min_steps_task, args.max_steps_task))
    kind = rng.choices(range(3), weights=args.mix)[0]
    if kind == 0:
        return tasks.arith_prompt(problem), problem.solution(), 0
    if kind == 1:
        if rng.random() < args.loc_correct_frac:
            lines = problem.solution().split("\n")
        else:
            lines = wrong_solution(problem, rng, args)
        return arith_localization_prompt(problem, lines), arith_localization_target(problem, lines), 1
    reference = problem.solution()
    if args.reference_error_frac and rng.random() < args.reference_error_frac:  # checked, not copied
        reference = "\n".join(wrong_solution(problem, rng, args))
    return arith_reference_prompt(problem, reference), problem.solution(), 2


DECISION_RE = re.compile(r"(\?)|\\boxed\{(\d+)\}")


def completion_weights(completion: str, decision_weight: float) -> list[float]:
    """Per-character loss weights (the tokenizer is character-level; +1 for EOS): `decision_weight` on
    the `?` that marks the first wrong character of the localization reply and on the digits in
    \\boxed{}, 1 elsewhere."""
    w = [1.0] * (len(completion) + 1)
    for m in DECISION_RE.finditer(completion):
        g = 1 if m.group(1) else 2
        for i in range(m.start(g), m.end(g)):
            w[i] = decision_weight
    return w


def make_batch(examples, tok, decision_weight: float = 1.0):
    """Right-padded input ids, attention mask, labels (-100 on prompt and padding) and loss weights."""
    rows = []
    for prompt, completion, *_ in examples:
        p = tok(prompt, add_special_tokens=False).input_ids
        c = tok(completion, add_special_tokens=False).input_ids + [tok.eos_token_id]
        w = completion_weights(completion, decision_weight)
        assert len(w) == len(c), "the weights assume one token per character"
        rows.append((p + c, [-100] * len(p) + c, [0.0] * len(p) + w))
    T = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), T), tok.pad_token_id)
    labels = torch.full((len(rows), T), -100)
    weights = torch.zeros((len(rows), T))
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, (x, y, w) in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        weights[i, : len(w)] = torch.tensor(w)
        mask[i, : len(x)] = 1
    return ids, mask, labels, weights


def budgets(problems) -> tuple[int, int]:
    """New tokens for a solution and for a localization reply of `problems` (the longest): 64 and 192 up to 4
    operations (the bundled models' evaluation), then 12 per operation and srpo.py's arith cap, 20 x (operations
    + 2)."""
    n = max(len(p.ops) for p in problems)
    return max(64, 12 * n), max(192, 20 * (n + 2))


@torch.no_grad()
def evaluate(model, tok, problems, rng_seed: int, own: bool = True) -> dict:
    """pass@1 at T=1 and greedy accuracy on `problems` (4 steps by default: --eval-steps-task), localization accuracy
    (greedy) on synthetic wrong solutions and (own=True) on the model's own wrong samples."""
    solve_tokens, loc_tokens = budgets(problems)
    model.eval()
    out = {}
    prompts = [tasks.arith_prompt(p) for p in problems]
    for name, kw in (
        ("pass@1_T1", dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)),
        ("greedy", dict(do_sample=False)),
    ):
        torch.manual_seed(rng_seed)
        texts = generate(model, tok, prompts, max_new_tokens=solve_tokens, **kw)
        out[name] = sum(tasks.arith_reward(t, str(p.answer)) for t, p in zip(texts, problems)) / len(problems)
    rng = random.Random(rng_seed)
    loc_prompts, labels = [], []
    for p in problems:
        lines, k = corrupt_solution(p, rng)
        loc_prompts.append(arith_localization_prompt(p, lines))
        labels.append(k)
    texts = generate(model, tok, loc_prompts, max_new_tokens=loc_tokens, do_sample=False)
    out["localization"] = sum((rewards.last_boxed(t) or "").strip() == str(k) for t, k in zip(texts, labels)) / len(
        labels
    )
    out["localization_chance"] = sum(1 / (len(p.ops) + 1) for p in problems) / len(problems)
    if own:
        out.update(own_localization(model, tok, problems, rng_seed))
    model.train()
    return out


@torch.no_grad()
def own_localization(model, tok, problems, rng_seed: int) -> dict:
    """Localization on the model's own wrong solutions, as srpo.py sees them: sample one solution per
    problem at T=1, keep the wrong ones, ask for their first wrong step (greedy) and compare with
    tasks.arith_first_error. Chance is a uniform guess over the solution's lines (RRPO's reset); at_or_before: the
    named step (srpo.parse_reply's) at or before the true one, the kept prefix error-free."""
    solve_tokens, loc_tokens = budgets(problems)
    prompts = [tasks.arith_prompt(p) for p in problems]
    torch.manual_seed(rng_seed + 1)
    texts = generate(model, tok, prompts, solve_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    wrong = [
        (p, [ln for ln in t.split("\n") if ln.strip()])
        for p, t in zip(problems, texts)
        if tasks.arith_reward(t, str(p.answer)) == 0.0
    ]
    wrong = [(p, lines, tasks.arith_first_error(p, "\n".join(lines))) for p, lines in wrong if lines]
    wrong = [(p, lines, k) for p, lines, k in wrong if k is not None and k <= len(lines)]
    if not wrong:
        return {"own_localization": None, "own_localization_n": 0}
    asks = [arith_localization_prompt(p, lines) for p, lines, _ in wrong]
    replies = generate(model, tok, asks, max_new_tokens=loc_tokens, do_sample=False)
    named = [(rewards.last_boxed(r) or "").strip() for r in replies]
    parsed = [parse_reply(r, len(lines))[0] for r, (_, lines, _) in zip(replies, wrong)]
    return {
        "own_localization": sum(n == str(k) for n, (_, _, k) in zip(named, wrong)) / len(wrong),
        "own_at_or_before": sum(n <= k for n, (_, _, k) in zip(parsed, wrong)) / len(wrong),
        "own_localization_chance": sum(1 / len(lines) for _, lines, _ in wrong) / len(wrong),
        "own_localization_n": len(wrong),
    }


def generate(model, tok, prompts, max_new_tokens, **kw):
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    gen = model.generate(
        **enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **kw
    )
    return tok.batch_decode(gen[:, enc.input_ids.shape[1] :], skip_special_tokens=True)


def save(model, tok, args: Args, report: dict, n_params: int, history: list, init_report: dict | None) -> None:
    """Write the model and its training report (atomically) to --out-dir; a warm start keeps the
    report of the run it started from under "init_from_report"."""
    model.eval()
    out = saving.save_model_atomic(model, tok, args.out_dir)
    report = dict(report, params=n_params, args=dataclasses.asdict(args), history=history)
    if init_report is not None:
        report["init_from_report"] = init_report
    (out / "training_report.json").write_text(json.dumps(report, indent=1))
    model.train()


UNCHECKED = ("resume", "stop_step", "threads", "checkpoint_minutes")  # flags a resumed run may change


def write_state(path: Path, model, opt, sched, rng: random.Random, step: int, history: list, seconds: float, args):
    """The resumable state after `step` (weights, optimizer, schedule, the data and torch RNGs, history, seconds),
    written to a temporary file and renamed over `path`: a kill leaves the previous state whole."""
    state = dict(model=model.state_dict(), optimizer=opt.state_dict(), schedule=sched.state_dict(), rng=rng.getstate())
    state |= dict(torch_rng=torch.get_rng_state(), step=step, history=history, seconds=seconds)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state | {"args": dataclasses.asdict(args)}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(args: Args) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(args.threads)
    common.seed_everything(args.seed)
    tok = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rope_theta=10000.0,
    )
    eval_problems = [
        tasks.make_arith_problem(random.Random(10_000 + i), steps=args.eval_steps_task) for i in range(args.num_eval)
    ]
    if args.eval_only:
        model = Qwen2ForCausalLM.from_pretrained(args.init_from or args.out_dir)
        print("eval", json.dumps(evaluate(model, tok, eval_problems, rng_seed=args.seed)))
        return
    anchor = None
    if args.anchor_solve and not args.init_from:
        raise ValueError("--anchor-solve needs --init-from (the model to anchor solving to)")
    if args.init_from:
        model = Qwen2ForCausalLM.from_pretrained(args.init_from)
        if args.anchor_solve:
            anchor = Qwen2ForCausalLM.from_pretrained(args.init_from).eval().requires_grad_(False)
        if model.config.vocab_size != len(tok):
            raise ValueError(f"--init-from {args.init_from}: vocabulary {model.config.vocab_size} != {len(tok)}")
        prev = Path(args.init_from) / "training_report.json"
        init_report = json.loads(prev.read_text()) if prev.exists() else None
        print(f"warm start from {args.init_from}")
    else:
        model, init_report = Qwen2ForCausalLM(config), None
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Qwen2ForCausalLM with {n_params / 1e6:.2f}M parameters, vocab {len(tok)}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = args.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * (
                0.1
                + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(min(s, args.max_steps) / args.max_steps * torch.pi)).item())
            )
        ),
    )
    rng = random.Random(args.seed)
    t0, history, report, first = time.time(), [], None, 1
    state_path = Path(f"{args.out_dir}.resume.pt")
    if args.resume and state_path.exists():  # --resume: the run continues exactly where its state was written
        state = torch.load(state_path, weights_only=True)  # tensors, numbers, strings: no code
        theirs, ours = (dict(x, **dict.fromkeys(UNCHECKED)) for x in (state["args"], dataclasses.asdict(args)))
        if theirs != ours:
            differ = sorted(k for k in ours if theirs.get(k) != ours[k])
            raise SystemExit(f"--resume {state_path}: its run had other flags ({', '.join(differ)})")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        first, history, t0 = state["step"] + 1, state["history"], time.time() - state["seconds"]
        report = history[-1] if history else None
        print(f"resumed from {state_path} after step {state['step']}", flush=True)
    last_state = time.time()
    model.train()
    for step in range(first, args.max_steps + 1):
        # two length-sorted micro-batches: padding every row to the longest (localization) example
        # would waste about half the compute; the loss is the mean over all completion tokens
        examples = sorted(
            (sample_example(rng, args) for _ in range(args.batch_size)), key=lambda e: len(e[0]) + len(e[1])
        )
        half = args.batch_size // 2
        opt.zero_grad(set_to_none=True)
        parts = [make_batch(part, tok, args.decision_weight) for part in (examples[:half], examples[half:])]
        n_tok = sum(p[3].sum().item() for p in parts)  # weighted completion token count of the whole batch
        for (ids, mask, labels, weights), rows in zip(parts, (examples[:half], examples[half:])):
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            ce = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
            )
            if anchor is not None:  # solving rows: KL(initial || model) per position instead of cross-entropy
                with torch.no_grad():
                    ref = torch.log_softmax(anchor(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
                kl = (ref.exp() * (ref - torch.log_softmax(logits, -1))).sum(-1).reshape(-1)
                solve = torch.tensor([r[2] != 1 for r in rows])[:, None].expand(-1, ids.shape[1] - 1).reshape(-1)
                ce = torch.where(solve, kl, ce)
            loss = (ce * weights[:, 1:].reshape(-1)).sum() / n_tok
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if args.checkpoint_minutes > 0 and time.time() - last_state >= 60 * args.checkpoint_minutes:
            write_state(state_path, model, opt, sched, rng, step, history, time.time() - t0, args)
            last_state = time.time()
        if step % 50 == 0:
            print(
                f"step {step} loss(last half) {loss.item() * 2:.4f} lr {sched.get_last_lr()[0]:.2e} "
                f"{time.time() - t0:.0f}s",
                flush=True,
            )
        if step % args.eval_every == 0 or step == args.max_steps:
            ev = evaluate(model, tok, eval_problems, rng_seed=args.seed)
            ev.update(step=step, seconds=round(time.time() - t0, 1), loss=round(loss.item(), 4))
            history.append(ev)
            print("eval", json.dumps(ev), flush=True)
            report = ev
            save(model, tok, args, ev, n_params, history, init_report)
            if args.checkpoint_minutes > 0:
                write_state(state_path, model, opt, sched, rng, step, history, time.time() - t0, args)
                last_state = time.time()
            if args.keep_evals:
                shutil.copytree(
                    args.out_dir, f"{args.out_dir}-step{step}", dirs_exist_ok=True
                )  # every evaluation: stopping the run early keeps the last one
            if step == args.stop_step:
                break
            if (
                step >= args.min_steps
                and ev["pass@1_T1"] >= args.target_pass_at_1
                and ev["localization"] >= 2 * ev["localization_chance"]
            ):
                break
    out = Path(args.out_dir)
    mb = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(
        f"saved {out} ({mb:.1f} MB) after {report['step']} steps, {report['seconds']:.0f}s: "
        f"pass@1 (T=1) {report['pass@1_T1']:.3f}, greedy {report['greedy']:.3f}, "
        f"localization {report['localization']:.3f} (chance {report['localization_chance']:.3f})"
    )


if __name__ == "__main__":
    main(tyro.cli(Args))

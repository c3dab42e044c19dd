"""Each token's effective credit, recorded from the loss itself (`--log-credit N`).

The effective credit of a completion token is the factor its log-prob's gradient gets in the loss, in advantage
units: c_t = -(dL / d log pi(o_t)) / w_t, where w_t = dL_agg / dx_t is the weight the loss aggregation gives token t
(1 / tokens for token-mean, 1 / (rows * |o_i|) for seq-mean-token-mean, ...). At an on-policy ratio of 1 that is
GRPO's A, SC-GRPO's f * A (and the solve-none bonus), GRPO-lambda's trace multiplier times A, EP-GRPO's
g_hat * (A + lambda * d * P), and SRPO's A on the resampled suffix and 0 on the kept prefix; a k3 KL term (beta > 0)
adds its own small part. Because it is read from the gradient of the loss that trains, it is what the update uses,
whatever the method. At each evaluation step the first N rows of the batch are written to <run-dir>/credit.jsonl
with their decoded tokens, reward and the method's own per-token signals; tools/credit_view.py draws them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from rlvr_utils.core import tasks


class CreditLog:
    def __init__(self, path: Path, rows: int):
        self.path, self.rows, self.active, self.pending = Path(path), rows, False, []
        self.watched: dict[int, tuple] = {}  # batch row -> (log-prob tensor, its row in it, aggregation weight)
        self.extra: dict[str, torch.Tensor] = {}
        self.prompt_ids: torch.Tensor | None = None  # [N] each row's prompt, when groups are not prompts (SRPO)

    def start(self, active: bool) -> None:
        self.active, self.watched, self.extra, self.pending = active and self.rows > 0, {}, {}, []
        self.prompt_ids = None

    def watch(self, logp: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> None:
        """Keep the gradient of `logp` [b, T] (rows `rows` of the batch), with each token's aggregation weight."""
        want = [k for k, r in enumerate(rows.tolist()) if r < self.rows and r not in self.watched]
        if not want or not logp.requires_grad:
            return
        logp.retain_grad()
        self.pending.append(logp)  # its backward comes next
        for k in want:
            self.watched[int(rows[k])] = (logp, k, weight[k].detach())

    def before_backward(self) -> None:
        """Forget any gradient a diagnostic pass put on the watched log-probs (GRPO-lambda's trace/* measures its own
        with autograd.grad, which also fills a retained .grad): what is recorded is the training backward's."""
        for logp in self.pending:
            logp.grad = None
        self.pending = []

    def signals(self, prompt_ids: torch.Tensor | None = None, **named) -> None:
        """The method's own per-row ([N]) or per-token ([N, T]) signals, recorded beside the credit. `prompt_ids` [N]:
        each row's prompt where a group is not a prompt (SRPO's reset groups), so rows line up across methods."""
        if self.active and prompt_ids is not None:
            self.prompt_ids = prompt_ids.detach().cpu()
        if self.active:
            self.extra.update({k: v.detach().float().cpu() for k, v in named.items() if v is not None})

    def write(self, step: int, script: str, ro, rewards, tokenizer, mask: torch.Tensor) -> list[dict]:
        """One JSON line per recorded row: tokens, credit, reward, signals. Returns the rows."""
        out = []
        for r in sorted(self.watched):
            logp, k, w = self.watched[r]
            if logp.grad is None:
                continue
            m = mask[r].bool().cpu()
            grad, w = logp.grad[k].detach().float().cpu(), w.float().cpu()
            credit = torch.where(w > 0, -grad / w.clamp(min=1e-30), torch.zeros_like(grad))[m]
            ids = ro.completion_ids[r].cpu()[m].tolist()
            row = {
                "step": step,
                "script": script,
                "row": r,
                "prompt_id": int((ro.group_ids if self.prompt_ids is None else self.prompt_ids)[r]),
                "prompt": tokenizer.decode(ro.prompt_ids[r][ro.prompt_mask[r].bool()].tolist()),
                "reward": float(rewards[r]) if rewards[r] == rewards[r] else None,  # NaN: no reward (None)
                "tokens": [tokenizer.decode([t]) for t in ids],
                "credit": [round(float(c), 6) for c in credit],
                "signals": {},
            }
            for name, v in self.extra.items():
                row["signals"][name] = [round(float(x), 6) for x in v[r].flatten()[m]] if v.dim() == 2 else float(v[r])
            out.append(row)
        if out:
            with self.path.open("a") as f:
                f.write("".join(json.dumps(row) + "\n" for row in out))
        self.start(False)
        return out


def token_lines(tokens: list[str]) -> list[int]:
    """The line each recorded token belongs to, 1-based over the text's non-empty lines (as tasks.arith_first_error
    counts them): the line its first character is on, so a newline token belongs to the line it ends. 0 for a token on
    a blank line (and an empty token). benchmarks/credit_accuracy.py and tools/credit_view.py use it."""
    text = "".join(tokens)
    number, n = [], 0
    for line in text.split("\n"):  # raw line j -> its number among the non-empty lines (0: blank)
        n += bool(line.strip())
        number.append(n if line.strip() else 0)
    out, pos = [], 0
    for t in tokens:
        out.append(number[text.count("\n", 0, pos)] if t else 0)
        pos += len(t)
    return out


ARITH_PROMPT = re.compile(r"Solve:\s*([0-9+\-\s]+?)\s*$", re.M)  # the built-in task's problem, in a recorded prompt
SPECIAL = re.compile(r"<\|?[A-Za-z_]+\|?>")  # a recorded special token (<eos>, <|endoftext|>): not the answer's text


def first_wrong_line(row: dict) -> int | None:
    """A recorded arith rollout's first wrong line (tasks.arith_first_error over the text its verifier saw: the recorded
    tokens without special tokens), or None for a non-arith prompt or a rollout with no wrong line."""
    m = ARITH_PROMPT.search(row["prompt"])
    if m is None:
        return None
    text = "".join(t for t in row["tokens"] if not SPECIAL.fullmatch(t))
    return tasks.arith_first_error(tasks.parse_arith_problem(m.group(1)), text)


def as_text(rows: list[dict]) -> str:
    """A TensorBoard text summary: each row's tokens with their credit."""
    return "\n\n".join(
        f"row {r['row']} (prompt {r['prompt_id']}, reward {_shown(r['reward'])}): "
        + " ".join(f"`{t!r}`:{c:+.3g}" for t, c in zip(r["tokens"], r["credit"]))
        for r in rows
    )


def _shown(reward) -> str:
    return "none (no reward function scored it)" if reward is None else f"{reward:.3g}"

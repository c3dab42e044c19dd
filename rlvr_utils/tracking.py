"""Metrics of a run: the update's diagnostics (UpdateStats, TRL's names), and where every metric goes: TensorBoard,
`metrics.jsonl` beside it, and Weights & Biases with --track."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

from rlvr_utils.errors import usage_error


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows; a last line cut off by a kill is dropped with a warning (a damaged line elsewhere, or a
    line that is not a JSON object with an integer step, is an error naming it)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            if not (isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool)):
                usage_error(f"{path}:{i}: not a metrics row (a JSON object with an integer step)")
            rows.append(row)
        except ValueError:
            if i < len(lines):
                usage_error(f"{path}:{i}: not a JSON line; the run's metrics are damaged")
            print(
                f"warning: {path}:{i}: a partial last line (the run was killed while writing it) is dropped",
                file=sys.stderr,
            )
    return rows


class Logger:
    """Metrics to TensorBoard (`<run_dir>/`), `<run_dir>/metrics.jsonl`, and wandb with `track`. `resume_step` k > 0
    (--resume): the rows after step k are dropped from metrics.jsonl and TensorBoard before the run goes on.
    `last_eval`: the latest evaluation metrics logged (or read back from metrics.jsonl when resuming)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        config: dict,
        track: bool = False,
        wandb_project: str = "credit-rlvr",
        enabled: bool = True,
        resume_step: int = 0,
    ):
        self.enabled, self.run_dir, self.last_eval = (
            enabled,
            Path(run_dir),
            None,
        )  # enabled: False on torchrun ranks > 0
        if resume_step:
            rows = read_rows(self.run_dir / "metrics.jsonl")
            rows = [r for r in rows if r["step"] <= resume_step]
            self.last_eval = {k: v for r in rows if "eval/accuracy" in r for k, v in r.items() if k.startswith("eval/")}
            if enabled:
                tmp = self.run_dir / "metrics.jsonl.tmp"
                tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
                os.replace(tmp, self.run_dir / "metrics.jsonl")
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.run_dir), purge_step=resume_step + 1 if resume_step else None)
        if not resume_step:
            self.writer.add_text(
                "hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in config.items())
            )
            (self.run_dir / "config.json").write_text(json.dumps(config, indent=1, default=str))
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self.wandb = None
        if track:
            import wandb

            self.wandb = wandb.init(
                project=wandb_project,
                name=self.run_dir.name,
                id=self.run_dir.name,
                resume="allow",
                config=config,
                dir=str(self.run_dir),
            )

    def log(self, metrics: dict, step: int) -> None:
        if "eval/accuracy" in metrics:
            self.last_eval = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if not self.enabled:
            return
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.enabled and text:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.writer.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


class UpdateStats:
    """The update's diagnostics, TRL's names: clip fractions and kl as token means over every pass, entropy over the
    first pass, policy_loss and grad_norm as means over optimizer steps, and the vLLM engine's mismatch (`engine`)."""

    def __init__(self, mask: torch.Tensor, passes: int):
        self.tokens, self.passes = max(float(mask.sum()), 1.0), passes
        self.sums, self.losses, self.norms, self.loss, self.engine_stats = defaultdict(float), [], [], 0.0, {}

    def engine(self, it: int) -> dict | None:
        return self.engine_stats if it == 0 else None  # the engine metrics describe the rollouts: once

    def add(self, m, ratio, adv, eps_low, eps_high, entropy=None, kl=None, loss=None) -> None:
        low, high = ((ratio < 1 - eps_low) & (adv < 0)).float() * m, ((ratio > 1 + eps_high) & (adv > 0)).float() * m
        self.sums["clip_ratio/low_mean"] += low.sum().item()
        self.sums["clip_ratio/high_mean"] += high.sum().item()
        self.sums["clip_ratio/region_mean"] += (low + high).sum().item()
        if entropy is not None:
            self.sums["entropy"] += (entropy * m).sum().item()
        if kl is not None:
            self.sums["kl"] += (kl.detach() * m).sum().item()
        self.loss += loss.item() if loss is not None else 0.0

    def step(self, grad_norm) -> None:
        """After each optimizer step: the mini-batch's loss and gradient norm."""
        self.losses.append(self.loss)
        self.norms.append(float(grad_norm))
        self.loss = 0.0

    def metrics(self) -> dict:
        out = {k: v / (self.tokens * (1 if k == "entropy" else self.passes)) for k, v in self.sums.items()}
        out.update(
            self.engine_stats,
            policy_loss=sum(self.losses) / len(self.losses),
            grad_norm=sum(self.norms) / len(self.norms),
        )
        return out


def completion_metrics(ro, rewards: torch.Tensor, group_size: int, success_threshold: float = 1.0) -> dict:
    """TRL-named rollout metrics: reward, reward_std, frac_reward_zero_std, completion lengths; and
    frac_groups_unsolved, the share of groups where no completion's verifier score reaches `success_threshold`."""
    lengths = ro.completion_mask.sum(1).float()
    r = rewards.float().cpu()
    _, inv = torch.unique(ro.group_ids.cpu(), return_inverse=True)
    n = int(inv.max()) + 1
    hi = torch.full((n,), -float("inf")).scatter_reduce(0, inv, r, "amax")
    constant = hi == torch.full((n,), float("inf")).scatter_reduce(0, inv, r, "amin")  # all rewards equal
    score = (ro.scores if ro.scores is not None else rewards).float().cpu()
    best = torch.full((len(constant),), -float("inf")).scatter_reduce(0, inv, score, "amax")
    return {
        "reward": r.mean().item(),
        "reward_std": r.std().item() if len(r) > 1 else 0.0,
        "frac_reward_zero_std": constant.float().mean().item(),
        "frac_groups_unsolved": (best < success_threshold).float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/max_length": lengths.max().item(),
        "completions/min_length": lengths.min().item(),
        "completions/clipped_ratio": ro.truncated.float().mean().item(),
    }

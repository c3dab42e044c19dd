"""Metrics of a run: TensorBoard, `metrics.jsonl` beside it, and Weights & Biases with --track."""

from __future__ import annotations

import json
import os
from pathlib import Path


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
            rows = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").open() if line.strip()]
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

    def close(self) -> None:
        if not self.enabled:
            return
        self.writer.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()

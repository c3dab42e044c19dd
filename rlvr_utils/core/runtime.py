"""What every run does around its algorithm, besides checkpoints (checkpoints.py): the one-line usage error, the one
process's `Dist` (torchrun's, with its collectives, is distributed.py's), stopping on Ctrl-C or SIGTERM, and the run's
metrics: the update's diagnostics (UpdateStats, TRL's names) and where every metric goes (TensorBoard, metrics.jsonl
beside it and read back by metrics_rows, the tracker libraries of --report-to).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import signal
import sys
from collections import defaultdict
from pathlib import Path
from typing import NoReturn, Sequence

import torch


# ----------------------------------------------------------------------------------------------
# the one-line usage error, before anything loads; the extras
# ----------------------------------------------------------------------------------------------
def usage_error(message: str) -> NoReturn:
    """One line on stderr, exit code 2 (as for tyro's own parse errors)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def need(ok: bool, message: str) -> None:
    if not ok:
        usage_error(message)


def extra(module: str, flag: str, *more: tuple[str, str]):
    """rlvr_utils/<folder>/<module>.py (rlvr_utils.WHERE), an extra that `flag` needs, imported where its flag is
    handled. A copy that lacks its file, one it needs (rlvr_utils.REQUIRES) or one of the (module, flag) pairs `more`:
    one line naming them all, exit 2."""
    from rlvr_utils import REQUIRES, WHERE  # the package's map (it imports nothing)

    package, asked = Path(__file__).resolve().parents[1], ((module, flag), *more)
    pairs = [(f, f"{WHERE[n]}/{n}.py") for m, f in asked for n in (m, *REQUIRES.get(m, ()))]
    pairs = [(f, path) for f, path in pairs if not (package / path).exists()]
    files = ", ".join(dict.fromkeys(f"rlvr_utils/{path}" for _, path in pairs))
    flags = ", ".join(dict.fromkeys(f for f, _ in pairs))
    need(not files, f"{flags} needs {files}, which this copy does not have: copy {'them' if ',' in files else 'it'} "
         "from the repository to the same path (README: Copy one method)")  # fmt: skip
    return importlib.import_module(f"rlvr_utils.{WHERE[module].replace('/', '.')}.{module}")


def ablated(args_type, ablations: str | None, flag: str | None = None):
    """args_type, and after them the flags of rlvr_utils/methods/<ablations>.py when `flag` asks for them (without
    `flag`: the command line's first flag that args_type lacks)."""
    names = {f.name for f in dataclasses.fields(args_type)} | {"help", "config"}  # --config: cli.parse's
    words = [w[2:].split("=", 1)[0].replace("-", "_") for w in sys.argv[1:] if w.startswith("--")]
    flag = flag or next((w for w in words if {w, w.removeprefix("no_")}.isdisjoint(names)), None)
    if not ablations or not flag:  # none asked for, or a mistake that tyro names
        return args_type
    module = extra(ablations, f"--{flag.replace('_', '-')} (not the method's flag)")  # docs/design.md
    more = {"__doc__": args_type.__doc__, "ablation_module": module}
    return dataclasses.make_dataclass(args_type.__name__, [], bases=(module.Ablations, args_type), namespace=more)


# ----------------------------------------------------------------------------------------------
# one process: a world of 1, where every method of Dist is what one process does (distributed.py: torchrun's)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Dist:
    """This process's place in a torchrun job: here a world of 1, where every collective is the identity. Under torchrun
    (WORLD_SIZE > 1) `init_distributed` returns distributed.py's subclass, whose methods talk to the other ranks; the
    scripts call the same methods either way (docs/scaling.md)."""

    rank: int = 0
    world: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))  # for collectives
    fsdp: bool = False
    uneven: bool = False  # ranks hold different numbers of rows (SRPO's): FSDP evens their passes (distributed.py)
    mixed: torch.dtype | None = None  # bf16 compute over fp32 masters (models.mixed_precision): `wrap` sets it up

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        return torch.tensor(list(values), dtype=torch.float64).tolist()

    def shard(self, examples: Sequence) -> list:
        """This rank's prompts of a global batch (every world-th one)."""
        return list(examples[self.rank :: self.world])

    def over_global_batch(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) over the global batch (for a method's batch statistics): here, this process's."""
        return fn(*args, **kwargs)

    def loss_counts(self, mask: torch.Tensor, num_seqs: int | None = None) -> tuple[float, float]:
        """(tokens, sequences) to normalize this rank's loss by: the global counts / world."""
        tokens, seqs = self.sum([mask.sum().item(), len(mask) if num_seqs is None else num_seqs])
        return tokens / self.world, seqs / self.world

    def micro_batches(self, train_model, micro: list):
        """Each micro-batch in turn: here `micro` itself (torchrun: all-reduced in the last, `uneven` rows evened);
        then mixed precision's fp32 masters and gradients in the weights for the clip and the step (precision.py)."""
        yield from micro
        if (mixed := getattr(train_model, "_rlvr_precision", None)) is not None:
            mixed.gradients_ready()

    def gathered_if_uneven(self, *models):  # FSDP with `uneven` rows: the no-grad passes on the full weights
        return self.gathered(*models) if self.uneven else contextlib.nullcontext()

    # what torchrun's ranks do together, and one process does alone: the model itself, no collective, nothing to wait
    def wrap(self, model, ref_model=None):  # the module the loss forward runs through (DDP, FSDP2)
        if self.mixed is not None:  # the weights compute as bf16 copies of fp32 masters (precision.py)
            extra("precision", "--dtype bfloat16 (mixed precision)").MixedPrecision(model, self.mixed)
        return model

    @contextlib.contextmanager
    def gathered(self, *models):  # FSDP: the full weights for the block
        yield

    def idle_forward(self, busy: bool, forward) -> None:  # FSDP: forward() where another rank is busy, this not
        pass

    def reduce_metrics(self, metrics: dict) -> dict:  # means over ranks (sums for counts)
        return metrics

    def full_state_dict(self, model) -> dict | None:  # FSDP: the full weights, gathered, for --save-model
        return None

    def broadcast(self, obj):  # rank 0's picklable obj on every rank
        return obj

    def barrier(self) -> None:  # every rank waits for every other
        pass

    def close(self, then_exit: bool = False, code: int = 0) -> None:  # the end of the process group
        pass

    def print(self, *a, **k) -> None:
        """print on rank 0 only, flushed; a closed stdout (`python grpo.py ... | head -1`) does not stop the run: its
        later output goes to /dev/null."""
        if self.main:
            try:
                print(*a, **k, flush=True)
            except BrokenPipeError:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def pick_device(device: str = "auto") -> torch.device:
    """auto: cuda when available, else cpu; otherwise the device named."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def init_distributed(
    device: str, args: dict, prompts_per_step: int, timeout_s: int = 1800, fsdp: bool = False
) -> tuple[Dist, torch.device]:
    """A world of 1, or, under torchrun (WORLD_SIZE > 1), its job (distributed.init_torchrun: the process group,
    every rank's flags compared, the batch divisible by the world size)."""
    if world_size() == 1:
        dev = pick_device(device)
        return Dist(device=dev), dev
    torchrun = extra("distributed", "torchrun (WORLD_SIZE > 1)")  # checked by cli.check_common already
    return torchrun.init_torchrun(device, args, prompts_per_step, timeout_s, fsdp)


TORCHRUN = "start the run with torchrun (torchrun --nproc_per_node N <script> ...), or unset WORLD_SIZE for one process"


def world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when unset); not a whole number >= 1: one line, exit code 2. The variables
    torchrun sets beside it are checked by its extra (distributed.check_env), once every missing file is named."""
    text = os.environ.get("WORLD_SIZE", "1").strip()
    need(text.isascii() and text.isdigit() and int(text) >= 1, f"WORLD_SIZE={text!r}: not a number of processes >= 1; "
         f"{TORCHRUN}")  # fmt: skip
    return int(text)


# ----------------------------------------------------------------------------------------------
# stopping on request: Ctrl-C (SIGINT), SIGTERM (a scheduler's preemption, forwarded by torchrun), SIGHUP (a closing
# terminal): before the first step one line; afterwards after the step, with a checkpoint, every rank at the same step
# ----------------------------------------------------------------------------------------------
class StopNow(SystemExit):
    """The exit a signal asks for at once (exit code 130): raised from a signal handler, wherever the main thread is
    (a reward function's code included, which must let it through)."""


# Ctrl-C, a scheduler's preemption, SIGHUP: a closed terminal or ssh session, SIGUSR1: Slurm's --signal warning
# before a time limit (whose default would end the run silently), where the platform has them
SIGNALS = tuple(getattr(signal, s) for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1") if hasattr(signal, s))


def _ignore_further_signals() -> None:
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


_STOPPED_WHILE_LOADING = []  # the signal, once stop_while_loading's handler has run


def stop_while_loading() -> None:
    """Until the run's first step (GracefulStop then takes over), Ctrl-C or SIGTERM ends the process with one line,
    not a traceback from inside the model loading: nothing has been trained, so nothing is saved."""
    _STOPPED_WHILE_LOADING.clear()  # a second run in the same process (a notebook) starts afresh

    def handler(signum, frame):
        _ignore_further_signals()  # a second Ctrl-C must not interrupt the exit itself (an atexit traceback)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n{name} before the first step: stopped, nothing was saved", file=sys.stderr, flush=True)
        _STOPPED_WHILE_LOADING.append(signum)
        raise StopNow(130)

    for sig in SIGNALS:
        try:
            signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass


def loading_stopped() -> None:
    """Called where loading ends: the stop asked for while loading, if its StopNow was lost (raised inside a __del__
    or a callback, it is printed as ignored and loading goes on), so the run stops here, its one line printed."""
    if _STOPPED_WHILE_LOADING:
        raise StopNow(130)


class GracefulStop:
    """The first Ctrl-C (SIGINT) or SIGTERM (what a cluster scheduler sends before it preempts a job) asks the run to
    stop after the step in progress: the script then saves a checkpoint, closes its logs and exits with one line
    naming the --resume command (exit code 130). A second signal stops at once, with one line and no traceback. Under
    torchrun every rank must agree on the step: `requested(dist)` all-reduces the flag."""

    def __init__(self):
        loading_stopped()
        self.flag = False
        for sig in SIGNALS:
            try:
                signal.signal(sig, self._handler)
            except ValueError:  # not the main thread (e.g. a test runner): the signal keeps its default
                pass

    def _handler(self, signum, frame):
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.flag:
            _ignore_further_signals()  # a third signal must not interrupt the exit itself
            print(f"\n{name} again: stopping now, without a checkpoint of this step", file=sys.stderr, flush=True)
            raise StopNow(130)
        self.flag = True
        what = "the run stops after this step and saves a checkpoint (a second signal stops at once)"
        print(f"\n{name}: {what}", file=sys.stderr, flush=True)

    def requested(self, dist=None) -> bool:
        """Whether a stop was asked for (torchrun: on any rank, so every rank stops after the same step)."""
        return self.flag if dist is None else dist.sum([float(self.flag)])[0] > 0


# ----------------------------------------------------------------------------------------------
# metrics: the update's diagnostics and where every metric goes
# ----------------------------------------------------------------------------------------------
class Logger:
    """Metrics to TensorBoard (`<run_dir>/`), `<run_dir>/metrics.jsonl`, and the tracker libraries `report_to` names
    (--report-to: wandb, trackio, mlflow, through trackers.py; `project`: theirs). `resume_step` k > 0 (--resume): the
    rows after step k are dropped from metrics.jsonl and TensorBoard before the run goes on. `last_eval`: the latest
    evaluation metrics logged (or read back from metrics.jsonl when resuming)."""

    def __init__(self, run_dir, config: dict, report_to=(), project="credit-rlvr", enabled=True, resume_step=0):
        self.enabled = enabled  # False on torchrun ranks > 0
        self.run_dir, self.last_eval = Path(run_dir), None
        if resume_step:
            rows = metrics_rows(self.run_dir / "metrics.jsonl")
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
            table = "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in config.items())
            self.writer.add_text("hyperparameters", table)
            (self.run_dir / "config.json").write_text(json.dumps(config, indent=1, default=str))
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self.trackers = []  # --report-to's tracker libraries (accelerate's trackers)
        if set(report_to) - {"tensorboard", "none"}:
            trackers = extra("trackers", "--report-to")
            self.trackers = trackers.start(report_to, self.run_dir, project, config, resume_step)

    def log(self, metrics: dict, step: int) -> None:
        if "eval/accuracy" in metrics:
            self.last_eval = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if not self.enabled:
            return
        metrics = {k: v for k, v in metrics.items() if k != "step"}  # the row's step is the step's own
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        self.jsonl.write(json.dumps({"step": step, **finite}) + "\n")  # NaN is not JSON: null
        self.jsonl.flush()
        for tracker in self.trackers:
            tracker.log(metrics, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.enabled and text:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.writer.close()
        self.jsonl.close()
        for tracker in self.trackers:
            tracker.finish()


def metrics_rows(path: Path) -> list[dict]:
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
        except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
            if i < len(lines):
                usage_error(f"{path}:{i}: not a JSON line; the run's metrics are damaged")
            print(
                f"warning: {path}:{i}: a partial last line (the run was killed while writing it) is dropped",
                file=sys.stderr,
            )
    return rows


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory measurement (CUDA; nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict:
    """{"memory/peak_gb": peak GPU memory since `reset_peak_memory`} on CUDA, {} on CPU."""
    if device.type != "cuda":
        return {}
    return {"memory/peak_gb": torch.cuda.max_memory_allocated(device) / 2**30}


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
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731  (over the optimizer steps)
        return out | self.engine_stats | dict(policy_loss=mean(self.losses), grad_norm=mean(self.norms))


def completion_metrics(ro, rewards: torch.Tensor, group_size: int, success_threshold: float = 1.0) -> dict:
    """TRL-named rollout metrics: reward, reward_std, frac_reward_zero_std, completion lengths; and
    frac_groups_unsolved, the share of groups where no completion's verifier score reaches `success_threshold`."""
    lengths = ro.completion_mask.sum(1).float()
    r, gids = rewards.float().cpu(), ro.group_ids.cpu()
    score = (ro.scores if ro.scores is not None else rewards).float().cpu()
    if r.isnan().any():  # NaN: a completion no reward function scored (None), left out here as in its advantage
        scored = ~r.isnan() if (~r.isnan()).any() else torch.arange(len(r)) == 0  # none: NaN figures (null)
        r, gids, score = r[scored], gids[scored], score[scored]
    _, inv = torch.unique(gids, return_inverse=True)
    n = int(inv.max()) + 1
    hi = torch.full((n,), -float("inf")).scatter_reduce(0, inv, r, "amax")
    constant = hi == torch.full((n,), float("inf")).scatter_reduce(0, inv, r, "amin")  # all rewards equal
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

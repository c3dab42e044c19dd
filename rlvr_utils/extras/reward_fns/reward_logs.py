"""What --reward-fn functions log, as TRL's GRPOTrainer logs it (reward_calls.py calls them), an extra: each
function's `rewards/<name>/mean` and `/std` over the trained completions it scored, their `log_metric` values (a name
the run logs itself, or `step`, goes under `log_metric/<name>`), `log_extra`'s columns in `<run-dir>/completions.jsonl`,
and the first evaluation's check of --success-threshold.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

from rlvr_utils.core.checkpoints import io_cause, write_failed


class Pending:
    """What a step's (or an evaluation's) calls left to log: each function's values, the log_metric values, the
    weighted totals, and each call's batch (texts, examples, values, log_extra columns, `keys`: each completion's)."""

    def __init__(self):
        self.values, self.metrics, self.totals, self.batches = defaultdict(list), defaultdict(list), [], []


def key(prompt_ids, completion_ids) -> int:
    """A completion by its prompt's and its own tokens (what the trained batch holds of it)."""
    return hash((tuple(prompt_ids), tuple(completion_ids)))


def trained(p: Pending, names: list[str], rows) -> dict:
    """Each function's values for the trained completions, `rows` = (Rollouts, their rewards before any shaping),
    found by their tokens, in their order: SRPO's search chains that are not trained and dynamic sampling's dropped
    groups are left out, as from `reward`. A completion scored more than once (sampled twice): the copy whose reward
    the row has. Every value scored when a call was not given the sampled ids."""
    ro, rewards = rows
    scored = defaultdict(list)
    for b in p.batches:
        for i, k in enumerate(b.get("keys", ())):
            scored[k].append((b, i))
    prompts = [ids[m.bool()].tolist() for ids, m in zip(ro.prompt_ids, ro.prompt_mask)]
    keys = [key(q, c) for q, c in zip(prompts, ro.completion_lists())]
    if any(keys.count(k) > len(scored.get(k, ())) for k in set(keys)):
        return p.values
    found = []
    for k, r in zip(keys, rewards.tolist()):
        same = [c for c in scored[k] if _same(c[0]["totals"][c[1]], r)] or scored[k]
        found.append(same[0])
        scored[k].remove(same[0])
    return {name: [b["values"][name][i] for b, i in found] for name in names}


def _same(a: float, b: float) -> bool:
    """Two rewards (one float64, one float32), both NaN (no reward) or equal to float32 precision."""
    return a != a and b != b or abs(a - b) <= 1e-6 * max(1.0, abs(a))


def stats(values: dict, names: list[str], prefix: str) -> dict:
    """TRL's rewards/<name>/mean and /std: mean and unbiased std over the completions the function scored."""
    out = {}
    for name in names:
        vals = [v for v in values[name] if v is not None]
        if vals:
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
            out[f"{prefix}rewards/{name}/mean"], out[f"{prefix}rewards/{name}/std"] = mean, std
    return out


def extra_file(run_dir, rank: int) -> Path:
    return Path(run_dir) / ("completions.jsonl" if rank == 0 else f"completions_rank{rank}.jsonl")


def trim_extra(run_dir, rank: int, step: int) -> None:
    """--resume after step `step`: this rank's completions.jsonl keeps the rows of steps up to `step` (the steps after
    it are trained again, and would be logged twice; a line a kill cut short goes too), as metrics.jsonl does."""
    path = extra_file(run_dir, rank)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def write_extra(p: Pending, run_dir, rank: int, step: int, mode: str) -> None:
    """log_extra's columns, one line per completion of a call that logged some (TRL's completions table); a full
    disk: one line, exit code 1."""
    if run_dir is None or not any(b["extra"] for b in p.batches):
        return
    path = extra_file(run_dir, rank)
    try:
        with open(path, "a") as f:
            for b in p.batches:
                for i, (text, e) in enumerate(zip(b["texts"], b["examples"])):
                    row = {"step": step, "mode": mode, "row": where(e), "prompt": e.meta.get("prompt", e.prompt)}
                    row |= {"completion": text, **{k: v[i] for k, v in b["values"].items()}}
                    row |= {k: v[i] if i < len(v) else None for k, v in b["extra"].items()}
                    f.write(json.dumps(_finite(row), default=str) + "\n")
    except OSError as e:  # the last checkpoint is what it was
        write_failed(f"writing log_extra's columns to {path} failed ({io_cause(e)})")


def _finite(value):
    """A row as JSON can hold it: a NaN or an infinity (json.dumps writes `NaN`, which JSON readers other than Python's
    refuse) is null, as in metrics.jsonl; inside lists and dicts too, numpy and torch values read as Python's."""
    if hasattr(value, "tolist"):  # a numpy or torch scalar or array (json.dumps would write str(value))
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def check_threshold(totals: list[float], threshold: float, rank: int) -> None:
    """The first evaluation: a warning when every held-out completion is a success, or none although rewards differ.
    `totals`: every evaluated completion's reward, NaN where none was given (no success, as eval/accuracy counts it)."""
    scored = [t for t in totals if t == t]
    share = sum(t >= threshold for t in totals) / len(totals)  # the logged eval/accuracy's share
    spread = max(scored) > min(scored)  # all 0 on a hard task is normal; graded rewards that never reach it are not
    if (share == 1.0 or share == 0.0 and spread) and rank == 0:
        side = "reaches" if share == 1.0 else "is below"
        print(
            f"\nwarning: eval/accuracy {share:.3f} at the first evaluation: every held-out completion's reward "
            f"{side} --success-threshold {threshold:g} (rewards {min(scored):g} to {max(scored):g}), so "
            "successes say nothing; set --success-threshold to the reward a correct completion gets "
            "(README: Your own task)",
            file=sys.stderr,
            flush=True,
        )


_CLASHED: set[str] = set()


def merged(builtin: dict, logged: dict) -> dict:
    """The step's (or evaluation's) metrics with what --reward-fn functions logged: a log_metric name that is already
    one of ours (e.g. "reward", "accuracy" under eval/) or one a metrics row needs ("step") keeps the run's value, and
    the function's goes under log_metric/<name> (eval/log_metric/<name>); a warning says so, once per name."""
    out = dict(builtin)
    for name, v in logged.items():
        bare = name.removeprefix("eval/")
        own, clash = f"{name[: len(name) - len(bare)]}log_metric/{bare}", name in builtin or bare == "step"
        if clash and name not in _CLASHED:
            _CLASHED.add(name)
            print(f"\nwarning: a --reward-fn logged {bare!r} with log_metric, a name of the run's own metrics: it is "
                  f"logged as {own!r}", file=sys.stderr, flush=True)  # fmt: skip
        out[own if clash else name] = v
    return out


def is_number(name: str) -> bool:
    try:
        float(name)
        return True
    except ValueError:
        return False


def where(e) -> str:
    """A row's file line (custom rows) or its prompt id."""
    return e.meta.get("where") or f"prompt id {e.id}"

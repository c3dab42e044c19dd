"""Calling --reward-fn functions as TRL's GRPOTrainer (1.16) calls them, and everything that can go wrong on the way.

Each function gets, as keywords: `prompts`, `completions`, `completion_ids` (the sampled token ids of each completion,
its stop token included), `trainer_state` (transformers' TrainerState: `global_step` = training steps done, 0 while
step 1's completions are scored; `max_steps` = --total-steps; `epoch` = training prompts drawn / their number),
`log_extra(column, values)`, `log_metric(name, value)`, and every other column of the rows (a function without
**kwargs gets only the ones it names). `async def` functions (or callables whose `__call__` is) are awaited, all of a
batch's at once on one event loop. A function returns one number or None per completion: None is "not this function's
row", and a completion's reward is the weighted sum of the numbers it got (TRL's nansum); one that got only None is
rewarded 0 with a warning (TRL 1.16 also leaves it out of its group's mean and gives it no advantage).
Logged per step, as TRL: `rewards/<name>/mean` and `/std` of each function over the completions it scored, each
`log_metric` name (mean of the step's values); evaluations the same under `eval/`. `log_extra` columns go to
`<run-dir>/completions.jsonl`, one line per completion scored in a step where a function called it (TRL's completions
table). Anything else a function does is one line naming it and the row's file line: an exception, a return that is not
a list of one number or None per completion, NaN or inf, `sys.exit` (exit code 1), KeyboardInterrupt (stops now, as a
second Ctrl-C: exit code 130), and a call that runs past `--reward-timeout` seconds.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import numbers
import sys
from collections import defaultdict
from pathlib import Path

from rlvr_utils import watchdog
from rlvr_utils.runtime import StopNow

RESERVED = ("completion_ids", "trainer_state", "log_extra", "log_metric")  # keyword arguments no column may take
MAX_WARNINGS = 5


def _unwrap(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def callable_name(fn) -> str:
    """TRL's name of a reward function: its __name__ (through functools.partial), else its class name."""
    return getattr(_unwrap(fn), "__name__", type(_unwrap(fn)).__name__)


def is_async(fn) -> bool:
    """An `async def` function, or a callable whose __call__ is one (TRL's is_async_callable)."""
    fn = _unwrap(fn)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def trainer_state():
    """transformers' TrainerState, the object TRL passes as `trainer_state`."""
    from transformers import TrainerState

    return TrainerState(global_step=0, max_steps=0, epoch=0.0)


class _Pending:
    """What a step's (or an evaluation's) calls left to log."""

    def __init__(self):
        self.values, self.metrics, self.totals, self.batches = defaultdict(list), defaultdict(list), [], []


class RewardFunctions:
    """The batch reward of a task with --reward-fn: `fns` [(spec, function)], summed with `weights`. Called as
    `(texts, examples, completion_ids=None, mode="train")`; `completion_ids` default: the texts re-encoded with
    `tokenizer` (the sampled ids are exact: pass them). `begin` gives it the run, `metrics` returns (and clears) what
    the step's or the evaluation's calls logged. `timeout`: --reward-timeout seconds per call (0: none).
    `success_threshold`: a run's first evaluation warns when it makes every held-out completion a success, or none."""

    def __init__(self, fns, weights=(), tokenizer=None, timeout: float = 0.0, success_threshold: float = 1.0):
        self.fns, self.weights = list(fns), list(weights) or [1.0] * len(fns)
        names = [callable_name(fn) for _, fn in self.fns]
        self.names = [n if names[:i].count(n) == 0 else f"{n}_{names[:i].count(n) + 1}" for i, n in enumerate(names)]
        self.tokenizer, self.timeout, self.threshold = tokenizer, timeout, success_threshold
        self.state, self.pending = trainer_state(), {"train": _Pending(), "eval": _Pending()}
        self.run_dir, self.rank, self.first_eval, self.warnings, self.loop = None, 0, True, 0, None
        self.prompts_per_step, self.num_train = 0, 0

    def begin(self, run_dir, rank: int, steps_done: int, total_steps: int, prompts_per_step: int, num_train: int):
        """The run: where completions.jsonl goes, this rank, the steps done (a resumed run's), the run's length."""
        self.run_dir, self.rank, self.first_eval = Path(run_dir), rank, steps_done == 0
        self.prompts_per_step, self.num_train = prompts_per_step, max(num_train, 1)
        s = self.state
        s.max_steps, s.train_batch_size = total_steps, prompts_per_step
        s.num_train_epochs = math.ceil(total_steps * prompts_per_step / self.num_train)
        s.is_local_process_zero = s.is_world_process_zero = rank == 0
        self._at(steps_done)

    def _at(self, step: int) -> None:
        self.state.global_step = step
        self.state.epoch = step * self.prompts_per_step / self.num_train if self.num_train else 0.0

    # --- one batch ---------------------------------------------------------------------------------------------
    def __call__(self, texts, examples, completion_ids=None, mode: str = "train") -> list[float]:
        if not texts:  # nothing to score (SRPO's step without continuations): the functions are not called
            return []
        prompts = [e.meta.get("prompt", e.prompt) for e in examples]
        completions = [
            [{"role": "assistant", "content": t}] if e.meta.get("chat") else t for t, e in zip(texts, examples)
        ]
        if completion_ids is None and self.tokenizer is not None:
            completion_ids = self.tokenizer(list(texts), add_special_tokens=False).input_ids
        rows = [_columns(e) for e in examples]
        columns = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)}
        batch = {"texts": list(texts), "examples": list(examples), "values": {}, "extra": {}}
        p = self.pending[mode]
        p.batches.append(batch)
        kwargs = {
            **columns,
            "prompts": prompts,
            "completions": completions,
            "completion_ids": [list(c) for c in completion_ids] if completion_ids is not None else None,
            "trainer_state": self.state,
            "log_extra": functools.partial(self._log_extra, batch),
            "log_metric": functools.partial(self._log_metric, mode),
        }
        outs, waits = {}, []  # by the function's position (a function may be named twice)
        for k, (spec, fn) in enumerate(self.fns):
            call = functools.partial(fn, **_accepted(fn, kwargs))
            if is_async(fn):
                waits.append((k, spec, call))
                continue
            out = self._guard(spec, examples, call)
            if inspect.isawaitable(out):  # a plain function that returned a coroutine
                waits.append((k, spec, lambda out=out: out))
            else:
                outs[k] = out
        if waits:
            outs.update(self._await_all(waits, examples))
        total, scored = [0.0] * len(texts), [False] * len(texts)
        for k, ((spec, _), name, w) in enumerate(zip(self.fns, self.names, self.weights)):
            values = _as_rewards(outs[k], len(texts), spec, examples)
            batch["values"][name] = values
            p.values[name] += values
            for i, v in enumerate(values):
                if v is not None:
                    total[i], scored[i] = total[i] + w * v, True
        if not all(scored):
            self._warn_unscored(scored, examples, texts)
        p.totals += total
        return total

    def _guard(self, spec: str, examples, call, margin: float = 0.0):
        """`call()` under --reward-timeout (plus `margin`), every way out of it one line naming the function."""
        try:
            with watchdog.Watchdog(self.timeout and self.timeout + margin, f"--reward-fn {spec}"):
                return call()
        except BaseException as e:
            _reward_failed(spec, e, self.timeout, examples)

    def _await_all(self, waits, examples) -> dict:
        """The async functions' results, all awaited at once on one event loop (TRL: asyncio.gather)."""

        async def one(k, spec, make):
            try:
                task = asyncio.ensure_future(make())
                done, _ = await asyncio.wait({task}, timeout=self.timeout or None)
                if not done:  # our deadline, not a TimeoutError the function raised itself
                    task.cancel()
                    return k, spec, None, watchdog.RewardTimeout()
                return k, spec, task.result(), None
            except BaseException as e:  # reported with the function's name below
                return k, spec, None, e

        async def gather():
            return await asyncio.gather(*(one(*w) for w in waits))

        self.loop = self.loop or asyncio.new_event_loop()
        names = ", ".join(spec for _, spec, _ in waits)  # a loop a blocking call holds: the watchdog, a moment later
        results = self._guard(names, examples, lambda: self.loop.run_until_complete(gather()), 1.0)
        for _, spec, _, error in results:
            if error is not None:
                _reward_failed(spec, error, self.timeout, examples)
        return {k: out for k, _, out, _ in results}

    def _warn_unscored(self, scored, examples, texts) -> None:
        self.warnings += 1
        if self.warnings > MAX_WARNINGS or self.rank:
            return
        i = scored.index(False)
        more = " (further warnings of this kind are not shown)" if self.warnings == MAX_WARNINGS else ""
        print(
            f"\nwarning: every --reward-fn returned None for {scored.count(False)} of {len(texts)} completions, "
            f"the first of {_where(examples[i])} (completion {texts[i][:60]!r}): each is rewarded 0{more}",
            file=sys.stderr,
            flush=True,
        )

    # --- TRL's logging hooks -----------------------------------------------------------------------------------
    def _log_extra(self, batch: dict, column: str, values) -> None:
        batch["extra"].setdefault(str(column), []).extend(list(values))

    def _log_metric(self, mode: str, name: str, value) -> None:
        try:
            v = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, OverflowError):  # raised inside the function: the one line names it
            raise ValueError(f"log_metric({name!r}, {value!r}): the value must be a number") from None
        self.pending[mode].metrics[str(name)].append(v)

    def metrics(self, step: int | None = None, mode: str = "train") -> dict:
        """What the step's calls (mode "train": `step` is then done) or the evaluation's logged, as metrics; writes
        their log_extra columns. Clears them."""
        p, prefix = self.pending[mode], "eval/" if mode == "eval" else ""
        self.pending[mode] = _Pending()
        out = {}
        for name in self.names:
            vals = [v for v in p.values[name] if v is not None]
            if vals:  # TRL: mean and unbiased std over the completions the function scored
                mean = sum(vals) / len(vals)
                std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
                out[f"{prefix}rewards/{name}/mean"], out[f"{prefix}rewards/{name}/std"] = mean, std
        out.update({prefix + k: sum(v) / len(v) for k, v in p.metrics.items()})
        if mode == "train" and step is not None:
            self._write_extra(p, step, mode)
            self._at(step)  # the step's update is done: its evaluation and the next step's rollouts see it
        if mode == "eval":
            self._write_extra(p, self.state.global_step, mode)
            if self.first_eval and p.totals:
                self.first_eval = False
                self._check_threshold(p.totals)
        return out

    def merged_into(self, builtin: dict, step: int | None = None, mode: str = "train") -> dict:
        """The run's metrics `builtin` with what the functions logged since the last call (`metrics`, `merged`)."""
        return merged(builtin, self.metrics(step, mode))

    def _write_extra(self, p: _Pending, step: int, mode: str) -> None:
        if self.run_dir is None or not any(b["extra"] for b in p.batches):
            return
        name = "completions.jsonl" if self.rank == 0 else f"completions_rank{self.rank}.jsonl"
        with open(self.run_dir / name, "a") as f:
            for b in p.batches:
                for i, (text, e) in enumerate(zip(b["texts"], b["examples"])):
                    row = {"step": step, "mode": mode, "row": _where(e), "prompt": e.meta.get("prompt", e.prompt)}
                    row |= {"completion": text, **{k: v[i] for k, v in b["values"].items()}}
                    row |= {k: v[i] if i < len(v) else None for k, v in b["extra"].items()}
                    f.write(json.dumps(row, default=str) + "\n")

    def _check_threshold(self, totals: list[float]) -> None:
        share = sum(t >= self.threshold for t in totals) / len(totals)
        spread = max(totals) > min(totals)  # all 0 on a hard task is normal; graded rewards that never reach it are not
        if (share == 1.0 or share == 0.0 and spread) and self.rank == 0:
            side = "reaches" if share == 1.0 else "is below"
            print(
                f"\nwarning: eval/accuracy {share:.3f} at the first evaluation: every held-out completion's reward "
                f"{side} --success-threshold {self.threshold:g} (rewards {min(totals):g} to {max(totals):g}), so "
                "successes say nothing; set --success-threshold to the reward a correct completion gets "
                "(README: Your own task)",
                file=sys.stderr,
                flush=True,
            )


def _accepted(fn, kwargs: dict) -> dict:
    """All the keywords for a function with **kwargs (TRL passes them all), else the ones it names."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: everything, as TRL
        return kwargs
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return kwargs
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in named}


def _as_rewards(out, n: int, spec: str, examples) -> list[float | None]:
    """A function's return as one float or None per completion, or one line naming the function (and the row)."""
    if hasattr(out, "detach") or type(out).__module__ == "numpy":  # a torch tensor (any device), a numpy array
        try:
            out = out.detach().cpu().tolist() if hasattr(out, "detach") else out.tolist()
        except Exception as e:  # a meta tensor, ...
            _stop(f"--reward-fn {spec} returned a {type(out).__name__} that cannot be read ({type(e).__name__}: {e})")
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
        _stop(
            f"--reward-fn {spec} returned {_show(out)} for {n} completions: "
            "return a list with one number (or None) per completion"
        )
    try:
        out = list(out)  # a generator runs its code here: what it raises is the function's failure
    except BaseException as e:
        _reward_failed(spec, e, 0, examples)
    if len(out) != n:
        _stop(f"--reward-fn {spec} returned {len(out)} values for {n} completions (one number or None each)")
    values = []
    for i, v in enumerate(out):
        if hasattr(v, "item") and getattr(v, "ndim", 0) == 0 and not isinstance(v, numbers.Real):
            v = v.item()  # a 0-d tensor or array
        if v is None:  # TRL's "this function does not apply to this row"
            values.append(None)
            continue
        at = f"for completion {i} of the batch ({_where(examples[i])})"
        if not isinstance(v, numbers.Real):
            _stop(f"--reward-fn {spec} returned {_show(v)} {at}: a reward must be a number (or None: not its row)")
        try:
            x = float(v)
        except OverflowError:
            _stop(f"--reward-fn {spec} returned an int too large for a float ({str(v)[:20]}...) {at}")
        if not math.isfinite(x):
            _stop(f"--reward-fn {spec} returned {v!r} {at}: a reward must be a finite number (or None: not its row)")
        values.append(x)
    return values


def _reward_failed(spec: str, e: BaseException, timeout: float, examples):
    """One line for what a reward call raised (or how it left), and the exit that goes with it."""
    if isinstance(e, StopNow):  # the second Ctrl-C arrived while a reward ran: the run's own stop
        raise e
    rows = f"scoring {len(examples)} completions, the first of {_where(examples[0])}"
    if isinstance(e, watchdog.RewardTimeout):
        _stop(f"--reward-fn {spec} did not return within {timeout:g} s (--reward-timeout) {rows}")
    if isinstance(e, KeyboardInterrupt):  # as a second Ctrl-C: exit code 130
        why = "stopping now, without a checkpoint of this step (the last checkpoint is kept)"
        _stop(f"--reward-fn {spec} raised KeyboardInterrupt {rows}: {why}", code=130)
    if isinstance(e, SystemExit):
        _stop(f"--reward-fn {spec} called sys.exit({e.code!r}) {rows}: a reward returns its list, it does not exit")
    if not isinstance(e, Exception):
        raise e
    _stop(f"--reward-fn {spec} raised {type(e).__name__}: {_first_line(e)} ({rows})")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] + (" ..." if len(lines) > 1 else "")) if lines else ""


def _show(v) -> str:
    return f"{repr(v)[:60]} ({type(v).__name__})"


def _where(e) -> str:
    """A row's file line (custom rows) or its prompt id."""
    return e.meta.get("where") or f"prompt id {e.id}"


def _columns(e) -> dict:
    """The columns a reward function gets besides prompts and completions: a custom row's own, or a built-in
    task's question and gold answer."""
    return e.meta["columns"] if "columns" in e.meta else {"question": e.question, "answer": e.gold}


def _stop(message: str, code: int = 1):
    print(f"\nerror: {message}", file=sys.stderr, flush=True)  # a new line: a progress bar may be mid-line
    raise SystemExit(code)


_CLASHED: set[str] = set()


def merged(builtin: dict, logged: dict) -> dict:
    """The step's (or evaluation's) metrics with what --reward-fn functions logged: a log_metric name that is already
    one of ours (e.g. "reward", "accuracy" under eval/) does not replace ours; a warning says so, once per name."""
    for name in sorted(set(builtin) & set(logged) - _CLASHED):
        _CLASHED.add(name)
        print(
            f"\nwarning: a --reward-fn logged {name!r} with log_metric, which is one of the run's own metrics: the "
            "run's value is kept; give the metric another name",
            file=sys.stderr,
            flush=True,
        )
    return logged | builtin

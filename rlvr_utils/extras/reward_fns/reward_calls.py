"""Calling --reward-fn functions as TRL's GRPOTrainer (1.16) calls them, and everything that can go wrong on the way.

Each function gets, as keywords: `prompts`, `completions`, `completion_ids` (the sampled token ids of each
completion, its stop token included), `trainer_state` (transformers' TrainerState: `global_step` = training steps
done, 0 while step 1's completions are scored; `max_steps` = --total-steps; `epoch` = training prompts drawn / their
number), `log_extra(column, values)`, `log_metric(name, value)`, and every other column of the rows (a function
without **kwargs gets only the ones it names); each call gets its own copies, and what it changes of torch's or the
process's state is put back after it (reward_isolation.py). `async def` functions (or callables whose `__call__` is)
are awaited, all of a batch's at once on one event loop. A function returns one number or None per completion: None
(or NaN, as TRL reads it) is "not this function's row", and a completion's reward is the weighted sum of the numbers
it got (TRL's nansum); one that got only None has no reward: NaN, which the advantages read as TRL does (left out of
its group's mean and std, advantage 0; common.group_advantages), with a warning.
Logged per step, as TRL: `rewards/<name>/mean` and `/std` of each function over the trained completions it scored,
each `log_metric` name (mean of the step's values; a name the run logs itself goes under `log_metric/<name>`);
evaluations the same under `eval/`. `log_extra` columns go to
`<run-dir>/completions.jsonl`, one line per completion scored in a step where a function called it (TRL's completions
table). Anything else a function does is one line naming it and the row's file line: any exception (BaseExceptions
too), a return that is not a list of one number or None per completion, inf or a number beyond 1e18, `sys.exit` (exit
code 1), KeyboardInterrupt (stops now, as a second Ctrl-C: exit code 130), and a call that runs past
`--reward-timeout` seconds (a generator is drained under it, and stopped at one value more than it may give).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import math
import numbers
import sys
from collections.abc import Iterator
from pathlib import Path

from rlvr_utils.core import runtime
from rlvr_utils.core.runtime import StopNow
from rlvr_utils.extras.reward_fns import reward_isolation, reward_logs, watchdog
from rlvr_utils.extras.reward_fns.reward_isolation import from_signal
from rlvr_utils.extras.reward_fns.reward_isolation import text as _text
from rlvr_utils.extras.reward_fns.reward_logs import where as _where

RESERVED = ("completion_ids", "trainer_state", "log_extra", "log_metric")  # keyword arguments no column may take
MAX_WARNINGS = 5
LARGEST = 1e18  # the largest reward: rewards are trained in float32, where a group's squares must stay finite


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


def unique_names(names: list[str]) -> list[str]:
    """Each function's metric name: a repeated name gets _2, _3, ... (the next suffix no other function has), so
    `f, f, f_2` log as f, f_3, f_2 and no two functions share rewards/<name>/*."""
    out, used = [], set(names)
    for i, n in enumerate(names):
        name, k = n, 2
        while name in out or (name != n and name in used):
            name, k = f"{n}_{k}", k + 1
        out.append(name)
    return out


class RewardFunctions:
    """The batch reward of a task with --reward-fn: `fns` [(spec, function)], summed with `weights`. Called as
    `(texts, examples, completion_ids=None, mode="train")`; `completion_ids` default: the texts re-encoded with
    `tokenizer` (the sampled ids are exact: pass them). `begin` gives it the run, `metrics` returns (and clears) what
    the step's or the evaluation's calls logged. `timeout`: --reward-timeout seconds per call (0: none).
    `success_threshold`: a run's first evaluation warns when it makes every held-out completion a success, or none."""

    def __init__(self, fns, weights=(), tokenizer=None, timeout: float = 0.0, success_threshold: float = 1.0):
        self.fns = list(fns)
        self.weights = list(weights) or [1.0] * len(self.fns)
        self.names = unique_names([callable_name(fn) for _, fn in self.fns])
        self.tokenizer, self.timeout, self.threshold = tokenizer, timeout, success_threshold
        self.state, self.pending = trainer_state(), {"train": reward_logs.Pending(), "eval": reward_logs.Pending()}
        self.run_dir, self.rank, self.first_eval, self.warnings, self.loop = None, 0, True, 0, None
        self.prompts_per_step, self.num_train = 0, 0
        self.guard = reward_isolation.CallGuard()  # what a call may change or leave behind (reward_isolation.py)

    def begin(self, run_dir, rank: int, steps_done: int, total_steps: int, prompts_per_step: int, num_train: int,
              completions: int = 0):  # fmt: skip
        """The run: where completions.jsonl goes, this rank, the steps done (a resumed run's: their logged rows are
        trainer_state.log_history's), the run's length, the completions this rank trains on per step (TRL's batch)."""
        self.run_dir, self.rank, self.first_eval = Path(run_dir), rank, steps_done == 0
        self.prompts_per_step, self.num_train = prompts_per_step, max(num_train, 1)
        s = self.state
        s.max_steps, s.train_batch_size = total_steps, completions or prompts_per_step
        if steps_done and (self.run_dir / "metrics.jsonl").is_file():
            rows = runtime.metrics_rows(self.run_dir / "metrics.jsonl")
            s.log_history = [r for r in rows if r["step"] <= steps_done]
        if steps_done:
            reward_logs.trim_extra(self.run_dir, rank, steps_done)
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
        if completion_ids is not None:  # each completion by its tokens, to find the trained ones again (metrics)
            batch["keys"] = [reward_logs.key(e.prompt_ids, c) for e, c in zip(examples, completion_ids)]
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
        outs, waits, n = {}, [], len(texts)  # by the function's position (a function may be named twice)
        for k, (spec, fn) in enumerate(self.fns):
            call = functools.partial(fn, **reward_isolation.own_copies(_accepted(fn, kwargs)))  # TRL: each batch anew
            if is_async(fn):
                waits.append((k, spec, call))
                continue
            out = self._guard(spec, examples, lambda: _drained(call(), n))  # a generator runs under the timeout
            if inspect.isawaitable(out):  # a plain function that returned a coroutine
                waits.append((k, spec, lambda out=out: out))
            else:
                outs[k] = out
        if waits:
            outs.update(self._await_all(waits, examples, n))
        total, scored = [0.0] * n, [False] * n
        for k, ((spec, _), name, w) in enumerate(zip(self.fns, self.names, self.weights)):
            values = _as_rewards(outs[k], n, spec, examples)
            batch["values"][name] = values
            p.values[name] += values
            for i, v in enumerate(values):
                if v is not None:
                    total[i], scored[i] = total[i] + w * v, True
        for i, t in enumerate(total):
            if not abs(t) <= LARGEST:
                where = f"for completion {i} of the batch ({_where(examples[i])})"
                _stop(f"--reward-fn's weighted sum is {t:g} {where}: beyond {LARGEST:g} (rewards are trained in "
                      "float32); use smaller rewards or --reward-weights")  # fmt: skip
        if not all(scored):  # no reward (TRL): NaN, left out of its group's mean and std, advantage 0
            self._warn_unscored(scored, examples, texts)
            total = [t if s else math.nan for t, s in zip(total, scored)]
        p.totals += total
        batch["totals"] = total
        return total

    def _guard(self, spec: str, examples, call, margin: float = 0.0):
        """`call()` under --reward-timeout (plus `margin`), every way out of it one line naming the function."""
        try:
            seconds = self.timeout and self.timeout + margin
            with self.guard.call(spec), watchdog.Watchdog(seconds, f"--reward-fn {spec}"):
                return call()
        except BaseException as e:
            _reward_failed(spec, e, self.timeout, examples)

    def _await_all(self, waits, examples, n: int) -> dict:
        """The async functions' results, all awaited at once on one event loop (TRL: asyncio.gather)."""

        async def one(k, spec, make):
            try:
                task = asyncio.ensure_future(make())
                done, _ = await asyncio.wait({task}, timeout=self.timeout or None)
                if not done:  # our deadline, not a TimeoutError the function raised itself
                    task.cancel()
                    return k, spec, None, watchdog.RewardTimeout()
                return k, spec, _drained(task.result(), n), None
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
            f"the first of {_where(examples[i])} (completion {texts[i][:60]!r}): each has no reward, so it is left out "
            f"of its group's mean and std and gets advantage 0, as in TRL{more}",
            file=sys.stderr,
            flush=True,
        )

    # --- TRL's logging hooks -----------------------------------------------------------------------------------
    def _log_extra(self, batch: dict, column: str, values) -> None:
        batch["extra"].setdefault(str(column), []).extend(list(values))

    def _log_metric(self, mode: str, name: str, value) -> None:
        if (
            not isinstance(name, str) or not name.strip() or reward_logs.is_number(name)
        ):  # raised inside: the line names it
            raise ValueError(f"log_metric({name!r}, ...): a metric's name must be a non-empty string, not a number")
        try:
            v = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, OverflowError):  # raised inside the function: the one line names it
            raise ValueError(f"log_metric({name!r}, {value!r}): the value must be a number") from None
        self.pending[mode].metrics[str(name)].append(v)

    def metrics(self, step: int | None = None, mode: str = "train", rows=None) -> dict:
        """What the step's calls (mode "train": `step` is then done) or the evaluation's logged, as metrics: the
        functions' rewards/<name>/* over the completions of `rows` (the Rollouts trained on; default: every one
        scored) and the log_metric values. Writes their log_extra columns. Clears them."""
        p, prefix = self.pending[mode], "eval/" if mode == "eval" else ""
        self.pending[mode] = reward_logs.Pending()
        values = reward_logs.trained(p, self.names, rows) if rows is not None else p.values
        out = reward_logs.stats(values, self.names, prefix)
        logged = {prefix + k: sum(v) / len(v) for k, v in p.metrics.items()}
        if mode == "train" and step is not None:
            reward_logs.write_extra(p, self.run_dir, self.rank, step, mode)
            self._at(step)  # the step's update is done: its evaluation and the next step's rollouts see it
        if mode == "eval":
            reward_logs.write_extra(p, self.run_dir, self.rank, self.state.global_step, mode)
            if self.first_eval and [t for t in p.totals if t == t]:  # t == t: scored (not NaN)
                self.first_eval = False
                reward_logs.check_threshold(p.totals, self.threshold, self.rank)  # as eval/accuracy: NaN no success
        return reward_logs.merged(out, logged)

    def merged_into(self, builtin: dict, step: int | None = None, mode: str = "train", rows=None) -> dict:
        """The run's metrics `builtin` with what the functions logged since the last call (`metrics`, `merged`), also
        kept as trainer_state.log_history's row of the step (the evaluation joins its step's row)."""
        out, history = reward_logs.merged(builtin, self.metrics(step, mode, rows)), self.state.log_history
        if history and history[-1]["step"] == self.state.global_step and mode == "eval":
            history[-1].update(out)
        else:
            history.append({"step": self.state.global_step, **out})
        return out


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
    array = str(type(out).__module__).startswith("numpy")  # a numpy array; numpy.ma's: None where masked
    if hasattr(out, "detach") or array:  # a torch tensor (any device)
        try:
            out = out.detach().cpu().tolist() if hasattr(out, "detach") else out.tolist()
        except Exception as e:  # a meta tensor, ...
            what = f"a {type(out).__name__} that cannot be read ({type(e).__name__}: {_first_line(e)})"
            _stop(f"--reward-fn {spec} returned {what}")
    if isinstance(out, (set, frozenset)):  # its order is not the completions' (nor stable across runs)
        _stop(f"--reward-fn {spec} returned a {type(out).__name__}, which has no order to match the completions by: "
              "return a list with one number (or None) per completion")  # fmt: skip
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
        _stop(
            f"--reward-fn {spec} returned {_show(out)} for {n} completions: "
            "return a list with one number (or None) per completion"
        )
    drained = isinstance(out, _Drained)  # a generator's values, at most n + 1
    try:
        out = list(out)  # an iterable's own code runs here: what it raises is the function's failure
    except BaseException as e:
        _reward_failed(spec, e, 0, examples)
    if len(out) != n:
        count = f"more than {n}" if drained and len(out) > n else len(out)
        _stop(f"--reward-fn {spec} returned {count} values for {n} completions (one number or None each)")
    values = []
    for i, v in enumerate(out):
        at = f"for completion {i} of the batch ({_where(examples[i])})"
        v = None if type(v).__name__ == "MaskedConstant" else v  # numpy.ma.masked: None, as its tolist() (not 0.0)
        try:
            if hasattr(v, "item") and getattr(v, "ndim", 0) == 0 and not isinstance(v, numbers.Real):
                v = v.item()  # a 0-d tensor or array
            x = float(v) if isinstance(v, numbers.Real) else v
        except OverflowError:
            _stop(f"--reward-fn {spec} returned an int too large for a float ({_text(v, str)[:20]}...) {at}")
        except BaseException as e:  # the value's own code (a Real of its own): the function's failure
            _reward_failed(spec, e, 0, examples)
        if v is None or isinstance(x, float) and math.isnan(x):  # TRL's "this function does not apply to this row"
            values.append(None)
            continue
        if not isinstance(v, numbers.Real):
            _stop(f"--reward-fn {spec} returned {_show(v)} {at}: a reward must be a number (or None: not its row)")
        if not abs(x) <= LARGEST:
            _stop(f"--reward-fn {spec} returned {_text(v)} {at}: a reward must be a finite number of at most "
                  f"{LARGEST:g} in magnitude (rewards are trained in float32), or None: not its row")  # fmt: skip
        values.append(x)
    return values


def _reward_failed(spec: str, e: BaseException, timeout: float, examples):
    """One line for what a reward call raised (or how it left), and the exit that goes with it."""
    if isinstance(e, StopNow) and from_signal(e):  # the second Ctrl-C arrived while a reward ran: the run's own stop
        raise e
    rows = f"scoring {len(examples)} completions, the first of {_where(examples[0])}"
    if isinstance(e, watchdog.RewardTimeout):
        _stop(f"--reward-fn {spec} did not return within {timeout:g} s (--reward-timeout) {rows}")
    if isinstance(e, KeyboardInterrupt):  # as a second Ctrl-C: exit code 130
        why = "stopping now, without a checkpoint of this step (the last checkpoint is kept)"
        _stop(f"--reward-fn {spec} raised KeyboardInterrupt {rows}: {why}", code=130)
    returns = "a reward returns its list, it does not"
    if isinstance(e, StopNow):  # raised by the reward itself: only the run's signal handlers stop the run
        _stop(f"--reward-fn {spec} raised the run's own StopNow {rows}: {returns} stop the run")
    if isinstance(e, SystemExit):
        _stop(f"--reward-fn {spec} called sys.exit({_text(e.code)}) {rows}: {returns} exit")
    _stop(f"--reward-fn {spec} raised {type(e).__name__}: {_first_line(e)} ({rows})")


def _first_line(e: BaseException) -> str:
    lines = _text(e, str).strip().splitlines()
    return (lines[0] + (" ..." if len(lines) > 1 else "")) if lines else ""


def _show(v) -> str:
    return f"{_text(v)[:60]} ({type(v).__name__})"


def _columns(e) -> dict:
    """The columns a reward function gets besides prompts and completions: a custom row's own, or a built-in
    task's question and gold answer."""
    return e.meta["columns"] if "columns" in e.meta else {"question": e.question, "answer": e.gold}


def _stop(message: str, code: int = 1):
    print(f"\nerror: {message}", file=sys.stderr, flush=True)  # a new line: a progress bar may be mid-line
    raise SystemExit(code)


class _Drained(list):
    """A generator's (an iterator's) values, drained under --reward-timeout: at most one more than it may give."""


def _drained(out, n: int):
    """`out`, or the values of an iterator (a generator reward), at most n + 1 of them (an endless one stops there)."""
    return _Drained(itertools.islice(out, n + 1)) if isinstance(out, Iterator) else out

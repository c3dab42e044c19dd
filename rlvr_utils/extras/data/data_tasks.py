"""The tasks that read data, an extra (loaded with --task gsm8k, math, code or custom, --data-path, --eval-data-path or
--reward-fn): the hub dataset through `datasets.load_dataset`, or a local file or directory with --data-path, read as
TRL's users read it (datafiles.py: checked line by line, then through `datasets.load_dataset`); custom: a file, a
directory or a hub id. gsm8k and math (rewards.py), code (sandbox.py: HumanEval's format or an MBPP-like one), custom
(custom.py: the user's rows and reward functions). Their checks run before anything loads (cli.parse): each problem
one line naming the flag or file, exit code 2.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

from rlvr_utils.core.models import looks_like_path
from rlvr_utils.core.runtime import extra, need, usage_error  # extra: each task's own modules, where they are used
from rlvr_utils.core.tasks import HUB_DATASETS, MATH_INSTRUCTION, Example, TaskBuilder, encode_prompt
from rlvr_utils.extras.model_checks import need_hub


def build(b, code_timeout: float, code_sandbox: str = "bwrap"):
    """(train, eval, reward_fn, batch_reward_fn) of task b.name (gsm8k, math, code or custom); b: tasks' TaskBuilder."""
    if b.name == "code":
        if not code_timeout > 0:
            raise ValueError(f"--code-timeout must be a positive number of seconds, got {code_timeout}")
        return _code_task(b, code_timeout, code_sandbox)
    return _custom_task(b) if b.name == "custom" else _text_task(b)


def _exists(path: str) -> bool:
    """Whether a path flag's file or directory is here, a leading ~ read as the shell would (bash leaves it as written
    after `--data-path=`), as datafiles reads it."""
    return Path(os.path.expanduser(path)).exists()


def _load_rows(task: str, data_path: str | None, split_kind: str) -> tuple[list[dict], list[str]]:
    """Rows of a local data file or directory (`data_path`, as `datasets` reads it: datafiles.py) or of the task's hub
    dataset, and where each row came from (`file:line`, `dataset[split] row N`)."""
    if data_path and task == "custom" and not _exists(data_path):  # a hub dataset id
        name, config, split = data_path, None, "train" if split_kind == "train" else "test"
    elif data_path:
        return extra("datafiles", "--data-path").read_rows(data_path)
    else:
        name, config, train_split, eval_split = HUB_DATASETS[task]
        split = train_split if split_kind == "train" else eval_split
    from datasets import load_dataset

    rows = list(load_dataset(name, config, split=split))
    return rows, [f"{name}[{split}] row {i}" for i in range(1, len(rows) + 1)]


def row_problem(task: str, row: dict) -> str | None:
    """What is wrong with a data row for `task` (a missing field, named), or None. Checked for every row of a
    local file before anything loads (cli.py), and again while building the task (hub datasets)."""
    if task == "gsm8k":
        need = [f for f in ("question", "answer") if f not in row]
    elif task == "math":
        need = [f for f in ("problem",) if f not in row] + (
            [] if "answer" in row or "solution" in row else ["answer (or solution)"]
        )
    elif task == "code" and "test_list" in row:  # MBPP-like
        tests = row["test_list"]
        if tests is not None and not (isinstance(tests, list) and all(isinstance(t, str) for t in tests)):
            return (
                f"code rows' test_list must be a list of assert lines (a JSON array; a CSV or TSV cell is one string), "
                f"not {type(tests).__name__} {str(tests)[:60]!r}"
            )
        need = [] if "text" in row or "prompt" in row else ["text (or prompt)"]
    elif task == "code":  # HumanEval-like
        need = [f for f in ("prompt", "test", "entry_point") if f not in row]
    else:
        return None
    return f"{task} rows need the field(s) {need}; this row has {sorted(row)}" if need else None


def _require(row: dict, where: str, task: str) -> None:
    problem = row_problem(task, row)
    if problem:
        raise KeyError(f"{where}: {problem}")


def from_rows(b, convert) -> tuple[list[Example], list[Example]]:
    """Train and eval examples of the hub dataset or local files, `convert(rows, wheres, id_offset)` row by row.
    Eval: `eval_data_path`, else the hub's eval split, else the first `num_eval` rows of the one file (at most a
    fifth of a file smaller than 2 * num_eval). b: tasks' TaskBuilder."""
    same = b.data_path and b.eval_data_path and _exists(b.data_path) and _exists(b.eval_data_path)
    if same and os.path.samefile(os.path.expanduser(b.data_path), os.path.expanduser(b.eval_data_path)):
        print(f"warning: --eval-data-path {b.eval_data_path} is the --data-path file: the run is evaluated on the "
              "rows it trains on, so eval/accuracy says nothing about held-out prompts", file=sys.stderr)  # fmt: skip
    rows, wheres = _load_rows(b.name, b.data_path, "train")
    if b.eval_data_path or (not b.data_path and HUB_DATASETS.get(b.name, (0, 0, 0, None))[3]):
        eval_rows, eval_wheres = _load_rows(b.name, b.eval_data_path, "eval")
        return convert(rows, wheres, 0), convert(eval_rows, eval_wheres, 10**9)[: b.num_eval]
    k = b.num_eval if len(rows) >= 2 * b.num_eval else len(rows) // 5
    return convert(rows[k:], wheres[k:], 0), convert(rows[:k], wheres[:k], 10**9)


def _text_task(b: TaskBuilder):
    """gsm8k (question, answer with `#### N`) or math (problem, answer or solution with \\boxed{})."""
    rewards = extra("rewards", f"--task {b.name}")

    def convert(rows, wheres, offset):
        out = []
        for i, (row, where) in enumerate(zip(rows, wheres)):
            _require(row, where, b.name)
            if b.name == "gsm8k":
                q, gold = row["question"], rewards.gsm8k_gold(str(row["answer"]))
                ok = gold is not None
            else:
                q = row["problem"]
                gold = str(row["answer"]) if "answer" in row else rewards.last_boxed(str(row["solution"]))
                ok = gold is not None and bool(rewards.parse_math_gold(gold))
            if not ok:
                b.skipped["unparsable_gold"] += 1
                continue
            ex = b.example(
                offset + i, q, gold, f"{q}\n{MATH_INSTRUCTION}", f"Question: {q}\n{MATH_INSTRUCTION}\nAnswer:"
            )
            if ex is not None:
                out.append(ex)
        return out

    reward = rewards.gsm8k_reward if b.name == "gsm8k" else rewards.math_reward
    return *from_rows(b, convert), lambda completion, ex: reward(completion, ex.gold), None


def _code_task(b: TaskBuilder, timeout: float, code_sandbox: str):
    """HumanEval's format (prompt, test, entry_point) or an MBPP-like one (text or prompt, test_list, optional
    test_setup_code); reward = fraction of tests passed in `code_sandbox` (a ValueError where it cannot start)."""
    b.skipped["no_tests_or_entry_point"] = 0
    sandbox = extra("sandbox", "--task code")
    if (problem := sandbox.isolation_problem(code_sandbox)) is not None:
        raise ValueError(problem)
    if code_sandbox == "audit-hook":
        print(f"warning: --code-sandbox audit-hook: {sandbox.WEAK}", file=sys.stderr)

    def convert(rows, wheres, offset):
        out = []
        for i, (row, where) in enumerate(zip(rows, wheres)):
            _require(row, where, b.name)
            if "test_list" in row:  # MBPP-like: the model writes the whole function
                text = row.get("text", row.get("prompt"))
                tests = [str(t) for t in row["test_list"] or []]
                m = (
                    re.search(r"assert\s+(?:not\s+)?\(?\s*(?:set\()?\s*([A-Za-z_]\w*)\s*\(", tests[0])
                    if tests
                    else None
                )
                entry = row.get("entry_point") or (m.group(1) if m else None)
                shown = "\n".join(tests)
                user = (
                    f"{text}\nYour code should pass these tests:\n{shown}\n"
                    "Reply with the code in one ```python code block."
                )
                plain = f'"""\n{text}\n{shown}\n"""\n'
                meta = dict(prompt_code="", tests=tests, setup=str(row.get("test_setup_code") or ""), entry_point=entry)
                gold, q = str(row.get("code", "")), text
            else:
                q, entry = row["prompt"], row["entry_point"]
                user, plain = f"{sandbox.CODE_INSTRUCTION}\n```python\n{q}```", q
                meta = dict(prompt_code=q, tests=str(row["test"]), setup="", entry_point=entry)
                gold = str(row.get("canonical_solution", ""))
            if not meta["tests"] or not entry:
                b.skipped["no_tests_or_entry_point"] += 1
                continue
            ex = b.example(offset + i, q, gold, user, plain, meta)
            if ex is not None:
                out.append(ex)
        return out

    def code_batch(texts, examples):
        programs = [
            sandbox.code_program(e.meta["prompt_code"], t, e.meta["entry_point"]) for t, e in zip(texts, examples)
        ]
        return sandbox.code_rewards(
            programs,
            [e.meta["tests"] for e in examples],
            [e.meta["entry_point"] for e in examples],
            timeout,
            setups=[e.meta["setup"] for e in examples],
            sandbox=code_sandbox,
        )

    return *from_rows(b, convert), lambda completion, ex: code_batch([completion], [ex])[0], code_batch


def _custom_task(b: TaskBuilder):
    """The user's rows (custom.py): `prompt` a string or chat messages, every other column for the reward."""
    custom = extra("custom", "--task custom")

    def convert(rows, wheres, offset):
        out = []
        for i, (row, where) in enumerate(zip(rows, wheres)):
            problem = custom.prompt_problem(row)
            if problem:
                raise KeyError(f"{where}: {problem}")
            text, user, chat = custom.render(b.tokenizer, row["prompt"])
            ids = encode_prompt(b.tokenizer, text, b.max_prompt_length)
            if ids is None or len(ids) > b.max_prompt_length:
                b.skipped["prompt_too_long"] += 1
                continue
            columns = {k: v for k, v in row.items() if k != "prompt"}
            meta = {"prompt": row["prompt"], "chat": chat, "columns": columns, "where": where}
            out.append(Example(offset + i, user, "", text, ids, user if chat else "", meta))
        return out

    return *from_rows(b, convert), None, None


# ----------------------------------------------------------------------------------------------
# the checks before anything loads
# ----------------------------------------------------------------------------------------------
def read_rows(path: str, flag: str) -> list[dict]:
    """Every row of a local data file or directory (datafiles.py: as `datasets` reads it, with `file:line: reason` for
    a line that is not a JSON object), and a clear error for a missing, empty or unreadable file."""
    return read_rows_where(path, flag)[0]


def read_rows_where(path: str, flag: str) -> tuple[list[dict], list[str]]:
    """`read_rows` and where each row came from (`file:line`)."""
    need(_exists(path), f"{flag} {path}: no such file")
    datafiles = extra("datafiles", flag)
    try:
        return datafiles.read_rows(path)
    except (datafiles.DataFileError, FileNotFoundError) as e:
        usage_error(str(e) if isinstance(e, datafiles.CacheError) else f"{flag} {e}")  # the cache: not the file's fault


def check_data(task: str, path: str | None, flag: str) -> None:
    if path is None:
        return
    need(
        task != "arith",
        f"{flag} {path}: --task arith is built in and reads no data file (use --task gsm8k, math, code or custom)",
    )
    if task == "custom" and not _exists(path) and not looks_like_path(path):  # a hub dataset id
        if not dataset_cached(path):
            need_hub(f"{flag} {path} is not a local file, so it names a hub dataset", "a local .jsonl file")
        return
    custom = extra("custom", "--task custom") if task == "custom" else None
    for i, (row, where) in enumerate(zip(*read_rows_where(path, flag)), 1):
        problem = custom.prompt_problem(row) if custom else row_problem(task, row)
        need(problem is None, f"{extra('datafiles', flag).row_name(where, i)}: {problem}")


def check_custom(a: dict) -> None:
    """--task custom needs rows and a reward; every --reward-fn must import and take TRL's arguments (the user's file
    is imported here, before anything loads)."""
    if a["task"] == "custom":
        need(a["data_path"] is not None, "--task custom needs --data-path (a .jsonl file of rows with a 'prompt')")
        need(bool(a["reward_fn"]), "--task custom needs --reward-fn PATH.py:NAME (README: Your own task)")
    need(
        not a["reward_weights"] or len(a["reward_weights"]) == len(a["reward_fn"]),
        f"--reward-weights gives {len(a['reward_weights'])} weights for {len(a['reward_fn'])} --reward-fn",
    )
    for spec in a["reward_fn"]:  # the reward-call layer: only with --reward-fn
        custom = extra("custom", "--reward-fn")
        try:
            custom.load_reward_fn(spec)
        except custom.RewardFnError as e:
            usage_error(str(e))


def dataset_cached(name: str) -> bool:
    """Whether the `datasets` or hub cache holds something of hub dataset `name` (then offline loading may work)."""
    home = Path(os.path.expanduser(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")))
    roots = [
        Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")),
        Path(os.environ.get("HF_HUB_CACHE", home / "hub")),
    ]
    keys = (name.replace("/", "___"), "datasets--" + name.replace("/", "--"))
    return any(r.is_dir() and any(p.name.startswith(keys) for p in r.iterdir()) for r in roots)


def check(a: dict) -> None:
    """The data flags' checks (cli.parse runs them before anything loads): --reward-fn, --data-path and
    --eval-data-path rows, rows left for training, a hub dataset that cannot be fetched, and the code task's sandbox
    (bubblewrap able to start here, or --code-sandbox audit-hook)."""
    check_custom(a)
    check_data(a["task"], a["data_path"], "--data-path")
    check_data(a["task"], a["eval_data_path"], "--eval-data-path")
    if a["task"] != "arith" and a["data_path"] is not None and a["eval_data_path"] is None:
        check_rows_left(a)
    hub = HUB_DATASETS.get(a["task"], (None,))[0]
    if hub is not None and a["data_path"] is None and not dataset_cached(hub):
        need_hub(f"--task {a['task']} downloads its dataset ({hub})", "--data-path FILE")
    if a["task"] == "code" and not a["reward_fn"]:  # bwrap installed and able to start, or the weaker sandbox accepted
        need((problem := extra("sandbox", "--task code").isolation_problem(a["code_sandbox"])) is None, problem)


def check_rows_left(a: dict) -> None:
    """A data file whose rows are all held out for evaluation (no --eval-data-path): one line."""
    if not _exists(a["data_path"]):
        return
    n = len(read_rows(a["data_path"], "--data-path"))
    held = a["num_eval"] if n >= 2 * a["num_eval"] else n // 5  # as tasks: a fifth of a small file
    need(
        n == 0 or (held >= 1 and n - held >= a["prompts_per_step"]),
        f"--data-path {a['data_path']}: {n} rows, {held} held out for evaluation (--num-eval {a['num_eval']}, at "
        f"most a fifth of a small file): too few for a held-out set and batches of --prompts-per-step "
        f"{a['prompts_per_step']} (pass --eval-data-path, or more rows)",
    )


def file_hashes(args) -> dict:
    """sha256 of the run's data (a file or a directory) and reward files by role (--data-path, --eval-data-path, each
    --reward-fn file), recorded in config.json: a resume warns when one changed, also when it moved and is given
    anew."""
    files = {"--data-path": getattr(args, "data_path", None), "--eval-data-path": getattr(args, "eval_data_path", None)}
    for i, spec in enumerate(getattr(args, "reward_fn", ()) or ()):
        files[f"--reward-fn {i + 1}"] = spec.rsplit(":", 1)[0]
    return {role: _digest(Path(os.path.expanduser(p))) for role, p in files.items() if p and _exists(p)}


def _digest(path: Path) -> str:
    """sha256 of a file's bytes; of a data directory: of each data file's name and bytes, in name order."""
    datafiles = extra("datafiles", "--data-path or --reward-fn")
    if path.is_file():
        return datafiles.sha256_file(path).hexdigest()
    h = hashlib.sha256()
    try:
        for f in datafiles.data_files(path):
            h.update(f.name.encode() + b"\0")
            datafiles.sha256_file(f, h)
    except (datafiles.DataFileError, OSError):  # no data file in it: the checks say so
        pass
    return h.hexdigest()

"""--config FILE, an extra: the flags a YAML, TOML or JSON file gives, as TRL's `--config recipe.yaml` gives them; its
keys are the flags' names (`learning_rate` or `learning-rate`), and the command line overrides it. A run directory's
config.json is such a file: `python sc_grpo.py --config runs/<run>/config.json` starts that run again (its `script`
must be the one running; `file_hashes` is --resume's, not a flag). The file is read with the standard parsers (PyYAML's
safe_load, tomllib, json); each value becomes the command-line words it stands for (`true`: --flag, `false`:
--no-flag, a list: the flag's values, null: None), and tyro, which parses the command line, parses them: a value is
right in the file exactly when it is right on the command line. An unknown key, a value of the wrong type, an
unreadable or missing file: one line naming the file and the key, exit code 2, before anything loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import sys
import typing
from pathlib import Path

from rlvr_utils.core.runtime import ablated, need, usage_error

SUFFIXES = (".yaml", ".yml", ".toml", ".json")
RUN_DIR_KEYS = ("script", "file_hashes")  # what config.json holds besides the flags


class Refused(Exception):
    """tyro's complaint about the words one key stands for."""


def read(argv: list[str]) -> tuple[str, dict]:
    """(the file --config names, its keys as field names and their values), or one line, exit code 2."""
    at = [i for i, w in enumerate(argv) if w == "--config" or w.startswith("--config=")]
    need(len(at) == 1, "--config is given more than once: give one file (the command line overrides it)")
    word = argv[at[0]]
    need(word != "--config" or at[0] + 1 < len(argv), "--config needs a file: --config FILE.yaml")
    path = word.split("=", 1)[1] if "=" in word else argv[at[0] + 1]
    p = Path(path).expanduser()
    need(p.suffix.lower() in SUFFIXES, f"--config {path}: a .yaml, .yml, .toml or .json file")
    need(p.is_file(), f"--config {path}: {'not a file' if p.exists() else 'no such file'}")
    kind = {".yml": ".yaml"}.get(p.suffix.lower(), p.suffix.lower())
    try:
        text = p.read_text()
        if kind == ".yaml":
            import yaml  # PyYAML (transformers' and datasets' requirement)

            data = yaml.safe_load(text)
        elif kind == ".toml":
            import tomllib  # the standard library's, Python 3.11+

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ImportError as e:
        usage_error(f"--config {path}: {kind[1:].upper()} needs {e.name} (pip install pyyaml; TOML: Python 3.11+)")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON's, TOML's
        why = " ".join(str(e).split())[:200]
        usage_error(f"--config {path}: not valid {kind[1:].upper()} ({why})")
    except Exception as e:  # PyYAML's YAMLError and its kin
        usage_error(f"--config {path}: not valid YAML ({' '.join(str(e).split())[:200]})")
    top = f"--config {path}: its top level must be a mapping of flags, not {type(data).__name__}"
    need(isinstance(data, dict), top)
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        need(name not in out, f"--config {path}: {key} is given twice (as {name} and {name.replace('_', '-')})")
        out[name] = value
    script = Path(sys.argv[0]).name
    made_by = out.pop("script", script)
    need(made_by == script, f"--config {path}: its flags are {made_by}'s (script: {made_by}), not {script}'s: run "
         f"python {made_by} --config {path}")  # fmt: skip
    out.pop("file_hashes", None)
    need(out.get("resume") is None, f"--config {path}: resume: a resumed run keeps the flags of its own config.json; "
         "give --resume RUN_DIR on the command line without --config")  # fmt: skip
    need("--resume" not in argv, "--config and --resume: a resumed run keeps the flags of its own config.json; give "
         "--resume RUN_DIR without --config")  # fmt: skip
    return path, out


def flags(args_type, ablations: str | None, argv: list[str], parse) -> tuple[type, list[str]]:
    """cli.parse's --config: (args_type, with the ablation module's flags where a key or the line names one, and
    the words of the file's keys that the command line `argv` does not give), every key checked by tyro first
    (`parse(args_type, words, on_error)`: flag_groups.parse)."""
    path, values = read(argv)
    names = {f.name for f in dataclasses.fields(args_type)}
    args_type = ablated(args_type, ablations, next((k for k in values if k not in names), None))
    args_type = ablated(args_type, ablations)  # or one the command line names
    quiet = functools.partial(parse, args_type, on_error=Refused)
    return args_type, check(path, words(path, values, args_type, argv), quiet)


def words(path: str, values: dict, args_type, argv: list[str]) -> dict[str, list[str]]:
    """{key: the command-line words its value stands for}, without the keys the command line gives (it overrides
    them; a repeated flag such as --reward-fn would add to them otherwise). Unknown keys and values of no flag's form
    (a mapping, a list for a single value, a bool flag's non-boolean): one line naming the file and the key."""
    hints = typing.get_type_hints(args_type)
    fields = [f.name for f in dataclasses.fields(args_type)]
    named = {n for w in argv if w.startswith("--") for n in (w[2:].split("=", 1)[0].replace("-", "_"),)}
    named |= {n.removeprefix("no_") for n in named}
    out = {}
    for key, value in values.items():
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f" (did you mean {close[0]}?)" if close else f" (the flags: {Path(sys.argv[0]).name} --help)"
        need(key in hints, f"--config {path}: {key} is not a flag of {Path(sys.argv[0]).name}{hint}")
        if key in named:
            continue
        flag, kind = "--" + key.replace("_", "-"), hints[key]
        many = typing.get_origin(kind) is tuple
        if kind is bool:
            need(isinstance(value, bool), f"--config {path}: {key} is {value!r}, not true or false")
            out[key] = [flag if value else f"--no-{key.replace('_', '-')}"]
            continue
        need(not isinstance(value, dict), f"--config {path}: {key} is a mapping, not a value of {flag}")
        need(many or not isinstance(value, list), f"--config {path}: {key} is a list, not one value of {flag}")
        items = value if isinstance(value, list) else [value]
        text = ["None" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for v in items]
        need(all(not isinstance(v, (dict, list)) for v in items), f"--config {path}: {key} holds a nested value")
        repeated = "UseAppendAction" in str(typing.get_type_hints(args_type, include_extras=True)[key])
        if repeated:  # --reward-fn a --reward-fn b
            out[key] = [w for t in text for w in (flag, t)]
        else:  # --flag=value (a value may start with "-"), or --flag v1 v2
            out[key] = [flag, *text] if many else [f"{flag}={text[0]}"]
    return out


def check(path: str, words_of: dict[str, list[str]], parse) -> list[str]:
    """The words of every key, parsed by tyro (`parse(words)`, which raises Refused with tyro's line) before the
    command line is: a value tyro refuses is one line naming the file and its key. Returns all the words."""
    every = [w for ws in words_of.values() for w in ws]
    try:
        parse(every)
    except Refused:
        for key, ws in words_of.items():  # which key: each alone (only when one is wrong)
            try:
                parse(ws)
            except Refused as e:
                usage_error(f"--config {path}: {key}: {str(e).split(' Argument helptext:')[0]}")
        raise
    return every

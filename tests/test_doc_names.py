"""Every name the README and the docs pages give in backticks exists: a project file (`srpo.py`,
`rlvr_utils/methods/chains.py`) is in the repository, and a project module's attribute (`common.token_logprobs`,
`teacher.FusedLinearKL`, `runtime.Dist.shard`) is defined where it is named. Names of files the reader makes
(`my_rm.py`) and of other libraries (`datasets.load_dataset`) are not the project's and are left alone; the project's
modules include the ones it has removed (REMOVED), so `rlvr_utils/arith.py` or `arith.arith_first_error` in a page is an
error."""

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

import rlvr_utils

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDERS = ("", "rlvr_utils", "tools", "benchmarks", "tests")
PACKAGE_FOLDERS = set(rlvr_utils.FOLDERS)  # core, methods, extras, extras/data, ...
# modules this repository had and removed (from its git history): a page naming one names something gone
REMOVED = {
    "arith", "checks", "errors", "masked_stats", "model_files", "reward_guard", "run_lock", "stopping", "tracking",
}  # fmt: skip


FILE_SUFFIXES = {"py", "md", "json", "jsonl", "JSONL", "txt", "toml", "gz", "csv", "tsv", "parquet", "png", "html"}


def modules() -> dict[str, Path]:
    """The project's modules by name (a script, common, rlvr_utils/**, tools/*, benchmarks/*): their files."""
    out = {}
    for folder in FOLDERS[:-1]:
        for f in sorted((ROOT / folder).rglob("*.py") if folder == "rlvr_utils" else (ROOT / folder).glob("*.py")):
            out.setdefault(f.stem, f)
    return out


@cache
def defined(path: Path) -> dict[str, set[str]]:
    """Top-level names of a module -> the names defined in each (a class's attributes and methods; {} otherwise)."""
    out: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            members = set()
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                    members |= {t.attr for t in item.targets if isinstance(t, ast.Attribute)}  # self.x = ...
            out[node.name] = members
        elif isinstance(node, ast.Assign):
            out |= {t.id: set() for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = set()
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0]: set() for a in node.names}
    return out


def spans(page: Path) -> list[tuple[int, str]]:
    """(line, text) of each inline backticked span outside fenced code blocks, and of each project file name inside
    them (a code block's dotted names are code, its file names are the project's)."""
    out, fenced = [], False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out += [(n, f) for f in re.findall(r"[\w./-]+\.py\b", line)]
        else:
            out += [(n, s) for s in re.findall(r"`([^`\n]+)`", line)]
    return out


def problems_in(text: str) -> list[str]:
    """What is wrong with the names in one backticked span."""
    mods, out = modules(), []
    files = {p.name for p in ROOT.rglob("*") if ".git" not in p.parts}
    for name in re.findall(r"[\w./-]+\.py\b", text):
        stem = Path(name).stem
        if stem in REMOVED:
            out.append(f"{name}: a module the project removed")
        elif "/" in name and Path(name).parts[0] in FOLDERS[1:] + ("assets", "docs") and not (ROOT / name).exists():
            out.append(f"{name}: no such file")
        elif "/" not in name and stem in mods and Path(name).name not in files:
            out.append(f"{name}: no such file")
    for dotted in re.findall(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/-])", text):
        parts = dotted.split(".")
        if parts[-1] in FILE_SUFFIXES:
            continue  # a file name
        if parts[0] == "rlvr_utils":
            parts, folder = parts[1:], []
            while parts and "/".join([*folder, parts[0]]) in PACKAGE_FOLDERS:  # rlvr_utils.extras.data.sandbox
                folder, parts = [*folder, parts[0]], parts[1:]
            if not parts or parts[0] in REMOVED:
                out += [f"{dotted}: a module the project removed"] if parts else []
                continue
            if parts[0] not in mods:
                out.append(f"{dotted}: no module rlvr_utils.{'.'.join([*folder, parts[0]])}")
                continue
            if mods[parts[0]].parent != ROOT.joinpath("rlvr_utils", *folder):
                out.append(f"{dotted}: {parts[0]} is in {mods[parts[0]].parent.relative_to(ROOT)}/")
                continue
        if parts[0] in REMOVED:
            out.append(f"{dotted}: {parts[0]} is a module the project removed")
            continue
        if parts[0] not in mods or len(parts) < 2:
            continue  # another library's, or a variable in a formula
        names = defined(mods[parts[0]])
        if parts[1] not in names:
            out.append(f"{dotted}: {parts[0]} defines no {parts[1]}")
        elif len(parts) > 2 and names[parts[1]] and parts[2] not in names[parts[1]]:
            out.append(f"{dotted}: {parts[0]}.{parts[1]} has no {parts[2]}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_backticked_project_name_exists(page):
    bad = [f"{page.name}:{n}: {p}" for n, text in spans(page) for p in problems_in(text)]
    assert not bad, "\n".join(bad)


def test_the_check_finds_gone_modules_names_and_files():
    assert problems_in("`rlvr_utils/arith.py`") and problems_in("`arith.arith_first_error`")
    assert problems_in("`teacher.kl_of_every_row`") and problems_in("`rlvr_utils/nosuch.py`")
    assert problems_in("`runtime.Dist.no_such_method`") and problems_in("`rlvr_utils.core.sandbox.run_code_tests`")
    assert not problems_in("`rlvr_utils.extras.data.sandbox.run_code_tests`") and not problems_in("`rlvr_utils.core`")
    assert not problems_in("`tasks.arith_first_error`") and not problems_in("`runtime.Dist.shard`")
    assert not problems_in("`my_rm.py`") and not problems_in("`datasets.load_dataset`") and not problems_in("`a.b`")


def test_removed_covers_the_modules_git_history_removed():
    """REMOVED holds every .py stem the history had that the tree has not (test files aside)."""
    log = subprocess.run(["git", "log", "HEAD", "--name-only", "--pretty=format:"], cwd=ROOT, capture_output=True,
                         text=True)  # fmt: skip
    if log.returncode != 0 or not log.stdout.strip():
        pytest.skip("no git history here (a copy without .git)")
    had = {Path(p).stem for p in log.stdout.split() if p.endswith(".py")}
    now = {p.stem for p in ROOT.rglob("*.py") if ".git" not in p.parts}
    gone = {s for s in had - now if not s.startswith("test_")}
    assert gone <= REMOVED, sorted(gone - REMOVED)

"""Static checks: pyflakes-level errors (undefined names, unused imports, syntax) anywhere in the project, and the
sandbox harness (a program the runner starts from its source text) fully linted."""

import shutil
import subprocess
import sys

import pytest
from conftest import ROOT


def _ruff(*args):
    if (
        shutil.which("ruff") is None
        and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode
    ):
        pytest.fail("ruff is not installed: pip install -r requirements-dev.txt")
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_the_tree_is_ruff_formatted_and_lint_clean():
    """One formatter and linter for the whole tree (pyproject.toml: line length 120; pycodestyle, pyflakes, import
    order): `ruff format --check .` and `ruff check .` as a contributor runs them (.pre-commit-config.yaml)."""
    for args in (["format", "--check", "."], ["check", "."]):
        out = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, f"ruff {' '.join(args)}:\n{out.stdout[-3000:]}{out.stderr[-1000:]}"


def test_no_undefined_names_or_unused_imports():
    out = _ruff("--select", "F,E9", ".")
    assert out.returncode == 0, out.stdout[-3000:]


def test_sandbox_harness_is_lint_clean():
    out = _ruff("--select", "E,F,W", "--line-length", "130", "rlvr_utils/extras/data/sandbox_harness.py")
    assert out.returncode == 0, out.stdout[-3000:]


def test_every_project_module_attribute_used_exists():
    """`common.save_model_atomic` after it moved to checkpoints is invisible to pyflakes: check every
    `<project module>.<name>` reference in the project's Python files against the module itself."""
    import ast
    import importlib

    package = {p.stem for p in (ROOT / "rlvr_utils").rglob("*.py")}
    missing = []
    for path in [
        *ROOT.glob("*.py"),
        *ROOT.glob("rlvr_utils/**/*.py"),
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("tools/*.py"),
    ]:
        tree = ast.parse(path.read_text())
        imported = {
            a.asname or a.name: a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
            if a.name in {"common", "grpo", "sc_grpo", "grpo_lambda", "ep_grpo", "srpo"}
        }
        imported |= {  # from rlvr_utils.<folder> import <module>
            a.asname or a.name: f"{n.module}.{a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("rlvr_utils")
            for a in n.names
            if a.name in package
        }
        assigned = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        assigned |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}  # a local `rewards` shadows the module
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
                if node.value.id not in assigned and not hasattr(
                    importlib.import_module(imported[node.value.id]), node.attr
                ):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not missing, missing


def test_ci_runs_the_readmes_test_command():
    """.ci/run calls the test command the README gives (the Quick start's `python -m pytest ...` before its comment)."""
    readme = (ROOT / "README.md").read_text().splitlines()
    (line,) = [x for x in readme if "python -m pytest" in x and x.startswith("pip install -r requirements-dev.txt")]
    command = line.split("&&", 1)[1].split("#", 1)[0].strip()
    ci = [x.strip() for x in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci, (command, [x for x in ci if "pytest" in x])

"""Static checks: pyflakes-level errors (undefined names, unused imports, syntax) anywhere in the project, and the
sandbox harness (a program the runner starts from its source text) fully linted."""
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


def _ruff(*args):
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode:
        pytest.fail("ruff is not installed: pip install -r requirements-dev.txt")
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", *args], cwd=ROOT, capture_output=True, text=True)


def test_no_undefined_names_or_unused_imports():
    out = _ruff("--select", "F,E9", ".")
    assert out.returncode == 0, out.stdout[-3000:]


def test_sandbox_harness_is_lint_clean():
    out = _ruff("--select", "E,F,W", "--line-length", "130", "sandbox_harness.py")
    assert out.returncode == 0, out.stdout[-3000:]

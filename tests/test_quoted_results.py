"""Every interval the README and docs/benchmarks.md quote for the positive control and each method's share of it is
what `learning_curves.py report --json` computes from the committed raw rows (benchmarks/results/positive_control and
its learning-rate sibling): a figure edited by hand, or rows changed without the text, fails here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BENCH = (ROOT / "docs" / "benchmarks.md").read_text()
FOLDERS = {  # results folder -> what the README quotes of it besides final - GRPO
    "positive_control": ("vs_control", "share"),
    "positive_control_srpo_lr1e-4": (),
}


def report(folder: str) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "learning_curves.py"), "report", "--setting", "long", "--json"]
    out = subprocess.run([*cmd, "--results", str(ROOT / "benchmarks" / "results" / folder)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def interval(row: dict, key: str, signed: bool = True) -> str:
    f = "{:+.3f}" if signed else "{:.2f}"
    lo, hi = ("lo", "hi") if key == "diff" else (f"{key}_lo", f"{key}_hi")
    return f"{f.format(row[key])} [{f.format(row[lo])}, {f.format(row[hi])}]"


def flat(text: str) -> str:
    return " ".join(text.split())  # a figure wrapped across lines still counts


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_quoted_intervals_are_reports(folder):
    rows = [r for r in report(folder) if r["method"] != "grpo"]
    assert rows and all(r["n"] == 10 for r in rows), [(r["method"], r["n"]) for r in rows]
    readme, bench = flat(README), flat(BENCH)
    for r in rows:
        quoted = interval(r, "diff")
        assert quoted in readme and quoted in bench, (folder, r["method"], quoted)
        for key in ("vs_control", "share") if r["method"] != "control" else ():
            quoted = interval(r, key, signed=key != "share")
            assert quoted in bench, (folder, r["method"], key, quoted)
            assert key not in FOLDERS[folder] or quoted in readme, (folder, r["method"], key, quoted)

"""Every interval the README and docs/benchmarks.md quote for the positive control and each method's share of it is
what `learning_curves.py report --json` computes from the committed raw rows (benchmarks/results/positive_control and
its learning-rate sibling), next to the method's name: a figure edited by hand, two methods' figures swapped, or rows
changed without the text fail here."""

import functools
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
LABELS = {"sc_grpo": "SC-GRPO", "grpo_lambda": "GRPO-λ", "ep_grpo": "EP-GRPO", "srpo": "SRPO", "rrpo": "RRPO"}
LABELS |= {"srpo_oracle": "oracle resets", "control": "beats GRPO by"}  # the prose's names


@functools.cache  # one report per folder, however many tests read it
def report(folder: str) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "learning_curves.py"), "report", "--setting", "long", "--json"]
    out = subprocess.run([*cmd, "--results", str(ROOT / "benchmarks" / "results" / folder)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return {r["method"]: r for r in rows if r["method"] != "grpo"}


def interval(row: dict, key: str) -> str:
    f = "{:.2f}" if key == "share" else "{:+.3f}"
    lo, hi = ("lo", "hi") if key == "diff" else (f"{key}_lo", f"{key}_hi")
    return f"{f.format(row[key])} [{f.format(row[lo])}, {f.format(row[hi])}]"


def flat(text: str) -> str:
    return " ".join(text.split())  # a figure wrapped across lines still counts


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_quoted_intervals_are_reports_beside_their_methods(folder):
    rows = report(folder)
    assert rows and all(r["n"] == 10 for r in rows.values()), {m: r["n"] for m, r in rows.items()}
    readme, bench = flat(README), flat(BENCH)
    for method, r in rows.items():
        label = LABELS[method.split("@")[0]]
        for key in ("diff", "vs_control", "share") if method != "control" else ("diff",):
            quoted = interval(r, key)
            assert quoted in bench, (folder, method, key, quoted)
            if key == "diff" or key in FOLDERS[folder]:
                assert f"{label} {quoted}" in readme, (folder, method, key, f"{label} {quoted}")
            if "@" in method and key != "vs_control":  # the learning-rate runs are quoted in prose, by name
                assert f"{label} {quoted}" in bench, (folder, method, key, f"{label} {quoted}")


def test_quoted_holm_p_values_are_reports():
    lr = report("positive_control_srpo_lr1e-4")
    holm = ", ".join(f"{lr[m]['p_holm']:.2f}" for m in ("srpo@lr1e-4", "rrpo@lr1e-4", "srpo_oracle@lr1e-4"))
    assert f"(Holm p {holm})" in flat(README), holm
    ep = report("positive_control")["ep_grpo"]
    assert f"{interval(ep, 'diff')}, Holm-adjusted p {ep['p_holm']:.3f}" in flat(README)

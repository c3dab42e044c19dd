"""The benchmark scripts run (small shapes on CPU; no timing is asserted: timings are the benchmarks' output)."""

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_gpu_vs_trl_runs_at_a_small_shape_on_cpu(tmp_path):
    sides = ["ours", "trl"] if importlib.util.find_spec("trl") else ["ours"]  # trl is a benchmark-only requirement
    out = tmp_path / "gpu_vs_trl.json"
    r = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_vs_trl.py",
            "--shapes",
            "tiny",
            "--steps",
            "2",
            "--prompts",
            "2",
            "--generations",
            "2",
            "--max-new-tokens",
            "8",
            "--micro-batch-size",
            "4",
            "--vocab",
            "2000",
            "--sides",
            *sides,
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    for side in sides:
        assert len(res[f"tiny/{side}"]["step_seconds"]) == 2 and res[f"tiny/{side}"]["peak_gb"] > 0


def test_script_memory_runs_every_script_at_a_small_vocabulary(tmp_path):
    scripts = ["grpo", "sc_grpo", "grpo_lambda", "ep_grpo", "srpo"]
    out = tmp_path / "script_memory.json"
    r = subprocess.run(
        [
            sys.executable,
            "benchmarks/script_memory.py",
            "--vocab",
            "2000",
            "--steps",
            "1",
            "--prompts",
            "2",
            "--generations",
            "4",
            "--max-new-tokens",
            "16",
            "--num-eval",
            "2",
            "--threads",
            "1",
            "--scripts",
            *scripts,
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    res = json.loads(out.read_text())
    assert list(res["scripts"]) == scripts and res["vocab"] == 2000
    for name, row in res["scripts"].items():
        assert row["rc"] == 0 and row["steps"] == 1 and row["rss_gb"] > 0.1, (name, row)
    assert res["scripts"]["sc_grpo"]["sc_routed"] > 0  # its teachers ran on the grown model
    assert "| grpo | " in r.stdout and "| 1.00 |" in r.stdout  # grpo.py against itself


def test_learning_curves_report_from_raw_results(tmp_path):
    """The report is rebuilt from the raw per-run metrics: bootstrap interval, steps to GRPO's final accuracy."""
    runs = {
        "srpo@lr": [[0.2, 0.1, 0.0]],
        "grpo": [[0.2, 0.4, 0.5], [0.2, 0.5, 0.6]],
        "srpo": [[0.2, 0.6, 0.6], [0.2, 0.5, 0.7]],
    }
    for method, accs in runs.items():
        d = tmp_path / "headroom" / method
        d.mkdir(parents=True)
        for seed, acc in enumerate(accs, 1):
            rows = [{"step": s, "num_tokens": 100, "eval/accuracy": a} for s, a in zip((0, 10, 20), acc)]
            (d / f"seed{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "headroom" / "srpo" / "seed3.jsonl").write_text(
        json.dumps({"step": 1, "num_tokens": 100}) + "\n"
    )  # unfinished
    r = subprocess.run(
        [
            sys.executable,
            "benchmarks/learning_curves.py",
            "report",
            "--setting",
            "headroom",
            "--results",
            str(tmp_path),
            "--img",
            str(tmp_path / "img"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    table = (tmp_path / "headroom" / "report.md").read_text()
    grpo = next(line for line in table.splitlines() if line.startswith("| grpo |"))
    srpo = next(line for line in table.splitlines() if line.startswith("| srpo |"))
    assert "0.550 (20)" in grpo and "| 20 | 1.00x |" in grpo  # GRPO's final mean 0.55, reached at its last step
    assert "skipped" in r.stdout and "| srpo | 2 |" in srpo  # the unfinished run is left out, and said so
    assert "0.650 (20)" in srpo and "| 10 | 2.00x |" in srpo  # mean 0.55 at step 10: twice as fast
    assert "| +0.100 [+0.100, +0.100] |" in srpo  # paired by seed: 0.6 - 0.5 and 0.7 - 0.6
    assert "| 0.400 [0.367, 0.433] |" in grpo  # mean over evaluations: (0.2+0.4+0.5)/3 and (0.2+0.5+0.6)/3
    names = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "seeds" not in line]
    assert names == ["grpo", "srpo", "srpo@lr"]  # GRPO first, the --tag sweeps after the defaults
    if importlib.util.find_spec("matplotlib"):  # a benchmark-only requirement
        assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
            "learning_curves_headroom.png",
            "learning_curves_headroom_srpo_sweeps.png",
        ]


def test_verify_math_benchmark_on_a_small_file(tmp_path):
    golds = ["\\frac43", "\\$12,\\!500", "5\\sqrt3", "\\frac{150}7\\text{ degrees}", "\\text{(C)}", "42"]
    rows = [{"problem": f"p{i}", "solution": f"Work. So $\\boxed{{{g}}}$."} for i, g in enumerate(golds)]
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "v.json"
    r = subprocess.run(
        [sys.executable, "benchmarks/verify_math.py", "--data-path", str(data), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["own_answer_scores_1"] == 1.0 and res["other_answer_scores_0"] == 1.0
    r = subprocess.run(
        [sys.executable, "benchmarks/verify_math.py", "--data-path", str(data), "--out", str(out), "--no-normalize"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert json.loads(out.read_text())["own_answer_scores_1"] < 1.0  # the shorthand is what normalize_latex fixes

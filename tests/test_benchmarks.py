"""The benchmark scripts run (small shapes on CPU; no timing is asserted: timings are the benchmarks' output)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

FAKE_SCRIPT = """
import argparse, json, pathlib
ap = argparse.ArgumentParser()
ap.add_argument("--mb", type=int, default=0)
ap.add_argument("--output-dir")
a = ap.parse_args()
held = bytearray(a.mb * 2**20)  # zero-filled: every page touched
run = pathlib.Path(a.output_dir) / "run-1"
run.mkdir()
rows = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "time/step": 0.5}, {"step": 1, "eval/accuracy": 0.5}]
(run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
"""


@pytest.fixture
def harness():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import harness

        yield harness
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_harness_reads_metrics_and_the_childs_own_peak_memory(tmp_path, harness):
    """The peak is the child's: wait4's ru_maxrss of a vfork + exec child reports this (larger) process's mark."""
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SCRIPT)
    parent = bytearray(400 * 2**20)  # this process's high-water mark is now above 400 MiB
    res = harness.run_script([str(script), "--mb", "64"], threads=1)
    del parent
    assert res.ok and res.returncode == 0, res.stderr
    assert [r["step"] for r in res.rows] == [0, 1, 1] and res.steps == [{"step": 1, "time/step": 0.5}]
    assert 64 < res.peak_rss_mb < 300, res.peak_rss_mb
    assert res.wall_s > 0 and res.cmd[1:3] == [str(script), "--mb"] and res.cmd[-2] == "--output-dir"
    assert res.check() is res


def test_harness_code_failures_timeouts_and_metric_files(tmp_path, harness):
    res = harness.run_script(["-c", "import sys; print(sys.argv); sys.exit('bad ' + sys.argv[1])", "x"], env={"A": "1"})
    assert res.returncode == 1 and not res.ok and res.rows == [] and "bad x" in res.tail()
    assert "'--output-dir'" in res.stdout and res.peak_rss_mb > 0  # argv as `python -c CODE x --output-dir DIR` has it
    with pytest.raises(SystemExit, match="lbl failed:\nbad x"):
        res.check("lbl")
    res = harness.run_script(
        ["-c", "import os; print(os.environ['A'], os.environ['OMP_NUM_THREADS'])"], env={"A": "7"}, threads=3
    )
    assert res.ok and res.stdout.split() == ["7", "3"]
    res = harness.run_script(["-c", "import time; time.sleep(60)"], timeout=2, output_dir=False)
    assert res.returncode == -9 and res.peak_rss_mb is None and "timed out" in res.stderr and res.wall_s < 30
    run = tmp_path / "out" / "run-1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n\n{"step": 1}\n')
    for path in (tmp_path / "out", run, run / "metrics.jsonl"):
        assert harness.read_metrics(path) == [{"step": 0}, {"step": 1}]
    assert harness.read_metrics(tmp_path / "absent") == []
    (tmp_path / "out" / "run-2").mkdir()
    (tmp_path / "out" / "run-2" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="several runs"):
        harness.read_metrics(tmp_path / "out")


@pytest.mark.slow
def test_default_run_and_step_time_run_at_a_small_size(tmp_path):
    small = "--total-steps 2 --eval-every 0 --num-eval 2 --prompts-per-step 2 --num-generations 2 --max-new-tokens 8"
    r = subprocess.run(
        [sys.executable, "benchmarks/default_run.py", "--extra", small + " --threads 1", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (out,) = tmp_path.glob("default_run_grpo_*.json")
    res = json.loads(out.read_text())
    assert res["steps"] == 2 and 100 < res["peak_rss_mb"] < 4000 and res["eval_accuracy"][-1][0] == 2
    assert "| `python grpo.py --total-steps 2" in r.stdout
    r = subprocess.run(
        [sys.executable, "benchmarks/step_time.py", "--steps", "2", "--rounds", "1", "--scripts", "grpo.py"]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads((tmp_path / "step_time.json").read_text())["table"]["grpo.py"]
    assert row["steps_measured"] == 1 and row["ratio_to_grpo"] == 1.0 and 100 < row["peak_rss_mb"] < 4000
    assert "| `grpo.py` |" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("lora", ["0", "4"])  # full fine-tuning; LoRA on both sides (TRL: its peft_config)
def test_gpu_vs_trl_runs_at_a_small_shape_on_cpu(tmp_path, lora):
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
            "--lora",
            lora,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    saved = json.loads(out.read_text())
    res = saved["results"]
    for side in sides:
        assert len(res[f"tiny/{side}"]["step_seconds"]) == 2 and res[f"tiny/{side}"]["peak_gb"] > 0
    assert saved["args"]["lora"] == int(lora) and ("LoRA r 4" in saved["table"][0]) == (lora == "4")


@pytest.mark.slow  # twelve script runs: three scripts x both engines x full fine-tuning and LoRA
def test_script_memory_runs_scripts_at_a_small_vocabulary(tmp_path):
    scripts = ["grpo", "sc_grpo", "ep_grpo"]  # the grown model's teacher (SC-GRPO), LoRA's reference (EP-GRPO)
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
            "--lora",
            "4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    res = json.loads(out.read_text())
    tiers = ["", " --engine hf", " --lora-rank 4", " --lora-rank 4 --engine hf"]  # both engines by default
    assert list(res["scripts"]) == [s + t for t in tiers for s in scripts] and res["vocab"] == 2000
    assert res["scripts"]["ep_grpo --lora-rank 4"]["vs_grpo"]["rss_gb"] > 0  # against grpo.py under LoRA
    assert res["scripts"]["sc_grpo --lora-rank 4"]["vs_hf"]["rss_gb"] > 0  # against itself under --engine hf
    assert not res["scripts"]["sc_grpo --engine hf"]["vs_hf"]
    for name, row in res["scripts"].items():
        assert row["rc"] == 0 and row["steps"] == 1 and row["rss_gb"] > 0.1, (name, row)
    assert res["scripts"]["sc_grpo"]["sc_routed"] > 0  # its teachers ran on the grown model
    assert "| grpo | " in r.stdout and "| 1.00 |" in r.stdout  # grpo.py against itself


def test_learning_curves_report_from_raw_results(tmp_path):
    """The report is rebuilt from the raw per-run metrics: t-intervals over seeds, the paired difference from GRPO
    and the lowest per-seed ratio to it, steps to GRPO's final accuracy; `--json` prints the same and writes nothing."""
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
            rows[1:1] = [{"step": s, "num_tokens": 100, "frac_groups_unsolved": 1 - a} for s, a in zip((1, 2), acc[1:])]
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
    # paired by seed: 0.6 - 0.5 and 0.7 - 0.6 (no spread: a zero-width interval) over n = 2 seeds; the lowest ratio
    # to GRPO's final on the same seed: min(0.6 / 0.5, 0.7 / 0.6) = 1.1667
    # p: no spread, so 0 (Holm over the family of 2 comparisons: 0 too); detects: no spread, 0
    assert "| 2 | +0.100 [+0.100, +0.100] | 0.000 (0.000) | 0.000 | 1.17 |" in srpo
    assert "family of 2 comparisons" in table and "- srpo: above GRPO by at least +0.100" in table
    # finals 0.5 and 0.6: mean 0.55 -+ t_{0.975, 1} * sd / sqrt(2) = 12.706 * 0.0707 / 1.414 = 0.635
    assert "| 0.550 [-0.085, 1.185] |" in grpo
    # mean over evaluations: (0.2+0.4+0.5)/3 and (0.2+0.5+0.6)/3: 0.400 -+ 12.706 * 0.04714 / 1.414 = 0.424
    assert "| 0.400 [-0.024, 0.824] |" in grpo
    # evals after step 0, paired: seed 1 ((0.6-0.4) + (0.6-0.5)) / 2 = 0.15, seed 2 ((0.5-0.5) + (0.7-0.6)) / 2 = 0.05;
    # mean 0.10 -+ 12.706 * 0.0707 / 1.414 = 0.635
    assert "| +0.100 [-0.535, +0.735] |" in srpo and grpo.count("| +0.000 [+0.000, +0.000] |") == 2  # GRPO - GRPO
    results, mechanisms = table.split("What explains it")
    names = [
        line.split("|")[1].strip() for line in results.splitlines() if line.startswith("| ") and "seeds" not in line
    ]
    assert names == ["grpo", "srpo", "srpo@lr"]  # GRPO first, the --tag sweeps after the defaults
    # the mechanism table: the mean over steps of each step's mean over seeds (steps 1 and 2 here)
    assert "| grpo | `frac_groups_unsolved` | 0.500 | 0.500 |" in mechanisms  # ((0.6+0.5)/2 + (0.5+0.4)/2) / 2
    assert "| srpo | `frac_groups_unsolved` | 0.400 | 0.400 |" in mechanisms  # ((0.4+0.5)/2 + (0.4+0.3)/2) / 2
    js = subprocess.run(
        [sys.executable, "benchmarks/learning_curves.py", "report", "--setting", "headroom", "--json"]
        + ["--results", str(tmp_path), "--img", str(tmp_path / "img2")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert js.returncode == 0, js.stderr[-3000:]
    out = {r["method"]: r for r in map(json.loads, js.stdout.splitlines())}  # every stdout line is JSON
    assert list(out) == ["grpo", "srpo", "srpo@lr"] and not (tmp_path / "img2").exists()
    assert out["srpo"]["n"] == 2 and out["srpo"]["diff"] == pytest.approx(0.1) and out["srpo"]["seeds"] == 2
    assert out["srpo"]["p"] == 0.0 and out["srpo"]["family"] == 2 and "share" not in out["srpo"]  # no control here
    assert out["srpo"]["lo"] == pytest.approx(0.1) and out["srpo"]["hi"] == pytest.approx(0.1)
    assert out["srpo"]["min_ratio"] == pytest.approx(0.7 / 0.6)
    assert out["srpo"]["evals_diff"] == pytest.approx(0.1) and out["srpo"]["evals_hi"] == pytest.approx(
        0.1 + 0.6353, abs=1e-3
    )
    assert out["grpo"]["final_lo"] == pytest.approx(0.55 - 12.7062 * 0.05, abs=1e-4)  # sd / sqrt(2) = 0.05
    lr = out["srpo@lr"]  # one seed: paired with GRPO's seed 1; no interval
    assert (lr["n"], lr["lo"], lr["hi"], lr["final_lo"]) == (1, None, None, None)
    assert lr["diff"] == pytest.approx(-0.5) and lr["min_ratio"] == 0.0
    assert out["srpo"]["evals_n"] == 2 and lr["evals_n"] == 1
    if importlib.util.find_spec("matplotlib"):  # a benchmark-only requirement
        assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
            "learning_curves_headroom.png",
            "learning_curves_headroom_srpo_sweeps.png",
            "learning_curves_headroom_unsolved.png",
        ]


def test_learning_curves_report_refuses_runs_of_two_commits_unless_asked(tmp_path):
    """Each run's provenance names its commit; a table of runs from two commits compares code as well as methods."""
    for method, commit in (("grpo", "aaa"), ("srpo", "bbb")):
        d = tmp_path / "long" / method
        d.mkdir(parents=True)
        for seed in (1, 2):
            rows = [{"step": s, "num_tokens": 100, "eval/accuracy": 0.1 * (s + seed)} for s in (0, 10)]
            (d / f"seed{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (d / f"seed{seed}.run.json").write_text(json.dumps({"commit": commit}))
    report = [sys.executable, "benchmarks/learning_curves.py", "report", "--setting", "long", "--json"]
    report += ["--results", str(tmp_path)]
    refused = subprocess.run(report, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "2 commits (aaa, bbb)" in refused.stderr
    pooled = subprocess.run(report + ["--pool-commits"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert pooled.returncode == 0 and json.loads(pooled.stdout.splitlines()[1])["commits"] == ["bbb"]


def test_versus_grpo_pairs_evaluations_only_where_both_made_one(monkeypatch):
    """A seed evaluated at other steps than GRPO's (another --eval-every) has no shared evaluation after step 0: it is
    left out of evals_diff and evals_n says so, while n (the finals) still counts it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import learning_curves as lc

    grpo = {1: [(0, 0, 0.2), (10, 0, 0.4), (20, 0, 0.5)], 2: [(0, 0, 0.2), (10, 0, 0.3), (20, 0, 0.6)]}
    mine = {1: [(0, 0, 0.2), (10, 0, 0.6), (20, 0, 0.7)], 2: [(0, 0, 0.2), (15, 0, 0.9), (25, 0, 0.5)]}
    v = lc.versus_grpo(mine, grpo)
    assert v["n"] == 2 and v["diff"] == pytest.approx(((0.7 - 0.5) + (0.5 - 0.6)) / 2)
    assert v["evals_n"] == 1 and v["evals_diff"] == pytest.approx(((0.6 - 0.4) + (0.7 - 0.5)) / 2)
    assert v["evals_lo"] is None  # one seed: no interval


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


def test_a_second_results_folders_report_keeps_its_plots_beside_it(tmp_path):
    """`report --results X` without --img: the plots go beside X's report.md, whose first line names X; docs/img (the
    default results' figures) is left as it was."""
    for method in ("grpo", "srpo"):
        d = tmp_path / "long" / method
        d.mkdir(parents=True)
        for seed, acc in enumerate(([0.2, 0.4], [0.2, 0.5]), 1):
            rows = [{"step": s, "num_tokens": 100, "eval/accuracy": a} for s, a in zip((0, 10), acc)]
            (d / f"seed{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    img = ROOT / "docs" / "img"
    before = {p.name: p.stat().st_mtime_ns for p in img.iterdir()}
    cmd = [sys.executable, "benchmarks/learning_curves.py", "report", "--setting", "long", "--results", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in img.iterdir()} == before
    if importlib.util.find_spec("matplotlib"):  # a benchmark-only requirement
        assert (tmp_path / "long" / "learning_curves_long.png").stat().st_size > 0
    first = (tmp_path / "long" / "report.md").read_text().split("\n")[0]
    assert first.endswith(f"--results {os.path.relpath(tmp_path, ROOT)}`"), first


def test_report_reads_a_hostile_results_folder_with_one_line_each_and_no_traceback(tmp_path):
    """A backup copy beside a seed (only seed<digits>.jsonl are seeds), a string where a number belongs, a .run.json
    that is not JSON, a cut last line (dropped with a warning), a NaN evaluation, and a method folder that is another's
    through a link: each is one line, and the table is built from what is left (no `nan` in it)."""

    def write(path, rows, tail=""):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)

    def seed(accs):
        return [{"step": s, "num_tokens": 100, "eval/accuracy": a} for s, a in zip((0, 10), accs)]

    base = tmp_path / "long"
    for method, finals in (("grpo", (0.4, 0.5, 0.6)), ("srpo", (0.5, 0.7, 0.6))):
        for k, final in enumerate(finals, 1):
            write(base / method / f"seed{k}.jsonl", seed([0.2, final]))
            (base / method / f"seed{k}.run.json").write_text(json.dumps({"commit": "abc"}))
    write(base / "grpo" / "seed1.bak.jsonl", seed([0.9, 0.9]))  # a backup copy: not seed 1 again
    write(base / "grpo" / "seed3.jsonl", seed([0.2, 0.6]), tail='{"step": 11, "num_tok')  # killed mid-line
    write(base / "srpo" / "seed2.jsonl", seed([0.2, "0.7"]))  # a string where a number belongs
    write(base / "srpo" / "seed4.jsonl", seed([0.2, float("nan")]))  # a failed evaluation
    (base / "srpo" / "seed3.run.json").write_text("{not json")
    (base / "grpo_again").symlink_to("grpo")  # the same files twice
    cmd = [sys.executable, "benchmarks/learning_curves.py", "report", "--setting", "long", "--results", str(tmp_path)]
    refused = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.strip() == (
        "long: its runs come from 2 commits (abc, unknown (seed3.run.json)); pooling them compares code as well as "
        "methods: rerun at one commit, or pass --pool-commits"
    )
    r = subprocess.run(cmd + ["--pool-commits"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    said = [line for line in r.stdout.splitlines() if line.startswith(("skipped ", "warning: "))]
    wanted = [
        "grpo/seed1.bak.jsonl: not a seed's file",
        "grpo_again: the same folder as grpo (a link)",
        "grpo/seed3.jsonl:3: a partial last line",
        "srpo/seed2.jsonl: line 2 (step 10): eval/accuracy is '0.7', not a number",
        "srpo/seed4.jsonl: eval/accuracy is nan at step 10",
        "srpo/seed3.run.json: not a JSON object",
    ]
    assert len(said) == len(wanted) and all(sum(w in line for line in said) == 1 for w in wanted), said
    table = (base / "report.md").read_text()
    assert "nan" not in table.lower() and "grpo_again" not in table
    assert "| grpo | 3 | 0.200 | 0.500 (10) |" in table and "| srpo | 2 | 0.200 | 0.550 (10) |" in table
    js = subprocess.run(cmd + ["--pool-commits", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert [json.loads(line)["method"] for line in js.stdout.splitlines()] == ["grpo", "srpo"]  # notes on stderr
    assert sum(line.startswith(("skipped ", "warning: ")) for line in js.stderr.splitlines()) == len(wanted)

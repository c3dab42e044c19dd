"""benchmarks/credit_accuracy.py: the blame measure against hand-computed values, its CLI, and a tiny `run`."""

import gzip
import json
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def ca():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import credit_accuracy

        yield credit_accuracy
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def row(text: str, credit: list[float], reward: float = 0.0, problem: str = "5+3+2", step: int = 10) -> dict:
    """A credit.jsonl row of a character-level completion (one token per character, as the tiny model's)."""
    assert len(credit) == len(text)
    return {"step": step, "prompt": f"Solve: {problem}\n", "reward": reward, "tokens": list(text), "credit": credit}


WRONG = "5+3=8\n8+2=11\n#### 11"  # first wrong line: 2 (8+2=10)


def hand_row() -> dict:
    """Line 1 (6 tokens, its newline included): credit -1; line 2 (7 tokens): -3 on the two result digits, -1 on the
    others; the answer line (7 tokens): -1."""
    return row(WRONG, [-1.0] * 6 + [-1, -1, -1, -1, -3, -3, -1] + [-1.0] * 7)


def test_token_lines_follow_arith_first_error_numbering(ca):
    assert ca.token_lines(list("ab\ncd\n")) == [1, 1, 1, 2, 2, 2]  # a newline belongs to the line it ends
    assert ca.token_lines(list("a\n\nb")) == [1, 1, 0, 2]  # a blank line has no number (arith_first_error skips it)
    assert ca.token_lines(["12", "+3", "=15\n", "15", "\n#", "### 15"]) == [1, 1, 1, 2, 2, 3]  # a token's first char


def test_hand_computed_auc_and_lift(ca):
    s = ca.completion_scores(hand_row())
    # 7 line-2 tokens x 6 line-1 tokens = 42 pairs: the two blame-3 digits beat all 6 (12), the other 5 tie (30 x 1/2)
    assert s["auc"] == pytest.approx(27 / 42)
    # |credit| on line 2 = 5 + 6 = 11 of 6 + 11 + 7 = 24; line 2 holds 7 of 20 tokens
    assert s["lift"] == pytest.approx((11 / 24) / (7 / 20))
    flipped = hand_row()
    flipped["credit"] = [-c for c in flipped["credit"]]  # credit pushing the wrong digits up: blame below the rest
    assert ca.completion_scores(flipped)["auc"] == pytest.approx(15 / 42)


def test_grpo_uniform_credit_is_the_measures_own_check(ca):
    s = ca.completion_scores(row(WRONG, [-0.75] * len(WRONG)))
    assert s["auc"] == 0.5 and s["lift"] == pytest.approx(1.0)


def test_rows_the_definition_leaves_out(ca):
    right = "5+3=8\n8+2=10\n#### 10"
    assert ca.completion_scores(row(right, [0.5] * len(right), reward=1.0)) is None  # a success
    first = "5+4=9\n9+2=11\n#### 11"
    assert ca.completion_scores(row(first, [-1.0] * len(first))) is None  # wrong at line 1: no correct line before
    short = "5+3=8\n8+2=10"
    assert ca.completion_scores(row(short, [-1.0] * len(short))) is None  # stopped early: line 3 holds no token
    zero = ca.completion_scores(row(WRONG, [0.0] * len(WRONG)))  # no gradient (an all-equal group)
    assert zero == {"auc": 0.5, "nonzero": False}  # counts 0.5 in auc, left out of lift (0/0)
    out = ca.summarize([ca.completion_scores(hand_row()), zero])
    assert out["auc"] == pytest.approx((27 / 42 + 0.5) / 2) and out["auc_nonzero"] == pytest.approx(27 / 42)
    assert out["lift"] == pytest.approx((11 / 24) / (7 / 20)) and (out["completions"], out["lift_completions"]) == (
        2,
        1,
    )


def test_report_cli_one_json_line_per_run(tmp_path):
    run = tmp_path / "arith__x__1__1"
    run.mkdir()
    right = "5+3=8\n8+2=10\n#### 10"
    rows = [hand_row(), row(WRONG, [-0.5] * len(WRONG), step=20), row(right, [1.0] * len(right), reward=1.0)]
    (run / "credit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gz = tmp_path / "grpo" / "seed3.credit.jsonl.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress((json.dumps(rows[1]) + "\n").encode()))
    cmd = [sys.executable, "benchmarks/credit_accuracy.py", "report", str(run), str(gz), "--by-step"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    first, second = map(json.loads, r.stdout.splitlines())
    assert first["run"] == "arith__x__1__1" and first["completions"] == 2
    assert first["auc"] == pytest.approx((27 / 42 + 0.5) / 2)
    assert first["by_step"]["10"]["auc"] == pytest.approx(27 / 42) and first["by_step"]["20"]["auc"] == 0.5
    assert second == {**second, "run": "grpo/seed3", "auc": 0.5, "completions": 1}
    bad = subprocess.run(
        [sys.executable, "benchmarks/credit_accuracy.py", "report", str(tmp_path)], cwd=ROOT, capture_output=True
    )
    assert bad.returncode != 0 and b"no credit.jsonl" in bad.stderr


def test_run_at_a_tiny_size_then_table(tmp_path):
    """`run` trains each (method, seed) with every row's credit recorded; `report` and `table` read the results."""
    extra = "--num-eval 8 --prompts-per-step 2 --num-generations 4 --max-new-tokens 40"
    cmd = [sys.executable, "benchmarks/credit_accuracy.py", "run", "--setting", "default", "--seeds", "1"]
    cmd += ["--methods", "grpo", "srpo_oracle", "--steps", "2", "--eval-every", "1", "--results", str(tmp_path)]
    r = subprocess.run([*cmd, "--extra", extra, "--tag", "tiny"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "FAILED" not in r.stdout, r.stdout + r.stderr[-3000:]
    for m in ("grpo@tiny", "srpo_oracle@tiny"):
        assert (tmp_path / "default" / m / "seed1.jsonl").is_file()
        rows = gzip.decompress((tmp_path / "default" / m / "seed1.credit.jsonl.gz").read_bytes()).splitlines()
        recorded = [json.loads(x) for x in rows]
        assert {x["step"] for x in recorded} == {1, 2} and len([x for x in recorded if x["step"] == 1]) >= 8
    files = [str(tmp_path / "default" / m / "seed1.credit.jsonl.gz") for m in ("grpo@tiny", "srpo_oracle@tiny")]
    rep = subprocess.run(
        [sys.executable, "benchmarks/credit_accuracy.py", "report", *files], cwd=ROOT, capture_output=True, text=True
    )
    grpo = json.loads(rep.stdout.splitlines()[0])
    assert grpo["run"] == "grpo@tiny/seed1" and grpo["auc"] in (0.5, None)  # uniform credit, whatever was sampled
    tab = subprocess.run(
        [sys.executable, "benchmarks/credit_accuracy.py", "table", "--setting", "default", "--results", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert tab.returncode == 0, tab.stderr
    assert "| grpo@tiny | 1 |" in tab.stdout and "| srpo_oracle@tiny | 1 |" in tab.stdout


def test_the_long_settings_flags_and_its_bundled_model():
    """`learning_curves.py flags --setting long` prints the script flags on one line; the model it names is bundled
    (under 20 MB) and was trained on chains as long as the setting's."""
    r = subprocess.run(
        [sys.executable, "benchmarks/learning_curves.py", "flags", "--setting", "long"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) == 1
    flags = r.stdout.split()
    model, steps = ROOT / flags[flags.index("--model") + 1], int(flags[flags.index("--arith-steps") + 1])
    assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
    assert sum(f.stat().st_size for f in model.iterdir()) < 20 * 2**20
    report = json.loads((model / "training_report.json").read_text())
    assert report["args"]["max_steps_task"] >= steps

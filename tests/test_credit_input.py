"""Bad input to the two readers of credit records, tools/credit_view.py and benchmarks/credit_accuracy.py (report,
table, calibrate, run): a damaged file, a record of the wrong schema, nothing there or an output that cannot be written
ends in one line on stderr, `error: ...`, and exit code 2, never a traceback. Both tools read records through one
function (credit_view.read_records), so each case is run through both. In-process (main() with sys.argv) for speed;
one subprocess per tool checks the same as a user sees it."""

import gzip
import json
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import credit_accuracy  # noqa: E402
import credit_view  # noqa: E402

RECORD = {
    "step": 1,
    "script": "grpo.py",
    "row": 0,
    "prompt_id": 5,
    "prompt": "Solve: 1+1\n",
    "reward": 0.0,
    "tokens": ["1", "+", "1", "=", "3"],
    "credit": [-0.5] * 5,
    "signals": {"f": [0.5] * 5, "role": 1.0},
}
GOOD = json.dumps(RECORD) + "\n"


def _with(**changes) -> str:
    """RECORD with `changes` (a value of None drops the key), as one JSON line."""
    rec = {k: v for k, v in {**RECORD, **changes}.items() if v is not None}
    return json.dumps(rec) + "\n"


# (file name, its bytes, what the one line must say after "error: FILE")
BAD = {
    "malformed JSON": ("c.jsonl", GOOD + '{"step": 1,\n', ":2: not a credit record (not JSON: "),
    "truncated gzip": ("c.jsonl.gz", gzip.compress((GOOD * 50).encode())[:-30], ": not a readable gzip file ("),
    "not UTF-8": ("c.jsonl", GOOD.encode() + b'{"prompt": "\xff"}\n', ":2: not a credit record (byte 0xff at column"),
    "a list, not an object": ("c.jsonl", "[1, 2]\n", ":1: not a credit record (a list, not a JSON object)"),
    "no tokens": ("c.jsonl", _with(tokens=None), ":1: not a credit record (missing 'tokens')"),
    "no credit": ("c.jsonl", GOOD + _with(credit=None), ":2: not a credit record (missing 'credit')"),
    "no reward": ("c.jsonl", _with(reward=None), ":1: not a credit record (missing 'reward')"),
    "no step": ("c.jsonl", _with(step=None), ":1: not a credit record (missing 'step')"),
    "no prompt": ("c.jsonl", _with(prompt=None), ":1: not a credit record (missing 'prompt')"),
    "reward a string": (
        "c.jsonl",
        _with(reward="1"),
        ":1: not a credit record ('reward' is a string, not a finite number or null)",
    ),
    "step a float": ("c.jsonl", _with(step=1.5), ":1: not a credit record ('step' is a number, not an integer)"),
    "tokens a string": (
        "c.jsonl",
        _with(tokens="1+1=3"),
        ":1: not a credit record ('tokens' is a string, not a list of strings)",
    ),
    "a token a number": (
        "c.jsonl",
        _with(tokens=["1", "+", 1, "=", "3"]),
        ":1: not a credit record ('tokens'[2] is a number, not a string)",
    ),
    "credit null": (
        "c.jsonl",
        _with(credit=[0.1, None, 0, 0, 0]),
        ":1: not a credit record ('credit'[1] is null, not a finite number)",
    ),
    "credit NaN": (
        "c.jsonl",
        _with(credit=[0.1, 0, float("nan"), 0, 0]),
        ":1: not a credit record ('credit'[2] is nan, not a finite number)",
    ),
    "lengths differ": (
        "c.jsonl",
        _with(credit=[0.1] * 4),
        ":1: not a credit record (5 tokens but 4 credit values: one per token)",
    ),
    "empty file": ("c.jsonl", "", ": no credit records in it (an empty file)"),
    "blank lines only": ("c.jsonl", "\n  \n", ": no credit records in it (an empty file)"),
    "empty gzip": ("c.jsonl.gz", gzip.compress(b""), ": no credit records in it (an empty file)"),
}
# what only the viewer reads: the measure needs step, prompt, reward, tokens and credit alone
VIEWER_ONLY = {
    "no signals": ("c.jsonl", _with(signals=None), ":1: not a credit record (missing 'signals')"),
    "no script": ("c.jsonl", _with(script=None), ":1: not a credit record (missing 'script')"),
    "prompt_id a string": (
        "c.jsonl",
        _with(prompt_id="5"),
        ":1: not a credit record ('prompt_id' is a string, not an integer)",
    ),
    "signal too short": (
        "c.jsonl",
        _with(signals={"f": [0.5] * 3}),
        ":1: not a credit record (signal 'f' has 3 values for 5 tokens)",
    ),
    "signal a string": (
        "c.jsonl",
        _with(signals={"role": "x"}),
        ":1: not a credit record (signal 'role' is a string, not a finite number",
    ),
}


def _one_line(capsys, call, *words) -> str:
    """`call()` ends with SystemExit(2) and exactly one stderr line, `error: ...`, holding each of `words`."""
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _viewer(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["credit_view.py", *map(str, args)])
    return credit_view.main


def _measure(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["credit_accuracy.py", *map(str, args)])
    return credit_accuracy.main


@pytest.mark.parametrize("case", list(BAD) + list(VIEWER_ONLY))
def test_the_viewer_refuses_a_bad_credit_file_in_one_line(case, tmp_path, monkeypatch, capsys):
    name, data, says = {**BAD, **VIEWER_ONLY}[case]
    f = tmp_path / name
    f.write_bytes(data if isinstance(data, bytes) else data.encode())
    _one_line(capsys, _viewer(monkeypatch, f, "-o", tmp_path / "p.html"), f"error: {f}{says}")
    assert not (tmp_path / "p.html").exists()


@pytest.mark.parametrize("case", list(BAD))
def test_report_refuses_a_bad_credit_file_in_one_line(case, tmp_path, monkeypatch, capsys):
    name, data, says = BAD[case]
    f = tmp_path / name
    f.write_bytes(data if isinstance(data, bytes) else data.encode())
    _one_line(capsys, _measure(monkeypatch, "report", f), f"error: {f}{says}")


@pytest.mark.parametrize("case", list(VIEWER_ONLY)[:3])
def test_report_reads_records_without_the_viewers_keys(case, tmp_path, monkeypatch, capsys):
    """The measure reads step, prompt, reward, tokens and credit: a record without the viewer's other keys is fine
    (tests/test_credit_accuracy.py's rows have none of them), one with a wrong type in them is not."""
    name, data, _ = VIEWER_ONLY[case]
    f = tmp_path / name
    f.write_text(data)
    if "missing" in VIEWER_ONLY[case][2]:
        _measure(monkeypatch, "report", f)()
        assert json.loads(capsys.readouterr().out)["run"] == "c"
    else:
        _one_line(capsys, _measure(monkeypatch, "report", f), "('prompt_id' is a string, not an integer)")


def test_a_directory_with_nothing_in_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "run").mkdir()
    says = f"error: {tmp_path / 'run'}: no credit.jsonl there (run the script with --log-credit N)"
    _one_line(capsys, _viewer(monkeypatch, tmp_path / "run", "-o", tmp_path / "p.html"), says)
    _one_line(
        capsys,
        _viewer(monkeypatch, tmp_path / "gone", "-o", tmp_path / "p.html"),
        f"error: {tmp_path / 'gone'}: no credit.jsonl there",
    )
    _one_line(capsys, _measure(monkeypatch, "report", tmp_path / "run"), says)
    results = ["--setting", "long", "--results", tmp_path / "run"]
    _one_line(capsys, _measure(monkeypatch, "table", *results), "error: no credit records under ")
    _one_line(capsys, _measure(monkeypatch, "calibrate", *results), "error: no GRPO runs under ")


def _results(tmp_path, credit: bytes, metrics: str) -> list:
    """A results tree with one GRPO seed: its credit records and its metrics rows."""
    d = tmp_path / "res" / "long" / "grpo"
    d.mkdir(parents=True, exist_ok=True)
    (d / "seed1.credit.jsonl.gz").write_bytes(credit)
    (d / "seed1.jsonl").write_text(metrics)
    return ["--setting", "long", "--results", tmp_path / "res"]


FINISHED = json.dumps({"step": 0, "eval/accuracy": 0.5}) + "\n" + json.dumps({"step": 1, "eval/accuracy": 0.5}) + "\n"


@pytest.mark.parametrize("cmd", ["table", "calibrate"])
def test_table_and_calibrate_refuse_bad_records_and_metrics(cmd, tmp_path, monkeypatch, capsys):
    gz = str(tmp_path / "res" / "long" / "grpo" / "seed1.credit.jsonl.gz")
    args = _results(tmp_path, gzip.compress(GOOD.encode())[:-20], FINISHED)
    _one_line(capsys, _measure(monkeypatch, cmd, *args), f"error: {gz}: not a readable gzip file")
    args = _results(tmp_path, gzip.compress((GOOD + _with(tokens=["1"])).encode()), FINISHED)
    _one_line(capsys, _measure(monkeypatch, cmd, *args), f"error: {gz}:2: not a credit record (1 tokens but 5 credit")
    metrics = FINISHED + json.dumps({"step": 2, "eval/accuracy": "high"}) + "\n"
    args = _results(tmp_path, gzip.compress(GOOD.encode()), metrics)
    _one_line(capsys, _measure(monkeypatch, cmd, *args), "seed1.jsonl: not a metrics row (step 2: 'eval/accuracy'")
    args = _results(tmp_path, gzip.compress(GOOD.encode()), FINISHED + "[3]\n" + FINISHED)
    _one_line(capsys, _measure(monkeypatch, cmd, *args), "seed1.jsonl:3: not a metrics row")


def test_calibrate_without_step_0_says_null_not_nan(tmp_path, monkeypatch, capsys):
    """No step-0 evaluation logged: the figure is null (valid JSON), not NaN."""
    args = _results(tmp_path, gzip.compress(GOOD.encode()), json.dumps({"step": 1, "eval/accuracy": 0.5}) + "\n")
    _measure(monkeypatch, "calibrate", *args)()
    out = json.loads(capsys.readouterr().out)
    assert out["step0_greedy_accuracy"] is None and out["failed_completions"] == 1  # 1+1=3 is wrong


@pytest.mark.parametrize("flag", ["--workers", "--threads"])
def test_run_refuses_fewer_than_one_worker_or_thread(flag, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(credit_accuracy.lc, "cmd_run", lambda a: pytest.fail(f"{flag} 0 started the runs"))
    call = _measure(monkeypatch, "run", flag, "0", "--results", tmp_path)
    _one_line(capsys, call, f"error: {flag} 0: must be >= 1")
    assert not list(tmp_path.iterdir())  # refused before anything is written


def test_an_output_that_cannot_be_written(tmp_path, monkeypatch, capsys):
    f = tmp_path / "c.jsonl"
    f.write_text(GOOD)
    out = tmp_path / "no" / "p.html"
    _one_line(capsys, _viewer(monkeypatch, f, "-o", out), f"error: -o {out}: cannot write it (No such file")
    (folder := tmp_path / "d.html").mkdir()  # a name of the right kind (another is refused before: issue #62)
    _one_line(capsys, _viewer(monkeypatch, f, "-o", folder), f"error: -o {folder}: cannot write it (Is a dir")
    args = _results(tmp_path, gzip.compress(GOOD.encode()), FINISHED)
    (tmp_path / "res" / "long" / "credit_accuracy.md").mkdir()  # the table's own output is a directory
    call = _measure(monkeypatch, "table", *args)
    _one_line(capsys, call, "credit_accuracy.md: cannot write the table (Is a directory)")


def test_the_viewer_never_writes_over_its_input_or_a_runs_files(tmp_path, monkeypatch, capsys):
    """Issue #62: `-o RUN/credit.jsonl` or `-o RUN/metrics.jsonl` wrote the page over the file, `--png pic.txt` was
    matplotlib's traceback after the page was written. Refused before anything is read or written."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "credit.jsonl").write_text(GOOD)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "page.html").write_text(GOOD)  # a credit file someone named .html
    (tmp_path / "link.html").symlink_to(run / "metrics.jsonl")
    before = {p: p.read_bytes() for p in (run / "credit.jsonl", run / "metrics.jsonl", tmp_path / "page.html")}
    cases = [
        ([run, "-o", run / "credit.jsonl"], "the page is written to a .html or .htm file"),
        ([run, "-o", run / "metrics.jsonl"], "the page is written to a .html or .htm file"),
        ([run, "-o", tmp_path / "p.html", "--png", tmp_path / "pic.txt"], "--png"),
        ([run, "-o", tmp_path / "link.html"], f"a link to {run / 'metrics.jsonl'}, which it would write over"),
        ([tmp_path / "page.html", "-o", tmp_path / "page.html"], "it is this command's input"),
    ]
    for args, words in cases:
        _one_line(capsys, _viewer(monkeypatch, *args), words)
    assert {p: p.read_bytes() for p in before} == before and not (tmp_path / "p.html").exists()


def test_the_viewer_refuses_a_step_or_prompt_with_no_rollout(tmp_path, monkeypatch, capsys):
    f = tmp_path / "c.jsonl"
    f.write_text(GOOD)
    _one_line(
        capsys,
        _viewer(monkeypatch, f, "--step", "7", "-o", tmp_path / "p.html"),
        f"error: {f}: no rollout for --step 7 (its recorded steps: 1)",
    )
    _one_line(
        capsys,
        _viewer(monkeypatch, f, "--max-rows", "0", "-o", tmp_path / "p.html"),
        "error: --max-rows 0: must be >= 1",
    )


@pytest.mark.parametrize("tool", ["tools/credit_view.py", "benchmarks/credit_accuracy.py report"])
def test_as_a_user_sees_it_one_line_and_exit_code_2(tool, tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(GOOD + _with(credit=[1.0]))
    out = subprocess.run([sys.executable, *tool.split(), str(f)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr == f"error: {f}:2: not a credit record (5 tokens but 1 credit values: one per token)\n"

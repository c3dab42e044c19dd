"""--log-credit: the credit each script records is the gradient its loss gives each token's log-prob, in advantage
units; checked against each method's own formula on one real step (GRPO's group z-score, SC-GRPO's f * A, GRPO-lambda's
A * c_k, EP-GRPO's gate * A_out at the first step, SRPO's 0 on the kept prefix and one value on the suffix); and the
viewer renders every recorded token with its value."""

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from helpers import run_dir, run_script

from rlvr_utils.trace_diagnostics import trace_multipliers
from sc_grpo import Role

FLAGS = [
    "--total-steps",
    "1",
    "--eval-every",
    "1",
    "--num-eval",
    "4",
    "--prompts-per-step",
    "2",
    "--num-generations",
    "4",
    "--threads",
    "1",
    "--log-credit",
    "8",
]


def _credit(script, tmp_path, *extra, n=8):
    out = run_script(script, *FLAGS, "--output-dir", str(tmp_path), *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "credit.jsonl").open()]
    assert len(rows) == n and all(r["step"] == 1 and len(r["tokens"]) == len(r["credit"]) for r in rows)
    return rows


def _z(rows, unbiased: bool, eps: float) -> dict:
    """Each row's group z-score of the rewards, computed here from the recorded rewards."""
    out = {}
    for g in {r["prompt_id"] for r in rows}:
        members = [r for r in rows if r["prompt_id"] == g]
        rw = torch.tensor([r["reward"] for r in members], dtype=torch.float64)
        std = rw.std(unbiased=unbiased)
        for r, a in zip(members, (rw - rw.mean()) / (std + eps) if std > 0 else torch.zeros_like(rw)):
            out[r["row"]] = float(a)
    return out


@pytest.mark.slow
def test_grpo_credit_is_the_group_advantage_on_every_token(tmp_path):
    rows = _credit("grpo.py", tmp_path)
    z = _z(rows, unbiased=True, eps=1e-4)
    assert any(z.values())
    for r in rows:
        assert r["credit"] == pytest.approx([z[r["row"]]] * len(r["credit"]), abs=1e-4), r["row"]


@pytest.mark.slow
def test_sc_grpo_credit_is_f_times_the_advantage(tmp_path):
    rows = _credit("sc_grpo.py", tmp_path, "--temperature", "1.5")
    z = _z(rows, unbiased=False, eps=1e-6)
    checked = 0
    for r in rows:
        f, role = r["signals"]["f"], r["signals"]["role"]
        if role == Role.REFERENCE:
            assert not any(r["credit"])
        elif role in (Role.PLAIN, Role.WEIGHTED):
            assert r["credit"] == pytest.approx([x * z[r["row"]] for x in f], abs=1e-4), r["row"]
            checked += role == Role.WEIGHTED and z[r["row"]] != 0
    assert checked or all(r["signals"]["role"] != Role.WEIGHTED for r in rows)


@pytest.mark.slow
def test_grpo_lambda_credit_is_the_advantage_times_the_trace_multiplier(tmp_path):
    rows = _credit("grpo_lambda.py", tmp_path)
    for r in rows:
        c = trace_multipliers(torch.tensor([len(r["credit"])]), 0.99, dtype=torch.float64)[0]
        want = (r["signals"]["advantage"] * c[: len(r["credit"])]).tolist()
        assert r["credit"] == pytest.approx(want, rel=1e-3, abs=1e-4), r["row"]
    assert any(r["signals"]["advantage"] for r in rows)


@pytest.mark.slow
def test_ep_grpo_credit_is_the_gate_times_the_outcome_at_the_first_step(tmp_path):
    """At step 1 pi_old = pi_ref, so delta = 0, P = 0 and the k3 KL's gradient is 0: A = g_hat * A_out."""
    rows = _credit("ep_grpo.py", tmp_path)
    for r in rows:
        s = r["signals"]
        assert not any(s["P"])
        assert r["credit"] == pytest.approx([g * s["outcome"] for g in s["gate"]], abs=1e-4), r["row"]
    assert any(r["signals"]["outcome"] for r in rows)


@pytest.mark.slow
def test_srpo_credit_is_zero_on_the_kept_prefix_and_one_value_on_the_suffix(tmp_path):
    rows = _credit("srpo.py", tmp_path, "--num-generations", "8", "--log-credit", "16", n=16)
    resets = [r for r in rows if r["signals"]["reset_at"] > 0]
    for r in rows:
        k = int(r["signals"]["reset_at"])
        assert not any(r["credit"][:k]), r["row"]
        assert len(set(r["credit"][k:])) <= 1, r["row"]  # REINFORCE: the row's advantage on every suffix token
    assert resets or all(not any(r["credit"]) for r in rows)


def _fake_run(path, script, credit):
    rows = [
        {
            "step": 1,
            "script": script,
            "row": 0,
            "prompt_id": 5,
            "prompt": "Solve: 1+1\n",
            "reward": 1.0,
            "tokens": ["1", "+", "1", "=", "2", "\n", "<b>"],
            "credit": credit,
            "signals": {"f": [0.5] * 7},
        }
    ]
    path.mkdir()
    (path / "credit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_the_page_renders_every_recorded_token_with_its_value(tmp_path):
    a = _fake_run(tmp_path / "a", "grpo.py", [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    b = _fake_run(tmp_path / "b", "sc_grpo.py", [0.1, -0.2, 0.0, 0.4, 0.3, 0.0, -0.05])
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "credit_view.py"),
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "-o",
            str(tmp_path / "p.html"),
            "--png",
            str(tmp_path / "p.png"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "p.html").read_text()
    titles = re.findall(r'title="credit ([^ ]+) \| f 0.5"', page)
    assert titles == [f"{c:+.4g}" for c in a[0]["credit"] + b[0]["credit"]]
    assert "&lt;b&gt;" in page and "<script" not in page and "http" not in page  # escaped, self-contained
    assert "rgb(255,255,255)" in page and "rgb(255,63,63)" in page  # 0 is white, the largest credit strongest red
    assert (tmp_path / "p.png").stat().st_size > 1000


def _arith_rows(script: str, credit_of_line: list[float], row: int, prompt_id: int = 7) -> dict:
    """A failed arith rollout (first wrong line 2 of 3), one token per character, each line's tokens one credit."""
    lines = ["5+3=8\n", "8+2=11\n", "#### 11"]
    return {
        "step": 10,
        "script": script,
        "row": row,
        "prompt_id": prompt_id,
        "prompt": "Solve: 5+3+2\n",
        "reward": 0.0,
        "tokens": [ch for line in lines for ch in line],
        "credit": [c for line, c in zip(lines, credit_of_line) for _ in line],
        "signals": {"reset_at": 6.0},
    }


def test_the_page_lines_up_rows_by_prompt_marks_the_first_wrong_line_and_resists_outliers(tmp_path):
    """SRPO's rows (another row order and group numbering) line up with GRPO's by prompt; each line's mean credit is
    written; the first wrong line is outlined; one huge credit does not wash out the others (95th percentile)."""
    for name, rows in {
        "a": [_arith_rows("grpo.py", [-0.5, -0.5, -0.5], row=3)],
        "b": [_arith_rows("srpo.py", [0.0, -1.0, -1.0], row=40), _arith_rows("srpo.py", [0.0, -1.0, -1.0], row=41)]
        + [_arith_rows("srpo.py", [0.0, -1.0, -1.0], row=42, prompt_id=8)]
        + [dict(_arith_rows("srpo.py", [0.0, 0.0, 0.0], row=43, prompt_id=9), credit=[-64.8] + [0.0] * 19)],
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "credit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "credit_view.py"), str(tmp_path / "a"), str(tmp_path / "b")]
        + ["-o", str(tmp_path / "p.html")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "p.html").read_text()
    body = page.split("<table>")[1].split("<tr>")[2:]  # the data rows
    assert len(body) == 4  # prompt 7 rollouts 1 and 2, prompt 8, prompt 9
    assert "row 3," in body[0] and "row 40," in body[0] and "row 41," in body[1] and "row 3," not in body[1]
    assert page.count("&larr; first wrong line") == 5 and page.count('class="ln w"') == 5
    assert ">-1 &larr; first wrong line<" in body[0] and ">-0.5 &larr; first wrong line<" in body[0]
    assert "colour scale 1 (95th percentile" in page  # not 64.8: the outlier saturates alone
    assert "rgb(63,63,255)" in body[0]  # so an ordinary -1 still gets the strongest blue


def test_the_page_in_headless_chromium(tmp_path):
    """The page as a person sees it: Chromium (Debian's package) renders it with no console error, and the DOM it
    builds holds every token and the first-wrong-line mark."""
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium; .ci/run installs it)")
    rows = [_arith_rows("grpo.py", [-0.5, -0.5, -0.5], row=0), _arith_rows("grpo.py", [0.2, -1.0, -0.1], row=1)]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "credit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html_path = tmp_path / "p.html"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "credit_view.py"), str(tmp_path / "a"), "-o", str(html_path)], check=True
    )
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    flags += [f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0"]
    dom = subprocess.run([*flags, "--dump-dom", html_path.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count('class="ln w"') == 2 and "first wrong line" in dom.stdout
    assert dom.stdout.count('class="t"') == 2 * len(rows[0]["tokens"])
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    shot = tmp_path / "p.png"
    r = subprocess.run(
        [*flags, "--window-size=900,600", f"--screenshot={shot}", html_path.as_uri()], capture_output=True, timeout=120
    )
    assert r.returncode == 0 and shot.stat().st_size > 5000

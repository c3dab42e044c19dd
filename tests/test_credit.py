"""--log-credit: the credit each script records is the gradient its loss gives each token's log-prob, in advantage
units; checked against each method's own formula on one real step (GRPO's group z-score, SC-GRPO's f * A, GRPO-lambda's
A * c_k, EP-GRPO's gate * A_out at the first step, SRPO's 0 on the kept prefix and one value on the suffix); and the
viewer renders every recorded token with its value."""

import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch
from conftest import ROOT
from helpers import run_dir, run_script

from rlvr_utils.methods.trace_diagnostics import trace_multipliers
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
    assert "rgb(90,130,255)" in body[0]  # so an ordinary -1 still gets the strongest blue


def test_the_page_in_headless_chromium(tmp_path):
    """The page as a person sees it: Chromium (Debian's package) renders it with no console error, and the DOM it
    builds holds every token and the first-wrong-line mark."""
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
    assert dom.stdout.count('class="t') == 2 * len(rows[0]["tokens"])  # "t" or "t rs" (the reset bar)
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    shot = tmp_path / "p.png"
    r = subprocess.run(
        [*flags, "--window-size=900,600", f"--screenshot={shot}", html_path.as_uri()], capture_output=True, timeout=120
    )
    assert r.returncode == 0 and shot.stat().st_size > 5000


# ----------------------------------------------------------------------------------------------
# the page: legend, contrast, collapsed groups, SRPO's rows
# ----------------------------------------------------------------------------------------------
sys.path.insert(0, str(ROOT / "tools"))
import credit_view  # noqa: E402


def _luminance(rgb) -> float:
    """WCAG 2's relative luminance of an sRGB colour (0-255 channels)."""
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (v / 255 for v in rgb)]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _contrast(a, b) -> float:
    """WCAG 2's contrast ratio of two colours, (L1 + 0.05) / (L2 + 0.05) with L1 the lighter."""
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _rgb(css: str) -> tuple[int, ...]:
    """'rgb(r, g, b)' (as the page writes it or a browser computes it) or '#rgb' / '#rrggbb' -> (r, g, b)."""
    if css.startswith("#"):
        h = css[1:] if len(css) == 7 else "".join(c * 2 for c in css[1:])
        return tuple(int(h[i : i + 2], 16) for i in (0, 2, 4))
    return tuple(int(float(v)) for v in re.findall(r"[\d.]+", css)[:3])


def test_the_palette_reaches_wcag_aa_contrast_and_stays_red_and_blue():
    """Token text on every shade, the strongest ones first, has a WCAG contrast of at least 4.5:1 (AA for normal
    text; the strongest blue gave 3.4:1 before); the scale stays diverging: white at 0, red up, blue down."""
    text = _rgb(credit_view.TEXT)
    for c in (1.0, -1.0, 5.0, -5.0):  # the extremes (and beyond: saturated)
        assert _contrast(_rgb(credit_view.color(c, 1.0)), text) >= 4.5, c
    worst = min(_contrast(_rgb(credit_view.color(k / 50, 1.0)), text) for k in range(-50, 51))
    assert worst >= 4.5
    assert credit_view.color(0.0, 1.0) == "rgb(255,255,255)"
    r, g, b = _rgb(credit_view.color(1.0, 1.0))
    assert r == 255 and g < 100 and b < 100  # red
    r, g, b = _rgb(credit_view.color(-1.0, 1.0))
    assert b == 255 and r < 128 and g < 160 and b - max(r, g) > 100  # blue
    lum = _luminance(credit_view.shade(1.0, 1.0)), _luminance(credit_view.shade(-1.0, 1.0))
    assert abs(lum[0] - lum[1]) < 0.02  # neither sign looks stronger at the same |credit|


class _Dom(HTMLParser):
    """A small DOM of the page: nodes {tag, attrs, kids, text} (text: all the text inside, as textContent)."""

    VOID = {"br", "col", "meta", "img", "hr", "input", "link", "wbr"}

    def __init__(self, page: str):
        super().__init__()
        self.root = {"tag": "root", "attrs": {}, "kids": [], "text": ""}
        self.stack = [self.root]
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        node = {"tag": tag, "attrs": dict(attrs), "kids": [], "text": ""}
        self.stack[-1]["kids"].append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        while len(self.stack) > 1 and self.stack[-1]["tag"] != tag:
            self.stack.pop()  # an end tag HTML lets the page leave out
        if len(self.stack) > 1:
            self.stack.pop()

    def handle_data(self, data):
        for node in self.stack:
            node["text"] += data

    def find(self, tag=None, cls=None, node=None):
        """Every node below `node` (the root) with this tag and/or this class, in document order."""
        for kid in (node or self.root)["kids"]:
            if (tag is None or kid["tag"] == tag) and (cls is None or cls in kid["attrs"].get("class", "").split()):
                yield kid
            yield from self.find(tag, cls, kid)


def _page_of(runs: dict) -> str:
    """credit_view.page over {name: rows}."""
    return credit_view.page([(name, rows) for name, rows in runs.items()])


def test_the_legend_shows_each_columns_scale_with_its_numbers():
    """The legend holds, per column, the colour at -scale, 0, +scale and the steps between, each swatch written with
    the credit it stands for on that column's scale, in the colour the tokens get."""
    a = [_arith_rows("grpo.py", [-0.5, -0.5, -0.5], row=0), _arith_rows("grpo.py", [2.0, 2.0, 2.0], row=1)]
    b = [_arith_rows("sc_grpo.py", [0.25, -1.0, 0.0], row=0)]
    dom = _Dom(_page_of({"a": a, "b": b}))
    (legend,) = dom.find("table", "legend")
    head = [th["text"] for th in dom.find("th", node=legend)]
    assert head[:10] == ["column", "-scale", "-0.75\u00d7scale", "-0.5\u00d7scale", "-0.25\u00d7scale", "0"] + [
        "+0.25\u00d7scale",
        "+0.5\u00d7scale",
        "+0.75\u00d7scale",
        "+scale",
    ]
    rows = [tr for tr in dom.find("tr", node=legend) if list(dom.find("td", "sw", tr))]
    assert [next(dom.find("th", node=tr))["text"] for tr in rows] == ["a", "b"]
    for tr, scale in zip(rows, (credit_view.robust_scale(a), credit_view.robust_scale(b))):
        cells = list(dom.find("td", "sw", tr))
        assert [c["text"] for c in cells] == ["0" if f == 0 else f"{f * scale:+.3g}" for f in credit_view.LEGEND_STEPS]
        assert cells[0]["attrs"]["style"] == f"background:{credit_view.color(-scale, scale)}"
        assert cells[4]["attrs"]["style"] == "background:rgb(255,255,255)"
        assert cells[-1]["attrs"]["style"] == f"background:{credit_view.color(scale, scale)}"
    assert [c["text"] for c in dom.find("td", "sw", rows[0])][-1] == "+2"  # grpo's 95th percentile of |credit|


def test_groups_where_every_rollout_is_right_are_collapsed():
    """A (step, prompt) whose every rollout in every column has the success reward is folded in a closed <details>
    whose summary counts its rollouts; a group with one wrong rollout anywhere stays open."""
    right = [dict(_arith_rows("grpo.py", [0.0] * 3, row=k, prompt_id=7), reward=1.0) for k in range(3)]
    mixed = [dict(_arith_rows("grpo.py", [0.5] * 3, row=3 + k, prompt_id=8), reward=float(k > 0)) for k in range(3)]
    other = [dict(r, script="sc_grpo.py") for r in right[:2]] + [dict(r, script="sc_grpo.py") for r in mixed]
    page = _page_of({"a": right + mixed, "b": other})
    dom = _Dom(page)
    (details,) = dom.find("details")
    assert "open" not in details["attrs"]
    (summary,) = dom.find("summary", node=details)
    assert summary["text"].startswith("step 10, prompt 7: 5 rollouts collapsed, every one right (reward 1)")
    assert len(list(dom.find("td", "k", details))) == 3  # its three rollout positions are inside, folded
    outside = [td["text"] for td in dom.find("td", "k") if "prompt 8," in td["text"]]
    assert len(outside) == 3 and "prompt 8" not in details["text"]  # the group with failures is not folded
    assert "<script" not in page


def _srpo_runs() -> dict:
    """GRPO's rollouts of prompt 7 beside SRPO's: two reset continuations (kept prefix: 6 tokens) and one row sampled
    whole (reset_at 0)."""
    grpo = [dict(_arith_rows("grpo.py", [-0.5, -0.5, -0.5], row=k), signals={}) for k in range(3)]
    srpo = [_arith_rows("srpo.py", [0.0, -1.0, -1.0], row=40 + k) for k in range(2)]
    srpo[0]["credit"][:6] = [0.0] * 6
    srpo.append(dict(_arith_rows("srpo.py", [1.0, 1.0, 1.0], row=44), signals={"reset_at": 0.0}))
    return {"grpo": grpo, "srpo": srpo}


def test_srpo_cells_say_which_rollout_they_show():
    """SRPO's k-th row of a prompt is not the other methods' k-th rollout: each SRPO cell says what it is (a reset
    continuation, with its kept prefix's length, or a chain sampled whole), its column says so, and the first
    resampled token is marked; the other columns' cells are unchanged."""
    dom = _Dom(_page_of(_srpo_runs()))
    heads = [div["text"] for div in dom.find("div", "m")]
    assert heads[0::2] == ["row 0, reward 0", "row 1, reward 0", "row 2, reward 0"]
    srpo = heads[1::2]
    assert srpo[0].startswith("SRPO: reset continuation of prompt 7, row 40, reward 0. Its first 6 tokens are the kept")
    assert srpo[1].startswith("SRPO: reset continuation of prompt 7, row 41, reward 0.")
    assert srpo[2].startswith("SRPO: sampled whole from prompt 7, row 44, reward 0. A fresh chain, or a continuation")
    column = [th["text"] for th in dom.find("th") if th["text"].startswith("srpocolour scale")]  # its heading
    assert len(column) == 1 and "not the other columns' k-th rollout" in column[0]
    bars = list(dom.find("span", "rs"))
    assert len(bars) == 2 and all(b["text"] == "8" for b in bars)  # token 6: the first of line 2 ("8+2=11")
    assert all("resampled from here" in b["attrs"]["title"] for b in bars)


PROBE = """<script>
const out = {width: innerWidth, scroll: document.documentElement.scrollWidth, pairs: [], legend: [], details: []};
for (const el of document.querySelectorAll('.t, .sw')) {
  const s = getComputedStyle(el);
  out.pairs.push([el.className, s.color, s.backgroundColor]);
}
for (const tr of document.querySelectorAll('table.legend tr'))
  out.legend.push([...tr.querySelectorAll('td.sw')].map(td => td.textContent));
for (const d of document.querySelectorAll('details'))
  out.details.push([d.open, d.querySelector('summary').textContent, d.getBoundingClientRect().height]);
const pre = document.createElement('pre');
pre.id = 'probe';
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


@pytest.mark.parametrize("width", [1280, 1700])
def test_the_page_in_headless_chromium_legend_contrast_and_folds(tmp_path, width):
    """In Chromium at 1280 and 1700 px: every token's and legend value's computed text colour on its computed
    background reaches WCAG AA (4.5:1); the legend has a row of 9 numbered swatches per column; the group whose every
    rollout is right is a closed <details> (its summary line alone is drawn); the page fits the window's width. A
    probe script is added to a copy of the page (the page itself has none) and reads the DOM Chromium builds."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium; .ci/run installs it)")
    runs = _srpo_runs()
    runs["grpo"] += [dict(_arith_rows("grpo.py", [0.0] * 3, row=9, prompt_id=3), reward=1.0)]  # a group all right
    runs["sc_grpo"] = [_arith_rows("sc_grpo.py", [0.3, -2.0, -0.2], row=k) for k in range(3)]
    page = _page_of(runs)
    assert "<script" not in page
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"))
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    flags += [f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},900"]
    dom = subprocess.run([*flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    assert found, dom.stdout[-2000:]
    out = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<"))
    assert out["width"] == width and out["scroll"] <= width  # no horizontal scrolling
    tokens = sum(len(r["tokens"]) for rows in runs.values() for r in rows)
    assert len([p for p in out["pairs"] if p[0].startswith("t")]) == tokens
    assert len([p for p in out["pairs"] if p[0] == "sw"]) == 9 * len(runs)
    worst = min(_contrast(_rgb(fg), _rgb(bg)) for _, fg, bg in out["pairs"])
    assert worst >= 4.5, worst
    assert [row for row in out["legend"] if row][1][0] == "-1"  # sc_grpo: scale 1 (its 95th percentile)
    ((opened, summary, height),) = out["details"]
    assert not opened and summary.startswith("step 10, prompt 3: 1 rollout collapsed") and height < 40


def test_sc_grpo_rows_show_their_role_by_name():
    """SC-GRPO's per-row role is sc_grpo.Role: the cell says `role weighted`, not `role 1`; other numbers as numbers."""
    row = _arith_rows("sc_grpo.py", [0.5] * 3, row=0)
    row["signals"] = {"role": 1.0, "f": [0.5] * len(row["tokens"])}
    head = credit_view.cell_head(row)
    assert "role weighted" in head and "role 1" not in head
    assert "role reference" in credit_view.cell_head(dict(row, signals={"role": 3.0}))
    assert "role weighted" in _page_of({"sc": [row]})  # the tooltips too


def test_the_picture_shows_a_failed_rollout_where_there_is_one():
    """--png draws, of the rows every run shares, a failed one (a right one has no wrong line for credit to find)."""
    right = [dict(_arith_rows(s, [1.0, 1.0, 1.0], row=0), reward=1.0, signals={}) for s in ("grpo.py", "sc_grpo.py")]
    wrong = [dict(_arith_rows(s, [0.1, -1.0, 0.5], row=1), signals={}) for s in ("grpo.py", "sc_grpo.py")]
    picked = credit_view.pick_rows([("a", [right[0], wrong[0]]), ("b", [right[1], wrong[1]])])
    assert [r["row"] for r in picked] == [1, 1]
    alone = credit_view.pick_rows([("a", [right[0], wrong[0]]), ("b", [right[1]])])  # nothing shared but the right
    assert [r["reward"] for r in alone] == [1.0, 1.0]
    assert credit_view.pick_rows([("a", [right[0], wrong[0]])])[0]["row"] == 1


def test_the_picture_has_a_colour_bar(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    bars = []
    real = matplotlib.figure.Figure.colorbar
    monkeypatch.setattr(
        matplotlib.figure.Figure, "colorbar", lambda self, *a, **k: bars.append(real(self, *a, **k)) or bars[-1]
    )
    rows = [dict(_arith_rows("grpo.py", [0.1, -1.0, 0.5], row=1), signals={})]
    credit_view.png([("a", rows)], str(tmp_path / "p.png"))
    assert len(bars) == 1 and [t.get_text() for t in bars[0].ax.get_xticklabels()][1] == "0"
    assert (tmp_path / "p.png").stat().st_size > 1000

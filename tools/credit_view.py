"""See the credit: each token of a few training rollouts shaded by the credit its log-prob's gradient got in the loss.

    python grpo.py --log-credit 4 --output-dir runs/credit && python sc_grpo.py --log-credit 4 --output-dir runs/credit
    python tools/credit_view.py runs/credit/<grpo run> runs/credit/<sc_grpo run> -o credit.html [--png credit.png]

Reads each run's credit.jsonl (written by any script with --log-credit N at its evaluation steps) and writes one
self-contained HTML page (no network, no JavaScript): one column per run, the rollouts of a step side by side when the
runs share a seed (same step, same prompt: the k-th rollout of each), each token on a diverging scale (red: pushed
up, blue: pushed down, white: no credit; each column scaled to the 95th percentile of its |credit|), each line's mean
credit written after it, the first wrong line of a failed arith rollout outlined, and each token's exact credit and
the method's signals in a tooltip. `--png` also draws one rollout of every
run as a picture (matplotlib), for the docs, each on its own colour scale.
"""

from __future__ import annotations

import argparse
import gzip
import html
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rlvr_utils import credit  # noqa: E402


def read_runs(dirs: list[str]) -> list[tuple[str, list[dict]]]:
    out = []
    for d in dirs:
        path = Path(d) / "credit.jsonl" if Path(d).is_dir() else Path(d)
        if not path.is_file():
            raise SystemExit(f"{d}: no credit.jsonl (run the script with --log-credit N)")
        data = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        rows = [json.loads(line) for line in data.splitlines() if line.strip()]
        name = rows[0]["script"] if rows else path.parent.name
        label = path.parent.name if path.name == "credit.jsonl" else f"{path.parent.name}/{path.name.split('.')[0]}"
        out.append((f"{name} ({label})", rows))
    return out


def color(c: float, scale: float) -> str:
    """A diverging colour: red for positive credit, blue for negative, white at 0; strongest at |c| >= scale."""
    x = max(-1.0, min(1.0, c / scale)) if scale > 0 else 0.0
    fade = int(255 * (1 - 0.75 * abs(x)))  # the strongest shade stays light enough to read the token on
    return f"rgb(255,{fade},{fade})" if x >= 0 else f"rgb({fade},{fade},255)"


def robust_scale(rows: list[dict], q: float = 0.95) -> float:
    """The colour scale of a column: the q-quantile of its nonzero |credit| (one outlier, e.g. GRPO-lambda's early
    tokens, cannot wash out every other shade; the few tokens above it saturate)."""
    vals = sorted(abs(c) for r in rows for c in r["credit"] if c)
    return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else 0.0


def first_wrong_line(row: dict) -> int | None:
    """arith rows with reward below 1: the first wrong line (1-based over non-empty lines), else None."""
    return credit.first_wrong_line(row) if row["reward"] < 1 else None


def row_html(row: dict, scale: float) -> str:
    """The tokens, shaded, line by line, each line followed by its mean credit (readable without a mouse); the first
    wrong line of a failed arith rollout outlined and labelled; each token's exact credit and signals in its tooltip."""
    lines, wrong = credit.token_lines(row["tokens"]), first_wrong_line(row)
    out, spans, values = [], [], []

    def close(line: int) -> None:
        if spans:
            mark = line == wrong and line > 0
            mean = f"{sum(values) / len(values):+.3g}" + (" &larr; first wrong line" if mark else "")
            out.append(f'<span class="{"ln w" if mark else "ln"}">{"".join(spans)}</span>')
            out.append(f'<span class="{"v wv" if mark else "v"}">{mean}</span>')
        spans.clear()
        values.clear()

    for i, tok in enumerate(row["tokens"]):
        tip = [f"credit {row['credit'][i]:+.4g}"]
        for name, v in row["signals"].items():
            tip.append(f"{name} {v[i]:.4g}" if isinstance(v, list) else f"{name} {v:.4g}")
        text = html.escape(tok.replace("\n", "")) + ("&#8629;" if "\n" in tok else "")
        style = f"background:{color(row['credit'][i], scale)}"
        spans.append(f'<span class="t" style="{style}" title="{" | ".join(tip)}">{text}</span>')
        values.append(row["credit"][i])
        if "\n" in tok:  # the line ends: its mean credit, then a line break
            close(lines[i])
            out.append("<br>")
    close(lines[-1] if lines else 0)
    return "".join(out)


def keyed(rows: list[dict]) -> dict:
    """(step, prompt, k): the k-th recorded row of that prompt at that step, so that runs of the same seed line up by
    prompt whatever their row order or group numbering (SRPO's groups are not prompts)."""
    out, seen = {}, {}
    for r in sorted(rows, key=lambda r: (r["step"], r["prompt_id"], r["row"])):
        k = seen[(r["step"], r["prompt_id"])] = seen.get((r["step"], r["prompt_id"]), -1) + 1
        out[(r["step"], r["prompt_id"], k)] = r
    return out


def page(runs: list[tuple[str, list[dict]]], max_rows: int | None = None) -> str:
    index = [keyed(rows) for _, rows in runs]
    keys = sorted({k for ix in index for k in ix})[:max_rows]
    scales = [robust_scale(rows) for _, rows in runs]
    head = "".join(
        f"<th>{html.escape(name)}<br><small>colour scale {s:.3g} (95th percentile of |credit|); max "
        f"{max((abs(c) for r in rows for c in r['credit']), default=0.0):.3g}</small></th>"
        for (name, rows), s in zip(runs, scales)
    )
    body = []
    for key in keys:
        cells = []
        for ix, scale in zip(index, scales):
            row = ix.get(key)
            if row is None:
                cells.append("<td></td>")
                continue
            sig = ", ".join(f"{k} {v:.3g}" for k, v in row["signals"].items() if not isinstance(v, list))
            head_line = f"row {row['row']}, reward {row['reward']:.3g}{'; ' + sig if sig else ''}"
            cells.append(f'<td><div class="m">{head_line}</div>{row_html(row, scale)}</td>')
        prompt = next(ix[key]["prompt"] for ix in index if key in ix)
        label = f"step {key[0]}, prompt {key[1]}, rollout {key[2] + 1}<pre>{html.escape(prompt)}</pre>"
        body.append(f"<tr><td class='k'>{label}</td>{''.join(cells)}</tr>")
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>token credit</title><style>
body{{font-family:sans-serif;font-size:13px}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;
vertical-align:top;padding:4px;max-width:34em}} .t{{font-family:monospace;white-space:pre}} .m{{color:#555}}
.w{{outline:2px solid #000;outline-offset:1px}} .v{{font-size:10px;color:#444;margin-left:6px}}
.wv{{color:#000;font-weight:bold}} .k pre{{margin:2px 0;white-space:pre-wrap}}</style></head><body>
<p>Each token shaded by its effective credit: the gradient its log-prob gets in the loss, in advantage units
(red: pushed up, blue: pushed down, white: none). Each column has its own colour scale, the 95th percentile of its
nonzero |credit| (tokens beyond it get the strongest shade, so one outlier cannot wash out the rest). The number after
each line is the line's mean credit; on a failed arith rollout the first wrong line is outlined. Rows line up by step
and prompt (the k-th rollout of the prompt in each run). Hover a token for its exact value and the method's
signals.</p>
<table><tr><th>rollout</th>{head}</tr>{"".join(body)}</table></body></html>"""


def png(runs: list[tuple[str, list[dict]]], path: str, width: int = 60) -> None:
    """One row (the first one every run shares, else each run's first) per run, tokens wrapped at `width` chars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picks = []  # each drawn row on its own scale (its largest |credit| is full colour), the scale in its label
    for (name, rows), row in zip(runs, pick_rows(runs)):
        scale = max((abs(c) for c in row["credit"]), default=0.0)
        label = f"{row['script']}, reward {row['reward']:.3g}\n|credit| max {scale:.3g}"
        picks.append((label, row, scale))
    lines = []
    for name, row, scale in picks:
        pos, line = 0, []
        for tok, c in zip(row["tokens"], row["credit"]):
            if pos + len(tok) > width or tok == "\n":
                lines.append((name, line))
                pos, line, name = 0, [], ""
            if tok != "\n":
                line.append((tok, c, scale))
                pos += len(tok)
        lines.append((name, line))
        lines.append(("", []))
    fig, ax = plt.subplots(figsize=(width * 0.13 + 2.5, 0.32 * len(lines) + 0.4))
    ax.set_axis_off()
    for y, (name, line) in enumerate(lines):
        ax.text(0, -y, name, fontsize=8, va="center", ha="right", family="sans-serif")
        for x, (tok, c, scale) in enumerate(_positions(line)):
            ax.text(
                x * 0.13 + 0.1,
                -y,
                tok,
                fontsize=9,
                va="center",
                family="monospace",
                bbox=dict(boxstyle="square,pad=0.05", fc=_rgb(c, scale), ec="none"),
            )
    ax.set_xlim(-0.1, width * 0.13 + 0.3)
    ax.set_ylim(-len(lines), 1)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def pick_rows(runs: list[tuple[str, list[dict]]]) -> list[dict]:
    """The rollout to draw for each run: the first (step, prompt, row) every run recorded where every run's credit is
    not all zero and the runs' credit differs most; else each run's first row with credit (SRPO: a reset row)."""
    key = lambda r: (r["step"], r["prompt_id"], r["row"])  # noqa: E731
    index = [{key(r): r for r in rows} for _, rows in runs]
    shared = [k for k in index[0] if all(k in ix and any(ix[k]["credit"]) for ix in index)]

    def spread(k):  # how differently the runs shape the credit along the rollout (after scaling each to its mean)
        shapes = []
        for ix in index:
            c = ix[k]["credit"]
            mean = sum(abs(x) for x in c) / len(c) or 1.0
            shapes.append([x / mean for x in c])
        return sum(max(col) - min(col) for col in zip(*shapes)) if len({len(s) for s in shapes}) == 1 else 0.0

    reset = [r for _, rows in runs for r in rows if r["signals"].get("reset_at", 0) > 0 and any(r["credit"])]
    if reset:  # SRPO: one of its reset rollouts, and the other runs' rollout of the same prompt
        want = reset[0]
        same = [
            next((r for r in rows if r["prompt_id"] == want["prompt_id"] and any(r["credit"])), None)
            for _, rows in runs
        ]
        return [
            want if any(r is want for r in rows) else s or next((r for r in rows if any(r["credit"])), rows[0])
            for (_, rows), s in zip(runs, same)
        ]
    if shared:
        best = max(shared, key=spread)
        return [ix[best] for ix in index]
    return [
        next(
            (r for r in rows if any(r["credit"]) and r["signals"].get("reset_at", 1) != 0),
            next((r for r in rows if any(r["credit"])), rows[0]),
        )
        for _, rows in runs
    ]


def _positions(line):
    out = []
    for tok, c, scale in line:
        out.extend([(ch, c, scale) for ch in tok])
    return out


def _rgb(c: float, scale: float) -> tuple[float, float, float]:
    r, g, b = (int(v) / 255 for v in color(c, scale)[4:-1].split(","))
    return r, g, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories (or credit.jsonl / .jsonl.gz files), one column each")
    ap.add_argument("--step", type=int, default=None, help="only this recorded step's rollouts")
    ap.add_argument("--prompt", type=int, default=None, help="only this prompt id's rollouts")
    ap.add_argument("--max-rows", type=int, default=None, help="only the first N rollouts (step, prompt) of the page")
    ap.add_argument("-o", "--out", default="credit.html")
    ap.add_argument("--png", default=None, help="also draw one shared row of every run into this PNG")
    a = ap.parse_args()
    if a.png and importlib.util.find_spec("matplotlib") is None:
        sys.exit("credit_view.py: --png needs matplotlib (pip install matplotlib, or -r requirements-dev.txt)")
    runs = read_runs(a.runs)
    if a.step is not None:
        runs = [(name, [r for r in rows if r["step"] == a.step]) for name, rows in runs]
    if a.prompt is not None:
        runs = [(name, [r for r in rows if r["prompt_id"] == a.prompt]) for name, rows in runs]
    Path(a.out).write_text(page(runs, a.max_rows))
    print(f"page: {a.out}")
    if a.png:
        png(runs, a.png)
        print(f"picture: {a.png}")


if __name__ == "__main__":
    main()

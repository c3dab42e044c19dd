"""See the credit: each token of a few training rollouts shaded by the credit its log-prob's gradient got in the loss.

    python grpo.py --log-credit 4 --output-dir runs/credit && python sc_grpo.py --log-credit 4 --output-dir runs/credit
    python tools/credit_view.py runs/credit/<grpo run> runs/credit/<sc_grpo run> -o credit.html [--png credit.png]

Reads each run's credit.jsonl (written by any script with --log-credit N at its evaluation steps) and writes one
self-contained HTML page (no network, no JavaScript): one column per run, the rollouts of a step side by side when the
runs share a seed (same step, same prompt: the k-th rollout of each), each token on a diverging scale (red: pushed
up, blue: pushed down, white: no credit; each column scaled to the 95th percentile of its |credit|, a legend giving
each column's numbers; black text on every shade at WCAG AA contrast or better), each line's mean credit written
after it, the first wrong line of a failed arith rollout outlined, and each token's exact credit and the method's
signals in a tooltip. A group (step, prompt) whose every rollout is right is collapsed (<details>). SRPO's rows are
not the k-th sampled rollout of a prompt: each says whether it is a reset continuation (its kept prefix marked) or a
chain sampled whole. `--png` also draws one rollout of every run as a picture (matplotlib), for the docs, each on its
own colour scale.

A file that cannot be read as credit records (damaged, truncated, empty, a record of the wrong schema) or an output
that cannot be written ends in one line, `error: FILE:LINE: not a credit record (...)` and the like, exit code 2;
benchmarks/credit_accuracy.py reads records through the same read_records.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import html
import importlib.util
import itertools
import json
import math
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rlvr_utils.core.runtime import usage_error  # noqa: E402
from rlvr_utils.extras import credit  # noqa: E402
from sc_grpo import Role  # noqa: E402  (SC-GRPO's row roles, shown by name)


class BadInput(Exception):
    """A credit file that cannot be used, as one line naming the file (and line) and what is wrong. The command-line
    tools (this one and benchmarks/credit_accuracy.py) print it as `error: ...` and exit with code 2, never a
    traceback: a damaged file is the reader's mistake to report, not a bug to debug."""


NUMBER = "a finite number"
RECORD_KEYS = ("step", "script", "row", "prompt_id", "prompt", "reward", "tokens", "credit", "signals")  # CreditLog's


def _json_kind(v) -> str:
    """How a JSON value reads in an error message: its JSON type (NaN and infinities by name)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number" if math.isfinite(v) else str(v)
    return {str: "a string", list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bad_number(values: list) -> int | None:
    """The index of the first element of `values` that is not a finite number, or None."""
    return next((i for i, v in enumerate(values) if not _is_number(v)), None)


def _is_a(kind: type):
    return lambda v: isinstance(v, kind)


FIELDS = {  # each key of a record: the check of its value, and what the check wants (for the message)
    "step": (_is_int, "an integer"),
    "script": (_is_a(str), "a string"),
    "row": (_is_int, "an integer"),
    "prompt_id": (_is_int, "an integer"),
    "prompt": (_is_a(str), "a string"),
    "reward": (lambda v: v is None or _is_number(v), f"{NUMBER} or null"),  # null: no reward function scored it
    "tokens": (_is_a(list), "a list of strings"),
    "credit": (_is_a(list), f"a list of {NUMBER}s"),
    "signals": (_is_a(dict), "an object"),
}


def record_problem(rec, required: tuple[str, ...] = RECORD_KEYS) -> str | None:
    """What makes `rec` (one parsed JSON line) not a credit record, or None. `required`: the keys the reader uses
    (the viewer needs them all; benchmarks/credit_accuracy.py only step, prompt, reward, tokens and credit); every
    known key present is checked whatever `required` says, so that no later line can fail on a wrong type."""
    if not isinstance(rec, dict):
        return f"{_json_kind(rec)}, not a JSON object"
    missing = [k for k in required if k not in rec]
    if missing:
        return "missing " + ", ".join(repr(k) for k in missing)
    for key, (ok, want) in FIELDS.items():
        if key in rec and not ok(rec[key]):
            return f"{key!r} is {_json_kind(rec[key])}, not {want}"
    tokens, credit = rec.get("tokens"), rec.get("credit")
    if tokens is not None:
        bad = next((i for i, t in enumerate(tokens) if not isinstance(t, str)), None)
        if bad is not None:
            return f"'tokens'[{bad}] is {_json_kind(tokens[bad])}, not a string"
    if credit is not None and (bad := _bad_number(credit)) is not None:
        return f"'credit'[{bad}] is {_json_kind(credit[bad])}, not {NUMBER}"
    if tokens is not None and credit is not None and len(tokens) != len(credit):
        return f"{len(tokens)} tokens but {len(credit)} credit values: one per token"
    for name, v in rec.get("signals", {}).items():
        if isinstance(v, list):
            if (bad := _bad_number(v)) is not None:
                return f"signal {name!r}[{bad}] is {_json_kind(v[bad])}, not {NUMBER}"
            if tokens is not None and len(v) != len(tokens):
                return f"signal {name!r} has {len(v)} values for {len(tokens)} tokens"
        elif not _is_number(v):
            return f"signal {name!r} is {_json_kind(v)}, not {NUMBER} or a list of one per token"
    return None


def credit_file(path: str | Path) -> Path:
    """The credit file of a command-line argument: a run directory's credit.jsonl, or the .jsonl / .jsonl.gz file."""
    path = Path(path)
    found = path / "credit.jsonl" if path.is_dir() else path
    if not found.is_file():
        raise BadInput(f"{path}: no credit.jsonl there (run the script with --log-credit N)")
    return found


def read_jsonl(path: Path, what: str) -> list[tuple[int, object]]:
    """(line number, parsed value) of every non-blank line of a JSON-lines file, gzipped or not (told by its first
    bytes, whatever its name). Any damage (unreadable, a truncated or corrupt gzip stream, bytes that are not UTF-8, a
    line that is not JSON) is a BadInput naming the file and, where there is one, the line; `what` names a line's
    kind in that message (`FILE:LINE: not a <what> (...)`)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BadInput(f"{path}: cannot read it ({e.strerror or e})") from None
    if data[:2] == b"\x1f\x8b" or path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; a cut-off stream an EOFError
            raise BadInput(f"{path}: not a readable gzip file ({e})") from None
    out = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode()
        except UnicodeDecodeError as e:
            raise BadInput(f"{path}:{n}: not a {what} (byte {raw[e.start]:#04x} at column {e.start + 1} is not UTF-8)")
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except ValueError as e:  # JSONDecodeError; also a number too long for int()
            where = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
            reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            raise BadInput(f"{path}:{n}: not a {what} (not JSON: {reason}{where})") from None
    return out


def read_records(path: str | Path, required: tuple[str, ...] = RECORD_KEYS) -> list[dict]:
    """The credit records of a run directory, a credit .jsonl or a .jsonl.gz file, each checked (record_problem):
    the one place both this viewer and benchmarks/credit_accuracy.py read them. A BadInput for a missing or empty file
    and for the first line that is not a credit record (`FILE:LINE: not a credit record (what is wrong)`)."""
    found = credit_file(path)
    rows = []
    for n, rec in read_jsonl(found, "credit record"):
        problem = record_problem(rec, required)
        if problem:
            raise BadInput(f"{found}:{n}: not a credit record ({problem})")
        rows.append(rec | {"reward": math.nan} if rec.get("reward", 0) is None else rec)  # NaN: neither right nor wrong
    if not rows:
        raise BadInput(f"{found}: no credit records in it (an empty file)")
    return rows


def read_runs(dirs: list[str]) -> list[tuple[str, list[dict]]]:
    out = []
    for d in dirs:
        rows = read_records(d)
        path = credit_file(d)
        label = path.parent.name if path.name == "credit.jsonl" else f"{path.parent.name}/{path.name.split('.')[0]}"
        out.append((f"{rows[0]['script']} ({label})", rows))
    return out


# The strongest shades (|credit| >= the column's scale): red pushed up, blue pushed down, of equal luminance (0.25) so
# that neither sign looks stronger, and light enough that black text on them has a WCAG contrast of 6.0:1 (AA asks
# 4.5:1). Every other shade lies between white and one of them, lighter, so its contrast is higher still.
RED, BLUE = (255, 63, 63), (90, 130, 255)
TEXT = "#000"  # every token's and legend value's text colour, set on them (not inherited), the one the contrast assumes
LEGEND_STEPS = (-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0)  # the legend's swatches, in units of the scale
SUCCESS = 1.0  # a right rollout's reward (the built-in tasks' success value): a group all at it is collapsed


def shade(c: float, scale: float) -> tuple[int, int, int]:
    """A diverging colour: from white at 0 to RED at c >= scale and to BLUE at c <= -scale, linear in between."""
    x = max(-1.0, min(1.0, c / scale)) if scale > 0 else 0.0
    end = RED if x >= 0 else BLUE
    return tuple(round(255 + (e - 255) * abs(x)) for e in end)


def color(c: float, scale: float) -> str:
    """shade() as CSS."""
    return "rgb({},{},{})".format(*shade(c, scale))


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
    wrong line of a failed arith rollout outlined and labelled; each token's exact credit and signals in its tooltip;
    on an SRPO continuation, a bar before the first resampled token (the kept prefix ends there)."""
    lines, wrong, reset = credit.token_lines(row["tokens"]), first_wrong_line(row), reset_point(row)
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
            tip.append(f"{name} {v[i]:.4g}" if isinstance(v, list) else signal(row, name, v, ".4g"))
        if i == reset:
            tip.append("resampled from here (the tokens before it are the kept prefix)")
        text = html.escape(tok.replace("\n", "")) + ("&#8629;" if "\n" in tok else "")
        style = f"background:{color(row['credit'][i], scale)}"
        cls = "t rs" if i == reset else "t"
        spans.append(f'<span class="{cls}" style="{style}" title="{html.escape(" | ".join(tip))}">{text}</span>')
        values.append(row["credit"][i])
        if "\n" in tok:  # the line ends: its mean credit, then a line break
            close(lines[i])
            out.append("<br>")
    close(lines[-1] if lines else 0)
    return "".join(out)


def reset_point(row: dict) -> int | None:
    """An SRPO continuation's first resampled token (its `reset_at` signal, when inside the row), else None."""
    n = row["signals"].get("reset_at")
    return int(n) if isinstance(n, (int, float)) and 0 < n < len(row["tokens"]) else None


def is_srpo(row: dict) -> bool:
    """SRPO's (and RRPO's) rows carry the suffix start `reset_at`: they are not the k-th sampled rollout of a prompt,
    as the other methods' rows are, but a reset continuation or a chain sampled whole."""
    return "reset_at" in row["signals"]


def kind(row: dict) -> tuple[str, str]:
    """What an SRPO row is, in words: (which row, how it came about). Its rows are not the other methods' k-th
    rollout of the prompt, so the page says this where they line up. reset_at 0 cannot tell a fresh chain from a
    continuation reset before its first thought (an empty kept prefix): the words say both."""
    n = int(row["signals"]["reset_at"])
    if n > 0:
        return (
            f"reset continuation of prompt {row['prompt_id']}, row {row['row']}",
            f"Its first {n} tokens are the kept prefix of a failed rollout (no credit by design); the rest was "
            "resampled from the bar",
        )
    return (
        f"sampled whole from prompt {row['prompt_id']}, row {row['row']}",
        "A fresh chain, or a continuation reset before its first thought",
    )


def signal(row: dict, name: str, value: float, fmt: str) -> str:
    """A row-level signal as `name value`; SC-GRPO's role by its name (sc_grpo.Role: plain, weighted, diversity,
    reference), not its number."""
    if name == "role" and row["script"] == "sc_grpo.py" and value in set(Role):
        return f"role {Role(int(value)).name.lower()}"
    return f"{name} {value:{fmt}}"


def cell_head(row: dict) -> str:
    """The line above a rollout: which row it is (for SRPO, which kind of row), its reward and its row-level
    signals."""
    sig = [signal(row, k, v, ".3g") for k, v in row["signals"].items() if not isinstance(v, list) and k != "reset_at"]
    sig = "; " + ", ".join(sig) if sig else ""
    if not is_srpo(row):
        return html.escape(f"row {row['row']}, reward {row['reward']:.3g}{sig}")
    which, how = kind(row)  # reset_at: said in words
    name = "SRPO" if row["script"] == "srpo.py" else row["script"]
    return html.escape(f"{name}: {which}, reward {row['reward']:.3g}{sig}. {how}.")


def _fraction(f: float) -> str:
    """A legend column's heading: its place on the scale (-scale, -0.75×scale, ..., 0, ..., +scale)."""
    if f == 0:
        return "0"
    return ("+" if f > 0 else "-") + ("" if abs(f) == 1 else f"{abs(f):g}&times;") + "scale"


def keyed(rows: list[dict]) -> dict:
    """(step, prompt, k): the k-th recorded row of that prompt at that step, so that runs of the same seed line up by
    prompt whatever their row order or group numbering (SRPO's groups are not prompts)."""
    out, seen = {}, {}
    for r in sorted(rows, key=lambda r: (r["step"], r["prompt_id"], r["row"])):
        k = seen[(r["step"], r["prompt_id"])] = seen.get((r["step"], r["prompt_id"]), -1) + 1
        out[(r["step"], r["prompt_id"], k)] = r
    return out


def legend(runs: list[tuple[str, list[dict]]], scales: list[float]) -> str:
    """The colour scale as a table: one row per column of the page, the colour at -scale, 0, +scale and the steps
    between, each swatch holding the credit it stands for in that column (its own scale): read off the page, not
    hovered."""
    head = "".join(f"<th>{_fraction(f)}</th>" for f in LEGEND_STEPS)
    rows = []
    for (name, _), s in zip(runs, scales):
        cells = "".join(
            f'<td class="sw" style="background:{color(f * s, s)}">{"0" if f == 0 else f"{f * s:+.3g}"}</td>'
            for f in LEGEND_STEPS
        )
        note = "" if s > 0 else " <small>(no credit: every token white)</small>"
        rows.append(f"<tr><th>{html.escape(name)}{note}</th>{cells}</tr>")
    caption = (
        "Colour scale: the credit each shade stands for, per column (red: pushed up, blue: pushed down, white: none; "
        "beyond &plusmn;scale, the strongest shade)"
    )
    return f'<table class="legend"><caption>{caption}</caption><tr><th>column</th>{head}</tr>{"".join(rows)}</table>'


def table_row(key: tuple, index: list[dict], scales: list[float]) -> str:
    """One rollout position (step, prompt, k) across the columns: the k-th recorded row of that prompt in each."""
    cells = []
    for ix, scale in zip(index, scales):
        row = ix.get(key)
        if row is None:
            cells.append("<td></td>")
            continue
        cells.append(f'<td><div class="m">{cell_head(row)}</div>{row_html(row, scale)}</td>')
    prompt = next(ix[key]["prompt"] for ix in index if key in ix)
    label = f"step {key[0]}, prompt {key[1]}, rollout {key[2] + 1}<pre>{html.escape(prompt)}</pre>"
    return f"<tr><td class='k'>{label}</td>{''.join(cells)}</tr>"


def page(runs: list[tuple[str, list[dict]]], max_rows: int | None = None) -> str:
    """The self-contained page (no JavaScript, no network): the legend, then one column per run, a row per rollout
    position; a group (step, prompt) whose every rollout in every column is right is collapsed in a <details>."""
    index = [keyed(rows) for _, rows in runs]
    keys = sorted({k for ix in index for k in ix})[:max_rows]
    scales = [robust_scale(rows) for _, rows in runs]
    srpo_note = (
        "<br><small>SRPO's rows are its own: a reset continuation or a chain sampled whole, not the other columns' "
        "k-th rollout; each cell says which it shows</small>"
    )
    head = "".join(
        f"<th>{html.escape(name)}<br><small>colour scale {s:.3g} (95th percentile of |credit|); max "
        f"{max((abs(c) for r in rows for c in r['credit']), default=0.0):.3g}</small>"
        f"{srpo_note if any(map(is_srpo, rows)) else ''}</th>"
        for (name, rows), s in zip(runs, scales)
    )
    cols = f'<colgroup><col class="kc">{"<col>" * len(runs)}</colgroup>'
    body = []
    for (step, prompt_id), group in itertools.groupby(keys, key=lambda k: k[:2]):
        group = list(group)
        trs = "".join(table_row(key, index, scales) for key in group)
        shown = [ix[k] for k in group for ix in index if k in ix]
        if all(r["reward"] >= SUCCESS for r in shown):  # nothing failed: nothing to compare, folded away
            n = f"{len(shown)} rollout{'s' * (len(shown) != 1)}"
            summary = (
                f"step {step}, prompt {prompt_id}: {n} collapsed, every one right (reward {SUCCESS:g}) in every "
                "column; open to show them"
            )
            body.append(
                f'<tr class="ok"><td colspan="{len(runs) + 1}"><details><summary>{summary}</summary>'
                f"<table>{cols}{trs}</table></details></td></tr>"
            )
        else:
            body.append(trs)
    srpo = any(is_srpo(r) for _, rows in runs for r in rows)
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>token credit</title><style>
body{{font-family:sans-serif;font-size:13px;color:#000;background:#fff}}
table{{border-collapse:collapse;table-layout:fixed;width:100%}} col.kc{{width:16em}}
td,th{{border:1px solid #ccc;vertical-align:top;padding:4px;overflow-wrap:anywhere}} th small{{font-weight:normal}}
.t{{font-family:monospace;white-space:pre-wrap;color:{TEXT}}} .rs{{border-left:2px solid #000}} .m{{color:#555}}
.w{{outline:2px solid #000;outline-offset:1px}} .v{{font-size:10px;color:#444;margin-left:6px}}
.wv{{color:#000;font-weight:bold}} .k pre{{margin:2px 0;white-space:pre-wrap}}
tr.ok>td{{padding:0}} tr.ok table{{border-style:hidden}} summary{{padding:4px;cursor:pointer;color:#333}}
.legend{{width:auto;table-layout:auto;margin:6px 0 12px}} .legend caption{{text-align:left;padding:2px 0}}
.legend td.sw{{font-family:monospace;text-align:center;min-width:5em;color:{TEXT}}}</style></head><body>
<p>Each token shaded by its effective credit: the gradient its log-prob gets in the loss, in advantage units
(red: pushed up, blue: pushed down, white: none). Each column has its own colour scale, the 95th percentile of its
nonzero |credit| (tokens beyond it get the strongest shade, so one outlier cannot wash out the rest); the legend below
gives each column's numbers. The number after each line is the line's mean credit; on a failed arith rollout the first
wrong line is outlined. Rows line up by step and prompt (the k-th rollout of the prompt in each run). A group whose
every rollout is right (reward {SUCCESS:g}) in every column is collapsed: open its line to see it. Hover a token for
its exact value and the method's signals.{
        " SRPO's rows are not sampled as the other methods' are: a reset continuation keeps a failed rollout's first "
        "tokens (no credit) and resamples the rest from the bar; each SRPO cell says which kind of row it shows."
        if srpo
        else ""
    }</p>
{legend(runs, scales)}
<table>{cols}<tr><th>rollout</th>{head}</tr>{"".join(body)}</table></body></html>"""


def png(runs: list[tuple[str, list[dict]]], path: str, width: int = 60) -> None:
    """One row per run (pick_rows: one every run shares, a failed one where there is one), tokens wrapped at `width`
    chars, under a colour bar: each row on its own scale, from -(its largest |credit|) to +(it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, Normalize

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
    steps = ListedColormap([_rgb(c, 1.0) for c in (i / 127.5 - 1 for i in range(256))])
    bar = fig.colorbar(
        ScalarMappable(Normalize(-1, 1), steps), ax=ax, orientation="horizontal", fraction=0.05, pad=0.02
    )
    bar.set_ticks([-1, 0, 1], labels=["-|credit| max: pushed down", "0", "+|credit| max: pushed up"], fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def pick_rows(runs: list[tuple[str, list[dict]]]) -> list[dict]:
    """The rollout to draw for each run: of the (step, prompt, row) every run recorded with credit, the one where the
    runs' credit differs most, among the failed ones where there are some (a failure is where credit has a line to
    find); else each run's first row with credit, a failed one first (SRPO: a reset row)."""
    key = lambda r: (r["step"], r["prompt_id"], r["row"])  # noqa: E731
    failed = lambda r: r["reward"] < SUCCESS  # noqa: E731  (NaN: unscored, not a failure)
    index = [{key(r): r for r in rows} for _, rows in runs]
    shared = [k for k in index[0] if all(k in ix and any(ix[k]["credit"]) for ix in index)]
    shared = [k for k in shared if all(failed(ix[k]) for ix in index)] or shared
    runs = [(name, sorted(rows, key=lambda r: not failed(r))) for name, rows in runs]  # stable: failed ones first

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
    r, g, b = (v / 255 for v in shade(c, scale))
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
    if a.max_rows is not None and a.max_rows < 1:
        usage_error(f"--max-rows {a.max_rows}: must be >= 1 (leave it out for every rollout)")
    for flag, out in (("-o", a.out), ("--png", a.png)):
        if out is not None:
            check_output(out, flag, a.runs)
    try:
        runs = read_runs(a.runs)
    except BadInput as e:
        usage_error(str(e))

    def chosen(r: dict) -> bool:
        return (a.step is None or r["step"] == a.step) and (a.prompt is None or r["prompt_id"] == a.prompt)

    for arg, (_, rows) in zip(a.runs, runs):
        if not any(map(chosen, rows)):  # an empty column (and nothing for --png to draw): say what the file holds
            picked = " ".join(f"--{k} {v}" for k, v in (("step", a.step), ("prompt", a.prompt)) if v is not None)
            steps = ", ".join(map(str, sorted({r["step"] for r in rows})))
            usage_error(f"{arg}: no rollout for {picked} (its recorded steps: {steps})")
    runs = [(name, [r for r in rows if chosen(r)]) for name, rows in runs]
    write(a.out, "-o", lambda path: Path(path).write_text(page(runs, a.max_rows)))
    print(f"page: {a.out}")
    if a.png:
        write(a.png, "--png", lambda path: png(runs, path))
        print(f"picture: {a.png}")


PAGES = {"-o": (".html", ".htm"), "--png": (".png",)}  # what each output is


def check_output(path: str, flag: str, inputs: list[str]) -> None:
    """Before any work, an output a person named: a name of its kind (a picture's format is its suffix, which
    matplotlib would refuse only at the end), never one of this command's input files, and never, through a link, an
    existing file of another kind (a run's metrics.jsonl or config.json, a data file): one line naming the flag."""
    kinds, target = PAGES[flag], Path(path).resolve()
    if Path(path).suffix.lower() not in kinds:
        usage_error(f"{flag} {path}: the {'page' if flag == '-o' else 'picture'} is written to a {' or '.join(kinds)} "
                    "file (this name could be one of a run's own files)")  # fmt: skip
    if target.exists() and target.suffix.lower() not in kinds:
        usage_error(f"{flag} {path}: a link to {target}, which it would write over (give a new {kinds[0]} file)")
    for arg in inputs:
        with contextlib.suppress(BadInput):  # an input that cannot be read is said by read_runs, once
            if credit_file(arg).resolve() == target:
                usage_error(f"{flag} {path}: it is this command's input ({arg}): the page would write over it")


def write(path: str, flag: str, save) -> None:
    """`save(path)`, an output a person named: a path that cannot be written (no such folder, no permission, a
    directory) ends in one line naming the flag, not a traceback after the work is done."""
    try:
        save(path)
    except OSError as e:
        usage_error(f"{flag} {path}: cannot write it ({e.strerror or e})")


if __name__ == "__main__":
    main()

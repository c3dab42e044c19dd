r"""Keep the docs' links to code lines honest: every link of the form [`FRAGMENT`](../FILE.py#La-Lb) in docs/*.md
and README.md points at the lines that hold FRAGMENT. FRAGMENT is either a name defined at the top level of FILE (a
function, class or constant: the link spans its whole definition) or a piece of code found on exactly one line of FILE
(the link points at that line). A link on the line just before a ```python block is that block's source: each line
the block quotes must be among the linked lines (a code FRAGMENT's link then spans the block's length). Line numbers
go stale when code moves: this rewrites them; a quote that no longer matches the code is reported, never rewritten.

    python tools/doc_links.py            # rewrite every stale link in place
    python tools/doc_links.py --check    # list the stale or broken links, exit 1 if any (tests/test_docs.py runs it)
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[`([^`]+)`\]\(((?:\.{1,2}/)*(?:[\w.-]+/)*[\w.-]+\.py)#L(\d+)(?:-L(\d+))?\)")


def pages() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def locate(path: Path, fragment: str, quote: list[str] | None = None) -> tuple[int, int]:
    """(first, last) 1-based lines of `fragment` in `path`: a top-level definition's whole span, or the one line that
    holds the code fragment (with a `quote` of n lines: that line and the n - 1 after it). ValueError when it is
    absent or found on several lines, or when a quoted line is not among the linked ones."""
    first, last = _span(path, fragment)
    if quote:
        last = max(last, first + len(quote) - 1) if not re.fullmatch(r"\w+", fragment) else last
        held = [line.strip() for line in path.read_text().splitlines()[first - 1 : last]]
        stale = [q.strip() for q in quote if q.strip() and q.strip() not in held]
        if stale:
            raise ValueError(f"`{fragment}`: the quoted line {stale[0]!r} is not in {path.name}{anchor(first, last)}")
    return first, last


def _span(path: Path, fragment: str) -> tuple[int, int]:
    src = path.read_text()
    if re.fullmatch(r"\w+", fragment):
        for node in ast.parse(src).body:
            names = [node.name] if hasattr(node, "name") else []
            names += [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            names += [node.target.id] if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) else []
            if fragment in names:
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                return first, node.end_lineno
    hits = [i for i, line in enumerate(src.splitlines(), 1) if fragment in line]
    if len(hits) != 1:
        where = f"on lines {hits}" if hits else "nowhere"
        raise ValueError(f"`{fragment}` is {where} in {path.name} (a link needs exactly one line)")
    return hits[0], hits[0]


def quoted(text: str, m: re.Match) -> list[str] | None:
    """The lines of the ```python block that starts on the line after the link `m` (the line's last link), or None."""
    rest = text[m.end() :].split("\n", 1)
    if len(rest) < 2 or not rest[1].startswith("```python\n") or LINK.search(rest[0]):
        return None
    return rest[1][len("```python\n") :].split("\n```", 1)[0].splitlines()


def links(page: Path) -> list[tuple[str, Path, int, int, list[str] | None]]:
    """(fragment, file, first, last, quoted block) of every code-line link of a page, as written."""
    text, out = page.read_text(), []
    for m in LINK.finditer(text):
        target = (page.parent / m.group(2)).resolve()
        out.append((m.group(1), target, int(m.group(3)), int(m.group(4) or m.group(3)), quoted(text, m)))
    return out


def anchor(first: int, last: int) -> str:
    return f"#L{first}" if first == last else f"#L{first}-L{last}"


def check() -> tuple[list[str], int]:
    """(problems, number of links): a link whose lines no longer hold its fragment, or whose fragment is gone."""
    problems, n = [], 0
    for page in pages():
        for fragment, target, first, last, quote in links(page):
            n += 1
            name = page.relative_to(ROOT)
            if not target.is_file():
                problems.append(f"{name}: `{fragment}` links to a missing file {target}")
                continue
            try:
                want = locate(target, fragment, quote)
            except ValueError as e:
                problems.append(f"{name}: {e}")
                continue
            if want != (first, last):
                problems.append(f"{name}: `{fragment}` is at {anchor(*want)}, the link says {anchor(first, last)}")
    return problems, n


def rewrite() -> int:
    """Rewrite stale line numbers in place; returns how many links changed (broken ones are left and reported)."""
    changed = 0
    for page in pages():
        text = page.read_text()

        def fix(m: re.Match) -> str:
            nonlocal changed
            target = (page.parent / m.group(2)).resolve()
            try:
                first, last = locate(target, m.group(1), quoted(text, m))
            except (ValueError, FileNotFoundError) as e:
                print(f"{page.relative_to(ROOT)}: {e}", file=sys.stderr)
                return m.group(0)
            new = f"[`{m.group(1)}`]({m.group(2)}{anchor(first, last)})"
            changed += new != m.group(0)
            return new

        new_text = LINK.sub(fix, text)
        if new_text != text:
            page.write_text(new_text)
    return changed


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report stale or broken links (exit 1 if any)")
    if ap.parse_args().check:
        problems, n = check()
        print("\n".join(problems) or f"{n} links, all current")
        sys.exit(1 if problems else 0)
    print(f"{rewrite()} links updated")

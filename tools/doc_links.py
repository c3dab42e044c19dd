r"""Keep the docs' links to code lines honest: every link of the form [`FRAGMENT`](../FILE.py#La-Lb) in docs/*.md
and README.md points at the lines that hold FRAGMENT. FRAGMENT is either a name defined at the top level of FILE (a
function, class or constant: the link spans its whole definition) or a piece of code found on exactly one line of FILE
(the link points at that line). A link on the line just before a ```python block is that block's source: each line
the block quotes must be among the linked lines (a code FRAGMENT's link then spans the block's length). Line numbers
go stale when code moves: this rewrites them; a quote that no longer matches the code is reported, never rewritten.

    python tools/doc_links.py            # rewrite every stale link in place
    python tools/doc_links.py --check    # list the stale or broken links, exit 1 if any (tests/test_docs.py runs it)
    python tools/doc_links.py --check docs/srpo.md    # only the pages named

A page or a linked file that cannot be read as UTF-8 text, or a linked Python file with a syntax error, stops either
mode with one line naming the file and the cause (exit 2): its links cannot be checked until it is fixed.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[`([^`]+)`\]\(((?:\.{1,2}/)*(?:[\w.-]+/)*[\w.-]+\.py)#L(\d+)(?:-L(\d+))?\)")


class Unreadable(Exception):
    """A page or a linked file that cannot be read as text (no permission, bytes that are not UTF-8) or, for a linked
    name, parsed as Python: one line naming the file and the cause, which the command line prints as `error: ...`
    (exit 2) in place of a traceback."""


def pages() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def show(path: Path) -> str:
    """`path` as a message names it: relative to the repository when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def read(path: Path) -> str:
    """The text of a page or a linked file (UTF-8); Unreadable when it cannot be read or is not UTF-8 text."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Unreadable(f"{show(path)}: cannot read it ({e.strerror or e})") from None
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise Unreadable(f"{show(path)}: not UTF-8 text (byte {data[e.start]:#04x} on line {line})") from None


def locate(path: Path, fragment: str, quote: list[str] | None = None) -> tuple[int, int]:
    """(first, last) 1-based lines of `fragment` in `path`: a top-level definition's whole span, or the one line that
    holds the code fragment (with a `quote` of n lines: that line and the n - 1 after it). ValueError when it is
    absent or found on several lines, or when a quoted line is not among the linked ones."""
    first, last = _span(path, fragment)
    if quote:
        last = max(last, first + len(quote) - 1) if not re.fullmatch(r"\w+", fragment) else last
        held = [line.strip() for line in read(path).splitlines()[first - 1 : last]]
        stale = [q.strip() for q in quote if q.strip() and q.strip() not in held]
        if stale:
            raise ValueError(f"`{fragment}`: the quoted line {stale[0]!r} is not in {path.name}{anchor(first, last)}")
    return first, last


def _span(path: Path, fragment: str) -> tuple[int, int]:
    src = read(path)
    if re.fullmatch(r"\w+", fragment):
        try:
            tree = ast.parse(src, filename=show(path))
        except (SyntaxError, ValueError) as e:  # ValueError: a null byte (Python < 3.12)
            where = f"line {e.lineno}: {e.msg}" if isinstance(e, SyntaxError) else str(e)
            raise Unreadable(f"{show(path)}: not valid Python ({where}), so `{fragment}` cannot be found") from None
        for node in tree.body:
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
    text, out = read(page), []
    for m in LINK.finditer(text):
        target = (page.parent / m.group(2)).resolve()
        out.append((m.group(1), target, int(m.group(3)), int(m.group(4) or m.group(3)), quoted(text, m)))
    return out


def anchor(first: int, last: int) -> str:
    return f"#L{first}" if first == last else f"#L{first}-L{last}"


def check(only: list[Path] | None = None) -> tuple[list[str], int]:
    """(problems, number of links) of the pages (`only` these, else every page): a link whose lines no longer hold
    its fragment, or whose fragment is gone. Unreadable for a page or a linked file that cannot be read or parsed."""
    problems, n = [], 0
    for page in only or pages():
        for fragment, target, first, last, quote in links(page):
            n += 1
            name = show(page)
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


def rewrite(only: list[Path] | None = None) -> int:
    """Rewrite stale line numbers in place (in `only` these pages, else every page); returns how many links changed
    (broken ones are left and reported). Unreadable for a file that cannot be read or parsed, or a page written."""
    changed = 0
    for page in only or pages():
        text = read(page)

        def fix(m: re.Match) -> str:
            nonlocal changed
            target = (page.parent / m.group(2)).resolve()
            try:
                if not target.is_file():
                    raise ValueError(f"`{m.group(1)}` links to a missing file {target}")
                first, last = locate(target, m.group(1), quoted(text, m))
            except ValueError as e:
                print(f"{show(page)}: {e}", file=sys.stderr)
                return m.group(0)
            new = f"[`{m.group(1)}`]({m.group(2)}{anchor(first, last)})"
            changed += new != m.group(0)
            return new

        new_text = LINK.sub(fix, text)
        if new_text != text:
            try:
                page.write_text(new_text)
            except OSError as e:
                raise Unreadable(f"{show(page)}: cannot write it ({e.strerror or e})") from None
    return changed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report stale or broken links (exit 1 if any)")
    ap.add_argument("pages", nargs="*", type=Path, help="only these pages (default: docs/*.md and README.md)")
    a = ap.parse_args(argv)
    only = [p.resolve() for p in a.pages]
    try:
        if a.check:
            problems, n = check(only)
            print("\n".join(problems) or f"{n} links, all current")
            sys.exit(1 if problems else 0)
        print(f"{rewrite(only)} links updated")
    except Unreadable as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

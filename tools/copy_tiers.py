"""The README's generated blocks. The two ways to copy one method (README "Copy one method"): the minimal copy, what a
default run of the script loads (the core, plus the method's own module), and the full copy (all of rlvr_utils/); and
the Layout, whose rlvr_utils/ part is the package's own module list (rlvr_utils/__init__.py's docstring). Prints them,
or rewrites them in place between their markers with --write; tests/test_copy.py keeps the README equal to this output
and the minimal copy equal to what a default run loads.

    python tools/copy_tiers.py            # print both blocks
    python tools/copy_tiers.py --write    # rewrite them in README.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("grpo.py", "sc_grpo.py", "grpo_lambda.py", "ep_grpo.py", "srpo.py")
CORE = ["common.py", "rlvr_utils/__init__.py"]  # and the folder rlvr_utils/core/, all of it
CORE += sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "rlvr_utils" / "core").glob("*.py"))
OWN = {  # the module a method's default run loads besides the core
    "sc_grpo.py": "rlvr_utils/methods/teacher.py",
    "srpo.py": "rlvr_utils/methods/chains.py",
    "grpo_lambda.py": "rlvr_utils/methods/trace_diagnostics.py",
    "ep_grpo.py": "rlvr_utils/methods/ep_diagnostics.py",
}
BEGIN, END = "<!-- copy tiers: python tools/copy_tiers.py --write -->", "<!-- /copy tiers -->"
LAYOUT = "<!-- layout: python tools/copy_tiers.py --write -->", "<!-- /layout -->"
TOP = """grpo.py            the baseline; every other script is a diff of it (GRPO / DAPO / Dr. GRPO by flags)
sc_grpo.py         SC-GRPO          grpo_lambda.py   GRPO-λ          ep_grpo.py   EP-GRPO
srpo.py            SRPO / RRPO / oracle resets
common.py          what every script uses, in the order a step uses it, and `Run`: the plumbing around the loop
rlvr_utils/        the support package in folders by role (its __init__.py lists them, below); it imports neither
                   common.py nor a script, its imports point down the roles, and no import cycle runs through it
                   (tests/test_layout.py)"""
BOTTOM = """assets/            tiny-arith/ (the default --model), tiny-arith-long/ (the long setting)
benchmarks/        learning curves, speed, memory, verifiers, the positive control; raw results in benchmarks/results/
docs/              one page per method, and running.md, tasks.md, lora.md, conventions.md, trl.md, benchmarks.md, ...
tools/             credit_view.py (see the credit), doc_links.py, places_to_open.py, copy_tiers.py (this block)
tests/             pytest, CPU (python -m pytest -q)      .ci/run   CI: a fresh venv, then the test command
pyproject.toml     ruff (format and lint; line length 100 for the scripts and common.py, 120 elsewhere)"""


def minimal(script: str) -> list[str]:
    """What a default run of `script` loads besides itself: the core and the method's own module."""
    return CORE + ([OWN[script]] if script in OWN else [])


def lines(paths) -> int:
    return sum(len((ROOT / p).read_text().splitlines()) for p in paths)


def table() -> str:
    package = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "rlvr_utils").rglob("*.py"))
    rows = [
        "| script | the minimal copy: besides the script and `assets/tiny-arith/` | files | lines | the full copy: "
        "files | lines |",
        "|---|---|---|---|---|---|",
    ]
    full = ["common.py", *package]
    for script in SCRIPTS:
        own = f" + `{Path(OWN[script]).name}`" if script in OWN else ""
        mine = minimal(script)
        rows.append(
            f"| `{script}` ({lines([script])} lines) | the core{own} | {len(mine)} | {lines(mine)} | {len(full)} | "
            f"{lines(full)} |"
        )
    core = ", ".join(f"`{Path(p).name}`" for p in CORE[2:])
    note = (
        f"The core: `common.py`, `rlvr_utils/__init__.py` and the folder `rlvr_utils/core/` ({core}): {len(CORE)} "
        f"files, {lines(CORE)} lines. A default run (its defaults, and `--help`) loads exactly its minimal copy "
        "(`tests/test_copy.py`)."
    )
    return "\n".join([BEGIN, *rows, "", note, END])


def layout() -> str:
    """The README's Layout block: the top level, then rlvr_utils/__init__.py's module list as it stands."""
    doc = (ROOT / "rlvr_utils" / "__init__.py").read_text().split('"""')[1]
    modules = doc[doc.index("\ncore/") :].strip("\n")
    body = "\n".join("  " + line if line.strip() else "" for line in modules.splitlines())
    return "\n".join([LAYOUT[0], "```", TOP, body, BOTTOM, "```", LAYOUT[1]])


def blocks() -> list[tuple[tuple[str, str], str]]:
    return [((BEGIN, END), table()), (LAYOUT, layout())]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite both blocks in README.md between their markers")
    if not ap.parse_args(argv).write:  # an unknown flag: argparse's usage and one error line, exit 2
        print("\n\n".join(text for _, text in blocks()))
        return
    readme = (ROOT / "README.md").read_text()
    for (begin, end), text in blocks():
        if begin not in readme or end not in readme:
            sys.exit(f"error: README.md has no {begin} ... {end} block to rewrite")
        head, rest = readme.split(begin, 1)
        readme = head + text + rest.split(end, 1)[1]
    (ROOT / "README.md").write_text(readme)
    print("README.md: the copy tiers and the layout rewritten")


if __name__ == "__main__":
    main()

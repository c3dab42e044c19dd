"""The two ways to copy one method (README "Copy one method"): the minimal copy, what a default run of the script loads
(the core, plus the method's own module), and the full copy (all of rlvr_utils/). Prints the README's table, or
rewrites it in place between its markers with --write; tests/test_copy.py keeps the README equal to this output and
the minimal copy equal to what a default run loads.

    python tools/copy_tiers.py            # print the table
    python tools/copy_tiers.py --write    # rewrite README.md's table
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("grpo.py", "sc_grpo.py", "grpo_lambda.py", "ep_grpo.py", "srpo.py")
CORE = ["common.py"] + [f"rlvr_utils/{m}.py" for m in ("__init__", "cli", "runtime", "models", "tasks", "rollouts")]
CORE += ["rlvr_utils/logprob_kernels.py", "rlvr_utils/checkpoints.py"]
OWN = {  # the module a method's default run loads besides the core
    "sc_grpo.py": "rlvr_utils/teacher.py",
    "srpo.py": "rlvr_utils/chains.py",
    "grpo_lambda.py": "rlvr_utils/trace_diagnostics.py",
    "ep_grpo.py": "rlvr_utils/ep_diagnostics.py",
}
BEGIN, END = "<!-- copy tiers: python tools/copy_tiers.py --write -->", "<!-- /copy tiers -->"


def minimal(script: str) -> list[str]:
    """What a default run of `script` loads besides itself: the core and the method's own module."""
    return CORE + ([OWN[script]] if script in OWN else [])


def lines(paths) -> int:
    return sum(len((ROOT / p).read_text().splitlines()) for p in paths)


def table() -> str:
    package = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "rlvr_utils").glob("*.py"))
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
    core = ", ".join(f"`{Path(p).name}`" for p in CORE[1:])
    note = (
        f"The core: `common.py` and `rlvr_utils/` {core} ({len(CORE)} files, {lines(CORE)} lines). A default run (its "
        "defaults, and `--help`) loads exactly its minimal copy (`tests/test_copy.py`)."
    )
    return "\n".join([BEGIN, *rows, "", note, END])


def main() -> None:
    out = table()
    if "--write" not in sys.argv[1:]:
        print(out)
        return
    readme = (ROOT / "README.md").read_text()
    if BEGIN not in readme or END not in readme:
        sys.exit(f"error: README.md has no {BEGIN} ... {END} block to rewrite")
    head, rest = readme.split(BEGIN, 1)
    (ROOT / "README.md").write_text(head + out + rest.split(END, 1)[1])
    print("README.md: the copy tiers rewritten")


if __name__ == "__main__":
    main()

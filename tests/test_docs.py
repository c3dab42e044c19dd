"""The docs stay honest about the code: every line a method page quotes in a ```python block is in the script or the
module that holds it, every relative link points at a file that exists, and no page or comment cites a document that
is not in the repository."""

import re
import sys

import pytest
from conftest import ROOT

PAGES = ["sc_grpo.md", "grpo_lambda.md", "ep_grpo.md", "srpo.md", "grpo_variants.md"]
CODE = [ROOT / "common.py", *ROOT.glob("*.py"), *(ROOT / "rlvr_utils").rglob("*.py")]


def _normalized(line: str) -> str:
    return re.sub(r"\s+", " ", line.split("  # ")[0]).strip()


@pytest.mark.parametrize("page", PAGES)
def test_quoted_code_is_in_the_code(page):
    text = (ROOT / "docs" / page).read_text()
    code = {_normalized(line) for path in CODE for line in path.read_text().splitlines()}
    joined = " ".join(sorted(code))
    missing = []
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            n = _normalized(line)
            if n and not n.startswith(("#", "...")) and n not in code and n not in joined:
                missing.append(line.strip())
    assert not missing, f"docs/{page} quotes lines that are not in the code: {missing}"


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")) + ["../README.md"])
def test_relative_links_point_at_files_that_exist(page):
    path = (ROOT / "docs" / page).resolve()
    links = re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", path.read_text())
    broken = [link for link in links if not (path.parent / link).exists()]
    assert not broken, f"{path.name}: {broken}"


def test_nothing_cites_a_document_outside_the_repository():
    files = [
        *CODE,
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
    ]
    cited = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in files
        if p.name != "test_docs.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bspec ?§|\bthe spec\b", line)
    ]
    assert not cited, cited


# --- places to open (issue #49): each method page lists, within its bound, what a reader opens to follow the credit
sys.path.insert(0, str(ROOT / "tools"))
import places_to_open  # noqa: E402

# (definitions, files); SC-GRPO's 22: SCConfig and Teachers, records read once by name (they replaced four
# positional settings and a 4-tuple)
BOUNDS = {"sc_grpo": (22, 4), "srpo": (30, 4), "grpo_lambda": (10, 4), "ep_grpo": (10, 4)}


@pytest.mark.parametrize("script", sorted(BOUNDS))
def test_each_method_page_lists_its_places_to_open_within_bounds(script):
    mods = places_to_open.load_modules()
    found = places_to_open.places(script, mods)
    most, files = BOUNDS[script]
    assert len(found) <= most and len({k for k, _ in found}) <= files, found
    page = (ROOT / places_to_open.PAGES[script]).read_text()
    assert places_to_open.block(script, mods) in page, "stale: python tools/places_to_open.py --write"


def test_the_places_rule_follows_calls_and_skips_logs_and_plumbing(tmp_path, monkeypatch):
    """On a hand-made script: a method line's call is followed into its callee's callees; a LOGS line, the plumbing
    module and a name bound on a LOGS line are not; a name bound in the block stands for what its value names; a task
    helper is counted (a reader opens it) but not followed; what grpo.py's list holds is not counted again."""
    (tmp_path / "rlvr_utils" / "core").mkdir(parents=True)
    (tmp_path / "rlvr_utils" / "core" / "runtime.py").write_text("def plumbing():\n    pass\n")
    (tmp_path / "rlvr_utils" / "core" / "tasks.py").write_text(
        "def prompt():\n    return inside()\n\n\ndef inside():\n    pass\n"
    )
    (tmp_path / "common.py").write_text("def group_advantages():\n    return helper()\n\n\ndef helper():\n    pass\n")
    (tmp_path / "sc_grpo.py").write_text(
        "import common\nfrom rlvr_utils.core import runtime, tasks\n\n\n"
        "def credit():\n    runtime.plumbing()\n    tasks.prompt()\n    return inner()\n\n\n"
        "def inner():\n    pass\n\n\ndef diagnostic():\n    pass\n\n\ndef unused():\n    pass\n\n\n"
        'if __name__ == "__main__":\n    f = credit  # ALGO LOGIC\n    log = diagnostic  # LOGS\n'
        "    # 3. ALGO LOGIC: credit\n    a = common.group_advantages()\n    b = f()\n    log()\n"
    )
    monkeypatch.setattr(places_to_open, "ROOT", tmp_path)
    found = places_to_open.places("sc_grpo", places_to_open.load_modules())
    want = [("sc_grpo", "credit"), ("sc_grpo", "inner"), ("common", "group_advantages"), ("common", "helper")]
    assert found == want + [("tasks", "prompt")]
    (tmp_path / "grpo.py").write_text(
        'import common\n\nif __name__ == "__main__":\n    # 3. ALGO LOGIC: credit\n    a = common.group_advantages()\n'
    )
    found = places_to_open.places("sc_grpo", places_to_open.load_modules())
    assert found == [("sc_grpo", "credit"), ("sc_grpo", "inner"), ("tasks", "prompt")]  # GRPO's: counted in grpo.py's


class _Parsed(Exception):
    """Raised in place of common.Run: the script's flags are parsed and checked, nothing is loaded."""


def _page_commands(page: str, needle: str) -> list[list[str]]:
    """The `python <script>.py ...` lines of a page's ```bash blocks that hold `needle` (continuations joined)."""
    import shlex

    out = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / page).read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("python ") and needle in line:
                out.append(shlex.split(line.split("  # ")[0], comments=True)[1:])
    return out


@pytest.mark.parametrize("page", ["sc_grpo.md", "grpo_lambda.md", "ep_grpo.md", "srpo.md"])
def test_each_page_gives_a_lora_command_that_its_script_accepts(page, monkeypatch):
    """Each method page gives the paper's or the official code's LoRA setting as a command, and the script accepts
    it: parsed and checked as a run would be (the hub model and dataset swapped for the bundled ones, offline)."""
    import runpy

    import common

    commands = _page_commands(page, "--lora-rank")
    assert commands, f"docs/{page}: no command with --lora-rank"
    for argv in commands:
        for flag, local in (("--model", common.DEFAULT_MODEL), ("--task", "arith")):
            argv[argv.index(flag) + 1] = local
        seen = {}

        def stop(args):
            seen["args"] = args
            raise _Parsed

        monkeypatch.setattr(common, "Run", stop)
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(_Parsed):
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
        assert seen["args"].lora_rank == int(argv[argv.index("--lora-rank") + 1]), argv

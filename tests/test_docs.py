"""The docs stay honest about the code: every line a method page quotes in a ```python block is in the script or the
module that holds it, every relative link points at a file that exists, and no page or comment cites a document that
is not in the repository."""

import re

import pytest
from conftest import ROOT

PAGES = ["sc_grpo.md", "grpo_lambda.md", "ep_grpo.md", "srpo.md", "grpo_variants.md"]
CODE = [ROOT / "common.py", *ROOT.glob("*.py"), *(ROOT / "rlvr_utils").glob("*.py")]


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

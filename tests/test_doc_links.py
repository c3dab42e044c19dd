"""The method pages link each equation to the lines that compute it (tools/doc_links.py): every link still points at
the lines that hold what it names, every quoted block is still the code, and each page links its own script."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import doc_links  # noqa: E402


def test_every_link_to_code_lines_is_current():
    problems, n = doc_links.check()
    assert not problems, (
        "stale links (run python tools/doc_links.py; a changed quote needs the page edited):\n" + "\n".join(problems)
    )
    assert n >= 8


@pytest.mark.parametrize("method", ["sc_grpo", "grpo_lambda", "ep_grpo", "srpo"])
def test_each_method_page_links_its_equations_to_its_script(method):
    own = [f for f, target, *_ in doc_links.links(ROOT / "docs" / f"{method}.md") if target.name == f"{method}.py"]
    assert len(own) >= 4, own


def test_the_checker_finds_moved_lines_and_changed_quotes(tmp_path):
    code = tmp_path / "algo.py"
    code.write_text("import torch\n\n\ndef f(x):\n    y = x + 1\n    return y * 2\n")
    assert doc_links.locate(code, "f") == (4, 6)  # a name: its whole definition
    assert doc_links.locate(code, "y = x + 1") == (5, 5)  # code: its one line
    assert doc_links.locate(code, "y = x + 1", ["y = x + 1", "return y * 2"]) == (5, 6)  # a quote spans the block
    with pytest.raises(ValueError, match="quoted line"):
        doc_links.locate(code, "f", ["return y * 3"])  # the code changed under the quote
    with pytest.raises(ValueError, match="nowhere"):
        doc_links.locate(code, "z = 0")
    page = tmp_path / "page.md"
    page.write_text("see [`f`](algo.py#L3-L6) and\n[`y = x + 1`](algo.py#L5):\n```python\ny = x + 1\n```\n")
    (fragment, target, first, last, quote), (_, _, _, _, block) = doc_links.links(page)
    assert (fragment, target, first, last, quote) == ("f", code, 3, 6, None) and block == ["y = x + 1"]
    assert doc_links.locate(target, fragment) != (first, last)  # the stale link is seen as stale

"""The method pages link each equation to the lines that compute it (tools/doc_links.py): every link still points at
the lines that hold what it names, every quoted block is still the code, and each page links its own script; a file
the tool cannot read or parse stops it with one line naming the file and the cause."""

import subprocess
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


def _cli(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "doc_links.py"), *map(str, args)], cwd=cwd, capture_output=True, text=True
    )


BROKEN = {  # a linked file's bytes -> the cause the one line gives
    "syntax error": (
        b"def f(x):\n    return x +\n",
        "not valid Python (line 2: invalid syntax), so `f` cannot be found",
    ),
    "not UTF-8": (b"def f(x):\n    return '\xe9'\n", "not UTF-8 text (byte 0xe9 on line 2)"),
}


@pytest.mark.parametrize("case", list(BROKEN))
@pytest.mark.parametrize("mode", [[], ["--check"]], ids=["rewrite", "check"])
def test_a_linked_file_that_cannot_be_read_is_one_line_and_exit_2(tmp_path, case, mode):
    """A linked Python file with a syntax error or bytes that are not UTF-8 stops both modes with one line naming the
    file and the cause (exit 2), not a traceback; the page is left as it was."""
    data, cause = BROKEN[case]
    (tmp_path / "algo.py").write_bytes(data)
    page = tmp_path / "page.md"
    page.write_text("see [`f`](algo.py#L1-L2)\n")
    out = _cli(*mode, page)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr == f"error: {tmp_path / 'algo.py'}: {cause}\n"
    assert page.read_text() == "see [`f`](algo.py#L1-L2)\n"


def test_an_unreadable_file_or_page_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """No permission to read a linked file (monkeypatched: root reads any file), a page that is not UTF-8, a page that
    is not there: one line naming it and the cause, exit 2."""
    code = tmp_path / "algo.py"
    code.write_text("def f(x):\n    return x\n")
    page = tmp_path / "page.md"
    page.write_text("see [`f`](algo.py#L1-L2)\n")
    real = Path.read_bytes

    def no_permission(self):
        if self == code:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", no_permission)
    for argv, says in [
        (["--check", str(page)], f"error: {code}: cannot read it (Permission denied)"),
        ([str(page)], f"error: {code}: cannot read it (Permission denied)"),
        (["--check", str(tmp_path / "gone.md")], f"error: {tmp_path / 'gone.md'}: cannot read it (No such file"),
    ]:
        with pytest.raises(SystemExit) as e:
            doc_links.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(says), err
    page.write_bytes(b"see \xff [`f`](algo.py#L1-L2)\n")
    with pytest.raises(SystemExit) as e:
        doc_links.main(["--check", str(page)])
    assert e.value.code == 2 and capsys.readouterr().err == f"error: {page}: not UTF-8 text (byte 0xff on line 1)\n"

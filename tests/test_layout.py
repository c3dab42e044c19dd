"""The package's layout (docs/design.md): layers point one way (scripts -> common.py -> rlvr_utils; the package imports
neither common.py nor a script), each module lives in the folder of its role that rlvr_utils.WHERE names, imports point
down the roles (core/ -> core/; methods/ -> core/; extras/ -> core/, extras/), extras are loaded by name and no import
cycle runs through the package, rlvr_utils/__init__.py lists every module under its folder, the one-line usage error
has one definition (rlvr_utils/core/runtime.py), and no line of Python is over 120 characters (ruff's E501 lets a line
that ends in a pragma comment run over; this does not)."""

import ast
import re
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "rlvr_utils"
FILES = {p.stem: p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"}  # module names are unique
MODULES = sorted(FILES)
FOLDER = {m: p.parent.relative_to(PACKAGE).as_posix() for m, p in FILES.items()}  # core, methods, extras/data, ...
ROLE = {m: FOLDER[m].split("/")[0] for m in MODULES}  # core, methods or extras
ALLOWED = {"core": {"core"}, "methods": {"core"}, "extras": {"core", "extras"}}  # the roles a role's modules import
SCRIPTS = {p.stem for p in ROOT.glob("*.py")}  # common.py and the five algorithm scripts
NOT_SOURCE = {"assets", "runs", "wandb", "__pycache__"}  # and every hidden directory (.git, .venv, caches)


def _is_function(node) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))


def _nodes(tree: ast.AST, module_level: bool):
    """Every node of `tree`; `module_level`: only those that run on import (not inside a function, not under
    `if TYPE_CHECKING:`)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if module_level and (_is_function(child) or _type_checking(child)):
                continue
            todo.append(child)


def _type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported(path: Path, module_level: bool) -> set[str]:
    """The project modules a file imports: `rlvr_utils.<module>` for a module of the package (imported from its
    folder, `from rlvr_utils.core import cli`, or by its dotted name), else a top-level name (common, a script)."""
    names = set()
    for node in _nodes(ast.parse(path.read_text()), module_level):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}:{node.lineno}: a relative import (the package imports by full name)"
            names.add(node.module)
            if node.module.split(".")[0] == "rlvr_utils":  # from rlvr_utils.<folder> import <module>
                names |= {f"{node.module}.{a.name}" for a in node.names if a.name in FILES}
    out = set()
    for n in names:
        parts = n.split(".")
        if parts[0] != "rlvr_utils":
            out.add(parts[0])
        elif parts[-1] in FILES:  # rlvr_utils.extras.data.sandbox; a folder alone (rlvr_utils.core) is no module
            out.add(f"rlvr_utils.{parts[-1]}")
    return out


def import_graph(module_level: bool = True) -> dict[str, set[str]]:
    return {m: {n.split(".", 1)[1] for n in imported(FILES[m], module_level) if "." in n} - {m} for m in MODULES}


def loads(path: Path) -> set[str]:
    """The modules a file loads by name: the literal module of every `extra("m", flag, ("m2", flag2), ...)` call
    (runtime.extra, the import where a flag is handled)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "extra":
            first, *more = node.args
            pairs = [first, *(m.elts[0] for m in more if isinstance(m, ast.Tuple))]
            out |= {a.value for a in pairs if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between folders: folder a -> folder b if a module of a imports one of b."""
    out = {}
    for m, ns in graph.items():
        out.setdefault(FOLDER[m], set()).update(FOLDER[n] for n in ns if FOLDER[n] != FOLDER[m])
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a -> b -> ... -> a) of `graph`, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("module_level", [True, False], ids=["at the top", "in functions too"])
def test_the_package_has_no_import_cycle(module_level):
    """Imports between rlvr_utils modules form no cycle, at the top nor counting those inside functions (the reader
    of metrics.jsonl lives beside its writer, runtime.Logger; torchrun's Dist is loaded by name)."""
    graph = import_graph(module_level)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert find_cycle(folder_graph(graph)) is None, " -> ".join(find_cycle(folder_graph(graph)))


def test_every_module_lives_where_the_map_says():
    """rlvr_utils.WHERE (from FOLDERS) is each module's folder; module names are unique across the folders
    (runtime.extra, REQUIRES and the docs name a module by its name), no folder is named like a module, and the root's
    __init__.py is the package's only one (the folders are namespace folders: a copy carries module files alone)."""
    import rlvr_utils

    assert rlvr_utils.WHERE == FOLDER
    assert len([p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]) == len(FILES), "a module name twice"
    folders = {part for f in FOLDER.values() for part in f.split("/")}
    assert sorted(folders & set(MODULES)) == [], "a folder named like a module"
    assert sorted(PACKAGE.rglob("__init__.py")) == [PACKAGE / "__init__.py"]


def test_imports_point_down_the_roles():
    """At any level, in functions too: core/ imports only core/, methods/ the core, extras/ the core and extras. None
    imports methods/: a script loads its own module, and the ablations come by name (runtime.ablated)."""
    bad = [
        f"{FOLDER[m]}/{m} -> {FOLDER[n]}/{n}"
        for m, ns in import_graph(module_level=False).items()
        for n in sorted(ns)
        if ROLE[n] not in ALLOWED[ROLE[m]]
    ]
    assert bad == []


def test_extras_are_loaded_by_name_and_never_in_a_circle():
    """Every module loaded by name (runtime.extra) is the package's and outside the core; each method script's
    ablations (cli.parse's third argument) are a methods/ module; and the imports plus the loads from outside the core
    have no cycle (the core reaches the extras by name where a flag is handled, by design; an extra does not load
    back what imports it: sharded uses saving one way)."""
    users = [*FILES.values(), PACKAGE / "__init__.py", *ROOT.glob("*.py")]
    loaded = {n for path in users for n in loads(path)}
    assert loaded and sorted(loaded - set(MODULES)) == [] and sorted(loaded & CORE) == []
    ablations = set()
    for script in ROOT.glob("*.py"):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "cli.parse" and len(node.args) > 2:
                ablations.add(node.args[2].value)
    assert len(ablations) == 4 and {FOLDER[m] for m in ablations} == {"methods"}, ablations
    graph = import_graph(module_level=False)
    for m in sorted(set(MODULES) - CORE):
        graph[m] = graph[m] | (loads(FILES[m]) - {m})
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_package_imports_neither_common_nor_a_script():
    """At any level, in a function too: the package is below common.py and the scripts."""
    bad = {
        str(path.relative_to(ROOT)): sorted(imported(path, module_level=False) & SCRIPTS)
        for path in [*FILES.values(), PACKAGE / "__init__.py"]
    }
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_init_lists_every_module_with_one_line_each():
    """rlvr_utils/__init__.py's docstring: `  <module>  <what it holds>` for every module, under the heading of its
    folder (`core/, ...:`), and no module that is not there."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    listed = re.findall(r"^  ([a-z_]+)  ", doc, re.M)
    assert sorted(set(MODULES) - set(listed)) == [], "not in rlvr_utils/__init__.py's list"
    assert sorted(set(listed) - set(MODULES)) == [], "listed in rlvr_utils/__init__.py but not a module"
    assert len(listed) == len(set(listed)), "a module listed twice"
    heading, under = None, {}
    for line in doc.splitlines():
        if found := re.match(r"^([a-z_/]+)/, ", line):
            heading = found[1]
        elif found := re.match(r"^  ([a-z_]+)  ", line):
            under[found[1]] = heading
    assert under == FOLDER


def python_files(root: Path = ROOT) -> list[Path]:
    """The repository's Python files: not under assets/, runs/, a hidden directory or a virtual environment."""
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if any(p.startswith(".") or p in NOT_SOURCE for p in parts):
            continue
        if any((root.joinpath(*parts[: i + 1]) / "pyvenv.cfg").exists() for i in range(len(parts))):
            continue
        out.append(path)
    return out


def long_lines(paths, root: Path = ROOT) -> list[str]:
    return [
        f"{p.relative_to(root)}:{i}: {len(line)} characters"
        for p in paths
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > 120
    ]


def test_no_line_is_over_120_characters():
    assert len(python_files()) > 20
    assert long_lines(python_files()) == []


USAGE_HELPER_NAMES = {"usage_error", "_usage_error", "_usage", "usage", "_fail", "fail", "_die", "die", "_error"}


def usage_error_copies(paths, root: Path = ROOT) -> list[str]:
    """Functions outside runtime.py that are the usage error again: named like it, or printing `error: ...` and
    raising SystemExit(2) (exit code 1 is a run that failed, not a usage error: custom._stop, Checkpointer.failed)."""
    found = []
    for path in paths:
        if path == PACKAGE / "core" / "runtime.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = ast.unparse(node)
            prints_error = re.search(r"""print\(f?['"]\\?n?error: """, body) is not None
            if node.name in USAGE_HELPER_NAMES or (prints_error and re.search(r"SystemExit\(2\)|exit\(2\)", body)):
                found.append(f"{path.relative_to(root)}:{node.lineno}: def {node.name}")
    return found


def test_the_usage_error_is_defined_once():
    """What a copy carries (the scripts, common.py, the package) uses rlvr_utils.core.runtime.usage_error; no copy of
    it."""
    paths = [*ROOT.glob("*.py"), *PACKAGE.rglob("*.py")]
    assert usage_error_copies(paths) == []


def test_the_line_and_helper_checks_find_what_they_look_for(tmp_path):
    """A long line, a usage error named _fail and one under another name are found; a hidden directory, assets/,
    runs/ and a virtual environment are not read; an exit code 1 error is not a usage error."""
    (tmp_path / "a.py").write_text(
        'def _fail(message):\n    print(f"error: {message}")\n    raise SystemExit(2)\n\n\n'
        'def stop(m):\n    print(f"error: {m}", file=sys.stderr)\n    raise SystemExit(2)\n\n\n'
        'def ok(m):\n    print(f"\\nerror: {m}")\n    raise SystemExit(1)\n' + "x = 1  # " + "y" * 120 + "\n"
    )
    for hidden in (".git", ".venv", "assets", "runs"):
        (tmp_path / hidden).mkdir()
        (tmp_path / hidden / "skip.py").write_text("x" * 200 + "\n")
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / "pyvenv.cfg").write_text("")
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "venv" / "lib" / "site.py").write_text("x" * 200 + "\n")
    paths = python_files(tmp_path)
    assert [p.name for p in paths] == ["a.py"], paths
    assert [s.split(":")[:2] for s in long_lines(paths, tmp_path)] == [["a.py", "14"]]
    assert [s.split(": ")[1] for s in usage_error_copies(paths, tmp_path)] == ["def _fail", "def stop"]


CORE = {m for m, p in FILES.items() if p.parent == PACKAGE / "core"}  # what every run loads


def test_each_extra_declares_every_file_it_imports():
    """rlvr_utils.REQUIRES, what runtime.extra names when a copy lacks it, is each extra's import closure (at the top
    and in its functions, transitively) besides the core: so copying what the one line names is enough. The sandbox
    also reads sandbox_harness.py as text. The other extras it imports go through runtime.extra (one line each)."""
    import rlvr_utils

    graph = import_graph(module_level=False)
    for module in sorted(set(MODULES) - CORE):
        seen, todo = set(), [module]
        while todo:
            for n in graph.get(todo.pop(), ()):
                if n not in seen and n != module and n not in CORE:  # the core is there (torchrun: one line)
                    seen.add(n)
                    todo.append(n)
        want = sorted(seen) + (["sandbox_harness"] if module == "sandbox" else [])
        assert sorted(rlvr_utils.REQUIRES.get(module, ())) == sorted(want), module
    assert sorted(set(rlvr_utils.REQUIRES) - set(MODULES)) == []

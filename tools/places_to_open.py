"""Places to open: the definitions a reader must open to follow a method's credit from its script, and the files they
are in (each method's list is on its docs page, under "Places to open"; tests/test_layout.py keeps the counts within
their bounds and the pages' lists current).

    python tools/places_to_open.py                 # every method: its count, its files, its definitions
    python tools/places_to_open.py sc_grpo --md    # one method's list, as its docs page shows it
    python tools/places_to_open.py --write         # rewrite the lists on the docs pages

The rule, static and the same for every method:
  - start: the lines of the script's `__main__` block that are the method's: an inline `# ALGO LOGIC` comment, or the
    run of code under a full-line `# ... ALGO LOGIC ...` comment (up to the next blank line or comment line; step 3,
    the credit assignment, is such a run); lines tagged `LOGS` (diagnostics) are left out. A name bound in the
    block (`f_and_bonus = functools.partial(weights_and_advantages, ...)`) stands for what its value names.
  - follow: every project function or class those lines name, then every one their bodies name, transitively (a
    class is one place: its methods are read with it).
  - plumbing included: a task, rollout or log-prob helper (the modules OPENED) that the method's code names is counted,
    as a reader opens it, but not followed into (its own helpers are plumbing of plumbing).
  - each counted once: a definition grpo.py's list holds (GRPO's group advantage) is counted there, not again for each
    method (a reader comes to a method from grpo.py).
  - not counted: the plumbing every script runs the same way (the modules PLUMBING: flags, the run, model loading,
    checkpoints; common.py's shared loop, SHARED), and the extras that a default run does not load (ablations,
    diagnostics, credit logging, torchrun, vLLM, a model whose logits are not lm_head(h)).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("grpo", "sc_grpo", "grpo_lambda", "ep_grpo", "srpo")
PLUMBING = {"runtime", "cli", "models", "checkpoints", "watchdog", "model_checks"}
OPENED = {"tasks", "rollouts", "logprob_kernels"}  # the task, rollout and log-prob helpers: counted, not followed
EXTRAS = {"credit", "ep_diagnostics", "trace_diagnostics", "ep_ablations", "sc_ablations", "engines", "distributed"}
EXTRAS |= {"sharded", "resume", "data_tasks", "datafiles", "custom", "reward_calls", "rewards", "sandbox", "model_card"}
EXTRAS |= {"lora", "reward_logs", "srpo_ablations", "lambda_ablations", "unfused", "cuda_graphs", "reward_isolation"}
SHARED = {"token_logprobs", "aggregate_loss", "k3_kl", "engine_correction", "minibatches", "rollouts_with_rewards"}
SHARED |= {"UpdateStats", "Run", "load_task", "load_model", "load_tokenizer", "stop_token_ids", "make_rollouts"}
SHARED |= {"seed_everything", "prompt_batches", "regroup", "evaluate", "stop_if_nonfinite"}
SHARED |= {"with_lora", "reference"}  # model loading: --lora-rank's adapters, the frozen reference


class Module:
    """A project file: its top-level definitions (def, class, and X = namedtuple(...)) and its imports."""

    def __init__(self, key: str, path: Path):
        self.key, self.path = key, path
        self.tree = ast.parse(path.read_text())
        self.defs: dict[str, ast.AST] = {}
        self.aliases: dict[str, str] = {}  # a name imported as a module -> module key
        self.imported: dict[str, tuple[str, str]] = {}  # a name imported from a module -> (module key, name)
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                call = ast.unparse(node.value.func)
                if call.endswith("namedtuple") or call.endswith("IntEnum"):
                    for t in node.targets:
                        if isinstance(t, ast.Name):
                            self.defs[t.id] = node
            elif isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name] = module_key(a.name)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if is_folder(node.module):  # from rlvr_utils.<folder> import <module>
                        self.aliases[a.asname or a.name] = a.name
                    else:
                        self.imported[a.asname or a.name] = (module_key(node.module), a.name)


def is_folder(dotted: str) -> bool:
    """rlvr_utils or one of its folders (rlvr_utils.core, rlvr_utils.extras.data), not a module."""
    return dotted.split(".")[0] == "rlvr_utils" and (ROOT / dotted.replace(".", "/")).is_dir()


def module_key(name: str) -> str:
    """A module's key: its name (module names are unique across the package's folders)."""
    return name.rsplit(".", 1)[-1] if name.startswith("rlvr_utils.") else name


def load_modules() -> dict[str, Module]:
    out = {p.stem: Module(p.stem, p) for p in ROOT.glob("*.py")}
    out |= {p.stem: Module(p.stem, p) for p in (ROOT / "rlvr_utils").rglob("*.py") if p.stem != "__init__"}
    return out


def references(node: ast.AST, mod: Module, mods: dict[str, Module], local: dict | None = None) -> set[tuple]:
    """(module key, name) of every project definition `node` names, through the module's imports and `local`
    (names bound in the same block -> what their values name)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            if local and n.id in local:
                out |= local[n.id]
            elif n.id in mod.defs:
                out.add((mod.key, n.id))
            elif n.id in mod.imported:
                key, name = mod.imported[n.id]
                if key in mods and name in mods[key].defs:
                    out.add((key, name))
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in mod.aliases:
            key = mod.aliases[n.value.id]
            if key in mods and n.attr in mods[key].defs:
                out.add((key, n.attr))
    return out


def counted(ref: tuple) -> bool:
    key, name = ref
    if key in SCRIPTS and name in ("Args", "validate"):  # the command line, not the credit
        return False
    return key not in PLUMBING and key not in EXTRAS and not (key == "common" and name in SHARED)


def logs_lines(path: Path) -> set[int]:
    """Lines tagged LOGS (diagnostics: what they call is not the credit)."""
    return {
        i for i, line in enumerate(path.read_text().splitlines(), 1) if "#" in line and "LOGS" in line.split("#", 1)[1]
    }


def body_references(node: ast.AST, mod: Module, mods: dict[str, Module]) -> set[tuple]:
    """`references` of a definition's statements, but those on LOGS lines."""
    logs = logs_lines(mod.path)
    out = set()
    for stmt in ast.walk(node):
        if isinstance(stmt, ast.stmt) and not isinstance(
            stmt, (ast.FunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.With, ast.Try)
        ):
            if stmt.lineno not in logs:
                out |= references(stmt, mod, mods)
        elif isinstance(stmt, (ast.If, ast.While)):
            out |= references(stmt.test, mod, mods)
        elif isinstance(stmt, ast.For):
            out |= references(stmt.iter, mod, mods)
        elif isinstance(stmt, ast.With):
            for item in stmt.items:
                out |= references(item.context_expr, mod, mods)
        elif isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
            for d in stmt.decorator_list:
                out |= references(d, mod, mods)
            if isinstance(stmt, ast.ClassDef):
                for b in stmt.bases:
                    out |= references(b, mod, mods)
    if isinstance(node, ast.Assign):  # a namedtuple / enum line
        out |= references(node, mod, mods)
    return out


def method_lines(src: str, main: ast.If) -> list[int]:
    """Line numbers of the main block's method lines (the rule in the module docstring)."""
    lines = src.splitlines()
    out, region = [], False
    for i in range(main.lineno, main.end_lineno + 1):
        text = lines[i - 1]
        stripped = text.strip()
        if not stripped:
            region = False
            continue
        if stripped.startswith("#"):
            region = "ALGO LOGIC" in stripped
            continue
        comment = text.split("#", 1)[1] if "#" in text else ""
        if "LOGS" in comment:
            continue
        if region or "ALGO LOGIC" in comment:
            out.append(i)
    return out


def places(script: str, mods: dict[str, Module]) -> list[tuple[str, str]]:
    """The counted definitions reached from `script`'s method lines, in reading order (file, then line)."""
    mod = mods[script]
    main = next(n for n in mod.tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    local: dict[str, set] = {}
    logs = logs_lines(mod.path)
    for n in ast.walk(main):  # names bound in the block stand for what their values name (not on LOGS lines)
        if isinstance(n, ast.Assign) and n.lineno not in logs:
            refs = references(n.value, mod, mods, local)
            for t in n.targets:
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        local[name.id] = local.get(name.id, set()) | refs
    wanted = set(method_lines(mod.path.read_text(), main))
    todo = set()
    for n in ast.walk(main):
        if isinstance(n, ast.stmt) and not isinstance(n, (ast.If, ast.For, ast.With)) and n.lineno in wanted:
            todo |= references(n, mod, mods, local)
    seen: set[tuple] = set()
    while todo:
        ref = todo.pop()
        if ref in seen or not counted(ref):
            continue
        seen.add(ref)
        if ref[0] not in OPENED:  # a task, rollout or log-prob helper is opened, not followed into
            todo |= body_references(mods[ref[0]].defs[ref[1]], mods[ref[0]], mods)
    if script != "grpo" and "grpo" in mods:  # counted once: what grpo.py's list already holds
        seen -= set(places("grpo", mods))
    order = lambda r: (r[0] != script, r[0], mods[r[0]].defs[r[1]].lineno)  # noqa: E731
    return sorted(seen, key=order)


def file_of(key: str, mods: dict[str, Module]) -> str:
    return mods[key].path.relative_to(ROOT).as_posix()


def markdown(script: str, found: list[tuple[str, str]], mods: dict[str, Module]) -> str:
    """The docs page's list: one line per file, its definitions in reading order."""
    files = list(dict.fromkeys(key for key, _ in found))
    head = f"{len(found)} definitions in {len(files)} files (`python tools/places_to_open.py {script} --md`):"
    rows = [f"- `{file_of(key, mods)}`: " + ", ".join(f"`{n}`" for k, n in found if k == key) for key in files]
    return "\n".join([head, *rows])


PAGES = {"sc_grpo": "docs/sc_grpo.md", "grpo_lambda": "docs/grpo_lambda.md", "ep_grpo": "docs/ep_grpo.md"}
PAGES["srpo"] = "docs/srpo.md"
BEGIN, END = "<!-- places to open: python tools/places_to_open.py --write -->", "<!-- /places to open -->"


def block(script: str, mods: dict[str, Module]) -> str:
    return f"{BEGIN}\n{markdown(script, places(script, mods), mods)}\n{END}"


def write_pages(mods: dict[str, Module]) -> None:
    for script, page in PAGES.items():
        text = (ROOT / page).read_text()
        if BEGIN not in text or END not in text:
            sys.exit(f"error: {page} has no {BEGIN} ... {END} block to rewrite")
        head, rest = text.split(BEGIN, 1)
        (ROOT / page).write_text(head + block(script, mods) + rest.split(END, 1)[1])
        print(f"{page}: its places to open rewritten")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scripts", nargs="*", help=f"some of {SCRIPTS} (default: all)")
    ap.add_argument("--md", action="store_true", help="the docs page's list")
    ap.add_argument("--write", action="store_true", help="rewrite the lists on the docs pages")
    a = ap.parse_args()
    unknown = [s for s in a.scripts if s not in SCRIPTS]
    if unknown:
        sys.exit(f"error: {unknown}: not a method script (choose from {', '.join(SCRIPTS)})")
    mods = load_modules()
    if a.write:
        return write_pages(mods)
    for script in a.scripts or SCRIPTS:
        found = places(script, mods)
        if a.md:
            print(markdown(script, found, mods))
            continue
        files = sorted({file_of(k, mods) for k, _ in found})
        print(f"{script}: {len(found)} definitions in {len(files)} files ({', '.join(files)})")
        print("    " + ", ".join(f"{k}.{n}" for k, n in found))


if __name__ == "__main__":
    sys.exit(main())

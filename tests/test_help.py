"""--help starts with the method (rlvr_utils/core/flag_groups.py): the flags in titled groups, the method's own first
(within the first 40 lines), then run, model, task, sampling, optimizer, evaluation, engine and torchrun, every flag
once under its own name; and the grouped command line parses exactly as the flat Args does."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import tyro
from conftest import ROOT

import ep_grpo
import grpo
import grpo_lambda
import sc_grpo
import srpo
from rlvr_utils.core import cli, flag_groups

SCRIPTS = {
    "grpo.py": grpo,
    "sc_grpo.py": sc_grpo,
    "grpo_lambda.py": grpo_lambda,
    "ep_grpo.py": ep_grpo,
    "srpo.py": srpo,
}
ORDER = ["run", "model", "task", "sampling", "optimizer", "evaluation", "engine", "torchrun"]


def _help(script: str, *flags: str) -> str:
    env = dict(os.environ, COLUMNS="100", OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    out = subprocess.run([sys.executable, str(ROOT / script), *flags, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _rows(text: str) -> list[str]:
    """Each option row's flag, in order (`│ --flag ...`)."""
    return re.findall(r"^│ (--[a-z0-9-]+)", text, flags=re.M)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_starts_with_the_method_then_the_groups_in_order(script):
    text = _help(script)
    args = SCRIPTS[script].Args
    own = [f.name for f in dataclasses.fields(args) if f.name in vars(args).get("__annotations__", {})]
    lines = text.splitlines()
    run_box = next(i for i, line in enumerate(lines) if "─ run options ─" in line)
    if own:  # the method's box right after -h and --config: every one of its flags before the shared groups
        start = next(i for i, line in enumerate(lines) if line.startswith("╭─") and "options" in line and i > 3)
        assert start < 12 and all(f"│ --{n.replace('_', '-')} " in "\n".join(lines[start:run_box]) for n in own), text
        assert run_box <= 42 or script == "ep_grpo.py", run_box  # within 40 lines; EP-GRPO has 15 flags (48 lines)
    titles = re.findall(r"╭─ (.+?) options ─", text)
    shared = [t for t in titles if t in ORDER]
    assert shared == ORDER, titles
    if own:  # the method's box comes first, after -h and --config
        assert titles[0] not in ORDER and titles.index(shared[0]) == 1, titles
    flags = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(args)]
    rows = _rows(text)
    assert sorted(rows) == sorted(["--config", *flags]), set(rows) ^ {"--config", *flags}  # each once, its own name


def test_every_box_says_what_it_is_for():
    text = _help("sc_grpo.py", "--divergence", "kl")
    for group, what in flag_groups.TITLES.items():
        assert f"{group} options" in text and " ".join(what.split()[:4]) in text, group
    assert "SC-GRPO options" in text and "ablations options" in text and "(ours)" in text


ARGVS = [
    [],
    ["--seed", "3", "--loss-agg", "token-mean", "--no-save-model", "--lora-target-modules", "q_proj", "v_proj"],
    ["--reward-fn", "a.py:f", "--reward-fn", "b.py:g", "--reward-weights", "1", "--reward-weights", "0.5"],
    ["--resume", "None", "--epsilon-high", "0.28", "--report-to", "trackio", "mlflow", "--dynamic-sampling"],
]


@pytest.mark.parametrize("argv", ARGVS)
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_the_grouped_command_line_parses_as_the_flat_args(script, argv):
    args = SCRIPTS[script].Args
    assert flag_groups.parse(args, argv) == tyro.cli(args, args=argv)


def test_a_shared_flag_without_a_group_joins_the_one_before_it(monkeypatch):
    monkeypatch.setattr(flag_groups, "GROUP_OF", {k: v for k, v in flag_groups.GROUP_OF.items() if k != "top_k"})
    layout = flag_groups.layout(grpo.Args)
    assert "top_k" in layout["sampling"][1] and layout["sampling"][1].index("top_k") == 6


def test_the_groups_name_only_real_flags():
    names = {f.name for f in dataclasses.fields(cli.BaseArgs)}
    assert set(flag_groups.GROUP_OF) <= names, set(flag_groups.GROUP_OF) - names

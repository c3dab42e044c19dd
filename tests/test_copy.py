"""One method copied into another project as README.md's "Copy one method" says: sc_grpo.py, common.py and
rlvr_utils/ (and assets/tiny-arith for the default --model) in a folder outside the repository, run with the
repository off sys.path. It trains there; without the bundled model it stops with one line saying what to do; and from
inside a package it works the way the README says (and fails the way it says without the package's two lines)."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY_MODEL

import rlvr_utils
from rlvr_utils.extras.data import sandbox

QUICK = [
    "--total-steps",
    "2",
    "--eval-every",
    "0",
    "--num-eval",
    "2",
    "--prompts-per-step",
    "2",
    "--num-generations",
    "2",
    "--max-new-tokens",
    "16",
    "--threads",
    "1",
    "--output-dir",
    "runs",
]


def copy_method(dest: Path, model: bool = True) -> Path:
    """The README's copy: the script, common.py, rlvr_utils/ and (`model`) assets/tiny-arith, side by side."""
    dest.mkdir(parents=True)
    shutil.copy(ROOT / "sc_grpo.py", dest)
    shutil.copy(ROOT / "common.py", dest)
    shutil.copytree(ROOT / "rlvr_utils", dest / "rlvr_utils", ignore=shutil.ignore_patterns("__pycache__"))
    if model:
        shutil.copytree(TINY_MODEL, dest / "assets" / "tiny-arith")
    return dest


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python args...` in `cwd` with no PYTHONPATH (the repository is not importable) and the hub off."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def metrics_rows(runs: Path) -> list[str]:
    (metrics,) = runs.glob("*/metrics.jsonl")
    return metrics.read_text().splitlines()


@pytest.mark.slow
def test_a_copy_trains_with_the_bundled_model_beside_it(tmp_path):
    here = copy_method(tmp_path / "myproj")
    assert ROOT not in here.parents
    out = run(["sc_grpo.py", *QUICK], cwd=here)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(metrics_rows(here / "runs")) == 3  # step 0's evaluation, then steps 1 and 2


def test_a_copy_without_the_bundled_model_says_what_to_pass_in_one_line(tmp_path):
    here = copy_method(tmp_path / "myproj", model=False)
    out = run(["sc_grpo.py", "--total-steps", "2"], cwd=here)
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --model "), out.stderr
    for words in (
        "assets/tiny-arith",
        "--model Qwen/Qwen2.5-0.5B-Instruct",
        "copy assets/tiny-arith beside the script",
    ):
        assert words in lines[0], (words, lines[0])
    assert not (here / "runs").exists()  # stopped before anything was made


def readme_package_lines() -> str:
    """The `mypkg/algos/__init__.py` README.md gives under "Copy one method"."""
    section = (ROOT / "README.md").read_text().split("## Copy one method", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


@pytest.mark.slow
def test_inside_a_package_as_the_readme_says(tmp_path):
    """mypkg/algos/{sc_grpo.py, common.py, rlvr_utils/, assets/}: `python -m mypkg.algos.sc_grpo` needs the README's
    lines in mypkg/algos/__init__.py (without them `import common` fails); with them it trains, and the script's
    functions import from the package."""
    proj = tmp_path / "proj"
    algos = copy_method(proj / "mypkg" / "algos")
    (proj / "mypkg" / "__init__.py").write_text("")
    (algos / "__init__.py").write_text("")
    out = run(["-c", "import mypkg.algos.sc_grpo"], cwd=proj)
    assert out.returncode == 1 and "No module named 'common'" in out.stderr, out.stderr[-3000:]

    (algos / "__init__.py").write_text(readme_package_lines())
    out = run(["-m", "mypkg.algos.sc_grpo", *QUICK], cwd=proj)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(metrics_rows(proj / "runs")) == 3
    imports = (
        "from mypkg.algos import sc_grpo; import common, rlvr_utils; "
        "print(sc_grpo.__file__, common.__file__, rlvr_utils.__file__, callable(sc_grpo.Args))"
    )
    out = run(["-c", imports], cwd=proj)
    assert out.returncode == 0, out.stderr[-3000:]
    *files, ok = out.stdout.split()
    assert ok == "True" and all(Path(f).is_relative_to(algos) for f in files), out.stdout


# --- the minimal copy (issue #49): the core, the method's own module, the script ---------------------------------
sys.path.insert(0, str(ROOT / "tools"))
import copy_tiers  # noqa: E402

LOADED = """
import atexit, json, os, runpy, sys
root = os.path.abspath(sys.argv[1]); script = sys.argv[2]; sys.argv = sys.argv[2:]
def report():
    paths = {os.path.abspath(f) for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None))}
    files = sorted(os.path.relpath(p, root) for p in paths if p.startswith(root + os.sep) and os.path.isfile(p))
    sys.stderr.write("LOADED " + json.dumps([f for f in files if f != script]) + "\\n")
atexit.register(report)
sys.path.insert(0, root)
runpy.run_path(script, run_name="__main__")
"""


def loaded(script: str, *flags: str) -> list[str]:
    """The project files a run of `script` with `flags` imported besides the script itself."""
    out = subprocess.run(
        [sys.executable, "-c", LOADED, str(ROOT), script, *flags], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    line = next((x for x in out.stderr.splitlines() if x.startswith("LOADED ")), None)
    assert line is not None, out.stderr[-3000:]
    return json.loads(line[len("LOADED ") :])


@pytest.mark.parametrize("script", copy_tiers.SCRIPTS)
def test_help_loads_the_minimal_copy_and_no_more(script):
    """`--help` imports exactly the script's minimal copy (its size is in the README's table, not capped)."""
    got = loaded(script, "--help")
    assert sorted(got) == sorted(copy_tiers.minimal(script))


@pytest.mark.slow
@pytest.mark.parametrize("script", copy_tiers.SCRIPTS)
def test_a_default_run_loads_the_minimal_copy_and_no_more(script, tmp_path):
    """A default run (one step, smaller) imports exactly the minimal copy, no extra."""
    flags = ["--total-steps", "1", "--eval-every", "0", "--num-eval", "2", "--prompts-per-step", "2"]
    flags += ["--num-generations", "2", "--max-new-tokens", "16", "--threads", "1", "--output-dir", str(tmp_path)]
    assert sorted(loaded(script, *flags)) == sorted(copy_tiers.minimal(script))


def test_the_readme_gives_the_copy_tiers_as_they_are():
    readme = (ROOT / "README.md").read_text()
    assert copy_tiers.table() in readme, "README.md's copy tiers are stale: python tools/copy_tiers.py --write"


def test_copy_tiers_refuses_an_unknown_flag_and_has_help():
    """A mistyped --write is refused (it printed the blocks and left the README stale); -h says what it does."""
    readme = (ROOT / "README.md").read_bytes()
    tool = [sys.executable, str(ROOT / "tools" / "copy_tiers.py")]
    out = subprocess.run([*tool, "--wirte"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == "" and "unrecognized arguments: --wirte" in out.stderr, out
    assert (ROOT / "README.md").read_bytes() == readme
    helped = subprocess.run([*tool, "-h"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--write" in helped.stdout and "README" in helped.stdout


def copy_minimal(script: str, dest: Path) -> Path:
    """The script's minimal copy and the bundled model in `dest`."""
    dest.mkdir(parents=True)
    shutil.copy(ROOT / script, dest)
    for f in copy_tiers.minimal(script):
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, dest / f)
    shutil.copytree(TINY_MODEL, dest / "assets" / "tiny-arith")
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("script", copy_tiers.SCRIPTS)
def test_the_minimal_copy_trains(script, tmp_path):
    here = copy_minimal(script, tmp_path / "myproj")
    out = run([script, *QUICK], cwd=here)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(metrics_rows(here / "runs")) == 3


# Each flag that needs an extra, run in the minimal copy, and the files its one line names (every file it lacks)
DATA = {  # a small data file of each task's format (8 training rows, 2 held out)
    "gsm.jsonl": [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(10)],
    "math.jsonl": [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)],
    "code.jsonl": [
        {
            "prompt": f'def f(x):\n    """x + {i}"""\n',
            "test": f"def check(c):\n    assert c(1) == {i + 1}\n",
            "entry_point": "f",
        }
        for i in range(10)
    ],  # fmt: skip
    "rows.jsonl": [{"prompt": f"{i} + 1 = ", "answer": str(i + 1)} for i in range(10)],
}
REWARD = "def f(completions, **kw):\n    return [float(len(c) % 2) for c in completions]\n"
DATA_FILES = ["data_tasks", "model_checks"]  # every data flag's (a hub dataset is looked up as a --model would be)
REWARD_FNS = ["custom", "reward_calls", "reward_isolation", "reward_logs", "watchdog"]  # TRL's reward-call layer
CODE_SANDBOX = [] if sandbox.isolation_problem() is None else ["--code-sandbox", "audit-hook"]  # where no bwrap starts
FOLLOW = [  # (script, flags, the files the line names)
    ("grpo.py", ["--task", "gsm8k", "--data-path", "gsm.jsonl"], [*DATA_FILES, "rewards", "datafiles"]),
    ("grpo.py", ["--task", "math", "--data-path", "math.jsonl"], [*DATA_FILES, "rewards", "datafiles"]),
    ("grpo.py", ["--task", "code", "--data-path", "code.jsonl", *CODE_SANDBOX],
     [*DATA_FILES, "sandbox", "sandbox_bwrap", "sandbox_harness", "datafiles"]),
    ("grpo.py", ["--task", "custom", "--data-path", "rows.jsonl", "--reward-fn", "r.py:f"],
     [*DATA_FILES, "datafiles", *REWARD_FNS]),
    ("grpo.py", ["--reward-fn", "r.py:f"], [*DATA_FILES, "datafiles", *REWARD_FNS]),
    ("grpo.py", ["--log-credit", "2"], ["credit"]),
    ("grpo.py", ["--save-model"], ["model_card", "saving"]),
    ("grpo.py", ["--save-every", "1"], ["saving"]),
    ("grpo.py", ["--eval-num-generations", "2"], ["trl_eval"]),
    ("grpo.py", ["--lora-rank", "2"], ["lora"]),
    ("grpo.py", ["--dtype", "bfloat16"], ["precision"]),  # fp32 masters under bf16 compute
    ("grpo.py", ["--dtype", "bfloat16", "--pure-bf16", "kahan"], ["precision"]),  # optimi's AdamW
    ("grpo.py", ["--resume", "RUN"], ["resume", "saving"]),  # the run's own --save-every 1
    ("grpo.py", ["--engine", "vllm"], ["engines"]),
    ("grpo.py", ["--arith-variant", "rising"], ["arith_variants"]),
    ("sc_grpo.py", ["--divergence", "sampled-logratio"], ["sc_ablations"]),
    ("ep_grpo.py", ["--gate", "hard"], ["ep_ablations"]),
    ("srpo.py", ["--clip"], ["srpo_ablations"]),
    ("grpo_lambda.py", ["--trace-apply", "weight"], ["lambda_ablations"]),
]  # fmt: skip
NAMED = re.compile(r"needs ((?:rlvr_utils/[\w/]+\.py(?:, )?)+), which this copy does not have")


def path_of(module: str) -> str:
    """rlvr_utils/<folder>/<module>.py (rlvr_utils.WHERE)."""
    return f"rlvr_utils/{rlvr_utils.WHERE[module]}/{module}.py"


def copy_in(name: str, here: Path) -> None:
    """The repository's file `name` into the copy `here`, at the same path (its folder made: a minimal copy has no
    extras/)."""
    (here / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / name, here / name)


def in_copy(script: str, flags: list[str], here: Path) -> subprocess.CompletedProcess:
    """`script` QUICK `flags` in the copy `here`, beside the data files and the reward function the flags name;
    --resume RUN: a checkpointed run of the copy's core first, then its resume to step 3."""
    for name, rows in DATA.items():
        (here / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (here / "r.py").write_text(REWARD)
    if flags == ["--resume", "RUN"]:
        if not (here / "runs").exists():  # a checkpointed run, written with saving.py, which the copy then lacks
            saving = path_of("saving")
            lent = not (here / saving).exists()
            copy_in(saving, here)
            assert run([script, *QUICK, "--save-every", "1"], cwd=here).returncode == 0
            if lent:
                (here / saving).unlink()
        return run([script, "--resume", str(next((here / "runs").iterdir())), "--total-steps", "3"], cwd=here)
    return run([script, *QUICK, *flags], cwd=here)


def one_line(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr[-3000:])
    return lines[0]


@pytest.mark.parametrize("script, flags, files", FOLLOW, ids=[f"{s} {' '.join(f)}" for s, f, _ in FOLLOW])
def test_a_flag_whose_extra_is_missing_names_every_file_it_needs_in_one_line(script, flags, files, tmp_path):
    """In the minimal copy a flag that needs an extra stops before anything loads: one line naming every file the flag
    needs and the copy lacks (rlvr_utils.REQUIRES: what each extra imports), exit 2."""
    here = copy_minimal(script, tmp_path / "myproj")
    line = one_line(in_copy(script, flags, here))
    named = NAMED.search(line)
    assert named and named.group(1).split(", ") == [path_of(f) for f in files], line
    assert "RUN" in flags or not (here / "runs").exists()  # stopped before anything was made


@pytest.mark.slow
@pytest.mark.parametrize("script, flags, files", FOLLOW, ids=[f"{s} {' '.join(f)}" for s, f, _ in FOLLOW])
def test_copying_what_the_line_names_makes_the_flag_train(script, flags, files, tmp_path):
    """The line is enough: copy the files it names, run again, and the flag trains a step (one round for every
    flag). --engine vllm: the next line is about vLLM itself where it is not installed (no file is missing)."""
    here = copy_minimal(script, tmp_path / "myproj")
    for name in NAMED.search(one_line(in_copy(script, flags, here))).group(1).split(", "):
        copy_in(name, here)
    out = in_copy(script, flags, here)
    if "vllm" in flags and importlib.util.find_spec("vllm") is None:
        assert "which this copy does not have" not in one_line(out) and "vLLM is not installed" in out.stderr
        return
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(r) for r in metrics_rows(here / "runs")]
    assert rows[-1]["step"] == (3 if "RUN" in flags else 2) and "policy_loss" in rows[-1], rows[-1]


def test_under_torchrun_the_line_names_every_file_and_torchruns_variables_come_after(tmp_path, monkeypatch):
    """WORLD_SIZE > 1 with --fsdp in the minimal copy: one line naming distributed.py, sharded.py and saving.py (not one
    at a time); with them copied, a missing RANK is the next line; a WORLD_SIZE that is no number is its own line."""
    here = copy_minimal("grpo.py", tmp_path / "myproj")
    monkeypatch.setenv("WORLD_SIZE", "2")
    named = NAMED.search(one_line(run(["grpo.py", *QUICK, "--fsdp"], cwd=here)))
    files = ["distributed", "sharded", "saving"]
    assert named and named.group(1).split(", ") == [path_of(f) for f in files], named
    for f in files:
        copy_in(path_of(f), here)
    assert "WORLD_SIZE=2 is set without RANK" in one_line(run(["grpo.py", *QUICK, "--fsdp"], cwd=here))
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert "WORLD_SIZE='two': not a number of processes" in one_line(run(["grpo.py", *QUICK], cwd=here))

"""--report-to (TRL's name, rlvr_utils/extras/run_io/trackers.py): a run logged to a local trackio store and to a local
MLflow store, its values read back through each library's own reader and compared with metrics.jsonl's; a resumed run
goes on in the same MLflow run; the flags' mistakes are one line before anything loads. trackio is a dev requirement;
MLflow's local store needs the full mlflow (slow to install), which .ci/run's TRL environment has: here its tests skip,
saying so."""

import importlib.machinery
import importlib.util
import json
import os
import sys

import pytest
from helpers import ROOT, run_dir, run_script

from rlvr_utils.extras.run_io import trackers

TINY = ["--total-steps", "2", "--eval-every", "1", "--num-eval", "4", "--prompts-per-step", "2"]
TINY += ["--num-generations", "4", "--max-new-tokens", "16", "--threads", "1"]
MLFLOW = importlib.util.find_spec("mlflow") is not None and importlib.util.find_spec("sqlalchemy") is not None
NO_MLFLOW = "needs the full mlflow (its local sqlite store: pip install mlflow); .ci/run's TRL environment has it"


def _run(tmp_path, *flags, env=None):
    import subprocess

    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, str(ROOT / "grpo.py"), "--output-dir", str(tmp_path / "runs"), *TINY, *flags]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (run_dir(tmp_path / "runs") / "metrics.jsonl").open()]


@pytest.mark.skipif(importlib.util.find_spec("trackio") is None, reason="trackio is not installed (requirements-dev)")
def test_a_run_logs_to_a_local_trackio_store_and_reads_back(tmp_path, monkeypatch):
    import trackio.sqlite_storage as storage
    from trackio import Api
    from trackio.sqlite_storage import SQLiteStorage

    out = _run(tmp_path, "--report-to", "trackio", "--wandb-project", "p72", env={"TRACKIO_DIR": str(tmp_path / "t")})
    assert "trackers: trackio project p72" in out.stdout, out.stdout
    name = run_dir(tmp_path / "runs").name
    monkeypatch.setattr(storage, "TRACKIO_DIR", tmp_path / "t")  # the reader's store (TRACKIO_DIR, read at import)
    (run,) = Api().runs("p72")
    assert run.name == name and run.config["learning_rate"] == 1e-4 and run.config["script"] == "grpo.py"
    logged = {r["step"]: r for r in SQLiteStorage.get_logs("p72", name)}
    for row in _rows(tmp_path):  # every metric of every step, as metrics.jsonl has it
        for key in ("reward", "eval/accuracy", "completions/mean_length", "grad_norm"):
            if key in row:
                assert logged[row["step"]][key] == pytest.approx(row[key], rel=1e-6), (row["step"], key)


@pytest.mark.slow
@pytest.mark.skipif(not MLFLOW, reason=NO_MLFLOW)
def test_a_run_logs_to_a_local_mlflow_store_reads_back_and_resumes_in_the_same_run(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri}
    out = _run(tmp_path, "--report-to", "mlflow", "--save-every", "1", env=env)
    assert f"trackers: mlflow experiment credit-rlvr in {uri}" in out.stdout, out.stdout
    d = run_dir(tmp_path / "runs")
    _run(tmp_path, "--resume", str(d), "--total-steps", "3", env=env)  # --report-to from its config.json
    client = MlflowClient(uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "credit-rlvr"]
    (run,) = client.search_runs([exp.experiment_id])  # the resumed run went on in the same MLflow run
    assert run.info.run_name == d.name and run.data.params["learning_rate"] == "0.0001"
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in ("reward", "eval/accuracy", "policy_loss"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert history == {r["step"]: pytest.approx(r[key], rel=1e-6) for r in rows if key in r}, key


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--report-to", "none", "trackio"], ["--report-to none trackio", "no tracker library"]),
        (["--report-to", "nowhere"], ["--report-to", "wandb", "trackio", "mlflow"]),
    ],
)
def test_report_to_mistakes_are_one_line(tmp_path, flags, words):
    out = run_script("grpo.py", *flags, "--output-dir", str(tmp_path), timeout=120)
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]
    assert not any(tmp_path.iterdir())  # before anything loads: no run directory


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_track_is_report_to_wandb_with_a_warning(tmp_path):
    out = run_script("grpo.py", "--track", "--output-dir", str(tmp_path), timeout=120)
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr  # the error alone (the warning is for a run)
    assert lines[0].startswith("error: --track (--report-to wandb): wandb is not installed: pip install wandb"), lines


def test_track_warns_that_it_is_report_to_wandb(monkeypatch, capsys):
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda n: object())  # wandb and accelerate "installed"
    trackers.check(("tensorboard",), track=True)
    assert capsys.readouterr().err.startswith("warning: --track is --report-to wandb (TRL's name)")


def test_all_names_the_installed_libraries_and_tensorboard_none_name_none(monkeypatch):
    installed = {"trackio"}
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda n: object() if n in installed else None)
    assert trackers.chosen(("all",)) == ["trackio"] and trackers.chosen(("tensorboard",)) == []
    assert trackers.chosen(("none",), track=True) == ["wandb"] and trackers.chosen(("mlflow", "wandb")) == [
        "wandb",
        "mlflow",
    ]


@pytest.mark.parametrize("mode", [None, "online"])
def test_wandb_is_offline_unless_wandb_mode_says_otherwise(tmp_path, monkeypatch, mode):
    """--report-to wandb through accelerate's WandBTracker: offline in the run directory by default; WANDB_MODE, when
    set, is wandb's to read (no mode is passed). A stand-in wandb module records what it is given."""
    import types

    calls = {}
    run = types.SimpleNamespace(log=lambda values, step=None: calls.setdefault("log", []).append((step, values)))
    run.finish = lambda: calls.setdefault("finish", True)
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # accelerate asks find_spec
    fake.init = lambda **kwargs: calls.setdefault("init", kwargs) and run
    fake.config = types.SimpleNamespace(update=lambda values, allow_val_change: calls.setdefault("config", values))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    if mode:
        monkeypatch.setenv("WANDB_MODE", mode)
    (tracker,) = trackers.start(("wandb",), tmp_path / "r1", "p", {"seed": 1, "reward_fn": ("a",)}, 0)
    tracker.log({"reward": 0.5}, step=3)
    tracker.finish()
    init = calls["init"]
    assert init["project"] == "p" and init["name"] == init["id"] == "r1" and init["resume"] == "allow"
    assert init["dir"] == str(tmp_path / "r1") and init.get("mode") == (None if mode else "offline")
    assert calls["config"] == {"seed": 1, "reward_fn": "('a',)"} and calls["log"] == [(3, {"reward": 0.5})]
    assert calls["finish"]

"""--report-to, an extra: the run's metrics and flags also go to tracker libraries, named and chosen as TRL's (and
transformers') `report_to` names them (wandb, trackio, mlflow; all: every one installed; none; tensorboard: always),
through one layer, accelerate's trackers (accelerate.tracking, installed with peft). TensorBoard and metrics.jsonl are
the run directory's own and always written (runtime.Logger). --track, the old flag, is --report-to wandb.

Offline by default where the library allows, so a run sends nothing anywhere unless asked:
  wandb    offline mode, its files in <run-dir>/wandb (`wandb sync` sends them; WANDB_MODE=online sends as it runs)
  trackio  its local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio; `trackio show`), unless TRACKIO_SPACE_ID
           or TRACKIO_SERVER_URL names a Space or server
  mlflow   its local store (MLflow's default: ./mlflow.db), unless MLFLOW_TRACKING_URI names another
The project (wandb, trackio) or experiment (MLflow) is --wandb-project, the run the run directory's name; a resumed
run goes on in the same tracker run (wandb's and trackio's resume="allow", MLflow's run of that name in the
experiment). Only rank 0 logs (runtime.Logger), so no tracker waits for another rank.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from rlvr_utils.core.checkpoints import shown
from rlvr_utils.core.runtime import need

TRACKERS = ("wandb", "trackio", "mlflow")  # what --report-to sends to, besides TensorBoard
INSTALL = {
    "wandb": "pip install wandb (then wandb login)",
    "trackio": "pip install trackio",
    "mlflow": "pip install mlflow",
}
ALWAYS = ("tensorboard", "none")  # TensorBoard is always written; none: no tracker library


def chosen(report_to, track: bool = False) -> list[str]:
    """The tracker libraries --report-to (and --track: wandb) names; `all`: each of them that is installed."""
    names = set(report_to) | ({"wandb"} if track else set())
    if "all" in names:
        names |= {t for t in TRACKERS if importlib.util.find_spec(t) is not None}
    return [t for t in TRACKERS if t in names]


def check(report_to, track: bool) -> None:
    """Before anything loads (cli.check_common): `none` with another library, a library that is not installed, or no
    accelerate: one line, exit code 2; --track: a warning that it is --report-to wandb."""
    others = sorted(set(report_to) - set(ALWAYS))
    need("none" not in report_to or not others, f"--report-to none {' '.join(others)}: none means no tracker library "
         "(TensorBoard and metrics.jsonl are always written); give the libraries alone")  # fmt: skip
    missing = [t for t in chosen(report_to, track) if importlib.util.find_spec(t) is None]
    named = "--track (--report-to wandb)" if track and missing == ["wandb"] else f"--report-to {' '.join(missing)}"
    how = "; ".join(f"{INSTALL[t]}" for t in missing)
    need(not missing, f"{named}: {', '.join(missing)} is not installed: {how}, or leave it out")
    local = not os.environ.get("MLFLOW_TRACKING_URI", "").startswith(("http", "databricks"))  # its own database
    skinny = "mlflow" in chosen(report_to) and local and importlib.util.find_spec("sqlalchemy") is None
    need(not skinny, "--report-to mlflow: its local store (sqlite) needs the full mlflow: pip install mlflow "
         "(mlflow-skinny logs to a server only: MLFLOW_TRACKING_URI=http://...)")  # fmt: skip
    accelerate = "--report-to logs through accelerate's trackers, which are not installed: pip install accelerate"
    need(importlib.util.find_spec("accelerate") is not None, accelerate)
    if track:
        print("warning: --track is --report-to wandb (TRL's name); it logs offline unless WANDB_MODE=online",
              file=sys.stderr)  # fmt: skip


def start(report_to, run_dir: Path, project: str, config: dict, resumed: int) -> list:
    """The trackers --report-to names, started, the run's flags stored as their config (a new run only: a resumed one
    has them), each said in one line; [] for none. Their log(values, step=) and finish() are accelerate's."""
    from accelerate import PartialState, tracking

    PartialState()  # accelerate's logging asks it (it finds torchrun's process group made already)
    name, out, said = Path(run_dir).name, [], []
    for lib in chosen(report_to):
        if lib == "wandb":
            offline = {} if "WANDB_MODE" in os.environ else {"mode": "offline"}
            tracker = tracking.WandBTracker(project, name=name, id=name, resume="allow", dir=str(run_dir), **offline)
            said.append(f"wandb {os.environ.get('WANDB_MODE', 'offline')} in {shown(run_dir)}/wandb")
        elif lib == "trackio":
            tracker = tracking.TrackioTracker(project, name=name, resume="allow")
            said.append(f"trackio project {project} (trackio show --project {project})")
        else:
            run_id = _mlflow_run(project, name) if resumed else None  # a resumed run: the same MLflow run
            tracker = tracking.MLflowTracker(project, run_name=name, run_id=run_id)
            said.append(f"mlflow experiment {project} in {_mlflow_uri()}")
        tracker.main_process_only = False  # rank 0 alone logs (runtime.Logger)
        tracker.start()
        if not resumed:
            tracker.store_init_configuration({k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                              for k, v in config.items()})  # fmt: skip
        out.append(tracker)
    if said:
        print(f"trackers: {'; '.join(said)}", flush=True)
    return out


def _mlflow_uri() -> str:
    import mlflow

    return mlflow.get_tracking_uri()


def _mlflow_run(experiment: str, name: str) -> str | None:
    """The id of the MLflow run called `name` in `experiment` (a resumed run goes on in it), or None."""
    import mlflow

    if mlflow.get_experiment_by_name(experiment) is None:
        return None
    runs = mlflow.search_runs(experiment_names=[experiment], filter_string=f"attributes.run_name = '{name}'",
                              output_format="list")  # fmt: skip
    return runs[0].info.run_id if runs else None

"""Run the scripts as users do: a subprocess, or in-process (runpy) when a test patches common.py."""
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def run_inprocess(script: str, *args: str) -> None:
    """Run `python script args...` inside this process (so monkeypatches of common apply)."""
    old = sys.argv
    sys.argv = [script, *args]
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    finally:
        sys.argv = old


def read_metrics(output_dir: Path) -> list[dict]:
    (run,) = [p for p in Path(output_dir).iterdir() if p.is_dir()]
    return [json.loads(line) for line in (run / "metrics.jsonl").open()]


def run_dir(output_dir: Path) -> Path:
    (run,) = [p for p in Path(output_dir).iterdir() if p.is_dir()]
    return run

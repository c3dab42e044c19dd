import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The suite is a CPU suite (exact float32 comparisons, gloo under torchrun), also on a GPU host: GPUs are hidden from
# it and from the scripts it starts. GPU runs are benchmarks (benchmarks/gpu_vs_trl.py, docs/benchmarks.md).
if os.environ.get("RLVR_TESTS_ON_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, str(ROOT))
SHARED_DATA = Path(os.environ.get("SHARED_DATA", ROOT.parent / "shared" / "data"))  # the one setting for real data


def shared_file(name: str) -> Path:
    """A real data file (GSM8K, HumanEval) from SHARED_DATA; the test is skipped, saying why, when it is absent
    (the repository never holds a copy)."""
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"{path} is absent: real data is not part of the repository (set SHARED_DATA to its folder)")
    return path


TINY_MODEL = ROOT / "assets" / "tiny-arith"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: end-to-end runs of the scripts, the learning checks, the torchrun jobs (tests/test_dist.py) and the "
        "longest memory and update checks; they run by default and in CI (python -m pytest -q -n 2 --dist loadfile), "
        "and `python -m pytest -q -m 'not slow'` leaves them out for a quick pass",
    )


@pytest.fixture(scope="session")
def tiny():
    """The bundled tiny policy and its tokenizer (CPU, float32)."""
    import torch

    import common

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # -n 2: the cores shared
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))
    if not (TINY_MODEL / "config.json").exists():
        pytest.fail(f"bundled model missing: {TINY_MODEL} (run tools/train_tiny_model.py)")
    return common.load_policy(str(TINY_MODEL), torch.device("cpu"))


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """A grpo.py run of 1 step (test_bad_input.py's TINY settings) with a checkpoint, made once; a test copies it
    before it changes anything."""
    from test_bad_input import TINY, _run

    out = tmp_path_factory.mktemp("saved")
    r = _run("grpo.py", *TINY, "--total-steps", "1", "--save-every", "1", "--output-dir", str(out / "runs"))
    assert r.returncode == 0, r.stderr[-2000:]
    (run,) = (out / "runs").iterdir()
    return run

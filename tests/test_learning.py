"""Learning test: a short seeded grpo.py run on the built-in task must raise eval accuracy by a
margin that a broken gradient cannot reach. The broken runs are the same script with
common.group_advantages patched (sign flipped, or zeroed), and the same assertion is shown to
fail for them, so the test can tell a working gradient from a broken one."""

import pytest
import torch
from helpers import read_metrics, run_inprocess

import common

MARGIN = 0.05
ARGS = [
    "--total-steps",
    "30",
    "--eval-every",
    "0",
    "--num-eval",
    "200",
    "--seed",
    "1",
]  # greedy eval: no sampling noise


def _gain(tmp_path, monkeypatch, mode):
    real = common.group_advantages
    if mode == "flipped":
        monkeypatch.setattr(common, "group_advantages", lambda *a, **k: -real(*a, **k))
    elif mode == "zeroed":
        monkeypatch.setattr(common, "group_advantages", lambda *a, **k: torch.zeros_like(real(*a, **k)))
    run_inprocess("grpo.py", "--output-dir", str(tmp_path), *ARGS)
    rows = read_metrics(tmp_path)
    return rows[-1]["eval/accuracy"] - rows[0]["eval/accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["working", "flipped", "zeroed"])
def test_grpo_learns_and_broken_gradients_do_not(tmp_path, monkeypatch, mode):
    torch.set_num_threads(2)
    gain = _gain(tmp_path, monkeypatch, mode)
    print(f"{mode}: eval accuracy gain {gain:+.3f}")
    if mode == "working":
        assert gain >= MARGIN, f"GRPO raised eval accuracy by only {gain:+.3f} (< {MARGIN})"
    else:  # the assertion above must fail for a broken gradient
        assert gain < MARGIN, (
            f"a {mode} gradient reached {gain:+.3f}: the learning test cannot tell it from a working one"
        )

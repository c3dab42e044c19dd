"""learning_curves.py's endpoint (the mean of a run's last evaluations) and its planned comparisons (report --last,
--contrast), against hand-computed values."""

import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import learning_curves as lc  # noqa: E402


def curve(*accs):
    return [(10 * i, 100.0 * i, a) for i, a in enumerate(accs)]


CURVES = {  # method -> seed -> [(step, tokens, accuracy)]
    "grpo": {1: curve(0.3, 0.4, 0.5, 0.3), 2: curve(0.3, 0.5, 0.6, 0.6), 3: curve(0.2, 0.2, 0.4, 0.5)},
    "control": {1: curve(0.3, 0.5, 0.6, 0.6), 2: curve(0.3, 0.6, 0.6, 0.7), 3: curve(0.2, 0.4, 0.4, 0.6)},
    "placebo": {1: curve(0.3, 0.4, 0.5, 0.5), 2: curve(0.3, 0.5, 0.7, 0.6)},
    "sc_grpo@lr3e-5": {1: curve(0.3, 0.3, 0.3, 0.3), 2: curve(0.3, 0.3, 0.3, 0.4)},
}


def test_endpoint_is_the_mean_of_the_last_evaluations():
    assert lc.endpoint(curve(0.3, 0.4, 0.5, 0.3)) == 0.3
    assert lc.endpoint(curve(0.3, 0.4, 0.5, 0.3), 2) == pytest.approx(0.4)
    assert lc.endpoint(curve(0.3, 0.4), 5) == pytest.approx(0.35)  # fewer evaluations than asked: all of them


def test_versus_grpo_pairs_the_endpoints():
    v = lc.versus_grpo(CURVES["control"], CURVES["grpo"], last=2)
    # endpoints (last 2): control 0.6, 0.65, 0.5; grpo 0.4, 0.6, 0.45 -> differences 0.2, 0.05, 0.05
    assert v["final"] == pytest.approx((0.6 + 0.65 + 0.5) / 3) and v["diff"] == pytest.approx(0.1)
    assert lc.versus_grpo(CURVES["control"], CURVES["grpo"])["diff"] == pytest.approx((0.3 + 0.1 + 0.1) / 3)


def test_contrasts_by_hand():
    got = lc.contrasts(CURVES, ["control-grpo", "control-placebo", "sc_grpo@lr3e-5-grpo"], last=2)
    c = {x["pair"]: x for x in got}
    d = [0.2, 0.05, 0.05]
    assert c["control-grpo"]["n"] == 3 and c["control-grpo"]["diff"] == pytest.approx(0.1)
    assert c["control-grpo"]["p"] == pytest.approx(lc.paired_p(d))
    # control - placebo on seeds 1, 2: 0.6 - 0.5, 0.65 - 0.65
    assert c["control-placebo"]["n"] == 2 and c["control-placebo"]["diff"] == pytest.approx(0.05)
    assert (c["sc_grpo@lr3e-5-grpo"]["a"], c["sc_grpo@lr3e-5-grpo"]["b"]) == ("sc_grpo@lr3e-5", "grpo")
    ps = {x["pair"]: x["p"] for x in got}
    assert {k: x["p_holm"] for k, x in c.items()} == pytest.approx(lc.holm(ps))  # Holm over the listed pairs
    with pytest.raises(SystemExit):
        lc.contrasts(CURVES, ["control-nothing"])

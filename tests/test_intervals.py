"""benchmarks/learning_curves.py's Student-t quantile and interval over seeds, against published values, exact closed
forms and a brute-force integral of the density."""

import math
import random
import sys

import numpy as np
import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def lc():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import learning_curves

        yield learning_curves
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize(
    "df, q",  # t_{0.975, df} as printed in the usual tables (3 decimals)
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (9, 2.262), (10, 2.228), (30, 2.042), (100, 1.984)],
)
def test_t_quantile_against_the_printed_table(lc, df, q):
    assert round(lc.t_quantile(0.975, df), 3) == q


def test_t_quantile_against_exact_closed_forms(lc):
    for p in (0.6, 0.9, 0.95, 0.975, 0.995):
        assert lc.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)  # Cauchy
        assert lc.t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
        assert lc.t_quantile(1 - p, 7) == pytest.approx(-lc.t_quantile(p, 7), rel=1e-12)  # symmetry
    assert lc.t_quantile(0.5, 4) == pytest.approx(0.0, abs=1e-9)
    # many degrees of freedom: the normal quantile 1.959964, approached from above by about (z^3 + z) / (4 df)
    assert 1.959964 < lc.t_quantile(0.975, 20000) < 1.959964 + 2e-4


@pytest.mark.parametrize("df", [1, 2, 3, 6, 9, 30])
def test_t_cdf_against_the_integrated_density(lc, df):
    """P(|T| <= t) = 2 * integral_0^t of the density, by the trapezoid rule on a fine grid (an independent route)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    for t in (0.3, 1.0, 2.5, 7.0):
        x = np.linspace(0.0, t, 200_001)
        dens = np.exp(log_c - (df + 1) / 2 * np.log1p(x**2 / df))
        brute = 2 * float(np.sum((dens[1:] + dens[:-1]) / 2 * np.diff(x)))
        assert lc.t_two_sided(t, df) == pytest.approx(brute, abs=1e-8)


def test_t_interval_by_hand_and_its_coverage(lc):
    m, lo, hi = lc.t_interval([1.0, 2.0, 3.0])  # mean 2, sd 1: half-width 4.3027 / sqrt(3) = 2.4841
    assert m == 2.0 and lo == pytest.approx(2 - 2.48414, abs=1e-4) and hi == pytest.approx(2 + 2.48414, abs=1e-4)
    assert lc.t_interval([0.4]) == (0.4, None, None)  # one seed: no interval
    assert lc.t_interval([0.3, 0.3, 0.3]) == pytest.approx((0.3, 0.3, 0.3))
    with pytest.raises(ValueError):
        lc.t_quantile(1.0, 3)
    with pytest.raises(ValueError):
        lc.t_two_sided(1.0, 0)
    # 3 normal draws per trial: the interval holds the true mean in ~95% of trials (a 2.5-point bootstrap of 3 values
    # would hold it far less often)
    rng = random.Random(0)
    trials = 4000
    hits = 0
    for _ in range(trials):
        _, lo, hi = lc.t_interval([rng.gauss(0.5, 0.1) for _ in range(3)])
        hits += lo <= 0.5 <= hi
    assert 0.935 < hits / trials < 0.965
    assert lc.fmt_ci((0.1, -0.2, 0.4), "+") == "+0.100 [-0.200, +0.400]" and lc.fmt_ci((0.5, None, None)) == (
        "0.500 (one seed)"
    )


def test_holm_by_hand(lc):
    """m = 3: the smallest p times 3, the next times 2 (never below the one before), the largest times 1."""
    got = lc.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": None})
    assert got == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    assert lc.holm({"x": 0.5, "y": 0.9}) == pytest.approx({"x": 1.0, "y": 1.0})  # capped at 1


def test_paired_p_and_the_detectable_effect_by_hand(lc):
    """diffs 1, 2, 3: mean 2, sd 1, t = 2 sqrt(3); with 2 degrees of freedom P(|T| <= t) = t / sqrt(2 + t^2)."""
    t = 2 * math.sqrt(3)
    assert lc.paired_p([1.0, 2.0, 3.0]) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    assert lc.paired_p([0.0, 0.0]) == 1.0 and lc.paired_p([0.5]) is None
    q = lambda p: (2 * p - 1) / math.sqrt(2 * p * (1 - p))  # noqa: E731  (t's quantile at 2 degrees of freedom)
    assert lc.detectable([1.0, 2.0, 3.0]) == pytest.approx((q(0.975) + q(0.8)) / math.sqrt(3), rel=1e-9)


def test_fieller_against_a_brute_force_scan(lc):
    """The interval is the set of ratios r with (a - r b)^2 <= t^2 (v_aa - 2 r v_ab + r^2 v_bb): found here by a scan
    of r; unbounded (None) when the denominator's own interval holds 0."""
    num, den = [1.0, 2.0, 3.0, 2.5], [10.0, 11.0, 12.5, 9.0]
    n = len(num)
    a, b = sum(num) / n, sum(den) / n
    v_aa, v_bb = np.var(num, ddof=1) / n, np.var(den, ddof=1) / n
    v_ab = np.cov(num, den, ddof=1)[0, 1] / n
    t2 = lc.t_quantile(0.975, n - 1) ** 2
    rs = np.linspace(-2, 2, 400001)
    inside = rs[(a - rs * b) ** 2 <= t2 * (v_aa - 2 * rs * v_ab + rs**2 * v_bb)]
    ratio, lo, hi = lc.fieller(num, den)
    assert ratio == pytest.approx(a / b) and lo == pytest.approx(inside.min(), abs=2e-5)
    assert hi == pytest.approx(inside.max(), abs=2e-5) and lo < ratio < hi
    assert lc.fieller([1.0, 2.0, 3.0], [-1.0, 0.5, 1.0])[1:] == (None, None)  # the control's gain is not shown


def test_versus_control_by_hand(lc):
    """Finals by seed: GRPO 0.40, 0.50, 0.45; the control 0.50, 0.62, 0.54; a method 0.45, 0.55, 0.50. Its gains over
    GRPO (0.05 each) over the control's (0.10, 0.12, 0.09): share 0.05 / (0.31 / 3); against the control: -0.05,
    -0.07, -0.04."""
    curve = lambda *finals: {k + 1: [(0, 0, 0.3), (40, 1e4, f)] for k, f in enumerate(finals)}  # noqa: E731
    v = lc.versus_control(curve(0.45, 0.55, 0.50), curve(0.40, 0.50, 0.45), curve(0.50, 0.62, 0.54))
    assert v["n_control"] == 3 and v["share"] == pytest.approx(0.05 / (0.31 / 3))
    assert v["vs_control"] == pytest.approx(-0.16 / 3)
    half = lc.t_quantile(0.975, 2) * np.std([-0.05, -0.07, -0.04], ddof=1) / math.sqrt(3)
    assert (v["vs_control_lo"], v["vs_control_hi"]) == pytest.approx((-0.16 / 3 - half, -0.16 / 3 + half))
    assert v["share_lo"] < v["share"] < v["share_hi"]

"""The mSPRT of scorer/sequential.py: valid when watched after every sample, and able to find a real difference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferlb.scorer.sequential import Moments, compare, half_width, mixture_ratio


def test_moments_match_numpy_and_merge_exactly() -> None:
    rng = np.random.default_rng(3)
    values = rng.lognormal(0, 1, 1000)
    a, b = Moments(), Moments()
    for v in values[:400]:
        a.add(v)
    for v in values[400:]:
        b.add(v)
    both = a.merged(b)
    assert both.count == 1000
    assert both.mean == pytest.approx(values.mean(), rel=1e-12)
    assert both.variance == pytest.approx(values.var(ddof=1), rel=1e-10)


def test_replacing_a_value_gives_the_moments_of_the_corrected_stream() -> None:
    rng = np.random.default_rng(4)
    values = (rng.random(500) < 0.1).astype(float)
    moments = Moments()
    for v in values:
        moments.add(v)
    for i in np.flatnonzero(values == 0)[:30]:  # thirty outcomes corrected from success to failure
        moments.replace(0.0, 1.0)
        values[i] = 1.0
    assert moments.count == 500
    assert moments.mean == pytest.approx(values.mean(), rel=1e-12)
    assert moments.variance == pytest.approx(values.var(ddof=1), rel=1e-10)
    with pytest.raises(ValueError, match="no value to replace"):
        Moments().replace(0.0, 1.0)


def test_the_interval_holds_exactly_the_differences_the_ratio_does_not_reject() -> None:
    d, v, tau, alpha = 0.3, 0.01, 0.1, 0.05
    w = half_width(v, tau, alpha)
    # At the interval's edge the ratio centred there is 1/alpha; inside it is below.
    assert mixture_ratio(w, v, tau) == pytest.approx(1 / alpha, rel=1e-9)
    assert mixture_ratio(w * 0.99, v, tau) < 1 / alpha
    assert (mixture_ratio(d, v, tau) >= 1 / alpha) == (abs(d) >= w)


def _watched(rng: np.random.Generator, effect: float, n: int, min_samples: int) -> str:
    """One experiment looked at after every 10 samples per arm; the first verdict, or none."""
    control, treatment = Moments(), Moments()
    a = rng.normal(0.0, 0.5, n)
    b = rng.normal(effect, 0.5, n)
    for i in range(n):
        control.add(a[i])
        treatment.add(b[i])
        if i % 10 == 9:
            verdict = compare(control, treatment, tau=0.1, min_samples=min_samples).verdict
            if verdict != "no difference yet":
                return verdict
    return "no difference yet"


def test_watching_after_every_batch_keeps_false_verdicts_under_alpha() -> None:
    rng = np.random.default_rng(11)
    runs = 300
    false = sum(_watched(rng, 0.0, 2000, 100) != "no difference yet" for _ in range(runs))
    # A fixed-horizon 95% test looked at 190 times would be wrong in far more than 5% of these runs.
    assert false / runs <= 0.05


def test_a_real_difference_gets_the_right_verdict() -> None:
    rng = np.random.default_rng(5)
    slower = [_watched(rng, 0.1, 3000, 100) for _ in range(20)]  # the treatment ~10% slower (log scale)
    faster = [_watched(rng, -0.1, 3000, 100) for _ in range(20)]
    assert slower.count("worse") >= 18 and "better" not in slower
    assert faster.count("better") >= 18 and "worse" not in faster


def test_no_verdict_before_the_minimum_sample_or_with_one_value() -> None:
    control, treatment = Moments(), Moments()
    for i in range(50):
        control.add(1.0 + 0.01 * (i % 3))
        treatment.add(2.0 + 0.01 * (i % 3))
    assert compare(control, treatment, tau=0.1, min_samples=51).verdict == "no difference yet"
    assert compare(control, treatment, tau=0.1, min_samples=50).verdict == "worse"
    one = Moments()
    one.add(1.0)
    result = compare(one, treatment, tau=0.1)
    assert result.verdict == "no difference yet" and math.isinf(result.high)


def test_higher_is_better_flips_the_verdict() -> None:
    control, treatment = Moments(), Moments()
    for i in range(300):
        control.add(i % 2)
        treatment.add(1.0)
    assert compare(control, treatment, tau=0.1, lower_is_better=False, min_samples=10).verdict == "better"
    with pytest.raises(ValueError, match="alpha"):
        compare(control, treatment, tau=0.1, alpha=1.5)

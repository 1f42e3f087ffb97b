"""Tests for otel/latency.py: the bucket layout and its error bound against numpy, window expiry and EWMA decay on
a fake clock, rejected values, fixed memory, the per-endpoint arrays, and the published estimate's drift toward
the fleet's as an endpoint's evidence ages (tests/otel/test_latency_drift.py closes the loop through the engine)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.otel.latency import QUANTILES, EndpointLatency, LogBuckets

BAD_VALUES = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.5]


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def exact_quantiles(values: np.ndarray, qs: tuple[float, ...]) -> np.ndarray:
    """numpy's nearest-rank quantiles: the definition the histograms estimate."""
    return np.quantile(values, qs, method="inverted_cdf")


def assert_within_bound(estimates: tuple[float, ...], exact: np.ndarray, buckets: LogBuckets) -> None:
    # A value on a bucket edge may round into the bucket below: allow for float rounding, nothing more.
    errors = np.abs(np.asarray(estimates) / exact - 1.0)
    assert np.all(errors <= buckets.max_relative_error * (1 + 1e-9)), (estimates, exact.tolist(), errors.tolist())


# --- LogBuckets ---


def test_default_layout() -> None:
    buckets = LogBuckets()
    assert (buckets.min_value, buckets.max_value, buckets.relative_width) == (1e-4, 1e4, 0.05)
    assert buckets.size == 378  # ceil(log(1e8) / log(1.05))
    edges = buckets.edges()
    assert edges.shape == (buckets.size + 1,)
    assert edges[0] == pytest.approx(1e-4)
    assert edges[-2] < 1e4 <= edges[-1]
    assert np.allclose(edges[1:] / edges[:-1], 1.05)
    assert np.allclose(buckets.midpoints, np.sqrt(edges[:-1] * edges[1:]))
    assert buckets.max_relative_error == pytest.approx(math.sqrt(1.05) - 1)
    assert 0.0246 < buckets.max_relative_error < 0.0248  # about half the bucket width
    assert not buckets.midpoints.flags.writeable


def test_layouts_compare_by_parameters() -> None:
    assert LogBuckets() == LogBuckets(1e-4, 1e4, 0.05)
    assert hash(LogBuckets()) == hash(LogBuckets(1e-4, 1e4, 0.05))
    assert LogBuckets() != LogBuckets(relative_width=0.1)


def test_index_clamps_to_the_end_buckets() -> None:
    buckets = LogBuckets()
    assert buckets.index(1e-9) == buckets.index(1e-4) == 0
    assert buckets.index(1e9) == buckets.index(1e4) == buckets.size - 1
    assert [buckets.index(float(m)) for m in buckets.midpoints] == list(range(buckets.size))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"min_value": 0.0}, "min_value must be a positive finite number", id="zero-min"),
        pytest.param({"min_value": -1.0}, "min_value must be a positive finite number", id="negative-min"),
        pytest.param({"max_value": math.inf}, "max_value must be a positive finite number", id="infinite-max"),
        pytest.param({"relative_width": math.nan}, "relative_width must be", id="nan-width"),
        pytest.param({"relative_width": 0.0}, "relative_width must be", id="zero-width"),
        pytest.param({"min_value": 2.0, "max_value": 1.0}, "must be greater than min_value", id="max-below-min"),
        pytest.param({"relative_width": 1e-6}, "raise relative_width", id="too-many-buckets"),
    ],
)
def test_invalid_layouts_say_what_to_fix(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LogBuckets(**kwargs)


# --- quantiles and window (one endpoint) ---


def one(buckets: LogBuckets | None = None, **kwargs: float) -> EndpointLatency:
    """One endpoint's statistics on a fake clock, by default over a window longer than any test."""
    options: dict[str, Any] = {"window_s": 1e9, "clock": FakeClock(), **kwargs}
    return EndpointLatency(1, buckets=buckets, **options)


def ttft_quantiles(latency: EndpointLatency, now: float | None = None) -> tuple[float, ...]:
    arrays = latency.arrays(now)
    return tuple(float(arrays[f"ttft_{key}"][0]) for key in ("p50", "p95", "p99"))


@pytest.mark.parametrize(
    ("seed", "n", "mu", "sigma"),
    [
        pytest.param(1, 10_000, math.log(0.2), 0.5, id="ttft-like"),
        pytest.param(2, 10_000, math.log(5.0), 1.0, id="e2e-like"),
        pytest.param(3, 101, math.log(0.05), 2.0, id="few-wide"),
        pytest.param(4, 1, 0.0, 1.0, id="one-value"),
        pytest.param(5, 50_000, math.log(1e-3), 3.0, id="very-wide"),
    ],
)
def test_quantiles_within_the_bound_of_numpy(seed: int, n: int, mu: float, sigma: float) -> None:
    values = np.random.default_rng(seed).lognormal(mu, sigma, n).clip(1e-4, 1e4)
    latency = one()
    for value in values.tolist():
        latency.observe(0, value, None)
    assert latency.arrays()["count"].tolist() == [n]
    assert_within_bound(ttft_quantiles(latency), exact_quantiles(values, QUANTILES), latency.buckets)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(1e-4, 1e4), min_size=1, max_size=300),
    width=st.sampled_from([0.01, 0.05, 0.2]),
)
def test_any_values_quantiles_are_within_the_bound(values: list[float], width: float) -> None:
    buckets = LogBuckets(relative_width=width)
    latency = one(buckets)
    for value in values:
        latency.observe(0, value, None)
    assert_within_bound(ttft_quantiles(latency), exact_quantiles(np.asarray(values), QUANTILES), buckets)


def test_out_of_range_values_are_clamped() -> None:
    low, high = one(), one()
    low.observe(0, 1e-9, None)
    high.observe(0, 1e9, None)
    assert ttft_quantiles(low) == (float(low.buckets.midpoints[0]),) * 3
    assert ttft_quantiles(high) == (float(high.buckets.midpoints[-1]),) * 3


def test_values_expire_a_window_after_their_slice_starts() -> None:
    clock = FakeClock(1000.0)  # a slice boundary: slices are 10 s
    latency = EndpointLatency(1, window_s=60, slices=6, clock=clock)
    latency.observe(0, 0.1, None)
    clock.now = 1009.9
    latency.observe(0, 0.1, None)
    clock.now = 1059.9
    assert latency.arrays()["count"].tolist() == [2]
    assert ttft_quantiles(latency)[0] == pytest.approx(0.1, rel=latency.buckets.max_relative_error)
    clock.now = 1060.0
    assert latency.arrays()["count"].tolist() == [0]
    assert all(math.isnan(q) for q in ttft_quantiles(latency))


def test_only_the_expired_slices_are_dropped() -> None:
    latency = EndpointLatency(1, window_s=60, slices=6, clock=FakeClock())
    for _ in range(10):
        latency.observe(0, 0.1, None, now=1000.0)
    for _ in range(10):
        latency.observe(0, 2.0, None, now=1030.0)
    assert latency.arrays(now=1059.0)["count"].tolist() == [20]
    p50, _, p99 = ttft_quantiles(latency, now=1065.0)
    assert latency.arrays(now=1065.0)["count"].tolist() == [10]
    assert p50 == pytest.approx(2.0, rel=latency.buckets.max_relative_error)
    assert p99 == p50
    assert latency.arrays(now=1000.0 + 10_000)["count"].tolist() == [0]  # a long silence clears the whole ring


def test_time_never_runs_backwards() -> None:
    latency = EndpointLatency(1, window_s=60, slices=6, clock=FakeClock())
    latency.observe(0, 1.0, None, now=1100.0)
    latency.observe(0, 1.0, None, now=1000.0)  # counts in the newest slice, not in one long expired
    assert latency.arrays(now=1100.0)["count"].tolist() == [2]
    assert latency.arrays(now=1000.0)["count"].tolist() == [2]
    assert latency.arrays(now=1160.0)["count"].tolist() == [0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"window_s": 0}, "window_s must be", id="zero-window"),
        pytest.param({"window_s": math.inf}, "window_s must be", id="infinite-window"),
        pytest.param({"slices": 0}, "slices must be", id="no-slices"),
        pytest.param({"slices": 2.5}, "slices must be", id="fractional-slices"),
        pytest.param({"half_life_s": 0.0}, "half_life_s must be", id="zero-half-life"),
        pytest.param({"half_life_s": -1.0}, "half_life_s must be", id="negative-half-life"),
        pytest.param({"half_life_s": math.nan}, "half_life_s must be", id="nan-half-life"),
        pytest.param({"half_life_s": math.inf}, "half_life_s must be", id="infinite-half-life"),
    ],
)
def test_invalid_windows(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EndpointLatency(1, **kwargs)


# --- the EWMA (one endpoint: its estimate is its own mean) ---


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        pytest.param([(1.0, 0.0), (3.0, 10.0)], (0.5 * 1 + 3) / 1.5, id="one-half-life"),
        pytest.param([(1.0, 0.0), (3.0, 20.0)], (0.25 * 1 + 3) / 1.25, id="two-half-lives"),
        pytest.param([(1.0, 0.0), (3.0, 0.0)], 2.0, id="same-instant"),
        pytest.param([(1.0, 0.0)] * 9 + [(3.0, 0.0)], 1.2, id="same-instant-many"),
        pytest.param([(1.0, 0.0), (5.0, 200.0)], 5.0, id="long-gap-forgets"),
        pytest.param([(1.0, 10.0), (3.0, 0.0)], 2.0, id="earlier-now-counts-as-latest"),
    ],
)
def test_ewma_weights_halve_every_half_life(samples: list[tuple[float, float]], expected: float) -> None:
    latency = one(half_life_s=10)
    for value, now in samples:
        latency.observe(0, value, None, now=now)
    assert latency.arrays(now=1000.0)["ttft_ewma"][0] == pytest.approx(expected, rel=1e-6)


def test_ewma_decays_by_time_not_by_sample_count() -> None:
    rng = np.random.default_rng(5)
    times = np.sort(rng.uniform(0.0, 60.0, 500))
    values = rng.lognormal(0.0, 1.0, 500)
    latency = one(half_life_s=7.5)
    for value, now in zip(values.tolist(), times.tolist(), strict=True):
        latency.observe(0, value, None, now=now)
    assert latency.arrays(now=60.0)["ttft_ewma"][0] == pytest.approx(ewma(times, values, 7.5, 60.0)[0], rel=1e-9)


def ewma(times: np.ndarray, values: np.ndarray, half_life_s: float, now: float) -> tuple[float, float]:
    """The definition: the mean of ``values`` weighted by ``2 ** (-(now - t) / half_life_s)``, and the weights'
    sum (the evidence behind it, as of ``now``)."""
    weights = 0.5 ** ((now - times) / half_life_s)
    return float((weights * values).sum() / weights.sum()), float(weights.sum())


# --- EndpointLatency ---

KEYS = ["ttft_ewma", "ttft_p50", "ttft_p95", "ttft_p99", "e2e_ewma", "e2e_p50", "e2e_p95", "e2e_p99", "count"]


def test_arrays_start_empty() -> None:
    arrays = EndpointLatency(4, clock=FakeClock()).arrays()
    assert list(arrays) == KEYS
    for key, array in arrays.items():
        assert array.shape == (4,)
        assert array.dtype == np.float64
        if key == "count":
            assert array.tolist() == [0.0] * 4
        else:
            assert np.isnan(array).all(), key


def test_a_metric_without_data_has_nan_quantiles_and_the_fleets_estimate() -> None:
    # The estimate used to be NaN here too; but a NaN scores neutral (0.5), below every healthy endpoint's score,
    # so an endpoint without recent spans got no requests and so no spans. Its best estimate is the fleet's.
    latency = EndpointLatency(3, clock=FakeClock())
    latency.observe(1, 0.25, None)
    latency.observe(2, None, 4.0)
    arrays = latency.arrays()
    assert arrays["count"].tolist() == [0.0, 1.0, 1.0]
    for key in ("p50", "p95", "p99"):
        ttft, e2e = arrays[f"ttft_{key}"], arrays[f"e2e_{key}"]
        assert np.isnan(ttft[[0, 2]]).all() and np.isnan(e2e[[0, 1]]).all()
        assert ttft[1] == pytest.approx(0.25, rel=latency.buckets.max_relative_error)
        assert e2e[2] == pytest.approx(4.0, rel=latency.buckets.max_relative_error)
    assert arrays["ttft_ewma"].tolist() == [0.25] * 3
    assert arrays["e2e_ewma"].tolist() == [4.0] * 3


def shrunk(own: list[tuple[float, float]], prior_weight: float = 1.0) -> np.ndarray:
    """The estimates `EndpointLatency` publishes, from each endpoint's own (mean, evidence) (each with a value in
    the window)."""
    values = np.array([value for value, _ in own])
    weights = np.array([weight for _, weight in own])
    fleet = (weights * values).sum() / weights.sum()
    return np.asarray((weights * values + prior_weight * fleet) / (weights + prior_weight))


def test_statistics_match_their_definitions() -> None:
    """Quantiles: the midpoint of the bucket of the nearest-rank value among those in the window's slices; the
    estimate: each endpoint's time-decayed mean shrunk toward the fleet's by its evidence."""
    clock = FakeClock(0.0)
    latency = EndpointLatency(5, window_s=30, half_life_s=5, slices=3, clock=clock)
    seen: list[tuple[float, int, float, float]] = []  # (time, endpoint, ttft, e2e)
    rng = np.random.default_rng(9)
    for step in range(3000):
        clock.now = step * 0.03
        endpoint = int(rng.integers(0, 5))
        ttft, e2e = float(rng.lognormal(-2.0, 0.5)), float(rng.lognormal(1.0, 0.7))
        latency.observe(endpoint, ttft, e2e)
        seen.append((clock.now, endpoint, ttft, e2e))
        if step % 700 == 0:
            latency.arrays()  # reads in between must not change the result
    clock.now += 7.0  # the estimates change without samples too: the evidence fades
    arrays = latency.arrays()
    buckets = latency.buckets
    oldest = math.floor(clock.now / 10.0) - 2  # slices of 10 s: the window holds the newest three
    for m, metric in enumerate(("ttft", "e2e")):
        own = []
        for endpoint in range(5):
            mine = [(t, v[m]) for t, e, *v in seen if e == endpoint]
            window = sorted(v for t, v in mine if math.floor(t / 10.0) >= oldest)
            expected = []
            for q in QUANTILES:
                rank = max(1, math.ceil(len(window) * q))
                expected.append(float(buckets.midpoints[buckets.index(window[rank - 1])]))
            assert [arrays[f"{metric}_{key}"][endpoint] for key in ("p50", "p95", "p99")] == expected
            times, values = (np.array(column) for column in zip(*mine, strict=True))
            own.append(ewma(times, values, 5.0, clock.now))
        assert arrays[f"{metric}_ewma"] == pytest.approx(shrunk(own), rel=1e-9)
        # With ~90 samples of evidence each, the shrinkage moves an estimate by about 1% of its distance to the fleet.
        assert arrays[f"{metric}_ewma"] == pytest.approx([value for value, _ in own], rel=0.02)
    counts = [sum(1 for t, e, *_ in seen if e == i and math.floor(t / 10.0) >= oldest) for i in range(5)]
    assert arrays["count"].tolist() == counts


def healthy_fleet(latency: EndpointLatency, start: float, end: float) -> None:
    """Endpoints 1..3 each send a 0.2 s TTFT every 0.1 s in [start, end)."""
    for step in range(round(start * 10), round(end * 10)):
        for endpoint in (1, 2, 3):
            latency.observe(endpoint, 0.2, None, now=step / 10)


@pytest.mark.parametrize(
    ("spell", "half_lives"),
    [
        # After k half-lives without samples, w = spell * 2**-k and the distance to the fleet is 4 * w / (w + 1) of
        # it: under 10% once w < 1/39, i.e. k > log2(39 * spell).
        pytest.param(1, 6, id="one-sample-6-half-lives"),
        pytest.param(10, 9, id="ten-samples-9-half-lives"),
        pytest.param(100, 12, id="hundred-samples-12-half-lives"),
    ],
)
def test_an_endpoint_without_samples_drifts_to_the_fleets_latency(spell: int, half_lives: int) -> None:
    """Endpoint 0 sends ``spell`` slow TTFTs (1.0 s, 5x the others' 0.2 s) at t=0 and nothing after; within the
    stated number of half-lives its estimate is within 10% of the fleet's."""
    latency = EndpointLatency(4, window_s=1000, half_life_s=10, clock=FakeClock(0.0))  # the window outlasts the test
    for _ in range(spell):
        latency.observe(0, 1.0, None, now=0.0)
    healthy_fleet(latency, 0.0, 0.1)
    first = latency.arrays(now=0.0)["ttft_ewma"]
    assert first[0] >= 0.6  # at first its own evidence rules: it looks 3x slower than the others or more
    previous = first[0]
    for k in range(1, half_lives + 1):
        healthy_fleet(latency, 10.0 * (k - 1) + 0.1, 10.0 * k + 0.1)
        estimates = latency.arrays(now=10.0 * k)["ttft_ewma"]
        assert estimates[0] < previous  # it moves toward the fleet with every half-life
        previous = estimates[0]
        assert estimates[1:] == pytest.approx([0.2] * 3, rel=0.05)  # with ~140 samples of evidence each
    assert estimates[0] / 0.2 - 1 < 0.1
    w = spell * 2.0**-half_lives
    assert estimates[0] == pytest.approx((w * 1.0 + 0.2) / (w + 1), rel=1e-3)


def test_an_endpoint_that_stays_slow_keeps_its_own_estimate() -> None:
    """The other side: endpoint 0 sends a fresh 1.0 s TTFT every second (about 15 samples of evidence at a 10 s
    half-life) and its estimate stays within 10% of that, 4x the others'."""
    latency = EndpointLatency(4, window_s=60, half_life_s=10, clock=FakeClock(0.0))
    for second in range(100):
        latency.observe(0, 1.0, None, now=float(second))
        healthy_fleet(latency, float(second), second + 1.0)
    estimates = latency.arrays(now=100.0)["ttft_ewma"]
    assert estimates[0] > 0.9
    assert estimates[1:] == pytest.approx([0.2] * 3, rel=1e-3)


def test_an_endpoint_whose_samples_left_the_window_reads_the_fleets_estimate() -> None:
    latency = EndpointLatency(2, window_s=60, half_life_s=10, clock=FakeClock(0.0))
    latency.observe(0, 1.0, 5.0, now=0.0)
    for t in range(0, 60, 5):
        latency.observe(1, 0.2, 1.0, now=float(t))
    before = latency.arrays(now=59.0)
    assert 0.2 < before["ttft_ewma"][0] < 0.22  # about 6 half-lives on: near the fleet's, not at it
    for t in range(60, 125, 5):
        latency.observe(1, 0.2, 1.0, now=float(t))
    after = latency.arrays(now=120.0)  # out of the window: no evidence at all, so exactly the fleet's, not NaN
    assert np.isnan(after["ttft_p50"][0])
    assert after["ttft_ewma"].tolist() == [0.2, 0.2]
    assert after["e2e_ewma"].tolist() == [1.0, 1.0]


def test_one_endpoint_reads_its_own_ewma() -> None:
    latency = EndpointLatency(1, half_life_s=10, clock=FakeClock())
    samples = ((0.0, 1.0), (5.0, 3.0), (40.0, 2.0))
    for t, value in samples:
        latency.observe(0, value, None, now=t)
    times, values = (np.array(column) for column in zip(*samples, strict=True))
    assert latency.arrays(now=55.0)["ttft_ewma"][0] == pytest.approx(ewma(times, values, 10.0, 55.0)[0], rel=1e-12)


@pytest.mark.parametrize(
    "prior_weight",
    [
        pytest.param(0.0, id="zero"),
        pytest.param(-1.0, id="negative"),
        pytest.param(math.nan, id="nan"),
        pytest.param(math.inf, id="infinite"),
        pytest.param(True, id="bool"),
    ],
)
def test_invalid_prior_weight(prior_weight: float) -> None:
    with pytest.raises(ValueError, match="prior_weight must be a positive finite number"):
        EndpointLatency(2, prior_weight=prior_weight)


def test_prior_weight_is_the_fleets_weight_in_samples() -> None:
    latency = EndpointLatency(2, prior_weight=3.0, clock=FakeClock())
    latency.observe(0, 1.0, None)
    latency.observe(1, 3.0, None)
    # fleet = 2.0; endpoint 0: (1 * 1.0 + 3 * 2.0) / 4; endpoint 1: (1 * 3.0 + 3 * 2.0) / 4.
    assert latency.arrays()["ttft_ewma"].tolist() == [1.75, 2.25]


def test_reads_follow_new_observations() -> None:
    latency = EndpointLatency(3, clock=FakeClock())
    latency.observe(0, 1.0, 1.0)
    first = latency.arrays()
    latency.observe(2, 0.5, 2.0)
    second = latency.arrays()
    assert second["count"].tolist() == [1.0, 0.0, 1.0]
    assert np.array_equal(first["ttft_p50"][:2], second["ttft_p50"][:2], equal_nan=True)
    assert second["e2e_p50"][2] == pytest.approx(2.0, rel=latency.buckets.max_relative_error)


def test_arrays_are_fresh_copies() -> None:
    latency = EndpointLatency(2, clock=FakeClock())
    latency.observe(0, 1.0, 2.0)
    latency.arrays()["ttft_p50"][0] = 123.0
    assert latency.arrays()["ttft_p50"][0] == pytest.approx(1.0, rel=0.03)


def test_everything_expires_with_the_window() -> None:
    clock = FakeClock(1000.0)
    latency = EndpointLatency(2, window_s=60, clock=clock)
    latency.observe(0, 0.2, 1.0)
    clock.now = 1059.0
    assert latency.arrays()["count"].tolist() == [1.0, 0.0]
    clock.now = 1060.0
    arrays = latency.arrays()
    assert arrays["count"].tolist() == [0.0, 0.0]
    assert all(np.isnan(arrays[key]).all() for key in KEYS if key != "count")
    latency.observe(1, 0.3, None)
    arrays = latency.arrays()
    assert arrays["count"].tolist() == [0.0, 1.0]
    assert arrays["ttft_ewma"][1] == pytest.approx(0.3)


def test_rejected_values_in_spans() -> None:
    latency = EndpointLatency(1, clock=FakeClock())
    latency.observe(0, math.nan, 2.0)
    latency.observe(0, -1.0, math.inf)
    latency.observe(0, None, None)
    arrays = latency.arrays()
    assert latency.rejected == 3
    assert arrays["count"].tolist() == [1.0]  # only the span with an accepted value
    assert math.isnan(arrays["ttft_p50"][0])
    assert arrays["e2e_ewma"][0] == 2.0


@pytest.mark.parametrize("endpoint", [-1, 3, 100])
def test_unknown_endpoint_is_an_error(endpoint: int) -> None:
    latency = EndpointLatency(3, clock=FakeClock())
    with pytest.raises(IndexError, match="not in this pool of 3"):
        latency.observe(endpoint, 1.0, 1.0)


def test_empty_pool() -> None:
    arrays = EndpointLatency(0, clock=FakeClock()).arrays()
    assert all(array.shape == (0,) for array in arrays.values())


@pytest.mark.parametrize("size", [-1, 2.0, True])
def test_invalid_size(size: int) -> None:
    with pytest.raises(ValueError, match="size must be an integer"):
        EndpointLatency(size)


def test_endpoint_memory_is_fixed() -> None:
    clock = FakeClock(0.0)
    latency = EndpointLatency(8, clock=clock)
    buckets = latency.buckets.size
    # 6 int32 slices and one int64 window sum per metric, 6 span counts, 9 cached floats, and per metric the EWMA's
    # decayed sum, weight and time of its latest sample, per endpoint.
    per_endpoint = 2 * 6 * buckets * 4 + 2 * buckets * 8 + 6 * 8 + 9 * 8 + 2 * 3 * 8
    assert latency.nbytes == 8 * per_endpoint
    rng = np.random.default_rng(2)
    for t in range(0, 600, 3):
        clock.now = float(t)
        for endpoint in rng.integers(0, 8, 30).tolist():
            latency.observe(endpoint, float(rng.lognormal(-2.0, 2.0)), float(rng.lognormal(1.0, 2.0)))
        latency.arrays()
    assert latency.nbytes == 8 * per_endpoint
    assert latency.arrays()["count"].sum() <= 30 * 20

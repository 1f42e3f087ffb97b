"""Tests for otel/latency.py: the bucket layout and its error bound against numpy, window expiry and EWMA decay on
a fake clock, rejected values, fixed memory, the per-endpoint arrays, and the published estimate's drift toward
the fleet's as an endpoint's evidence ages (tests/otel/test_latency_drift.py closes the loop through the engine)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferlb.otel.latency import QUANTILES, EndpointLatency, Ewma, LogBuckets, LogHistogram, WindowedQuantiles

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


# --- LogHistogram ---


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
    histogram = LogHistogram()
    for value in values.tolist():
        histogram.add(value)
    qs = (0.0, 0.01, 0.25, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)
    assert histogram.count == n
    assert_within_bound(histogram.quantiles(qs), exact_quantiles(values, qs), histogram.buckets)
    assert histogram.quantile(0.99) == histogram.quantiles((0.99,))[0]


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(1e-4, 1e4), min_size=1, max_size=300),
    q=st.floats(0.0, 1.0),
    width=st.sampled_from([0.01, 0.05, 0.2]),
)
def test_any_quantile_is_within_the_bound(values: list[float], q: float, width: float) -> None:
    buckets = LogBuckets(relative_width=width)
    histogram = LogHistogram(buckets)
    for value in values:
        histogram.add(value)
    assert_within_bound(histogram.quantiles((q,)), exact_quantiles(np.asarray(values), (q,)), buckets)


def test_out_of_range_values_are_clamped() -> None:
    histogram = LogHistogram()
    histogram.add(1e-9)
    assert histogram.quantile(0.5) == histogram.buckets.midpoints[0]
    histogram.clear()
    histogram.add(1e9)
    assert histogram.quantile(0.5) == histogram.buckets.midpoints[-1]


def test_rejected_values_are_counted_not_added() -> None:
    histogram = LogHistogram()
    for value in BAD_VALUES:
        histogram.add(value)
    assert (histogram.count, histogram.rejected) == (0, len(BAD_VALUES))
    assert int(histogram.counts.sum()) == 0
    assert math.isnan(histogram.quantile(0.5))
    histogram.add(0.5)
    assert (histogram.count, histogram.rejected) == (1, len(BAD_VALUES))


def test_empty_histogram_quantiles_are_nan() -> None:
    assert all(math.isnan(q) for q in LogHistogram().quantiles())


@pytest.mark.parametrize("q", [pytest.param(-0.1, id="negative"), pytest.param(1.5, id="above-one"), math.nan])
def test_quantile_outside_0_1_is_an_error(q: float) -> None:
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        LogHistogram().quantile(q)


def test_merge_equals_adding_everything_to_one() -> None:
    values = np.random.default_rng(7).lognormal(0.0, 1.0, 1000).tolist()
    a, b, both = LogHistogram(), LogHistogram(), LogHistogram()
    for i, value in enumerate(values):
        (a if i % 3 else b).add(value)
        both.add(value)
    b.add(math.nan)
    a.merge(b)
    assert np.array_equal(a.counts, both.counts)
    assert (a.count, a.rejected) == (1000, 1)
    assert a.quantiles() == both.quantiles()


def test_merge_needs_the_same_layout() -> None:
    with pytest.raises(ValueError, match="different layouts"):
        LogHistogram().merge(LogHistogram(LogBuckets(relative_width=0.1)))


def test_clear_forgets_everything() -> None:
    histogram = LogHistogram()
    histogram.add(1.0)
    histogram.add(-1.0)
    histogram.clear()
    assert (histogram.count, histogram.rejected, int(histogram.counts.sum())) == (0, 0, 0)


def test_histogram_memory_is_fixed() -> None:
    histogram = LogHistogram()
    before = histogram.nbytes
    assert before == histogram.buckets.size * 8
    for value in np.geomspace(1e-7, 1e7, 100_000).tolist():
        histogram.add(value)
    assert histogram.counts.shape == (histogram.buckets.size,)
    assert histogram.counts.dtype == np.int64
    assert histogram.nbytes == before
    assert histogram.count == 100_000
    with pytest.raises(ValueError, match="read-only"):
        histogram.counts[0] = 1


# --- WindowedQuantiles ---


def test_values_expire_a_window_after_their_slice_starts() -> None:
    clock = FakeClock(1000.0)  # a slice boundary: slices are 10 s
    window = WindowedQuantiles(window_s=60, slices=6, clock=clock)
    window.add(0.1)
    clock.now = 1009.9
    window.add(0.1)
    clock.now = 1059.9
    assert window.count() == 2
    assert window.quantiles((0.5,))[0] == pytest.approx(0.1, rel=window.buckets.max_relative_error)
    clock.now = 1060.0
    assert window.count() == 0
    assert all(math.isnan(q) for q in window.quantiles())


def test_only_the_expired_slices_are_dropped() -> None:
    window = WindowedQuantiles(window_s=60, slices=6, clock=FakeClock())
    for _ in range(10):
        window.add(0.1, now=1000.0)
    for _ in range(10):
        window.add(2.0, now=1030.0)
    assert window.count(now=1059.0) == 20
    p50, p99 = window.quantiles((0.5, 0.99), now=1065.0)
    assert window.count(now=1065.0) == 10
    assert p50 == pytest.approx(2.0, rel=window.buckets.max_relative_error)
    assert p99 == p50
    assert window.count(now=1000.0 + 10_000) == 0  # a long silence clears the whole ring


def test_window_matches_a_histogram_of_the_values_it_holds() -> None:
    rng = np.random.default_rng(11)
    window = WindowedQuantiles(window_s=30, slices=3, clock=FakeClock())
    histogram = LogHistogram()
    times = np.sort(rng.uniform(0.0, 100.0, 2000))
    values = rng.lognormal(0.0, 1.0, 2000)
    for t, value in zip(times.tolist(), values.tolist(), strict=True):
        window.add(value, now=t)
        if t >= 80.0:  # slices of 10 s: at t=100 the window holds [80, 110)
            histogram.add(value)
    assert window.count(now=100.0) == histogram.count
    assert window.quantiles((0.1, 0.5, 0.9), now=100.0) == histogram.quantiles((0.1, 0.5, 0.9))


def test_time_never_runs_backwards() -> None:
    window = WindowedQuantiles(window_s=60, slices=6, clock=FakeClock())
    window.add(1.0, now=1100.0)
    window.add(1.0, now=1000.0)  # counts in the newest slice, not in one long expired
    assert window.count(now=1100.0) == 2
    assert window.count(now=1000.0) == 2
    assert window.count(now=1160.0) == 0


def test_window_rejects_bad_values() -> None:
    window = WindowedQuantiles(clock=FakeClock())
    for value in BAD_VALUES:
        window.add(value)
    assert (window.count(), window.rejected) == (0, len(BAD_VALUES))


def test_window_memory_is_fixed() -> None:
    clock = FakeClock(0.0)
    window = WindowedQuantiles(window_s=60, slices=6, clock=clock)
    before = window.nbytes
    assert before == 6 * window.buckets.size * 8
    rng = np.random.default_rng(3)
    for t in range(0, 3600, 2):
        clock.now = float(t)
        for value in rng.lognormal(0.0, 2.0, 20).tolist():
            window.add(value)
    assert window.nbytes == before
    assert window.count() <= 20 * 30


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"window_s": 0}, "window_s must be", id="zero-window"),
        pytest.param({"window_s": math.inf}, "window_s must be", id="infinite-window"),
        pytest.param({"slices": 0}, "slices must be", id="no-slices"),
        pytest.param({"slices": 2.5}, "slices must be", id="fractional-slices"),
    ],
)
def test_invalid_windows(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WindowedQuantiles(**kwargs)


# --- Ewma ---


def test_ewma_is_nan_until_the_first_sample() -> None:
    ewma = Ewma(half_life_s=10, clock=FakeClock())
    assert math.isnan(ewma.value)
    ewma.add(3.0)
    assert ewma.value == 3.0


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
    ewma = Ewma(half_life_s=10)
    for value, now in samples:
        ewma.add(value, now)
    assert ewma.value == pytest.approx(expected, rel=1e-6)


def test_ewma_decays_by_time_not_by_sample_count() -> None:
    rng = np.random.default_rng(5)
    times = np.sort(rng.uniform(0.0, 60.0, 500))
    values = rng.lognormal(0.0, 1.0, 500)
    ewma = Ewma(half_life_s=7.5)
    for value, now in zip(values.tolist(), times.tolist(), strict=True):
        ewma.add(value, now)
    weights = 0.5 ** ((times[-1] - times) / 7.5)
    assert ewma.value == pytest.approx(float((weights * values).sum() / weights.sum()), rel=1e-9)


def test_ewma_rejects_bad_values() -> None:
    ewma = Ewma(clock=FakeClock())
    ewma.add(2.0)
    for value in BAD_VALUES:
        ewma.add(value)
    assert (ewma.value, ewma.rejected) == (2.0, len(BAD_VALUES))


def test_ewma_weight_is_the_evidence_decayed_to_now() -> None:
    clock = FakeClock(0.0)
    ewma = Ewma(half_life_s=10, clock=clock)
    assert ewma.weight() == 0.0
    ewma.add(2.0, now=0.0)
    ewma.add(4.0, now=0.0)
    assert ewma.weight() == 2.0
    clock.now = 30.0
    assert ewma.weight() == pytest.approx(2.0 / 8)  # three half-lives without samples
    assert ewma.value == 3.0  # the mean does not move with time; only the evidence behind it fades
    assert ewma.weight(now=-5.0) == 2.0  # a time before the latest sample counts as that sample's
    ewma.add(1.0)
    assert ewma.weight() == pytest.approx(2.0 / 8 + 1.0)


@pytest.mark.parametrize("half_life_s", [0.0, -1.0, math.nan, math.inf])
def test_invalid_half_life(half_life_s: float) -> None:
    with pytest.raises(ValueError, match="half_life_s must be"):
        Ewma(half_life_s)


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


def shrunk(ewmas: list[Ewma], now: float, prior_weight: float = 1.0) -> np.ndarray:
    """The estimates `EndpointLatency` publishes, from one `Ewma` per endpoint (each with a value in the window)."""
    values = np.array([e.value for e in ewmas])
    weights = np.array([e.weight(now) for e in ewmas])
    fleet = (weights * values).sum() / weights.sum()
    return np.asarray((weights * values + prior_weight * fleet) / (weights + prior_weight))


def test_statistics_match_the_building_blocks() -> None:
    clock = FakeClock(0.0)
    latency = EndpointLatency(5, window_s=30, half_life_s=5, slices=3, clock=clock)
    windows = [[WindowedQuantiles(30, 3, clock) for _ in range(5)] for _ in range(2)]
    ewmas = [[Ewma(5, clock=clock) for _ in range(5)] for _ in range(2)]
    rng = np.random.default_rng(9)
    for step in range(3000):
        clock.now = step * 0.03
        endpoint = int(rng.integers(0, 5))
        ttft, e2e = float(rng.lognormal(-2.0, 0.5)), float(rng.lognormal(1.0, 0.7))
        latency.observe(endpoint, ttft, e2e)
        for m, value in enumerate((ttft, e2e)):
            windows[m][endpoint].add(value)
            ewmas[m][endpoint].add(value)
        if step % 700 == 0:
            latency.arrays()  # reads in between must not change the result
    clock.now += 7.0  # the estimates change without samples too: the evidence fades
    arrays = latency.arrays()
    for m, metric in enumerate(("ttft", "e2e")):
        for endpoint in range(5):
            expected = windows[m][endpoint].quantiles(QUANTILES)
            got = tuple(arrays[f"{metric}_{key}"][endpoint] for key in ("p50", "p95", "p99"))
            assert got == expected
        assert arrays[f"{metric}_ewma"] == pytest.approx(shrunk(ewmas[m], clock.now), rel=1e-9)
        # With ~90 samples of evidence each, the shrinkage moves an estimate by about 1% of its distance to the fleet.
        own = np.array([e.value for e in ewmas[m]])
        assert arrays[f"{metric}_ewma"] == pytest.approx(own, rel=0.02)
    assert arrays["count"].tolist() == [windows[0][e].count() for e in range(5)]


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
    ewma = Ewma(10)
    for t, value in ((0.0, 1.0), (5.0, 3.0), (40.0, 2.0)):
        latency.observe(0, value, None, now=t)
        ewma.add(value, now=t)
    assert latency.arrays(now=55.0)["ttft_ewma"][0] == pytest.approx(ewma.value, rel=1e-12)


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

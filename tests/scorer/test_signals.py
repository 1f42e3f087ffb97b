"""Tests for scorer/signals.py, scorer/loadscorers.py, scorer/filters.py and scorer/pickers.py: table-driven,
on fleets with missing, stale, zero and garbage signals."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import NEUTRAL_SCORE, State
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.filters import MemoryFitFilter, SaturationFilter, StalenessFilter
from inferlb.scorer.inflight import InFlight
from inferlb.scorer.loadscorers import (
    GpuFreeMemoryScorer,
    GpuUtilScorer,
    InFlightTokensScorer,
    KVCacheScorer,
    LatencyScorer,
    LoraAffinityScorer,
    PredictedTTFTScorer,
    QueueScorer,
    RunningScorer,
    SeedFormulaScorer,
    fewer_is_better,
    min_max_low,
)
from inferlb.scorer.pickers import PowerOfTwoPicker, WeightedRandomPicker
from inferlb.scorer.pool import Pool
from inferlb.scorer.promtext import LoraInfo
from inferlb.scorer.signals import Signals, Snapshot

NAN = math.nan
REQUEST = RequestFeatures(model="m", prompt_tokens=1000, max_tokens=100)


def state(n: int = 4, now: float = 100.0, **values) -> State:
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", None) for i in range(n)])
    signals = Signals(n, stale_after_s=1.0)
    if values:
        values.setdefault("scraped_at", [now] * n)
        signals.publish(signals.snapshot.with_values(**values))
    return State(pool, InFlight(n), signals)


ALL = np.arange(4)


def test_an_empty_snapshot_knows_nothing():
    snapshot = Snapshot.empty(3)
    assert np.isnan(snapshot.running).all() and snapshot.up.all()
    assert np.isinf(snapshot.age()).all()
    with pytest.raises(ValueError):
        snapshot.running[0] = 1  # read-only
    with pytest.raises(ValueError, match="shape"):
        snapshot.with_values(running=[1, 2])


def test_signals_publish_swaps_and_checks_the_size():
    signals = Signals(2)
    new = signals.snapshot.with_values(running=[1, 2])
    signals.publish(new)
    assert signals.snapshot is new and signals.published == 1
    with pytest.raises(ValueError, match="pool of 2"):
        signals.publish(Snapshot.empty(3))
    with pytest.raises(ValueError, match="stale_after_s"):
        Signals(2, stale_after_s=0)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param([0, 1, 2, 3], [1, 2 / 3, 1 / 3, 0], id="spread"),
        pytest.param([5, 5, 5, 5], [1, 1, 1, 1], id="all-equal"),
        pytest.param([NAN, 0, 2, NAN], [NEUTRAL_SCORE, 1, 0, NEUTRAL_SCORE], id="missing"),
        pytest.param([NAN] * 4, [NEUTRAL_SCORE] * 4, id="nothing-known"),
    ],
)
def test_min_max_low(values, expected):
    assert min_max_low(np.array(values, dtype=float)) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("values", "unit", "expected"),
    [
        pytest.param([0, 1, 2, 0], 1, [1, 0.5, 1 / 3, 1], id="requests"),
        pytest.param([4096, 0, 8192, NAN], 4096, [0.5, 1, 1 / 3, NEUTRAL_SCORE], id="tokens"),
        pytest.param([NAN] * 4, 1, [NEUTRAL_SCORE] * 4, id="nothing-known"),
    ],
)
def test_fewer_is_better(values, unit, expected):
    assert fewer_is_better(np.array(values, dtype=float), unit) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("scorer", "values", "expected"),
    [
        pytest.param(QueueScorer(), {"waiting": [0, 3, NAN, 1]}, [1, 0.25, NEUTRAL_SCORE, 0.5], id="queue"),
        pytest.param(RunningScorer(), {"running": [10, 0, 5, NAN]}, [0, 1, 0.5, NEUTRAL_SCORE], id="running"),
        pytest.param(KVCacheScorer(), {"kv_usage": [0.0, 0.9, NAN, 7.0]}, [1, 0.1, NEUTRAL_SCORE, 0], id="kv-garbage"),
        pytest.param(GpuUtilScorer(), {"gpu_util": [0.2, 1.0, NAN, -3]}, [0.8, 0, NEUTRAL_SCORE, 1], id="gpu-util"),
        pytest.param(
            GpuFreeMemoryScorer(),
            {"gpu_free_bytes": [10, 0, NAN, 5], "gpu_total_bytes": [10, 10, 10, 0]},
            [1, 0, NEUTRAL_SCORE, NEUTRAL_SCORE],
            id="gpu-memory-zero-total",
        ),
        pytest.param(
            LatencyScorer(), {"ttft_s": [0.1, 0.2, NAN, 0.0]}, [1, 0.5, NEUTRAL_SCORE, NEUTRAL_SCORE], id="latency"
        ),
        pytest.param(LatencyScorer(), {}, [NEUTRAL_SCORE] * 4, id="latency-no-spans-yet"),
    ],
)
def test_signal_scorers(scorer, values, expected):
    got = scorer.score(REQUEST, state(**values), ALL)
    assert got == pytest.approx(expected)
    assert ((got >= 0) & (got <= 1)).all()


def test_in_flight_tokens_and_predicted_ttft_use_the_pickers_own_counts():
    s = state()
    s.inflight.acquire(1, 8192)
    s.inflight.acquire(2, 2000)
    assert InFlightTokensScorer().score(REQUEST, s, ALL) == pytest.approx([1, 1 / 3, 1 / (1 + 2000 / 4096), 1])
    predicted = PredictedTTFTScorer().score(REQUEST, s, ALL)
    # (queued + 1000) tokens of work: 1000, 9192, 3000, 1000
    assert predicted == pytest.approx([1, 1000 / 9192, 1000 / 3000, 1])


def test_predicted_ttft_counts_the_prefix_an_endpoint_holds_and_its_learned_rate():
    class Match:
        def match(self, hashes):
            return np.array([0, 10, 0, 0])

    request = RequestFeatures(model="m", prompt_tokens=1000, prefix_hashes=tuple(range(15)))
    s = state(prefill_tokens_per_s=[NAN, NAN, NAN, 80_000.0])
    got = PredictedTTFTScorer(Match(), block_tokens=64).score(request, s, ALL)
    # endpoint 1 holds 640 of the 1000 tokens; endpoint 3 is 4x faster than the default rate
    costs = np.array([1000 / 20_000, 360 / 20_000, 1000 / 20_000, 1000 / 80_000])
    assert got == pytest.approx(costs.min() / costs)


def test_seed_formula_is_floored_and_neutral_where_unknown():
    s = state(gpu_util=[0.0, 1.0, NAN, 1.0], waiting=[0, 64, NAN, 64], e2e_s=[1.0, 2.0, NAN, 100.0])
    got = SeedFormulaScorer(max_queue=32, floor=0.05).score(REQUEST, s, ALL)
    assert got[0] == pytest.approx(1.0)
    assert got[1] == pytest.approx((0 + 0 + 0.5) / 3)
    assert got[2] == pytest.approx(NEUTRAL_SCORE)
    assert got[3] == pytest.approx(0.05)


def test_staleness_filter_against_the_clock():
    now = time.monotonic()
    s = state(running=[0] * 4, scraped_at=[now, now - 5, now, NAN])
    assert list(StalenessFilter().filter(REQUEST, s, ALL)) == [0, 2]
    down = state(running=[0] * 4, scraped_at=[now] * 4, up=[True, False, True, True])
    assert list(StalenessFilter().filter(REQUEST, down, ALL)) == [0, 2, 3]
    never = state()  # nothing ever scraped: all stale, all kept
    assert list(StalenessFilter().filter(REQUEST, never, ALL)) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param({"waiting": [0, 20, 3, NAN]}, [0, 2, 3], id="queue"),
        pytest.param({"kv_usage": [0.5, 0.99, NAN, 0.2]}, [0, 2, 3], id="kv"),
        pytest.param({"waiting": [50, 50, 50, 50]}, [0, 1, 2, 3], id="all-saturated-keeps-all"),
    ],
)
def test_saturation_filter(values, expected):
    assert list(SaturationFilter(max_waiting=16, max_kv_usage=0.95).filter(REQUEST, state(**values), ALL)) == expected


def test_memory_fit_filter_needs_1_3_times_the_estimate():
    need = 1.3 * 1000 * (1000 + 100)  # bytes_per_token 1000, prompt 1000, max_tokens 100
    s = state(gpu_free_bytes=[need, need - 1, NAN, 10 * need])
    assert list(MemoryFitFilter(bytes_per_token=1000).filter(REQUEST, s, ALL)) == [0, 2, 3]
    full = state(gpu_free_bytes=[0, 0, 0, 0])
    assert list(MemoryFitFilter(bytes_per_token=1000).filter(REQUEST, full, ALL)) == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [{"max_waiting": -1}, {"max_kv_usage": 0}, {"max_kv_usage": 1.5}])
def test_saturation_refuses_bad_thresholds(bad):
    with pytest.raises(ValueError):
        SaturationFilter(**bad)


def test_weighted_random_follows_the_scores():
    picker = WeightedRandomPicker(np.random.default_rng(1))
    totals = np.array([0.0, 1.0, 3.0])
    counts = np.bincount([picker.pick(REQUEST, ALL[:3], totals) for _ in range(4000)], minlength=3)
    assert counts[0] == 0
    assert counts[2] / counts[1] == pytest.approx(3, rel=0.15)
    zeros = [picker.pick(REQUEST, ALL[:3], np.zeros(3)) for _ in range(300)]
    assert set(zeros) == {0, 1, 2}


def test_power_of_two_never_picks_the_worst_of_three_and_spreads_the_rest():
    picker = PowerOfTwoPicker(np.random.default_rng(2))
    totals = np.array([1.0, 0.0, 0.9])
    counts = np.bincount([picker.pick(REQUEST, ALL[:3], totals) for _ in range(3000)], minlength=3)
    assert counts[1] == 0
    assert counts[0] == pytest.approx(2000, rel=0.1) and counts[2] == pytest.approx(1000, rel=0.15)
    assert picker.pick(REQUEST, ALL[:1], np.array([0.3])) == 0


def test_lora_affinity_prefers_loaded_adapters_then_free_slots():
    s = state()
    lora = [
        LoraInfo(running=("sql",), waiting=(), max_lora=2),  # has it
        LoraInfo(running=("chat",), waiting=(), max_lora=2),  # a slot free
        LoraInfo(running=("chat", "math"), waiting=(), max_lora=2),  # full
        None,  # does not report LoRA state
    ]
    s.signals.publish(s.signals.snapshot.with_values(lora=lora))
    scorer = LoraAffinityScorer()
    sql = RequestFeatures(model="sql")
    assert scorer.score(sql, s, ALL) == pytest.approx([1.0, 0.5, 0.0, NEUTRAL_SCORE])
    assert scorer.score(sql, s, ALL) is scorer.score(sql, s, ALL)  # computed once per scrape and model
    base = RequestFeatures(model="base-model")  # loaded nowhere: not an adapter, or not loaded yet
    assert scorer.score(base, s, ALL) == pytest.approx([NEUTRAL_SCORE] * 4)

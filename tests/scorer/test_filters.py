"""Tests for scorer/filters.py: table-driven, on fleets with fresh, stale, missing, zero and garbage signals.

Every filter returns a subset of its candidates in their order, and never empties the list on its own: when it
would drop them all, it keeps them all."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest

from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import State
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.filters import (
    MemoryFitFilter,
    SaturationFilter,
    SpeedClassFilter,
    StalenessFilter,
    TtftGapFilter,
    TtftSloFilter,
)
from inferlb.scorer.inflight import InFlight
from inferlb.scorer.loadscorers import DEFAULT_PREFILL_TOKENS_PER_S
from inferlb.scorer.pool import Pool
from inferlb.scorer.saturation import Saturation
from inferlb.scorer.signals import Signals

NAN = math.nan
INF = math.inf
REQUEST = RequestFeatures(model="m", prompt_tokens=1000, max_tokens=100)
# Long enough that a test never sees a fresh scrape go stale while it runs.
STALE_AFTER_S = 30.0


def state(n: int = 4, saturation: Saturation | None = None, **values: Any) -> State:
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", None) for i in range(n)])
    signals = Signals(n, stale_after_s=STALE_AFTER_S)
    if values:
        signals.publish(signals.snapshot.with_values(**values))
    return State(pool, InFlight(n), signals, saturation or Saturation())


def check_subset(kept: np.ndarray, candidates: np.ndarray) -> None:
    """What every filter promises: a non-empty subset of the candidates, in their order."""
    assert len(kept) > 0
    positions = [list(candidates).index(c) for c in kept]
    assert positions == sorted(set(positions))


# ---------------------------------------------------------------- staleness


@pytest.mark.parametrize(
    ("ages", "up", "candidates", "expected"),
    [
        pytest.param([0, 0, 0, 0], None, [0, 1, 2, 3], [0, 1, 2, 3], id="all-fresh"),
        pytest.param([0, 60, 0, 0], None, [0, 1, 2, 3], [0, 2, 3], id="one-stale"),
        pytest.param([0, 1, STALE_AFTER_S - 5, 0], None, [0, 1, 2, 3], [0, 1, 2, 3], id="old-but-within-stale-after"),
        pytest.param([0, NAN, 0, 0], None, [0, 1, 2, 3], [0, 2, 3], id="never-scraped"),
        pytest.param([0, 0, 0, 0], [True, False, True, True], [0, 1, 2, 3], [0, 2, 3], id="last-scrape-failed"),
        pytest.param([0, 0, 60, 0], [True, False, True, True], [0, 1, 2, 3], [0, 3], id="stale-and-down"),
        pytest.param([60, 60, 60, 60], None, [0, 1, 2, 3], [0, 1, 2, 3], id="all-stale-keeps-all"),
        pytest.param([NAN] * 4, None, [0, 1, 2, 3], [0, 1, 2, 3], id="nothing-scraped-keeps-all"),
        pytest.param([0] * 4, [False] * 4, [0, 1, 2, 3], [0, 1, 2, 3], id="all-down-keeps-all"),
        pytest.param([0, 60, 0, 0], None, [1, 2], [2], id="subset-of-candidates"),
        pytest.param([0, 60, 0, 60], None, [1, 3], [1, 3], id="every-candidate-stale-keeps-them"),
        pytest.param([0, 60, 0, 0], None, [1], [1], id="single-stale-candidate-kept"),
        pytest.param([0, INF, 0, 0], None, [0, 1, 2, 3], [0, 2, 3], id="garbage-minus-inf-timestamp"),
    ],
)
def test_staleness_filter(ages: list[float], up: list[bool] | None, candidates: list[int], expected: list[int]) -> None:
    now = time.monotonic()
    values: dict[str, Any] = {"running": [0] * 4, "scraped_at": [now - age for age in ages]}
    if up is not None:
        values["up"] = up
    given = np.array(candidates)
    kept = StalenessFilter().filter(REQUEST, state(**values), given)
    assert list(kept) == expected
    check_subset(kept, given)


def test_staleness_filter_on_an_empty_snapshot_keeps_all() -> None:
    # Nothing ever published: every endpoint is stale, so all are kept.
    assert list(StalenessFilter().filter(REQUEST, state(), np.arange(4))) == [0, 1, 2, 3]


# ---------------------------------------------------------------- saturation


@pytest.mark.parametrize(
    ("params", "values", "candidates", "expected"),
    [
        pytest.param({}, {"waiting": [0, 20, 3, NAN]}, [0, 1, 2, 3], [0, 2, 3], id="queue"),
        pytest.param({}, {"kv_usage": [0.5, 0.99, NAN, 0.2]}, [0, 1, 2, 3], [0, 2, 3], id="kv"),
        pytest.param(
            {},
            {"waiting": [16, 17, 0, 0], "kv_usage": [0.95, 0, 0.96, 0]},
            [0, 1, 2, 3],
            [0, 3],
            id="at-threshold-passes",
        ),
        pytest.param(
            {}, {"waiting": [NAN] * 4, "kv_usage": [NAN] * 4}, [0, 1, 2, 3], [0, 1, 2, 3], id="unknown-passes"
        ),
        pytest.param({}, {"waiting": [0, 0, 0, 0], "kv_usage": [0, 0, 0, 0]}, [0, 1, 2, 3], [0, 1, 2, 3], id="zeros"),
        pytest.param({}, {"waiting": [50, 50, 50, 50]}, [0, 1, 2, 3], [0, 1, 2, 3], id="all-saturated-keeps-all"),
        pytest.param({}, {"waiting": [-5, INF, 0, 0], "kv_usage": [-1, 0, 7, 0]}, [0, 1, 2, 3], [0, 3], id="garbage"),
        pytest.param({}, {"waiting": [0, 20, 0, 20]}, [1, 2, 3], [2], id="subset-of-candidates"),
        pytest.param({}, {"waiting": [0, 20, 0, 0]}, [1], [1], id="single-saturated-candidate-kept"),
        pytest.param({"max_waiting": 0}, {"waiting": [0, 1, 0, 2]}, [0, 1, 2, 3], [0, 2], id="max-waiting-zero"),
        pytest.param({"max_waiting": INF}, {"waiting": [0, 1e9, 0, 0]}, [0, 1, 2, 3], [0, 1, 2, 3], id="queue-ignored"),
        pytest.param(
            {"max_kv_usage": 1}, {"kv_usage": [1.0, 0.5, 1.01, 0]}, [0, 1, 2, 3], [0, 1, 3], id="kv-full-is-ok"
        ),
    ],
)
def test_saturation_filter(
    params: dict[str, float], values: dict[str, list[float]], candidates: list[int], expected: list[int]
) -> None:
    given = np.array(candidates)
    kept = SaturationFilter().filter(REQUEST, state(saturation=Saturation(**params), **values), given)
    assert list(kept) == expected
    check_subset(kept, given)


def test_saturation_filter_follows_a_new_snapshot() -> None:
    s = state(waiting=[0, 20, 0, 0])
    flt = SaturationFilter()
    assert list(flt.filter(REQUEST, s, np.arange(4))) == [0, 2, 3]
    s.signals.publish(s.signals.snapshot.with_values(waiting=[20, 0, 0, 0]))
    assert list(flt.filter(REQUEST, s, np.arange(4))) == [1, 2, 3]


@pytest.mark.parametrize(
    ("waiting", "inflight_at_scrape", "requests", "expected"),
    [
        pytest.param([0, 10, 10, 0], [5, 5, 5, 5], [5, 12, 11, 5], [0, 2, 3], id="growth-since-scrape-fills-a-queue"),
        pytest.param([0, 10, 16, 0], [5, 5, 5, 5], [5, 11, 5, 5], [0, 1, 2, 3], id="at-threshold-passes"),
        pytest.param([0, 0, 0, 0], [NAN, 0, 0, 0], [30, 0, 0, 0], [0, 1, 2, 3], id="unknown-count-adds-nothing"),
        pytest.param([NAN, 0, 0, 0], [0, 0, 0, 0], [30, 0, 0, 0], [0, 1, 2, 3], id="unknown-queue-passes"),
        pytest.param([0, 0, 0, 0], [9, 0, 0, 0], [3, 0, 0, 0], [0, 1, 2, 3], id="fewer-than-at-scrape-counts-zero"),
        pytest.param([0, 0, 0, 0], [40, 40, 0, 0], [40, 57, 16, 0], [0, 2, 3], id="in-flight-at-scrape-not-queued"),
        pytest.param([20, 0, 0, 0], [0, 0, 0, 0], [0, 17, 17, 17], [0, 1, 2, 3], id="all-over-keeps-all"),
    ],
)
def test_saturation_counts_the_growth_in_flight_since_the_scrape(
    waiting: list[float], inflight_at_scrape: list[float], requests: list[int], expected: list[int]
) -> None:
    s = state(waiting=waiting, inflight_at_scrape=inflight_at_scrape)
    s.inflight.requests[:] = requests
    kept = SaturationFilter().filter(REQUEST, s, np.arange(4))
    assert list(kept) == expected


@pytest.mark.parametrize("seed", range(10))
def test_the_saturation_rules_cached_answer_is_always_the_fresh_one(seed: int) -> None:
    # The rule answers from a cache between decisions and releases; a new Saturation, with no cache, must agree at
    # every step of a random run of decisions, releases and scrapes.
    rng = np.random.default_rng(seed)
    s = state(waiting=[14, 2, 0, 16], inflight_at_scrape=[0, 0, 0, 0])
    leases = []
    for _ in range(400):
        step = rng.random()
        if step < 0.55:
            leases.append(s.inflight.acquire(int(rng.integers(4)), 10))
        elif step < 0.9 and leases:
            leases.pop(int(rng.integers(len(leases)))).release()
        elif step < 0.95 and leases:  # served elsewhere: a count rises without a decision
            leases[int(rng.integers(len(leases)))].move(int(rng.integers(4)))
        else:
            waiting = rng.integers(0, 20, size=4).astype(float)
            snapshot = s.signals.snapshot.with_values(
                waiting=waiting, inflight_at_scrape=s.inflight.requests.astype(float)
            )
            s.signals.publish(snapshot)
        fresh = Saturation().over(s.signals, s.inflight)
        assert s.saturation.over(s.signals, s.inflight).tolist() == fresh.tolist()


def test_requests_that_run_at_once_are_not_a_queue() -> None:
    # 30 in flight on endpoint 1 when it was scraped with nothing queued (the server runs them all), 20 sent since
    # and 20 ended since: its queue cannot have grown. Counting the 20 sent since that were still in flight held it
    # (and, with every endpoint like it, the requests in admission) as saturated.
    s = state(waiting=[0, 0, 0, 0], inflight_at_scrape=[0, 30, 0, 0])
    running = [s.inflight.acquire(1, 10) for _ in range(30)]
    for _ in range(20):
        s.inflight.acquire(1, 10)
    for lease in running[:20]:
        lease.release()
    assert s.inflight.requests[1] == 30 and s.inflight.sent[1] == 50
    assert list(SaturationFilter().filter(REQUEST, s, np.arange(4))) == [0, 1, 2, 3]


def test_requests_sent_since_the_scrape_that_have_ended_are_not_queued() -> None:
    # 12 sent to endpoint 1 since the scrape (10 queued then), 8 of them answered already: at most 4 can have joined
    # its queue, so it is not over 16. Before, all 12 counted, and servers that answer fast were held as saturated.
    s = state(waiting=[0, 10, 0, 0], inflight_at_scrape=[0, 0, 0, 0])
    leases = [s.inflight.acquire(1, 10) for _ in range(12)]
    assert list(SaturationFilter().filter(REQUEST, s, np.arange(4))) == [0, 2, 3]
    for lease in leases[:8]:
        lease.release()
    assert list(SaturationFilter().filter(REQUEST, s, np.arange(4))) == [0, 1, 2, 3]


def test_saturation_stops_herding_onto_the_endpoints_last_seen_idle() -> None:
    """Between two scrapes the endpoints last seen under the threshold stop taking requests once what was sent
    them fills their queues; the next scrape starts the count again."""
    s = state(waiting=[17, 17, 14, 12], inflight_at_scrape=[0, 0, 0, 0])
    flt = SaturationFilter()
    taken = []
    for _ in range(10):
        kept = flt.filter(REQUEST, s, np.arange(4))
        chosen = int(kept[np.argmin(s.inflight.sent[kept])])  # least sent among those kept
        s.inflight.acquire(chosen, 100)
        taken.append(chosen)
    # Over 16 waiting is saturated: 2 takes 3 more (up to 17), 3 takes 5.
    assert taken[:8] == [2, 3, 2, 3, 2, 3, 3, 3]
    assert sorted(taken[8:]) == [0, 1]  # then every endpoint is over: all are kept again
    assert s.inflight.sent.tolist() == [1, 1, 3, 5]
    s.signals.publish(s.signals.snapshot.with_values(waiting=[0, 16, 17, 16], inflight_at_scrape=s.inflight.requests))
    assert list(flt.filter(REQUEST, s, np.arange(4))) == [0, 1, 3]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        pytest.param({"max_waiting": -1}, r"^max_waiting must be >= 0; got -1$", id="negative-waiting"),
        pytest.param({"max_waiting": NAN}, r"^max_waiting must be >= 0; got nan$", id="nan-waiting"),
        pytest.param({"max_kv_usage": 0}, r"^max_kv_usage must be in \(0, 1\]; got 0$", id="kv-zero"),
        pytest.param({"max_kv_usage": 1.5}, r"^max_kv_usage must be in \(0, 1\]; got 1.5$", id="kv-above-one"),
    ],
)
def test_saturation_refuses_bad_thresholds(params: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Saturation(**params)


def test_on_unequal_servers_the_queue_limit_is_the_fastest_ones_time() -> None:
    # Declared speeds 4 : 4 : 1 : 1 and max_waiting 16: the slow servers are saturated past 4 queued, where the fast
    # ones clear 16 in the same time. Without speeds (or with equal ones) every endpoint's limit is 16.
    speeds = np.array([4.0, 4.0, 1.0, 1.0])
    queued = {"waiting": [10, 17, 3, 5], "kv_usage": [0.1] * 4, "inflight_at_scrape": [0, 0, 0, 0]}
    st = state(saturation=Saturation(16, speeds=speeds), **queued)
    assert st.saturation.over(st.signals, st.inflight).tolist() == [False, True, False, True]
    assert SaturationFilter().filter(REQUEST, st, np.arange(4)).tolist() == [0, 2]
    even = state(saturation=Saturation(16, speeds=np.ones(4)), **queued)
    assert even.saturation.over(even.signals, even.inflight).tolist() == [False, True, False, False]
    plain = state(**queued)
    assert plain.saturation.over(plain.signals, plain.inflight).tolist() == [False, True, False, False]
    # Requests sent since the scrape count against the scaled limit too: two more on the slow server 2 saturate it.
    st.inflight.acquire(2, 10)
    assert not st.saturation.over(st.signals, st.inflight)[2]
    st.inflight.acquire(2, 10)
    assert st.saturation.over(st.signals, st.inflight).tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="speeds must be positive"):
        Saturation(16, speeds=np.array([1.0, 0.0]))


# ---------------------------------------------------------------- memory fit

# bytes_per_token 1000, margin 1.3, prompt 1000 + max_tokens 100: 1.43 MB needed.
NEED = 1.3 * 1000 * (1000 + 100)


@pytest.mark.parametrize(
    ("params", "request_", "free", "candidates", "expected"),
    [
        pytest.param({}, REQUEST, [NEED, NEED - 1, NAN, 10 * NEED], [0, 1, 2, 3], [0, 2, 3], id="exactly-enough-fits"),
        pytest.param({}, REQUEST, [NAN] * 4, [0, 1, 2, 3], [0, 1, 2, 3], id="unknown-passes"),
        pytest.param({}, REQUEST, [0, 0, 0, 0], [0, 1, 2, 3], [0, 1, 2, 3], id="none-fits-keeps-all"),
        pytest.param({}, REQUEST, [0, NEED, 0, 0], [0, 1, 2, 3], [1], id="zeros-but-one"),
        pytest.param({}, REQUEST, [-1, INF, -INF, NEED], [0, 1, 2, 3], [1, 3], id="garbage"),
        pytest.param({}, REQUEST, [NEED] * 4, [0, 1, 2, 3], [0, 1, 2, 3], id="all-equal"),
        pytest.param({}, REQUEST, [0, NEED, 0, NEED], [0, 1, 2], [1], id="subset-of-candidates"),
        pytest.param({}, REQUEST, [0, 0, 0, 0], [2], [2], id="single-candidate-that-does-not-fit"),
        pytest.param({"margin": 1}, REQUEST, [1000 * 1100, 1000 * 1100 - 1, 0, 0], [0, 1, 2, 3], [0], id="margin-1"),
        pytest.param(
            {"default_output_tokens": 0},
            RequestFeatures(model="m", prompt_tokens=1000),
            [1.3e6, 1.3e6 - 1, 0, 0],
            [0, 1, 2, 3],
            [0],
            id="no-max-tokens-uses-default-output",
        ),
        pytest.param(
            {},
            RequestFeatures(model="m", prompt_tokens=1000),
            [1.3 * 1000 * 1256, 1.3 * 1000 * 1255, 0, 0],
            [0, 1, 2, 3],
            [0],
            id="default-output-256",
        ),
        pytest.param(
            {},
            RequestFeatures(model="m", prompt_tokens=0, max_tokens=0),
            [0, -1, NAN, 5],
            [0, 1, 2, 3],
            [0, 2, 3],
            id="empty-request-needs-nothing",
        ),
    ],
)
def test_memory_fit_filter(
    params: dict[str, float], request_: RequestFeatures, free: list[float], candidates: list[int], expected: list[int]
) -> None:
    given = np.array(candidates)
    kept = MemoryFitFilter(bytes_per_token=1000, **params).filter(request_, state(gpu_free_bytes=free), given)
    assert list(kept) == expected
    check_subset(kept, given)


# ---------------------------------------------------------------- ttft-slo


class FixedMatch:
    """Prefix matches per endpoint (blocks of the request each endpoint holds), as the prefix index gives them."""

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = np.array(blocks, dtype=np.float64)

    def match(self, hashes: tuple[int, ...]) -> np.ndarray:
        return self.blocks


# The default prefill rate is 20,000 tokens/s: 1,000 prompt tokens alone take 50 ms.
@pytest.mark.parametrize(
    ("slo", "backlog", "rates", "cached_blocks", "expected"),
    [
        pytest.param(None, [10**6] * 4, None, None, [0, 1, 2, 3], id="no-objective-passes-all"),
        pytest.param(0.5, [0, 0, 0, 0], None, None, [0, 1, 2, 3], id="all-meet-it"),
        pytest.param(0.5, [0, 20_000, 9_000, 0], None, None, [0, 2, 3], id="a-long-queue-misses-it"),
        pytest.param(0.1, [0, 0, 0, 0], [NAN, 5_000, 20_000, 0], None, [0, 2, 3], id="a-slow-learned-rate-misses"),
        pytest.param(0.06, [500, 500, 0, 0], None, [0, 30, 0, 0], [1, 2, 3], id="a-cached-prefix-helps"),
        pytest.param(0.01, [0, 0, 0, 0], None, None, [0, 1, 2, 3], id="none-can-keeps-all"),
    ],
)
def test_ttft_slo_filter(
    slo: float | None,
    backlog: list[int],
    rates: list[float] | None,
    cached_blocks: list[int] | None,
    expected: list[int],
) -> None:
    st = state(prefill_tokens_per_s=rates) if rates is not None else state()
    st.inflight.clock = lambda: 0.0
    for i, tokens in enumerate(backlog):  # prompt tokens sent there and not yet prefilled
        st.inflight.acquire(i, 0, (tokens, DEFAULT_PREFILL_TOKENS_PER_S)).release()
    request = RequestFeatures(model="m", prompt_tokens=1000, prefix_hashes=(1, 2), ttft_slo_s=slo)
    # Tokens alone (attention_tokens=0): "a-long-queue-misses-it" sits on the objective, 0.5 s exactly.
    flt = TtftSloFilter(
        FixedMatch(cached_blocks) if cached_blocks is not None else None, block_tokens=64, attention_tokens=0
    )
    candidates = np.arange(4)
    kept = flt.filter(request, st, candidates)
    check_subset(kept, candidates)
    assert kept.tolist() == expected


# ---------------------------------------------------------------- ttft-gap

# Two fast servers (40,000 prompt tokens/s) and two four times slower; a 1,000-token prompt takes 25 ms alone on a
# fast one, 100 ms on a slow one. The backlog is prompt tokens sent and not yet prefilled.
GAP_RATES = [40_000.0, 40_000.0, 10_000.0, 10_000.0]


@pytest.mark.parametrize(
    ("backlog", "expected"),
    [
        pytest.param([0, 0, 0, 0], [0, 1, 2, 3], id="all-close"),
        pytest.param([0, 0, 0, 40_000], [0, 1, 2], id="a-slow-server-seconds-behind-is-dropped"),
        pytest.param([0, 80_000, 0, 0], [0, 1, 2, 3], id="a-fast-server-seconds-behind-stays"),
        pytest.param([0, 0, 0, 5_000], [0, 1, 2, 3], id="under-a-second-behind-stays"),
        # Best 2.0 s; 3.2 s is over a second behind but not twice as long.
        pytest.param([79_000, 79_000, 19_000, 31_000], [0, 1, 2, 3], id="not-twice-as-long-stays"),
        pytest.param([79_000, 79_000, 19_000, 90_000], [0, 1, 2], id="twice-as-long-and-a-second-behind-is-dropped"),
        pytest.param([0, 0, 40_000, 40_000], [0, 1], id="both-slow-ones-dropped"),
    ],
)
def test_ttft_gap_filter(backlog: list[int], expected: list[int]) -> None:
    st = state(prefill_tokens_per_s=GAP_RATES, peak_tokens_per_s=GAP_RATES)
    st.inflight.clock = lambda: 0.0
    for i, tokens in enumerate(backlog):
        st.inflight.acquire(i, 0, (tokens, GAP_RATES[i])).release()
    candidates = np.arange(4)
    kept = TtftGapFilter().filter(REQUEST, st, candidates)
    check_subset(kept, candidates)
    assert kept.tolist() == expected


def test_ttft_gap_filter_follows_its_bounds() -> None:
    st = state(prefill_tokens_per_s=GAP_RATES, peak_tokens_per_s=GAP_RATES)
    st.inflight.clock = lambda: 0.0
    st.inflight.acquire(3, 0, (5_000, GAP_RATES[3])).release()  # 0.6 s against the best's 25 ms
    candidates = np.arange(4)
    assert TtftGapFilter(seconds=0.5).filter(REQUEST, st, candidates).tolist() == [0, 1, 2]
    assert TtftGapFilter(seconds=0.5, factor=30.0).filter(REQUEST, st, candidates).tolist() == [0, 1, 2, 3]
    # Four times slower counts as slower only under slower=0.25 and above.
    assert TtftGapFilter(seconds=0.5, slower=0.2).filter(REQUEST, st, candidates).tolist() == [0, 1, 2, 3]
    assert TtftGapFilter(seconds=0.5, slower=0.3).filter(REQUEST, st, candidates).tolist() == [0, 1, 2]
    assert TtftGapFilter().filter(REQUEST, st, np.array([3])).tolist() == [3]


@pytest.mark.parametrize(
    "peaks",
    [
        pytest.param([NAN, NAN, NAN, NAN], id="peaks-not-yet-learned"),
        pytest.param([40_000.0, 40_000.0, 40_000.0, 40_000.0], id="equal-hardware-a-busy-server-learned-slow"),
    ],
)
def test_ttft_gap_filter_drops_no_server_it_does_not_know_to_be_slower(peaks: list[float]) -> None:
    # The learned rates say the last two are four times slower, but the rates they prefill at when idle are
    # equal (or unknown): their gap is queueing, which the load scorers weigh, so nothing is dropped.
    st = state(prefill_tokens_per_s=GAP_RATES, peak_tokens_per_s=peaks)
    st.inflight.clock = lambda: 0.0
    st.inflight.acquire(3, 0, (40_000, GAP_RATES[3])).release()
    assert TtftGapFilter().filter(REQUEST, st, np.arange(4)).tolist() == [0, 1, 2, 3]


def test_ttft_gap_filter_judges_a_server_whose_idle_rate_is_unknown_by_its_learned_rate() -> None:
    # The fast servers' idle rates are known, the slow ones' not (seldom found idle, as on a mixed fleet): their
    # learned rates, at most what they do idle, stand in. Four times slower and seconds behind: dropped.
    peaks = [40_000.0, 40_000.0, NAN, NAN]
    st = state(prefill_tokens_per_s=GAP_RATES, peak_tokens_per_s=peaks)
    st.inflight.clock = lambda: 0.0
    st.inflight.acquire(3, 0, (40_000, GAP_RATES[3])).release()
    assert TtftGapFilter().filter(REQUEST, st, np.arange(4)).tolist() == [0, 1, 2]


# ---------------------------------------------------------------- speed-class

# Two fast servers (40,000 prompt tokens/s) and two four times slower, declared so (pool.speeds).
CLASS_SPEEDS = np.array([4.0, 4.0, 1.0, 1.0])


def _class_state(backlog: list[int], *, exact: bool = True) -> State:
    st = state(prefill_tokens_per_s=GAP_RATES, peak_tokens_per_s=GAP_RATES)
    st.inflight.clock = lambda: 0.0
    st.inflight.first_tokens = exact
    for i, tokens in enumerate(backlog):
        st.inflight.acquire(i, 0, (tokens, GAP_RATES[i]), streamed=True)
    return st


# REQUEST's 1,000 prompt tokens take 0.025 s on a fast server and 0.1 s on a slow one; the backlogs below are in
# prompt tokens, so a fast server with 30,000 waits 0.775 s and a slow one with 8,000 0.9 s.
@pytest.mark.parametrize("exact", [True, False], ids=["timed", "estimated"])
@pytest.mark.parametrize(
    ("backlog", "expected"),
    [
        # The slow servers hold fewer tokens but are predicted later: the load scorers must not get to choose them.
        pytest.param([30_000, 30_000, 8_000, 8_000], [0, 1], id="fast-ones-busier-still-sooner"),
        pytest.param([200_000, 160_000, 10_000, 12_000], [2, 3], id="fast-ones-seconds-behind-the-slow-kind"),
        # Below min_wait_s (0.75 s) even at best: the first token waits mostly on decode steps the prediction does
        # not see, so the kind is left to the scorers.
        pytest.param([0, 0, 0, 0], [0, 1, 2, 3], id="idle-all-stay"),
        pytest.param([20_000, 20_000, 0, 0], [0, 1, 2, 3], id="short-waits-all-stay"),
    ],
)
def test_speed_class_filter_keeps_the_kind_of_server_predicted_soonest_when_the_wait_is_long(
    backlog: list[int], expected: list[int], exact: bool
) -> None:
    # Timed responses (an exact backlog) or spans (an estimate): the filter acts on either.
    st = _class_state(backlog, exact=exact)
    candidates = np.arange(4)
    kept = SpeedClassFilter(speeds=CLASS_SPEEDS).filter(REQUEST, st, candidates)
    check_subset(kept, candidates)
    assert kept.tolist() == expected


def test_speed_class_filter_min_wait_s_sets_where_it_acts() -> None:
    candidates = np.arange(4)
    st = _class_state([0, 0, 0, 0])
    assert SpeedClassFilter(speeds=CLASS_SPEEDS, min_wait_s=0.0).filter(REQUEST, st, candidates).tolist() == [0, 1]
    st = _class_state([30_000, 30_000, 8_000, 8_000])  # 0.775 s at best
    assert SpeedClassFilter(speeds=CLASS_SPEEDS, min_wait_s=0.8).filter(REQUEST, st, candidates).tolist() == [
        0,
        1,
        2,
        3,
    ]


def test_speed_class_filter_keeps_all_without_declared_speeds_or_a_second_kind() -> None:
    candidates = np.arange(4)
    st = _class_state([200_000, 160_000, 10_000, 12_000])
    assert SpeedClassFilter().filter(REQUEST, st, candidates).tolist() == [0, 1, 2, 3]  # nothing declared
    assert SpeedClassFilter(speeds=np.ones(4)).filter(REQUEST, st, candidates).tolist() == [0, 1, 2, 3]
    assert SpeedClassFilter(speeds=CLASS_SPEEDS).filter(REQUEST, st, np.array([0, 1])).tolist() == [0, 1]
    assert SpeedClassFilter(speeds=CLASS_SPEEDS[:3]).filter(REQUEST, st, candidates).tolist() == [0, 1, 2, 3]

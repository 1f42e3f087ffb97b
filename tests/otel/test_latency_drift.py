"""A closed loop without a network: 4 identical simulated servers routed by the real `Engine` with the ``default``
preset, each request's latencies fed back through `EndpointLatency` and published into the signals snapshot every
0.25 s as ``otel/loop.py`` does, all on a virtual clock (no sleeping, no wall clock in the outcome).

Server 0 has one early slow spell; afterwards it must get an even share again. It did not while the published
EWMA kept its slow value for want of new samples (the picker is max-score, so a server that looks slower by any
margin loses every pick the load scorers tie on, and gets no samples to correct the estimate): with one request
in flight it got a fifth of an even share for 8-12 half-lives after the spell, then up to twice one as the herd
turned; with one in twenty, none at all for the 16 half-lives simulated. The lighter load needs both halves of the
fix: the estimate's drift toward the fleet's as its evidence ages (`EndpointLatency`), and the latency scorer's
tolerance, without which a residue of the spell keeps the estimate a hair above the others' for tens of
half-lives (the drift alone changed neither figure; the tolerance alone fixed only the first)."""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest

from inferlb.otel.latency import EndpointLatency
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import InFlight, Lease
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.signals import Signals

SERVERS = 4
HALF_LIFE_S = 1.0
WINDOW_S = 6.0  # the quantile window, 6 half-lives as in the config's defaults (60 s, 10 s)
PUBLISH_S = 0.25  # OtelConfig.publish_interval_s
RATE = 400.0  # requests per second, Poisson: 800 per window of 2 half-lives
SPELL_S = 2.0  # server 0 is SLOWDOWN times slower for the first 2 half-lives
SLOWDOWN = 5.0
PROMPT_TOKENS = 5  # a backlog of 0.25 ms to prefill at the default 20k tokens/s: a tenth of the time between picks
SETTLE_HALF_LIVES = 6  # how long after the spell the shares must be even again
WINDOWS = 5  # then this many windows of 2 half-lives are checked
SEED = 1  # seeds 1..4 all pass; one keeps the test fast
RUN_S = SPELL_S + (SETTLE_HALF_LIVES + 2 * WINDOWS) * HALF_LIFE_S
# Requests in flight in all (RATE x E2E): at 1 the load scorers balance some picks and the once-slow server gets a
# trickle of them; at 1/20 they tie on nearly every pick and it gets none unless its estimate comes back.
LOADS = [pytest.param(1.0, id="one-in-flight"), pytest.param(0.05, id="one-in-twenty-in-flight")]


def simulate(seed: int, load: float, *, slow_until: float = SPELL_S, run_s: float = RUN_S) -> np.ndarray:
    """Rows of (arrival time, endpoint) for every request: Poisson arrivals at ``RATE``, each request taking
    ``load / RATE`` seconds end to end (a fifth of it to the first token) times 1 +- 10% uniform noise, and
    ``SLOWDOWN`` times that on server 0 before ``slow_until``."""
    e2e_s = load / RATE
    now = 0.0

    def clock() -> float:
        return now

    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", frozenset({"m"})) for i in range(SERVERS)])
    inflight = InFlight(SERVERS, clock=clock)
    signals = Signals(SERVERS)
    engine = Engine(pool, build_profile("default", np.random.default_rng(seed), size=SERVERS), inflight, signals)
    latency = EndpointLatency(SERVERS, window_s=WINDOW_S, half_life_s=HALF_LIFE_S, clock=clock)
    rng = np.random.default_rng(seed + 1)
    running: list[tuple[float, int, int, Lease, float, float]] = []  # (ends at, seq, endpoint, lease, ttft, e2e)
    next_publish = PUBLISH_S
    picks = []
    arrival = 0.0
    while True:
        arrival += float(rng.exponential(1.0 / RATE))
        if arrival >= run_s:
            break
        # Everything that happens before this arrival, in time order: the requests that end, the publishes.
        while True:
            ends = running[0][0] if running else np.inf
            step = min(ends, next_publish)
            if step > arrival:
                break
            now = step
            if step == next_publish:
                arrays = latency.arrays()
                signals.publish(signals.snapshot.with_values(ttft_s=arrays["ttft_ewma"], e2e_s=arrays["e2e_ewma"]))
                next_publish += PUBLISH_S
            else:
                _, _, endpoint, lease, ttft, e2e = heapq.heappop(running)
                lease.release()
                latency.observe(endpoint, ttft, e2e)
        now = arrival
        # A fresh object per request: the predicted-TTFT scorer counts a request's prefill once per object.
        request = RequestFeatures(path="/v1/completions", method="POST", model="m", prompt_tokens=PROMPT_TOKENS)
        endpoint = engine.decide(request).endpoint.index
        lease = inflight.acquire(endpoint, request.prompt_tokens)
        e2e = e2e_s * (SLOWDOWN if endpoint == 0 and now < slow_until else 1.0) * float(1.0 + rng.uniform(-0.1, 0.1))
        heapq.heappush(running, (now + e2e, len(picks), endpoint, lease, e2e / 5, e2e))
        picks.append((now, endpoint))
    return np.array(picks)


def shares(picks: np.ndarray, start: float, width: float, end: float = RUN_S) -> np.ndarray:
    """Per whole window of ``width`` seconds from ``start`` to ``end``, each server's share of the picks (shape
    windows x servers)."""
    edges = start + width * np.arange(int((end - start) / width + 1e-9) + 1)
    rows = []
    for low, high in itertools.pairwise(edges):
        chosen = picks[(picks[:, 0] >= low) & (picks[:, 0] < high), 1].astype(int)
        rows.append(np.bincount(chosen, minlength=SERVERS) / len(chosen))
    return np.array(rows)


@pytest.mark.parametrize("load", LOADS)
def test_a_server_with_one_early_slow_spell_regains_an_even_share(load: float) -> None:
    """After a slow spell of 2 half-lives, from 6 half-lives after it on, each server's share of every window of 2
    half-lives (800 picks) is within +-25% of an even share (0.1875 .. 0.3125).

    The load is light, so the load scorers tie on most picks and the latency scorer decides them: the regime where
    a slow estimate that is never re-measured starved a server for minutes."""
    picks = simulate(SEED, load)
    during = shares(picks, 0.0, SPELL_S)[0]
    assert during[0] < 0.5 / SERVERS  # the spell was seen: server 0 lost most of its share while it lasted
    after = shares(picks, SPELL_S + SETTLE_HALF_LIVES * HALF_LIFE_S, 2 * HALF_LIFE_S)
    assert len(after) == WINDOWS
    assert np.all(np.abs(after * SERVERS - 1.0) <= 0.25), np.round(after * SERVERS, 2).tolist()


@pytest.mark.parametrize("load", LOADS)
def test_a_server_that_stays_slow_keeps_losing_traffic(load: float) -> None:
    """The other side: a server 5x slower all along gets under half an even share in every window; the loop is not
    blind to a server that is really slow."""
    run_s = SPELL_S + (SETTLE_HALF_LIVES + 4) * HALF_LIFE_S
    picks = simulate(SEED, load, slow_until=np.inf, run_s=run_s)
    later = shares(picks, SPELL_S + SETTLE_HALF_LIVES * HALF_LIFE_S, 2 * HALF_LIFE_S, run_s)
    assert np.all(later[:, 0] < 0.5 / SERVERS), np.round(later[:, 0] * SERVERS, 2).tolist()

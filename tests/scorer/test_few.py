"""Tests for the list paths (`scorer.inflight.FEW_AS_LIST`): up to that many candidates the per-decision arithmetic
runs on Python lists, beyond it on numpy arrays, and both must give the same numbers, bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from inferlb.scorer import inflight, loadscorers, plugins
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import State
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import DRAIN_SHARE, InFlight, Load
from inferlb.scorer.loadscorers import InFlightTokensScorer, PredictedTTFTScorer
from inferlb.scorer.plugins import InFlightScorer
from inferlb.scorer.pool import Pool
from inferlb.scorer.prefix import PrefixIndex
from inferlb.scorer.signals import Signals

from ..conftest import ManualClock
from .test_presets_decisions import PINNED, run_workload

# Every module that reads the limit, by its own name for it.
MODULES = (inflight, loadscorers, plugins)
SOURCES = Path(inflight.__file__).parent


def _few_as_list(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    for module in MODULES:
        monkeypatch.setattr(module, "FEW_AS_LIST", limit)


def test_every_module_that_reads_the_limit_is_switched_here() -> None:
    readers = {path.stem for path in SOURCES.glob("*.py") if re.search(r"\bFEW_AS_LIST\b", path.read_text())}
    assert readers == {module.__name__.rsplit(".", 1)[1] for module in MODULES}


@pytest.mark.parametrize(("size", "seed"), [pytest.param(*key, id=f"{key[0]}-endpoints") for key in PINNED])
@pytest.mark.parametrize("limit", [pytest.param(0, id="arrays"), pytest.param(1_000, id="lists")])
def test_the_pinned_decisions_come_out_the_same_on_lists_and_on_arrays(
    monkeypatch: pytest.MonkeyPatch, size: int, seed: int, limit: int
) -> None:
    # The pinned workload moves everything a decision reads (tests/scorer/test_presets_decisions.py); its pools of 6
    # and 24 endpoints take the lists and its pool of 80 the arrays unless the limit says otherwise.
    _few_as_list(monkeypatch, limit)
    assert run_workload(size, seed) == PINNED[size, seed]


def _busy_state(clock: ManualClock, size: int, rng: np.random.Generator) -> State:
    """A pool whose counters hold everything the backlog reads: estimated and exact (first tokens) backlogs, requests
    in flight, and other replicas' load."""
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", None) for i in range(size)])
    signals = Signals(size, clock=clock)
    rates = rng.choice([8_000.0, 30_000.0, np.nan], size)
    steps = rng.choice([0.0, 0.02, np.nan], size)
    signals.publish(signals.snapshot.with_values(prefill_tokens_per_s=rates, decode_step_s=steps))
    counters = InFlight(size, clock=clock)
    counters.first_tokens = True
    leases = []
    for _ in range(8 * size):
        clock.now += float(rng.choice([0.0, 0.01, 0.05]))
        index = int(rng.integers(size))
        uncached = float(rng.integers(0, 6_000))
        leases.append(counters.acquire(index, int(uncached) + 10, (uncached, 20_000.0), streamed=rng.random() < 0.5))
        if rng.random() < 0.3:
            leases.pop(int(rng.integers(len(leases)))).release()
        if rng.random() < 0.2 and leases:
            leases[int(rng.integers(len(leases)))].first_token()
    peers = Load(
        rng.integers(0, 5, size),
        rng.integers(0, 9_000, size),
        rng.integers(0, 50, size),
        rng.random(size) * 8_000,
        np.full(size, clock.now) - rng.random(size),
        rng.choice([0.0, 1_500.0], size),
    )
    counters.set_peers(peers)
    clock.now += 0.02
    return State(pool, counters, signals)


@pytest.mark.parametrize("size", [1, 3, 8])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_backlog_and_the_load_scorers_read_the_same_on_lists_and_on_arrays(
    monkeypatch: pytest.MonkeyPatch, size: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    state = _busy_state(ManualClock(), size, rng)
    everyone = np.arange(size)
    some = np.sort(rng.choice(size, max(1, size - 1), replace=False))
    index = PrefixIndex(size)
    prompt = tuple(int(x) for x in rng.integers(1, 2**62, 6))
    for endpoint in range(size):
        index.record(endpoint, prompt[: int(rng.integers(0, 7))])
    requests = [
        RequestFeatures(model="m", prompt_tokens=0),  # a headers-only route: the prompt unknown
        RequestFeatures(model="m", prompt_tokens=900, prefix_hashes=prompt[:3]),
        RequestFeatures(model="m", prompt_tokens=80_000, prefix_hashes=prompt),
    ]
    drain = np.full(size, 20_000.0 * DRAIN_SHARE)

    def read(limit: int) -> list[np.ndarray]:
        _few_as_list(monkeypatch, limit)
        out = []
        for candidates in (everyone, some):
            for waiting in (False, True):
                pending, counted = state.inflight.prefill_queue(candidates, drain[candidates], waiting=waiting)
                out += [pending] if counted is None else [pending, counted]
            out.append(InFlightScorer().score(requests[0], state, candidates))
            out.append(InFlightTokensScorer().score(requests[0], state, candidates))
            for request in requests:
                scorer = PredictedTTFTScorer(index, block_tokens=16)
                out.append(scorer.predictor.seconds(request, state, candidates))
                added = scorer.predictor.added_delay(request, state, candidates)
                assert added is not None
                out.append(added)
                out.append(scorer.score(request, state, candidates))
                estimate = scorer.prefill(request, int(candidates[-1]))
                assert estimate is not None
                out.append(np.array(estimate))
        return out

    lists, arrays = read(1_000), read(0)
    assert len(lists) == len(arrays)
    for few, many in zip(lists, arrays, strict=True):
        np.testing.assert_array_equal(few, many)
        assert type(few) is np.ndarray and few.dtype == many.dtype

"""Tests for scorer/engine.py, scorer/plugins.py and scorer/presets.py: the filters -> scorers -> picker pipeline."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import (
    NEUTRAL_SCORE,
    RANKED_UP_TO_CANDIDATES,
    Decision,
    Engine,
    Filter,
    Picker,
    Profile,
    Scorer,
    State,
    WeightedScorer,
)
from inferlb.scorer.errors import NoEndpointError, RoutingError, UnknownModelError
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import InFlight
from inferlb.scorer.plugins import InFlightScorer, MaxScorePicker, ModelFilter, RoundRobinPicker
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import PRESET_NAMES, PRESETS, build_profile
from inferlb.scorer.registry import PluginSpec, ProfileSpec
from inferlb.scorer.signals import Signals

# 0 and 2 serve only "a", 1 serves "a" and "b", 3 serves only "b", 4 serves only "c".
FLEET = (
    EndpointConfig("10.0.0.1:8000", frozenset({"a"})),
    EndpointConfig("10.0.0.2:8000", frozenset({"a", "b"})),
    EndpointConfig("10.0.0.3:8000", frozenset({"a"})),
    EndpointConfig("10.0.0.4:8000", frozenset({"b"})),
    EndpointConfig("10.0.0.5:8000", frozenset({"c"})),
)
SERVERS = {"a": {0, 1, 2}, "b": {1, 3}, "c": {4}, None: {0, 1, 2, 3, 4}}


def _state(requests: Sequence[int] = (0, 0, 0, 0, 0)) -> State:
    pool = Pool(FLEET)
    inflight = InFlight(len(pool))
    inflight.requests[:] = requests
    return State(pool, inflight, Signals(len(pool)))


def _req(model: str | None = "a") -> RequestFeatures:
    return RequestFeatures(path="/v1/completions", method="POST", model=model)


def _idx(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.intp)


# ---------------------------------------------------------------- in-test fakes that satisfy the protocols


class FixedScorer:
    """Scores each endpoint index with a fixed value (or returns exactly what ``make`` builds)."""

    def __init__(
        self, name: str, by_index: dict[int, float] | None = None, make: Callable[[np.ndarray], Any] | None = None
    ) -> None:
        self.name = name
        self._by_index = by_index or {}
        self._make = make
        self.seen: list[list[int]] = []

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> Any:
        self.seen.append(candidates.tolist())
        if self._make is not None:
            return self._make(candidates)
        return np.array([self._by_index[int(c)] for c in candidates])


class RaisingScorer:
    name = "broken"

    def score(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        raise ZeroDivisionError("signal went away")


class DropFilter:
    """Drops the given endpoint indices."""

    def __init__(self, name: str, drop: set[int]) -> None:
        self.name = name
        self._drop = drop

    def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
        return np.array([c for c in candidates if int(c) not in self._drop], dtype=np.intp)


class FixedPicker:
    """Always picks one position and records what it was given."""

    name = "fixed"

    def __init__(self, position: int = 0) -> None:
        self.position = position
        self.calls: list[tuple[list[int], list[float]]] = []

    def pick(self, request: RequestFeatures, candidates: np.ndarray, totals: np.ndarray) -> int:
        self.calls.append((candidates.tolist(), totals.tolist()))
        return self.position


def test_fakes_and_builtins_satisfy_the_protocols() -> None:
    filters: list[Filter] = [ModelFilter(), DropFilter("d", set())]
    scorers: list[Scorer] = [InFlightScorer(), FixedScorer("f", {}), RaisingScorer()]
    pickers: list[Picker] = [MaxScorePicker(), RoundRobinPicker(), FixedPicker()]
    assert all(isinstance(p.name, str) and p.name for p in [*filters, *scorers, *pickers])


# ---------------------------------------------------------------- plugins, one table each


@pytest.mark.parametrize(
    ("model", "candidates", "expected"),
    [
        pytest.param("a", _idx(0, 1, 2, 3, 4), [0, 1, 2], id="a-from-all"),
        pytest.param("b", _idx(0, 1, 2, 3, 4), [1, 3], id="b-from-all"),
        pytest.param("c", _idx(0, 1, 2, 3, 4), [4], id="c-from-all"),
        pytest.param("a", _idx(1, 3, 4), [1], id="a-from-subset"),
        pytest.param("c", _idx(0, 1), [], id="c-from-subset-empty"),
        pytest.param(None, _idx(0, 3), [0, 3], id="none-keeps-all"),
    ],
)
def test_model_filter(model: str | None, candidates: np.ndarray, expected: list[int]) -> None:
    assert ModelFilter().filter(_req(model), _state(), candidates).tolist() == expected


def test_model_filter_unknown_model_raises() -> None:
    with pytest.raises(UnknownModelError, match=r"'z' is not served by this pool \(served: a, b, c\)"):
        ModelFilter().filter(_req("z"), _state(), _idx(0, 1, 2, 3, 4))


@pytest.mark.parametrize(
    ("requests", "candidates", "expected"),
    [
        pytest.param((0, 0, 0, 0, 0), _idx(0, 1, 2), [1.0, 1.0, 1.0], id="all-idle"),
        pytest.param((0, 1, 2, 0, 0), _idx(0, 1, 2), [1.0, 1 / 2, 1 / 3], id="one-and-two-more"),
        pytest.param((5, 5, 5, 0, 0), _idx(0, 1, 2), [1.0, 1.0, 1.0], id="equally-busy"),
        pytest.param((9, 4, 7, 0, 0), _idx(0, 1, 2), [1 / 6, 1.0, 1 / 4], id="relative-to-least"),
        pytest.param((0, 3, 4, 9, 9), _idx(1, 2), [1.0, 1 / 2], id="min-over-candidates-only"),
        pytest.param((0, 0, 0, 0, 7), _idx(4), [1.0], id="single"),
    ],
)
def test_inflight_scorer(requests: tuple[int, ...], candidates: np.ndarray, expected: list[float]) -> None:
    scores = InFlightScorer().score(_req(), _state(requests), candidates)
    np.testing.assert_allclose(scores, expected)
    assert ((scores > 0) & (scores <= 1)).all()


@pytest.mark.parametrize(
    ("totals", "expected"),
    [
        pytest.param([0.2, 0.9, 0.5], 1, id="middle"),
        pytest.param([1.0, 0.0], 0, id="first"),
        pytest.param([0.0, 0.0, 3.0], 2, id="last"),
        pytest.param([0.7], 0, id="single"),
        pytest.param([1.0, 1.0 - 1e-6], 0, id="difference-above-tie"),
        pytest.param([-1.0, -0.5], 1, id="negative-totals"),
    ],
)
def test_max_score_picker_picks_the_highest(totals: list[float], expected: int) -> None:
    picker = MaxScorePicker(np.random.default_rng(0))
    candidates = np.arange(len(totals), dtype=np.intp)
    assert {picker.pick(_req(), candidates, np.array(totals)) for _ in range(200)} == {expected}


@pytest.mark.parametrize(
    ("totals", "tied"),
    [
        pytest.param([0.5, 0.5, 0.5], {0, 1, 2}, id="three-equal"),
        pytest.param([0.1, 0.8, 0.8, 0.3], {1, 2}, id="two-best-equal"),
        pytest.param([1.0, 1.0 + 1e-12], {0, 1}, id="within-tie"),
        pytest.param([1e4, 1e4, 1e4], {0, 1, 2}, id="large-totals"),
    ],
)
def test_max_score_picker_breaks_ties_at_random(totals: list[float], tied: set[int]) -> None:
    picker = MaxScorePicker(np.random.default_rng(1))
    candidates = np.arange(len(totals), dtype=np.intp)
    counts = Counter(picker.pick(_req(), candidates, np.array(totals)) for _ in range(600))
    assert set(counts) == tied
    assert min(counts.values()) > 600 / len(tied) * 0.7


def test_max_score_picker_refills_its_jitter_block() -> None:
    picker = MaxScorePicker(np.random.default_rng(2))
    picker.BLOCK = 4  # tiny blocks: exercise the refill path and a candidate list longer than a block
    for n in (3, 3, 2, 10, 3):
        candidates = np.arange(n, dtype=np.intp)
        counts = Counter(picker.pick(_req(), candidates, np.zeros(n)) for _ in range(40 * n))
        assert set(counts) == set(range(n))


def test_max_score_picker_same_seed_same_picks() -> None:
    def run() -> list[int]:
        picker = MaxScorePicker(np.random.default_rng(42))
        return [picker.pick(_req(), _idx(0, 1, 2, 3), np.zeros(4)) for _ in range(100)]

    assert run() == run()


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        pytest.param([("a", 3)] * 7, [0, 1, 2, 0, 1, 2, 0], id="cycles"),
        pytest.param([("a", 3), ("b", 2), ("a", 3), ("b", 2), ("a", 3)], [0, 0, 1, 1, 2], id="cursor-per-model"),
        pytest.param([(None, 2)] * 3, [0, 1, 0], id="no-model"),
        pytest.param([("a", 1)] * 3, [0, 0, 0], id="single-candidate"),
        pytest.param([("a", 4), ("a", 2), ("a", 4)], [0, 1, 2], id="candidate-count-changes"),
    ],
)
def test_round_robin_picker(calls: list[tuple[str | None, int]], expected: list[int]) -> None:
    picker = RoundRobinPicker()
    got = [picker.pick(_req(model), np.arange(n, dtype=np.intp), np.zeros(n)) for model, n in calls]
    assert got == expected


def test_round_robin_picker_cursors_are_bounded() -> None:
    picker = RoundRobinPicker()
    candidates = _idx(0, 1, 2)
    for i in range(4096):
        picker.pick(_req(f"model-{i}"), candidates, np.zeros(3))
    # Past the bound, every new name shares one overflow cursor; known names keep their own.
    picks = [picker.pick(_req(f"new-{i}"), candidates, np.zeros(3)) for i in range(5)]
    assert picks == [0, 1, 2, 0, 1]
    assert picker.pick(_req("model-7"), candidates, np.zeros(3)) == 1
    assert len(picker._cursors) == 4097


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize("name", [pytest.param(name, id=name) for name in PRESET_NAMES])
def test_build_profile_returns_a_fresh_profile(name: str) -> None:
    first, second = build_profile(name, size=4), build_profile(name, size=4)
    assert first.name == name
    assert first.picker is not second.picker
    assert type(first.filters[0]) is ModelFilter
    assert all(a is not b for a, b in zip(first.scorers, second.scorers, strict=True))


def test_preset_names() -> None:
    expected = ("round-robin", "least-request", "kv-aware", "prefix-aware", "seed-formula", "default")
    assert PRESET_NAMES == expected == tuple(PRESETS)


@pytest.mark.parametrize("name", [pytest.param("fastest", id="unknown"), pytest.param("Round-Robin", id="case")])
def test_build_profile_unknown_name(name: str) -> None:
    with pytest.raises(KeyError) as info:
        build_profile(name)
    assert info.value.args[0] == f"unknown policy {name!r}; known: {', '.join(PRESET_NAMES)}"


# ---------------------------------------------------------------- Engine.decide with the presets


def _engine(preset: str, seed: int = 0) -> Engine:
    return Engine(Pool(FLEET), build_profile(preset, np.random.default_rng(seed), size=len(FLEET)))


def test_engine_defaults_to_its_own_inflight_sized_to_the_pool() -> None:
    pool = Pool(FLEET)
    engine = Engine(pool, build_profile("least-request"))
    assert engine.inflight.requests.shape == (5,)
    assert engine.state == State(pool, engine.inflight, engine.signals, engine.saturation)
    shared = InFlight(5)
    assert Engine(pool, build_profile("least-request"), shared).inflight is shared


def test_least_request_follows_inflight_counts() -> None:
    engine = _engine("least-request")
    busy = [engine.inflight.acquire(0, 1), engine.inflight.acquire(0, 1), engine.inflight.acquire(2, 1)]
    assert {engine.decide(_req("a")).endpoint.index for _ in range(50)} == {1}

    # Load endpoint 1 until it is the busiest: the picks move to the least loaded, 2.
    extra = [engine.inflight.acquire(1, 1) for _ in range(3)]
    assert {engine.decide(_req("a")).endpoint.index for _ in range(50)} == {2}

    for lease in [*busy, *extra]:
        lease.release()
    assert {engine.decide(_req("a")).endpoint.index for _ in range(200)} == {0, 1, 2}


def test_least_request_with_leases_balances_exactly() -> None:
    engine = _engine("least-request", seed=3)
    leases = []
    for _ in range(30):
        decision = engine.decide(_req("a"))
        leases.append(engine.inflight.acquire(decision.endpoint.index, 10))
        # Never more than one request apart: each pick goes to a least loaded endpoint.
        loads = engine.inflight.requests[[0, 1, 2]]
        assert loads.max() - loads.min() <= 1
    assert engine.inflight.requests.tolist() == [10, 10, 10, 0, 0]
    assert engine.inflight.tokens.tolist() == [100, 100, 100, 0, 0]


def test_least_request_random_tie_break_spreads_over_equal_endpoints() -> None:
    engine = _engine("least-request", seed=1234)
    counts = Counter(engine.decide(_req("a")).endpoint.index for _ in range(3000))
    assert set(counts) == {0, 1, 2}
    # Expected 1000 each (sd ~26): none starved, none favoured.
    assert all(800 < n < 1200 for n in counts.values()), counts


def test_least_request_tie_break_ignores_busier_endpoints() -> None:
    engine = _engine("least-request", seed=5)
    engine.inflight.acquire(1, 1)
    counts = Counter(engine.decide(_req("a")).endpoint.index for _ in range(3000))
    assert set(counts) == {0, 2}
    assert all(1300 < n < 1700 for n in counts.values()), counts


def test_round_robin_cycles_evenly_per_model() -> None:
    engine = _engine("round-robin")
    picks = [engine.decide(_req("a")).endpoint.index for _ in range(30)]
    assert picks[:6] == [0, 1, 2, 0, 1, 2]
    assert Counter(picks) == {0: 10, 1: 10, 2: 10}


def test_round_robin_keeps_a_separate_cursor_per_model() -> None:
    interleaved = _engine("round-robin")
    sequence = ["a", "b", "b", "a", "c", "b", "a", "a", "b", "c"]
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for model in sequence:
        got[model].append(interleaved.decide(_req(model)).endpoint.index)
    assert got == {"a": [0, 1, 2, 0], "b": [1, 3, 1, 3], "c": [4, 4]}

    # The same as each model alone: interleaving does not skew any rotation.
    for model, picks in got.items():
        alone = _engine("round-robin")
        assert [alone.decide(_req(model)).endpoint.index for _ in picks] == picks


def test_round_robin_ignores_inflight() -> None:
    engine = _engine("round-robin")
    for _ in range(5):
        engine.inflight.acquire(0, 1)
    assert [engine.decide(_req("a")).endpoint.index for _ in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("preset", [pytest.param(name, id=name) for name in PRESET_NAMES])
@pytest.mark.parametrize("model", [pytest.param(m, id=str(m)) for m in SERVERS])
def test_presets_only_pick_endpoints_that_serve_the_model(preset: str, model: str | None) -> None:
    engine = _engine(preset)
    picked = {engine.decide(_req(model)).endpoint.index for _ in range(60)}
    assert picked == SERVERS[model]


@pytest.mark.parametrize("preset", [pytest.param(name, id=name) for name in PRESET_NAMES])
def test_presets_unknown_model(preset: str) -> None:
    with pytest.raises(UnknownModelError) as info:
        _engine(preset).decide(_req("gpt-4"))
    assert isinstance(info.value, RoutingError)
    assert info.value.served == frozenset({"a", "b", "c"})


@pytest.mark.parametrize("preset", [pytest.param(name, id=name) for name in PRESET_NAMES])
def test_presets_wildcard_endpoint_takes_unlisted_models(preset: str) -> None:
    pool = Pool((*FLEET, EndpointConfig("[fd00::9]:8000", None)))
    engine = Engine(pool, build_profile(preset, np.random.default_rng(0), size=len(pool)))
    assert {engine.decide(_req("unlisted")).endpoint.address for _ in range(10)} == {"[fd00::9]:8000"}
    assert {engine.decide(_req("c")).endpoint.index for _ in range(40)} == {4, 5}


@pytest.mark.parametrize("preset", [pytest.param(name, id=name) for name in PRESET_NAMES])
def test_two_engines_are_independent(preset: str) -> None:
    first, second = _engine(preset), _engine(preset)
    first.inflight.acquire(0, 1)
    first.decide(_req("a"))
    assert second.inflight.total() == 0
    if preset == "round-robin":
        assert second.decide(_req("a")).endpoint.index == 0


# ---------------------------------------------------------------- Engine.decide with fakes


@pytest.mark.parametrize(
    ("drops", "model", "message"),
    [
        pytest.param(
            [("drop-all", {0, 1, 2, 3, 4})], "a", "no endpoint left after filter 'drop-all'", id="first-filter"
        ),
        pytest.param(
            [("noop", set()), ("drop-rest", {0, 1, 2, 3, 4})],
            "a",
            "no endpoint left after filter 'drop-rest'",
            id="second-filter",
        ),
        pytest.param([("drop-b", {1, 3})], "b", "no endpoint left after filter 'model'", id="after-model-filter"),
    ],
)
def test_no_endpoint_error_when_a_filter_empties_the_candidates(
    drops: list[tuple[str, set[int]]], model: str, message: str
) -> None:
    filters: list[Filter] = [DropFilter(name, drop) for name, drop in drops]
    filters.append(ModelFilter())
    scorer = FixedScorer("never", {})
    picker = FixedPicker()
    engine = Engine(Pool(FLEET), Profile("p", filters, (WeightedScorer(scorer, 1.0),), picker))
    with pytest.raises(NoEndpointError) as info:
        engine.decide(_req(model))
    assert str(info.value) == message
    assert isinstance(info.value, RoutingError)
    assert scorer.seen == [] and picker.calls == []


def test_filters_run_in_order_and_scorers_see_the_survivors() -> None:
    scorer = FixedScorer("s", {0: 0.1, 1: 0.2, 2: 0.3})
    picker = FixedPicker()
    profile = Profile("p", (DropFilter("drop-0", {0}), ModelFilter()), (WeightedScorer(scorer, 1.0),), picker)
    decision = Engine(Pool(FLEET), profile).decide(_req("a"))
    assert scorer.seen == [[1, 2]]
    assert picker.calls == [([1, 2], [0.2, 0.3])]
    assert decision.endpoint.index == 1


def _bad(make: Callable[[np.ndarray], Any]) -> FixedScorer:
    return FixedScorer("bad", make=make)


# (scorer output for candidates [0, 1, 2], the scores the engine uses, whether it counts as an error)
MISBEHAVING = [
    pytest.param(_bad(lambda c: [0.2, 0.5, 0.9]), [0.2, 0.5, 0.9], False, id="good-list"),
    pytest.param(_bad(lambda c: np.array([-0.5, 0.5, 1.5])), [0.0, 0.5, 1.0], False, id="out-of-range-clamped"),
    pytest.param(_bad(lambda c: np.array([np.nan, 0.4, np.nan])), [0.0, 0.4, 0.0], False, id="nan-is-worst"),
    pytest.param(_bad(lambda c: np.array([np.inf, -np.inf, 0.3])), [1.0, 0.0, 0.3], False, id="infinities-clamped"),
    pytest.param(_bad(lambda c: np.array([-3, 7, 1])), [0.0, 1.0, 1.0], False, id="ints-clamped"),
    pytest.param(RaisingScorer(), [NEUTRAL_SCORE] * 3, True, id="raises"),
    pytest.param(_bad(lambda c: np.ones(len(c) + 1)), [NEUTRAL_SCORE] * 3, True, id="too-long"),
    pytest.param(_bad(lambda c: np.ones(len(c) - 1)), [NEUTRAL_SCORE] * 3, True, id="too-short"),
    pytest.param(_bad(lambda c: 0.7), [NEUTRAL_SCORE] * 3, True, id="scalar"),
    pytest.param(_bad(lambda c: np.ones((len(c), 1))), [NEUTRAL_SCORE] * 3, True, id="column"),
    pytest.param(_bad(lambda c: ["x", "y", "z"]), [NEUTRAL_SCORE] * 3, True, id="strings"),
    pytest.param(_bad(lambda c: None), [NEUTRAL_SCORE] * 3, True, id="none"),
]


@pytest.mark.parametrize(("scorer", "expected", "is_error"), MISBEHAVING)
def test_misbehaving_scorer_is_clamped_or_neutralised_and_never_raises(
    scorer: Scorer, expected: list[float], is_error: bool, caplog: pytest.LogCaptureFixture
) -> None:
    good = FixedScorer("good", {0: 0.0, 1: 0.0, 2: 0.0})
    picker = FixedPicker(position=1)
    profile = Profile("p", (ModelFilter(),), (WeightedScorer(scorer, 1.0), WeightedScorer(good, 1.0)), picker)
    engine = Engine(Pool(FLEET), profile)
    with caplog.at_level(logging.ERROR, logger="inferlb.scorer.engine"):
        decisions = [engine.decide(_req("a")) for _ in range(3)]
    for decision in decisions:
        assert decision.endpoint.index == 1
        assert decision.scores == {scorer.name: expected[1], "good": 0.0}
        np.testing.assert_allclose(decision.totals, expected)
    assert all(0.0 <= t <= 1.0 for _, totals in picker.calls for t in totals)
    assert engine.scorer_errors == (Counter({scorer.name: 3}) if is_error else Counter())
    # Logged once per scorer, not once per request.
    assert len(caplog.records) == (1 if is_error else 0)


def test_scorer_errors_are_counted_per_scorer() -> None:
    class Other(RaisingScorer):
        name = "other"

    profile = Profile("p", (), (WeightedScorer(RaisingScorer(), 1.0), WeightedScorer(Other(), 2.0)), FixedPicker())
    engine = Engine(Pool(FLEET), profile)
    for _ in range(4):
        decision = engine.decide(_req(None))
        np.testing.assert_allclose(decision.totals, [1.5] * 5)
    assert engine.scorer_errors == Counter({"broken": 4, "other": 4})


@pytest.mark.parametrize(
    ("weight_first", "weight_second", "chosen", "totals"),
    [
        pytest.param(1.0, 2.0, 1, [1.0, 2.0, 1.65], id="second-weighs-more"),
        pytest.param(3.0, 2.0, 0, [3.0, 2.0, 2.75], id="first-weighs-more"),
        pytest.param(1.0, 0.0, 0, [1.0, 0.0, 0.55], id="zero-weight-ignored"),
        pytest.param(0.25, 0.25, 2, [0.25, 0.25, 0.275], id="balanced-middle-wins"),
    ],
)
def test_weights_apply(weight_first: float, weight_second: float, chosen: int, totals: list[float]) -> None:
    first = FixedScorer("first", {0: 1.0, 1: 0.0, 2: 0.55})
    second = FixedScorer("second", {0: 0.0, 1: 1.0, 2: 0.55})
    profile = Profile(
        "weighted",
        (ModelFilter(),),
        (WeightedScorer(first, weight_first), WeightedScorer(second, weight_second)),
        MaxScorePicker(np.random.default_rng(0)),
    )
    decision = Engine(Pool(FLEET), profile).decide(_req("a"))
    assert decision.endpoint.index == chosen
    np.testing.assert_allclose(decision.totals, totals)
    assert decision.scores == {"first": first._by_index[chosen], "second": second._by_index[chosen]}
    assert decision.profile == "weighted"
    assert decision.reason == "best-score"


def test_no_scorers_gives_zero_totals() -> None:
    picker = FixedPicker(position=2)
    decision = Engine(Pool(FLEET), Profile("p", (ModelFilter(),), (), picker)).decide(_req("a"))
    assert decision.endpoint.index == 2
    assert decision.scores == {}
    assert decision.totals.tolist() == [0.0, 0.0, 0.0]
    assert decision.reason == "fixed"


@pytest.mark.parametrize(
    ("position", "ranked"),
    [
        pytest.param(2, (0, 2, 1, 3, 4), id="best-chosen"),
        pytest.param(1, (2, 0, 1, 3, 4), id="other-of-tie-chosen"),
        pytest.param(0, (1, 2, 0, 3, 4), id="chosen-not-best-ties-in-candidate-order"),
        pytest.param(4, (4, 2, 0, 1, 3), id="worst-chosen"),
    ],
)
def test_decision_ranked_puts_the_chosen_first_and_each_candidate_once(position: int, ranked: tuple[int, ...]) -> None:
    # Totals by endpoint: 0 -> 0.9, 2 -> 0.9 (tie), 1 -> 0.5, 3 -> 0.2, 4 -> 0.1; candidates in order 1,2,0,3,4.
    scorer = FixedScorer("s", {0: 0.9, 1: 0.5, 2: 0.9, 3: 0.2, 4: 0.1})

    class Reorder:
        name = "reorder"

        def filter(self, request: RequestFeatures, state: State, candidates: np.ndarray) -> np.ndarray:
            return _idx(1, 2, 0, 3, 4)

    profile = Profile("p", (Reorder(),), (WeightedScorer(scorer, 1.0),), FixedPicker(position))
    decision = Engine(Pool(FLEET), profile).decide(_req(None))
    assert decision.ranked == ranked
    assert decision.ranked[0] == decision.endpoint.index
    assert sorted(decision.ranked) == [0, 1, 2, 3, 4]


def test_decision_scores_are_before_weighting() -> None:
    scorer = FixedScorer("s", {0: 0.4, 1: 0.6, 2: 0.8})
    profile = Profile("p", (ModelFilter(),), (WeightedScorer(scorer, 10.0),), FixedPicker(1))
    decision = Engine(Pool(FLEET), profile).decide(_req("a"))
    assert isinstance(decision, Decision)
    assert decision.scores == {"s": 0.6}
    np.testing.assert_allclose(decision.totals, [4.0, 6.0, 8.0])
    assert decision.candidates.tolist() == [0, 1, 2]


@pytest.mark.parametrize("size", [RANKED_UP_TO_CANDIDATES, RANKED_UP_TO_CANDIDATES + 1])
def test_decision_scores_are_the_chosen_endpoints_with_or_without_every_candidates(size: int) -> None:
    # Up to RANKED_UP_TO_CANDIDATES a decision keeps every candidate's scores and reads the chosen one's from them
    # when asked; beyond, it keeps the chosen one's alone.
    first = FixedScorer("first", {i: (i % 7) / 7 for i in range(size)})
    second = FixedScorer("second", {i: (i % 5) / 5 for i in range(size)})
    fleet = [EndpointConfig(f"10.0.1.{i + 1}:8000") for i in range(size)]
    profile = Profile("p", (), (WeightedScorer(first, 1.0), WeightedScorer(second, 2.0)), FixedPicker(size - 3))
    decision = Engine(Pool(fleet), profile).decide(_req(None))
    chosen = decision.endpoint.index
    assert chosen == size - 3
    assert decision.scores == {"first": (chosen % 7) / 7, "second": (chosen % 5) / 5}
    assert len(decision.per_scorer) == (2 if size <= RANKED_UP_TO_CANDIDATES else 0)


def test_least_request_decision_reports_the_inflight_score() -> None:
    engine = _engine("least-request")
    engine.inflight.acquire(0, 1)
    engine.inflight.acquire(0, 1)
    engine.inflight.acquire(2, 1)
    decision = engine.decide(_req("a"))
    assert decision.endpoint.index == 1
    assert decision.scores == {"in-flight": 1.0}
    np.testing.assert_allclose(decision.totals, [1 / 3, 1.0, 1 / 2])
    assert decision.ranked == (1, 2, 0)
    assert (decision.profile, decision.reason) == ("least-request", "best-score")


@pytest.mark.parametrize(
    ("preset", "ages", "model", "reason"),
    [
        pytest.param("default", [0.1] * 3, "a", "best-score", id="scored"),
        pytest.param("round-robin", [0.1] * 3, "a", "rotation", id="rotation"),
        pytest.param("least-request", [None] * 3, "a", "best-score", id="never-scraped-is-no-news"),
        pytest.param("default", [50.0] * 3, "a", "no-fresh-metrics", id="all-stale"),
        pytest.param("default", [50.0, 0.1, 0.1], "a", "best-score", id="two-fresh"),
        pytest.param("default", [0.1] * 3, "b", "only-candidate", id="one-serves-the-model"),
    ],
)
def test_a_decision_says_why(preset: str, ages: list[float | None], model: str, reason: str) -> None:
    pool = Pool(FLEET[:3])
    signals = Signals(3, stale_after_s=1.0)
    if any(a is not None for a in ages):
        now = time.monotonic()
        signals.publish(signals.snapshot.with_values(scraped_at=[now - a for a in ages]))
    engine = Engine(pool, build_profile(preset, np.random.default_rng(0), size=3), signals=signals)
    assert engine.decide(_req(model)).reason == reason


def test_sampling_pickers_say_so() -> None:
    spec = ProfileSpec("p", (PluginSpec("model"),), (PluginSpec("in-flight"),), PluginSpec("power-of-two"))
    engine = Engine(Pool(FLEET[:3]), build_profile(spec, np.random.default_rng(0), size=3))
    decision = engine.decide(_req("a"))
    assert decision.reason == "sampled"
    assert [name for name, _ in decision.per_scorer] == ["in-flight"]
    assert decision.per_scorer[0][1].shape == decision.candidates.shape

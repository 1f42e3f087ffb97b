"""Per-server speeds learned online (`scorer.speeds`), and their way into the predicted-TTFT scorer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.engine import Engine, State
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import InFlight
from inferlb.scorer.loadscorers import ATTENTION_TOKENS, DEFAULT_PREFILL_TOKENS_PER_S, TtftPredictor
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.router import Router
from inferlb.scorer.signals import Signals, Snapshot
from inferlb.scorer.speeds import PEAK_MIN_SAMPLES, PEAK_MIN_WORK, ServerSpeeds, SpeedHints


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed(speeds: ServerSpeeds, clock: Clock, endpoint: int, work: float, ttft: float, key: str, **more: float) -> bool:
    speeds.sent(key, endpoint, work)
    clock.now += 0.01
    return speeds.observed(key, ttft, more.get("e2e"), int(more["tokens"]) if "tokens" in more else None)


def test_each_endpoint_learns_its_own_prefill_rate_and_step_from_its_requests() -> None:
    clock = Clock()
    speeds = ServerSpeeds(2, clock, prior_requests=0.0, min_requests=1)
    rates, steps = (40_000.0, 10_000.0), (0.006, 0.03)
    rng = np.random.default_rng(1)
    for k in range(400):
        endpoint = k % 2
        work = float(rng.integers(100, 8000))
        ttft = work / rates[endpoint] + steps[endpoint]
        tokens = int(rng.integers(2, 300))
        assert timed(
            speeds, clock, endpoint, work, ttft, f"r{k}", e2e=ttft + steps[endpoint] * (tokens - 1), tokens=tokens
        )
    assert speeds.decode_step_s() == pytest.approx(steps, rel=1e-6)
    # The step that makes the first token is not prefill time: without taking it out, the L4-like endpoint's
    # rate would read ~20% low (a 30 ms step beside ~0.4 s of prefill on average).
    assert speeds.prefill_tokens_per_s() == pytest.approx(rates, rel=0.02)


def test_nothing_is_claimed_before_the_fleet_has_enough_timings() -> None:
    clock = Clock()
    speeds = ServerSpeeds(3, clock, min_requests=3)
    for k in range(2):
        timed(speeds, clock, 0, 1000.0, 0.05, f"r{k}")
    assert np.isnan(speeds.prefill_tokens_per_s()).all() and np.isnan(speeds.decode_step_s()).all()
    timed(speeds, clock, 0, 1000.0, 0.05, "r2")
    learned = speeds.prefill_tokens_per_s()
    # Endpoints without evidence of their own are priced as the fleet is, not left unknown beside a known one.
    assert learned == pytest.approx([20_000.0] * 3)


def test_an_endpoint_whose_evidence_ages_shrinks_toward_the_fleet() -> None:
    clock = Clock()
    speeds = ServerSpeeds(2, clock, half_life_s=10.0, prior_requests=4.0, min_requests=1)
    for k in range(50):
        timed(speeds, clock, 0, 2000.0, 0.2, f"slow{k}")  # 10k tokens/s
        timed(speeds, clock, 1, 4000.0, 0.1, f"fast{k}")  # 40k tokens/s
    before = speeds.prefill_tokens_per_s()
    assert before[0] == pytest.approx(10_000, rel=0.1) and before[1] == pytest.approx(40_000, rel=0.1)
    clock.now += 120.0  # 12 half-lives without a timing from endpoint 0; endpoint 1 keeps serving
    for k in range(50):
        timed(speeds, clock, 1, 4000.0, 0.1, f"later{k}")
    after = speeds.prefill_tokens_per_s()
    assert after[1] == pytest.approx(40_000, rel=0.05)
    assert after[0] > 30_000  # its one slow spell is forgotten: it is priced as the fleet now is


@pytest.mark.parametrize(
    "ttft", [None, 0.0, -1.0, math.inf, math.nan], ids=["missing", "zero", "negative", "infinite", "nan"]
)
def test_a_timing_that_is_not_a_positive_number_teaches_nothing(ttft: float | None) -> None:
    clock = Clock()
    speeds = ServerSpeeds(1, clock, min_requests=1)
    speeds.sent("r", 0, 1000.0)
    assert speeds.observed("r", ttft, None) is False
    assert speeds.timings == 0 and np.isnan(speeds.prefill_tokens_per_s()).all()


def test_only_requests_it_was_told_of_count_and_each_once() -> None:
    clock = Clock()
    speeds = ServerSpeeds(2, clock, min_requests=1)
    assert speeds.observed("never-sent", 0.1, 0.2) is False
    speeds.sent("r", 1, 1000.0)
    assert speeds.observed("r", 0.1, None) is True
    assert speeds.observed("r", 0.001, None) is False  # a repeated span or a second timing of the same request
    assert speeds.timings == 1
    speeds.sent("", 0, 10.0)  # no request id: nothing to join a timing to
    speeds.sent("bad-index", 7, 10.0)
    speeds.sent("bad-work", 0, math.nan)
    assert not any(speeds.observed(k, 0.1, None) for k in ("", "bad-index", "bad-work"))


def test_pending_sends_are_bounded_and_old_ones_forgotten() -> None:
    clock = Clock()
    speeds = ServerSpeeds(1, clock, max_pending=2, max_age_s=5.0, min_requests=1)
    for key in ("a", "b", "c"):
        speeds.sent(key, 0, 100.0)
    assert speeds.observed("a", 0.1, None) is False  # dropped for room, oldest first
    clock.now += 6.0
    assert speeds.observed("b", 0.1, None) is False  # its timing came after max_age_s
    speeds.sent("d", 0, 100.0)
    clock.now += 6.0
    speeds.forget_pending()
    assert speeds.observed("d", 0.1, None) is False and speeds.observed("c", 0.1, None) is False


def test_a_membership_change_keeps_each_staying_endpoints_speed_and_its_pending_sends() -> None:
    clock = Clock()
    speeds = ServerSpeeds(3, clock, prior_requests=0.0, min_requests=1)
    for k in range(10):
        for endpoint, rate in enumerate((10_000.0, 20_000.0, 40_000.0)):
            timed(speeds, clock, endpoint, 4000.0, 4000.0 / rate, f"{endpoint}-{k}")
    speeds.sent("to-2", 2, 4000.0)
    speeds.sent("to-0", 0, 4000.0)
    moved = speeds.moved(np.array([2, -1]))  # endpoint 2 is now 0; 0 and 1 left; a new one joined
    learned = moved.prefill_tokens_per_s()
    assert learned[0] == pytest.approx(40_000.0) and np.isnan(learned[1])
    assert moved.observed("to-0", 0.1, None) is False  # sent to an endpoint that left
    assert moved.observed("to-2", 0.2, None) is True
    assert moved.prefill_tokens_per_s()[0] < 40_000.0  # counted for the same server, under its new index


def _state(rates: list[float] | None = None, steps: list[float] | None = None, n: int = 2) -> State:
    pool = Pool([EndpointConfig(f"10.0.0.{i + 1}:8000", frozenset({"m"})) for i in range(n)])
    signals = Signals(n)
    values: dict[str, list[float]] = {}
    if rates is not None:
        values["prefill_tokens_per_s"] = rates
    if steps is not None:
        values["decode_step_s"] = steps
    signals.publish(Snapshot.empty(n).with_values(**values))
    return State(pool, InFlight(n), signals)


def test_the_prediction_prices_work_at_each_endpoints_learned_rate_plus_its_step() -> None:
    request = RequestFeatures(model="m", prompt_tokens=4000)
    candidates = np.arange(2)
    fixed = TtftPredictor(attention_tokens=0).seconds(request, _state(), candidates)  # its tokens alone
    assert fixed == pytest.approx([4000 / DEFAULT_PREFILL_TOKENS_PER_S] * 2)
    learned = TtftPredictor(attention_tokens=0).seconds(request, _state([40_000.0, 8_000.0], [0.006, 0.03]), candidates)
    assert learned == pytest.approx([4000 / 40_000 + 0.006, 4000 / 8_000 + 0.03])


def test_the_routing_unit_tells_the_speeds_the_work_it_counted_ahead_of_each_request() -> None:
    clock = Clock()
    n = 1
    pool = Pool([EndpointConfig("10.0.0.1:8000", frozenset({"m"}))])
    signals = Signals(n, clock=clock)
    inflight = InFlight(n, clock=clock)
    engine = Engine(pool, build_profile("default", np.random.default_rng(0), size=n), inflight, signals)
    speeds = ServerSpeeds(n, clock, prior_requests=0.0, min_requests=1)
    router = Router(engine, speeds=speeds)
    router.route(RequestFeatures(model="m", request_id="first", prompt_tokens=3000))
    router.route(RequestFeatures(model="m", request_id="second", prompt_tokens=1000))
    # The second request's first token waits for the first's prompt too (nothing drained: the clock stood still):
    # both prompts' work, each with its attention over the context before its tokens (the default's predictor).
    work = 3000 * (1 + 1500 / ATTENTION_TOKENS) + 1000 * (1 + 500 / ATTENTION_TOKENS)
    assert speeds.observed("second", 0.2, None) is True
    assert speeds.prefill_tokens_per_s()[0] == pytest.approx(work / 0.2)
    router.route(RequestFeatures(model="m", prompt_tokens=1000))  # no request id: nothing to join its timing to
    assert speeds.timings == 1


def test_the_peak_rate_counts_only_requests_that_found_the_server_idle() -> None:
    clock = Clock()
    speeds = ServerSpeeds(2, clock, prior_requests=0.0, min_requests=1)
    for k in range(PEAK_MIN_SAMPLES + 4):
        for endpoint, rate in ((0, 40_000.0), (1, 10_000.0)):
            # An idle request prefills at the hardware's rate; one that queued behind 20 s of waiting for a slot
            # brings the same work but a TTFT that is mostly the wait.
            speeds.sent(f"i{endpoint}-{k}", endpoint, 4000.0, idle=True)
            speeds.sent(f"q{endpoint}-{k}", endpoint, 4000.0, idle=False)
            clock.now += 0.01
            assert speeds.observed(f"i{endpoint}-{k}", 4000.0 / rate, None)
            assert speeds.observed(f"q{endpoint}-{k}", 20.0 + 4000.0 / rate, None)
    assert speeds.peak_tokens_per_s() == pytest.approx([40_000.0, 10_000.0])
    # The learned rate prices the queue as well: it is far below the hardware's on both.
    assert (speeds.prefill_tokens_per_s() < [4_000.0, 2_000.0]).all()


def test_the_peak_rate_needs_enough_idle_requests_of_real_work_and_follows_the_pool() -> None:
    clock = Clock()
    speeds = ServerSpeeds(3, clock, min_requests=1)
    for k in range(PEAK_MIN_SAMPLES):
        speeds.sent(f"a{k}", 0, 4000.0, idle=True)
        speeds.sent(f"b{k}", 1, PEAK_MIN_WORK / 2, idle=True)  # a short prompt: its TTFT is mostly the step
        if k:
            speeds.sent(f"c{k}", 2, 4000.0, idle=True)  # one sample short
        clock.now += 0.01
        for key in (f"a{k}", f"b{k}", f"c{k}"):
            speeds.observed(key, 0.1, None)
    peak = speeds.peak_tokens_per_s()
    assert peak[0] == pytest.approx(4000.0 / 0.1) and np.isnan(peak[1:]).all()
    moved = speeds.moved(np.array([-1, 0, 2]))  # endpoint 0 stays (now 1), 1 leaves, one joins (now 0)
    assert np.isnan(moved.peak_tokens_per_s()[[0, 2]]).all()
    assert moved.peak_tokens_per_s()[1] == pytest.approx(peak[0])


def test_the_routing_unit_marks_a_request_that_found_its_server_idle() -> None:
    clock = Clock()
    pool = Pool([EndpointConfig("10.0.0.1:8000", frozenset({"m"}))])
    signals = Signals(1, clock=clock)
    engine = Engine(pool, build_profile("default", np.random.default_rng(0), size=1), InFlight(1, clock=clock), signals)
    speeds = ServerSpeeds(1, clock, min_requests=1)
    router = Router(engine, speeds=speeds)
    router.route(RequestFeatures(model="m", request_id="first", prompt_tokens=3000))  # nothing ahead of it
    router.route(RequestFeatures(model="m", request_id="second", prompt_tokens=1000))  # 3,000 tokens ahead
    clock.now = 10.0  # both prefilled long ago
    signals.publish(signals.snapshot.with_values(waiting=[2.0]))
    router.route(RequestFeatures(model="m", request_id="third", prompt_tokens=1000))  # the server says 2 queue
    assert [entry[3] for entry in speeds._pending.values()] == [True, False, False]


def test_declared_speeds_start_each_endpoint_from_the_fleets_rate_per_unit_of_its_own() -> None:
    # Two H100-like endpoints that served everything so far at 30k tokens/s, and an L4-like one, declared 3x slower,
    # that served nothing: undeclared, it is priced at the fleet's 30k; declared, at a third of it.
    clock = Clock()
    hints = SpeedHints("gpu", {"h100": 3.0, "l4": 1.0})
    relative = hints.of([{"gpu": "h100"}, {"gpu": "h100"}, {"gpu": "l4"}])
    assert relative is not None and list(relative) == [3.0, 3.0, 1.0]
    undeclared = ServerSpeeds(3, clock, min_requests=1)
    declared = ServerSpeeds(3, clock, min_requests=1, relative=relative)
    for k in range(20):
        for speeds in (undeclared, declared):
            timed(speeds, clock, k % 2, 3000.0, 0.1, f"r{k}")
    assert undeclared.prefill_tokens_per_s()[2] == pytest.approx(30_000.0)
    assert declared.prefill_tokens_per_s() == pytest.approx([30_000.0, 30_000.0, 10_000.0])
    # Its own timings still win over the declaration as they come.
    for k in range(200):
        timed(declared, clock, 2, 1000.0, 0.05, f"l4-{k}")  # 20k tokens/s: faster than declared
    assert declared.prefill_tokens_per_s()[2] == pytest.approx(20_000.0, rel=0.05)


def test_declared_speeds_name_the_slower_hardware_and_equal_ones_change_nothing() -> None:
    hints = SpeedHints("gpu", {"h100": 3.0, "a100": 1.0}, default=0.5)
    assert hints.of([{"gpu": "h100"}, {"gpu": "h100"}]) is None  # all equal: nothing to tell apart
    relative = hints.of([{"gpu": "h100"}, {"gpu": "a100"}, {}, {"gpu": "tpu"}])
    assert relative is not None and list(relative) == [3.0, 1.0, 0.5, 0.5]
    # An endpoint without the label is not one whose label reads "None".
    assert list(SpeedHints("gpu", {"None": 2.0, "h100": 3.0}).of([{}, {"gpu": "h100"}])) == [1.0, 3.0]
    clock = Clock()
    speeds = ServerSpeeds(4, clock, min_requests=1, relative=relative)
    # No idle request was ever timed (the learned idle rates are unknown), yet the slower hardware is known: the
    # declared speeds, in tokens/s once a rate is learned.
    assert list(speeds.peak_tokens_per_s()) == [3.0, 1.0, 0.5, 0.5]
    for k in range(10):
        timed(speeds, clock, 0, 3000.0, 0.1, f"r{k}")
    assert speeds.peak_tokens_per_s() == pytest.approx([30_000.0, 10_000.0, 5_000.0, 5_000.0])
    with pytest.raises(ValueError, match="4 positive numbers"):
        speeds.relate(np.array([1.0, 0.0, 1.0, 1.0]))
    moved = speeds.moved(np.array([1, 0]), relative[[1, 0]])  # the a100 and the h100 swap places
    assert moved.prefill_tokens_per_s() == pytest.approx([10_000.0, 30_000.0], rel=0.01)


def test_the_ttft_gap_filter_drops_declared_slower_hardware_before_any_idle_rate_is_learned() -> None:
    # Without declared speeds the filter waits for learned idle rates, which a slow server busy from the start never
    # gets; with them it keeps a long prompt off the L4 whose queue the prediction says is seconds longer.
    from inferlb.scorer.filters import TtftGapFilter

    clock = Clock()
    for relative, kept in ((None, [0, 1]), (np.array([3.0, 1.0]), [0])):
        speeds = ServerSpeeds(2, clock, min_requests=1, prior_requests=0.0, relative=relative)
        for k in range(10):  # both busy (no timing counts as idle): 30k and 10k tokens/s
            timed(speeds, clock, 0, 3000.0, 0.1, f"h{k}")
            timed(speeds, clock, 1, 1000.0, 0.1, f"l{k}")
        assert speeds.prefill_tokens_per_s() == pytest.approx([30_000.0, 10_000.0])
        state = _state()
        state.signals.publish(
            Snapshot.empty(2).with_values(
                prefill_tokens_per_s=speeds.prefill_tokens_per_s(), peak_tokens_per_s=speeds.peak_tokens_per_s()
            )
        )
        request = RequestFeatures(prompt_tokens=40_000)  # predicted 1.3 s on the H100, 4 s on the L4
        assert list(TtftGapFilter().filter(request, state, np.array([0, 1]))) == kept

"""Tests for sim/engine.py: properties of the scheduler and step model (hypothesis), and exact small cases."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferlb.sim.engine import EngineModel, EngineOptions, RequestState, SimRequest
from inferlb.sim.profiles import get_profile

BASE = get_profile("h100-llama3.1-8b")
# A tiny server: 24 blocks of 16 tokens, so a few requests fill it and force preemption.
TINY = dataclasses.replace(BASE, num_gpu_blocks=24, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=4096)
EXACT = EngineOptions(jitter=0.0)


def check_blocks(engine: EngineModel) -> None:
    cache = engine.cache
    assert 0 <= cache.free <= cache.num_blocks
    # A cached block shared by several requests is one block.
    shared = {h for r in engine.running for h in r.blocks.hashed}
    assert len(shared) + sum(r.blocks.plain for r in engine.running) == cache.used
    assert all(r.blocks.blocks == 0 for r in engine.waiting)


def run_to_end(engine: EngineModel, limit: float = 1e6) -> None:
    t = engine.now
    while (end := engine.segment_end()) is not None and end < limit:
        t = max(t, end)
        engine.advance(t)
        check_blocks(engine)


request_spec = st.tuples(
    st.integers(0, 3),  # prefix family (shared leading blocks)
    st.integers(1, 200),  # prompt tokens
    st.integers(1, 60),  # output tokens
    st.floats(0, 0.5),  # gap before it arrives (s)
)


def make(i: int, family: int, prompt: int, output: int, block_size: int) -> SimRequest:
    hashes = [family * 1000 + j for j in range(prompt // block_size)]
    return SimRequest(f"r{i}", prompt, output, hashes)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=25), fast=st.booleans())
def test_blocks_never_exceed_total_and_every_request_completes_exactly(specs, fast):
    engine = EngineModel(TINY, EngineOptions(jitter=0.05, seed=1, fast_forward=fast))
    requests = arrive(engine, specs, [])
    run_to_end(engine)
    check_all_finished_exactly(engine, requests)


def arrive(engine: EngineModel, specs, requests: list[SimRequest]) -> list[SimRequest]:
    """Add a request per (family, prompt, output, gap) spec after ``requests``, checking blocks at every step."""
    t = 0.0
    for i, (family, prompt, output, gap) in enumerate(specs, start=len(requests)):
        t += gap
        engine.advance(t)
        check_blocks(engine)
        request = make(i, family, prompt, output, TINY.block_size)
        assert engine.add(request)
        requests.append(request)
        check_blocks(engine)
    return requests


def check_all_finished_exactly(engine: EngineModel, requests: list[SimRequest]) -> None:
    assert not engine.running and not engine.waiting
    assert engine.cache.used == 0
    for request in requests:
        assert request.state is RequestState.FINISHED
        assert request.output == request.max_tokens
        assert request.arrival <= request.scheduled_at <= request.first_token_at <= request.finished_at


# Two requests that arrive together, each short enough to be admitted at once (2 x 16 tokens of a 64-token
# budget) and long enough to hold 14..24 of TINY's 24 blocks by its end. They decode side by side, at most a few
# tokens apart beyond their prompts' difference, so the one that would finish first needs >= 14 blocks while the
# other holds >= 13: 27 > 24, and one of them must be preempted first.
crowding_pair = st.lists(
    st.tuples(st.integers(1, 16), st.integers(14 * 16, 24 * 16)),  # (prompt tokens, prompt + output tokens)
    min_size=2,
    max_size=2,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=crowding_pair, later=st.lists(request_spec, max_size=10), fast=st.booleans())
def test_requests_preempted_for_blocks_still_complete_exactly(pair, later, fast):
    engine = EngineModel(TINY, EngineOptions(jitter=0.05, seed=2, fast_forward=fast))
    requests = [make(i, 10 + i, prompt, total - prompt, TINY.block_size) for i, (prompt, total) in enumerate(pair)]
    for request in requests:
        assert engine.add(request)
    arrive(engine, later, requests)
    run_to_end(engine)
    assert engine.preemptions > 0
    assert engine.preemptions == sum(r.preemptions for r in requests)
    check_all_finished_exactly(engine, requests)


def test_preempted_requests_resume_and_finish():
    engine = EngineModel(TINY, EXACT)
    requests = [SimRequest(f"r{i}", 100, 60) for i in range(4)]  # 4 x 160 tokens > 24 x 16 blocks
    for request in requests:
        engine.add(request)
    run_to_end(engine)
    assert engine.preemptions > 0
    assert any(r.preemptions for r in requests)
    assert all(r.state is RequestState.FINISHED and r.output == 60 for r in requests)


def test_prefix_counters_count_first_admissions_only():
    # Four prompts that share nothing, on a server too small to hold them all to the end: requests are preempted,
    # and readmitted they find their own blocks in the cache. vLLM counts those lookups apart, not in
    # vllm:prefix_cache_queries/_hits; neither may the emulator, or a policy that overloads servers looks
    # cache-friendly.
    engine = EngineModel(TINY, EXACT)
    requests = [make(i, i, 100, 60, TINY.block_size) for i in range(4)]  # 4 x 160 tokens > 24 x 16 blocks
    for request in requests:
        engine.add(request)
    run_to_end(engine)
    assert engine.preemptions > 0
    assert (engine.prefix_queries, engine.prefix_hits) == (400, 0)


@settings(max_examples=25, deadline=None)
@given(ahead=st.lists(st.integers(0, 12), min_size=2, max_size=4, unique=True), prompt=st.integers(64, 3000))
def test_ttft_grows_with_queue_length(ahead, prompt):
    ttfts = []
    for queued in sorted(ahead):
        engine = EngineModel(BASE, EXACT)
        for i in range(queued):
            engine.add(SimRequest(f"q{i}", prompt, 50))
        probe = SimRequest("probe", prompt, 10)
        engine.add(probe)
        run_to_end(engine)
        ttfts.append(probe.ttft_s)
    assert ttfts == sorted(ttfts)
    assert ttfts[-1] > ttfts[0]


@settings(max_examples=25, deadline=None)
@given(prompt=st.integers(64, 20000), output=st.integers(1, 50))
def test_a_repeated_prefix_lowers_ttft(prompt, output):
    engine = EngineModel(BASE, EXACT)
    hashes = list(range(prompt // BASE.block_size))
    first = SimRequest("a", prompt, output, hashes)
    engine.add(first)
    run_to_end(engine)
    second = SimRequest("b", prompt, output, hashes)
    engine.add(second)
    run_to_end(engine)
    assert second.cached_tokens == min(len(hashes), (prompt - 1) // BASE.block_size) * BASE.block_size
    if second.cached_tokens:
        assert second.ttft_s < first.ttft_s
    assert engine.prefix_hits == second.cached_tokens


@settings(max_examples=30, deadline=None)
@given(specs=st.lists(request_spec, min_size=1, max_size=15))
def test_fast_forward_matches_step_by_step(specs):
    results = []
    steps = []
    for fast in (False, True):
        engine = EngineModel(BASE, EngineOptions(jitter=0.0, fast_forward=fast))
        requests = []
        t = 0.0
        for i, (family, prompt, output, gap) in enumerate(specs):
            t += gap
            engine.advance(t)
            request = make(i, family, prompt, output, BASE.block_size)
            engine.add(request)
            requests.append(request)
        run_to_end(engine)
        results.append([(r.ttft_s, r.e2e_s, r.cached_tokens) for r in requests])
        steps.append(engine.steps)
    assert steps[0] == steps[1]
    for slow, fast in zip(*results, strict=True):
        assert fast[0] == pytest.approx(slow[0], rel=1e-9, abs=1e-9)
        assert fast[1] == pytest.approx(slow[1], rel=1e-9, abs=1e-9)
        assert fast[2] == slow[2]


def test_one_request_timing_follows_the_profile():
    engine = EngineModel(BASE, EXACT)
    request = SimRequest("a", 1000, 3)
    engine.add(request)
    run_to_end(engine)
    prefill = BASE.step_time(1000, 1000 * 500, 0, 0)
    assert request.ttft_s == pytest.approx(prefill)
    decode = BASE.step_time(0, 0, 1, 1000) + BASE.step_time(0, 0, 1, 1001)
    assert request.e2e_s == pytest.approx(prefill + decode)


def test_long_prompt_is_prefilled_in_chunks_and_decodes_interleave():
    engine = EngineModel(BASE, EXACT)
    short = SimRequest("short", 100, 200)
    engine.add(short)
    engine.advance(0.05)  # short is decoding
    long = SimRequest("long", BASE.max_num_batched_tokens * 3, 5)
    engine.add(long)
    run_to_end(engine)
    # The long prompt took at least three steps, and the short request kept getting a token in each.
    assert long.ttft_s >= 3 * BASE.step_time(BASE.max_num_batched_tokens - 1, 0, 1, 0) * 0.99
    assert short.state is RequestState.FINISHED and short.output == 200


def test_error_rate_rejects_and_hang_stops_progress():
    engine = EngineModel(BASE, EXACT)
    engine.error_rate = 1.0
    assert not engine.add(SimRequest("x", 10, 5))
    engine.error_rate = 0.0
    request = SimRequest("y", 10, 50)
    engine.add(request)
    engine.advance(0.02)
    engine.set_hung(True)
    engine.advance(10.0)
    stuck = request.output
    assert request.state is RequestState.RUNNING and stuck < 50
    engine.advance(20.0)
    assert request.output == stuck
    engine.set_hung(False)
    run_to_end(engine)
    assert request.state is RequestState.FINISHED and request.finished_at > 20.0


def test_slowdown_multiplies_step_time():
    times = []
    for factor in (1.0, 5.0):
        engine = EngineModel(BASE, EXACT)
        engine.set_slowdown(factor)
        request = SimRequest("a", 500, 20)
        engine.add(request)
        run_to_end(engine)
        times.append(request.e2e_s)
    assert times[1] == pytest.approx(5 * times[0])


def test_restart_aborts_everything_and_cold_starts():
    engine = EngineModel(BASE, EXACT)
    requests = [SimRequest(f"r{i}", 100, 100, list(range(6))) for i in range(3)]
    for request in requests:
        engine.add(request)
    engine.advance(0.1)
    lost = engine.restart()
    assert set(lost) == set(requests)
    assert all(r.state is RequestState.ABORTED for r in requests)
    assert engine.cache.used == 0 and engine.cache.cached_blocks == 0
    assert not engine.ready and engine.ready_at == pytest.approx(0.1 + BASE.cold_start_s)
    late = SimRequest("late", 100, 5)
    engine.add(late)
    run_to_end(engine)
    assert late.scheduled_at == pytest.approx(engine.ready_at)


def test_abort_frees_blocks():
    engine = EngineModel(BASE, EXACT)
    request = SimRequest("a", 1000, 500)
    engine.add(request)
    engine.advance(0.2)
    assert engine.cache.used > 0
    engine.abort(request)
    run_to_end(engine)
    assert engine.cache.used == 0
    assert request.state is RequestState.ABORTED
    assert engine.finished[-1] is request

"""Tests for sim/des.py: the discrete-event fleet simulator."""

from __future__ import annotations

import itertools

import pytest

from inferlb.sim.des import Arrival, FaultEvent, FleetView, Hold, Refuse, simulate, trace_arrivals
from inferlb.sim.profiles import get_profile
from inferlb.sim.traces import load_trace

H100 = get_profile("h100-llama3.1-8b")


def arrivals(n: int, gap: float = 0.05, prompt: int = 800, output: int = 40, families: int = 0) -> list[Arrival]:
    out = []
    for i in range(n):
        hashes = [(i % families) * 10_000 + j for j in range(prompt // H100.block_size)] if families else ()
        out.append(Arrival(f"a{i}", i * gap, prompt, output, hashes))
    return out


def round_robin():
    counter = itertools.count()
    return lambda arrival, view: next(counter) % len(view.servers)


def test_every_request_finishes_with_its_exact_output_and_timings():
    result = simulate(arrivals(40), round_robin(), [H100] * 4, seed=3)
    assert len(result.records) == 40
    assert [r.id for r in result.records] == [f"a{i}" for i in range(40)]
    for record in result.records:
        assert record.error is None
        assert record.output_tokens == 40
        assert 0 <= record.queue_s <= record.ttft_s <= record.e2e_s
    assert [s.requests for s in result.servers] == [10, 10, 10, 10]
    assert sum(s.busy_s for s in result.servers) > 0


def test_same_seed_same_result_other_seed_other_timings():
    a = simulate(arrivals(30), round_robin(), [H100] * 3, seed=1)
    b = simulate(arrivals(30), round_robin(), [H100] * 3, seed=1)
    c = simulate(arrivals(30), round_robin(), [H100] * 3, seed=2)
    assert a.records == b.records
    assert [r.e2e_s for r in a.records] != [r.e2e_s for r in c.records]


def test_the_policy_sees_stale_scrapes_and_exact_inflight_counts():
    seen = []
    ages = []
    routed = [0, 0]

    def policy(arrival: Arrival, view: FleetView) -> int:
        for snap in view.snapshots:
            assert snap is not None
            ages.append(view.now - snap.scraped_at)
        seen.append((list(view.inflight), sum(routed)))
        choice = len(seen) % 2
        routed[choice] += 1
        return choice

    result = simulate(arrivals(50, gap=0.02, output=200), policy, [H100] * 2, scrape_interval_s=0.5)
    assert len(result.records) == 50
    assert min(ages) >= 0 and max(ages) < 0.5
    assert max(ages) > 0.4  # stale by up to one scrape interval, as a real picker's view is
    # Requests pile up (each runs ~1.5 s, arriving every 20 ms), and the counts say so at once.
    assert max(sum(inflight) for inflight, _ in seen) > 10
    for inflight, sent in seen:
        assert 0 <= sum(inflight) <= sent


def test_least_inflight_beats_everything_on_one_server_under_load():
    load = arrivals(60, gap=0.01, prompt=2000, output=100)

    def least(arrival, view):
        return min(range(len(view.servers)), key=view.inflight.__getitem__)

    spread = simulate(load, least, [H100] * 4)
    piled = simulate(load, lambda a, v: 0, [H100] * 4)
    p = lambda res: sorted(r.ttft_s for r in res.records)[len(res.records) // 2]  # noqa: E731
    assert p(spread) < p(piled)


def test_prefix_affinity_raises_the_hit_rate():
    # 20 prompt families, each seen 4 times: kept together, 3 of 4 visits hit; spread over 4 servers, none do.
    load = arrivals(80, gap=0.05, prompt=1600, output=20, families=20)
    by_family = simulate(load, lambda a, v: int(a.id[1:]) % 20 % 4, [H100] * 4)
    shuffled = simulate(load, lambda a, v: (int(a.id[1:]) // 20) % 4, [H100] * 4)

    def rate(res):
        return sum(s.prefix_cache_hits for s in res.servers) / sum(s.prefix_cache_queries for s in res.servers)

    assert rate(by_family) == pytest.approx(0.75, abs=0.02)
    assert rate(shuffled) == 0
    assert sum(r.cached_tokens for r in by_family.records) > sum(r.cached_tokens for r in shuffled.records)


def test_a_slowed_server_is_slower():
    load = arrivals(40, gap=0.1)
    result = simulate(load, round_robin(), [H100] * 2, faults=[FaultEvent(0.0, 0, "slowdown", 5.0)])
    slow = [r.e2e_s for r in result.records if r.server == 0]
    fast = [r.e2e_s for r in result.records if r.server == 1]
    assert min(slow) > 3 * max(fast)


def test_crash_aborts_its_requests_and_the_server_is_unavailable_during_cold_start():
    load = arrivals(60, gap=0.1, output=400)
    result = simulate(load, round_robin(), [H100] * 2, faults=[FaultEvent(1.0, 0, "crash")])
    errors = {r.error for r in result.records if r.server == 0}
    assert "aborted" in errors and "unavailable" in errors
    assert all(r.error is None for r in result.records if r.server == 1)
    assert all(r.error == "unavailable" for r in result.records if r.server == 0 and 1.0 < r.arrival_s < 5.0)


def test_error_rate_rejects_and_hang_delays_until_released():
    load = arrivals(40, gap=0.05)
    faults = [FaultEvent(0.0, 0, "error_rate", 1.0), FaultEvent(0.0, 1, "hang", 1), FaultEvent(10.0, 1, "hang", 0)]
    result = simulate(load, round_robin(), [H100] * 2, faults=faults)
    assert all(r.error == "rejected" for r in result.records if r.server == 0)
    hung = [r for r in result.records if r.server == 1]
    assert all(r.error is None and r.arrival_s + r.ttft_s >= 10.0 for r in hung)


def test_a_failing_policy_is_counted_and_its_requests_still_run():
    def broken(arrival, view):
        if arrival.id.endswith("3"):
            raise RuntimeError("boom")
        return 99 if arrival.id.endswith("5") else 0

    result = simulate(arrivals(20), broken, [H100] * 2)
    assert result.policy_errors == sum(1 for i in range(20) if str(i).endswith(("3", "5")))
    assert all(r.error is None for r in result.records)


def test_no_drain_stops_at_the_last_arrival():
    result = simulate(arrivals(10, gap=0.01, output=2000), round_robin(), [H100] * 2, drain=False)
    assert {r.error for r in result.records} == {"unfinished"}
    assert result.simulated_s == pytest.approx(0.09)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"profiles": []}, "at least one server", id="no-servers"),
        pytest.param({"scrape_interval_s": 0}, "scrape_interval_s", id="bad-interval"),
        pytest.param({"faults": [FaultEvent(0, 5, "crash")]}, r"faults\[0\].server", id="fault-server"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    options = {"profiles": [H100], **kwargs}
    profiles = options.pop("profiles")
    with pytest.raises(ValueError, match=message):
        simulate(arrivals(2), round_robin(), profiles, **options)


def test_unknown_fault_kind_is_refused():
    with pytest.raises(ValueError, match="kind"):
        FaultEvent(0, 0, "explode")


def test_scrapes_report_gpu_utilization():
    seen = []

    def policy(arrival, view):
        seen.append([s.gpu_utilization for s in view.snapshots])
        return 0

    simulate(arrivals(40, gap=0.05, prompt=3000, output=200), policy, [H100] * 2, scrape_interval_s=0.2)
    assert max(u[0] for u in seen) > 0.9  # server 0 takes everything and is busy
    assert max(u[1] for u in seen) == 0.0  # server 1 gets nothing


def test_trace_arrivals_keep_the_traces_prefix_sharing(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        '{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}',
        '{"timestamp": 500, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 3]}',
        '{"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]}',
    ]
    path.write_text("\n".join(rows))
    trace = load_trace(path)
    got = trace_arrivals(trace, H100.block_size)
    assert [a.id for a in got] == ["t/0", "t/1", "t/2"]
    assert [a.at for a in got] == [0.0, 0.5, 1.0]
    assert [len(a.prompt_hashes) for a in got] == [1100 // 16, 1100 // 16, 600 // 16]
    shared = sum(1 for x, y in zip(got[0].prompt_hashes, got[1].prompt_hashes, strict=False) if x == y)
    assert shared == 1024 // 16  # two full 512-token blocks in common
    assert not set(got[2].prompt_hashes) & set(got[0].prompt_hashes)
    result = simulate(got, lambda a, v: 0, [H100])
    assert [r.cached_tokens for r in result.records] == [0, 1024, 0]


def test_a_held_request_is_asked_again_and_its_wait_counts_in_its_times():
    asked: list[tuple[str, float]] = []

    def hold_the_first_until_one_second(arrival, view):
        asked.append((arrival.id, view.now))
        if arrival.id == "0" and view.now < 1.0:
            return Hold(1.0)
        return 0

    profile = get_profile("h100-llama3.1-8b")
    alone = simulate([Arrival("0", 0.0, 800, 40)], lambda a, v: 0, [profile], seed=0).records[0]
    held = simulate([Arrival("0", 0.0, 800, 40)], hold_the_first_until_one_second, [profile], seed=0).records[0]
    assert asked == [("0", 0.0), ("0", 1.0)]
    assert held.arrival_s == 0.0 and held.error is None
    assert held.ttft_s == pytest.approx(alone.ttft_s + 1.0)
    assert held.e2e_s == pytest.approx(alone.e2e_s + 1.0)


def test_a_refused_request_reaches_no_server_and_is_reported_as_it_ends():
    ended = []
    result = simulate(
        arrivals(3),
        lambda a, v: Refuse("shed") if a.id == "a1" else 0,
        [get_profile("h100-llama3.1-8b")],
        on_finish=lambda record, now: ended.append((record.id, record.error)),
    )
    refused = [r for r in result.records if r.error is not None]
    assert [(r.id, r.server, r.error, r.ttft_s) for r in refused] == [("a1", -1, "shed", None)]
    assert result.servers[0].requests == 2
    assert ("a1", "shed") in ended and len(ended) == 3

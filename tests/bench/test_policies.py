"""Tests for bench/policies.py: Envoy's balancers as Envoy does them, the oracle, and the preset policy, which
routes through the routing unit Envoy's requests take, admission control included, on the simulator's clock."""

from __future__ import annotations

import numpy as np
import pytest

from inferlb.bench.policies import LeastRequest, Oracle, PresetPolicy, RoundRobin
from inferlb.scorer.classes import Classifier, RequestClass
from inferlb.sim.des import Arrival, FleetView, Hold, Refuse, simulate
from inferlb.sim.profiles import get_profile

H100 = get_profile("h100-llama3.1-8b")


def test_a_burst_past_saturation_waits_for_capacity_and_every_lease_ends() -> None:
    profiles = [H100] * 2
    policy = PresetPolicy("least-request", profiles, seed=0)
    # 80 long prompts in 40 ms: after 16 sent to each server since the last scrape both count as saturated, so
    # the rest wait in the admission queue (a scrape every 100 ms shows the queues) instead of piling on.
    burst = [Arrival(str(i), i * 0.0005, 6000, 8) for i in range(80)]
    result = simulate(burst, policy, profiles, seed=0, on_finish=policy.finished)
    assert result.policy_errors == 0 and policy.decisions == 80
    assert policy.held > 0
    assert all(r.error is None for r in result.records) and len(result.records) == 80
    assert policy.inflight.total() == 0 and not policy.router.queue  # every lease released, nobody waiting
    held_ttfts = sorted(r.ttft_s for r in result.records)
    assert held_ttfts[-1] > 0.1


def test_without_saturation_nothing_waits() -> None:
    profiles = [H100] * 4
    policy = PresetPolicy("default", profiles, seed=0)
    arrivals = [Arrival(str(i), i * 0.05, 300, 20) for i in range(40)]
    simulate(arrivals, policy, profiles, seed=0, on_finish=policy.finished)
    assert (policy.held, policy.waited_out, policy.decisions) == (0, 0, 40)


def test_envoy_round_robin_and_least_request_as_envoy_does_them() -> None:
    arrivals = [Arrival(str(i), i * 0.01, 200, 400) for i in range(40)]
    rr = simulate(arrivals, RoundRobin(), [H100] * 4, seed=0, drain=False)
    assert [r.server for r in rr.records[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    # Least request: the less busy of two random choices. An idle server among busy ones wins whenever it is
    # drawn, 1 - (3/4)^2 = 7/16 of the time (uniform random would give it 1/4).
    lr = LeastRequest(seed=3)
    view = _view(inflight=[0, 9, 9, 9])
    share = sum(lr(arrivals[0], view) == 0 for _ in range(4000)) / 4000
    assert share == pytest.approx(7 / 16, abs=0.03)


def _view(inflight: list[int]) -> FleetView:
    n = len(inflight)
    return FleetView(0.0, tuple(f"s{i}" for i in range(n)), [None] * n, inflight, [0] * n, ())


def test_the_oracle_goes_where_the_prefix_is_cached() -> None:
    shared = list(range(1000, 1064))  # 64 blocks of 16 tokens: 1,024 tokens of shared prefix
    first = Arrival("a", 0.0, 1024, 4, shared)
    rest = [Arrival(f"b{i}", 1.0 + i, 1100, 4, [*shared, 5000 + i]) for i in range(6)]
    result = simulate([first, *rest], Oracle([H100] * 4), [H100] * 4, seed=0)
    assert {r.server for r in result.records} == {result.records[0].server}  # everything follows the cache
    assert sum(r.cached_tokens for r in result.records[1:]) >= 6 * 1024 - 6 * 16


def test_a_preset_decides_through_the_engine_and_learns_latency_from_finished_requests() -> None:
    profiles = [H100] * 3
    policy = PresetPolicy("default", profiles, seed=0)
    arrivals = [Arrival(str(i), i * 0.05, 300, 20) for i in range(60)]
    result = simulate(arrivals, policy, profiles, seed=0, on_finish=policy.finished)
    assert result.policy_errors == 0 and policy.decisions == 60
    assert len({r.server for r in result.records}) == 3
    assert np.isfinite(policy.signals.snapshot.ttft_s).all()  # the latency scorer had data
    assert policy.decide_cpu_s > 0


def test_a_class_that_sheds_is_refused_past_saturation_and_reaches_no_server() -> None:
    profiles = [H100] * 2
    batch = RequestClass("batch", on_saturation="shed")
    policy = PresetPolicy("least-request", profiles, seed=0, classifier=Classifier(default=batch))
    burst = [Arrival(str(i), i * 0.0005, 6000, 8) for i in range(80)]
    result = simulate(burst, policy, profiles, seed=0, on_finish=policy.finished)
    shed = [r for r in result.records if r.error == "shed"]
    assert shed and len(shed) == policy.refused and policy.held == 0
    assert {r.server for r in shed} == {-1} and policy.decisions == 80 - len(shed)
    assert policy.inflight.total() == 0


def test_on_a_mixed_fleet_the_default_learns_which_servers_are_slow_and_sends_them_less() -> None:
    l4 = get_profile("l4-llama3.2-3b")
    profiles = [H100, H100, l4, l4]
    rng = np.random.default_rng(5)
    arrivals = [Arrival(str(i), i * 0.04, int(rng.integers(500, 4000)), int(rng.integers(20, 120))) for i in range(600)]
    shares = {}
    for learn in (False, True):
        policy = PresetPolicy("default", profiles, seed=0, learn_speeds=learn)
        result = simulate(arrivals, policy, profiles, seed=0, on_finish=policy.finished)
        assert result.policy_errors == 0 and all(r.error is None for r in result.records)
        shares[learn] = sum(r.server >= 2 for r in result.records) / len(result.records)
        if learn:
            assert policy.speeds is not None
            rates, steps = policy.speeds.prefill_tokens_per_s(), policy.speeds.decode_step_s()
            # Learned from the timings alone: the H100s prefill faster and step quicker than the L4s.
            assert min(rates[:2]) > 1.5 * max(rates[2:])
            assert max(steps[:2]) < min(steps[2:])
    assert shares[True] < shares[False]


def test_with_first_tokens_the_backlog_counts_the_prompts_whose_first_token_has_not_come() -> None:
    # The stream deployment (otel.latency_source: stream): before every decision the policy tells the leases of the
    # first tokens that came, so the exact backlog on each server is the uncached tokens of the requests it routed
    # there that have no first token yet.
    profiles = [H100] * 3
    policy = PresetPolicy("default", profiles, seed=0, first_tokens=True)
    checked = told = 0

    def check(arrival: Arrival, view: FleetView) -> int | Hold | Refuse:
        nonlocal checked, told
        chosen = policy(arrival, view)
        if not isinstance(chosen, int):  # held for capacity: presented again later
            return chosen
        waiting = np.zeros(3)
        for server, engine in enumerate(view.engines):
            for request in (*engine.waiting, *engine.running):
                lease = policy._leases.get(request.id)
                if lease is not None and request.first_token_at is None:
                    waiting[server] += lease.unprefilled
                elif lease is not None:
                    told += lease.unprefilled == 0
        waiting[chosen] += policy._leases[arrival.id].unprefilled  # not at its server yet
        pending = policy.inflight.pending_prefill(np.arange(3), np.ones(3))
        assert pending == pytest.approx(waiting)
        checked += pending.sum() > 0
        return chosen

    arrivals = [Arrival(str(i), i * 0.01, 3000, 30) for i in range(150)]
    result = simulate(arrivals, check, profiles, seed=0, on_finish=policy.finished)
    assert result.policy_errors == 0 and all(r.error is None for r in result.records)
    assert checked > 50 and told > 50  # backlogs were there to count, and first tokens took prompts out of them
    # Nothing left but rounding: the work of a prompt (its tokens, weighted for attention) is not a whole number.
    assert policy.inflight.total() == 0
    assert policy.inflight.pending_prefill(np.arange(3), np.ones(3)).sum() == pytest.approx(0, abs=1e-6)

"""Tests for bench/policies.py's preset policy: the simulator routes through the routing unit Envoy's requests
take, admission control included, on the simulator's clock."""

from __future__ import annotations

from inferlb.bench.policies import PresetPolicy
from inferlb.sim.des import Arrival, simulate
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

"""bench/experiments.py's simulator parts on synthetic traffic: an injected TTFT difference is found with the right
sign while an A/A run finds nothing, and a grey release's canary ramps when healthy and is cut and rolled back when
it fails requests, with the failures it caused bounded."""

from __future__ import annotations

import random

from inferlb.bench.experiments import CANARY_FAULT_RATE, Fleet, _canary_spec, _rolled_back, release, watched_run
from inferlb.sim.des import Arrival


def _fleet(requests: int, rate_rps: float, seed: int = 0) -> Fleet:
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for i in range(requests):
        t += rng.expovariate(rate_rps)
        arrivals.append(Arrival(str(i), t, rng.randrange(200, 2000), rng.randrange(10, 60)))
    return Fleet(arrivals, rate_rps)


def test_an_injected_difference_is_found_and_an_a_a_run_finds_nothing() -> None:
    fleet = _fleet(1200, 20.0)
    slower = watched_run(fleet, seed=1, effect=1.5)
    assert slower.first["ttft"][1] == "worse" and slower.first["ttft"][0] <= 1200
    for seed in range(3):
        assert watched_run(fleet, seed=seed).first == {}


def test_a_failing_canary_is_cut_and_rolled_back_and_a_healthy_one_ramps() -> None:
    fleet = _fleet(2400, 40.0, seed=2)  # a minute
    spec = _canary_spec(ramp=(0.05, 0.1, 0.2), step_s=10.0)
    faulty = release(fleet, spec, faulty=True)
    assert [c["kind"] for c in faulty["changes"]][-1] == "rolled-back" and faulty["state"] == "rolled back"
    assert faulty["first_cut_after_s"] is not None and faulty["first_cut_after_s"] < 10
    assert faulty["failed_elsewhere"] == 0
    # Failures are bounded by how much the canary got before the roll-back: about the fault's share of it.
    assert faulty["canary_failed_requests"] <= faulty["canary_requests"] * CANARY_FAULT_RATE * 3 + 3
    assert faulty["canary_requests"] < 0.05 * len(fleet.arrivals)
    healthy = release(fleet, spec, faulty=False)
    steps = [(c["kind"], c["weight"]) for c in healthy["changes"]]
    # It ramps to its fair share and is never rolled back. Its one server has no neighbour to share a burst with, so
    # once it carries a full share its TTFT p99 may pass 2x the balanced pool's by chance: one cut at most, after
    # which it ramps again.
    assert steps[:2] == [("ramp", 0.1), ("ramp", 0.2)]
    assert steps[2:] in ([], [("cut", 0.06)], [("cut", 0.06), ("ramp", 0.1)])
    assert healthy["changes"][0]["at_s"] >= 10.0 and healthy["state"] == "running"
    assert healthy["canary_failed_requests"] == 0


def test_the_report_says_when_a_failing_canary_was_not_rolled_back_before_the_run_ended() -> None:
    assert _rolled_back({"rolled_back_after_s": 72.3, "final_weight": 0.0, "state": "rolled back"}) == (
        "rolled back after 72.3 s"
    )
    running = _rolled_back({"rolled_back_after_s": None, "final_weight": 0.015, "state": "running"})
    assert running == "not rolled back before the run ended (its weight then 1.5%, running)"

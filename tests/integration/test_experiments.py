"""Experiments through real Envoy and emulated servers: on a shared-prefix workload, ``default`` against
``round-robin`` is found better on TTFT (with the right sign), and ``default`` against ``default`` is found
nothing. The benchmark's own code runs it (`bench.experiments.ab_through_envoy`) with a smaller budget and a
stricter alpha, so that an A/A verdict by chance is rarer than 1 run in 100."""

from __future__ import annotations

import pytest

from inferlb.bench.experiments import LIVE_CANARY_RAMP, ab_through_envoy, live_canary

pytestmark = pytest.mark.envoy


@pytest.mark.timeout(300)
def test_default_beats_round_robin_on_ttft_and_an_a_a_finds_nothing() -> None:
    result = ab_through_envoy(quick=True, alpha=0.01)
    ab, aa = result["ab"], result["aa"]
    assert ab["client_errors"] == 0 and aa["client_errors"] == 0
    assert ab["verdict"] == "better", ab
    assert ab["ttft_log_difference"] < 0 and ab["ttft_interval"][1] < 0  # default's TTFT is lower
    assert ab["requests_to_verdict"] <= result["budget"]
    assert sum(arm["requests"] for arm in ab["arms"].values()) == ab["sent"]  # every request counted in an arm
    assert aa["verdict"] is None and aa["sent"] == result["budget"] // 2


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("latency_source", ["stream", "spans"])
def test_a_canary_that_fails_requests_is_cut_through_envoy(latency_source: str) -> None:
    """The emulator's own fault injection: the canary server fails 10% of its requests; the picker sees the 5xx
    on the response stream (``stream``) or in Envoy's access log, with the successes from the servers' spans
    (``spans``), and the guard cuts the canary's weight. Only the canary's requests fail."""
    # ~60 canary requests: some fail (1 - 0.9^60 > 0.998).
    result = live_canary(faulty=True, seconds=60.0, latency_source=latency_source)
    assert result["first_cut_after_s"] is not None and result["first_cut_after_s"] < 60.0
    assert result["failed_elsewhere"] == 0 and 1 <= result["canary_failed_requests"] <= result["canary_requests"]
    assert result["final_weight"] < LIVE_CANARY_RAMP[0]

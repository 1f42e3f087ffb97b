"""Experiments through real Envoy and emulated servers: on a shared-prefix workload, ``default`` against
``round-robin`` is found better on TTFT (with the right sign), and ``default`` against ``default`` is found
nothing. The benchmark's own code runs it (`bench.experiments.ab_through_envoy`) with a smaller budget and a
stricter alpha, so that an A/A verdict by chance is rarer than 1 run in 100."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from inferlb.bench.experiments import LIVE_CANARY_RAMP, ab_through_envoy, live_canary
from inferlb.stack import LocalStack, StackOptions

pytestmark = pytest.mark.envoy


@pytest.mark.slow  # 44 s on two cores; CI runs it (make test-slow)
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
    tpot = result["tpot_p50_s"]  # the emulator's spans report output tokens; the response stream does not
    if latency_source == "spans":
        assert all(0 < seconds < 1 for seconds in tpot.values()), tpot
    else:
        assert set(tpot.values()) == {None}, tpot


@pytest.mark.timeout(120)
def test_a_release_arm_sends_its_requests_as_another_model_through_envoy(tmp_path: Path) -> None:
    """Every server serves both names; the canary's requests reach them as ``m-next`` (the emulator answers with
    the model the body names), whole and with the new length, and everyone else's as sent."""
    experiment = {
        "name": "next",
        "assign": "header",
        "header": "x-canary",
        "values": {"true": "next"},
        "scope": {"models": ["m"]},
        "arms": [{"name": "stable", "profile": "default"}, {"name": "next", "profile": "default", "model": "m-next"}],
    }
    options = StackOptions(backends=2, models=("m", "m-next"), picker_config={"experiments": [experiment]})
    prompt = "a prompt with a tail of text " * 20
    with LocalStack(options, tmp_path) as stack, httpx.Client(base_url=stack.gateway_url, timeout=30) as client:
        answers = {}
        for canary in ("true", None):
            headers = {"x-canary": canary} if canary else {}
            completion = {"model": "m", "prompt": prompt, "max_tokens": 4}
            plain = client.post("/v1/completions", json=completion, headers=headers)
            chat = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "stream": True}
            with client.stream("POST", "/v1/chat/completions", json=chat, headers=headers) as streamed:
                events = [line for line in streamed.iter_lines() if line.startswith("data: {")]
                status = streamed.status_code
            answers[canary] = (plain.status_code, plain.json()["model"], status, json.loads(events[0][6:])["model"])
        shown = client.get(f"{stack.picker_admin_url}/experiments", headers=stack.admin_headers).json()
    assert answers["true"] == (200, "m-next", 200, "m-next")
    assert answers[None] == (200, "m", 200, "m")
    arms = {arm["name"]: arm["requests"] for arm in shown["experiments"][0]["arms"]}
    assert arms == {"stable": 2, "next": 2}

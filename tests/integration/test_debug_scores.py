"""debug_scores through a real Envoy: every routed response names the candidates' scores, best first (the served
endpoint first); off, the default, no response says anything of the pool."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from inferlb.procs import SERVER_HEADER
from inferlb.stack import LocalStack, StackOptions

pytestmark = pytest.mark.envoy

MODEL = "m1"
COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_routed_responses_name_the_scores_only_when_asked(tmp_path: Path, on: bool) -> None:
    options = StackOptions(backends=3, models=(MODEL,), picker_config={"debug_scores": True} if on else {})
    with LocalStack(options, tmp_path) as stack, httpx.Client(base_url=stack.gateway_url, timeout=10) as client:
        for _ in range(3):
            response = client.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200
            header = response.headers.get("x-inferlb-scores")
            if not on:
                assert header is None
                continue
            assert header is not None
            listed = [part.split("=") for part in header.split(",")]
            assert {address for address, _ in listed} == set(stack.endpoints)
            assert listed[0][0] == response.headers[SERVER_HEADER]  # the chosen one first
            assert all(float(score) >= 0.0 for _, score in listed)

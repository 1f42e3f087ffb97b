"""A configuration reload through the admin API while requests stream through the real gateway."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from inferlb.stack import LocalStack, StackOptions

pytestmark = pytest.mark.envoy

MODEL = "m"


def test_reload_keeps_streams_and_changes_the_policy(tmp_path: Path) -> None:
    with LocalStack(StackOptions(backends=2, models=(MODEL,), policy="least-request"), tmp_path) as stack:
        long = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 300, "stream": True}
        with httpx.Client(base_url=stack.gateway_url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=long) as streaming:
                lines = streaming.iter_lines()
                assert next(lines).startswith("data: ")  # routed and streaming
                document = yaml.safe_load(stack.config_path.read_text())
                applied = httpx.post(
                    f"{stack.picker_admin_url}/config",
                    content=yaml.safe_dump({**document, "policy": "default"}),
                    headers={**stack.admin_headers, "content-type": "application/yaml"},
                )
                assert applied.status_code == 200, applied.text
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert len(rest) == 300 - 1 + 1  # the other 299 tokens and [DONE]: nothing was cut
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 3})
            assert response.status_code == 200
        recent = httpx.get(
            f"{stack.picker_admin_url}/decisions", params={"limit": 1}, headers=stack.admin_headers
        ).json()["decisions"][0]
        assert recent["profile"] == "default" and recent["endpoint"] in stack.endpoints
        assert httpx.get(f"{stack.picker_admin_url}/config", headers=stack.admin_headers).json()["reloads"] == 1

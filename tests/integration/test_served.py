"""The served endpoint through a real Envoy: with Override Host, a request the first endpoint refuses (a 503 from
a server in its cold start) is retried on the next one listed, and Envoy reports the endpoint that served to the
picker (the Endpoint Picker protocol's ``envoy.lb`` / ``x-gateway-destination-endpoint-served``, on the
observing stream). The picker moves the request's in-flight count there and times the response for it; the
client never sees the report."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferlb.envoyconf import EnvoyOptions
from inferlb.procs import SERVER_HEADER
from inferlb.stack import LocalStack, StackOptions

from .conftest import log_entry

pytestmark = pytest.mark.envoy

REQUESTS = 24


def _samples(stack: LocalStack, family: str) -> dict[str, float]:
    text = httpx.get(f"{stack.picker_admin_url}/metrics", timeout=5).text
    for metric in text_string_to_metric_families(text):
        if metric.name == family:
            return {next(iter(s.labels.values()), ""): s.value for s in metric.samples if s.name.endswith("_total")}
    return {}


def test_a_request_retried_on_the_next_endpoint_counts_and_is_timed_where_it_was_served(tmp_path: Path) -> None:
    options = StackOptions(
        backends=3,
        models=("m1",),
        latency_source="stream",
        envoy=EnvoyOptions(cluster_mode="override-host"),
        # No scrapes: the picker does not learn of the cold start, so it keeps listing that server (least request).
        picker_config={"destinations": 2, "signals": {"scrape_metrics": False}},
    )
    with LocalStack(options, tmp_path) as stack, httpx.Client(base_url=stack.gateway_url, timeout=10.0) as client:
        victim = stack.endpoints[0]
        httpx.post(
            f"http://{victim}/admin/faults", json={"crash": True, "cold_start_s": 600}, timeout=5
        ).raise_for_status()
        served = []
        for _ in range(REQUESTS):
            response = client.post("/v1/completions", json={"model": "m1", "prompt": "hello", "max_tokens": 2})
            assert response.status_code == 200
            assert "x-gateway-destination-endpoint-served" not in response.headers
            served.append((response.headers["x-request-id"], response.headers[SERVER_HEADER]))
        retried = 0
        for request_id, server in served:
            entry = log_entry(stack, request_id)
            assert entry["upstream"] == server != victim
            retried += entry["picked"].split(",")[0] != server
        assert retried > 0, "the picker never listed the cold server first"
        deadline = time.monotonic() + 10
        while (reports := _samples(stack, "inferlb_served_reports")).get("elsewhere", 0) < retried:
            assert time.monotonic() < deadline, reports
            time.sleep(0.05)
        assert reports["elsewhere"] == retried
        # A report that reaches the picker after Envoy's access log ended its request finds no lease: unknown. The
        # two come on different gRPC streams, so under load one of a quick request's reports can lose that race.
        assert reports["as-picked"] + reports["unknown"] == REQUESTS - retried
        assert reports["unknown"] <= 2, reports
        timed = _samples(stack, "inferlb_responses_timed")
        assert timed["e2e"] == REQUESTS and timed["unknown_endpoint"] == 0


def test_a_request_whose_list_is_short_is_not_retried_past_it(tmp_path: Path) -> None:
    # Only the first server has model m2: the picker lists it alone. Envoy was rendered for two retries, and past
    # the list Override Host retried on any member (one without the model, or one a release arm keeps apart):
    # the picker caps the retries at its list's length (x-envoy-max-retries).
    options = StackOptions(
        backends=3,
        models=("m1", "m2"),
        endpoint_models=(("m1", "m2"), ("m1",), ("m1",)),
        envoy=EnvoyOptions(cluster_mode="override-host", retries=2),
        picker_config={"destinations": 3, "signals": {"scrape_metrics": False}},
    )
    with LocalStack(options, tmp_path) as stack, httpx.Client(base_url=stack.gateway_url, timeout=10.0) as client:
        only = stack.endpoints[0]
        httpx.post(
            f"http://{only}/admin/faults", json={"crash": True, "cold_start_s": 600}, timeout=5
        ).raise_for_status()
        for _ in range(6):
            response = client.post("/v1/completions", json={"model": "m2", "prompt": "hello", "max_tokens": 2})
            assert response.status_code == 503, response.text  # its only server's answer, not another's
            entry = log_entry(stack, response.headers["x-request-id"])
            assert entry["picked"] == only and entry["upstream"] == only
        # A model every server has: the full list, and a retry on the next listed server.
        response = client.post("/v1/completions", json={"model": "m1", "prompt": "hello", "max_tokens": 2})
        assert response.status_code == 200 and response.headers[SERVER_HEADER] != only

"""Tests for inferlb/metrics.py: the picker's /metrics through prometheus_client, parsed back with its parser."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from inferlb.admin import create_admin_app
from inferlb.metrics import histogram_family, picker_registry, prometheus_text, scrape
from inferlb.picker import PickerProcess, create_picker
from inferlb.procs import free_port
from inferlb.scorer.config import parse_config
from inferlb.scorer.histogram import Histogram

ENDPOINTS = ("10.0.0.1:8000", "10.0.0.2:8000")

# What dashboards and rules read: every family the picker exposes, with its type.
ALWAYS = {
    "inferlb_decisions": "counter",
    "inferlb_refused": "counter",
    "inferlb_shed": "counter",
    "inferlb_served_reports": "counter",
    "inferlb_pick_seconds": "histogram",
    "inferlb_scrape_errors": "counter",
    "inferlb_endpoint_stale": "gauge",
    "inferlb_metrics_age_seconds": "gauge",
    "inferlb_inflight_requests": "gauge",
    "inferlb_scorer_errors": "counter",
    "inferlb_config_reloads": "counter",
    "inferlb_membership_changes": "counter",
    "inferlb_pool_endpoints": "gauge",
}
WITH_SPANS = {"inferlb_endpoint_ttft_seconds": "histogram", "inferlb_endpoint_e2e_seconds": "histogram"}
WITH_RECEIVER = {
    "inferlb_spans_received": "counter",
    "inferlb_span_requests_dropped": "counter",
    "inferlb_span_requests_refused": "counter",
    "inferlb_span_receiver_restarts": "counter",
}
WITH_STREAM = {"inferlb_responses_timed": "counter", "inferlb_stored_responses": "counter"}
WITH_LEASES = {
    "inferlb_request_ends": "counter",
    "inferlb_access_log_unmatched": "counter",
    "inferlb_requests_awaiting_end": "gauge",
}


def _picker(**extra: Any) -> PickerProcess:
    """A picker that is never started: its counters are there to read."""
    return create_picker(
        parse_config(
            {
                "listen": f"127.0.0.1:{free_port()}",
                "admin": f"127.0.0.1:{free_port()}",
                "pool": {"endpoints": [{"address": a} for a in ENDPOINTS]},
                **extra,
            }
        )
    )


def _families(text: str) -> dict[str, Metric]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _values(family: Metric, sample_name: str | None = None) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for s in family.samples
        if s.name == (sample_name or family.name + ("_total" if family.type == "counter" else ""))
    }


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        pytest.param({"inflight": {"end": "stream"}}, ALWAYS, id="no-otel-no-access-log"),
        pytest.param(
            {"otel": {"latency_source": "stream"}},
            {**ALWAYS, **WITH_SPANS, **WITH_STREAM, **WITH_LEASES},
            id="stream-and-access-log",
        ),
        pytest.param(
            {"otel": {"receiver": f"127.0.0.1:{free_port()}"}},
            {**ALWAYS, **WITH_SPANS, **WITH_RECEIVER, **WITH_LEASES},
            id="receiver",
        ),
    ],
)
async def test_every_family_has_its_name_type_and_help(extra: dict[str, Any], expected: dict[str, str]) -> None:
    families = _families(prometheus_text(_picker(**extra)))
    assert {name: f.type for name, f in families.items()} == expected
    assert all(f.documentation for f in families.values())


async def test_counters_read_the_pickers_own_counts_at_scrape_time() -> None:
    picker = _picker(otel={"receiver": f"127.0.0.1:{free_port()}"})
    log = picker.service.decisions
    log.by_endpoint[ENDPOINTS[0], "max-score"] += 3
    log.by_endpoint[ENDPOINTS[1], 'odd "reason"\\\n'] += 1
    picker.service.stats.refused[429] += 2  # every refusal the filter answers, not only the routing ones
    log.shed["batch"] += 1
    picker.service.stats.served["elsewhere"] += 5
    picker.engine.scorer_errors["kv-cache"] += 4
    registry = picker_registry(picker)
    families = _families(prometheus_text(picker))
    decisions = _values(families["inferlb_decisions"])
    assert decisions == {
        (("endpoint", ENDPOINTS[0]), ("reason", "max-score")): 3,
        (("endpoint", ENDPOINTS[1]), ("reason", 'odd "reason"\\\n')): 1,
    }
    zero = {(("status", str(status)),): 0 for status in (400, 404, 413, 429, 503)}  # present before the first
    assert _values(families["inferlb_refused"]) == zero | {(("status", "429"),): 2}
    assert _values(families["inferlb_shed"]) == {(("class", "batch"),): 1}
    served = {(("outcome", "as-picked"),): 0, (("outcome", "elsewhere"),): 5, (("outcome", "unknown"),): 0}
    assert _values(families["inferlb_served_reports"]) == served
    assert _values(families["inferlb_scorer_errors"]) == {(("scorer", "kv-cache"),): 4}
    assert _values(families["inferlb_config_reloads"]) == {(): 0}
    assert _values(families["inferlb_pool_endpoints"]) == {
        (("state", "draining"),): 0,
        (("state", "ramping"),): 0,
        (("state", "serving"),): 2,
    }
    never = {(("endpoint", a),): math.inf for a in ENDPOINTS}
    assert _values(families["inferlb_metrics_age_seconds"]) == never
    assert _values(families["inferlb_inflight_requests"]) == {(("endpoint", a),): 0 for a in ENDPOINTS}
    spans = _values(families["inferlb_spans_received"])
    assert set(spans) == {
        (("outcome", o),)
        for o in (
            "joined_by_trace",
            "joined_by_resource",
            "unjoined",
            "envoy",
            "malformed",
            "other",
            "duplicate",
            "unverified",
            "out_of_bounds",
            "rate_limited",
            "over_limit",
            "dropped",
        )
    }
    # Read again, the same registry sees what changed since: nothing is cached or counted twice.
    picker.service.stats.refused[429] += 1
    again = {f.name: f for f in registry.collect()}
    assert _values(again["inferlb_refused"]) == zero | {(("status", "429"),): 3}


async def test_histograms_are_cumulative_with_sum_and_count() -> None:
    picker = _picker(otel={"latency_source": "stream"})
    for seconds in (3e-6, 1e-5, 2e-5, 0.5):
        picker.service.decisions.pick_s.observe(seconds)
    assert picker.spans is not None
    picker.spans.histograms.observe(1, 0.05, 1.2)
    picker.spans.histograms.observe(1, 3000.0, None)
    families = _families(prometheus_text(picker))
    pick = families["inferlb_pick_seconds"]
    buckets = {s.labels["le"]: s.value for s in pick.samples if s.name.endswith("_bucket")}
    assert list(buckets)[:3] == ["1e-05", "2.5e-05", "5e-05"]
    assert (buckets["1e-05"], buckets["2.5e-05"], buckets["0.01"], buckets["+Inf"]) == (2, 3, 3, 4)
    assert _values(pick, "inferlb_pick_seconds_count") == {(): 4}
    assert _values(pick, "inferlb_pick_seconds_sum")[()] == pytest.approx(0.500033)
    ttft = families["inferlb_endpoint_ttft_seconds"]
    counts = _values(ttft, "inferlb_endpoint_ttft_seconds_count")
    assert counts == {(("endpoint", ENDPOINTS[0]),): 0, (("endpoint", ENDPOINTS[1]),): 2}
    second = [s for s in ttft.samples if s.name.endswith("_bucket") and s.labels["endpoint"] == ENDPOINTS[1]]
    assert [(s.labels["le"], s.value) for s in second][6:9] == [("0.08", 1), ("0.1", 1), ("0.25", 1)]
    assert (second[-2].value, second[-1].labels["le"], second[-1].value) == (1, "+Inf", 2)


def test_a_histogram_family_of_several_series() -> None:
    a, b = Histogram((1.0, 2.0)), Histogram((1.0, 2.0))
    a.observe(1.0)
    b.observe(5.0)
    family = histogram_family("x_seconds", "X.", ("k",), [(("a",), a), (("b",), b)])
    rows = [(s.name, s.labels, s.value) for s in family.samples]
    assert rows[:5] == [
        ("x_seconds_bucket", {"k": "a", "le": "1.0"}, 1),
        ("x_seconds_bucket", {"k": "a", "le": "2.0"}, 1),
        ("x_seconds_bucket", {"k": "a", "le": "+Inf"}, 1),
        ("x_seconds_count", {"k": "a"}, 1),
        ("x_seconds_sum", {"k": "a"}, 1.0),
    ]
    assert [s.value for s in family.samples[5:]] == [0, 0, 1, 1, 5.0]


async def test_two_pickers_each_have_their_own_registry() -> None:
    one, two = _picker(), _picker()
    one.service.stats.refused[404] += 1
    first, second = picker_registry(one), picker_registry(two)
    assert first is not second
    refused = [{f.name: f for f in r.collect()}["inferlb_refused"] for r in (first, second)]
    assert [_values(f)[(("status", "404"),)] for f in refused] == [1, 0]


async def test_the_admin_app_serves_the_text_format() -> None:
    picker = _picker(inflight={"end": "stream"})
    picker.service.decisions.by_endpoint[ENDPOINTS[0], "max-score"] += 1
    transport = httpx.ASGITransport(app=create_admin_app(picker))
    async with httpx.AsyncClient(transport=transport, base_url=f"http://{picker.config.admin}") as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'inferlb_decisions_total{endpoint="10.0.0.1:8000",reason="max-score"} 1.0' in response.text
    assert set(_families(response.text)) == set(ALWAYS)


async def test_a_scrape_formats_on_a_worker_thread_what_it_read_on_the_loop() -> None:
    picker = _picker(otel={"latency_source": "stream"})
    picker.service.stats.refused[503] += 1
    registry = picker_registry(picker)
    body = await scrape(registry, picker)
    assert body.decode() == prometheus_text(picker)
    # What the scrape read is its own: counting on afterwards changes the next scrape only.
    picker.service.stats.refused[503] += 1
    assert _values(_families((await scrape(registry, picker)).decode())["inferlb_refused"])[(("status", "503"),)] == 2


async def test_a_shedding_class_and_the_guards_changes_show_zero_before_their_first() -> None:
    """A series that appears only at its first event hides that event from rate() and increase()."""
    arms = [{"name": "a", "profile": "default", "weight": 0.5}, {"name": "b", "profile": "round-robin", "weight": 0.5}]
    picker = _picker(
        classes=[{"name": "bulk", "priority": -1}, {"name": "chat", "priority": 1}],
        experiments=[{"name": "ab", "arms": arms}],
    )
    families = _families(prometheus_text(picker))
    assert _values(families["inferlb_shed"]) == {(("class", "bulk"),): 0}  # chat waits: it is never shed
    changes = _values(families["inferlb_experiment_weight_changes"])
    for arm in ("a", "b"):
        for kind in ("cut", "rolled-back"):
            assert changes[(("arm", arm), ("experiment", "ab"), ("kind", kind))] == 0
    assert changes[(("arm", ""), ("experiment", "ab"), ("kind", "started"))] == 1
    unmatched = _values(families["inferlb_experiment_outcomes_unmatched"])
    assert unmatched == {(("reason", "unattributed"),): 0, (("reason", "evicted"),): 0}
    experiments = picker.service.router.experiments
    assert experiments is not None
    experiments.outcome("never-routed", failed=False)
    unmatched = _values(_families(prometheus_text(picker))["inferlb_experiment_outcomes_unmatched"])
    assert unmatched[(("reason", "unattributed"),)] == 1


async def test_shared_quota_buckets_repaired_sent_again_or_dropped_are_counted(tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text("not-used")
    picker = _picker(
        quotas={"source": "gateway", "header": "x-tenant", "default": {"tokens_per_minute": 600}},
        replicas={"url": "redis://127.0.0.1:1", "password": {"token_file": str(secret)}},
    )
    quotas = picker.service.quotas
    assert quotas is not None
    quotas.stats.repaired, quotas.stats.applied_before, quotas.stats.dropped = 2, 3, 1
    buckets = _values(_families(prometheus_text(picker))["inferlb_quota_buckets"])
    assert buckets == {(("event", "repaired"),): 2, (("event", "sent_again"),): 3, (("event", "dropped"),): 1}


async def test_requests_routed_without_exact_cache_keys_are_counted_by_reason() -> None:
    picker = _picker(kv_events={"port": free_port(), "tokenizers": {"m": "pieces"}, "block_size": 4})
    zero = {(("reason", r),): 0 for r in ("busy", "late", "media", "refused")}  # present before the first
    assert _values(_families(prometheus_text(picker))["inferlb_kv_unkeyed"]) == zero
    picker.service.stats.unkeyed["late"] += 2
    picker.service.stats.unkeyed["busy"] += 1
    assert picker.service.keyer is not None
    picker.service.keyer.media += 3
    unkeyed = _values(_families(prometheus_text(picker))["inferlb_kv_unkeyed"])
    assert unkeyed == zero | {(("reason", "late"),): 2, (("reason", "busy"),): 1, (("reason", "media"),): 3}
    assert "inferlb_kv_unkeyed" not in _families(prometheus_text(_picker()))  # no tokenizers: no series


async def test_gpu_source_failures_are_counted_by_source() -> None:
    sources = {"endpoints": [{"address": a, "gpu": {"url": f"http://{a}/gpu"}} for a in ENDPOINTS]}
    picker = _picker(pool={**sources, "allowed_networks": ["10.0.0.0/8"]})
    assert picker.gpu_collector is not None
    picker.gpu_collector.errors[f"http://{ENDPOINTS[0]}/gpu"] += 3
    failures = _values(_families(prometheus_text(picker))["inferlb_gpu_source_failures"])
    assert failures == {(("source", f"http://{ENDPOINTS[0]}/gpu"),): 3}

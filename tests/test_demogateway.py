"""The demo's round-robin listener, added to a rendered bootstrap (no Envoy started here)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from inferlb.demogateway import FALLBACK_CLUSTER, ROUND_ROBIN_CLUSTER, add_round_robin_listener
from inferlb.envoyconf import EnvoyOptions, render_bootstrap
from inferlb.scorer.config import parse_config

SERVERS = ["10.0.0.1:8000", "10.0.0.2:8000"]


def bootstrap(**config: Any) -> dict[str, Any]:
    document = {"pool": {"endpoints": [{"address": a} for a in SERVERS]}, **config}
    return yaml.safe_load(render_bootstrap(parse_config(document), EnvoyOptions()))


def manager(listener: dict[str, Any]) -> dict[str, Any]:
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def test_the_listener_balances_the_pool_by_round_robin_without_the_picker() -> None:
    doc = bootstrap()
    gateway_before = yaml.safe_dump(doc["static_resources"]["listeners"][0])
    add_round_robin_listener(doc, "127.0.0.1:7001")
    gateway, added = doc["static_resources"]["listeners"]
    assert yaml.safe_dump(gateway) == gateway_before, "the picker's listener must not change"
    assert added["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 7001}
    hcm = manager(added)
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    # A client still cannot choose its upstream there: the destination header is stripped before routing.
    assert hcm["early_header_mutation_extensions"] == manager(gateway)["early_header_mutation_extensions"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["name"] for r in routes] == ["v1", "not_found"]
    assert routes[0]["route"]["cluster"] == ROUND_ROBIN_CLUSTER
    assert [log["name"] for log in hcm["access_log"]] == ["envoy.access_loggers.file"]

    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    assert clusters[ROUND_ROBIN_CLUSTER]["lb_policy"] == "ROUND_ROBIN"
    assert clusters[FALLBACK_CLUSTER]["lb_policy"] == "LEAST_REQUEST", "the fallback cluster must not change"
    endpoints = clusters[ROUND_ROBIN_CLUSTER]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    addresses = [e["endpoint"]["address"]["socket_address"] for e in endpoints]
    assert [f"{a['address']}:{a['port_value']}" for a in addresses] == SERVERS


def test_a_bootstrap_whose_servers_come_from_xds_is_refused() -> None:
    doc = bootstrap()
    fallback = next(c for c in doc["static_resources"]["clusters"] if c["name"] == FALLBACK_CLUSTER)
    del fallback["load_assignment"]
    with pytest.raises(ValueError, match="static fallback cluster"):
        add_round_robin_listener(doc, "127.0.0.1:7001")

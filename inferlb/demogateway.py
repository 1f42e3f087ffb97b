"""The demo's gateway: the local stack plus a second listener on the same Envoy that balances with Envoy's own
ROUND_ROBIN over the same servers, so that the demo can send the same traffic both ways through one gateway.

The second listener and its cluster are added to the rendered bootstrap by the demo only; production bootstraps
(``inferlb envoy-config``) never have them. A client still cannot name its upstream: the listener keeps the
bootstrap's early header mutation that strips ``x-gateway-destination-endpoint``, and the cluster lists only the
pool's members.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from inferlb.otel.render import render_html, render_png
from inferlb.procs import free_port
from inferlb.stack import LocalStack, StackOptions

ACCESS_LOG_WAIT_S = 10.0
SPANS_WAIT_S = 10.0

ROUND_ROBIN_CLUSTER = "demo_round_robin"
"""The round-robin listener's cluster, as Envoy's access log names it."""
PICKED_CLUSTER = "inferlb_picked"
FALLBACK_CLUSTER = "inferlb_fallback"


class DemoStack(LocalStack):
    """`LocalStack` whose Envoy also listens on ``round_robin_url``: every ``/v1/`` request there goes to the pool
    by Envoy's ROUND_ROBIN, without the picker. Same lifetime rules as `LocalStack`."""

    def __init__(self, options: StackOptions, workdir: Path) -> None:
        super().__init__(options, workdir)
        self.round_robin_address = f"127.0.0.1:{free_port()}"

    @property
    def round_robin_url(self) -> str:
        return f"http://{self.round_robin_address}"

    def start_envoy(self) -> None:
        bootstrap = yaml.safe_load(self.envoy_path.read_text(encoding="utf-8"))
        add_round_robin_listener(bootstrap, self.round_robin_address)
        self.envoy_path.write_text(yaml.safe_dump(bootstrap, sort_keys=False), encoding="utf-8")
        super().start_envoy()


def add_round_robin_listener(bootstrap: dict[str, Any], address: str) -> None:
    """Add to ``bootstrap`` (a rendered inferlb bootstrap with a static fallback cluster) a listener on ``address``
    whose ``/v1/`` routes go to a ROUND_ROBIN copy of the fallback cluster, with no ext_proc filter. ValueError if
    the bootstrap has not the expected shape."""
    resources = bootstrap["static_resources"]
    fallback = next((c for c in resources["clusters"] if c["name"] == FALLBACK_CLUSTER), None)
    if fallback is None or "load_assignment" not in fallback:
        raise ValueError("the round-robin listener needs the bootstrap's static fallback cluster (no xds)")
    cluster = copy.deepcopy(fallback)
    cluster["name"] = cluster["load_assignment"]["cluster_name"] = ROUND_ROBIN_CLUSTER
    cluster["lb_policy"] = "ROUND_ROBIN"
    resources["clusters"].append(cluster)

    listener = copy.deepcopy(resources["listeners"][0])
    host, _, port = address.rpartition(":")
    listener["name"] = "demo_round_robin"
    listener["address"] = {"socket_address": {"address": host, "port_value": int(port)}}
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    manager["stat_prefix"] = "demo_round_robin"
    # The file access log only: the other logger tells the picker about requests it routed, and it routes none here.
    manager["access_log"] = [log for log in manager.get("access_log", ()) if log["name"] == "envoy.access_loggers.file"]
    manager["http_filters"] = [f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.router"]
    host_config = manager["route_config"]["virtual_hosts"][0]
    host_config["routes"] = [
        {"name": "v1", "match": {"prefix": "/v1/"}, "route": {"cluster": ROUND_ROBIN_CLUSTER, "timeout": "0s"}},
        *(r for r in host_config["routes"] if r["name"] == "not_found"),
    ]
    manager["route_config"]["name"] = "demo_round_robin"
    resources["listeners"].append(listener)


async def refusals(base_url: str, timeout_s: float = 30.0) -> list[tuple[str, int, str]]:
    """Two requests the picker must refuse, to show its errors: malformed JSON and an unknown model."""
    cases = [
        ("malformed JSON", b'{"model": "demo-model", "prompt": '),
        ("unknown model", json.dumps({"model": "no-such-model", "prompt": "hi"}).encode()),
    ]
    out = []
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as client:
        for name, content in cases:
            response = await client.post(
                "/v1/completions", content=content, headers={"content-type": "application/json"}
            )
            out.append((name, response.status_code, response.text))
    return out


def wait_for_access_log(
    stack: LocalStack, done: Callable[[list[dict[str, Any]]], bool], timeout_s: float = ACCESS_LOG_WAIT_S
) -> list[dict[str, Any]]:
    """Envoy's access log once ``done(log)`` holds, or as it is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        log = stack.access_log()
        if done(log) or time.monotonic() > deadline:
            return log
        time.sleep(0.05)  # Envoy flushes its access log every 100 ms; the deadline bounds the wait


def save_heatmap(stack: LocalStack, expected: int, png: Path, page: Path | None = None) -> str:
    """Wait (bounded) until the picker's heatmap holds ``expected`` requests (the servers export their spans in
    batches), then save it: as PNG, the admin API's ``/heatmap.png`` without ``page``, else drawn here with the
    requests per endpoint too, and as a self-contained HTML page that does not refresh; returns the paths
    written, or why there are none."""
    deadline = time.monotonic() + SPANS_WAIT_S
    try:
        while True:
            grid = httpx.get(f"{stack.picker_admin_url}/heatmap.json", timeout=5).json()
            if sum(sum(row) for row in grid["count"]) >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # the servers export spans in batches every 0.5 s; the deadline bounds the wait
        if page is None:
            response = httpx.get(f"{stack.picker_admin_url}/heatmap.png", timeout=60)
            response.raise_for_status()
            png.write_bytes(response.content)
            return str(png)
        render_png(grid, png, endpoint_counts=True)
        page.write_text(render_html(grid, refresh_s=None, json_url=None), encoding="utf-8")
    except (httpx.HTTPError, ValueError, KeyError, TypeError, OSError) as exc:
        return f"none ({exc})"
    return f"{png} and {page}"

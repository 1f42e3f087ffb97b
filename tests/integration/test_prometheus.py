"""A real Prometheus (Debian's package) scrapes a live gateway with deploy/prometheus/prometheus.yml and loads
deploy/prometheus/rules.yml: every query of deploy/grafana-dashboard.json returns data, and every recording rule
yields a series per endpoint.

The stack is made to do everything a panel draws: server spans fill the TTFT and E2E histograms, an experiment
splits the traffic, an unknown model is refused, and batch requests are shed (``admission.max_waiting: 0`` makes
an endpoint saturated as soon as it was sent a request since its last scrape began).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from inferlb.procs import ManagedProcess, free_port, http_ok
from inferlb.stack import LocalStack, StackOptions

from ..conftest import poll

# Skips without Debian's prometheus here, never on CI, where .ci/run installs it.
needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None and not os.environ.get("CI"),
    reason="needs Debian's prometheus (.ci/run installs it)",
)

pytestmark = needs_prometheus

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana-dashboard.json"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES = DEPLOY / "prometheus" / "rules.yml"

MODEL = "m"
STREAMED = 60  # streamed completions through Envoy, 6 at a time
# What Grafana would put in place of each variable the dashboard's queries use. `$endpoint` is multi-valued with
# "All", which Grafana sends as a regex of every value: `.+` is that and, like it, needs the label to be there
# (`.*` would also match series without it, so a misspelt label name would go unnoticed).
VARIABLES = {"endpoint": ".+", "__rate_interval": "30s", "__interval": "5s", "__range": "1m"}
EXPERIMENT = {
    "name": "ab",
    "arms": [
        {"name": "control", "profile": "least-request", "weight": 0.5},
        {"name": "treatment", "profile": "round-robin", "weight": 0.5},
    ],
}
OPTIONS = StackOptions(
    backends=3,
    models=(MODEL,),
    spans=True,
    picker_config={
        "class_header": "x-request-class",
        "classes": [{"name": "batch", "match": {"header": ["batch"]}, "on_saturation": "shed", "retry_after_s": 1}],
        "admission": {"max_waiting": 0},
        "experiments": [EXPERIMENT],
    },
)


def _substitute(expr: str) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in VARIABLES:
            raise AssertionError(f"the dashboard uses ${name}, which this test does not fill in: add it to VARIABLES")
        return VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def _panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, query with the variables filled in) for every target of every panel."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [
        (panel["title"], target.get("refId", "?"), _substitute(target["expr"]))
        for panel in dashboard["panels"]
        for target in panel.get("targets", ())
    ]


def _recording_rules() -> list[str]:
    groups = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    return [rule["record"] for group in groups for rule in group["rules"] if "record" in rule]


class Prometheus:
    """The ``prometheus`` binary on a free loopback port, its TSDB in ``workdir``, and its HTTP API."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        argv = [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={config_path}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address={self.url.removeprefix('http://')}",
            "--log.level=warn",
        ]
        self.process = ManagedProcess("prometheus", argv, workdir / "prometheus.log")

    def __enter__(self) -> Prometheus:
        self.process.start()
        try:
            self.process.wait_ready(http_ok(f"{self.url}/-/ready"), 30.0, "ready")
        except BaseException:
            self.process.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stop()

    def api(self, path: str, **params: str) -> Any:
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=5.0).json()
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus refused {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` gives now (each sample's labels and [time, value])."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def targets_up(self) -> bool:
        active = self.api("targets", state="active")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)


def _scrape_config(stack: LocalStack) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with this stack's addresses, 1 s intervals and the rules by full path."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text(encoding="utf-8"))
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RULES)]
    targets = {"inferlb-picker": [stack.picker_admin_address], "vllm": list(stack.endpoints)}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(targets), f"the example's jobs changed: {sorted(jobs)}; update this test"
    for name, addresses in targets.items():
        jobs[name]["static_configs"] = [{"targets": addresses}]
    return config


def _finite(samples: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in samples)


def _send_traffic(stack: LocalStack) -> None:
    """A bounded burst: streamed completions (all 200), requests for an unknown model (404) and volleys of batch
    requests until one is shed (429)."""
    with httpx.Client(base_url=stack.gateway_url, timeout=10.0) as client, ThreadPoolExecutor(9) as pool:

        def streamed(i: int) -> int:
            body = {"model": MODEL, "prompt": f"request {i} " + "x" * 400, "max_tokens": 12, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                for _ in response.iter_lines():
                    pass
                return response.status_code

        assert list(pool.map(streamed, range(STREAMED))) == [200] * STREAMED
        for _ in range(3):
            assert client.post("/v1/completions", json={"model": "nope", "prompt": "hi"}).status_code == 404

        def batch(i: int) -> int:
            body = {"model": MODEL, "prompt": f"batch {i}", "max_tokens": 4}
            return client.post("/v1/completions", json=body, headers={"x-request-class": "batch"}).status_code

        def volley() -> bool:
            statuses = list(pool.map(batch, range(9)))
            assert set(statuses) <= {200, 429}, statuses
            return 429 in statuses

        poll(volley, "a batch request shed with 429", timeout=15.0)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[LocalStack]:
    with LocalStack(OPTIONS, tmp_path / "stack") as running:
        yield running


def test_promtool_accepts_the_rules_and_the_example_config() -> None:
    promtool = shutil.which("promtool") or "promtool"
    for argv in ([promtool, "check", "rules", str(RULES)], [promtool, "check", "config", str(PROMETHEUS_CONFIG)]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout}{done.stderr}"


@pytest.mark.envoy
@pytest.mark.timeout(90)
def test_every_dashboard_query_and_recording_rule_returns_data(stack: LocalStack, tmp_path: Path) -> None:
    queries = _panel_queries()  # a variable the test does not know fails here, before anything starts
    with Prometheus(_scrape_config(stack), tmp_path) as prometheus:
        poll(prometheus.targets_up, "every scrape target up", timeout=15.0)
        _send_traffic(stack)
        # Every completion's span reached the picker (the servers export in batches every 0.5 s) and Prometheus has
        # scraped that; then three more scrapes of every target, and an evaluation of the rules after them.
        poll(
            lambda: _finite(prometheus.query(f"sum(inferlb_endpoint_ttft_seconds_count) >= {STREAMED}")),
            "every completion's TTFT in Prometheus",
            timeout=20.0,
        )
        since = time.time()
        poll(
            lambda: _finite(prometheus.query(f"min(timestamp(up)) > {since + 3}")),
            "three more scrapes of every target",
            timeout=15.0,
        )
        records = _recording_rules()
        poll(
            lambda: all(_finite(prometheus.query(f"min(timestamp({r})) > {since + 3}")) for r in records),
            "the recording rules evaluated after those scrapes",
            timeout=10.0,
        )
        # The dashboard's endpoint selector offers every endpoint.
        offered = prometheus.api("label/endpoint/values", **{"match[]": "inferlb_endpoint_ttft_seconds_bucket"})
        assert sorted(offered) == sorted(stack.endpoints)

        empty = [
            f"panel {title!r} ({ref}): {expr}" for title, ref, expr in queries if not _finite(prometheus.query(expr))
        ]
        assert not empty, "dashboard queries that return no data (or only NaN):\n" + "\n".join(empty)

        rules = [r for g in prometheus.api("rules", type="record")["groups"] for r in g["rules"]]
        assert sorted(r["name"] for r in rules) == sorted(records)
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r["health"], r.get("lastError")) for r in rules]
        for record in records:
            samples = prometheus.query(record)
            endpoints = {s["metric"].get("endpoint") for s in samples if math.isfinite(float(s["value"][1]))}
            assert endpoints == set(stack.endpoints), f"recording rule {record} gave {samples}"

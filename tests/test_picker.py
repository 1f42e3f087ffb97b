"""Tests for inferlb/picker.py and inferlb/admin.py: a whole picker in process (gRPC, collectors, admin API) over
emulated servers, its admin API, and configuration reloads from the API and from the file."""

from __future__ import annotations

import asyncio
import ipaddress
import math
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from inferlb import picker as picker_module
from inferlb.bench.redisserver import REDIS, redis_server
from inferlb.filter.requestend import OpenLeases
from inferlb.picker import PickerProcess, create_picker
from inferlb.procs import free_port
from inferlb.scorer.config import EndpointConfig, load_config, parse_config
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.tokenizer import cache_keys
from inferlb.sim.fleet import serving
from inferlb.sim.profiles import get_profile
from inferlb.sim.server import EmulatedServer, ServerOptions

from .conftest import ManualClock, until

H100 = get_profile("h100-llama3.1-8b")
TOKEN = "test-admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
COLLECTOR = ipaddress.ip_address("127.0.0.1")  # where spans relayed by a collector on this host come from
YAML = {**AUTH, "content-type": "application/yaml"}


@pytest.fixture(autouse=True)
def admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERLB_TEST_ADMIN_TOKEN", TOKEN)


def _families(text: str) -> dict[str, Metric]:
    """/metrics by family name, as prometheus_client parses it (counters without ``_total``)."""
    return {family.name: family for family in text_string_to_metric_families(text)}


@pytest.fixture
async def servers():
    emulated = [
        EmulatedServer(f"127.0.0.1:{free_port()}", ServerOptions(profile=H100, models=("m",))) for _ in range(3)
    ]
    async with serving(emulated):
        yield emulated


def document(servers, **extra) -> dict:
    return {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
        "policy": "kv-aware",
        "admin_auth": {"token_env": "INFERLB_TEST_ADMIN_TOKEN"},
        "signals": {"scrape_interval_s": 0.05, "gpu_interval_s": 0.1},
        "pool": {
            "endpoints": [
                {"address": s.address, "models": ["m"], "gpu": {"url": f"http://{s.address}/gpu"}} for s in servers
            ]
        },
        **extra,
    }


@pytest.fixture
async def picker(servers, tmp_path: Path):
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump(document(servers)))
    picker = create_picker(load_config(path), config_path=path)
    await picker.start()
    yield picker
    await picker.stop(0.5)


async def test_admin_api_shows_endpoints_decisions_config_and_metrics(picker, servers):
    admin = f"http://{picker.config.admin}"
    async with httpx.AsyncClient(base_url=admin, timeout=5, headers=AUTH) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        await until(lambda: picker.collector.first_round_done and picker.gpu_collector.rounds > 0)
        assert (await client.get("/readyz")).status_code == 200
        rows = (await client.get("/endpoints")).json()["endpoints"]
        assert [r["address"] for r in rows] == [s.address for s in servers]
        assert all(r["up"] and not r["stale"] and r["running"] == 0 and r["kv_cache_usage"] == 0 for r in rows)
        assert all(r["kv_cache_tokens"] == H100.num_gpu_blocks * H100.block_size for r in rows)
        assert all(r["gpu_free_bytes"] > 0 for r in rows)
        assert all(r["prefill_tokens_per_s"] is None and r["decode_step_s"] is None for r in rows)  # nothing timed
        assert picker.collector.inflight is picker.engine.inflight
        for i in range(5):
            picker.service._route(RequestFeatures(model="m", request_id=f"r{i}", prompt_tokens=10), ((None,) * 3))
        picker.service._route(RequestFeatures(model="nope", request_id="bad"), ((None,) * 3))
        decisions = (await client.get("/decisions", params={"limit": 3})).json()["decisions"]
        assert [d["request_id"] for d in decisions] == ["bad", "r4", "r3"]
        assert decisions[0] == {**decisions[0], "outcome": "refused", "status": 404}
        assert set(decisions[1]["scores"]) == {"kv-cache", "queue", "in-flight"}
        assert decisions[1]["profile"] == "kv-aware" and decisions[1]["endpoint"] in {s.address for s in servers}
        assert decisions[1]["reason"] == "best-score"
        ranking = decisions[1]["ranking"]  # every candidate (3 here, up to 5), best first, with its scores
        assert {row["endpoint"] for row in ranking} == {s.address for s in servers}
        assert [row["total"] for row in ranking] == sorted((row["total"] for row in ranking), reverse=True)
        assert [row["endpoint"] for row in ranking if row["chosen"]] == [decisions[1]["endpoint"]]
        assert all(set(row["scores"]) == {"kv-cache", "queue", "in-flight"} for row in ranking)
        assert (await client.get("/decisions", params={"limit": 0})).status_code == 400
        config = (await client.get("/config")).json()
        assert config["policy"] == "kv-aware" and len(config["endpoints"]) == 3
        assert config["signals"]["stale_after_s"] == 1.0 and config["admission"]["max_waiting"] == 16
        assert config["otel"]["latency_source"] == "spans" and config["classes"] == []
        assert config["default_class"]["name"] == "default"
        metrics = _families((await client.get("/metrics")).text)
        routed = sum(s.value for s in metrics["inferlb_decisions"].samples)
        assert routed == 5
        assert metrics["inferlb_pick_seconds"].type == "histogram"
        refused = {s.labels["status"]: s.value for s in metrics["inferlb_refused"].samples}
        assert refused == {"400": 0, "404": 1, "413": 0, "429": 0, "503": 0}  # the usual ones, zero before the first
        assert all(s.value == 0 for s in metrics["inferlb_endpoint_stale"].samples)


async def test_a_posted_config_applies_and_a_bad_one_is_refused(picker, servers):
    admin = f"http://{picker.config.admin}"
    inflight = picker.engine.inflight
    lease = inflight.acquire(1, 500)  # a request in flight across the reload
    async with httpx.AsyncClient(base_url=admin, timeout=5) as client:
        bad = document(servers, policy="mine", profiles={"mine": {"scorers": [{"type": "queue", "weight": -1}]}})
        bad["listen"], bad["admin"] = picker.config.listen, picker.config.admin
        refused = await client.post("/config", content=yaml.safe_dump(bad), headers=YAML)
        assert refused.status_code == 400
        assert "profiles.mine.scorers[0].weight must be a number in (0, 100]" in refused.json()["error"]["message"]
        assert picker.config.policy == "kv-aware" and picker.reloads == 0

        good = {**bad, "policy": "prefix-aware", "profiles": {}}
        moved = {**good, "listen": f"127.0.0.1:{free_port()}"}
        refused = await client.post("/config", content=yaml.safe_dump(moved), headers=YAML)
        assert refused.status_code == 400 and "listen cannot change" in refused.json()["error"]["message"]
        # An ORIGINAL_DST gateway cannot take a list of endpoints: every request would fail.
        listing = {**good, "destinations": 2}
        refused = await client.post("/config", content=yaml.safe_dump(listing), headers=YAML)
        assert refused.status_code == 400
        assert "destinations cannot change while the picker runs (1 -> 2)" in refused.json()["error"]["message"]

        # What Envoy's bootstrap or the running process was made for: applied, it would have done nothing.
        unapplied = [
            ({**good, "class_header": "x-tier"}, "needs Envoy to send the picker the headers x-tier"),
            ({**good, "session_header": "x-user"}, "the headers x-user"),
            ({**good, "debug_scores": True}, "the scores' header back (debug_scores)"),
            ({**good, "otel": {"window_s": 600}}, "otel.window_s cannot change while the picker runs"),
            ({**good, "otel": {"exporter": "otlp-grpc", "export_endpoint": "127.0.0.1:4317"}}, "otel.exporter"),
            (
                {
                    **good,
                    "pool": {**good["pool"], "discovery": {"etcd": {"urls": ["http://127.0.0.1:1"], "prefix": "/a/"}}},
                },
                "pool.discovery (and, with it, pool.allowed_networks) cannot change",
            ),
        ]
        for doc, words in unapplied:
            refused = await client.post("/config", content=yaml.safe_dump(doc), headers=YAML)
            assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text
        # What the bootstrap was made for may come back: a header dropped by one reload and put back by the next.
        headed = {**good, "session_header": "x-user"}
        picker.bootstrap_needs = picker_module._bootstrap_needs(parse_config(headed))  # as if it started so
        for doc in (good, headed):
            applied = await client.post("/config", content=yaml.safe_dump(doc), headers=YAML)
            assert applied.status_code == 200, applied.text
        assert picker.config.session_header == "x-user"
        # A value PyYAML cannot build, or a document nested past the parser's depth: 400, not 500.
        for body in ("policy: 2024-13-01\n", "[" * 5000):
            refused = await client.post("/config", content=body, headers=YAML)
            assert refused.status_code == 400 and "not valid YAML" in refused.json()["error"]["message"]
        applied = await client.post("/config", content=yaml.safe_dump(good), headers=YAML)
        assert applied.status_code == 200, applied.text
    assert picker.config.policy == "prefix-aware" and picker.reloads == 3
    assert picker.engine.inflight is inflight and inflight.requests[1] == 1  # same pool: counts carry over
    lease.release()
    assert inflight.requests[1] == 0


async def test_the_config_file_is_watched(picker, servers):
    path = picker.config_path
    doc = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**doc, "policy": "round-robin"}))
    await until(lambda: picker.config.policy == "round-robin")
    # A broken file is refused; the picker keeps routing with what it had.
    path.write_text("pool: [\n")
    await until(lambda: picker.config_refusals == 1)
    assert picker.config.policy == "round-robin"
    # So is a value PyYAML cannot build (it raised ValueError, which ended the watch: later edits were ignored).
    path.write_text(yaml.safe_dump({**doc, "policy": "x"}).replace("policy: x", "policy: 2024-13-01"))
    await until(lambda: picker.config_refusals == 2)
    # A new pool: fresh counts and the collectors follow the new endpoints.
    path.write_text(yaml.safe_dump({**doc, "pool": {"endpoints": doc["pool"]["endpoints"][:2]}}))
    await until(lambda: len(picker.engine.pool) == 2)
    # The new collector (it notes what the new in-flight counts had sent when each scrape began).
    await until(
        lambda: (
            picker.collector is not None
            and picker.collector.inflight is picker.engine.inflight
            and picker.collector.first_round_done
        )
    )
    assert len(picker.engine.signals.snapshot) == 2
    assert picker.engine.signals.snapshot.inflight_at_scrape.tolist() == [0, 0]


async def test_the_watch_applies_a_file_once_it_has_stopped_changing(tmp_path: Path, monkeypatch) -> None:
    # A file written in two parts an interval apart was applied half-written: endpoints left, then came back.
    doc = {"listen": f"127.0.0.1:{free_port()}", "admin": None, "pool": {"endpoints": [{"address": "10.0.0.1:8000"}]}}
    path = _write(tmp_path, doc)
    picker = create_picker(load_config(path), config_path=path)
    stamps = ["as read", "half written", "whole"]  # then "whole" for good
    reads: list[str] = []

    def stamp(_: Path) -> str:
        reads.append(stamps[min(len(reads), len(stamps) - 1)])
        return reads[-1]

    reloads: list[str] = []
    monkeypatch.setattr(picker_module, "file_stamp", stamp)
    monkeypatch.setattr(picker_module, "WATCH_INTERVAL_S", 0)
    monkeypatch.setattr(picker_module, "SETTLE_S", 0)
    monkeypatch.setattr(PickerProcess, "reload_file", lambda _: reloads.append(reads[-1]))
    watch = asyncio.create_task(picker._watch(path))
    try:
        await until(lambda: len(reads) > 20, "the watch looking at the file for a while")
    finally:
        watch.cancel()
    assert reloads == ["whole"]


async def test_a_rotated_admin_token_file_takes_effect_without_a_call_or_a_restart(servers, tmp_path: Path):
    secret = tmp_path / "admin-token"
    secret.write_text(TOKEN + "\n")
    path = _write(tmp_path, document(servers, admin_auth={"token_file": str(secret)}))
    picker = create_picker(load_config(path), config_path=path)
    await picker.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{picker.config.admin}", timeout=5) as client:
            assert (await client.get("/config", headers=AUTH)).status_code == 200
            rotated = "rotated-admin-token-9876543210"
            secret.write_text(rotated + "\n")  # as a Secret volume's update: the config file stays as it was
            await until(lambda: picker.reloads == 1)
            assert (await client.get("/config", headers=AUTH)).status_code == 401
            assert (await client.get("/config", headers={"authorization": f"Bearer {rotated}"})).status_code == 200
            # A file of the same size put in its place with the old one's time (cp -p, rsync -t) is new too.
            again = "rotated-admin-token-0123456789"
            fresh = tmp_path / "admin-token.new"
            fresh.write_text(again + "\n")
            times = secret.stat()
            os.utime(fresh, ns=(times.st_atime_ns, times.st_mtime_ns))
            os.replace(fresh, secret)
            await until(lambda: picker.reloads == 2)
            assert (await client.get("/config", headers={"authorization": f"Bearer {again}"})).status_code == 200
    finally:
        await picker.stop()


async def test_stream_timed_latency_reaches_the_scorers_the_heatmap_and_metrics(servers, tmp_path: Path):
    # No receiver: the filter's response timings are the only latency source.
    doc = document(servers, otel={"latency_source": "stream", "publish_interval_s": 0.05})
    picker = create_picker(load_config(_write(tmp_path, doc)))
    await picker.start()
    try:
        assert picker.spans is not None and picker.spans.receiver is None
        timer = picker.service.response_timer
        assert timer is not None
        addresses = [e.address for e in picker.engine.pool]
        for _ in range(20):
            timer(addresses[2], 0.8, None)  # slow first tokens on the third endpoint
            timer(addresses[0], 0.05, None)
            timer(addresses[1], None, 1.5)  # an unstreamed response: E2E only
        timer("10.9.9.9:8000", 0.01, None)  # not in the pool (it left since the request was routed): not counted
        await until(lambda: picker.engine.signals.snapshot.ttft_s[2] > 0.5)
        admin = f"http://{picker.config.admin}"
        async with httpx.AsyncClient(base_url=admin, timeout=5, headers=AUTH) as client:
            rows = (await client.get("/endpoints")).json()["endpoints"]
            assert [r["latency"]["count"] for r in rows] == [20, 20, 20]
            assert rows[2]["latency"]["ttft_p99"] == pytest.approx(0.8, rel=0.03)
            assert rows[1]["latency"]["e2e_p50"] == pytest.approx(1.5, rel=0.03)
            grid = (await client.get("/heatmap.json")).json()
            assert sum(map(sum, grid["count"])) == 60
            renderers = _render_workers()  # the heatmap's views are made in a worker process
            assert len(renderers) == 1
            metrics = _families((await client.get("/metrics")).text)
            assert metrics["inferlb_endpoint_ttft_seconds"].type == "histogram"
            assert metrics.get("inferlb_responses_timed") is not None
            assert metrics.get("inferlb_spans_received") is None  # no receiver, no span counters

            changed = {**doc, "otel": {"latency_source": "spans"}}
            refused = await client.post("/config", content=yaml.safe_dump(changed), headers=YAML)
            assert refused.status_code == 400 and "latency_source cannot change" in refused.json()["error"]["message"]
    finally:
        await picker.stop(0.5)
    # It stops with the picker (the admin API's lifespan), not a minute later or with the test process.
    await until(lambda: not _render_workers() or None, "the render worker gone with the picker")


def _render_workers() -> list[int]:
    """This process's children started by multiprocessing's spawn (the heatmap's render worker)."""
    me = os.getpid()
    found = []
    for pid in map(int, Path(f"/proc/{me}/task/{me}/children").read_text().split()):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except FileNotFoundError:
            continue
    return found


def _write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def test_experiments_are_shown_steered_by_the_operator_only_and_counted_in_metrics(servers, tmp_path: Path):
    doc = document(servers)
    doc["pool"]["endpoints"][2]["labels"] = {"version": "canary"}
    doc["experiments"] = [
        {
            "name": "release",
            "arms": [
                {"name": "stable", "profile": "kv-aware", "weight": 0.5},
                {"name": "canary", "profile": "least-request", "weight": 0.5, "endpoints": {"version": "canary"}},
            ],
        }
    ]
    picker = create_picker(load_config(_write(tmp_path, doc)))
    await picker.start()
    try:
        router = picker.service.router
        for i in range(40):
            admitted = router.admit(RequestFeatures(model="m", request_id=f"r{i}", prompt_tokens=10)).request
            picker.service._route(admitted, ((None,) * 3))
        async with httpx.AsyncClient(base_url=f"http://{picker.config.admin}", timeout=5) as client:
            # Only the operator steers traffic: no token, no change.
            refused = await client.post(
                "/experiments/release", json={"action": "weights", "weights": {"stable": 0, "canary": 1}}
            )
            assert refused.status_code == 401
            client.headers.update(AUTH)
            (shown,) = (await client.get("/experiments")).json()["experiments"]
            assert shown["weights"] == {"stable": 0.5, "canary": 0.5}
            requests = {arm["name"]: arm["requests"] for arm in shown["arms"]}
            assert sum(requests.values()) == 40 and min(requests.values()) > 0
            assert [a["endpoints"] for a in shown["arms"]] == [{}, {"version": "canary"}]
            assert (await client.post("/experiments/nope", json={"action": "pause"})).status_code == 404
            bad = await client.post("/experiments/release", json={"action": "explode"})
            assert bad.status_code == 400 and "unknown action" in bad.text
            bad = await client.post("/experiments/release", json={"action": "weights", "weights": {"stable": 0.7}})
            assert bad.status_code == 400 and "every arm" in bad.text
            moved = await client.post(
                "/experiments/release", json={"action": "weights", "weights": {"stable": 0.9, "canary": 0.1}}
            )
            assert moved.status_code == 200 and moved.json()["weights"] == {"stable": 0.9, "canary": 0.1}
            paused = (await client.post("/experiments/release", json={"action": "pause"})).json()
            assert paused["state"] == "paused" and [h["kind"] for h in paused["history"]] == [
                "started",
                "set",
                "paused",
            ]
            metrics = _families((await client.get("/metrics")).text)
            by_arm = {s.labels["arm"]: s.value for s in metrics["inferlb_experiment_requests"].samples}
            assert by_arm == {"stable": requests["stable"], "canary": requests["canary"]}
            weights = {s.labels["arm"]: s.value for s in metrics["inferlb_experiment_weight"].samples}
            assert weights == {"stable": 0.9, "canary": 0.1}
            changes = {
                (s.labels["arm"], s.labels["kind"]): s.value
                for s in metrics["inferlb_experiment_weight_changes"].samples
            }
            guard = {(arm, kind): 0 for arm in ("stable", "canary") for kind in ("cut", "rolled-back")}
            assert changes == guard | {("", "started"): 1, ("", "set"): 1, ("", "paused"): 1}
        # Paused: covered requests route as the rest do, and the canary's endpoint stays reserved for its arm.
        for i in range(20):
            admitted = router.admit(RequestFeatures(model="m", request_id=f"p{i}", prompt_tokens=10)).request
            assert admitted.arm is None
            reply, lease, _ = picker.service._route(admitted, tuple(range(3)))
            assert reply != 2
            lease.release()
    finally:
        await picker.stop(0.5)


async def test_with_span_latency_the_servers_spans_are_the_experiments_outcomes(tmp_path: Path):
    from inferlb.otel.spanwire import SpanRecord

    doc = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
        # The servers' spans come through a collector on this host (a relay: the servers are elsewhere).
        "otel": {"receiver": f"127.0.0.1:{free_port()}", "relays": ["127.0.0.1/32"]},
        "pool": {"endpoints": [{"address": "10.0.0.1:8000", "models": ["m"]}, {"address": "10.0.0.2:8000"}]},
        "experiments": [
            {
                "name": "ab",
                "arms": [
                    {"name": "a", "profile": "default", "weight": 0.5},
                    {"name": "b", "profile": "round-robin", "weight": 0.5},
                ],
            }
        ],
    }
    picker = create_picker(load_config(_write(tmp_path, doc)))
    router, replies = picker.service.router, picker.service.replies.headers
    traces = []
    for i in range(40):
        trace = f"{i + 1:032x}"
        features = RequestFeatures(model="m", request_id=f"r{i}", traceparent=f"00-{trace}-{1:016x}-01")
        _, lease, _ = picker.service._route(router.admit(features).request, replies)
        lease.release()
        traces.append(bytes.fromhex(trace))
    joiner = picker.spans.receiver.joiner
    for trace in traces:
        joiner.add(COLLECTOR, SpanRecord(trace, None, 0.25, 1.0, 1_700_000_000.0))
    arms = router.experiments.running["ab"].arms
    assert sum(arm.outcomes.ttft.moments.count for arm in arms) == 40
    assert sum(arm.outcomes.finished for arm in arms) == 40 and router.experiments.unattributed == 0


async def test_span_timings_teach_the_picker_each_servers_speed_and_it_routes_by_it(tmp_path: Path):
    from inferlb.otel.spanwire import SpanRecord

    doc = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
        "otel": {"receiver": f"127.0.0.1:{free_port()}", "publish_interval_s": 0.01, "relays": ["127.0.0.1/32"]},
        "pool": {"endpoints": [{"address": "10.0.0.1:8000", "models": ["m"]}, {"address": "10.0.0.2:8000"}]},
    }
    picker = create_picker(load_config(_write(tmp_path, doc)))
    router, replies = picker.service.router, picker.service.replies.headers
    assert router.speeds is picker.spans.speeds
    joiner = picker.spans.receiver.joiner
    # A span joined to no decision of this picker (a forged or a stranger's trace id, naming a server) teaches
    # nothing: only a timing of a request the picker routed, by its trace, reaches the speeds.
    features = RequestFeatures(model="m", request_id="routed", prompt_tokens=4000)
    _, lease, _ = picker.service._route(router.admit(features).request, replies)
    lease.release()
    joiner.add(COLLECTOR, SpanRecord(bytes.fromhex("ab" * 16), "10.0.0.2:8000", 60.0, 61.0, 1_700_000_000.0, 100))
    assert picker.spans.speeds.timings == 0
    for i in range(40):
        trace = f"{i + 1:032x}"
        features = RequestFeatures(
            model="m", request_id=f"r{i}", prompt_tokens=4000, traceparent=f"00-{trace}-{1:016x}-01"
        )
        _, lease, _ = picker.service._route(router.admit(features).request, replies)
        lease.release()
        endpoint = lease.index
        # Server 2 (index 1) prefills four times slower than server 1; its decode steps are 30 ms, server 1's 6.
        ttft = 4000 / (40_000 if endpoint == 0 else 10_000)
        step = 0.006 if endpoint == 0 else 0.03
        joiner.add(COLLECTOR, SpanRecord(bytes.fromhex(trace), None, ttft, ttft + 99 * step, 1_700_000_000.0, 100))
    assert picker.spans.speeds.timings == 40
    await picker.spans.start()  # the publisher, which puts what was learned into the snapshot
    try:
        await until(
            lambda: np.isfinite(picker.engine.signals.snapshot.prefill_tokens_per_s).all(), "learned speeds published"
        )
        snapshot = picker.engine.signals.snapshot
    finally:
        await picker.spans.stop()
    fast, slow = snapshot.prefill_tokens_per_s
    assert fast > 2 * slow
    assert snapshot.decode_step_s[1] > 2 * snapshot.decode_step_s[0]
    # With both idle, a long prompt goes where it prefills fastest.
    routed = router.route(RequestFeatures(model="m", request_id="next", prompt_tokens=8000))
    assert routed.decision.endpoint.index == 0


def _queue_limits(picker: PickerProcess) -> list[float]:
    """Each endpoint's queue limit in the saturation rule (max_waiting scaled by its declared speed)."""
    limit = picker.service.router.engine.saturation.waiting_limit
    return np.broadcast_to(limit, len(picker.service.router.pool)).tolist()


def _recent_prefill_speeds(picker: PickerProcess) -> list[float] | None:
    """The declared speeds the profile's recent-prefill scorer compares by (None: one speed)."""
    scorer = next(s.scorer for s in picker.service.router.engine.profile.scorers if s.scorer.name == "recent-prefill")
    speeds = getattr(scorer, "speeds", None)
    return None if speeds is None else list(speeds)


async def test_declared_speeds_reach_the_learned_speeds_and_a_reload_changes_them(tmp_path: Path):
    doc = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
        "otel": {"latency_source": "stream"},
        "policy": "recent",
        "profiles": {"recent": {"scorers": [{"type": "recent-prefill"}, {"type": "predicted-ttft"}]}},
        "pool": {
            "endpoints": [
                {"address": "10.0.0.1:8000", "labels": {"gpu": "h100"}},
                {"address": "10.0.0.2:8000", "labels": {"gpu": "l4"}},
            ],
            "speeds": {"label": "gpu", "relative": {"h100": 3, "l4": 1}},
        },
    }
    picker = create_picker(load_config(_write(tmp_path, doc)))
    assert picker.service.router.speeds is picker.spans.speeds
    assert list(picker.spans.speeds.relative) == [3.0, 1.0]
    assert _recent_prefill_speeds(picker) == [3.0, 1.0]  # it compares the tokens sent within each speed
    assert _queue_limits(picker) == [16.0, 16 / 3]  # an L4's queue of 5.3 takes as long as an H100's of 16
    await picker.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{picker.config.admin}", timeout=5) as client:

            async def shown() -> list[float | None]:
                return [r.get("declared_speed") for r in (await client.get("/endpoints")).json()["endpoints"]]

            assert await shown() == [3.0, 1.0]
            picker.reload_document({**doc, "pool": {**doc["pool"], "speeds": {"label": "gpu", "relative": {"l4": 2}}}})
            assert list(picker.spans.speeds.relative) == [1.0, 2.0]  # the H100s now get the default, 1
            assert picker.service.router.speeds is picker.spans.speeds
            assert _recent_prefill_speeds(picker) == [1.0, 2.0]
            assert _queue_limits(picker) == [8.0, 16.0]
            assert await shown() == [1.0, 2.0]
            picker.reload_document({**doc, "pool": {"endpoints": doc["pool"]["endpoints"]}})
            assert picker.spans.speeds.relative is None
            assert _recent_prefill_speeds(picker) is None
            assert _queue_limits(picker) == [16.0, 16.0]
            assert await shown() == [None, None]
    finally:
        await picker.stop(0.5)


async def test_the_filters_timing_of_a_response_teaches_the_speeds_and_a_failure_does_not(tmp_path: Path):
    doc = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
        "otel": {"latency_source": "stream"},
        "pool": {"endpoints": [{"address": "10.0.0.1:8000", "models": ["m"]}]},
    }
    picker = create_picker(load_config(_write(tmp_path, doc)))
    router, replies = picker.service.router, picker.service.replies.headers
    for name in ("ok", "failed"):
        features = RequestFeatures(model="m", request_id=name, prompt_tokens=2000)
        _, lease, _ = picker.service._route(router.admit(features).request, replies)
        lease.release()
    picker.service._timed("failed", None, None, True)
    picker.service._timed("ok", 0.1, None, False)
    assert picker.spans.speeds.timings == 1


@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")
async def test_two_pickers_sharing_redis_count_each_others_requests_and_say_when_redis_is_gone(servers, tmp_path: Path):
    with redis_server(tmp_path / "redis") as redis:
        secret = tmp_path / "redis-password"
        secret.write_text(redis.password)
        shared = {"url": redis.url, "password": {"token_file": str(secret)}, "key": "inferlb:test-pool"}
        pickers = []
        for name in ("a", "b"):
            folder = tmp_path / name
            folder.mkdir()
            doc = document(servers, replicas=shared)
            pickers.append((create_picker(load_config(_write(folder, doc))), doc))
        (a, _), (b, b_doc) = pickers
        for picker, _ in pickers:
            await picker.start()
        try:
            await until(lambda: not a.not_ready() and not b.not_ready(), "both ready")
            routed = a.service.router.route(RequestFeatures(model="m", request_id="r1"))
            index = routed.decision.endpoint.index
            await until(lambda: b.engine.inflight.requests[index] == 1, "b counts a's request")
            async with httpx.AsyncClient(base_url=f"http://{b.config.admin}", timeout=5, headers=AUTH) as client:
                metrics = _families((await client.get("/metrics")).text)
                assert metrics["inferlb_replicas_redis_up"].samples[0].value == 1
                assert metrics["inferlb_replicas_peers"].samples[0].value == 1
                refused = await client.post(
                    "/config", content=yaml.safe_dump({**b_doc, "replicas": None}), headers=YAML
                )
                assert refused.status_code == 400 and "replicas cannot change" in refused.json()["error"]["message"]
                redis.stop()
                await until(lambda: b.replicas is not None and b.replicas.up is False, "b sees Redis gone")
                ready = await client.get("/readyz")
                assert ready.status_code == 200 and "routing alone" in ready.json()["notes"][0]
                metrics = _families((await client.get("/metrics")).text)
                assert metrics["inferlb_replicas_redis_up"].samples[0].value == 0
            routed.lease.release()
        finally:
            for picker, _ in pickers:
                await picker.stop(0.5)


@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")
async def test_an_experiment_paused_through_one_pickers_admin_api_is_paused_in_every_picker_and_after_a_restart(
    servers, tmp_path: Path
):
    with redis_server(tmp_path / "redis") as redis:
        secret = tmp_path / "redis-password"
        secret.write_text(redis.password)
        shared = {"url": redis.url, "password": {"token_file": str(secret)}, "key": "inferlb:test-pool"}
        experiment = {
            "name": "release",
            "arms": [
                {"name": "stable", "profile": "kv-aware", "weight": 0.5},
                {"name": "canary", "profile": "kv-aware", "weight": 0.5, "endpoints": {"version": "canary"}},
            ],
        }

        def picker(name: str) -> PickerProcess:
            folder = tmp_path / name
            folder.mkdir()
            doc = document(servers, replicas=shared, experiments=[experiment])
            doc["pool"]["endpoints"][2]["labels"] = {"version": "canary"}
            return create_picker(load_config(_write(folder, doc)))

        def state(p: PickerProcess) -> str:
            experiments = p.service.router.experiments
            assert experiments is not None
            return experiments.running["release"].state

        a, b = picker("a"), picker("b")
        running = [a, b]
        await a.start()
        await b.start()
        try:
            await until(lambda: not a.not_ready() and not b.not_ready(), "both ready")
            async with httpx.AsyncClient(base_url=f"http://{a.config.admin}", timeout=5, headers=AUTH) as client:
                paused = await client.post("/experiments/release", json={"action": "pause"})
                assert paused.status_code == 200 and paused.json()["state"] == "paused"
            await until(lambda: state(b) == "paused", "b paused by a's admin API")
            await b.stop(0.5)
            running.remove(b)
            restarted = picker("b-again")
            running.append(restarted)
            assert "experiments: reading their shared control state from Redis" in restarted.not_ready()
            await restarted.start()
            await until(lambda: not restarted.not_ready(), "the restarted picker ready")
            assert state(restarted) == "paused"  # taken up before it reported ready
            async with httpx.AsyncClient(base_url=f"http://{restarted.config.admin}", timeout=5) as client:
                metrics = _families((await client.get("/metrics")).text)
            shared_changes = {s.labels["kind"]: s.value for s in metrics["inferlb_experiment_shared_changes"].samples}
            assert shared_changes == {"published": 0, "applied": 1, "rejected": 0, "conflicts": 0}
            assert metrics["inferlb_experiment_shared_outages"].samples[0].value == 0
        finally:
            for p in running:
                await p.stop(0.5)


@pytest.mark.parametrize(
    ("otel", "replicas", "exact"),
    [
        ({"latency_source": "stream"}, False, True),
        ({}, False, False),  # spans arrive at the request's end: the backlog stays estimated
        # The replica whose observing stream saw a first token passes it on to the one that holds the lease.
        ({"latency_source": "stream"}, True, True),
        ({}, True, False),
    ],
    ids=["stream", "spans", "stream-with-replicas", "spans-with-replicas"],
)
async def test_the_prefill_backlog_is_exact_where_the_picker_times_the_responses(
    tmp_path: Path, otel: dict, replicas: bool, exact: bool
) -> None:
    doc: dict = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
        "otel": otel,
        "pool": {"endpoints": [{"address": "10.0.0.1:8000"}, {"address": "10.0.0.2:8000"}]},
    }
    if replicas:
        secret = tmp_path / "redis-password"
        secret.write_text("not-used")
        doc["replicas"] = {"url": "redis://127.0.0.1:1", "password": {"token_file": str(secret)}, "key": "inferlb:t"}
    picker = create_picker(load_config(_write(tmp_path, doc)))
    assert picker.engine.inflight.first_tokens is exact
    # The mirrored responses also tell where stored Responses API responses live (filter/storedresponses.py).
    assert (picker.service.stored_responses is not None) is exact
    if replicas:
        relayed = picker.replicas is not None and picker.replicas.first_token is not None
        assert relayed is exact and (picker.service.on_first_token_elsewhere is not None) is exact


async def test_a_collector_that_ends_with_an_error_is_logged_shown_in_readyz_and_the_stop_completes(
    servers, tmp_path: Path, caplog
):
    picker = create_picker(load_config(_write(tmp_path, document(servers))))

    async def broken() -> None:
        raise OverflowError("int too large to convert to float")

    picker.gpu_collector.run = broken  # type: ignore[method-assign]
    await picker.start()
    stopped = False
    try:
        async with httpx.AsyncClient(base_url=f"http://{picker.config.admin}", timeout=5) as client:
            await until(lambda: picker.collector_failures, "the failure noticed")
            await until(lambda: picker.collector.first_round_done, "the metrics round")
            ready = (await client.get("/readyz")).json()
        assert ready["status"] == "ready"  # the metrics still come: it routes, on GPU state going stale
        assert ready["notes"] == [
            "the gpu collector stopped (OverflowError('int too large to convert to float')): its signals are going "
            "stale"
        ]
        assert "the gpu collector stopped" in caplog.text and "OverflowError" in caplog.text
        await picker.stop(0.5)  # once, the collector's error came out of here and the rest of the stop was skipped
        stopped = True
    finally:
        if not stopped:
            await picker.stop(0.5)


@pytest.mark.parametrize(
    "change", [pytest.param("leaves", id="an-endpoint-leaves"), pytest.param("joins", id="one-joins")]
)
async def test_requests_waiting_for_capacity_across_a_membership_change_go_to_members_of_the_new_pool(
    change: str, tmp_path: Path
) -> None:
    # Once, a waiting request was answered from the old pool's reply table at the new pool's index: a departed
    # endpoint was named (4 of 8 requests), or, with a pool that grew, the old candidate mask failed the stream.
    from .filter.test_server import FakeEnvoy, destination, headers_message

    addresses = [f"127.0.0.1:{free_port()}" for _ in range(4)]
    listen = f"127.0.0.1:{free_port()}"

    def doc(members: list[str]) -> dict:
        return {
            "listen": listen,
            "admin": None,
            "policy": "least-request",
            "signals": {"scrape_metrics": False},
            "pool": {"endpoints": [{"address": a} for a in members]},
        }

    before, after = (addresses[:3], addresses[1:3]) if change == "leaves" else (addresses[:3], addresses)
    picker = create_picker(load_config(_write(tmp_path, doc(before))))
    await picker.start()
    try:
        signals = picker.engine.signals
        now = signals.clock()
        n = len(before)
        signals.publish(  # every endpoint saturated: each request waits for capacity (the default class, 0.5 s)
            signals.snapshot.with_values(waiting=[50.0] * n, kv_usage=[0.1] * n, scraped_at=[now] * n, up=[True] * n)
        )
        envoys, sent = [], []
        for i in range(8):
            envoys.append(FakeEnvoy(picker.server))
            message = headers_message(eos=True)
            message.request_headers.headers.headers[2].raw_value = f"rid-{i}".encode()
            sent.append(asyncio.create_task(envoys[-1].send(message)))
        await until(lambda: len(picker.service.router.queue) == 8, "every request waiting")
        picker.reload_document(doc(after))
        destinations = [destination(await reply) for reply in sent]
        assert set(destinations) <= set(after), destinations
        counts = picker.engine.inflight.requests
        assert {e.address: int(counts[e.index]) for e in picker.engine.pool} == {
            a: destinations.count(a) for a in after
        }
        assert picker.service.stats.failed == 0
        for envoy in envoys:
            await envoy.channel.close()
    finally:
        await picker.stop(0.2)


async def test_reloads_a_moment_apart_leave_one_metrics_collector_and_none_after_the_stop(servers, tmp_path: Path):
    # Once, two reloads a few milliseconds apart restarted the collectors concurrently: the second cleared the list
    # of tasks the first had just started, which scraped on unseen, past the picker's stop (20 double reloads left
    # 20 collectors and 40 scrape loops running).
    doc = document(servers)
    small = {**doc, "pool": {"endpoints": doc["pool"]["endpoints"][:2]}}
    picker = create_picker(load_config(_write(tmp_path, doc)))

    def running(prefix: str) -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t.get_name().startswith(prefix) and not t.done()]

    await picker.start()
    try:
        for _ in range(20):
            picker.reload_document(small)  # one endpoint leaves (idle: at once)
            picker.reload_document(doc)  # and comes back
            await asyncio.sleep(0)
        await until(lambda: len(running("metrics")) == 1 and len(running("scrape ")) == len(servers), "one collector")
        await until(lambda: picker.collector.stats.scrapes >= len(servers), "the last collector scraping")
    finally:
        await picker.stop(0.2)
    await until(lambda: not running("metrics") and not running("scrape "), "every collector stopped")


async def test_the_decision_counts_of_an_endpoint_that_left_the_pool_are_dropped(servers, tmp_path: Path):
    # With pods that come and go, one series per address ever routed to would grow without end (300 membership
    # changes: 303 entries).
    doc = document(servers)
    picker = create_picker(load_config(_write(tmp_path, doc)))
    router, replies = picker.service.router, picker.service.replies.headers
    leases = []  # held meanwhile: the in-flight counts spread the requests over every endpoint
    for i in range(12):
        _, lease, _ = picker.service._route(
            router.admit(RequestFeatures(model="m", request_id=f"r{i}")).request, replies
        )
        leases.append(lease)
    for lease in leases:
        lease.release()
    counted = {address for address, _ in picker.service.decisions.by_endpoint}
    assert counted == {s.address for s in servers}
    picker.reload_document({**doc, "pool": {"endpoints": doc["pool"]["endpoints"][1:]}})  # idle: it leaves at once
    assert {address for address, _ in picker.service.decisions.by_endpoint} == {s.address for s in servers[1:]}


async def test_kv_events_of_an_endpoint_back_before_it_drained_are_forgotten(tmp_path: Path) -> None:
    # A server that came back while draining is another process: the index kept the old one's blocks for good.
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    doc = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": None,
        "policy": "least-request",
        "signals": {"scrape_metrics": False},
        "kv_events": {"port": free_port(), "tokenizers": {"m": "pieces"}, "block_size": 4},
        "pool": {"endpoints": [{"address": a, "models": ["m"]} for a in addresses]},
    }
    picker = create_picker(load_config(_write(tmp_path, doc)))
    kv = picker.engine.signals.kv
    assert kv is not None
    keys = cache_keys(list(range(8)), 4)
    for endpoint in (0, 1):
        kv.store(endpoint, [1, 2], keys)
        kv.states[endpoint].sequence = 7
    picker.engine.inflight.requests[0] = 1  # it leaves with a request in flight: draining
    picker.reload_document({**doc, "pool": {"endpoints": doc["pool"]["endpoints"][1:]}})
    picker.reload_document(doc)  # and is back before it drained
    kv = picker.engine.signals.kv
    assert kv is not None and [e.address for e in picker.engine.pool] == addresses
    assert kv.match_depth(keys)[0].tolist() == [0, 2]
    assert kv.states[0].sequence is None and kv.states[1].sequence == 7


async def test_how_long_a_request_waits_for_its_exact_keys_is_the_configs(tmp_path: Path) -> None:
    # A fleet of long prompts, whose keyed heads take the tokenizer most of a second, may wait longer than 50 ms.
    kv_events = {"port": free_port(), "tokenizers": {"m": "pieces"}}
    doc = {"listen": f"127.0.0.1:{free_port()}", "admin": None, "pool": {"endpoints": [{"address": "10.0.0.1:8000"}]}}
    picker = create_picker(load_config(_write(tmp_path, {**doc, "kv_events": kv_events})))
    assert (picker.service.keying_deadline_s, picker.service.keying_queue) == (0.05, 8)
    tuned = {**kv_events, "keying_deadline_s": 0.8, "keying_queue": 32}
    picker = create_picker(load_config(_write(tmp_path, {**doc, "kv_events": tuned})))
    assert (picker.service.keying_deadline_s, picker.service.keying_queue) == (0.8, 32)
    with pytest.raises(ConfigError, match=r"kv_events\.keying_queue"):
        parse_config({**doc, "kv_events": {**kv_events, "keying_queue": 0}})


def _discovered_picker(gpu: dict | None = None) -> PickerProcess:
    listed = [{"address": "10.0.0.1:8000", "gpu": gpu}] if gpu else []
    doc = {
        "admin": None,
        "pool": {
            "endpoints": listed,
            "allowed_networks": ["10.0.0.0/8"],
            "discovery": {"etcd": {"urls": ["http://127.0.0.1:2379"], "prefix": "/x/"}},
        },
    }
    found = tuple(EndpointConfig(address=a) for a in ("10.0.0.1:8000", "10.0.0.2:8000"))
    return create_picker(parse_config(doc), discovered=found)


async def test_a_discovered_entry_keeps_the_gpu_source_the_file_gives_its_address() -> None:
    # Discovery gives no GPU source (those come from the file): its entry replaced the file's, source and all.
    picker = _discovered_picker(gpu={"url": "http://10.0.0.1:9400/gpu"})
    by = {e.address: e.gpu for e in picker.config.endpoints}
    assert by["10.0.0.1:8000"] is not None and by["10.0.0.1:8000"].url == "http://10.0.0.1:9400/gpu"
    assert by["10.0.0.2:8000"] is None


async def test_every_endpoint_leaving_with_requests_in_flight_leaves_the_pool_in_force_serving() -> None:
    # With nothing in flight, a source emptied by mistake was already refused (the pool stayed); with requests in
    # flight every endpoint drained, every new request failed, and once they drained the pool stayed draining.
    picker = _discovered_picker()
    lease = picker.engine.inflight.acquire(0, 100)
    picker.discovered_endpoints(())
    assert picker.membership_refusals == 1
    assert [e.draining for e in picker.engine.pool] == [False, False]
    router = picker.service.router
    routed = router.route(router.admit(RequestFeatures(model="m", request_id="after")).request)
    routed.lease.release()
    lease.release()


async def test_sessions_on_endpoints_that_stay_keep_them_when_another_leaves() -> None:
    # The profile is built anew for each pool; its session ring placed points by index, which shift when an
    # endpoint leaves: 92% of the sessions of the endpoints that stayed moved, their KV cache lost.
    doc = {
        "admin": None,
        "policy": "sticky",
        "session_header": "x-session",
        "profiles": {"sticky": {"scorers": [{"type": "session-affinity", "weight": 1}]}},
        "pool": {
            "endpoints": [],
            "allowed_networks": ["10.0.0.0/8"],
            "discovery": {"etcd": {"urls": ["http://127.0.0.1:2379"], "prefix": "/x/"}},
        },
    }
    found = tuple(EndpointConfig(address=f"10.0.0.{i}:8000") for i in range(1, 5))
    picker = create_picker(parse_config(doc), discovered=found)

    def where(session: str) -> str:
        router = picker.service.router
        features = RequestFeatures(request_id=session, session_key=session)
        routed = router.route(router.admit(features).request)
        routed.lease.release()
        return routed.decision.endpoint.address

    sessions = [f"s{i}" for i in range(200)]
    before = {s: where(s) for s in sessions}
    picker.discovered_endpoints(found[1:])  # the first leaves
    kept = [s for s in sessions if before[s] != found[0].address]
    assert kept and all(where(s) == before[s] for s in kept)


async def test_leases_held_while_redis_is_out_of_reach_may_have_lost_their_end(monkeypatch) -> None:
    # Their end may reach another replica, which cannot pass it on: they age out after max_age_s, not 4x it.
    clock = ManualClock()
    leases = OpenLeases(max_age_s=60, clock=clock)
    monkeypatch.setattr(picker_module, "LEASE_EXPIRY_INTERVAL_S", 0)
    out_of_reach = [False]
    task = asyncio.create_task(picker_module._expire_leases(leases, lambda: out_of_reach[0]))
    try:
        await asyncio.sleep(0.01)
        assert leases.lost_at == -math.inf
        clock.advance(100)
        out_of_reach[0] = True
        await until(lambda: leases.lost_at == clock.now, "the leases held marked")
    finally:
        task.cancel()


async def test_a_peer_gone_silent_may_have_taken_ends_of_requests_routed_here(tmp_path: Path) -> None:
    # Envoy's access-log stream to a peer that died held ends of this picker's requests: its leases held then age out
    # after max_age_s, not four times it.
    secret = tmp_path / "redis-password"
    secret.write_text("not-used")
    doc = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": None,
        "pool": {"endpoints": [{"address": "10.0.0.1:8000"}]},
        "replicas": {"url": "redis://127.0.0.1:1", "password": {"token_file": str(secret)}, "key": "inferlb:t"},
    }
    picker = create_picker(load_config(_write(tmp_path, doc)))
    replicas = picker.replicas
    assert replicas is not None
    replicas.up = True
    assert not picker._ends_may_be_lost()
    replicas.peers_gone += 1
    assert picker._ends_may_be_lost() and not picker._ends_may_be_lost()  # once per peer gone
    replicas.up = False
    assert picker._ends_may_be_lost()

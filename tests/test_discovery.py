"""A whole picker whose pool follows etcd (inferlb/picker.py with scorer/etcd.py): an endpoint put in etcd joins
within a second and ramps in, one deleted drains and goes when its last request ends (the others keep their
latency statistics), and /endpoints and /metrics say so. Real etcd, emulated servers, the picker in process."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from inferlb.bench.etcdserver import delete, etcd_server, put
from inferlb.picker import create_picker, first_membership, serve
from inferlb.procs import free_port
from inferlb.scorer.config import parse_config
from inferlb.scorer.etcd import EtcdSource
from inferlb.scorer.features import RequestFeatures
from inferlb.sim.fleet import serving
from inferlb.sim.profiles import get_profile
from inferlb.sim.server import EmulatedServer, ServerOptions

from .conftest import needs_etcd, until

pytestmark = needs_etcd

PREFIX = "/inferlb/pool/"


@pytest.fixture
def etcd(tmp_path: Path):
    with etcd_server(tmp_path) as url:
        yield url


@pytest.fixture
async def servers():
    profile = get_profile("h100-llama3.1-8b")
    emulated = [
        EmulatedServer(f"127.0.0.1:{free_port()}", ServerOptions(profile=profile, models=("m",))) for _ in range(3)
    ]
    async with serving(emulated):
        yield emulated


def document(etcd: str, static: list[str], **pool) -> dict:
    return {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": f"127.0.0.1:{free_port()}",
        "policy": "least-request",
        "signals": {"scrape_interval_s": 0.05},
        "pool": {
            "endpoints": [{"address": a, "models": ["m"]} for a in static],
            "discovery": {"etcd": {"urls": [etcd], "prefix": PREFIX}},
            **pool,
        },
    }


def route(picker, request_id: str):
    routed = picker.service.router.route(RequestFeatures(model="m", request_id=request_id))
    return routed.decision.endpoint.address, routed.lease


async def test_endpoints_put_in_etcd_join_and_those_deleted_drain(etcd: str, servers) -> None:
    a, b, c = (s.address for s in servers)
    put(etcd, PREFIX + "b", {"address": b, "models": ["m"]})
    doc = {**document(etcd, [a], slow_start={"ramp_s": 60, "min_fraction": 0.25}), "otel": {"latency_source": "stream"}}
    config = parse_config(doc)
    assert config.discovery is not None
    source = EtcdSource(config.discovery.etcd, config.allowed_networks)
    picker = create_picker(config, discovered=await first_membership(source))
    await picker.start()
    admin = httpx.AsyncClient(base_url=f"http://{config.admin}", timeout=5)
    try:
        assert [e.address for e in picker.engine.pool] == [a, b]
        # c joins: in the pool within a second of the put, ramping in.
        put(etcd, PREFIX + "c", {"address": c, "models": ["m"], "labels": {"zone": "z"}})
        await until(lambda: len(picker.engine.pool) == 3, "the joiner in the pool", timeout=1.0)
        # It gets requests once its first scrape is in (the staleness filter skips a server never scraped).
        await until(lambda: not picker.engine.signals.stale()[2], "the joiner scraped", timeout=1.0)
        rows = {r["address"]: r for r in (await admin.get("/endpoints")).json()["endpoints"]}
        assert rows[c]["state"] == "ramping" and rows[c]["slow_start"]["fraction"] == pytest.approx(0.25, abs=0.01)
        assert rows[c]["labels"] == {"zone": "z"} and rows[a]["state"] == rows[b]["state"] == "serving"
        # Least-request would send the empty joiner every request now; its ramp gives it a quarter of them.
        leases = []
        chosen = []
        for i in range(40):
            address, lease = route(picker, f"r{i}")
            chosen.append(address)
            leases.append(lease)
        assert 5 <= chosen.count(c) <= 11, chosen.count(c)
        timer = picker.service.response_timer
        assert timer is not None and picker.spans is not None
        for _ in range(3):
            timer(c, 0.3, None)  # the filter timed three of c's responses
        # b leaves with requests in flight: no new request goes there, and it stays until they end.
        held = [lease for lease, address in zip(leases, chosen, strict=True) if address == b]
        assert held
        delete(etcd, PREFIX + "b")
        await until(lambda: picker.engine.pool.draining, "b draining", timeout=1.0)
        for i in range(30):
            address, lease = route(picker, f"s{i}")
            assert address != b
            leases.append(lease)
        rows = {r["address"]: r for r in (await admin.get("/endpoints")).json()["endpoints"]}
        assert rows[b]["state"] == "draining" and rows[b]["inflight_requests"] == len(held)
        for lease in held:
            lease.release()
        await until(lambda: len(picker.engine.pool) == 2, "b gone once drained", timeout=2.0)
        assert [e.address for e in picker.engine.pool] == [a, c]
        assert picker.spans.view()["count"].tolist() == [0, 3]  # c's latency moved with it, from index 2 to 1
        view = (await admin.get("/endpoints")).json()["membership"]
        assert view["source"] == "etcd" and view["healthy"] and view["skipped"] == []
        assert view["changes"] == {"joined": 1, "left": 1, "removed": 1, "changed": 0}
        metrics = {f.name: f for f in text_string_to_metric_families((await admin.get("/metrics")).text)}
        changes = {s.labels["change"]: s.value for s in metrics["inferlb_membership_changes"].samples}
        assert changes["joined"] == 1 and changes["removed"] == 1
        assert {s.labels["source"]: s.value for s in metrics["inferlb_discovery_healthy"].samples} == {"etcd": 1}
        # Every other request's count survived the two changes: releasing them all leaves zero everywhere.
        for lease in leases:
            lease.release()
        assert picker.engine.inflight.requests.tolist() == [0, 0]
    finally:
        await admin.aclose()
        await picker.stop(0.5)


async def test_a_bad_entry_in_etcd_is_skipped_and_shown_and_the_pool_keeps_serving(etcd: str, servers) -> None:
    a = servers[0].address
    put(etcd, PREFIX + "bad", {"address": "192.0.2.1:8000"})  # outside the pool's networks (loopback here)
    config = parse_config(document(etcd, [a], allowed_networks=["127.0.0.0/8"]))
    picker = create_picker(config)
    await picker.start()
    try:
        await until(lambda: picker.discovered is not None, "the first read")
        assert [e.address for e in picker.engine.pool] == [a]
        async with httpx.AsyncClient(base_url=f"http://{config.admin}", timeout=5) as admin:
            skipped = (await admin.get("/endpoints")).json()["membership"]["skipped"]
        assert skipped == [{"key": PREFIX + "bad", "reason": skipped[0]["reason"]}]
        assert "outside pool.allowed_networks" in skipped[0]["reason"]
    finally:
        await picker.stop(0.5)


async def test_without_static_endpoints_the_picker_waits_for_its_first_member(etcd: str) -> None:
    config = parse_config({**document(etcd, []), "admin": None})
    assert config.discovery is not None
    source = EtcdSource(config.discovery.etcd, config.allowed_networks)
    waiting = asyncio.create_task(first_membership(source, report_every_s=0.1))
    await until(lambda: source.healthy, "etcd read")
    assert not waiting.done()  # an empty prefix is no pool
    put(etcd, PREFIX + "x", {"address": "127.0.0.9:8000"})
    found = await asyncio.wait_for(waiting, 5)
    assert [e.address for e in found] == ["127.0.0.9:8000"]


async def test_while_it_waits_for_its_first_member_the_picker_is_alive_but_not_ready(etcd: str, servers) -> None:
    """A kubelet's probes: liveness SERVING from the start (waiting for servers is no fault to restart for),
    readiness NOT_SERVING until the picker can route, then SERVING on the same port."""
    config = parse_config({**document(etcd, []), "admin": None})
    running = asyncio.create_task(serve(config))

    async def status(service: str) -> int | None:
        try:
            async with grpc.aio.insecure_channel(config.listen) as channel:
                request = health_pb2.HealthCheckRequest(service=service)
                reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=1)
                return int(reply.status)
        except grpc.aio.AioRpcError:
            return None  # not listening (yet, or between the two servers)

    async def both_are(liveness: int, readiness: int) -> bool:
        return (await status("liveness"), await status("readiness")) == (liveness, readiness)

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        await until(lambda: both_are(serving, not_serving), "alive, not ready, while it waits", timeout=10)
        assert not running.done()
        put(etcd, PREFIX + "a", {"address": servers[0].address, "models": ["m"]})
        await until(lambda: both_are(serving, serving), "ready once it routes", timeout=10)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running

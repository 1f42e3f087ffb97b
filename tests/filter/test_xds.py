"""The picker's ADS/EDS control plane (filter/xds.py) over real gRPC, as Envoy speaks to it: subscribe, get the
assignments, ACK, get each new version pushed; a NACK is counted and not answered with the same version."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from envoy.config.endpoint.v3.endpoint_pb2 import ClusterLoadAssignment
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest, DiscoveryResponse
from google.rpc.status_pb2 import Status

from inferlb.filter.xds import EDS_TYPE, MAX_RESOURCE_NAMES, ControlPlane, Member
from inferlb.procs import free_port

from ..conftest import until

CLUSTERS = ("inferlb_fallback", "inferlb_picked")


def endpoints(response: DiscoveryResponse) -> dict[str, list[tuple[str, int, int]]]:
    out = {}
    for resource in response.resources:
        assignment = ClusterLoadAssignment()
        resource.Unpack(assignment)
        out[assignment.cluster_name] = [
            (
                e.endpoint.address.socket_address.address,
                e.endpoint.address.socket_address.port_value,
                e.load_balancing_weight.value,
            )
            for group in assignment.endpoints
            for e in group.lb_endpoints
        ]
    return out


async def test_envoy_gets_each_version_and_its_acks_and_nacks_are_counted() -> None:
    control = ControlPlane(CLUSTERS)
    control.publish([Member("127.0.0.1", 8001, 10), Member("127.0.0.2", 8002, 1000)])
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(control, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    requests: asyncio.Queue[DiscoveryRequest] = asyncio.Queue()

    async def outgoing():
        while True:
            yield await requests.get()

    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stream = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(outgoing())
            requests.put_nowait(DiscoveryRequest(type_url=EDS_TYPE, resource_names=["inferlb_fallback", "other"]))
            first = await asyncio.wait_for(stream.read(), 5)
            assert first.version_info == "1" and first.type_url == EDS_TYPE
            assert endpoints(first) == {
                "inferlb_fallback": [("127.0.0.1", 8001, 10), ("127.0.0.2", 8002, 1000)],
                "other": [],  # not a cluster the picker serves: no endpoints
            }
            ack = DiscoveryRequest(
                type_url=EDS_TYPE,
                resource_names=["inferlb_fallback", "other"],
                version_info="1",
                response_nonce=first.nonce,
            )
            requests.put_nowait(ack)
            assert not control.publish([Member("127.0.0.1", 8001, 10), Member("127.0.0.2", 8002, 1000)])  # same
            assert control.publish([Member("127.0.0.2", 8002, 1)])  # a member left, a weight changed
            second = await asyncio.wait_for(stream.read(), 5)
            assert second.version_info == "2" and second.nonce != first.nonce
            assert endpoints(second)["inferlb_fallback"] == [("127.0.0.2", 8002, 1)]
            # The ACK and the new version cross: the ACK may be read after the response went out.
            await until(lambda: control.stats.acks == 1, "the ACK counted")
            assert "1" in control.stats.acked_at
            nack = DiscoveryRequest(
                type_url=EDS_TYPE,
                resource_names=["inferlb_fallback", "other"],
                version_info="1",
                response_nonce=second.nonce,
                error_detail=Status(code=3, message="bad weights"),
            )
            requests.put_nowait(nack)
            control.publish([Member("127.0.0.3", 8003, 5)])
            third = await asyncio.wait_for(stream.read(), 5)
            assert third.version_info == "3" and control.stats.nacks == 1  # the next version, not the refused one
            assert endpoints(third)["inferlb_fallback"] == [("127.0.0.3", 8003, 5)]
            assert control.stats.streams == 1 and control.stats.sent == 3
    finally:
        await server.stop(0)


def test_weights_are_clamped_to_what_envoy_takes() -> None:
    control = ControlPlane(CLUSTERS)
    control.publish([Member("127.0.0.1", 1, 0), Member("127.0.0.1", 2, 10**9)])
    weights = [e.load_balancing_weight.value for e in control.assignment("inferlb_picked").endpoints[0].lb_endpoints]
    assert weights == [1, 1000]


async def _serving(control: ControlPlane) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(control, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    return server, address


async def test_a_stream_asking_for_more_clusters_than_any_envoy_does_is_refused() -> None:
    # Each name costs an assignment at every publish, on the routing loop: 40,000 names once stalled it 157 ms.
    control = ControlPlane(CLUSTERS)
    control.publish([Member("127.0.0.1", 8001)])
    server, address = await _serving(control)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            names = [f"cluster-{i}" for i in range(MAX_RESOURCE_NAMES + 1)]
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(
                iter([DiscoveryRequest(type_url=EDS_TYPE, resource_names=names)])
            )
            with contextlib.suppress(grpc.aio.AioRpcError):
                await asyncio.wait_for(call.read(), 5)
            assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "65 clusters asked for" in (await call.details())
    finally:
        await server.stop(0)


async def test_a_client_that_sends_without_reading_holds_only_its_latest_request() -> None:
    # State of the world: each request supersedes the one before. Once, every request waited in a queue of its own
    # while the stream's handler was blocked on a client that did not read (150 requests of 0.9 MB: +230 MB).
    control = ControlPlane(CLUSTERS)
    control.publish([Member("127.0.0.1", 8001)])
    go, all_sent = asyncio.Event(), asyncio.Event()

    async def requests() -> AsyncIterator[DiscoveryRequest]:
        for i in range(200):
            yield DiscoveryRequest(type_url=EDS_TYPE, resource_names=["inferlb_picked", f"x{i}"])
            if i == 0:
                await go.wait()
        all_sent.set()
        await asyncio.Event().wait()  # the stream stays open

    handler = control.StreamAggregatedResources(requests(), None)  # type: ignore[arg-type]
    first = await asyncio.wait_for(anext(handler), 5)  # the handler now waits at its yield: nobody reads
    go.set()
    await asyncio.wait_for(all_sent.wait(), 5)
    second = await asyncio.wait_for(anext(handler), 5)
    assert set(endpoints(first)) == {"inferlb_picked", "x0"}
    assert set(endpoints(second)) == {"inferlb_picked", "x199"}  # the latest, not the 199 in between
    await handler.aclose()
    assert not control._streams

"""The picker's ADS/EDS control plane (filter/xds.py) over real gRPC, as Envoy speaks to it: subscribe, get the
assignments, ACK, get each new version pushed; a NACK is counted and not answered with the same version."""

from __future__ import annotations

import asyncio

import grpc
from envoy.config.endpoint.v3.endpoint_pb2 import ClusterLoadAssignment
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest, DiscoveryResponse
from google.rpc.status_pb2 import Status

from inferlb.filter.xds import EDS_TYPE, ControlPlane, Member
from inferlb.procs import free_port

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
            assert control.stats.acks == 1 and "1" in control.stats.acked_at
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

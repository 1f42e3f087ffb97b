"""The picker as Envoy's control plane: endpoint discovery (EDS) over the aggregated discovery service (ADS).

Envoy's bootstrap declares the server clusters as EDS clusters whose ``eds_config`` is ADS, and ADS as this gRPC
service on the picker's own port (`PickerServer` serves it beside ext_proc). Envoy subscribes to each cluster's
``ClusterLoadAssignment``; `ControlPlane.publish` replaces the membership (the pool's endpoints that serve, each
with a ``load_balancing_weight``) and every open stream gets the new assignments at once, state of the world,
version by version. So Envoy's clusters and the picker's pool never disagree: an endpoint that joins is in them
as soon as the picker has it, one that leaves is gone, and the weights the picker derives from its scores
(``filter/weights.py`` computes them) are Envoy's own balancer's.

Envoy ACKs a version by sending it back with the response's nonce, and NACKs with ``error_detail``; both are
counted (``stats``), NACKs logged. Envoy keeps the last assignment it accepted while the picker is away, so a
picker restart changes nothing until the new one publishes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3.address_pb2 import Address, SocketAddress
from envoy.config.endpoint.v3.endpoint_components_pb2 import Endpoint, LbEndpoint, LocalityLbEndpoints
from envoy.config.endpoint.v3.endpoint_pb2 import ClusterLoadAssignment
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest, DiscoveryResponse
from google.protobuf.any_pb2 import Any as AnyMessage
from google.protobuf.wrappers_pb2 import UInt32Value

from inferlb.scorer.weights import MAX_WEIGHT  # Envoy's weights are uint32 >= 1; the picker's span 1..MAX_WEIGHT

__all__ = ["EDS_TYPE", "ControlPlane", "Member", "XdsStats"]

logger = logging.getLogger(__name__)

EDS_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
# Envoy asks for the bootstrap's two server clusters; a stream that asks for more than this many is refused.
MAX_RESOURCE_NAMES = 64


@dataclass(frozen=True, slots=True)
class Member:
    """One endpoint as Envoy's clusters hold it."""

    host: str
    port: int
    weight: int = 1


@dataclass(slots=True)
class XdsStats:
    """Counters (event-loop owned): streams opened, responses sent, ACKs and NACKs received, versions published,
    and when the latest version was published and first ACKed (monotonic seconds; what a weight change costs)."""

    streams: int = 0
    sent: int = 0
    acks: int = 0
    nacks: int = 0
    versions: int = 0
    published_at: float = 0.0
    acked_at: dict[str, float] = field(default_factory=dict)  # version -> first ACK


class ControlPlane(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """State-of-the-world EDS over ADS for the clusters in ``clusters`` (other names get empty assignments)."""

    def __init__(self, clusters: Sequence[str]) -> None:
        self.clusters = tuple(clusters)
        self.stats = XdsStats()
        self.version = 0
        self.members: tuple[Member, ...] = ()
        self._streams: set[_Stream] = set()

    def publish(self, members: Sequence[Member]) -> bool:
        """Make ``members`` every cluster's endpoints; True if that changed anything (then every stream gets it)."""
        members = tuple(members)
        if members == self.members and self.version:
            return False
        self.members = members
        self.version += 1
        self.stats.versions += 1
        self.stats.published_at = time.monotonic()
        for stream in self._streams:
            stream.changed = True
            stream.wake.set()
        return True

    def assignment(self, cluster: str) -> ClusterLoadAssignment:
        """The cluster's endpoints now, in Envoy's message."""
        endpoints = [
            LbEndpoint(
                endpoint=Endpoint(address=Address(socket_address=SocketAddress(address=m.host, port_value=m.port))),
                load_balancing_weight=UInt32Value(value=max(1, min(m.weight, MAX_WEIGHT))),
            )
            for m in (self.members if cluster in self.clusters else ())
        ]
        return ClusterLoadAssignment(cluster_name=cluster, endpoints=[LocalityLbEndpoints(lb_endpoints=endpoints)])

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[DiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[DiscoveryResponse]:
        self.stats.streams += 1
        stream = _Stream()
        self._streams.add(stream)

        async def read() -> None:
            # State of the world: a request supersedes the one before it, so only the latest waits. A client that
            # sends and never reads holds one request here, not all it sent.
            try:
                async for request in request_iterator:
                    stream.request = request
                    stream.wake.set()
            finally:
                stream.ended = True
                stream.wake.set()

        reader = asyncio.get_running_loop().create_task(read())
        subscribed: tuple[str, ...] = ()
        sent_version = ""
        nonce = 0
        try:
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                request, stream.request = stream.request, None
                respond = stream.changed and sent_version != str(self.version)
                stream.changed = False
                if request is not None and request.type_url == EDS_TYPE:  # only EDS is served
                    if len(request.resource_names) > MAX_RESOURCE_NAMES:
                        # Each name costs an assignment at every publish, on the routing loop.
                        await context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"{len(request.resource_names)} clusters asked for; this control plane serves "
                            f"{', '.join(self.clusters)} and answers at most {MAX_RESOURCE_NAMES} names",
                        )
                    names = tuple(dict.fromkeys(request.resource_names))
                    if request.response_nonce:
                        if request.HasField("error_detail"):
                            self.stats.nacks += 1
                            logger.error(
                                "Envoy refused endpoints version %s: %s", sent_version, request.error_detail.message
                            )
                        else:
                            self.stats.acks += 1
                            self.stats.acked_at.setdefault(request.version_info, time.monotonic())
                            if len(self.stats.acked_at) > 64:
                                self.stats.acked_at.pop(next(iter(self.stats.acked_at)))
                    # An answer to an older response is stale (the newer one is on its way); one to the latest needs a
                    # response only if it asks for other clusters (a refused version is not resent).
                    if not request.response_nonce or (request.response_nonce == str(nonce) and names != subscribed):
                        subscribed = names
                        respond = True
                if respond and subscribed:
                    nonce += 1
                    sent_version = str(self.version)
                    resources = []
                    for name in subscribed:
                        message = AnyMessage()
                        message.Pack(self.assignment(name))
                        resources.append(message)
                    self.stats.sent += 1
                    yield DiscoveryResponse(
                        version_info=sent_version, resources=resources, type_url=EDS_TYPE, nonce=str(nonce)
                    )
                if stream.ended and stream.request is None:
                    return
        finally:
            self._streams.discard(stream)
            reader.cancel()


class _Stream:
    """One ADS stream's state between its reader and its handler: the latest request not yet handled, whether a
    new version was published meanwhile, whether Envoy closed its side; ``wake`` tells the handler."""

    __slots__ = ("changed", "ended", "request", "wake")

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.request: DiscoveryRequest | None = None
        self.changed = False
        self.ended = False


def members_of(addresses: Sequence[tuple[str, int]], weights: Mapping[int, int] | None = None) -> list[Member]:
    """Members from (host, port) pairs, with ``weights`` by position (default 1)."""
    return [Member(host, port, (weights or {}).get(i, 1)) for i, (host, port) in enumerate(addresses)]

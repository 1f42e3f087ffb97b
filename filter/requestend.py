"""How the picker learns that a routed request has ended, without holding the request's routing stream open.

A request counts as in flight on its endpoint from the decision until it ends. The picker used to learn the end
from Envoy closing the ext_proc stream, which Envoy keeps open for the whole HTTP request; but then a picker
that exits or restarts breaks that stream, and with fail-closed Envoy resets the request it belongs to, a
streamed answer cut in the middle. So the picker ends the routing stream right after its decision, and Envoy
reports each routed request's end through its gRPC access-log service (``envoy.access_loggers.http_grpc``, to
the same gRPC port): one entry per finished request, batched, carrying Envoy's request id (``x-request-id``),
which the picker read from the request headers at decision time.

`OpenLeases` holds the leases of routed requests until their entry comes; `AccessLogReceiver` is the gRPC
service that takes the entries. An entry can be lost: Envoy drops what it holds when its access-log stream to
the picker breaks, and with replicas an end that reached another picker is lost while Redis is out of reach. A
lease held when that happened, and older than ``max_age_s``, is released and counted; any other only after
`UNBROKEN_AGE_FACTOR` times that (an entry Envoy dropped with its stream up, from an overflowing buffer), since a
long generation (32k tokens at 35 a second is a quarter of an hour) is still running at ``max_age_s``: released
then, it would count as nothing while its server works. So a lost entry costs a bounded error in the counts, not a
permanent one. Entries for requests this picker does not hold (routed before a restart, or repeated) are
counted and change nothing.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

from inferlb.filter.request import client_key
from inferlb.scorer.inflight import Lease

__all__ = [
    "ACCESS_LOG_SERVICE",
    "FAILURE_FLAGS",
    "AccessLogReceiver",
    "LeaseStats",
    "OpenLeases",
    "add_to_server",
    "failed",
]

ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
DEFAULT_MAX_AGE_S = 900.0
UNBROKEN_AGE_FACTOR = 4  # a lease held since no entry could have been lost ages out after this x max_age_s
DEFAULT_CAPACITY = 1 << 18


@dataclass(slots=True)
class LeaseStats:
    """Counters (event-loop owned): leases held, ended by an access-log entry, expired, evicted for room, and
    entries that matched no held lease."""

    held: int = 0
    ended: int = 0
    expired: int = 0
    evicted: int = 0
    unknown_entries: int = 0
    log_streams: int = 0


class OpenLeases:
    """Leases of routed requests, keyed by request id, until the request's end is reported or they age out.

    A request id is Envoy's ``x-request-id``; a client may repeat one, so an id may hold several leases and each
    reported end releases the oldest. At most ``capacity`` leases are held (the oldest is released to make room,
    counted in ``evicted``); `expire` (the picker runs it every second) releases those older than ``max_age_s``
    that were held when an entry may have been lost (`may_have_lost`), and any older than `UNBROKEN_AGE_FACTOR` times
    that.
    Memory is one small entry per lease held, whatever order requests end in (a request that streams for an hour
    holds back nothing behind it); `hold` and `finish` are O(1). One event loop; not thread-safe.
    """

    def __init__(
        self,
        *,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        capacity: int = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not max_age_s > 0 or capacity < 1:
            raise ValueError(f"max_age_s must be > 0 and capacity >= 1; got {max_age_s!r}, {capacity!r}")
        self.max_age_s = max_age_s
        self.capacity = capacity
        self.clock = clock
        self.stats = LeaseStats()
        # serial -> (held at, request id, lease), in the order held: the first entry is the oldest lease.
        self._held: dict[int, tuple[float, str, Lease]] = {}
        # request id -> the serial of its lease, or a list of serials, oldest first, when the id repeats.
        self._by_id: dict[str, int | list[int]] = {}
        self._serial = 0
        self.lost_at = -math.inf  # when an entry may last have been lost (`may_have_lost`), on ``clock``

    def may_have_lost(self) -> None:
        """An access-log entry may have been lost now (a stream from Envoy ended, a peer replica is out of reach):
        the leases held until now age out after ``max_age_s``."""
        self.lost_at = self.clock()

    def __len__(self) -> int:
        """Leases held and not yet released."""
        return len(self._held)

    def hold(self, request_id: str, lease: Lease) -> None:
        """Keep ``lease`` until `finish(request_id)`, or until it is ``max_age_s`` old."""
        now = self.clock()
        while len(self._held) >= self.capacity:
            self._release_oldest()
            self.stats.evicted += 1
        self._serial += 1
        serial = self._serial
        self._held[serial] = (now, request_id, lease)
        known = self._by_id.get(request_id)
        if known is None:
            self._by_id[request_id] = serial
        elif isinstance(known, list):
            known.append(serial)
        else:
            self._by_id[request_id] = [known, serial]
        self.stats.held += 1

    def lease_of(self, request_id: str) -> Lease | None:
        """The oldest lease held for ``request_id`` (the one its next reported end releases), or None."""
        known = self._by_id.get(request_id)
        if known is None:
            return None
        return self._held[known[0] if isinstance(known, list) else known][2]

    def finish(self, request_id: str, *, count_unknown: bool = True) -> bool:
        """The request ``request_id`` ended: release its oldest held lease. False if none was held (counted in
        ``unknown_entries`` unless ``count_unknown`` is False: a peer replica's report of ends it did not hold)."""
        known = self._by_id.get(request_id)
        if known is None:
            self.stats.unknown_entries += count_unknown
            return False
        if isinstance(known, list):
            serial = known.pop(0)
            if len(known) == 1:
                self._by_id[request_id] = known[0]
        else:
            serial = known
            del self._by_id[request_id]
        _, _, lease = self._held.pop(serial)
        lease.release()
        self.stats.ended += 1
        return True

    def expire(self, now: float | None = None) -> int:
        """Release every lease older than ``max_age_s`` that was held when an entry may have been lost, and every
        lease older than `UNBROKEN_AGE_FACTOR` x ``max_age_s``; how many were released."""
        now = self.clock() if now is None else now
        # Leases are in the order held: both kinds are a prefix of them.
        limit = min(now - self.max_age_s, max(self.lost_at, now - UNBROKEN_AGE_FACTOR * self.max_age_s))
        released = 0
        while self._held and next(iter(self._held.values()))[0] <= limit:
            self._release_oldest()
            released += 1
        self.stats.expired += released
        return released

    def release_all(self) -> None:
        """Release every held lease (the picker is stopping)."""
        while self._held:
            self._release_oldest()

    def _release_oldest(self) -> None:
        serial, (_, request_id, lease) = next(iter(self._held.items()))
        del self._held[serial]
        known = self._by_id[request_id]
        if isinstance(known, list):
            known.remove(serial)  # the oldest of its id: the front
            if len(known) == 1:
                self._by_id[request_id] = known[0]
        else:
            del self._by_id[request_id]
        lease.release()


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """Envoy's gRPC access-log service: each HTTP entry ends the held lease of its request id.

    Envoy keeps one stream open per worker and sends entries in batches; the handler does O(1) work per entry
    on the routing event loop, and reads of each entry only its request id (`add_to_server` registers it with a
    parser that skips the rest). ``leases`` is read on every message, so a reload may replace it; while it gives
    None (the service counts requests by their streams instead), entries change nothing. `close` ends every
    open stream (the picker is stopping: Envoy then reconnects to whichever picker listens next), so that these
    long-lived streams do not hold the server's shutdown for its whole grace period.
    """

    def __init__(
        self,
        leases: Callable[[], OpenLeases | None],
        failures: Callable[[], Callable[[str], None] | None] | None = None,
        elsewhere: Callable[[], Callable[[str], None] | None] | None = None,
    ) -> None:
        self._leases = leases
        # Read on every message, like ``leases``: what to tell of each failed request's id (experiments), if anything.
        self._failures = failures
        # Likewise: who takes the ends of requests this picker does not hold (another replica routed them, and
        # Envoy's access-log stream reached this one): the replicas' exchange passes them on.
        self._elsewhere = elsewhere
        self._streams: set[asyncio.Task[object]] = set()
        self._closed = False

    def close(self) -> None:
        self._closed = True
        for task in list(self._streams):
            task.cancel()

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        leases = self._leases()
        if leases is not None:
            leases.stats.log_streams += 1
        # The stream's own task: `close` cancels it. Waiting on each message and on a closing event at once would
        # cost a task and an asyncio.wait per message.
        task = asyncio.current_task()
        if task is not None and not self._closed:
            self._streams.add(task)
        try:
            if not self._closed:
                async for message in request_iterator:
                    leases = self._leases()
                    if leases is None:
                        continue
                    tell = self._failures() if self._failures is not None else None
                    elsewhere = self._elsewhere() if self._elsewhere is not None else None
                    for entry in message.http_logs.log_entry:
                        request_id = client_key(entry.request.request_id)
                        if not leases.finish(request_id) and elsewhere is not None and request_id:
                            elsewhere(request_id)
                        if tell is not None and failed(entry):
                            tell(request_id)
        except asyncio.CancelledError:
            if not self._closed or task is None:
                raise
            task.uncancel()  # cancelled by close(): the stream ends as if Envoy had closed it
        finally:
            if task is not None:
                self._streams.discard(task)
            if not self._closed and (ended := self._leases()) is not None:
                ended.may_have_lost()  # Envoy drops what it had not sent on a stream that ends
        return als_pb2.StreamAccessLogsResponse()


# What makes an entry a failed request, to experiments: a 5xx, or Envoy's flags for an upstream that reset, failed,
# timed out or closed mid-way (`ResponseFlags`). A client that went away is not the server's failure.
FAILURE_FLAGS = (
    "upstream_request_timeout",
    "local_reset",
    "upstream_remote_reset",
    "upstream_connection_failure",
    "upstream_connection_termination",
)


def _request_ids_message() -> type[Message]:
    """A message type that reads a `StreamAccessLogsMessage` as far as its HTTP entries' request ids, response codes
    and the failure flags (`FAILURE_FLAGS`), and skips everything else Envoy sends (addresses, timings, headers
    sizes, metadata: ~450 bytes an entry), which the full type would build objects for. Field numbers come from
    the real descriptors."""
    message = als_pb2.StreamAccessLogsMessage.DESCRIPTOR
    http_logs = message.fields_by_name["http_logs"]
    log_entry = http_logs.message_type.fields_by_name["log_entry"]
    entry = log_entry.message_type
    request, response, common = (entry.fields_by_name[n] for n in ("request", "response", "common_properties"))
    request_id = request.message_type.fields_by_name["request_id"]
    response_code = response.message_type.fields_by_name["response_code"]
    response_flags = common.message_type.fields_by_name["response_flags"]
    flags = response_flags.message_type.fields_by_name
    field = descriptor_pb2.FieldDescriptorProto
    string, uint32, boolean = field.TYPE_STRING, field.TYPE_UINT32, field.TYPE_BOOL
    # message -> its fields: (name, number, repeated, a scalar type or the name of a message type here)
    layout: dict[str, list[tuple[str, int, bool, int | str]]] = {
        "Message": [("http_logs", http_logs.number, False, "Entries")],
        "Entries": [("log_entry", log_entry.number, True, "Entry")],
        "Entry": [
            ("request", request.number, False, "Request"),
            ("response", response.number, False, "Response"),
            ("common_properties", common.number, False, "Common"),
        ],
        "Request": [("request_id", request_id.number, False, string)],
        "Response": [("response_code", response_code.number, False, "Code")],
        "Code": [("value", 1, False, uint32)],  # google.protobuf.UInt32Value
        "Common": [("response_flags", response_flags.number, False, "Flags")],
        "Flags": [(name, flags[name].number, False, boolean) for name in FAILURE_FLAGS],
    }
    package = "inferlb.request_end"
    file = descriptor_pb2.FileDescriptorProto(name="inferlb/request_end.proto", package=package, syntax="proto3")
    for name, members in layout.items():
        added = file.message_type.add(name=name)
        for member, number, repeated, kind in members:
            one = added.field.add(
                name=member, number=number, label=field.LABEL_REPEATED if repeated else field.LABEL_OPTIONAL
            )
            if isinstance(kind, str):
                one.type, one.type_name = field.TYPE_MESSAGE, f".{package}.{kind}"
            else:
                one.type = kind
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.Message"))


def failed(entry: Any) -> bool:
    """Whether an entry (of `_request_ids_message`) is of a failed request: a 5xx, or a failure flag."""
    if entry.response.response_code.value >= 500:
        return True
    flags = entry.common_properties.response_flags
    return any(getattr(flags, name) for name in FAILURE_FLAGS)


def add_to_server(receiver: AccessLogReceiver, server: grpc.aio.Server) -> None:
    """Serve ``receiver`` on ``server`` as Envoy's ``AccessLogService``, its messages read as far as request ids and
    failures only."""
    handler = grpc.stream_unary_rpc_method_handler(
        receiver.StreamAccessLogs,
        request_deserializer=_request_ids_message().FromString,
        response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(ACCESS_LOG_SERVICE, {"StreamAccessLogs": handler}),)
    )

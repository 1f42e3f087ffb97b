"""Latency measured from the response stream, for servers that send no spans (``otel.latency_source: stream``).

Envoy runs a second ext_proc filter, ``inferlb.observe``, in observability mode: it mirrors the request's headers
(after the picker has set ``x-gateway-destination-endpoint``), the response's headers and the response body's
chunks to the picker without waiting for answers, so it adds nothing to the request's path. Per stream:

1. ``request_headers``: the clock starts; the destination header names the endpoint (an address outside the
   pool, or none, ends the stream: nothing to measure).
2. ``response_headers``: anything but a 200 ends the stream (errors are not latency). ``text/event-stream``
   marks a streamed response. Their ``envoy.lb`` metadata names the endpoint that served (the protocol's
   served endpoint; inferlb's bootstrap sets it from Envoy's upstream address): when a retry went to the next
   endpoint listed, the measurement is that endpoint's, and the request's in-flight count moves there.
3. The first non-empty body chunk: for a streamed response the first token is in it (TTFT); any other response
   is complete by then, up to the transfer of its own body (E2E). The measurement is recorded and the stream
   ends, so Envoy sends nothing more: one extra stream of three messages per request, whatever its length.

The clock starts when the mirrored request headers reach the picker, just after its routing reply, so the figure
includes the upstream connection, the server's queue and the prefill: what a client waits for, less the
client's own hop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass
from typing import Any

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from inferlb.filter.request import client_key, header_text, served_endpoint

__all__ = ["OBSERVED_HEADERS", "ObserveStats", "RequestOutcome", "time_response"]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
# What Envoy mirrors to the picker on the observing streams, and nothing else.
# x-request-id ties the measurement to its request, for the experiment arm the request was routed in.
OBSERVED_HEADERS = (DESTINATION_HEADER, ":status", "content-type", "x-request-id")

# What an experiment is told of one observed response: (request id, TTFT s, E2E s, failed).
RequestOutcome = Callable[[str, float | None, float | None, bool], None]


@dataclass(slots=True)
class ObserveStats:
    """Outcomes of the observing streams (event-loop owned)."""

    ttft: int = 0  # streamed responses timed to their first token
    e2e: int = 0  # other responses timed to their body
    not_ok: int = 0  # responses with a status other than 200: not timed
    unknown_endpoint: int = 0  # no destination header, or an address outside the pool
    unfinished: int = 0  # the stream ended before a body chunk came (client gone, empty body)
    served_elsewhere: int = 0  # timed for the endpoint the data plane reports served, not the one picked first


async def time_response(
    first: ProcessingRequest,
    messages: AsyncIterator[ProcessingRequest],
    endpoints: Collection[str],
    observe: Callable[[str, float | None, float | None], None],
    stats: ObserveStats,
    clock: Callable[[], float] = time.monotonic,
    outcome: RequestOutcome | None = None,
    served: Callable[[str, str], None] | None = None,
    body_seen: Callable[[bytes, str], None] | None = None,
) -> None:
    """Read one observing stream, starting with its ``first`` message, until there is a measurement to give
    ``observe(address, ttft_s, e2e_s)`` (``address`` one of ``endpoints``) or nothing to measure; then return,
    which ends the stream. ``outcome``, if given, is told of the request (by its ``x-request-id``): its
    measurement, or that it failed (a 5xx). ``served``, if given, is told of the served endpoint the data plane
    reports on the response headers: (request id, address). ``body_seen``, if given, is given the first body chunk
    of a 200 response and the address that served it (`filter.storedresponses`)."""
    started = clock()
    if first.WhichOneof("request") != "request_headers":
        stats.unknown_endpoint += 1
        return
    # The picker's first choice (with Override Host, the header lists the next ones after it).
    endpoint = (_header(first.request_headers, DESTINATION_HEADER) or "").split(",", 1)[0]
    if endpoint not in endpoints:
        stats.unknown_endpoint += 1
        return
    request_id = client_key(_header(first.request_headers, "x-request-id") or "")
    streamed = False
    async for message in messages:
        kind = message.WhichOneof("request")
        if kind == "response_headers":
            # The endpoint that served: the data plane reports it (the protocol's served endpoint), and when a
            # retry went to the next one listed, the measurement is that endpoint's.
            if message.HasField("metadata_context"):
                address = served_endpoint(message.metadata_context)
                if address is not None:
                    if served is not None and request_id:
                        served(request_id, address)
                    if address != endpoint and address in endpoints:
                        endpoint = address
                        stats.served_elsewhere += 1
            headers = message.response_headers
            status = _header(headers, ":status")
            if status != "200":
                stats.not_ok += 1
                if outcome is not None and request_id and (status or "").startswith("5"):
                    outcome(request_id, None, None, True)
                return
            streamed = (_header(headers, "content-type") or "").lower().startswith("text/event-stream")
        elif kind == "response_body":
            if not message.response_body.body:
                if message.response_body.end_of_stream:
                    break
                continue
            elapsed = clock() - started
            ttft, e2e = (elapsed, None) if streamed else (None, elapsed)
            if streamed:
                stats.ttft += 1
            else:
                stats.e2e += 1
            observe(endpoint, ttft, e2e)
            if body_seen is not None:
                body_seen(message.response_body.body, endpoint)
            if outcome is not None and request_id:
                outcome(request_id, ttft, e2e, False)
            return
    stats.unfinished += 1


def _header(headers: Any, name: str) -> str | None:
    for header in headers.headers.headers:
        if header.key == name:
            return header_text(header)
    return None

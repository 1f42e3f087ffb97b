"""Latency measured from the response stream, for servers that send no spans (``otel.latency_source: stream``).

Envoy runs a second ext_proc filter, ``inferlb.observe``, in observability mode: it mirrors the request's headers
(after the picker has set ``x-gateway-destination-endpoint``), the response's headers and the response body's
chunks to the picker without waiting for answers, so it adds nothing to the request's path. Per stream:

1. ``request_headers``: the clock starts; the destination header names the endpoint (an address outside the
   pool, or none, ends the stream: nothing to measure).
2. ``response_headers``: anything but a 200 ends the stream (errors are not latency). ``text/event-stream``
   marks a streamed response.
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

from inferlb.filter.request import header_text

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


async def time_response(
    first: ProcessingRequest,
    messages: AsyncIterator[ProcessingRequest],
    endpoints: Collection[str],
    observe: Callable[[str, float | None, float | None], None],
    stats: ObserveStats,
    clock: Callable[[], float] = time.monotonic,
    outcome: RequestOutcome | None = None,
) -> None:
    """Read one observing stream, starting with its ``first`` message, until there is a measurement to give
    ``observe(address, ttft_s, e2e_s)`` (``address`` one of ``endpoints``) or nothing to measure; then return,
    which ends the stream. ``outcome``, if given, is told of the request (by its ``x-request-id``): its
    measurement, or that it failed (a 5xx)."""
    started = clock()
    if first.WhichOneof("request") != "request_headers":
        stats.unknown_endpoint += 1
        return
    endpoint = _header(first.request_headers, DESTINATION_HEADER) or ""
    if endpoint not in endpoints:
        stats.unknown_endpoint += 1
        return
    request_id = _header(first.request_headers, "x-request-id") if outcome is not None else None
    streamed = False
    async for message in messages:
        kind = message.WhichOneof("request")
        if kind == "response_headers":
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
            if outcome is not None and request_id:
                outcome(request_id, ttft, e2e, False)
            return
    stats.unfinished += 1


def _header(headers: Any, name: str) -> str | None:
    for header in headers.headers.headers:
        if header.key == name:
            return header_text(header)
    return None

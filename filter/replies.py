"""Envoy ext_proc replies: route to an endpoint, continue unchanged, or answer the client directly.

Route replies depend only on the endpoint, so they are built once per endpoint and reused: the request
path serialises a ready message instead of assembling protobufs.
"""

from __future__ import annotations

import functools
import json

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from inferlb.filter.errors import RequestError
from inferlb.scorer.pool import Pool

# The Gateway API Inference Extension's names: any gateway built for its Endpoint Picker reads these.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
ERROR_METADATA_KEY = "inferlb_error"

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

CONTINUE: dict[str, ProcessingResponse] = {
    "request_headers": ProcessingResponse(request_headers=HeadersResponse()),
    "request_body": ProcessingResponse(request_body=BodyResponse()),
    "request_trailers": ProcessingResponse(request_trailers=TrailersResponse()),
    "response_headers": ProcessingResponse(response_headers=HeadersResponse()),
    "response_body": ProcessingResponse(response_body=BodyResponse()),
    "response_trailers": ProcessingResponse(response_trailers=TrailersResponse()),
}
"""An empty reply for each phase: let the request or response through unchanged."""


REPLIES_KEPT = 1 << 14  # endpoints' route replies kept across pools (a few hundred bytes each)


def _route_common(address: str) -> CommonResponse:
    header = HeaderValueOption(
        header=HeaderValue(key=DESTINATION_HEADER, raw_value=address.encode()), append_action=_OVERWRITE
    )
    return CommonResponse(header_mutation=HeaderMutation(set_headers=[header]), clear_route_cache=True)


def _route_metadata(address: str) -> Struct:
    metadata = Struct()
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: address}})
    return metadata


class RouteReplies:
    """The replies that send a request to each endpoint of a pool, at the headers or the body phase.

    Each sets the destination header (which Envoy's ORIGINAL_DST cluster reads), the same value as dynamic
    metadata under ``envoy.lb``, and clears the route cache so Envoy matches the route again with the header.
    Immutable after construction; share freely.
    """

    def __init__(self, pool: Pool) -> None:
        pairs = [_replies_to(e.address) for e in pool]
        self.headers: tuple[ProcessingResponse, ...] = tuple(headers for headers, _ in pairs)
        self.body: tuple[ProcessingResponse, ...] = tuple(body for _, body in pairs)


@functools.lru_cache(maxsize=REPLIES_KEPT)
def _replies_to(address: str) -> tuple[ProcessingResponse, ProcessingResponse]:
    """The route replies to ``address``, at the headers and at the body phase. Kept: a pool rebuilt at each change of
    membership builds most of them again (2,000 endpoints: 92 ms of the event loop a change, most of it these)."""
    return (
        ProcessingResponse(
            request_headers=HeadersResponse(response=_route_common(address)), dynamic_metadata=_route_metadata(address)
        ),
        ProcessingResponse(
            request_body=BodyResponse(response=_route_common(address)), dynamic_metadata=_route_metadata(address)
        ),
    )


def listed_reply(addresses: str, body_phase: bool) -> ProcessingResponse:
    """A route reply naming several endpoints, best first (``"ip:port,ip:port"``, as the Endpoint Picker protocol
    allows): Envoy's Override Host cluster tries them in order. Built per request (the list depends on it)."""
    common = _route_common(addresses)
    metadata = _route_metadata(addresses)
    if body_phase:
        return ProcessingResponse(request_body=BodyResponse(response=common), dynamic_metadata=metadata)
    return ProcessingResponse(request_headers=HeadersResponse(response=common), dynamic_metadata=metadata)


def with_header(reply: ProcessingResponse, key: str, value: str) -> ProcessingResponse:
    """A copy of a prebuilt route reply that also sets request header ``key`` (e.g. a per-request traceparent)."""
    out = ProcessingResponse()
    out.CopyFrom(reply)
    phase = out.WhichOneof("response")
    mutation = getattr(out, phase).response.header_mutation
    mutation.set_headers.append(
        HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode("ascii")), append_action=_OVERWRITE)
    )
    return out


STREAMED_CHUNK_BYTES = 64 << 10  # Envoy's advice for a streamed body response's chunk


def streamed_body(body: bytes, *, trailers: bool) -> list[ProcessingResponse]:
    """The replies that give Envoy back a request body the picker took in FULL_DUPLEX_STREAMED mode (which
    forwards only what comes back): its bytes in chunks of at most ``STREAMED_CHUNK_BYTES``, the last one ending
    the stream, or, with ``trailers`` (they ended it), followed by the trailers' reply."""
    pieces = [body[i : i + STREAMED_CHUNK_BYTES] for i in range(0, len(body), STREAMED_CHUNK_BYTES)] or [b""]
    replies = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1 and not trailers
        mutation = BodyMutation(streamed_response=StreamedBodyResponse(body=piece, end_of_stream=last))
        replies.append(ProcessingResponse(request_body=BodyResponse(response=CommonResponse(body_mutation=mutation))))
    if trailers:
        replies.append(CONTINUE["request_trailers"])
    return replies


# With several destinations (Envoy's Override Host): the retries Envoy takes for a request whose list is shorter than
# the bootstrap's retries (the ext_proc filter lets the picker set it: mutation_rules.allow_envoy).
RETRIES_HEADER = "x-envoy-max-retries"
SCORES_KEY = "x-inferlb-scores"  # config debug_scores: the candidates' scores, in envoy.lb metadata and a header
SCORES_LISTED = 8  # the best this many


def with_scores(reply: ProcessingResponse, scores: str) -> ProcessingResponse:
    """A copy of a route reply whose ``envoy.lb`` metadata also holds ``scores`` (Envoy puts it in a response
    header: config ``debug_scores``)."""
    out = ProcessingResponse()
    out.CopyFrom(reply)
    out.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields[SCORES_KEY].string_value = scores
    return out


def with_body(reply: ProcessingResponse, body: bytes) -> ProcessingResponse:
    """A copy of a prebuilt body-phase route reply that also replaces the request body Envoy forwards with ``body``,
    and sets its content-length: with headers sent and the body buffered, Envoy leaves that to the processor (the
    upstream would otherwise read the old length)."""
    out = ProcessingResponse()
    out.CopyFrom(reply)
    response = out.request_body.response
    response.body_mutation.body = body
    response.header_mutation.set_headers.append(
        HeaderValueOption(
            header=HeaderValue(key="content-length", raw_value=str(len(body)).encode()), append_action=_OVERWRITE
        )
    )
    return out


_JSON_CONTENT = HeaderMutation(
    set_headers=[
        HeaderValueOption(
            header=HeaderValue(key="content-type", raw_value=b"application/json"), append_action=_OVERWRITE
        )
    ]
)


def _error_metadata(error_type: str) -> Struct:
    metadata = Struct()
    metadata.update({METADATA_NAMESPACE: {ERROR_METADATA_KEY: error_type}})
    return metadata


def error_reply(error: RequestError) -> ProcessingResponse:
    """An ImmediateResponse: Envoy answers the client with ``error.status`` and a JSON body saying what was wrong.

    The body follows OpenAI's error shape, which OpenAI-compatible clients already know how to show. The
    reply also sets dynamic metadata ``envoy.lb/inferlb_error`` (the error type), which our Envoy bootstrap
    uses to leave this body alone while it rewrites Envoy's own plain-text errors as JSON.
    """
    details = getattr(error, "details", None) or {}
    body = json.dumps({"error": {"message": error.message, "type": error.type, "code": error.status, **details}})
    headers = _JSON_CONTENT
    retry_after = getattr(error, "retry_after_s", None)
    if retry_after is not None:
        headers = HeaderMutation(
            set_headers=[
                *_JSON_CONTENT.set_headers,
                HeaderValueOption(
                    header=HeaderValue(key="retry-after", raw_value=str(retry_after).encode()),
                    append_action=_OVERWRITE,
                ),
            ]
        )
    return ProcessingResponse(
        dynamic_metadata=_error_metadata(error.type),
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=error.status),
            headers=headers,
            body=body.encode(),
            details=f"inferlb_{error.type}",
        ),
    )

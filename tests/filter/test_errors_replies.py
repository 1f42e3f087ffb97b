"""Tests for filter/errors.py and filter/replies.py: routing errors become HTTP errors, replies Envoy reads."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import CommonResponse, ProcessingResponse
from google.protobuf.json_format import MessageToDict

from inferlb.filter.errors import (
    MAX_MESSAGE_CHARS,
    MalformedRequestError,
    ModelNotFoundError,
    NoEndpointAvailableError,
    OverloadedError,
    PayloadTooLargeError,
    RequestError,
    from_routing_error,
)
from inferlb.filter.replies import (
    CONTINUE,
    DESTINATION_HEADER,
    ERROR_METADATA_KEY,
    METADATA_NAMESPACE,
    RouteReplies,
    error_reply,
)
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.errors import NoEndpointError, RoutingError, UnknownModelError
from inferlb.scorer.pool import Pool


def test_names_envoy_and_the_gateway_api_read() -> None:
    assert DESTINATION_HEADER == "x-gateway-destination-endpoint"
    assert METADATA_NAMESPACE == "envoy.lb"
    assert ERROR_METADATA_KEY == "inferlb_error"


@pytest.mark.parametrize(
    ("error", "kind", "status", "error_type", "message"),
    [
        pytest.param(
            UnknownModelError("gpt-4", frozenset({"a", "b"})),
            ModelNotFoundError,
            404,
            "model_not_found",
            "model 'gpt-4' is not served by this pool (served: a, b)",
            id="unknown-model",
        ),
        pytest.param(
            UnknownModelError("x" * 3_000_000, frozenset({"a"})),
            ModelNotFoundError,
            404,
            "model_not_found",
            f"model {'x' * 200!r}… (3000000 characters) is not served by this pool (served: a)",
            id="unknown-model-name-is-not-echoed-whole",
        ),
        pytest.param(
            NoEndpointError("no endpoint left after filter 'model'"),
            NoEndpointAvailableError,
            503,
            "no_endpoint_available",
            "no endpoint available: no endpoint left after filter 'model'",
            id="no-endpoint",
        ),
        pytest.param(
            RoutingError("something else"),
            NoEndpointAvailableError,
            503,
            "no_endpoint_available",
            "request cannot be routed: something else",
            id="other-routing-error",
        ),
    ],
)
def test_from_routing_error(
    error: RoutingError, kind: type[RequestError], status: int, error_type: str, message: str
) -> None:
    translated = from_routing_error(error)
    assert type(translated) is kind
    assert (translated.status, translated.type, translated.message) == (status, error_type, message)


@pytest.mark.parametrize(
    ("error", "status", "error_type"),
    [
        pytest.param(
            MalformedRequestError("field 'model' must be a non-empty string"), 400, "invalid_request_error", id="400"
        ),
        pytest.param(
            PayloadTooLargeError("request body is 9 bytes; the limit is 8 bytes"), 413, "payload_too_large", id="413"
        ),
        pytest.param(ModelNotFoundError("model 'x' is not served"), 404, "model_not_found", id="404"),
        pytest.param(
            NoEndpointAvailableError('no endpoint available: "quoted" \u00e9'),
            503,
            "no_endpoint_available",
            id="503-escaped",
        ),
    ],
)
def test_error_reply(error: RequestError, status: int, error_type: str) -> None:
    reply = error_reply(error)
    assert reply.WhichOneof("response") == "immediate_response"
    immediate = reply.immediate_response
    assert immediate.status.code == status
    assert immediate.details == f"inferlb_{error_type}"

    headers = immediate.headers.set_headers
    assert len(headers) == 1
    assert headers[0].header.key == "content-type"
    assert headers[0].header.raw_value == b"application/json"
    assert headers[0].append_action == HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

    assert json.loads(immediate.body) == {"error": {"message": error.message, "type": error_type, "code": status}}
    assert MessageToDict(reply.dynamic_metadata) == {METADATA_NAMESPACE: {ERROR_METADATA_KEY: error_type}}


def test_error_reply_survives_the_wire() -> None:
    reply = error_reply(ModelNotFoundError("model 'x' is not served"))
    again = ProcessingResponse.FromString(reply.SerializeToString())
    assert again == reply


POOLS = [
    pytest.param(("10.0.0.1:8000",), id="one"),
    pytest.param(("10.0.0.1:8000", "10.0.0.2:8001", "[fd00::7]:9000"), id="mixed"),
    pytest.param(("[::1]:8000",), id="ipv6-loopback"),
]


def _check_common(common: CommonResponse, address: str) -> None:
    assert common.clear_route_cache is True
    headers = common.header_mutation.set_headers
    assert len(headers) == 1
    assert headers[0].header.key == DESTINATION_HEADER
    assert headers[0].header.raw_value == address.encode()
    assert headers[0].header.value == ""
    assert headers[0].append_action == HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert list(common.header_mutation.remove_headers) == []


@pytest.mark.parametrize("addresses", POOLS)
def test_route_replies_for_every_endpoint(addresses: tuple[str, ...]) -> None:
    pool = Pool([EndpointConfig(address=a, models=None) for a in addresses])
    replies = RouteReplies(pool)
    assert len(replies.headers) == len(replies.body) == len(pool)
    for endpoint in pool:
        address = endpoint.address
        by_headers, by_body = replies.headers[endpoint.index], replies.body[endpoint.index]
        assert by_headers.WhichOneof("response") == "request_headers"
        assert by_body.WhichOneof("response") == "request_body"
        _check_common(by_headers.request_headers.response, address)
        _check_common(by_body.request_body.response, address)
        for reply in (by_headers, by_body):
            assert MessageToDict(reply.dynamic_metadata) == {METADATA_NAMESPACE: {DESTINATION_HEADER: address}}
            assert ProcessingResponse.FromString(reply.SerializeToString()) == reply


def test_route_replies_differ_per_endpoint() -> None:
    pool = Pool([EndpointConfig(address=f"10.0.0.{i}:8000", models=None) for i in range(1, 6)])
    replies = RouteReplies(pool)
    serialized = {reply.SerializeToString() for reply in replies.headers}
    assert len(serialized) == 5
    assert serialized.isdisjoint(reply.SerializeToString() for reply in replies.body)


def test_a_pool_built_again_reuses_the_replies_of_the_endpoints_it_keeps() -> None:
    # A discovery change rebuilds the pool: building every endpoint's replies again held the event loop 92 ms of a
    # change at 2,000 endpoints. An endpoint that stays keeps its replies (immutable, shared).
    before = RouteReplies(Pool([EndpointConfig(address=f"10.0.0.{i}:8000") for i in range(1, 5)]))
    after = RouteReplies(Pool([EndpointConfig(address=f"10.0.0.{i}:8000") for i in (2, 3, 4, 9)]))
    assert all(after.headers[i] is before.headers[i + 1] for i in range(3))
    assert all(after.body[i] is before.body[i + 1] for i in range(3))
    assert after.headers[3] is not before.headers[0] and after.headers[3] != before.headers[0]


@pytest.mark.parametrize(
    ("phase", "field"),
    [
        pytest.param("request_headers", "request_headers", id="request-headers"),
        pytest.param("request_body", "request_body", id="request-body"),
        pytest.param("request_trailers", "request_trailers", id="request-trailers"),
        pytest.param("response_headers", "response_headers", id="response-headers"),
        pytest.param("response_body", "response_body", id="response-body"),
        pytest.param("response_trailers", "response_trailers", id="response-trailers"),
    ],
)
def test_continue_is_an_empty_reply_for_each_phase(phase: str, field: str) -> None:
    reply = CONTINUE[phase]
    assert reply.WhichOneof("response") == field
    assert getattr(reply, field).ByteSize() == 0
    assert not reply.HasField("dynamic_metadata")
    assert reply.ByteSize() == 2  # just the empty oneof member: tag and zero length


def test_continue_covers_exactly_the_six_phases() -> None:
    assert set(CONTINUE) == {
        "request_headers",
        "request_body",
        "request_trailers",
        "response_headers",
        "response_body",
        "response_trailers",
    }


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(MalformedRequestError("x" * 5_000_000), id="400"),
        pytest.param(ModelNotFoundError("model " + "x" * 5_000_000), id="404"),
        pytest.param(OverloadedError(f"every endpoint that serves {'x' * 5_000_000!r} is saturated", 3), id="429"),
    ],
)
def test_request_error_messages_are_bounded(error: RequestError) -> None:
    assert len(error.message) == MAX_MESSAGE_CHARS + 1
    assert error.message.endswith("…")
    assert str(error) == error.message
    assert len(error_reply(error).immediate_response.body) < MAX_MESSAGE_CHARS + 200

"""Tests for otel/tracing.py: what `create_tracer_provider` refuses, and the OTLP modules it needs. Spans exported
through it to real gRPC and HTTP collectors are checked with the emulator's spans in tests/sim/test_spans.py."""

from __future__ import annotations

from typing import Any

import pytest

from inferlb.otel.tracing import OTLP_PROTOS_HINT, PROTOCOLS, create_tracer_provider


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"protocol": "http/json"}, "'grpc', 'http/protobuf'", id="protocol"),
        pytest.param({"server_address": "vllm-0:8000"}, "server_address", id="hostname-address"),
        pytest.param({"resource_attributes": {"service.name": "x"}}, "service_name=", id="clashing-resource"),
        pytest.param({"service_name": ""}, "service_name", id="empty-service"),
        pytest.param({"export_timeout_s": 0}, "export_timeout_s", id="timeout"),
    ],
)
def test_bad_configuration_is_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        create_tracer_provider("127.0.0.1:4317", **{"service_name": "inferlb", **kwargs})


@pytest.mark.parametrize(
    ("endpoint", "protocol"),
    [
        pytest.param("", "grpc", id="grpc-empty"),
        pytest.param("127.0.0.1", "grpc", id="grpc-no-port"),
        pytest.param("ftp://127.0.0.1:4317", "grpc", id="grpc-scheme"),
        pytest.param("http://127.0.0.1:4317/v1/traces", "grpc", id="grpc-path"),
        pytest.param("127.0.0.1:notaport", "http/protobuf", id="http-port"),
        pytest.param("grpc://127.0.0.1:4318", "http/protobuf", id="http-scheme"),
    ],
)
def test_bad_endpoint_is_rejected(endpoint: str, protocol: str) -> None:
    with pytest.raises(ValueError, match="endpoint"):
        create_tracer_provider(endpoint, service_name="inferlb", protocol=protocol)


def test_protocols_are_the_otlp_names() -> None:
    assert PROTOCOLS == ("grpc", "http/protobuf")


def test_the_installed_otlp_protos_are_opentelemetry_protos_own() -> None:
    # xds-protos ships an older copy of these modules; when it is installed last the exporter cannot load.
    from opentelemetry.proto.common.v1 import common_pb2

    assert hasattr(common_pb2, "InstrumentationScope"), OTLP_PROTOS_HINT

"""The picker's inferlb.route span: the decision's attributes, the client's trace continued, and the server's span
made a child of it through the injected traceparent."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inferlb.filter.server import ExtProcService, PickerServer
from inferlb.otel.receiver import TraceJoin
from inferlb.otel.routespans import ROUTE_SPAN, RouteSpans
from inferlb.scorer.config import parse_config
from inferlb.scorer.errors import ConfigError

from ..filter.test_server import (
    MODEL,
    destination,
    make_engine,
    route_buffered,
)

INCOMING = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
async def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    join = TraceJoin()
    service = ExtProcService(make_engine(), max_body_bytes=4096, trace_join=join, route_spans=RouteSpans(provider))
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    yield server, exporter, join
    await server.stop(0)


async def send(server, body, traceparent=None):
    return await route_buffered(server, body, {"traceparent": traceparent})


def injected(reply) -> str:
    common = getattr(reply, reply.WhichOneof("response")).response
    return next(
        h.header.raw_value.decode() for h in common.header_mutation.set_headers if h.header.key == "traceparent"
    )


async def test_a_routed_request_gets_a_span_that_parents_the_servers(traced):
    server, exporter, join = traced
    reply = await send(server, {"model": MODEL, "prompt": "x" * 400}, traceparent=INCOMING)
    (span,) = exporter.get_finished_spans()
    assert span.name == ROUTE_SPAN
    context = span.get_span_context()
    assert format(context.trace_id, "032x") == INCOMING.split("-")[1]  # the client's trace, continued
    assert format(span.parent.span_id, "016x") == INCOMING.split("-")[2]
    assert injected(reply) == f"00-{context.trace_id:032x}-{context.span_id:016x}-01"  # the server's parent
    attributes = dict(span.attributes)
    assert attributes["inferlb.outcome"] == "routed"
    assert attributes["inferlb.endpoint"] == destination(reply)
    assert attributes["inferlb.profile"] == "least-request"
    assert attributes["inferlb.score.in-flight"] == 1.0
    assert attributes["inferlb.prompt_tokens"] == 100 and attributes["gen_ai.request.model"] == MODEL
    assert join.get(context.trace_id.to_bytes(16, "big")) is not None


async def test_a_refused_request_gets_an_error_span(traced):
    server, exporter, _ = traced
    reply = await send(server, {"model": "no-such-model", "prompt": "x"})
    assert reply.immediate_response.status.code == 404
    (span,) = exporter.get_finished_spans()
    attributes = dict(span.attributes)
    assert attributes["inferlb.outcome"] == "refused" and attributes["http.response.status_code"] == 404
    assert not span.status.is_ok


@pytest.mark.parametrize(
    ("otel", "message"),
    [
        pytest.param({"exporter": "jaeger"}, "otel.exporter must be", id="exporter"),
        pytest.param({"exporter": "otlp-grpc"}, "otel.export_endpoint is required", id="endpoint"),
        pytest.param({"receiver": "127.0.0.1:9002"}, "must differ from listen", id="receiver-port"),
        pytest.param({"latency_source": "envoy"}, "otel.latency_source must be spans or stream", id="source"),
    ],
)
def test_otel_config_errors(otel, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"otel": otel, "pool": {"endpoints": [{"address": "10.0.0.1:80"}]}})


def test_experiment_arms_and_weight_changes_reach_the_spans() -> None:
    import numpy as np

    from inferlb.otel.routespans import EXPERIMENT_SPAN, WEIGHT_CHANGE_EVENT
    from inferlb.scorer.engine import Engine
    from inferlb.scorer.experiments import ArmSpec, Experiments, ExperimentSpec
    from inferlb.scorer.features import RequestFeatures
    from inferlb.scorer.pool import Pool
    from inferlb.scorer.presets import build_profile
    from inferlb.scorer.router import Router

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = RouteSpans(provider)
    config = parse_config({"pool": {"endpoints": [{"address": "10.0.0.1:8000"}, {"address": "10.0.0.2:8000"}]}})
    engine = Engine(Pool(config.endpoints), build_profile("default", np.random.default_rng(0), size=2))
    spec = ExperimentSpec("ab", (ArmSpec("control", "round-robin", 0.5), ArmSpec("treatment", "default", 0.5)))
    experiments = Experiments.over(engine, [spec], config.profile_spec, np.random.default_rng(0))
    experiments.listeners.append(spans.weight_changed)
    router = Router(engine, experiments=experiments)
    request = router.admit(RequestFeatures(model="m", request_id="r1")).request
    routed = router.route(request)
    spans.routed(request, routed.decision, 0)
    experiments.running["ab"].control("weights", {"control": 0.9, "treatment": 0.1})
    route, change = exporter.get_finished_spans()
    assert route.attributes["inferlb.experiment"] == "ab"
    assert route.attributes["inferlb.arm"] == routed.arm.name  # type: ignore[union-attr]
    assert change.name == EXPERIMENT_SPAN
    (event,) = change.events
    assert event.name == WEIGHT_CHANGE_EVENT
    assert dict(event.attributes) == {
        "inferlb.experiment": "ab",
        "inferlb.change.kind": "set",
        "inferlb.change.reason": "set by the operator",
        "inferlb.weight.control": 0.9,
        "inferlb.weight.treatment": 0.1,
    }

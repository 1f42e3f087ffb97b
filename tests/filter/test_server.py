"""The ext_proc stream state machine, driven over real gRPC by a client that speaks as Envoy does."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferlb.filter.replies import DESTINATION_HEADER
from inferlb.filter.request import apply_body
from inferlb.filter.server import GRPC_ENVELOPE_BYTES, HEALTH_SERVICES, ExtProcService, PickerServer
from inferlb.scorer.config import parse_config
from inferlb.scorer.engine import Engine, Profile
from inferlb.scorer.experiments import ArmSpec, Experiments, ExperimentSpec
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.kvindex import KVBlockIndex
from inferlb.scorer.plugins import MaxScorePicker, ModelFilter
from inferlb.scorer.pool import Pool
from inferlb.scorer.prefix import PrefixAffinityScorer
from inferlb.scorer.presets import build_profile
from inferlb.scorer.tokenizer import CacheKeyer, cache_keys, chat_text, piece_ids

from ..conftest import until

ENDPOINTS = ["127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:9103"]
MODEL = "m"


def make_engine(profile: Profile | None = None) -> Engine:
    config = parse_config({"pool": {"endpoints": [{"address": a, "models": [MODEL]} for a in ENDPOINTS]}})
    return Engine(Pool(config.endpoints), profile or build_profile("least-request", np.random.default_rng(7)))


@pytest.fixture
async def picker() -> AsyncIterator[PickerServer]:
    server = PickerServer(ExtProcService(make_engine(), max_body_bytes=4096), "127.0.0.1:0")
    await server.start()
    yield server
    await server.stop(0)


def headers_message(
    path: str = "/v1/completions", *, body_mode: int | None = None, eos: bool = False
) -> ProcessingRequest:
    pairs = [(":path", path), (":method", "POST"), ("x-request-id", "rid-1")]
    message = ProcessingRequest(
        request_headers=HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
            end_of_stream=eos,
        )
    )
    if body_mode is not None:
        message.protocol_config.CopyFrom(ProtocolConfiguration(request_body_mode=body_mode))  # type: ignore[arg-type]
    return message


def body_message(body: bytes | dict[str, Any], *, eos: bool = True) -> ProcessingRequest:
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    return ProcessingRequest(request_body=HttpBody(body=raw, end_of_stream=eos))


class FakeEnvoy:
    """One ext_proc stream, driven message by message like Envoy drives it."""

    def __init__(self, picker: PickerServer) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{picker.port}")
        self.call = external_processor_pb2_grpc.ExternalProcessorStub(self.channel).Process()

    async def send(self, message: ProcessingRequest) -> ProcessingResponse:
        await self.call.write(message)
        reply = await asyncio.wait_for(self.call.read(), 5)
        assert isinstance(reply, ProcessingResponse), f"stream ended: {reply!r}"
        return reply

    async def close(self) -> None:
        await self.call.done_writing()
        await asyncio.wait_for(self.call.read(), 5)  # EOF once the server finishes the stream
        await self.channel.close()


async def route_buffered(
    picker: PickerServer, body: dict[str, Any], headers: dict[str, str | None]
) -> ProcessingResponse:
    """One request the way Envoy sends a buffered-body route: headers (plus ``headers``; None values are left
    out), then the JSON body; returns the picker's reply to the body."""
    envoy = FakeEnvoy(picker)
    try:
        message = headers_message(body_mode=ProcessingMode.BUFFERED)
        for key, value in headers.items():
            if value is not None:
                header = message.request_headers.headers.headers.add()
                header.key, header.raw_value = key, value.encode()
        await envoy.send(message)
        return await envoy.send(body_message(body))
    finally:
        await envoy.close()


def destination(reply: ProcessingResponse) -> str:
    phase = reply.WhichOneof("response")
    common = getattr(reply, phase).response
    values = [
        h.header.raw_value.decode() for h in common.header_mutation.set_headers if h.header.key == DESTINATION_HEADER
    ]
    assert len(values) == 1 and common.clear_route_cache
    return values[0]


def immediate(reply: ProcessingResponse) -> tuple[int, dict[str, Any]]:
    assert reply.WhichOneof("response") == "immediate_response"
    return int(reply.immediate_response.status.code), json.loads(reply.immediate_response.body)


async def test_headers_only_request_is_routed_at_the_headers_phase(picker: PickerServer) -> None:
    envoy = FakeEnvoy(picker)
    reply = await envoy.send(headers_message("/v1/embeddings", eos=True))
    assert reply.WhichOneof("response") == "request_headers"
    address = destination(reply)
    assert address in ENDPOINTS
    assert reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value == address
    inflight = picker.service.engine.inflight
    assert inflight.requests[ENDPOINTS.index(address)] == 1
    await envoy.close()
    await until(lambda: inflight.total() == 0)


@pytest.mark.parametrize(
    "mode", [ProcessingMode.BUFFERED, ProcessingMode.BUFFERED_PARTIAL], ids=["buffered", "partial"]
)
async def test_body_route_waits_for_the_body_then_routes(picker: PickerServer, mode: int) -> None:
    envoy = FakeEnvoy(picker)
    first = await envoy.send(headers_message(body_mode=mode))
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.HasField("response"), "the headers reply must not route before the body"
    reply = await envoy.send(body_message({"model": MODEL, "prompt": "x" * 400, "max_tokens": 10}))
    assert reply.WhichOneof("response") == "request_body"
    index = ENDPOINTS.index(destination(reply))
    inflight = picker.service.engine.inflight
    assert (inflight.requests[index], inflight.tokens[index]) == (1, 100)  # prompt tokens: the prefill work
    await envoy.close()
    await until(lambda: inflight.total() == 0 and inflight.tokens.sum() == 0)


async def test_least_request_spreads_open_streams(picker: PickerServer) -> None:
    envoys = [FakeEnvoy(picker) for _ in ENDPOINTS]
    chosen = [destination(await e.send(headers_message(eos=True))) for e in envoys]
    assert sorted(chosen) == sorted(ENDPOINTS), "each open request must push the next one elsewhere"
    for envoy in envoys:
        await envoy.close()


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        pytest.param(b"{not json", 400, "not valid JSON", id="malformed"),
        pytest.param(b"", 400, "empty", id="empty"),
        pytest.param(b"[1, 2]", 400, "JSON object", id="array"),
        pytest.param({"prompt": "hi"}, 400, "'model'", id="no-model"),
        pytest.param({"model": MODEL, "stream": "yes"}, 400, "'stream'", id="stream-type"),
        pytest.param({"model": "other", "prompt": "hi"}, 404, "'other' is not served", id="unknown-model"),
        pytest.param({"model": MODEL, "prompt": "x" * 5000}, 413, "limit is 4096 bytes", id="too-large"),
    ],
)
async def test_bad_requests_get_a_json_error_and_count_nothing(
    picker: PickerServer, body: bytes | dict[str, Any], status: int, words: str
) -> None:
    envoy = FakeEnvoy(picker)
    await envoy.send(headers_message(body_mode=ProcessingMode.BUFFERED))
    code, payload = immediate(await envoy.send(body_message(body)))
    assert code == status
    assert payload["error"]["code"] == status
    assert words in payload["error"]["message"]
    assert picker.service.engine.inflight.total() == 0
    assert picker.service.stats.refused[status] == 1


async def test_partial_buffer_means_the_body_was_too_large(picker: PickerServer) -> None:
    envoy = FakeEnvoy(picker)
    await envoy.send(headers_message(body_mode=ProcessingMode.BUFFERED_PARTIAL))
    code, payload = immediate(await envoy.send(body_message(b'{"model": "m", "prompt": "xxxx', eos=False)))
    assert code == 413 and "more than" in payload["error"]["message"]


async def test_no_endpoint_left_is_a_503() -> None:
    class DropAll:
        name = "drop-all"

        def filter(self, request: Any, state: Any, candidates: np.ndarray) -> np.ndarray:
            return candidates[:0]

    profile = Profile("test", filters=(ModelFilter(), DropAll()), scorers=(), picker=MaxScorePicker())
    server = PickerServer(ExtProcService(make_engine(profile), max_body_bytes=4096), "127.0.0.1:0")
    await server.start()
    try:
        envoy = FakeEnvoy(server)
        code, payload = immediate(await envoy.send(headers_message(eos=True)))
        assert code == 503 and "drop-all" in payload["error"]["message"]
    finally:
        await server.stop(0)


async def test_cancelled_stream_releases_its_count(picker: PickerServer) -> None:
    envoy = FakeEnvoy(picker)
    await envoy.send(headers_message(eos=True))
    inflight = picker.service.engine.inflight
    assert inflight.total() == 1
    envoy.call.cancel()  # the client went away mid-response: Envoy resets the stream
    await until(lambda: inflight.total() == 0)
    await envoy.channel.close()


async def test_response_phases_are_let_through(picker: PickerServer) -> None:
    envoy = FakeEnvoy(picker)
    destination(await envoy.send(headers_message(eos=True)))
    reply = await envoy.send(ProcessingRequest(response_headers=HttpHeaders(end_of_stream=False)))
    assert reply.WhichOneof("response") == "response_headers"
    assert not reply.response_headers.HasField("response")
    reply = await envoy.send(ProcessingRequest(response_body=HttpBody(body=b"data", end_of_stream=True)))
    assert reply.WhichOneof("response") == "response_body"
    await envoy.close()


async def test_a_served_endpoint_on_the_routing_stream_moves_the_count_and_the_prefix() -> None:
    """A gateway that keeps the routing stream to the response reports the endpoint that served (the Endpoint Picker
    protocol's ``envoy.lb`` / ``x-gateway-destination-endpoint-served``): when a retry served it elsewhere, the
    request counts there and the prefix index learns that its prompt went there."""
    engine = make_engine(build_profile("prefix-aware", np.random.default_rng(7), size=len(ENDPOINTS)))
    [prefix] = [w.scorer for w in engine.profile.scorers if isinstance(w.scorer, PrefixAffinityScorer)]
    picker = PickerServer(ExtProcService(engine, max_body_bytes=1 << 16), "127.0.0.1:0")
    await picker.start()
    body = {"model": MODEL, "prompt": "shared words " * 200}
    envoy = FakeEnvoy(picker)
    await envoy.send(headers_message(body_mode=ProcessingMode.BUFFERED))
    picked = destination(await envoy.send(body_message(body)))
    elsewhere = next(a for a in ENDPOINTS if a != picked)
    message = ProcessingRequest(response_headers=HttpHeaders(end_of_stream=False))
    message.metadata_context.filter_metadata["envoy.lb"].fields[
        "x-gateway-destination-endpoint-served"
    ].string_value = elsewhere
    reply = await envoy.send(message)
    assert reply.WhichOneof("response") == "response_headers"
    inflight = engine.inflight
    index = {a: i for i, a in enumerate(ENDPOINTS)}
    assert inflight.requests[index[elsewhere]] == 1 and inflight.requests[index[picked]] == 0
    assert picker.service.stats.served == {"elsewhere": 1}
    hashes = apply_body(RequestFeatures(), json.dumps(body).encode(), complete=True, max_bytes=1 << 16).prefix_hashes
    assert prefix.index.match(hashes)[index[elsewhere]] == len(hashes) > 0
    await envoy.close()
    await until(lambda: inflight.total() == 0)  # released where it was served
    await picker.stop(0)


async def test_a_failing_engine_ends_only_its_own_stream(picker: PickerServer, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = picker.service.engine
    real_decide = engine.decide

    def broken(request: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(engine, "decide", broken)
    envoy = FakeEnvoy(picker)
    await envoy.call.write(headers_message(eos=True))
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await asyncio.wait_for(envoy.call.read(), 5)
    assert failure.value.code() == grpc.StatusCode.UNKNOWN
    assert picker.service.stats.failed == 1
    monkeypatch.setattr(engine, "decide", real_decide)
    assert destination(await FakeEnvoy(picker).send(headers_message(eos=True))) in ENDPOINTS


async def test_health_reports_serving_for_every_service(picker: PickerServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in HEALTH_SERVICES:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_second_picker_on_a_taken_port_fails_loudly(picker: PickerServer) -> None:
    clash = PickerServer(ExtProcService(make_engine(), max_body_bytes=4096), f"127.0.0.1:{picker.port}")
    with pytest.raises(OSError, match="cannot listen"):
        await clash.start()


async def test_a_post_without_a_body_on_a_body_route_is_refused(picker: PickerServer) -> None:
    envoy = FakeEnvoy(picker)
    code, payload = immediate(await envoy.send(headers_message(body_mode=ProcessingMode.BUFFERED, eos=True)))
    assert code == 400 and "request body is empty" in payload["error"]["message"]
    assert picker.service.engine.inflight.total() == 0


@pytest.mark.parametrize(
    "max_body", [pytest.param(4 << 20, id="default-4MiB"), pytest.param(6 << 20, id="raised-6MiB")]
)
async def test_a_body_at_max_body_bytes_reaches_the_picker(max_body: int) -> None:
    # gRPC's own receive limit (4 MiB unless set) must not be what refuses a body the config allows: a failed
    # stream sends the request upstream undecided when Envoy fails open.
    service = ExtProcService(make_engine(), max_body_bytes=max_body)
    server = PickerServer(service, "127.0.0.1:0", max_message_bytes=max_body + GRPC_ENVELOPE_BYTES)
    await server.start()
    try:
        prefix = json.dumps({"model": MODEL, "prompt": ""}).encode()[:-2]
        body = prefix + b"x" * (max_body - len(prefix) - 2) + b'"}'
        assert len(body) == max_body
        envoy = FakeEnvoy(server)
        await envoy.send(headers_message(body_mode=ProcessingMode.BUFFERED))
        assert destination(await envoy.send(body_message(body))) in ENDPOINTS
        over = FakeEnvoy(server)
        await over.send(headers_message(body_mode=ProcessingMode.BUFFERED))
        code, _ = immediate(await over.send(body_message(body + b" ")))
        assert code == 413
    finally:
        await server.stop(0)


async def test_a_release_arm_with_a_model_rewrites_the_body_it_forwards() -> None:
    endpoints = [{"address": ENDPOINTS[0], "models": [MODEL]}, {"address": ENDPOINTS[1], "models": ["m-next"]}]
    config = parse_config({"pool": {"endpoints": endpoints}})
    engine = Engine(Pool(config.endpoints), build_profile("least-request", np.random.default_rng(7)))
    arms = (ArmSpec("control", "least-request", 1.0), ArmSpec("next", "least-request", 0.0, model="m-next"))
    by_header = {"assign": "header", "header": "x-canary", "values": {"true": "next"}}
    spec = ExperimentSpec("next", arms, models=frozenset({MODEL}), **by_header)  # type: ignore[arg-type]
    experiments = Experiments.over(engine, [spec], config.profile_spec)
    service = ExtProcService(engine, max_body_bytes=4096, experiments=experiments, experiment_headers=["x-canary"])
    server = PickerServer(service, "127.0.0.1:0")
    await server.start()
    body = {"model": MODEL, "prompt": "héllo " * 50, "max_tokens": 10, "stream": True}
    try:
        canary = await route_buffered(server, body, {"x-canary": "true"})
        control = await route_buffered(server, body, {"x-canary": None})
    finally:
        await server.stop(0)
    assert destination(canary) == ENDPOINTS[1]
    common = canary.request_body.response
    forwarded = common.body_mutation.body
    assert json.loads(forwarded) == {**body, "model": "m-next"}  # the rest of the request as the client sent it
    lengths = [h.header.raw_value for h in common.header_mutation.set_headers if h.header.key == "content-length"]
    assert lengths == [str(len(forwarded)).encode()]
    # The control's request goes as it came: no body mutation, its own model's endpoint.
    assert destination(control) == ENDPOINTS[0]
    assert not control.request_body.response.HasField("body_mutation")
    assert service.decisions.recent(2)[1]["model"] == "m-next"  # the canary's decision, routed as m-next


def with_subset_hint(message: ProcessingRequest, subset: list[str] | str) -> ProcessingRequest:
    """``message`` carrying the gateway's subset hint in its metadata context, as a list or as one string."""
    hint = message.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    value = hint.fields["x-gateway-destination-endpoint-subset"]
    if isinstance(subset, str):
        value.string_value = subset
    else:
        value.list_value.SetInParent()
        for address in subset:
            value.list_value.values.add().string_value = address
    return message


@pytest.mark.parametrize(
    "subset",
    [[ENDPOINTS[2]], [ENDPOINTS[2], "10.9.9.9:8000"], f"{ENDPOINTS[2]}, 10.9.9.9:8000"],
    ids=["list", "list-with-a-non-member", "comma-separated"],
)
async def test_the_gateways_subset_hint_is_the_only_choice(picker: PickerServer, subset: list[str] | str) -> None:
    # least-request would spread open streams over all three; the hint allows one.
    envoys = [FakeEnvoy(picker) for _ in range(4)]
    for envoy in envoys:
        reply = await envoy.send(with_subset_hint(headers_message("/v1/embeddings", eos=True), subset))
        assert destination(reply) == ENDPOINTS[2]
    assert picker.service.engine.inflight.requests.tolist() == [0, 0, 4]
    # Without a hint the next request may go anywhere: least-request sends it to an idle endpoint.
    envoys.append(FakeEnvoy(picker))
    assert destination(await envoys[-1].send(headers_message("/v1/embeddings", eos=True))) in ENDPOINTS[:2]
    for envoy in envoys:
        await envoy.close()


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:8000"], "not-an-address"], ids=["empty", "no-member", "garbage"])
async def test_a_subset_hint_with_no_eligible_endpoint_is_a_503(picker: PickerServer, subset: list[str] | str) -> None:
    envoy = FakeEnvoy(picker)
    code, payload = immediate(await envoy.send(with_subset_hint(headers_message("/v1/embeddings", eos=True), subset)))
    assert code == 503 and "subset hint" in payload["error"]["message"]
    assert picker.service.engine.inflight.total() == 0
    await envoy.close()


async def test_a_subset_hint_reaches_body_routes_too(picker: PickerServer) -> None:
    envoy = FakeEnvoy(picker)
    await envoy.send(with_subset_hint(headers_message(body_mode=ProcessingMode.BUFFERED), [ENDPOINTS[0]]))
    reply = await envoy.send(body_message({"model": MODEL, "prompt": "hello"}))
    assert destination(reply) == ENDPOINTS[0]
    await envoy.close()


class DuplexEnvoy(FakeEnvoy):
    """A stream in FULL_DUPLEX_STREAMED mode: Envoy sends on without waiting for replies."""

    async def write(self, message: ProcessingRequest) -> None:
        await self.call.write(message)

    async def read(self, count: int) -> list[ProcessingResponse]:
        return [await asyncio.wait_for(self.call.read(), 5) for _ in range(count)]


def streamed(reply: ProcessingResponse) -> tuple[bytes, bool]:
    assert reply.WhichOneof("response") == "request_body"
    part = reply.request_body.response.body_mutation.streamed_response
    return part.body, part.end_of_stream


@pytest.mark.parametrize("trailers", [False, True], ids=["last-chunk-ends", "trailers-end"])
async def test_full_duplex_streamed_bodies_are_routed_once_whole_and_given_back(trailers: bool) -> None:
    picker = PickerServer(ExtProcService(make_engine(), max_body_bytes=1 << 20), "127.0.0.1:0")
    await picker.start()
    body = json.dumps({"model": MODEL, "prompt": "x" * 100_000}).encode()  # two chunks back: 64 KiB at most each
    envoy = DuplexEnvoy(picker)
    await envoy.write(headers_message(body_mode=ProcessingMode.FULL_DUPLEX_STREAMED))
    half = len(body) // 2
    await envoy.write(body_message(body[:half], eos=False))
    await envoy.write(body_message(body[half:], eos=not trailers))
    if trailers:
        await envoy.write(ProcessingRequest(request_trailers=HttpTrailers()))
    first, *rest = await envoy.read(4 if trailers else 3)
    assert first.WhichOneof("response") == "request_headers" and destination(first) in ENDPOINTS
    parts = [streamed(r) for r in rest[:2]]
    assert b"".join(p for p, _ in parts) == body and all(len(p) <= 64 << 10 for p, _ in parts)
    assert [eos for _, eos in parts] == [False, not trailers]
    if trailers:
        assert rest[2].WhichOneof("response") == "request_trailers"
    assert picker.service.engine.inflight.total() == 1
    await envoy.close()
    await picker.stop(0)


async def test_a_full_duplex_body_over_the_limit_is_a_413(picker: PickerServer) -> None:
    envoy = DuplexEnvoy(picker)
    await envoy.write(headers_message(body_mode=ProcessingMode.FULL_DUPLEX_STREAMED))
    await envoy.write(body_message(b"x" * 3000, eos=False))
    await envoy.write(body_message(b"x" * 3000, eos=False))  # 6000 bytes: the limit is 4096
    [reply] = await envoy.read(1)
    code, payload = immediate(reply)
    assert code == 413 and "4096" in payload["error"]["message"]
    assert picker.service.engine.inflight.total() == 0
    await envoy.channel.close()


class _SlowTokenizer:
    """A tokenizer too slow for the routing loop (`inline` False): it records the thread it ran on."""

    inline = False

    def __init__(self) -> None:
        self.threads: list[str] = []

    def text_ids(self, text: str, max_tokens: int | None = None) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return piece_ids(text)

    def chat_ids(self, messages: list[Any], max_tokens: int | None = None) -> list[int]:
        return self.text_ids(chat_text(messages))


async def test_a_slow_tokenizer_keys_the_prompt_in_a_worker_thread_before_the_decision() -> None:
    """The exact cache index's keys of a prompt come from the model's tokenizer; a slow one runs off the routing
    loop, and the request is decided with its keys: the server that reports the prompt's blocks gets it."""
    engine = make_engine(build_profile("prefix-aware", np.random.default_rng(7), size=len(ENDPOINTS)))
    kv = KVBlockIndex(len(ENDPOINTS), clock=engine.signals.clock, block_size=16)
    engine.signals.kv = kv
    service = ExtProcService(engine, max_body_bytes=1 << 16)
    tokenizer = _SlowTokenizer()
    service.keyer = CacheKeyer({MODEL: tokenizer}, 16)
    service.keying_deadline_s = 600.0  # a loaded test machine must not make it late
    prompt = "a prompt that one server holds " * 40
    keys = cache_keys(piece_ids(prompt), 16)
    for endpoint in range(len(ENDPOINTS)):
        kv.subscribed(endpoint, True)
    kv.store(2, list(range(len(keys))), keys)
    picker = PickerServer(service, "127.0.0.1:0")
    await picker.start()
    try:
        reply = await route_buffered(picker, {"model": MODEL, "prompt": prompt}, {})
        assert destination(reply) == ENDPOINTS[2]
        assert tokenizer.threads and all(name.startswith("inferlb-tokenize") for name in tokenizer.threads)
    finally:
        await picker.stop(0)
        service.close()

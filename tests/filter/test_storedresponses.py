"""A Responses API request that continues a stored response goes to the server that stored it (vLLM keeps stored
responses in the memory of the server that made them: any other answers 404)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from inferlb.filter.server import ExtProcService, PickerServer
from inferlb.filter.storedresponses import StoredResponses, previous_response_id

from .test_observe import _chunk, _mirror, request, response
from .test_server import ENDPOINTS, MODEL, FakeEnvoy, body_message, destination, headers_message, make_engine, until

WHOLE = b'{"id":"resp_6a1f","object":"response","created_at":1733600000,"status":"completed","output":[]}'
STREAMED = (
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":'
    b'{"id":"resp_77b0","object":"response","status":"in_progress"}}\n\n'
)


def test_a_responses_id_is_learned_from_the_first_chunk_whole_or_streamed() -> None:
    stored = StoredResponses(capacity=2)
    stored.learn(WHOLE, ENDPOINTS[0])
    stored.learn(STREAMED, ENDPOINTS[1])
    stored.learn(b'{"id":"chatcmpl-1","object":"chat.completion","choices":[]}', ENDPOINTS[2])  # not a Responses one
    assert stored.home("resp_6a1f") == ENDPOINTS[0] and stored.home("resp_77b0") == ENDPOINTS[1]
    assert stored.stats.learned == 2
    stored.learn(WHOLE.replace(b"resp_6a1f", b"resp_new"), ENDPOINTS[2])
    assert stored.home("resp_77b0") == ENDPOINTS[1] and stored.home("resp_6a1f") is None  # the oldest forgotten


@pytest.mark.parametrize(
    ("body", "found"),
    [
        (b'{"model": "m", "input": "hi", "previous_response_id": "resp_6a1f"}', "resp_6a1f"),
        (b'{"model": "m", "input": "hi"}', None),
        (b'{"model": "m", "previous_response_id": 7}', None),
        (b'{"previous_response_id": "' + b"x" * 300 + b'"}', None),
        (b'not json "previous_response_id"', None),
    ],
)
def test_the_previous_response_id_is_read_from_the_request(body: bytes, found: str | None) -> None:
    assert previous_response_id(body) == found


@pytest.fixture
async def server() -> AsyncIterator[PickerServer]:
    service = ExtProcService(make_engine(), max_body_bytes=1 << 16)
    service.response_timer = lambda *_: None
    service.stored_responses = StoredResponses()
    picker = PickerServer(service, "127.0.0.1:0")
    await picker.start()
    yield picker
    await picker.stop(0)


async def _route(picker: PickerServer, body: dict[str, object]) -> str:
    envoy = FakeEnvoy(picker)
    try:
        await envoy.send(headers_message("/v1/responses", body_mode=ProcessingMode.BUFFERED))
        return destination(await envoy.send(body_message(body)))
    finally:
        await envoy.channel.close()


async def test_a_request_continuing_a_stored_response_goes_to_the_server_that_stored_it(
    server: PickerServer,
) -> None:
    service = server.service
    stored = service.stored_responses
    assert stored is not None
    # The response was made on endpoint 2 (Envoy mirrors its first chunk to the picker).
    assert (
        await _mirror(server, [request(ENDPOINTS[2]), response(content_type="application/json"), _chunk(WHOLE)]) == []
    )
    await until(lambda: stored.stats.learned == 1)
    # Endpoint 2 is the busiest: least-request would send anything else elsewhere.
    leases = [service.engine.inflight.acquire(2, 10) for _ in range(3)]
    continuing = {"model": MODEL, "input": "and then?", "previous_response_id": "resp_6a1f"}
    assert await _route(server, continuing) == ENDPOINTS[2]
    assert await _route(server, {**continuing, "previous_response_id": "resp_unseen"}) != ENDPOINTS[2]
    assert await _route(server, {"model": MODEL, "input": "new"}) != ENDPOINTS[2]
    assert (stored.stats.pinned, stored.stats.unknown) == (1, 1)
    for lease in leases:
        lease.release()


async def test_a_continuing_request_is_not_pinned_to_a_server_that_left(server: PickerServer) -> None:
    # The client names the response; only the operator's pool decides where traffic may go: a server that is no
    # longer a serving member is never the destination, whatever a request names.
    service = server.service
    stored = service.stored_responses
    assert stored is not None
    stored.learn(WHOLE, "10.9.9.9:8000")  # an address outside the pool (a server that left)
    continuing = {"model": MODEL, "input": "and then?", "previous_response_id": "resp_6a1f"}
    assert await _route(server, continuing) in ENDPOINTS
    assert (stored.stats.pinned, stored.stats.gone) == (0, 1)

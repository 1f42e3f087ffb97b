"""Tests for sim/replay.py's client: what one streamed request's record says."""

from __future__ import annotations

import httpx

from inferlb.sim import replay
from inferlb.sim.replay import Shot

SHOT = Shot("r1", 0.0, "http://router", "m", "a prompt", 4)


async def _record(body: bytes, status: int = 200) -> replay.ClientRecord:
    def answer(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream", "x-inferlb-sim-server": "s1"}
        return httpx.Response(status, content=body, headers=headers)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        return await replay._one(client, SHOT, start=0.0, scale=1.0)


async def test_a_streamed_answer_is_timed_and_counted() -> None:
    record = await _record(b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\ndata: [DONE]\n\n')
    assert (record.status, record.server, record.tokens, record.error) == (200, "s1", 2, None)
    assert record.ttft_s is not None and record.e2e_s is not None


async def test_an_error_event_in_a_200_stream_is_a_failed_request() -> None:
    # Dynamo's frontend, for one: the server refused the request after the router had answered 200.
    body = b'data: {"error":{"message":"Internal server error","code":500}}\n\ndata: [DONE]\n\n'
    record = await _record(body)
    assert record.status == 200
    assert record.error is not None and "Internal server error" in record.error
    assert record.ttft_s is None and record.e2e_s is None

"""Exact cache keys from a slow tokenizer, through the ext_proc service driven over real gRPC: a request never waits
long for them. Beyond `keying_queue` prompts held by the tokenizing threads a request routes at once without keys
(busy), and one whose keys miss `keying_deadline_s` routes without them (late); both are counted. The keys
themselves: tests/scorer/test_tokenizer.py; the worker thread: tests/filter/test_server.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from inferlb.filter.server import ExtProcService, PickerServer
from inferlb.scorer.tokenizer import CacheKeyer, chat_text, piece_ids

from ..conftest import until
from .test_server import ENDPOINTS, MODEL, destination, make_engine, route_buffered


class _GatedTokenizer:
    """A slow tokenizer that holds every prompt until ``gate`` is set; counts the prompts it has begun."""

    inline = False

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.begun = 0

    def text_ids(self, text: str, max_tokens: int | None = None) -> list[int]:
        self.begun += 1
        self.gate.wait()
        return piece_ids(text)

    def chat_ids(self, messages: list[Any], max_tokens: int | None = None) -> list[int]:
        return self.text_ids(chat_text(messages), max_tokens)


@pytest.fixture
async def gated() -> AsyncIterator[tuple[PickerServer, _GatedTokenizer]]:
    service = ExtProcService(make_engine(), max_body_bytes=1 << 16)
    tokenizer = _GatedTokenizer()
    service.keyer = CacheKeyer({MODEL: tokenizer}, 16)
    picker = PickerServer(service, "127.0.0.1:0")
    await picker.start()
    try:
        yield picker, tokenizer
    finally:
        tokenizer.gate.set()  # never leave a worker thread blocked
        await picker.stop(0)
        service.close()


def _body(n: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"prompt {n} of a client " * 40}


async def test_a_full_tokenizer_queue_routes_other_requests_at_once_without_exact_keys(
    gated: tuple[PickerServer, _GatedTokenizer],
) -> None:
    picker, tokenizer = gated
    service = picker.service
    service.keying_queue, service.keying_deadline_s = 2, 600.0  # none is late: only the queue's bound applies
    held = [asyncio.create_task(route_buffered(picker, _body(n), {})) for n in range(2)]
    await until(lambda: tokenizer.begun == 2, "both prompts in the tokenizer")
    for n in range(2, 5):  # the tokenizer is stuck: these route now, on the approximate index
        assert destination(await route_buffered(picker, _body(n), {})) in ENDPOINTS
    assert service.stats.unkeyed == {"busy": 3}
    assert tokenizer.begun == 2 and not any(task.done() for task in held)
    tokenizer.gate.set()
    assert all(destination(reply) in ENDPOINTS for reply in await asyncio.gather(*held))
    assert service.stats.unkeyed == {"busy": 3}  # the held two got their keys in time


async def test_a_request_whose_keys_are_late_routes_without_them(gated: tuple[PickerServer, _GatedTokenizer]) -> None:
    picker, tokenizer = gated
    service = picker.service
    service.keying_deadline_s = 0.0  # every prompt the tokenizer has not finished is late
    replies = [await route_buffered(picker, _body(n), {}) for n in range(3)]
    assert all(destination(reply) in ENDPOINTS for reply in replies)
    assert service.stats.unkeyed == {"late": 3}
    # The late prompts are still the tokenizer's (a thread cannot be stopped) and count against its queue until
    # they finish; then their keys are dropped.
    await until(lambda: tokenizer.begun == 2, "the tokenizing threads busy with late prompts")
    tokenizer.gate.set()
    await until(lambda: service._keying == 0, "the late prompts finished")

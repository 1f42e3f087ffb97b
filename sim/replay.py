"""Open-loop replay of trace requests against live HTTP servers (emulated or real, direct or through a gateway).

Each `Shot` is sent at its time (scaled by ``1 / time_scale``) whether or not earlier ones have finished, as a
streaming ``/v1/completions`` request, and the client records when the first non-empty token arrived and when the
stream ended. `ClientRecord` times are wall seconds; multiply by the time scale to compare with engine time.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import orjson

__all__ = ["ClientRecord", "Shot", "replay"]


@dataclass(frozen=True, slots=True)
class Shot:
    """One request to send: at ``at`` seconds (trace time), to ``url`` (a base URL), this prompt and length."""

    id: str
    at: float
    url: str
    model: str
    prompt: str | list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class ClientRecord:
    """What the client saw of one shot. ``server`` is the ``x-inferlb-sim-server`` header ("" if absent)."""

    id: str
    status: int
    server: str
    sent_at: float
    ttft_s: float | None
    e2e_s: float | None
    tokens: int
    error: str | None


async def _one(client: httpx.AsyncClient, shot: Shot, start: float, scale: float) -> ClientRecord:
    delay = start + shot.at / scale - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.monotonic()
    body = {"model": shot.model, "prompt": shot.prompt, "max_tokens": shot.max_tokens, "stream": True}
    first = None
    tokens = 0
    failure = None  # an error event in the stream: a router that had sent its 200 before the server failed
    try:
        async with client.stream("POST", f"{shot.url}/v1/completions", json=body) as response:
            server = response.headers.get("x-inferlb-sim-server", "")
            if response.status_code != 200:
                await response.aread()
                return ClientRecord(shot.id, response.status_code, server, sent, None, None, 0, response.text[:200])
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    failure = f"error in the stream: {orjson.dumps(chunk['error']).decode()[:200]}"
                for choice in chunk.get("choices", ()):
                    if choice.get("text"):
                        tokens += 1
                        if first is None:
                            first = time.monotonic()
    except httpx.HTTPError as exc:
        return ClientRecord(shot.id, 0, "", sent, None, None, tokens, f"{type(exc).__name__}: {exc}")
    end = time.monotonic()
    if failure is not None:
        return ClientRecord(shot.id, 200, server, sent, None, None, tokens, failure)
    return ClientRecord(shot.id, 200, server, sent, None if first is None else first - sent, end - sent, tokens, None)


async def replay(shots: Sequence[Shot], *, time_scale: float = 1.0, timeout_s: float = 120.0) -> list[ClientRecord]:
    """Send every shot at its scaled time and wait for all; records in the order of ``shots``.

    Every request is bounded by ``timeout_s`` (wall); a request that fails or times out gets a record with its
    ``error``, so nothing is lost silently.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    # Without TCP_NODELAY a small request body waits behind its headers for the server's delayed ACK (~40 ms).
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), transport=transport) as client:
        start = time.monotonic()
        return list(await asyncio.gather(*(_one(client, shot, start, time_scale) for shot in shots)))

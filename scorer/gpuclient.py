"""Reading a node's GPU report over HTTP, whatever serves it: a GPU agent's or the emulator's ``/gpu`` (JSON, the
schema of :mod:`inferlb.scorer.gpustate`) or an NVIDIA DCGM exporter's ``/metrics`` (see :mod:`inferlb.scorer.dcgm`).

Every failure (connection, timeout, HTTP status, a redirect, an oversized or encoded body, a body that is not JSON
-- nested too deeply for Python's parser included -- or not a GPU report) is raised as :class:`GpuReadError` with the
URL and a one-line reason, so a collector handles one exception type. The URL is the operator's
(``pool.endpoints[i].gpu.url``, checked against the allowed networks at load): a redirect is never followed, since it
would send the picker wherever the source says. A body over ``PARSE_ON_LOOP_BYTES`` is parsed in a worker thread,
so the event loop the picker routes on goes on meanwhile.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from inferlb.scorer.dcgm import read_dcgm
from inferlb.scorer.gpustate import GpuReport, parse_gpu_report

__all__ = ["GPU_SOURCE_KINDS", "MAX_GPU_REPORT_BYTES", "PARSE_ON_LOOP_BYTES", "GpuReadError", "fetch_gpu_report"]

GPU_SOURCE_KINDS = ("agent", "dcgm")
"""``agent``: JSON from a GPU agent's or the emulator's ``/gpu``; ``dcgm``: a DCGM exporter's ``/metrics``."""

MAX_GPU_REPORT_BYTES = 1 << 20
"""The largest body read. An agent's report is about 200 bytes per GPU. A DCGM exporter prints a line of about 270
bytes per device for each of its 23 default families (tests/fixtures/dcgm): 60 KB for a node of 8 GPUs, about
500 KB when each of them is split into 7 MIG instances and every family is printed per instance as well. The limit
leaves twice that for counters added to the exporter's config (tests/scorer/test_gpuclient.py builds that body)."""

PARSE_ON_LOOP_BYTES = 64 << 10
"""A body longer than this is parsed in a worker thread (``asyncio.to_thread``); a shorter one, as every real node's
is, on the event loop, where it costs well under a millisecond."""

_DETAIL_CHARS = 200  # how much of an error body a message quotes
_REASON_CHARS = 500  # a reason quotes what the source sent: no source makes a log line or /endpoints row longer


class GpuReadError(Exception):
    """A GPU report could not be read from ``url``; ``reason`` says why in one line."""

    def __init__(self, url: str, reason: str) -> None:
        reason = reason.replace("\r", " ").replace("\n", " ")
        reason = reason if len(reason) <= _REASON_CHARS else reason[: _REASON_CHARS - 3] + "..."
        super().__init__(f"cannot read GPU state from {url}: {reason}")
        self.url = url
        self.reason = reason


async def fetch_gpu_report(
    client: httpx.AsyncClient,
    url: str,
    *,
    kind: str,
    host: str,
    max_bytes: int = MAX_GPU_REPORT_BYTES,
    timeout_s: float | None = None,
) -> GpuReport:
    """GET ``url`` with ``client`` and return the node's GPU report.

    ``host`` names the node in a DCGM report (the exposition's own ``Hostname`` label is optional and is the
    exporter pod's name under Kubernetes); an agent's report keeps the name the agent gave it. Redirects are not
    followed, whatever ``client`` would do; the body is streamed and refused past ``max_bytes`` (never read whole);
    the client's timeouts bound each step, ``timeout_s`` (None: no bound) the whole read, body included. Raises
    :class:`GpuReadError` on any failure to read, ValueError for an unknown ``kind``.
    """
    if kind not in GPU_SOURCE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(GPU_SOURCE_KINDS)}; got {kind!r}")
    try:
        async with asyncio.timeout(timeout_s):
            status, body = await _get(client, url, kind, max_bytes)
    except TimeoutError:
        # a server that sends a byte now and then never trips the client's read timeout
        raise GpuReadError(url, f"timed out after {timeout_s:g} s in all") from None
    if status != 200:
        raise GpuReadError(url, f"HTTP {status}{_detail(body)}")
    if len(body) > PARSE_ON_LOOP_BYTES:
        return await asyncio.to_thread(_parse, url, kind, host, body)
    return _parse(url, kind, host, body)


def _parse(url: str, kind: str, host: str, body: bytes) -> GpuReport:
    """The report in a 200's ``body``; GpuReadError when it is none. Thread-safe: called off the loop for a large
    body."""
    if kind == "dcgm":
        try:
            return read_dcgm(body, host)
        except ValueError as exc:
            raise GpuReadError(url, f"not a usable DCGM exposition: {exc}") from exc
    try:
        obj = json.loads(body)
    except RecursionError:  # C's json recurses once per level: "[" * 1000 is enough
        raise GpuReadError(url, "the body is not JSON (nested too deeply to parse)") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        raise GpuReadError(url, f"the body is not JSON ({exc})") from exc
    try:
        return parse_gpu_report(obj)
    except ValueError as exc:
        raise GpuReadError(url, f"not a GPU report: {exc}") from exc


async def _get(client: httpx.AsyncClient, url: str, kind: str, max_bytes: int) -> tuple[int, bytes]:
    """(status, body) of one GET; a redirect, an encoded body or one over ``max_bytes`` is a GpuReadError."""
    # identity: a compressed body could inflate far past max_bytes within one chunk
    headers = {"accept": "application/json" if kind == "agent" else "text/plain", "accept-encoding": "identity"}
    try:
        async with client.stream("GET", url, headers=headers, follow_redirects=False) as response:
            status = response.status_code
            if 300 <= status < 400:
                location = response.headers.get("location")
                to = f" to {location[:_DETAIL_CHARS]!r}" if location else ""
                raise GpuReadError(
                    url, f"HTTP {status} redirect{to} (redirects are not followed: set gpu.url to where the report is)"
                )
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise GpuReadError(url, f"the body is encoded ({encoding[:40]}); the picker asks for identity")
            declared = response.headers.get("content-length", "").strip()
            if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
                raise GpuReadError(url, f"the body of {int(declared)} bytes exceeds {max_bytes}")
            parts: list[bytes] = []
            total = 0
            async for chunk in response.aiter_bytes():  # no decoding: only identity gets here
                total += len(chunk)
                if total > max_bytes:
                    raise GpuReadError(url, f"the body exceeds {max_bytes} bytes")
                parts.append(chunk)
            return status, b"".join(parts)
    except httpx.TimeoutException as exc:
        raise GpuReadError(url, f"timed out ({type(exc).__name__})") from exc
    except httpx.HTTPError as exc:
        raise GpuReadError(url, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc


def _detail(body: bytes) -> str:
    """``": <message>"`` from an error body: the agent's ``{"error": {"message": ...}}``, else its first line."""
    if len(body) > PARSE_ON_LOOP_BYTES:  # an agent's error is a line of JSON: this is something else
        return _first_line(body)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return _first_line(body)
    error = obj.get("error") if isinstance(obj, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return f": {message}" if isinstance(message, str) and message else ""


def _first_line(body: bytes) -> str:
    text = body[:_DETAIL_CHARS].decode("utf-8", "replace").strip().split("\n", 1)[0]
    return f": {text}" if text else ""

"""Reading a node's GPU report over HTTP, whatever serves it: a GPU agent's or the emulator's ``/gpu`` (JSON, the
schema of :mod:`inferlb.scorer.gpustate`) or an NVIDIA DCGM exporter's ``/metrics`` (see :mod:`inferlb.scorer.dcgm`).

Every failure (connection, timeout, HTTP status, a redirect, an oversized or encoded body, a body that is not JSON
or not a GPU report) is raised as :class:`GpuReadError` with the URL and the reason, so a collector handles one
exception type. The URL is the operator's (``pool.endpoints[i].gpu.url``, checked against the allowed networks at
load): a redirect is never followed, since it would send the picker wherever the source says.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from inferlb.scorer.dcgm import read_dcgm
from inferlb.scorer.gpustate import GpuReport, parse_gpu_report

__all__ = ["GPU_SOURCE_KINDS", "MAX_GPU_REPORT_BYTES", "GpuReadError", "fetch_gpu_report"]

GPU_SOURCE_KINDS = ("agent", "dcgm")
"""``agent``: JSON from a GPU agent's or the emulator's ``/gpu``; ``dcgm``: a DCGM exporter's ``/metrics``."""

MAX_GPU_REPORT_BYTES = 2 << 20
"""The largest body read. An agent's report is a few hundred bytes per GPU; a DCGM exporter's exposition is
about 8 KB per GPU (tests/fixtures/dcgm), so a node of 8 GPUs split into 7 MIG instances each stays well below."""

_DETAIL_CHARS = 200  # how much of an error body a message quotes


class GpuReadError(Exception):
    """A GPU report could not be read from ``url``; ``reason`` says why in one line."""

    def __init__(self, url: str, reason: str) -> None:
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
    if kind == "dcgm":
        try:
            return read_dcgm(body, host)
        except ValueError as exc:
            raise GpuReadError(url, f"not a usable DCGM exposition: {exc}") from exc
    try:
        obj = json.loads(body)
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
    try:
        obj = json.loads(body)
    except ValueError:
        text = body[:_DETAIL_CHARS].decode("utf-8", "replace").strip().split("\n", 1)[0]
        return f": {text}" if text else ""
    error = obj.get("error") if isinstance(obj, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return f": {message}" if isinstance(message, str) and message else ""

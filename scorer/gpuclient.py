"""Reading a node's GPU report over HTTP, whatever serves it: a GPU agent's or the emulator's ``/gpu`` (JSON, the
schema of :mod:`inferlb.scorer.gpustate`) or an NVIDIA DCGM exporter's ``/metrics`` (see :mod:`inferlb.scorer.dcgm`).

Every failure (connection, timeout, HTTP status, a body that is not JSON or not a GPU report) is raised as
:class:`GpuReadError` with the URL and the reason, so a collector handles one exception type.
"""

from __future__ import annotations

import json

import httpx

from inferlb.scorer.dcgm import read_dcgm
from inferlb.scorer.gpustate import GpuReport, parse_gpu_report

__all__ = ["GPU_SOURCE_KINDS", "GpuReadError", "fetch_gpu_report"]

GPU_SOURCE_KINDS = ("agent", "dcgm")
"""``agent``: JSON from a GPU agent's or the emulator's ``/gpu``; ``dcgm``: a DCGM exporter's ``/metrics``."""

_DETAIL_CHARS = 200  # how much of an error body a message quotes


class GpuReadError(Exception):
    """A GPU report could not be read from ``url``; ``reason`` says why in one line."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot read GPU state from {url}: {reason}")
        self.url = url
        self.reason = reason


async def fetch_gpu_report(client: httpx.AsyncClient, url: str, *, kind: str, host: str) -> GpuReport:
    """GET ``url`` with ``client`` (its timeouts apply) and return the node's GPU report.

    ``host`` names the node in a DCGM report (the exposition's own ``Hostname`` label is optional and is the
    exporter pod's name under Kubernetes); an agent's report keeps the name the agent gave it. Raises
    :class:`GpuReadError` on any failure to read, ValueError for an unknown ``kind``.
    """
    if kind not in GPU_SOURCE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(GPU_SOURCE_KINDS)}; got {kind!r}")
    accept = "application/json" if kind == "agent" else "text/plain"
    try:
        response = await client.get(url, headers={"accept": accept})
    except httpx.TimeoutException as exc:
        raise GpuReadError(url, f"timed out ({type(exc).__name__})") from exc
    except httpx.HTTPError as exc:
        raise GpuReadError(url, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc
    if response.status_code != 200:
        raise GpuReadError(url, f"HTTP {response.status_code}{_detail(response)}")
    if kind == "dcgm":
        try:
            return read_dcgm(response.content, host)
        except ValueError as exc:
            raise GpuReadError(url, f"not a usable DCGM exposition: {exc}") from exc
    try:
        obj = json.loads(response.content)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        raise GpuReadError(url, f"the body is not JSON ({exc})") from exc
    try:
        return parse_gpu_report(obj)
    except ValueError as exc:
        raise GpuReadError(url, f"not a GPU report: {exc}") from exc


def _detail(response: httpx.Response) -> str:
    """``": <message>"`` from an error body: the agent's ``{"error": {"message": ...}}``, else its first line."""
    try:
        body = json.loads(response.content)
    except ValueError:
        text = response.content[:_DETAIL_CHARS].decode("utf-8", "replace").strip().split("\n", 1)[0]
        return f": {text}" if text else ""
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return f": {message}" if isinstance(message, str) and message else ""

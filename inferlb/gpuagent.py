"""The per-node GPU agent: this node's GPUs read through NVML (``pynvml``) and served over HTTP as a GPU report.

``GET /gpu`` answers the latest :class:`~inferlb.scorer.gpustate.GpuReport` (source ``"nvml"``), the schema the
emulator's ``/gpu`` and the DCGM reader share; ``GET /healthz`` answers ``{"status": "ok", "gpus": n,
"sampled_at": t}``. NVML calls block (milliseconds per GPU, much longer on a failing GPU), so they never run on the
event loop: a background task samples every ``interval_s`` in a thread and a request only reads the cached
sample. While sampling fails (a GPU fell off the bus, the driver went away) or a read has not returned for
``stale_after_s``, both endpoints answer 503 with a JSON body that says why; the next good sample clears it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from inferlb.scorer.address import parse_address
from inferlb.scorer.gpustate import GpuReport, parse_gpu_report
from inferlb.serving import serve

__all__ = [
    "DEFAULT_INTERVAL_S",
    "DEFAULT_LISTEN",
    "GpuReader",
    "NvmlError",
    "NvmlReader",
    "NvmlUnavailable",
    "create_agent_app",
    "read_nvml",
    "run_agent",
    "serve_agent",
]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.5
DEFAULT_LISTEN = "127.0.0.1:9400"
_GRACEFUL_SHUTDOWN_S = 2


class NvmlError(RuntimeError):
    """An NVML call failed while reading the GPUs; the message names the GPU and the call."""


class NvmlUnavailable(NvmlError):
    """NVML cannot be used on this node at all: ``pynvml`` is missing, ``nvmlInit`` failed (no driver, no
    ``libnvidia-ml.so``) or it found no GPU. The message is a one-line reason."""


class GpuReader(Protocol):
    """Where the agent's samples come from. ``read`` blocks (the agent calls it in a worker thread, one call at a
    time) and raises on failure; ``close`` releases the reader and may be called twice."""

    def read(self) -> GpuReport: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Device:
    index: int
    handle: Any
    uuid: str
    name: str


class NvmlReader:
    """This node's GPUs through NVML. The constructor calls ``nvmlInit`` once and lists the GPUs (index, UUID and
    name are read once); :meth:`read` then queries utilisation and memory of each; :meth:`close` calls
    ``nvmlShutdown``.

    Raises :class:`NvmlUnavailable` from the constructor when NVML cannot be used. :meth:`read` blocks and raises
    :class:`NvmlError` naming the GPU and the call that failed. Thread-safe: calls are serialised by a lock.
    ``close`` waits up to ``close_timeout_s`` for a read in progress, then gives up on ``nvmlShutdown`` (a hung NVML
    call must not keep the process from exiting); it is idempotent and never raises (a failure is logged).
    """

    def __init__(self, host: str, *, close_timeout_s: float = 5.0) -> None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as exc:
            raise NvmlUnavailable(f"cannot import pynvml: {_one_line(exc)}") from exc
        try:
            nvml.nvmlInit()
        except Exception as exc:  # any failure here (NVMLError, a broken library) means no NVML on this node
            raise NvmlUnavailable(f"nvmlInit failed: {_one_line(exc)}") from exc
        try:
            devices = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid, name = _text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetName(handle))
                devices.append(_Device(index, handle, uuid, name))
        except Exception as exc:
            _shutdown(nvml)
            raise NvmlUnavailable(f"NVML could not list the GPUs: {_one_line(exc)}") from exc
        if not devices:
            _shutdown(nvml)
            raise NvmlUnavailable("NVML found no GPU")
        self.host = host
        self._close_timeout_s = close_timeout_s
        self._nvml = nvml
        self._devices = tuple(devices)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def gpu_count(self) -> int:
        return len(self._devices)

    def read(self) -> GpuReport:
        """One sample of every GPU (source ``"nvml"``); blocks for the NVML calls."""
        with self._lock:
            if self._closed:
                raise NvmlError("the NVML reader is closed")
            gpus = [self._read_device(device) for device in self._devices]
            sampled_at = time.time()
        try:
            return parse_gpu_report({"source": "nvml", "host": self.host, "sampled_at": sampled_at, "gpus": gpus})
        except ValueError as exc:
            raise NvmlError(f"NVML returned values outside the GPU report schema: {exc}") from exc

    def _read_device(self, device: _Device) -> dict[str, object]:
        utilization = self._call("nvmlDeviceGetUtilizationRates", device)
        memory = self._call("nvmlDeviceGetMemoryInfo", device)
        # The v1 memory struct: `used` counts the driver's reserved memory too, so total - used is what can be
        # allocated, the same "free" the DCGM reader reports.
        return {
            "index": device.index,
            "uuid": device.uuid,
            "name": device.name,
            "utilization_pct": utilization.gpu,
            "memory_used_bytes": memory.used,
            "memory_total_bytes": memory.total,
        }

    def _call(self, function: str, device: _Device) -> Any:
        try:
            return getattr(self._nvml, function)(device.handle)
        except self._nvml.NVMLError as exc:
            raise NvmlError(f"GPU {device.index} ({device.uuid}): {function} failed: {_one_line(exc)}") from exc

    def close(self) -> None:
        if not self._lock.acquire(timeout=self._close_timeout_s):
            logger.warning(
                "an NVML read has not returned after %.1f s; exiting without nvmlShutdown", self._close_timeout_s
            )
            return
        try:
            if not self._closed:
                self._closed = True
                _shutdown(self._nvml)
        finally:
            self._lock.release()


def read_nvml(host: str) -> GpuReport:
    """One NVML sample of this node's GPUs (init, read, shutdown); blocks. Raises like :class:`NvmlReader`."""
    reader = NvmlReader(host)
    try:
        return reader.read()
    finally:
        reader.close()


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception as exc:  # nothing to do about it; the process is letting go of NVML anyway
        logger.warning("nvmlShutdown failed: %s", _one_line(exc))


def _text(value: object) -> str:
    # pynvml before 11.5 returns names and UUIDs as bytes.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


# --------------------------------------------------------------------------------------------------------------
# The HTTP app


class _Sampler:
    """Keeps the latest sample of a reader, refreshed every ``interval_s`` by a task on the event loop. Each read
    runs in a daemon thread of its own, so a read that never returns delays nothing but the next sample, and cannot
    keep the process from exiting (a thread pool's workers are joined at exit). State is touched only on the event
    loop."""

    def __init__(self, reader: GpuReader, interval_s: float, stale_after_s: float) -> None:
        self._reader = reader
        self._interval_s = interval_s
        self._stale_after_s = stale_after_s
        self._report: GpuReport | None = None
        self._sampled_mono = 0.0
        self._reading_since: float | None = None  # monotonic start of the read in flight
        self._failure: str | None = None
        self._failing_since: float | None = None
        self._first = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start sampling; wait for the first sample, at most ``stale_after_s`` (a hung NVML must not stop the
        server from answering 503)."""
        self._task = asyncio.create_task(self._run(), name="gpu-agent sampler")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first.wait(), self._stale_after_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._sample()
            self._first.set()
            await asyncio.sleep(self._interval_s)

    async def _sample(self) -> None:
        self._reading_since = time.monotonic()
        try:
            report = await _in_daemon_thread(self._reader.read)
        except Exception as exc:  # any reader failure is reported to clients until a read succeeds again
            reason = _one_line(exc)
            if self._failure is None:
                self._failing_since = time.time()
                logger.warning("GPU sampling failed: %s", reason)
            self._failure = reason
            return
        finally:
            self._reading_since = None
        if self._failure is not None:
            logger.info("GPU sampling works again after: %s", self._failure)
            self._failure = self._failing_since = None
        self._report, self._sampled_mono = report, time.monotonic()

    def current(self) -> tuple[GpuReport, None] | tuple[None, dict[str, object]]:
        """The latest report, or the 503 body that says why there is none to serve."""
        now = time.monotonic()
        if self._failure is not None:
            message = f"GPU sampling failed: {self._failure}"
        elif self._report is None:
            message = "no GPU sample yet: the agent is starting"
            if self._reading_since is not None and now - self._reading_since > self._stale_after_s:
                message = f"no GPU sample yet: the first read has not returned after {now - self._reading_since:.1f} s"
        elif now - self._sampled_mono > self._stale_after_s:
            message = f"no new GPU sample for {now - self._sampled_mono:.1f} s: the last read has not returned"
        else:
            return self._report, None
        return None, {
            "status": "error",
            "error": {"message": message, "type": "gpu_unavailable", "code": 503},
            "failing_since": self._failing_since,
            "last_sampled_at": None if self._report is None else self._report.sampled_at,
        }


async def _in_daemon_thread(function: Callable[[], GpuReport]) -> GpuReport:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[GpuReport] = loop.create_future()

    def settle(setter: Callable[[Any], None], value: object) -> None:
        if not future.done():  # done: the sampler was cancelled while the read ran
            setter(value)

    def work() -> None:
        outcome: tuple[Callable[[Any], None], object]
        try:
            outcome = (future.set_result, function())
        except BaseException as exc:  # handed to the event loop, which raises it in the sampler
            outcome = (future.set_exception, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed while the read ran: nobody is waiting
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=work, name="gpu-agent read", daemon=True).start()
    return await future


def create_agent_app(
    reader: GpuReader, *, interval_s: float = DEFAULT_INTERVAL_S, stale_after_s: float | None = None
) -> FastAPI:
    """The agent's ASGI app over ``reader``; sampling runs while the app's lifespan does (uvicorn's, or
    ``app.router.lifespan_context(app)`` in process). ``stale_after_s`` (default ``max(5 * interval_s, 2)``): a
    sample older than this is not served. The caller owns ``reader`` and closes it after the app stops."""
    if not (isinstance(interval_s, int | float) and math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"interval_s must be a number of seconds > 0; got {interval_s!r}")
    stale = max(5 * interval_s, 2.0) if stale_after_s is None else stale_after_s
    if not (isinstance(stale, int | float) and math.isfinite(stale) and stale > 0):
        raise ValueError(f"stale_after_s must be a number of seconds > 0; got {stale_after_s!r}")
    sampler = _Sampler(reader, float(interval_s), float(stale))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await sampler.start()
        try:
            yield
        finally:
            await sampler.stop()

    app = FastAPI(title="inferlb GPU agent", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/gpu")
    async def gpu() -> JSONResponse:
        report, problem = sampler.current()
        if report is None:
            return JSONResponse(problem, status_code=503)
        return JSONResponse(report.to_json())

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        report, problem = sampler.current()
        if report is None:
            return JSONResponse(problem, status_code=503)
        return JSONResponse({"status": "ok", "gpus": len(report.gpus), "sampled_at": report.sampled_at})

    return app


# --------------------------------------------------------------------------------------------------------------
# Serving


async def serve_agent(app: FastAPI, listen: str, *, ready: asyncio.Event | None = None) -> None:
    """Serve ``app`` on ``listen`` (literal ``ip:port``) until SIGTERM/SIGINT or cancellation, then shut down
    gracefully and return. A malformed address raises ValueError, a busy one OSError naming it; ``ready`` is set
    once the server listens. Signal handlers are installed only in the main thread and put back on return."""
    try:
        parse_address(listen)
    except ValueError as exc:
        raise ValueError(f"bad listen address {listen!r}: {exc}") from None
    # lifespan "on": the app's sampler starts and stops with the server.
    await serve([(listen, app)], ready=ready, lifespan="on", what="GPU agent")


def run_agent(listen: str, interval_s: float = DEFAULT_INTERVAL_S, host: str | None = None) -> int:
    """The agent process (``inferlb gpu-agent``): read this node's GPUs and serve them on ``listen`` until
    SIGTERM/SIGINT; the exit status: 0, or 3 when NVML is not available (said on stderr). Raises ValueError for a
    bad ``listen`` or ``interval_s``. Imports only what the agent needs (a GPU node runs nothing else of inferlb)."""
    try:
        parse_address(listen)
    except ValueError as exc:
        raise ValueError(f"--listen: {exc}") from None
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"--interval-s must be a number of seconds > 0; got {interval_s}")
    try:
        reader = NvmlReader(host or socket.gethostname())
    except NvmlUnavailable as exc:
        print(
            f"inferlb: error: NVML is not available ({exc}); the GPU agent needs an NVIDIA driver and GPU on this node",
            file=sys.stderr,
        )
        return 3
    try:
        asyncio.run(serve_agent(create_agent_app(reader, interval_s=interval_s), listen))
    finally:
        reader.close()
    return 0

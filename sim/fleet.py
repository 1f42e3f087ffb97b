"""A fleet of emulated servers in one process: what ``inferlb sim`` runs.

Each server gets its own engine (seeded ``seed + i``), its own tracer provider (so its spans name it in their
resource) and its start-up faults; `run_fleet` serves them all until SIGTERM/SIGINT and then flushes their spans.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence

from inferlb.otel.tracing import create_tracer_provider
from inferlb.serving import ASGIApp, serve
from inferlb.sim.profiles import ServerProfile
from inferlb.sim.server import FAULT_KEYS, EmulatedServer, ServerOptions
from inferlb.sim.spans import SERVICE_NAME, RequestSpans

SERVER_CONNECTIONS = 1 << 16  # as good as none: the file descriptors run out first, as for vLLM
SERVER_BACKLOG = 2048  # uvicorn's default, which vLLM runs with

__all__ = ["build_fleet", "parse_fault", "run_fleet", "serving"]


def parse_fault(text: str, replicas: int) -> tuple[int, dict[str, object]]:
    """``"INDEX:key=value[,key=value]"`` (e.g. ``"2:slowdown=5,error_rate=0.1"``, ``"0:hang=true"``) → (index, spec).

    ValueError with the expected shape otherwise; the values are checked when applied.
    """
    shape = "expected INDEX:key=value[,key=value], e.g. 2:slowdown=5"
    index_text, sep, rest = text.partition(":")
    if not sep or not rest:
        raise ValueError(f"bad --fault {text!r}: {shape}")
    try:
        index = int(index_text)
    except ValueError:
        raise ValueError(f"bad --fault {text!r}: the server index must be an integer; {shape}") from None
    if not 0 <= index < replicas:
        raise ValueError(f"bad --fault {text!r}: server index must be in 0..{replicas - 1}")
    spec: dict[str, object] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in FAULT_KEYS:
            raise ValueError(f"bad --fault {text!r}: {key!r} is not one of {', '.join(FAULT_KEYS)}; {shape}")
        lowered = value.strip().lower()
        if lowered in ("true", "false"):
            spec[key] = lowered == "true"
        else:
            try:
                spec[key] = float(value)
            except ValueError:
                raise ValueError(f"bad --fault {text!r}: {key} needs a number or true/false") from None
    return index, spec


def build_fleet(
    addresses: Sequence[str],
    options: ServerOptions,
    *,
    otlp_endpoint: str | None = None,
    otlp_protocol: str = "grpc",
    faults: Mapping[int, Mapping[str, object]] | None = None,
    profiles: Sequence[ServerProfile] | None = None,
) -> list[EmulatedServer]:
    """One `EmulatedServer` per address; faults are applied before the first request. ``profiles``: one per
    address, a mixed fleet (default: every server runs ``options.profile``); where ``options`` serve only the
    profile's own model (the default), each server serves its own profile's model. ValueError on bad input."""
    if profiles is not None and len(profiles) != len(addresses):
        raise ValueError(f"{len(profiles)} profiles for {len(addresses)} servers")
    servers = []
    for i, address in enumerate(addresses):
        spans = None
        if otlp_endpoint:
            provider = create_tracer_provider(
                otlp_endpoint, service_name=SERVICE_NAME, protocol=otlp_protocol, server_address=address
            )
            spans = RequestSpans(provider)
        own = dataclasses.replace(options, seed=options.seed + i)
        if profiles is not None:
            own_model = options.models == (options.profile.model,)
            own = dataclasses.replace(own, profile=profiles[i], models=() if own_model else options.models)
        server = EmulatedServer(address, own, spans=spans)
        if faults and i in faults:
            server.apply_faults(faults[i])
        servers.append(server)
    return servers


async def run_fleet(
    servers: Sequence[EmulatedServer],
    *,
    ready: asyncio.Event | None = None,
    extra: Sequence[tuple[str, ASGIApp]] = (),
) -> None:
    """Serve ``servers`` (and any ``extra`` apps) until SIGTERM/SIGINT or cancellation, then stop their drivers and
    flush their spans."""
    try:
        # Envoy opens a connection to a server per request it has in flight there (HTTP/1.1), as to vLLM, whose
        # uvicorn neither caps connections nor shortens its backlog: nor do the emulated ones.
        await serve(
            [*((server.address, server) for server in servers), *extra],
            ready=ready,
            max_connections=SERVER_CONNECTIONS,
            backlog=SERVER_BACKLOG,
        )
    finally:
        for server in servers:
            await server.aclose()


@contextlib.asynccontextmanager
async def serving(
    servers: Sequence[EmulatedServer], *, extra: Sequence[tuple[str, ASGIApp]] = (), timeout_s: float = 10.0
) -> AsyncIterator[Sequence[EmulatedServer]]:
    """``async with serving(servers):`` the fleet listens over loopback in this event loop for the block, and is
    shut down (drivers stopped, spans flushed) when it ends. A server that cannot start raises here."""
    ready = asyncio.Event()
    task = asyncio.create_task(run_fleet(servers, ready=ready, extra=extra))
    waiting = asyncio.create_task(ready.wait())
    await asyncio.wait([waiting, task], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if task.done():
        task.result()
    if not ready.is_set():
        task.cancel()
        raise TimeoutError(f"the emulated servers did not listen within {timeout_s} s")
    try:
        yield servers
    finally:
        task.cancel()
        await asyncio.wait({task}, timeout=timeout_s)

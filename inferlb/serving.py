"""Serving ASGI apps: one uvicorn server per address, all in the current event loop.

The one way the project runs HTTP servers: ``inferlb sim`` (several emulated servers in one process), the GPU
agent, and the picker's admin API (which leaves signals to the picker).

Connections are taken before any app (and any token check) runs, so each server bounds what a client that sends
nothing costs: a connection that has not sent a whole request head within `HEADER_TIMEOUT_S` of connecting (or of
its previous response) is closed, and past `MAX_CONNECTIONS` open at once a new one is answered 503 and closed as
soon as it is accepted. uvicorn has neither: its keep-alive timer starts only after a response, and its
``limit_concurrency`` answers 503 but keeps every connection open, so idle connections could take every file
descriptor of the process (the picker's routing listener included).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping, Sequence
from typing import Any, Literal, cast

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from inferlb.scorer.address import parse_address

__all__ = ["HEADER_TIMEOUT_S", "MAX_CONNECTIONS", "ASGIApp", "serve"]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Every HTTP client sends a request head at once; one still sending its head after this is stalled or hostile.
HEADER_TIMEOUT_S = 10.0
# Connections one server keeps open at once. Prometheus needs one or two per scraper, a browser six per page's
# origin; and it is a quarter of the 1024 file descriptors a process gets by default (systemd's soft limit), so a
# flood of idle connections leaves the rest of the process its descriptors.
MAX_CONNECTIONS = 256

# Bounds how long a shutdown waits for in-flight streams.
_GRACEFUL_SHUTDOWN_S = 5
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_REFUSAL_LOG_INTERVAL_S = 60.0
# The listen backlog (uvicorn's default: 2048). asyncio accepts up to the backlog at each wake-up before any
# protocol runs, so a deep one let a burst of connections take that many descriptors at once, past the cap.
BACKLOG = 64
_TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 21\r\n"
    b"connection: close\r\n\r\ntoo many connections\n"
)


async def serve(
    apps: Sequence[tuple[str, ASGIApp]],
    *,
    ready: asyncio.Event | None = None,
    lifespan: Literal["auto", "on", "off"] = "off",
    handle_signals: bool = True,
    what: str = "server",
    max_connections: int = MAX_CONNECTIONS,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    backlog: int = BACKLOG,
) -> None:
    """Serve each ``(address, app)`` in the running event loop until SIGTERM/SIGINT or cancellation.

    Every address is validated and bound before any server starts: a malformed address raises ValueError, a busy
    one OSError naming it. `ready` is set once every server is listening. On SIGTERM/SIGINT all servers shut down
    gracefully (in-flight streams get up to a few seconds) and `serve` returns; a second SIGINT forces the exit. On
    cancellation the servers are shut down the same way before CancelledError propagates. If a server fails, the
    others are stopped and its exception is raised.

    Signal handlers are installed with `loop.add_signal_handler` only when running in the main thread (elsewhere the
    loop cannot receive signals, so stop by cancelling); the previous Python-level handlers are put back on return.
    uvicorn's own per-server signal capture is disabled because with several servers in one loop each would replace
    the process-wide handler of the one before, and it re-raises the signal after shutdown.

    ``lifespan`` is uvicorn's setting ("on" for apps with start-up work); ``handle_signals=False`` leaves signals to
    the caller (stop by cancelling); ``what`` names the servers in messages ("bad {what} address ...").
    ``max_connections`` and ``header_timeout_s`` bound each server's connections (see the module docstring);
    ValueError unless the first is at least 1 and the second above 0. ``backlog``: the listen backlog (servers
    that stand in for inference servers, which Envoy opens a connection to per concurrent request, take uvicorn's
    own 2048 and no cap that bites).
    """
    endpoints = [(address, *_parse_address(address, what)) for address, _ in apps]
    if not endpoints:
        raise ValueError("serve() needs at least one address")
    if max_connections < 1 or not header_timeout_s > 0:
        raise ValueError(
            f"max_connections must be >= 1 and header_timeout_s > 0, not {max_connections} and {header_timeout_s}"
        )
    addresses = [address for address, _ in apps]

    sockets: list[socket.socket] = []
    try:
        for address, host, port in endpoints:
            sockets.append(_bind(address, host, port, what))
    except OSError:
        for sock in sockets:
            sock.close()
        raise

    servers = [
        _Server(
            _Config(
                app,
                limits=_Limits(f"{what} {address}", max_connections, header_timeout_s),
                http=_LimitedH11Protocol,
                backlog=backlog,
                # The caller owns logging configuration; uvicorn's default dictConfig would replace handlers
                # process-wide. log_level still quiets uvicorn's own loggers.
                log_config=None,
                log_level="warning",
                access_log=False,
                lifespan=lifespan,
                ws="none",
                timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
            )
        )
        for address, app in apps
    ]
    loop = asyncio.get_running_loop()
    restore_signals = _install_signal_handlers(loop, servers) if handle_signals else (lambda: None)
    tasks: list[asyncio.Task[None]] = []
    try:
        # Pre-bound sockets: uvicorn's own bind failure path calls sys.exit(), which escapes an event loop.
        tasks = [
            asyncio.create_task(server.serve(sockets=[sock]), name=f"{what} {address}")
            for server, sock, (address, _, _) in zip(servers, sockets, endpoints, strict=True)
        ]
        listening = asyncio.create_task(_all_listening(servers))
        try:
            await asyncio.wait([listening, *tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
        if listening.done() and not listening.cancelled():
            logger.info("%s listening on %s", what, ", ".join(addresses))
            if ready is not None:
                ready.set()
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for server in servers:
            server.should_exit = True
        try:
            if tasks:
                await asyncio.wait(tasks)
        finally:
            restore_signals()
            for sock in sockets:
                sock.close()
    for task in tasks:
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            raise failure


class _Limits:
    """One server's connection bounds, and its refusals to report (at most one warning a minute)."""

    def __init__(self, what: str, max_connections: int, header_timeout_s: float) -> None:
        self.what, self.max_connections, self.header_timeout_s = what, max_connections, header_timeout_s
        self.refused = 0
        self._reported = 0
        self._reported_at = -_REFUSAL_LOG_INTERVAL_S

    def refuse(self) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._reported_at >= _REFUSAL_LOG_INTERVAL_S:
            logger.warning(
                "%s: %d connections open, the most it keeps; %d more refused (503) since the last report",
                self.what,
                self.max_connections,
                self.refused - self._reported,
            )
            self._reported, self._reported_at = self.refused, now


class _Config(uvicorn.Config):
    """uvicorn's config with the server's `_Limits`, for `_LimitedH11Protocol`."""

    def __init__(self, app: ASGIApp, *, limits: _Limits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limits = limits


class _LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, bounded by the server's `_Limits`: past ``max_connections`` a new connection is
    answered 503 and closed at once; a connection is closed when no whole request head arrived within
    ``header_timeout_s`` of connecting or of its previous response. A head that arrived stops the clock: a slow
    app or a long streamed response is never cut. Event-loop owned, like its base."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._limits = cast(_Config, config).limits
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._waiting_after: object = None  # the request cycle the awaited head comes after (None: the first)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if len(self.connections) >= self._limits.max_connections:
            self._refused = True
            self._limits.refuse()
            cast(asyncio.Transport, transport).write(_TOO_MANY)
            transport.close()
            return
        super().connection_made(cast(asyncio.Transport, transport))
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return  # never counted in, nothing to undo
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._waiting_after:
            self._stop_head_timer()  # a new request cycle: its whole head is in

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may close the connection, or start a pipelined request's cycle
        if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
            self._await_head()

    def _await_head(self) -> None:
        self._stop_head_timer()
        self._waiting_after = self.cycle
        self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            logger.debug(
                "%s: no whole request head from %s in %g s; closed",
                self._limits.what,
                self.client,
                self._limits.header_timeout_s,
            )
            self.transport.close()


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to `serve()` and tells when it is listening."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # serve() handles signals for all servers at once; see its docstring.
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.listening.set()


async def _all_listening(servers: Sequence[_Server]) -> None:
    for server in servers:
        await server.listening.wait()


def _install_signal_handlers(loop: asyncio.AbstractEventLoop, servers: Sequence[_Server]) -> Callable[[], None]:
    """Make SIGINT/SIGTERM stop every server; return a function that undoes it."""
    if threading.current_thread() is not threading.main_thread():
        logger.debug("not in the main thread, no signal handlers; stop serve() by cancelling it")
        return lambda: None

    def on_signal(signum: int) -> None:
        logger.info("got %s, shutting down", signal.Signals(signum).name)
        for server in servers:
            if server.should_exit and signum == signal.SIGINT:
                server.force_exit = True
            server.should_exit = True

    previous: dict[int, Any] = {}
    for signum in _HANDLED_SIGNALS:
        handler = signal.getsignal(signum)
        try:
            loop.add_signal_handler(signum, on_signal, signum)
        except (NotImplementedError, RuntimeError, ValueError) as exc:
            # e.g. a loop without signal support; cancellation still works.
            logger.warning("cannot handle %s in this loop (%s); stop serve() by cancelling it", signum, exc)
            continue
        previous[signum] = handler

    def restore() -> None:
        for signum, handler in previous.items():
            loop.remove_signal_handler(signum)
            # remove_signal_handler resets to the default; put back what was there (None: not set from Python).
            if handler is not None:
                signal.signal(signum, handler)

    return restore


def _bind(address: str, host: str, port: int, what: str = "server") -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections whose socket says it is TCP. Without it a
    # streamed token written soon after the response headers waited for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        # A restarted demo must not wait out TIME_WAIT from the previous run on the same port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"{what}: cannot bind {address}: {exc.strerror}") from exc
    return sock


def _parse_address(address: str, what: str) -> tuple[str, int]:
    """Split literal ``"ip:port"`` / ``"[ipv6]:port"``; ValueError naming the address otherwise.

    The same rules as the pool's addresses: a server must be something the picker can name."""
    try:
        return parse_address(address)
    except ValueError as exc:
        raise ValueError(f"bad {what} address {address!r}: {exc}") from None

"""Serving ASGI apps: one uvicorn server per address, all in the current event loop.

The one way the project runs HTTP servers: ``inferlb sim`` (several emulated servers in one process), the GPU
agent, and the picker's admin API (which leaves signals to the picker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator, MutableMapping, Sequence
from typing import Any, Literal

import uvicorn

from inferlb.scorer.address import parse_address

__all__ = ["ASGIApp", "serve"]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Bounds how long a shutdown waits for in-flight streams.
_GRACEFUL_SHUTDOWN_S = 5
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def serve(
    apps: Sequence[tuple[str, ASGIApp]],
    *,
    ready: asyncio.Event | None = None,
    lifespan: Literal["auto", "on", "off"] = "off",
    handle_signals: bool = True,
    what: str = "server",
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
    """
    endpoints = [(address, *_parse_address(address, what)) for address, _ in apps]
    if not endpoints:
        raise ValueError("serve() needs at least one address")
    addresses = [address for address, _ in apps]

    sockets: list[socket.socket] = []
    try:
        for address, host, port in endpoints:
            sockets.append(_bind(address, host, port))
    except OSError:
        for sock in sockets:
            sock.close()
        raise

    servers = [
        _Server(
            uvicorn.Config(
                app,
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
        for _, app in apps
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


def _bind(address: str, host: str, port: int) -> socket.socket:
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
        raise OSError(exc.errno, f"cannot bind {address}: {exc.strerror}") from exc
    return sock


def _parse_address(address: str, what: str) -> tuple[str, int]:
    """Split literal ``"ip:port"`` / ``"[ipv6]:port"``; ValueError naming the address otherwise.

    The same rules as the pool's addresses: a server must be something the picker can name."""
    try:
        return parse_address(address)
    except ValueError as exc:
        raise ValueError(f"bad {what} address {address!r}: {exc}") from None

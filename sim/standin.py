"""OpenAI-compatible stand-in inference backends for the demo and the integration tests.

Each backend is a plain ASGI app built by `create_app(address, options)`. It answers `/health`, `/v1/models`,
`/v1/completions` and `/v1/chat/completions` with deterministic output (token i is the text ``f"tok{i} "``) and says
who it is on every response, so a test can tell which backend the gateway picked:

- `STANDIN_HEADER` carries the backend's own ``"ip:port"``;
- `SEEN_DEST_HEADER` echoes the ``x-gateway-destination-endpoint`` request header it received ("" if absent).

Streamed chunks also carry ``"seq"`` (0-based token index) and ``"sent_at"`` (`time.monotonic()` when sent), so a
receiver on the same machine can measure per-token latency against its own monotonic clock.

`serve(addresses, options)` runs one uvicorn server per address in the current event loop until SIGTERM/SIGINT or
cancellation. This is a stand-in until the real simulator lands: it does no tokenization, batching or queueing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import signal
import socket
import threading
import time
import types
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn

from inferlb.scorer.address import parse_address

__all__ = [
    "SEEN_DEST_HEADER",
    "STANDIN_HEADER",
    "ASGIApp",
    "StandinOptions",
    "create_app",
    "serve",
]

logger = logging.getLogger(__name__)

STANDIN_HEADER = "x-inferlb-sim-server"
SEEN_DEST_HEADER = "x-inferlb-seen-destination"

_DEST_REQUEST_HEADER = b"x-gateway-destination-endpoint"
_MODEL_MISMATCH_HEADER = (b"x-inferlb-model-mismatch", b"1")
_OWNER = "inferlb-standin"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# path -> the one method it answers; anything else on a known path is a 405.
_ROUTES: Mapping[str, str] = types.MappingProxyType(
    {"/health": "GET", "/v1/models": "GET", "/v1/completions": "POST", "/v1/chat/completions": "POST"}
)

# Bounds how long a shutdown waits for in-flight streams; the longest default stream (512 tokens x 5 ms) fits.
_GRACEFUL_SHUTDOWN_S = 5
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class StandinOptions:
    """How every stand-in backend behaves. Immutable; one instance may be shared by any number of apps.

    - `models`: served model names, non-empty; `/v1/models` lists them and the first is echoed when a request names
      none. A request naming another model is still answered (routing is the gateway's job) but gets the header
      ``x-inferlb-model-mismatch: 1``.
    - `token_delay_s` (>= 0): pause between streamed chunks. Non-streaming requests are answered at once.
    - `default_max_tokens` (>= 0): output length when the request gives no valid ``max_tokens``.
    - `max_output_tokens` (>= 0): cap on output length whatever the request asks.

    Raises ValueError naming the bad field.
    """

    models: tuple[str, ...] = ("stand-in",)
    token_delay_s: float = 0.005
    default_max_tokens: int = 16
    max_output_tokens: int = 512

    def __post_init__(self) -> None:
        if isinstance(self.models, str) or not self.models:
            raise ValueError(
                f"StandinOptions.models must be a non-empty tuple of names, e.g. ('stand-in',); got {self.models!r}"
            )
        if not isinstance(self.models, tuple):
            object.__setattr__(self, "models", tuple(self.models))
        for i, name in enumerate(self.models):
            if not isinstance(name, str) or not name:
                raise ValueError(f"StandinOptions.models[{i}] must be a non-empty string; got {name!r}")
        if not (isinstance(self.token_delay_s, int | float) and math.isfinite(self.token_delay_s)) or (
            self.token_delay_s < 0
        ):
            raise ValueError(f"StandinOptions.token_delay_s must be a finite number >= 0; got {self.token_delay_s!r}")
        for field in ("default_max_tokens", "max_output_tokens"):
            value = getattr(self, field)
            if not _is_count(value):
                raise ValueError(f"StandinOptions.{field} must be an int >= 0; got {value!r}")


def create_app(address: str, options: StandinOptions) -> ASGIApp:
    """Build one stand-in backend that reports `address` (literal ``"ip:port"``, IPv6 as ``"[ip]:port"``).

    The app keeps only a request-id counter; it is safe to create any number of them. Raises ValueError if
    `address` is malformed or has port 0.
    """
    _parse_address(address)
    return _StandinApp(address, options)


async def serve(addresses: Sequence[str], options: StandinOptions, *, ready: asyncio.Event | None = None) -> None:
    """Serve one stand-in backend per address in the running event loop until SIGTERM/SIGINT or cancellation.

    Every address is validated and bound before any server starts: a malformed address raises ValueError, a busy
    one OSError naming it. `ready` is set once every server is listening. On SIGTERM/SIGINT all servers shut down
    gracefully (in-flight streams get up to a few seconds) and `serve` returns; a second SIGINT forces the exit. On
    cancellation the servers are shut down the same way before CancelledError propagates. If a server fails, the
    others are stopped and its exception is raised.

    Signal handlers are installed with `loop.add_signal_handler` only when running in the main thread (elsewhere the
    loop cannot receive signals, so stop by cancelling); the previous Python-level handlers are put back on return.
    uvicorn's own per-server signal capture is disabled because with several servers in one loop each would replace
    the process-wide handler of the one before, and it re-raises the signal after shutdown.
    """
    endpoints = [(address, *_parse_address(address)) for address in addresses]
    if not endpoints:
        raise ValueError("serve() needs at least one address")
    apps = [create_app(address, options) for address, _, _ in endpoints]

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
                lifespan="off",
                ws="none",
                timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
            )
        )
        for app in apps
    ]
    loop = asyncio.get_running_loop()
    restore_signals = _install_signal_handlers(loop, servers)
    tasks: list[asyncio.Task[None]] = []
    try:
        # Pre-bound sockets: uvicorn's own bind failure path calls sys.exit(), which escapes an event loop.
        tasks = [
            asyncio.create_task(server.serve(sockets=[sock]), name=f"standin {address}")
            for server, sock, (address, _, _) in zip(servers, sockets, endpoints, strict=True)
        ]
        listening = asyncio.create_task(_all_listening(servers))
        try:
            await asyncio.wait([listening, *tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
        if listening.done() and not listening.cancelled():
            logger.info("stand-in backends listening on %s", ", ".join(addresses))
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
        logger.debug("stand-in: not in the main thread, no signal handlers; stop serve() by cancelling it")
        return lambda: None

    def on_signal(signum: int) -> None:
        logger.info("stand-in: got %s, shutting down", signal.Signals(signum).name)
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
            logger.warning("stand-in: cannot handle %s in this loop (%s); stop serve() by cancelling it", signum, exc)
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
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A restarted demo must not wait out TIME_WAIT from the previous run on the same port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"stand-in cannot bind {address}: {exc.strerror}") from exc
    return sock


def _parse_address(address: str) -> tuple[str, int]:
    """Split literal ``"ip:port"`` / ``"[ipv6]:port"`` into (host, port); ValueError naming the address otherwise.

    The same rules as the pool's addresses: a stand-in must be something the picker can name."""
    try:
        return parse_address(address)
    except ValueError as exc:
        raise ValueError(f"bad stand-in address {address!r}: {exc}") from None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _StandinApp:
    """One stand-in backend as an ASGI app; see the module docstring for what it answers."""

    def __init__(self, address: str, options: StandinOptions) -> None:
        self._address = address.encode("ascii")
        self._options = options
        self._ids = itertools.count(1)
        self._models_body = {
            "object": "list",
            "data": [{"id": name, "object": "model", "owned_by": _OWNER} for name in options.models],
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _run_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        seen = b""
        for name, value in scope["headers"]:
            if name == _DEST_REQUEST_HEADER:
                seen = value
                break
        headers = [(STANDIN_HEADER.encode(), self._address), (SEEN_DEST_HEADER.encode(), seen)]

        path, method = scope["path"], scope["method"]
        allowed = _ROUTES.get(path)
        if allowed is None:
            await _send_error(send, 404, f"no route for {path}", headers)
        elif method != allowed:
            headers.append((b"allow", allowed.encode()))
            await _send_error(send, 405, f"{method} not allowed on {path}; use {allowed}", headers)
        elif path == "/health":
            await _send_json(send, 200, {"status": "ok"}, headers)
        elif path == "/v1/models":
            await _send_json(send, 200, self._models_body, headers)
        else:
            await self._complete(receive, send, headers, chat=path == "/v1/chat/completions")

    async def _complete(self, receive: Receive, send: Send, headers: list[tuple[bytes, bytes]], *, chat: bool) -> None:
        raw = await _read_body(receive)
        if raw is None:
            return
        try:
            request = json.loads(raw)
        except (ValueError, RecursionError):
            request = None
        if not isinstance(request, dict):
            await _send_error(send, 400, "request body must be a JSON object", headers)
            return
        model = request.get("model")
        if model is not None and not isinstance(model, str):
            await _send_error(send, 400, f"'model' must be a string; got {type(model).__name__}", headers)
            return
        options = self._options
        if model is None:
            model = options.models[0]
        elif model not in options.models:
            headers.append(_MODEL_MISMATCH_HEADER)

        # Chat prefers max_completion_tokens (OpenAI's replacement for max_tokens), as vLLM does.
        keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        asked = next((request[k] for k in keys if _is_count(request.get(k))), options.default_max_tokens)
        n = min(asked, options.max_output_tokens)
        prompt_tokens = _chat_prompt_tokens(request.get("messages")) if chat else _prompt_tokens(request.get("prompt"))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        common = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }

        if request.get("stream") is True:
            stream_options = request.get("stream_options")
            include_usage = isinstance(stream_options, dict) and stream_options.get("include_usage") is True
            await self._stream(receive, send, headers, common, n, usage if include_usage else None, chat=chat)
            return

        text = "".join(f"tok{i} " for i in range(n))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        await _send_json(send, 200, {**common, "choices": [choice], "usage": usage}, headers)

    async def _stream(
        self,
        receive: Receive,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        common: dict[str, Any],
        n: int,
        usage: dict[str, int] | None,
        *,
        chat: bool,
    ) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *headers]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if chat:
            common = {**common, "object": "chat.completion.chunk"}
        disconnected = asyncio.Event()
        # uvicorn silently drops sends after a disconnect, so without this the stream would run to its end unheard.
        watcher = asyncio.create_task(_watch_disconnect(receive, disconnected))
        try:
            # n == 0 still sends one (empty) chunk so the client sees a finish_reason.
            for i in range(max(n, 1)):
                if i:
                    await asyncio.sleep(self._options.token_delay_s)
                if disconnected.is_set():
                    return
                token = f"tok{i} " if n else ""
                choice: dict[str, Any] = {
                    "index": 0,
                    "finish_reason": "length" if i >= n - 1 else None,
                    "logprobs": None,
                }
                if chat:
                    choice["delta"] = {"role": "assistant", "content": token} if i == 0 else {"content": token}
                else:
                    choice["text"] = token
                await _send_event(send, {**common, "choices": [choice], "seq": i})
            if usage is not None:
                await _send_event(send, {**common, "choices": [], "usage": usage})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except OSError:
            # Some servers raise on send after the client went away; that is an expected way for a stream to end.
            return
        finally:
            watcher.cancel()


async def _send_event(send: Send, chunk: dict[str, Any]) -> None:
    chunk["sent_at"] = time.monotonic()
    body = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def _watch_disconnect(receive: Receive, disconnected: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    disconnected.set()


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _run_lifespan(receive: Receive, send: Send) -> None:
    # Nothing to set up; answering keeps servers that run lifespan ("auto") from logging a failure.
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _send_json(send: Send, status: int, payload: object, headers: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps(payload, separators=(",", ":")).encode()
    start_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]]) -> None:
    await _send_json(
        send, status, {"error": {"message": message, "type": "invalid_request_error", "code": status}}, headers
    )


def _prompt_tokens(prompt: object) -> int:
    """Estimate: ceil(chars / 4) of the prompt text; a token-id list (or a batch of them) counts one per id."""
    if isinstance(prompt, str):
        return _chars_to_tokens(len(prompt))
    if isinstance(prompt, list):
        if all(isinstance(item, str) for item in prompt):
            return _chars_to_tokens(sum(len(item) for item in prompt))
        if all(isinstance(item, int) for item in prompt):
            return len(prompt)
        if all(isinstance(item, list) for item in prompt):
            return sum(len(item) for item in prompt)
    return 0


def _chat_prompt_tokens(messages: object) -> int:
    """Estimate: ceil(chars / 4) over string contents and {"type": "text"} parts of all messages."""
    if not isinstance(messages, list):
        return 0
    chars = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    chars += len(part["text"])
    return _chars_to_tokens(chars)


def _chars_to_tokens(chars: int) -> int:
    return (chars + 3) // 4

"""The live emulated inference server: the engine model behind vLLM's HTTP API, in real (or scaled) time.

`EmulatedServer` is one server as an ASGI app. Engine time is wall time since start-up times ``time_scale``; every
latency it reports (``/metrics``, spans, ``/admin/requests``) is engine time, as the emulated GPU would see it, so
a run at ``--time-scale 10`` reports the same latencies as a run at 1, ten times sooner.

A driver task advances the engine to the next moment something happens (a step that ends a prefill or a request,
or the next streaming flush, every ``flush_interval_s`` of wall time) and wakes the requests that progressed.
Arrivals and faults wake it at once. All state lives in the one event loop; nothing here is thread-safe.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not), ``POST /tokenize``,
``POST /v1/completions/render`` (403 unless ``enable_scale_out``, as in vLLM), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (vLLM's names), ``GET /gpu`` (the emulated GPU view, the GPU agent's schema), ``GET|POST
/admin/faults``, ``GET /admin/requests`` (the log of finished requests), ``GET /admin/routes`` (how many
requests each route answered, by status) and ``GET /admin/kv-blocks`` (the block hashes cached now, the truth a
KV-event index should equal).

With ``kv_events_port`` set the server publishes its KV-cache events as vLLM does (`sim/kvevents.py`): one batch
each time the engine is brought up to date and changed the cache. Two faults act on them: ``kv_events_pause``
(events are lost, as from a server whose publisher died) and ``kv_events_drop`` (the next N batches are numbered
and kept for replay but not sent live: a subscriber sees a gap that replay fills).

Every response names the server in `inferlb.stack.SERVER_HEADER` and echoes the ``x-gateway-destination-endpoint``
it was sent in `SEEN_DEST_HEADER`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from inferlb.procs import SERVER_HEADER
from inferlb.scorer.gpustate import GpuInfo, GpuReport
from inferlb.serving import Message, Receive, Scope, Send
from inferlb.sim.engine import EngineModel, EngineOptions, RequestState, SimRequest
from inferlb.sim.kvevents import DEFAULT_TOPIC, ENCODINGS, KVEventPublisher, KVEventsOptions
from inferlb.sim.metrics import VllmMetrics
from inferlb.sim.openai import (
    BadRequest,
    Prompt,
    chunk_event,
    completion_body,
    parse_chat,
    parse_completion,
    parse_tokenize,
    render_body,
    tokenize_body,
)
from inferlb.sim.profiles import ServerProfile
from inferlb.sim.spans import RequestSpans
from inferlb.sim.tokens import token_ids

_Parsed = TypeVar("_Parsed")

__all__ = ["FAULT_KEYS", "SEEN_DEST_HEADER", "EmulatedServer", "ServerOptions"]

logger = logging.getLogger(__name__)

SEEN_DEST_HEADER = "x-inferlb-seen-destination"
FAULT_KEYS = ("slowdown", "error_rate", "hang", "crash", "cold_start_s", "kv_events_pause", "kv_events_drop")

_DEST_REQUEST_HEADER = b"x-gateway-destination-endpoint"
_MAX_BODY = 64 << 20
_GPU_WINDOW_S = 1.0
_ROUTES: Mapping[str, tuple[str, ...]] = {
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/tokenize": ("POST",),
    "/v1/completions/render": ("POST",),
    "/v1/models": ("GET",),
    "/health": ("GET",),
    "/metrics": ("GET",),
    "/gpu": ("GET",),
    "/admin/faults": ("GET", "POST"),
    "/admin/requests": ("GET",),
    "/admin/routes": ("GET",),
    "/admin/kv-blocks": ("GET",),
}
# Paths that answer while the server is starting (cold start): the emulator's own controls and the GPU view,
# which a separate agent process would keep serving.
_ALWAYS_UP = frozenset({"/admin/faults", "/admin/requests", "/admin/routes", "/admin/kv-blocks", "/gpu"})


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """How one emulated server behaves. Times are engine seconds unless named ``_wall``.

    - ``models``: served names (default: the profile's model); a request for another model gets vLLM's 404.
    - ``time_scale`` (> 0): engine seconds per wall second.
    - ``start_cold``: not ready for the cold-start time after start-up, as after a crash.
    - ``cold_start_s``: the cold-start time (default: the profile's).
    - ``default_max_tokens``: output length when a request gives none (it then finishes with "stop").
    - ``flush_interval_s_wall``: how often streamed tokens are sent during long decode runs.
    - ``enable_scale_out``: serve ``/v1/completions/render``, as ``vllm serve --enable-scale-out`` does; without it
      vLLM 0.32 answers that route 403.
    - ``kv_events_port``: publish KV-cache events on this TCP port of the server's host (0: off);
      ``kv_events_replay_port`` serves replays (0: none); ``kv_events_encoding`` is ``"map"`` (vLLM 0.32.0's) or
      ``"array"`` (older vLLM's); ``kv_events_topic`` is the ZMQ topic (vLLM's default: empty).
    """

    profile: ServerProfile
    models: tuple[str, ...] = ()
    time_scale: float = 1.0
    seed: int = 0
    jitter: float = 0.02
    start_cold: bool = False
    cold_start_s: float | None = None
    default_max_tokens: int = 128
    flush_interval_s_wall: float = 0.02
    log_size: int = 100_000
    enable_scale_out: bool = False
    kv_events_port: int = 0
    kv_events_replay_port: int = 0
    kv_events_encoding: str = "map"
    kv_events_topic: str = DEFAULT_TOPIC

    def __post_init__(self) -> None:
        if not self.models:
            object.__setattr__(self, "models", (self.profile.model,))
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be a finite number > 0; got {self.time_scale!r}")
        if self.cold_start_s is not None and not (math.isfinite(self.cold_start_s) and self.cold_start_s >= 0):
            raise ValueError(f"cold_start_s must be a finite number >= 0; got {self.cold_start_s!r}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1; got {self.default_max_tokens!r}")
        if not self.flush_interval_s_wall > 0:
            raise ValueError(f"flush_interval_s_wall must be > 0; got {self.flush_interval_s_wall!r}")
        for name in ("kv_events_port", "kv_events_replay_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535 (0: off); got {getattr(self, name)!r}")
        if self.kv_events_replay_port and not self.kv_events_port:
            raise ValueError("kv_events_replay_port needs kv_events_port")
        if self.kv_events_encoding not in ENCODINGS:
            known = ", ".join(ENCODINGS)
            raise ValueError(f"kv_events_encoding must be one of {known}; got {self.kv_events_encoding!r}")


class _Active:
    """A request between arrival and its response's end (and, for one aborted in the middle of an engine step,
    until that step ends and the request is logged: ``closed`` says its handler is gone)."""

    __slots__ = (
        "closed",
        "created",
        "disconnected",
        "event",
        "logged",
        "prompt",
        "request",
        "sent",
        "trace",
        "wall_start_ns",
    )

    def __init__(self, request: SimRequest, prompt: Prompt, trace: tuple[str | None, str | None]) -> None:
        self.request = request
        self.prompt = prompt
        self.trace = trace
        self.event = asyncio.Event()
        self.sent = 0
        self.disconnected = False
        self.logged = self.closed = False
        self.created = int(time.time())
        self.wall_start_ns = time.time_ns()


class EmulatedServer:
    """One emulated vLLM server at ``address``; see the module docstring. Call `aclose` when done."""

    def __init__(
        self,
        address: str,
        options: ServerOptions,
        *,
        spans: RequestSpans | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.options = options
        self.profile = options.profile
        self._spans = spans
        self._clock = clock
        self._t0 = clock()
        self._cold_start_s = options.cold_start_s if options.cold_start_s is not None else self.profile.cold_start_s
        # The publisher binds its ports here: a port in use fails the server's construction (KVEventsError).
        self.kv_events: KVEventPublisher | None = None
        if options.kv_events_port:
            host = address.rpartition(":")[0].strip("[]")
            kv = KVEventsOptions(
                host,
                options.kv_events_port,
                options.kv_events_replay_port or None,
                encoding=options.kv_events_encoding,
                topic=options.kv_events_topic,
            )
            self.kv_events = KVEventPublisher(kv, self.profile.block_size)
        self.engine = EngineModel(
            self.profile, EngineOptions(seed=options.seed, jitter=options.jitter), kv_listener=self.kv_events
        )
        if options.start_cold:
            self.engine.ready_at = self._cold_start_s
        self.metrics = VllmMetrics(
            options.models[0],
            block_size=self.profile.block_size,
            num_gpu_blocks=self.profile.num_gpu_blocks,
            max_num_seqs=self.profile.max_num_seqs,
            max_num_batched_tokens=self.profile.max_num_batched_tokens,
            max_model_len=self.profile.max_model_len,
        )
        self._counted = (0, 0, 0)  # prefix queries, prefix hits, preemptions already added to the metrics
        self._active: dict[int, _Active] = {}
        self._log: deque[dict[str, Any]] = deque(maxlen=options.log_size)
        self._log_seq = itertools.count(1)
        self._ids = itertools.count(1)
        self._kick = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._gpu_samples: deque[tuple[float, float]] = deque(maxlen=512)
        self._headers = [(SERVER_HEADER.encode(), address.encode())]
        digest = hashlib.sha256(address.encode()).hexdigest()
        self._gpu_uuids = tuple(f"GPU-{digest[:8]}-{digest[8:12]}-{i:04x}" for i in range(self.profile.gpu_count))
        self.injected_errors = 0
        # "METHOD /path STATUS" -> responses; paths outside the route table count as one key so the map stays small.
        self.route_counts: Counter[str] = Counter()

    # ---- the clock and the driver ----------------------------------------------------------------------------

    def _vnow(self) -> float:
        return (self._clock() - self._t0) * self.options.time_scale

    def _ensure_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name=f"sim driver {self.address}")

    async def _drive(self) -> None:
        scale = self.options.time_scale
        flush = self.options.flush_interval_s_wall * scale
        while True:
            self.sync()
            now = self.engine.now
            target = self.engine.segment_end()
            if target is not None and any(a.prompt.stream for a in self._active.values()):
                target = min(target, now + flush)
            self._kick.clear()
            timeout = None if target is None else max(0.0, (target - now) / scale)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), timeout)

    def sync(self) -> None:
        """Bring the engine to now and wake every request that progressed or ended."""
        engine = self.engine
        engine.advance(self._vnow())
        now = engine.now
        if not self._gpu_samples or now - self._gpu_samples[-1][0] >= 0.05:
            self._gpu_samples.append((now, engine.busy_s))
        while engine.finished:
            request = engine.finished.popleft()
            active = self._active.get(id(request))
            if active is not None:
                self._finished(active)
                active.event.set()
                if active.closed:  # aborted mid-step after its client left: logged now, nothing waits for it
                    del self._active[id(request)]
        for active in self._active.values():
            if active.prompt.stream and active.request.output > active.sent:
                active.event.set()
        if self.kv_events is not None:
            self.kv_events.flush()

    def _finished(self, active: _Active) -> None:
        request, prompt = active.request, active.prompt
        ok = request.state is RequestState.FINISHED
        active.logged = True
        entry: dict[str, Any] = {
            "seq": next(self._log_seq),
            "id": request.id,
            "status": "finished" if ok else "aborted",
            "arrival_s": request.arrival,
            "queue_s": request.queue_s,
            "ttft_s": request.ttft_s,
            "e2e_s": request.e2e_s,
            "prompt_tokens": request.prompt_tokens,
            "output_tokens": request.output,
            "cached_tokens": request.cached_tokens,
            "preemptions": request.preemptions,
        }
        self._log.append(entry)
        if not ok or request.scheduled_at is None or request.first_token_at is None or request.finished_at is None:
            return
        queue_s = request.scheduled_at - request.arrival
        ttft_s = request.first_token_at - request.arrival
        e2e_s = request.finished_at - request.arrival
        prefill_s = request.first_token_at - request.scheduled_at
        decode_s = request.finished_at - request.first_token_at
        self.metrics.record_finished(
            queue_s=queue_s,
            ttft_s=ttft_s,
            e2e_s=e2e_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            prompt_tokens=request.prompt_tokens,
            generation_tokens=request.output,
            finished_reason="stop" if prompt.default_length else "length",
            mean_itl_s=decode_s / (request.output - 1) if request.output > 1 else None,
            itl_count=request.output - 1,
        )
        if self._spans is not None:
            self._spans.record(
                traceparent=active.trace[0],
                tracestate=active.trace[1],
                request_id=request.id,
                model=prompt.model,
                start_ns=active.wall_start_ns,
                end_ns=time.time_ns(),
                ttft_s=ttft_s,
                e2e_s=e2e_s,
                queue_s=queue_s,
                prompt_tokens=request.prompt_tokens,
                completion_tokens=request.output,
                max_tokens=None if prompt.default_length else prompt.max_tokens,
                prefill_s=prefill_s,
                decode_s=decode_s,
                temperature=prompt.temperature,
                top_p=prompt.top_p,
            )

    async def aclose(self) -> None:
        """Stop the driver and flush spans. Safe to call twice."""
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None
        if self._spans is not None:
            await asyncio.to_thread(self._spans.shutdown)
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)

    # ---- faults ---------------------------------------------------------------------------------------------

    def faults(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "slowdown": engine.slowdown,
            "error_rate": engine.error_rate,
            "hang": engine.hung,
            "ready": engine.ready,
            "restarts": engine.restarts,
            "cold_start_s": self._cold_start_s,
            "time_scale": self.options.time_scale,
            "kv_events_pause": self.kv_events is not None and self.kv_events.paused,
            "kv_events_drop": 0 if self.kv_events is None else self.kv_events.drop_remaining,
        }

    def apply_faults(self, spec: Mapping[str, object]) -> None:
        """Apply a fault spec (keys in `FAULT_KEYS`); ValueError naming the bad key, nothing applied then."""
        unknown = sorted(set(spec) - set(FAULT_KEYS))
        if unknown:
            raise ValueError(f"unknown fault {', '.join(unknown)}; known: {', '.join(FAULT_KEYS)}")
        slowdown = spec.get("slowdown")
        if slowdown is not None and (
            isinstance(slowdown, bool)
            or not isinstance(slowdown, int | float)
            or not math.isfinite(slowdown)
            or slowdown <= 0
        ):
            raise ValueError(f"slowdown must be a number > 0; got {slowdown!r}")
        error_rate = spec.get("error_rate")
        if error_rate is not None and (
            isinstance(error_rate, bool) or not isinstance(error_rate, int | float) or not 0 <= error_rate <= 1
        ):
            raise ValueError(f"error_rate must be a number in [0, 1]; got {error_rate!r}")
        for key in ("hang", "crash"):
            if key in spec and not isinstance(spec[key], bool):
                raise ValueError(f"{key} must be true or false; got {spec[key]!r}")
        cold = spec.get("cold_start_s")
        if cold is not None and (
            isinstance(cold, bool) or not isinstance(cold, int | float) or not math.isfinite(cold) or cold < 0
        ):
            raise ValueError(f"cold_start_s must be a number >= 0; got {cold!r}")
        if "kv_events_pause" in spec and not isinstance(spec["kv_events_pause"], bool):
            raise ValueError(f"kv_events_pause must be true or false; got {spec['kv_events_pause']!r}")
        drop = spec.get("kv_events_drop")
        if drop is not None and (
            isinstance(drop, bool) or not isinstance(drop, int | float) or drop < 0 or drop != int(drop)
        ):
            raise ValueError(f"kv_events_drop must be a whole number >= 0; got {drop!r}")
        publisher = self.kv_events
        if publisher is None and ("kv_events_pause" in spec or drop is not None):
            raise ValueError("kv_events_pause and kv_events_drop need KV events on (kv_events_port)")
        self.sync()
        engine = self.engine
        if cold is not None:
            self._cold_start_s = float(cold)
        if slowdown is not None:
            engine.set_slowdown(float(slowdown))
        if error_rate is not None:
            engine.error_rate = float(error_rate)
        if publisher is not None and "kv_events_pause" in spec:
            publisher.pause(bool(spec["kv_events_pause"]))
        if publisher is not None and drop is not None:
            publisher.drop_next(int(drop))
        if "hang" in spec:
            engine.set_hung(bool(spec["hang"]))
        if spec.get("crash"):
            engine.restart(cold_start=False)
            engine.ready_at = engine.now + self._cold_start_s
            logger.info("sim %s: crashed; ready again in %.1f s (engine time)", self.address, self._cold_start_s)
        self.sync()
        self._kick.set()

    def kv_blocks(self) -> dict[str, Any]:
        """The hashes cached now (held or free), sorted; with KV events on, ``next_seq``: the events of batches
        ``< next_seq`` (all published by now) describe exactly this set."""
        self.sync()
        kv = self.kv_events
        return {
            "server": self.address,
            "block_size": self.profile.block_size,
            "blocks": sorted(self.engine.cache.cached_hashes()),
            "next_seq": None if kv is None else kv.next_seq,
        }

    # ---- GPU view -------------------------------------------------------------------------------------------

    def gpu_report(self) -> GpuReport:
        """Utilisation = the share of the last second (engine time) spent in steps; memory = what vLLM
        pre-allocates (``gpu_memory_utilization`` of each GPU), as nvidia-smi shows under vLLM."""
        self.sync()
        now, busy = self.engine.now, self.engine.busy_s
        then, busy_then = now, busy
        for t, b in reversed(self._gpu_samples):
            then, busy_then = t, b
            if now - t >= _GPU_WINDOW_S:
                break
        util = 0.0 if now <= then else min(1.0, max(0.0, (busy - busy_then) / (now - then)))
        profile = self.profile
        used = int(profile.gpu_memory_bytes * profile.gpu_memory_utilization) if self.engine.ready else 0
        gpus = tuple(
            GpuInfo(i, uuid, profile.gpu, round(util * 100, 1), used, profile.gpu_memory_bytes)
            for i, uuid in enumerate(self._gpu_uuids)
        )
        return GpuReport("emulated", self.address, time.time(), gpus)

    # ---- HTTP -----------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        self._ensure_driver()
        path, method = scope["path"], scope["method"]
        route = f"{method} {path if path in _ROUTES else '(other)'}"
        counts = self.route_counts

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                counts[f"{route} {message['status']}"] += 1
            await send(message)

        await self._route(scope, receive, counted)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen = b""
        for name, value in scope["headers"]:
            if name == _DEST_REQUEST_HEADER:
                seen = value
        headers = [*self._headers, (SEEN_DEST_HEADER.encode(), seen)]
        path, method = scope["path"], scope["method"]
        allowed = _ROUTES.get(path)
        if allowed is None:
            await _send_error(send, 404, f"Not Found: {path}", headers)
            return
        if method not in allowed:
            headers.append((b"allow", ", ".join(allowed).encode()))
            await _send_error(send, 405, f"Method Not Allowed: {method} {path}", headers)
            return
        if path not in _ALWAYS_UP:
            self.sync()
            if not self.engine.ready:
                await _send_error(send, 503, "the server is starting (cold start)", headers, kind="ServiceUnavailable")
                return
        if path == "/health":
            await _send(send, 200, b"", headers, b"text/plain")
        elif path == "/v1/models":
            await _send_json(send, 200, self._models_body(), headers)
        elif path == "/metrics":
            await _send(send, 200, self._render_metrics(), headers, b"text/plain; version=0.0.4; charset=utf-8")
        elif path == "/gpu":
            await _send_json(send, 200, self.gpu_report().to_json(), headers)
        elif path == "/admin/requests":
            # busy_s: time spent in engine steps since start (the benchmarks' load-imbalance figure).
            body = {"server": self.address, "busy_s": self.engine.busy_s, "requests": list(self._log)}
            await _send_json(send, 200, body, headers)
        elif path == "/admin/routes":
            await _send_json(send, 200, {"server": self.address, "routes": dict(self.route_counts)}, headers)
        elif path == "/admin/kv-blocks":
            await _send_json(send, 200, self.kv_blocks(), headers)
        elif path == "/admin/faults":
            await self._faults_route(method, receive, send, headers)
        elif path == "/tokenize":
            await self._tokenize(receive, send, headers)
        elif path == "/v1/completions/render":
            await self._render(receive, send, headers)
        else:
            await self._generate(scope, receive, send, headers, chat=path == "/v1/chat/completions")

    def _models_body(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(self._t0),
                    "owned_by": "vllm",
                    "root": self.profile.model,
                    "parent": None,
                    "max_model_len": self.profile.max_model_len,
                }
                for name in self.options.models
            ],
        }

    def _render_metrics(self) -> bytes:
        engine = self.engine
        queries, hits, preemptions = self._counted
        self.metrics.add_prefix_cache(engine.prefix_queries - queries, engine.prefix_hits - hits)
        self.metrics.add_preemptions(engine.preemptions - preemptions)
        self._counted = (engine.prefix_queries, engine.prefix_hits, engine.preemptions)
        self.metrics.set_state(len(engine.running), len(engine.waiting), min(1.0, engine.cache.usage))
        return self.metrics.render()

    async def _faults_route(
        self, method: str, receive: Receive, send: Send, headers: list[tuple[bytes, bytes]]
    ) -> None:
        if method == "POST":
            body = await _read_json(receive, send, headers)
            if body is None:
                return
            if not isinstance(body, dict):
                await _send_error(send, 400, "a fault spec must be a JSON object", headers)
                return
            try:
                self.apply_faults(body)
            except ValueError as exc:
                await _send_error(send, 400, str(exc), headers)
                return
        await _send_json(send, 200, self.faults(), headers)

    async def _tokenize(self, receive: Receive, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        read = await _read_parsed(receive, send, headers, lambda body: parse_tokenize(body, models=self.options.models))
        if read is not None:
            await _send_json(send, 200, tokenize_body(read[1], self.profile.max_model_len), headers)

    async def _render(self, receive: Receive, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        if not self.options.enable_scale_out:
            message = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
            await _send_error(send, 403, message, headers, kind="PermissionDeniedError")
            return
        read = await _read_parsed(receive, send, headers, lambda body: self._parse(body, chat=False))
        if read is not None:
            await _send_json(send, 200, render_body(*read), headers)

    def _parse(self, body: object, *, chat: bool) -> Prompt:
        profile, options = self.profile, self.options
        return (parse_chat if chat else parse_completion)(
            body,
            models=options.models,
            block_size=profile.block_size,
            max_model_len=profile.max_model_len,
            default_max_tokens=options.default_max_tokens,
        )

    async def _generate(
        self, scope: Scope, receive: Receive, send: Send, headers: list[tuple[bytes, bytes]], *, chat: bool
    ) -> None:
        # Latencies count from when the request arrived, as vLLM's do: reading, parsing and hashing the prompt
        # (a tokenizer's work in vLLM) are part of the time to first token. That work is CPU time, not emulated
        # GPU time, so it counts at its wall duration whatever the time scale.
        received = self._clock()
        read = await _read_parsed(receive, send, headers, lambda body: self._parse(body, chat=chat))
        if read is None:
            return
        prompt = read[1]
        trace = _trace_headers(scope["headers"])
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        ids: Sequence[int] = ()
        if self.kv_events is not None:  # BlockStored carries the blocks' token ids
            ids = token_ids(prompt.source) if isinstance(prompt.source, str) else prompt.source
        request = SimRequest(rid, prompt.prompt_tokens, prompt.max_tokens, prompt.hashes, token_ids=ids)
        self.sync()
        if not self.engine.add(request):
            self.injected_errors += 1
            await _send_error(send, 500, "injected fault: internal server error", headers, kind="InternalServerError")
            return
        request.arrival -= self._clock() - received
        active = _Active(request, prompt, trace)
        self._active[id(request)] = active
        self._kick.set()
        watcher = asyncio.create_task(self._watch_disconnect(receive, active))
        try:
            if prompt.stream:
                await self._stream(send, headers, active)
            else:
                await self._respond(send, headers, active)
        finally:
            watcher.cancel()
            if request.state in (RequestState.WAITING, RequestState.RUNNING):
                self.engine.abort(request)
                self.sync()  # logs it as aborted, unless it is in the engine step now running
            if active.logged or request.state is not RequestState.ABORTED:
                self._active.pop(id(request), None)
            else:  # it leaves the engine when the running step ends: `sync` logs it then, and lets it go
                active.closed = True

    async def _watch_disconnect(self, receive: Receive, active: _Active) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        active.disconnected = True
        active.event.set()

    async def _respond(self, send: Send, headers: list[tuple[bytes, bytes]], active: _Active) -> None:
        request = active.request
        while request.state in (RequestState.WAITING, RequestState.RUNNING) and not active.disconnected:
            await active.event.wait()
            active.event.clear()
        if active.disconnected:
            return
        if request.state is not RequestState.FINISHED:
            await _send_error(
                send, 500, "the server crashed while serving this request", headers, kind="InternalServerError"
            )
            return
        body = completion_body(request.id, active.prompt, request.output)
        await _send(send, 200, body, headers, b"application/json")

    async def _stream(self, send: Send, headers: list[tuple[bytes, bytes]], active: _Active) -> None:
        request, prompt = active.request, active.prompt
        start = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *headers]
        await send({"type": "http.response.start", "status": 200, "headers": start})
        while not active.disconnected:
            await active.event.wait()
            active.event.clear()
            if active.disconnected:
                return
            state = request.state
            if state is RequestState.ABORTED:
                # A crash: the connection drops mid-stream, as it would when a real server dies.
                raise ConnectionAbortedError(f"{self.address} crashed during {request.id}")
            final = state is RequestState.FINISHED
            out = request.output
            if out > active.sent or final:
                chunk = chunk_event(
                    request.id, prompt, active.created, active.sent, out, final=final, with_usage=prompt.include_usage
                )
                active.sent = out
                await send({"type": "http.response.body", "body": chunk, "more_body": not final})
            if final:
                return


def _trace_headers(raw: Sequence[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    parent = state = None
    for name, value in raw:
        if name == b"traceparent":
            parent = value.decode("latin-1")
        elif name == b"tracestate":
            state = value.decode("latin-1")
    return parent, state


async def _read_parsed(
    receive: Receive, send: Send, headers: list[tuple[bytes, bytes]], parse: Callable[[Any], _Parsed]
) -> tuple[Any, _Parsed] | None:
    """The JSON body and what ``parse`` made of it, or None after answering (400 for a `BadRequest`, 413) or when
    the client left."""
    body = await _read_json(receive, send, headers)
    if body is None:
        return None
    try:
        return body, parse(body)
    except BadRequest as exc:
        await _send_bad_request(send, exc, headers)
        return None


async def _read_json(receive: Receive, send: Send, headers: list[tuple[bytes, bytes]]) -> Any:
    """The decoded JSON body, or None after answering (400/413) or when the client left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _MAX_BODY:
            await _send_error(send, 413, f"request body exceeds {_MAX_BODY} bytes", headers)
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    try:
        return orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        await _send_error(send, 400, f"request body is not valid JSON: {exc}", headers)
        return None


async def _send(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]], content_type: bytes) -> None:
    start = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send: Send, status: int, payload: object, headers: list[tuple[bytes, bytes]]) -> None:
    await _send(send, status, orjson.dumps(payload), headers, b"application/json")


async def _send_bad_request(send: Send, exc: BadRequest, headers: list[tuple[bytes, bytes]]) -> None:
    kind = "BadRequestError" if exc.status == 400 else "NotFoundError"
    await _send_error(send, exc.status, str(exc), headers, kind=kind)


async def _send_error(
    send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]], *, kind: str = "BadRequestError"
) -> None:
    # vLLM's error shape: {"error": {"message", "type", "param", "code"}}.
    payload = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    await _send_json(send, status, payload, headers)

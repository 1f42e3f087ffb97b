"""The vLLM emulator's per-request OpenTelemetry span, shaped like the one vLLM exports with ``--otlp-traces-endpoint``.

vLLM (V1 engine, ``OutputProcessor.do_tracing``) ends one span per finished request:

- name ``llm_request``, kind ``SERVER``, instrumentation scope ``vllm.llm_engine``;
- parent: the W3C ``traceparent``/``tracestate`` headers of the HTTP request (no headers: a new root trace);
- start: the request's arrival time; end: when the engine saw the last token;
- attributes (latencies in seconds as doubles, counts as ints):

  - ``gen_ai.latency.time_to_first_token`` (double): arrival to first token;
  - ``gen_ai.latency.e2e`` (double): arrival to finish;
  - ``gen_ai.latency.time_in_queue`` (double): waiting before the first schedule;
  - ``gen_ai.latency.time_in_model_prefill`` (double, if given): first schedule to first token;
  - ``gen_ai.latency.time_in_model_decode`` (double, if given): first token to last token;
  - ``gen_ai.latency.time_in_model_inference`` (double, if both given): prefill + decode;
  - ``gen_ai.usage.prompt_tokens``, ``gen_ai.usage.completion_tokens`` (int);
  - ``gen_ai.request.id`` (string): the id the client sees (``cmpl-...``/``chatcmpl-...``);
  - ``gen_ai.response.model`` (string): the served model name;
  - ``gen_ai.request.max_tokens`` (int), ``gen_ai.request.temperature`` (double), ``gen_ai.request.top_p``
    (double), ``gen_ai.request.n`` (int): only when set and non-zero, as vLLM does (so greedy
    ``temperature=0`` is absent).

``gen_ai.response.model`` is what vLLM's V0 engine set; V1 dropped it, but a receiver that splits traffic by
model needs it, so it is kept. V0's ``gen_ai.usage.num_sequences`` and scheduler/forward timings are not emitted.

The latency attributes are whatever the emulator reports. The emulator may run on a virtual clock faster than real
time, so ``gen_ai.latency.e2e`` need not equal the span's ``end - start``: the span's times are wall-clock instants
(for ordering and joining with the caller's spans), the attributes are the emulated engine's own measurements.

The exporter is built by `inferlb.otel.tracing.create_tracer_provider`; nothing here reads or sets the global tracer
or meter provider.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["INSTRUMENTATION_SCOPE", "SERVICE_NAME", "SPAN_NAME", "RequestSpans"]

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"
"""The span name vLLM gives its per-request span."""

INSTRUMENTATION_SCOPE = "vllm.llm_engine"
"""The tracer (instrumentation scope) name vLLM creates its request tracer under."""

SERVICE_NAME = "vllm"
"""The ``service.name`` of vLLM's span resource."""


class RequestSpans:
    """Emits one vLLM-style ``llm_request`` span per finished request to the given tracer provider.

    Contract:

    - `record` builds and ends the span synchronously and returns; with a batching provider (as built by
      `create_tracer_provider`) that is an append to the SDK's bounded queue, and the export happens on the SDK's
      worker thread. It never raises: any failure (bad input, SDK error) is logged once and counted in `errors`.
    - `record` may be called from any thread. ``errors`` is read without a lock; it only ever grows.
    - `shutdown` flushes pending spans and shuts the provider down (this object owns it). It is idempotent and
      thread-safe; `record` after `shutdown` emits nothing and counts an error.
    """

    def __init__(self, tracer_provider: trace_api.TracerProvider) -> None:
        self._provider = tracer_provider
        self._tracer = tracer_provider.get_tracer(INSTRUMENTATION_SCOPE)
        self._propagator = TraceContextTextMapPropagator()
        self._lock = threading.Lock()
        self._closed = False
        self.errors = 0
        """Requests whose span could not be emitted (failures and calls after `shutdown`)."""

    def record(
        self,
        *,
        traceparent: str | None,
        tracestate: str | None,
        request_id: str,
        model: str,
        start_ns: int,
        end_ns: int,
        ttft_s: float,
        e2e_s: float,
        queue_s: float,
        prompt_tokens: int,
        completion_tokens: int,
        max_tokens: int | None,
        prefill_s: float | None = None,
        decode_s: float | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        n: int | None = None,
    ) -> None:
        """Emit the span of one finished request.

        ``start_ns``/``end_ns`` are Unix-epoch nanoseconds (``time.time_ns()``), the request's arrival and finish;
        an ``end_ns`` before ``start_ns`` is raised to ``start_ns``. The ``*_s`` values are seconds and may be
        emulated (virtual) time; they are exported as given. ``traceparent``/``tracestate`` are the request's W3C
        headers; an absent or malformed ``traceparent`` starts a new trace. ``max_tokens``, ``temperature``,
        ``top_p`` and ``n`` are omitted when None or zero, as vLLM does. Never raises.
        """
        if self._closed:
            self._count_error(None)
            return
        try:
            carrier: dict[str, str] = {}
            if traceparent:
                carrier["traceparent"] = traceparent
                if tracestate:
                    carrier["tracestate"] = tracestate
            # An explicit empty base context: the span's parent is the request's header or nothing, never whatever
            # span happens to be current in the caller's task.
            parent = self._propagator.extract(carrier, context=Context())
            attributes: dict[str, Any] = {
                "gen_ai.response.model": str(model),
                "gen_ai.request.id": str(request_id),
                "gen_ai.latency.time_to_first_token": float(ttft_s),
                "gen_ai.latency.e2e": float(e2e_s),
                "gen_ai.latency.time_in_queue": float(queue_s),
                "gen_ai.usage.prompt_tokens": int(prompt_tokens),
                "gen_ai.usage.completion_tokens": int(completion_tokens),
            }
            if prefill_s is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = float(prefill_s)
            if decode_s is not None:
                attributes["gen_ai.latency.time_in_model_decode"] = float(decode_s)
            if prefill_s is not None and decode_s is not None:
                attributes["gen_ai.latency.time_in_model_inference"] = float(prefill_s) + float(decode_s)
            if max_tokens:
                attributes["gen_ai.request.max_tokens"] = int(max_tokens)
            if temperature:
                attributes["gen_ai.request.temperature"] = float(temperature)
            if top_p:
                attributes["gen_ai.request.top_p"] = float(top_p)
            if n:
                attributes["gen_ai.request.n"] = int(n)
            start = int(start_ns)
            span = self._tracer.start_span(
                SPAN_NAME,
                context=parent,
                kind=trace_api.SpanKind.SERVER,
                attributes=attributes,
                start_time=start,
            )
            span.end(end_time=max(start, int(end_ns)))
        except Exception as exc:
            self._count_error(exc)

    def _count_error(self, exc: Exception | None) -> None:
        with self._lock:
            self.errors += 1
            first = self.errors == 1
        if first:
            if exc is None:
                logger.warning("request span dropped: RequestSpans is shut down (further drops are only counted)")
            else:
                logger.warning("request span dropped: %r (further failures are only counted)", exc)

    def shutdown(self) -> None:
        """Flush pending spans and shut the provider down; later calls do nothing.

        Blocks until the provider's processors finish; with `create_tracer_provider`'s provider and a dead
        collector that is a few export timeouts at most.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        shutdown = getattr(self._provider, "shutdown", None)
        if shutdown is None:
            return
        try:
            shutdown()
        except Exception:
            logger.exception("tracer provider shutdown failed")

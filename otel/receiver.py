"""The OTLP trace receiver: takes the servers' spans over gRPC and turns them into per-endpoint latency.

Each `llm_request` span (vLLM's; any span with ``gen_ai.latency.time_to_first_token`` or ``gen_ai.latency.e2e``
counts) is joined to the endpoint that served it: first by trace id, through the `TraceJoin` the picker fills at
decision time (it injects the trace id into the upstream request), else by the span's resource naming the
server (``server.address`` + ``server.port``). Envoy's own spans are accepted and counted. Nothing a client
sends can hurt the picker: the Export handler only queues the request (a bounded queue; a full queue drops and
counts), a consumer task processes it in the background, and every malformed field is skipped and counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from inferlb.otel.heatmap import (
    E2E_ATTRIBUTE,
    LLM_SPAN,
    TTFT_ATTRIBUTE,
    HeatmapAggregator,
    latency_seconds,
    otlp_attributes,
    span_endpoint,
)

__all__ = ["LLM_SPAN", "ReceiverStats", "SpanReceiver", "TraceJoin"]

logger = logging.getLogger(__name__)


class TraceJoin:
    """Trace id (16 bytes) -> endpoint index of the decision that started it; the newest ``capacity`` kept."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._map: OrderedDict[bytes, int] = OrderedDict()

    def record(self, trace_id: bytes, endpoint: int) -> None:
        self._map[trace_id] = endpoint
        if len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def get(self, trace_id: bytes) -> int | None:
        return self._map.get(trace_id)

    def __len__(self) -> int:
        return len(self._map)


@dataclass(slots=True)
class ReceiverStats:
    """Counters (event-loop owned)."""

    requests: int = 0
    dropped_requests: int = 0
    spans: int = 0
    llm_spans: int = 0
    joined_by_trace: int = 0
    joined_by_resource: int = 0
    unjoined: int = 0
    envoy_spans: int = 0
    malformed: int = 0


class SpanReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP TraceService. ``observe(endpoint_index, ttft_s, e2e_s)`` gets every joined latency;
    ``endpoints`` maps "ip:port" to the endpoint index (for the resource fallback); ``join`` the trace ids.

    `run` must run as a task to process what `Export` queues; queue at most ``max_queue`` requests.
    """

    def __init__(
        self,
        observe: Callable[[int, float | None, float | None], None],
        endpoints: Mapping[str, int],
        join: TraceJoin,
        *,
        max_queue: int = 1024,
        heatmap: HeatmapAggregator | None = None,
    ) -> None:
        self.observe = observe
        self.endpoints = dict(endpoints)
        self._addresses = {index: address for address, index in self.endpoints.items()}
        self.join = join
        self.heatmap = heatmap
        self.stats = ReceiverStats()
        self._queue: deque[trace_service_pb2.ExportTraceServiceRequest] = deque()
        self._max_queue = max_queue
        self._ready = asyncio.Event()

    def rebind(self, observe: Callable[[int, float | None, float | None], None], endpoints: Mapping[str, int]) -> None:
        """Feed another pool from now on (after a config reload)."""
        self.observe, self.endpoints = observe, dict(endpoints)
        self._addresses = {index: address for address, index in self.endpoints.items()}

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.stats.requests += 1
        if len(self._queue) >= self._max_queue:
            self.stats.dropped_requests += 1
            response = trace_service_pb2.ExportTraceServiceResponse()
            spans = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            response.partial_success.rejected_spans = spans
            response.partial_success.error_message = "receiver queue full; spans dropped"
            return response
        self._queue.append(request)
        self._ready.set()
        return trace_service_pb2.ExportTraceServiceResponse()

    async def run(self) -> None:
        """Process queued requests forever (cancel to stop); yields to the loop between requests."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                self.process(self._queue.popleft())
                await asyncio.sleep(0)

    def process(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        stats = self.stats
        for resource_spans in request.resource_spans:
            resource = otlp_attributes(resource_spans.resource.attributes)
            is_envoy = str(resource.get("service.name", "")).lower().startswith("envoy")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    stats.spans += 1
                    if is_envoy:
                        stats.envoy_spans += 1
                        continue
                    try:
                        self._span(span, resource)
                    except Exception:  # a span of a shape we never imagined: skip it, count it
                        stats.malformed += 1

    def _span(self, span: Any, resource: Mapping[str, Any]) -> None:
        stats = self.stats
        attributes = otlp_attributes(span.attributes)
        if span.name != LLM_SPAN and TTFT_ATTRIBUTE not in attributes and E2E_ATTRIBUTE not in attributes:
            return
        stats.llm_spans += 1
        ttft = latency_seconds(attributes.get(TTFT_ATTRIBUTE))
        e2e = latency_seconds(attributes.get(E2E_ATTRIBUTE))
        if ttft is None and e2e is None:
            stats.malformed += 1
            return
        endpoint = self.join.get(bytes(span.trace_id)) if len(span.trace_id) == 16 else None
        if endpoint is not None:
            stats.joined_by_trace += 1
        else:
            server = span_endpoint(attributes, resource)
            endpoint = self.endpoints.get(server) if server is not None else None
            if endpoint is None:
                stats.unjoined += 1
                return
            stats.joined_by_resource += 1
        self.observe(endpoint, ttft, e2e)
        if self.heatmap is not None:
            self.heatmap.add(span.end_time_unix_nano / 1e9, self._addresses.get(endpoint), ttft, e2e)

"""The picker's latency loop: per-endpoint latency statistics, fed by the servers' spans at the OTLP receiver
(``otel.latency_source: spans``) or by the filter timing responses (``stream``), and the task that publishes
them into the signals snapshot (``ttft_s`` and ``e2e_s``: the EWMAs) for the latency scorers. The statistics,
the Prometheus histograms and the heatmap take one source only, so nothing is counted twice; with ``stream``
a configured receiver still takes spans (Envoy's, say) and counts them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import grpc
import numpy as np
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from inferlb.otel.heatmap import HeatmapAggregator
from inferlb.otel.latency import EndpointLatency
from inferlb.otel.promhist import LatencyHistograms
from inferlb.otel.receiver import SpanReceiver, TraceJoin
from inferlb.scorer.config import OtelConfig
from inferlb.scorer.pool import Pool
from inferlb.scorer.signals import Signals

__all__ = ["SpanLoop"]

logger = logging.getLogger(__name__)


class SpanLoop:
    """Receiver (if configured) + statistics + publisher for one picker. `start`/`stop` run it; `rebind` follows
    a new pool; `observe_response` is the filter's way in (``latency_source: stream``)."""

    def __init__(self, config: OtelConfig, pool: Pool, signals: Signals) -> None:
        self.config = config
        self.from_spans = config.latency_source == "spans"
        self.join = TraceJoin()
        self.pool, self.signals = pool, signals
        self.latency = EndpointLatency(len(pool), window_s=config.window_s, half_life_s=config.half_life_s)
        self.histograms = LatencyHistograms(len(pool))
        self.heatmap = HeatmapAggregator(bucket_s=config.heatmap_bucket_s)
        self._addresses = [e.address for e in pool]
        self.receiver = (
            SpanReceiver(
                self._observe if self.from_spans else _ignore,
                {e.address: e.index for e in pool},
                self.join,
                heatmap=self.heatmap if self.from_spans else None,
            )
            if config.receiver is not None
            else None
        )
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._publish(), name="latency publisher")]
        if self.receiver is None:
            return
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 8 << 20)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self.receiver, server)
        assert self.config.receiver is not None
        self.port = server.add_insecure_port(self.config.receiver)
        if not self.port:
            raise OSError(f"the OTLP receiver cannot bind {self.config.receiver}")
        await server.start()
        self._server = server
        self._tasks.append(loop.create_task(self.receiver.run(), name="otlp receiver"))
        logger.info("OTLP receiver listening on %s", self.config.receiver)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0.5)
            self._server = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    def rebind(self, pool: Pool, signals: Signals, *, keep: bool) -> None:
        """After a reload: the same pool keeps its statistics and trace ids; a new pool starts fresh."""
        self.signals = signals
        if keep:
            return
        self.pool = pool
        self._addresses = [e.address for e in pool]
        self.join = TraceJoin()
        self.latency = EndpointLatency(len(pool), window_s=self.config.window_s, half_life_s=self.config.half_life_s)
        self.histograms = LatencyHistograms(len(pool))
        if self.receiver is not None:
            self.receiver.join = self.join
            self.receiver.rebind(self._observe if self.from_spans else _ignore, {e.address: e.index for e in pool})

    def _observe(self, endpoint: int, ttft_s: float | None, e2e_s: float | None) -> None:
        self.latency.observe(endpoint, ttft_s, e2e_s)
        self.histograms.observe(endpoint, ttft_s, e2e_s)

    def observe_response(self, endpoint: int, ttft_s: float | None, e2e_s: float | None) -> None:
        """A latency the filter measured on the response stream (``latency_source: stream``)."""
        if endpoint >= len(self._addresses):
            return  # measured against a pool a reload has just replaced
        self._observe(endpoint, ttft_s, e2e_s)
        self.heatmap.add(time.time(), self._addresses[endpoint], ttft_s, e2e_s)

    def view(self) -> dict[str, Any]:
        """The statistics as arrays (for the admin API)."""
        return {k: np.asarray(v) for k, v in self.latency.arrays().items()}

    async def _publish(self) -> None:
        while True:
            await asyncio.sleep(self.config.publish_interval_s)
            arrays = self.latency.arrays()
            signals = self.signals
            if len(arrays["ttft_ewma"]) != len(signals.snapshot):
                continue  # a reload is switching pools
            signals.publish(signals.snapshot.with_values(ttft_s=arrays["ttft_ewma"], e2e_s=arrays["e2e_ewma"]))


def _ignore(endpoint: int, ttft_s: float | None, e2e_s: float | None) -> None:
    """Spans' latencies when the statistics come from the response stream: the receiver still counts them."""

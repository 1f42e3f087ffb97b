"""The picker's latency loop: per-endpoint latency statistics, fed by the servers' spans at the OTLP receiver
(``otel.latency_source: spans``) or by the filter timing responses (``stream``), and the task that publishes
them into the signals snapshot (``ttft_s`` and ``e2e_s``: the EWMAs) for the latency scorers. The statistics,
the Prometheus histograms and the heatmap take one source only, so nothing is counted twice; with ``stream``
a configured receiver still takes spans (Envoy's, say) and counts them.

Where the spans are handled: the receiver runs in a process of its own (otel/receiverproc.py: the gRPC server,
the sender allowlist and token, size, count and rate limits, decoding and the span bounds); this process only
joins the compact records it sends (otel/spanfeed.py, otel/receiver.py), in bounded slices on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from inferlb.otel.heatmap import HeatmapAggregator
from inferlb.otel.latency import EndpointLatency
from inferlb.otel.promhist import LatencyHistograms
from inferlb.otel.receiver import ReceiverStats, SpanJoiner, TraceJoin
from inferlb.otel.spanfeed import SpanFeed
from inferlb.otel.spanwire import ReceiverSettings, SpanBounds
from inferlb.scorer.config import OtelConfig
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.networks import LOOPBACK_NETWORKS, Networks, networks_of_hosts
from inferlb.scorer.pool import Pool
from inferlb.scorer.signals import Signals
from inferlb.scorer.speeds import ServerSpeeds, SpeedHints

__all__ = ["SpanLoop", "receiver_settings"]

logger = logging.getLogger(__name__)


def receiver_settings(config: OtelConfig, pool: Pool) -> ReceiverSettings:
    """What the receiver process runs with under ``config`` for ``pool``; reads the token now (``ConfigError``
    naming ``otel.receiver_auth`` if it cannot be read). The default allowlist is the pool's hosts and loopback.
    Raises ValueError if ``config.receiver`` is None."""
    if config.receiver is None:
        raise ValueError("no otel.receiver: there are no receiver settings")
    if config.allowed_senders is not None:
        allowed = Networks.of(config.allowed_senders)
    else:
        allowed = networks_of_hosts([e.host for e in pool]).union(LOOPBACK_NETWORKS)
    allowed = allowed.union(Networks.of(config.relays or ()))  # a relay sends, or it could relay nothing
    token = None
    if config.receiver_auth is not None:
        token = config.receiver_auth.read("otel.receiver_auth").reveal().decode()
    return ReceiverSettings(
        bind=config.receiver,
        allowed=allowed.cidrs(),
        token=token,
        max_message_bytes=config.receiver_max_message_bytes,
        max_spans_per_request=config.receiver_max_spans_per_request,
        max_spans_per_s=config.receiver_max_spans_per_s,
        bounds=SpanBounds(
            max_age_s=config.span_max_age_s,
            max_ahead_s=config.span_max_ahead_s,
            max_latency_s=config.span_max_latency_s,
        ),
    )


class SpanLoop:
    """Receiver (if configured) + statistics + publisher for one picker. `start`/`stop` run it; `rebind` follows
    a new pool or config; `observe_response` is the filter's way in (``latency_source: stream``).

    ``receiver`` is the `SpanFeed` (its ``stats``: `ReceiverStats`), or None without ``otel.receiver``; ``join``
    the `TraceJoin` the filter records decisions in (a new one after a pool change)."""

    def __init__(self, config: OtelConfig, pool: Pool, signals: Signals, hints: SpeedHints | None = None) -> None:
        self.config = config
        self.hints = hints  # the operator's relative speeds (pool.speeds); a reload sets it before `rebind`
        self.from_spans = config.latency_source == "spans"
        self.join = TraceJoin(max_age_s=config.join_max_age_s)
        self.pool, self.signals = pool, signals
        self.latency = EndpointLatency(len(pool), window_s=config.window_s, half_life_s=config.half_life_s)
        # The servers' speeds, learned from each routed request's predicted work and its timing (the routing unit
        # records the work, the spans or the filter's timing of the response the time; see `observed`).
        self.speeds = ServerSpeeds(len(pool), signals.clock, relative=self._relative(pool))
        self.histograms = LatencyHistograms(len(pool))
        # The heatmap's window follows the newest end time it is given: it takes none from the future.
        self.heatmap = HeatmapAggregator(
            bucket_s=config.heatmap_bucket_s, clock=time.time, max_ahead_s=config.span_max_ahead_s
        )
        self._addresses = [e.address for e in pool]
        self._indices = {address: i for i, address in enumerate(self._addresses)}
        self.receiver: SpanFeed | None = None
        if config.receiver is not None:
            joiner = SpanJoiner(
                self._observe if self.from_spans else _ignore,
                self._addresses,
                self.join,
                ReceiverStats(),
                heatmap=self.heatmap if self.from_spans else None,
                by_name=config.join_by_name,
                relays=Networks.of(config.relays or ()),
            )
            # The token is read at start; until then the settings hold none and nothing runs.
            self.receiver = SpanFeed(_untokened(config, pool), joiner)
        self.port: int | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start publishing and the receiver process (reads the receiver's token: ``ConfigError`` if it cannot;
        ``OSError`` if the receiver cannot listen)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._publish(), name="latency publisher")]
        if self.receiver is None:
            return
        try:
            self.receiver.settings = receiver_settings(self.config, self.pool)
            self.port = await self.receiver.start()
        except BaseException:
            await self.stop()
            raise
        logger.info("OTLP receiver listening on %s (its own process)", self.config.receiver)

    async def stop(self) -> None:
        if self.receiver is not None:
            await self.receiver.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    def rebind(
        self,
        pool: Pool,
        signals: Signals,
        *,
        keep: bool,
        config: OtelConfig | None = None,
        mapping: np.ndarray | None = None,
        restarted: Sequence[int] = (),
    ) -> None:
        """After a reload: the same pool (``keep``) keeps its statistics and trace ids. After a membership change
        (``mapping``: endpoint j of ``pool`` was endpoint ``mapping[j]``, -1 if it joined) each endpoint that
        stays keeps its own, under its new index: latency statistics, ``/metrics`` histograms and the decisions
        waiting for their spans; one that joined starts with none, and so do the latency statistics of those
        ``restarted`` (indices in ``pool``: a restarted server is cold). Otherwise a new pool starts fresh.
        Never raises.

        The receiver process gets the new allowlist (the default one follows the pool) and, with ``config`` (the
        reloaded ``otel`` section), the new limits and the token read again; a token that cannot be read now is
        logged and the one in force stays (the receiver never opens up). To refuse such a reload instead, call
        `receiver_settings` first: it raises ``ConfigError``."""
        self.signals = signals
        if config is not None:
            self.config = config
            if self.receiver is not None:
                self.receiver.joiner.by_name = config.join_by_name
                self.receiver.joiner.relays = Networks.of(config.relays or ())
        if not keep:
            self.pool = pool
            self._addresses = [e.address for e in pool]
            self._indices = {address: i for i, address in enumerate(self._addresses)}
            if mapping is not None and len(mapping) == len(pool):
                cold = np.array(mapping, copy=True)
                cold[list(restarted)] = -1
                self.latency = self.latency.moved(cold)
                # A restarted server runs on the same hardware.
                self.speeds = self.speeds.moved(mapping, self._relative(pool))
                self.histograms = self.histograms.moved(mapping)
                self.join.remap(mapping)
            else:
                self.join = TraceJoin(max_age_s=self.config.join_max_age_s)
                self.latency = EndpointLatency(
                    len(pool), window_s=self.config.window_s, half_life_s=self.config.half_life_s
                )
                self.speeds = ServerSpeeds(len(pool), signals.clock, relative=self._relative(pool))
                self.histograms = LatencyHistograms(len(pool))
            if self.receiver is not None:
                observe = self._observe if self.from_spans else _ignore
                self.receiver.joiner.rebind(observe, self._addresses, self.join)
        else:  # the same endpoints, whose labels or declared speeds may have changed
            self.speeds.relate(self._relative(pool))
        if self.receiver is None or (keep and config is None):
            return
        try:
            settings = receiver_settings(self.config, self.pool)
        except ConfigError as exc:
            logger.error("the OTLP receiver keeps the token it had: %s", exc)
            settings = replace(_untokened(self.config, self.pool), token=self.receiver.settings.token)
        self.receiver.update(settings)

    def _relative(self, pool: Pool) -> np.ndarray | None:
        return None if self.hints is None else self.hints.of([e.labels for e in pool])

    def _observe(self, endpoint: int, ttft_s: float | None, e2e_s: float | None) -> None:
        self.latency.observe(endpoint, ttft_s, e2e_s)
        self.histograms.observe(endpoint, ttft_s, e2e_s)

    def observe_response(self, address: str, ttft_s: float | None, e2e_s: float | None) -> None:
        """A latency the filter measured on the response stream (``latency_source: stream``) of a request sent to
        ``address``; nothing if it is not in the pool any more (by address: a membership change since the request
        was routed moves the others' indices)."""
        endpoint = self._indices.get(address)
        if endpoint is None:
            return
        self._observe(endpoint, ttft_s, e2e_s)
        self.heatmap.add(time.time(), address, ttft_s, e2e_s)

    def observed(
        self, request_id: str, ttft_s: float | None, e2e_s: float | None, output_tokens: int | None = None
    ) -> None:
        """A routed request's latencies, by its request id (a span joined to its decision, or the filter's timing
        of its response): what the servers' speeds are learned from."""
        self.speeds.observed(request_id, ttft_s, e2e_s, output_tokens)

    def view(self) -> dict[str, Any]:
        """The statistics as arrays (for the admin API)."""
        return {k: np.asarray(v) for k, v in self.latency.arrays().items()}

    async def _publish(self) -> None:
        while True:
            await asyncio.sleep(self.config.publish_interval_s)
            self.join.expire()  # decisions whose span never came, even while no new decision is recorded
            self.speeds.forget_pending()
            arrays = self.latency.arrays()
            signals = self.signals
            if len(arrays["ttft_ewma"]) != len(signals.snapshot) or self.speeds.size != len(signals.snapshot):
                continue  # a reload is switching pools
            signals.publish(
                signals.snapshot.with_values(
                    ttft_s=arrays["ttft_ewma"],
                    e2e_s=arrays["e2e_ewma"],
                    prefill_tokens_per_s=self.speeds.prefill_tokens_per_s(),
                    decode_step_s=self.speeds.decode_step_s(),
                    peak_tokens_per_s=self.speeds.peak_tokens_per_s(),
                )
            )


def _untokened(config: OtelConfig, pool: Pool) -> ReceiverSettings:
    """`receiver_settings` without reading the token (it is None here)."""
    return receiver_settings(replace(config, receiver_auth=None), pool)


def _ignore(endpoint: int, ttft_s: float | None, e2e_s: float | None) -> None:
    """Spans' latencies when the statistics come from the response stream: the receiver still counts them."""

"""The KV-event collector: follows every endpoint's KV-event publisher and keeps `KVBlockIndex` up to date.

One ZMQ SUB socket per endpoint, connected to ``tcp://ENDPOINT_IP:port`` (the endpoint's own address, so only
pool members inside the allowed networks are ever contacted), read by its own task. A socket monitor says when
the connection is up; only then is the endpoint's stream `subscribed`.

Sequence numbers rise by one per batch. A gap is asked of the server's replay socket (a DEALER to
``ENDPOINT_IP:replay_port``, bounded by ``replay_timeout_s``); what replay cannot give makes the endpoint unsure
for a while (`KVBlockIndex.lost`). A sequence that goes back means the server restarted: its cache is empty and
the index forgets it. The last sequence applied is kept in the index's state of the endpoint, so the collector of
the next pool (after a membership change) goes on from it. The first batch ever seen from an endpoint whose
sequence is past 0 means events were published before the picker listened: the start is asked of replay the same
way. A batch that cannot be decoded counts as
missed. Nothing here runs on the routing path: decisions read the index, which this collector updates between
them.

A publisher is a pool member, but what it sends costs the picker's CPU: a batch at the 1 MiB limit takes up to
about 0.1 s to decode and 50 ms to apply. So each endpoint has a budget of bytes (``max_bytes_per_s``, with one
batch at the limit as its burst; replays draw on it too): a batch over it is dropped and the endpoint counted
unsure, as for a lost one. Batches are decoded in a worker thread (the loop runs meanwhile: `decode_batch` bounds
what msgpack's unpacker, which holds the GIL, does between two Python calls) and applied in slices of
`APPLY_SLICE` events, the loop free between them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from inferlb.scorer.address import parse_address
from inferlb.scorer.kvevents import (
    END_SEQUENCE,
    MAX_PAYLOAD_BYTES,
    EventBatch,
    KVEventError,
    decode_frames,
    sequence_bytes,
)
from inferlb.scorer.kvindex import KVBlockIndex
from inferlb.scorer.pool import Pool

__all__ = ["KVEventCollector", "KVEventOptions"]

logger = logging.getLogger(__name__)

# How often pending blocks lapse and liveness is recomputed.
TICK_S = 0.25
# At most this many batches are taken from one replay (vLLM buffers 10,000 steps by default).
MAX_REPLAY_BATCHES = 20_000
# Events applied to the index between two yields to the event loop (a few milliseconds).
APPLY_SLICE = 4096


@dataclass(frozen=True, slots=True)
class KVEventOptions:
    """Where each endpoint publishes (``port`` and, optionally, ``replay_port`` on the endpoint's IP), the topic
    it publishes under, and how long a replay may take."""

    port: int
    replay_port: int | None = None
    topic: str = ""
    replay_timeout_s: float = 2.0
    # By endpoint address: ports other than the common ones (several servers on one IP).
    ports: Mapping[str, int] = field(default_factory=dict)
    replay_ports: Mapping[str, int] = field(default_factory=dict)
    # What one endpoint may send a second, on average (its burst: one batch at MAX_PAYLOAD_BYTES).
    max_bytes_per_s: int = 1 << 20


class KVEventCollector:
    """Follows the KV events of every endpoint of ``pool`` into ``index`` (one per pool: a membership change
    makes a new collector over the moved index). `run` until cancelled; `aclose` releases the sockets."""

    def __init__(self, pool: Pool, index: KVBlockIndex, options: KVEventOptions) -> None:
        if len(pool) != index.size:
            raise ValueError(f"the KV index has {index.size} endpoints, the pool {len(pool)}")
        self.pool = pool
        self.index = index
        self.options = options
        self.errors: Counter[str] = Counter()
        self.batches = 0
        self.replayed = 0
        self._context = zmq.asyncio.Context()
        self._warned: set[tuple[int, str]] = set()
        self._budget = [_Budget(options.max_bytes_per_s, MAX_PAYLOAD_BYTES) for _ in pool]

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._follow(e.index, e.address)) for e in self.pool]
        tasks.append(asyncio.create_task(self._tick()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        self._context.destroy(linger=0)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.index.tick()

    async def _follow(self, endpoint: int, address: str) -> None:
        host = parse_address(address)[0]
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, 1)  # else a connect to an IPv6 endpoint ([fd00::7]) never happens
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        sub.setsockopt(zmq.SUBSCRIBE, self.options.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(f"tcp://{_bracketed(host)}:{self.options.ports.get(address, self.options.port)}")
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                for socket, _ in await poller.poll():
                    if socket is monitor:
                        event = parse_monitor_message(await monitor.recv_multipart())
                        self.index.subscribed(endpoint, event["event"] == zmq.EVENT_CONNECTED)
                    else:
                        frames = await sub.recv_multipart()
                        try:
                            await self._received(endpoint, address, frames)
                        except Exception as exc:  # one message never ends this stream, nor (through run) the pool's
                            self._error(endpoint, "failed", f"a batch failed: {type(exc).__name__}: {exc}")
                            self.index.lost(endpoint)
        finally:
            self.index.subscribed(endpoint, False)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _received(self, endpoint: int, address: str, frames: list[bytes]) -> None:
        size = sum(map(len, frames))
        if not self._budget[endpoint].take(size):
            self._error(
                endpoint,
                "over_budget",
                f"a batch of {size} bytes over the budget of {self.options.max_bytes_per_s} a second",
            )
            self.index.lost(endpoint)
            if len(frames) == 3 and len(frames[1]) == 8:  # skipped, not replayed: a replay would cost as much
                self.index.states[endpoint].sequence = int.from_bytes(frames[1], "big", signed=True)
            return
        try:
            sequence, batch = await asyncio.to_thread(decode_frames, frames)
        except KVEventError as exc:
            self._error(endpoint, "undecodable", str(exc))
            self.index.lost(endpoint)
            return
        last = self.index.states[endpoint].sequence
        if last is not None and sequence <= last:
            # The sequence went back: a restarted server, whose cache starts empty.
            logger.info("KV events of endpoint %d restarted at sequence %d (was %d)", endpoint, sequence, last)
            self.index.clear(endpoint)
            last = None
        expected = 0 if last is None else last + 1
        if sequence > expected:
            filled = await self._replay(endpoint, address, expected, sequence)
            if not filled:
                self.index.lost(endpoint)
        await self._apply(endpoint, batch)
        self.batches += 1
        self.index.states[endpoint].sequence = sequence

    async def _apply(self, endpoint: int, batch: EventBatch) -> None:
        """Apply ``batch`` in order, in slices of `APPLY_SLICE` events with the event loop free between them."""
        events = batch.events
        if len(events) <= APPLY_SLICE:
            self.index.apply(endpoint, batch)
            return
        for start in range(0, len(events), APPLY_SLICE):
            self.index.apply(
                endpoint, EventBatch(batch.ts, events[start : start + APPLY_SLICE], batch.data_parallel_rank)
            )
            await asyncio.sleep(0)

    async def _replay(self, endpoint: int, address: str, start: int, stop: int) -> bool:
        """Apply, in order, what the server's replay socket still holds of the batches ``start`` .. ``stop - 1``;
        whether every one of them came (a buffer that begins later still gives the rest)."""
        host = parse_address(address)[0]
        port = self.options.replay_ports.get(address, self.options.replay_port)
        if port is None:
            self._error(endpoint, "gap", f"events {start}..{stop - 1} missed and no replay_port is configured")
            return False
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        dealer.connect(f"tcp://{_bracketed(host)}:{port}")
        wanted, complete = start, True
        try:
            await dealer.send_multipart([b"", sequence_bytes(start)])
            for _ in range(MAX_REPLAY_BATCHES):
                # Each reply within the timeout, not the whole replay: a full buffer (10,000 batches) takes longer
                # to decode and apply than a reply takes to come, and a replay cut short leaves the endpoint unsure.
                async with asyncio.timeout(self.options.replay_timeout_s):
                    frames = await dealer.recv_multipart()
                if len(frames) == 3:  # vLLM before 0.32: [b"", sequence, payload], no topic
                    frames = [frames[0], b"", *frames[1:]]
                elif len(frames) != 4:
                    raise KVEventError(f"a replay reply has 3 or 4 frames, not {len(frames)}")
                if frames[2] == sequence_bytes(END_SEQUENCE):
                    break
                size = sum(map(len, frames))
                if not self._budget[endpoint].take(size):
                    raise KVEventError(
                        f"a replayed batch of {size} bytes, over the budget of {self.options.max_bytes_per_s} B/s"
                    )
                sequence, batch = await asyncio.to_thread(decode_frames, frames[1:])
                if sequence < wanted:
                    continue
                if sequence >= stop:
                    break
                complete = complete and sequence == wanted  # a later start: the buffer lost the first ones
                await self._apply_replayed(endpoint, batch)
                wanted = sequence + 1
        except TimeoutError:
            self._error(
                endpoint,
                "replay",
                f"replay of events {start}..{stop - 1} failed: no reply within {self.options.replay_timeout_s} s "
                f"({wanted - start} of {stop - start} batches came)",
            )
        except Exception as exc:  # whatever a reply holds, the replay fails and the stream goes on
            reason = str(exc) or type(exc).__name__
            self._error(endpoint, "replay", f"replay of events {start}..{stop - 1} failed: {reason}")
        finally:
            dealer.close(linger=0)
        if complete and wanted != stop:
            self._error(endpoint, "replay", f"replay gave events {start}..{wanted - 1} of {start}..{stop - 1}")
        return complete and wanted == stop

    async def _apply_replayed(self, endpoint: int, batch: EventBatch) -> None:
        await self._apply(endpoint, batch)
        self.replayed += 1

    def _error(self, endpoint: int, kind: str, message: str) -> None:
        self.errors[kind] += 1
        if (endpoint, kind) not in self._warned:  # once per endpoint and kind: a broken publisher would flood
            self._warned.add((endpoint, kind))
            logger.warning("KV events of endpoint %d: %s", endpoint, message)


class _Budget:
    """A token bucket of bytes: ``rate`` a second, at most ``burst`` saved up (full at the start)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.level, self.at = burst, clock()

    def take(self, size: int) -> bool:
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if size > self.level:
            return False
        self.level -= size
        return True


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host

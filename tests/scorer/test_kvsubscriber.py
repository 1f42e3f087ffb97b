"""The KV-event collector against a publisher made here with real ZMQ sockets (PUB and a replay ROUTER, framed as
vLLM frames them): gaps are replayed, a buffer that lost the start still gives the rest, a restarted server's
cache is forgotten, and garbage counts as missed."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from inferlb.procs import free_port
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.kvindex import KVBlockIndex
from inferlb.scorer.kvsubscriber import APPLY_SLICE, KVEventCollector, KVEventOptions, _Budget
from inferlb.scorer.pool import Pool
from inferlb.scorer.tokenizer import cache_keys

from ..conftest import LoopTurns, until

B = 4
END = (-1).to_bytes(8, "big", signed=True)


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> bytes:
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": B,
        "lora_id": None,
        "medium": "GPU",
    }
    return msgpack.packb([0.0, [event], 0])


@dataclass
class Publisher:
    """A server's publisher: ``send`` numbers a payload and keeps it for replay (``live=False``: kept, not sent).

    An XPUB socket: a PUB drops what it sends before the subscriber's subscription has reached it, which can come
    after the connection is up (on a busy machine, long after), so the first live ``send`` waits for it."""

    pub: zmq.asyncio.Socket
    router: zmq.asyncio.Socket
    buffer: list[tuple[int, bytes]] = field(default_factory=list)
    next: int = 0
    joined: bool = False
    asked: list[int] = field(default_factory=list)  # the start of every replay asked
    topic_in_replay: bool = True  # vLLM 0.32's replies; before, [b"", sequence, payload]
    replay_gap_s: float = 0.0  # a slow server's pause before each replayed batch

    async def send(self, payload: bytes, *, live: bool = True) -> None:
        sequence, self.next = self.next, self.next + 1
        self.buffer.append((sequence, payload))
        if live:
            if not self.joined:
                await asyncio.wait_for(self.pub.recv(), 20.0)  # the subscription, which XPUB hands over
                self.joined = True
            await self.pub.send_multipart([b"", sequence.to_bytes(8, "big"), payload])

    async def serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.asked.append(int.from_bytes(start, "big"))
            topic = [b""] if self.topic_in_replay else []
            for sequence, payload in self.buffer:
                if sequence >= int.from_bytes(start, "big"):
                    if self.replay_gap_s:
                        await asyncio.sleep(self.replay_gap_s)
                    await self.router.send_multipart([client, b"", *topic, sequence.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", *topic, END, b""])


@contextlib.asynccontextmanager
async def publishing(host: str = "127.0.0.1") -> AsyncIterator[tuple[Publisher, KVEventOptions]]:
    context = zmq.asyncio.Context()
    pub, router = context.socket(zmq.XPUB), context.socket(zmq.ROUTER)
    port, replay_port = free_port(), free_port()
    bound = f"[{host}]" if ":" in host else host
    for socket, on in ((pub, port), (router, replay_port)):
        socket.setsockopt(zmq.IPV6, 1)
        socket.bind(f"tcp://{bound}:{on}")
    server = Publisher(pub, router)
    task = asyncio.create_task(server.serve_replays())
    try:
        yield server, KVEventOptions(port, replay_port, replay_timeout_s=5.0)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        context.destroy(linger=0)


@pytest.fixture
async def publisher() -> AsyncIterator[tuple[Publisher, KVEventOptions]]:
    async with publishing() as served:
        yield served


@contextlib.asynccontextmanager
async def following(
    options: KVEventOptions, index: KVBlockIndex | None = None, address: str = "127.0.0.1:8000"
) -> AsyncIterator[tuple[KVBlockIndex, KVEventCollector]]:
    if index is None:
        index = KVBlockIndex(1, clock=asyncio.get_running_loop().time, block_size=B)
    collector = KVEventCollector(Pool([EndpointConfig(address)]), index, options)
    task = asyncio.create_task(collector.run())
    try:
        await until(lambda: bool(index.live[0]), "the collector to connect")
        yield index, collector
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await collector.aclose()


PROMPT = list(range(100, 124))  # six blocks of four tokens


def depth(index: KVBlockIndex, tokens: list[int] = PROMPT) -> int:
    return int(index.match_depth(cache_keys(tokens, B))[0][0])


@pytest.mark.parametrize("topic_in_replay", [pytest.param(True, id="vllm-0.32"), pytest.param(False, id="older-vllm")])
async def test_a_gap_in_the_stream_is_replayed(
    publisher: tuple[Publisher, KVEventOptions], topic_in_replay: bool
) -> None:
    server, options = publisher
    server.topic_in_replay = topic_in_replay
    async with following(options) as (index, collector):
        await server.send(stored([1, 2], None, PROMPT[:8]))
        await server.send(stored([3, 4], 2, PROMPT[8:16]), live=False)  # lost on the way
        await server.send(stored([5, 6], 4, PROMPT[16:24]))
        await until(lambda: depth(index) == 6, "the whole prompt, the gap replayed")
        assert index.live[0] and collector.errors.total() == 0


async def test_an_ipv6_endpoint_is_followed_and_its_gaps_replayed() -> None:
    # Without zmq.IPV6 on its sockets, a connect to [::1] (or [fd00::7]) never happened: never subscribed.
    async with publishing("::1") as (server, options), following(options, address="[::1]:8000") as (index, collector):
        await server.send(stored([1, 2], None, PROMPT[:8]))
        await server.send(stored([3, 4], 2, PROMPT[8:16]), live=False)  # lost on the way
        await server.send(stored([5, 6], 4, PROMPT[16:24]))
        await until(lambda: depth(index) == 6, "the whole prompt, the gap replayed over IPv6")
        assert index.live[0] and collector.replayed == 1 and collector.errors.total() == 0


async def test_a_replay_that_never_ends_says_so(
    publisher: tuple[Publisher, KVEventOptions], caplog: pytest.LogCaptureFixture
) -> None:
    server, options = publisher
    silent = replace(options, replay_port=free_port(), replay_timeout_s=0.2)  # nothing listens there
    async with following(silent) as (index, collector):
        await server.send(stored([1], None, PROMPT[:4]))
        await server.send(stored([2], 1, PROMPT[4:8]), live=False)
        await server.send(stored([3], 2, PROMPT[8:12]))
        await until(lambda: collector.batches == 2, "the batch after the gap")
        assert collector.errors["replay"] >= 1 and not index.live[0]
    logged = [r.getMessage() for r in caplog.records if "replay of events 1..1" in r.getMessage()]
    assert logged == [
        "KV events of endpoint 0: replay of events 1..1 failed: no reply within 0.2 s (0 of 1 batches came)"
    ]


async def test_a_replay_longer_than_the_timeout_goes_on_while_each_reply_comes_in_time(
    publisher: tuple[Publisher, KVEventOptions],
) -> None:
    # The timeout bounded the whole replay: a server's full buffer, decoded and applied in turn, ran past it and
    # the endpoint stayed unsure for 30 s though every batch came. Each reply is bounded now.
    server, options = publisher
    server.replay_gap_s = 0.15  # 8 batches: 1.2 s in all, each well within the timeout
    async with following(replace(options, replay_timeout_s=0.6)) as (index, collector):
        long = list(range(200, 240))  # ten blocks
        await server.send(stored([1], None, long[:4]))
        for n in range(2, 10):
            await server.send(stored([n], n - 1, long[4 * (n - 1) : 4 * n]), live=False)
        await server.send(stored([10], 9, long[36:40]))
        await until(lambda: depth(index, long) == 10, "the whole gap replayed, then the batch after it")
        assert collector.replayed == 8 and collector.errors["replay"] == 0 and index.live[0]


async def test_a_buffer_that_lost_the_start_gives_the_rest_and_the_endpoint_is_unsure(
    publisher: tuple[Publisher, KVEventOptions],
) -> None:
    server, options = publisher
    for _ in range(3):
        await server.send(stored([90], None, [9] * B), live=False)
    del server.buffer[:2]  # the server's buffer keeps only the last of them
    async with following(options) as (index, _):
        await server.send(stored([1, 2], None, PROMPT[:8]))
        await until(lambda: depth(index) == 2, "the batch after the gap")
        assert depth(index, [9] * B) == 1  # what the buffer still had was applied
        assert not index.live[0] and "missed" in index.states[0].reason


async def test_a_sequence_that_goes_back_is_a_restarted_server_whose_cache_is_empty(
    publisher: tuple[Publisher, KVEventOptions],
) -> None:
    server, options = publisher
    async with following(options) as (index, _):
        await server.send(stored([1, 2], None, PROMPT[:8]))
        await until(lambda: depth(index) == 2, "the first prompt")
        server.next, server.buffer = 0, []
        await server.send(stored([7], None, [5] * B))
        await until(lambda: depth(index, [5] * B) == 1, "the restarted server's first block")
        assert depth(index) == 0 and index.held(0) == 1


async def test_the_next_pools_collector_goes_on_from_the_last_sequence_applied(
    publisher: tuple[Publisher, KVEventOptions],
) -> None:
    # Once every membership change made a collector without sequence numbers: the next batch looked like a first
    # one past 0, replay was asked from 0 (vLLM buffers 10,000 batches) and, the buffer not reaching back that far,
    # every endpoint was unsure for resync_s.
    server, options = publisher
    async with following(options) as (index, collector):
        for i in range(3):
            await server.send(stored([10 + i], None, [i] * B))
        await until(lambda: collector.batches == 3, "the first pool's batches")
    del server.buffer[:2]  # the server's buffer no longer reaches back to 0
    moved = index.moved(np.array([0]))
    async with following(options, moved) as (index, collector):
        await server.send(stored([1], None, PROMPT[:4]))
        await until(lambda: depth(index) == 1, "the next batch")
        assert server.asked == [] and collector.replayed == 0 and collector.errors.total() == 0
        assert index.live[0] and index.states[0].sequence == 3


async def test_a_message_that_is_not_a_batch_counts_as_missed(publisher: tuple[Publisher, KVEventOptions]) -> None:
    server, options = publisher
    async with following(options) as (index, collector):
        await server.send(stored([1], None, PROMPT[:4]))
        await until(lambda: depth(index) == 1, "the first block")
        await server.pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])
        await until(lambda: collector.errors["undecodable"] == 1, "the garbage to be counted")
        assert not index.live[0]
        assert np.array_equal(index.match_depth(cache_keys(PROMPT[:4], B))[0], [1])


async def test_valid_msgpack_that_python_cannot_hold_costs_one_batch_not_the_stream(
    publisher: tuple[Publisher, KVEventOptions],
) -> None:
    # A map keyed by an array ({[1]: 1}) once let a TypeError end the endpoint's task, and with it every other's.
    server, options = publisher
    async with following(options) as (index, collector):
        await server.send(stored([1], None, PROMPT[:4]))
        await server.send(b"\x81\x91\x01\x01")
        await until(lambda: collector.errors["undecodable"] == 1, "the bad batch to be counted")
        await server.send(stored([2], 1, PROMPT[4:8]))
        await until(lambda: depth(index) == 2, "the batch after it")
        assert index.states[0].subscribed


async def test_a_failure_while_applying_one_batch_is_counted_and_the_stream_goes_on(
    publisher: tuple[Publisher, KVEventOptions],
) -> None:
    server, options = publisher
    async with following(options) as (index, collector):
        real, failures = index.apply, [RuntimeError("a bug")]

        def apply(endpoint, batch):
            if failures:
                raise failures.pop()
            real(endpoint, batch)

        index.apply = apply  # type: ignore[method-assign]
        await server.send(stored([1], None, PROMPT[:4]))
        await until(lambda: collector.errors["failed"] == 1, "the failure to be counted")
        assert not index.live[0]
        await server.send(stored([2], 1, PROMPT[4:8]))  # its gap is replayed: the failed batch comes again
        await until(lambda: depth(index) == 2, "the next batch and the one that failed")


def removed(count: int, hashes_each: int = 8) -> bytes:
    events = [{"type": "BlockRemoved", "block_hashes": list(range(i, i + hashes_each))} for i in range(count)]
    return msgpack.packb([0.0, events, 0])


async def test_a_publisher_over_its_byte_budget_is_dropped_not_replayed_and_counted(
    publisher: tuple[Publisher, KVEventOptions],
) -> None:
    # A member may send a batch of 1 MiB (up to 0.1 s of the picker's CPU) as often as it likes: beyond its
    # budget a batch is dropped and the endpoint unsure, and the gap it leaves is not asked of replay.
    server, options = publisher
    async with following(replace(options, max_bytes_per_s=1)) as (index, collector):
        await server.send(stored([1, 2], None, PROMPT[:8]))
        await until(lambda: depth(index) == 2, "the first batch, within the burst")
        collector._budget[0].level = 0.0  # the burst spent
        await server.send(removed(2000))
        await until(lambda: collector.errors["over_budget"] == 1, "the batch over the budget counted")
        assert not index.live[0] and collector.replayed == 0 and collector.batches == 1
        assert depth(index) == 2  # nothing of it applied


async def test_a_large_batch_is_applied_in_slices_with_the_loop_free_between() -> None:
    index = KVBlockIndex(1, clock=asyncio.get_running_loop().time, block_size=B)
    collector = KVEventCollector(Pool([EndpointConfig("127.0.0.1:8000")]), index, KVEventOptions(free_port()))
    frames = [b"", (0).to_bytes(8, "big"), removed(3 * APPLY_SLICE + 1)]
    slices: list[tuple[int, int]] = []  # (events, turns of the loop before it)
    real = index.apply
    async with LoopTurns() as turns:

        def apply(endpoint, batch):
            slices.append((len(batch.events), turns.count))
            real(endpoint, batch)

        index.apply = apply  # type: ignore[method-assign]
        try:
            await collector._received(0, "127.0.0.1:8000", frames)
        finally:
            await collector.aclose()
    assert collector.batches == 1 and collector.errors.total() == 0
    assert [n for n, _ in slices] == [APPLY_SLICE] * 3 + [1]
    assert all(b > a for (_, a), (_, b) in itertools.pairwise(slices))  # the loop ran between slices


def test_the_budget_refills_at_its_rate_up_to_its_burst() -> None:
    now = [0.0]
    budget = _Budget(100, 300, clock=lambda: now[0])
    assert budget.take(300) and not budget.take(1)
    now[0] = 1.0
    assert budget.take(100) and not budget.take(1)
    now[0] = 100.0
    assert not budget.take(301) and budget.take(300)  # saved up to the burst, no more

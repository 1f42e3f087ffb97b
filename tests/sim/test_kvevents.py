"""Tests for sim/kvevents.py and the server's KV events: a ZMQ subscriber reads what a real emulator publishes."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from inferlb.procs import free_port
from inferlb.sim.fleet import serving
from inferlb.sim.kvevents import END_SEQ, encode_batch
from inferlb.sim.profiles import get_profile
from inferlb.sim.server import EmulatedServer, ServerOptions
from inferlb.sim.tokens import block_hashes

from ..conftest import until

H100 = get_profile("h100-llama3.1-8b")
BS = H100.block_size
BLOCK_CHARS = BS * 4  # four characters make one token (sim/tokens.py)
ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
# vLLM 0.32.0's msgspec encoder on KVEventBatch(ts=1.5, [BlockStored(block_hashes=[1, 2], parent_block_hash=None,
# token_ids=[5, 6, 7, 8], block_size=2, lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None],
# group_idx=0), BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0), AllBlocksCleared()], data_parallel_rank=0)
VLLM_0_32_BATCH = bytes.fromhex(
    "93cb3ff8000000000000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102b1706172656e745f62"
    "6c6f636b5f68617368c0a9746f6b656e5f6964739405060708aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3"
    "475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f6964780084a474797065ac426c6f636b52656d"
    "6f766564ac626c6f636b5f6861736865739101a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f"
    "636b73436c656172656400"
)
_unique = itertools.count()


def test_map_encoding_is_byte_for_byte_vllm_0_32() -> None:
    events = [("s", [1, 2], None, [5, 6, 7, 8]), ("r", 1), ("c",)]
    assert encode_batch(1.5, events, 2) == VLLM_0_32_BATCH


def test_array_encoding_puts_the_tag_first_and_the_fields_by_position() -> None:
    ts, events, rank = msgpack.unpackb(encode_batch(2.0, [("s", [7], 3, [1, 2]), ("r", 7), ("c",)], 2, "array"))
    assert (ts, rank) == (2.0, 0)
    assert events == [
        ["BlockStored", [7], 3, [1, 2], 2, None, "GPU", None, [None], 0],
        ["BlockRemoved", [7], "GPU", 0],
        ["AllBlocksCleared"],
    ]


def event_dict(raw: Any) -> dict[str, Any]:
    """One event of either encoding as a map with its ``type``."""
    if isinstance(raw, dict):
        return raw
    return {"type": raw[0], **dict(zip(ARRAY_FIELDS[raw[0]], raw[1:], strict=True))}


def decode(payload: bytes) -> list[dict[str, Any]]:
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0
    return [event_dict(e) for e in events]


def apply(view: set[int], events: list[dict[str, Any]]) -> None:
    for event in events:
        if event["type"] == "BlockStored":
            view.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            view.difference_update(event["block_hashes"])
        else:
            view.clear()


class Subscriber:
    """A SUB client of one emulated server, and its replay client (a DEALER)."""

    def __init__(self, ctx: zmq.asyncio.Context, server: EmulatedServer, topic: bytes = b"") -> None:
        self.server = server
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(f"tcp://127.0.0.1:{server.options.kv_events_port}")
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(f"tcp://127.0.0.1:{server.options.kv_events_replay_port}")
        self.live: list[tuple[int, bytes]] = []

    async def drain(self) -> None:
        """Take every message already received."""
        while await self.sub.poll(0):
            topic, seq, payload = await self.sub.recv_multipart()
            assert topic == self.server.options.kv_events_topic.encode()
            self.live.append((int.from_bytes(seq, "big"), payload))

    async def live_until(self, next_seq: int) -> list[tuple[int, bytes]]:
        """Live batches received until the one numbered ``next_seq - 1`` (or past it)."""

        async def done() -> bool:
            await self.drain()
            return bool(self.live) and self.live[-1][0] >= next_seq - 1

        await until(done, f"live batch {next_seq - 1}", 10.0)
        return self.live

    async def replay(self, start: int) -> list[tuple[int, bytes]]:
        await self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await self.dealer.recv_multipart()
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                return out
            empty, topic, seq, payload = frames
            assert empty == b"" and topic == self.server.options.kv_events_topic.encode()
            out.append((int.from_bytes(seq, "big"), payload))

    async def ready(self, client: httpx.AsyncClient) -> None:
        """Send prompts until one's events arrive live: the subscription is in place (ZMQ's slow joiner)."""

        async def heard() -> bool:
            await complete(client, self.server, f"warm-up {next(_unique)} ".ljust(BLOCK_CHARS, "w"))
            await self.drain()
            return bool(self.live)

        await until(heard, "a live batch", 10.0)
        self.live.clear()


async def complete(client: httpx.AsyncClient, server: EmulatedServer, prompt: str, max_tokens: int = 2) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens}
    response = await client.post(f"http://{server.address}/v1/completions", json=body)
    assert response.status_code == 200, response.text


async def truth(client: httpx.AsyncClient, server: EmulatedServer) -> dict[str, Any]:
    response = await client.get(f"http://{server.address}/admin/kv-blocks")
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


async def faults(client: httpx.AsyncClient, server: EmulatedServer, spec: dict[str, object]) -> dict[str, Any]:
    response = await client.post(f"http://{server.address}/admin/faults", json=spec)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def options(**changes: Any) -> ServerOptions:
    base = ServerOptions(
        profile=H100,
        models=("m",),
        time_scale=50.0,
        jitter=0.0,
        kv_events_port=free_port(),
        kv_events_replay_port=free_port(),
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@contextlib.asynccontextmanager
async def run_one(ctx: zmq.asyncio.Context, opts: ServerOptions) -> AsyncIterator[tuple[Subscriber, Any]]:
    server = EmulatedServer(f"127.0.0.1:{free_port()}", opts)
    async with serving([server]), httpx.AsyncClient(timeout=10) as client:
        sub = Subscriber(ctx, server, opts.kv_events_topic.encode())
        await sub.ready(client)
        yield sub, client
    assert not server.kv_events._thread.is_alive()  # type: ignore[union-attr]


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_block_stored_chains_hashes_with_the_prompts_token_ids(ctx, encoding) -> None:
    async with run_one(ctx, options(kv_events_encoding=encoding, kv_events_topic="kv")) as (sub, client):
        server = sub.server
        first = f"shared system prompt {next(_unique)} ".ljust(2 * BLOCK_CHARS, "s") + "first question ".ljust(
            3 * BLOCK_CHARS + 10, "q"
        )
        second = first[: 2 * BLOCK_CHARS] + "another question ".ljust(2 * BLOCK_CHARS, "a")
        start = (await truth(client, server))["next_seq"]
        await complete(client, server, first)
        await complete(client, server, second)
        end = (await truth(client, server))["next_seq"]
        live = await sub.live_until(end)  # published (the publisher's thread): the replay then holds them too
        stored = [e for _, p in await sub.replay(start) for e in decode(p) if e["type"] == "BlockStored"]
        ids = {}
        for prompt in (first, second):
            response = await client.post(f"http://{server.address}/tokenize", json={"model": "m", "prompt": prompt})
            ids[prompt] = response.json()["tokens"]
        one, two = block_hashes(first, BS), block_hashes(second, BS)
        assert len(one) == 5 and one[:2] == two[:2]
        assert [e["block_hashes"] for e in stored] == [one, two[2:]]
        assert [e["parent_block_hash"] for e in stored] == [None, one[1]]
        assert stored[0]["token_ids"] == ids[first][: 5 * BS]
        assert stored[1]["token_ids"] == ids[second][2 * BS : 4 * BS]
        assert {(e["block_size"], e["medium"], e["lora_id"], e["group_idx"]) for e in stored} == {(BS, "GPU", None, 0)}
        assert [seq for seq, _ in live] == list(range(live[0][0], end))


async def test_eviction_and_a_crash_keep_the_replayed_view_equal_to_the_cache(ctx) -> None:
    tiny = dataclasses.replace(H100, num_gpu_blocks=24)
    async with run_one(ctx, options(profile=tiny)) as (sub, client):
        server = sub.server
        for i in range(12):
            await complete(client, server, f"prompt {i} {next(_unique)} ".ljust(4 * BLOCK_CHARS, "x"))
        state = await truth(client, server)
        await sub.live_until(state["next_seq"])  # published (the publisher's thread): the replay then holds them too
        batches = await sub.replay(0)
        assert [seq for seq, _ in batches] == list(range(state["next_seq"]))
        events = [e for _, p in batches for e in decode(p)]
        assert any(e["type"] == "BlockRemoved" and len(e["block_hashes"]) == 1 for e in events)
        view: set[int] = set()
        apply(view, events)
        assert state["blocks"] and sorted(view) == state["blocks"]

        await faults(client, server, {"crash": True, "cold_start_s": 0})
        state = await truth(client, server)
        await sub.live_until(state["next_seq"])
        cleared = [decode(p) for _, p in await sub.replay(batches[-1][0] + 1)]
        assert cleared[-1] == [{"type": "AllBlocksCleared"}]
        assert state["blocks"] == []


async def test_dropped_batches_leave_a_gap_that_replay_fills(ctx) -> None:
    async with run_one(ctx, options()) as (sub, client):
        server = sub.server
        start = (await truth(client, server))["next_seq"]
        assert (await faults(client, server, {"kv_events_drop": 2}))["kv_events_drop"] == 2
        for i in range(4):
            await complete(client, server, f"gap {i} {next(_unique)} ".ljust(2 * BLOCK_CHARS, "g"))
        end = (await truth(client, server))["next_seq"]
        assert end >= start + 4
        # Batches numbered before `start` may still be arriving (published before it was read): not this test's.
        live = {seq: payload for seq, payload in await sub.live_until(end) if seq >= start}
        assert sorted(live) == list(range(start + 2, end))
        replayed = dict(await sub.replay(start))
        assert sorted(replayed) == list(range(start, end))
        assert all(replayed[seq] == payload for seq, payload in live.items())
        view: set[int] = set()
        apply(view, [e for _, p in await sub.replay(0) for e in decode(p)])
        assert sorted(view) == (await truth(client, server))["blocks"]


async def test_a_paused_publisher_sends_nothing_until_resumed(ctx) -> None:
    async with run_one(ctx, options()) as (sub, client):
        server = sub.server
        assert (await faults(client, server, {"kv_events_pause": True}))["kv_events_pause"] is True
        before = (await truth(client, server))["next_seq"]
        await complete(client, server, f"paused {next(_unique)} ".ljust(2 * BLOCK_CHARS, "p"))
        state = await truth(client, server)
        assert state["next_seq"] == before and len(state["blocks"]) > 0
        assert server.kv_events is not None and server.kv_events.dropped_events > 0
        await faults(client, server, {"kv_events_pause": False})
        await complete(client, server, f"resumed {next(_unique)} ".ljust(2 * BLOCK_CHARS, "r"))
        assert (await truth(client, server))["next_seq"] == before + 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param({"kv_events_port": 0, "kv_events_replay_port": 5}, "needs kv_events_port", id="replay-alone"),
        pytest.param({"kv_events_encoding": "json"}, "kv_events_encoding", id="encoding"),
        pytest.param({"kv_events_port": 70000}, "kv_events_port", id="port"),
    ],
)
def test_options_name_the_bad_kv_events_setting(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        options(**changes)


async def test_kv_event_faults_need_a_publisher_and_a_whole_count() -> None:
    server = EmulatedServer("127.0.0.1:1", ServerOptions(profile=H100))
    with pytest.raises(ValueError, match="need KV events on"):
        server.apply_faults({"kv_events_pause": True})
    assert server.kv_blocks()["next_seq"] is None
    await server.aclose()
    server = EmulatedServer("127.0.0.1:1", options())
    try:
        with pytest.raises(ValueError, match="whole number"):
            server.apply_faults({"kv_events_drop": 1.5})
        server.apply_faults({"kv_events_drop": 3.0})  # --fault parses numbers as floats
        assert server.faults()["kv_events_drop"] == 3
    finally:
        await server.aclose()
        await server.aclose()

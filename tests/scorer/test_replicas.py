"""Picker replicas sharing in-flight counts through a real Redis (Debian's redis-server, with a password)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis

from inferlb.bench.redisserver import REDIS, RedisServer, redis_server
from inferlb.filter.requestend import OpenLeases
from inferlb.scorer.config import ReplicasConfig, parse_config
from inferlb.scorer.engine import Engine
from inferlb.scorer.features import text_block_hashes
from inferlb.scorer.pool import Pool
from inferlb.scorer.prefix import PrefixAffinityScorer, PrefixIndex
from inferlb.scorer.presets import build_profile
from inferlb.scorer.replicas import (
    CATCH_UP_COUNT,
    MAX_ENDS_PER_ENTRY,
    MAX_PREFIXES_PER_ENTRY,
    Replicas,
    _load_values,
    hash_seed_problem,
)

from ..conftest import until

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")

ENDPOINTS = ["127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:9103"]


def _engine(endpoints: list[str] = ENDPOINTS) -> Engine:
    config = parse_config({"pool": {"endpoints": [{"address": a, "models": ["m"]} for a in endpoints]}})
    return Engine(Pool(config.endpoints), build_profile("least-request", np.random.default_rng(3)))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


def _config(server: RedisServer, tmp_path: Path, **more: object) -> ReplicasConfig:
    secret = tmp_path / "redis-password"
    secret.write_text(server.password + "\n")
    document = {"url": server.url, "password": {"token_file": str(secret)}, "peer_ttl_s": 1.5, **more}
    config = parse_config({"pool": {"endpoints": [{"address": ENDPOINTS[0]}]}, "replicas": document}).replicas
    assert config is not None
    return config


class Running:
    """Replicas running on this loop, each with its own engine."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []
        self.replicas: list[Replicas] = []

    def start(self, config: ReplicasConfig, engine: Engine, name: str) -> Replicas:
        replica = Replicas(config, lambda: engine, replica_id=name)
        self.replicas.append(replica)
        self.tasks.append(asyncio.create_task(replica.run()))
        return replica

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for replica in self.replicas:
            await replica.close()


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    group = Running()
    yield group
    await group.stop()


async def test_what_one_replica_has_in_flight_the_other_counts_within_milliseconds(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    config = _config(server, tmp_path)
    a, b = _engine(), _engine()
    ra, rb = running.start(config, a, "a"), running.start(config, b, "b")
    await until(lambda: ra.ready() and rb.ready(), "both caught up")
    leases = [a.inflight.acquire(0, 100), a.inflight.acquire(0, 50), a.inflight.acquire(2, 7)]
    own = b.inflight.acquire(1, 10)
    await until(lambda: b.inflight.requests.tolist() == [2, 1, 1], "b counts a's requests")
    assert b.inflight.tokens.tolist() == [150, 10, 7]
    told = b.inflight.own()
    assert [told.requests.tolist(), told.tokens.tolist()] == [[0, 1, 0], [0, 10, 0]]  # what b tells: its own
    await until(lambda: a.inflight.requests.tolist() == [2, 1, 1], "a counts b's request")
    for lease in leases:
        lease.release()
    await until(lambda: b.inflight.requests.tolist() == [0, 1, 0], "a's ends reach b")
    own.release()
    await until(lambda: a.inflight.requests.tolist() == [0, 0, 0], "b's end reaches a")
    assert ra.peers() == rb.peers() == 1 and ra.up and rb.up


async def test_a_replica_that_starts_late_is_caught_up_when_it_reports_ready(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    config = _config(server, tmp_path)
    a, late = _engine(), _engine()
    ra = running.start(config, a, "a")
    await until(ra.ready, "a caught up")
    a.inflight.acquire(1, 30)
    await until(lambda: ra.stats.published > 0, "a published")
    rl = running.start(config, late, "late")
    await until(rl.ready, "late caught up")
    assert late.inflight.requests.tolist() == [0, 1, 0] and late.inflight.tokens.tolist() == [0, 30, 0]


async def _forge(server: RedisServer, config: ReplicasConfig, entries: list[dict[str, Any]]) -> None:
    """Append ``entries`` to the replicas' stream as someone who can write to Redis, not a replica (in order, in one
    round trip)."""
    forger = aioredis.Redis.from_url(server.url, password=server.password)
    try:
        pipe = forger.pipeline(transaction=False)
        for fields in entries:
            pipe.xadd(config.key, fields)
        await pipe.execute()
    finally:
        await forger.aclose()


def _history(writer: str, count: int) -> list[dict[str, Any]]:
    """``count`` full entries of a peer ``writer`` whose load on the first endpoint changes: i % 5 requests."""
    return [{"r": writer, "k": "full", "d": orjson.dumps({ENDPOINTS[0]: [i % 5, 10 * (i % 5)]})} for i in range(count)]


async def test_a_replica_that_reconnects_reads_only_the_entries_after_the_last_it_read(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    """A blip (here CLIENT KILL; a failover or a timeout does the same) does not replay the whole stream again on
    the routing loop: the replica resumes after the last entry it read."""
    config = _config(server, tmp_path)
    b = _engine()
    history = _history("x", 3 * CATCH_UP_COUNT + 7)
    await _forge(server, config, history)
    rb = running.start(config, b, "b")
    await until(rb.ready, "b caught up")
    assert rb.stats.applied == len(history) and rb.stats.caught_up == 1
    killer = aioredis.Redis.from_url(server.url, password=server.password)
    try:
        await killer.client_kill_filter(_type="normal", skipme=True)
    finally:
        await killer.aclose()
    news = [{"r": "x", "k": "full", "d": orjson.dumps({ENDPOINTS[1]: [4, 40]})}] * 5  # read once (catch-up or follow)
    await _forge(server, config, news)
    await until(lambda: rb.stats.caught_up == 2, "b reconnected")
    await until(lambda: rb.stats.applied >= len(history) + len(news), "b read the new entries")
    assert rb.stats.applied == len(history) + len(news)  # the new ones only, once each
    assert b.inflight.requests.tolist() == [0, 4, 0] and rb.peers() == 1


async def test_a_replay_gives_the_event_loop_a_turn_after_each_slice(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    """A fresh replica replays the stream (its warm start) a slice at a time: other tasks on its loop (the routing,
    the health checks) run between slices instead of waiting for the whole stream."""
    config = _config(server, tmp_path)
    b = _engine()
    history = _history("x", 5 * CATCH_UP_COUNT)
    await _forge(server, config, history)
    rb = running.start(config, b, "b")
    between: set[int] = set()  # how far the replay was each time another task ran

    async def watch() -> None:
        while True:
            between.add(rb.stats.applied)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        await until(rb.ready, "b caught up")
    finally:
        watcher.cancel()
    assert rb.stats.applied == len(history)
    assert {CATCH_UP_COUNT * k for k in range(1, 5)} <= between


async def test_a_replica_replays_from_the_start_a_stream_that_redis_lost(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    """Redis lost the stream and began it again with ids behind the last one a replica read (another clock, a
    failover to a replica without it): resuming after that id would skip every new entry, so it replays the stream
    from its start."""
    config = _config(server, tmp_path)
    b = _engine()
    rb = running.start(config, b, "b")
    await until(rb.ready, "b caught up")
    writer = aioredis.Redis.from_url(server.url, password=server.password)
    try:
        ahead = {"r": "x", "k": "full", "d": orjson.dumps({ENDPOINTS[0]: [1, 10]})}
        await writer.xadd(config.key, ahead, id="9999999999999-0")  # type: ignore[arg-type]
        await until(lambda: b.inflight.requests[0] == 1, "b read the entry ahead")
        await writer.delete(config.key)
        behind = {"r": "y", "k": "full", "d": orjson.dumps({ENDPOINTS[1]: [2, 20]})}
        await writer.xadd(config.key, behind)  # type: ignore[arg-type]
        await writer.client_kill_filter(_type="normal", skipme=True)
    finally:
        await writer.aclose()
    await until(lambda: b.inflight.requests[1] == 2, "b replayed the new stream")
    assert rb.stats.caught_up == 2


async def test_only_well_formed_counts_of_its_own_pool_members_are_applied(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    config = _config(server, tmp_path)
    b = _engine()
    rb = running.start(config, b, "b")
    await until(rb.ready, "b caught up")
    entries = [
        {"r": "x", "k": "full", "d": orjson.dumps({"10.9.9.9:80": [50, 5000], ENDPOINTS[2]: [3, 30]})},
        {"r": "y", "k": "full", "d": orjson.dumps({ENDPOINTS[0]: [-4, 1], ENDPOINTS[1]: ["9", 1]})},
        {"r": "z", "k": "full", "d": b"not json"},
        {"r": "w", "k": "orders", "d": orjson.dumps({ENDPOINTS[0]: [1, 1]})},
    ]
    await _forge(server, config, entries)
    await until(lambda: rb.stats.rejected >= 4, "the bad entries refused")
    # Only the member's well-formed count counts; the address outside the pool steers nothing.
    assert b.inflight.requests.tolist() == [0, 0, 3] and b.inflight.tokens.tolist() == [0, 0, 30]


async def test_a_picker_of_another_pool_under_the_same_key_is_no_peer(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    """Two pools share one Redis under the default key: every entry of the other pool's picker names no member of
    this pool, so it changes nothing here, not even the number of peers (which divides the tenants' quotas)."""
    config = _config(server, tmp_path)
    a, other = _engine(), _engine(["10.1.0.1:8000", "10.1.0.2:8000"])
    ra, ro = running.start(config, a, "a"), running.start(config, other, "other")
    other.inflight.acquire(0, 10)
    await until(lambda: ra.stats.rejected >= 2, "a refused the other pool's entries")
    assert ra.peers() == 0 and ra.stats.applied == 0 and a.inflight.requests.tolist() == [0, 0, 0]
    assert ro.peers() == 0


async def test_an_entry_larger_than_any_replica_sends_is_refused_whole(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    # The sender's bounds hold on receipt too: a writer to the stream cannot make a replica apply more than a
    # replica of this pool ever sends (and so spend its routing loop on it).
    config = _config(server, tmp_path)
    b = _engine()
    rb = running.start(config, b, "b")
    await until(rb.ready, "b caught up")
    too_many = {ENDPOINTS[2]: [3, 30], **{f"10.9.{i // 250}.{i % 250}:80": [1, 1] for i in range(len(ENDPOINTS))}}
    prompts = [[ENDPOINTS[0], [1, 2, 3]]] * (MAX_PREFIXES_PER_ENTRY + 1)
    ends = ["r"] * (MAX_ENDS_PER_ENTRY + 1)
    entries = [
        {"r": "x", "k": "full", "d": orjson.dumps(too_many)},
        {"r": "y", "k": "tick", "h": rb.fingerprint, "p": orjson.dumps(prompts)},
        {"r": "z", "k": "tick", "e": orjson.dumps(ends)},
    ]
    await _forge(server, config, entries)
    refused = 3 if rb.share_prefixes else 2  # prompts are shared only under a fixed hash seed
    await until(lambda: rb.stats.rejected >= refused, "the entries refused")
    assert b.inflight.requests.tolist() == [0, 0, 0] and rb.stats.prefixes_applied == 0


async def test_a_peers_load_counts_only_as_far_as_each_value_is_a_count(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    """The load's five or six values (requests, tokens, sent, estimated prefill backlog, its age in ms, and the
    exact backlog where there is one): a negative or non-integer one, or a list of another length, refuses that
    endpoint's entry; an age beyond any backlog's life is cut."""
    config = _config(server, tmp_path)
    b = _engine()
    rb = running.start(config, b, "b")
    await until(rb.ready, "b caught up")
    forger = aioredis.Redis.from_url(server.url, password=server.password)
    load = {ENDPOINTS[0]: [1, 1, -5, 0, 0], ENDPOINTS[1]: [1, 1, 1, 1], ENDPOINTS[2]: [2, 20, 7, 900, 10**12]}
    bad_exact = {ENDPOINTS[0]: [1, 1, 1, 0, 0, -1], ENDPOINTS[1]: [1, 1, 1, 0, 0, 1.5]}
    try:
        await forger.xadd(config.key, {"r": "u", "k": "full", "d": orjson.dumps(bad_exact)})  # type: ignore[arg-type]
        await forger.xadd(config.key, {"r": "v", "k": "full", "d": orjson.dumps(load)})  # type: ignore[arg-type]
        await until(lambda: b.inflight.requests.tolist() == [0, 0, 2], "the well-formed endpoint applied")
    finally:
        await forger.aclose()
    assert rb.stats.rejected >= 2
    assert b.inflight.sent.tolist() == [0, 0, 0]  # what it sent before b first heard of it is no news
    backlog = b.inflight.pending_prefill(np.array([2]), np.array([1.0]))
    assert backlog.tolist() == [0.0]  # dated an hour back at most: long drained, never a negative time


async def test_without_redis_each_replica_routes_alone_says_so_and_resynchronises(
    server: RedisServer, tmp_path: Path, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inferlb.scorer.replicas")
    config = _config(server, tmp_path)
    a, b = _engine(), _engine()
    ra, rb = running.start(config, a, "a"), running.start(config, b, "b")
    a.inflight.acquire(0, 10)
    await until(lambda: b.inflight.requests[0] == 1, "b counts a's request")
    server.stop()
    await until(lambda: rb.up is False and ra.up is False, "both see Redis gone")
    assert rb.ready() and "out of reach" in (rb.problem or "")
    # A's request stops weighing once A has not been heard from for peer_ttl_s; B's own routing goes on.
    await until(lambda: b.inflight.requests.tolist() == [0, 0, 0], "a's count expired at b", timeout=10)
    assert rb.peers_gone == 1  # the picker's lease expiry learns from it that ends may have been lost
    b.inflight.acquire(2, 1)
    server.start()  # empty: Redis kept nothing
    await until(lambda: rb.up and ra.up, "both back", timeout=15)
    await until(lambda: b.inflight.requests.tolist() == [1, 0, 1], "b has a's count again", timeout=10)
    await until(lambda: a.inflight.requests.tolist() == [1, 0, 1], "a has b's count", timeout=10)
    outages = [r.message for r in caplog.records if "out of reach" in r.message]
    assert len(outages) == 2  # one line per replica per transition, not one per retry
    assert rb.stats.outages == 1 and rb.stats.caught_up >= 2


async def test_wrong_credentials_leave_it_routing_alone_with_the_reason(server: RedisServer, tmp_path: Path) -> None:
    secret = tmp_path / "wrong"
    secret.write_text("not-the-password-at-all-0000")
    parsed = _config(server, tmp_path)
    config = parse_config(
        {
            "pool": {"endpoints": [{"address": ENDPOINTS[0]}]},
            "replicas": {"url": parsed.url, "password": {"token_file": str(secret)}},
        }
    ).replicas
    assert config is not None
    engine = _engine()
    replica = Replicas(config, lambda: engine, replica_id="a")
    task = asyncio.create_task(replica.run())
    try:
        await until(lambda: replica.up is False, "refused")
        assert replica.ready() and not replica.caught_up
        assert "out of reach" in (replica.problem or "") and "invalid" in (replica.problem or "").lower()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await replica.close()


def _prefix_engine() -> Engine:
    config = parse_config({"pool": {"endpoints": [{"address": a, "models": ["m"]} for a in ENDPOINTS]}})
    profile = build_profile("prefix-aware", np.random.default_rng(3), size=len(ENDPOINTS))
    return Engine(Pool(config.endpoints), profile)


def _index(engine: Engine) -> PrefixIndex:
    [index] = [w.scorer.index for w in engine.profile.scorers if isinstance(w.scorer, PrefixAffinityScorer)]
    return index


async def test_a_prompt_one_replica_routed_is_found_in_the_others_prefix_index(
    server: RedisServer, tmp_path: Path, running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "4242")  # the same on every replica (here: one process anyway)
    config = _config(server, tmp_path)
    a, b = _prefix_engine(), _prefix_engine()
    ra, rb = running.start(config, a, "a"), running.start(config, b, "b")
    await until(lambda: ra.ready() and rb.ready(), "both caught up")
    hashes = text_block_hashes("a shared system prompt. " * 100, seed=7)
    ra.routed(ENDPOINTS[1], hashes)
    await until(lambda: _index(b).match(hashes)[1] == len(hashes), "b's index holds a's prompt on endpoint 1")
    assert _index(b).match(hashes).tolist() == [0, len(hashes), 0]
    # a counts its publish once the store has answered, which may be after b has the message.
    await until(lambda: ra.stats.prefixes_published == 1, "a counts the prompt it published")
    assert rb.stats.prefixes_applied == 1
    # Hashes of another seed (their fingerprint differs), or naming no member of the pool, are not recorded.
    forger = aioredis.Redis.from_url(server.url, password=server.password)
    other = text_block_hashes("another prompt entirely. " * 100, seed=7)
    try:
        rejected = rb.stats.rejected
        for fingerprint, address in (("12345", ENDPOINTS[0]), (rb.fingerprint, "10.9.9.9:80")):
            fields = {"r": "x", "k": "prefix", "h": fingerprint, "d": orjson.dumps([[address, list(other)]])}
            await forger.xadd(config.key, fields)  # type: ignore[arg-type]
        await until(lambda: rb.stats.rejected == rejected + 2, "both refused")
    finally:
        await forger.aclose()
    assert not _index(b).match(other).any()


def test_prefix_hashes_are_shared_only_under_a_fixed_secret_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, shared in (
        ("", False),
        ("random", False),
        ("0", False),
        ("-3", False),
        ("99999999999", False),
        ("17", True),
    ):
        monkeypatch.setenv("PYTHONHASHSEED", value)
        assert (hash_seed_problem() is None) == shared, value


async def test_an_end_reported_to_another_replica_releases_the_lease_where_it_is_held(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    """Envoy's access-log stream reaches one replica; the request it reports may have been routed by another."""
    config = _config(server, tmp_path)
    a, b = _engine(), _engine()
    ra, rb = running.start(config, a, "a"), running.start(config, b, "b")
    held_a, held_b = OpenLeases(), OpenLeases()
    ra.finish = lambda rid: held_a.finish(rid, count_unknown=False)
    rb.finish = lambda rid: held_b.finish(rid, count_unknown=False)
    await until(lambda: ra.ready() and rb.ready(), "both caught up")
    held_a.hold("req-1", a.inflight.acquire(0, 10))
    held_a.hold("req-2", a.inflight.acquire(1, 10))
    for request_id in ("req-1", "req-9"):  # req-9: nobody holds it (routed before a restart)
        assert not held_b.finish(request_id)
        rb.ended_elsewhere(request_id)
    await until(lambda: ra.stats.ends_taken == 1, "a released req-1")
    assert a.inflight.own().requests.tolist() == [0, 1, 0] and len(held_a) == 1
    assert held_a.stats.unknown_entries == 0
    # b counts what it passed on once its write returns, which may be after a has read it.
    await until(lambda: rb.stats.ends_passed == 2, "b counted both ends passed on")
    await until(lambda: b.inflight.requests.tolist() == [0, 1, 0], "b sees a's remaining request")


async def test_a_first_token_seen_by_another_replica_reaches_the_exact_backlog_where_the_lease_is_held(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    """With the responses timed (exact prefill backlogs), a request's observing stream may reach another replica
    than the one holding its lease: the first token is passed on, and the backlog it ends goes from every view."""
    config = _config(server, tmp_path)
    a, b = _engine(), _engine()
    for engine in (a, b):
        engine.inflight.first_tokens = True
    ra, rb = running.start(config, a, "a"), running.start(config, b, "b")
    held_a, held_b = OpenLeases(), OpenLeases()

    def told(held: OpenLeases) -> Callable[[str], bool]:
        def first_token(request_id: str) -> bool:
            lease = held.lease_of(request_id)
            if lease is not None:
                lease.first_token()
            return lease is not None

        return first_token

    ra.first_token, rb.first_token = told(held_a), told(held_b)
    await until(lambda: ra.ready() and rb.ready() and rb.peers() == 1, "both caught up, b hears of a")
    held_a.hold("req-1", a.inflight.acquire(0, 1200, (1000, 1000.0), streamed=True))
    rates = np.full(3, 1000.0)
    await until(lambda: b.inflight.pending_prefill(np.arange(3), rates)[0] > 900, "b counts a's backlog")
    for request_id in ("req-1", "req-9"):  # req-9: nobody holds it
        rb.first_token_elsewhere(request_id)
    await until(lambda: ra.stats.first_tokens_taken == 1, "a told req-1's lease")
    assert a.inflight.pending_prefill(np.arange(3), rates).tolist() == [0, 0, 0]
    assert a.inflight.requests.tolist() == [1, 0, 0]  # still in flight until its end
    await until(lambda: b.inflight.pending_prefill(np.arange(3), rates)[0] == 0, "b no longer counts it")
    await until(lambda: rb.stats.first_tokens_passed == 2, "b counted both passed on")
    # First tokens that are not a list of request ids are refused and tell no lease anything.
    held_a.hold("req-2", a.inflight.acquire(1, 600, (500, 1000.0), streamed=True))
    forger = aioredis.Redis.from_url(server.url, password=server.password)
    try:
        rejected = ra.stats.rejected
        for bad in (b"not json", orjson.dumps("req-2"), orjson.dumps([2]), orjson.dumps(["x" * 300])):
            await forger.xadd(config.key, {"r": "f", "k": "tick", "f": bad})  # type: ignore[arg-type]
        await until(lambda: ra.stats.rejected >= rejected + 4, "the bad first tokens refused")
    finally:
        await forger.aclose()
    assert a.inflight.pending_prefill(np.arange(3), rates).tolist() == [0, 500, 0] and ra.stats.first_tokens_taken == 1


async def test_a_peers_exact_backlog_counts_here_undrained_until_its_first_token(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    """With the responses timed, a replica's streamed requests wait in its exact backlog for their first token, which
    no rate drains: a peer counts them as they are, apart from the estimated backlog that it drains, until the
    first token takes them out. Entries without an exact backlog keep the five values older replicas read."""
    config = _config(server, tmp_path)
    a, b = _engine(), _engine()
    for engine in (a, b):
        engine.inflight.first_tokens = True
    ra, rb = running.start(config, a, "a"), running.start(config, b, "b")
    await until(lambda: ra.ready() and rb.ready() and rb.peers() == 1, "both caught up, b hears of a")
    fast = np.full(3, 1e12)  # a rate at which any estimated backlog drains at once
    streamed = a.inflight.acquire(0, 1200, (1000, 1000.0), streamed=True)
    unstreamed = a.inflight.acquire(1, 900, (800, 1000.0))
    await until(lambda: b.inflight.pending_prefill(np.arange(3), fast).tolist() == [1000, 0, 0], "b counts it as is")
    assert b.inflight.pending_prefill(np.arange(3), np.full(3, 1e-6))[1] == pytest.approx(800)  # the estimate, apart
    values = _load_values(a.pool, a.inflight.own(), a.inflight.clock())
    assert len(values[ENDPOINTS[0]]) == 6 and len(values[ENDPOINTS[1]]) == 5
    streamed.first_token()
    await until(lambda: b.inflight.pending_prefill(np.arange(3), fast).tolist() == [0, 0, 0], "b drops it")
    streamed.release()
    unstreamed.release()


async def test_what_a_peer_sent_since_the_scrape_saturates_here_and_its_prefill_backlog_counts(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    """Global admission: the saturation rule adds to the scraped queue what every replica added in flight since, so an
    endpoint one replica filled is saturated for the others too; and a peer's prefill backlog counts here."""
    config = _config(server, tmp_path)
    a, b = _engine(), _engine()
    ra, rb = running.start(config, a, "a"), running.start(config, b, "b")
    await until(lambda: ra.ready() and rb.ready() and rb.peers() == 1, "both caught up, b hears of a")
    limit = b.saturation.max_waiting
    snapshot = b.signals.snapshot.with_values(
        waiting=[limit - 2, 0, 0], kv_usage=[0.1] * 3, scraped_at=[b.signals.clock()] * 3, inflight_at_scrape=[0, 0, 0]
    )
    b.signals.publish(snapshot)
    assert not b.saturation.over(b.signals, b.inflight).any()
    leases = [a.inflight.acquire(0, 10, prefill=(4000.0, 1.0)) for _ in range(3)]  # three more queued at 0
    await until(lambda: b.inflight.requests.tolist() == [3, 0, 0], "b counts what a has in flight")
    assert b.saturation.over(b.signals, b.inflight).tolist() == [True, False, False]
    backlog = b.inflight.pending_prefill(np.array([0, 1]), np.array([1.0, 1.0]))
    assert 11_000 < backlog[0] <= 12_000 and backlog[1] == 0  # a's 3 x 4,000 tokens, draining at 1 a second
    for lease in leases:
        lease.release()


async def test_a_peer_that_joins_brings_no_old_sends_that_would_saturate(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    config = _config(server, tmp_path)
    a, b = _engine(), _engine()
    leases = [a.inflight.acquire(0, 10) for _ in range(50)]  # a has sent 50 before b hears of it
    for lease in leases:
        lease.release()
    ra = running.start(config, a, "a")
    await until(ra.ready, "a caught up")
    rb = running.start(config, b, "b")
    await until(lambda: rb.ready() and rb.peers() == 1, "b hears of a")
    assert b.inflight.sent.tolist() == [0, 0, 0]
    a.inflight.acquire(0, 10)
    await until(lambda: b.inflight.sent.tolist() == [1, 0, 0], "b counts what a sends from then on")


async def test_a_tick_appends_one_entry_with_the_load_the_prompts_and_the_ends(
    server: RedisServer, tmp_path: Path, running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "4242")
    config = _config(server, tmp_path, publish_interval_s=0.05)
    a = _prefix_engine()
    ra = running.start(config, a, "a")
    await until(ra.ready, "caught up")
    await until(lambda: ra.stats.published >= 1, "the first full entry")
    client = aioredis.Redis.from_url(server.url, password=server.password)
    try:
        before = await client.xlen(config.key)
        a.inflight.acquire(1, 10)
        ra.routed(ENDPOINTS[1], text_block_hashes("a system prompt. " * 100, seed=7))
        ra.ended_elsewhere("req-7")
        await until(lambda: ra.stats.ends_passed == 1, "published")
        entries = await client.xrange(config.key, "-", "+")
    finally:
        await client.aclose()
    assert len(entries) == before + 1  # one entry, not one per kind
    fields = entries[-1][1]
    assert {b"r", b"k", b"d", b"h", b"p", b"e"} <= set(fields) and fields[b"k"] == b"changes"
    assert orjson.loads(fields[b"d"])[ENDPOINTS[1]][:3] == [1, 10, 1]


@pytest.mark.skipif(
    shutil.which("openssl") is None and not os.environ.get("CI"), reason="needs openssl (.ci/run installs it)"
)
async def test_replicas_share_over_tls_and_one_that_cannot_verify_redis_routes_alone(
    tmp_path: Path, running: Running
) -> None:
    with redis_server(tmp_path / "redis-tls", tls=True) as server:
        secret = tmp_path / "redis-password"
        secret.write_text(server.password)
        document = {"url": server.url, "password": {"token_file": str(secret)}, "ca_file": str(server.ca_file)}
        config = parse_config({"pool": {"endpoints": [{"address": ENDPOINTS[0]}]}, "replicas": document}).replicas
        assert config is not None and config.url.startswith("rediss://")
        a, b = _engine(), _engine()
        ra, rb = running.start(config, a, "a"), running.start(config, b, "b")
        await until(lambda: ra.ready() and rb.ready() and ra.up and rb.up, "both in touch over TLS")
        lease = a.inflight.acquire(2, 5)
        await until(lambda: b.inflight.requests.tolist() == [0, 0, 1], "b counts a's request")
        lease.release()
        # A CA that did not sign Redis's certificate: no connection, and the reason says so.
        other = tmp_path / "other-ca"
        other.mkdir()
        stranger = running.start(replace(config, ca_file=str(_other_ca(other))), _engine(), "c")
        await until(lambda: stranger.up is False, "c refuses the server")
        assert stranger.problem is not None and "certificate" in stranger.problem.lower()


def _other_ca(folder: Path) -> Path:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
         "-days", "2", "-subj", "/CN=another CA"],
        cwd=folder, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return folder / "ca.crt"


async def test_an_experiment_outcome_is_passed_on_and_a_malformed_one_refused(
    server: RedisServer, tmp_path: Path, running: Running
) -> None:
    config = _config(server, tmp_path)
    ra, rb = running.start(config, _engine(), "a"), running.start(config, _engine(), "b")
    taken: list[tuple[str, float | None, float | None, bool]] = []

    def take(request_id: str, ttft: float | None, e2e: float | None, failed: bool) -> bool:
        taken.append((request_id, ttft, e2e, failed))
        return request_id != "nobody's"

    ra.take_outcome = take
    await until(lambda: ra.ready() and rb.ready(), "both caught up")
    rb.outcome_elsewhere("req-1", 0.25, None, False)
    rb.outcome_elsewhere("req-2", None, None, True)
    rb.outcome_elsewhere("nobody's", None, 1.5, False)
    await until(lambda: len(taken) == 3, "a told of the three")
    assert taken == [("req-1", 0.25, None, False), ("req-2", None, None, True), ("nobody's", None, 1.5, False)]
    assert ra.stats.outcomes_taken == 2
    await until(lambda: rb.stats.outcomes_passed == 3, "b counted the three passed on")
    forger = aioredis.Redis.from_url(server.url, password=server.password)
    try:
        rejected = ra.stats.rejected
        bad = (
            b"not json",
            orjson.dumps(["req-3", 0.1, None, False]),  # not a list of outcomes
            orjson.dumps([["req-3", -1.0, None, False]]),  # a negative latency
            orjson.dumps([["req-3", 0.1, 1e9, False]]),  # a latency of years
            orjson.dumps([["req-3", 0.1, None, 1]]),  # failed is not a bool
            orjson.dumps([["", 0.1, None, False]]),  # no request id
        )
        for payload in bad:
            await forger.xadd(config.key, {"r": "f", "k": "tick", "o": payload})  # type: ignore[arg-type]
        await until(lambda: ra.stats.rejected >= rejected + len(bad), "the bad outcomes refused")
    finally:
        await forger.aclose()
    assert len(taken) == 3

"""Tests for scorer/collect.py: scraping real emulated vLLM servers, dead, silent and garbage endpoints."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable

import httpx
import pytest

from inferlb.procs import free_port
from inferlb.scorer.collect import CollectorOptions, MetricsCollector, scrape_phases
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.inflight import InFlight
from inferlb.scorer.pool import Pool
from inferlb.scorer.signals import Signals
from inferlb.sim.fleet import serving
from inferlb.sim.profiles import get_profile
from inferlb.sim.server import EmulatedServer, ServerOptions

from ..conftest import until

H100 = get_profile("h100-llama3.1-8b")
TINY = dataclasses.replace(H100, max_num_seqs=2)


async def garbage_app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"# nothing here\nhello world\n"})


@pytest.fixture
async def fleet():
    """Two emulated servers, one garbage /metrics, one that accepts and never answers, one closed port."""
    emulated = [
        EmulatedServer(f"127.0.0.1:{free_port()}", ServerOptions(profile=TINY, models=("m",), time_scale=1.0))
        for _ in range(2)
    ]
    garbage = f"127.0.0.1:{free_port()}"

    async def never_answer(reader, writer):
        await reader.read()  # holds the connection open until the client gives up

    silent = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    silent_address = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    closed = f"127.0.0.1:{free_port()}"
    async with serving(emulated, extra=[(garbage, garbage_app)]):
        yield emulated, [s.address for s in emulated] + [garbage, silent_address, closed]
    silent.close()


async def test_one_round_reads_live_servers_and_marks_the_rest_down(fleet):
    emulated, addresses = fleet
    pool = Pool([EndpointConfig(a, None) for a in addresses])
    signals = Signals(len(pool), stale_after_s=5)
    collector = MetricsCollector(pool, signals, CollectorOptions(interval_s=0.05, timeout_s=0.3))
    # Load server 0: two running (max_num_seqs=2), one waiting.
    loaded = emulated[0]
    client_tasks = [
        asyncio.create_task(_post(loaded.address, {"model": "m", "prompt": "x" * 4000, "max_tokens": 2000}))
        for _ in range(3)
    ]
    deadline = asyncio.get_running_loop().time() + 5
    while (len(loaded.engine.running), len(loaded.engine.waiting)) != (2, 1):
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.005)
    try:
        await collector.scrape_once()
    finally:
        for t in client_tasks:
            t.cancel()
        await collector.aclose()
    snap = signals.snapshot
    assert list(snap.up) == [True, True, False, False, False]
    assert (snap.running[0], snap.waiting[0]) == (2, 1)
    assert 0 < snap.kv_usage[0] < 0.01
    assert (snap.running[1], snap.waiting[1], snap.kv_usage[1]) == (0, 0, 0)
    assert snap.kv_tokens[0] == TINY.num_gpu_blocks * TINY.block_size
    assert all(math.isnan(snap.running[i]) for i in (2, 3, 4))
    assert list(signals.stale()) == [False, False, True, True, True]
    errors = collector.stats.errors
    assert set(errors) == set(addresses[2:])
    assert "no vLLM metrics" in collector.last_error[2]
    assert "timed out" in collector.last_error[3]
    assert "ConnectionRefusedError" in collector.last_error[4]
    assert collector.stats.published == 1 and collector.stats.scrapes == 5 and collector.first_round_done


async def test_a_scrape_notes_how_many_requests_were_in_flight_when_it_began(fleet):
    _, addresses = fleet
    pool = Pool([EndpointConfig(a, None) for a in addresses[:3]])
    signals = Signals(len(pool), stale_after_s=5)
    inflight = InFlight(len(pool))
    collector = MetricsCollector(pool, signals, CollectorOptions(timeout_s=0.3), inflight=inflight)
    leases = [inflight.acquire(index, 10) for index in (0, 0, 1)]
    await collector.scrape_once()
    inflight.acquire(0, 10)
    snap = signals.snapshot
    assert snap.inflight_at_scrape[:2].tolist() == [2, 1]
    assert math.isnan(snap.inflight_at_scrape[2])  # the garbage endpoint: no successful scrape
    assert (inflight.requests[:2] - snap.inflight_at_scrape[:2]).tolist() == [1, 0]  # the growth since the scrape
    leases[2].release()  # an end, not a send: the next scrape's base is lower
    await collector.scrape_once()
    await collector.aclose()
    assert signals.snapshot.inflight_at_scrape[:2].tolist() == [3, 0]


async def test_a_server_that_goes_down_keeps_its_values_but_turns_stale(fleet):
    emulated, addresses = fleet
    pool = Pool([EndpointConfig(addresses[0], None)])
    signals = Signals(1, stale_after_s=5)
    collector = MetricsCollector(pool, signals, CollectorOptions(timeout_s=0.3))
    await collector.scrape_once()
    first = signals.snapshot
    assert first.up[0] and not signals.stale()[0]
    await _post(addresses[0], {"model": "m", "prompt": "y", "max_tokens": 1})  # let it exist once more
    emulated[0].apply_faults({"crash": True, "cold_start_s": 1000})  # /metrics now answers 503
    await collector.scrape_once()
    await collector.aclose()
    second = signals.snapshot
    assert not second.up[0] and signals.stale()[0]
    assert second.scraped_at[0] == first.scraped_at[0]
    assert second.running[0] == first.running[0]
    assert collector.last_error[0] == "HTTP 503"


async def _scrape_until(collector: MetricsCollector, done: Callable[[], bool], what: str) -> None:
    """Run ``collector`` until ``done()``, then cancel it (it must still run then: it ends only when cancelled)."""
    task = asyncio.create_task(collector.run())
    try:
        await until(lambda: task.done() or done(), what)
        assert not task.done(), task
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await collector.aclose()


async def test_run_keeps_scraping_until_cancelled(fleet):
    _, addresses = fleet
    pool = Pool([EndpointConfig(addresses[1], None)])
    signals = Signals(1)
    collector = MetricsCollector(pool, signals, CollectorOptions(interval_s=0.01, timeout_s=0.3))
    await _scrape_until(collector, lambda: signals.published >= 3, "three snapshots published")
    assert collector.stats.scrapes >= 3 and not collector.stats.errors


async def test_a_hung_endpoint_holds_back_only_its_own_readings(fleet):
    """Each endpoint is scraped on its own schedule: one that never answers (here for up to 30 s) does not stop
    the others from being read every interval."""
    _, addresses = fleet
    pool = Pool([EndpointConfig(a, None) for a in (addresses[0], addresses[3])])  # live, silent
    signals = Signals(2, stale_after_s=5)
    collector = MetricsCollector(pool, signals, CollectorOptions(interval_s=0.02, timeout_s=30))
    task = asyncio.create_task(collector.run())
    seen: set[float] = set()
    deadline = asyncio.get_running_loop().time() + 20
    while len(seen) < 5:  # five fresh readings of the live server, each published
        assert asyncio.get_running_loop().time() < deadline
        seen.add(float(signals.snapshot.scraped_at[0]))
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await collector.aclose()
    assert not collector.first_round_done  # the silent endpoint's first scrape never ended
    assert math.isnan(signals.snapshot.scraped_at[1]) and not collector.stats.errors


async def test_the_collector_counts_what_it_fetched(fleet):
    _, addresses = fleet
    collector = MetricsCollector(Pool([EndpointConfig(addresses[0], None)]), Signals(1))
    await collector.scrape_once()
    await collector.aclose()
    assert collector.stats.bytes > 10_000 and collector.stats.parse_s > 0  # a whole exposition, parsed


@pytest.mark.parametrize(
    "bad", [{"interval_s": 0}, {"timeout_s": -1}, {"timeout_s": math.nan}, {"publish_delay_s": True}]
)
def test_options_refuse_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        CollectorOptions(**bad)


async def _post(address: str, body: dict) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        await client.post(f"http://{address}/v1/completions", json=body)


def test_scrape_phases_start_endpoints_in_groups_spread_over_the_interval():
    assert scrape_phases(4, 0.1) == [0.0] * 4  # a small pool: one group, one wake-up a round
    phases = scrape_phases(20, 0.3, group=8)
    assert phases == [0.0] * 8 + [pytest.approx(0.1)] * 8 + [pytest.approx(0.2)] * 4
    assert scrape_phases(0, 0.1) == []


class _Timed(MetricsCollector):
    """Records when each endpoint's scrapes start; the first of ``slow`` takes ``slow_s``."""

    def __init__(self, pool: Pool, options: CollectorOptions, slow: int | None = None, slow_s: float = 0.0) -> None:
        super().__init__(pool, Signals(len(pool)), options)
        self.starts: list[list[float]] = [[] for _ in pool]
        self.slow, self.slow_s = slow, slow_s

    async def _scrape(self, i: int) -> None:
        self.starts[i].append(asyncio.get_running_loop().time())
        if i == self.slow and len(self.starts[i]) == 1:
            await asyncio.sleep(self.slow_s)


async def _run_until(collector: _Timed, rounds: int) -> None:
    task = asyncio.create_task(collector.run())
    deadline = asyncio.get_running_loop().time() + 10
    while min(len(s) for s in collector.starts) < rounds:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_endpoints_of_a_group_wake_together_every_round():
    """A small pool's scrapes start in the same turn of the loop, round after round (one timer, one snapshot);
    spread one per endpoint over the interval they were 25 ms apart here."""
    pool = Pool([EndpointConfig(f"127.0.0.1:{8000 + i}", None) for i in range(4)])
    collector = _Timed(pool, CollectorOptions(interval_s=0.1))
    await _run_until(collector, 4)
    for round_starts in zip(*collector.starts, strict=False):
        assert max(round_starts) - min(round_starts) < 0.005


async def test_a_scrape_that_overruns_its_slot_waits_for_the_next_slot_of_the_grid():
    pool = Pool([EndpointConfig(f"127.0.0.1:{8000 + i}", None) for i in range(2)])
    collector = _Timed(pool, CollectorOptions(interval_s=0.05), slow=1, slow_s=0.075)
    await _run_until(collector, 3)
    start = collector.starts[0][0]
    slow = collector.starts[1]
    # Not at once after the 75 ms scrape (0.075): at the slot after (0.1; ``start`` itself may lag its slot a little).
    assert slow[1] - start >= 0.1 - 0.005
    assert min(abs(slow[1] - t) for t in collector.starts[0]) < 0.005  # back in step with its group


def _bad_cache_app(digits: int):
    """A /metrics with sane gauges and a cache_config_info whose block_size has ``digits`` digits."""
    body = (
        'vllm:num_requests_running{model_name="m"} 1\n'
        'vllm:num_requests_waiting{model_name="m"} 0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
        f'vllm:cache_config_info{{block_size="{"9" * digits}",num_gpu_blocks="1000"}} 1.0\n'
    ).encode()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": body})

    return app


@pytest.mark.parametrize("digits", [pytest.param(400, id="overflows-float64"), pytest.param(5000, id="past-int-limit")])
async def test_a_huge_label_value_is_no_reading_and_every_endpoint_goes_on_being_scraped(digits: int):
    # Once, a block_size of 400 digits raised OverflowError out of one endpoint's scrape; the collector's gather
    # then cancelled every endpoint's loop, and all signals froze with nothing logged.
    emulated = EmulatedServer(f"127.0.0.1:{free_port()}", ServerOptions(profile=TINY, models=("m",), time_scale=1.0))
    bad = f"127.0.0.1:{free_port()}"
    async with serving([emulated], extra=[(bad, _bad_cache_app(digits))]):
        pool = Pool([EndpointConfig(a, None) for a in (emulated.address, bad)])
        signals = Signals(len(pool), stale_after_s=5)
        collector = MetricsCollector(pool, signals, CollectorOptions(interval_s=0.02, timeout_s=1.0))
        await _scrape_until(collector, lambda: collector.stats.scrapes >= 10, "ten scrapes")
    snap = signals.snapshot
    assert list(snap.up) == [True, True]
    assert snap.running[1] == 1 and math.isnan(snap.kv_tokens[1])  # the gauges read; the cache size not
    assert collector.last_error == [None, None]


async def test_a_reading_that_raises_marks_its_endpoint_down_and_the_loop_goes_on(fleet, caplog):
    _, addresses = fleet
    pool = Pool([EndpointConfig(a, None) for a in addresses[:2]])
    signals = Signals(len(pool), stale_after_s=5)
    collector = MetricsCollector(pool, signals, CollectorOptions(interval_s=0.02, timeout_s=1.0))
    reader = collector._readers[0]
    real_read, calls = reader.read, []

    def read(body):
        calls.append(len(calls))
        if len(calls) == 1:
            raise OverflowError("int too large to convert to float")
        if len(calls) == 2:
            raise RuntimeError("a bug in the reader")
        return real_read(body)

    reader.read = read
    task = asyncio.create_task(collector.run())
    deadline = asyncio.get_running_loop().time() + 10
    seen = []
    while len(calls) < 4:
        assert not task.done(), task
        assert asyncio.get_running_loop().time() < deadline
        seen.append(collector.last_error[0])
        await asyncio.sleep(0.002)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await collector.aclose()
    assert "unreadable metrics: int too large to convert to float" in seen
    assert "the picker failed to read the scrape (its log has the traceback)" in seen
    assert "RuntimeError: a bug in the reader" in caplog.text
    assert collector.last_error[0] is None and bool(signals.snapshot.up[0])  # read again once the reader could

"""Tests for scorer/discovery.py: a source's entries to endpoints, remembered while their values stay, bounded in
what is kept of the skipped ones, and in slices that leave the event loop to the requests; an entry that cannot
be read costs that entry only."""

from __future__ import annotations

import orjson
import pytest

from inferlb.scorer import discovery
from inferlb.scorer.discovery import MAX_SKIPPED, YIELD_EVERY, Members, endpoints_of, resolve_host
from inferlb.scorer.networks import Networks

from ..conftest import LoopTurns

PRIVATE = Networks.of(["10.0.0.0/8"])


def member(address: str, **more: object) -> bytes:
    return orjson.dumps({"address": address, **more})


def entries(n: int, start: int = 0) -> dict[str, bytes]:
    return {f"m/{i:05d}": member(f"10.0.{i // 250}.{i % 250 + 1}:8000") for i in range(start, start + n)}


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The values `Members` validated (rather than remembered)."""
    seen: list[bytes] = []
    real = discovery._outcome

    async def counted(value, allowed, resolve):
        seen.append(value)
        return await real(value, allowed, resolve)

    monkeypatch.setattr(discovery, "_outcome", counted)
    return seen


async def test_an_unchanged_value_is_not_validated_again(validations: list[bytes]) -> None:
    members = Members()
    source = entries(300)
    first = await members.endpoints(source, PRIVATE)
    assert len(first[0]) == 300 and len(validations) == 300
    source["m/00007"] = member("10.9.9.9:8000", labels={"zone": "b"})
    source["m/99999"] = b"not json"
    second = await members.endpoints(source, PRIVATE)
    assert len(validations) == 302  # the changed entry and the new one
    assert [e.address for e in second[0]][7] == "10.9.9.9:8000" and len(second[0]) == 300
    assert [s.key for s in second[1]] == ["m/99999"]
    assert second[0][:7] == first[0][:7]


async def test_a_name_is_resolved_at_every_pass_and_other_networks_are_checked_anew(validations: list[bytes]) -> None:
    resolved: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        resolved.append(host)
        return ["10.0.0.50"]

    members = Members()
    source = {"a": member("gpu-a.example:8000"), "b": member("10.0.0.2:8000")}
    for _ in range(3):
        found, _ = await members.endpoints(source, PRIVATE, resolve=resolve)
        assert [e.address for e in found] == ["10.0.0.50:8000", "10.0.0.2:8000"]
    assert resolved == ["gpu-a.example"] * 3 and validations.count(source["b"]) == 1
    found, skipped = await members.endpoints(source, Networks.of(["192.168.0.0/16"]), resolve=resolve)
    assert found == () and len(skipped) == 2  # the allowlist changed: nothing remembered holds


async def test_skipped_entries_are_kept_up_to_a_bound_and_the_rest_counted() -> None:
    source = {f"bad/{i:05d}": member(f"203.0.113.{i % 250 + 1}:{1000 + i}") for i in range(MAX_SKIPPED + 40)}
    source.update(entries(3))
    found, skipped = await endpoints_of(source, PRIVATE)
    assert len(found) == 3 and len(skipped) == MAX_SKIPPED + 1
    assert skipped[-1].key == "..." and skipped[-1].reason.startswith("40 more entries skipped")


async def test_a_large_source_leaves_the_event_loop_to_others_as_it_goes() -> None:
    # 20,000 entries validated in one go held the routing loop for over two seconds at every watch event.
    source = {f"bad/{i:05d}": member(f"203.0.113.{i % 250 + 1}:{1000 + i % 60000}") for i in range(2000)}
    async with LoopTurns() as turns:
        _, skipped = await Members().endpoints(source, PRIVATE)
    assert len(skipped) == MAX_SKIPPED + 1
    assert turns.count >= 2000 // YIELD_EVERY - 1


async def test_a_port_past_what_getaddrinfo_takes_resolves_to_nothing() -> None:
    # getaddrinfo raises OverflowError (before any lookup), which ended the etcd source's task.
    assert await resolve_host("gpu-7.internal", 99999999999999999999) == []


async def test_a_name_with_a_port_out_of_range_is_skipped_unresolved_and_the_rest_serve() -> None:
    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return ["10.0.0.50"]

    source = {
        "a": member("gpu-7.internal:99999999999999999999"),
        "b": member("gpu-8.internal:0"),
        "c": member("gpu-9.internal:8000"),
    }
    found, skipped = await endpoints_of(source, PRIVATE, resolve=resolve)
    assert [e.address for e in found] == ["10.0.0.50:8000"] and asked == [("gpu-9.internal", 8000)]
    assert {s.key: s.reason for s in skipped} == {
        "a": "address: 'gpu-7.internal:99999999999999999999': port must be an integer in 1..65535",
        "b": "address: 'gpu-8.internal:0': port must be an integer in 1..65535",
    }


async def test_an_entry_whose_resolving_fails_unexpectedly_costs_that_entry_only() -> None:
    async def resolve(host: str, port: int) -> list[str]:
        if host == "broken.internal":
            raise RuntimeError("resolver defect")
        return ["10.0.0.50"]

    source = {"a": member("broken.internal:8000"), "b": member("gpu-9.internal:8000")}
    found, skipped = await endpoints_of(source, PRIVATE, resolve=resolve)
    assert [e.address for e in found] == ["10.0.0.50:8000"]
    assert [(s.key, s.reason) for s in skipped] == [("a", "cannot be read (RuntimeError: resolver defect)")]

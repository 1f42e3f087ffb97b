"""Tests for sim/kvcache.py: the KV-cache listener hears exactly the changes to the set of cached hashes."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from inferlb.sim.kvcache import BlockTable, KVCache, KVListener


class Recorder:
    """A `KVListener` that keeps what it heard, and the view an index would build from it."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.view: set[int] = set()

    def stored(self, hashes: list[int], parent: int | None, token_ids: Sequence[int]) -> None:
        self.calls.append(("stored", list(hashes), parent, list(token_ids)))
        self.view.update(hashes)

    def removed(self, hashes: list[int]) -> None:
        self.calls.append(("removed", list(hashes)))
        self.view.difference_update(hashes)

    def cleared(self) -> None:
        self.calls.append(("cleared",))
        self.view.clear()


def test_recorder_is_a_listener() -> None:
    listener: KVListener = Recorder()
    assert listener is not None


def test_register_announces_one_run_with_its_parent_and_tokens() -> None:
    rec = Recorder()
    cache = KVCache(8, 2, rec)
    table = BlockTable()
    assert cache.allocate(table, 3)
    cache.register(table, [11, 12], None, [1, 2, 3, 4])
    cache.register(table, [13], 12, [5, 6])
    assert rec.calls == [("stored", [11, 12], None, [1, 2, 3, 4]), ("stored", [13], 12, [5, 6])]
    assert rec.view == set(cache.cached_hashes()) == {11, 12, 13}


def test_register_skips_blocks_cached_first_by_another_request_and_splits_the_run() -> None:
    rec = Recorder()
    cache = KVCache(8, 1, rec)
    first, second = BlockTable(), BlockTable()
    cache.allocate(first, 1)
    cache.register(first, [2], 1, [20])
    cache.allocate(second, 3)
    cache.register(second, [1, 2, 3], None, [10, 20, 30])
    assert rec.calls[1:] == [("stored", [1], None, [10]), ("stored", [3], 2, [30])]
    assert second.plain == 1  # the block whose hash `first` cached stays unhashed


def test_eviction_announces_the_evicted_hashes_and_reset_clears() -> None:
    rec = Recorder()
    cache = KVCache(3, 1, rec)
    table = BlockTable()
    cache.allocate(table, 3)
    cache.register(table, [1, 2, 3])
    cache.release(table)  # all three stay cached, free; the last block of the prompt goes first
    assert rec.calls == [("stored", [1, 2, 3], None, [])]
    other = BlockTable()
    assert cache.allocate(other, 2)
    assert rec.calls[-1] == ("removed", [3, 2])
    assert rec.view == set(cache.cached_hashes()) == {1}
    cache.reset()
    assert rec.calls[-1] == ("cleared",)
    assert rec.view == set(cache.cached_hashes()) == set()


@pytest.mark.parametrize("listener", [pytest.param(None, id="none"), pytest.param(Recorder(), id="recorder")])
def test_the_cache_behaves_the_same_with_or_without_a_listener(listener: Recorder | None) -> None:
    cache = KVCache(4, 1, listener)
    a, b = BlockTable(), BlockTable()
    cache.allocate(a, 3)
    cache.register(a, [1, 2, 3])
    cache.release(a)
    assert cache.match([1, 2, 3], 3) == (3, 3)
    cache.take_cached(b, [1])
    assert cache.allocate(b, 3)
    assert sorted(cache.cached_hashes()) == [1]
    assert cache.free == 0

"""The exact prefix-cache index: what servers report, what the picker sent meanwhile, and when to trust it."""

from __future__ import annotations

import numpy as np

from inferlb.scorer.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from inferlb.scorer.kvindex import KVBlockIndex
from inferlb.scorer.tokenizer import cache_keys

from ..conftest import ManualClock

B = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], **extra: object) -> EventBatch:
    return EventBatch(0.0, (BlockStored(tuple(hashes), parent, tuple(tokens), B, **extra),))  # type: ignore[arg-type]


def index(size: int = 3) -> tuple[KVBlockIndex, ManualClock]:
    clock = ManualClock()
    kv = KVBlockIndex(size, clock=clock, block_size=B, pending_s=2.0, stale_s=5.0, resync_s=30.0)
    for e in range(size):
        kv.subscribed(e, True)
    return kv, clock


PROMPT = list(range(100, 116))  # four blocks of four tokens


def test_stored_blocks_match_a_prompt_tokenized_the_same_way_across_events() -> None:
    kv, _ = index()
    kv.apply(1, stored([901, 902], None, PROMPT[:8]))
    kv.apply(1, stored([903], 902, PROMPT[8:12]))  # a later event continues the chain through its parent
    counts, deepest = kv.match_depth(cache_keys(PROMPT, B))
    assert counts.tolist() == [0, 3, 0] and deepest == 3
    assert kv.live.tolist() == [True, True, True]
    # Another prompt sharing only the first block matches one block.
    assert kv.match_depth(cache_keys([*PROMPT[:4], 1, 2, 3, 4], B))[0].tolist() == [0, 1, 0]


def test_removed_blocks_and_a_cleared_cache_stop_matching() -> None:
    kv, _ = index()
    kv.apply(0, stored([1, 2, 3, 4], None, PROMPT))
    kv.apply(0, EventBatch(0.0, (BlockRemoved((3,), "GPU"),)))
    assert kv.match_depth(cache_keys(PROMPT, B))[0].tolist() == [2, 0, 0]
    kv.apply(0, EventBatch(0.0, (AllBlocksCleared(),)))
    assert kv.match_depth(cache_keys(PROMPT, B))[0].tolist() == [0, 0, 0]
    assert kv.held(0) == 0


def test_a_run_whose_parent_is_unknown_is_not_keyed_and_counted() -> None:
    kv, _ = index()
    kv.apply(2, stored([7], 6, PROMPT[4:8]))
    assert kv.held(2) == 0 and kv.skipped["orphan"] == 1


def test_events_the_index_cannot_key_change_nothing() -> None:
    kv, _ = index()
    kv.apply(0, stored([1], None, PROMPT[:4], lora_id=3))
    kv.apply(0, stored([1], None, PROMPT[:4], medium="CPU"))
    kv.apply(0, stored([1], None, PROMPT[:3]))
    assert kv.held(0) == 0
    assert dict(kv.skipped) == {"lora": 1, "medium": 1, "token_count": 1}


def test_another_block_size_takes_the_endpoint_off_the_exact_view() -> None:
    kv, _ = index()
    kv.apply(0, EventBatch(0.0, (BlockStored((1,), None, tuple(range(16)), 16),)))
    assert not kv.live[0]
    assert "16 tokens" in kv.states[0].reason


def test_a_cleared_cache_takes_back_an_endpoint_whose_block_size_was_another() -> None:
    # A server restarted with the right --block-size (its sequence goes back: the collector clears it) once stayed
    # off the exact view until the picker restarted.
    kv, _ = index()
    kv.apply(0, EventBatch(0.0, (BlockStored((1,), None, tuple(range(16)), 16),)))
    kv.apply(0, stored([2], None, PROMPT[:4]))
    assert not kv.live[0]  # blocks of the right size alone do not clear it
    kv.apply(0, EventBatch(0.0, (AllBlocksCleared(),)))
    kv.apply(0, stored([2], None, PROMPT[:4]))
    assert kv.live[0] and kv.states[0].reason == "live" and kv.held(0) == 1


def test_sent_blocks_are_pending_until_confirmed_or_lapsed() -> None:
    kv, clock = index()
    keys = cache_keys(PROMPT, B)
    kv.sent(2, keys)
    assert kv.match_depth(keys)[0].tolist() == [0, 0, 4]
    assert kv.pending(2) == 4
    kv.apply(2, stored([1, 2], None, PROMPT[:8]))  # the server stored half of it
    clock.now += 2.5
    kv.tick()
    assert kv.match_depth(keys)[0].tolist() == [0, 0, 2]  # the unconfirmed half lapsed
    assert kv.pending(2) == 0 and kv.held(2) == 2


def test_an_endpoint_whose_events_stop_while_requests_go_there_is_not_live() -> None:
    kv, clock = index()
    kv.sent(1, cache_keys(PROMPT, B))
    clock.now += 4.0
    kv.tick()
    assert kv.live[1]
    clock.now += 1.5
    kv.tick()
    assert not kv.live[1] and "no events" in kv.states[1].reason
    kv.apply(1, stored([1], None, PROMPT[:4]))
    assert kv.live[1]


def test_an_idle_endpoint_stays_live_without_events() -> None:
    kv, clock = index()
    clock.now += 3600
    kv.tick()
    assert kv.live.all()


def test_missed_events_make_an_endpoint_unsure_for_a_while_and_unsubscribed_ones_are_not_live() -> None:
    kv, clock = index()
    kv.lost(0)
    assert not kv.live[0] and "missed" in kv.states[0].reason
    clock.now += 31
    kv.tick()
    assert kv.live[0]
    kv.subscribed(2, False)
    assert not kv.live[2]


def test_an_endpoint_whose_reports_are_mostly_orphans_stays_unsure_after_resync() -> None:
    # The shared prefix's event was missed; vLLM never announces it again while it stays cached, so every block
    # continuing it is an orphan here, long after resync_s.
    kv, clock = index()
    kv.apply(1, stored([1], None, PROMPT[:4]))
    kv.lost(0)
    for i in range(100):
        clock.now += 0.6
        kv.apply(0, stored([1000 + i], 100, [10 + i, 11, 12, 13]))
        kv.apply(1, stored([2000 + i], 1, [10 + i, 11, 12, 13]))  # the same traffic, its parent known
    kv.tick()
    assert not kv.live[0] and "never reported here" in kv.states[0].reason
    assert kv.live[1]
    for i in range(100):  # new prompts chain up again
        kv.apply(0, stored([3000 + i, 4000 + i], None, [i, 1, 2, 3, i, 5, 6, 7]))
    assert kv.live[0]
    kv.apply(0, stored([9], 8, PROMPT[4:8]))  # an orphan now and then changes nothing
    assert kv.live[0]


def test_a_cleared_cache_forgets_the_orphans() -> None:
    kv, _ = index()
    for i in range(40):
        kv.apply(0, stored([1000 + i], 100, [10 + i, 11, 12, 13]))
    assert not kv.live[0]
    kv.apply(0, EventBatch(0.0, (AllBlocksCleared(),)))
    assert kv.live[0]


def test_a_membership_change_keeps_what_staying_endpoints_hold() -> None:
    kv, _ = index()
    kv.apply(0, stored([1, 2], None, PROMPT[:8]))
    kv.apply(2, stored([5], None, PROMPT[:4]))
    moved = kv.moved(np.array([2, -1]))  # endpoint 2 is now 0; a new one joined as 1
    assert moved.match_depth(cache_keys(PROMPT, B))[0].tolist() == [1, 0]
    assert moved.live.tolist() == [True, False]
    moved.apply(0, EventBatch(0.0, (BlockRemoved((5,)),)))
    assert moved.held(0) == 0


def test_the_old_index_changed_after_a_membership_change_leaves_the_new_one_alone() -> None:
    # The old pool's collector runs on until the picker's restart stops it; a removal it applied there once emptied
    # the new index's shared tables but kept its holder bit: a block matched for good, even after a clear.
    kv, _ = index()
    kv.apply(0, stored([1], None, PROMPT[:4]))
    kv.states[0].sequence = 5
    moved = kv.moved(np.array([0, 1, 2]))
    kv.apply(0, EventBatch(0.0, (BlockRemoved((1,)),)))
    kv.states[0].sequence = 6
    kv.subscribed(0, False)
    assert moved.held(0) == 1 and moved.match_depth(cache_keys(PROMPT, B))[0].tolist() == [1, 0, 0]
    assert moved.states[0].sequence == 5 and moved.live[0]
    moved.apply(0, EventBatch(0.0, (BlockRemoved((1,)),)))
    assert moved.held(0) == 0 and moved.match_depth(cache_keys(PROMPT, B))[0].tolist() == [0, 0, 0]


def test_a_restarted_endpoint_forgets_its_blocks_and_its_sequence_and_others_keep_theirs() -> None:
    kv, _ = index()
    kv.apply(0, stored([1, 2], None, PROMPT[:8]))
    kv.apply(1, stored([1, 2], None, PROMPT[:8]))
    kv.states[0].sequence = kv.states[1].sequence = 41
    moved = kv.moved(np.array([0, 1]))
    moved.restarted(0)
    assert moved.match_depth(cache_keys(PROMPT, B))[0].tolist() == [0, 2]
    assert moved.held(0) == 0 and moved.states[0].sequence is None and moved.states[1].sequence == 41


def test_the_blocks_held_are_bounded() -> None:
    clock = ManualClock()
    kv = KVBlockIndex(1, clock=clock, block_size=B, max_blocks=2)
    kv.subscribed(0, True)
    kv.apply(0, stored([1, 2, 3], None, PROMPT[:12]))
    assert kv.held(0) == 2 and not kv.live[0]

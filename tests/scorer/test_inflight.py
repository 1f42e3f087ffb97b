"""Tests for scorer/inflight.py: per-endpoint request and token counters, and idempotent leases."""

from __future__ import annotations

import numpy as np
import pytest

from inferlb.scorer.inflight import DRAIN_SHARE, RECENT_HALF_LIFE_S, InFlight, Lease, Load


def test_starts_at_zero() -> None:
    inflight = InFlight(3)
    assert inflight.requests.tolist() == [0, 0, 0]
    assert inflight.tokens.tolist() == [0, 0, 0]
    assert inflight.requests.dtype == inflight.tokens.dtype == np.int64
    assert inflight.total() == 0


@pytest.mark.parametrize(
    ("acquires", "requests", "tokens"),
    [
        pytest.param([(0, 10)], [1, 0, 0], [10, 0, 0], id="one"),
        pytest.param([(1, 5), (1, 7)], [0, 2, 0], [0, 12, 0], id="same-endpoint"),
        pytest.param([(0, 1), (1, 2), (2, 3)], [1, 1, 1], [1, 2, 3], id="spread"),
        pytest.param([(2, 0)], [0, 0, 1], [0, 0, 0], id="zero-tokens"),
    ],
)
def test_acquire_counts_requests_and_tokens(
    acquires: list[tuple[int, int]], requests: list[int], tokens: list[int]
) -> None:
    inflight = InFlight(3)
    leases = [inflight.acquire(i, t) for i, t in acquires]
    assert inflight.requests.tolist() == requests
    assert inflight.tokens.tolist() == tokens
    assert inflight.total() == len(acquires)
    assert [(lease.index, lease.tokens, lease.released) for lease in leases] == [(i, t, False) for i, t in acquires]
    for lease in leases:
        lease.release()
    assert inflight.requests.tolist() == [0, 0, 0]
    assert inflight.tokens.tolist() == [0, 0, 0]
    assert inflight.total() == 0


def test_release_is_idempotent() -> None:
    inflight = InFlight(2)
    kept = inflight.acquire(0, 100)
    lease = inflight.acquire(0, 40)
    assert isinstance(lease, Lease)
    for _ in range(3):
        lease.release()
        assert lease.released
        assert inflight.requests.tolist() == [1, 0]
        assert inflight.tokens.tolist() == [100, 0]
    kept.release()
    assert inflight.requests.tolist() == [0, 0]
    assert inflight.tokens.tolist() == [0, 0]


def test_many_leases_in_random_order_return_to_zero() -> None:
    rng = np.random.default_rng(7)
    size = 5
    inflight = InFlight(size)
    indices = rng.integers(0, size, 5000)
    tokens = rng.integers(0, 4000, 5000)
    leases = [inflight.acquire(int(i), int(t)) for i, t in zip(indices, tokens, strict=True)]
    assert inflight.requests.tolist() == np.bincount(indices, minlength=size).tolist()
    assert inflight.tokens.tolist() == np.bincount(indices, weights=tokens, minlength=size).astype(np.int64).tolist()
    assert inflight.total() == 5000

    order = rng.permutation(len(leases))
    half = order[: len(order) // 2]
    for k in half:
        leases[k].release()
        leases[k].release()  # every exit path may release again
    remaining = np.setdiff1d(np.arange(len(leases)), half)
    assert inflight.requests.tolist() == np.bincount(indices[remaining], minlength=size).tolist()
    assert inflight.total() == len(remaining)

    for lease in leases:
        lease.release()
    assert inflight.requests.tolist() == [0] * size
    assert inflight.tokens.tolist() == [0] * size


def test_two_counters_are_independent() -> None:
    first, second = InFlight(2), InFlight(2)
    first.acquire(1, 3)
    assert second.requests.tolist() == [0, 0]
    assert first.requests.tolist() == [0, 1]


def test_sent_counts_every_request_ever_sent() -> None:
    inflight = InFlight(2)
    for index in (0, 1, 1):
        inflight.acquire(index, 10).release()
    assert inflight.sent.tolist() == [1, 2] and inflight.total() == 0


def test_the_prefill_backlog_drains_at_the_given_rate_and_outlives_the_request() -> None:
    now = [100.0]
    inflight = InFlight(3, clock=lambda: now[0])
    rates = np.array([1000.0, 1000.0, 500.0])
    inflight.acquire(0, 2100, (2000, 1000)).release()  # 100 of its tokens were cached there
    inflight.acquire(1, 500)  # no estimate: no backlog
    inflight.acquire(2, 2000, (2000, 500))
    assert inflight.pending_prefill(np.arange(3), rates).tolist() == [2000, 0, 2000]
    now[0] = 100.0 + 1 / DRAIN_SHARE  # the time to prefill 1,000 tokens at DRAIN_SHARE of 1,000 a second
    assert inflight.pending_prefill(np.arange(3), rates) == pytest.approx([1000, 0, 1500])
    inflight.acquire(0, 300, (300, 1000))  # onto what is left: 1,000 + 300
    assert inflight.pending_prefill(np.array([2, 0]), rates[[2, 0]]) == pytest.approx([1500, 1300])
    now[0] = 200.0  # long drained: never below zero
    assert inflight.pending_prefill(np.arange(3), rates).tolist() == [0, 0, 0]


def test_the_requests_waiting_in_the_estimated_backlog_drain_with_its_tokens() -> None:
    now = [100.0]
    inflight = InFlight(3, clock=lambda: now[0])
    rates = np.array([1000.0, 1000.0, 1000.0])
    inflight.acquire(0, 1000, (1000, 1000)).release()  # waits until prefilled, not until its request ends
    inflight.acquire(0, 1000, (1000, 1000))
    inflight.acquire(1, 500)  # no estimate: not waiting as far as the picker knows
    inflight.acquire(2, 0, (0, 1000))  # nothing to prefill: not waiting either
    assert inflight.waiting_prefill(np.arange(3), rates).tolist() == [2, 0, 0]
    now[0] = 100.0 + 1 / DRAIN_SHARE  # half the 2,000 tokens drained: half the requests still wait
    assert inflight.waiting_prefill(np.arange(3), rates) == pytest.approx([1, 0, 0])
    inflight.acquire(0, 1000, (1000, 1000))  # one more onto the half left
    assert inflight.waiting_prefill(np.array([0]), rates[:1]) == pytest.approx([2])
    now[0] = 100.0 + 2 / DRAIN_SHARE  # 1,000 of the 2,000 tokens left drained
    assert inflight.waiting_prefill(np.array([0]), rates[:1]) == pytest.approx([1])
    now[0] = 200.0
    assert inflight.waiting_prefill(np.arange(3), rates).tolist() == [0, 0, 0]
    moved = inflight.moved(np.array([2, 0]))  # the count moves with its endpoint
    inflight.acquire(0, 1000, (1000, 1000))
    inflight.hand_over(moved, np.array([2, 0]))
    assert moved.waiting_prefill(np.arange(2), rates[:2]).tolist() == [0, 0]  # moved before that request


def test_the_streamed_requests_waiting_for_their_first_token_are_counted_exactly() -> None:
    now = [100.0]
    inflight = InFlight(3, clock=lambda: now[0])
    inflight.first_tokens = True
    rates = np.array([1000.0, 1000.0, 1000.0])
    a = inflight.acquire(0, 2000, (2000, 1000), streamed=True)
    b = inflight.acquire(0, 500, (500, 1000), streamed=True)
    c = inflight.acquire(2, 900, (900, 1000), streamed=True)
    inflight.acquire(1, 3000, (3000, 1000))  # not streamed: estimated, and drained
    assert inflight.waiting_prefill(np.arange(3), rates).tolist() == [2, 1, 1]
    now[0] = 160.0  # no first token came: the streamed ones still wait, the estimate has drained
    assert inflight.waiting_prefill(np.arange(3), rates).tolist() == [2, 0, 1]
    a.first_token()
    a.first_token()  # idempotent
    a.release()  # counted out at its first token, not again at its end
    assert inflight.waiting_prefill(np.arange(3), rates).tolist() == [1, 0, 1]
    b.release()  # ended before its first token
    c.move(1)  # served on endpoint 1: it waits there
    assert inflight.waiting_prefill(np.arange(3), rates).tolist() == [0, 1, 0]
    moved = inflight.moved(np.array([1, -1]))
    inflight.hand_over(moved, np.array([1, -1]))
    assert moved.waiting_prefill(np.arange(2), rates[:2]).tolist() == [1, 0]
    c.first_token()  # through the lease, wherever it counts now
    assert moved.waiting_prefill(np.arange(2), rates[:2]).tolist() == [0, 0]


def test_the_imbalance_guard_is_kept_until_a_count_changes() -> None:
    inflight = InFlight(4)
    candidates = np.arange(4)
    leases = [inflight.acquire(0, 10) for _ in range(2)]
    assert inflight.overloaded(candidates, 2.0) is None  # 2 against the others' mean 0: not over 2 x (0 + 1)
    assert inflight.overloaded(candidates, 2.0) is None
    leases.append(inflight.acquire(0, 10))  # 3: over
    over = inflight.overloaded(candidates, 2.0)
    assert over is not None and over.tolist() == [True, False, False, False]
    assert inflight.overloaded(candidates, 2.0) is over  # asked again with nothing changed: the same answer
    assert inflight.overloaded(candidates, 3.0) is None  # another guard is another question
    leases.pop().release()  # a count falls: asked anew
    assert inflight.overloaded(candidates, 2.0) is None
    assert inflight.overloaded(candidates[1:], 2.0) is None  # other candidates too
    lease = inflight.acquire(1, 10)
    assert inflight.overloaded(candidates, 2.0) is None
    lease.move(0)  # moved by a retry: endpoint 0 holds 3 again
    over = inflight.overloaded(candidates, 2.0)
    assert over is not None and over.tolist() == [True, False, False, False]
    with pytest.raises(ValueError):
        over[1] = True  # shared by the plugins that ask: read-only


def test_recent_prefill_work_halves_every_half_life_and_outlives_the_request() -> None:
    now = [50.0]
    inflight = InFlight(3, clock=lambda: now[0])
    inflight.acquire(0, 2100, (2000, 1000)).release()  # the uncached part counts: 2,000
    inflight.acquire(1, 500)  # no estimate: the whole prompt
    assert inflight.recent_prefill(np.arange(3)).tolist() == [2000, 500, 0]
    now[0] += RECENT_HALF_LIFE_S
    assert inflight.recent_prefill(np.arange(3)) == pytest.approx([1000, 250, 0])
    inflight.acquire(0, 300, (300, 1000))  # onto what is left
    assert inflight.recent_prefill(np.array([2, 0])) == pytest.approx([0, 1300])
    now[0] += 2 * RECENT_HALF_LIFE_S
    assert inflight.recent_prefill(np.arange(3)) == pytest.approx([325, 62.5, 0])
    moved = inflight.moved(np.array([1, -1, 0]))  # it follows its endpoint to the next pool; a new one starts at 0
    assert moved.recent_prefill(np.arange(3)) == pytest.approx([62.5, 0, 325])


def test_a_lease_moved_to_the_endpoint_that_served_releases_there() -> None:
    inflight = InFlight(3)
    lease = inflight.acquire(0, 50)
    assert lease.move(2)
    assert inflight.requests.tolist() == [0, 0, 1] and inflight.tokens.tolist() == [0, 0, 50]
    assert inflight.sent.tolist() == [1, 0, 0]  # decisions stay where they were made
    lease.release()
    assert inflight.requests.tolist() == [0, 0, 0] and inflight.tokens.tolist() == [0, 0, 0]
    assert not lease.move(1)  # released: it counts nowhere
    assert inflight.requests.tolist() == [0, 0, 0]


def test_a_moved_lease_takes_what_is_left_of_its_prefill_and_its_recent_work_along() -> None:
    # A retry the first endpoint refused was served by another: the refusing one kept a backlog of work it never
    # got, and the one doing it showed none.
    now = [100.0]
    inflight = InFlight(3, clock=lambda: now[0])
    rates = np.full(3, 100.0)
    other = inflight.acquire(0, 10, prefill=(400.0, 100.0))  # another request's work stays on endpoint 0
    lease = inflight.acquire(0, 10, prefill=(1000.0, 100.0))
    inflight.acquire(2, 10, prefill=(200.0, 100.0))
    now[0] += 1.0  # 90 tokens of endpoint 0's backlog drained: 1,310 left, of which this request's 1,000 - 90
    recent = inflight.recent_prefill(np.arange(3))
    assert lease.move(2)
    backlog = inflight.pending_prefill(np.arange(3), rates)
    assert backlog.tolist() == pytest.approx([1310 - 910, 0, 200 - 90 + 910])
    # The requests waiting in each backlog drain with its tokens (2 in 1,400 -> 1,310 at 0, 1 in 200 -> 110 at 2); one
    # moves from the first to the last.
    waiting = [2 * 1310 / 1400 - 1, 0, 110 / 200 + 1]
    assert inflight.waiting_prefill(np.arange(3), rates).tolist() == pytest.approx(waiting)
    moved = 1000 * 0.5 ** (1.0 / RECENT_HALF_LIFE_S)
    assert inflight.recent_prefill(np.arange(3)) == pytest.approx([recent[0] - moved, 0, recent[2] + moved])
    other.release()


def test_a_lease_moves_within_the_counters_that_replaced_its_own() -> None:
    old = InFlight(3)
    lease = old.acquire(1, 10)
    mapping = np.array([1, 2, -1])  # old 1 is now 0, old 2 is now 1, a new endpoint joined as 2
    new = old.moved(mapping)
    old.hand_over(new, mapping)
    assert lease.current() == (new, 0)
    assert lease.move(2)
    assert new.requests.tolist() == [0, 0, 1] and new.tokens.tolist() == [0, 0, 10]
    lease.release()
    assert new.requests.tolist() == [0, 0, 0] and old.requests.tolist() == [0, 1, 0]  # the old ones are not read


def test_peers_load_counts_in_requests_sent_and_the_prefill_backlog() -> None:
    now = [100.0]
    inflight = InFlight(2, clock=lambda: now[0])
    inflight.acquire(0, 10, prefill=(1000.0, 100.0))  # 1,000 tokens to prefill at 100 a second
    decisions = inflight.decisions
    none = np.zeros(2)
    peers = Load(
        np.array([2, 0]), np.array([20, 0]), np.array([5, 1]), np.array([500.0, 0.0]), np.array([99.0, 0.0]), none
    )
    inflight.set_peers(peers)
    assert inflight.requests.tolist() == [3, 0] and inflight.tokens.tolist() == [30, 0]
    assert inflight.sent.tolist() == [6, 1]  # its own one and the peers' six: the saturation rule sees them all
    assert inflight.decisions == decisions + 6  # a version that moves with what the peers sent
    now[0] = 102.0
    # Its own 1,000 less 2 s drained, and the peers' 500 (of a second earlier) less 3 s, each at DRAIN_SHARE of 100/s.
    expected = 1000 - 200 * DRAIN_SHARE + 500 - 300 * DRAIN_SHARE
    assert inflight.pending_prefill(np.array([0, 1]), np.array([100.0, 100.0])) == pytest.approx([expected, 0.0])
    own = inflight.own()
    assert own.requests.tolist() == [1, 0] and own.sent.tolist() == [1, 0] and own.backlog.tolist() == [1000.0, 0.0]
    inflight.set_peers(Load.zero(2))  # the peers gone
    assert inflight.requests.tolist() == [1, 0] and inflight.sent.tolist() == [1, 0]


def test_a_peer_backlog_counts_until_cleared_and_moves_with_the_pool() -> None:
    # pending_prefill skips the peers' part while none has a backlog: it must come back with one, go with it, and
    # follow the counters that replace these after a membership change.
    now = [100.0]
    inflight = InFlight(2, clock=lambda: now[0])
    rates = np.array([100.0, 100.0])
    assert inflight.pending_prefill(np.arange(2), rates).tolist() == [0.0, 0.0]
    inflight.set_peers(
        Load(
            np.array([0, 1]),
            np.array([0, 5]),
            np.array([0, 1]),
            np.array([0.0, 400.0]),
            np.array([0.0, 100.0]),
            rates * 0,
        )
    )
    assert inflight.pending_prefill(np.arange(2), rates).tolist() == [0.0, 400.0]
    moved = inflight.moved(np.array([1, 0, -1]))  # old 1 is now 0; a new endpoint joined as 2
    assert moved.pending_prefill(np.arange(3), np.array([100.0, 100.0, 100.0])).tolist() == [400.0, 0.0, 0.0]
    inflight.set_peers(Load.zero(2))
    assert inflight.pending_prefill(np.arange(2), rates).tolist() == [0.0, 0.0]


def test_loads_add_up_with_their_backlogs_dated_by_weight() -> None:
    one = Load(np.array([1]), np.array([10]), np.array([3]), np.array([300.0]), np.array([10.0]), np.array([50.0]))
    two = Load(np.array([2]), np.array([20]), np.array([4]), np.array([100.0]), np.array([14.0]), np.array([25.0]))
    total = Load.sum([one, two], 1)
    assert (total.requests.tolist(), total.tokens.tolist(), total.sent.tolist()) == ([3], [30], [7])
    assert total.backlog.tolist() == [400.0] and total.backlog_at.tolist() == [11.0]
    assert total.exact.tolist() == [75.0]
    assert Load.sum([], 3).requests.tolist() == [0, 0, 0]


def test_with_first_tokens_reported_the_backlog_is_the_prompts_still_waiting_for_theirs() -> None:
    now = [100.0]
    inflight = InFlight(3, clock=lambda: now[0])
    inflight.first_tokens = True
    rates = np.array([1000.0, 1000.0, 1000.0])
    a = inflight.acquire(0, 2100, (2000, 1000), streamed=True)  # 100 of its tokens cached there: 2,000 to prefill
    b = inflight.acquire(0, 500, (500, 1000), streamed=True)
    inflight.acquire(1, 700)  # no estimate: nothing in the backlog
    c = inflight.acquire(2, 900, (900, 1000), streamed=True)
    # Not streamed: its first token comes with its whole answer, so its tokens drain at the rate instead.
    d = inflight.acquire(1, 3000, (3000, 1000))
    assert d.unprefilled == 0 and inflight.pending_prefill(np.arange(3), rates).tolist() == [2500, 3000, 900]
    now[0] = 100.0 + 1 / DRAIN_SHARE  # the time to prefill 1,000 tokens at DRAIN_SHARE of 1,000 a second
    assert inflight.pending_prefill(np.arange(3), rates) == pytest.approx([2500, 2000, 900])
    now[0] = 160.0  # a minute on: a drained estimate would be 0 everywhere; no first token came, so nothing is done
    assert inflight.pending_prefill(np.arange(3), rates).tolist() == [2500, 0, 900]
    assert inflight.pending_prefill_at(0, 1000.0) == 2500
    a.first_token()
    a.first_token()  # idempotent
    assert inflight.pending_prefill(np.arange(3), rates).tolist() == [500, 0, 900]
    a.release()  # its tokens left the backlog at its first token, not again at its end
    b.release()  # ended before any first token (a client gone): its tokens go at its end
    assert inflight.pending_prefill(np.arange(3), rates).tolist() == [0, 0, 900]
    d.release()
    assert inflight.requests.tolist() == [0, 1, 1]
    c.move(1)  # a retry served it on endpoint 1: its waiting tokens go with it
    assert inflight.pending_prefill(np.arange(3), rates).tolist() == [0, 900, 0]
    moved = inflight.moved(np.array([1, -1]))  # endpoint 1 is now 0 (and 0, 2 left): the flag and the count follow
    inflight.hand_over(moved, np.array([1, -1]))
    assert moved.first_tokens and moved.pending_prefill(np.arange(2), rates[:2]).tolist() == [900, 0]
    # What a replica would tell its peers: the exact backlog apart from the estimated one, which goes as it was
    # sent (the unstreamed 3,000 at 100 s), for them to drain from its time.
    own = moved.own()
    assert own.exact.tolist() == [900, 0] and own.backlog.tolist() == [3000, 0] and own.backlog_at[0] == 100.0
    moved.acquire(1, 1000, (1000, 100.0))  # unstreamed: 1,000 drained at 100 tokens/s
    now[0] = 162.0
    own = moved.own()
    assert own.exact.tolist() == [900, 0] and own.backlog.tolist() == [3000, 1000] and own.backlog_at[1] == 160.0
    c.first_token()  # told through the lease, wherever the request counts now
    assert moved.pending_prefill(np.arange(2), rates[:2]).tolist() == [0, 0]
    assert moved.own().exact.tolist() == [0, 0]


def test_a_peers_exact_backlog_counts_as_it_is_and_its_estimate_drains() -> None:
    # A peer's streamed requests still waiting for their first token are work the endpoint has not done however
    # long ago they were sent; only its estimated part drains at the endpoint's rate.
    now = [100.0]
    inflight = InFlight(2, clock=lambda: now[0])
    rates = np.array([100.0, 100.0])
    ints = np.zeros(2, dtype=np.int64)
    inflight.set_peers(Load(ints, ints, ints, np.array([300.0, 0.0]), np.array([100.0, 0.0]), np.array([0.0, 800.0])))
    assert inflight.pending_prefill(np.arange(2), rates).tolist() == [300.0, 800.0]
    now[0] = 160.0
    assert inflight.pending_prefill(np.arange(2), rates).tolist() == [0.0, 800.0]
    assert inflight.pending_prefill_at(1, 100.0) == 800.0
    moved = inflight.moved(np.array([1]))  # endpoint 1 is now 0: its peers' exact backlog follows
    assert moved.pending_prefill(np.arange(1), rates[:1]).tolist() == [800.0]
    inflight.set_peers(Load.zero(2))
    assert inflight.pending_prefill(np.arange(2), rates).tolist() == [0.0, 0.0]


def test_without_first_tokens_reported_a_first_token_changes_nothing() -> None:
    # The drained estimate stays the backlog: a report that reaches the lease leaves it as it was.
    now = [100.0]
    inflight = InFlight(1, clock=lambda: now[0])
    lease = inflight.acquire(0, 2000, (2000, 1000), streamed=True)
    now[0] = 100.0 + 1 / DRAIN_SHARE
    lease.first_token()
    assert inflight.pending_prefill(np.arange(1), np.array([1000.0])) == pytest.approx([1000])


def _read_only(values: list[int]) -> np.ndarray:
    array = np.array(values, dtype=np.intp)
    array.flags.writeable = False
    return array


def test_counters_are_read_whole_only_for_a_read_only_array_of_every_endpoint_in_order() -> None:
    inflight = InFlight(4)
    for index, tokens in ((0, 10), (1, 200), (1, 30), (3, 4000)):
        inflight.acquire(index, tokens)
    everyone = _read_only([0, 1, 2, 3])  # what a pool hands on every request
    assert inflight.whole(everyone)
    assert inflight.whole(everyone)  # now known by identity
    writable = np.arange(4)  # may change after the check: never taken as whole
    reversed_ = _read_only([3, 2, 1, 0])
    some = _read_only([1, 3])
    assert not inflight.whole(writable)
    assert not inflight.whole(reversed_)
    assert not inflight.whole(reversed_)  # known by identity as well
    assert not inflight.whole(some)
    for candidates in (everyone, writable, reversed_, some):
        assert inflight.few(inflight.requests, candidates) == inflight.requests[candidates].tolist()
        assert inflight.few(inflight.tokens, candidates) == inflight.tokens[candidates].tolist()
    assert inflight.few(inflight.tokens, reversed_) == [4000, 0, 230, 10]


@pytest.mark.parametrize("busy", [False, True], ids=["own-backlog", "exact-and-peer-backlogs"])
def test_the_backlog_read_whole_is_the_backlog_read_by_index(busy: bool) -> None:
    now = [0.0]
    inflight = InFlight(3, clock=lambda: now[0])
    inflight.acquire(0, 1000, (800.0, 10_000.0))
    inflight.acquire(2, 5000, (5000.0, 20_000.0))
    if busy:  # a streamed request's exact backlog, and other replicas' load
        inflight.first_tokens = True
        inflight.acquire(1, 300, (300.0, 10_000.0), streamed=True)
        ints = np.array([1, 0, 2], dtype=np.int64)
        inflight.set_peers(Load(ints, ints * 100, ints, np.array([50.0, 0.0, 900.0]), np.zeros(3), np.full(3, 7.0)))
    now[0] = 0.01
    drain = [10_000.0 * DRAIN_SHARE, 10_000.0 * DRAIN_SHARE, 20_000.0 * DRAIN_SHARE]
    everyone = _read_only([0, 1, 2])
    whole = inflight.prefill_queue_few(everyone, drain, waiting=True)
    assert inflight.whole(everyone)
    assert whole == inflight.prefill_queue_few(np.arange(3), drain, waiting=True)
    if busy:  # endpoint 1: the streamed prompt and the peers' exact backlog, which do not drain
        assert whole[0][1] == 300.0 + 7.0
    else:
        assert whole[0][1] == 0.0 and 0.0 < whole[0][0] < 800.0 and 0.0 < whole[0][2] < 5000.0
    reversed_ = _read_only([2, 1, 0])
    pending, counted = inflight.prefill_queue_few(reversed_, drain[::-1], waiting=True)
    assert pending == whole[0][::-1]
    assert counted == whole[1][::-1]  # type: ignore[index]

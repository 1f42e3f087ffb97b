"""In-flight accounting: what the picker has sent to each endpoint, with no scrape lag.

* ``requests`` and ``tokens``: requests (and their estimated prompt tokens) sent and not yet seen finish; they
  move on every decision and every completion.
* ``sent``: requests ever sent (with the peers' sends, for replicas).
* The prefill backlog: the work of the prompt tokens sent that the endpoint has not prefilled yet (in tokens, as the
  predictor counts a prompt's work: its uncached tokens weighted for their attention, `scorer.loadscorers`'s
  ``ATTENTION_TOKENS``; the leases bring it, this module adds and drains it). Where each request's first token
  is reported (``first_tokens``: the filter times the responses, ``otel.latency_source: stream``), a streamed
  request's part is exact: its uncached tokens count until its first token (`Lease.first_token`). Elsewhere, and for
  a request whose response is not streamed (its first token comes with its whole answer), it is estimated: a
  prompt's tokens count until its endpoint has had time to prefill them at `DRAIN_SHARE` of its learned rate.
  Either way not until its request ends: a server busy decoding long answers is not one with a long queue to
  prefill. With the backlog, how many requests it holds (`waiting_prefill`): exact where it is exact, else
  estimated, draining with the estimated backlog's tokens (a backlog half drained holds half its requests).
* Recent prefill work: the prompt tokens sent to prefill (the uncached part, where the profile estimated it),
  summed with a decay of half-life `RECENT_HALF_LIFE_S`. It forgets a prompt at a fixed pace, whether or not its
  request is still running: what a server was given to do in the last few seconds (the ``recent-prefill`` scorer).
  This replica's own only.
* Other replicas' `Load` (`set_peers`, from the replicas' exchange): counted with this replica's own, so that
  every scorer, the saturation rule and the prefill estimate see the pool's load, not one replica's share.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_NOTHING = 1e-9  # tokens: less than any backlog held

RECENT_HALF_LIFE_S = 2.0
"""Half-life of the recent prefill work, seconds: a few times a long prompt's prefill, so that it tells which
servers were given the most to do lately, and short enough that a burst is forgotten soon after it is served."""

DRAIN_SHARE = 0.9
"""The estimated prefill backlog drains at this share of the endpoint's learned prefill rate. The rate prices one
request's wait (`scorer.speeds`); a backlog drains a little slower, because its server also runs decode steps
between the prefill chunks. In the simulator (bench/results/quality/fleets, three seeds, four fleets of one kind
of server, four traces, loads 0.6-1.0, the responses' first tokens not timed) 0.9 rather than 1 took the rows
whose TTFT p99 was over 1.15x the oracle's from 9 of 144 to 3 (the A100s' Azure conversation trace at 0.8: 1.21-1.37x
to 1.09-1.15x); 0.8 helped one fleet and hurt others."""


FEW_AS_LIST = 32
"""Up to this many candidates the routing core's per-decision arithmetic runs on Python lists, beyond it on numpy
arrays: on a few values numpy's cost per call (a microsecond or so, whatever the length) is most of the work, and
from about 64 values the list costs more. Both ways compute the same numbers: the same IEEE operations in the same
order (tests/scorer/test_few.py holds each pair to it). On 4 endpoints the default preset's route and release
take 12-14% fewer CPU instructions so, the whole stream handler 8-9% (`inferlb bench hop --instructions`)."""


def overloaded(load: np.ndarray, guard: float) -> np.ndarray | None:
    """The imbalance guard of prefix affinity: which candidates hold more than ``guard x (the mean in-flight
    requests of the other candidates + 1)``, as a mask; None when none does (the common case, found cheaply).

    The others' mean, not all candidates': on a small pool a server that piles up requests lifts a mean that counts
    itself (3 servers, two holding 3 requests each: it would need 19 to be over 2x, against 9 here), and a prefix
    it caches holds traffic on it long after it has turned slow.
    """
    n = len(load)
    if n < 2 or guard == math.inf:
        return None
    # load_i > guard * ((total - load_i) / (n - 1) + 1), solved for load_i: one bound for every candidate. For whole
    # request counts and a whole guard it decides as the exact rational would: a quotient that is not a whole number
    # is too far from one (at least 1 / (n - 1 + guard)) for rounding to carry it across.
    if n <= FEW_AS_LIST:  # the sum and the busiest as Python ints: a quarter of numpy's per-call cost, same bar
        values = load.tolist()
        total, busiest = sum(values), max(values)
    else:
        total, busiest = np.add.reduce(load), load[load.argmax()]  # cheaper than load.sum() and load.max()
    bar = guard * (total + n - 1) / (n - 1 + guard)
    if busiest <= bar:  # only the busiest can be the first over
        return None
    return load > bar


class InFlight:
    """Per-endpoint counters, as arrays aligned with the pool (read them, never write them directly).

    Owned by the event loop that routes requests: not thread-safe, and it need not be, because the counters
    change only on that loop. ``clock`` (seconds) dates the prefill backlog.
    """

    def __init__(self, size: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.requests = np.zeros(size, dtype=np.int64)
        self.tokens = np.zeros(size, dtype=np.int64)
        self.sent = np.zeros(size, dtype=np.int64)
        self.decisions = 0  # requests counted so far (and counts raised otherwise), all endpoints: a version
        # Times a count went down (a request ended or moved away, or the peers' changed): with ``decisions``, the
        # counters' version for a reader that must see a count fall (the saturation rule's cache).
        self.lowered = 0
        self.clock = clock
        # Whether streamed responses' first tokens are reported (`Lease.first_token`): a streamed request's tokens
        # then wait in _unprefilled until its first token, instead of draining at a rate in _prefill.
        self.first_tokens = False
        # Prompt tokens not yet prefilled at the time in _prefill_at; they drain at DRAIN_SHARE of the rate given by
        # the reader.
        self._prefill = np.zeros(size)
        self._prefill_at = np.zeros(size)
        # The requests in that backlog at the time in _prefill_at: they drain with its tokens.
        self._prefill_n = np.zeros(size)
        # The rate (tokens/s) the last request counted there was estimated with: what a lease that moves (a retry
        # served elsewhere) drains the backlog with, where no reader gives one.
        self._prefill_rate = np.zeros(size)
        # Uncached prompt tokens of the streamed requests counted here whose first token has not been reported, and
        # how many requests those are.
        self._unprefilled = np.zeros(size)
        self._unprefilled_n = np.zeros(size, dtype=np.int64)
        # Prompt tokens sent to prefill, decayed with RECENT_HALF_LIFE_S: their sum as of the time in _recent_at.
        self._recent = np.zeros(size)
        self._recent_at = np.zeros(size)
        # Set by `moved`: the counters that replaced these, and where each endpoint went there (-1: gone).
        self.successor: tuple[InFlight, np.ndarray] | None = None
        # What other picker replicas have in flight (`set_peers`), included in ``requests`` and ``tokens``; what
        # they sent, included in ``sent``; their prefill backlog (apart: it drains on its own clock).
        self.peer_requests = np.zeros(size, dtype=np.int64)
        self.peer_tokens = np.zeros(size, dtype=np.int64)
        self.peer_sent = np.zeros(size, dtype=np.int64)
        self._peer_prefill = np.zeros(size)
        self._peer_prefill_at = np.zeros(size)
        # Their exact backlog (of streamed requests before their first token): it does not drain with time.
        self._peer_unprefilled = np.zeros(size)
        self._peer_backlog = False  # whether any peer backlog is set (without one, `pending_prefill` skips it)
        # The last `overloaded` answer: (candidates, guard, decisions, lowered, mask).
        self._overloaded: tuple[np.ndarray, float, int, int, np.ndarray | None] | None = None
        # The read-only candidates array last found to list every endpoint in order (`whole`), and the last found not
        # to: a pool hands the same array on every request.
        self._whole_for: np.ndarray | None = None
        self._not_whole_for: np.ndarray | None = None

    def _backlog_add(self, index: int, tokens: float, now: float) -> None:
        """Add ``tokens`` (one request's; negative: take them out) to endpoint ``index``'s estimated prefill backlog,
        drained to ``now`` at the rate its last request was counted with."""
        held = self._prefill.item(index)
        left = max(held - self._prefill_rate.item(index) * DRAIN_SHARE * (now - self._prefill_at.item(index)), 0.0)
        waiting = self._prefill_n.item(index) * left / held if held > 0 else 0.0
        self._prefill[index] = max(left + tokens, 0.0)
        self._prefill_n[index] = max(waiting + (1.0 if tokens > 0 else -1.0), 0.0)
        self._prefill_at[index] = now

    def moved(self, mapping: np.ndarray) -> InFlight:
        """The counters of the next pool after a membership change: endpoint j of the new pool has what endpoint
        ``mapping[j]`` had here (-1: it joined, and starts at zero). Changes nothing here until `hand_over`."""
        new = InFlight(len(mapping), clock=self.clock)
        new.first_tokens = self.first_tokens
        kept = mapping >= 0
        source = mapping[kept]
        for name in (*_OWN_FIELDS, *_PEER_FIELDS):
            getattr(new, name)[kept] = getattr(self, name)[source]
        new.decisions = self.decisions
        new.lowered = self.lowered
        new._peer_backlog = bool(new._peer_prefill.any() or new._peer_unprefilled.any())
        return new

    def hand_over(self, new: InFlight, mapping: np.ndarray) -> None:
        """``new`` (from `moved` with ``mapping``) is in force: leases still open here release into it from now on,
        so no request in flight is lost or counted twice. Count nothing here afterwards."""
        forward = np.full(len(self.requests), -1, dtype=np.intp)
        kept = mapping >= 0
        forward[mapping[kept]] = np.flatnonzero(kept)
        self.successor = (new, forward)

    def acquire(
        self, index: int, tokens: int, prefill: tuple[float, float] | None = None, *, streamed: bool = False
    ) -> Lease:
        """Count one request to endpoint ``index``; the returned lease must be released when it ends.

        ``prefill``, when the profile estimated it: (the prompt's tokens still to prefill there, its uncached part;
        the endpoint's prefill rate in tokens/s), added to the endpoint's prefill backlog: with ``first_tokens`` and
        a ``streamed`` response until `Lease.first_token` (or the release), else drained at `DRAIN_SHARE` of that
        rate. The recent prefill work adds the uncached part, or all ``tokens`` without an estimate."""
        self.requests[index] += 1
        self.tokens[index] += tokens
        self.sent[index] += 1
        self.decisions += 1
        now = self.clock()
        work: float = tokens
        unprefilled = 0.0
        estimated = None
        if prefill is not None:
            uncached, tokens_per_s = prefill
            work = uncached
            if self.first_tokens and streamed:
                self._unprefilled[index] += uncached
                self._unprefilled_n[index] += uncached > 0  # as long as the lease holds tokens here
                unprefilled = uncached
            else:
                # item(): a Python float, as float() of the element, without the numpy scalar in between.
                held = self._prefill.item(index)
                left = max(held - tokens_per_s * DRAIN_SHARE * (now - self._prefill_at.item(index)), 0.0)
                waiting = self._prefill_n.item(index) * left / held if held > 0 else 0.0
                self._prefill_n[index] = waiting + (uncached > 0)
                self._prefill[index] = left + uncached
                self._prefill_at[index] = now
                self._prefill_rate[index] = tokens_per_s
                estimated = (uncached, tokens_per_s, now)
        kept = 0.5 ** ((now - self._recent_at.item(index)) / RECENT_HALF_LIFE_S)
        self._recent[index] = self._recent.item(index) * kept + work
        self._recent_at[index] = now
        return Lease(self, index, tokens, unprefilled, estimated, (work, now))

    def overloaded(self, candidates: np.ndarray, guard: float) -> np.ndarray | None:
        """`overloaded` of the candidates' requests in flight, kept until a count changes (``decisions`` and
        ``lowered`` are the counters' version): the prefix-affinity scorer and the TTFT prediction of one decision
        ask the same. The mask is read-only."""
        last = self._overloaded
        if (
            last is not None
            and last[0] is candidates
            and last[1] == guard
            and last[2] == self.decisions
            and last[3] == self.lowered
        ):
            return last[4]
        over = overloaded(self.requests[candidates], guard)
        if over is not None:
            over.flags.writeable = False
        self._overloaded = (candidates, guard, self.decisions, self.lowered, over)
        return over

    def total(self) -> int:
        return int(self.requests.sum())

    def set_peers(self, load: Load) -> None:
        """Other replicas have ``load`` per endpoint (aligned with the pool; their sum): from now on ``requests``,
        ``tokens`` and ``sent`` count theirs with this replica's own, which stay as they are (`own`), and the prefill
        backlog adds theirs. What they sent since the last call counts as that many decisions, or what their counts
        rose by if more (``decisions`` is the counters' version: the saturation rule's cache holds for so many)."""
        raised = load.requests - self.peer_requests
        self.requests += raised
        self.tokens += load.tokens - self.peer_tokens
        self.lowered += 1
        more = load.sent - self.peer_sent
        self.sent += more
        # At least every count raised: the saturation rule's cache must not hold past a rise.
        self.decisions += max(int(np.abs(more).sum()), int(np.maximum(raised, 0).sum()))
        self.peer_requests = load.requests.astype(np.int64, copy=True)
        self.peer_tokens = load.tokens.astype(np.int64, copy=True)
        self.peer_sent = load.sent.astype(np.int64, copy=True)
        self._peer_prefill = load.backlog.astype(float, copy=True)
        self._peer_prefill_at = load.backlog_at.astype(float, copy=True)
        self._peer_unprefilled = load.exact.astype(float, copy=True)
        self._peer_backlog = bool(self._peer_prefill.any() or self._peer_unprefilled.any())

    def own(self) -> Load:
        """This replica's own load per endpoint (new arrays): what it tells its peers. They drain its estimated
        backlog at the endpoint's rate from its time, and count its exact one (``first_tokens``) as it is."""
        return Load(
            self.requests - self.peer_requests,
            self.tokens - self.peer_tokens,
            self.sent - self.peer_sent,
            self._prefill.copy(),
            self._prefill_at.copy(),
            np.maximum(self._unprefilled, 0.0),
        )

    def recent_prefill(self, candidates: np.ndarray) -> np.ndarray:
        """Per candidate, the prompt tokens this replica sent there to prefill, each counted with weight
        ``0.5 ** (its age / RECENT_HALF_LIFE_S)`` (a new array)."""
        age = self.clock() - self._recent_at[candidates]
        return self._recent[candidates] * np.exp2(age * (-1.0 / RECENT_HALF_LIFE_S))

    def pending_prefill_at(self, index: int, tokens_per_s: float) -> float:
        """`pending_prefill` of one endpoint, as a number (no arrays: the routing unit asks once per request)."""
        now = self.clock()
        rate = tokens_per_s * DRAIN_SHARE
        own = max(float(self._prefill[index]) - rate * (now - float(self._prefill_at[index])), 0.0)
        if self.first_tokens:
            own += max(float(self._unprefilled[index]), 0.0)
        peers = float(self._peer_prefill[index]) - rate * (now - float(self._peer_prefill_at[index]))
        return own + max(peers, 0.0) + float(self._peer_unprefilled[index])

    def waiting_prefill(self, candidates: np.ndarray, tokens_per_s: np.ndarray) -> np.ndarray:
        """Per candidate, how many of the requests this replica sent there wait for their prompt to be prefilled:
        with ``first_tokens`` the streamed ones whose first token has not come, plus the estimated backlog's
        requests in the share of its tokens not yet drained at `DRAIN_SHARE` of ``tokens_per_s`` (a fraction: the
        chance that one still waits). The peers' requests are not counted: `Load` carries their backlog's tokens,
        not its requests."""
        waiting = self.prefill_queue(candidates, tokens_per_s * DRAIN_SHARE, waiting=True)[1]
        assert waiting is not None, "asked for"
        return waiting

    def pending_prefill(self, candidates: np.ndarray, tokens_per_s: np.ndarray) -> np.ndarray:
        """Per candidate, the prompt tokens sent there that it has not prefilled: with ``first_tokens`` those of the
        streamed requests whose first token has not come, plus (always) those it has not had time to prefill at
        `DRAIN_SHARE` of ``tokens_per_s`` (aligned with ``candidates``). The peers' backlog drains likewise."""
        return self.prefill_queue(candidates, tokens_per_s * DRAIN_SHARE)[0]

    def prefill_queue(
        self, candidates: np.ndarray, drain_per_s: np.ndarray, *, waiting: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """`pending_prefill` and, with ``waiting``, `waiting_prefill` (else None) at once, from one reading of the
        clock and of the backlog: ``drain_per_s`` is `DRAIN_SHARE` of each candidate's prefill rate. A prediction
        asks for both, and on a small pool each array operation costs more than its arithmetic."""
        if len(candidates) <= FEW_AS_LIST:
            pending, counted_few = self.prefill_queue_few(candidates, drain_per_s.tolist(), waiting=waiting)
            return np.array(pending), None if counted_few is None else np.array(counted_few)
        now = self.clock()
        held = self._prefill[candidates]
        left = np.maximum(held - drain_per_s * (now - self._prefill_at[candidates]), 0.0)
        counted = None
        if waiting:
            # Where nothing is held nothing is left: the floor keeps 0 / 0 out (a held backlog is at least a token).
            counted = self._prefill_n[candidates] * left / np.maximum(held, _NOTHING)
            if self.first_tokens:
                counted += self._unprefilled_n[candidates]
        own = left
        if self.first_tokens:
            own = own + np.maximum(self._unprefilled[candidates], 0.0)
        if not self._peer_backlog:  # no replicas, or none with a backlog: half the work, on every prediction
            return own, counted
        peers = self._peer_prefill[candidates] - drain_per_s * (now - self._peer_prefill_at[candidates])
        return own + np.maximum(peers, 0.0) + self._peer_unprefilled[candidates], counted

    def whole(self, candidates: np.ndarray) -> bool:
        """Whether ``candidates`` lists every endpoint in order, so that ``counter[candidates]`` is the counter itself
        and a read needs no indexing (reading four values whole costs 40% of indexing them first). Only a read-only
        array can be: the answer is kept by identity (the pool's arrays are read-only and the same on every request),
        and an array that can change is not checked at all."""
        if candidates is self._whole_for:
            return True
        if (
            candidates is self._not_whole_for
            or candidates.flags.writeable
            or len(candidates) != len(self.requests)
            or candidates.dtype.kind not in "iu"
        ):
            return False
        if not (candidates == np.arange(len(candidates))).all():
            self._not_whole_for = candidates
            return False
        self._whole_for = candidates
        return True

    def few(self, counter: np.ndarray, candidates: np.ndarray) -> list[Any]:
        """``counter[candidates].tolist()`` (``counter`` one of these counters), without the indexing where the
        candidates are every endpoint (`whole`)."""
        if candidates is self._whole_for or self.whole(candidates):
            return counter.tolist()
        return counter[candidates].tolist()

    def prefill_queue_few(
        self, candidates: np.ndarray, drain_per_s: list[float], *, waiting: bool = False
    ) -> tuple[list[float], list[float] | None]:
        """`prefill_queue` as Python lists, for at most `FEW_AS_LIST` candidates (``drain_per_s`` a list too): the
        same numbers, without numpy's per-call cost."""
        now = self.clock()
        # Every endpoint in order (the usual case): the counters are read whole, without indexing.
        whole = candidates is self._whole_for or self.whole(candidates)
        held = (self._prefill if whole else self._prefill[candidates]).tolist()
        at = (self._prefill_at if whole else self._prefill_at[candidates]).tolist()
        # Indices rather than zip(..., strict=True), whose keyword alone costs more than the arithmetic of a few
        # candidates (the lists are all the candidates' length); conditionals, not max(): the same numbers (NaN
        # passing, as through np.maximum), without a call each.
        span = range(len(held))
        left = [0.0 if (x := held[i] - drain_per_s[i] * (now - at[i])) < 0.0 else x for i in span]
        counted = None
        if waiting:
            requests = (self._prefill_n if whole else self._prefill_n[candidates]).tolist()
            counted = [requests[i] * left[i] / (_NOTHING if held[i] < _NOTHING else held[i]) for i in span]
            if self.first_tokens:
                unprefilled_n = self.few(self._unprefilled_n, candidates)
                counted = [counted[i] + unprefilled_n[i] for i in span]
        own = left
        if self.first_tokens:
            unprefilled = self.few(self._unprefilled, candidates)
            own = [left[i] + max(unprefilled[i], 0.0) for i in span]
        if not self._peer_backlog:
            return own, counted
        peer = self.few(self._peer_prefill, candidates)
        peer_at = self.few(self._peer_prefill_at, candidates)
        peer_unprefilled = self.few(self._peer_unprefilled, candidates)
        return [
            own[i] + max(peer[i] - drain_per_s[i] * (now - peer_at[i]), 0.0) + peer_unprefilled[i] for i in span
        ], counted


_PEER_FIELDS = ("peer_requests", "peer_tokens", "peer_sent", "_peer_prefill", "_peer_prefill_at", "_peer_unprefilled")
_OWN_FIELDS = (
    "requests",
    "tokens",
    "sent",
    "_prefill",
    "_prefill_at",
    "_prefill_n",
    "_prefill_rate",
    "_unprefilled",
    "_unprefilled_n",
    "_recent",
    "_recent_at",
)


@dataclass(frozen=True, slots=True)
class Load:
    """What one replica (or several, `sum`) has on each endpoint of a pool: requests and tokens in flight, requests
    sent so far (a cumulative count), the estimated prefill backlog (prompt tokens not yet prefilled as of
    ``backlog_at``, on the reader's clock: it drains from then as `InFlight` drains its own), and the exact one
    (``exact``: uncached prompt tokens of streamed requests whose first token has not come; it does not drain)."""

    requests: np.ndarray
    tokens: np.ndarray
    sent: np.ndarray
    backlog: np.ndarray
    backlog_at: np.ndarray
    exact: np.ndarray

    @staticmethod
    def zero(size: int) -> Load:
        ints, floats = np.zeros(size, dtype=np.int64), np.zeros(size)
        return Load(ints, ints, ints, floats, floats, floats)

    @staticmethod
    def sum(loads: Sequence[Load], size: int) -> Load:
        """The loads together. Backlogs add up; their time is the backlog-weighted mean of theirs (the replicas'
        backlogs drain together at the endpoint's rate, so one time for the sum is an approximation)."""
        if not loads:
            return Load.zero(size)
        backlog = np.sum([x.backlog for x in loads], axis=0)
        weighted = np.sum([x.backlog * x.backlog_at for x in loads], axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            at = np.where(backlog > 0, weighted / backlog, 0.0)
        return Load(
            np.sum([x.requests for x in loads], axis=0).astype(np.int64),
            np.sum([x.tokens for x in loads], axis=0).astype(np.int64),
            np.sum([x.sent for x in loads], axis=0).astype(np.int64),
            backlog,
            at,
            np.sum([x.exact for x in loads], axis=0),
        )


class Lease:
    """One counted request. ``release()`` is idempotent, so every exit path may call it; so is ``first_token()``.
    ``unprefilled``: its uncached prompt tokens while its first token has not been reported (then 0)."""

    __slots__ = ("_inflight", "estimated", "index", "released", "tokens", "unprefilled", "work")

    def __init__(
        self,
        inflight: InFlight,
        index: int,
        tokens: int,
        unprefilled: float = 0.0,
        estimated: tuple[float, float, float] | None = None,
        work: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self._inflight = inflight
        self.index = index
        self.tokens = tokens
        self.unprefilled = unprefilled
        # Its part of the estimated backlog: (uncached tokens, the rate they drain at, when counted), and the prefill
        # work it added to the recent work (tokens, when): what moves with it if a retry is served elsewhere.
        self.estimated = estimated
        self.work = work
        self.released = False

    def current(self) -> tuple[InFlight, int] | None:
        """The counters this request counts in now and its endpoint's index there (the pool may have changed
        since the decision); None once released, or when its endpoint's state is gone."""
        if self.released:
            return None
        inflight, index = self._inflight, self.index
        while inflight.successor is not None:  # the pool changed while the request was in flight
            inflight, forward = inflight.successor
            index = int(forward[index])
            if index < 0:
                return None  # its endpoint's state is gone (it can go only once its last request has ended)
        return inflight, index

    def move(self, index: int) -> bool:
        """The request is served by endpoint ``index`` of the counters it counts in now (`current`), not by the
        one it was counted to (the data plane retried it elsewhere): its request and tokens count there from now
        on. False if it counts nowhere (released, or its endpoint gone). ``sent`` stays: it counts decisions."""
        where = self.current()
        if where is None:
            return False
        inflight, old = where
        inflight.requests[old] -= 1
        inflight.tokens[old] -= self.tokens
        inflight.lowered += 1
        inflight.requests[index] += 1
        inflight.decisions += 1  # a count raised, as by a decision (the saturation rule's cache)
        inflight.tokens[index] += self.tokens
        if self.unprefilled:
            inflight._unprefilled[old] -= self.unprefilled
            inflight._unprefilled_n[old] -= 1
            inflight._unprefilled[index] += self.unprefilled
            inflight._unprefilled_n[index] += 1
        now = inflight.clock()
        if self.estimated is not None:  # what is left of its estimated prefill waits on the endpoint that serves it
            uncached, rate, counted_at = self.estimated
            share = max(uncached - rate * DRAIN_SHARE * (now - counted_at), 0.0)
            if share > 0:
                inflight._backlog_add(old, -share, now)
                inflight._backlog_add(index, share, now)
            self.estimated = (share, rate, now)
        tokens, at = self.work
        if tokens:  # and so does its part of the recent prefill work
            part = tokens * 0.5 ** ((now - at) / RECENT_HALF_LIFE_S)
            for endpoint, sign in ((old, -1.0), (index, 1.0)):
                kept = 0.5 ** ((now - inflight._recent_at.item(endpoint)) / RECENT_HALF_LIFE_S)
                inflight._recent[endpoint] = max(inflight._recent.item(endpoint) * kept + sign * part, 0.0)
                inflight._recent_at[endpoint] = now
            self.work = (part, now)
        self._inflight, self.index = inflight, index
        return True

    def first_token(self) -> None:
        """The request's first token came: its prompt is prefilled, and leaves its endpoint's exact backlog."""
        if not self.unprefilled:
            return
        where = self.current()
        if where is not None:
            inflight, index = where
            inflight._unprefilled[index] -= self.unprefilled
            inflight._unprefilled_n[index] -= 1
        self.unprefilled = 0.0

    def release(self) -> None:
        where = self.current()
        self.released = True
        if where is None:
            return
        inflight, index = where
        inflight.requests[index] -= 1
        inflight.tokens[index] -= self.tokens
        if self.unprefilled:
            inflight._unprefilled[index] -= self.unprefilled
            inflight._unprefilled_n[index] -= 1
            self.unprefilled = 0.0
        inflight.lowered += 1

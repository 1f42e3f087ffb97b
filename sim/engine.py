"""The emulated inference engine: vLLM V1-style continuous batching on a clock the caller drives.

One model, two clocks: the live server (`sim/server.py`) maps wall time to engine time, the discrete-event
simulator (`sim/des.py`) jumps from event to event. Both only call `advance(t)` (run every step that ends by
``t``), `add` and the fault methods, so the two see the same steps.

The scheduler follows vLLM's V1 engine: each step has a token budget (``max_num_batched_tokens``) and at most
``max_num_seqs`` running requests. Running requests are scheduled first, in order, each taking the tokens it still
needs (one for a decoding request, a chunk of its prompt for a prefilling one: chunked prefill). When a running
request cannot get the KV blocks it needs, the most recently admitted running request is preempted by recompute
(its blocks are freed; it goes back to the front of the waiting queue and later recomputes prompt and output so
far). Then, if nothing was preempted, waiting requests are admitted in FIFO order while budget, sequence slots
and blocks last; a waiting request first takes the prompt blocks already in the prefix cache. The prefix-cache
counters (``prefix_queries``, ``prefix_hits``; vLLM's ``vllm:prefix_cache_queries`` and ``_hits``) count a request's
first admission only, as vLLM's do: a preempted request that finds its own blocks again on readmission would
otherwise count them as hits, and a policy that overloads servers would look cache-friendly. The step that
computes the last prompt token also samples the first output token (time to first token ends there); each later
step gives one token.

A step's duration is `ServerProfile.step_time` of its batch, times a seeded jitter factor and the fault slow-down.
Identical decode steps are not simulated one by one: when a step is decode-only and nothing can change the batch
before a request finishes or blocks run out, the engine plans a *segment* of k such steps and computes the end of
any of them in closed form (the KV read grows by the batch size each step, so the durations form an arithmetic
series). A segment is cut short, after the step in progress, whenever a request arrives or a fault changes.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from inferlb.sim.kvcache import BlockTable, KVCache, KVListener
from inferlb.sim.profiles import ServerProfile

__all__ = ["EngineModel", "EngineOptions", "RequestState", "SimRequest"]


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class SimRequest:
    """One request inside the engine. Times are engine seconds; ``None`` until the event happened.

    ``prompt_hashes`` are the chained hashes of the prompt's full blocks (see `sim/tokens.py`); ``max_tokens`` is
    the exact number of output tokens the request will get (>= 1). ``token_ids`` are the prompt's token ids when the
    caller knows them (the live server does; the discrete-event simulator does not): they only go into the KV-cache
    listener's events, ``block_size`` per cached block. The engine updates the progress fields; callers read them.
    """

    __slots__ = (
        "arrival",
        "blocks",
        "cached_tokens",
        "computed",
        "finished_at",
        "first_token_at",
        "id",
        "max_tokens",
        "output",
        "preemptions",
        "prompt_hashes",
        "prompt_tokens",
        "scheduled_at",
        "server",
        "state",
        "tag",
        "token_ids",
    )

    def __init__(
        self,
        id: str,
        prompt_tokens: int,
        max_tokens: int,
        prompt_hashes: Sequence[int] = (),
        tag: object = None,
        token_ids: Sequence[int] = (),
    ) -> None:
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(f"request {id}: prompt_tokens and max_tokens must be >= 1")
        self.id = id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.prompt_hashes = prompt_hashes
        self.token_ids = token_ids
        self.tag = tag
        self.server = ""
        self.state = RequestState.WAITING
        self.arrival = 0.0
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.computed = 0
        self.output = 0
        self.cached_tokens = 0
        self.preemptions = 0
        self.blocks = BlockTable()

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output

    @property
    def queue_s(self) -> float | None:
        return None if self.scheduled_at is None else self.scheduled_at - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Per-engine knobs. ``jitter`` is the standard deviation of the log of each step's time factor (0: none);
    ``fast_forward=False`` runs identical decode steps one by one (slower; the same result without jitter)."""

    seed: int = 0
    jitter: float = 0.02
    cold_start: bool = False
    fast_forward: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.jitter) and 0 <= self.jitter < 1):
            raise ValueError(f"EngineOptions.jitter must be in [0, 1); got {self.jitter!r}")


class _Segment:
    """k steps with one batch; step i (0-based) takes ``base + growth * i`` seconds, the first starting at ``start``."""

    __slots__ = ("base", "batch", "decode_only", "done", "growth", "k", "start")

    def __init__(
        self, start: float, k: int, base: float, growth: float, batch: list[tuple[SimRequest, int]], decode_only: bool
    ) -> None:
        self.start = start
        self.k = k
        self.base = base
        self.growth = growth
        self.batch = batch
        self.decode_only = decode_only
        self.done = 0

    def end_of(self, n: int) -> float:
        """When the n-th step (1-based) ends."""
        return self.start + n * self.base + self.growth * n * (n - 1) / 2

    def steps_by(self, t: float) -> int:
        """How many steps have ended by ``t`` (0..k)."""
        elapsed = t - self.start
        if elapsed <= 0:
            return 0
        if self.growth <= 0:
            n = int(elapsed / self.base)
        else:
            b = self.base - self.growth / 2
            n = int((-b + math.sqrt(b * b + 2 * self.growth * elapsed)) / self.growth)
        n = max(0, min(n, self.k))
        # The closed form can be off by one in floating point; settle it against end_of, which is the definition.
        while n < self.k and self.end_of(n + 1) <= t:
            n += 1
        while n > 0 and self.end_of(n) > t:
            n -= 1
        return n


class EngineModel:
    """One emulated inference server's engine. Single-threaded; the caller owns the clock.

    ``now`` only moves forward through `advance`. Every request that ends, FINISHED or ABORTED, is appended to
    ``finished`` for the caller to drain. ``busy_s`` is the total time spent in steps (for GPU utilisation),
    ``steps`` the number of steps run. ``kv_listener`` hears every change to the set of cached blocks (see
    `KVListener`), from inside `advance`, `add` and `restart`.
    """

    def __init__(
        self,
        profile: ServerProfile,
        options: EngineOptions | None = None,
        *,
        now: float = 0.0,
        kv_listener: KVListener | None = None,
    ) -> None:
        self.profile = profile
        self.options = options or EngineOptions()
        self.cache = KVCache(profile.num_gpu_blocks, profile.block_size, kv_listener)
        self.now = now
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.finished: deque[SimRequest] = deque()
        self._rng = random.Random(self.options.seed)
        self._segment: _Segment | None = None
        self.ready_at = now + (profile.cold_start_s if self.options.cold_start else 0.0)
        self.slowdown = 1.0
        self.hung = False
        self.error_rate = 0.0
        self.busy_s = 0.0
        self.steps = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.restarts = 0
        self.rejected = 0

    # ---- the clock --------------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.now >= self.ready_at

    def segment_end(self) -> float | None:
        """When the planned run of steps ends (the next time a request can finish or join); None when idle."""
        seg = self._segment
        if seg is None:
            return self.ready_at if self.waiting and not self.hung and self.ready_at > self.now else None
        return seg.end_of(seg.k)

    def advance(self, t: float) -> None:
        """Run every step that ends at or before ``t``, then set ``now = t`` (never backwards)."""
        if t < self.now:
            return
        while True:
            seg = self._segment
            if seg is None:
                if self.hung or not (self.waiting or self.running) or t < self.ready_at:
                    break
                self._plan(max(self.now, self.ready_at))
                if self._segment is None:
                    break
                continue
            n = seg.steps_by(t)
            if n > seg.done:
                self._apply(seg, n)
            if seg.done < seg.k:
                break
            end = seg.end_of(seg.k)
            self._segment = None
            self._finish_segment(seg, end)
            if not self.hung:
                self._plan(end)
        self.now = t

    # ---- requests and faults --------------------------------------------------------------------------------

    def add(self, request: SimRequest) -> bool:
        """Queue ``request`` at ``now``; False (and nothing queued) if the error-rate fault rejected it."""
        if self.error_rate > 0 and self._rng.random() < self.error_rate:
            self.rejected += 1
            return False
        request.arrival = self.now
        request.state = RequestState.WAITING
        self.waiting.append(request)
        if self._segment is None:
            if not self.hung and self.ready:
                self._plan(self.now)
        else:
            self._cut()
        return True

    def abort(self, request: SimRequest) -> None:
        """Drop a request (its client went away). Its blocks are freed at once; a no-op once it has ended."""
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state is RequestState.RUNNING:
            seg = self._segment
            if seg is not None and any(r is request for r, _ in seg.batch):
                # It is in the step now running; it leaves when that step ends.
                self._cut()
                request.state = RequestState.ABORTED
                request.finished_at = self.now
                return
            self.running.remove(request)
            self.cache.release(request.blocks)
        else:
            return
        request.state = RequestState.ABORTED
        request.finished_at = self.now
        self.finished.append(request)

    def set_slowdown(self, factor: float) -> None:
        """Multiply the time of every step planned from now on by ``factor`` (> 0)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"slowdown must be a finite number > 0; got {factor!r}")
        self.slowdown = float(factor)
        self._cut()

    def set_hung(self, hung: bool) -> None:
        """A hung engine finishes the step in progress and then runs no more until un-hung."""
        self.hung = hung
        if hung:
            self._cut()
        elif self._segment is None and (self.waiting or self.running) and self.ready:
            self._plan(self.now)

    def restart(self, *, cold_start: bool = True) -> list[SimRequest]:
        """Crash and restart: every queued and running request is aborted (and returned), the cache is emptied,
        and the engine is not ready again until ``profile.cold_start_s`` from now (unless ``cold_start`` is False).
        """
        lost = [*self.running, *self.waiting]
        for request in lost:
            request.state = RequestState.ABORTED
            request.finished_at = self.now
            request.blocks = BlockTable()
            self.finished.append(request)
        self.running.clear()
        self.waiting.clear()
        self._segment = None
        self.cache.reset()
        self.restarts += 1
        self.ready_at = self.now + (self.profile.cold_start_s if cold_start else 0.0)
        return lost

    # ---- scheduling -----------------------------------------------------------------------------------------

    def _cut(self) -> None:
        """End the planned segment after the step in progress, so the scheduler runs again then."""
        seg = self._segment
        if seg is not None and seg.k > seg.done + 1:
            seg.k = seg.done + 1

    def _plan(self, start: float) -> None:
        """Schedule the batch of the step starting at ``start`` (vLLM V1's order) and plan its segment."""
        profile, cache = self.profile, self.cache
        bs = cache.block_size
        budget = profile.max_num_batched_tokens
        batch: list[tuple[SimRequest, int]] = []
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            new = min(request.num_tokens - request.computed, budget)
            need = cache.blocks_for(request.computed + new) - request.blocks.blocks
            while not cache.allocate(request.blocks, need):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                batch.append((request, new))
                budget -= new
                i += 1
                continue
            break
        if not preempted:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < profile.max_num_seqs:
                request = waiting[0]
                limit = (request.num_tokens - 1) // bs
                hits, idle = cache.match(request.prompt_hashes, limit)
                new = min(request.num_tokens - hits * bs, budget)
                need = cache.blocks_for(hits * bs + new) - hits
                if need > cache.free - idle:
                    break
                waiting.popleft()
                cache.take_cached(request.blocks, request.prompt_hashes[:hits])
                cache.allocate(request.blocks, need)
                request.computed = hits * bs
                if not request.preemptions:  # as vLLM: a preempted request finding its own blocks again is no hit
                    self.prefix_queries += request.num_tokens
                    self.prefix_hits += hits * bs
                if request.scheduled_at is None:
                    request.scheduled_at = start
                    request.cached_tokens = hits * bs
                request.state = RequestState.RUNNING
                running.append(request)
                batch.append((request, new))
                budget -= new
        if not batch:
            return
        prefill = pairs = decode = kv = 0
        for request, new in batch:
            if new == 1 and request.output > 0:
                decode += 1
                kv += request.computed
            else:
                prefill += new
                pairs += new * (request.computed + (new + 1) // 2)
        factor = self.slowdown
        if self.options.jitter:
            factor *= math.exp(self._rng.gauss(0.0, self.options.jitter))
        base = profile.step_time(prefill, pairs, decode, kv) * factor
        k = 1
        growth = 0.0
        if self.options.fast_forward and prefill == 0 and not preempted and len(batch) == len(running):
            k = self._decode_run_length()
            growth = profile.kv_read_token_s * decode * factor
        self._segment = _Segment(start, k, base, growth, batch, prefill == 0)

    def _decode_run_length(self) -> int:
        """How many identical decode steps can run before a request finishes or the blocks run out (>= 1)."""
        running = self.running
        k = min(r.max_tokens - r.output for r in running)
        if k <= 1:
            return 1
        cache = self.cache
        free = cache.free

        def extra_blocks(steps: int) -> int:
            # Blocks for steps 2..steps beyond those the first step already holds.
            return sum(cache.blocks_for(r.computed + steps) - r.blocks.blocks for r in running)

        if extra_blocks(k) <= free:
            return k
        lo, hi = 1, k  # extra_blocks(lo) == 0 <= free; extra_blocks(hi) > free
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if extra_blocks(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    def _preempt(self, request: SimRequest) -> None:
        self.cache.release(request.blocks)
        request.computed = 0
        request.state = RequestState.WAITING
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    # ---- running steps --------------------------------------------------------------------------------------

    def _apply(self, seg: _Segment, n: int) -> None:
        """Account for steps ``seg.done+1 .. n`` having run."""
        steps = n - seg.done
        self.busy_s += seg.end_of(n) - seg.end_of(seg.done)
        self.steps += steps
        if seg.decode_only:
            cache = self.cache
            more = n < seg.k
            for request, _ in seg.batch:
                request.computed += steps
                request.output += steps
                if more:
                    # The next step of the segment is already running: it holds the block for its token.
                    cache.allocate(request.blocks, cache.blocks_for(request.computed + 1) - request.blocks.blocks)
        # A mixed step is a segment of one; its effects land in _finish_segment.
        seg.done = n

    def _finish_segment(self, seg: _Segment, end: float) -> None:
        cache = self.cache
        bs = cache.block_size
        done: list[SimRequest] = []
        for request, new in seg.batch:
            if request.state is RequestState.ABORTED:
                done.append(request)
                continue
            if not seg.decode_only:
                before = request.computed
                request.computed = before + new
                hashes = request.prompt_hashes
                first, last = before // bs, min(request.computed // bs, len(hashes))
                if last > first:
                    if cache.listener is None:
                        cache.register(request.blocks, hashes[first:last])
                    else:
                        ids = request.token_ids
                        parent = hashes[first - 1] if first else None
                        cache.register(request.blocks, hashes[first:last], parent, ids[first * bs : last * bs])
                if request.computed < request.num_tokens:
                    continue
                request.output += 1
            if request.first_token_at is None:
                request.first_token_at = end
            if request.output >= request.max_tokens:
                request.state = RequestState.FINISHED
                done.append(request)
        for request in done:
            if request.state is RequestState.FINISHED or request.finished_at is None:
                request.finished_at = end
            self.running.remove(request)
            cache.release(request.blocks)
            self.finished.append(request)

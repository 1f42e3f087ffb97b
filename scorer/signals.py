"""Live server signals as one immutable snapshot: what every pick reads, what the collectors replace.

Collectors (the vLLM metrics scraper, the GPU reader, the span receiver) run as background tasks; each builds a
new `Snapshot` and swaps it into `Signals` in one assignment, so a pick never sees half an update and never waits.
Arrays are aligned with the pool (index i is endpoint i) and read-only. A value nobody has measured is NaN, never
a made-up number; scorers turn NaN into a neutral score.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from inferlb.scorer.kvindex import KVBlockIndex

__all__ = ["SIGNAL_FIELDS", "Signals", "Snapshot"]

# The per-endpoint float arrays of a snapshot, NaN where unknown.
SIGNAL_FIELDS = (
    "running",  # vllm:num_requests_running
    "waiting",  # vllm:num_requests_waiting
    "kv_usage",  # vllm:kv_cache_usage_perc, 0..1
    "kv_tokens",  # KV-cache capacity in tokens (num_gpu_blocks x block_size)
    "gpu_util",  # 0..1, from the GPU agent, DCGM or the emulator's GPU view
    "gpu_free_bytes",  # free GPU memory (summed over the endpoint's GPUs)
    "gpu_total_bytes",
    "ttft_s",  # recent time to first token (EWMA), from spans; NaN until the span receiver has data
    "e2e_s",  # recent end-to-end latency (EWMA), from spans
    "prefill_tokens_per_s",  # learned prefill rate (`scorer.speeds`); NaN until known
    "decode_step_s",  # learned decode time per step (`scorer.speeds`); NaN until known
    "peak_tokens_per_s",  # prefill rate of requests that found the server idle (`scorer.speeds`); NaN until known
)


def _frozen(values: np.ndarray) -> np.ndarray:
    values.setflags(write=False)
    return values


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Endpoint state at one moment. ``scraped_at`` is the ``time.monotonic()`` of each endpoint's last successful
    metrics scrape (NaN: never); ``up`` says whether the last scrape attempt succeeded. ``inflight_at_scrape`` is how
    many requests the picker had in flight on the endpoint (`InFlight.requests`) when that scrape began (NaN: not
    known), so that a scraped queue can be brought up to date with their growth since. Every array is read-only.
    """

    running: np.ndarray
    waiting: np.ndarray
    kv_usage: np.ndarray
    kv_tokens: np.ndarray
    gpu_util: np.ndarray
    gpu_free_bytes: np.ndarray
    gpu_total_bytes: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    prefill_tokens_per_s: np.ndarray
    decode_step_s: np.ndarray
    peak_tokens_per_s: np.ndarray
    scraped_at: np.ndarray
    up: np.ndarray
    inflight_at_scrape: np.ndarray
    built_at: float = field(default_factory=time.monotonic)
    # Per endpoint, the LoRA adapters its running and waiting requests use and its adapter slots, from
    # ``vllm:lora_requests_info`` (None: not reported). Not an array: sets of names.
    lora: tuple[Any, ...] = ()

    @classmethod
    def empty(cls, size: int) -> Snapshot:
        """Nothing known yet: every value NaN, every endpoint never scraped (and counted as up)."""
        nan: dict[str, Any] = {name: _frozen(np.full(size, np.nan)) for name in SIGNAL_FIELDS}
        return cls(
            **nan,
            scraped_at=_frozen(np.full(size, np.nan)),
            inflight_at_scrape=_frozen(np.full(size, np.nan)),
            up=_frozen(np.ones(size, dtype=bool)),
            lora=(None,) * size,
        )

    def __len__(self) -> int:
        return len(self.up)

    def age(self, now: float | None = None) -> np.ndarray:
        """Seconds since each endpoint's last successful scrape (inf: never)."""
        now = time.monotonic() if now is None else now
        age = now - self.scraped_at
        return np.where(np.isnan(age), math.inf, age)

    def over(self, max_waiting: float | np.ndarray, max_kv_usage: float) -> np.ndarray:
        """Per endpoint: more than ``max_waiting`` queued requests (one for all, or one per endpoint) or KV-cache use
        above ``max_kv_usage`` (unknown values are not over)."""
        with np.errstate(invalid="ignore"):
            return (self.waiting > max_waiting) | (self.kv_usage > max_kv_usage)

    def moved(self, mapping: np.ndarray) -> Snapshot:
        """This snapshot for the next pool after a membership change: endpoint j has what endpoint ``mapping[j]``
        had here; one that joined (-1) is unknown, never scraped."""
        kept = mapping >= 0
        source = mapping[kept]
        empty = Snapshot.empty(len(mapping))
        arrays: dict[str, Any] = {}
        for name in (*SIGNAL_FIELDS, "scraped_at", "inflight_at_scrape", "up"):
            array = np.array(getattr(empty, name), copy=True)
            array[kept] = getattr(self, name)[source]
            arrays[name] = _frozen(array)
        lora = list(empty.lora)
        if len(self.lora) == len(self):
            for j, i in enumerate(mapping.tolist()):
                if i >= 0:
                    lora[j] = self.lora[i]
        return replace(self, **arrays, lora=tuple(lora), built_at=time.monotonic())

    def with_values(self, **changes: Any) -> Snapshot:
        """A new snapshot with some arrays replaced (each copied and frozen); the rest is shared."""
        size = len(self)
        frozen: dict[str, Any] = {}
        lora = changes.pop("lora", None)
        if lora is not None:
            if len(lora) != size:
                raise ValueError(f"Snapshot.lora must have {size} entries; got {len(lora)}")
            frozen["lora"] = tuple(lora)
        for name, values in changes.items():
            array = np.array(values, dtype=bool if name == "up" else np.float64)
            if array.shape != (size,):
                raise ValueError(f"Snapshot.{name} must have shape ({size},); got {array.shape}")
            frozen[name] = _frozen(array)
        return replace(self, **frozen, built_at=time.monotonic())


class Signals:
    """The holder of the latest snapshot. Collectors call `publish`; picks read ``snapshot``.

    ``stale_after_s``: a scrape older than this no longer describes the endpoint (the staleness filter and the
    ``/endpoints`` view use it). ``clock`` (seconds) is the routing core's clock: scrape times are on it, and every
    freshness check reads it (the simulator passes its virtual clock). Single event loop; publishing is one
    attribute assignment.
    """

    def __init__(self, size: int, *, stale_after_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be > 0; got {stale_after_s!r}")
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.published = 0
        # The servers' own account of their prefix caches, where they publish KV events (set by the composition).
        self.kv: KVBlockIndex | None = None
        self._install(Snapshot.empty(size))

    def moved(self, mapping: np.ndarray, *, stale_after_s: float | None = None) -> Signals:
        """The signals of the next pool after a membership change (see `Snapshot.moved`), on the same clock."""
        signals = Signals(len(mapping), stale_after_s=stale_after_s or self.stale_after_s, clock=self.clock)
        signals._install(self.snapshot.moved(mapping))
        signals.published = self.published
        if self.kv is not None:
            signals.kv = self.kv.moved(mapping)
        return signals

    def publish(self, snapshot: Snapshot) -> None:
        if len(snapshot) != len(self.snapshot):
            raise ValueError(f"snapshot for {len(snapshot)} endpoints published to a pool of {len(self.snapshot)}")
        self._install(snapshot)
        self.published += 1

    def _install(self, snapshot: Snapshot) -> None:
        # Until when each endpoint's data is fresh (-inf: down or never scraped), and until when all of it is:
        # before that moment the staleness check of a pick is one comparison.
        fresh = np.where(
            snapshot.up & ~np.isnan(snapshot.scraped_at), snapshot.scraped_at + self.stale_after_s, -math.inf
        )
        fresh.setflags(write=False)
        self.fresh_until = fresh
        self.all_fresh_until = float(fresh.min()) if len(fresh) else math.inf
        # Until when some endpoint's is: after that moment nothing is fresh (no scraper, or every scrape failing),
        # which a pick also learns from one comparison.
        self.any_fresh_until = float(fresh.max()) if len(fresh) else -math.inf
        # Whether any endpoint was ever scraped: without a scraper nothing is fresh, and that is no news.
        self.scraped_any = bool((~np.isnan(snapshot.scraped_at)).any())
        self.snapshot = snapshot

    def stale(self, now: float | None = None) -> np.ndarray:
        """Per endpoint: no successful scrape within ``stale_after_s``, or the last attempt failed."""
        now = self.clock() if now is None else now
        return self.fresh_until < now

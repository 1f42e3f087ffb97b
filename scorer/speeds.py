"""Each server's speed, learned from the requests it served: its prefill rate and its decode step time.

The predicted-TTFT scorer (`scorer.loadscorers.TtftPredictor`) prices a request on an endpoint as the prompt
tokens queued there for prefill plus its own uncached ones, over the endpoint's prefill rate. One constant rate
for every server is wrong by 3x between an L4 and an H100, and a server's rate under load (prefill chunks beside a
decode batch) is not its rate alone. `ServerSpeeds` learns, per endpoint, the rate that makes that prediction
right:

- **Prefill rate.** When the routing unit sends a request it records the work the prediction counted for it: the
  endpoint's prefill backlog then plus the request's own uncached tokens (`sent`; tokens weighted for their attention
  over the context before them, as the predictor counts work: `scorer.loadscorers.ATTENTION_TOKENS`). When the
  request's first token is timed (the server's span, or the filter timing the response stream), the endpoint has
  prefilled that work in the TTFT less one decode step (the step that produced the token). The rate is the ratio of
  the decayed sums of work and of those times, so long prompts weigh more than short ones, whose TTFT is mostly the
  fixed step; a request whose prompt hit the cache brings little work and weighs little; queueing the backlog did
  not count lowers the rate, which is what a busier server is.
- **Decode step.** From requests that report their output tokens: (E2E - TTFT) / (output tokens - 1), as the
  ratio of decayed sums.

Both shrink toward the fleet's pooled figure as an endpoint's evidence ages (``prior_requests`` requests' worth
of the pooled figure is mixed in), so an endpoint that got no traffic for a while is priced as the fleet is, not
by what it did once; an endpoint is NaN (the caller's default) until the fleet has ``min_requests`` timings.

**Declared speeds.** On a fleet of unequal servers the pooled figure is the fast servers' (they serve most
requests), and a slow server is priced at it until its own timings outweigh it: in the simulator, on 8 H100s, 4
A100s and 4 L4s, the L4s' predicted TTFT was 3.4x too low at the median over a run, and they took most of the
slowest requests. The operator knows which server runs on what: `SpeedHints` (``pool.speeds``) maps an endpoint
label to a relative prefill speed, and with it (``relative``) the prior of endpoint i is the fleet's rate per unit
of declared speed (its prefill work over the time each endpoint took, weighted by its declared speed) times its
own. Only the ratios matter. `peak_tokens_per_s` then is the declared speed in the same units, so the ``ttft-gap``
filter tells slower hardware by what the operator declared. Equal speeds everywhere are the same as none.

Sums decay with ``half_life_s`` on the routing core's clock. Pending sends are bounded (``max_pending``, the
oldest dropped first) and forgotten after ``max_age_s``. `moved` follows a membership change. One event loop.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ServerSpeeds", "SpeedHints"]

_PRIOR_STEPS = 64  # decode steps of the fleet's figure mixed in per prior request
_MIN_PREFILL_SHARE = 0.25  # the prefill part of a TTFT is at least this share of it, whatever the step estimate
PEAK_SAMPLES = 64  # per-request rates kept per endpoint for the peak rate
PEAK_MIN_SAMPLES = 8  # the peak rate is NaN until an endpoint has this many
PEAK_MIN_WORK = 512.0  # tokens: a request with less is mostly the decode step, and says little of prefill
PEAK_QUANTILE = 0.5


@dataclass(frozen=True, slots=True)
class SpeedHints:
    """The operator's relative prefill speed per kind of server (``pool.speeds``): an endpoint's ``label`` value
    looked up in ``relative``; ``default`` for an endpoint without the label or with a value not listed."""

    label: str
    relative: Mapping[str, float] = field(default_factory=dict)
    default: float = 1.0

    def of(self, labels: list[Mapping[str, str]]) -> np.ndarray | None:
        """Per endpoint (given by its labels), its declared relative speed; None where all are equal (nothing to
        tell apart)."""
        values = [e.get(self.label) for e in labels]
        speeds = np.array([self.default if v is None else self.relative.get(v, self.default) for v in values])
        return None if speeds.size == 0 or bool((speeds == speeds[0]).all()) else speeds


class ServerSpeeds:
    """Per-endpoint prefill tokens/s and decode seconds per step, learned online (module docstring)."""

    def __init__(
        self,
        size: int,
        clock: Callable[[], float],
        *,
        half_life_s: float = 60.0,
        prior_requests: float = 4.0,
        min_requests: int = 8,
        max_pending: int = 1 << 16,
        max_age_s: float = 600.0,
        relative: np.ndarray | None = None,
    ) -> None:
        if not (half_life_s > 0 and math.isfinite(half_life_s)):
            raise ValueError(f"half_life_s must be a positive number of seconds; got {half_life_s!r}")
        if prior_requests < 0 or min_requests < 1 or max_pending < 1 or not max_age_s > 0:
            raise ValueError("prior_requests >= 0, min_requests >= 1, max_pending >= 1 and max_age_s > 0")
        self.size, self.clock = size, clock
        self.half_life_s, self.prior_requests, self.min_requests = half_life_s, prior_requests, min_requests
        self.max_pending, self.max_age_s = max_pending, max_age_s
        # Decayed sums per endpoint, as of _at: prefill work (tokens), its time (s), timings; decode time, steps.
        self._work = np.zeros(size)
        self._time = np.zeros(size)
        self._count = np.zeros(size)
        self._decode_s = np.zeros(size)
        self._steps = np.zeros(size)
        self._at = clock()
        self.timings = 0  # first-token timings taken, over the whole life (the min_requests bar)
        # id -> (endpoint, work, sent at, found it idle)
        self._pending: OrderedDict[str, tuple[int, float, float, bool]] = OrderedDict()
        self._cache: tuple[np.ndarray, np.ndarray] | None = None
        # The prefill rates of each endpoint's last PEAK_SAMPLES requests that brought PEAK_MIN_WORK tokens of work
        # or more (a ring per endpoint, NaN where not yet filled), for `peak_tokens_per_s`.
        self._samples = np.full((size, PEAK_SAMPLES), np.nan)
        self._sampled = np.zeros(size, dtype=np.int64)
        self._peak: np.ndarray | None = None
        self.relative: np.ndarray | None = None
        self.relate(relative)

    def relate(self, relative: np.ndarray | None) -> None:
        """Take the endpoints' declared relative speeds (`SpeedHints.of`; None: none declared)."""
        if relative is not None:
            relative = np.array(relative, dtype=float)
            if relative.shape != (self.size,) or not (np.isfinite(relative).all() and (relative > 0).all()):
                raise ValueError(f"relative speeds must be {self.size} positive numbers; got {relative!r}")
            relative.setflags(write=False)
        self.relative = relative
        self._cache = None

    def sent(self, request_id: str, endpoint: int, work_tokens: float, *, idle: bool = False) -> None:
        """The routing unit sent request ``request_id`` to ``endpoint`` counting ``work_tokens`` of prefill ahead
        of its first token there (the backlog and its own uncached tokens); ``idle``: it found nothing queued there
        (its timing counts toward `peak_tokens_per_s`)."""
        if not request_id or not 0 <= endpoint < self.size or not work_tokens >= 0:
            return
        pending = self._pending
        pending.pop(request_id, None)
        pending[request_id] = (endpoint, float(work_tokens), self.clock(), idle)
        while len(pending) > self.max_pending:
            pending.popitem(last=False)

    def forget(self, request_id: str) -> None:
        """Request ``request_id`` will teach nothing: it was retried on another endpoint than the one it was sent to
        (its timing holds the failed attempt and the other server's work)."""
        self._pending.pop(request_id, None)

    def observed(
        self, request_id: str, ttft_s: float | None, e2e_s: float | None, output_tokens: int | None = None
    ) -> bool:
        """The request's latencies were measured (either may be None). True when it was one this object was told
        of (`sent`) and its first token was timed; a request is taken once."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return False
        endpoint, work, sent_at, idle = entry
        now = self.clock()
        if now - sent_at > self.max_age_s or ttft_s is None or not (0 < ttft_s < math.inf):
            return False
        self._decay(now)
        step = self._step_of(endpoint)
        prefill_s = max(ttft_s - step, _MIN_PREFILL_SHARE * ttft_s)
        self._work[endpoint] += work
        self._time[endpoint] += prefill_s
        if idle and work >= PEAK_MIN_WORK:
            self._samples[endpoint, self._sampled[endpoint] % PEAK_SAMPLES] = work / prefill_s
            self._sampled[endpoint] += 1
            self._peak = None
        self._count[endpoint] += 1
        if output_tokens is not None and output_tokens > 1 and e2e_s is not None and e2e_s > ttft_s:
            self._decode_s[endpoint] += e2e_s - ttft_s
            self._steps[endpoint] += output_tokens - 1
        self.timings += 1
        self._cache = None
        return True

    def _step_of(self, endpoint: int) -> float:
        """`decode_step_s` of one endpoint (0 while unknown), without building the arrays."""
        steps, total = float(self._steps.sum()), float(self._decode_s.sum())
        if not (steps > 0 and total > 0):
            return 0.0
        mix = self.prior_requests * _PRIOR_STEPS / steps
        own_steps = float(self._steps[endpoint]) + mix * steps
        return (float(self._decode_s[endpoint]) + mix * total) / own_steps if own_steps > 0 else 0.0

    def prefill_tokens_per_s(self) -> np.ndarray:
        """Per endpoint, the learned prefill rate (tokens/s); NaN until the fleet has ``min_requests`` timings."""
        return self._rates()[0]

    def peak_tokens_per_s(self) -> np.ndarray:
        """Per endpoint, how fast it prefills when little waits ahead: the `PEAK_QUANTILE` of the rates of its last
        `PEAK_SAMPLES` requests with `PEAK_MIN_WORK` tokens of work or more (NaN until `PEAK_MIN_SAMPLES` came).

        `prefill_tokens_per_s` is a busy server's rate, the one that prices its queue: where requests wait for a
        free slot rather than for prefill, it falls far below what the hardware does, and identical servers differ
        by several times. The requests that found no queue keep this figure near the hardware's, so it tells a
        slower server from a busier one (the ``ttft-gap`` filter). With declared speeds (``relative``) it is those,
        scaled to the learned rates (their median ratio; 1 token/s per unit before any is learned)."""
        if self.relative is not None:  # declared: the hardware's speed as the operator says
            prefill = self._rates()[0]
            scale = float(np.nanmedian(prefill / self.relative)) if np.isfinite(prefill).any() else 1.0
            declared = self.relative * scale
            declared.setflags(write=False)
            return declared
        peak = self._peak
        if peak is None:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # an endpoint with no samples yet: NaN
                peak = np.nanquantile(self._samples, PEAK_QUANTILE, axis=1)
            peak[self._sampled < PEAK_MIN_SAMPLES] = np.nan
            peak.setflags(write=False)
            self._peak = peak
        return peak

    def decode_step_s(self) -> np.ndarray:
        """Per endpoint, the learned decode time per step (s); NaN until some request reported its tokens."""
        return self._rates()[1]

    def forget_pending(self) -> None:
        """Drop sends older than ``max_age_s`` (their timing never came)."""
        cutoff = self.clock() - self.max_age_s
        pending = self._pending
        while pending:
            first = next(iter(pending.values()))
            if first[2] >= cutoff:
                break
            pending.popitem(last=False)

    def moved(self, mapping: np.ndarray, relative: np.ndarray | None = None) -> ServerSpeeds:
        """The same statistics for a new pool: endpoint j of the new pool was endpoint ``mapping[j]`` (-1: it
        joined, and starts with none), whose declared speeds are ``relative``. Pending sends to endpoints that left
        are dropped."""
        mapping = np.asarray(mapping, dtype=np.int64)
        new = ServerSpeeds(
            len(mapping),
            self.clock,
            half_life_s=self.half_life_s,
            prior_requests=self.prior_requests,
            min_requests=self.min_requests,
            max_pending=self.max_pending,
            max_age_s=self.max_age_s,
            relative=relative,
        )
        self._decay(self.clock())
        new._at, new.timings = self._at, self.timings
        kept = mapping >= 0
        for name in ("_work", "_time", "_count", "_decode_s", "_steps", "_samples", "_sampled"):
            getattr(new, name)[kept] = getattr(self, name)[mapping[kept]]
        where = {int(old): j for j, old in enumerate(mapping.tolist()) if old >= 0}
        for request_id, (endpoint, work, at, idle) in self._pending.items():
            if endpoint in where:
                new._pending[request_id] = (where[endpoint], work, at, idle)
        return new

    def _decay(self, now: float) -> None:
        elapsed = now - self._at
        if elapsed <= 0:
            return
        factor = 0.5 ** (elapsed / self.half_life_s)
        for sums in (self._work, self._time, self._count, self._decode_s, self._steps):
            sums *= factor
        self._at = now
        self._cache = None

    def _rates(self) -> tuple[np.ndarray, np.ndarray]:
        cached = self._cache
        if cached is not None:
            return cached
        prefill = _shrunk(self._work, self._time, self._count, self.prior_requests, self.relative)
        if self.timings < self.min_requests:
            prefill = np.full(self.size, np.nan)
        decode = _shrunk(self._decode_s, self._steps, self._steps, self.prior_requests * _PRIOR_STEPS)
        decode.setflags(write=False)
        prefill.setflags(write=False)
        self._cache = (prefill, decode)
        return self._cache


def _shrunk(
    top: np.ndarray, bottom: np.ndarray, weight: np.ndarray, prior: float, relative: np.ndarray | None = None
) -> np.ndarray:
    """Per endpoint ``top / bottom``, with ``prior`` units of ``weight`` at the pooled ratio mixed in (an endpoint
    without evidence gets the pooled ratio; NaN where nothing is known at all). With ``relative`` (declared
    speeds) the pooled ratio is per unit of declared speed, ``sum(top) / sum(bottom * relative)``, and an
    endpoint's prior is that times its own."""
    total_top, total_bottom, total_weight = float(top.sum()), float(bottom.sum()), float(weight.sum())
    if not (total_bottom > 0 and total_top > 0 and total_weight > 0):
        return np.full(len(top), np.nan)
    mix = prior / total_weight  # the prior's share of the fleet's sums, per unit of weight
    prior_top: float | np.ndarray = mix * total_top
    if relative is not None:
        prior_top = mix * total_bottom * (total_top / float((bottom * relative).sum())) * relative
    with np.errstate(invalid="ignore", divide="ignore"):
        return (top + prior_top) / (bottom + mix * total_bottom)

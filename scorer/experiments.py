"""Experiments: a scope of traffic split between arms, each arm a scheduling profile over the same pool.

An experiment (`ExperimentSpec`) names its arms (the first is the control), how a request is assigned to one, and
which requests it covers (models, request classes, path prefixes; empty: all). Assignment is one of:

* ``weight``: at random by the arms' weights (fractions of 0.001 and up), request by request;
* ``hash``: by a hash of a header's value (a user or session id), so that a user stays in one arm; requests
  without the header go by weight. The hash (BLAKE2b of the experiment's name and the value) is the same in
  every picker process, so replicas agree;
* ``header``: a header's value names the arm (``x-canary: true`` -> ``canary``); any other value, or none, goes
  to the control.

`Experiments` holds the running ones; the routing unit (`scorer.router.Router`) asks it for a request's arm and
routes with the arm's engine. Every arm's engine shares the pool's in-flight counts, signals and saturation rule,
so each arm sees the load the others put on the servers. A request is in at most one experiment: the first, in
the config's order, whose scope covers it.

Outcomes reach the arm through its request id (`Experiments.outcome`): the time to first token, the end-to-end
time, and whether the request failed (a 5xx, or a reset). Each arm keeps, over the experiment's life and over the
last ``window_s``, the moments of log-TTFT and log-E2E (for the sequential test of `scorer.sequential`), histograms
for their quantiles, and counts of requests, errors and sheds: memory per arm is fixed, whatever the traffic.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from inferlb.scorer.engine import Engine
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.histogram import Histogram
from inferlb.scorer.presets import build_profile
from inferlb.scorer.registry import ProfileSpec
from inferlb.scorer.sequential import Comparison, Moments, compare

__all__ = [
    "LATENCY_BUCKETS_S",
    "Arm",
    "ArmOutcomes",
    "ArmSpec",
    "ExperimentSpec",
    "Experiments",
    "RunningExperiment",
]

Assign = Literal["weight", "hash", "header"]
WEIGHT_STEP = 0.001  # the finest share an arm can have: 0.1%

# Upper bounds of the per-arm latency histograms, seconds (5 ms .. 10 min, ~12% apart: quantiles to ~6%).
LATENCY_BUCKETS_S = tuple(round(0.005 * 1.12**i, 6) for i in range(int(math.log(600 / 0.005, 1.12)) + 1))


@dataclass(frozen=True, slots=True)
class ArmSpec:
    """One arm: its ``name``, the scheduling ``profile`` it routes with (a preset or a profile of the config) and
    its ``weight`` (a share of the experiment's traffic)."""

    name: str
    profile: str
    weight: float


@dataclass(frozen=True, slots=True)
class ExperimentSpec:
    """An experiment as configured (see the module's docstring). ``alpha``: the false-verdict rate each comparison
    allows; ``min_samples``: requests per arm before any verdict; ``latency_tau`` / ``error_tau``: the scale of the
    differences the sequential test is tuned to (log-latency: 0.1 is ~10%; error rate: 0.01 is one point)."""

    name: str
    arms: tuple[ArmSpec, ...]
    assign: Assign = "weight"
    header: str | None = None
    values: Mapping[str, str] = field(default_factory=dict)
    models: frozenset[str] = frozenset()
    classes: frozenset[str] = frozenset()
    paths: tuple[str, ...] = ()
    alpha: float = 0.05
    min_samples: int = 200
    latency_tau: float = 0.1
    error_tau: float = 0.01
    window_s: float = 300.0

    def __post_init__(self) -> None:
        if len(self.arms) < 2:
            raise ValueError(f"experiment {self.name!r} needs at least two arms (a control and a treatment)")
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"experiment {self.name!r}: arm names repeat ({', '.join(names)})")
        if self.assign != "header":
            check_weights(self.name, [a.weight for a in self.arms])
        if self.assign in ("hash", "header") and not self.header:
            raise ValueError(f"experiment {self.name!r}: assign {self.assign!r} needs the header it reads")
        unknown = sorted(set(self.values.values()) - set(names))
        if unknown:
            raise ValueError(f"experiment {self.name!r}: values name arms it does not have: {', '.join(unknown)}")


def check_weights(experiment: str, weights: Sequence[float]) -> None:
    """ValueError unless ``weights`` are steps of 0.1% in [0, 1] that sum to 1."""
    for w in weights:
        if not (0 <= w <= 1) or abs(w / WEIGHT_STEP - round(w / WEIGHT_STEP)) > 1e-6:
            raise ValueError(f"experiment {experiment!r}: weight {w!r} is not a step of 0.001 in [0, 1]")
    if abs(sum(weights) - 1) > 1e-9:
        raise ValueError(f"experiment {experiment!r}: the arms' weights sum to {sum(weights):g}, not 1")


class _Window:
    """The moments and histogram of one metric over a sliding window, as ``slices`` rotating sub-windows."""

    __slots__ = ("_histograms", "_moments", "_slice_s", "_started")

    def __init__(self, window_s: float, now: float, slices: int = 10) -> None:
        self._slice_s = window_s / slices
        self._started = [now - i * self._slice_s for i in range(slices)]  # newest first
        self._moments = [Moments() for _ in range(slices)]
        self._histograms = [Histogram(LATENCY_BUCKETS_S) for _ in range(slices)]

    def _rotate(self, now: float) -> None:
        while now - self._started[0] >= self._slice_s:
            self._started.insert(0, self._started[0] + self._slice_s)
            self._started.pop()
            self._moments.insert(0, Moments())
            self._moments.pop()
            self._histograms.insert(0, Histogram(LATENCY_BUCKETS_S))
            self._histograms.pop()
            if now - self._started[0] >= self._slice_s * len(self._started):  # idle for a whole window
                self._started[0] = now
                break

    def add(self, seconds: float, now: float) -> None:
        self._rotate(now)
        self._moments[0].add(math.log(seconds))
        self._histograms[0].observe(seconds)

    def moments(self, now: float) -> Moments:
        self._rotate(now)
        total = Moments()
        for m in self._moments:
            total = total.merged(m)
        return total

    def histogram(self, now: float) -> Histogram:
        self._rotate(now)
        total = Histogram(LATENCY_BUCKETS_S)
        for h in self._histograms:
            total.counts = [a + b for a, b in zip(total.counts, h.counts, strict=True)]
            total.count += h.count
            total.sum += h.sum
        return total


class _Latency:
    """One latency metric of one arm: log-moments and a histogram, over the experiment's life and a window."""

    __slots__ = ("histogram", "moments", "window")

    def __init__(self, window_s: float, now: float) -> None:
        self.moments = Moments()
        self.histogram = Histogram(LATENCY_BUCKETS_S)
        self.window = _Window(window_s, now)

    def add(self, seconds: float, now: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        self.moments.add(math.log(seconds))
        self.histogram.observe(seconds)
        self.window.add(seconds, now)


class ArmOutcomes:
    """What one arm's requests got: counts, errors, sheds, TTFT and E2E (see `Experiments`)."""

    def __init__(self, window_s: float, now: float) -> None:
        self.requests = 0  # routed to this arm
        self.shed = 0  # refused by admission control while assigned to it
        self.finished = 0  # with a reported outcome
        self.errors = Moments()  # 1 per failed request, 0 per good one: the mean is the error rate
        self.ttft = _Latency(window_s, now)
        self.e2e = _Latency(window_s, now)


@dataclass(slots=True)
class Arm:
    """An arm of a running experiment: its spec, the engine it routes with, and its outcomes."""

    experiment: str
    spec: ArmSpec
    engine: Engine
    outcomes: ArmOutcomes

    @property
    def name(self) -> str:
        return self.spec.name


class RunningExperiment:
    """One experiment with its arms' engines and outcomes; `assign` says which arm a request goes to."""

    def __init__(
        self,
        spec: ExperimentSpec,
        engines: Mapping[str, Engine],
        rng: np.random.Generator,
        clock: Callable[[], float],
    ) -> None:
        self.spec = spec
        self.clock = clock
        self.started_at = clock()
        self.paused = False
        self.arms = tuple(
            Arm(spec.name, a, engines[a.profile], ArmOutcomes(spec.window_s, self.started_at)) for a in spec.arms
        )
        self._by_name = {a.name: a for a in self.arms}
        self._rng = rng
        self._draws = np.empty(0)
        self._cursor = 0
        self._cumulative: list[float] = []
        self.set_weights({a.name: a.weight for a in spec.arms})
        self._salt = spec.name.encode() + b"\0"
        self.history: list[dict[str, Any]] = [
            {"time": time.time(), "weights": self.weights(), "reason": "started"},
        ]

    def weights(self) -> dict[str, float]:
        previous = 0.0
        out = {}
        for arm, edge in zip(self.arms, self._cumulative, strict=True):
            out[arm.name] = round(edge - previous, 6)
            previous = edge
        return out

    def set_weights(self, weights: Mapping[str, float], reason: str | None = None) -> None:
        """New weights for the arms (by name; every arm, summing to 1); ValueError otherwise."""
        if set(weights) != set(self._by_name):
            raise ValueError(f"weights must name every arm of {self.spec.name!r}: {', '.join(self._by_name)}")
        check_weights(self.spec.name, [weights[a.name] for a in self.arms])
        total = 0.0
        cumulative = []
        for arm in self.arms:
            total += weights[arm.name]
            cumulative.append(total)
        cumulative[-1] = 1.0
        self._cumulative = cumulative
        if reason is not None:
            self.history.append({"time": time.time(), "weights": self.weights(), "reason": reason})

    def covers(self, request: RequestFeatures) -> bool:
        spec = self.spec
        if spec.models and request.model not in spec.models:
            return False
        if spec.classes and request.request_class not in spec.classes:
            return False
        return not spec.paths or request.path.startswith(spec.paths)

    def assign(self, request: RequestFeatures) -> Arm:
        spec = self.spec
        if spec.assign == "header":
            named = spec.values.get((request.headers or {}).get(spec.header or "", ""))
            return self._by_name[named] if named is not None else self.arms[0]
        key = (request.headers or {}).get(spec.header or "") if spec.assign == "hash" else None
        if key:
            digest = hashlib.blake2b(self._salt + key.encode(), digest_size=8).digest()
            return self._by_share(int.from_bytes(digest, "big") / 2**64)
        return self._by_share(self._draw())

    def _by_share(self, u: float) -> Arm:
        for arm, edge in zip(self.arms, self._cumulative, strict=True):
            if u < edge:
                return arm
        return self.arms[-1]

    def _draw(self) -> float:
        # Drawn in blocks: one numpy call per request would cost more than the assignment.
        if self._cursor >= len(self._draws):
            self._draws = self._rng.random(4096)
            self._cursor = 0
        u = float(self._draws[self._cursor])
        self._cursor += 1
        return u

    def comparisons(self, window: bool = False) -> dict[str, dict[str, Comparison]]:
        """Per treatment arm, per metric (``ttft``, ``e2e``, ``errors``): its comparison with the control, over the
        experiment's life or (``window``) its last ``window_s``."""
        spec = self.spec
        now = self.clock()
        control = self.arms[0].outcomes

        def moments(outcomes: ArmOutcomes, metric: str) -> Moments:
            if metric == "errors":
                return outcomes.errors
            latency: _Latency = getattr(outcomes, metric)
            return latency.window.moments(now) if window else latency.moments

        out: dict[str, dict[str, Comparison]] = {}
        for arm in self.arms[1:]:
            out[arm.name] = {}
            for metric, tau in (("ttft", spec.latency_tau), ("e2e", spec.latency_tau), ("errors", spec.error_tau)):
                out[arm.name][metric] = compare(
                    moments(control, metric),
                    moments(arm.outcomes, metric),
                    tau=tau,
                    alpha=spec.alpha,
                    min_samples=spec.min_samples,
                )
        return out

    def describe(self) -> dict[str, Any]:
        """The experiment as JSON: spec, weights, per-arm counts and quantiles, comparisons, weight history."""
        now = self.clock()
        arms = []
        for arm in self.arms:
            o = arm.outcomes
            arms.append(
                {
                    "name": arm.name,
                    "profile": arm.spec.profile,
                    "requests": o.requests,
                    "finished": o.finished,
                    "shed": o.shed,
                    "error_rate": o.errors.mean if o.errors.count else None,
                    "ttft_s": _quantiles(o.ttft.histogram),
                    "e2e_s": _quantiles(o.e2e.histogram),
                    "ttft_s_window": _quantiles(o.ttft.window.histogram(now)),
                    "e2e_s_window": _quantiles(o.e2e.window.histogram(now)),
                }
            )
        return {
            "name": self.spec.name,
            "state": "paused" if self.paused else "running",
            "assign": self.spec.assign,
            "header": self.spec.header,
            "control": self.arms[0].name,
            "weights": self.weights(),
            "alpha": self.spec.alpha,
            "min_samples": self.spec.min_samples,
            "running_s": now - self.started_at,
            "arms": arms,
            "comparisons": {
                scope: {
                    arm: {metric: _comparison(c) for metric, c in metrics.items()}
                    for arm, metrics in self.comparisons(window=scope == "window").items()
                }
                for scope in ("life", "window")
            },
            "history": list(self.history),
        }


def _quantiles(h: Histogram) -> dict[str, float | None]:
    return {f"p{q}": histogram_quantile(h, q / 100) for q in (50, 90, 99)}


def _comparison(c: Comparison) -> dict[str, Any]:
    def finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {
        "difference": c.difference,
        "low": finite(c.low),
        "high": finite(c.high),
        "p_value": c.p_value,
        "verdict": c.verdict,
        "control_count": c.control_count,
        "treatment_count": c.treatment_count,
    }


def histogram_quantile(h: Histogram, q: float) -> float | None:
    """The ``q`` quantile of ``h``, interpolated linearly inside its bucket (None when empty; the last bound for
    values in the overflow bucket)."""
    if not h.count:
        return None
    rank = q * h.count
    seen = 0
    lower = 0.0
    for bound, count in zip(h.bounds, h.counts, strict=False):
        if count and seen + count >= rank:
            return lower + (bound - lower) * (rank - seen) / count
        seen += count
        lower = bound
    return h.bounds[-1]


class Experiments:
    """The running experiments of one pool, and which arm each routed request went to (until its outcome).

    ``engine_for(profile)`` builds (or returns) the engine of a profile over the pool's shared state. A request id
    is remembered for at most ``max_age_s`` and ``capacity`` requests: an outcome that never comes costs nothing
    after that. One event loop; not thread-safe."""

    def __init__(
        self,
        specs: Iterable[ExperimentSpec],
        engine_for: Callable[[str], Engine],
        *,
        rng: np.random.Generator | None = None,
        clock: Callable[[], float] = time.monotonic,
        capacity: int = 1 << 16,
        max_age_s: float = 900.0,
    ) -> None:
        rng = rng if rng is not None else np.random.default_rng()
        self.clock = clock
        self.running: dict[str, RunningExperiment] = {}
        for spec in specs:
            if spec.name in self.running:
                raise ValueError(f"experiment {spec.name!r} is configured twice")
            engines = {a.profile: engine_for(a.profile) for a in spec.arms}
            self.running[spec.name] = RunningExperiment(spec, engines, rng, clock)
        self.capacity = capacity
        self.max_age_s = max_age_s
        self._open: OrderedDict[str, tuple[float, Arm]] = OrderedDict()
        self.unattributed = 0  # outcomes for request ids not (or no longer) remembered

    @classmethod
    def over(
        cls,
        engine: Engine,
        specs: Sequence[ExperimentSpec],
        spec_of: Callable[[str], ProfileSpec | str],
        rng: np.random.Generator | None = None,
    ) -> Experiments:
        """The experiments ``specs`` over ``engine``'s pool and state: an arm whose profile is ``engine``'s routes
        with it, any other with an engine of its own (``spec_of`` gives a profile's spec) on the same state."""
        built = {engine.profile.name: engine}

        def engine_for(name: str) -> Engine:
            if name not in built:
                profile = build_profile(spec_of(name), rng, size=len(engine.pool))
                built[name] = Engine(engine.pool, profile, engine.inflight, engine.signals, engine.saturation)
            return built[name]

        return cls(specs, engine_for, rng=rng, clock=engine.signals.clock)

    def adopt(self, previous: Experiments | None) -> None:
        """Carry over from ``previous`` (the experiments before a config reload) every experiment configured the same
        way: its outcomes, weights, state and history continue; the arms route with the new engines."""
        if previous is None:
            return
        for name, experiment in self.running.items():
            old = previous.running.get(name)
            if old is None or old.spec != experiment.spec:
                continue
            for arm, old_arm in zip(experiment.arms, old.arms, strict=True):
                arm.outcomes = old_arm.outcomes
            experiment.set_weights(old.weights())
            experiment.paused, experiment.started_at, experiment.history = old.paused, old.started_at, old.history
        self._open = OrderedDict(
            (rid, (at, found))
            for rid, (at, held) in previous._open.items()
            if (found := self._arm(held.experiment, held.name)) is not None
        )

    def _arm(self, experiment: str, arm: str) -> Arm | None:
        running = self.running.get(experiment)
        return None if running is None else running._by_name.get(arm)

    def __bool__(self) -> bool:
        return bool(self.running)

    def assign(self, request: RequestFeatures) -> Arm | None:
        """The arm ``request`` goes to, or None when no running experiment covers it."""
        for experiment in self.running.values():
            if not experiment.paused and experiment.covers(request):
                return experiment.assign(request)
        return None

    def routed(self, request_id: str, arm: Arm) -> None:
        """``arm``'s request ``request_id`` was routed: count it, and remember it until its outcome."""
        arm.outcomes.requests += 1
        if not request_id:
            return
        now = self.clock()
        self._open.pop(request_id, None)
        self._open[request_id] = (now, arm)
        while len(self._open) > self.capacity:
            self._open.popitem(last=False)
        limit = now - self.max_age_s
        while self._open and next(iter(self._open.values()))[0] < limit:
            self._open.popitem(last=False)

    def shed(self, arm: Arm) -> None:
        arm.outcomes.shed += 1

    def first_token(self, request_id: str, ttft_s: float) -> None:
        """The time to first token of a routed request (a streamed response's first chunk, or a server span)."""
        held = self._open.get(request_id)
        if held is None:
            self.unattributed += 1
            return
        held[1].outcomes.ttft.add(ttft_s, self.clock())

    def outcome(self, request_id: str, *, failed: bool, e2e_s: float | None = None) -> None:
        """The end of a routed request: whether it failed (5xx, reset) and, if it did not, its end-to-end time."""
        held = self._open.pop(request_id, None)
        if held is None:
            self.unattributed += 1
            return
        outcomes = held[1].outcomes
        outcomes.finished += 1
        outcomes.errors.add(1.0 if failed else 0.0)
        if not failed and e2e_s is not None:
            outcomes.e2e.add(e2e_s, self.clock())

    def observed(self, request_id: str, ttft_s: float | None, e2e_s: float | None, failed: bool) -> None:
        """What the filter's timing of a response says (``filter.observe.RequestOutcome``): a streamed answer's first
        token (its TTFT; it is measured no further, so that is its end), another's full body (E2E), or a failure."""
        if ttft_s is not None:
            self.first_token(request_id, ttft_s)
        self.outcome(request_id, failed=failed, e2e_s=e2e_s)

    def describe(self) -> list[dict[str, Any]]:
        return [e.describe() for e in self.running.values()]

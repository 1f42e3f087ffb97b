"""Experiments: a scope of traffic split between arms, each arm a scheduling profile over the same pool.

An experiment (`ExperimentSpec`) names its arms (the first is the control), how a request is assigned to one, and
which requests it covers (models, request classes, path prefixes; empty: all). Assignment is one of:

* ``weight``: at random by the arms' weights (fractions of 0.001 and up), request by request;
* ``hash``: by a hash of a header's value (a user or session id), so that a user stays in one arm; requests
  without the header go by weight. The hash (BLAKE2b of the experiment's name and the value) is the same in
  every picker process, so replicas agree;
* ``header``: a header's value names the arm (``x-canary: true`` -> ``canary``); any other value, or none, goes
  to the control.

An arm is a *policy arm* (a scheduling profile over the same endpoints) or a *release arm*: ``endpoints``, a label
selector, gives it the endpoints whose labels match (another server build, a new model version: a grey release).
While an experiment with release arms is configured (running, paused, stopped or rolled back), the endpoints they
select serve only their arms' requests: its other arms, other experiments' arms, and every request it does not
cover, route among the rest. A release arm may instead (or as well) name
another ``model`` the servers serve: its requests route among the endpoints that serve that model, and the filter
rewrites the ``model`` of the body it forwards. Only requests whose body the picker read can be rewritten, so an
experiment with such an arm must scope itself to models (a request without a body has none).

A *guard rail* (`GuardSpec`) watches each treatment arm against the control and cuts the arm's weight when it
misbehaves (by default: an error rate above 2% -> weight x 0.3; the third breach sets it to 0 and marks the
experiment rolled back); a *ramp* steps a treatment's weight up on a schedule while the guard finds nothing.
Both judge the outcomes since the last change of weight, so that one bad spell is judged once. Every change is
kept in the experiment's history with its reason, logged, and told to `Experiments.listeners` (the picker
exports it as a metric and a span event).

`Experiments` holds the running ones; the routing unit (`scorer.router.Router`) asks it for a request's arm and
routes with the arm's engine. Every arm's engine shares the pool's in-flight counts, signals and saturation rule,
so each arm sees the load the others put on the servers. A request is in at most one experiment: the first, in
the config's order, whose scope covers it.

Outcomes reach the arm through its request id (`Experiments.outcome`): the time to first token, the end-to-end
time, and whether the request failed (a 5xx, or a reset), from the filter's timing of the response or from the
server's span joined to the decision. Each arm keeps, over the experiment's life and over the
last ``window_s``, the moments of log-TTFT and log-E2E (for the sequential test of `scorer.sequential`), histograms
for their quantiles, and counts of requests, errors and sheds: memory per arm is fixed, whatever the traffic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import orjson

from inferlb.scorer.engine import Engine
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.histogram import Histogram
from inferlb.scorer.presets import build_profile
from inferlb.scorer.registry import ProfileSpec
from inferlb.scorer.sequential import Comparison, Moments, compare
from inferlb.scorer.shares import UNITS, ShareLine

__all__ = [
    "LATENCY_BUCKETS_S",
    "TPOT_BUCKETS_S",
    "Arm",
    "ArmOutcomes",
    "ArmSpec",
    "ControlState",
    "ExperimentSpec",
    "Experiments",
    "GuardSpec",
    "RunningExperiment",
    "SpecError",
    "WeightChange",
    "arm_masks",
    "comparison_json",
    "endpoint_masks",
    "spec_fingerprint",
]

logger = logging.getLogger(__name__)

Assign = Literal["weight", "hash", "header"]
WEIGHT_STEP = 1 / UNITS  # the finest share an arm can have: 0.1%
# Routed requests remembered until their outcome: as many as the filter's book of leases (filter/requestend.py),
# so that the slowest requests of a busy picker are not the ones whose outcome is lost (tests pin the two equal).
OPEN_CAPACITY = 1 << 18
HISTORY = 1000  # weight changes an experiment keeps (the counts of changes by kind are kept whole)
P99_MIN_SAMPLES = 100  # TTFTs on each side, since the last change, before the guard compares p99s

# Upper bounds of the per-arm latency histograms, seconds (5 ms .. 10 min, ~12% apart: quantiles to ~6%).
LATENCY_BUCKETS_S = tuple(round(0.005 * 1.12**i, 6) for i in range(int(math.log(600 / 0.005, 1.12)) + 1))
# And of the time per output token (0.1 ms .. 10 s, as far apart): a decode step is milliseconds.
TPOT_BUCKETS_S = tuple(round(0.0001 * 1.12**i, 7) for i in range(int(math.log(10 / 0.0001, 1.12)) + 1))


@dataclass(frozen=True, slots=True)
class ArmSpec:
    """One arm: its ``name``, the scheduling ``profile`` it routes with (a preset or a profile of the config), its
    ``weight`` (a share of the experiment's traffic) and, for a release arm, ``endpoints``: the labels (all of them)
    of the endpoints it routes to, and/or ``model``: the model its requests are sent as (the body's ``model``
    rewritten) and routed by."""

    name: str
    profile: str
    weight: float
    endpoints: Mapping[str, str] = field(default_factory=dict)
    model: str | None = None


@dataclass(frozen=True, slots=True)
class GuardSpec:
    """When a treatment arm's outcomes since its weight last changed breach a bound, its weight is cut to ``cut`` x
    what it was (in steps of 0.1%), the rest going to the control; at the ``max_breaches``-th breach, or when the cut
    leaves less than one step (always, for arms assigned by header), to 0, and the experiment is rolled back.

    The bounds: an error rate above ``max_error_rate``; a TTFT p99 above ``max_ttft_p99_ratio`` x the control's over
    the same time (None: not judged). An arm is judged once it has ``min_requests`` finished requests since the
    change, or sooner once more than ``max_error_rate x min_requests`` of them failed (its error rate over
    ``min_requests`` is then a breach whatever the rest do); the p99s once both arms have that many TTFTs, and at
    least `P99_MIN_SAMPLES` (fewer, and a p99 is a maximum). At most every ``check_s``."""

    max_error_rate: float = 0.02
    max_ttft_p99_ratio: float | None = 2.0
    min_requests: int = 50
    cut: float = 0.3
    max_breaches: int = 3
    check_s: float = 5.0


@dataclass(frozen=True, slots=True)
class WeightChange:
    """One change of an experiment's weights or state: when (wall clock), the weights after it, which arm it was
    about (None: all), its kind (``started``, ``ramp``, ``cut``, ``rolled-back``, ``set``, ``paused``, ``resumed``,
    ``stopped``) and why."""

    experiment: str
    time: float
    weights: Mapping[str, float]
    arm: str | None
    kind: str
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "weights": dict(self.weights),
            "arm": self.arm,
            "kind": self.kind,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class ControlState:
    """What decides whether an experiment's arms take traffic, as replicas share it (`scorer.sharedcontrol`): how
    many times it was started (``starts``: an operator's ``start`` re-arms it), the weights an operator set since
    (``weights``, the ``weight_sets``-th setting; None: none), whether a guard rolled it back (``rolled``: the arm,
    the reason, who), and whether it is paused or stopped (stopped implies paused). ``fingerprint`` names the
    experiment's configuration; ``by`` and ``reason`` the last change."""

    fingerprint: str
    starts: int = 0
    weight_sets: int = 0
    weights: Mapping[str, float] | None = None
    rolled: tuple[str | None, str, str] | None = None  # (arm, reason, by)
    paused: bool = False
    stopped: bool = False
    by: str = ""
    reason: str = ""

    def merged(self, mine: ControlState, kinds: Iterable[str]) -> ControlState:
        """This state (the shared one) with a replica's own changes of ``kinds`` (`WeightChange.kind`) made on top of
        what it knew (``mine``): a start supersedes everything before it; a roll-back stays until a start; weights
        and pause, resume or stop are the latest operator's. What another replica changed meanwhile is kept."""
        if self.fingerprint != mine.fingerprint:
            return mine  # another configuration's entry: this one replaces it
        kinds = set(kinds)
        if "started" in kinds:  # numbered after every start the shared state knows of
            starts = max(mine.starts, self.starts + 1)
            return replace(mine, starts=starts, weight_sets=max(mine.weight_sets, self.weight_sets))
        if mine.starts > self.starts:
            return mine  # the shared state predates a start made here (lost with a Redis that restarted empty, say)
        out = self
        if "rolled-back" in kinds and mine.starts == self.starts and self.rolled is None:
            out = replace(out, rolled=mine.rolled)  # a roll-back made before a start it did not see is void
        if "set" in kinds and mine.weights is not None:
            out = replace(out, weights=mine.weights, weight_sets=max(self.weight_sets + 1, mine.weight_sets))
        if kinds & {"paused", "resumed", "stopped"}:
            out = replace(out, paused=mine.paused, stopped=mine.stopped)
        return replace(out, by=mine.by, reason=mine.reason)


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
    guard: GuardSpec | None = None
    ramp: tuple[float, ...] = ()  # the treatment's weights, step by step (two arms only); starts at the first
    ramp_step_s: float = 60.0  # at least this long at each step, and as long as the guard needs to judge it

    def __post_init__(self) -> None:
        name = f"experiment {self.name!r}"
        if len(self.arms) < 2:
            raise SpecError(f"{name} needs at least two arms (a control and a treatment)", "arms")
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise SpecError(f"{name}: arm names repeat ({', '.join(names)})", "arms")
        if self.assign != "header" and not self.ramp:  # a ramp sets the weights
            check_weights(self.name, [a.weight for a in self.arms])
        if self.assign in ("hash", "header") and not self.header:
            raise SpecError(f"{name}: assign {self.assign!r} needs the header it reads", "header")
        if self.assign == "header" and not self.values:
            raise SpecError(
                f"{name}: assign 'header' needs `values`, the header's values and the arms they name"
                ' ({"true": ARM}): without them every request goes to the control',
                "values",
            )
        if self.assign != "header" and self.values:
            raise SpecError(f"{name}: `values` name arms only with assign 'header' (here {self.assign!r})", "values")
        for k, path in enumerate(self.paths):
            if not path.startswith("/"):
                fixed = "/" + path
                raise SpecError(
                    f"{name}: path {path!r} never matches: a request's path starts with '/' ({fixed!r}?)",
                    "scope",
                    "paths",
                    k,
                )
        if self.arms[0].model is not None:
            control = "the control arm sends requests as they came; it sets no model"
            raise SpecError(f"{name}: {control}", "arms", 0, "model")
        if any(a.model is not None for a in self.arms) and not self.models:
            raise SpecError(
                f"{name}: an arm that sets a model needs the experiment scoped to models"
                " (scope.models): only requests whose body names a model can be sent as another",
                "scope",
                "models",
            )
        unknown = sorted(set(self.values.values()) - set(names))
        if unknown:
            raise SpecError(f"{name}: values name arms it does not have: {', '.join(unknown)}", "values")
        if self.ramp:
            if len(self.arms) != 2 or self.assign == "header":
                raise SpecError(f"{name}: a ramp needs two arms assigned by weight or hash", "ramp")
            check_weights(self.name, self.ramp, total=False, at="ramp")
            if any(b <= a for a, b in itertools.pairwise(self.ramp)) or self.ramp[-1] > 1:
                raise SpecError(f"{name}: the ramp's weights must increase: {self.ramp}", "ramp")

    @property
    def starting_weights(self) -> dict[str, float]:
        """The arms' weights when the experiment starts: as configured, or the ramp's first step."""
        if self.ramp:
            return {self.arms[0].name: round(1 - self.ramp[0], 6), self.arms[1].name: self.ramp[0]}
        if self.assign == "header" and abs(sum(a.weight for a in self.arms) - 1) > 1e-9:  # weights unused there
            return {a.name: 1.0 if a is self.arms[0] else 0.0 for a in self.arms}
        return {a.name: a.weight for a in self.arms}


class SpecError(ValueError):
    """An invalid experiment; ``field``: the place of the error in the experiment's entry of the config file
    (``("arms", 1, "weight")``; empty: the entry), for the config to name it."""

    def __init__(self, message: str, *field: str | int) -> None:
        super().__init__(message)
        self.field = field


def check_weights(experiment: str, weights: Sequence[float], *, total: bool = True, at: str = "arms") -> None:
    """`SpecError` (a ValueError) unless ``weights`` (of the arms, or of the ``ramp``: ``at``) are steps of 0.1% in
    [0, 1] that sum to 1 (``total``)."""
    for i, w in enumerate(weights):
        if not (0 <= w <= 1) or abs(w / WEIGHT_STEP - round(w / WEIGHT_STEP)) > 1e-6:
            field = (at, i, "weight") if at == "arms" else (at, i)
            raise SpecError(f"experiment {experiment!r}: weight {w!r} is not a step of 0.001 in [0, 1]", *field)
    if total and abs(sum(weights) - 1) > 1e-9:
        raise SpecError(f"experiment {experiment!r}: the arms' weights sum to {sum(weights):g}, not 1", at)


class _Window:
    """The moments and histogram of one metric over a sliding window, as ``slices`` rotating sub-windows."""

    __slots__ = ("_buckets", "_histograms", "_moments", "_slice_s", "_started")

    def __init__(
        self, window_s: float, now: float, slices: int = 10, buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    ) -> None:
        self._buckets = buckets
        self._slice_s = window_s / slices
        self._empty(now, slices)

    def _empty(self, now: float, slices: int) -> None:
        self._started = [now - i * self._slice_s for i in range(slices)]  # newest first
        self._moments = [Moments() for _ in range(slices)]
        self._histograms = [Histogram(self._buckets) for _ in range(slices)]

    def _rotate(self, now: float) -> None:
        slices = len(self._started)
        if now - self._started[0] >= self._slice_s * slices:  # idle for a whole window: nothing in it is recent
            self._empty(now, slices)
            return
        while now - self._started[0] >= self._slice_s:
            self._started.insert(0, self._started[0] + self._slice_s)
            self._started.pop()
            self._moments.insert(0, Moments())
            self._moments.pop()
            self._histograms.insert(0, Histogram(self._buckets))
            self._histograms.pop()

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
        total = Histogram(self._buckets)
        for h in self._histograms:
            total.counts = [a + b for a, b in zip(total.counts, h.counts, strict=True)]
            total.count += h.count
            total.sum += h.sum
        return total


class _Latency:
    """One latency metric of one arm: log-moments and a histogram, over the experiment's life and a window."""

    __slots__ = ("histogram", "moments", "window")

    def __init__(self, window_s: float, now: float, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.moments = Moments()
        self.histogram = Histogram(buckets)
        self.window = _Window(window_s, now, buckets=buckets)

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
        self.failed = 0  # of which failed
        self.errors = Moments()  # 1 per failed request, 0 per good one: the mean is the error rate
        self.ttft = _Latency(window_s, now)
        self.e2e = _Latency(window_s, now)
        # Time per output token, (E2E - TTFT) / (output tokens - 1), where a server span reports all three.
        self.tpot = _Latency(window_s, now, TPOT_BUCKETS_S)


@dataclass(slots=True)
class Arm:
    """An arm of a running experiment: its spec, the engine it routes with, its outcomes, and the endpoints it may
    use (a bool mask over the pool; None: any)."""

    experiment: str
    spec: ArmSpec
    engine: Engine
    outcomes: ArmOutcomes
    mask: np.ndarray | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def vacant(self) -> bool:
        """A release arm none of whose endpoints is in the pool now (they left discovery): its requests go to the
        experiment's control until one is back."""
        return self.mask is not None and not self.mask.any()


class _Mark:
    """An arm's cumulative outcomes at its experiment's last change of weight: what the guard judges is the rest."""

    __slots__ = ("failed", "finished", "ttft")

    def __init__(self, outcomes: ArmOutcomes) -> None:
        self.finished = outcomes.finished
        self.failed = outcomes.failed
        self.ttft = outcomes.ttft.histogram.counts[:]

    def ttft_since(self, outcomes: ArmOutcomes) -> Histogram:
        now = outcomes.ttft.histogram
        since = Histogram(LATENCY_BUCKETS_S)
        since.counts = [a - b for a, b in zip(now.counts, self.ttft, strict=True)]
        since.count = sum(since.counts)
        return since


def endpoint_masks(
    arms: Sequence[ArmSpec], labels: Sequence[Mapping[str, str]], *, vacant_ok: bool = False
) -> list[np.ndarray | None]:
    """Per arm, the endpoints it routes to (``labels``: each endpoint's, in the pool's order), or None for any:
    a release arm's are those its selector matches; when an experiment has release arms, its other arms get the
    endpoints no release arm selects. ValueError when a selector matches nothing (with ``vacant_ok``, a treatment
    arm is vacant instead: its mask selects nothing; never the control, the first, where a vacant arm's requests
    go), or nothing is left for the rest."""
    selected: list[np.ndarray | None] = []
    for i, arm in enumerate(arms):
        if not arm.endpoints:
            selected.append(None)
            continue
        mask = np.array([all(own.get(k) == v for k, v in arm.endpoints.items()) for own in labels], dtype=bool)
        if not mask.any() and not (vacant_ok and i > 0):
            raise ValueError(f"arm {arm.name!r}: no endpoint of the pool has the labels {dict(arm.endpoints)}")
        selected.append(mask)
    masks = [m for m in selected if m is not None]
    if not masks:
        return selected
    rest = ~np.logical_or.reduce(masks)
    if not rest.any() and any(m is None for m in selected):
        raise ValueError("the release arms select every endpoint of the pool: none is left for the other arms")
    return [rest if m is None else m for m in selected]


def arm_masks(
    specs: Sequence[ExperimentSpec], labels: Sequence[Mapping[str, str]], *, vacant_ok: bool = False
) -> list[list[np.ndarray | None]]:
    """Per experiment, per arm, the endpoints the arm routes to (None: any): its own (`endpoint_masks`) less those
    the other experiments' release arms reserve. A release's endpoints serve its own arms only, for as long as it is
    configured (also paused, stopped or rolled back: a canary the guard rolled back takes no one's traffic). ValueError
    when a selector matches nothing (unless ``vacant_ok``: see `endpoint_masks`), two experiments reserve one
    endpoint, or an arm is left with none."""
    own: list[list[np.ndarray | None]] = []
    for spec in specs:
        try:
            release = any(a.endpoints for a in spec.arms)
            own.append(endpoint_masks(spec.arms, labels, vacant_ok=vacant_ok) if release else [None] * len(spec.arms))
        except ValueError as exc:
            raise ValueError(f"experiment {spec.name!r}: {exc}") from None
    reserved = [_reserved(spec.arms, masks) for spec, masks in zip(specs, own, strict=True)]
    for (a, mine), (b, theirs) in itertools.combinations(zip(specs, reserved, strict=True), 2):
        if mine is not None and theirs is not None and (mine & theirs).any():
            raise ValueError(
                f"experiments {a.name!r} and {b.name!r} both reserve endpoints for release arms (their labels select"
                " the same servers): a release's endpoints serve one experiment"
            )
    out = []
    for i, (spec, masks) in enumerate(zip(specs, own, strict=True)):
        others = [r for j, r in enumerate(reserved) if j != i and r is not None]
        if not others:
            out.append(masks)
            continue
        free = ~np.logical_or.reduce(others)
        combined = [free if m is None else m & free for m in masks]
        for i, (arm, mask) in enumerate(zip(spec.arms, combined, strict=True)):
            if not mask.any() and not (vacant_ok and arm.endpoints and i > 0):
                raise ValueError(
                    f"experiment {spec.name!r}: arm {arm.name!r} has no endpoint left: other experiments' release arms"
                    " reserve them all"
                )
        out.append(list(combined))
    return out


def _reserved(arms: Sequence[ArmSpec], masks: Sequence[np.ndarray | None]) -> np.ndarray | None:
    """The endpoints an experiment's release arms select (None: it has none)."""
    release = [m for arm, m in zip(arms, masks, strict=True) if arm.endpoints and m is not None]
    return np.logical_or.reduce(release) if release else None


class RunningExperiment:
    """One experiment with its arms' engines and outcomes; `assign` says which arm a request goes to, and `check`
    runs the guard rail and the ramp. ``labels``: the pool's endpoints' labels, for release arms; ``masks``: each
    arm's endpoints as `arm_masks` gives them with the other experiments (default: from ``labels`` alone)."""

    def __init__(
        self,
        spec: ExperimentSpec,
        engines: Mapping[str, Engine],
        rng: np.random.Generator,
        clock: Callable[[], float],
        labels: Sequence[Mapping[str, str]] = (),
        tell: Callable[[WeightChange], None] | None = None,
        masks: Sequence[np.ndarray | None] | None = None,
    ) -> None:
        self.spec = spec
        self.clock = clock
        self.started_at = clock()
        self.paused = False
        self.stopped = False
        self.rolled_back = False
        # The control state replicas share (`ControlState`): starts and weight settings by an operator, the weights
        # set since the last start, and the roll-back (arm, reason, by).
        self.starts = 0
        self.weight_sets = 0
        self.operator_weights: dict[str, float] | None = None
        self.rolled: tuple[str | None, str, str] | None = None
        if masks is None:
            masks = arm_masks([spec], labels)[0]
        self.arms = tuple(
            Arm(spec.name, a, engines[a.profile], ArmOutcomes(spec.window_s, self.started_at), mask)
            for a, mask in zip(spec.arms, masks, strict=True)
        )
        # The endpoints only this experiment's release arms may use, while it is configured.
        self.reserved = _reserved(spec.arms, masks)
        self._by_name = {a.name: a for a in self.arms}
        self._rng = rng
        self._draws = np.empty(0)
        self._cursor = 0
        # Everyone in the control until the start's `set_weights` lays the arms out after it, in order.
        self._line = ShareLine([UNITS] + [0] * (len(self.arms) - 1))
        self._salt = spec.name.encode() + b"\0"
        self._tell = tell
        self.history: deque[WeightChange] = deque(maxlen=HISTORY)
        self.changes: Counter[tuple[str, str]] = Counter()  # (arm or "", kind) -> changes of weight
        self.breaches: dict[str, int] = {a.name: 0 for a in self.arms}
        self._marks: dict[str, _Mark] = {}
        self._changed_at = self.started_at
        self._next_check = self.started_at
        self.set_weights(spec.starting_weights, kind="started", reason="the experiment started")

    @property
    def fingerprint(self) -> str:
        """The experiment's configuration, in 16 hex digits, the same in every process that reads the same config
        (sets sorted, mappings by key): replicas share control state only between copies of the same
        configuration (a changed experiment is a new one)."""
        return spec_fingerprint(self.spec)

    def control_state(self, by: str = "", reason: str = "") -> ControlState:
        """This copy's `ControlState`, made ``by`` (also the roll-back's maker where this copy's own guard made it)."""
        rolled = self.rolled if self.rolled_back else None
        if rolled is not None and not rolled[2]:
            rolled = (rolled[0], rolled[1], by)
        return ControlState(
            self.fingerprint,
            self.starts,
            self.weight_sets,
            self.operator_weights,
            rolled,
            self.paused,
            self.stopped,
            by,
            reason,
        )

    @property
    def state(self) -> str:
        if self.rolled_back:
            return "rolled back"
        if self.stopped:
            return "stopped"
        return "paused" if self.paused else "running"

    def control(self, action: str, weights: Mapping[str, float] | None = None, *, origin: str = "the operator") -> None:
        """An operator's action: ``pause`` (the requests it covers route as the rest do, outcomes so far kept;
        ``resume`` undoes it),
        ``stop`` (the same, until ``start``), ``start`` (from the starting weights, the guard's count of breaches
        reset: also after a roll-back) or ``weights`` (set ``weights``; refused after a roll-back, where the guard
        judges no more: ``start`` re-arms it). ValueError for anything else. ``origin`` names who acted, in the
        history's reasons ("paused by the operator")."""
        if action == "weights":
            if weights is None:
                raise ValueError("action 'weights' needs the arms' weights")
            if self.rolled_back:
                raise ValueError(
                    f"experiment {self.spec.name!r} was rolled back and its guard judges no more: 'start' it again"
                    " (from its starting weights, the guard re-armed), then set weights"
                )
            self.set_weights(weights, reason=f"set by {origin}")
            self.weight_sets += 1
            self.operator_weights = dict(weights)
        elif action in ("pause", "resume", "stop"):
            if action == "resume" and self.stopped:
                raise ValueError("a stopped experiment starts again with 'start' (its weights and guard anew)")
            self.paused = action != "resume"
            self.stopped = action == "stop"
            done = {"pause": "paused", "resume": "resumed", "stop": "stopped"}[action]
            self.set_weights(self.weights(), kind=done, reason=f"{done} by {origin}")
        elif action == "start":
            self.paused = self.stopped = self.rolled_back = False
            self.rolled, self.operator_weights = None, None
            self.starts += 1
            self.breaches = {a.name: 0 for a in self.arms}
            self.set_weights(self.spec.starting_weights, kind="started", reason=f"started by {origin}")
        else:
            raise ValueError(f"unknown action {action!r}: pause, resume, stop, start or weights")

    def roll_back(self, arm: str | None, reason: str, by: str = "") -> None:
        """The guard's verdict, taken from elsewhere (another replica's guard): ``arm`` to weight 0, the control
        taking up its share (every treatment arm where ``arm`` is None or none of this experiment's), and the
        experiment rolled back. Nothing when it is rolled back already."""
        if self.rolled_back:
            return
        self.rolled_back = True
        self.rolled = (arm, reason, by)
        found = self._by_name.get(arm) if arm is not None else None
        shown = f"rolled back by {by}: {reason}" if by else reason
        if found is not None and found is not self.arms[0]:
            self._move(found, 0.0, "rolled-back", shown)
            return
        control = self.arms[0].name
        weights = {one.name: 1.0 if one.name == control else 0.0 for one in self.arms}
        self.set_weights(weights, kind="rolled-back", reason=shown)

    def follow(self, state: ControlState, origin: str) -> None:
        """Bring this copy to the control state replicas share (`scorer.sharedcontrol`), made by ``origin``: a start
        this copy has not seen re-arms it; a roll-back rolls it back (only a start undoes one); then it is paused,
        stopped or running as the state says, with the weights an operator set last. A state older than a start this
        copy made changes nothing (its own goes out). Following the same state twice changes nothing. ValueError
        where the weights do not fit."""
        if state.fingerprint != self.fingerprint or state.starts < self.starts:
            return
        if state.starts > self.starts:
            self.control("start", origin=origin)
            self.starts = state.starts
        if state.rolled is not None and not self.rolled_back:
            arm, reason, by = state.rolled
            self.roll_back(arm, reason, by or origin)
        if (state.paused or state.stopped, state.stopped) != (self.paused, self.stopped):
            self.paused, self.stopped = state.paused or state.stopped, state.stopped
            kind = "stopped" if self.stopped else "paused" if self.paused else "resumed"
            self.set_weights(self.weights(), kind=kind, reason=f"{kind} by {origin}")
        if state.weight_sets > self.weight_sets:
            self.weight_sets = state.weight_sets
            if state.weights is not None and not self.rolled_back:
                self.set_weights(state.weights, reason=f"set by {origin}")
                self.operator_weights = dict(state.weights)

    def weights(self) -> dict[str, float]:
        units = self._line.units(len(self.arms))
        return {arm.name: round(u / UNITS, 6) for arm, u in zip(self.arms, units, strict=True)}

    def set_weights(
        self,
        weights: Mapping[str, float],
        *,
        kind: str = "set",
        reason: str = "set by the operator",
        arm: str | None = None,
    ) -> None:
        """New weights for the arms (by name; every arm, summing to 1); ValueError otherwise. The change is kept in
        the history (``kind``, ``reason``, the ``arm`` it was about), and the guard judges from here on. Only shares
        of the arms that shrink move, to the arms that grow (`ShareLine`): by hash, a cut moves the cut arm's users
        only."""
        if set(weights) != set(self._by_name):
            raise ValueError(f"weights must name every arm of {self.spec.name!r}: {', '.join(self._by_name)}")
        check_weights(self.spec.name, [weights[a.name] for a in self.arms])
        units = [round(weights[one.name] * UNITS) for one in self.arms]
        self._line.move_to(units)
        self._changed_at = self.clock()
        self._marks = {one.name: _Mark(one.outcomes) for one in self.arms}
        change = WeightChange(self.spec.name, time.time(), self.weights(), arm, kind, reason)
        self.history.append(change)
        self.changes[arm or "", kind] += 1
        if kind != "started":
            log = logger.warning if kind in ("cut", "rolled-back") else logger.info
            log("experiment %r: %s %s: %s -> weights %s", self.spec.name, kind, arm or "", reason, change.weights)
        if self._tell is not None:
            self._tell(change)

    def _move(self, arm: Arm, weight: float, kind: str, reason: str) -> None:
        """Set ``arm``'s weight, the control taking up (or giving) the difference."""
        weights = self.weights()
        control = self.arms[0].name
        weights[control] = round(weights[control] + weights[arm.name] - weight, 6)
        weights[arm.name] = weight
        self.set_weights(weights, kind=kind, reason=reason, arm=arm.name)

    def check(self) -> None:
        """The guard rail and the ramp, at most every ``guard.check_s`` (called as outcomes arrive): a treatment arm
        whose outcomes since the last change breach a bound is cut, or rolled back; otherwise a ramp whose step has
        lasted ``ramp_step_s``, and been judged, steps up."""
        spec = self.spec
        guard = spec.guard
        if (guard is None and not spec.ramp) or self.paused or self.rolled_back:
            return
        now = self.clock()
        if now < self._next_check:
            return
        guard = guard or GuardSpec()
        self._next_check = now + guard.check_s
        control = self.arms[0]
        for arm in self.arms[1:]:
            weight = self.weights()[arm.name]
            if weight <= 0 and spec.assign != "header":  # by header, an arm's weight says nothing of its traffic
                continue
            mark = self._marks[arm.name]
            finished = arm.outcomes.finished - mark.finished
            # Failures that a full sample's error rate would show as a breach whatever the rest does: judged now.
            spent = (
                spec.guard is not None and arm.outcomes.failed - mark.failed > guard.max_error_rate * guard.min_requests
            )
            if finished < guard.min_requests and not spent:
                continue
            breach = self._breach(guard, arm, control, finished) if spec.guard is not None else None
            if breach is not None:
                self.breaches[arm.name] += 1
                cut = math.floor(round(weight * guard.cut / WEIGHT_STEP, 6)) * WEIGHT_STEP
                # By header, a weight steers nothing (`assign`): the first breach rolls the arm back, whatever
                # weights the arms were given.
                header = spec.assign == "header"
                if header or self.breaches[arm.name] >= guard.max_breaches or cut < WEIGHT_STEP:
                    self.rolled_back = True
                    reason = f"{breach} (breach {self.breaches[arm.name]})"
                    self.rolled = (arm.name, reason, "")
                    self._move(arm, 0.0, "rolled-back", reason)
                    return
                self._move(arm, round(cut, 6), "cut", f"{breach} (breach {self.breaches[arm.name]})")
                return
            if spec.ramp and now - self._changed_at >= spec.ramp_step_s:
                higher = [w for w in spec.ramp if w > weight + 1e-9]
                if higher:
                    self._move(arm, higher[0], "ramp", f"{finished} requests since the last change within bounds")
                    return

    def _breach(self, guard: GuardSpec, arm: Arm, control: Arm, finished: int) -> str | None:
        mark = self._marks[arm.name]
        failed = arm.outcomes.failed - mark.failed
        rate = failed / max(finished, guard.min_requests)  # at least a full sample's worth of requests
        if rate > guard.max_error_rate:
            return f"{failed} of {finished} requests failed, over {guard.max_error_rate:.1%} of {guard.min_requests}"
        ratio = guard.max_ttft_p99_ratio
        if ratio is None:
            return None
        own = mark.ttft_since(arm.outcomes)
        base = self._marks[control.name].ttft_since(control.outcomes)
        least = max(guard.min_requests, P99_MIN_SAMPLES)
        if own.count < least or base.count < least:
            return None
        own_p99, base_p99 = histogram_quantile(own, 0.99), histogram_quantile(base, 0.99)
        if own_p99 is not None and base_p99 is not None and own_p99 > ratio * base_p99:
            return f"TTFT p99 {own_p99:.3g} s over {ratio:g} x the control's {base_p99:.3g} s"
        return None

    def continue_from(self, old: RunningExperiment) -> None:
        """Take over ``old``'s outcomes, weights, state and history (the same experiment, before a reload)."""
        for arm, old_arm in zip(self.arms, old.arms, strict=True):
            arm.outcomes = old_arm.outcomes
        self._line = old._line.copy()
        self._marks, self._changed_at, self._next_check = old._marks, old._changed_at, old._next_check
        self.paused, self.stopped, self.rolled_back = old.paused, old.stopped, old.rolled_back
        self.starts, self.weight_sets, self.operator_weights, self.rolled = (
            old.starts,
            old.weight_sets,
            old.operator_weights,
            old.rolled,
        )
        self.breaches, self.started_at, self.history, self.changes = (
            old.breaches,
            old.started_at,
            old.history,
            old.changes,
        )

    def covers(self, request: RequestFeatures) -> bool:
        spec = self.spec
        if spec.models and request.model not in spec.models:
            return False
        if spec.classes and request.request_class not in spec.classes:
            return False
        return not spec.paths or request.path.startswith(spec.paths)

    def assign(self, request: RequestFeatures) -> Arm:
        spec = self.spec
        if spec.assign == "header":  # weights do not apply: a guard's breach acts when it rolls the arm back
            named = spec.values.get((request.headers or {}).get(spec.header or "", ""))
            arm = self._by_name[named] if named is not None and not self.rolled_back else self.arms[0]
        else:
            key = (request.headers or {}).get(spec.header or "") if spec.assign == "hash" else None
            if key:
                digest = hashlib.blake2b(self._salt + key.encode(), digest_size=8).digest()
                arm = self._by_share(int.from_bytes(digest, "big") / 2**64)
            else:
                arm = self._by_share(self._draw())
        return self.arms[0] if arm.vacant else arm

    def _by_share(self, u: float) -> Arm:
        return self.arms[self._line.arm_at(u)]

    def _draw(self) -> float:
        # Drawn in blocks: one numpy call per request would cost more than the assignment.
        if self._cursor >= len(self._draws):
            self._draws = self._rng.random(4096)
            self._cursor = 0
        u = float(self._draws[self._cursor])
        self._cursor += 1
        return u

    def comparisons(self, window: bool = False) -> dict[str, dict[str, Comparison]]:
        """Per treatment arm, per metric (``ttft``, ``e2e``, ``tpot``, ``errors``): its comparison with the control,
        over the experiment's life or (``window``) its last ``window_s``."""
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
            latency = spec.latency_tau
            for metric, tau in (("ttft", latency), ("e2e", latency), ("tpot", latency), ("errors", spec.error_tau)):
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
                    "endpoints": dict(arm.spec.endpoints),
                    "model": arm.spec.model,
                    "requests": o.requests,
                    "finished": o.finished,
                    "shed": o.shed,
                    "error_rate": o.errors.mean if o.errors.count else None,
                    "ttft_s": _quantiles(o.ttft.histogram),
                    "ttft_cdf": histogram_cdf(o.ttft.histogram),
                    "e2e_s": _quantiles(o.e2e.histogram),
                    "tpot_s": _quantiles(o.tpot.histogram),
                    "ttft_s_window": _quantiles(o.ttft.window.histogram(now)),
                    "e2e_s_window": _quantiles(o.e2e.window.histogram(now)),
                    "tpot_s_window": _quantiles(o.tpot.window.histogram(now)),
                }
            )
        return {
            "name": self.spec.name,
            "state": self.state,
            "assign": self.spec.assign,
            "header": self.spec.header,
            "control": self.arms[0].name,
            "weights": self.weights(),
            "alpha": self.spec.alpha,
            "min_samples": self.spec.min_samples,
            "running_s": now - self.started_at,
            "arms": arms,
            # The life's comparisons hold however often they are looked at (the sequential test). A window's are
            # the same test over the last window_s, recomputed at each look: looked at as the page does (every 5 s
            # for hours), an A/A pair gets a "verdict" in a quarter of runs. So a window shows its difference and
            # interval, and no verdict or p-value to act on.
            "comparisons": {
                "life": {
                    arm: {metric: comparison_json(c) for metric, c in metrics.items()}
                    for arm, metrics in self.comparisons().items()
                },
                "window": {
                    arm: {
                        metric: comparison_json(c) | {"verdict": None, "p_value": None} for metric, c in metrics.items()
                    }
                    for arm, metrics in self.comparisons(window=True).items()
                },
            },
            "breaches": dict(self.breaches),
            "history": [change.as_json() for change in self.history],
        }


def spec_fingerprint(spec: ExperimentSpec) -> str:
    """16 hex digits of ``spec``'s canonical form (sets sorted, mappings by key, numbers as numbers): the same for the
    same configuration in every process, whatever its hash seed."""

    def canonical(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): canonical(v) for k, v in value.items()}
        if isinstance(value, set | frozenset):
            return sorted((canonical(v) for v in value), key=repr)
        if isinstance(value, list | tuple):
            return [canonical(v) for v in value]
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return value
        if isinstance(value, int | float):
            return float(value)
        raise TypeError(f"an experiment's spec holds a {type(value).__name__}, which has no canonical form")

    text = orjson.dumps(canonical(dataclasses.asdict(spec)), option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(text, digest_size=8).hexdigest()


def _quantiles(h: Histogram) -> dict[str, float | None]:
    return {f"p{q}": histogram_quantile(h, q / 100) for q in (50, 90, 99)}


def comparison_json(c: Comparison) -> dict[str, Any]:
    """A comparison as JSON (an infinite bound as None)."""

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


def histogram_cdf(h: Histogram) -> list[tuple[float, float]]:
    """(upper bound, share of values at or below it) for the buckets from the first with values to the first
    that holds them all: the CDF of ``h`` at its bucket bounds (empty when ``h`` is)."""
    if not h.count:
        return []
    out = []
    seen = 0
    for bound, count in zip(h.bounds, h.counts, strict=False):
        seen += count
        if seen:
            out.append((bound, round(seen / h.count, 6)))
        if seen == h.count:
            break
    return out


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
    is remembered for at most ``max_age_s`` and ``capacity`` requests (the oldest forgotten first, counted in
    ``evicted``): an outcome that never comes costs nothing after that. One event loop; not thread-safe."""

    def __init__(
        self,
        specs: Iterable[ExperimentSpec],
        engine_for: Callable[[str], Engine],
        *,
        rng: np.random.Generator | None = None,
        clock: Callable[[], float] = time.monotonic,
        capacity: int = OPEN_CAPACITY,
        max_age_s: float = 900.0,
        labels: Sequence[Mapping[str, str]] = (),
        vacant_ok: bool = False,
    ) -> None:
        rng = rng if rng is not None else np.random.default_rng()
        self.clock = clock
        # Told of every change of weight after the start (the picker: a metric and a span event); must not raise.
        self.listeners: list[Callable[[WeightChange], None]] = []
        self.running: dict[str, RunningExperiment] = {}
        specs = list(specs)
        names = [spec.name for spec in specs]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ValueError(f"experiment {name!r} is configured twice")
        for spec, masks in zip(specs, arm_masks(specs, labels, vacant_ok=vacant_ok), strict=True):
            engines = {a.profile: engine_for(a.profile) for a in spec.arms}
            self.running[spec.name] = RunningExperiment(spec, engines, rng, clock, labels, self._tell, masks)
        # Every arm's engine, each once: the requests of all arms share the servers, so each engine's state of them
        # (its prefix index) learns where the others' requests went (`Router.route`).
        self.engines: tuple[Engine, ...] = tuple(
            {id(arm.engine): arm.engine for e in self.running.values() for arm in e.arms}.values()
        )
        reserved = [e.reserved for e in self.running.values() if e.reserved is not None]
        # The endpoints a request no experiment assigns may use (None: any): all but the release arms' (whatever
        # their experiments' state: see `arm_masks`).
        self.outside: np.ndarray | None = ~np.logical_or.reduce(reserved) if reserved else None
        self.capacity = capacity
        self.max_age_s = max_age_s
        self._open: OrderedDict[str, tuple[float, Arm]] = OrderedDict()
        # Requests whose outcome was a success at their first token (a streamed response is timed no further):
        # Envoy's access log may still report them failed (a server that dies mid-answer), which then counts.
        self._streamed: OrderedDict[str, tuple[float, Arm]] = OrderedDict()
        self.unattributed = 0  # outcomes for request ids not (or no longer) remembered
        self.evicted = 0  # routed requests forgotten before their outcome because ``capacity`` were open
        # The pool's own engine when built `over` it (its owner carries its learned state across a reload).
        self.pool_engine: Engine | None = None

    @classmethod
    def over(
        cls,
        engine: Engine,
        specs: Sequence[ExperimentSpec],
        spec_of: Callable[[str], ProfileSpec | str],
        rng: np.random.Generator | None = None,
        *,
        speeds: np.ndarray | None = None,
        vacant_ok: bool = False,
    ) -> Experiments:
        """The experiments ``specs`` over ``engine``'s pool and state: an arm whose profile is ``engine``'s routes
        with it, any other with an engine of its own (``spec_of`` gives a profile's spec) on the same state; the
        pool's declared relative speeds are ``speeds`` (`SpeedHints.of`). ``vacant_ok``: a release arm whose
        endpoints are none of the pool's is vacant (`Arm.vacant`) instead of an error."""
        built = {engine.profile.name: engine}

        def engine_for(name: str) -> Engine:
            if name not in built:
                addresses = tuple(e.address for e in engine.pool)
                profile = build_profile(spec_of(name), rng, size=len(engine.pool), speeds=speeds, addresses=addresses)
                built[name] = Engine(engine.pool, profile, engine.inflight, engine.signals, engine.saturation)
            return built[name]

        labels = [endpoint.labels for endpoint in engine.pool.endpoints]
        experiments = cls(specs, engine_for, rng=rng, clock=engine.signals.clock, labels=labels, vacant_ok=vacant_ok)
        experiments.pool_engine = engine
        return experiments

    def _tell(self, change: WeightChange) -> None:
        for listener in self.listeners:
            listener(change)

    def adopt(
        self,
        previous: Experiments | None,
        mapping: np.ndarray | None = None,
        restarted: Sequence[int] = (),
        *,
        taken: Sequence[Engine] = (),
    ) -> None:
        """Carry over from ``previous`` (the experiments before a config reload) every experiment configured the same
        way: its outcomes, weights, state and history continue; the arms route with the new engines. Given the
        membership's ``mapping`` (and ``restarted``, as `Engine.adopt` takes them), each arm's engine other than the
        pool's also takes over the learned state (the prefix index) of the engine before of the same profile, unless
        that one is ``taken`` (the caller's pool engine adopted it: an old index goes to one new engine only). Call
        it before the first decision."""
        if previous is None:
            return
        if mapping is not None:
            before = {e.profile.name: e for e in previous.engines if all(e is not t for t in taken)}
            for engine in self.engines:
                old = before.get(engine.profile.name)
                if engine is not self.pool_engine and old is not None:
                    engine.adopt(old, mapping, restarted)
        for name, experiment in self.running.items():
            old = previous.running.get(name)
            if old is None or old.spec != experiment.spec:
                continue
            experiment.continue_from(old)
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

    def owns(self, arm: Arm) -> bool:
        """Whether ``arm`` is one of these experiments' (not of the experiments before a reload)."""
        return self._arm(arm.experiment, arm.name) is arm

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
            self.evicted += 1
        limit = now - self.max_age_s
        while self._open and next(iter(self._open.values()))[0] < limit:
            self._open.popitem(last=False)

    def arm_of(self, request_id: str) -> Arm | None:
        """The arm of a routed request whose outcome has not come yet (None: none, or no longer remembered)."""
        held = self._open.get(request_id)
        return None if held is None else held[1]

    def holds(self, request_id: str) -> bool:
        """Whether an outcome of ``request_id`` would count here: its outcome has not come, or was a success at its
        first token (which a failure may still correct)."""
        return request_id in self._open or request_id in self._streamed

    def shed(self, arm: Arm) -> None:
        arm.outcomes.shed += 1

    def first_token(self, request_id: str, ttft_s: float) -> Arm | None:
        """The time to first token of a routed request (a streamed response's first chunk, or a server span); its arm,
        or None when the request is not (or no longer) remembered."""
        held = self._open.get(request_id)
        if held is None:
            self.unattributed += 1
            return None
        held[1].outcomes.ttft.add(ttft_s, self.clock())
        return held[1]

    def outcome(self, request_id: str, *, failed: bool, e2e_s: float | None = None) -> None:
        """The end of a routed request: whether it failed (5xx, reset) and, if it did not, its end-to-end time."""
        held = self._open.pop(request_id, None)
        if held is None:
            self.unattributed += 1
            return
        arm = held[1]
        outcomes = arm.outcomes
        outcomes.finished += 1
        outcomes.failed += failed
        outcomes.errors.add(1.0 if failed else 0.0)
        if not failed and e2e_s is not None:
            outcomes.e2e.add(e2e_s, self.clock())
        self.running[arm.experiment].check()

    def failed(self, request_id: str) -> None:
        """A routed request failed (Envoy's access log: a 5xx or a reset). Nothing if its outcome already came, unless
        that was a success at its first token (the response broke off after it): that outcome becomes a failure."""
        if request_id in self._open:
            self.outcome(request_id, failed=True)
            return
        held = self._streamed.pop(request_id, None)
        if held is None or not self.owns(held[1]):
            return
        arm = held[1]
        arm.outcomes.failed += 1
        arm.outcomes.errors.replace(0.0, 1.0)
        self.running[arm.experiment].check()

    def observed(
        self,
        request_id: str,
        ttft_s: float | None,
        e2e_s: float | None,
        failed: bool,
        *,
        output_tokens: int | None = None,
    ) -> None:
        """What the filter's timing of a response says (``filter.observe.RequestOutcome``): a streamed answer's first
        token (its TTFT; it is measured no further, so that is its end), another's full body (E2E), or a failure;
        or a server span: TTFT, E2E and, with ``output_tokens`` (more than one), the time per output token."""
        arm = None
        if ttft_s is not None:
            arm = self.first_token(request_id, ttft_s)
            if arm is None:
                return  # counted once as unattributed, there
            if e2e_s is not None and output_tokens is not None and output_tokens > 1:
                arm.outcomes.tpot.add((e2e_s - ttft_s) / (output_tokens - 1), self.clock())
        self.outcome(request_id, failed=failed, e2e_s=e2e_s)
        if arm is not None and e2e_s is None and not failed and request_id:
            now = self.clock()
            streamed = self._streamed
            streamed[request_id] = (now, arm)
            while len(streamed) > self.capacity or next(iter(streamed.values()))[0] < now - self.max_age_s:
                streamed.popitem(last=False)

    def describe(self) -> list[dict[str, Any]]:
        return [e.describe() for e in self.running.values()]

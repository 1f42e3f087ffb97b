"""Release arms (endpoints by label), the guard rail that cuts and rolls back a misbehaving arm, and the ramp."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from inferlb.scorer.config import ConfigError, parse_config
from inferlb.scorer.engine import Engine
from inferlb.scorer.experiments import (
    P99_MIN_SAMPLES,
    ArmSpec,
    ControlState,
    Experiments,
    ExperimentSpec,
    GuardSpec,
    WeightChange,
    endpoint_masks,
)
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.router import Router
from inferlb.scorer.signals import Signals

LABELS = [{"version": "stable"}] * 3 + [{"version": "canary"}]
POOL = {
    "endpoints": [
        {"address": f"10.0.0.{i + 1}:8000", "models": ["m"], "labels": labels} for i, labels in enumerate(LABELS)
    ]
}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _router(*specs: ExperimentSpec, clock: Clock | None = None) -> Router:
    config = parse_config({"policy": "least-request", "pool": POOL})
    clock = clock or Clock()
    pool = Pool(config.endpoints)
    engine = Engine(
        pool, build_profile("least-request", np.random.default_rng(0), size=4), signals=Signals(4, clock=clock)
    )
    experiments = Experiments.over(engine, specs, config.profile_spec, np.random.default_rng(0))
    return Router(engine, experiments=experiments)


def _canary(weight: float = 0.5, **kw: object) -> ExperimentSpec:
    arms = (
        ArmSpec("stable", "least-request", round(1 - weight, 6)),
        ArmSpec("canary", "least-request", weight, {"version": "canary"}),
    )
    return ExperimentSpec("release", arms, **kw)  # type: ignore[arg-type]


def _send(router: Router, n: int, start: int = 0, **features: object) -> list[tuple[str | None, int]]:
    """Route ``n`` requests, ending each at once; (arm, endpoint) of each."""
    out = []
    for i in range(start, start + n):
        routed = router.route(router.admit(RequestFeatures(model="m", request_id=f"r{i}", **features)).request)  # type: ignore[arg-type]
        routed.lease.release()
        out.append((None if routed.arm is None else routed.arm.name, routed.decision.endpoint.index))
    return out


def _finish(
    router: Router, routed: list[tuple[str | None, int]], start: int, failing: float, ttft: float = 0.1
) -> None:
    """Report outcomes for requests r{start}..: the canary's fail at the given share (every k-th)."""
    experiments = router.experiments
    assert experiments is not None
    every = round(1 / failing) if failing else 0
    canary = 0
    for i, (arm, _) in enumerate(routed, start):
        failed = False
        if arm == "canary":
            canary += 1
            failed = bool(every) and canary % every == 0
        if not failed:
            experiments.first_token(f"r{i}", ttft)
        experiments.outcome(f"r{i}", failed=failed, e2e_s=None if failed else ttft * 2)


def _rounds(router: Router, clock: Clock, *, rounds: int, size: int, step_s: float, failing: float) -> Iterator[int]:
    """``rounds`` times: the clock moves ``step_s`` on, ``size`` requests are routed and finished (`_finish`); after
    each round, the requests sent so far."""
    start = 0
    for _ in range(rounds):
        clock.now += step_s
        _finish(router, _send(router, size, start), start, failing)
        start += size
        yield start


def test_a_release_arm_routes_to_its_labelled_endpoints_and_nothing_else_does() -> None:
    router = _router(
        _canary(),
        ExperimentSpec("other", (ArmSpec("a", "default", 0.5), ArmSpec("b", "default", 0.5)), models=frozenset({"x"})),
    )
    routed = _send(router, 400)
    by_arm: dict[str | None, set[int]] = {}
    for arm, endpoint in routed:
        by_arm.setdefault(arm, set()).add(endpoint)
    assert by_arm == {"canary": {3}, "stable": {0, 1, 2}}
    # A request outside the experiment's scope stays off the canary too.
    scoped = _router(ExperimentSpec("release", _canary().arms, paths=("/v1/completions",)))
    outside = _send(scoped, 100, path="/v1/embeddings")
    assert {arm for arm, _ in outside} == {None} and {endpoint for _, endpoint in outside} == {0, 1, 2}


@pytest.mark.parametrize("action", [None, "stop", "pause", "rolled back"])
def test_another_experiments_arms_stay_off_a_releases_endpoints_whatever_its_state(action: str | None) -> None:
    other = ExperimentSpec("ab", (ArmSpec("a", "round-robin", 0.5), ArmSpec("b", "default", 0.5)), paths=("/v1/x",))
    router = _router(ExperimentSpec("release", _canary().arms, paths=("/v1/chat",)), other)
    release = router.experiments.running["release"]  # type: ignore[union-attr]
    if action == "rolled back":  # what the guard's last breach does
        release.rolled_back = True
        release._move(release.arms[1], 0.0, "rolled-back", "a test")
    elif action is not None:
        release.control(action)
    ab = _send(router, 400, path="/v1/x")
    assert {arm for arm, _ in ab} == {"a", "b"}
    assert {endpoint for _, endpoint in ab} == {0, 1, 2}


def test_two_experiments_cannot_reserve_the_same_endpoints() -> None:
    twin = ExperimentSpec("twin", _canary().arms, models=frozenset({"x"}))
    with pytest.raises(ValueError, match="'release' and 'twin' both reserve endpoints"):
        _router(_canary(), twin)
    experiment = {
        "arms": [
            {"name": "a", "profile": "default", "weight": 0.5},
            {"name": "b", "profile": "default", "weight": 0.5, "endpoints": {"version": "canary"}},
        ]
    }
    both = [{**experiment, "name": "one"}, {**experiment, "name": "two"}]
    with pytest.raises(ConfigError, match=r"^experiments: experiments 'one' and 'two' both reserve"):
        parse_config({"pool": POOL, "experiments": both})


def test_selectors_are_checked_against_the_pool() -> None:
    with pytest.raises(ValueError, match="no endpoint of the pool has the labels"):
        endpoint_masks([ArmSpec("a", "default", 0.5), ArmSpec("b", "default", 0.5, {"version": "v9"})], LABELS)
    everything = [
        ArmSpec("a", "default", 0.5),
        ArmSpec("b", "default", 0.5, {"version": "stable"}),
        ArmSpec("c", "default", 0.0, {"version": "canary"}),
    ]
    with pytest.raises(ValueError, match="none is left for the other arms"):
        endpoint_masks(everything, LABELS)
    experiment = {
        "name": "e",
        "arms": [
            {"name": "a", "profile": "default", "weight": 0.5},
            {"name": "b", "profile": "default", "weight": 0.5, "endpoints": {"version": "v9"}},
        ],
    }
    with pytest.raises(ConfigError, match=r"experiments\[0\].*no endpoint of the pool has the labels"):
        parse_config({"pool": POOL, "experiments": [experiment]})


def test_an_erroring_canary_is_cut_then_rolled_back_and_each_change_is_told() -> None:
    clock = Clock()
    told: list[WeightChange] = []
    router = _router(_canary(0.5, guard=GuardSpec(min_requests=20, check_s=1.0)), clock=clock)
    experiments = router.experiments
    assert experiments is not None
    experiments.listeners.append(told.append)
    experiment = experiments.running["release"]
    rounds = _rounds(router, clock, rounds=12, size=200, step_s=1.5, failing=0.1)
    sent = next((n for n in rounds if experiment.rolled_back), None)
    assert sent is not None, "never rolled back"
    assert [c.kind for c in told] == ["cut", "cut", "rolled-back"]
    assert [c.weights["canary"] for c in told] == [0.15, 0.045, 0.0]
    assert experiment.state == "rolled back" and experiment.breaches["canary"] == 3
    assert all("failed, over 2.0%" in c.reason for c in told)
    # Rolled back: nothing more goes to the canary, and its endpoint stays reserved (no one else uses it).
    assert {endpoint for _, endpoint in _send(router, 200, sent)} == {0, 1, 2}
    described = experiment.describe()
    assert [h["kind"] for h in described["history"]] == ["started", "cut", "cut", "rolled-back"]


def test_a_few_failures_are_judged_before_the_full_sample() -> None:
    """With min_requests 20 and 2%, the first failure already is a breach: the guard does not wait for 20."""
    clock = Clock()
    router = _router(_canary(0.5, guard=GuardSpec(min_requests=20, check_s=0.0)), clock=clock)
    experiment = router.experiments.running["release"]  # type: ignore[union-attr]
    batch = _send(router, 10)
    canary = [i for i, (arm, _) in enumerate(batch) if arm == "canary"]
    experiments = router.experiments
    assert experiments is not None
    experiments.outcome(f"r{canary[0]}", failed=True)
    assert experiment.weights()["canary"] == 0.15


def test_a_healthy_canary_is_not_cut_and_a_slow_one_is_by_its_p99() -> None:
    clock = Clock()
    guard = GuardSpec(min_requests=20, check_s=1.0, max_ttft_p99_ratio=1.5)
    healthy = _router(_canary(0.5, guard=guard), clock=clock)
    for k in range(5):
        clock.now += 2
        _finish(healthy, _send(healthy, 400, k * 400), k * 400, failing=0.0)
    assert healthy.experiments.running["release"].history[-1].kind == "started"  # type: ignore[union-attr]

    clock = Clock()
    slow = _router(_canary(0.5, guard=guard), clock=clock)
    experiments = slow.experiments
    assert experiments is not None
    batch = _send(slow, 2 * P99_MIN_SAMPLES + 300)
    for i, (arm, _) in enumerate(batch):
        experiments.first_token(f"r{i}", 0.5 if arm == "canary" else 0.1)
        clock.now += 0.01
        experiments.outcome(f"r{i}", failed=False, e2e_s=1.0)
    change = experiments.running["release"].history[-1]
    assert change.kind == "cut" and "TTFT p99" in change.reason


def test_the_p99_is_not_judged_on_a_handful_of_requests() -> None:
    clock = Clock()
    router = _router(_canary(0.5, guard=GuardSpec(min_requests=20, check_s=0.0)), clock=clock)
    experiments = router.experiments
    assert experiments is not None
    batch = _send(router, 60)  # ~30 a side: over min_requests, under P99_MIN_SAMPLES
    for i, (arm, _) in enumerate(batch):
        experiments.first_token(f"r{i}", 5.0 if arm == "canary" else 0.1)
        experiments.outcome(f"r{i}", failed=False)
    assert experiments.running["release"].history[-1].kind == "started"


def test_the_ramp_steps_up_on_schedule_while_the_guard_finds_nothing() -> None:
    clock = Clock()
    spec = _canary(0.0, ramp=(0.05, 0.2, 0.5), ramp_step_s=30.0, guard=GuardSpec(min_requests=20, check_s=1.0))
    router = _router(spec, clock=clock)
    experiment = router.experiments.running["release"]  # type: ignore[union-attr]
    assert experiment.weights() == {"stable": 0.95, "canary": 0.05}
    seen = [
        (clock.now, experiment.weights()["canary"])
        for _ in _rounds(router, clock, rounds=100, size=50, step_s=1.0, failing=0.0)
    ]
    steps = [(t, w) for (t, w), (_, before) in zip(seen[1:], seen, strict=False) if w != before]
    assert [w for _, w in steps] == [0.2, 0.5]
    assert [t for t, _ in steps] == [30.0, 60.0]  # each step held ramp_step_s


def _by_header(weights: tuple[float, float], guard: GuardSpec) -> ExperimentSpec:
    """A release whose canary arm takes the requests with ``x-canary: true``."""
    arms = (
        ArmSpec("stable", "least-request", weights[0]),
        ArmSpec("canary", "least-request", weights[1], {"version": "canary"}),
    )
    return ExperimentSpec("release", arms, assign="header", header="x-canary", values={"true": "canary"}, guard=guard)


def test_header_assignment_sends_everyone_to_the_control_once_rolled_back() -> None:
    clock = Clock()
    router = _router(_by_header((0.0, 0.0), GuardSpec(min_requests=5, check_s=0.0, max_breaches=1)), clock=clock)
    headers = {"x-canary": "true"}
    batch = _send(router, 10, headers=headers)
    assert {arm for arm, _ in batch} == {"canary"}
    _finish(router, batch, 0, failing=0.5)
    assert router.experiments.running["release"].rolled_back  # type: ignore[union-attr]
    assert {arm for arm, _ in _send(router, 10, 10, headers=headers)} == {"stable"}


@pytest.mark.parametrize(
    "weights", [pytest.param((0.5, 0.5), id="weights-that-sum-to-1"), pytest.param((1.0, 0.0), id="all-on-control")]
)
def test_an_arm_assigned_by_header_is_rolled_back_at_its_first_breach_whatever_its_weights(
    weights: tuple[float, float],
) -> None:
    # By header a weight steers nothing: once, with weights that summed to 1, a breach only cut a weight nobody
    # read, and the canary kept its header's traffic until the third breach.
    clock = Clock()
    # Three breaches to roll back, were it weighted.
    router = _router(_by_header(weights, GuardSpec(min_requests=5, check_s=0.0)), clock=clock)
    headers = {"x-canary": "true"}
    _finish(router, _send(router, 10, headers=headers), 0, failing=0.5)
    experiment = router.experiments.running["release"]  # type: ignore[union-attr]
    assert experiment.rolled_back and experiment.breaches["canary"] == 1
    assert {arm for arm, _ in _send(router, 10, 10, headers=headers)} == {"stable"}


def test_a_stopped_experiment_starts_again_only_with_start() -> None:
    router = _router(_canary(0.5))
    experiment = router.experiments.running["release"]  # type: ignore[union-attr]
    experiment.control("stop")
    with pytest.raises(ValueError, match="a stopped experiment starts again with 'start'"):
        experiment.control("resume")
    assert experiment.state == "stopped"
    experiment.control("start")
    assert experiment.state == "running"


def test_weights_are_refused_after_a_roll_back_until_start_re_arms_the_guard() -> None:
    clock = Clock()
    router = _router(_canary(0.1, guard=GuardSpec(min_requests=20, check_s=0.0, max_breaches=1)), clock=clock)
    _finish(router, _send(router, 400), 0, failing=1.0)
    experiment = router.experiments.running["release"]  # type: ignore[union-attr]
    assert experiment.state == "rolled back" and experiment.weights() == {"stable": 1.0, "canary": 0.0}
    with pytest.raises(ValueError, match="rolled back and its guard judges no more: 'start' it again"):
        experiment.control("weights", {"stable": 0.9, "canary": 0.1})
    assert experiment.state == "rolled back" and experiment.weights() == {"stable": 1.0, "canary": 0.0}
    experiment.control("start")
    experiment.control("weights", {"stable": 0.8, "canary": 0.2})
    assert experiment.state == "running" and experiment.weights() == {"stable": 0.8, "canary": 0.2}
    _finish(router, _send(router, 400, 400), 400, failing=1.0)
    assert experiment.state == "rolled back"  # judged again


def test_a_reload_keeps_the_guards_state() -> None:
    clock = Clock()
    spec = _canary(0.5, guard=GuardSpec(min_requests=20, check_s=0.0))
    before = _router(spec, clock=clock)
    _finish(before, _send(before, 100), 0, failing=0.1)
    old = before.experiments.running["release"]  # type: ignore[union-attr]
    assert old.breaches["canary"] >= 1
    after = _router(spec, clock=clock)
    assert after.experiments is not None
    after.experiments.adopt(before.experiments)
    new = after.experiments.running["release"]
    assert (new.weights(), new.breaches, new.history) == (old.weights(), old.breaches, old.history)


def test_ramps_and_guards_in_the_config() -> None:
    experiment = {
        "name": "release",
        "arms": [
            {"name": "stable", "profile": "default"},
            {"name": "canary", "profile": "default", "endpoints": {"version": "canary"}},
        ],
        "ramp": [0.01, 0.05, 0.25],
        "ramp_step_s": 120,
        "guard": {"max_error_rate": 0.05, "min_requests": 30},
    }
    config = parse_config({"pool": POOL, "experiments": [experiment]})
    (spec,) = config.experiments
    assert spec.ramp == (0.01, 0.05, 0.25) and spec.ramp_step_s == 120
    assert spec.guard == GuardSpec(max_error_rate=0.05, min_requests=30)
    assert spec.starting_weights == {"stable": 0.99, "canary": 0.01}
    # The TTFT p99 bound may be turned off (null: not judged), as the README shows.
    unjudged = {**experiment, "guard": {"max_ttft_p99_ratio": None}}
    assert parse_config({"pool": POOL, "experiments": [unjudged]}).experiments[0].guard.max_ttft_p99_ratio is None
    bad = {**experiment, "ramp": [0.05, 0.01]}
    with pytest.raises(ConfigError, match="must increase"):
        parse_config({"pool": POOL, "experiments": [bad]})
    three = {**experiment, "arms": [*experiment["arms"], {"name": "x", "profile": "default"}]}  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="a ramp needs two arms"):
        parse_config({"pool": POOL, "experiments": [three]})


def test_a_request_admitted_before_a_reload_routes_with_the_new_experiments() -> None:
    before = _router(_canary(0.5))
    admitted = [before.admit(RequestFeatures(model="m", request_id=f"r{i}")).request for i in range(50)]
    assert {a.arm.name for a in admitted if a.arm is not None} == {"stable", "canary"}
    after = _router(_canary(0.5))  # a reload: new experiments, new arms
    for request in admitted:
        routed = after.route(request)
        routed.lease.release()
        assert routed.arm is None and routed.decision.profile == "least-request"
    assert sum(arm.outcomes.requests for arm in after.experiments.running["release"].arms) == 0  # type: ignore[union-attr]


def test_a_roll_back_taken_from_another_copy_zeroes_the_arm_it_was_about_as_the_guard_would() -> None:
    arms = (
        ArmSpec("stable", "least-request", 0.6),
        ArmSpec("canary", "least-request", 0.2, {"version": "canary"}),
        ArmSpec("policy", "round-robin", 0.2),
    )
    experiment = _router(ExperimentSpec("release", arms)).experiments.running["release"]  # type: ignore[union-attr]
    shared = experiment.control_state()
    rolled = replace(shared, rolled=("canary", "5 of 50 requests failed", "replica a"))
    experiment.follow(rolled, "replica a")
    assert experiment.state == "rolled back"
    assert experiment.weights() == {"stable": 0.8, "canary": 0.0, "policy": 0.2}
    assert experiment.history[-1].reason == "rolled back by replica a: 5 of 50 requests failed"
    experiment.follow(rolled, "replica a")  # following the same state again changes nothing
    assert [c.kind for c in experiment.history] == ["started", "rolled-back"]
    experiment.follow(replace(rolled, paused=True), "replica b")  # a pause does not undo a roll-back
    assert experiment.state == "rolled back" and experiment.paused
    # A start re-arms it; a roll-back about no arm of this config takes every treatment out.
    experiment.follow(replace(shared, starts=1), "replica b")
    assert experiment.state == "running" and experiment.weights() == {"stable": 0.6, "canary": 0.2, "policy": 0.2}
    experiment.follow(replace(shared, starts=1, rolled=("gone", "?", "replica c")), "replica c")
    assert experiment.weights() == {"stable": 1.0, "canary": 0.0, "policy": 0.0}
    experiment.control("start")
    with pytest.raises(ValueError, match="every arm"):
        experiment.follow(replace(shared, starts=2, weight_sets=1, weights={"stable": 1.0}), "replica d")
    # Another configuration's state, or one older than a start made here, changes nothing.
    experiment.follow(replace(shared, fingerprint="0" * 16, paused=True), "replica e")
    experiment.follow(replace(shared, starts=1, paused=True), "replica e")
    assert not experiment.paused


def test_merging_keeps_what_each_replica_changed() -> None:
    shared = ControlState("f", starts=1)
    rolled = ControlState("f", starts=1, rolled=("canary", "errors", "replica a"), by="replica a")
    paused = ControlState("f", starts=1, paused=True, by="replica b")
    both = shared.merged(rolled, ["rolled-back"]).merged(paused, ["paused"])
    assert both.rolled == ("canary", "errors", "replica a") and both.paused
    assert both.merged(ControlState("f", starts=1, by="replica c"), ["resumed"]).rolled is not None
    restarted = both.merged(ControlState("f", starts=2), ["started"])
    assert (restarted.starts, restarted.rolled, restarted.paused) == (2, None, False)
    # Two starts at once are two starts; a roll-back made before a start it did not see is void.
    assert restarted.merged(ControlState("f", starts=2), ["started"]).starts == 3
    assert restarted.merged(replace(rolled, starts=1), ["rolled-back"]).rolled is None
    weights = restarted.merged(ControlState("f", starts=2, weight_sets=1, weights={"a": 1.0}), ["set"])
    assert weights.weight_sets == 1 and weights.weights == {"a": 1.0}
    assert ControlState("other").merged(paused, ["paused"]) == paused

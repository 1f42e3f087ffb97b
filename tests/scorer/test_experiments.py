"""Experiments in the routing core: assignment, scope, the arms' engines in the routing unit, outcomes, reloads."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from inferlb.filter.requestend import DEFAULT_CAPACITY as LEASE_CAPACITY
from inferlb.scorer.config import ConfigError, parse_config
from inferlb.scorer.engine import Engine
from inferlb.scorer.experiments import (
    OPEN_CAPACITY,
    ArmSpec,
    Experiments,
    ExperimentSpec,
    _Window,
    histogram_quantile,
)
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.histogram import Histogram
from inferlb.scorer.loadscorers import ATTENTION_TOKENS
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.router import Routed, Router
from inferlb.scorer.sequential import Moments

POOL = {"endpoints": [{"address": f"10.0.0.{i}:8000", "models": ["m"]} for i in range(1, 5)]}


def _router(*specs: ExperimentSpec, seed: int = 1) -> Router:
    config = parse_config({"policy": "default", "pool": POOL})
    engine = Engine(Pool(config.endpoints), build_profile("default", np.random.default_rng(seed), size=4))
    experiments = Experiments.over(engine, specs, config.profile_spec, np.random.default_rng(seed))
    return Router(engine, experiments=experiments)


def _ab(**kw: object) -> ExperimentSpec:
    arms = (ArmSpec("control", "round-robin", 0.8), ArmSpec("treatment", "default", 0.2))
    return ExperimentSpec("ab", arms, **kw)  # type: ignore[arg-type]


def _route(router: Router, request: RequestFeatures) -> tuple[str | None, str]:
    routed = router.route(router.admit(request).request)
    routed.lease.release()
    return (None if routed.arm is None else routed.arm.name), routed.decision.profile


def test_weights_split_traffic_and_each_arm_routes_with_its_profile() -> None:
    router = _router(_ab())
    seen = [_route(router, RequestFeatures(model="m", request_id=str(i))) for i in range(5000)]
    treated = sum(arm == "treatment" for arm, _ in seen)
    assert 0.18 < treated / len(seen) < 0.22
    assert {(arm, profile) for arm, profile in seen} == {("control", "round-robin"), ("treatment", "default")}
    arms = router.experiments.running["ab"].arms  # type: ignore[union-attr]
    assert [a.outcomes.requests for a in arms] == [len(seen) - treated, treated]


def test_an_arms_own_engine_compares_by_the_pools_declared_speeds() -> None:
    profiles = {"recent": {"scorers": [{"type": "recent-prefill"}]}}
    config = parse_config({"policy": "round-robin", "profiles": profiles, "pool": POOL})
    engine = Engine(Pool(config.endpoints), build_profile("round-robin", np.random.default_rng(0), size=4))
    speeds = np.array([3.0, 3.0, 1.0, 1.0])
    arms = (ArmSpec("control", "round-robin", 0.5), ArmSpec("treatment", "recent", 0.5))
    experiments = Experiments.over(engine, [ExperimentSpec("ab", arms)], config.profile_spec, speeds=speeds)
    treatment = experiments.running["ab"].arms[1].engine
    assert treatment is not engine
    scorer = next(s.scorer for s in treatment.profile.scorers if s.scorer.name == "recent-prefill")
    assert scorer.speeds is speeds  # type: ignore[attr-defined]


def test_arms_share_the_pools_in_flight_counts() -> None:
    router = _router(_ab())
    leases = [router.route(RequestFeatures(model="m", request_id=str(i))).lease for i in range(40)]
    assert router.engine.inflight.requests.sum() == 40  # whichever arm counted them
    for lease in leases:
        lease.release()
    assert router.engine.inflight.requests.sum() == 0


def test_hash_assignment_keeps_a_user_in_one_arm_and_agrees_across_processes() -> None:
    spec = _ab(assign="hash", header="x-user")
    one, other = _router(spec, seed=1), _router(spec, seed=2)  # different random streams: the hash decides
    for user in ("alice", "bob", "carol", "dave", "erin"):
        request = RequestFeatures(model="m", headers={"x-user": user})
        arms = {_route(router, request)[0] for router in (one, other) for _ in range(5)}
        assert len(arms) == 1
    users = [RequestFeatures(model="m", headers={"x-user": f"u{i}"}) for i in range(4000)]
    share = sum(_route(one, r)[0] == "treatment" for r in users) / len(users)
    assert 0.17 < share < 0.23


def test_by_hash_a_cut_moves_only_the_cut_arms_users_and_only_to_the_control() -> None:
    arms = (ArmSpec("control", "round-robin", 0.5), ArmSpec("A", "default", 0.25), ArmSpec("B", "default", 0.25))
    router = _router(ExperimentSpec("three", arms, assign="hash", header="x-user"))
    experiment = router.experiments.running["three"]  # type: ignore[union-attr]
    users = [RequestFeatures(model="m", headers={"x-user": f"user-{i}"}) for i in range(20000)]
    before = [experiment.assign(user).name for user in users]
    experiment._move(experiment.arms[2], 0.075, "cut", "a test")  # what the guard does on B's breach
    after = [experiment.assign(user).name for user in users]
    moves = Counter(f"{a}->{b}" for a, b in zip(before, after, strict=True) if a != b)
    assert set(moves) == {"B->control"} and 0.15 < moves["B->control"] / len(users) < 0.2
    assert experiment.weights() == {"control": 0.675, "A": 0.25, "B": 0.075}


def test_header_assignment_names_the_arm_and_everyone_else_is_control() -> None:
    router = _router(_ab(assign="header", header="x-canary", values={"true": "treatment"}))
    assert _route(router, RequestFeatures(model="m", headers={"x-canary": "true"}))[0] == "treatment"
    assert _route(router, RequestFeatures(model="m", headers={"x-canary": "no"}))[0] == "control"
    assert _route(router, RequestFeatures(model="m"))[0] == "control"


def test_a_request_outside_the_scope_routes_with_the_pools_policy() -> None:
    router = _router(_ab(paths=("/v1/chat/",)))
    assert _route(router, RequestFeatures(model="m", path="/v1/completions")) == (None, "default")
    assert _route(router, RequestFeatures(model="m", path="/v1/chat/completions"))[0] in ("control", "treatment")


def test_outcomes_reach_the_arm_of_their_request_and_compare_arms() -> None:
    spec = _ab(min_samples=50)
    router = _router(spec)
    experiments = router.experiments
    assert experiments is not None
    rng = np.random.default_rng(0)
    for i in range(3000):
        arm, _ = _route(router, RequestFeatures(model="m", request_id=f"r{i}"))
        ttft = rng.lognormal(np.log(0.2 if arm == "control" else 0.1), 0.3)  # the treatment twice as fast
        experiments.first_token(f"r{i}", ttft)
        experiments.outcome(f"r{i}", failed=False, e2e_s=ttft + 1.0)
    experiments.outcome("never-routed", failed=True)
    described = experiments.describe()[0]
    ttft = described["comparisons"]["life"]["treatment"]["ttft"]
    assert ttft["verdict"] == "better" and ttft["high"] < 0
    assert ttft["low"] < np.log(0.5) < ttft["high"]  # the interval holds the true log-ratio
    assert described["comparisons"]["life"]["treatment"]["errors"]["verdict"] == "no difference yet"
    # The last window's comparison is recomputed at every look: no verdict to act on, the interval alone.
    window = described["comparisons"]["window"]["treatment"]["ttft"]
    assert window["verdict"] is None and window["p_value"] is None and window["high"] < 0
    control = described["arms"][0]
    assert control["finished"] == control["requests"] and control["error_rate"] == 0.0
    assert control["ttft_s"]["p50"] == pytest.approx(0.2, rel=0.1)
    assert experiments.unattributed == 1


def test_a_streamed_response_that_breaks_off_after_its_first_token_counts_as_failed() -> None:
    # otel.latency_source: stream times a streamed response to its first token, and that ends its outcome: a
    # server that dies mid-answer was a success until Envoy's access log says otherwise.
    router = _router(_ab())
    experiments = router.experiments
    assert experiments is not None
    arms = {}
    for i in range(40):
        arms[f"r{i}"] = _route(router, RequestFeatures(model="m", request_id=f"r{i}"))[0]
    for i in range(40):
        rid = f"r{i}"
        if i % 4 == 0:
            experiments.observed(rid, None, None, True)  # failed before its first token
        elif i % 4 == 1:
            experiments.observed(rid, None, 0.5, False)  # a whole body
        else:
            experiments.observed(rid, 0.1, None, False)  # a first token: taken for a success
    for i in range(40):
        if i % 4 != 3:
            experiments.failed(f"r{i}")  # Envoy's access log: a 5xx or a reset
    experiments.failed("never-routed")
    for arm in experiments.running["ab"].arms:
        ids = [i for i in range(40) if arms[f"r{i}"] == arm.name]
        failed = sum(i % 4 in (0, 2) for i in ids)  # before the first token, or broken off after it
        outcomes = arm.outcomes
        assert (outcomes.finished, outcomes.failed) == (len(ids), failed)
        errors = Moments()
        for i in ids:
            errors.add(float(i % 4 in (0, 2)))
        assert outcomes.errors.count == errors.count
        assert outcomes.errors.mean == pytest.approx(errors.mean) and outcomes.errors.m2 == pytest.approx(errors.m2)
    experiments.failed("r2")  # told twice: counted once
    assert sum(a.outcomes.failed for a in experiments.running["ab"].arms) == 20


def test_remembered_requests_are_bounded() -> None:
    router = _router(_ab())
    assert router.experiments is not None
    router.experiments.capacity = 10
    for i in range(100):
        _route(router, RequestFeatures(model="m", request_id=f"r{i}"))
    assert len(router.experiments._open) == 10
    assert router.experiments.evicted == 90
    router.experiments.outcome("r0", failed=False)
    assert router.experiments.unattributed == 1


def test_as_many_requests_await_their_outcome_as_leases_await_their_end() -> None:
    assert OPEN_CAPACITY == LEASE_CAPACITY
    experiments = Experiments([_ab()], lambda name: _router().engine, rng=np.random.default_rng(0))
    assert experiments.capacity == OPEN_CAPACITY


@pytest.mark.parametrize(
    ("ttft_s", "e2e_s", "tokens"),
    [
        pytest.param(0.2, 1.5, 100, id="a-span"),
        pytest.param(0.2, None, None, id="a-streams-first-token"),
        pytest.param(None, 1.5, None, id="a-whole-body"),
    ],
)
def test_an_outcome_for_an_unknown_request_is_counted_once(
    ttft_s: float | None, e2e_s: float | None, tokens: int | None
) -> None:
    router = _router(_ab())
    assert router.experiments is not None
    router.experiments.observed("never-routed-here", ttft_s, e2e_s, False, output_tokens=tokens)
    assert router.experiments.unattributed == 1


def test_a_reload_with_the_same_experiment_keeps_its_outcomes() -> None:
    spec = _ab()
    before = _router(spec)
    _route(before, RequestFeatures(model="m", request_id="kept"))
    after = _router(spec)
    assert after.experiments is not None
    after.experiments.adopt(before.experiments)
    assert sum(a.outcomes.requests for a in after.experiments.running["ab"].arms) == 1
    after.experiments.outcome("kept", failed=True)
    assert after.experiments.unattributed == 0


def test_weights_are_steps_of_a_tenth_of_a_percent_summing_to_one() -> None:
    ExperimentSpec("fine", (ArmSpec("a", "default", 0.999), ArmSpec("b", "default", 0.001)))
    with pytest.raises(ValueError, match=r"step of 0\.001"):
        ExperimentSpec("x", (ArmSpec("a", "default", 0.9995), ArmSpec("b", "default", 0.0005)))
    with pytest.raises(ValueError, match=r"sum to 0\.9,"):
        ExperimentSpec("x", (ArmSpec("a", "default", 0.5), ArmSpec("b", "default", 0.4)))


def test_the_config_section_is_validated_with_the_fields_place() -> None:
    arms = [{"name": "a", "profile": "round-robin", "weight": 0.5}, {"name": "b", "profile": "default", "weight": 0.5}]
    config = parse_config(
        {"pool": POOL, "experiments": [{"name": "e", "arms": arms, "assign": "hash", "header": "X-User"}]}
    )
    assert config.experiments[0].header == "x-user" and config.experiment_headers == ("x-user",)
    bad = [dict(arms[0]), {"name": "b", "profile": "nope", "weight": 0.5}]
    with pytest.raises(ConfigError, match=r"experiments\[0\]\.arms\[1\]\.profile must be a preset"):
        parse_config({"pool": POOL, "experiments": [{"name": "e", "arms": bad}]})
    with pytest.raises(ConfigError, match=r"experiments\[0\].*needs the header"):
        parse_config({"pool": POOL, "experiments": [{"name": "e", "arms": arms, "assign": "header"}]})
    with pytest.raises(ConfigError, match=r"experiments\[0\]: unknown key .colour."):
        parse_config({"pool": POOL, "experiments": [{"name": "e", "arms": arms, "colour": "red"}]})


DISCOVERED = {"discovery": {"etcd": {"urls": ["http://127.0.0.1:2379"], "prefix": "/inferlb/"}}}
TWO_ARMS = [{"name": "c", "profile": "round-robin", "weight": 0.5}, {"name": "t", "profile": "default", "weight": 0.5}]


@pytest.mark.parametrize("pool", [pytest.param(POOL, id="listed"), pytest.param(DISCOVERED, id="discovered")])
@pytest.mark.parametrize(
    ("entry", "error"),
    [
        pytest.param(
            {"arms": [{**TWO_ARMS[0], "weight": 0.9}, {**TWO_ARMS[1], "weight": 0.3}]},
            r"experiments\[0\]\.arms: experiment 'e': the arms' weights sum to 1\.2, not 1",
            id="weights-sum",
        ),
        pytest.param(
            {"arms": [{**TWO_ARMS[0], "weight": 0.4995}, {**TWO_ARMS[1], "weight": 0.5005}]},
            r"experiments\[0\]\.arms\[0\]\.weight: experiment 'e': weight 0\.4995 is not a step of 0\.001",
            id="weight-step",
        ),
        pytest.param(
            {"assign": "header", "header": "x-c", "values": {"x": "nope"}},
            r"experiments\[0\]\.values: experiment 'e': values name arms it does not have: nope",
            id="values-unknown-arm",
        ),
        pytest.param(
            {"assign": "header", "header": "x-c"},
            r"experiments\[0\]\.values: experiment 'e': assign 'header' needs `values`",
            id="header-without-values",
        ),
        pytest.param(
            {"header": "x-c", "values": {"true": "t"}},
            r"experiments\[0\]\.values: experiment 'e': `values` name arms only with assign 'header'",
            id="values-without-header-assignment",
        ),
        pytest.param(
            {"scope": {"paths": ["/v1/completions", "v1/chat"]}},
            r"experiments\[0\]\.scope\.paths\[1\]: experiment 'e': path 'v1/chat' never matches.*'/v1/chat'\?",
            id="path-without-slash",
        ),
        pytest.param(
            {"ramp": [0.1, 0.05]},
            r"experiments\[0\]\.ramp: experiment 'e': the ramp's weights must increase",
            id="ramp",
        ),
    ],
)
def test_an_experiment_that_cannot_work_is_a_config_error_naming_its_field(
    pool: dict[str, object], entry: dict[str, object], error: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{error}"):
        parse_config({"pool": pool, "experiments": [{"name": "e", "arms": TWO_ARMS, **entry}]})


def test_a_scope_model_no_endpoint_serves_is_a_config_error() -> None:
    scoped = {"name": "e", "arms": TWO_ARMS, "scope": {"models": ["m", "lama"]}}
    with pytest.raises(
        ConfigError, match=r"^experiments\[0\]\.scope\.models\[1\] 'lama': no endpoint .* \(served: m\)"
    ):
        parse_config({"pool": POOL, "experiments": [scoped]})
    assert parse_config({"pool": POOL, "experiments": [{**scoped, "scope": {"models": ["m"]}}]}).experiments


def test_histogram_quantiles_interpolate_inside_a_bucket() -> None:
    h = Histogram((1.0, 2.0, 4.0))
    for v in (0.5, 1.5, 1.5, 3.0):
        h.observe(v)
    assert histogram_quantile(h, 0.5) == pytest.approx(1.5)
    assert histogram_quantile(Histogram((1.0,)), 0.5) is None


MIXED_POOL = {
    "endpoints": [
        {"address": "10.0.0.1:8000", "models": ["m"]},
        {"address": "10.0.0.2:8000", "models": ["m"]},
        {"address": "10.0.0.3:8000", "models": ["m-next"]},
    ]
}


def _release(**kw: object) -> ExperimentSpec:
    arms = (ArmSpec("control", "default", 0.7), ArmSpec("next", "default", 0.3, model="m-next"))
    return ExperimentSpec("next", arms, models=frozenset({"m"}), **kw)  # type: ignore[arg-type]


def test_a_release_arm_with_a_model_routes_its_requests_as_that_model() -> None:
    config = parse_config({"policy": "default", "pool": MIXED_POOL})
    engine = Engine(Pool(config.endpoints), build_profile("default", np.random.default_rng(3), size=3))
    # Seeded: the same draws on every run (unseeded, the share of 600 fell below 0.25 in one run of the suite).
    experiments = Experiments.over(engine, [_release()], config.profile_spec, np.random.default_rng(11))
    router = Router(engine, experiments=experiments)
    seen = []
    for i in range(600):
        routed = router.route(router.admit(RequestFeatures(model="m", request_id=str(i))).request)
        routed.lease.release()
        seen.append((None if routed.arm is None else routed.arm.name, routed.decision.endpoint.address))
    assert {address for arm, address in seen if arm == "next"} == {"10.0.0.3:8000"}
    assert {address for arm, address in seen if arm == "control"} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert 0.25 < sum(arm == "next" for arm, _ in seen) / len(seen) < 0.35
    # A request the experiment does not cover keeps its model: m-next's own clients reach its server.
    routed = router.route(router.admit(RequestFeatures(model="m-next")).request)
    assert routed.arm is None and routed.decision.endpoint.address == "10.0.0.3:8000"


def test_a_model_arm_needs_a_model_scope_and_the_control_sends_requests_as_they_came() -> None:
    arms = (ArmSpec("control", "default", 0.5), ArmSpec("next", "default", 0.5, model="m-next"))
    with pytest.raises(ValueError, match="scoped to models"):
        ExperimentSpec("next", arms)
    with pytest.raises(ValueError, match="control arm"):
        ExperimentSpec("next", arms[::-1], models=frozenset({"m"}))


def _release_file(model: str, scope: dict[str, object] | None = None) -> dict[str, object]:
    arms = [{"name": "control", "profile": "default", "weight": 0.9}]
    arms.append({"name": "next", "profile": "default", "weight": 0.1, "model": model})
    return {"name": "next", "arms": arms, "scope": {"models": ["m"]} if scope is None else scope}


def test_the_config_refuses_a_release_model_that_no_endpoint_serves() -> None:
    config = parse_config({"pool": MIXED_POOL, "experiments": [_release_file("m-next")]})
    assert config.experiments[0].arms[1].model == "m-next"
    with pytest.raises(ConfigError, match=r"experiments\[0\]\.arms\[1\]\.model 'm-nope': no endpoint"):
        parse_config({"pool": MIXED_POOL, "experiments": [_release_file("m-nope")]})
    with pytest.raises(ConfigError, match=r"experiments\[0\].*scoped to models"):
        parse_config({"pool": MIXED_POOL, "experiments": [_release_file("m-next", scope={})]})


def test_server_spans_with_output_tokens_give_each_arm_its_time_per_output_token() -> None:
    router = _router(_ab())
    experiments = router.experiments
    assert experiments is not None
    for i in range(400):
        routed = router.route(router.admit(RequestFeatures(model="m", request_id=f"r{i}")).request)
        routed.lease.release()
        assert routed.arm is not None
        tpot = 0.010 if routed.arm.name == "control" else 0.020  # 101 tokens after the first: 1 s or 2 s of decode
        experiments.observed(f"r{i}", 0.2, 0.2 + 100 * tpot, False, output_tokens=101)
    experiments.observed("r-unknown", 0.2, 1.2, False, output_tokens=101)  # no such request: nothing counted
    shown = {arm["name"]: arm for arm in experiments.describe()[0]["arms"]}
    assert shown["control"]["tpot_s"]["p50"] == pytest.approx(0.010, rel=0.12)
    assert shown["treatment"]["tpot_s"]["p50"] == pytest.approx(0.020, rel=0.12)
    running = experiments.running["ab"]
    assert sum(a.outcomes.tpot.histogram.count for a in running.arms) == 400
    assert running.comparisons()["treatment"]["tpot"].difference > 0  # the treatment decodes slower


def test_a_span_without_output_tokens_or_with_one_gives_no_time_per_output_token() -> None:
    router = _router(_ab())
    experiments = router.experiments
    assert experiments is not None
    for i, tokens in enumerate((None, 0, 1)):
        router.route(router.admit(RequestFeatures(model="m", request_id=f"r{i}")).request).lease.release()
        experiments.observed(f"r{i}", 0.2, 1.2, False, output_tokens=tokens)
    running = experiments.running["ab"]
    assert sum(a.outcomes.tpot.histogram.count for a in running.arms) == 0
    assert sum(a.outcomes.ttft.histogram.count for a in running.arms) == 3


# A prompt of 64 blocks (4,096 tokens) that every request below repeats.
PROMPT = {"model": "m", "prompt_tokens": 4096, "prefix_hashes": tuple(range(1, 65))}


def _routed_to(router: Router, arm: str) -> tuple[RequestFeatures, Routed]:
    """Route repeats of PROMPT until one goes to ``arm``: that request (as admitted) and its routing, still held."""
    for i in range(50):
        admitted = router.admit(RequestFeatures(**PROMPT, request_id=f"{arm}-{i}")).request  # type: ignore[arg-type]
        routed = router.route(admitted)
        if routed.arm is not None and routed.arm.name == arm:
            return admitted, routed
        routed.lease.release()
    pytest.fail(f"no request went to the {arm} arm")


def test_a_request_one_arm_routed_is_counted_by_every_other_arms_engine() -> None:
    # The arms' requests share the servers: a prompt the round-robin control sent somewhere is cached there and
    # queued for prefill there, and the default arm's predictions must see both (else the server that holds a
    # prompt the control sent looks cold to the default and idle while it prefills the control's requests).
    router = _router(_ab())
    prompt = PROMPT
    admitted, routed = _routed_to(router, "control")
    assert routed.arm is not None
    index = routed.decision.endpoint.index
    assert routed.decision.prefill is None  # round robin estimates nothing itself
    default = router.engine
    assert routed.arm.engine is not default
    rates = np.full(4, 1e-9)  # drains nothing: the backlog as the lease left it
    # The control's prompt is in that endpoint's prefill backlog, estimated by the default's predictor (its 4,096
    # tokens' work, with their attention over the context before each).
    work = 4096 * (1 + 2048 / ATTENTION_TOKENS)
    assert default.inflight.pending_prefill(np.arange(4), rates)[index] == pytest.approx(work)
    # And the default's prefix index knows the endpoint now holds the prompt: a repeat costs it one token there
    # (after the 4,095 cached).
    uncached, _ = default.prefill_at(RequestFeatures(**prompt, request_id="again"), index)  # type: ignore[arg-type, misc]
    assert uncached == pytest.approx(1 + 4095.5 / ATTENTION_TOKENS)
    elsewhere = (index + 1) % 4
    assert default.prefill_at(RequestFeatures(**prompt, request_id="again"), elsewhere)[0] == pytest.approx(work)  # type: ignore[arg-type, index]
    # A retry served it on another endpoint: the default's index learns that too.
    assert router.served(routed.lease, router.pool.endpoints[elsewhere].address, admitted) == "elsewhere"
    assert default.prefill_at(RequestFeatures(**prompt, request_id="third"), elsewhere)[0] == pytest.approx(uncached)  # type: ignore[arg-type, index]
    routed.lease.release()


def test_a_profile_without_a_predictor_estimates_no_prefill_for_anothers_request() -> None:
    engine = Engine(Pool(parse_config({"pool": POOL}).endpoints), build_profile("round-robin", None, size=4))
    assert engine.prefill_at(RequestFeatures(model="m", prompt_tokens=100, request_id="r"), 0) is None


def test_a_retry_served_elsewhere_is_learned_by_every_arms_prefix_index() -> None:
    arms = (ArmSpec("control", "default", 0.5), ArmSpec("treatment", "prefix-aware", 0.5))
    router = _router(ExperimentSpec("ab", arms))
    prompt = PROMPT
    admitted, routed = _routed_to(router, "treatment")
    assert routed.arm is not None
    treatment = routed.arm.engine
    affinity = next(s.scorer for s in treatment.profile.scorers if s.scorer.name == "prefix-affinity")
    elsewhere = (routed.decision.endpoint.index + 1) % 4
    assert router.served(routed.lease, router.pool.endpoints[elsewhere].address, admitted) == "elsewhere"
    # The treatment's own index (not only the pool's engine's) now finds the prompt where the retry served it.
    scores = affinity.score(RequestFeatures(**prompt, request_id="again"), treatment.state, np.arange(4))  # type: ignore[arg-type]
    assert scores[elsewhere] == pytest.approx(1.0)
    routed.lease.release()


@pytest.mark.parametrize("read_at", [650.0, 1000.0, 10_000.0])
def test_a_window_idle_for_longer_than_itself_holds_nothing_old(read_at: float) -> None:
    # Once, a window idle for a whole window length dropped one slice only: 90 of 100 old values stayed in the
    # window's quantiles and comparisons for nine more slices.
    window = _Window(300.0, now=0.0)
    for i in range(100):
        window.add(0.5, now=i * 3.0)  # 100 values over the first 300 s
    assert window.moments(299.0).count == 100
    assert window.moments(read_at).count == 0 and window.histogram(read_at).count == 0
    window.add(0.25, now=read_at + 1)
    assert window.moments(read_at + 2).count == 1


def test_a_window_keeps_what_is_younger_than_itself() -> None:
    window = _Window(300.0, now=0.0)
    for t in (0.0, 100.0, 200.0, 290.0):
        window.add(0.5, now=t)
    assert window.moments(350.0).count == 3  # the value at 0 s left with its slice (30 s slices)
    assert window.moments(450.0).count == 2

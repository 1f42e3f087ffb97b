"""Experiments between routing policies, measured: false verdicts, power, and grey releases that ramp down.

    inferlb bench experiments --out bench/results [--quick] [--traces DIR] [--aa-runs 200] [--skip-live]

Every part runs the experiment code of the ext_proc service (`scorer.experiments`, through `scorer.router.Router`):
the simulator's on its virtual clock (`bench.policies.PresetPolicy`), the live part through real Envoy.

1. **A/A** (simulator): ``--aa-runs`` experiments of ``default`` against ``default`` on the Mooncake conversation
   trace, each on its own seed, watched after every ``LOOK_EVERY`` outcomes as an operator's page would be. A run
   gives a false verdict if any look, on any metric (TTFT, E2E, error rate), says ``better`` or ``worse``.
2. **Power** (simulator, per trace): the same A/A experiment with the treatment's reported TTFTs made 10% longer
   (so its TTFT p99, and every other quantile, is 10% higher): the requests in the experiment when TTFT first gets
   the right verdict (``worse``), over ``POWER_RUNS`` seeds. The sequential test compares mean log-TTFT, where a
   10% longer TTFT is a shift of log(1.1).
3. **Grey release** (simulator, the Azure conversation trace): five servers, one of them the canary pool (label
   ``version: canary``); the canary arm ramps 2% -> 5% -> 10% -> 20% (its server's fair share) behind the
   default guard rail (error rate > 2% -> weight x 0.3, the third breach
   rolls it back). Once with the canary server failing 10% of its requests (the simulator's ``error_rate``
   fault), once healthy: when the weight was cut and rolled back, how many client requests failed on the canary,
   and when the healthy canary reached each step.
4. **A/B through Envoy** (live, unless ``--skip-live``): four emulated servers behind Envoy and the picker, a
   shared-prefix workload, ``round-robin`` (control) against ``default``, then ``default`` against ``default``:
   the requests until the TTFT verdict, and whether the A/A run stayed silent.
5. **Grey release through Envoy** (live): five emulated servers, the fifth the canary pool failing 10% of its
   requests by the emulator's fault injection, then healthy; the JSON's ``canary_*`` keys come from this run.

Writes ``experiments.json`` (``aa_runs``, ``aa_false_verdicts``, ``ab_requests_to_verdict``, ``canary_cut_after_s``,
``canary_failed_requests`` and the detail) and ``experiments.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from inferlb.bench.desrun import capacity_rps, load_arrivals, scaled
from inferlb.bench.policies import PresetPolicy
from inferlb.bench.report import header, table, write
from inferlb.bench.sim import traces_dir
from inferlb.bench.stats import median
from inferlb.scorer.experiments import ArmSpec, Experiments, ExperimentSpec, GuardSpec, WeightChange
from inferlb.scorer.sequential import mixture_ratio
from inferlb.sim.des import Arrival, FaultEvent, RequestRecord, simulate
from inferlb.sim.profiles import get_profile
from inferlb.sim.replay import Shot, replay
from inferlb.stack import LocalStack, StackOptions

__all__ = [
    "Fleet",
    "aa_study",
    "ab_through_envoy",
    "add_arguments",
    "live_canary",
    "power_study",
    "release",
    "run",
    "watched_run",
]

PROFILE = "h100-llama3.1-8b"
SERVERS = 4
LOAD = 0.7  # of the fleet's capacity
LOOK_EVERY = 20  # outcomes between two looks at the comparisons
POWER_RUNS = 10
EFFECT = 1.10  # the treatment's TTFTs x this in the power study
MIN_SAMPLES = ExperimentSpec("x", (ArmSpec("a", "default", 0.5), ArmSpec("b", "default", 0.5))).min_samples
AA_TRACE = "mooncake_conversation_trace.jsonl"
TRACES = (
    "mooncake_conversation_trace.jsonl",
    "mooncake_synthetic_trace.jsonl",
    "AzureLLMInferenceTrace_conv.csv",
    "AzureLLMInferenceTrace_code.csv",
)
CANARY_TRACE = "AzureLLMInferenceTrace_conv.csv"
# One canary server of five: 20% is its fair share, where the ramp ends.
CANARY_RAMP = (0.02, 0.05, 0.1, 0.2)
CANARY_STEP_S = 30.0
CANARY_MIN_REQUESTS = 20
CANARY_CHECK_S = 2.0
CANARY_FAULT_RATE = 0.10
LIVE_SERVERS = 4
LIVE_MODEL = "m"
# 16 shared prompts of ~4,000 tokens, on servers whose KV cache holds 24,000 tokens (--kv-blocks): a server holds
# a few of them, so where a prompt goes decides whether it is prefilled again.
LIVE_PREFIXES = 16
LIVE_PREFIX_REPEATS = 2300
LIVE_KV_BLOCKS = 1500
LIVE_RATE_RPS = 20.0
LIVE_BATCH = 100


def _aa_spec(name: str = "aa") -> ExperimentSpec:
    return ExperimentSpec(name, (ArmSpec("control", "default", 0.5), ArmSpec("treatment", "default", 0.5)))


class _Watched(PresetPolicy):
    """A preset policy whose experiment is looked at every `LOOK_EVERY` outcomes; the treatment's TTFTs can be made
    ``effect`` x longer before the experiment hears of them (an injected difference of known size)."""

    def __init__(self, *args: Any, effect: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.effect = effect
        self.outcomes = 0
        self.first: dict[str, tuple[int, str]] = {}  # metric -> (requests in the experiment, verdict) at its first

    def report(self, experiments: Experiments, record: RequestRecord) -> None:
        if self.effect != 1.0 and record.ttft_s is not None:
            arm = experiments.arm_of(record.id)
            if arm is not None and arm.name == "treatment":
                record = _scaled(record, self.effect)
        super().report(experiments, record)
        self.outcomes += 1
        if self.outcomes % LOOK_EVERY:
            return
        for experiment in experiments.running.values():
            requests = sum(arm.outcomes.requests for arm in experiment.arms)
            for metric, comparison in experiment.comparisons()["treatment"].items():
                if comparison.verdict != "no difference yet" and metric not in self.first:
                    self.first[metric] = (requests, comparison.verdict)


def _scaled(record: RequestRecord, factor: float) -> RequestRecord:
    return replace(record, ttft_s=None if record.ttft_s is None else record.ttft_s * factor)


@dataclass(frozen=True, slots=True)
class Fleet:
    arrivals: list[Arrival]
    rate_rps: float


def _fleet(trace: Path, requests: int, servers: int = SERVERS, load: float = LOAD) -> Fleet:
    profile = get_profile(PROFILE)
    arrivals = load_arrivals(str(trace), requests, profile.block_size)
    rate = load * servers * capacity_rps(arrivals, profile, seed=0)
    return Fleet(scaled(arrivals, rate), rate)


def watched_run(fleet: Fleet, seed: int, effect: float = 1.0) -> _Watched:
    profiles = [get_profile(PROFILE)] * SERVERS
    policy = _Watched("default", profiles, seed=seed, experiments=(_aa_spec(),), effect=effect)
    simulate(fleet.arrivals, policy, profiles, seed=seed, on_finish=policy.finished)
    return policy


Watched = tuple[dict[str, tuple[int, str]], float]


def _first_verdicts(fleet: Fleet, seed: int, effect: float) -> Watched:
    """A watched run's first verdicts, and the variance of its control arm's log-TTFT."""
    policy = watched_run(fleet, seed, effect)
    assert policy.experiments is not None
    control = policy.experiments.running["aa"].arms[0].outcomes
    return policy.first, control.ttft.moments.variance


def requests_needed(variance: float, effect: float = EFFECT, alpha: float = 0.05, tau: float = 0.1) -> int:
    """The requests (both arms, split evenly) at which the sequential test's statistic, at its expected value for
    a shift of ``log(effect)`` in mean log-TTFT with this per-request ``variance``, first reaches its threshold
    1/alpha: a projection of the requests needed where a run's budget was too small to see it."""
    shift = math.log(effect)
    per_arm = 2
    while mixture_ratio(shift, 2 * variance / per_arm, tau) < 1 / alpha:
        per_arm = math.ceil(per_arm * 1.01) + 1
    return 2 * max(per_arm, MIN_SAMPLES)


def _many(fleet: Fleet, seeds: Sequence[int], effect: float, workers: int) -> list[Watched]:
    """The first verdicts of one watched run per seed, ``workers`` processes at a time."""
    if workers <= 1:
        return [_first_verdicts(fleet, seed, effect) for seed in seeds]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_first_verdicts, [fleet] * len(seeds), seeds, [effect] * len(seeds)))


def aa_study(traces: Path, runs: int, requests: int, workers: int = 1) -> dict[str, Any]:
    """`runs` A/A experiments on seeds 0..runs-1 (see the module's docstring)."""
    fleet = _fleet(traces / AA_TRACE, requests)
    false_by_metric = {"ttft": 0, "e2e": 0, "errors": 0}
    false_runs = 0
    for first, _ in _many(fleet, range(runs), 1.0, workers):
        false_runs += bool(first)
        for metric in first:
            false_by_metric[metric] += 1
    return {
        "trace": AA_TRACE,
        "runs": runs,
        "requests_per_run": requests,
        "rate_rps": round(fleet.rate_rps, 3),
        "looks_every_outcomes": LOOK_EVERY,
        "false_verdict_runs": false_runs,
        "false_verdict_rate": round(false_runs / runs, 4) if runs else None,
        "false_verdicts_by_metric": false_by_metric,
    }


def power_study(traces: Path, runs: int, requests: int, workers: int = 1) -> list[dict[str, Any]]:
    """Per trace, the requests until a 10% longer TTFT in the treatment is called ``worse``."""
    rows = []
    for name in TRACES:
        path = traces / name
        if not path.exists():
            continue
        fleet = _fleet(path, requests)
        found: list[int] = []
        wrong = 0
        watched = _many(fleet, range(1000, 1000 + runs), EFFECT, workers)
        variance = median([v for _, v in watched]) or 0.0
        for verdicts, _ in watched:
            first = verdicts.get("ttft")
            if first is None:
                continue
            if first[1] == "worse":
                found.append(first[0])
            else:
                wrong += 1
        rows.append(
            {
                "trace": name,
                "runs": runs,
                "requests_per_run": requests,
                "detected": len(found),
                "wrong_sign": wrong,
                "power_within_budget": round(len(found) / runs, 3),
                "requests_to_verdict_median": median(found) if found else None,
                "requests_to_verdict_max": max(found) if found else None,
                "log_ttft_variance": round(variance, 4),
                "requests_needed_projected": requests_needed(variance) if variance > 0 else None,
            }
        )
    return rows


def _canary_spec(ramp: tuple[float, ...] = CANARY_RAMP, step_s: float = CANARY_STEP_S) -> ExperimentSpec:
    return ExperimentSpec(
        "canary",
        (ArmSpec("stable", "default", 1.0), ArmSpec("canary", "default", 0.0, {"version": "canary"})),
        guard=GuardSpec(min_requests=CANARY_MIN_REQUESTS, check_s=CANARY_CHECK_S),
        ramp=ramp,
        ramp_step_s=step_s,
    )


def canary_run(traces: Path, requests: int, faulty: bool) -> dict[str, Any]:
    """One grey release on five servers, the last the canary pool (see the module's docstring)."""
    return release(_fleet(traces / CANARY_TRACE, requests, servers=SERVERS + 1), _canary_spec(), faulty)


def release(fleet: Fleet, spec: ExperimentSpec, faulty: bool) -> dict[str, Any]:
    """``spec`` (a release arm ``canary`` on the ``version: canary`` server) over ``fleet`` on `SERVERS` + 1
    servers, the last the canary; ``faulty``: that server fails `CANARY_FAULT_RATE` of its requests."""
    profile = get_profile(PROFILE)
    servers = SERVERS + 1
    profiles = [profile] * servers
    labels = [{"version": "stable"}] * SERVERS + [{"version": "canary"}]
    policy = PresetPolicy("default", profiles, seed=7, experiments=(spec,), labels=labels)
    changes: list[tuple[float, WeightChange]] = []
    assert policy.experiments is not None
    policy.experiments.listeners.append(lambda change: changes.append((policy.signals.clock(), change)))
    faults = (FaultEvent(0.0, SERVERS, "error_rate", CANARY_FAULT_RATE),) if faulty else ()
    result = simulate(fleet.arrivals, policy, profiles, seed=7, on_finish=policy.finished, faults=faults)
    on_canary = [r for r in result.records if r.server == SERVERS]
    failed = [r for r in on_canary if r.error is not None]
    experiment = policy.experiments.running["canary"]
    first_cut = next((at for at, c in changes if c.kind in ("cut", "rolled-back")), None)
    rolled = next((at for at, c in changes if c.kind == "rolled-back"), None)
    steps = [
        {"at_s": round(at, 1), "weight": c.weights["canary"], "kind": c.kind, "reason": c.reason} for at, c in changes
    ]
    return {
        "faulty": faulty,
        "rate_rps": round(fleet.rate_rps, 3),
        "duration_s": round(fleet.arrivals[-1].at, 1),
        "requests": len(result.records),
        "canary_requests": len(on_canary),
        "canary_failed_requests": len(failed),
        "failed_elsewhere": sum(r.error is not None and r.server != SERVERS for r in result.records),
        "first_cut_after_s": None if first_cut is None else round(first_cut, 1),
        "rolled_back_after_s": None if rolled is None else round(rolled, 1),
        "final_weight": experiment.weights()["canary"],
        "state": experiment.state,
        "changes": steps,
    }


def _live_experiment(
    name: str, control: str, treatment: str, min_samples: int, alpha: float, latency_tau: float
) -> dict[str, Any]:
    return {
        "alpha": alpha,
        "latency_tau": latency_tau,
        "name": name,
        "arms": [
            {"name": "control", "profile": control, "weight": 0.5},
            {"name": "treatment", "profile": treatment, "weight": 0.5},
        ],
        "min_samples": min_samples,
    }


def _shared_prefix_shots(url: str, count: int, rate_rps: float, seed: int, start: float = 0.0) -> list[Shot]:
    """``count`` streamed requests at ``rate_rps`` (Poisson), each one of `LIVE_PREFIXES` long shared prompts
    followed by a question of its own: where a prefix was prefilled before, it is cheap."""
    rng = random.Random(seed)
    shots = []
    t = start
    for k in range(count):
        t += rng.expovariate(rate_rps)
        prefix = rng.randrange(LIVE_PREFIXES)
        head = f"system prompt {prefix}: " + f"rule {prefix} " * LIVE_PREFIX_REPEATS
        prompt = head + f"\nquestion {seed}-{k}: " + "q" * rng.randrange(20, 200)
        shots.append(Shot(f"s{seed}-{k}", t, url, LIVE_MODEL, prompt, 8))
    return shots


async def _watch_live(stack: LocalStack, budget: int, rate_rps: float, seed: int) -> dict[str, Any]:
    """Send batches of the shared-prefix workload until the TTFT comparison has a verdict or ``budget`` requests
    went out; after each batch read ``GET /experiments``."""
    sent = 0
    looks: list[dict[str, Any]] = []
    verdict: dict[str, Any] | None = None
    failed = 0
    async with httpx.AsyncClient(timeout=10) as client:
        while sent < budget and verdict is None:
            batch = _shared_prefix_shots(stack.gateway_url, min(LIVE_BATCH, budget - sent), rate_rps, seed + sent)
            records = await replay(batch, timeout_s=120)
            failed += sum(r.error is not None for r in records)
            sent += len(batch)
            response = await client.get(f"{stack.picker_admin_url}/experiments", headers=stack.admin_headers)
            response.raise_for_status()
            (experiment,) = response.json()["experiments"]
            ttft = experiment["comparisons"]["life"]["treatment"]["ttft"]
            counts = {arm["name"]: arm["requests"] for arm in experiment["arms"]}
            look = {"sent": sent, "requests": sum(counts.values()), "ttft": ttft, "arms": experiment["arms"]}
            looks.append(look)
            if ttft["verdict"] != "no difference yet":
                verdict = look
    last = looks[-1]
    return {
        "sent": sent,
        "client_errors": failed,
        "verdict": None if verdict is None else verdict["ttft"]["verdict"],
        "requests_to_verdict": None if verdict is None else verdict["requests"],
        "ttft_log_difference": last["ttft"]["difference"],
        "ttft_interval": [last["ttft"]["low"], last["ttft"]["high"]],
        "arms": {
            arm["name"]: {"profile": arm["profile"], "requests": arm["requests"], "ttft_s": arm["ttft_s"]}
            for arm in last["arms"]
        },
        "looks": len(looks),
    }


def ab_through_envoy(*, quick: bool = False, alpha: float = 0.05) -> dict[str, Any]:
    """`round-robin` against `default`, then `default` against `default`, through real Envoy and emulated
    servers on the shared-prefix workload (see the module's docstring). ``quick``: a smaller budget and minimum
    sample, and a test tuned to large differences (``latency_tau`` 0.5: the test's)."""
    budget = 1200 if quick else 1600
    min_samples = 50 if quick else 200
    tau = 0.5 if quick else 0.1
    out: dict[str, Any] = {
        "budget": budget,
        "min_samples": min_samples,
        "alpha": alpha,
        "latency_tau": tau,
        "rate_rps": LIVE_RATE_RPS,
    }
    for key, control, treatment in (("ab", "round-robin", "default"), ("aa", "default", "default")):
        options = StackOptions(
            backends=LIVE_SERVERS,
            models=(LIVE_MODEL,),
            policy="default",
            latency_source="stream",
            sim_args=("--kv-blocks", str(LIVE_KV_BLOCKS)),
            picker_config={"experiments": [_live_experiment(key, control, treatment, min_samples, alpha, tau)]},
        )
        with tempfile.TemporaryDirectory(prefix=f"inferlb-exp-{key}-") as tmp, LocalStack(options, Path(tmp)) as stack:
            out[key] = {
                "control": control,
                "treatment": treatment,
                **asyncio.run(_watch_live(stack, budget if key == "ab" else budget // 2, LIVE_RATE_RPS, seed=11)),
            }
    ab, aa = out["ab"], out["aa"]
    out["markdown"] = [
        f"{LIVE_SERVERS} emulated servers behind Envoy and the picker (the picker times the streamed responses),",
        f"requests at {LIVE_RATE_RPS} req/s, each one of {LIVE_PREFIXES} shared prompts of ~4,000 tokens and a",
        f"question of its own, on servers whose KV cache holds {LIVE_KV_BLOCKS * 16:,} tokens (a few of the prompts);",
        f"assignment 50/50 at random, at least {min_samples} requests per arm before a verdict, looked at every",
        f"{LIVE_BATCH} requests.",
        "",
        f"- `round-robin` (control) against `default`: TTFT verdict for `default` **{ab['verdict']}** after",
        f"  **{ab['requests_to_verdict']} requests** (log-TTFT difference {ab['ttft_log_difference']:.3f});",
        f"  client errors {ab['client_errors']}.",
        f"- `default` against `default`: {aa['sent']} requests, verdict **{aa['verdict'] or 'none'}**"
        f" (log-TTFT difference {aa['ttft_log_difference']:.3f}); client errors {aa['client_errors']}.",
    ]
    return out


LIVE_CANARY_RAMP = (0.05, 0.1, 0.2)
LIVE_CANARY_STEP_S = 10.0


async def _canary_traffic(stack: LocalStack, seconds: float, rate_rps: float) -> dict[str, Any]:
    """Streamed requests with prompts of their own at ``rate_rps`` for ``seconds``, then the experiment's state."""
    rng = random.Random(5)
    shots: list[Shot] = []
    t = 0.0
    while t < seconds:
        t += rng.expovariate(rate_rps)
        prompt = f"request {len(shots)}: " + "p" * rng.randrange(200, 2000)
        shots.append(Shot(f"c{len(shots)}", t, stack.gateway_url, LIVE_MODEL, prompt, 16))
    started = time.time()  # the weight changes are dated by the wall clock
    records = await replay(shots, timeout_s=120)
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(f"{stack.picker_admin_url}/experiments", headers=stack.admin_headers)
        response.raise_for_status()
    (experiment,) = response.json()["experiments"]
    return {"records": records, "experiment": experiment, "started": started}


def live_canary(*, faulty: bool, seconds: float = 60.0, latency_source: str = "stream") -> dict[str, Any]:
    """A grey release through Envoy: five emulated servers, the fifth the canary pool (``version: canary``), which
    fails `CANARY_FAULT_RATE` of its requests when ``faulty`` (the emulator's own fault injection); the canary arm
    ramps `LIVE_CANARY_RAMP`, `LIVE_CANARY_STEP_S` a step, behind the default guard rail. ``latency_source``: the
    picker's outcomes from its timing of the responses (``stream``), or from the servers' spans and, for failures,
    Envoy's access log (``spans``)."""
    experiment = {
        "name": "canary",
        "arms": [
            {"name": "stable", "profile": "default"},
            {"name": "canary", "profile": "default", "endpoints": {"version": "canary"}},
        ],
        "ramp": list(LIVE_CANARY_RAMP),
        "ramp_step_s": LIVE_CANARY_STEP_S,
        "guard": {"min_requests": CANARY_MIN_REQUESTS, "check_s": CANARY_CHECK_S},
    }
    options = StackOptions(
        backends=SERVERS + 1,
        models=(LIVE_MODEL,),
        policy="default",
        latency_source=latency_source,
        spans=latency_source == "spans",
        sim_args=("--fault", f"{SERVERS}:error_rate={CANARY_FAULT_RATE}") if faulty else (),
        endpoint_labels=(*({"version": "stable"},) * SERVERS, {"version": "canary"}),
        picker_config={"experiments": [experiment]},
    )
    with tempfile.TemporaryDirectory(prefix="inferlb-canary-") as tmp, LocalStack(options, Path(tmp)) as stack:
        canary = stack.endpoints[SERVERS]
        seen = asyncio.run(_canary_traffic(stack, seconds, LIVE_RATE_RPS))
    records, shown = seen["records"], seen["experiment"]
    started = seen["started"]
    changes = [
        {
            "at_s": round(c["time"] - started, 1),
            "weight": c["weights"]["canary"],
            "kind": c["kind"],
            "reason": c["reason"],
        }
        for c in shown["history"][1:]
    ]
    cut = next((c["at_s"] for c in changes if c["kind"] in ("cut", "rolled-back")), None)
    rolled = next((c["at_s"] for c in changes if c["kind"] == "rolled-back"), None)
    failed = [r for r in records if r.error is not None or r.status >= 500]
    return {
        "faulty": faulty,
        "seconds": seconds,
        "rate_rps": LIVE_RATE_RPS,
        "requests": len(records),
        "canary_requests": sum(r.server == canary for r in records),
        "canary_failed_requests": sum(r.server == canary for r in failed),
        "failed_elsewhere": sum(r.server != canary for r in failed),
        "first_cut_after_s": cut,
        "rolled_back_after_s": rolled,
        "final_weight": shown["weights"]["canary"],
        "state": shown["state"],
        "changes": changes,
        # Time per output token per arm: known where the servers' spans report their output tokens (spans only).
        "tpot_p50_s": {arm["name"]: arm["tpot_s"]["p50"] for arm in shown["arms"]},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="directory for the results")
    parser.add_argument("--traces", type=Path, default=None, help="the traces directory (default: ../shared/traces)")
    parser.add_argument("--aa-runs", type=int, default=200, help="A/A experiments in the simulator (default 200)")
    parser.add_argument("--quick", action="store_true", help="fewer runs and requests (a smoke run)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="simulator processes (default: CPUs)")
    parser.add_argument("--skip-live", action="store_true", help="leave out the A/B test through Envoy")


def run(args: argparse.Namespace) -> int:
    traces = traces_dir(args.traces)
    if not (traces / AA_TRACE).exists():
        print(f"inferlb bench experiments: error: no {AA_TRACE} in {traces}; give --traces DIR", file=sys.stderr)
        return 2
    quick = args.quick
    aa_runs = 10 if quick else args.aa_runs
    report: dict[str, Any] = header(getattr(args, "command", "inferlb bench experiments"))
    print(f"A/A: {aa_runs} runs ...", flush=True)
    aa = aa_study(traces, aa_runs, 600 if quick else 1500, args.workers)
    print(f"power: {2 if quick else POWER_RUNS} runs per trace ...", flush=True)
    power = power_study(traces, 2 if quick else POWER_RUNS, 1500 if quick else 4000, args.workers)
    print("grey release ...", flush=True)
    canary = {
        "faulty": canary_run(traces, 4000 if quick else 12000, faulty=True),
        "healthy": canary_run(traces, 4000 if quick else 12000, faulty=False),
    }
    live: dict[str, Any] | None = None
    if not args.skip_live:
        print("A/B and A/A through Envoy ...", flush=True)
        live = ab_through_envoy(quick=quick)
        print("grey release through Envoy ...", flush=True)
        live["canary"] = {
            "faulty": live_canary(faulty=True, seconds=30.0 if quick else 90.0),
            "healthy": live_canary(faulty=False, seconds=30.0 if quick else 90.0),
        }
    report.update(
        {
            "aa_runs": aa["runs"],
            "aa_false_verdicts": aa["false_verdict_runs"],
            "ab_requests_to_verdict": None if live is None else live["ab"]["requests_to_verdict"],
            # Through Envoy, with the emulator's fault injection, where the live part ran; else the simulator's.
            "canary_cut_after_s": (live or {}).get("canary", canary)["faulty"]["first_cut_after_s"],
            "canary_failed_requests": (live or {}).get("canary", canary)["faulty"]["canary_failed_requests"],
            "canary_source": "envoy" if live else "simulator",
            "aa": aa,
            "power": power,
            "canary": canary,
            "live": live,
        }
    )
    write(args.out, "experiments", report, _markdown(report))
    return 0


def _markdown(r: dict[str, Any]) -> str:
    aa, canary = r["aa"], r["canary"]
    out = [
        "# Experiments: false verdicts, power and grey releases",
        "",
        f"{r['date']}, `{r['command']}`, {r['machine']}. The simulator runs the routing unit and experiment code of",
        "the ext_proc service on its virtual clock; see bench/experiments.py for the method.",
        "",
        "## A/A in the simulator",
        "",
        f"{aa['runs']} experiments of `default` against `default` ({aa['trace']}, {aa['requests_per_run']} requests",
        f"each at {aa['rate_rps']} req/s on {SERVERS} servers), each looked at every {aa['looks_every_outcomes']}",
        f"outcomes on TTFT, E2E and error rate: **{aa['false_verdict_runs']} gave a false verdict**",
        f"({aa['false_verdict_rate']:.1%}; by metric: "
        + ", ".join(f"{metric} {n}" for metric, n in aa["false_verdicts_by_metric"].items())
        + ").",
        "",
        "## Power: a 10% longer TTFT in the treatment",
        "",
    ]
    out += table(
        [
            "trace",
            "runs",
            "budget (requests)",
            "detected",
            "wrong sign",
            "requests to verdict, median",
            "max",
            "log-TTFT variance",
            "requests needed, projected",
        ],
        (
            [
                p["trace"],
                p["runs"],
                p["requests_per_run"],
                p["detected"],
                p["wrong_sign"],
                p["requests_to_verdict_median"],
                p["requests_to_verdict_max"],
                p["log_ttft_variance"],
                p["requests_needed_projected"],
            ]
            for p in r["power"]
        ),
    )
    out += [
        "",
        "The projection: the requests (both arms) at which the test's statistic, at its expected value for this",
        "trace's log-TTFT variance, reaches its threshold (alpha 0.05, tau 0.1); a run's own count varies around it.",
        "The test compares mean log-TTFT: a 10% longer TTFT for every request is a 10% higher p99 as well.",
    ]
    faulty, healthy = canary["faulty"], canary["healthy"]
    out += [
        "",
        "## Grey release in the simulator",
        "",
        f"{CANARY_TRACE}, five servers, the fifth the canary pool. Ramp",
        f"{' -> '.join(f'{w:.0%}' for w in CANARY_RAMP)}, at least {CANARY_STEP_S:g} s a step; guard: error rate",
        f"> 2% or TTFT p99 > {GuardSpec().max_ttft_p99_ratio:g}x the control's -> weight x 0.3, judged once "
        f"{CANARY_MIN_REQUESTS} canary requests",
        f"finished since the last change, every {CANARY_CHECK_S:g} s; the third breach rolls back. Times are simulated",
        "seconds from the start.",
        "",
        f"- Canary failing {CANARY_FAULT_RATE:.0%} of its requests: first cut after",
        f"  **{faulty['first_cut_after_s']} s**,"
        f" {_rolled_back(faulty)}; **{faulty['canary_failed_requests']} client requests",
        f"  failed on the canary** of {faulty['canary_requests']} it got ({faulty['requests']} in all).",
        f"  Changes: {_changes(faulty['changes'])}. The run: {faulty['duration_s']} s at {faulty['rate_rps']} req/s.",
        f"- Healthy canary: final weight {healthy['final_weight']:.0%} ({healthy['state']});",
        f"  changes: {_changes(healthy['changes'])}.",
        *(
            [f"  Its cuts: {'; '.join(c['reason'] for c in healthy['changes'] if c['kind'] == 'cut')}."]
            if any(c["kind"] == "cut" and "reason" in c for c in healthy["changes"])
            else []
        ),
        "",
        "A canary pool of one server has no choice of server where the control's requests are spread over four by",
        "load, so at the same share of traffic its TTFT tail is longer: the p99 bound must be sized to the pools.",
        "",
    ]
    live = r.get("live")
    if live:
        out += ["## A/B through Envoy", "", *live["markdown"], ""]
        faulty, healthy = live["canary"]["faulty"], live["canary"]["healthy"]
        out += [
            "## Grey release through Envoy",
            "",
            f"{SERVERS + 1} emulated servers behind Envoy and the picker, the last the canary pool; {LIVE_RATE_RPS:g}",
            f"req/s of streamed requests for {faulty['seconds']:g} s; ramp",
            f"{' -> '.join(f'{w:.0%}' for w in LIVE_CANARY_RAMP)}, at least {LIVE_CANARY_STEP_S:g} s a step, the same",
            "guard as above. Seconds are wall time from the first request.",
            "",
            f"- Canary failing {CANARY_FAULT_RATE:.0%} of its requests (`inferlb sim --fault`): first cut after",
            f"  **{faulty['first_cut_after_s']} s**, {_rolled_back(faulty)};",
            f"  **{faulty['canary_failed_requests']} client requests failed on the canary** of",
            f"  {faulty['canary_requests']} it got ({faulty['requests']} in all, {faulty['failed_elsewhere']} failed",
            f"  elsewhere). Changes: {_changes(faulty['changes'])}.",
            f"- Healthy canary: final weight {healthy['final_weight']:.0%} ({healthy['state']}), client errors",
            f"  {healthy['canary_failed_requests'] + healthy['failed_elsewhere']};",
            f"  changes: {_changes(healthy['changes'])}.",
            "",
        ]
    return "\n".join(out)


def _rolled_back(run: dict[str, Any]) -> str:
    """When a failing canary was rolled back, or that it was not before the run ended (its weight then)."""
    if run["rolled_back_after_s"] is None:
        return f"not rolled back before the run ended (its weight then {run['final_weight']:.1%}, {run['state']})"
    return f"rolled back after {run['rolled_back_after_s']} s"


def _changes(steps: Sequence[dict[str, Any]]) -> str:
    return ", ".join(f"{s['kind']} to {s['weight']:.1%} at {s['at_s']} s" for s in steps) or "none"


if __name__ == "__main__":
    from inferlb.bench.suites import script

    raise SystemExit(script(sys.modules[__name__]))

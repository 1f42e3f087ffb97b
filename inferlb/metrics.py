"""The picker's own Prometheus metrics (``GET /metrics`` of the admin API), through prometheus_client.

`PickerCollector` is a prometheus_client custom collector: at scrape time it reads the counters the picker keeps
anyway (the decision log, the scrape and scorer error counts, the receiver's, the leases' and the filter's stats,
the latency histograms) and yields them as metric families. Nothing is counted twice and nothing on the request
path changes: the counters stay plain integers and `Histogram` objects, and prometheus_client only formats them.

Each admin app has a `CollectorRegistry` of its own (`picker_registry`), never the process-global one, so that two
pickers in one process (the tests make many) each expose their own.

The counters belong to the picker's event loop, and building and formatting the families is pure Python at
tenths of a millisecond per endpoint (the per-endpoint histograms have two dozen buckets each): too long a pause
for the loop that routes. So `scrape` copies the counters there (`Readings.take`, a few µs per endpoint) and runs
`generate_latest` on a worker thread, where the collector builds the families from that copy.

The families: decisions by endpoint and reason, refusals by status, shed requests by class, pick latency, scrape
errors, staleness and metrics age per endpoint, in-flight requests, scorer errors, the OTLP receiver's span
outcomes and refusals, TTFT and E2E histograms per endpoint, responses timed on the stream, request ends, and
config reloads, and per experiment arm its weight, requests, outcomes, failures, sheds and changes of weight
(deploy/grafana-dashboard.json and tests/test_deploy.py use the names).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from inferlb.filter.server import UNKEYED_REASONS
from inferlb.filter.storedresponses import StoredStats
from inferlb.scorer.histogram import Histogram
from inferlb.scorer.quotas import QuotaStats
from inferlb.scorer.replicas import ReplicaStats
from inferlb.scorer.sharedcontrol import ControlStats

if TYPE_CHECKING:
    from inferlb.filter.observe import ObserveStats
    from inferlb.filter.requestend import LeaseStats
    from inferlb.otel.receiver import ReceiverStats
    from inferlb.picker import PickerProcess
    from inferlb.scorer.engine import Engine

__all__ = [
    "CONTENT_TYPE",
    "PickerCollector",
    "Readings",
    "families",
    "histogram_family",
    "picker_registry",
    "prometheus_text",
    "scrape",
]

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
# Refusals shown as zero before the first: a malformed request, an unknown model, a body too large, a request shed
# under load, no endpoint available.
KNOWN_REFUSALS = (400, 404, 413, 429, 503)
SERVED_OUTCOMES = ("as-picked", "elsewhere", "unknown")
# The experiment guard's changes of weight, shown per arm as zero before the first.
GUARD_CHANGES = ("cut", "rolled-back")
"""What ``/metrics`` answers with: the text format `generate_latest` writes (0.0.4)."""


@lru_cache(maxsize=64)
def _les(bounds: tuple[float, ...]) -> tuple[str, ...]:
    # A pure memo of the `le` label values, as prometheus_client's own Histogram prints them.
    return (*(floatToGoString(b) for b in bounds), "+Inf")


def histogram_family(
    name: str, help_text: str, label_names: Sequence[str], series: Iterable[tuple[Sequence[str], Histogram]]
) -> HistogramMetricFamily:
    """A histogram family with one series per (label values, `Histogram`): cumulative buckets, ``_count``, ``_sum``."""
    family = HistogramMetricFamily(name, help_text, labels=label_names)
    for labels, histogram in series:
        family.add_metric(labels, list(zip(_les(histogram.bounds), histogram.cumulative(), strict=True)), histogram.sum)
    return family


def _counter(
    name: str, help_text: str, label_names: Sequence[str], rows: Iterable[tuple[Sequence[str], float]]
) -> Metric:
    family = CounterMetricFamily(name, help_text, labels=label_names)
    for labels, value in rows:
        family.add_metric(labels, value)
    return family


def _gauge(
    name: str, help_text: str, label_names: Sequence[str], rows: Iterable[tuple[Sequence[str], float]]
) -> Metric:
    family = GaugeMetricFamily(name, help_text, labels=label_names)
    for labels, value in rows:
        family.add_metric(labels, value)
    return family


@dataclasses.dataclass(frozen=True, slots=True)
class Readings:
    """Everything ``/metrics`` shows of one picker, copied (`take`) on its event loop so that another thread may
    build the families from it (`families`) while the loop goes on counting."""

    decisions: dict[tuple[str, str], int]  # (endpoint, reason) -> requests routed
    refused: dict[int, int]  # HTTP status -> requests
    shed: dict[str, int]  # request class -> requests
    served: dict[str, int]  # served-endpoint reports by outcome (SERVED_OUTCOMES)
    pick_s: Histogram
    addresses: list[str]  # the engine's pool
    scrape_errors: list[int] | None  # per endpoint; None without a metrics collector
    stale: list[bool]
    ages_s: list[float]
    inflight: list[int]
    scorer_errors: dict[str, int]
    reloads: int
    receiver: ReceiverStats | None = None
    latency: tuple[list[str], list[Histogram], list[Histogram]] | None = None  # span pool, TTFT and E2E
    timed: ObserveStats | None = None  # with otel.latency_source: stream
    leases: LeaseStats | None = None
    awaiting_end: int = 0
    # Per experiment arm: (experiment, arm) -> (weight, requests, finished, failed, shed); and changes of weight by
    # (experiment, arm or "", kind).
    arms: dict[tuple[str, str], tuple[float, int, int, int, int]] = dataclasses.field(default_factory=dict)
    weight_changes: dict[tuple[str, str, str], int] = dataclasses.field(default_factory=dict)
    # Experiment outcomes that no arm took: (for request ids not, or no longer, remembered; requests forgotten
    # before their outcome came, because more awaited theirs).
    unmatched: tuple[int, int] | None = None
    membership: dict[str, int] = dataclasses.field(default_factory=dict)  # changes by kind (joined, left, ...)
    endpoint_states: dict[str, int] = dataclasses.field(default_factory=dict)  # endpoints by state
    discovery: tuple[str, bool] | None = None  # the source's name and whether it is in touch
    gpu_failures: dict[str, int] | None = None  # per GPU source URL, the collector's rounds in which it failed
    replicas: tuple[bool, int, ReplicaStats] | None = None  # Redis in touch, peers counted, the exchange's counts
    shared_control: ControlStats | None = None  # the experiments' control state shared through Redis: its counts
    stored_responses: StoredStats | None = None  # where stored Responses API responses live: its counts
    quotas: tuple[bool | None, QuotaStats] | None = None  # in step through Redis (None: alone), the counts
    # With kv_events: per endpoint whether its exact view is used, the blocks it reports; the collector's counts.
    kv: tuple[list[bool], list[int], int, int, dict[str, int], dict[str, int]] | None = None
    # With tokenizers for exact cache keys: requests routed without them, by reason.
    unkeyed: dict[str, int] | None = None

    @classmethod
    def take(cls, picker: PickerProcess) -> Readings:
        """Copy ``picker``'s counters; call on its event loop (a few µs per endpoint)."""
        log = picker.service.decisions
        engine = picker.engine
        addresses = [e.address for e in engine.pool]
        errors = picker.collector.stats.errors if picker.collector is not None else None
        now = time.monotonic()
        readings = cls(
            decisions=dict(log.by_endpoint),
            # Every refusal the filter answered (400, 404, 413, 429, 503, ...), and a zero for the usual ones and for
            # every class that sheds: a series that appears only at its first event hides that event from rate().
            refused=dict.fromkeys(KNOWN_REFUSALS, 0) | dict(picker.service.stats.refused),
            shed=dict.fromkeys(_shedding(picker), 0) | dict(log.shed),
            served=dict.fromkeys(SERVED_OUTCOMES, 0) | dict(picker.service.stats.served),
            pick_s=log.pick_s.copy(),
            addresses=addresses,
            scrape_errors=None if errors is None else [errors.get(a, 0) for a in addresses],
            stale=engine.signals.stale(now).tolist(),
            ages_s=engine.signals.snapshot.age(now).tolist(),
            inflight=engine.inflight.requests.tolist(),
            scorer_errors=dict(engine.scorer_errors),
            reloads=picker.reloads,
            membership=dict(picker.membership.changes),
            endpoint_states=_states(engine),
            discovery=None if picker.discovery is None else (picker.discovery.name, picker.discovery.healthy),
            gpu_failures=None if picker.gpu_collector is None else dict(picker.gpu_collector.errors),
            replicas=None
            if picker.replicas is None
            else (bool(picker.replicas.up), picker.replicas.peers(), copy.copy(picker.replicas.stats)),
            shared_control=None if picker.shared_control is None else copy.copy(picker.shared_control.stats),
            stored_responses=None
            if picker.service.stored_responses is None
            else copy.copy(picker.service.stored_responses.stats),
            quotas=_quotas(picker),
            kv=_kv(picker),
            unkeyed=_unkeyed(picker),
        )
        spans, leases = picker.spans, picker.service.leases
        extra: dict[str, Any] = {}
        if spans is not None:
            if spans.receiver is not None:
                extra["receiver"] = copy.copy(spans.receiver.stats)
            histograms = spans.histograms
            extra["latency"] = (
                [e.address for e in spans.pool],
                [h.copy() for h in histograms.ttft],
                [h.copy() for h in histograms.e2e],
            )
            if spans.config.latency_source == "stream":
                extra["timed"] = copy.copy(picker.service.observe_stats)
        if leases is not None:
            extra["leases"], extra["awaiting_end"] = copy.copy(leases.stats), len(leases)
        experiments = picker.service.router.experiments
        if experiments is not None:
            arms, changes = {}, {}
            for name, experiment in experiments.running.items():
                weights = experiment.weights()
                for arm in experiment.arms:
                    o = arm.outcomes
                    arms[name, arm.name] = (weights[arm.name], o.requests, o.finished, o.failed, o.shed)
                for arm in experiment.arms:  # the guard's changes, zero until the first
                    for kind in GUARD_CHANGES:
                        changes[name, arm.name, kind] = 0
                for (arm_name, kind), n in experiment.changes.items():
                    changes[name, arm_name, kind] = n
            extra["arms"], extra["weight_changes"] = arms, changes
            extra["unmatched"] = (experiments.unattributed, experiments.evicted)
        return dataclasses.replace(readings, **extra) if extra else readings


def _shedding(picker: PickerProcess) -> list[str]:
    """The names of the request classes that shed under load."""
    classifier = picker.service.router.classifier
    classes = [rule.request_class for rule in classifier.rules] + [classifier.default]
    return [c.name for c in classes if c.on_saturation == "shed"]


def _states(engine: Engine) -> dict[str, int]:
    pool = engine.pool
    draining = sum(e.draining for e in pool)
    ramping = sum(not ramp.done for _, ramp in pool.ramping)
    return {"serving": len(pool) - draining - ramping, "ramping": ramping, "draining": draining}


def families(readings: Readings) -> Iterator[Metric]:
    """The metric families of ``readings``, in the order ``/metrics`` prints them."""
    r = readings
    yield _counter(
        "inferlb_decisions_total",
        "Requests routed, by endpoint and why that one (see Decision.reason).",
        ("endpoint", "reason"),
        sorted(r.decisions.items()),
    )
    yield _counter(
        "inferlb_refused_total",
        "Requests refused, by HTTP status.",
        ("status",),
        [((str(status),), n) for status, n in sorted(r.refused.items())],
    )
    yield _counter(
        "inferlb_served_reports_total",
        "Served endpoints the data plane reported, by outcome: as-picked, elsewhere (a retry served it; its count "
        "moved there), unknown (outside the pool, or a request not held).",
        ("outcome",),
        [((outcome,), n) for outcome, n in sorted(r.served.items())],
    )
    yield _counter(
        "inferlb_shed_total",
        "Requests shed by admission control, by request class.",
        ("class",),
        [((name,), n) for name, n in sorted(r.shed.items())],
    )
    yield histogram_family("inferlb_pick_seconds", "Time one decision took.", (), [((), r.pick_s)])
    yield _counter(
        "inferlb_scrape_errors_total",
        "Failed metrics scrapes, by endpoint.",
        ("endpoint",),
        [] if r.scrape_errors is None else [((a,), n) for a, n in zip(r.addresses, r.scrape_errors, strict=True)],
    )
    yield _gauge(
        "inferlb_endpoint_stale",
        "1 when an endpoint's metrics are stale (treated as saturated).",
        ("endpoint",),
        [((a,), int(stale)) for a, stale in zip(r.addresses, r.stale, strict=True)],
    )
    yield _gauge(
        "inferlb_metrics_age_seconds",
        "Seconds since an endpoint's last successful scrape (+Inf: never).",
        ("endpoint",),
        [((a,), age) for a, age in zip(r.addresses, r.ages_s, strict=True)],
    )
    yield _gauge(
        "inferlb_inflight_requests",
        "Requests the picker sent to an endpoint that have not finished.",
        ("endpoint",),
        [((a,), n) for a, n in zip(r.addresses, r.inflight, strict=True)],
    )
    yield _counter(
        "inferlb_scorer_errors_total",
        "Scorer failures (each scored neutral for that request).",
        ("scorer",),
        [((name,), n) for name, n in sorted(r.scorer_errors.items())],
    )
    if r.receiver is not None:
        yield from _receiver(r.receiver)
    if r.latency is not None:
        addresses, ttft, e2e = r.latency
        yield histogram_family(
            "inferlb_endpoint_ttft_seconds",
            "Time to first token per endpoint, from the servers' spans.",
            ("endpoint",),
            [((a,), h) for a, h in zip(addresses, ttft, strict=True)],
        )
        yield histogram_family(
            "inferlb_endpoint_e2e_seconds",
            "End-to-end latency per endpoint, from the servers' spans.",
            ("endpoint",),
            [((a,), h) for a, h in zip(addresses, e2e, strict=True)],
        )
    if r.timed is not None:
        timed = r.timed
        outcomes = {
            "ttft": timed.ttft,
            "e2e": timed.e2e,
            "not_ok": timed.not_ok,
            "unknown_endpoint": timed.unknown_endpoint,
            "unfinished": timed.unfinished,
        }
        yield _counter(
            "inferlb_responses_timed_total",
            "Responses the filter timed or not (otel.latency_source: stream).",
            ("outcome",),
            [((outcome,), n) for outcome, n in outcomes.items()],
        )
    if r.leases is not None:
        leases = r.leases
        yield _counter(
            "inferlb_request_ends_total",
            "Routed requests whose end came, by how (access_log: Envoy's entry; expired: none came within "
            "inflight.max_age_s; evicted: the oldest, to make room).",
            ("how",),
            [(("access_log",), leases.ended), (("expired",), leases.expired), (("evicted",), leases.evicted)],
        )
        yield _counter(
            "inferlb_access_log_unmatched_total",
            "Access-log entries for no request this picker holds.",
            (),
            [((), leases.unknown_entries)],
        )
        yield _gauge(
            "inferlb_requests_awaiting_end",
            "Routed requests whose end has not been reported yet.",
            (),
            [((), r.awaiting_end)],
        )
    yield _counter(
        "inferlb_config_reloads_total", "Configurations applied since start (file or API).", (), [((), r.reloads)]
    )
    if r.gpu_failures is not None:
        yield _counter(
            "inferlb_gpu_source_failures_total",
            "Rounds in which a GPU source failed (unreachable, a bad report, a GPU it should list missing), by source.",
            ("source",),
            [((url,), n) for url, n in sorted(r.gpu_failures.items())],
        )
    yield _counter(
        "inferlb_membership_changes_total",
        "Endpoints that joined, left (and drained), were removed or changed models or labels, since start.",
        ("change",),
        [((k,), v) for k, v in sorted(r.membership.items())],
    )
    yield _gauge(
        "inferlb_pool_endpoints",
        "The pool's endpoints by state: serving, ramping in (slow start), draining.",
        ("state",),
        [((k,), v) for k, v in sorted(r.endpoint_states.items())],
    )
    if r.discovery is not None:
        yield _gauge(
            "inferlb_discovery_healthy",
            "1 while the discovery source is in touch with its backend (0: the last membership stays in force).",
            ("source",),
            [((r.discovery[0],), int(r.discovery[1]))],
        )
    if r.replicas is not None:
        up, peers, stats = r.replicas
        yield _gauge(
            "inferlb_replicas_redis_up",
            "1 while this replica is in touch with Redis (0: it routes on its own view).",
            (),
            [((), int(up))],
        )
        yield _gauge("inferlb_replicas_peers", "Other replicas whose in-flight counts count here.", (), [((), peers)])
        yield _counter(
            "inferlb_replicas_entries_total",
            "Entries of the replicas' exchange: published by this replica, applied from peers, rejected (malformed or "
            "naming no member of the pool).",
            ("kind",),
            [(("published",), stats.published), (("applied",), stats.applied), (("rejected",), stats.rejected)],
        )
        yield _counter("inferlb_replicas_outages_total", "Times Redis went out of reach.", (), [((), stats.outages)])
    if r.stored_responses is not None:
        kept = r.stored_responses
        yield _counter(
            "inferlb_stored_responses_total",
            "Responses API responses seen made (learned), and requests continuing one: routed to the server that "
            "stored it (pinned), naming one not seen here (unknown), or whose server left (gone).",
            ("kind",),
            [((kind,), getattr(kept, kind)) for kind in ("learned", "pinned", "unknown", "gone")],
        )
    if r.shared_control is not None:
        control = r.shared_control
        yield _counter(
            "inferlb_experiment_shared_changes_total",
            "Experiments' control changes (an operator's action, a guard's roll-back) shared through Redis: merged in "
            "by this replica, followed from others, refused (malformed, or arms this config does not have), merged "
            "again because another replica wrote meanwhile.",
            ("kind",),
            [
                (("published",), control.published),
                (("applied",), control.applied),
                (("rejected",), control.rejected),
                (("conflicts",), control.conflicts),
            ],
        )
        yield _counter(
            "inferlb_experiment_shared_outages_total",
            "Times Redis went out of reach for the experiments' shared control state.",
            (),
            [((), control.outages)],
        )
    if r.quotas is not None:
        shared, quota = r.quotas
        quota_outcomes = [((t, "admitted"), n) for t, n in sorted(quota.admitted.items())]
        quota_outcomes += [((t, f"over {limit}"), n) for (t, limit), n in sorted(quota.refused.items())]
        quota_outcomes += [((t, "refunded"), n) for t, n in sorted(quota.refunded.items())]
        yield _counter(
            "inferlb_quota_requests_total",
            "Requests charged to tenant quotas: admitted, or refused (429) over which limit, and refunded (admitted, "
            "then refused by admission or routing: their tokens given back); tenants not listed are 'other'.",
            ("tenant", "outcome"),
            quota_outcomes,
        )
        yield _counter(
            "inferlb_quota_tokens_total",
            "Tokens admitted under tenant quotas (prompt plus max_tokens, or the assumed output).",
            ("tenant",),
            [((t,), n) for t, n in sorted(quota.tokens.items())],
        )
        if shared is not None:
            yield _gauge(
                "inferlb_quota_redis_up",
                "1 while the quotas are in step with the replicas' buckets in Redis (0: this replica enforces its "
                "share alone).",
                (),
                [((), int(shared))],
            )
            yield _counter(
                "inferlb_quota_buckets_total",
                "Tenant buckets in Redis by event: repaired (found holding no number, reset to full), sent_again (a "
                "batch sent again after a failed call that Redis had taken: not charged twice), dropped (given up "
                "with spending not yet in Redis: more tenants gone than max_tenants).",
                ("event",),
                [
                    (("repaired",), quota.repaired),
                    (("sent_again",), quota.applied_before),
                    (("dropped",), quota.dropped),
                ],
            )
    if r.kv is not None:
        live, blocks, batches, replayed, errors, skipped = r.kv
        yield _gauge(
            "inferlb_kv_events_live",
            "1 while the prefix scorers use what an endpoint's server reports of its cache (its KV events); 0 while "
            "they guess (not subscribed, events missed or stopped).",
            ("endpoint",),
            [((a,), int(v)) for a, v in zip(r.addresses, live, strict=False)],
        )
        yield _gauge(
            "inferlb_kv_events_blocks",
            "Blocks each endpoint's server reports in its prefix cache.",
            ("endpoint",),
            [((a,), n) for a, n in zip(r.addresses, blocks, strict=False)],
        )
        yield _counter(
            "inferlb_kv_events_batches_total", "KV event batches applied from the live streams.", (), [((), batches)]
        )
        yield _counter(
            "inferlb_kv_events_replayed_total",
            "KV event batches applied from replays of missed ones.",
            (),
            [((), replayed)],
        )
        yield _counter(
            "inferlb_kv_events_errors_total",
            "KV event stream problems by kind (undecodable, gap without replay, replay failed).",
            ("kind",),
            [((k,), n) for k, n in sorted(({"undecodable": 0, "gap": 0, "replay": 0} | errors).items())],
        )
        yield _counter(
            "inferlb_kv_events_skipped_total",
            "Stored blocks the index could not use, by reason (orphan, lora, medium, block_size, token_count).",
            ("reason",),
            [((k,), n) for k, n in sorted(skipped.items())],
        )
    if r.unkeyed is not None:
        yield _counter(
            "inferlb_kv_unkeyed_total",
            "Requests routed without their exact cache keys (on the approximate prefix index), by reason: late (the "
            "tokenizer missed the deadline), busy (too many prompts held by the tokenizer), refused (the chat "
            "template refused the chat, or the prompt could not be tokenized), media (a chat with images or audio).",
            ("reason",),
            [((k,), n) for k, n in sorted(r.unkeyed.items())],
        )
    if r.arms:
        labels = ("experiment", "arm")
        arms = sorted(r.arms.items())
        yield _gauge(
            "inferlb_experiment_weight",
            "Each experiment arm's share of its traffic.",
            labels,
            [(k, v[0]) for k, v in arms],
        )
        for i, (what, help_text) in enumerate(
            (
                ("requests", "Requests routed by each experiment arm."),
                ("finished", "Requests of each experiment arm whose outcome came."),
                ("failed", "Requests of each experiment arm that failed (5xx, reset)."),
                ("shed", "Requests of each experiment arm shed by admission control."),
            ),
            start=1,
        ):
            yield _counter(f"inferlb_experiment_{what}_total", help_text, labels, [(k, v[i]) for k, v in arms])
        yield _counter(
            "inferlb_experiment_weight_changes_total",
            "Changes of an experiment's weights or state, by arm (empty: all) and kind (ramp, cut, rolled-back, ...).",
            ("experiment", "arm", "kind"),
            sorted(r.weight_changes.items()),
        )
    if r.unmatched is not None:
        yield _counter(
            "inferlb_experiment_outcomes_unmatched_total",
            "Experiment outcomes no arm took: for a request not remembered (unattributed), or requests forgotten "
            "before their outcome came because more awaited theirs (evicted).",
            ("reason",),
            [(("unattributed",), r.unmatched[0]), (("evicted",), r.unmatched[1])],
        )


def _receiver(stats: ReceiverStats) -> Iterator[Metric]:
    outcomes = {
        "joined_by_trace": stats.joined_by_trace,
        "joined_by_resource": stats.joined_by_resource,
        "unjoined": stats.unjoined,
        "envoy": stats.envoy_spans,
        "malformed": stats.malformed,
        "other": stats.spans - stats.llm_spans - stats.envoy_spans,
        "duplicate": stats.duplicate,
        "unverified": stats.unverified,
        "out_of_bounds": stats.out_of_bounds,
        "rate_limited": stats.rate_limited,
        "over_limit": stats.over_limit,
        "dropped": stats.dropped_spans,
    }
    yield _counter(
        "inferlb_spans_received_total",
        "Spans the OTLP receiver took, by what became of them.",
        ("outcome",),
        [((outcome,), n) for outcome, n in outcomes.items()],
    )
    yield _counter(
        "inferlb_span_requests_dropped_total",
        "OTLP export requests refused whole because the picker was behind.",
        (),
        [((), stats.dropped_requests)],
    )
    refusals = {
        "untrusted_sender": stats.untrusted_sender,
        "unauthenticated": stats.unauthenticated,
        "invalid": stats.invalid_requests,
        "busy": stats.busy_requests,
        "slow": stats.slow_requests,
        "incomplete": stats.incomplete_requests,
    }
    yield _counter(
        "inferlb_span_requests_refused_total",
        "OTLP export requests the receiver refused whole, by reason.",
        ("reason",),
        [((reason,), n) for reason, n in refusals.items()],
    )
    yield _counter(
        "inferlb_span_receiver_restarts_total",
        "Times the OTLP receiver process was started again after it died.",
        (),
        [((), stats.restarts)],
    )


# The readings a scrape in progress took on the event loop, for the collector running on its worker thread
# (asyncio.to_thread runs the function in a copy of the caller's context). Each scrape has its own context.
_TAKEN: ContextVar[tuple[PickerProcess, Readings] | None] = ContextVar("inferlb_metrics_taken", default=None)


class PickerCollector(Collector):
    """Yields one picker's metric families. In a `scrape`, from the readings it took on the event loop; called
    directly (``generate_latest`` on the loop, as `prometheus_text` does), from readings taken then. Everything is
    reached through ``picker`` at each scrape, so a reload that swaps the engine or the pool is followed."""

    def __init__(self, picker: PickerProcess) -> None:
        self.picker = picker

    def collect(self) -> Iterator[Metric]:
        taken = _TAKEN.get()
        readings = taken[1] if taken is not None and taken[0] is self.picker else Readings.take(self.picker)
        yield from families(readings)


def picker_registry(picker: PickerProcess) -> CollectorRegistry:
    """A registry of its own for one picker's admin app, holding its `PickerCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PickerCollector(picker))
    return registry


async def scrape(registry: CollectorRegistry, picker: PickerProcess) -> bytes:
    """``generate_latest(registry)`` for ``picker``'s registry: its counters are copied here, on the event loop,
    and the families are built and formatted on a worker thread."""
    token = _TAKEN.set((picker, Readings.take(picker)))
    try:
        return await asyncio.to_thread(generate_latest, registry)
    finally:
        _TAKEN.reset(token)


def prometheus_text(picker: PickerProcess) -> str:
    """The picker's metrics in the Prometheus text format, read and formatted here (the caller's thread must be
    allowed to read the picker's counters: its event loop's)."""
    return generate_latest(picker_registry(picker)).decode()


def _unkeyed(picker: PickerProcess) -> dict[str, int] | None:
    keyer, stats = picker.service.keyer, picker.service.stats
    if keyer is None:
        return None
    return dict.fromkeys(UNKEYED_REASONS, 0) | dict(stats.unkeyed) | {"refused": keyer.failed, "media": keyer.media}


def _kv(picker: PickerProcess) -> tuple[list[bool], list[int], int, int, dict[str, int], dict[str, int]] | None:
    kv, collector = picker.engine.signals.kv, picker.kv_collector
    if kv is None:
        return None
    blocks = [kv.held(i) for i in range(kv.size)]
    if collector is None:
        return kv.live.tolist(), blocks, 0, 0, {}, dict(kv.skipped)
    return kv.live.tolist(), blocks, collector.batches, collector.replayed, dict(collector.errors), dict(kv.skipped)


def _quotas(picker: PickerProcess) -> tuple[bool | None, QuotaStats] | None:
    quotas = picker.service.quotas
    if quotas is None:
        return None
    q = quotas.stats
    stats = QuotaStats(
        q.admitted.copy(),
        q.refused.copy(),
        q.tokens.copy(),
        q.refunded.copy(),
        repaired=q.repaired,
        applied_before=q.applied_before,
        dropped=q.dropped,
    )
    return (None if quotas.replicas is None else bool(quotas.up), stats)

"""Assembling and running the picker process: config -> pool -> signals, engine -> ext_proc gRPC server, plus the
background collectors that keep the signals fresh, the admin API, and configuration reloads.

A reload (the config file changed, or ``POST /config``) builds a new engine from the new configuration and swaps
it in between two requests; nothing in flight is dropped. A membership change (a reload that lists other endpoints,
or the discovery source's new list: `scorer.membership`) does the same: endpoints that stay keep their in-flight
counts, signals and prefix-index entries, one that joins ramps in (slow start), one that leaves drains (no new
requests; its state goes when its last request ends). An invalid new configuration is refused and the old one
stays in force. ``listen`` and ``admin`` cannot change at run time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from inferlb.admin import create_admin_app
from inferlb.filter.request import OBJECTIVE_HEADERS
from inferlb.filter.requestend import OpenLeases
from inferlb.filter.server import GRPC_ENVELOPE_BYTES, ExtProcService, PickerServer, WaitingHealth
from inferlb.filter.storedresponses import StoredResponses
from inferlb.filter.tls import CertificateFiles
from inferlb.filter.xds import ControlPlane, Member
from inferlb.otel.loop import SpanLoop, receiver_settings
from inferlb.otel.receiver import TraceJoin
from inferlb.otel.routespans import RouteSpans
from inferlb.otel.spanwire import SpanRecord
from inferlb.otel.tracing import create_tracer_provider
from inferlb.scorer.classes import Classifier
from inferlb.scorer.collect import CollectorOptions, MetricsCollector
from inferlb.scorer.config import OTEL_FIXED_AT_START, Config, EndpointConfig, load_config, parse_config
from inferlb.scorer.credentials import Credential, FileStamp, file_stamp
from inferlb.scorer.discovery import DiscoverySource
from inferlb.scorer.engine import Engine
from inferlb.scorer.errors import ConfigError
from inferlb.scorer.experiments import Experiments, WeightChange
from inferlb.scorer.gpucollect import GpuCollector
from inferlb.scorer.inflight import InFlight
from inferlb.scorer.kvindex import KVBlockIndex
from inferlb.scorer.membership import REAP_INTERVAL_S, Membership, Plan
from inferlb.scorer.pool import Pool
from inferlb.scorer.presets import build_profile
from inferlb.scorer.quotas import Quotas
from inferlb.scorer.replicas import Replicas
from inferlb.scorer.router import Router
from inferlb.scorer.saturation import Saturation
from inferlb.scorer.sharedcontrol import SharedControl
from inferlb.scorer.signals import Signals
from inferlb.scorer.tokenizer import (
    CacheKeyer,
    HuggingFaceTokenizer,
    PieceTokenizer,
    PromptTokenizer,
    TokenizerError,
)
from inferlb.scorer.weights import endpoint_weights
from inferlb.serving import serve as serve_asgi
from inferlb.threads import batch_other_threads
from inferlb.workers import say_ready, watch_supervisor, worker_config

if TYPE_CHECKING:
    from inferlb.scorer.kvsubscriber import KVEventCollector

    _Collectors = tuple[MetricsCollector | None, GpuCollector | None, KVEventCollector | None]

logger = logging.getLogger(__name__)

# After the drain, how long streams still open get to finish. Routing streams end at their decision, so what is
# left is a request waiting for its body or for capacity (at most a class's max_wait_s).
SHUTDOWN_GRACE_S = 2.0
WATCH_INTERVAL_S = 0.25  # a stat of the config file this often
SETTLE_S = 0.05  # a changed file is read once it has stayed the same this long (up to SETTLE_TRIES times)
SETTLE_TRIES = 10
LEASE_EXPIRY_INTERVAL_S = 1.0
# A second SIGTERM/SIGINT cuts the drain short only this long after the first: one stop often arrives twice at once
# (systemd's default KillMode and Ctrl-C signal the whole process group, and the supervisor of `--workers` passes
# its own on to each worker), and the copy must not end the drain it started.
SECOND_SIGNAL_AFTER_S = 1.0
# The Envoy clusters whose endpoints the picker serves over ADS (envoy/bootstrap.yaml.j2 names them).
XDS_CLUSTERS = ("inferlb_fallback", "inferlb_picked")


@dataclass(slots=True)
class PickerProcess:
    """One picker: its gRPC server, engine, collectors and admin API. `start` and `stop` run the whole of it.
    One event loop; `reload_document` / `reload_file` raise ConfigError and change nothing on a bad config."""

    config: Config
    engine: Engine
    service: ExtProcService
    server: PickerServer
    rng: np.random.Generator | None = None
    config_path: Path | None = None
    collector: MetricsCollector | None = None
    gpu_collector: GpuCollector | None = None
    kv_collector: KVEventCollector | None = None
    reloads: int = 0
    config_refusals: int = 0
    listen_override: str | None = None
    worker: int | None = None  # which worker of `inferlb serve --workers N` this is (None: the only picker)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _collector_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # The collectors a reload wants running next, those it built and a later one replaced, and the one restart
    # that runs at a time (`_restart_collectors`).
    _next_collectors: _Collectors | None = None
    _superseded: list[_Collectors] = field(default_factory=list)
    _restarting: asyncio.Task[None] | None = None
    # (collector, error) for each collector that ended other than by cancellation (a bug): shown in /readyz.
    collector_failures: list[tuple[str, str]] = field(default_factory=list)
    _started: bool = False
    spans: SpanLoop | None = None
    admin_credential: Credential | None = None
    draining: bool = False
    membership: Membership = field(default_factory=Membership)
    discovery: DiscoverySource | None = None
    # What the discovery source lists now (None: nothing yet), and the endpoints the config file lists.
    discovered: tuple[EndpointConfig, ...] | None = None
    static_endpoints: tuple[EndpointConfig, ...] = ()
    membership_refusals: int = 0
    # Other pickers of the pool, through Redis (config replicas): what they have in flight counts here too.
    replicas: Replicas | None = None
    # And the experiments' control state (an operator's actions, a guard's roll-back), shared and remembered there.
    shared_control: SharedControl | None = None
    # What Envoy's bootstrap was rendered for, as far as a reload could need more of it (`_bootstrap_needs` of the
    # config the picker started with).
    bootstrap_needs: tuple[frozenset[str], object, bool] | None = None
    _peers_gone_seen: int = 0  # the replicas' count of peers gone silent, when the lease expiry last looked

    async def start(self) -> None:
        await self.server.start()
        loop = asyncio.get_running_loop()
        if self.spans is not None:
            await self.spans.start()
        self._start_collectors()
        if self.config.admin is not None:
            # The picker handles SIGTERM/SIGINT for all of its parts; the admin server stops when cancelled.
            listening = asyncio.Event()
            admin = loop.create_task(
                serve_asgi(
                    [(self.config.admin, create_admin_app(self))],
                    ready=listening,
                    # The app's lifespan stops the heatmap's render process with the admin API.
                    lifespan="on",
                    handle_signals=False,
                    what="admin API",
                ),
                name="admin",
            )
            self._tasks.append(admin)
            waiting = loop.create_task(listening.wait())
            await asyncio.wait([waiting, admin], return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if admin.done():
                admin.result()  # raises the bind error
        if self.config_path is not None:
            self._tasks.append(loop.create_task(self._watch(self.config_path), name="config watch"))
        if self.service.leases is not None:
            expiry = _expire_leases(self.service.leases, self._ends_may_be_lost)
            self._tasks.append(loop.create_task(expiry, name="lease expiry"))
        self._tasks.append(loop.create_task(self._reap(), name="membership"))
        self._tasks.append(loop.create_task(self._push_weights(), name="weights"))
        if self.discovery is not None:
            self._tasks.append(loop.create_task(self.discovery.run(self.discovered_endpoints), name="discovery"))
        if self.replicas is not None:
            self._tasks.append(loop.create_task(self.replicas.run(), name="replicas"))
        if self.shared_control is not None:
            self._tasks.append(loop.create_task(self.shared_control.run(), name="experiments' shared control"))
        quotas = self.service.quotas
        if quotas is not None and quotas.replicas is not None:
            self._tasks.append(loop.create_task(quotas.run(), name="quotas"))
        self._started = True

    async def drain(self, seconds: float) -> None:
        """Report NOT_SERVING (gRPC health and /readyz) and keep answering for ``seconds``, so that whoever sends
        requests here (a Service, another Envoy) moves to other pickers first and nothing is refused."""
        self.draining = True
        await self.server.drain()
        await asyncio.sleep(seconds)

    async def stop(self, grace: float | None = SHUTDOWN_GRACE_S) -> None:
        try:
            await self.server.stop(grace)
        finally:
            if self.spans is not None:
                await self.spans.stop()
            if self.service.route_spans is not None:
                await asyncio.to_thread(self.service.route_spans.shutdown)
            if self._restarting is not None:
                self._restarting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._restarting
            if self._next_collectors is not None:
                self._superseded.append(self._next_collectors)
                self._next_collectors = None
            await self._close_superseded()
            await self._stop_collectors()
            self.service.close()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks.clear()
            if self.replicas is not None:
                await self.replicas.close()
            if self.service.leases is not None:
                self.service.leases.release_all()

    def _ends_may_be_lost(self) -> bool:
        """Whether ends of requests routed here that reached other replicas may have been lost since the last look:
        Redis is out of reach, or a peer went silent (it died, and Envoy's access-log stream to it with it)."""
        replicas = self.replicas
        if replicas is None:
            return False
        went = replicas.peers_gone != self._peers_gone_seen
        self._peers_gone_seen = replicas.peers_gone
        return replicas.up is False or went

    def not_ready(self) -> list[str]:
        """Why the picker should not get traffic yet (empty: ready)."""
        reasons = []
        if not self._started:
            reasons.append("starting")
        if self.draining:
            reasons.append("draining: the picker is shutting down")
        if self.collector is not None and not self.collector.first_round_done:
            reasons.append("no metrics scrape finished yet")
        if self.replicas is not None and not self.replicas.ready():
            reasons.append("replicas: catching up from Redis")
        if self.shared_control is not None and not self.shared_control.ready():
            reasons.append("experiments: reading their shared control state from Redis")
        return reasons

    def notes(self) -> list[str]:
        """What a ready picker should tell whoever asks (``/readyz``): it routes, but not as it would like to."""
        replicas = self.replicas
        notes = [replicas.problem] if replicas is not None and replicas.problem else []
        return notes + [
            f"the {name} collector stopped ({error}): its signals are going stale"
            for name, error in self.collector_failures
        ]

    # ---- collectors ---------------------------------------------------------------------------------------

    def _start_collectors(self) -> None:
        loop = asyncio.get_running_loop()
        runs = []
        if self.collector is not None:
            runs.append((self.collector.run(), "metrics"))
        if self.gpu_collector is not None:
            runs.append((self.gpu_collector.run(), "gpu"))
        if self.kv_collector is not None:
            runs.append((self.kv_collector.run(), "kv-events"))
        for run, name in runs:
            task = loop.create_task(run, name=name)
            task.add_done_callback(self._collector_ended)
            self._collector_tasks.append(task)

    def _collector_ended(self, task: asyncio.Task[None]) -> None:
        # A collector returns only when cancelled; each one survives its sources' faults. One that ends otherwise
        # is a bug, and its signals would freeze without a word: say so where the operator looks.
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        self.collector_failures.append((task.get_name(), repr(error)[:200]))
        logger.error("the %s collector stopped: its signals go stale", task.get_name(), exc_info=error)

    async def _stop_collectors(self) -> None:
        tasks, self._collector_tasks = self._collector_tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            # A collector that failed was logged when it did (`_collector_ended`): the rest of the stop must run.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.collector is not None:
            await self.collector.aclose()
        if self.gpu_collector is not None:
            await self.gpu_collector.aclose()
        if self.kv_collector is not None:
            await self.kv_collector.aclose()

    # ---- reloads --------------------------------------------------------------------------------------------

    def reload_document(self, document: Any) -> None:
        """Apply a configuration given as a parsed document; ConfigError (nothing changed) if it is invalid."""
        self._apply(self._overridden(parse_config(document)))

    def reload_file(self) -> None:
        """Re-read the config file and apply it; ConfigError (nothing changed) if it is invalid."""
        if self.config_path is None:
            raise ConfigError("this picker was not started from a config file")
        self._apply(self._overridden(load_config(self.config_path)))

    def _overridden(self, config: Config) -> Config:
        # A --listen given on the command line holds for every later config too, and so do a worker's ports.
        return _addressed(config, self.listen_override, self.worker)

    def _wanted(self, listed: tuple[EndpointConfig, ...]) -> tuple[EndpointConfig, ...]:
        """The endpoints that should serve: those the config file lists, then those discovered (a discovered entry
        for a listed address replaces the file's)."""
        return _merged(listed, self.discovered)

    def discovered_endpoints(self, endpoints: tuple[EndpointConfig, ...]) -> None:
        """The discovery source's new list: rebuild the pool (a change that cannot be applied is logged and
        counted; the membership in force stays)."""
        self.discovered = endpoints
        self.rebuild("discovery")

    def rebuild(self, reason: str) -> None:
        """Apply the membership anew with the config in force (after discovery changed, or to drop endpoints that
        have drained)."""
        try:
            self._apply(replace(self.config, endpoints=self.static_endpoints), reason=reason)
        except ConfigError as exc:
            self.membership_refusals += 1
            logger.error("membership change (%s) refused, the pool in force stays: %s", reason, exc)

    def publish_endpoints(self) -> None:
        """Tell Envoy (over ADS, filter/xds.py) the pool's serving endpoints and the weights its scores give them
        now; a no-op when nothing changed."""
        control = self.server.control_plane
        if control is None:
            return
        engine = self.engine
        weights = endpoint_weights(engine)
        control.publish([Member(e.host, e.port, weights.get(e.index, 1)) for e in engine.pool if not e.draining])

    async def _push_weights(self) -> None:
        while True:
            await asyncio.sleep(self.config.weights_interval_s)
            self.publish_endpoints()

    async def _reap(self) -> None:
        """Drop draining endpoints once their last request has ended."""
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            engine = self.engine
            if any(engine.inflight.requests[e.index] <= 0 for e in engine.pool.draining):
                self.rebuild("drained")

    def _apply(self, config: Config, *, reason: str = "config") -> None:
        old = self.config
        if config.otel.receiver != old.otel.receiver:
            raise ConfigError("otel.receiver cannot change while the picker runs; restart it")
        if config.otel.latency_source != old.otel.latency_source:
            raise ConfigError(
                "otel.latency_source cannot change while the picker runs: Envoy's bootstrap changes with it "
                "(inferlb envoy-config); restart both"
            )
        if config.replicas != old.replicas:
            raise ConfigError("replicas cannot change while the picker runs; restart it")
        for name in OTEL_FIXED_AT_START:
            if getattr(config.otel, name) != getattr(old.otel, name):
                raise ConfigError(
                    f"otel.{name} cannot change while the picker runs (it is read at start-up); restart it"
                )
        if config.discovery != old.discovery or (
            config.discovery is not None and config.allowed_networks != old.allowed_networks
        ):
            # The source is built and started once; the one running would go on adding what it finds.
            raise ConfigError(
                "pool.discovery (and, with it, pool.allowed_networks) cannot change while the picker runs; restart it"
            )
        # Against what Envoy's bootstrap was made for (the config the picker started with), not the config in force:
        # a header dropped by one reload and put back by the next is still forwarded.
        made_for = self.bootstrap_needs if self.bootstrap_needs is not None else _bootstrap_needs(old)
        (headers, jwt, scores), (had, jwt_before, scores_before) = _bootstrap_needs(config), made_for
        missing = sorted(headers - had)
        if missing or jwt != jwt_before or (scores and not scores_before):
            what = (
                f"the headers {', '.join(missing)}"
                if missing
                else "its JWT filter as quotas.jwt says"
                if jwt != jwt_before
                else "the scores' header back (debug_scores)"
            )
            raise ConfigError(
                f"this change needs Envoy to send the picker {what}, which Envoy's bootstrap in force was not made "
                "for: re-render it (inferlb envoy-config) and restart both (or restart the picker alone if the "
                "bootstrap forwards them already, --forward-header)"
            )
        if config.kv_events != old.kv_events:
            raise ConfigError("kv_events cannot change while the picker runs; restart it")
        if config.tls != old.tls:
            raise ConfigError("tls cannot change while the picker runs (its files may: they are read again); restart")
        if (config.quotas is None) != (old.quotas is None):
            raise ConfigError("quotas cannot be turned on or off while the picker runs (their limits can); restart it")
        if config.inflight.end != old.inflight.end:
            raise ConfigError(
                "inflight.end cannot change while the picker runs: Envoy's bootstrap changes with it "
                "(inferlb envoy-config); restart both"
            )
        if config.destinations != old.destinations:
            # An ORIGINAL_DST gateway cannot take a list of endpoints (every request would fail), and an Override
            # Host gateway's retries were rendered for the number in force.
            raise ConfigError(
                f"destinations cannot change while the picker runs ({old.destinations} -> {config.destinations}): "
                "Envoy's bootstrap changes with it (inferlb envoy-config); restart both"
            )
        if config.max_body_bytes + GRPC_ENVELOPE_BYTES > self.server.max_message_bytes:
            raise ConfigError(
                f"max_body_bytes cannot rise above {self.server.max_message_bytes - GRPC_ENVELOPE_BYTES} while the "
                "picker runs (its gRPC message limit is set at start-up); restart it, and re-render Envoy's bootstrap"
            )
        credential = _admin_credential(config)
        for name in ("listen", "admin"):
            if getattr(config, name) != getattr(old, name):
                raise ConfigError(
                    f"{name} cannot change while the picker runs ({getattr(old, name)!r} -> "
                    f"{getattr(config, name)!r}); restart it"
                )
        listed = config.endpoints
        engine_before = self.engine
        plan = self.membership.plan(
            engine_before.pool, engine_before.inflight.requests, self._wanted(listed), engine_before.signals.clock()
        )
        if not plan.endpoints:
            raise ConfigError("the pool would be empty: no endpoint is listed or discovered, and none is draining")
        if len(plan.draining) == len(plan.endpoints):
            # Every endpoint left while some still had requests in flight: with nothing to serve new requests, the
            # pool in force stays, as it does when they had none (most likely the source was emptied by mistake).
            raise ConfigError(
                f"no endpoint would serve: none is listed or discovered, and the {len(plan.draining)} left still "
                "have requests in flight"
            )
        config = replace(config, endpoints=plan.endpoints)  # in the pool's order, draining ones included
        pool = self.membership.pool(plan)
        if config.otel.receiver is not None:
            receiver_settings(config.otel, pool)  # an unreadable receiver token refuses the reload here
        same_pool = not plan.moves
        if same_pool:
            inflight, signals = self.engine.inflight, self.engine.signals
            if signals.stale_after_s != config.signals.stale_after_s:
                signals.stale_after_s = config.signals.stale_after_s
                signals.publish(signals.snapshot)
        else:
            inflight = self.engine.inflight.moved(plan.mapping)
            signals = self.engine.signals.moved(plan.mapping, stale_after_s=config.signals.stale_after_s)
            if signals.kv is not None:
                for endpoint in plan.restarted:  # back before it drained: another server process, its cache empty
                    signals.kv.restarted(endpoint)
        profile = build_profile(
            config.profile_spec(), self.rng, size=len(pool), speeds=_declared(config, pool), addresses=_addresses(pool)
        )
        engine = Engine(pool, profile, inflight, signals, _saturation(config, pool))
        # A membership change that takes a release arm's last endpoint leaves the arm vacant (its requests go to
        # the control until one is back) rather than being refused: refusing froze the whole membership, and the
        # departed canary kept its share. A config that names labels no endpoint has is refused, as a mistake.
        try:
            experiments = _experiments(config, engine, self.rng, vacant_ok=reason != "config")
        except ValueError as exc:  # a release arm's labels match no endpoint of this membership, for one
            raise ConfigError(f"experiments: {exc}") from None
        for name, running in () if experiments is None else experiments.running.items():
            for arm in running.arms:
                if arm.vacant:
                    logger.warning(
                        "experiment %r: arm %r has no endpoint (labels %s) after this membership change: its "
                        "requests go to the control until one is back",
                        name,
                        arm.name,
                        dict(arm.spec.endpoints),
                    )
        router = Router(engine, Classifier(config.classes, config.default_class), experiments=experiments)
        # From here on nothing can fail: swap everything between two requests.
        experiments_before = self.service.router.experiments
        # The pool's engine learns from the engine before of its profile (an arm's, when the policy became it).
        learned = engine_before
        if experiments_before is not None:
            learned = next((e for e in experiments_before.engines if e.profile.name == profile.name), engine_before)
        engine.adopt(learned, plan.mapping, plan.restarted)
        if experiments is not None:
            experiments.adopt(experiments_before, plan.mapping, plan.restarted, taken=(learned,))
        if inflight is not engine_before.inflight:
            engine_before.inflight.hand_over(inflight, plan.mapping)
        self.membership.commit(plan)
        self.membership.slow_start = config.slow_start
        self.static_endpoints = listed
        self.admin_credential = credential
        if self.service.leases is not None:
            self.service.leases.max_age_s = config.inflight.max_age_s
        self.service.swap_router(router)
        _export_changes(self.service)
        if experiments is not None and self.shared_control is not None:
            experiments.listeners.append(self.shared_control.changed)
        self.service.max_body_bytes = config.max_body_bytes
        self.service.session_header = config.session_header
        self.service.class_header = config.class_header
        self.service.objectives = config.inference_objectives
        self.service.debug_scores = config.debug_scores
        self.service.experiment_headers = frozenset(config.named_headers)
        if self.service.quotas is not None and config.quotas is not None:
            self.service.quotas.reconfigure(config.quotas)
        if self.spans is not None:
            self.spans.hints = config.speeds
            self.spans.rebind(
                pool, signals, keep=same_pool, config=config.otel, mapping=plan.mapping, restarted=plan.restarted
            )
            self.service.trace_join = _trace_join(config, self.spans)
            router.speeds = self.spans.speeds  # the one that follows the pool (rebind moved it)
        self.engine, self.config = engine, config
        if reason == "config":
            self.reloads += 1
        restart = (
            not same_pool
            or config.signals != old.signals
            or [e.gpu for e in config.endpoints] != [e.gpu for e in old.endpoints]
        )
        if restart:
            collectors = _collectors(config, pool, signals, inflight)
            if self._started:
                self._restart_collectors(collectors)
            else:
                self.collector, self.gpu_collector, self.kv_collector = collectors
        self.service.destinations = config.destinations
        self.service.decisions.forget_endpoints_but(e.address for e in pool)
        self.publish_endpoints()
        if reason == "config":
            logger.info("config applied (reload %d): policy %s, %d endpoints", self.reloads, config.policy, len(pool))
        _log_membership(plan, pool, inflight, reason)

    def _restart_collectors(self, collectors: _Collectors) -> None:
        """Run ``collectors`` instead of the running ones, by one restart at a time (`_restarts`): two reloads a
        few milliseconds apart once restarted concurrently, and the second cleared the list of tasks that the first
        had just started, which then scraped on past the picker's stop."""
        if self._next_collectors is not None:
            self._superseded.append(self._next_collectors)  # never started: only its sockets to close
        self._next_collectors = collectors
        if self._restarting is None or self._restarting.done():
            self._restarting = asyncio.get_running_loop().create_task(self._restarts(), name="collectors restart")

    async def _restarts(self) -> None:
        while self._next_collectors is not None:
            collectors, self._next_collectors = self._next_collectors, None
            await self._close_superseded()
            await self._stop_collectors()
            self.collector, self.gpu_collector, self.kv_collector = collectors
            self._start_collectors()
        await self._close_superseded()

    async def _close_superseded(self) -> None:
        while self._superseded:
            for collector in self._superseded.pop():
                if collector is not None:
                    await collector.aclose()

    async def _watch(self, path: Path) -> None:
        """Reload when the modification time or size of the file, or of a token file the config in force names (the
        admin API's, the span receiver's), changes: checked every WATCH_INTERVAL_S. So a rotated Secret takes
        effect without a restart, and without a call that the old token would have to make."""

        def stamp() -> tuple[FileStamp | None, ...] | None:
            files = (path, *_token_files(self.config))
            stamps = tuple(map(file_stamp, files))
            return None if stamps[0] is None else stamps

        seen = stamp()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = stamp()
            if now is None or now == seen:
                continue
            # Still being written, perhaps (a copy, `cat > file`): applied once the files stay the same for SETTLE_S
            # (a few tries at most; a writer that pauses longer should rename a whole file into place).
            for _ in range(SETTLE_TRIES):
                await asyncio.sleep(SETTLE_S)
                again = stamp()
                if again == now:
                    break
                now = again
            if now is None:
                continue
            seen = now
            try:
                self.reload_file()
            except ConfigError as exc:
                self.config_refusals += 1
                logger.error(
                    "the config file or a token file it names changed, and the reload was refused; the old config"
                    " (and token) stays in force: %s",
                    exc,
                )
            except Exception:  # a bug: the watch must go on, or every later edit and rotation would be ignored
                self.config_refusals += 1
                logger.exception("the config file changed, and its reload failed; the old config stays in force")

    # ---- admin API ----------------------------------------------------------------------------------------


def _merged(
    listed: tuple[EndpointConfig, ...], discovered: tuple[EndpointConfig, ...] | None
) -> tuple[EndpointConfig, ...]:
    """The endpoints that should serve: those the config file lists, then those discovered (a discovered entry for a
    listed address replaces the file's, but keeps the file's GPU source: discovery gives none)."""
    if not discovered:
        return listed
    sources = {e.address: e.gpu for e in listed if e.gpu is not None}
    found = {e.address for e in discovered}
    kept = (
        e if e.gpu is not None or e.address not in sources else replace(e, gpu=sources[e.address]) for e in discovered
    )
    return (*(e for e in listed if e.address not in found), *kept)


def _token_files(config: Config) -> tuple[Path, ...]:
    """The token files ``config`` reads on each reload: the admin API's and the span receiver's."""
    sources = (config.admin_auth.token, config.otel.receiver_auth)
    return tuple(Path(source.file) for source in sources if source is not None and source.file is not None)


def _addressed(config: Config, listen_override: str | None, worker: int | None) -> Config:
    """``config`` with the command line's ``--listen`` and, for a worker of ``--workers N``, that worker's ports."""
    config = replace(config, listen=listen_override) if listen_override else config
    return config if worker is None else worker_config(config, worker)


def _log_membership(plan: Plan, pool: Pool, inflight: InFlight, reason: str) -> None:
    if plan.empty:
        return
    draining = {e.address: int(inflight.requests[e.index]) for e in pool.draining}
    parts = []
    for name, addresses in (
        ("joined", plan.joined),
        ("left", plan.left),
        ("removed", plan.removed),
        ("changed", plan.changed),
    ):
        if addresses:
            parts.append(f"{name} {', '.join(addresses)}")
    if draining:
        parts.append("draining " + ", ".join(f"{a} ({n} in flight)" for a, n in draining.items()))
    logger.info("membership (%s): %s; %d endpoints", reason, "; ".join(parts), len(pool) - len(draining))


def _saturation(config: Config, pool: Pool) -> Saturation:
    admission = config.admission
    return Saturation(admission.max_waiting, admission.max_kv_usage, speeds=_declared(config, pool))


def _collectors(
    config: Config, pool: Pool, signals: Signals, inflight: InFlight
) -> tuple[MetricsCollector | None, GpuCollector | None, KVEventCollector | None]:
    collector = None
    if config.signals.scrape_metrics:
        options = CollectorOptions(
            interval_s=config.signals.scrape_interval_s,
            timeout_s=config.signals.scrape_timeout_s,
        )
        collector = MetricsCollector(pool, signals, options, inflight=inflight)
    sources = [e.gpu for e in config.endpoints]
    gpu = GpuCollector(sources, signals, interval_s=config.signals.gpu_interval_s) if any(sources) else None
    kv = None
    if config.kv_events is not None and signals.kv is not None:
        from inferlb.scorer.kvsubscriber import KVEventCollector, KVEventOptions  # ZMQ loads with KV events only

        options = KVEventOptions(
            config.kv_events.port,
            config.kv_events.replay_port,
            config.kv_events.topic,
            config.kv_events.replay_timeout_s,
            config.kv_events.ports,
            config.kv_events.replay_ports,
            config.kv_events.max_bytes_per_s,
        )
        kv = KVEventCollector(pool, signals.kv, options)
    return collector, gpu, kv


def _bootstrap_needs(config: Config) -> tuple[frozenset[str], object, bool]:
    """What Envoy's bootstrap must do for ``config`` beyond what any config needs (`inferlb envoy-config` renders
    it): the request headers the picker reads (sessions, classes, experiments' and quotas' headers, the gateway's
    objective), whether quotas take the tenant from a JWT (a JWT filter), and whether the picker's scores go back to
    the client (``debug_scores``). A reload that needs more of it would be applied but never get it."""
    headers = {h.lower() for h in (config.session_header, config.class_header) if h}
    headers.update(config.named_headers)
    if config.inference_objectives:
        headers.update(OBJECTIVE_HEADERS)
    jwt = config.quotas.jwt if config.quotas is not None else None
    return frozenset(headers), jwt, config.debug_scores


def _kv_events(config: Config, signals: Signals, service: ExtProcService) -> None:
    """With ``kv_events``: the exact cache index on the signals, and the tokenizers on the filter. Raises
    ConfigError for a tokenizer that cannot be loaded."""
    settings = config.kv_events
    if settings is None:
        return
    tokenizers: dict[str, PromptTokenizer] = {}
    for model, source in settings.tokenizers.items():
        try:
            tokenizers[model] = PieceTokenizer() if source == "pieces" else HuggingFaceTokenizer(source)
        except TokenizerError as exc:
            raise ConfigError(f"kv_events.tokenizers.{model}: {exc}") from None
    signals.kv = KVBlockIndex(
        len(signals.snapshot),
        clock=signals.clock,
        block_size=settings.block_size,
        pending_s=settings.pending_s,
        stale_s=settings.stale_s,
        resync_s=settings.resync_s,
    )
    service.keyer = CacheKeyer(tokenizers, settings.block_size)
    service.keying_deadline_s = settings.keying_deadline_s
    service.keying_queue = settings.keying_queue


def _experiments(
    config: Config, engine: Engine, rng: np.random.Generator | None, *, vacant_ok: bool = False
) -> Experiments | None:
    """The config's experiments over ``engine``'s pool and state, or None without any (``vacant_ok``: see
    `Experiments.over`)."""
    if not config.experiments:
        return None
    return Experiments.over(
        engine, config.experiments, config.profile_spec, rng, speeds=_declared(config, engine.pool), vacant_ok=vacant_ok
    )


def _addresses(pool: Pool) -> tuple[str, ...]:
    return tuple(e.address for e in pool)


def _declared(config: Config, pool: Pool) -> np.ndarray | None:
    """The pool's declared relative speeds (``pool.speeds``), None where the config declares none or all are equal."""
    return None if config.speeds is None else config.speeds.of([e.labels for e in pool])


def _span_outcomes(service: ExtProcService, spans: SpanLoop | None) -> None:
    """With ``otel.latency_source: spans``, each server span joined to a decision tells the servers' speeds and the
    request's experiment arm its TTFT, E2E and output tokens (with ``stream``, the filter's timing of the response
    tells TTFT or E2E)."""
    if spans is None or spans.receiver is None or not spans.from_spans:
        return

    def outcome(request_id: str, record: SpanRecord) -> None:
        spans.observed(request_id, record.ttft_s, record.e2e_s, record.output_tokens)
        experiments = service.router.experiments  # read at each span: a reload may replace them
        if experiments is not None:
            experiments.observed(request_id, record.ttft_s, record.e2e_s, False, output_tokens=record.output_tokens)

    spans.receiver.joiner.outcome = outcome


def _export_changes(service: ExtProcService) -> None:
    """Each change of an experiment's weights becomes a span event, where the picker exports spans."""
    experiments = service.router.experiments
    if experiments is None:
        return

    def export(change: WeightChange) -> None:
        if service.route_spans is not None:
            service.route_spans.weight_changed(change)

    experiments.listeners.append(export)


def create_picker(
    config: Config,
    *,
    rng: np.random.Generator | None = None,
    config_path: Path | None = None,
    discovered: tuple[EndpointConfig, ...] | None = None,
    discovery: DiscoverySource | None = None,
) -> PickerProcess:
    """Everything a picker needs, built from ``config`` and nothing global: two pickers can live side by side.
    ``discovered``: the endpoints a discovery source lists already (with ``discovery``, the source that goes on
    watching once the picker starts; by default the config's own, if it names one)."""
    listed = config.endpoints
    if discovered:
        config = replace(config, endpoints=_merged(listed, discovered))
    if not config.endpoints:
        raise ConfigError("no endpoints: the config lists none and discovery has found none yet")
    if discovery is None:
        discovery = discovery_source(config)
    pool = Pool(config.endpoints)
    signals = Signals(len(pool), stale_after_s=config.signals.stale_after_s)
    profile = build_profile(
        config.profile_spec(), rng, size=len(pool), speeds=_declared(config, pool), addresses=_addresses(pool)
    )
    engine = Engine(pool, profile, signals=signals, saturation=_saturation(config, pool))
    try:
        experiments = _experiments(config, engine, rng, vacant_ok=bool(discovered))
    except ValueError as exc:  # a control arm's labels match no endpoint discovered yet, say
        raise ConfigError(f"experiments: {exc}") from None
    service = ExtProcService(
        engine,
        max_body_bytes=config.max_body_bytes,
        session_header=config.session_header,
        class_header=config.class_header,
        classifier=Classifier(config.classes, config.default_class),
        leases=OpenLeases(max_age_s=config.inflight.max_age_s) if config.inflight.end == "access-log" else None,
        experiments=experiments,
        experiment_headers=config.named_headers,
        objectives=config.inference_objectives,
    )
    service.debug_scores = config.debug_scores
    _kv_events(config, signals, service)
    collector, gpu, kv = _collectors(config, pool, signals, engine.inflight)
    spans = None
    if config.otel.receiver is not None or config.otel.latency_source == "stream":
        spans = SpanLoop(config.otel, pool, signals, config.speeds)
        service.trace_join = _trace_join(config, spans)
        if config.otel.latency_source == "stream":
            service.response_timer = spans.observe_response
            # The mirrored responses also say where each stored Responses API response lives: a request that
            # continues one is routed there (filter/storedresponses.py).
            service.stored_responses = StoredResponses()
            # Each response's first token is seen, so the prefill backlog is counted exactly (with replicas, the
            # replica whose observing stream saw it passes it on to the one that holds the lease).
            engine.inflight.first_tokens = True
        service.router.speeds = spans.speeds
        _span_outcomes(service, spans)
    if config.otel.exporter != "none" and config.otel.export_endpoint is not None:
        protocol = "grpc" if config.otel.exporter == "otlp-grpc" else "http/protobuf"
        provider = create_tracer_provider(config.otel.export_endpoint, protocol=protocol, service_name="inferlb")
        service.route_spans = RouteSpans(provider)
    _export_changes(service)
    picker = PickerProcess(
        config,
        engine,
        service,
        PickerServer(
            service,
            config.listen,
            max_message_bytes=config.max_body_bytes + GRPC_ENVELOPE_BYTES,
            control_plane=ControlPlane(XDS_CLUSTERS),
            tls=_certificates(config),
            health_listen=None if config.tls is None else config.tls.health_listen,
        ),
        rng=rng,
        config_path=config_path,
        collector=collector,
        gpu_collector=gpu,
        kv_collector=kv,
        admin_credential=_admin_credential(config),
        membership=Membership(config.slow_start),
        discovery=discovery,
        discovered=discovered,
        static_endpoints=listed,
    )
    picker.spans = spans
    picker.bootstrap_needs = _bootstrap_needs(config)
    if config.replicas is not None:
        picker.replicas = Replicas(config.replicas, lambda: picker.engine)
        service.on_routed = picker.replicas.routed
        leases = service.leases
        if leases is not None:
            # With several replicas behind one Envoy, a request's end may reach another replica than the one that
            # routed it: the exchange passes such ends on, and each replica releases the leases it holds.
            service.on_end_elsewhere = picker.replicas.ended_elsewhere
            picker.replicas.finish = lambda request_id: leases.finish(request_id, count_unknown=False)
        if engine.inflight.first_tokens:
            # Likewise a response's first token, which the replica its observing stream reached saw.
            service.on_first_token_elsewhere = picker.replicas.first_token_elsewhere
            picker.replicas.first_token = service.first_token
        # And an experiment's outcome: counted by the replica that holds the request's arm (experiments may come
        # with a reload, so this is wired whether or not the config has them now).
        service.on_outcome_elsewhere = picker.replicas.outcome_elsewhere
        picker.replicas.take_outcome = service.outcome_from_elsewhere
        # What decides whether an arm takes traffic at all (an operator's action, a guard's roll-back) is the same
        # for every replica, and outlives each: shared through Redis, read before the picker reports ready.
        picker.shared_control = SharedControl(
            config.replicas, lambda: service.router.experiments, replica_id=picker.replicas.id
        )
        if experiments is not None:
            experiments.listeners.append(picker.shared_control.changed)
    if config.quotas is not None:
        replicas = picker.replicas
        service.quotas = Quotas(
            config.quotas, config.replicas, shares=(lambda: 1) if replicas is None else (lambda: replicas.peers() + 1)
        )
    service.destinations = config.destinations
    picker.publish_endpoints()
    return picker


def discovery_source(config: Config) -> DiscoverySource | None:
    """The source ``pool.discovery`` names, or None."""
    if config.discovery is None:
        return None
    # Each source's module (and its HTTP client) loads only where the config names it: a faster start.
    if config.discovery.etcd is not None:
        from inferlb.scorer.etcd import EtcdSource

        return EtcdSource(config.discovery.etcd, config.allowed_networks)
    assert config.discovery.kubernetes is not None  # the config has exactly one
    from inferlb.scorer.kubernetes import KubernetesSource

    return KubernetesSource(config.discovery.kubernetes, config.allowed_networks)


async def first_membership(source: DiscoverySource, *, report_every_s: float = 5.0) -> tuple[EndpointConfig, ...]:
    """Run ``source`` until it lists at least one endpoint, and return that list (logging every
    ``report_every_s`` why it has not yet)."""
    found: asyncio.Future[tuple[EndpointConfig, ...]] = asyncio.get_running_loop().create_future()

    def publish(endpoints: tuple[EndpointConfig, ...]) -> None:
        if endpoints and not found.done():
            found.set_result(endpoints)

    task = asyncio.create_task(source.run(publish), name="first membership")
    try:
        while True:
            await asyncio.wait([found, task], timeout=report_every_s, return_when=asyncio.FIRST_COMPLETED)
            if found.done():
                return found.result()
            if task.done():
                task.result()  # raises what stopped it
                raise ConfigError(f"the {source.name} discovery source stopped before it found an endpoint")
            logger.warning(
                "waiting for the %s discovery source to list an endpoint: %s", source.name, source.problem or "none yet"
            )
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _expire_leases(leases: OpenLeases, peers_lost: Callable[[], bool]) -> None:
    # Off the request path: a request's lease is held and released in O(1); ageing out runs here. The book lives
    # as long as the picker (a reload cannot change inflight.end). When ``peers_lost()`` (Redis out of reach, a peer
    # gone), ends that reached other replicas may not have been passed on: the leases held then may never see theirs.
    while True:
        await asyncio.sleep(LEASE_EXPIRY_INTERVAL_S)
        if peers_lost():
            leases.may_have_lost()
        leases.expire()


def _certificates(config: Config) -> CertificateFiles | None:
    """The gRPC listener's certificate files (config ``tls``), read and checked now; ConfigError."""
    return None if config.tls is None else CertificateFiles(config.tls.cert_file, config.tls.key_file)


def _admin_credential(config: Config) -> Credential | None:
    """The admin API's token, read now (a rotated Secret file takes effect on the next reload); ConfigError."""
    source = config.admin_auth.token
    return source.read("admin_auth") if source is not None and config.admin is not None else None


def _trace_join(config: Config, spans: SpanLoop) -> TraceJoin | None:
    """The join that injected trace ids go into: only where spans come in to be joined."""
    return spans.join if config.otel.receiver is not None and config.otel.inject_traceparent else None


async def serve(
    config: Config, config_path: Path | None = None, *, listen_override: str | None = None, worker: int | None = None
) -> None:
    """Run a picker until SIGTERM or SIGINT, then drain: readiness goes NOT_SERVING while the picker goes on
    answering for ``config.drain_s`` seconds (a second signal, `SECOND_SIGNAL_AFTER_S` or more after the first,
    cuts that short), then streams still open get ``SHUTDOWN_GRACE_S`` seconds to finish. With ``config_path`` the
    file is watched and reloaded on change.
    ``worker``: this picker is that worker of ``inferlb serve --workers N`` (its ports follow; inferlb/workers.py)."""
    config = _addressed(config, listen_override, worker)
    discovered = None
    if config.discovery is not None and not config.endpoints:
        source = discovery_source(config)
        assert source is not None
        # Meanwhile the gRPC port answers health checks: alive, not ready.
        health_listen = None if config.tls is None else config.tls.health_listen
        waiting = WaitingHealth(config.listen, tls=_certificates(config), health_listen=health_listen)
        await waiting.start()
        try:
            discovered = await first_membership(source)
        finally:
            await waiting.stop()
    picker = create_picker(config, config_path=config_path, discovered=discovered)
    picker.listen_override = listen_override
    picker.worker = worker
    try:
        await picker.start()
    except BaseException:
        await picker.stop(0)  # what started (the gRPC server) stops here, not at the loop's close with a traceback
        raise
    if worker is not None:
        say_ready(asyncio.get_running_loop())
        watch_supervisor(asyncio.get_running_loop())
    # Everything built so far lives as long as the process: move it out of the collector's way, so that
    # the collections that per-request garbage triggers stay cheap.
    gc.collect()
    gc.freeze()
    # gRPC's threads (its poller, its event engine) are up: from now on they wait for the event loop to block
    # instead of preempting it (inferlb/threads.py).
    unbatched = batch_other_threads()
    if unbatched is not None:
        logger.info("the picker's helper threads keep the normal scheduling policy: %s", unbatched)
    logger.info(
        "inferlb picker listening on %s%s (policy %s, %d endpoints, metrics scrape %s, admin API %s)",
        config.listen,
        "" if worker is None else f" as worker {worker}",
        config.policy,
        len(picker.engine.pool),
        f"every {config.signals.scrape_interval_s:g} s" if config.signals.scrape_metrics else "off",
        config.admin or "off",
    )
    signalled = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled.set)
    try:
        await signalled.wait()
        signalled.clear()
        first_at = loop.time()
        drain_s = picker.config.drain_s
        logger.info("inferlb picker draining: NOT_SERVING, still answering for %.1f s", drain_s)
        draining = asyncio.create_task(picker.drain(drain_s))
        again = asyncio.create_task(_signal_again(signalled, loop, first_at + SECOND_SIGNAL_AFTER_S))
        await asyncio.wait([draining, again], return_when=asyncio.FIRST_COMPLETED)
        for task in (draining, again):
            task.cancel()
    finally:
        logger.info("inferlb picker stopping: open streams get up to %.0f s", SHUTDOWN_GRACE_S)
        await picker.stop(SHUTDOWN_GRACE_S)


async def _signal_again(signalled: asyncio.Event, loop: asyncio.AbstractEventLoop, not_before: float) -> None:
    """Return at the first signal from the loop's time ``not_before`` on; one before it is the first one's copy."""
    while True:
        await signalled.wait()
        signalled.clear()
        if loop.time() >= not_before:
            return
        logger.info("a second stop signal right after the first: the same stop (send another to cut the drain short)")


__all__ = ["PickerProcess", "create_picker", "discovery_source", "first_membership", "serve"]

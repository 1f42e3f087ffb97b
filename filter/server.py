"""The ext_proc gRPC service: one stream per HTTP request, from Envoy's headers (and body) to a routing reply.

Stream state machine, per request:

1. ``request_headers``: read path, method, request id and the session header, if one is configured. If the
   route asked for the body (``protocol_config`` says BUFFERED or BUFFERED_PARTIAL) and one is coming, reply
   "continue" and wait for it; if the route asked for one and none is coming, refuse (400); otherwise decide
   now.
2. ``request_body`` (buffered, whole or a partial buffer that hit the limit): parse it, decide, reply with
   the destination header, or refuse with an ImmediateResponse (400/404/413/503, JSON body).
3. Anything else Envoy sends (response phases, if a route turns them on) is let through unchanged.

A stream whose first message is in observability mode comes from the ``inferlb.observe`` filter instead: it is
timed (``filter/observe.py``) when the service has a ``response_timer`` and closed at once otherwise.

The decision counts the request as in flight on its endpoint until the request ends. With ``leases`` (the
default in ``inferlb serve``) the stream ends right after the decision or the refusal, and the lease waits in
`OpenLeases` for Envoy's access-log entry of that request (``filter/requestend.py``): a picker that exits or
restarts then cuts no request it has routed, whatever Envoy's failure mode. Without ``leases`` (or for a
request without an ``x-request-id``) the stream stays open until Envoy closes it, which it does when the HTTP
request finishes, fails, or the client goes away, and the lease is released then; release sits in a
``finally``, so no exit path leaks a count. Unexpected exceptions are logged and end the stream with a gRPC
error, and Envoy's failure mode decides (fail-open sends the request to the fallback cluster).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inferlb.filter.errors import (
    MalformedRequestError,
    OverloadedError,
    PayloadTooLargeError,
    QuotaExceededError,
    RequestError,
    TenantRefusedError,
    from_routing_error,
)
from inferlb.filter.observe import ObserveStats, time_response
from inferlb.filter.replies import (
    CONTINUE,
    RETRIES_HEADER,
    SCORES_LISTED,
    RouteReplies,
    error_reply,
    listed_reply,
    streamed_body,
    with_body,
    with_header,
    with_scores,
)
from inferlb.filter.request import (
    RESPONSES_PATH,
    apply_body,
    client_key,
    features_from_headers,
    served_endpoint,
    subset_hint,
    with_model,
)
from inferlb.filter.requestend import ACCESS_LOG_SERVICE, AccessLogReceiver, OpenLeases
from inferlb.filter.requestend import add_to_server as add_access_log_service
from inferlb.filter.storedresponses import StoredResponses, previous_response_id
from inferlb.filter.tls import CertificateFiles, server_credentials
from inferlb.filter.xds import ControlPlane
from inferlb.otel.receiver import TraceJoin
from inferlb.otel.routespans import RouteSpans
from inferlb.scorer.classes import Classifier
from inferlb.scorer.config import KEYING_DEADLINE_S, KEYING_QUEUE
from inferlb.scorer.decisions import DecisionLog
from inferlb.scorer.engine import Engine
from inferlb.scorer.errors import RoutingError, shown
from inferlb.scorer.experiments import Experiments
from inferlb.scorer.features import RequestFeatures
from inferlb.scorer.inflight import Lease
from inferlb.scorer.quotas import Quotas
from inferlb.scorer.router import Admit, Router
from inferlb.scorer.tokenizer import CacheKeyer

logger = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE, ACCESS_LOG_SERVICE)
# What a gRPC message to the picker may hold beyond the request body: the ext_proc envelope and the few headers
# Envoy forwards (Envoy's own limit on request headers is 60 KiB by default).
GRPC_ENVELOPE_BYTES = 256 * 1024
_BUFFERED = frozenset({ProcessingMode.BUFFERED, ProcessingMode.BUFFERED_PARTIAL})
# Prompts tokenized at once by a slow tokenizer (the `tokenizers` library's batch call runs without the GIL).
TOKENIZER_THREADS = 2
# Why a request that a tokenizer would key routed without exact keys (FilterStats.unkeyed; the keyer counts the rest).
UNKEYED_REASONS = ("late", "busy")


@dataclass(slots=True)
class FilterStats:
    """Counters of the processor, cheap enough to bump on every request (event-loop owned)."""

    streams: int = 0
    routed: int = 0
    refused: Counter[int] = field(default_factory=Counter)
    failed: int = 0
    waited: int = 0
    waited_out: int = 0
    # Served-endpoint reports from the data plane, by outcome: as-picked, elsewhere (the count moved), unknown.
    served: Counter[str] = field(default_factory=Counter)
    # Requests routed without their exact cache keys, by reason (UNKEYED_REASONS).
    unkeyed: Counter[str] = field(default_factory=Counter)


class ExtProcService(external_processor_pb2_grpc.ExternalProcessorServicer):
    """Envoy's ``ExternalProcessor`` service backed by the routing unit (`scorer.router.Router`, built here from
    ``engine`` and ``classifier``). Runs on one asyncio loop.

    ``session_header`` names the request header that carries a session (or user) key for session affinity;
    header names are case-insensitive, so it is lower-cased here. Envoy must forward that header to ext_proc.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_body_bytes: int,
        session_header: str | None = None,
        class_header: str | None = None,
        classifier: Classifier | None = None,
        trace_join: TraceJoin | None = None,
        route_spans: RouteSpans | None = None,
        leases: OpenLeases | None = None,
        experiments: Experiments | None = None,
        experiment_headers: Iterable[str] = (),
        objectives: bool = False,
    ) -> None:
        for name, value in (("session_header", session_header), ("class_header", class_header)):
            if value is not None and (not value or value != value.strip()):
                raise ValueError(f"{name} must be a header name such as 'x-session-id', not {value!r}")
        self.router = Router(engine, classifier, experiments=experiments)
        self.max_body_bytes = max_body_bytes
        self.session_header = session_header.lower() if session_header is not None else None
        self.class_header = class_header.lower() if class_header is not None else None
        # The headers experiments assign by: read from each request (Envoy forwards them) into its features.
        self.experiment_headers = frozenset(h.lower() for h in experiment_headers)
        # Whether the inference objective header names the request's class (config inference_objectives).
        self.objectives = objectives
        # Whether each route reply lists the candidates' scores (config debug_scores).
        self.debug_scores = False
        # With a join, every routed request gets a W3C traceparent (continuing the client's trace if it sent one)
        # and its trace id is remembered with the endpoint, so the server's span can be matched to the decision.
        self.trace_join = trace_join
        # With route spans, the injected traceparent names the picker's own inferlb.route span.
        self.route_spans = route_spans
        # With a response timer (otel.latency_source: stream), observing streams are timed into it.
        self.response_timer: Callable[[str, float | None, float | None], None] | None = None
        # Where the stored Responses API responses it observed live (with the response timer): a request that
        # continues one is routed there (`filter.storedresponses`).
        self.stored_responses: StoredResponses | None = None
        self.observe_stats = ObserveStats()
        self._endpoints = {e.address: e.index for e in engine.pool}
        self.replies = RouteReplies(engine.pool)
        # How many endpoints a route reply names (more than one: for Envoy's Override Host cluster, best first).
        self.destinations = 1
        self.stats = FilterStats()
        self.decisions = DecisionLog()
        # With leases, routing streams end at the decision and Envoy's access log ends each request's count.
        self.leases = leases
        # Told of every decision (endpoint address, prompt block hashes): the replicas' exchange publishes them.
        self.on_routed: Callable[[str, tuple[int, ...]], None] | None = None
        # Told of each reported end of a request this picker holds no lease for (another replica may).
        self.on_end_elsewhere: Callable[[str], None] | None = None
        # Told of each first token the filter saw of a request this picker holds no lease for (the same).
        self.on_first_token_elsewhere: Callable[[str], None] | None = None
        # Told of each experiment outcome (request id, TTFT, E2E, failed) of a request whose arm this picker does not
        # hold: the response's timing, or Envoy's access log, reached this replica, and another routed it.
        self.on_outcome_elsewhere: Callable[[str, float | None, float | None, bool], None] | None = None
        # Without leases: the leases of requests whose routing stream is open, by request id (for the served
        # endpoint, which the observing stream reports).
        self._open: dict[str, Lease] = {}
        # Tenant quotas (config quotas): the tenant is the value of `quotas.config.header`, which must be among the
        # headers read into the features (experiment_headers; the picker adds it).
        self.quotas: Quotas | None = None
        # With KV events (config kv_events.tokenizers): the prompt's cache keys, for the exact cache index; a slow
        # tokenizer's run in these threads (made at the first need), at most `keying_queue` prompts held there, and a
        # request waits `keying_deadline_s` for its keys.
        self.keyer: CacheKeyer | None = None
        self.keying_queue = KEYING_QUEUE
        self.keying_deadline_s = KEYING_DEADLINE_S
        self._tokenizing: ThreadPoolExecutor | None = None
        self._keying = 0  # prompts in or waiting for the tokenizing threads

    @property
    def engine(self) -> Engine:
        return self.router.engine

    def failure_listener(self) -> Callable[[str], None] | None:
        """What Envoy's access log tells of a failed request (a 5xx, a reset): its experiment arm's outcome. Where the
        response stream told it already (``otel.latency_source: stream``), it counts only for a streamed response
        that broke off after its first token, which the stream took for a success."""
        return None if self.router.experiments is None else self._failed

    async def _keyed(self, features: RequestFeatures) -> RequestFeatures:
        """``features`` with their cache keys, computed by a slow tokenizer in a worker thread (the routing loop goes
        on meanwhile); at most `TOKENIZER_THREADS` prompts are tokenized at once. Without keys (counted in
        ``stats.unkeyed``) where `keying_queue` prompts are held there already (busy) or the keys take longer than
        `keying_deadline_s` (late: the thread finishes the job, and its keys are dropped)."""
        if self._keying >= self.keying_queue:
            self.stats.unkeyed["busy"] += 1
            return features.keyed(())
        if self._tokenizing is None:
            self._tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="inferlb-tokenize")
        job = asyncio.get_running_loop().run_in_executor(self._tokenizing, features.keying)
        self._keying += 1
        job.add_done_callback(self._keying_done)
        try:
            # shield: a late job is left to finish (a thread cannot be stopped), and is still counted as held.
            keys = await asyncio.wait_for(asyncio.shield(job), self.keying_deadline_s)
        except TimeoutError:
            self.stats.unkeyed["late"] += 1
            return features.keyed(())
        return features.keyed(keys)

    def _keying_done(self, _: object) -> None:
        self._keying -= 1

    def close(self) -> None:
        """Stop the tokenizing threads, if any ran (their jobs finish first)."""
        if self._tokenizing is not None:
            self._tokenizing.shutdown(wait=False, cancel_futures=True)
            self._tokenizing = None

    def swap_router(self, router: Router) -> None:
        """Route with ``router`` from now on (a config reload). Streams that already hold a lease release it into
        the old engine's counters; a request between its headers and its body, or waiting for capacity, is
        decided by the new one."""
        self.replies = RouteReplies(router.pool)
        self._endpoints = {e.address: e.index for e in router.pool}
        self.router = router

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        self.stats.streams += 1
        lease: Lease | None = None
        features: RequestFeatures | None = None
        raw_body: bytes | None = None
        decided = False
        # FULL_DUPLEX_STREAMED: the body's chunks as they come (Envoy forwards only what the picker sends back).
        duplex: list[bytes] | None = None
        duplex_bytes = 0
        trailers = False
        # With Envoy's own tracing on, Envoy sends its trace context on this gRPC stream and later replaces the
        # traceparent we set on the upstream request with its own: the server's span then carries Envoy's trace
        # id, so the join remembers that one too.
        envoy_trace = _envoy_trace_id(context) if self.trace_join is not None else None
        # gRPC's request iterator is an async generator. Left suspended when the stream ends at the decision, it
        # would be closed later by the event loop's async-generator finalizer (a wake-up through the loop's
        # self-pipe and a task per request): closed here instead, at the cost of one resumption.
        messages = aiter(request_iterator)
        try:
            async for message in messages:
                if message.observability_mode:
                    timer = self.response_timer
                    if timer is not None:
                        await time_response(
                            message,
                            messages,
                            self._endpoints,
                            timer,
                            self.observe_stats,
                            outcome=self._timed,
                            served=self._served_by_id,
                            body_seen=None if self.stored_responses is None else self.stored_responses.learn,
                        )
                    return
                kind = message.WhichOneof("request")
                if duplex is not None and not decided and kind in ("request_body", "request_trailers"):
                    if kind == "request_body":
                        chunk = message.request_body
                        duplex_bytes += len(chunk.body)
                        if duplex_bytes > self.max_body_bytes:
                            limit = f"request body is over the limit of {self.max_body_bytes} bytes"
                            yield self._refuse(PayloadTooLargeError(limit))
                            return
                        duplex.append(chunk.body)
                        if not chunk.end_of_stream:
                            continue  # no reply per chunk: the whole body comes back once routed
                    else:
                        trailers = True  # they end a body whose last chunk did not say so
                    raw_body = b"".join(duplex)
                    try:
                        features = apply_body(
                            features or RequestFeatures(),
                            raw_body,
                            complete=True,
                            max_bytes=self.max_body_bytes,
                            keyer=self.keyer,
                        )
                    except RequestError as exc:
                        yield self._refuse(exc)
                        return
                    if features.keying is not None:
                        features = await self._keyed(features)
                    body_reply = False  # the headers' reply, held back until the body was in
                elif decided or kind not in ("request_headers", "request_body"):
                    if kind == "response_headers" and lease is not None and message.HasField("metadata_context"):
                        # A gateway that keeps the routing stream to the response reports the endpoint that served.
                        address = served_endpoint(message.metadata_context)
                        if address is not None:
                            self.stats.served[self.router.served(lease, address, features)] += 1
                    if kind in CONTINUE:
                        yield CONTINUE[kind]
                    continue
                elif kind == "request_headers":
                    headers = message.request_headers
                    features = features_from_headers(
                        headers.headers.headers,
                        self.session_header,
                        self.class_header,
                        self.experiment_headers,
                        self.objectives,
                    )
                    if message.HasField("metadata_context"):  # the gateway's subset hint, if it sent one
                        hint = subset_hint(message.metadata_context)
                        if hint is not None:
                            features = features.hinted(hint)
                    body_mode = message.protocol_config.request_body_mode
                    wants_body = body_mode in _BUFFERED or body_mode == ProcessingMode.FULL_DUPLEX_STREAMED
                    if body_mode == ProcessingMode.FULL_DUPLEX_STREAMED and not headers.end_of_stream:
                        duplex = []  # the headers' reply waits for the body, which Envoy streams meanwhile
                        continue
                    if wants_body and not headers.end_of_stream:
                        yield CONTINUE["request_headers"]
                        continue
                    if wants_body and features.method == "POST":
                        yield self._refuse(MalformedRequestError("request body is empty; expected a JSON object"))
                        return
                    body_reply = False
                else:
                    if features is None:
                        features = RequestFeatures()
                    body = message.request_body
                    raw_body = body.body
                    try:
                        features = apply_body(
                            features,
                            body.body,
                            complete=body.end_of_stream,
                            max_bytes=self.max_body_bytes,
                            keyer=self.keyer,
                        )
                    except RequestError as exc:
                        yield self._refuse(exc)
                        return
                    if features.keying is not None:
                        features = await self._keyed(features)
                    body_reply = True
                decided = True
                stored = self.stored_responses
                if stored is not None and raw_body is not None and features.subset is None:
                    features = self._continuing(stored, features, raw_body)
                quotas = self.quotas
                charged = None
                if quotas is not None:
                    over, charged = self._over_quota(quotas, features)
                    if over is not None:
                        yield self._refuse(over)
                        return
                router, asked = self.router, features
                admit = router.admit(features)
                features = admit.request
                refusal, saturated = None, False
                if admit.verdict != "go":  # shed, or wait for capacity: the only awaiting on the way
                    try:
                        refusal, saturated = await self._not_admitted(admit)
                    except asyncio.CancelledError:
                        # The client left while it waited (Envoy's message timeout, which outlasts any wait
                        # `inferlb envoy-config` allows, is not it): it never reached a server.
                        if quotas is not None and charged is not None:
                            quotas.refund(*charged)
                        raise
                    if refusal is None and self.router is not router:
                        # A reload while it waited: its admission (class, candidates, arm) describes the old pool
                        # and policy. The routing in force admits it again; it has waited its turn already.
                        admit = self.router.admit(asked)
                        features = admit.request
                        saturated = saturated or admit.verdict != "go"
                if refusal is not None:
                    if self.route_spans is not None:
                        self.route_spans.refused(features, refusal.status, refusal.type, time.time_ns())
                    if quotas is not None and charged is not None:
                        quotas.refund(*charged)  # it never reached a server: its tenant keeps its tokens
                    yield self._refuse(refusal)
                    return  # an ImmediateResponse ends the request: nothing more will come
                replies = self.replies.body if body_reply else self.replies.headers  # the pool's in force now
                reply, lease, forwarded = self._route(
                    features, replies, saturated, envoy_trace, raw_body, streamed=duplex is not None
                )
                if lease is None and quotas is not None and charged is not None:
                    quotas.refund(*charged)
                yield reply
                if lease is None:
                    return  # refused by the engine
                if duplex is not None:
                    for part in streamed_body(forwarded or b"", trailers=trailers):
                        yield part
                leases = self.leases
                if leases is not None and features.request_id:
                    # Nothing more to say on this stream. Ending it here means a picker that exits later cannot cut
                    # this request; its end comes through Envoy's access log.
                    leases.hold(features.request_id, lease)
                    lease = None
                    return
                if features.request_id:
                    self._open[features.request_id] = lease
        except Exception:
            self.stats.failed += 1
            logger.exception("ext_proc stream failed; Envoy's failure mode decides what happens to the request")
            raise
        finally:
            if lease is not None:
                lease.release()
                if features is not None and self._open.get(features.request_id) is lease:
                    del self._open[features.request_id]
            aclose = getattr(messages, "aclose", None)
            if aclose is not None:
                await aclose()

    def _continuing(self, stored: StoredResponses, features: RequestFeatures, body: bytes) -> RequestFeatures:
        """``features`` pinned to the server that stored the response the request continues, where it is a Responses
        API request naming one this picker observed, on a serving member; else as they are."""
        if features.path.partition("?")[0] != RESPONSES_PATH:
            return features
        previous = previous_response_id(body)
        if previous is None:
            return features
        home = stored.home(previous)
        if home is None:
            return features
        index = self.router.pool.find(home)
        if index is None or self.router.pool.endpoints[index].draining:
            stored.stats.gone += 1
            return features
        stored.stats.pinned += 1
        return features.hinted(frozenset({home}))

    def _over_quota(
        self, quotas: Quotas, features: RequestFeatures
    ) -> tuple[RequestError | None, tuple[str | None, int] | None]:
        """Charge the request to its tenant's quota: the 429 that refuses it (or the 403 of a token that names no
        usable tenant), or what was charged (tenant, tokens: to be given back if the request is refused later, and
        never reaches a server)."""
        config = quotas.config
        tenant = features.headers.get(config.header or "") if features.headers else None
        if config.jwt is not None:
            problem = _tenant_problem(tenant, config.jwt.claim)
            if problem is not None:
                if self.route_spans is not None:
                    self.route_spans.refused(features, 403, TenantRefusedError.type, time.time_ns())
                return TenantRefusedError(problem), None
        if tenant is not None:
            tenant = client_key(tenant)  # up to max_tenants of them are kept
        output = features.max_tokens if features.max_tokens is not None else config.assumed_output_tokens
        output *= features.output_copies
        tokens = features.prompt_tokens + output
        refusal = quotas.charge(tenant, tokens)
        if refusal is None:
            return None, (tenant, tokens)
        if self.route_spans is not None:
            self.route_spans.refused(features, 429, QuotaExceededError.type, time.time_ns())
        return QuotaExceededError(refusal), None

    def _timed(self, request_id: str, ttft_s: float | None, e2e_s: float | None, failed: bool) -> None:
        """The filter timed request ``request_id``'s response (or saw it fail): its lease learns that its prompt is
        prefilled (the exact prefill backlog, `InFlight.first_tokens`), and its experiment arm and the servers'
        speeds are told."""
        if not self.first_token(request_id) and self.on_first_token_elsewhere is not None:
            self.on_first_token_elsewhere(request_id)
        router = self.router  # read now: a reload may have replaced it since the request was routed
        if router.speeds is not None and not failed:
            router.speeds.observed(request_id, ttft_s, e2e_s)
        experiments = router.experiments
        if experiments is None:
            return
        if self.on_outcome_elsewhere is not None and not experiments.holds(request_id):
            self.on_outcome_elsewhere(request_id, ttft_s, e2e_s, failed)
        else:
            experiments.observed(request_id, ttft_s, e2e_s, failed)

    def _failed(self, request_id: str) -> None:
        """Envoy's access log reports request ``request_id`` failed: its experiment arm's outcome, here or, where
        another replica holds its arm, there."""
        experiments = self.router.experiments
        if experiments is None:
            return
        if self.on_outcome_elsewhere is not None and not experiments.holds(request_id):
            self.on_outcome_elsewhere(request_id, None, None, True)
        else:
            experiments.failed(request_id)

    def outcome_from_elsewhere(self, request_id: str, ttft_s: float | None, e2e_s: float | None, failed: bool) -> bool:
        """Another replica's experiment outcome of request ``request_id`` (`on_outcome_elsewhere` there): taken if
        this picker holds its arm (True then)."""
        experiments = self.router.experiments
        if experiments is None or not experiments.holds(request_id):
            return False
        if failed and ttft_s is None and e2e_s is None:
            experiments.failed(request_id)  # Envoy's access log's: it may correct a success at the first token
        else:
            experiments.observed(request_id, ttft_s, e2e_s, failed)
        return True

    def _served_by_id(self, request_id: str, address: str) -> None:
        """The served endpoint the observing stream of request ``request_id`` reported: its lease (held, or that of
        its open routing stream) moves if a retry served it elsewhere."""
        lease = self._lease_of(request_id)
        outcome = "unknown" if lease is None else self.router.served(lease, address, request_id=request_id)
        self.stats.served[outcome] += 1

    def first_token(self, request_id: str) -> bool:
        """Request ``request_id``'s first token came: its lease, if this picker holds it (True then), takes its
        prompt out of the exact prefill backlog."""
        lease = self._lease_of(request_id)
        if lease is None:
            return False
        lease.first_token()
        return True

    def _lease_of(self, request_id: str) -> Lease | None:
        """The lease of request ``request_id`` that this picker holds (or that of its open routing stream)."""
        leases = self.leases
        return leases.lease_of(request_id) if leases is not None else self._open.get(request_id)

    async def _not_admitted(self, admit: Admit) -> tuple[RequestError | None, bool]:
        """For a request admission did not let go ahead at once: a refusal (shed, 429), or None to go ahead after
        waiting up to its class's ``max_wait_s`` for capacity; then whether it goes though still saturated (it
        waited out)."""
        features = admit.request
        request_class = admit.request_class
        if admit.verdict == "shed":
            self.decisions.shed[request_class.name] += 1
            return (
                OverloadedError(
                    f"every endpoint that serves {shown(features.model)} is saturated and requests of class "
                    f"{request_class.name!r} are shed under load; retry after {request_class.retry_after_s} s",
                    request_class.retry_after_s,
                ),
                False,
            )
        self.stats.waited += 1
        if await self.router.wait(admit):
            return None, False
        self.stats.waited_out += 1  # no capacity came: route to the best of the saturated anyway
        return None, True

    def _route(
        self,
        features: RequestFeatures,
        replies: tuple[ProcessingResponse, ...],
        saturated: bool = False,
        envoy_trace: bytes | None = None,
        body: bytes | None = None,
        *,
        streamed: bool = False,
    ) -> tuple[ProcessingResponse, Lease | None, bytes | None]:
        """The reply that routes ``features``, its lease and the body to forward; or a refusal (no lease).
        ``body``: the request's body, which a release arm that sends its requests as another model rewrites: in
        the reply, or, ``streamed`` (FULL_DUPLEX_STREAMED, where the body goes back in pieces after the reply), in
        the body returned."""
        spans = self.route_spans
        started_ns = time.time_ns() if spans is not None else 0
        try:
            routed = self.router.route(features, saturated=saturated)
        except RoutingError as exc:
            error = from_routing_error(exc)
            self.decisions.record_refusal(features.request_id, features.model, error.status)
            if spans is not None:
                spans.refused(features, error.status, error.type, started_ns)
            return self._refuse(error), None, None
        decision = routed.decision
        arm = routed.arm
        label = None if arm is None else (arm.experiment, arm.name)
        self.decisions.record(features.request_id, features.model, decision, routed.pick_s, label)
        index = decision.endpoint.index
        self.stats.routed += 1
        if self.on_routed is not None:
            self.on_routed(decision.endpoint.address, features.prefix_hashes)
        reply = replies[index]
        if self.destinations > 1:
            # The chosen endpoint first, then the next best: where Envoy retries a request that never arrived.
            ranked = decision.ranked[: self.destinations] if len(decision.candidates) > 1 else (index,)
            if len(ranked) > 1:
                endpoints = self.router.pool.endpoints
                reply = listed_reply(",".join(endpoints[i].address for i in ranked), replies is self.replies.body)
            if len(ranked) < self.destinations:
                # Fewer candidates than the retries Envoy was rendered for: past this list, Override Host would
                # retry on any member (one without the model, or one a release arm keeps apart).
                reply = with_header(reply, RETRIES_HEADER, str(len(ranked) - 1))
        if self.debug_scores:
            endpoints = self.router.pool.endpoints
            by = dict(zip(decision.candidates.tolist(), decision.totals.tolist(), strict=True))
            ranked = [f"{endpoints[i].address}={by[i]:.3f}" for i in decision.ranked[:SCORES_LISTED]]
            reply = with_scores(reply, ",".join(ranked))
        if arm is not None and arm.spec.model is not None and body is not None:
            # features.model is already the arm's (admission set it); the client's body still names its own.
            try:
                body = with_model(body, arm.spec.model)
            except RequestError as exc:  # apply_body read this body, so only a parser's disagreement gets here
                routed.lease.release()
                return self._refuse(exc), None, None
            if not streamed:
                reply = with_body(reply, body)
        join = self.trace_join
        traced = spans.routed(features, decision, started_ns) if spans is not None else None
        if traced is None:
            if join is None:
                return reply, routed.lease, body
            trace_id = _trace_id(features.traceparent) or os.urandom(16)
            traceparent = f"00-{trace_id.hex()}-{os.urandom(8).hex()}-01"
        else:
            trace_id, traceparent = traced
        if join is not None:
            # One decision, one span: Envoy's trace id (with Envoy's tracing on) is an alias of the same decision.
            # The span id: the parent the server's span names, which tells this request's span from those of the
            # client's other requests in the same trace.
            span_id = bytes.fromhex(traceparent[36:52])
            join.record(trace_id, index, also=envoy_trace, request_id=features.request_id, span_id=span_id)
        return with_header(reply, "traceparent", traceparent), routed.lease, body

    def _refuse(self, error: RequestError) -> ProcessingResponse:
        self.stats.refused[error.status] += 1
        return error_reply(error)


def _envoy_trace_id(context: grpc.aio.ServicerContext) -> bytes | None:
    try:
        metadata = context.invocation_metadata() or ()
    except Exception:  # a context without metadata (a test double): nothing to learn
        return None
    for key, value in metadata:
        if key == "traceparent":
            return _trace_id(value if isinstance(value, str) else value.decode("latin-1"))
    return None


def _trace_id(traceparent: str | None) -> bytes | None:
    """The trace id of a valid W3C ``traceparent`` (version 00), else None."""
    if traceparent is None or len(traceparent) != 55:
        return None
    version, trace, span, flags = [*traceparent.split("-"), "", "", "", ""][:4]
    if version != "00" or len(trace) != 32 or len(span) != 16 or len(flags) != 2:
        return None
    try:
        raw = bytes.fromhex(trace)
        bytes.fromhex(span + flags)
    except ValueError:
        return None
    return raw if any(raw) else None


async def _listen(server: grpc.aio.Server, listen: str, tls: CertificateFiles | None = None) -> int:
    """Bind ``server`` to ``listen`` (with TLS, given its files) and start it; the port bound. OSError naming the
    address if it cannot."""
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, server_credentials(tls))
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {listen}: {exc}") from exc
    await server.start()
    return port


class HealthListener:
    """gRPC health alone, in plaintext, at ``listen`` (config ``tls.health_listen``): what a kubelet's gRPC probe,
    which cannot speak TLS, asks when the picker's own port serves TLS. It answers from ``health``, the servicer of
    the picker's port, so both say the same."""

    def __init__(self, listen: str, servicer: health.aio.HealthServicer) -> None:
        self.listen = listen
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self._server)
        self.port: int | None = None

    async def start(self) -> None:
        self.port = await _listen(self._server, self.listen)

    async def stop(self, grace: float | None = 0) -> None:
        await self._server.stop(grace)


class WaitingHealth:
    """The picker's gRPC port while it waits for its discovery source's first member, before it can route: gRPC
    health only, ``liveness`` SERVING (the process is fine: a kubelet must not restart it) and the rest
    NOT_SERVING (it takes no request yet). ``stop`` frees the port (and ``health_listen``'s) for the
    `PickerServer`."""

    def __init__(self, listen: str, *, tls: CertificateFiles | None = None, health_listen: str | None = None) -> None:
        self.listen = listen
        self.tls = tls
        self.health = health.aio.HealthServicer()
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._plain = None if health_listen is None else HealthListener(health_listen, self.health)
        self.port: int | None = None

    async def start(self) -> None:
        self.port = await _listen(self._server, self.listen, self.tls)
        if self._plain is not None:
            await self._plain.start()
        for name in HEALTH_SERVICES:
            alive = name == "liveness"
            await self.health.set(
                name, health_pb2.HealthCheckResponse.SERVING if alive else health_pb2.HealthCheckResponse.NOT_SERVING
            )

    async def stop(self) -> None:
        if self._plain is not None:
            await self._plain.stop()
        await self._server.stop(0)


class PickerServer:
    """The picker's gRPC server: the ext_proc service, Envoy's access-log service (which ends held leases) and
    gRPC health (``liveness``, ``readiness`` and the service names). ``start`` binds and serves; ``stop`` reports
    NOT_SERVING, then lets open streams finish for ``grace`` seconds.

    ``max_message_bytes`` bounds one gRPC message; it must exceed the largest body Envoy forwards (the config's
    ``max_body_bytes``) by the envelope, or a body under the limit fails the stream and, with fail-open, goes
    upstream without a decision. It is fixed for the server's life."""

    def __init__(
        self,
        service: ExtProcService,
        listen: str,
        *,
        max_message_bytes: int = 4 << 20,
        control_plane: ControlPlane | None = None,
        tls: CertificateFiles | None = None,
        health_listen: str | None = None,
    ) -> None:
        self.service = service
        self.control_plane = control_plane
        self.listen = listen
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        self.health = health.aio.HealthServicer()
        self._server = grpc.aio.server(
            options=[
                # SO_REUSEPORT is on by default in gRPC: a second picker on the same port would share it silently.
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ]
        )
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(service, self._server)
        self._access_logs = AccessLogReceiver(
            lambda: service.leases, service.failure_listener, lambda: service.on_end_elsewhere
        )
        add_access_log_service(self._access_logs, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        if control_plane is not None:  # Envoy's endpoints over ADS (filter/xds.py)
            ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(control_plane, self._server)
        self._plain = None if health_listen is None else HealthListener(health_listen, self.health)
        self.port: int | None = None

    async def start(self) -> None:
        self.port = await _listen(self._server, self.listen, self.tls)
        if self._plain is not None:
            await self._plain.start()
        for name in HEALTH_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self) -> None:
        """Report NOT_SERVING (readiness and the services), and go on serving: a load balancer in front stops
        sending new requests, and those it still sends are answered."""
        for name in ("readiness", EXT_PROC_SERVICE, ACCESS_LOG_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.drain()
        self._access_logs.close()  # Envoy's access-log streams never end on their own
        if self._plain is not None:
            await self._plain.stop()
        await self._server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


def _tenant_problem(tenant: str | None, claim: str) -> str | None:
    """Why a tenant that Envoy took from the token's ``claim`` cannot be charged (None: it can). A token without the
    claim would share one unnamed tenant with every other such token; a name with control characters or spaces
    around it is one Envoy would not forward as sent."""
    if not tenant:
        return f"the request's token names no tenant: its claim {claim!r} is missing or empty"
    if not tenant.isprintable() or tenant != tenant.strip():
        return f"the tenant the request's token names ({shown(tenant)}) has control characters or spaces around it"
    return None

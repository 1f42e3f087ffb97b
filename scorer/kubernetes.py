"""The Kubernetes discovery source: the pool's endpoints are the Pods a label selector picks, or the endpoints of
a Service's EndpointSlices, watched.

Pods: the shape of the Gateway API Inference Extension's InferencePool, a ``selector`` (labels every serving Pod
has) and ``target_ports``; each ready Pod gives one endpoint per target port at its Pod IP (never a name: Envoy's
ORIGINAL_DST needs an IP, and a Pod IP is the server itself): on a dual-stack cluster, the one of its ``podIPs`` in
the family that ``pool.allowed_networks`` admits (IPv4 where it admits both), as for EndpointSlices below. A Pod is
ready when its ``Ready`` condition is true and it is not being deleted; one that is not ready leaves the pool (and
drains) until it is ready again. The Pod's labels become the endpoint's labels, and the annotation
``inferlb.io/models`` (comma-separated) its models.

EndpointSlices: ``service`` names a Service; its slices (label ``kubernetes.io/service-name``) list the serving
addresses with their readiness, which Kubernetes itself keeps from the Pods' probes. Each endpoint of a slice
gives one endpoint per TCP port of the slice (those of ``target_ports`` only, when it is set) at its first
address; one that is not serving (its ``serving`` condition, else ``ready``: a Service that publishes not-ready
addresses marks every endpoint ready) or is terminating leaves the pool and drains. A Pod (the endpoint's ``targetRef``)
counts once however many slices list it: a Pod moving between two slices counts as ready if either says so, and
a dual-stack Service, which lists every Pod in a slice of each address family, gives one endpoint per Pod, in the
family that ``pool.allowed_networks`` admits (IPv4 where it admits both). Endpoints with no ``targetRef`` are
taken in that family only, where the Service has slices of both. The slice's labels (the Service's) become the
endpoint's, with the endpoint's zone as ``topology.kubernetes.io/zone``.

It speaks the API's list-then-watch protocol over HTTP (httpx): ``GET .../pods?labelSelector=...&limit=100`` (or
``.../endpointslices``), page after page (``continue``), for the state and its ``resourceVersion``, then
``...&watch=true&resourceVersion=RV&allowWatchBookmarks=true&timeoutSeconds=300`` for the events, one JSON object
per line (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR). A list page's body is parsed off the event loop and may not
exceed a bound. A watch the server ends (its ``timeoutSeconds``) is followed by the next from the last version
seen. The source never waits without a deadline: a list page not whole within ``timeout_s`` (however its bytes
trickle in: httpx's own timeout is per read), or a watch not ended ``timeout_s`` past its ``timeoutSeconds``
(silent, or kept open with blank lines), is a failure; so is a list whose pages do not end (a continue token given
twice, or more pages than `Pacing` allows). Every failure (a refusal, an error, a lost connection) starts over from
a fresh list after a backoff (`Pacing`) that only a watch that delivered a change (a bookmark is not one) or lasted
resets, and never shorter than a ``Retry-After`` (in seconds or an HTTP date); an expired version (410 Gone, or an
ERROR event saying so) lists again at once, and after a backoff when it recurs before anything was delivered. A
defect (an unexpected exception) is reported with its traceback and retried the same way. Meanwhile the last
membership stays in force. An object without the shape the API gives it (a status that is not an object, say) gives
no endpoint: it is skipped with its reason (logged, and in ``skipped``), and the others stand. Health says whether
a watch is established; each change of it is logged once.

In a cluster it authenticates with the Pod's service-account token (re-read at each request: it is rotated) and
trusts the cluster's CA (the certificate of any API server not reached over plain ``http://`` is verified, however
the scheme is spelt); RBAC needs ``list`` and ``watch`` on ``pods`` (or on ``endpointslices`` of the API group
``discovery.k8s.io``) in the namespace.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import os
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import orjson

from inferlb.scorer.config import EndpointConfig, KubernetesConfig
from inferlb.scorer.discovery import MAX_SKIPPED, Members, Skipped, SourceHealth
from inferlb.scorer.networks import Networks

__all__ = ["MODELS_ANNOTATION", "SERVICE_LABEL", "KubernetesSource", "Pacing"]

logger = logging.getLogger(__name__)

MODELS_ANNOTATION = "inferlb.io/models"
SERVICE_LABEL = "kubernetes.io/service-name"  # the label that ties an EndpointSlice to its Service
ZONE_LABEL = "topology.kubernetes.io/zone"
MAX_LINE_BYTES = 4 << 20  # one watch event is one object; a Pod is a few KB
PARSE_ON_LOOP_BYTES = 64 << 10  # a watch event longer than this is parsed off the event loop
MAX_ERROR_BYTES = 64 << 10  # what is read of a refusal's body (for its message)


@dataclass(frozen=True, slots=True)
class Pacing:
    """How the source paces its requests to the API server (the defaults suit a real one; tests shorten them).

    After a failure it waits ``retry_s``, doubling to ``max_retry_s`` while failures go on, each wait drawn
    between half and all of that (so that replicas spread out), and never less than a ``Retry-After`` (up to
    ``max_retry_after_s``). A watch that delivered a change (ADDED, MODIFIED or DELETED: a bookmark alone is no
    sign that watching works, a server may send one and fail each time) or stayed open ``settled_s`` (or half of
    ``watch_s``, if less) resets the backoff. ``watch_s``: how long the server is asked to keep a watch open
    (``timeoutSeconds``, whole seconds). ``page``: the objects per list request (a page is parsed on a worker
    thread, but orjson holds the GIL while it parses: the page's size bounds how long the event loop waits, and
    500 Pods with their managedFields make it tens of milliseconds); ``max_page_bytes``: the largest page read;
    ``max_pages``: the most pages of one list (a server whose continue tokens never end fails the list instead of
    holding it forever)."""

    retry_s: float = 0.25
    max_retry_s: float = 30.0
    max_retry_after_s: float = 60.0
    watch_s: int = 300
    settled_s: float = 10.0
    page: int = 100
    max_page_bytes: int = 64 << 20
    max_pages: int = 10_000


class KubernetesError(Exception):
    """The API server answered, but not with what the source needs (the message says what)."""


class _Expired(KubernetesError):
    """The watch's resourceVersion (or the list's continue token) is too old: list again."""


class _Malformed(KubernetesError):
    """An object without the shape the API gives it (the message says where): it is skipped, the others stand."""


class _Refused(KubernetesError):
    """The API server refused a request; ``retry_after``: the seconds it asked the client to wait (or None)."""

    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class _Member:
    """One endpoint an object gives: its key (one per Pod and port), its discovery entry (scorer.discovery's JSON),
    whether it is ready, and for a slice's endpoint its address family and whether it names its Pod."""

    key: str
    entry: bytes
    ready: bool
    family: str = ""
    anonymous: bool = False


@dataclass(frozen=True, slots=True)
class _Found:
    """What one object gives: its address family (a slice's ``addressType``) and its endpoints, or why it gives
    none (``problem``: it is malformed)."""

    family: str
    members: tuple[_Member, ...]
    problem: str | None = None


class KubernetesSource(SourceHealth):
    """Watches the Pods of ``config.selector`` (or the EndpointSlices of ``config.service``) in
    ``config.namespace`` and publishes their endpoints (all of them, after each list and each change: a burst of
    changes as a few states, see `_Publisher`) from `run`, on the event loop that runs it; list bodies are parsed
    on a worker thread. `run` returns only by cancellation."""

    name = "kubernetes"

    def __init__(
        self,
        config: KubernetesConfig,
        allowed: Networks,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        pacing: Pacing | None = None,
    ) -> None:
        self.config = config
        self.allowed = allowed
        self.pacing = pacing or Pacing()
        super().__init__()
        self.revision = ""
        self.skipped: tuple[Skipped, ...] = ()
        self._members = Members()
        self.updates = 0
        self._found: dict[str, _Found] = {}  # object -> what it gives
        self._transport = transport
        self._random = random.Random()
        self._delay = self.pacing.retry_s  # the next wait after a failure
        self._expired = 0  # watches in a row that expired before delivering anything
        self._ending = False  # watches end at once with nothing (logged once)
        # A dual-stack Service's endpoints are taken in the family that the pool admits: IPv4 unless only IPv6.
        versions = {network.version for network in allowed.networks}
        self._family = "IPv6" if versions == {6} else "IPv4"
        namespace = quote(config.namespace, safe="")
        if config.service is not None:
            self._what = "endpointslices"
            self._path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
            self._selector = f"{SERVICE_LABEL}={config.service}"
        else:
            self._what = "pods"
            self._path = f"/api/v1/namespaces/{namespace}/pods"
            self._selector = ",".join(f"{k}={v}" for k, v in sorted((config.selector or {}).items()))

    def _base_url(self) -> str:
        if self.config.api_url is not None:
            return self.config.api_url
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubernetesError("no api_url configured and not in a cluster (KUBERNETES_SERVICE_HOST is unset)")
        return f"https://{f'[{host}]' if ':' in host else host}:{port}"

    def _headers(self) -> dict[str, str]:
        path = self.config.token_file
        if path is None:
            return {}
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise KubernetesError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
        return {"authorization": f"Bearer {token}"} if token else {}

    async def _client(self, base: str) -> httpx.AsyncClient:
        """A client for one list and the watches after it (the CA file read again, off the event loop: it may have
        been rotated)."""
        verify: ssl.SSLContext | bool = False  # plain http: no TLS to verify, no trust store to load
        if urlsplit(base).scheme.lower() != "http":  # HTTPS:// is TLS too (httpx reads schemes in any case)
            verify = await asyncio.to_thread(self._trust)
        # A list's page is whole within timeout_s (see _page); a watch sets its own read deadline.
        return httpx.AsyncClient(timeout=self.config.timeout_s, verify=verify, transport=self._transport)

    def _trust(self) -> ssl.SSLContext:
        """The CAs that sign the API server's certificate: ``ca_file``'s, or the system's where it is None."""
        try:
            return ssl.create_default_context(cafile=self.config.ca_file)
        except (OSError, ssl.SSLError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise KubernetesError(f"cannot read the CA file {self.config.ca_file}: {reason}") from None

    async def run(self, publish: Callable[[tuple[EndpointConfig, ...]], None]) -> None:
        while True:
            retry_after: float | None = None
            error: Exception | None = None  # an unexpected one, logged with its traceback
            try:
                base = self._base_url()
                async with await self._client(base) as client:
                    await self._list(client, base, publish)
                    while True:  # watch after watch from the last version seen, until it expires or fails
                        if not await self._watch(client, base, publish):
                            await self._ended_at_once()
            except _Expired as exc:
                self._expired += 1
                if self._expired == 1:
                    logger.debug("kubernetes discovery lists again: %s", exc)
                    continue  # the events in between are gone, the state is not
                problem = f"{exc}, again before anything was delivered"
            except _Refused as exc:
                problem, retry_after = str(exc), exc.retry_after
            except (httpx.HTTPError, KubernetesError, ValueError, OSError) as exc:
                problem = str(exc) or type(exc).__name__
            except Exception as exc:
                # A defect rather than an outage, but no reason to stop following the API server: the next list may
                # not meet it.
                problem, error = f"unexpected {type(exc).__name__}: {exc}", exc
            self._down(problem, error)
            await asyncio.sleep(self._wait(retry_after))

    def _wait(self, retry_after: float | None) -> float:
        """The wait before the next try (and the backoff doubled for the one after)."""
        wait = self._delay * self._random.uniform(0.5, 1.0)
        self._delay = min(self._delay * 2, self.pacing.max_retry_s)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.pacing.max_retry_after_s))
        return wait

    def _settle(self) -> None:
        """A watch delivered a change or lasted: the next failure starts the backoff afresh."""
        self._delay, self._expired, self._ending = self.pacing.retry_s, 0, False

    async def _ended_at_once(self) -> None:
        # Not an error (a server shutting down ends its watches so), but no reason to ask again at once either.
        if not self._ending:
            logger.warning("kubernetes discovery: watches of %s end at once with nothing; backing off", self._what)
            self._ending = True
        await asyncio.sleep(self._wait(None))

    async def _list(
        self, client: httpx.AsyncClient, base: str, publish: Callable[[tuple[EndpointConfig, ...]], None]
    ) -> None:
        """Every object, a page at a time, then one publish of the whole membership."""
        found: dict[str, _Found] = {}
        params = {"labelSelector": self._selector, "limit": str(self.pacing.page)}
        tokens: set[str] = set()
        while True:
            body = await self._page(client, base + self._path, params)
            version, token, page = await asyncio.to_thread(self._read_page, body)
            found.update(page)
            if not token:
                break
            if token in tokens:
                raise KubernetesError(f"listing {self._what}: the API server gave a continue token twice")
            if len(tokens) + 1 >= self.pacing.max_pages:
                raise KubernetesError(f"listing {self._what}: more than {self.pacing.max_pages} pages")
            tokens.add(token)
            params["continue"] = token
        self.revision = version
        self._found = found
        await self._publish(publish)

    async def _page(self, client: httpx.AsyncClient, url: str, params: dict[str, str]) -> bytes:
        """The body of one list request, whole within ``timeout_s`` (httpx's timeout bounds each read, not a body
        that comes a byte at a time)."""
        what = f"listing {self._what}"
        try:
            async with (
                asyncio.timeout(self.config.timeout_s),
                client.stream("GET", url, params=params, headers=self._headers()) as response,
            ):
                if response.status_code == 410:  # the list took longer than the server keeps its snapshot
                    raise _Expired(f"{what}: the continue token expired (HTTP 410)")
                if response.status_code != 200:
                    raise await _refusal(what, response)
                body = await _read(response, self.pacing.max_page_bytes)
        except (httpx.ReadTimeout, TimeoutError):
            raise KubernetesError(f"{what}: no answer within {self.config.timeout_s:g} s") from None
        if body is None:
            raise KubernetesError(
                f"{what}: a page of {self.pacing.page} is over {self.pacing.max_page_bytes} bytes (the API server "
                "ignores limit, or its objects are unusually large)"
            )
        return body

    def _read_page(self, body: bytes) -> tuple[str, str, dict[str, _Found]]:
        """A list page's version, continue token and the endpoints of its objects (on a worker thread: it only
        reads the config)."""
        document = orjson.loads(body)
        if not isinstance(document, dict):
            raise KubernetesError(f"listing {self._what}: not a JSON object")
        metadata, items = document.get("metadata"), document.get("items")
        if not isinstance(metadata, dict) or not isinstance(items, list | None):
            raise KubernetesError(f"listing {self._what}: not a list (its metadata or items are not what a list has)")
        found = {_name(obj): self._found_in(obj) for obj in items or ()}
        return str(metadata.get("resourceVersion", "")), str(metadata.get("continue") or ""), found

    async def _watch(
        self, client: httpx.AsyncClient, base: str, publish: Callable[[tuple[EndpointConfig, ...]], None]
    ) -> bool:
        """One watch from ``self.revision``, until the server ends it; whether it delivered something or lasted."""
        params = {
            "labelSelector": self._selector,
            "watch": "true",
            "resourceVersion": self.revision,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.pacing.watch_s),
        }
        # The server ends the watch after watch_s (and meanwhile sends events and bookmarks): a watch open for
        # longer is gone (a lost peer, a dropped NAT entry, whether or not the kernel knows it) or kept open by
        # something that is not the API server (a proxy's keep-alive lines): either way no longer a watch.
        deadline_s = self.pacing.watch_s + self.config.timeout_s
        timeout = httpx.Timeout(self.config.timeout_s, read=deadline_s)
        loop = asyncio.get_running_loop()
        started = loop.time()
        delivered = False
        # Each publish rebuilds the picker's pool: a burst of events (a rollout) is published as a few states, not
        # one per event (see _Publisher).
        publisher = _Publisher(lambda: self._publish(publish))
        request = client.stream("GET", base + self._path, params=params, headers=self._headers(), timeout=timeout)
        try:
            async with asyncio.timeout(deadline_s), request as response:
                if response.status_code == 410:
                    raise _Expired(f"watching {self._what}: the resourceVersion expired (HTTP 410)")
                if response.status_code != 200:
                    raise await _refusal(f"watching {self._what}", response)
                self._up(f"{self.config.namespace}, {self._selector}")
                async for event in _events(response.aiter_bytes()):
                    if not self._apply(event):
                        continue
                    if not delivered:
                        delivered = True
                        self._settle()
                    publisher.changed()
            await publisher.done()  # the last state in force before the next watch
        except (httpx.ReadTimeout, TimeoutError):
            raise KubernetesError(
                f"watching {self._what}: not ended within {deadline_s:g} s (the API server was asked to end it after "
                f"{self.pacing.watch_s} s)"
            ) from None
        finally:
            publisher.cancel()  # a failure lists again, and publishes the whole state then
            lasted = loop.time() - started >= min(self.pacing.settled_s, self.pacing.watch_s / 2)
            if lasted and not delivered:
                self._settle()
        return delivered or lasted

    def _apply(self, event: dict[str, Any]) -> bool:
        """One watch event applied to the objects watched: whether it changed them (a bookmark only moves the
        version to watch from, and is no sign that watching works)."""
        kind, obj = event.get("type"), event.get("object") or {}
        if not isinstance(obj, dict):  # nothing to name it by: the state is not known any more
            raise KubernetesError(f"watching {self._what}: an event whose object is not a JSON object")
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired(f"watching {self._what}: {obj.get('message', 'the version expired')}")
            raise KubernetesError(f"watching {self._what}: error: {obj.get('message', obj)}")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            return False
        version = _metadata(obj).get("resourceVersion")
        if version:
            self.revision = str(version)
        if kind == "BOOKMARK":
            return False
        if kind == "DELETED":
            self._found.pop(_name(obj), None)
        else:
            self._found[_name(obj)] = self._found_in(obj)
        return True

    def _found_in(self, obj: Any) -> _Found:
        """What an object gives (nothing, with the reason, when it is malformed)."""
        try:
            if not isinstance(obj, dict):
                raise _Malformed("not a JSON object")
            if self.config.service is None:
                return _Found("", tuple(self._pod_members(_name(obj), obj)))
            return _Found(_text(obj.get("addressType"), "addressType"), tuple(self._slice_members(obj)))
        except _Malformed as exc:
            return _Found("", (), f"a malformed {self._what[:-1]}: {exc}")

    def _entries(self) -> dict[str, bytes]:
        """The discovery entries of the objects watched, by key: one per Pod and port, ready if any slice of the
        pool's family says so."""
        dual = {"IPv4", "IPv6"} <= {found.family for found in self._found.values()}
        found: dict[str, _Member] = {}
        for obj in self._found.values():
            ours = obj.family == self._family
            for member in obj.members:
                if dual and member.anonymous and not ours:
                    continue  # nothing says which Pod it is, and the other family's slice lists it too
                held = found.get(member.key)
                if held is None or (ours, member.ready) > (held.family == self._family, held.ready):
                    found[member.key] = member
        return {key: member.entry for key, member in found.items()}

    def _pod_members(self, name: str, pod: dict[str, Any]) -> Iterator[_Member]:
        for port in self.config.target_ports or ():
            entry = _pod_entry(pod, port, self.config.models, self._family)
            yield _Member(f"{name}:{port}", orjson.dumps(entry), entry["ready"])

    def _slice_members(self, endpoint_slice: dict[str, Any]) -> Iterator[_Member]:
        """One per endpoint and port, keyed by its Pod (by its address where it names none)."""
        family = _text(endpoint_slice.get("addressType"), "addressType")
        ports = [
            p["port"]
            for p in _array(endpoint_slice.get("ports"), "ports")
            if isinstance(p, dict) and p.get("protocol", "TCP") == "TCP" and isinstance(p.get("port"), int)
        ]
        if self.config.target_ports is not None:
            ports = [p for p in ports if p in self.config.target_ports]
        labels = dict(_mapping(_metadata(endpoint_slice).get("labels"), "metadata.labels"))
        # Every endpoint is checked before any is given: a slice counts whole or not at all.
        endpoints = [
            _mapping(endpoint, f"endpoints[{i}]")
            for i, endpoint in enumerate(_array(endpoint_slice.get("endpoints"), "endpoints"))
        ]
        for i, endpoint in enumerate(endpoints):
            addresses = _array(endpoint.get("addresses"), f"endpoints[{i}].addresses")
            if not addresses:
                continue
            # The API: all of an endpoint's addresses are fungible; the first will do.
            ip = _text(addresses[0], f"endpoints[{i}].addresses[0]")
            conditions = _mapping(endpoint.get("conditions"), f"endpoints[{i}].conditions")
            # serving is the Pod's readiness; ready is true for every Pod of a Service that publishes not-ready
            # addresses. Where serving is absent (an older API server), ready says it, and an absent ready means
            # ready (the API's own rule). A terminating endpoint drains.
            serving = conditions.get("serving")
            ready = (conditions.get("ready") if serving is None else serving) is not False
            ready = ready and not conditions.get("terminating")
            zone = endpoint.get("zone")
            ref = _mapping(endpoint.get("targetRef"), f"endpoints[{i}].targetRef")
            pod = ref.get("uid") or (f"{ref.get('namespace', '')}/{ref['name']}" if ref.get("name") else None)
            for port in ports:
                address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
                entry: dict[str, Any] = {
                    "address": address,
                    "labels": {**labels, ZONE_LABEL: str(zone)} if zone else labels,
                    "ready": ready,
                }
                if self.config.models is not None:
                    entry["models"] = sorted(self.config.models)
                key = address if pod is None else f"{pod}:{port}"
                yield _Member(key, orjson.dumps(entry), ready, family, pod is None)

    async def _publish(self, publish: Callable[[tuple[EndpointConfig, ...]], None]) -> None:
        endpoints, skipped = await self._members.endpoints(
            self._entries(), self.allowed, limit=self.config.max_endpoints
        )
        malformed = [Skipped(name, found.problem) for name, found in self._found.items() if found.problem is not None]
        if len(malformed) > MAX_SKIPPED:
            more = len(malformed) - MAX_SKIPPED
            malformed[MAX_SKIPPED:] = [
                Skipped("...", f"{more} more objects skipped (the first {MAX_SKIPPED} are listed)")
            ]
        skipped = (*malformed, *skipped)
        before = set(self.skipped)
        for entry in skipped:
            if entry not in before:
                logger.error("kubernetes discovery skips %s: %s", entry.key, entry.reason)
        self.skipped = skipped
        self.updates += 1
        publish(endpoints)


class _Publisher:
    """Publishes the membership after changes, coalesced: at once (on the event loop's next turn) when no publish is
    under way, else once more when it ends, however many changes came meanwhile; each publish takes the state as it
    is then. So the first change after a quiet spell is published without delay, a burst as a few states (the
    events that arrive while one is published are all in the next), and the last state always. At most one publish
    task is alive; `done` waits for it, `cancel` drops it. A publish that fails (a defect) is raised by the next
    `changed` or by `done`, where the watch handles failures."""

    def __init__(self, publish: Callable[[], Awaitable[None]]) -> None:
        self._publish = publish
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self._failed: Exception | None = None

    def changed(self) -> None:
        self._raise()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        else:
            self._again = True

    async def _run(self) -> None:
        try:
            while True:
                self._again = False
                await self._publish()
                if not self._again:
                    return
        except Exception as exc:
            self._failed = exc

    async def done(self) -> None:
        if self._task is not None:
            await self._task
        self._raise()

    def _raise(self) -> None:
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _metadata(obj: dict[str, Any]) -> dict[str, Any]:
    """An object's metadata ({} where it has none, or none that is an object: what names it is then empty)."""
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def _name(obj: Any) -> str:
    metadata = _metadata(obj) if isinstance(obj, dict) else {}
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


def _mapping(value: Any, where: str) -> dict[str, Any]:
    """``value``, a JSON object ({} where absent or null); `_Malformed` naming ``where`` if it is something else."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Malformed(f"{where} is not an object")
    return value


def _array(value: Any, where: str) -> list[Any]:
    """``value``, a JSON array ([] where absent or null); `_Malformed` naming ``where`` if it is something else."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _Malformed(f"{where} is not a list")
    return value


def _text(value: Any, where: str) -> str:
    """``value``, a string ("" where absent or null); `_Malformed` naming ``where`` if it is something else."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _Malformed(f"{where} is not a string")
    return value


def _ready(metadata: dict[str, Any], status: dict[str, Any]) -> bool:
    if metadata.get("deletionTimestamp"):
        return False
    conditions = [
        _mapping(c, f"status.conditions[{i}]")
        for i, c in enumerate(_array(status.get("conditions"), "status.conditions"))
    ]
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _pod_ip(status: dict[str, Any], family: str) -> str:
    """The Pod's IP in ``family`` (IPv4 or IPv6) among its ``podIPs`` (a dual-stack Pod has one of each), else its
    ``podIP`` (the primary; "" before it has one)."""
    primary = _text(status.get("podIP"), "status.podIP")
    for i, listed in enumerate(_array(status.get("podIPs"), "status.podIPs")):
        ip = _text(_mapping(listed, f"status.podIPs[{i}]").get("ip"), f"status.podIPs[{i}].ip")
        if ip and (":" in ip) == (family == "IPv6"):
            return ip
    return primary


def _pod_entry(pod: dict[str, Any], port: int, models: frozenset[str] | None, family: str) -> dict[str, Any]:
    """The discovery entry (scorer.discovery's JSON, as a dict) for one Pod and port, at its IP in ``family`` where
    it has one; ``models`` unless the Pod's annotation names its own."""
    metadata, status = _metadata(pod), _mapping(pod.get("status"), "status")
    ip = _pod_ip(status, family)
    address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    entry: dict[str, Any] = {
        "address": address,
        "labels": _mapping(metadata.get("labels"), "metadata.labels"),
        "ready": _ready(metadata, status) and bool(ip),
    }
    annotated = _mapping(metadata.get("annotations"), "metadata.annotations").get(MODELS_ANNOTATION)
    if annotated:
        entry["models"] = [m.strip() for m in str(annotated).split(",") if m.strip()]
    elif models is not None:
        entry["models"] = sorted(models)
    return entry


async def _read(response: httpx.Response, limit: int) -> bytes | None:
    """A response's body, or None once it is over ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _refusal(what: str, response: httpx.Response) -> _Refused:
    """The error for an answer other than 200, with the server's message (a Status object's) and Retry-After."""
    body = await _read(response, MAX_ERROR_BYTES) or b""
    try:
        status = orjson.loads(body)
        message = str(status["message"]) if isinstance(status, dict) and "message" in status else ""
    except ValueError:
        message = ""
    message = message or body[:200].decode("utf-8", "replace")
    return _Refused(f"{what}: HTTP {response.status_code}: {message[:200]}", _retry_after(response.headers))


def _retry_after(headers: httpx.Headers, now: datetime | None = None) -> float | None:
    """The seconds a ``Retry-After`` asks for: a number (what the API server sends) or an HTTP date (what a proxy
    in front of it may send; one already past is 0). None when absent or unreadable."""
    value = headers.get("retry-after", "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # "-0000": UTC, the only zone HTTP dates use
            when = when.replace(tzinfo=UTC)
        seconds = max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


async def _events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a watch stream, one per line (a long one parsed off the event loop)."""
    pending = bytearray()
    async for chunk in chunks:
        pending += chunk
        if b"\n" not in chunk:
            if len(pending) > MAX_LINE_BYTES:
                raise KubernetesError(f"a watch event over {MAX_LINE_BYTES} bytes")
            continue
        *lines, rest = bytes(pending).split(b"\n")
        pending = bytearray(rest)
        for line in lines:
            if len(line) > MAX_LINE_BYTES:
                raise KubernetesError(f"a watch event over {MAX_LINE_BYTES} bytes")
            if not line.strip():
                continue
            event = (
                orjson.loads(line) if len(line) < PARSE_ON_LOOP_BYTES else await asyncio.to_thread(orjson.loads, line)
            )
            if isinstance(event, dict):
                yield event

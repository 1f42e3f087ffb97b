"""The Kubernetes discovery source: the pool's endpoints are the Pods a label selector picks, or the endpoints of
a Service's EndpointSlices, watched.

Pods: the shape of the Gateway API Inference Extension's InferencePool, a ``selector`` (labels every serving Pod
has) and ``target_ports``; each ready Pod gives one endpoint per target port at its Pod IP (never a name: Envoy's
ORIGINAL_DST needs an IP, and a Pod IP is the server itself). A Pod is ready when its ``Ready`` condition is true
and it is not being deleted; one that is not ready leaves the pool (and drains) until it is ready again. The
Pod's labels become the endpoint's labels, and the annotation ``inferlb.io/models`` (comma-separated) its models.

EndpointSlices: ``service`` names a Service; its slices (label ``kubernetes.io/service-name``) list the serving
addresses with their readiness, which Kubernetes itself keeps from the Pods' probes. Each endpoint of a slice
gives one endpoint per TCP port of the slice (those of ``target_ports`` only, when it is set) at its first
address; one that is not ready or is terminating leaves the pool and drains. An address listed by two slices
(a Pod moving between them) counts once, as ready if either says so. The slice's labels (the Service's) become
the endpoint's, with the endpoint's zone as ``topology.kubernetes.io/zone``.

It speaks the API's list-then-watch protocol over plain HTTP (httpx): ``GET .../pods?labelSelector=...`` (or
``.../endpointslices``) for the state and its ``resourceVersion``, then ``...&watch=true&resourceVersion=RV`` for
the events, one JSON object per line (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR). An expired version (410 Gone,
or an ERROR event saying so), a dropped connection or any error starts over from a fresh list after a backoff;
meanwhile the last membership stays in force. In a cluster it authenticates with the Pod's service-account token
(re-read at each connection: it is rotated) and trusts the cluster's CA; RBAC needs ``list`` and ``watch`` on
``pods`` (or on ``endpointslices`` of the API group ``discovery.k8s.io``) in the namespace.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from inferlb.scorer.config import EndpointConfig, KubernetesConfig
from inferlb.scorer.discovery import Members, Skipped, SourceHealth
from inferlb.scorer.networks import Networks

__all__ = ["MODELS_ANNOTATION", "SERVICE_LABEL", "KubernetesSource"]

logger = logging.getLogger(__name__)

MODELS_ANNOTATION = "inferlb.io/models"
SERVICE_LABEL = "kubernetes.io/service-name"  # the label that ties an EndpointSlice to its Service
ZONE_LABEL = "topology.kubernetes.io/zone"
RETRY_S = 0.25
MAX_RETRY_S = 5.0
MAX_LINE_BYTES = 4 << 20  # one watch event is one object; a Pod is a few KB
WATCH_TIMEOUT_S = 300  # the server ends a watch after this long; the source starts the next from where it was


class KubernetesError(Exception):
    """The API server answered, but not with what the source needs (the message says what)."""


class _Expired(KubernetesError):
    """The watch's resourceVersion is too old: list again."""


class KubernetesSource(SourceHealth):
    """Watches the Pods of ``config.selector`` (or the EndpointSlices of ``config.service``) in
    ``config.namespace`` and publishes their endpoints."""

    name = "kubernetes"

    def __init__(
        self, config: KubernetesConfig, allowed: Networks, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.config = config
        self.allowed = allowed
        super().__init__()
        self.revision = ""
        self.skipped: tuple[Skipped, ...] = ()
        self._members = Members()
        self.updates = 0
        self._objects: dict[str, dict[str, Any]] = {}
        self._transport = transport
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

    async def run(self, publish: Callable[[tuple[EndpointConfig, ...]], None]) -> None:
        delay = RETRY_S
        verify: Any = self.config.ca_file if self.config.ca_file is not None else True
        timeout = httpx.Timeout(self.config.timeout_s, read=None)
        async with httpx.AsyncClient(timeout=timeout, verify=verify, transport=self._transport) as client:
            while True:
                try:
                    base = self._base_url()
                    await self._list(client, base, publish)
                    self._up(f"{self.config.namespace}, {self._selector}")
                    delay = RETRY_S
                    while True:  # watch after watch from the last version seen, until it expires or fails
                        await self._watch(client, base, publish)
                except _Expired:
                    continue  # list again at once: the events in between are gone, the state is not
                except (httpx.HTTPError, KubernetesError, ValueError, OSError) as exc:
                    self._down(str(exc) or type(exc).__name__)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, MAX_RETRY_S)

    async def _list(
        self, client: httpx.AsyncClient, base: str, publish: Callable[[tuple[EndpointConfig, ...]], None]
    ) -> None:
        response = await client.get(
            base + self._path, params={"labelSelector": self._selector}, headers=self._headers()
        )
        if response.status_code != 200:
            raise KubernetesError(f"listing {self._what}: HTTP {response.status_code}: {response.text[:200]}")
        document = response.json()
        self.revision = str(document.get("metadata", {}).get("resourceVersion", ""))
        self._objects = {_name(obj): obj for obj in document.get("items") or ()}
        await self._publish(publish)

    async def _watch(
        self, client: httpx.AsyncClient, base: str, publish: Callable[[tuple[EndpointConfig, ...]], None]
    ) -> None:
        params = {
            "labelSelector": self._selector,
            "watch": "true",
            "resourceVersion": self.revision,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        async with client.stream("GET", base + self._path, params=params, headers=self._headers()) as response:
            if response.status_code == 410:
                raise _Expired("resourceVersion expired")
            if response.status_code != 200:
                raise KubernetesError(f"watching {self._what}: HTTP {response.status_code}")
            async for event in _lines(response.aiter_bytes()):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Expired(obj.get("message", "resourceVersion expired"))
                    raise KubernetesError(f"watch error: {obj.get('message', obj)}")
                version = obj.get("metadata", {}).get("resourceVersion")
                if version:
                    self.revision = str(version)
                if kind == "BOOKMARK":
                    continue
                if kind == "DELETED":
                    self._objects.pop(_name(obj), None)
                elif kind in ("ADDED", "MODIFIED"):
                    self._objects[_name(obj)] = obj
                else:
                    continue
                await self._publish(publish)

    def _entries(self) -> dict[str, bytes]:
        """The discovery entries (scorer.discovery's JSON) of the objects watched, by key."""
        found: dict[str, dict[str, Any]] = {}
        for name, obj in self._objects.items():
            members = self._slice_members(obj) if self.config.service else self._pod_members(name, obj)
            for key, entry in members:
                if key not in found or (entry["ready"] and not found[key]["ready"]):
                    found[key] = entry
        return {key: orjson.dumps(entry) for key, entry in found.items()}

    def _pod_members(self, name: str, pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        for port in self.config.target_ports or ():
            yield f"{name}:{port}", _pod_entry(pod, port, self.config.models)

    def _slice_members(self, endpoint_slice: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        """One entry per endpoint and port, keyed by its address (a Pod listed by two slices counts once)."""
        ports = [
            p["port"]
            for p in endpoint_slice.get("ports") or ()
            if isinstance(p, dict) and p.get("protocol", "TCP") == "TCP" and isinstance(p.get("port"), int)
        ]
        if self.config.target_ports is not None:
            ports = [p for p in ports if p in self.config.target_ports]
        labels = dict(endpoint_slice.get("metadata", {}).get("labels") or {})
        for endpoint in endpoint_slice.get("endpoints") or ():
            addresses = endpoint.get("addresses") or ()
            if not addresses:
                continue
            ip = str(addresses[0])  # the API: all of an endpoint's addresses are fungible; the first will do
            conditions = endpoint.get("conditions") or {}
            # A ready condition that is absent means ready (the API's own rule); a terminating endpoint drains.
            ready = conditions.get("ready") is not False and not conditions.get("terminating")
            zone = endpoint.get("zone")
            for port in ports:
                address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
                entry: dict[str, Any] = {
                    "address": address,
                    "labels": {**labels, ZONE_LABEL: str(zone)} if zone else labels,
                    "ready": ready,
                }
                if self.config.models is not None:
                    entry["models"] = sorted(self.config.models)
                yield address, entry

    async def _publish(self, publish: Callable[[tuple[EndpointConfig, ...]], None]) -> None:
        endpoints, skipped = await self._members.endpoints(
            self._entries(), self.allowed, limit=self.config.max_endpoints
        )
        before = set(self.skipped)
        for entry in skipped:
            if entry not in before:
                logger.error("kubernetes discovery skips %s: %s", entry.key, entry.reason)
        self.skipped = skipped
        self.updates += 1
        publish(endpoints)


def _name(pod: dict[str, Any]) -> str:
    metadata = pod.get("metadata", {})
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


def _ready(pod: dict[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _pod_entry(pod: dict[str, Any], port: int, models: frozenset[str] | None) -> dict[str, Any]:
    """The discovery entry (scorer.discovery's JSON, as a dict) for one Pod and port; ``models`` unless the Pod's
    annotation names its own."""
    metadata, status = pod.get("metadata", {}), pod.get("status", {})
    ip = status.get("podIP") or ""
    address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    entry: dict[str, Any] = {
        "address": address,
        "labels": metadata.get("labels") or {},
        "ready": _ready(pod) and bool(ip),
    }
    annotated = (metadata.get("annotations") or {}).get(MODELS_ANNOTATION)
    if annotated:
        entry["models"] = [m.strip() for m in str(annotated).split(",") if m.strip()]
    elif models is not None:
        entry["models"] = sorted(models)
    return entry


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a watch stream, one per line."""
    text = codecs.getincrementaldecoder("utf-8")()
    buffer = ""
    async for chunk in chunks:
        buffer += text.decode(chunk)
        if len(buffer) > MAX_LINE_BYTES:
            raise KubernetesError(f"a watch event over {MAX_LINE_BYTES} bytes")
        *lines, buffer = buffer.split("\n")
        for line in lines:
            if line.strip():
                event = orjson.loads(line)
                if isinstance(event, dict):
                    yield event

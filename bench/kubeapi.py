"""A small Kubernetes API server for the Kubernetes discovery source's tests and benchmarks: Pods and
EndpointSlices, in memory.

No Kubernetes API server can run on these machines, so the source is tested against this one. It speaks the part of
the API the source uses, the way the real one does: ``GET /api/v1/namespaces/NS/pods`` (or
``/apis/discovery.k8s.io/v1/namespaces/NS/endpointslices``) with an equality ``labelSelector`` lists (a ``PodList``
or ``EndpointSliceList`` with its ``resourceVersion``, one version counter for both, as etcd keeps); ``limit``
pages the list (``metadata.continue`` names the next page; a token from before a `compact` answers 410 Gone); with
``watch=true&resourceVersion=RV`` it streams the changes after RV, one JSON event per line (ADDED, MODIFIED,
DELETED; an object that starts or stops matching the selector, relabelled, is ADDED or DELETED), until
``timeoutSeconds``, then a BOOKMARK with the current version when the watch asked for them
(``allowWatchBookmarks``); a version older than what it keeps (`compact` forgets history) answers 410 Gone.
``POST``, ``PUT`` and ``DELETE`` on the same paths change objects (what a kubelet or a controller would), and a
bearer ``token`` is checked when set. A test can make it misbehave the way API servers and networks do (the
attributes under "faults").

    python -m inferlb.bench.kubeapi --listen 127.0.0.1:6443

serves it on its own (the membership benchmark's picker then points ``api_url`` at it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

__all__ = ["KubeApi", "endpoint_slice", "pod"]

# kind -> (the resource's path under a namespace, the kind of its list)
RESOURCES = {
    "Pod": ("/api/v1/namespaces/{namespace}/pods", "PodList"),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", "EndpointSliceList"),
}


def pod(
    name: str,
    ip: str,
    labels: dict[str, str],
    *,
    ready: bool = True,
    models: str | None = None,
    also: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A Pod object as the API returns it (the fields the source reads); ``also``: its other IPs, on a dual-stack
    cluster (``podIPs`` lists ``ip``, the primary, then those)."""
    annotations = {"inferlb.io/models": models} if models else {}
    status: dict[str, Any] = {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIPs"] = [{"ip": each} for each in (ip, *also)]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": labels, "annotations": annotations},
        "status": status,
    }


def endpoint_slice(
    name: str,
    service: str,
    endpoints: list[tuple[str, bool]],
    ports: tuple[int, ...] = (8000,),
    *,
    terminating: tuple[str, ...] = (),
    zone: str | None = None,
    address_type: str = "IPv4",
    pods: Sequence[str | None] | None = None,
) -> dict[str, Any]:
    """An EndpointSlice of ``service`` (the fields the source reads): one endpoint per (ip, ready), backed by the
    Pod of the same place in ``pods`` (default ``pod-IP``; None: no Pod, no ``targetRef``). A dual-stack Service
    has a slice of each ``address_type`` (IPv4, IPv6) listing the same Pods."""
    listed = []
    for i, (ip, ready) in enumerate(endpoints):
        endpoint: dict[str, Any] = {
            "addresses": [ip],
            "conditions": {"ready": ready, "serving": ready, "terminating": ip in terminating},
        }
        backing = f"pod-{ip}" if pods is None else pods[i]
        if backing is not None:
            endpoint["targetRef"] = {"kind": "Pod", "namespace": "default", "name": backing, "uid": f"uid-{backing}"}
        if zone:
            endpoint["zone"] = zone
        listed.append(endpoint)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
        "addressType": address_type,
        "endpoints": listed,
        "ports": [{"name": f"p{port}", "port": port, "protocol": "TCP"} for port in ports],
    }


class KubeApi:
    """The store and its ASGI app (``app``)."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.version = 1
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, namespace, name)
        # (version, type, object, the object before the change or None), oldest first
        self.events: list[tuple[int, str, dict[str, Any], dict[str, Any] | None]] = []
        self.oldest = 1  # the first version a watch may start after
        self.watches = 0
        self.lists = 0
        self.requests: list[tuple[float, dict[str, str]]] = []  # (time.monotonic(), query) of each list and watch
        # ---- faults: what API servers and networks do to a client
        self.hang_lists = False  # a list is taken and never answered
        self.hang_watches = False  # a watch answers 200, then nothing more (a peer gone without FIN or RST)
        self.end_watches = False  # a watch answers 200 and ends at once with nothing (a server shutting down)
        # Seconds between the blank lines of a watch that says nothing else and never ends (a proxy's keep-alive).
        self.trickle_watches = 0.0
        # A watch answers 200 and a BOOKMARK at the current version, then ends ("end") or says the version expired
        # ("expire": a 410 ERROR event), every time.
        self.bookmark_watches: Literal["end", "expire"] | None = None
        self.trickle_lists = 0.0  # seconds between the bytes of a list's body (a server or proxy dribbling it)
        self.repeat_continue = False  # a paged list's every page names the same next page (its token never ends)
        self.refuse_watches: tuple[int, str | None] | None = None  # (status, Retry-After) for every watch
        self.after_page: Callable[[], None] | None = None  # called after each page of a paged list
        self._changed = asyncio.Event()
        self.app = self._build()

    # ---- the store, as the tests change it ---------------------------------------------------------------

    def apply(self, obj: dict[str, Any], kind: str | None = None) -> dict[str, Any]:
        metadata = obj.setdefault("metadata", {})
        key = (obj.setdefault("kind", "Pod"), metadata.setdefault("namespace", "default"), metadata["name"])
        kind = kind or ("MODIFIED" if key in self.objects else "ADDED")
        self.version += 1
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(self.version)
        before = self.objects.pop(key, None) if kind == "DELETED" else self.objects.get(key)
        if kind != "DELETED":
            self.objects[key] = stored
        self.events.append((self.version, kind, stored, before))
        self._changed.set()
        self._changed = asyncio.Event()
        return stored

    def delete(self, namespace: str, name: str, kind: str = "Pod") -> dict[str, Any] | None:
        found = self.objects.get((kind, namespace, name))
        return None if found is None else self.apply(copy.deepcopy(found), "DELETED")

    def compact(self) -> None:
        """Forget the history: open watches end with a 410 ERROR event, and a watch from an older version gets
        410 Gone (the API server's answer once etcd has compacted)."""
        self.events.clear()
        self.version += 1  # the compaction's own revision: a list from now on starts a valid watch
        self.oldest = self.version
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- the API -----------------------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        for kind, (path, list_kind) in RESOURCES.items():
            self._serve(app, kind, path, list_kind)
        return app

    def _serve(self, app: FastAPI, kind: str, path: str, list_kind: str) -> None:
        """List, watch, create, replace and delete for one kind of object at ``path``."""

        def refused(request: Request) -> Response | None:
            if self.token is not None and request.headers.get("authorization") != f"Bearer {self.token}":
                return _status(401, "Unauthorized")
            return None

        @app.get(path)
        async def listed(
            request: Request,
            namespace: str,
            labelSelector: str = "",  # the API's own parameter names
            watch: str = "",
            resourceVersion: str = "",
            timeoutSeconds: int = 300,
            allowWatchBookmarks: str = "",
            limit: int = 0,
            continue_: str = Query("", alias="continue"),
        ) -> Response:
            if (no := refused(request)) is not None:
                return no
            self.requests.append((time.monotonic(), dict(request.query_params)))
            wanted = _selector(labelSelector)
            if watch not in ("true", "1"):
                self.lists += 1
                if self.hang_lists:
                    await _until_gone(request)
                page = self._list(kind, namespace, wanted, list_kind, limit, continue_)
                if self.trickle_lists:
                    body = _trickle(bytes(page.body), self.trickle_lists)
                    return StreamingResponse(body, status_code=page.status_code, media_type="application/json")
                return page
            since = int(resourceVersion or self.version)
            if since < self.oldest:
                return _status(410, f"too old resource version: {since} ({self.oldest})")
            self.watches += 1
            if self.refuse_watches is not None:
                status, retry_after = self.refuse_watches
                refusal = _status(status, "refused")
                if retry_after is not None:
                    refusal.headers["retry-after"] = retry_after
                return refusal
            if self.hang_watches or self.end_watches:
                return StreamingResponse(_silent(None if self.end_watches else request), media_type="application/json")
            if self.trickle_watches:
                return StreamingResponse(_blank_lines(request, self.trickle_watches), media_type="application/json")
            if self.bookmark_watches is not None:
                events = [
                    {"type": "BOOKMARK", "object": {"kind": kind, "metadata": {"resourceVersion": str(self.version)}}}
                ]
                if self.bookmark_watches == "expire":
                    events.append({"type": "ERROR", "object": _gone("too old resource version")})
                lines = b"".join((json.dumps(event) + "\n").encode() for event in events)
                return Response(lines, media_type="application/json")
            bookmarks = allowWatchBookmarks in ("true", "1")
            stream = self._stream(kind, namespace, wanted, since, min(timeoutSeconds, 3600), bookmarks)
            return StreamingResponse(stream, media_type="application/json")

        @app.post(path)
        async def create(namespace: str, request: Request) -> Response:
            if (no := refused(request)) is not None:
                return no
            obj = await request.json()
            obj["kind"] = kind
            obj.setdefault("metadata", {})["namespace"] = namespace
            return JSONResponse(self.apply(obj), status_code=201)

        @app.put(path + "/{name}")
        async def replace(namespace: str, name: str, request: Request) -> Response:
            if (no := refused(request)) is not None:
                return no
            obj = await request.json()
            obj["kind"] = kind
            obj.setdefault("metadata", {}).update(namespace=namespace, name=name)
            return JSONResponse(self.apply(obj))

        @app.delete(path + "/{name}")
        async def remove(namespace: str, name: str, request: Request) -> Response:
            if (no := refused(request)) is not None:
                return no
            gone = self.delete(namespace, name, kind)
            return _status(404, "not found") if gone is None else JSONResponse(gone)

    def _list(
        self, kind: str, namespace: str, wanted: dict[str, str], list_kind: str, limit: int, token: str
    ) -> Response:
        """A page of the list: ``limit`` objects (0: all) after the name that ``token`` carries. The real server
        serves every page from the snapshot of the first; this one serves the current objects under the first
        page's version (a watch from there replays what changed since, which the client applies again)."""
        version, after = self.version, ""
        if token:
            number, _, after = token.partition("/")
            version = int(number)
            if version < self.oldest:
                return _status(410, "The provided continue parameter is too old to display a consistent list result")
        items = [
            obj
            for (k, ns, name), obj in sorted(self.objects.items())
            if k == kind and ns == namespace and name > after and _matches(obj, wanted)
        ]
        metadata = {"resourceVersion": str(version)}
        if 0 < limit < len(items):
            items = items[:limit]
            metadata["continue"] = f"{version}/{items[-1]['metadata']['name']}"
            if self.repeat_continue and token:
                metadata["continue"] = token
        if limit and self.after_page is not None:
            self.after_page()
        return JSONResponse({"kind": list_kind, "apiVersion": "v1", "metadata": metadata, "items": items})

    async def _stream(
        self, kind: str, namespace: str, wanted: dict[str, str], since: int, timeout_s: float, bookmarks: bool
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if since < self.oldest:
                yield (json.dumps({"type": "ERROR", "object": _gone("too old resource version")}) + "\n").encode()
                return
            for version, change, obj, before in list(self.events):
                if version <= since:
                    continue
                since = version
                if obj["kind"] != kind or obj["metadata"].get("namespace") != namespace:
                    continue
                seen = _seen(change, obj, before, wanted)
                if seen is not None:
                    yield (json.dumps({"type": seen[0], "object": seen[1]}) + "\n").encode()
            left = deadline - loop.time()
            if left > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
                    continue
            if bookmarks:  # where the next watch may start, even when nothing here changed
                bookmark = {"kind": kind, "metadata": {"resourceVersion": str(self.version)}}
                yield (json.dumps({"type": "BOOKMARK", "object": bookmark}) + "\n").encode()
            return


async def _until_gone(request: Request) -> None:
    """Wait, answering nothing, until the client goes away (at most an hour)."""
    for _ in range(36_000):
        if await request.is_disconnected():
            return
        await asyncio.sleep(0.1)


async def _silent(request: Request | None) -> AsyncIterator[bytes]:
    """A watch's body that says nothing: ends at once (no request), or stays open until the client goes away."""
    if request is not None:
        await _until_gone(request)
    return
    yield b""  # an async generator


async def _blank_lines(request: Request, every_s: float) -> AsyncIterator[bytes]:
    """A blank line every ``every_s`` until the client goes away (at most 36,000 of them)."""
    for _ in range(36_000):
        if await request.is_disconnected():
            return
        yield b"\n"
        await asyncio.sleep(every_s)


async def _trickle(body: bytes, every_s: float) -> AsyncIterator[bytes]:
    """A body a byte at a time, ``every_s`` apart."""
    for i in range(len(body)):
        if i:
            await asyncio.sleep(every_s)
        yield body[i : i + 1]


def _gone(message: str) -> dict[str, Any]:
    """The Status of a watch's 410 ERROR event."""
    return {"kind": "Status", "status": "Failure", "code": 410, "message": message}


def _selector(text: str) -> dict[str, str]:
    pairs = [part.split("=", 1) for part in text.split(",") if part]
    return {k.strip(): v.strip() for k, v in pairs}


def _seen(
    change: str, obj: dict[str, Any], before: dict[str, Any] | None, wanted: dict[str, str]
) -> tuple[str, dict[str, Any]] | None:
    """What a watch of the selector ``wanted`` is told of a change (None: nothing), as the API server tells it: an
    object that starts matching (a relabel) is ADDED, one that stops matching is DELETED (its last state that
    matched, at the change's version)."""
    now = change != "DELETED" and _matches(obj, wanted)
    then = before is not None and _matches(before, wanted)
    if now:
        return ("MODIFIED" if then else "ADDED"), obj
    if not then or before is None:
        return None
    gone = copy.deepcopy(before)
    gone["metadata"]["resourceVersion"] = obj["metadata"]["resourceVersion"]
    return "DELETED", gone


def _matches(obj: dict[str, Any], wanted: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def _status(code: int, message: str) -> JSONResponse:
    return JSONResponse({"kind": "Status", "status": "Failure", "message": message, "code": code}, status_code=code)


def main(argv: Sequence[str] | None = None) -> int:
    from inferlb.serving import serve

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", required=True)
    args = parser.parse_args(argv)
    api = KubeApi()
    asyncio.run(serve([(args.listen, api.app)], what="kubernetes API"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

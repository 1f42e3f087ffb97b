"""A small Kubernetes API server for the Kubernetes discovery source's tests and benchmarks: Pods only, in memory.

No Kubernetes API server can run on these machines, so the source is tested against this one. It speaks the part
of the API the source uses, the way the real one does: ``GET /api/v1/namespaces/NS/pods`` with an equality
``labelSelector`` lists (a ``PodList`` with its ``resourceVersion``); with ``watch=true&resourceVersion=RV`` it
streams the changes after RV, one JSON event per line (ADDED, MODIFIED, DELETED), until ``timeoutSeconds``; a
version older than what it keeps (`compact` forgets history) answers 410 Gone. ``POST``, ``PUT`` and ``DELETE`` on
the same paths change Pods (what a kubelet or a controller would), and a bearer ``token`` is checked when set.

    python -m inferlb.bench.kubeapi --listen 127.0.0.1:6443

serves it on its own (the membership benchmark's picker then points ``api_url`` at it).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

__all__ = ["KubeApi", "pod"]


def pod(name: str, ip: str, labels: dict[str, str], *, ready: bool = True, models: str | None = None) -> dict[str, Any]:
    """A Pod object as the API returns it (the fields the source reads)."""
    annotations = {"inferlb.io/models": models} if models else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": labels, "annotations": annotations},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


class KubeApi:
    """The store and its ASGI app (``app``)."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.version = 1
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, object), oldest first
        self.oldest = 1  # the first version a watch may start after
        self.watches = 0
        self.lists = 0
        self._changed = asyncio.Event()
        self.app = self._build()

    # ---- the store, as the tests change it ---------------------------------------------------------------

    def apply(self, obj: dict[str, Any], kind: str | None = None) -> dict[str, Any]:
        metadata = obj.setdefault("metadata", {})
        key = (metadata.setdefault("namespace", "default"), metadata["name"])
        kind = kind or ("MODIFIED" if key in self.pods else "ADDED")
        self.version += 1
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(self.version)
        if kind == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = stored
        self.events.append((self.version, kind, stored))
        self._changed.set()
        self._changed = asyncio.Event()
        return stored

    def delete(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.pods.get((namespace, name))
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

        def refused(request: Request) -> Response | None:
            if self.token is not None and request.headers.get("authorization") != f"Bearer {self.token}":
                return _status(401, "Unauthorized")
            return None

        @app.get("/api/v1/namespaces/{namespace}/pods")
        async def pods(
            request: Request,
            namespace: str,
            labelSelector: str = "",  # the API's own parameter names
            watch: str = "",
            resourceVersion: str = "",
            timeoutSeconds: int = 300,
        ) -> Response:
            if (no := refused(request)) is not None:
                return no
            wanted = _selector(labelSelector)
            if watch not in ("true", "1"):
                self.lists += 1
                items = [p for (ns, _), p in sorted(self.pods.items()) if ns == namespace and _matches(p, wanted)]
                return JSONResponse(
                    {
                        "kind": "PodList",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(self.version)},
                        "items": items,
                    }
                )
            since = int(resourceVersion or self.version)
            if since < self.oldest:
                return _status(410, f"too old resource version: {since} ({self.oldest})")
            self.watches += 1
            return StreamingResponse(
                self._stream(namespace, wanted, since, min(timeoutSeconds, 3600)), media_type="application/json"
            )

        @app.post("/api/v1/namespaces/{namespace}/pods")
        async def create(namespace: str, request: Request) -> Response:
            if (no := refused(request)) is not None:
                return no
            obj = await request.json()
            obj.setdefault("metadata", {})["namespace"] = namespace
            return JSONResponse(self.apply(obj), status_code=201)

        @app.put("/api/v1/namespaces/{namespace}/pods/{name}")
        async def replace(namespace: str, name: str, request: Request) -> Response:
            if (no := refused(request)) is not None:
                return no
            obj = await request.json()
            obj.setdefault("metadata", {}).update(namespace=namespace, name=name)
            return JSONResponse(self.apply(obj))

        @app.delete("/api/v1/namespaces/{namespace}/pods/{name}")
        async def remove(namespace: str, name: str, request: Request) -> Response:
            if (no := refused(request)) is not None:
                return no
            gone = self.delete(namespace, name)
            return _status(404, "not found") if gone is None else JSONResponse(gone)

        return app

    async def _stream(
        self, namespace: str, wanted: dict[str, str], since: int, timeout_s: float
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if since < self.oldest:
                gone = {"kind": "Status", "status": "Failure", "code": 410, "message": "too old resource version"}
                yield (json.dumps({"type": "ERROR", "object": gone}) + "\n").encode()
                return
            for version, kind, obj in list(self.events):
                if version <= since:
                    continue
                since = version
                if obj["metadata"].get("namespace") == namespace and _matches(obj, wanted):
                    yield (json.dumps({"type": kind, "object": obj}) + "\n").encode()
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return


def _selector(text: str) -> dict[str, str]:
    pairs = [part.split("=", 1) for part in text.split(",") if part]
    return {k.strip(): v.strip() for k, v in pairs}


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

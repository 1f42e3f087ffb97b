"""The admin API's guard: who may read it and who may change routing through it.

The admin API can replace the pool (``POST /config``), so a write reroutes all traffic. The guard is an ASGI
middleware in front of every route; it refuses, in this order:

1. a ``Host`` that is not the admin API's own address (421): a web page can make a browser send requests to
   127.0.0.1 through a name it controls (DNS rebinding), and that name shows in ``Host``. Accepted: the address
   the admin API is bound to, ``localhost`` and loopback addresses when it is bound to loopback or to every
   interface, any IP literal when it is bound to every interface, and the names in ``admin_auth.allowed_hosts``;
2. a cross-site request (403): an ``Origin`` or ``Sec-Fetch-Site: cross-site`` header that is not this host;
3. a state-changing request (any method but GET and HEAD) without the bearer token (401), or any when no token
   is configured (403: writes are off);
4. a state-changing request whose body is not JSON or YAML by content type (415): an HTML form or a
   ``text/plain`` fetch is how a web page posts without the browser asking first;
5. a read of the configuration, the decisions or the endpoints without the token, when a token is configured
   (401). ``/healthz``, ``/readyz``, ``/metrics`` and the heatmap stay open: probes and Prometheus read them.

No CORS headers are ever sent, so a browser never lets another site read an answer, and a preflight
(``OPTIONS``) gets 405. Every refusal is JSON that says what to do. The credential is read through a callable
on every request, so a reload that rotates it takes effect at once.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from inferlb.scorer.address import parse_address
from inferlb.scorer.credentials import Credential

__all__ = ["BODY_TYPES", "OPEN_PATHS", "AdminGuard"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/heatmap", "/heatmap.json", "/heatmap.png", "/experiments"})
"""Routes anyone who passes the Host check may read: they change nothing and hold no secrets."""
BODY_TYPES = frozenset({"application/json", "application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"})
"""The content types a state-changing request may carry."""
_READ_METHODS = frozenset({"GET", "HEAD"})
_NEEDS_TOKEN = (
    401,
    "this route needs the admin token: send 'Authorization: Bearer <token>'",
    [(b"www-authenticate", b'Bearer realm="inferlb admin"')],
)


class AdminGuard:
    """ASGI middleware enforcing the rules in the module docstring for an admin API bound to ``admin`` (a
    literal ``ip:port``). ``auth()`` gives, now, the bearer token (None: none configured) and the extra ``Host``
    names allowed (lower case, no port): a reload may change both. Stateless between requests."""

    def __init__(
        self, app: ASGIApp, *, admin: str, auth: Callable[[], tuple[Credential | None, frozenset[str]]]
    ) -> None:
        self.app = app
        self.auth = auth
        host, _ = parse_address(admin)
        ip = ipaddress.ip_address(host)
        self._any_ip = ip.is_unspecified
        # localhost cannot be a rebound name; a wildcard bind is reachable on loopback too (kubectl port-forward).
        local = ip.is_loopback or ip.is_unspecified
        self._names = frozenset({host, "localhost", "127.0.0.1", "::1"} if local else {host})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message, extra = refusal
        body = orjson.dumps({"error": {"message": message, "code": status}})
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, scope: Scope) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            # A repeated Host or Authorization is ambiguous: refuse rather than guess which one counts.
            if name in headers and name in (b"host", b"authorization", b"origin", b"content-type"):
                return 400, f"the {name.decode()} header is repeated", []
            headers[name] = value
        host = headers.get(b"host", b"").decode("latin-1")
        credential, allowed_hosts = self.auth()
        if not self._host_allowed(host, allowed_hosts):
            return (
                421,
                f"Host {host[:100]!r} is not this admin API's address; if it is a name of yours for it, add it to "
                "admin_auth.allowed_hosts",
                [],
            )
        method = scope["method"]
        if method == "OPTIONS":
            return 405, "this API answers no cross-origin (CORS) requests", [(b"allow", b"GET, HEAD, POST")]
        if self._cross_site(headers, host):
            return 403, "cross-site requests are refused", []
        authorized = credential is not None and credential.matches_bearer(headers.get(b"authorization"))
        if method not in _READ_METHODS:
            if credential is None:
                return (
                    403,
                    "state-changing routes are off: no admin token is configured (set admin_auth.token_file or "
                    "admin_auth.token_env in the picker's config)",
                    [],
                )
            if not authorized:
                return _NEEDS_TOKEN
            content_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower().decode("latin-1")
            has_body = headers.get(b"content-length", b"0") not in (b"0", b"") or b"transfer-encoding" in headers
            if (has_body or content_type) and content_type not in BODY_TYPES:
                return (
                    415,
                    f"content type {content_type[:100] or 'none'!r} is refused: send application/json or "
                    "application/yaml",
                    [],
                )
            return None
        if credential is not None and scope["path"] not in OPEN_PATHS and not authorized:
            return _NEEDS_TOKEN
        return None

    def _host_allowed(self, host: str, allowed_hosts: frozenset[str]) -> bool:
        if not host:
            return False
        name, port = host.lower(), ""
        if name.startswith("["):  # [v6]:port
            name, _, rest = name[1:].partition("]")
            if rest:
                if not rest.startswith(":"):
                    return False
                port = rest[1:]
        elif ":" in name:
            name, _, port = name.partition(":")
        if port and not (port.isascii() and port.isdigit()):
            return False
        if name in self._names or name in allowed_hosts:
            return True
        if not self._any_ip:
            return False
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True  # bound to every interface: any address of this host; rebinding needs a name, not an IP

    def _cross_site(self, headers: dict[bytes, bytes], host: str) -> bool:
        if headers.get(b"sec-fetch-site", b"") == b"cross-site":
            return True
        origin = headers.get(b"origin")
        if origin is None:
            return False
        # A same-origin request carries Origin: scheme://host[:port], the host as the browser wrote it.
        text = origin.decode("latin-1").lower()
        return text.partition("://")[2] != host.lower()

"""The etcd discovery source: the pool's endpoints are the values under a key prefix, watched.

It speaks etcd v3 through the JSON gateway every etcd server has (``/v3/kv/range``, ``/v3/watch``,
``/v3/auth/authenticate``; keys and values base64 in JSON), so it needs nothing beyond httpx. The loop: read the
whole prefix and its revision, publish, then watch from the next revision and publish after each batch of events.

It never waits on a member without a deadline: authentication and reads get each part of their answer within
``timeout_s``; a watch may rightly be silent for hours, so while it is open the member is checked every
``timeout_s`` with a linearizable read of the prefix's newest change and count of keys (the source may read them;
etcd answers from its index), which must be answered within ``timeout_s``. A member that hangs (a frozen process, a
host cut off, or one cut off from its cluster's quorum, which answers no linearizable read and whose watches see no
news) is noticed within twice ``timeout_s``; so is a watch whose connection died while the member answers (the
check shows a change that the watch has not delivered by the next check). The watch asks for etcd's progress
notifications too, and one silent for `WATCH_SILENT_S` (past etcd's default progress interval of 10 minutes) is
taken for a lost connection. An auth token that a check finds refused (expired, or forgotten) is replaced there,
and the watch goes on.

Any failure (a broken connection, a deadline missed, a compacted revision, a refused auth token, a password file
that cannot be read, even a defect: everything but cancellation) starts the loop again from a fresh read, after a
backoff (``RETRY_S`` doubling to ``MAX_RETRY_S``, reset by a read that succeeds), trying the next URL: `run`
returns only when cancelled. A bad entry costs that entry only (`scorer.discovery` skips it with its reason).
While etcd is out of reach the last membership stays in force: endpoints that go unseen keep serving (their own
failures are the metrics' and the routing's business), which is safer than emptying the pool. ``healthy`` and
``problem`` say whether the source is in touch; each transition is logged once.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from inferlb.scorer.config import EndpointConfig, EtcdConfig
from inferlb.scorer.credentials import Credential
from inferlb.scorer.discovery import Members, Resolver, Skipped, SourceHealth, resolve_host
from inferlb.scorer.errors import ScorerError
from inferlb.scorer.networks import Networks

__all__ = ["EtcdSource"]

logger = logging.getLogger(__name__)

RETRY_S = 0.25
MAX_RETRY_S = 5.0
# One watch message carries one revision's events; etcd caps a request at 1.5 MiB, so a message is far below this.
MAX_MESSAGE_BYTES = 8 << 20
# etcd sends a watch that asks for them a progress notification every 10 minutes by default
# (--experimental-watch-progress-notify-interval): a watch silent for longer has lost its connection. A member
# that hangs is found sooner, by the checks made while watching (see the module's docstring).
WATCH_SILENT_S = 900.0


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's ``range_end`` for a prefix)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


class EtcdError(Exception):
    """etcd answered, but not with what the source needs (the message says what)."""


class _Unauthenticated(EtcdError):
    """etcd refused the auth token (HTTP 401): it expired, or etcd forgot it (its auth turned off and on)."""


class EtcdSource(SourceHealth):
    """Watches ``config.prefix`` in etcd and publishes the endpoints found there (see the module's docstring)."""

    name = "etcd"

    def __init__(
        self,
        config: EtcdConfig,
        allowed: Networks,
        *,
        resolve: Resolver = resolve_host,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self.allowed = allowed
        self.resolve = resolve
        super().__init__()
        self.revision = 0
        self.skipped: tuple[Skipped, ...] = ()
        self._members = Members()
        self.updates = 0  # memberships published
        self._entries: dict[str, bytes] = {}
        self._prefix = config.prefix.encode()
        self._range = {"key": _b64(self._prefix), "range_end": _b64(prefix_end(self._prefix))}
        self._url = 0
        self._token: str | None = None
        # The watch's revision when a check last found the prefix ahead of it (None: it was not).
        self._behind: int | None = None
        self._transport = transport
        self._password: Credential | None = None

    async def run(self, publish: Callable[[tuple[EndpointConfig, ...]], None]) -> None:
        """Publish the membership at each change until cancelled; every failure is reported and retried."""
        delay = RETRY_S
        verify: Any = self.config.ca_file if self.config.ca_file is not None else True
        # Each read of an answer within timeout_s; the watch sets its own (see _follow).
        async with httpx.AsyncClient(timeout=self.config.timeout_s, verify=verify, transport=self._transport) as client:
            while True:
                url = self.config.urls[self._url % len(self.config.urls)]
                try:
                    await self._authenticate(client, url)
                    await self._read(client, url, publish)
                    self._up(f"{self.config.prefix}, revision {self.revision}")
                    delay = RETRY_S
                    await self._watch(client, url, publish)
                    raise EtcdError("the watch ended")
                except (httpx.HTTPError, EtcdError, ScorerError, ValueError, OSError) as exc:
                    self._down(f"{url}: {exc or type(exc).__name__}")
                except Exception as exc:
                    # A defect rather than an outage (logged with its traceback), but no reason to stop following
                    # etcd: the next try may not meet it.
                    self._down(f"{url}: unexpected {type(exc).__name__}: {exc}", exc)
                self._url += 1
                self._token = None
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_S)

    async def _authenticate(self, client: httpx.AsyncClient, url: str) -> None:
        if self.config.username is None or self.config.password is None:
            return
        password = self.config.password.read("pool.discovery.etcd.password")  # read each time: it may be rotated
        self._token = None  # not sent with the request for a new one
        reply = await self._post(
            client, url, "/v3/auth/authenticate", {"name": self.config.username, "password": password.reveal().decode()}
        )
        token = reply.get("token")
        if not isinstance(token, str) or not token:
            raise EtcdError("authentication gave no token")
        self._token = token

    async def _post(self, client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {} if self._token is None else {"authorization": self._token}
        try:
            response = await client.post(url + path, json=body, headers=headers)
        except httpx.TimeoutException:
            raise EtcdError(f"{path}: no answer within {self.config.timeout_s:g} s") from None
        if response.status_code == 401 and self._token is not None:
            raise _Unauthenticated(f"{path}: the auth token was refused: {response.text[:200]}")
        if response.status_code != 200:
            raise EtcdError(f"{path}: HTTP {response.status_code}: {response.text[:200]}")
        reply = response.json()
        if not isinstance(reply, dict):
            raise EtcdError(f"{path}: not a JSON object")
        return reply

    async def _read(
        self, client: httpx.AsyncClient, url: str, publish: Callable[[tuple[EndpointConfig, ...]], None]
    ) -> None:
        reply = await self._post(client, url, "/v3/kv/range", dict(self._range))
        self.revision = int(reply.get("header", {}).get("revision", 0))
        self._entries = {}
        for kv in reply.get("kvs", ()):
            self._entries[self._key(kv)] = base64.b64decode(kv.get("value", ""))
        await self._publish(publish)

    async def _watch(
        self, client: httpx.AsyncClient, url: str, publish: Callable[[tuple[EndpointConfig, ...]], None]
    ) -> None:
        """Follow the prefix's events, checking the member every ``timeout_s`` meanwhile, until the watch ends or a
        check fails (raised)."""
        following = asyncio.create_task(self._follow(client, url, publish), name="etcd watch")
        self._behind = None
        try:
            while True:
                done, _ = await asyncio.wait((following,), timeout=self.config.timeout_s)
                if done:
                    return following.result()  # raises what ended it
                await self._check(client, url)
        finally:
            following.cancel()
            await asyncio.wait((following,))
            if not following.cancelled():
                following.exception()  # retrieved: what is raised here (or was returned above) says what happened

    async def _check(self, client: httpx.AsyncClient, url: str) -> None:
        """Whether ``url`` still answers, and for its cluster: a linearizable read of the prefix (its newest change
        and its count of keys: the source may read them), answered within ``timeout_s``. And whether the watch
        keeps up: a change under the prefix that the watch has not delivered by the next check (the watch's
        connection died while the member answers) is raised, and the loop reads the prefix again."""
        probe = {**self._range, "keys_only": True, "sort_order": "DESCEND", "sort_target": "MOD", "limit": "1"}
        try:
            reply = await self._post(client, url, "/v3/kv/range", probe)
        except _Unauthenticated:
            # A token past its TTL (etcd's JWT tokens; a simple one lives as long as it is used): the watch, checked
            # when it was created, goes on; a new token, and the check again.
            await self._authenticate(client, url)
            reply = await self._post(client, url, "/v3/kv/range", probe)
        kvs = reply.get("kvs") or ()
        newest = int(kvs[0].get("mod_revision", 0)) if kvs else 0
        if newest <= self.revision and int(reply.get("count", 0) or 0) == len(self._entries):
            self._behind = None
        elif self._behind is not None and self._behind == self.revision:
            raise EtcdError(
                f"the watch delivered nothing past revision {self.revision} while the prefix changed (newest change "
                f"{newest}): its connection is taken for lost"
            )
        else:
            self._behind = self.revision  # an event may be on its way: judged at the next check

    async def _follow(
        self, client: httpx.AsyncClient, url: str, publish: Callable[[tuple[EndpointConfig, ...]], None]
    ) -> None:
        body = {"create_request": {**self._range, "start_revision": str(self.revision + 1), "progress_notify": True}}
        headers = {} if self._token is None else {"authorization": self._token}
        timeout = httpx.Timeout(self.config.timeout_s, read=WATCH_SILENT_S)
        try:
            async with client.stream(
                "POST", url + "/v3/watch", json=body, headers=headers, timeout=timeout
            ) as response:
                if response.status_code != 200:
                    raise EtcdError(f"/v3/watch: HTTP {response.status_code}")
                async for message in _messages(response.aiter_bytes()):
                    if "error" in message:
                        raise EtcdError(f"/v3/watch: {message['error']}")
                    result = message.get("result", {})
                    if result.get("canceled") or int(result.get("compact_revision", 0) or 0):
                        raise EtcdError(f"the watch was cancelled ({result.get('cancel_reason') or 'compacted'})")
                    events = result.get("events")
                    if not events:
                        continue  # created, or a progress notification
                    for event in events:
                        kv = event.get("kv", {})
                        key = self._key(kv)
                        if event.get("type") == "DELETE":
                            self._entries.pop(key, None)
                        else:
                            self._entries[key] = base64.b64decode(kv.get("value", ""))
                    self.revision = max(self.revision, int(result.get("header", {}).get("revision", self.revision)))
                    await self._publish(publish)
        except httpx.ReadTimeout:
            raise EtcdError(f"/v3/watch: nothing for {WATCH_SILENT_S:g} s, not even a progress notification") from None

    def _key(self, kv: dict[str, Any]) -> str:
        return base64.b64decode(kv.get("key", "")).decode("utf-8", "replace")

    async def _publish(self, publish: Callable[[tuple[EndpointConfig, ...]], None]) -> None:
        endpoints, skipped = await self._members.endpoints(
            self._entries, self.allowed, resolve=self.resolve, limit=self.config.max_endpoints
        )
        before = set(self.skipped)
        for entry in skipped:
            if entry not in before:
                logger.error("etcd discovery skips %s: %s", entry.key, entry.reason)
        self.skipped = skipped
        self.updates += 1
        publish(endpoints)


async def _messages(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a watch stream (one after another, newline-separated or not)."""
    decoder = json.JSONDecoder()
    text = codecs.getincrementaldecoder("utf-8")()  # a chunk may end inside a character
    buffer = ""
    async for chunk in chunks:
        buffer += text.decode(chunk)
        if len(buffer) > MAX_MESSAGE_BYTES:
            raise EtcdError(f"a watch message over {MAX_MESSAGE_BYTES} bytes")
        while True:
            buffer = buffer.lstrip()
            if not buffer:
                break
            try:
                message, end = decoder.raw_decode(buffer)
            except json.JSONDecodeError:
                break  # the rest of it is still to come
            buffer = buffer[end:]
            if isinstance(message, dict):
                yield message

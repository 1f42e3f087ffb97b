"""Discovery: the endpoints a source says should serve, checked as strictly as the config file's.

A source (etcd: `scorer.etcd`; the config file is the picker's own reload) publishes the whole membership each
time it changes, as `Member` entries: one per key, a JSON object with ``address``, ``models``, ``labels`` and
``ready``. `endpoints_of` turns them into `EndpointConfig`s: an address that names a host is resolved here (every
address it has becomes an endpoint; Envoy's ORIGINAL_DST needs an IP), each address must be inside
``pool.allowed_networks`` (a source is a trust boundary: whoever writes to it must not reach beyond the pool's
networks), an entry that is not ready is left out, and a bad entry is skipped with a reason, never applied and
never fatal to the rest.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from pydantic import TypeAdapter, ValidationError

from inferlb.scorer.address import format_address
from inferlb.scorer.config import EndpointConfig
from inferlb.scorer.errors import shown
from inferlb.scorer.networks import Networks, destination_problem
from inferlb.scorer.validation import config_error

__all__ = [
    "MAX_MEMBER_BYTES",
    "MAX_SKIPPED",
    "DiscoverySource",
    "Members",
    "Resolver",
    "SourceHealth",
    "endpoints_of",
    "resolve_host",
]

logger = logging.getLogger(__name__)

# A member's JSON is a few hundred bytes; anything much larger is not a member.
MAX_MEMBER_BYTES = 16 << 10

_ENDPOINT = TypeAdapter(EndpointConfig)

Resolver = Callable[[str, int], Awaitable[list[str]]]


class DiscoverySource(Protocol):
    """A running source of membership. ``run`` publishes the whole list of endpoints each time it changes (and once
    when it first knows it), until cancelled; it survives its backend's outages (``healthy`` says whether it is
    in touch now, ``problem`` why not)."""

    name: str
    healthy: bool
    problem: str | None

    async def run(self, publish: Callable[[tuple[EndpointConfig, ...]], None]) -> None: ...


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA), in a stable order; [] when it resolves to nothing."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, OverflowError):  # OverflowError: a port past what C's long holds
        return []
    return sorted({str(info[4][0]) for info in infos})


class SourceHealth:
    """Whether a source is in touch with its backend (``healthy``, ``problem``), with one log line per transition
    and a count of the connections lost or refused (``failures``)."""

    name = "source"

    def __init__(self) -> None:
        self.healthy = False
        self.problem: str | None = "not read yet"
        self.failures = 0

    def _up(self, where: str) -> None:
        if not self.healthy:
            logger.info("%s discovery in touch (%s)", self.name, where)
        self.healthy, self.problem = True, None

    def _down(self, problem: str, error: BaseException | None = None) -> None:
        """Out of touch because of ``problem``; ``error``: an unexpected exception, logged with its traceback."""
        self.failures += 1
        if self.healthy or self.problem != problem:
            logger.warning(
                "%s discovery out of touch, the last membership stays in force: %s",
                self.name,
                problem,
                exc_info=error,
            )
        self.healthy, self.problem = False, problem


@dataclass(frozen=True, slots=True)
class Skipped:
    """An entry of a source that is not an endpoint, and why (for the log and ``/endpoints``)."""

    key: str
    reason: str


# Skipped entries kept with their reasons (for the log and /endpoints); the rest are counted in one more line.
MAX_SKIPPED = 256
# Entries validated between two yields to the event loop (a few milliseconds of work): a source of tens of
# thousands of entries never holds the routing loop for long.
YIELD_EVERY = 32


class Members:
    """Turns a source's entries into endpoints, remembering what each entry's value came to for as long as the value
    stays in the source. A source publishes its whole membership at each change; validated anew each time, 20,000
    entries held the routing loop for seconds at every watch event (and skipped entries, compared pairwise, grew
    that quadratically). An entry whose address names a host is resolved again each time (DNS moves)."""

    def __init__(self) -> None:
        self._allowed: Networks | None = None
        self._memo: dict[bytes, list[EndpointConfig] | str | None] = {}

    async def endpoints(
        self, entries: Mapping[str, bytes], allowed: Networks, *, resolve: Resolver = resolve_host, limit: int = 4096
    ) -> tuple[tuple[EndpointConfig, ...], tuple[Skipped, ...]]:
        """The endpoints that ``entries`` (key -> JSON value) describe, in key order, and the entries skipped (at
        most `MAX_SKIPPED` with their reasons, then one that counts the rest)."""
        if allowed != self._allowed:
            self._allowed, self._memo = allowed, {}
        memo: dict[bytes, list[EndpointConfig] | str | None] = {}
        endpoints: list[EndpointConfig] = []
        skipped: list[Skipped] = []
        more_skipped = 0
        seen: dict[str, str] = {}
        for n, key in enumerate(sorted(entries)):
            if n % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
            value = entries[key]
            if value in self._memo:
                outcome = memo[value] = self._memo[value]  # kept for as long as its value is in the source
            else:
                outcome, lasting = await _outcome(value, allowed, resolve)
                if lasting:
                    memo[value] = outcome
            try:
                if isinstance(outcome, str):
                    raise ValueError(outcome)
                for endpoint in outcome or ():
                    if endpoint.address in seen:
                        raise ValueError(f"{endpoint.address} is also the address of {shown(seen[endpoint.address])}")
                    if len(endpoints) >= limit:
                        raise ValueError(f"more than {limit} endpoints (max_endpoints)")
                    seen[endpoint.address] = key
                    endpoints.append(endpoint)
            except ValueError as exc:
                if len(skipped) < MAX_SKIPPED:
                    skipped.append(Skipped(key, str(exc)))
                else:
                    more_skipped += 1
        self._memo = memo
        if more_skipped:
            skipped.append(Skipped("...", f"{more_skipped} more entries skipped (the first {MAX_SKIPPED} are listed)"))
        return tuple(endpoints), tuple(skipped)


async def endpoints_of(
    entries: Mapping[str, bytes],
    allowed: Networks,
    *,
    resolve: Resolver = resolve_host,
    limit: int = 4096,
) -> tuple[tuple[EndpointConfig, ...], tuple[Skipped, ...]]:
    """The endpoints that ``entries`` (key -> JSON value) describe, in key order, and the entries skipped (`Members`
    without its memory of earlier calls)."""
    return await Members().endpoints(entries, allowed, resolve=resolve, limit=limit)


async def _outcome(
    value: bytes, allowed: Networks, resolve: Resolver
) -> tuple[list[EndpointConfig] | str | None, bool]:
    """What one entry's value comes to: its endpoints, why it is skipped, or None (not ready); and whether that
    holds for as long as the value does (False where a host name was resolved)."""
    resolved: list[bool] = []

    async def resolving(host: str, port: int) -> list[str]:
        resolved.append(True)
        return await resolve(host, port)

    try:
        return await _entry(value, allowed, resolving), not resolved
    except _NotReady:
        return None, not resolved
    except ValueError as exc:
        return str(exc), not resolved
    except Exception as exc:  # whatever one entry does (a resolver that raises) costs that entry, never the source
        return f"cannot be read ({type(exc).__name__}: {exc})", not resolved


class _NotReady(Exception):
    pass


async def _entry(value: bytes, allowed: Networks, resolve: Resolver) -> list[EndpointConfig]:
    if len(value) > MAX_MEMBER_BYTES:
        raise ValueError(f"the value is {len(value)} bytes; an endpoint takes at most {MAX_MEMBER_BYTES}")
    try:
        document: Any = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ValueError('must be a JSON object such as {"address": "10.0.0.7:8000"}')
    ready = document.pop("ready", True)
    if not isinstance(ready, bool):
        raise ValueError(f"ready must be true or false; got {shown(ready)}")
    if not ready:
        raise _NotReady
    if "gpu" in document:
        raise ValueError("gpu: an endpoint's GPU source is set in the config file only")
    address = document.get("address")
    addresses = [address]
    if isinstance(address, str):
        host, sep, port = address.rpartition(":")
        if sep and host and not _is_literal(host) and port.isascii() and port.isdigit():
            if not 1 <= int(port) <= 65535:
                raise ValueError(f"address: {shown(address)}: port must be an integer in 1..65535")
            ips = await resolve(host, int(port))
            if not ips:
                raise ValueError(f"{shown(address)}: {host!r} does not resolve")
            addresses = [format_address(ip, int(port)) for ip in ips]
    endpoints = []
    for each in addresses:
        try:
            endpoint = _ENDPOINT.validate_python({**document, "address": each})
        except ValidationError as exc:
            raise ValueError(str(config_error(exc)).replace("\n", "; ")) from None
        host = endpoint.address.rpartition(":")[0].strip("[]")
        problem = destination_problem(host, allowed, "pool.allowed_networks")
        if problem is not None:
            raise ValueError(f"{endpoint.address} {problem}")
        endpoints.append(endpoint)
    return endpoints


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def describe_skipped(skipped: Sequence[Skipped]) -> list[dict[str, str]]:
    return [{"key": s.key, "reason": s.reason} for s in skipped]

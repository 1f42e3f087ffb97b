"""Who may send spans: the receiver process's check of each export before it reads a byte of the message.

An export is served only when its peer (gRPC's ``context.peer()``: ``ipv4:10.0.0.7:53211``, ``ipv6:[fd00::7]:53211``,
percent-encoded by some gRPC versions) is an IP address inside the allowlist, and, when a token is configured,
its ``authorization`` metadata is ``Bearer <token>`` (compared in constant time, `Credential.matches_bearer`). A
peer that is not an IP address (a Unix socket, an unparsable string) is refused: the receiver listens on TCP only.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from urllib.parse import unquote

from inferlb.scorer.credentials import Credential
from inferlb.scorer.networks import IPAddress, Networks, unmapped

__all__ = ["Refusal", "SenderGate", "peer_ip"]


class Refusal(Enum):
    """Why an export was refused; the value is the counter's name."""

    UNTRUSTED_SENDER = "untrusted_sender"
    UNAUTHENTICATED = "unauthenticated"


def peer_ip(peer: str) -> IPAddress | None:
    """The IP address of a gRPC peer string (an IPv4-mapped IPv6 address as IPv4), None if it names none."""
    kind, _, rest = unquote(peer).partition(":")
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]") if rest.startswith("[") else rest
    else:
        return None
    try:
        return unmapped(host.partition("%")[0])  # drop an IPv6 zone
    except ValueError:
        return None


class SenderGate:
    """The allowlist and the optional token; immutable (a settings change builds a new gate). `check` is O(networks)
    and never raises."""

    def __init__(self, allowed: Networks, token: str | None) -> None:
        self.allowed = allowed
        self._credential = Credential(token.encode()) if token is not None else None

    def check(
        self, peer: str, metadata: Iterable[tuple[str, str | bytes]] | None
    ) -> tuple[IPAddress | None, Refusal | None]:
        """The sender's IP and, if it may not send, why."""
        ip = peer_ip(peer)
        if ip is None or not self.allowed.contains(ip):
            return ip, Refusal.UNTRUSTED_SENDER
        if self._credential is not None:
            presented = None
            for key, value in metadata or ():
                if key.lower() == "authorization":
                    presented = value
                    break
            if not self._credential.matches_bearer(presented):
                return ip, Refusal.UNAUTHENTICATED
        return ip, None

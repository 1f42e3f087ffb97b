"""Which addresses the operator allows: networks (CIDR lists) and the unicast rule for anything the picker
connects to or takes routing input from.

The picker sends traffic to pool endpoints, fetches GPU state from GPU sources, and takes spans from senders.
Each of those addresses must be a unicast address (not unspecified, multicast, broadcast, link-local or
reserved: ``169.254.169.254`` is the cloud metadata service, ``0.0.0.0`` reaches the local host) inside
networks the operator allows. The default allows loopback and the private ranges a fleet lives in; a public
address has to be allowed explicitly.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_ALLOWED_NETWORKS",
    "DEFAULT_NETWORKS",
    "LOOPBACK_NETWORKS",
    "IPAddress",
    "IPNetwork",
    "Networks",
    "destination_problem",
    "networks_of_hosts",
    "unicast_problem",
    "unmapped",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_ALLOWED_NETWORKS: tuple[str, ...] = (
    "127.0.0.0/8",  # loopback
    "::1/128",
    "10.0.0.0/8",  # RFC 1918 private networks
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",  # shared address space (RFC 6598), used for pod networks by some clusters
    "fc00::/7",  # IPv6 unique local addresses
)
"""Loopback and the private ranges, IPv4 and IPv6: where GPU fleets' servers live."""


@dataclass(frozen=True, slots=True)
class Networks:
    """An immutable list of networks; ``contains`` says whether an address is inside one of them.

    An IPv4-mapped IPv6 address (``::ffff:10.0.0.1``) counts as the IPv4 address it maps."""

    networks: tuple[IPNetwork, ...]

    @classmethod
    def of(cls, cidrs: Iterable[str]) -> Networks:
        """Networks from CIDR strings known to be valid (ValueError otherwise)."""
        return cls(tuple(ipaddress.ip_network(c, strict=False) for c in cidrs))

    def contains(self, address: IPAddress | str) -> bool:
        ip = unmapped(address)
        return any(ip.version == net.version and ip in net for net in self.networks)

    def describe(self) -> str:
        return ", ".join(self.cidrs()) or "none"

    def cidrs(self) -> tuple[str, ...]:
        """The networks in CIDR form (what `of` reads back)."""
        return tuple(str(n) for n in self.networks)

    def union(self, other: Networks) -> Networks:
        """These networks and then ``other``'s, each network once."""
        return Networks(tuple(dict.fromkeys((*self.networks, *other.networks))))


DEFAULT_NETWORKS = Networks.of(DEFAULT_ALLOWED_NETWORKS)
LOOPBACK_NETWORKS = Networks.of(("127.0.0.0/8", "::1/128"))
"""This host's own addresses, IPv4 and IPv6."""


def unicast_problem(address: IPAddress | str) -> str | None:
    """Why ``address`` may not be a destination or a trusted source (None: it is a usable unicast address)."""
    ip = unmapped(address)
    if ip.is_loopback:
        return None  # ::1 lies in a range Python calls reserved (::/8)
    if ip.is_unspecified:
        return "is the unspecified address (it reaches this host, not a server)"
    if ip.is_multicast:
        return "is a multicast address"
    if isinstance(ip, ipaddress.IPv4Address) and ip == ipaddress.IPv4Address("255.255.255.255"):
        return "is the broadcast address"
    if ip.is_link_local:
        return "is link-local (169.254.0.0/16 and fe80::/10 hold cloud metadata services, never servers)"
    if ip.is_reserved:
        return "is in a reserved range"
    return None


def destination_problem(address: IPAddress | str, allowed: Networks | None, allowed_where: str = "") -> str | None:
    """Why the picker may not connect to ``address`` (None: it may).

    An address must be unicast (``unicast_problem``, whatever ``allowed`` says), carry no IPv6 zone ID, and lie
    inside ``allowed`` (None: anywhere), the networks configured at ``allowed_where`` (a config field, named in the
    reason). The reason reads after the address ("'8.8.8.8:8000' is outside ...") and says how to fix it."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        # "fd00::1%eth0" compares equal to fd00::1 in a network, but Envoy needs the bare address
        return f"has a zone ID ('%{ip.scope_id}'): name the server by its address alone"
    problem = unicast_problem(ip)
    if problem is not None:
        return f"{problem}: the picker connects only to a server's own unicast address"
    if allowed is not None and not allowed.contains(ip):
        return f"is outside {allowed_where} ({allowed.describe()}): add its network there if this server is yours"
    return None


def unmapped(address: IPAddress | str) -> IPAddress:
    """``address`` as an address object; an IPv4-mapped IPv6 address (``::ffff:10.0.0.1``, what a dual-stack
    socket reports for an IPv4 peer) as the IPv4 address it maps. ValueError if it is not an IP address."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def networks_of_hosts(hosts: Sequence[str]) -> Networks:
    """One single-address network per host (for allowlists derived from the pool)."""
    return Networks(tuple(ipaddress.ip_network(unmapped(h)) for h in dict.fromkeys(hosts)))

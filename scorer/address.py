"""Endpoint addresses: literal ``ip:port`` only.

Envoy's ORIGINAL_DST cluster connects to exactly the address the picker names and rejects hostnames, so
every address is validated once, when the pool is loaded, and kept in one canonical spelling. A URL's
authority (a GPU source's ``http://10.0.0.7:9400``) is held to the same rule, its port optional.
"""

from __future__ import annotations

import functools
import ipaddress

_ENVOY_NEEDS_IP = "hostnames are not allowed: Envoy's ORIGINAL_DST cluster needs 'ip:port'"
_NAMES_MOVE = "hostnames are not allowed: a name could resolve to any address later"


def parse_address(text: str) -> tuple[str, int]:
    """Split ``"10.0.0.1:8000"`` or ``"[fd00::1]:8000"`` into a literal IP and a port.

    Raises ``ValueError`` with a message that says what form is expected.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("must be a literal 'ip:port' string, e.g. '10.0.0.7:8000'")
    return _parse_address(text)


@functools.lru_cache(maxsize=1 << 14)
def _parse_address(text: str) -> tuple[str, int]:
    # Kept: a pool is rebuilt at each change of membership, and parses every address again.
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} must be a literal 'ip:port', e.g. '10.0.0.7:8000'")
    return _literal(text, host, port_text, _ENVOY_NEEDS_IP)


def parse_authority(text: str, *, default_port: int) -> tuple[str, int]:
    """Split a URL's authority, ``"10.0.0.7:9400"``, ``"[fd00::7]"`` or ``"10.0.0.7"``, into a literal IP and a
    port (``default_port`` where it names none). User information (``user@``) is not an authority's business
    here: the caller refuses it first.

    Raises ``ValueError`` with a message that says what form is expected.
    """
    if not text:
        raise ValueError("names no host")
    # An unbracketed IPv6 address has several colons: it is not "host:port", and _literal says to bracket it.
    has_port = "]:" in text if text.startswith("[") else text.count(":") == 1
    host, port_text = text.rsplit(":", 1) if has_port else (text, str(default_port))
    return _literal(text, host, port_text, _NAMES_MOVE)


def _literal(text: str, host: str, port_text: str, why_no_names: str) -> tuple[str, int]:
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{text!r}: {host!r} is not a literal IP address ({why_no_names})") from None
    # "fd00::1:8000" could be an address or an address and a port: IPv6 must be bracketed, IPv4 must not be.
    if bracketed != (ip.version == 6):
        raise ValueError(f"{text!r}: write IPv6 addresses in brackets ('[fd00::1]:8000') and IPv4 without them")
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text!r}: port must be an integer in 1..65535")
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    if mapped is not None:
        # Envoy spells it ::ffff:10.0.0.1 and Python ::ffff:a00:1: Envoy's hosts would never match the address named.
        raise ValueError(f"{text!r}: an IPv4-mapped IPv6 address; write the IPv4 address ('{mapped}:{port_text}')")
    return str(ip), int(port_text)


def format_address(host: str, port: int) -> str:
    """The canonical ``ip:port`` spelling (IPv6 in brackets) that Envoy accepts in the destination header."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

"""Tests for otel/sendergate.py: the sender allowlist and the bearer token, checked before any parsing."""

from __future__ import annotations

import ipaddress

import pytest

from inferlb.otel.sendergate import Refusal, SenderGate, peer_ip
from inferlb.scorer.networks import Networks

TOKEN = "s3cret-token-0123456789"


@pytest.mark.parametrize(
    ("peer", "ip"),
    [
        pytest.param("ipv4:10.0.0.7:53211", "10.0.0.7", id="ipv4"),
        pytest.param("ipv6:[fd00::7]:53211", "fd00::7", id="ipv6"),
        pytest.param("ipv6:%5B::1%5D:53211", "::1", id="percent-encoded"),
        pytest.param("ipv6:[::ffff:10.0.0.7]:1", "10.0.0.7", id="ipv4-mapped"),
        pytest.param("ipv6:[fe80::1%25eth0]:1", "fe80::1", id="zone"),
        pytest.param("unix:/tmp/socket", None, id="unix"),
        pytest.param("ipv4:not-an-ip:1", None, id="garbage"),
        pytest.param("", None, id="empty"),
    ],
)
def test_the_peer_ip(peer: str, ip: str | None) -> None:
    assert peer_ip(peer) == (ipaddress.ip_address(ip) if ip else None)


@pytest.mark.parametrize(
    ("peer", "refusal"),
    [
        pytest.param("ipv4:10.0.0.7:1", None, id="allowed"),
        pytest.param("ipv6:[::ffff:10.0.0.7]:1", None, id="allowed-mapped"),
        pytest.param("ipv4:192.0.2.1:1", Refusal.UNTRUSTED_SENDER, id="outside"),
        pytest.param("unix:/x", Refusal.UNTRUSTED_SENDER, id="no-ip"),
    ],
)
def test_only_allowed_networks_may_send(peer: str, refusal: Refusal | None) -> None:
    assert SenderGate(Networks.of(["10.0.0.0/8"]), None).check(peer, ())[1] == refusal


@pytest.mark.parametrize(
    ("metadata", "refusal"),
    [
        pytest.param((("authorization", f"Bearer {TOKEN}"),), None, id="right"),
        pytest.param((("Authorization", f"bearer {TOKEN}"),), None, id="any-case"),
        pytest.param((), Refusal.UNAUTHENTICATED, id="missing"),
        pytest.param((("authorization", "Bearer wrong-token-0123456789"),), Refusal.UNAUTHENTICATED, id="wrong"),
        pytest.param((("authorization", TOKEN),), Refusal.UNAUTHENTICATED, id="no-scheme"),
        pytest.param((("authorization", f"Basic {TOKEN}"),), Refusal.UNAUTHENTICATED, id="other-scheme"),
    ],
)
def test_a_configured_token_is_required(metadata: tuple[tuple[str, str], ...], refusal: Refusal | None) -> None:
    gate = SenderGate(Networks.of(["127.0.0.0/8"]), TOKEN)
    assert gate.check("ipv4:127.0.0.1:1", metadata) == (ipaddress.ip_address("127.0.0.1"), refusal)


def test_the_allowlist_comes_before_the_token() -> None:
    gate = SenderGate(Networks.of(["10.0.0.0/8"]), TOKEN)
    assert gate.check("ipv4:192.0.2.1:1", (("authorization", f"Bearer {TOKEN}"),))[1] == Refusal.UNTRUSTED_SENDER

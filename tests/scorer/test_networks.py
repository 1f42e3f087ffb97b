"""Tests for scorer/networks.py: which addresses the picker may connect to."""

from __future__ import annotations

import pytest

from inferlb.scorer.networks import DEFAULT_NETWORKS, Networks, destination_problem

EVERYWHERE = Networks.of(["0.0.0.0/0", "::/0"])


@pytest.mark.parametrize(
    ("address", "words"),
    [
        pytest.param("169.254.169.254", "is link-local", id="cloud-metadata"),
        pytest.param("fe80::1", "is link-local", id="ipv6-link-local"),
        pytest.param("::ffff:169.254.169.254", "is link-local", id="ipv4-mapped-metadata"),
        pytest.param("0.0.0.0", "is the unspecified address", id="unspecified"),
        pytest.param("::", "is the unspecified address", id="ipv6-unspecified"),
        pytest.param("224.0.0.1", "is a multicast address", id="multicast"),
        pytest.param("ff02::1", "is a multicast address", id="ipv6-multicast"),
        pytest.param("255.255.255.255", "is the broadcast address", id="broadcast"),
        pytest.param("240.0.0.1", "is in a reserved range", id="reserved"),
        pytest.param("fd00::1%eth0", "has a zone ID", id="zone-id"),
    ],
)
def test_non_unicast_addresses_are_refused_whatever_the_allowlist(address: str, words: str) -> None:
    problem = destination_problem(address, EVERYWHERE, "pool.allowed_networks")
    assert problem is not None and problem.startswith(words), problem


@pytest.mark.parametrize(
    "address",
    [
        pytest.param("127.0.0.1", id="loopback"),
        pytest.param("::1", id="ipv6-loopback"),
        pytest.param("10.0.0.7", id="rfc1918-10"),
        pytest.param("172.31.255.254", id="rfc1918-172"),
        pytest.param("192.168.1.1", id="rfc1918-192"),
        pytest.param("100.64.0.1", id="shared-space"),
        pytest.param("fd00::7", id="ipv6-ula"),
        pytest.param("::ffff:10.0.0.7", id="ipv4-mapped-private"),
    ],
)
def test_loopback_and_private_addresses_are_allowed_by_default(address: str) -> None:
    assert destination_problem(address, DEFAULT_NETWORKS, "pool.allowed_networks") is None


def test_a_public_address_needs_its_network_allowed() -> None:
    problem = destination_problem("8.8.8.8", DEFAULT_NETWORKS, "pool.allowed_networks")
    assert problem == (
        "is outside pool.allowed_networks (127.0.0.0/8, ::1/128, 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, "
        "100.64.0.0/10, fc00::/7): add its network there if this server is yours"
    )
    assert destination_problem("8.8.8.8", Networks.of(["8.8.8.0/24"]), "pool.allowed_networks") is None
    # the allowlist replaces the default: what it does not name is refused
    assert destination_problem("10.0.0.1", Networks.of(["8.8.8.0/24"]), "x").startswith("is outside x (8.8.8.0/24)")

"""Tests for scorer/address.py: literal ``ip:port`` parsing and the canonical spelling."""

from __future__ import annotations

from typing import Any

import pytest

from inferlb.scorer.address import format_address, parse_address, parse_authority


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("10.0.0.7:8000", ("10.0.0.7", 8000), id="ipv4"),
        pytest.param("127.0.0.1:1", ("127.0.0.1", 1), id="lowest-port"),
        pytest.param("127.0.0.1:65535", ("127.0.0.1", 65535), id="highest-port"),
        pytest.param("127.0.0.1:08000", ("127.0.0.1", 8000), id="leading-zero-port"),
        pytest.param("[::1]:8000", ("::1", 8000), id="ipv6-loopback"),
        pytest.param("[fd00::1]:9000", ("fd00::1", 9000), id="ipv6"),
        pytest.param("[FD00:0:0::1]:9000", ("fd00::1", 9000), id="ipv6-canonicalised"),
    ],
)
def test_parse_address_accepts_literal_ip_and_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("", "literal 'ip:port'", id="empty"),
        pytest.param(None, "literal 'ip:port'", id="none"),
        pytest.param(8000, "literal 'ip:port'", id="int"),
        pytest.param(b"10.0.0.1:80", "literal 'ip:port'", id="bytes"),
        pytest.param("10.0.0.1", "literal 'ip:port'", id="no-port"),
        pytest.param(":8000", "literal 'ip:port'", id="no-host"),
        pytest.param("localhost:8000", "not a literal IP address", id="hostname"),
        pytest.param("vllm.svc.cluster.local:8000", "hostnames are not allowed", id="fqdn"),
        pytest.param("10.0.0.x:8000", "not a literal IP address", id="bad-ipv4"),
        pytest.param("[::1:8000", "not a literal IP address", id="unclosed-bracket"),
        pytest.param("fd00::1:8000", "IPv6 addresses in brackets", id="ipv6-unbracketed-ambiguous"),
        pytest.param("[10.0.0.1]:80", "IPv4 without them", id="ipv4-bracketed"),
        pytest.param("[::ffff:10.0.0.1]:80", "write the IPv4 address ('10.0.0.1:80')", id="ipv4-mapped"),
        pytest.param("10.0.0.1:\u0668\u0660", "port must be an integer", id="port-arabic-digits"),
        pytest.param(" 10.0.0.1:8000", "not a literal IP address", id="leading-space"),
        pytest.param("10.0.0.1:0", "port must be an integer in 1..65535", id="port-zero"),
        pytest.param("10.0.0.1:65536", "port must be an integer in 1..65535", id="port-too-big"),
        pytest.param("10.0.0.1:-1", "port must be an integer in 1..65535", id="port-negative"),
        pytest.param("10.0.0.1:", "port must be an integer in 1..65535", id="port-empty"),
        pytest.param("10.0.0.1:http", "port must be an integer in 1..65535", id="port-name"),
        pytest.param("10.0.0.1:80 ", "port must be an integer in 1..65535", id="port-trailing-space"),
    ],
)
def test_parse_address_refuses_with_a_message_saying_what_is_expected(text: Any, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_address(text)
    assert fragment in str(info.value)


def test_parse_address_superscript_port_gets_the_port_message() -> None:
    with pytest.raises(ValueError, match=r"port must be an integer in 1\.\.65535"):
        parse_address("10.0.0.1:\u00b2")


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        pytest.param("10.0.0.7", 8000, "10.0.0.7:8000", id="ipv4"),
        pytest.param("::1", 8000, "[::1]:8000", id="ipv6-bracketed"),
        pytest.param("fd00::1", 1, "[fd00::1]:1", id="ipv6"),
    ],
)
def test_format_address(host: str, port: int, expected: str) -> None:
    assert format_address(host, port) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("10.0.0.7:8000", id="ipv4"),
        pytest.param("[::1]:8000", id="ipv6"),
        pytest.param("[fd00:0:0:0:0:0:0:1]:443", id="ipv6-long-form"),
    ],
)
def test_format_of_parse_is_canonical_and_stable(text: str) -> None:
    canonical = format_address(*parse_address(text))
    assert format_address(*parse_address(canonical)) == canonical


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("10.0.0.7:9400", ("10.0.0.7", 9400), id="ipv4-port"),
        pytest.param("10.0.0.7", ("10.0.0.7", 80), id="ipv4-default-port"),
        pytest.param("[FD00::7]:9400", ("fd00::7", 9400), id="ipv6-port"),
        pytest.param("[fd00::7]", ("fd00::7", 80), id="ipv6-default-port"),
    ],
)
def test_parse_authority_takes_an_optional_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_authority(text, default_port=80) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("", "names no host", id="empty"),
        pytest.param("node-7:9400", "'node-7' is not a literal IP address", id="hostname"),
        pytest.param("node-7", "'node-7' is not a literal IP address", id="hostname-no-port"),
        pytest.param("fd00::7", "IPv6 addresses in brackets", id="ipv6-unbracketed"),
        pytest.param("fd00::7:9400", "IPv6 addresses in brackets", id="ipv6-unbracketed-port"),
        pytest.param("10.0.0.7:", "port must be an integer in 1..65535", id="port-empty"),
        pytest.param("[fd00::7]:x", "port must be an integer in 1..65535", id="port-name"),
    ],
)
def test_parse_authority_refuses_what_is_not_a_literal_ip(text: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_authority(text, default_port=80)
    assert fragment in str(info.value)
    assert "ORIGINAL_DST" not in str(info.value)  # that reason belongs to pool addresses, not to URLs

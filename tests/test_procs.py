"""Port allocation for local stacks: free ports that outgoing connections cannot steal before the bind."""

from __future__ import annotations

import socket

from inferlb.procs import _ephemeral_range, free_port


def test_ports_are_outside_the_range_outgoing_connections_draw_from() -> None:
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert all(not low <= port <= high for port in ports)


def test_a_port_is_never_handed_out_twice_and_can_be_bound() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
        sock.listen()

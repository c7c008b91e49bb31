"""`free_ports` hands out distinct ports that can each be bound on 127.0.0.1 once it returns:
a NATS cluster's members take their client, route, monitoring and leaf node ports from one
call, and one port given twice kept a member from starting."""

from __future__ import annotations

import contextlib
import socket

from broker.embedded import free_port, free_ports


def test_ports_found_together_are_distinct_and_each_can_be_bound() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == 64
    with contextlib.ExitStack() as held:
        for port in ports:
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", port))
        assert free_port() not in ports  # they are all taken now

"""Listener ports chosen where outgoing connections never land."""

from __future__ import annotations

import socket

from shared.ports import LOWEST_CHOSEN_PORT, ephemeral_start, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_repeated() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST_CHOSEN_PORT <= p < ephemeral_start() for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_an_outgoing_connection_never_takes_a_chosen_port() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", free_port()))
        server.listen()
        clients = [socket.create_connection(server.getsockname()) for _ in range(50)]
        try:
            assert all(c.getsockname()[1] >= ephemeral_start() for c in clients)
        finally:
            for c in clients:
                c.close()

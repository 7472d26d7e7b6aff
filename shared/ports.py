"""Ports for the mesh's listeners that nothing else will take between choosing one and binding it.

A port the kernel hands out for `bind(("127.0.0.1", 0))` lies in its ephemeral range, the range it also draws every
outgoing connection's local port from: between the launcher choosing such a port and a child binding it, any
connection the machine opens (a client reaching NATS, a test's HTTP request) can take it, and the child fails to start
with "address already in use". Ports below that range are never handed out implicitly, so a listener chosen there can
only meet another program that asked for that very port.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FALLBACK_EPHEMERAL_START = 32768  # Linux's default; macOS and Windows start theirs higher (49152)
LOWEST_CHOSEN_PORT = 10000  # clear of the well-known and the commonly configured service ports
ATTEMPTS = 64

_handed_out: set[int] = set()  # never the same port twice from one process, even once its listener has closed


def ephemeral_start() -> int:
    """The lowest port the kernel gives outgoing connections."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return FALLBACK_EPHEMERAL_START


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def can_listen(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now. Bound as servers bind (SO_REUSEADDR: a port whose last
    connections linger in TIME_WAIT is free); a host that does not resolve is left for the server to report."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return True
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port free now, chosen at random below the ephemeral range (or from the kernel where that range starts
    too low to leave room)."""
    top = ephemeral_start()
    if top > LOWEST_CHOSEN_PORT + ATTEMPTS:
        for _ in range(ATTEMPTS):
            port = random.randrange(LOWEST_CHOSEN_PORT, top)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Returns once host:port accepts a connection; raises if proc exits first or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s}s")

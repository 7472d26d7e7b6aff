"""`specmesh nats`: the embedded NATS server alone, in the foreground.

Its users' credentials live in `<store-dir>/credentials/<role>.json`: made at the first start, kept across restarts
so that services started separately (`--nats-credentials <store-dir>/credentials/<role>.json`) reconnect after one.
Delete the directory to change them. Once the server listens, its admin user declares the mesh's streams with the
--queue-max-* limits (shared/streams.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.supervisor import STOP_SIGNALS, die_with_parent
from shared.nats_credentials import MeshCredentials
from shared import stream_limits
from shared.nats_server import READY_TIMEOUT_S, admin_settings, credentials_dir, default_store_dir, server_command
from shared.streams import OnThread, declare
from shared.ports import wait_for_port
from shared.stream_limits import StreamLimits

LAME_DUCK_SIGNAL = signal.SIGUSR2  # nats-server: take no new clients, close the connected ones gradually, exit
WAIT_INTERVAL_S = 0.1
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # listening on every address; the declaration connects over loopback
SIGNAL_EXIT_BASE = 128  # a process killed by signal N exits with 128 + N, as shells report it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=4222, help="client port")
    parser.add_argument(
        "--store-dir", type=Path, default=default_store_dir(), help="JetStream store; also holds each role's credentials"
    )
    parser.add_argument(
        "--stop-timeout", type=float, default=45.0,
        help="seconds the server may spend in lame-duck mode after SIGTERM or SIGINT before it is killed "
        "(a second signal kills it at once)",
    )
    stream_limits.add_arguments(parser)


class LameDuckStop:
    """The first SIGTERM or SIGINT puts the server in lame-duck mode (it closes its clients over its grace period
    and exits); a second one, or the end of the timeout, kills it. Either way it never outlives `specmesh nats`."""

    def __init__(self, server: subprocess.Popen, timeout_s: float) -> None:
        self.server = server
        self.timeout_s = timeout_s
        self.deadline: float | None = None
        self.declaring: OnThread | None = None  # the streams' declaration, while it may still be running
        self.listening = False  # the server takes clients (and signals: one sent before is lost)
        self._lame_duck_sent = False

    @property
    def stopping(self) -> bool:
        return self.deadline is not None

    def on_signal(self, signum: int, frame: object) -> None:
        if self.deadline is None:
            print(f"specmesh nats: lame-duck mode; the server has {self.timeout_s:g}s to close its clients",
                  file=sys.stderr, flush=True)
            self.deadline = time.monotonic() + self.timeout_s
            self._lame_duck()
        else:
            self.deadline = time.monotonic()

    def wait(self) -> int:
        """The server's exit status, shell-style (128 + N when a signal ended it); once the streams are declared,
        says so, and kills the server and exits if they could not be."""
        while True:
            if self.declaring is not None and self.declaring.future.done():
                self._declared(self.declaring)
                self.declaring = None
            if self.stopping:
                self._lame_duck()
            try:
                code = self.server.wait(timeout=WAIT_INTERVAL_S)
                return code if code >= 0 else SIGNAL_EXIT_BASE - code
            except subprocess.TimeoutExpired:
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    print("specmesh nats: killing the server", file=sys.stderr, flush=True)
                    os.killpg(self.server.pid, signal.SIGKILL)

    def _lame_duck(self) -> None:
        """Once the server listens, and the streams' declaration is over (a few milliseconds): a server still
        starting ignores the signal, and the declaration's connection, cut by lame-duck mode, would hold the server
        through its grace period."""
        if not self._lame_duck_sent and self.listening and self.declaring is None:
            self.server.send_signal(LAME_DUCK_SIGNAL)
            self._lame_duck_sent = True

    def _declared(self, declaring: OnThread) -> None:
        if self.stopping:
            return
        if (error := declaring.future.exception()) is not None:
            os.killpg(self.server.pid, signal.SIGKILL)
            raise SystemExit(f"specmesh nats: the server did not take the mesh's streams: {error!r}")
        print("specmesh nats: streams declared", flush=True)


def run(args: argparse.Namespace) -> None:
    credentials = MeshCredentials.read_or_generate(credentials_dir(args.store_dir))
    cmd = server_command(args.port, args.store_dir, credentials, args.host)
    print(f"specmesh nats: credentials of each role in {credentials_dir(args.store_dir)}", flush=True)
    # Its own session keeps a terminal's Ctrl-C from reaching the server directly, past lame-duck mode.
    server = subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent)
    stop = LameDuckStop(server, args.stop_timeout)
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop.on_signal)
    host = "127.0.0.1" if args.host in WILDCARD_HOSTS else args.host
    try:
        wait_for_port(host, args.port, READY_TIMEOUT_S, server)
        stop.listening = True
    except (RuntimeError, TimeoutError) as exc:
        if not stop.stopping:
            os.killpg(server.pid, signal.SIGKILL)
            raise SystemExit(f"specmesh nats: the server did not start: {exc}") from exc
    if not stop.stopping:
        # On a thread: a stop signal meanwhile is taken at once, and lame-duck mode waits for the declaration's end.
        admin = admin_settings(f"nats://{host}:{args.port}", credentials)
        stop.declaring = OnThread(declare(admin, StreamLimits.from_args(args), READY_TIMEOUT_S))
    raise SystemExit(stop.wait())

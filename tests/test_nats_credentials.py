"""NATS credentials and TLS as the services take them: from the environment or a file, checked before connecting,
never on a command line; TLS through an ssl context, against a real nats-server that requires client certificates;
`specmesh nats` writing each role's credentials and keeping them across a restart."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors
import openai
import pytest
from pydantic import ValidationError

from services.mesh_process import start_mesh
from shared import nats_settings, subjects
from shared.nats_credentials import PASSWORD_ENV, USER_ENV, CredentialsError, MeshCredentials, NatsCredentials
from shared.nats_roles import NatsRole, authorization_config
from shared.nats_server import AUTH_CONFIG, credentials_dir, server_binary
from shared.natsutil import barrier
from shared.ports import free_port, wait_for_port
from shared.nats_settings import NatsSettings
from tests.natsfixture import NatsServer, nats_server  # noqa: F401  (the fixture is used by name)

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
STOP_SIGNALS = 2
LAME_DUCK_WAIT_S = 1.0
CERT_DAYS = "1"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    nats_settings.add_arguments(parser)
    return parser.parse_args(argv)


def test_credentials_come_from_the_environment_or_a_private_file(tmp_path: Path) -> None:
    env = {USER_ENV: "gateway", PASSWORD_ENV: "s3cret"}
    settings = NatsSettings.from_args(parse(), NatsRole.GATEWAY, env)
    assert settings.connect_options() == {"inbox_prefix": "_INBOX.gateway", "user": "gateway", "password": "s3cret"}
    assert "s3cret" not in repr(settings)

    path = tmp_path / "worker.json"
    NatsCredentials(user="worker", password="w0rker").write(path)
    assert path.stat().st_mode & 0o777 == 0o600
    settings = NatsSettings.from_args(parse("--nats-credentials", str(path)), NatsRole.WORKER, {})
    assert (settings.credentials.user, settings.credentials.password.get_secret_value()) == ("worker", "w0rker")
    assert NatsSettings.from_args(parse(), NatsRole.WORKER, {}).connect_options() == {"inbox_prefix": "_INBOX.worker"}


def test_credentials_that_are_ambiguous_incomplete_or_exposed_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    NatsCredentials(user="worker", password="w").write(path)
    env = {USER_ENV: "a", PASSWORD_ENV: "b"}
    with pytest.raises(CredentialsError, match="given twice"):
        NatsSettings.from_args(parse("--nats-credentials", str(path)), NatsRole.WORKER, env)
    with pytest.raises(CredentialsError, match=PASSWORD_ENV):
        NatsSettings.from_args(parse(), NatsRole.WORKER, {USER_ENV: "worker"})
    with pytest.raises(ValidationError, match="given twice"):
        NatsSettings.from_args(parse("--nats-url", "nats://u:p@127.0.0.1:4222"), NatsRole.WORKER, env)
    path.chmod(0o644)
    with pytest.raises(CredentialsError, match="chmod 600"):
        NatsSettings.from_args(parse("--nats-credentials", str(path)), NatsRole.WORKER, {})
    path.chmod(0o600)
    path.write_text("user=worker")
    with pytest.raises(CredentialsError, match="expected"):
        NatsSettings.from_args(parse("--nats-credentials", str(path)), NatsRole.WORKER, {})
    with pytest.raises(ValidationError, match="--nats-tls-cert needs --nats-tls-key"):
        NatsSettings.from_args(parse("--nats-tls-cert", str(path)), NatsRole.WORKER, {})


def test_mesh_credentials_are_random_private_and_kept_once_written(tmp_path: Path) -> None:
    first, second = MeshCredentials.generate(), MeshCredentials.generate()
    passwords = list(first.passwords().values()) + list(second.passwords().values())
    assert len(set(passwords)) == len(passwords) and min(map(len, passwords)) >= 40
    directory = tmp_path / "credentials"
    kept = MeshCredentials.read_or_generate(directory)
    assert directory.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in directory.iterdir())
    assert MeshCredentials.read_or_generate(directory) == kept


def test_the_server_reads_passwords_from_a_private_file_not_its_command_line(
    nats_server: NatsServer,  # noqa: F811
) -> None:
    assert (nats_server.store_dir / AUTH_CONFIG).stat().st_mode & 0o777 == 0o600
    cmdline = Path(f"/proc/{nats_server.process.pid}/cmdline").read_bytes().decode()
    for password in nats_server.credentials.passwords().values():
        assert password not in cmdline


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificate(directory: Path, name: str, extension: str) -> None:
    """An EC key and a certificate for `name` signed by the test CA in `directory`."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    (directory / f"{name}.ext").write_text(extension)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", CERT_DAYS, "-extfile", f"{name}.ext", cwd=directory)


@pytest.fixture
def tls_server(tmp_path: Path):
    """nats-server requiring TLS and a client certificate from the test CA, with the mesh's users."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             "ca.key", "-out", "ca.pem", "-days", CERT_DAYS, "-subj", "/CN=specmesh-test-ca", cwd=tmp_path)
    _certificate(tmp_path, "server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _certificate(tmp_path, "client", "extendedKeyUsage=clientAuth\n")
    credentials, port = MeshCredentials.generate(), free_port()
    config = tmp_path / "nats.conf"
    config.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f'tls {{cert_file: "{tmp_path}/server.pem", key_file: "{tmp_path}/server.key", ca_file: "{tmp_path}/ca.pem", '
        "verify: true}\n" + authorization_config(credentials.passwords())
    )
    process = subprocess.Popen(
        [server_binary(), "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for_port("127.0.0.1", port, START_TIMEOUT_S, process)
        yield f"tls://127.0.0.1:{port}", tmp_path, credentials
    finally:
        process.terminate()
        process.wait(STOP_TIMEOUT_S)


async def test_tls_options_reach_nats_py(tls_server) -> None:
    url, certs, credentials = tls_server
    env = credentials[NatsRole.GATEWAY].environment()
    tls = ("--nats-tls-ca", str(certs / "ca.pem"), "--nats-tls-cert", str(certs / "client.pem"),
           "--nats-tls-key", str(certs / "client.key"))
    settings = NatsSettings.from_args(parse("--nats-url", url, *tls), NatsRole.GATEWAY, env)
    nc = await nats.connect(url, allow_reconnect=False, **settings.connect_options())
    await nc.publish(subjects.CANCEL, b"over tls")
    await barrier(nc)
    await nc.close()

    async def refused(*options: str) -> None:
        settings = NatsSettings.from_args(parse("--nats-url", url, *options), NatsRole.GATEWAY, env)
        await nats.connect(url, allow_reconnect=False, error_cb=ignore, **settings.connect_options())

    async def ignore(exc: Exception) -> None:
        pass

    with pytest.raises(ssl.SSLCertVerificationError):  # the system's CAs do not know the test CA
        await refused()
    with pytest.raises(OSError):  # the server requires a client certificate: an alert or a reset, by timing
        await refused(*tls[:2])
    with pytest.raises(ValueError, match="--nats-tls-ca"):
        await refused("--nats-tls-ca", str(certs / "server.ext"))


def _stop(proc: subprocess.Popen) -> None:
    """Stops `specmesh nats` and its server: a first signal may only start the server's lame-duck mode, a second
    ends it at once."""
    for _ in range(STOP_SIGNALS):
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(LAME_DUCK_WAIT_S)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait(STOP_TIMEOUT_S)


def test_specmesh_nats_writes_each_roles_credentials_and_keeps_them(tmp_path: Path) -> None:
    port, store = free_port(), tmp_path / "store"

    async def check() -> None:
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False)
        settings = NatsSettings.from_args(
            parse("--nats-url", f"nats://127.0.0.1:{port}", "--nats-credentials",
                  str(credentials_dir(store) / "gateway.json")), NatsRole.GATEWAY, {},
        )
        nc = await nats.connect(settings.url, allow_reconnect=False, **settings.connect_options())
        await nc.close()

    written = None
    for _ in range(2):  # a restart keeps the credentials, so separately started services reconnect
        cmd = [sys.executable, "-m", "services.cli", "nats", "--port", str(port), "--store-dir", str(store)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for_port("127.0.0.1", port, START_TIMEOUT_S, proc)
            asyncio.run(check())
            files = {p.name: p.read_bytes() for p in credentials_dir(store).iterdir()}
            assert set(files) == {f"{role}.json" for role in NatsRole}
            assert written in (None, files)
            written = files
        finally:
            _stop(proc)


@pytest.mark.e2e
def test_specmesh_up_on_an_external_server_hands_its_credentials_to_every_service(
    nats_server: NatsServer, tmp_path: Path  # noqa: F811
) -> None:
    """An external server with its own users: `specmesh up --nats-url --nats-credentials` logs every child in."""
    admin = str(nats_server.credentials_file(NatsRole.ADMIN))
    mesh = start_mesh(tmp_path, "--nats-url", nats_server.url, "--nats-credentials", admin, "--max-model-len", "256")
    try:
        client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
        completion = client.completions.create(model=mesh.model, prompt="def", max_tokens=4, temperature=0)
        assert completion.usage.completion_tokens > 0
        assert not (tmp_path / "nats").exists(), "no embedded server was started"
    finally:
        assert mesh.stop() == 0

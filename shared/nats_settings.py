"""How a service reaches NATS: the server's URL, the credentials of the service's role, TLS, and the reply-inbox
prefix its role may read. Built from the command line and the environment, validated before anything connects."""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, model_validator

from shared.nats_credentials import PASSWORD_ENV, USER_ENV, CredentialsError, NatsCredentials
from shared.nats_roles import NatsRole, inbox_prefix

DEFAULT_URL = "nats://127.0.0.1:4222"


def add_arguments(parser: argparse.ArgumentParser, url_default: str | None = DEFAULT_URL, url_help: str = "") -> None:
    """The NATS options every service takes (`specmesh up` passes them on to its services)."""
    parser.add_argument("--nats-url", default=url_default, help=url_help or "NATS server to connect to")
    parser.add_argument(
        "--nats-credentials", type=Path, default=None,
        help=f'JSON file {{"user": ..., "password": ...}}, mode 600 (default: {USER_ENV} and {PASSWORD_ENV})',
    )
    parser.add_argument("--nats-tls-ca", type=Path, default=None, help="CA certificates that verify the NATS server")
    parser.add_argument(
        "--nats-tls-cert", type=Path, default=None, help="client certificate for NATS, with --nats-tls-key"
    )
    parser.add_argument("--nats-tls-key", type=Path, default=None, help="the client certificate's private key")


class NatsTls(BaseModel):
    """TLS towards NATS: the server verified against `ca` (or the system's CAs), and optionally a client certificate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    @model_validator(mode="after")
    def _cert_with_key(self) -> "NatsTls":
        if (self.cert is None) != (self.key is None):
            flags = ["--nats-tls-cert", "--nats-tls-key"]
            given, missing = flags if self.key is None else flags[::-1]
            raise ValueError(f"{given} needs {missing}")
        return self

    def context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=None if self.ca is None else str(self.ca))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--nats-tls-ca {self.ca}: {exc}") from exc
        if self.cert is not None:
            try:
                context.load_cert_chain(str(self.cert), str(self.key))
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"--nats-tls-cert {self.cert} / --nats-tls-key {self.key}: {exc}") from exc
        return context


class NatsSettings(BaseModel):
    """Everything natsutil.connect needs besides the service's name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    role: NatsRole
    credentials: NatsCredentials | None = None  # None: the URL's own (nats://user:password@host) or none at all
    tls: NatsTls | None = None

    @model_validator(mode="after")
    def _credentials_once(self) -> "NatsSettings":
        if self.credentials is not None and urlsplit(self.url).username is not None:
            raise ValueError("NATS credentials given twice: in --nats-url and in --nats-credentials or the environment")
        return self

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, role: NatsRole, environ: Mapping[str, str] = os.environ
    ) -> "NatsSettings":
        from_env = NatsCredentials.from_environment(environ)
        if args.nats_credentials is not None and from_env is not None:
            raise CredentialsError(f"NATS credentials given twice: --nats-credentials and {USER_ENV}/{PASSWORD_ENV}")
        credentials = from_env if args.nats_credentials is None else NatsCredentials.from_file(args.nats_credentials)
        paths = (args.nats_tls_ca, args.nats_tls_cert, args.nats_tls_key)
        tls = None if paths == (None, None, None) else NatsTls(ca=paths[0], cert=paths[1], key=paths[2])
        return cls(url=args.nats_url, role=role, credentials=credentials, tls=tls)

    def connect_options(self) -> dict[str, object]:
        """nats-py's connect() keywords for the credentials, TLS and the role's inbox prefix."""
        options: dict[str, object] = {"inbox_prefix": inbox_prefix(self.role)}
        if self.credentials is not None:
            options["user"] = self.credentials.user
            options["password"] = self.credentials.password.get_secret_value()
        if self.tls is not None:
            options["tls"] = self.tls.context()
        return options

    def command_line(self) -> list[str]:
        """The options that hand these settings to a child service, credentials excepted (they go by environment)."""
        args = ["--nats-url", self.url]
        if self.tls is not None:
            paths = {"--nats-tls-ca": self.tls.ca, "--nats-tls-cert": self.tls.cert, "--nats-tls-key": self.tls.key}
            for flag, path in paths.items():
                if path is not None:
                    args += [flag, str(path)]
        return args

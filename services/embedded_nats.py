"""`specmesh nats`: the embedded NATS server alone, in the foreground.

Its users' credentials live in `<store-dir>/credentials/<role>.json`: made at the first start, kept across restarts
so that services started separately (`--nats-credentials <store-dir>/credentials/<role>.json`) reconnect after one.
Delete the directory to change them.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from shared.nats_credentials import MeshCredentials
from shared.nats_server import credentials_dir, default_store_dir, server_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4222)
    parser.add_argument("--store-dir", type=Path, default=default_store_dir())


def run(args: argparse.Namespace) -> None:
    credentials = MeshCredentials.read_or_generate(credentials_dir(args.store_dir))
    cmd = server_command(args.port, args.store_dir, credentials, args.host)
    print(f"specmesh nats: credentials of each role in {credentials_dir(args.store_dir)}", flush=True)
    raise SystemExit(subprocess.call(cmd))

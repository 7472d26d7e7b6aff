"""`specmesh nats`: the embedded NATS server alone, in the foreground."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from shared.nats_server import default_store_dir, server_binary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4222)
    parser.add_argument("--store-dir", type=Path, default=default_store_dir())


def run(args: argparse.Namespace) -> None:
    args.store_dir.mkdir(parents=True, exist_ok=True)
    cmd = [server_binary(), "--jetstream", "--addr", args.host, "--port", str(args.port), "--store_dir", str(args.store_dir)]
    raise SystemExit(subprocess.call(cmd))

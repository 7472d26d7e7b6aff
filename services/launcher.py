"""`specmesh up`: the whole mesh on one machine, as child processes, stopped together.

NATS (embedded, unless --nats-url names one), a detokenizer, the workers and a gateway start in that order.
The embedded server gets new passwords at every start, one NATS user per role (shared/nats_roles.py); each child
receives its role's credentials in its environment. With --nats-url, every child connects with the credentials and
TLS options given to `specmesh up` (or the URL's own).
The URL is printed once a one-token completion has travelled the whole path. SIGINT or SIGTERM stops the
children in reverse order and waits for them, so no process is left behind.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from shared import nats_settings
from shared.config import DEFAULT_MODEL_DIR, EngineConfig
from shared.nats_credentials import MeshCredentials
from shared.nats_roles import SERVICE_ROLES, NatsRole
from shared.nats_server import credentials_dir, default_store_dir, free_port, start_nats_server
from shared.nats_settings import NatsSettings
from shared.tokenizer import TOKENIZER_FILE

STOP_GRACE_S = 15.0
PR_SET_PDEATHSIG = 1  # Linux prctl option: signal the child when its parent dies


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--detokenizers", type=int, default=1)
    nats_settings.add_arguments(
        parser, url_default=None, url_help="use this NATS server instead of starting one (then --nats-credentials and "
        "--nats-tls-* are handed to every service)",
    )
    parser.add_argument("--nats-port", type=int, default=4222)
    parser.add_argument("--nats-store-dir", type=Path, default=default_store_dir())
    parser.add_argument("--speculative-config", default=None)
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.model_fields["max_num_seqs"].default)
    parser.add_argument("--max-model-len", type=int, default=EngineConfig.model_fields["max_model_len"].default)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks per worker (default: no preemption)")
    parser.add_argument("--block-size", type=int, default=EngineConfig.model_fields["block_size"].default)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--torch-threads", type=int, default=0,
        help="each worker's torch intra-op threads (default 0: torch's own choice, one per core)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true",
        help="on CUDA, run decode and verify passes eagerly instead of as captured CUDA graphs",
    )
    parser.add_argument(
        "--load-format", default=EngineConfig.model_fields["load_format"].default, choices=["auto", "dummy"],
        help="auto: the checkpoint's weights; dummy: random weights from config.json alone, for speed measurements",
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--log-level", default="INFO")


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own shutdown still stops every child


def _spawn(service: str, log_level: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", "--log-level", log_level, service, *extra]
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent, env=env)


def _child_nats(
    args: argparse.Namespace, nats_url: str, credentials: MeshCredentials | None, role: NatsRole
) -> tuple[list[str], dict[str, str]]:
    """A child's NATS options and environment: its role's credentials on the embedded server, or whatever
    --nats-credentials, the environment and the TLS options say for an external one. Passwords go by environment."""
    if credentials is not None:
        settings = NatsSettings(url=nats_url, role=role, credentials=credentials[role])
    else:
        settings = NatsSettings.from_args(args, role)
    env = dict(os.environ)
    if settings.credentials is not None:
        env.update(settings.credentials.environment())
    return settings.command_line(), env


def _refuse_external_only_options(args: argparse.Namespace) -> None:
    """The embedded server makes its own credentials and listens on loopback without TLS."""
    given = [flag for flag, value in (
        ("--nats-credentials", args.nats_credentials), ("--nats-tls-ca", args.nats_tls_ca),
        ("--nats-tls-cert", args.nats_tls_cert), ("--nats-tls-key", args.nats_tls_key),
    ) if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to an external NATS server: give --nats-url too")


def _probe(url: str, model: str) -> bool:
    body = json.dumps({"model": model, "prompt": "def", "max_tokens": 1}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop


def _stop_all(children: list[tuple[str, subprocess.Popen]]) -> None:
    """Stops the services together, then NATS, so that they can drain their connections first."""
    services = [(name, proc) for name, proc in children if name != "nats"]
    _stop(services)
    _stop([(name, proc) for name, proc in children if name == "nats"])


def _stop(children: list[tuple[str, subprocess.Popen]]) -> None:
    for _, proc in children:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for name, proc in children:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"specmesh: {name} did not stop in {STOP_GRACE_S}s; killing it", file=sys.stderr)
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace) -> None:
    if not (Path(args.model) / TOKENIZER_FILE).is_file():
        # The gateway encodes prompts and the detokenizer decodes tokens; only the engine (and its benchmarks)
        # can serve a model directory without a tokenizer, such as a shape from benchmarks/shapes.
        raise SystemExit(f"specmesh: {args.model} has no {TOKENIZER_FILE}: the gateway and detokenizer need one")
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    children: list[tuple[str, subprocess.Popen]] = []
    exit_code = 0
    try:
        nats_url = args.nats_url
        credentials = None
        if nats_url is None:
            _refuse_external_only_options(args)
            credentials = MeshCredentials.generate()
            nats = start_nats_server(
                args.nats_port, args.nats_store_dir, credentials, start_new_session=True, preexec_fn=_die_with_parent
            )
            children.append(("nats", nats))
            nats_url = f"nats://127.0.0.1:{args.nats_port}"
        nats_of = {role: _child_nats(args, nats_url, credentials, role) for role in SERVICE_ROLES}
        common = ["--model", str(args.model)]
        url = f"http://{args.host}:{args.port}"
        metrics_urls = {"gateway": f"{url}/metrics"}
        for i in range(args.detokenizers):
            port = free_port()
            name = "detokenizer" if args.detokenizers == 1 else f"detokenizer-{i}"
            metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"
            nats_args, env = nats_of[NatsRole.DETOKENIZER]
            extra = (*nats_args, "--metrics-port", str(port))
            children.append((name, _spawn("detokenizer", args.log_level, *common, *extra, env=env)))
        worker_args = [*common, "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
        worker_args += ["--device", args.device, "--block-size", str(args.block_size)]
        worker_args += ["--torch-threads", str(args.torch_threads)]
        if args.num_kv_blocks is not None:
            worker_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
        if args.enforce_eager:
            worker_args.append("--enforce-eager")
        worker_args += ["--load-format", args.load_format]
        if args.speculative_config:
            worker_args += ["--speculative-config", args.speculative_config]
        for i in range(args.workers):
            port = free_port()
            metrics_urls[f"worker-{i}"] = f"http://127.0.0.1:{port}/metrics"
            nats_args, env = nats_of[NatsRole.WORKER]
            extra = (*nats_args, "--worker-id", str(i), "--metrics-port", str(port))
            children.append((f"worker-{i}", _spawn("worker", args.log_level, *worker_args, *extra, env=env)))
        gateway_args = [*common, "--host", args.host, "--port", str(args.port), "--max-model-len", str(args.max_model_len)]
        if args.speculative_config:  # the gateway refuses requests for more drafts than the workers make
            gateway_args += ["--speculative-config", args.speculative_config]
        nats_args, env = nats_of[NatsRole.GATEWAY]
        children.append(("gateway", _spawn("gateway", args.log_level, *gateway_args, *nats_args, env=env)))

        deadline = time.monotonic() + args.startup_timeout
        while not _probe(url, Path(args.model).name):
            dead = [name for name, proc in children if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the mesh did not answer within {args.startup_timeout}s")
            time.sleep(0.5)
        print(f"specmesh is up: {url}/v1 (model {Path(args.model).name}, NATS {nats_url})", flush=True)
        for name, metrics_url in metrics_urls.items():
            print(f"  metrics of {name}: {metrics_url}", flush=True)
        if credentials is not None:
            print(f"  NATS credentials (one file per role): {credentials_dir(args.nats_store_dir)}", flush=True)
        while True:
            dead = [name for name, proc in children if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited; stopping the mesh")
            time.sleep(0.5)
    except _Stop:
        print("specmesh: stopping", flush=True)
    except RuntimeError as exc:
        print(f"specmesh: {exc}", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop_all(children)
    raise SystemExit(exit_code)

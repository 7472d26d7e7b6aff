"""`specmesh up`: the whole mesh on one machine, as child processes, stopped together.

NATS (embedded, unless --nats-url names one), a detokenizer, the workers and a gateway start in that order.
The embedded server gets new passwords at every start, one NATS user per role (shared/nats_roles.py); each child
receives its role's credentials in its environment, and the server's admin user declares the streams (shared/
streams.py). With --nats-url, every child connects with the credentials and TLS options given to `specmesh up` (or
the URL's own), and so does the declaration; where they are not the admin's, the streams must be declared already.
The URL is printed once a one-token completion has travelled the whole path. From then on a child that exits is
started again with backoff (services/supervisor.py) and the mesh keeps serving; only a child that crashes more than
--max-restarts times in a row ends it. SIGINT or SIGTERM stops the services, then NATS, within a few seconds
(SIGKILL after a grace period), so no process is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import nats.errors
from pydantic import SecretStr

from shared import nats_settings, option_types, stream_limits, streams
from services.gateway import auth, limits, routing_options, seed_option, unknown_fields
from services.gateway.reasoning import options as reasoning_options
from services.gateway.tools import tool_options
from services.gateway.auth import API_KEY_ENV, API_KEY_ENVS, KEY_SEPARATOR
from services.gateway.limits import GatewayLimits
from services import cpu_plan, engine_flags
from services.cpu_affinity import format_cpu_list, pin
from services.detokenizer.migration import max_migrations_arg
from services.worker.engine.kv_budget import default_cpu_budget
from services.startup_checks import (
    UsageError, check_kv_cache_memory, check_tensor_parallel, check_tokenizer_dir,
    servable_max_model_len, speculative_config,
)
from services.supervisor import (
    SIGNALS, Child, RestartPolicy, StopRequested, Supervisor, die_with_parent, stop_children,
)
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.nats_credentials import MeshCredentials
from shared.nats_roles import SERVICE_ROLES, NatsRole
from shared.nats_server import admin_settings, credentials_dir, default_store_dir, start_nats_server
from shared.ports import can_listen, free_port
from shared.nats_settings import NatsSettings
from shared.stream_limits import StreamLimits
from shared.schemas import MAX_REQUEST_CHOICES
from shared.tokenizer import TOKENIZER_FILE

DISAGGREGATED_ROLES = ("prefill", "decode")  # worker roles that split a request between them (--role)

# Stopping takes at most SERVICE_STOP_GRACE_S + NATS_STOP_GRACE_S: a service still draining after its grace is
# killed (its unfinished requests stay in the work queue), and NATS, stopped last, has no clients left by then.
SERVICE_STOP_GRACE_S = 2.5
NATS_STOP_GRACE_S = 1.0
SUPERVISE_INTERVAL_S = 0.1  # how often the launcher looks for exited children once the mesh is up


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL_DIR,
        help="a local Hugging Face checkpoint directory (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3, Granite, "
        "Seed-OSS, Gemma 3)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    parser.add_argument("--port", type=option_types.port, default=8000, help="the gateway's HTTP port")
    parser.add_argument(
        "--workers", type=option_types.at_least(1), default=None,
        help="worker processes sharing the request queue (default 1)"
    )
    parser.add_argument(
        "--prefill-workers", type=option_types.at_least(0), default=0,
        help="prefill/decode disaggregation: workers that compute prompts and first tokens, then hand each request "
        "with its KV to a decode worker (with --decode-workers, instead of --workers)",
    )
    parser.add_argument(
        "--decode-workers", type=option_types.at_least(0), default=0,
        help="workers that continue the requests prefill workers hand them"
    )
    for role in DISAGGREGATED_ROLES:
        parser.add_argument(
            f"--{role}-tensor-parallel-size", type=engine_flags.tensor_parallel_size, default=None,
            help=f"split each {role} worker's model over this many processes (default: --tensor-parallel-size); a "
            "handoff carries every KV head, so the two roles may be split differently",
        )
    parser.add_argument(
        "--detokenizers", type=option_types.at_least(1), default=1,
        help="detokenizer processes; each request is owned by one of them"
    )
    nats_settings.add_arguments(
        parser, url_default=None, url_help="use this NATS server instead of starting one (then --nats-credentials and "
        "--nats-tls-* are handed to every service)",
    )
    parser.add_argument("--nats-port", type=option_types.port, default=4222, help="the embedded NATS server's port")
    parser.add_argument(
        "--nats-store-dir", type=Path, default=default_store_dir(), help="the embedded NATS server's JetStream store"
    )
    parser.add_argument(
        "--speculative-config", type=speculative_config, default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' (README: Speculative decoding)',
    )
    parser.add_argument(
        "--max-num-seqs", type=option_types.at_least(1), default=EngineConfig.model_fields["max_num_seqs"].default,
        help="sequences each worker batches together",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None,
        help="prompt + generated tokens per sequence (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--num-kv-blocks", type=option_types.at_least(1), default=None,
        help="KV-cache blocks per worker (default: --max-num-seqs full-length sequences, within --kv-cache-memory)",
    )
    parser.add_argument(
        "--block-size", type=option_types.at_least(1), default=EngineConfig.model_fields["block_size"].default,
        help="positions per KV-cache block",
    )
    parser.add_argument("--device", default="cpu", help="the workers' torch device: cpu or cuda")
    cpu_plan.add_arguments(parser)
    parser.add_argument(
        "--enforce-eager", action="store_true",
        help="on CUDA, run decode and verify passes eagerly instead of as captured CUDA graphs",
    )
    engine_flags.add_arguments(parser)
    parser.add_argument(
        "--load-format", default=EngineConfig.model_fields["load_format"].default, choices=["auto", "dummy"],
        help="auto: the checkpoint's weights; dummy: random weights from config.json alone, for speed measurements",
    )
    parser.add_argument(
        "--served-model-name", default=None,
        help="the name clients send as `model` and /v1/models lists (default: the model directory's name)",
    )
    parser.add_argument(
        "--max-n", type=option_types.between(1, MAX_REQUEST_CHOICES), default=None,
        help="the most choices per prompt a request may ask for (`n`) (default: the gateway's own)",
    )
    parser.add_argument(
        "--max-migrations", type=max_migrations_arg, default=None,
        help="times a request whose worker died may be taken over by another before it ends with an error "
        "(default: the detokenizer's own)",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds for the first completion to travel the mesh"
    )
    auth.add_arguments(parser)
    parser.add_argument(
        "--max-restarts", type=option_types.at_least(0), default=RestartPolicy.max_restarts,
        help="restarts in a row of a crashing child (with backoff) before the mesh gives up; 0: any exit ends it",
    )
    limits.add_arguments(
        parser, in_flight_default=None,
        in_flight_help="sequences (prompts x n) in the mesh at once; more wait at the gateway and are admitted round "
        "robin between clients (default: workers x max-num-seqs, the workers' batch slots; 0: no bound)",
    )
    stream_limits.add_arguments(parser)
    routing_options.add_arguments(parser)
    unknown_fields.add_arguments(parser)
    seed_option.add_arguments(parser)
    tool_options.add_arguments(parser)
    reasoning_options.add_arguments(parser)


def resolve_args(args: argparse.Namespace) -> None:
    """The workers must be able to serve the model; --max-model-len defaults to its context length, which the
    gateway and the workers are then both given."""
    check_tokenizer_dir(args.model)
    args.max_model_len = servable_max_model_len(args.model, args.max_model_len)
    args.api_keys = auth.parse_api_keys(args.api_key, args.api_key_file, os.environ)
    args.worker_roles = worker_roles(args.workers, args.prefill_workers, args.decode_workers)
    args.worker_tensor_parallel = worker_tensor_parallel(args)
    for size in sorted(set(args.worker_tensor_parallel)):
        check_tensor_parallel(args.model, size, args.enable_expert_parallel, args.speculative_config)
        check_kv_cache_memory(EngineConfig(
            model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, device=args.device,
            speculative=SpeculativeConfig.from_json(args.speculative_config),
            **(engine_flags.config_keys(args) | {"tensor_parallel_size": size}),
        ))
    args.workers = len(args.worker_roles)
    if args.kv_cache_memory is None and not args.device.startswith("cuda") and args.workers > 1:
        # The workers draw on one host's memory: each gets its share of the default (kv_budget.py)
        args.kv_cache_memory = default_cpu_budget() // args.workers
    args.cpu_plan = cpu_plan.plan_for(args, args.workers)
    # Last of the checks, still before anything starts: else the start-up probe, API key and all, would reach
    # whatever holds the port, and report the mesh up.
    if not can_listen(args.host, args.port):
        raise UsageError(f"--port {args.port}: {args.host}:{args.port} is already in use by another program")
    if args.nats_url is None and not can_listen("127.0.0.1", args.nats_port):  # where start_nats_server listens
        raise UsageError(f"--nats-port {args.nats_port}: already in use by another program")


def worker_tensor_parallel(args: argparse.Namespace) -> list[int]:
    """Each worker's --tensor-parallel-size: its role's own where one is given (disaggregated workers only), else
    --tensor-parallel-size."""
    sizes = {role: getattr(args, f"{role}_tensor_parallel_size") for role in DISAGGREGATED_ROLES}
    given = [f"--{role}-tensor-parallel-size" for role, size in sizes.items() if size is not None]
    if given and "both" in args.worker_roles:
        raise UsageError(f"{' and '.join(given)} split disaggregated workers: give --prefill-workers and "
                         "--decode-workers, or --tensor-parallel-size for whole-request workers")
    return [sizes.get(role) or args.tensor_parallel_size for role in args.worker_roles]


def worker_roles(workers: int | None, prefill_workers: int, decode_workers: int) -> list[str]:
    """Each worker's --role: `workers` doing whole requests, or prefill workers then decode workers."""
    if not prefill_workers and not decode_workers:
        return ["both"] * (1 if workers is None else workers)
    if workers is not None:
        raise UsageError("--workers does not go with --prefill-workers and --decode-workers: they count the workers")
    if prefill_workers < 1 or decode_workers < 1:
        raise UsageError(
            f"--prefill-workers {prefill_workers} --decode-workers {decode_workers}: disaggregation needs at least one "
            "of each"
        )
    return ["prefill"] * prefill_workers + ["decode"] * decode_workers


def _spawn(
    service: str, log_level: str, *extra: str, env: dict[str, str] | None = None, cpus: frozenset[int] | None = None,
    death_signal: int = signal.SIGTERM,
) -> Child:
    cmd = [sys.executable, "-m", "services.cli", service, "--log-level", log_level, *extra]
    setup = _child_setup(cpus, death_signal)
    return Child(lambda: subprocess.Popen(cmd, start_new_session=True, preexec_fn=setup, env=env))


def _child_setup(cpus: frozenset[int] | None, death_signal: int = signal.SIGTERM) -> Callable[[], None]:
    """preexec_fn of a child: it gets `death_signal` when the launcher dies, and runs on `cpus` (None: wherever the
    kernel puts it)."""

    def setup() -> None:
        die_with_parent(death_signal)
        pin(cpus)

    return setup


def _service_death_signal(args: argparse.Namespace) -> int:
    """What a service gets when the launcher dies (kill -9, the OOM killer). With an external NATS, SIGTERM: it drains
    and hands its requests back through the NATS that outlives it. With the embedded one, NATS dies too and a drain
    has nowhere to go: it would wait out its timeouts (a minute) with the engines generating for no one."""
    return signal.SIGKILL if args.nats_url is None else signal.SIGTERM


def _child_nats(
    args: argparse.Namespace, nats_url: str, credentials: MeshCredentials | None, role: NatsRole
) -> tuple[list[str], dict[str, str]]:
    """A child's NATS options and environment: its role's credentials on the embedded server, or whatever
    --nats-credentials, the environment and the TLS options say for an external one. Passwords go by environment."""
    if credentials is not None:
        settings = NatsSettings(url=nats_url, role=role, credentials=credentials[role])
    else:
        settings = NatsSettings.from_args(args, role)
    # The API keys are the gateway's alone (the launcher hands them to it below), whatever started the launcher with.
    env = {name: value for name, value in os.environ.items() if name not in API_KEY_ENVS}
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


def _drop_orphaned_requests(nats_url: str, credentials: MeshCredentials, store_dir: Path) -> None:
    """Requests an earlier `up` on this store left (it was killed): their clients are gone with its gateway."""
    dropped = streams.OnThread(streams.drop_orphaned_requests(admin_settings(nats_url, credentials))).result()
    if dropped:
        print(f"specmesh: dropped {dropped} requests an earlier run left in {store_dir} (their clients are gone)",
              flush=True)


def _declare_external_streams(args: argparse.Namespace) -> None:
    """Declares the streams on --nats-url with the credentials given; a user that may not (one of a service role)
    leaves them to the server's admin, and the services wait for them."""
    settings = NatsSettings.from_args(args, NatsRole.ADMIN)
    try:
        streams.declare_blocking(settings, StreamLimits.from_args(args), args.startup_timeout)
    except TimeoutError as exc:  # no server there
        raise RuntimeError(str(exc)) from exc
    except (nats.errors.Error, PermissionError) as exc:
        print(f"specmesh: could not declare the streams on {args.nats_url} ({exc!r}); the services wait for them: "
              f"{streams.HOW_TO_DECLARE}", file=sys.stderr, flush=True)


def _probe(url: str, model: str, api_keys: tuple[SecretStr, ...]) -> bool:
    body = json.dumps({"model": model, "prompt": "def", "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    if api_keys:
        headers["Authorization"] = f"Bearer {api_keys[0].get_secret_value()}"
    req = urllib.request.Request(f"{url}/v1/completions", body, headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop_all(children: list[tuple[str, Child]]) -> None:
    """Stops the services together, then NATS, so that they can close their connections first."""
    stop_children([(name, child) for name, child in children if name != "nats"], SERVICE_STOP_GRACE_S)
    stop_children([(name, child) for name, child in children if name == "nats"], NATS_STOP_GRACE_S)


def run(args: argparse.Namespace) -> None:
    if not (Path(args.model) / TOKENIZER_FILE).is_file():
        # The gateway encodes prompts and the detokenizer decodes tokens; only the engine (and its benchmarks)
        # can serve a model directory without a tokenizer, such as a shape from benchmarks/shapes.
        raise SystemExit(f"specmesh: {args.model} has no {TOKENIZER_FILE}: the gateway and detokenizer need one")
    SIGNALS.install()
    children: list[tuple[str, Child]] = []
    plan = args.cpu_plan
    print(f"{cpu_plan.PLAN_LINE}{plan.describe()}", flush=True)
    rest = plan.rest_cpus  # every process but the engines, when they are pinned
    pin(rest)  # this one's supervision loop too
    exit_code = 0
    try:
        nats_url = args.nats_url
        credentials = None
        if nats_url is None:
            _refuse_external_only_options(args)
            credentials = MeshCredentials.generate()
            nats = Child(lambda: start_nats_server(
                args.nats_port, args.nats_store_dir, credentials, limits=StreamLimits.from_args(args),
                start_new_session=True, preexec_fn=_child_setup(rest),
            ))
            children.append(("nats", nats))
            nats_url = f"nats://127.0.0.1:{args.nats_port}"
            _drop_orphaned_requests(nats_url, credentials, args.nats_store_dir)
        else:
            _declare_external_streams(args)
        nats_of = {role: _child_nats(args, nats_url, credentials, role) for role in SERVICE_ROLES}
        death_signal = _service_death_signal(args)
        common = ["--model", str(args.model)]
        url = f"http://{args.host}:{args.port}"
        metrics_urls = {"gateway": f"{url}/metrics"}
        for i in range(args.detokenizers):
            port = free_port()
            name = "detokenizer" if args.detokenizers == 1 else f"detokenizer-{i}"
            metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"
            nats_args, env = nats_of[NatsRole.DETOKENIZER]
            extra = (*nats_args, "--metrics-port", str(port))
            if args.max_migrations is not None:
                extra += ("--max-migrations", str(args.max_migrations))
            children.append((name, _spawn(
                "detokenizer", args.log_level, *common, *extra, env=env, cpus=rest, death_signal=death_signal
            )))
        worker_args = [*common, "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
        worker_args += ["--device", args.device, "--block-size", str(args.block_size)]
        if args.num_kv_blocks is not None:
            worker_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
        if args.enforce_eager:
            worker_args.append("--enforce-eager")
        worker_args += engine_flags.forwarded(args)
        worker_args += ["--load-format", args.load_format]
        if args.speculative_config:
            worker_args += ["--speculative-config", args.speculative_config]
        worker_args += ["--torch-threads", str(plan.torch_threads)]
        for i in range(args.workers):
            port = free_port()
            metrics_urls[f"worker-{i}"] = f"http://127.0.0.1:{port}/metrics"
            nats_args, env = nats_of[NatsRole.WORKER]
            engine_cpus = plan.engine_cpus[i]
            extra = (*nats_args, "--worker-id", str(i), "--metrics-port", str(port), "--engine-cpus",
                     cpu_plan.UNPINNED if engine_cpus is None else format_cpu_list(engine_cpus),
                     "--role", args.worker_roles[i], "--tensor-parallel-size", str(args.worker_tensor_parallel[i]))
            children.append((f"worker-{i}", _spawn(
                "worker", args.log_level, *worker_args, *extra, env=env, cpus=plan.worker_cpus(i),
                death_signal=death_signal,
            )))
        gateway_args = [*common, "--host", args.host, "--port", str(args.port), "--max-model-len", str(args.max_model_len)]
        if args.max_n is not None:  # the gateway's own default otherwise: importing it would load torch here
            gateway_args += ["--max-n", str(args.max_n)]
        served_name = args.served_model_name or Path(args.model).name
        gateway_args += ["--served-model-name", served_name]
        if args.max_in_flight is None:  # the workers' batch slots: the gateway, not the queue, orders what waits
            args.max_in_flight = args.workers * args.max_num_seqs
        gateway_args += GatewayLimits.from_args(args).command_line()
        gateway_args += routing_options.forwarded(args)
        gateway_args += unknown_fields.forwarded(args)
        gateway_args += seed_option.forwarded(args)
        gateway_args += tool_options.forwarded(args)
        gateway_args += reasoning_options.forwarded(args)
        if args.speculative_config:  # the gateway refuses requests for more drafts than the workers make
            gateway_args += ["--speculative-config", args.speculative_config]
        # Stopping, the whole mesh stops at once: open requests cannot finish, so the gateway ends them with a 503
        # at once, which cancels them in the mesh while NATS is still up (nothing left to redeliver at next start).
        gateway_args += ["--shutdown-timeout", "0"]
        nats_args, env = nats_of[NatsRole.GATEWAY]
        if args.api_keys:  # by environment: a command line is visible to every user of the machine
            env = {**env, API_KEY_ENV: KEY_SEPARATOR.join(key.get_secret_value() for key in args.api_keys)}
        children.append(("gateway", _spawn(
            "gateway", args.log_level, *gateway_args, *nats_args, env=env, cpus=rest, death_signal=death_signal
        )))

        deadline = time.monotonic() + args.startup_timeout
        while not _probe(url, served_name, args.api_keys):
            SIGNALS.check()
            dead = [name for name, proc in children if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the mesh did not answer within {args.startup_timeout}s")
            time.sleep(0.5)
        print(f"specmesh is up: {url}/v1 (model {served_name}, NATS {nats_url})", flush=True)
        for name, metrics_url in metrics_urls.items():
            print(f"  metrics of {name}: {metrics_url}", flush=True)
        if credentials is not None:
            print(f"  NATS credentials (one file per role): {credentials_dir(args.nats_store_dir)}", flush=True)
        supervisor = Supervisor(children, RestartPolicy(max_restarts=args.max_restarts))
        while True:
            supervisor.check()
            time.sleep(SUPERVISE_INTERVAL_S)
    except StopRequested:
        print("specmesh: stopping", flush=True)
    except RuntimeError as exc:  # CrashLoopError included
        print(f"specmesh: {exc}", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        SIGNALS.ignore()
        _stop_all(children)
    raise SystemExit(exit_code)

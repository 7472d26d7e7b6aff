"""`specmesh worker`: options and the lifecycle of one worker process.

Start: spawn the engine process (engine_process.py), which loads the model and warms it up, connect, then take
requests. SIGTERM: readiness goes false, no new work is taken, in-flight requests may finish for `--drain-timeout`
seconds, the engine stops, the rest are handed back to the queue with their progress for another worker to
continue, and the NATS connection is drained.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import zlib
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from shared import option_types
from shared import nats_settings, subjects
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.nats_roles import NatsRole
from shared.nats_settings import NatsSettings
from shared import streams
from shared.natsutil import connect, core_only
from shared.observability import Readiness, start_http
from shared.prefix_router import PrefixRouter
from services import cpu_plan, engine_flags
from services.cpu_affinity import pin
from services.startup_checks import (
    check_kv_cache_memory, check_tensor_parallel, servable_max_model_len, speculative_config,
)
from services.worker.dead_letters import DeadLetters
from services.worker.engine_process import EngineProcess
from services.worker.handoff.nats_transport import NatsKvTransport
from services.worker.handoff.sender import HandoffSender
from services.worker.metrics import BAD_WORKER_STATES, HANDOFF_TRANSFERS_HELD, WorkerMetrics
from services.worker.queue_worker import ENGINE_STALL_S, QueueWorker
from services.worker.routing import Routing

log = logging.getLogger("specmesh.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    nats_settings.add_arguments(parser)
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL_DIR,
        help="a local Hugging Face checkpoint directory (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3, Granite, "
        "Seed-OSS, Gemma 3)"
    )
    parser.add_argument(
        "--speculative-config", type=speculative_config, default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' (README: Speculative decoding)',
    )
    parser.add_argument(
        "--max-num-seqs", type=option_types.at_least(1), default=EngineConfig.model_fields["max_num_seqs"].default,
        help="sequences batched together",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None,
        help="prompt + generated tokens per sequence (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--num-kv-blocks", type=option_types.at_least(1), default=None,
        help="KV cache blocks (default: enough for max-num-seqs full-length sequences, within --kv-cache-memory); "
        "fewer preempt sequences",
    )
    parser.add_argument(
        "--block-size", type=option_types.at_least(1), default=EngineConfig.model_fields["block_size"].default,
        help="positions per KV cache block",
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu or cuda")
    cpu_plan.add_arguments(parser)
    parser.add_argument(
        "--load-format", default=EngineConfig.model_fields["load_format"].default, choices=["auto", "dummy"],
        help="auto: the checkpoint's weights; dummy: random weights from config.json alone, for speed measurements",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true",
        help="on CUDA, run decode and verify passes eagerly instead of as captured CUDA graphs",
    )
    engine_flags.add_arguments(parser)
    parser.add_argument(
        "--role", default=EngineConfig.model_fields["role"].default, choices=["both", "prefill", "decode"],
        help="prefill/decode disaggregation: prefill computes prompts and first tokens and hands each request, with "
        "its KV, to a decode worker; decode takes only those; both (the default) does whole requests",
    )
    parser.add_argument(
        "--worker-id", type=int, default=None, help="numeric id in frame headers and metrics (default: from host and pid)"
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address of /metrics, /health and /ready")
    parser.add_argument(
        "--metrics-port", type=option_types.port_or_any, default=9100,
        help="/metrics, /health and /ready; 0 picks one",
    )
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds in-flight requests may finish on SIGTERM")
    parser.add_argument(
        "--engine-stall-timeout", type=option_types.seconds, default=ENGINE_STALL_S,
        help="seconds an engine holding requests may return no step before it is taken to hang: its requests are "
        "then left for other workers to take over",
    )


def resolve_args(args: argparse.Namespace) -> None:
    """The engine must be able to serve the model; --max-model-len defaults to its context length."""
    args.max_model_len = servable_max_model_len(args.model, args.max_model_len)
    check_tensor_parallel(args.model, args.tensor_parallel_size, args.enable_expert_parallel, args.speculative_config)
    check_kv_cache_memory(engine_config(args))
    args.cpu_plan = cpu_plan.plan_for(args, 1)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        device=args.device,
        load_format=args.load_format,
        speculative=SpeculativeConfig.from_json(args.speculative_config),
        enforce_eager=args.enforce_eager,
        role=args.role,
        **engine_flags.config_keys(args),
    )


async def _start_handoffs(nc, worker: QueueWorker, worker_id: int, metrics: WorkerMetrics) -> None:
    """Prefill/decode disaggregation (handoff/): a decode worker receives KV transfers; a prefill worker follows the
    decode workers' states and cache events to choose where each request goes."""
    role = worker.role
    transport = NatsKvTransport(nc, worker_id, has_room=worker.has_room_for_handoff)
    if role == "decode":
        await transport.start()
        worker.transport = transport
        metrics.child(HANDOFF_TRANSFERS_HELD).set_function(lambda: transport.num_held)
    elif role == "prefill":
        router = PrefixRouter(
            nc, roles=frozenset({"decode"}), min_choices=1,
            on_bad_message=lambda kind: metrics.child(BAD_WORKER_STATES).inc(),
        )
        await router.start()
        worker.sender = HandoffSender(nc, worker_id, transport, router, metrics)


def _report_stop(what: str) -> Callable[[asyncio.Task], None]:
    """A done callback that logs a housekeeping task's failure: `what` is no longer done by this worker."""

    def report(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s no longer by this worker", what, exc_info=task.exception())

    return report


async def run(args: argparse.Namespace) -> None:
    readiness = Readiness()
    http = await start_http(readiness, args.metrics_host, args.metrics_port)
    config = engine_config(args)
    # Every container's pid is 1, so the host name (the pod's name on Kubernetes) must go into the default id.
    worker_id = args.worker_id if args.worker_id is not None else zlib.crc32(f"{socket.gethostname()}:{os.getpid()}".encode())
    plan = args.cpu_plan
    log.info("CPUs: %s", plan.describe())
    engine = await EngineProcess.start(config, worker_id, plan.torch_threads, plan.engine_cpus[0])
    pin(plan.rest_cpus)  # the event loop, once the engine process (which pins itself) is started
    log.info("model %s loaded and warmed up in %.1fs; speculation %s", config.model, engine.ready.seconds,
             config.speculative.model_dump_json())
    try:
        await _serve(args, readiness, http, engine, worker_id)
    finally:
        await engine.close()


async def _serve(
    args: argparse.Namespace, readiness: Readiness, http: web.AppRunner, engine: EngineProcess, worker_id: int
) -> None:
    config = engine.config
    nc = await connect(NatsSettings.from_args(args, NatsRole.WORKER), "worker")
    readiness.nc = nc
    js = nc.jetstream()
    await streams.wait_for(js, streams.WORKER_NEEDS, "worker")
    metrics = WorkerMetrics(Path(config.model).name, config.speculative.method, worker_id)
    metrics.observe_engine(engine.ready.kv_cache_bytes)
    worker = QueueWorker(engine, nc, worker_id, metrics, args.engine_stall_timeout)
    routing = Routing(
        nc, worker_id, config, engine.ready.revision, lambda: worker.num_choices, lambda: worker.num_routed_held,
        metrics,
    )
    worker.routing = routing
    await _start_handoffs(nc, worker, worker_id, metrics)
    await nc.subscribe(subjects.CANCEL, cb=core_only(worker.on_cancel))
    await nc.subscribe(subjects.STOP, cb=core_only(worker.on_cancel))
    # A decode worker takes only the requests handed to it, on its routed subject.
    psub = None if config.role == "decode" else await js.pull_subscribe_bind(
        subjects.WORKER_CONSUMER, subjects.REQUEST_STREAM
    )
    routed_psub = await routing.start()
    fetching = asyncio.create_task(worker.fetch_loop(psub) if psub is not None else asyncio.Event().wait())
    fetching_routed = asyncio.create_task(worker.fetch_loop(routed_psub, routed=True))
    heartbeat = asyncio.create_task(worker.heartbeat_loop())
    stepping = asyncio.create_task(worker.publish_loop())
    stating = asyncio.create_task(routing.state_loop())
    # Housekeeping, like moving dead letters: serving goes on without it.
    sweeping = asyncio.create_task(routing.sweep_loop())
    sweeping.add_done_callback(_report_stop("routed requests of workers gone are adopted"))
    # Not among the tasks that end the worker: moving dead letters is housekeeping; serving goes on without it.
    burying = asyncio.create_task(DeadLetters(nc, worker_id, metrics).loop())
    burying.add_done_callback(_report_stop("dead letters are moved"))
    readiness.started = True
    log.info("worker %d ready", worker_id)
    try:
        # asyncio.wait, unlike gather, leaves the tasks running when this coroutine is cancelled.
        done, _ = await asyncio.wait(
            [fetching, fetching_routed, heartbeat, stepping, stating], return_when=asyncio.FIRST_EXCEPTION
        )
        for task in done:
            task.result()
    except asyncio.CancelledError:
        readiness.draining = True
        routing.draining = True
        fetching.cancel()
        fetching_routed.cancel()
        await routing.publish_state()  # gateways stop routing here at once
        finished = await worker.wait_idle(args.drain_timeout)
        worker.stop()
        await stepping
        if not finished:
            log.warning("drain timeout: handed %d unfinished requests back to the queue", await worker.hand_back())
        await asyncio.gather(fetching, fetching_routed, return_exceptions=True)
        await routed_psub.unsubscribe()
        moved = await routing.move_backlog()
        if moved:
            log.info("moved %d routed requests to the shared queue", moved)
        heartbeat.cancel()
        burying.cancel()
        stating.cancel()
        sweeping.cancel()
        await asyncio.gather(heartbeat, burying, stating, sweeping, return_exceptions=True)
        if psub is not None:
            await psub.unsubscribe()  # a pull subscription with a fetch outstanding would stall the drain
        await nc.drain()
        await http.cleanup()

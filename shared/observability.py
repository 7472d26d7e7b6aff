"""Health, readiness and Prometheus metrics that every service exposes the same way.

`/health` is liveness: the process's event loop answers. `/ready` is readiness: NATS is connected, the
service has finished starting (a worker: model loaded and warmed up) and it is not draining. Workers and the
detokenizer serve these on a small HTTP port of their own; the gateway serves them on its API port.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from nats.aio.client import Client
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest
from prometheus_client.registry import REGISTRY


@dataclass
class Readiness:
    """What a service's /ready reports; each flag is set by the part of the service that knows it."""

    nc: Client | None = None
    started: bool = False
    draining: bool = False

    @property
    def checks(self) -> dict[str, bool]:
        return {
            "nats_connected": self.nc is not None and self.nc.is_connected,
            "started": self.started,
            "not_draining": not self.draining,
        }

    @property
    def ready(self) -> bool:
        return all(self.checks.values())


class NatsMetrics:
    """The NATS client's health as seen from one service: reconnects, slow-consumer drops, pending bytes.

    One per service and process (`for_service`), since Prometheus metrics are registered once.
    """

    _instances: dict[str, "NatsMetrics"] = {}

    @classmethod
    def for_service(cls, service: str) -> "NatsMetrics":
        if service not in cls._instances:
            cls._instances[service] = cls(service)
        return cls._instances[service]

    def __init__(self, service: str) -> None:
        self.reconnects = Counter(f"specmesh_{service}_nats_reconnects", "Reconnections to NATS")
        self.slow_consumers = Counter(
            f"specmesh_{service}_nats_slow_consumer_errors", "Messages dropped by a subscription over its pending limits"
        )
        self.permission_violations = Counter(
            f"specmesh_{service}_nats_permission_violations", "Publishes and subscriptions the NATS server refused"
        )
        self.errors = Counter(f"specmesh_{service}_nats_errors", "Other errors reported by the NATS client")
        self.pending_bytes = Gauge(f"specmesh_{service}_nats_pending_bytes", "Bytes buffered for publishing to NATS")

    def watch(self, nc: Client) -> None:
        self.pending_bytes.set_function(lambda: nc.pending_data_size if nc.is_connected else 0)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def ready_handler(readiness: Readiness):
    async def ready(request: web.Request) -> web.Response:
        status = 200 if readiness.ready else 503
        return web.json_response({"ready": readiness.ready, **readiness.checks}, status=status)

    return ready


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application, readiness: Readiness) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready_handler(readiness))
    app.router.add_get("/metrics", metrics)


async def start_http(readiness: Readiness, host: str, port: int) -> web.AppRunner:
    """The small HTTP server of a service that has no HTTP API of its own."""
    app = web.Application()
    add_routes(app, readiness)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

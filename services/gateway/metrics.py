"""The gateway's Prometheus metrics (default registry, served on GET /metrics)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import Counter, Gauge, Histogram


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

UNMATCHED_ROUTE = "unmatched"  # one label for every unknown path, so clients cannot blow up cardinality
CLIENT_GONE_STATUS = "client_disconnected"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# "route", not "endpoint": prometheus-operator sets `endpoint` on every target (the port's name), which would rename
# a scraped `endpoint` label to `exported_endpoint`.
REQUESTS = Counter("specmesh_gateway_requests", "HTTP requests by route and status code", ["route", "status"])
IN_FLIGHT = Gauge("specmesh_gateway_generations_in_flight", "Generation requests waiting for or streaming output")
TIME_TO_FIRST_CHUNK = Histogram(
    "specmesh_gateway_time_to_first_token_seconds",
    "From receiving a generation request to its first response chunk, by API (chat, completion, responses)",
    ["api"],
    buckets=LATENCY_BUCKETS,
)
REQUEST_DURATION = Histogram(
    "specmesh_gateway_request_duration_seconds",
    "From receiving a generation request to its last response chunk, by API",
    ["api"],
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "specmesh_gateway_inter_token_latency_seconds",
    "Time between tokens as the client receives them (a chunk's gap shared by its tokens), by API",
    ["api"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
CLIENT_DISCONNECTS = Counter("specmesh_gateway_client_disconnects", "Generation requests abandoned by their client")
REQUEST_ERRORS = Counter("specmesh_gateway_request_errors", "Requests answered with an error, by error type", ["type"])
PROMPT_TOKENS = Counter("specmesh_gateway_prompt_tokens", "Prompt tokens of finished generation requests")
COMPLETION_TOKENS = Counter("specmesh_gateway_completion_tokens", "Tokens generated for finished requests")
ROUTED_REQUESTS = Counter(
    "specmesh_gateway_routed_requests",
    "Requests sent to the worker holding the longest part of their prompt (target worker) or to the shared queue",
    ["target"],
)
BAD_ROUTING_MESSAGES = Counter(
    "specmesh_gateway_bad_routing_messages",
    "Worker states and cache events that could not be decoded and were dropped, by kind", ["kind"],
)


def count_bad_routing_message(kind: str) -> None:
    BAD_ROUTING_MESSAGES.labels(kind=kind).inc()


BAD_CHUNKS = Counter("specmesh_gateway_bad_chunks", "Response chunks that could not be decoded and were dropped")
BAD_HELD_QUERIES = Counter(
    "specmesh_gateway_bad_held_queries", "Detokenizers' questions after held requests that could not be decoded"
)
SEQUENCES_IN_FLIGHT = Gauge(
    "specmesh_gateway_admitted_sequences", "Sequences (prompts x n) of the requests admitted into the mesh (admission.py)"
)
ADMISSION_WAITING = Gauge("specmesh_gateway_admission_waiting", "Requests waiting at the gateway for room in the mesh")
ADMISSION_REFUSED = Counter(
    "specmesh_gateway_admission_refused", "Requests refused admission: per_key_limit (429), wait_timeout (503)", ["reason"]
)
BODY_REFUSED = Counter(
    "specmesh_gateway_bodies_refused", "Request bodies refused before parsing: too_large (413), too_slow (408)", ["reason"]
)


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost middleware, so it sees the status the error middleware settled on."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else UNMATCHED_ROUTE
    try:
        response = await handler(request)
    except (ConnectionResetError, asyncio.CancelledError):
        REQUESTS.labels(route, CLIENT_GONE_STATUS).inc()
        raise
    REQUESTS.labels(route, str(response.status)).inc()
    return response

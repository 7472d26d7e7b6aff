"""The gateway's aiohttp application: OpenAI-compatible routes over one NATS connection.

Run it with an AppRunner created with `handler_cancellation=True` (service.py does), so that a client
that hangs up while waiting for a non-streaming answer cancels its handler, and with it the generation, and with
`config.limits.runner_options()`, which bound how long a connection may sit without a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

from aiohttp import web
from nats.aio.client import Client
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from services.gateway import metrics
from services.gateway.reasoning.parser import FORMATS as REASONING_FORMATS
from services.gateway.tools.formats import format_for
from services.gateway.admission import RETRY_AFTER, Admission
from services.gateway.auth import require_api_key
from services.gateway.body import body_limits
from services.gateway.disconnects import quiet_disconnects
from services.gateway.errors import UNAVAILABLE, OpenAIError, error_middleware, model_not_found
from services.gateway.generation import Generator
from services.gateway.responses.handler import ResponsesEndpoint
from services.gateway.responses.store import ResponseStore
from services.gateway.tokenize import Tokenization
from services.gateway.limits import GatewayLimits
from shared.prefix_router import DEFAULT_BUSY_MARGIN, PrefixRouter
from services.gateway.protocol import DEFAULT_MAX_N
from services.gateway.router import ChunkRouter
from services.worker.model.config import context_length
from shared.config import DEFAULT_MODEL_DIR, SpeculativeConfig
from shared.schemas import MAX_REQUEST_CHOICES
from shared.seeds import SeedDraw
from shared import streams
from shared.observability import Readiness, add_routes
from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MIB = 1024 * 1024
OWNER = "specmesh"
SERVICE_UNAVAILABLE = 503
DRAIN_POLL_S = 0.1  # how often a draining gateway looks whether its requests have finished


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: Path = DEFAULT_MODEL_DIR
    served_model_name: str = Field(min_length=1)
    max_model_len: int = Field(1024, ge=16)
    request_timeout_s: float = Field(600.0, gt=0.0)  # longest silence (no chunk at all) before a request fails
    max_body_bytes: int = Field(4 * MIB, ge=1024)
    max_n: int = Field(DEFAULT_MAX_N, ge=1, le=MAX_REQUEST_CHOICES)  # choices per prompt a request may ask for (`n`)
    # The workers' --speculative-config: a request may ask for fewer drafts per step than it sets, never more.
    speculative: SpeculativeConfig = SpeculativeConfig()
    limits: GatewayLimits = GatewayLimits()
    api_keys: tuple[SecretStr, ...] = ()  # none: no key is asked for
    # Send each request to the worker holding the longest part of its prompt (prefix_router.py)
    prefix_routing: bool = True
    routing_busy_margin: float = Field(DEFAULT_BUSY_MARGIN, ge=0.0)
    strict_params: bool = False  # unknown request fields: a 400, as OpenAI answers (unknown_fields.py)
    tool_call_parser: str = "auto"  # how the model writes tool calls (tools/formats.py)
    reasoning_parser: str | None = None  # how it sets its thinking apart (reasoning/parser.py); None: it does not
    seed: int | None = None  # starts the seeds of sampled requests that name none (vLLM's --seed); None: entropy


def model_position_limit(model_dir: Path) -> int | None:
    """The model's trained context (config.json max_position_embeddings, or its architecture's default), when the
    directory says."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    return context_length(json.loads(path.read_text()))


class Gateway:
    """State shared by the routes: the NATS connection, the chunk router and the generation handler."""

    def __init__(self, config: GatewayConfig, nc: Client, tokenizer: Tokenizer) -> None:
        self.config = config
        self.nc = nc
        self.gateway_id = uuid.uuid4().hex
        self.created = int(time.time())
        self.router = ChunkRouter(nc, self.gateway_id, config.request_timeout_s)
        limits = config.limits
        self.admission = Admission(limits.max_in_flight, limits.max_concurrent_per_key, config.request_timeout_s)
        self.prefix_router = PrefixRouter(
            nc, config.routing_busy_margin, on_bad_message=metrics.count_bad_routing_message
        ) if config.prefix_routing else None
        self.generator = Generator(
            nc, tokenizer, self.router, config.served_model_name, config.max_model_len,
            server_drafts=config.speculative.num_drafts, admission=self.admission, max_n=config.max_n,
            keys_checked=bool(config.api_keys), prefix_router=self.prefix_router, strict_params=config.strict_params,
            tool_format=format_for(tokenizer.chat_template, config.tool_call_parser, tokenizer.special_tokens),
            reasoning_format=None if config.reasoning_parser is None
            else REASONING_FORMATS[config.reasoning_parser].for_tokenizer(tokenizer.special_tokens),
            seeds=SeedDraw(config.seed),
        )
        self.responses = ResponsesEndpoint(self.generator, tokenizer, ResponseStore(nc), nc)
        self.tokenization = Tokenization(self.generator, tokenizer, config.served_model_name, config.max_model_len)
        if self.generator.tool_format is None:
            log.warning(
                "the chat template writes tool calls in no format this gateway reads: requests with tools are "
                "refused (--tool-call-parser names one)"
            )
        self.readiness = Readiness(nc=nc)
        self._streams_waited: asyncio.Task | None = None

    def model_card(self) -> dict:
        return {
            "id": self.config.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": OWNER,
            "max_model_len": self.config.max_model_len,
        }

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generator.handle(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generator.handle(request, "chat")

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.model_card()]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.config.served_model_name:
            raise model_not_found(name)
        return web.json_response(self.model_card())

    async def start(self, app: web.Application) -> None:
        await self.router.start()
        await self.responses.background.start()
        if self.prefix_router is not None:
            await self.prefix_router.start()
        # Ready once the streams exist (the admin declares them, shared/streams.py). Waited for apart, so that the
        # gateway listens meanwhile: /health answers, and /ready says what it waits for.
        self._streams_waited = asyncio.create_task(self._ready_with_streams())

    async def _ready_with_streams(self) -> None:
        await streams.wait_for(self.nc.jetstream(), streams.GATEWAY_NEEDS, "gateway")
        self.readiness.started = True

    async def drain(self, timeout_s: float) -> None:
        """Leaves the ready set (/ready turns 503), lets the open requests finish for up to timeout_s, then ends the
        rest with a 503 (an error event where a stream has begun), which cancels them in the mesh: a stopping mesh
        (`specmesh up` stopped) gives them no time, and its clients learn why instead of being cut off."""
        self.readiness.draining = True
        deadline = time.monotonic() + timeout_s
        while self.router.num_open and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self.router.fail_all(OpenAIError(
            SERVICE_UNAVAILABLE, "The gateway is shutting down; retry the request", type=UNAVAILABLE,
            headers=RETRY_AFTER,
        ))

    async def stop(self, app: web.Application) -> None:
        self.readiness.draining = True
        if self._streams_waited is not None:
            self._streams_waited.cancel()
        await self.responses.background.stop()
        await self.router.stop()


GATEWAY = web.AppKey("gateway", Gateway)


def create_app(config: GatewayConfig, nc: Client, tokenizer: Tokenizer | None = None) -> web.Application:
    """Builds the app on a connected NATS client; the stream and the subscription are set up at startup."""
    limit = model_position_limit(config.model_dir)
    if limit is not None and config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {limit}"
        )
    gateway = Gateway(config, nc, tokenizer or Tokenizer(config.model_dir))
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[
            quiet_disconnects, metrics.count_requests, error_middleware,
            *([require_api_key(config.api_keys)] if config.api_keys else []),  # before any body is read
            body_limits(config.max_body_bytes, config.limits.body_timeout_s),
        ],
    )
    app[GATEWAY] = gateway
    app.router.add_post("/v1/completions", gateway.completions)
    app.router.add_post("/v1/chat/completions", gateway.chat_completions)
    app.router.add_post("/v1/responses", gateway.responses.create)
    app.router.add_get("/v1/responses/{response_id}", gateway.responses.get)
    app.router.add_delete("/v1/responses/{response_id}", gateway.responses.delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", gateway.responses.input_items)
    app.router.add_post("/v1/responses/{response_id}/cancel", gateway.responses.cancel)
    app.router.add_get("/v1/models", gateway.list_models)
    app.router.add_post("/tokenize", gateway.tokenization.tokenize)
    app.router.add_post("/detokenize", gateway.tokenization.detokenize)
    app.router.add_get("/v1/models/{model}", gateway.get_model)
    add_routes(app, gateway.readiness)
    app.on_startup.append(gateway.start)
    app.on_cleanup.append(gateway.stop)
    return app

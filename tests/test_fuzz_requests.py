"""Generated requests against real processes (tests/poisonfixture.py's mesh serving the demo model): bodies of every
shape through the gateway, and forged messages straight onto the work queue (tests/fuzzstrategies.py). No 5xx, no
process exits, the worker answers a normal request afterwards, and the memory of the gateway and the worker stays
roughly flat.

SPECMESH_FUZZ_EXAMPLES sets how many examples each test draws (the default keeps the module near 40 s on two cores);
README.md shows a longer run.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import Counter

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from shared import subjects
from shared.nats_roles import NatsRole
from shared.schemas import Cancel
from tests.fuzzstrategies import bodies, work_messages
from tests.poisonfixture import (
    PoisonMesh, as_role, open_at_detokenizer, poison_mesh, rss_bytes, until_queue_empty,
)
from tests.partsfixture import Service

__all__ = ["poison_mesh"]  # a fixture, imported for pytest to find

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("SPECMESH_FUZZ_EXAMPLES", "300"))
HTTP_TIMEOUT_S = 20.0
# Memory a process may gain over a run after its warm-up, while allocator and tokenizer caches settle. A leak of a
# request's state per request grows past this within a few hundred examples.
RSS_GROWTH_LIMIT = 160 * 1024 * 1024
WARM_UP_REQUESTS = 8
SERVER_ERROR = b'"server_error"'  # an error event inside a 200 stream
FAIL_REASONS = ("malformed", "no_detokenizer", "out_of_limits", "refused", "engine_error")
# No shrinking: each try of a smaller example costs real requests, up to a timeout each; the first failing example
# is reported as it was drawn.
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.generate),
)


def _watched(mesh: PoisonMesh) -> dict[str, Service]:
    return {"gateway": mesh.parts.gateway, "worker": mesh.worker}


def test_generated_bodies_get_no_server_error(poison_mesh: PoisonMesh) -> None:
    statuses: Counter[int] = Counter()
    base = f"http://127.0.0.1:{poison_mesh.parts.gateway.port}/v1"
    for _ in range(WARM_UP_REQUESTS):
        poison_mesh.serves()
    before = {name: rss_bytes(service) for name, service in _watched(poison_mesh).items()}
    with httpx.Client(base_url=base, timeout=HTTP_TIMEOUT_S) as http:

        @FUZZ
        @given(case=bodies())
        def post(case: tuple[str, bytes]) -> None:
            path, body = case
            response = http.post(path, content=body, headers={"Content-Type": "application/json"})
            statuses[response.status_code] += 1
            assert response.status_code < 500, (body, response.text)
            assert SERVER_ERROR not in response.content, (body, response.text)

        post()
    assert poison_mesh.alive()
    poison_mesh.serves()
    grown = {name: rss_bytes(service) - before[name] for name, service in _watched(poison_mesh).items()}
    shown = {name: round(size / 2**20, 1) for name, size in grown.items()}
    print(f"\nHTTP bodies by status: {dict(sorted(statuses.items()))}; RSS growth MB: {shown}")
    assert all(size < RSS_GROWTH_LIMIT for size in grown.values()), shown


async def _publish(nc, raw: bytes) -> None:
    """Queues the message with the gateway's credentials, then cancels it, as the gateway does when a client leaves:
    a valid forged request runs until then."""
    await nc.jetstream().publish(subjects.REQUESTS, raw)
    try:
        request_id = orjson.loads(raw).get("request_id")
    except (orjson.JSONDecodeError, AttributeError):
        return
    if isinstance(request_id, str):
        await nc.publish(subjects.CANCEL, Cancel(request_id=request_id, reason="client_disconnected").to_bytes())


def test_forged_queue_messages_hurt_nobody(poison_mesh: PoisonMesh) -> None:
    published = 0
    with asyncio.Runner() as runner:
        gateway = runner.run(as_role(poison_mesh.nats, NatsRole.GATEWAY))
        admin = runner.run(as_role(poison_mesh.nats, NatsRole.ADMIN))
        # A real detokenizer's id, so that forged requests that name it reach one.
        detok_id, chunks = runner.run(open_at_detokenizer(gateway, uuid.uuid4().hex, 1))
        runner.run(chunks.unsubscribe())

        @FUZZ
        @given(raw=work_messages(detok_id))
        def forge(raw: bytes) -> None:
            nonlocal published
            runner.run(_publish(gateway, raw))
            published += 1

        forge()
        runner.run(until_queue_empty(admin))
        for nc in (gateway, admin):
            runner.run(nc.close())
    failed = {
        reason: poison_mesh.worker.metric("specmesh_worker_failed_requests_total", f'reason="{reason}"')
        for reason in FAIL_REASONS
    }
    print(f"\nforged messages: {published}; terminated by reason: {failed}")
    assert poison_mesh.alive()
    poison_mesh.serves()
    assert failed["engine_error"] == 0

"""No request can hurt the mesh, now or after a restart: real NATS, detokenizer, gateway and worker processes
serving the demo model. A request the gateway should refuse is a 400 naming the parameter; a forged WorkRequest the
worker cannot serve ends with an error chunk, is counted and terminated, and the worker goes on; a message the queue
delivered max_deliver times moves to the dead-letter subject, and a restart on the same store serves."""

from __future__ import annotations

import asyncio
import time
import uuid

import openai
import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from shared import subjects
from shared.nats_roles import NatsRole
from shared.natsutil import REQUEST_MAX_DELIVER
from shared.schemas import Cancel, SamplingParams, WorkRequest
from tests.fuzzstrategies import to_json
from tests.poisonfixture import (
    PoisonMesh, as_role, final_chunk, open_at_detokenizer, poison_mesh, until_queue_empty,
)
from tests.test_e2e import E2E_MODEL

__all__ = ["poison_mesh"]  # a fixture, imported for pytest to find

pytestmark = pytest.mark.e2e

INT64_OVERFLOW = 2**63
OUT_OF_VOCAB = 10**6
PROMPT = (1, 2, 3)
FETCH_TIMEOUT_S = 5.0
GIVE_UP_TIMEOUT_S = 1.0
MALFORMED = (
    b"\x00\xff not json",
    b"[]",
    b'{"request_id": "x"}',
    # Ids past int64, past uint64 (orjson refuses those), negative, a next_seq_no past the frame's u32, and more
    # choices than a request may ask for (the worker would copy the prompt for each).
    *(
        f'{{"request_id": "{"a" * 32}", "prompt_token_ids": [{ids}], "detok_id": "d", "sampling": {{}}, '
        f'"created": 0{extra}}}'.encode()
        for ids, extra in (
            (str(2**63), ""), (str(2**64), ""), ("-1", ""),
            ("1", ', "progress": [{"index": 0, "next_seq_no": 4294967296}]'),
            ("1", ', "n": 65536'),
        )
    ),
)


def _work(request_id: str, detok_id: str, prompt: tuple[int, ...], **sampling) -> WorkRequest:
    return WorkRequest(
        request_id=request_id, prompt_token_ids=prompt, detok_id=detok_id,
        sampling=SamplingParams(temperature=0.0, max_tokens=4, **sampling), created=time.time(),
    )


def test_top_k_past_int64_is_a_400_naming_top_k(poison_mesh: PoisonMesh) -> None:
    for top_k in (INT64_OVERFLOW, 10**30):
        with pytest.raises(openai.BadRequestError) as info:
            poison_mesh.client.completions.create(
                model=E2E_MODEL.name, prompt="def f():", max_tokens=4, extra_body={"top_k": top_k}
            )
        assert info.value.param == "top_k"
    assert poison_mesh.alive()
    poison_mesh.serves()


async def _forge(mesh: PoisonMesh, body: dict) -> str | None:
    """Opens a request at the detokenizer as the gateway does, queues `body` as its WorkRequest with the gateway's
    credentials, and returns the error of its final chunk."""
    nc = await as_role(mesh.nats, NatsRole.GATEWAY)
    try:
        request_id = uuid.uuid4().hex
        detok_id, chunks = await open_at_detokenizer(nc, request_id, len(body["prompt_token_ids"]))
        raw = to_json({**body, "request_id": request_id, "detok_id": detok_id})
        await nc.jetstream().publish(subjects.REQUESTS, raw)
        return (await final_chunk(chunks)).error
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("prompt", "sampling", "reason"),
    [
        ((*PROMPT, OUT_OF_VOCAB), {}, "out_of_limits"),  # an IndexError in the embedding, before
        (PROMPT, {"top_k": INT64_OVERFLOW}, "malformed"),  # "Overflow when unpacking long long", before
        (PROMPT, {"top_k": OUT_OF_VOCAB}, "out_of_limits"),
    ],
)
def test_a_request_the_worker_cannot_serve_ends_with_an_error(
    poison_mesh: PoisonMesh, prompt: tuple[int, ...], sampling: dict, reason: str
) -> None:
    before = poison_mesh.worker.metric("specmesh_worker_failed_requests_total", f'reason="{reason}"')
    body = _work(uuid.uuid4().hex, "unset", prompt).model_dump(mode="json")
    body["sampling"] |= sampling
    assert asyncio.run(_forge(poison_mesh, body))
    assert poison_mesh.alive()
    poison_mesh.serves()
    assert poison_mesh.worker.metric("specmesh_worker_failed_requests_total", f'reason="{reason}"') == before + 1


async def _publish_malformed(mesh: PoisonMesh) -> None:
    nc, admin = await as_role(mesh.nats, NatsRole.GATEWAY), await as_role(mesh.nats, NatsRole.ADMIN)
    try:
        for raw in MALFORMED:
            await nc.jetstream().publish(subjects.REQUESTS, raw)
        await until_queue_empty(admin)
    finally:
        await nc.close()
        await admin.close()


def test_malformed_messages_on_the_queue_are_terminated_and_counted(poison_mesh: PoisonMesh) -> None:
    before = poison_mesh.worker.metric("specmesh_worker_failed_requests_total", 'reason="malformed"')
    asyncio.run(_publish_malformed(poison_mesh))
    assert poison_mesh.worker.metric("specmesh_worker_failed_requests_total", 'reason="malformed"') == (
        before + len(MALFORMED)
    )
    assert poison_mesh.alive()
    poison_mesh.serves()


async def _deliver_until_given_up(mesh: PoisonMesh) -> tuple[str, object, object]:
    """Queues a request while no worker runs and takes it REQUEST_MAX_DELIVER times as a worker that never finishes
    it (a nak, as a worker dying on it would leave it). Returns its id, the gateway's connection and its chunks."""
    gateway, worker = await as_role(mesh.nats, NatsRole.GATEWAY), await as_role(mesh.nats, NatsRole.WORKER)
    request_id = uuid.uuid4().hex
    detok_id, chunks = await open_at_detokenizer(gateway, request_id, len(PROMPT))
    await gateway.jetstream().publish(subjects.REQUESTS, _work(request_id, detok_id, PROMPT).to_bytes())
    psub = await worker.jetstream().pull_subscribe_bind(subjects.WORKER_CONSUMER, subjects.REQUEST_STREAM)
    for delivery in range(1, REQUEST_MAX_DELIVER + 1):
        [msg] = await psub.fetch(1, timeout=FETCH_TIMEOUT_S)
        assert msg.metadata.num_delivered == delivery
        await msg.nak()
    # The next pull finds the message delivered max_deliver times: JetStream gives it up and announces it.
    with pytest.raises(NatsTimeoutError):
        await psub.fetch(1, timeout=GIVE_UP_TIMEOUT_S)
    await psub.unsubscribe()
    await worker.close()
    return request_id, gateway, chunks


async def _dead_letters(mesh: PoisonMesh) -> list[bytes]:
    admin = await as_role(mesh.nats, NatsRole.ADMIN)
    try:
        js = admin.jetstream()
        await until_queue_empty(admin)
        info = await js.stream_info(subjects.DEAD_LETTER_STREAM, subjects_filter=subjects.DEAD_REQUESTS)
        dead = info.state.subjects or {}
        return [(await js.get_msg(subjects.DEAD_LETTER_STREAM, subject=subject)).data for subject in dead]
    finally:
        await admin.close()


def test_a_message_no_worker_finishes_is_dead_lettered_and_a_restart_serves(poison_mesh: PoisonMesh) -> None:
    assert poison_mesh.worker.terminate() == 0

    async def give_up_then_restart() -> str | None:
        """The advisory is stored before NATS restarts: the new worker finds it on the same store."""
        request_id, gateway, chunks = await _deliver_until_given_up(poison_mesh)
        try:
            # In threads, so this client keeps its connection (and its subscription to the chunks) across the restart.
            await asyncio.to_thread(poison_mesh.restart_nats)
            poison_mesh.worker = await asyncio.to_thread(poison_mesh.parts.start, "worker")
            error = (await final_chunk(chunks)).error
            await gateway.publish(subjects.CANCEL, Cancel(request_id=request_id, reason="error").to_bytes())
            return error
        finally:
            await gateway.close()

    assert asyncio.run(give_up_then_restart())
    [dead] = asyncio.run(_dead_letters(poison_mesh))
    assert WorkRequest.from_bytes(dead).prompt_token_ids == PROMPT
    assert poison_mesh.worker.metric("specmesh_worker_dead_letters_total") == 1
    assert poison_mesh.alive()
    poison_mesh.serves()

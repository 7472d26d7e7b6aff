"""Prefill/decode disaggregation through real processes: two prefill and two decode workers behind one gateway, and
beside them a colocated mesh (one worker doing whole requests) on its own NATS. A request's stream, logprobs and
draft_logprobs included, is byte for byte the colocated one, greedy and seeded; the first token comes from the
prefill worker; a `kill -9` of a prefill worker or of a decode worker while requests are handed off costs the
streams seconds and no token."""

from __future__ import annotations

import asyncio
import json
from contextlib import ExitStack
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from shared.natsutil import REQUEST_ACK_WAIT_S
from services.worker.routing import DEAD_AFTER_S, SWEEP_PERIOD_S
from tests.failoverfixture import Streamed, kill, stream, until_streaming
from tests.natsfixture import running_nats_server
from tests.partsfixture import Service
from tests.test_e2e import E2E_MODEL

MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2, "num_model_steps": 2})
WORKER_OPTIONS = ("--torch-threads", "1", "--max-num-seqs", "4", "--speculative-config", MTP)
PROMPT = "def parse_headers(request):\n    '''Reads every header of the request and returns them as a dict.'''\n"
MAX_STALL_S = DEAD_AFTER_S + SWEEP_PERIOD_S + REQUEST_ACK_WAIT_S + 4.0


class Meshes:
    def __init__(self, tmp) -> None:
        self._stack = ExitStack()
        pd_nats = self._stack.enter_context(running_nats_server(tmp / "pd"))
        alone_nats = self._stack.enter_context(running_nats_server(tmp / "alone"))
        with ThreadPoolExecutor() as pool:
            started = [
                pool.submit(Service, "worker", pd_nats, *WORKER_OPTIONS, "--worker-id", str(i), "--role", role)
                for i, role in ((1, "prefill"), (2, "prefill"), (3, "decode"), (4, "decode"))
            ] + [
                pool.submit(Service, "detokenizer", pd_nats),
                pool.submit(Service, "gateway", pd_nats),
                pool.submit(Service, "worker", alone_nats, *WORKER_OPTIONS, "--worker-id", "9"),
                pool.submit(Service, "detokenizer", alone_nats),
                pool.submit(Service, "gateway", alone_nats),
            ]
            self.services = [s.result() for s in started]
        self.prefill, self.decode = self.services[:2], self.services[2:4]
        self.pd_gateway, self.alone_gateway = self.services[5], self.services[8]
        self.pd, self.alone = (
            openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{g.port}/v1", api_key="unused", max_retries=0, timeout=60)
            for g in (self.pd_gateway, self.alone_gateway)
        )

    def close(self) -> None:
        for service in self.services:
            service.kill()
        self._stack.close()


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    meshes = Meshes(tmp_path_factory.mktemp("disaggregation"))
    yield meshes
    meshes.close()


async def _raw_stream(port: int, body: dict) -> list[dict]:
    """The SSE events of a streamed completion, parsed, without what differs between two requests (id, created)."""
    events = []
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line.removeprefix("data: "))
                    event.pop("id"), event.pop("created")
                    events.append(event)
    return events


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "seeded"])
async def test_a_handed_off_stream_is_the_colocated_one_byte_for_byte(meshes, sampling) -> None:
    body = {
        "model": E2E_MODEL.name, "prompt": PROMPT, "max_tokens": 40, "stream": True, "logprobs": 2,
        "include_draft_logprobs": True, "ignore_eos": True, "stream_options": {"include_usage": True}, **sampling,
    }
    imported = sum(w.metric("specmesh_worker_handoffs_total", 'outcome="imported"') for w in meshes.decode)
    alone = await _raw_stream(meshes.alone_gateway.port, body)
    handed = await _raw_stream(meshes.pd_gateway.port, body)
    assert handed == alone
    assert any(e["choices"] and e["choices"][0].get("draft_logprobs") for e in handed), "MTP drafted and reported"
    assert sum(w.metric("specmesh_worker_handoffs_total", 'outcome="imported"') for w in meshes.decode) == imported + 1


async def test_chat_and_several_choices_are_handed_off_too(meshes) -> None:
    params = dict(
        model=E2E_MODEL.name, messages=[{"role": "user", "content": "Write a haiku about caches."}], max_tokens=24,
        n=3, temperature=0.8, seed=3, logprobs=True, top_logprobs=1,
    )
    alone, handed = [await client.chat.completions.create(**params) for client in (meshes.alone, meshes.pd)]
    assert [c.model_dump() for c in handed.choices] == [c.model_dump() for c in alone.choices]
    assert handed.usage == alone.usage


async def test_blocks_the_decode_worker_holds_do_not_travel_again(meshes) -> None:
    """The same long prompt twice: the second handoff goes to the decode worker that holds its blocks, and only the
    blocks past them travel."""
    prompt = PROMPT * 6 + "# once more\n"

    def sent() -> float:
        return sum(w.metric("specmesh_worker_handoff_bytes_total") for w in meshes.prefill if w.proc.poll() is None)

    sizes = []
    for _ in range(2):
        before = sent()
        r = await meshes.pd.completions.create(model=E2E_MODEL.name, prompt=prompt, max_tokens=8, temperature=0)
        assert r.choices[0].text
        await asyncio.sleep(1.0)  # the handoff's metrics, and the decode worker's cache events
        sizes.append(sent() - before)
    assert 0 < sizes[1] < sizes[0] / 4, f"bytes sent for the first and second handoff: {sizes}"


async def test_handed_off_requests_leave_nothing_held_on_either_worker(meshes) -> None:
    """A request whose stop string is its first token is cancelled while its KV travels: the decode worker that
    then gets it lets the KV go at once, instead of holding room for it for a minute and refusing other transfers."""
    params = {"model": E2E_MODEL.name, "prompt": PROMPT, "temperature": 0}
    first = (await meshes.alone.completions.create(max_tokens=1, **params)).choices[0].text
    assert first, "the prompt's first token is text a stop string can name"
    before = sum(w.metric("specmesh_worker_handoffs_total", 'outcome="sent"') for w in meshes.prefill)
    for _ in range(5):
        r = await meshes.pd.completions.create(max_tokens=16, stop=[first], **params)
        assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    await asyncio.sleep(1.0)  # the last handoffs' routed messages reach the decode workers
    assert sum(w.metric("specmesh_worker_handoffs_total", 'outcome="sent"') for w in meshes.prefill) > before
    assert sum(w.metric("specmesh_worker_handoff_transfers_held") for w in meshes.decode) == 0
    # Nor does a prefill worker count what it handed off as its own: its gauges are taken after the handoffs (a
    # request that runs to its end, so that no cancel reaches the prefill worker after its handoff).
    assert (await meshes.pd.completions.create(max_tokens=4, **params)).choices[0].text
    assert sum(w.metric("specmesh_worker_running_sequences") for w in meshes.prefill) == 0


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
async def test_a_worker_killed_mid_handoff_costs_seconds_and_no_token(meshes, role) -> None:
    """Long prompts keep the prefill workers handing off while the decode workers stream: one of a role is killed,
    and every stream ends with the text it has when nothing is killed."""
    victims = meshes.prefill if role == "prefill" else meshes.decode
    params = [
        {"prompt": PROMPT * (2 + i % 3) + f"# variant {i}\n", "max_tokens": 48, "temperature": 0,
         "extra_body": {"ignore_eos": True}}
        for i in range(8)
    ]
    expected = [(await meshes.alone.completions.create(model=E2E_MODEL.name, **p)).choices[0].text for p in params]
    streams = [Streamed(p) for p in params]
    tasks = []
    for streamed in streams:  # arriving one after another: some are in their handoff when the worker dies
        tasks.append(asyncio.create_task(stream(meshes.pd, streamed)))
        await asyncio.sleep(0.05)
    await until_streaming(streams[:2], 2)
    victim = next(v for v in victims if v.proc.poll() is None)
    killed_at = kill(victim.proc.pid)
    await asyncio.gather(*tasks)
    stalls = [s.longest_silence_after(killed_at) for s in streams]
    print(f"\nkill -9 of a {role} worker mid-handoff: worst stall {max(stalls):.2f} s")
    assert [s.error for s in streams] == [None] * len(streams)
    assert [s.text for s in streams] == expected
    assert max(stalls) <= MAX_STALL_S


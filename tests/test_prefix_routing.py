"""Prefix-aware routing: the gateway's rule on what workers announce (no NATS), the cache events' codec, and the
whole path through real processes (NATS, two workers, two detokenizers, a gateway): a conversation's next turn goes
to the worker that holds it and finds its cache there; a worker killed with routed requests in flight and queued,
loses none of them, and their streams end as undisturbed runs do; a gateway started after the workers learns what
they hold from their snapshots."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import openai
import pytest
from nats.aio.client import Client
from prometheus_client import REGISTRY

from services.gateway.metrics import count_bad_routing_message
from shared.prefix_router import PrefixRouter
from services.worker.metrics import WorkerMetrics
from services.worker.routing import DEAD_AFTER_S, SWEEP_PERIOD_S, Routing
from shared.config import EngineConfig
from shared.cache_events import CacheEventError, CacheEvents
from shared.natsutil import REQUEST_ACK_WAIT_S
from shared.prefix_hash import extend_hashes, root_hash
from shared.schemas import WorkerState
from tests.failoverfixture import FailoverMesh, Streamed, kill, stream
from tests.partsfixture import Service
from tests.test_e2e import E2E_MODEL

BLOCK_SIZE = 4
REVISION = "r1"


def _state(worker_id: int, in_flight: int = 0, **overrides) -> WorkerState:
    return WorkerState(
        worker_id=worker_id, epoch=overrides.pop("epoch", 7), revision=REVISION, block_size=BLOCK_SIZE, caching=True,
        max_num_seqs=8, in_flight=in_flight, routed_backlog=0, **overrides,
    )


def _names(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return extend_hashes([], root_hash(REVISION, salt), tokens, BLOCK_SIZE)


def _router(*states: WorkerState, margin: float = 4) -> PrefixRouter:
    router = PrefixRouter(nc=None, busy_margin=margin)
    for state in states:
        router.observe_state(state)
    return router


PROMPT = list(range(17))  # 4 cacheable blocks: a worker computes at least the last token


def test_the_worker_holding_the_longest_prefix_gets_the_prompt() -> None:
    router = _router(_state(1), _state(2), _state(3))
    router.observe_events(CacheEvents(1, 7, 0, tuple(_names(PROMPT[:8])), ()))
    router.observe_events(CacheEvents(2, 7, 0, tuple(_names(PROMPT[:16])), ()))
    assert router.choose(PROMPT, None) == 2
    router.observe_events(CacheEvents(2, 7, 1, (), tuple(_names(PROMPT[:16])[1:])))
    assert router.choose(PROMPT, None) == 1  # worker 2 evicted all but the first block


def test_a_prompt_nobody_holds_goes_to_the_least_busy_worker() -> None:
    router = _router(_state(1, in_flight=3), _state(2, in_flight=1), _state(3, in_flight=2))
    router.observe_events(CacheEvents(1, 7, 0, tuple(_names(PROMPT[:16])), ()))
    assert router.choose(list(range(100, 117)), None) == 2
    assert router.choose(PROMPT, "tenant") == 2  # a salt's names are others: nobody holds them either
    assert router.choose(PROMPT, "tenant") == 3  # what this gateway routed counts until the next state


def test_a_busy_holder_loses_the_prompt_to_the_next_longest_and_at_last_to_the_least_busy() -> None:
    router = _router(_state(1), _state(2, in_flight=7), _state(3), margin=4)
    router.observe_events(CacheEvents(2, 7, 0, tuple(_names(PROMPT[:16])), ()))
    router.observe_events(CacheEvents(1, 7, 0, tuple(_names(PROMPT[:8])), ()))
    assert router.choose(PROMPT, None) == 1  # 7 sequences, more than 4 beyond 0
    router.observe_state(_state(1, in_flight=8))
    assert router.choose(PROMPT, None) == 3
    router.observe_state(_state(1))
    router.observe_state(_state(2, in_flight=3))
    router.observe_state(_state(3))
    assert router.choose(PROMPT, None, num_seqs=2) == 2
    assert router.choose(PROMPT, None, num_seqs=2) == 1  # worker 2 at 5 now, beyond the margin


def test_when_every_worker_holds_it_the_least_busy_takes_it() -> None:
    router = _router(_state(1, in_flight=2), _state(2))
    for worker_id in (1, 2):
        router.observe_events(CacheEvents(worker_id, 7, 0, tuple(_names(PROMPT[:16])), ()))
    assert router.choose(PROMPT, None) == 2


def test_a_restarted_silent_draining_or_gapped_worker_loses_what_it_was_believed_to_hold() -> None:
    events = CacheEvents(2, 7, 0, tuple(_names(PROMPT[:16])), ())
    router = _router(_state(1), _state(2))
    router.observe_events(events)
    router.observe_state(_state(2, epoch=8))
    assert router.choose(PROMPT, None) == 1  # nobody holds it now: the least busy, the lower id

    router = _router(_state(1), _state(2))
    assert not router.observe_events(CacheEvents(2, 7, 0, tuple(_names(PROMPT[:16])), ()))
    assert router.observe_events(CacheEvents(2, 7, 2, (), ()))  # event 1 was missed: ask for a snapshot
    assert router.choose(PROMPT, None) == 1

    router = _router(_state(1), _state(2))
    router.observe_events(events)
    router._workers[2].seen -= 60.0
    router.choose(PROMPT, None)
    assert 2 not in router._workers and not router._holders  # forgotten, names and all

    router = _router(_state(1), _state(2, draining=True))
    router.observe_events(events)
    assert router.choose(PROMPT, None) is None  # one worker left to choose from: the shared queue

    router = _router(_state(1), _state(2))
    router.observe_events(events)
    router._workers[2].seen -= 10.0
    assert router.choose(PROMPT, None) is None


def test_a_worker_met_is_asked_for_a_snapshot_which_replaces_what_was_believed() -> None:
    router = PrefixRouter(nc=None)
    assert router.observe_state(_state(1)) == 1  # met: ask it (subjects.cache_sync)
    assert router.observe_state(_state(1)) is None
    assert router.observe_state(_state(1, epoch=9)) == 1  # restarted
    assert router.observe_state(_state(2)) == 2
    router.observe_events(CacheEvents(2, 7, 0, tuple(_names(PROMPT[:16])), ()))
    assert router.choose(PROMPT, None) == 2
    # Its snapshot: numbered on from its events, everything it holds now (the prompt's first block only).
    router.observe_events(CacheEvents(2, 7, 1, tuple(_names(PROMPT[:4])), (), snapshot=True))
    router.observe_events(CacheEvents(1, 9, 0, tuple(_names(PROMPT[:8])), (), snapshot=True))
    assert router.choose(PROMPT, None) == 1


async def test_forged_states_and_events_are_dropped_and_counted() -> None:
    router = PrefixRouter(nc=None, on_bad_message=count_bad_routing_message)
    before = {kind: _bad(kind) for kind in ("state", "cache_event")}
    await router._on_state(SimpleNamespace(data=b'{"worker_id": -1}'))
    await router._on_events(SimpleNamespace(data=b"\x02\x00not an event"))
    assert {kind: _bad(kind) - before[kind] for kind in before} == {"state": 1, "cache_event": 1}
    assert router.choose(PROMPT, None) is None  # nothing was taken from them


async def test_a_worker_drops_and_counts_a_forged_state_of_a_peer() -> None:
    routing = Routing(Client(), 7, EngineConfig(), REVISION, lambda: 0, lambda: 0, WorkerMetrics("model", "naive", 7))
    labels = {"model": "model", "method": "naive", "worker": "7"}

    def dropped() -> float:
        return REGISTRY.get_sample_value("specmesh_worker_bad_worker_states_total", labels) or 0.0

    before = dropped()
    await routing._on_state(SimpleNamespace(data=b"not a state"))
    await routing._on_state(SimpleNamespace(data=_state(3).to_bytes()))
    assert dropped() == before + 1
    assert set(routing._last_seen) == {3}


def _bad(kind: str) -> float:
    return REGISTRY.get_sample_value("specmesh_gateway_bad_routing_messages_total", {"kind": kind}) or 0.0


def test_cache_events_round_trip_and_refuse_what_they_cannot_read() -> None:
    events = CacheEvents(3, 2**40, 9, tuple(_names(PROMPT[:8])), tuple(_names(PROMPT[:4], "s")))
    assert CacheEvents.decode(events.encode()) == events
    snapshot = CacheEvents(3, 2**40, 10, tuple(_names(PROMPT[:8])), (), snapshot=True)
    assert CacheEvents.decode(snapshot.encode()) == snapshot
    with pytest.raises(CacheEventError):
        CacheEvents.decode(events.encode()[:-1])
    with pytest.raises(CacheEventError):
        CacheEvents.decode(b"\x09" + events.encode()[1:])  # an unknown version


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    mesh = FailoverMesh(tmp_path_factory.mktemp("nats"))
    yield mesh
    mesh.close()


PROMPTS = tuple(
    f"def handler_{i}(request, response):\n    '''Reads the {topic} of the request and'''\n"
    for i, topic in enumerate(("headers", "cookies", "body", "query", "form", "files"))
)
LONG = dict(max_tokens=160, temperature=0, extra_body={"ignore_eos": True})
# A worker killed: its state stops; the others adopt its routed subject DEAD_AFTER_S later, at their next sweep, and
# what it had taken comes back once ack_wait after its last heartbeat is over; a loaded 2-core machine adds to it.
MAX_STALL_S = DEAD_AFTER_S + SWEEP_PERIOD_S + REQUEST_ACK_WAIT_S + 4.0


async def _warm(mesh: FailoverMesh) -> None:
    """Every prompt once: each worker's cache then holds some of them, which the gateway hears of."""
    for prompt in PROMPTS:
        await mesh.client.completions.create(model=E2E_MODEL.name, prompt=prompt, max_tokens=4, temperature=0)
    await asyncio.sleep(1.0)  # the last events and states


def _routed(mesh: FailoverMesh) -> float:
    return mesh.gateway.metric("specmesh_gateway_routed_requests_total", 'target="worker"')


async def _undisturbed(mesh: FailoverMesh, streamed: Streamed) -> str:
    r = await mesh.client.completions.create(model=E2E_MODEL.name, **streamed.params)
    return r.choices[0].text


async def test_a_turn_goes_where_the_conversation_is_cached(mesh: FailoverMesh) -> None:
    """Each prompt again: the gateway sends it to the worker that computed it, which finds it cached (with the
    shared queue alone, each would find it with one chance in two)."""
    await _warm(mesh)
    routed_before = _routed(mesh)
    for prompt in PROMPTS:
        r = await mesh.client.completions.create(model=E2E_MODEL.name, prompt=prompt, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert _routed(mesh) - routed_before == len(PROMPTS)


async def test_a_restarted_gateway_routes_to_what_the_workers_held_before(mesh: FailoverMesh) -> None:
    """A new gateway asks each worker it meets for a snapshot of its names, so even the prompts cached before it
    started go where they are cached."""
    await _warm(mesh)
    assert mesh.gateway.terminate() == 0
    mesh.gateway = mesh.services[4] = Service("gateway", mesh.nats)
    mesh.client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{mesh.gateway.port}/v1", api_key="unused", max_retries=0, timeout=60
    )
    await asyncio.sleep(1.5)  # the workers' states, then their snapshots
    for prompt in PROMPTS:
        r = await mesh.client.completions.create(model=E2E_MODEL.name, prompt=prompt, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert _routed(mesh) == len(PROMPTS)


@pytest.mark.exclusive  # bounds a time: alone, not beside another worker's tests (tests/conftest.py)
async def test_routed_requests_of_a_killed_worker_continue_exactly_on_the_other(mesh: FailoverMesh) -> None:
    await _warm(mesh)
    routed_before = _routed(mesh)
    # Twice each prompt: more streams than one worker's batch, so some wait in its routed queue when it dies.
    streams = [Streamed({"prompt": prompt, **LONG}) for prompt in PROMPTS + PROMPTS]
    tasks = [asyncio.create_task(stream(mesh.client, s)) for s in streams]
    deadline = time.monotonic() + 60
    while sum(len(s.arrivals) >= 4 for s in streams) < len(PROMPTS):  # a batch streams, the rest may wait
        assert time.monotonic() < deadline, "the streams did not start"
        await asyncio.sleep(0.02)
    assert _routed(mesh) - routed_before >= len(streams) / 2, "the prompts went to the workers holding them"
    killed_at = kill(mesh.workers[0].proc.pid)
    await asyncio.gather(*tasks)
    stalls = [s.longest_silence_after(killed_at) for s in streams]
    print(f"\nkill -9 of a worker with routed requests: worst stall {max(stalls):.2f} s")
    assert [s.error for s in streams] == [None] * len(streams)
    assert max(stalls) <= MAX_STALL_S
    moved = mesh.workers[1].metric("specmesh_worker_routed_requests_moved_total")
    assert moved > 0, "the survivor adopted the dead worker's routed requests"
    for streamed in streams:
        assert streamed.text == await _undisturbed(mesh, streamed)


def test_the_least_busy_is_the_emptiest_by_its_size_and_the_margin_counts_sequences() -> None:
    big = _state(1, in_flight=9).model_copy(update={"max_num_seqs": 64})
    router = _router(big, _state(2, in_flight=3), margin=8)  # 9/64 against 3/8
    assert router.choose(list(range(100, 117)), None) == 1  # nobody holds it: the emptier by its size
    router = _router(big, _state(2, in_flight=1), margin=8)  # 1/8 is the emptier now
    router.observe_events(CacheEvents(1, 7, 0, tuple(_names(PROMPT[:16])), ()))
    assert router.choose(PROMPT, None) == 1  # 9 is within 8 sequences of 1
    router.observe_state(big.model_copy(update={"in_flight": 10}))
    assert router.choose(PROMPT, None) == 2  # 10 is not

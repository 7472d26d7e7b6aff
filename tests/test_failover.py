"""Failures of real processes under load: a worker, a detokenizer and NATS killed with `kill -9` mid-stream.

A dead worker's streams stall for about the work queue's ack_wait, then continue on the other worker from the
tokens their clients already have, and end exactly as an undisturbed run (greedy, seeded, and sampled without a seed:
the gateway fixes one). A dead detokenizer's streams end with a clear error within seconds. NATS killed and restarted:
every stream finishes or ends with an error, none is silent for 10 s, and the mesh serves again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from services.process_tree import descendants
from shared.natsutil import REQUEST_ACK_WAIT_S
from tests.failoverfixture import (
    DETOKENIZER_IDS, ENGINE_STALL_S, FailoverMesh, QueuedRequests, Streamed, failover_mesh, kill, stream,
    until_streaming,
)
from tests.test_e2e import E2E_MODEL

__all__ = ["failover_mesh"]  # the fixture, imported for pytest to find

# Each bounds a time (a stop, a stall, a restart): alone, not beside another worker's tests (tests/conftest.py)
pytestmark = [pytest.mark.e2e, pytest.mark.exclusive]

LONG = dict(max_tokens=200, extra_body={"ignore_eos": True})
KINDS = {
    "greedy": dict(temperature=0),
    "seeded": dict(temperature=1.0, seed=1234),
    "unseeded": dict(temperature=1.0),
}
PROMPTS = ("def read_config(path):\n", "class Parser:\n    def __init__(self", "import os\nimport sys\n\ndef main(")
MIN_CHUNKS_BEFORE_KILL = 8
# The stall a dead worker costs: ack_wait after its last heartbeat, then the take-over and a prefill; a loaded 2-core
# machine adds to it.
MAX_STALL_S = REQUEST_ACK_WAIT_S + 2.5
MAX_ERROR_AFTER_S = 6.0  # a dead detokenizer is noticed within liveness.DETOK_LOST_S plus a check's interval
MAX_SILENCE_S = 10.0


def _streams() -> list[Streamed]:
    return [Streamed({"prompt": prompt, **LONG, **params}) for params in KINDS.values() for prompt in PROMPTS[:2]]


async def _undisturbed(mesh: FailoverMesh, streamed: Streamed, seed: int | None) -> str:
    params = {"seed": seed, **streamed.params}  # the seed it was given, else the one the gateway fixed
    r = await mesh.client.completions.create(model=E2E_MODEL.name, **params)
    return r.choices[0].text


async def test_a_hung_engines_streams_continue_exactly_on_the_other(failover_mesh: FailoverMesh) -> None:
    """An engine that neither answers nor dies (stopped, as a frozen tensor-parallel rank holds it in a collective):
    after --engine-stall-timeout its worker stops heartbeating the requests, and the other worker continues them."""
    mesh = failover_mesh
    queued = QueuedRequests()
    admin = await queued.watch(mesh)
    worker = mesh.workers[0]
    [engine] = [pid for pid, cmd in descendants(worker.proc.pid).items() if "spawn_main" in cmd]
    streams = _streams()
    tasks = [asyncio.create_task(stream(mesh.client, s)) for s in streams]
    try:
        await until_streaming(streams, MIN_CHUNKS_BEFORE_KILL)
        os.kill(engine, signal.SIGSTOP)
        stopped_at = time.monotonic()
        await asyncio.gather(*tasks)
    finally:
        os.kill(engine, signal.SIGCONT)
        await admin.drain()
    stalls = [s.longest_silence_after(stopped_at) for s in streams]
    print(f"\nan engine stopped: stall per stream (s) {[round(s, 2) for s in stalls]}, worst {max(stalls):.2f}")
    assert [s.error for s in streams] == [None] * len(streams)
    assert worker.metric("specmesh_worker_engine_stalls_total") >= 1, "the stopped engine held some of the streams"
    assert max(stalls) <= ENGINE_STALL_S + MAX_STALL_S
    await _equal_to_undisturbed_runs(mesh, streams, queued)


async def test_a_dead_workers_streams_continue_exactly_on_the_other(failover_mesh: FailoverMesh) -> None:
    mesh = failover_mesh
    queued = QueuedRequests()
    admin = await queued.watch(mesh)
    migrations_before = sum(d.metric("specmesh_detokenizer_migrations_total") for d in mesh.detokenizers)
    streams = _streams()
    tasks = [asyncio.create_task(stream(mesh.client, s)) for s in streams]
    try:
        await until_streaming(streams, MIN_CHUNKS_BEFORE_KILL)
        killed_at = kill(mesh.workers[0].proc.pid)
        await asyncio.gather(*tasks)
    finally:
        await admin.drain()
    stalls = [s.longest_silence_after(killed_at) for s in streams]
    print(f"\nkill -9 of a worker: stall per stream (s) {[round(s, 2) for s in stalls]}, worst {max(stalls):.2f}")
    assert [s.error for s in streams] == [None] * len(streams)
    migrations = sum(d.metric("specmesh_detokenizer_migrations_total") for d in mesh.detokenizers)
    migrations -= migrations_before
    assert 0 < migrations <= len(streams), "the dead worker held some of the streams, each taken over once"
    assert max(stalls) <= MAX_STALL_S
    await _equal_to_undisturbed_runs(mesh, streams, queued)


async def _equal_to_undisturbed_runs(mesh: FailoverMesh, streams: list[Streamed], queued: QueuedRequests) -> None:
    """Each stream's text is what the same request gives when nothing happens: an unseeded one is run again with the
    seed the gateway fixed for it."""
    seeds = [queued.by_id[s.request_id].sampling.seed for s in streams]
    assert all(seed is not None for s, seed in zip(streams, seeds) if s.params["temperature"] > 0), (
        "the gateway fixes a seed for every sampled request"
    )
    undisturbed = await asyncio.gather(*(_undisturbed(mesh, s, seed) for s, seed in zip(streams, seeds)))
    for s, text in zip(streams, undisturbed):
        assert s.text == text, f"{s.params}: not the undisturbed text"


async def test_a_dead_detokenizers_streams_end_with_a_clear_error(failover_mesh: FailoverMesh) -> None:
    mesh = failover_mesh
    streams = _streams()
    tasks = [asyncio.create_task(stream(mesh.client, s)) for s in streams]
    await until_streaming(streams, MIN_CHUNKS_BEFORE_KILL)
    # Whichever detokenizer answers first takes a request, so the six may all sit on one: kill one that holds some.
    held = [d.metric("specmesh_detokenizer_active_requests") for d in mesh.detokenizers]
    victim = held.index(max(held))
    killed_at = kill(mesh.detokenizers[victim].proc.pid)
    await asyncio.gather(*tasks)
    failed = [s for s in streams if s.error is not None]
    print(f"\nkill -9 of a detokenizer: {len(failed)} of {len(streams)} streams ended with an error after "
          f"{[round(s.ended - killed_at, 2) for s in failed]} s")
    assert failed, "the dead detokenizer held some of the streams"
    for s in failed:
        assert f"detokenizer {DETOKENIZER_IDS[victim]}" in s.error and s.ended - killed_at <= MAX_ERROR_AFTER_S
    for s in streams:
        assert s.longest_silence_after(killed_at) <= MAX_ERROR_AFTER_S
    r = await mesh.client.completions.create(model=E2E_MODEL.name, prompt=PROMPTS[2], max_tokens=8)
    assert r.choices[0].text, "the other detokenizer serves"


async def test_nats_killed_and_restarted_under_load(failover_mesh: FailoverMesh) -> None:
    mesh = failover_mesh
    queued = QueuedRequests()
    admin = await queued.watch(mesh)
    streams = _streams()
    tasks = [asyncio.create_task(stream(mesh.client, s)) for s in streams]
    try:
        await until_streaming(streams, MIN_CHUNKS_BEFORE_KILL)
        alive = [service for service in mesh.services if service.proc.poll() is None]  # earlier tests killed some
        killed_at = kill(mesh.nats.process.pid)
        await asyncio.to_thread(mesh.restart_nats)
        await asyncio.gather(*tasks)
    finally:
        await admin.close()
    silences = [s.longest_silence_after(killed_at) for s in streams]
    print(f"\nkill -9 of NATS: {sum(s.error is None for s in streams)} of {len(streams)} streams finished, the others "
          f"ended with {[s.error for s in streams if s.error]}; longest silence per stream (s) "
          f"{[round(s, 2) for s in silences]}")
    assert max(silences) <= MAX_SILENCE_S
    deadline = time.monotonic() + MAX_SILENCE_S
    while True:  # the services reconnect within seconds
        try:
            r = await mesh.client.completions.create(model=E2E_MODEL.name, prompt=PROMPTS[2], max_tokens=8)
            break
        except openai.APIError:
            assert time.monotonic() < deadline, "the mesh does not serve again after NATS came back"
            await asyncio.sleep(0.5)
    assert r.choices[0].text
    assert all(service.proc.poll() is None for service in alive), "a service did not outlive NATS's restart"
    await _equal_to_undisturbed_runs(mesh, [s for s in streams if s.error is None], queued)

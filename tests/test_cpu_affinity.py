"""--engine-cpus (services/cpu_affinity.py): CPU lists parse as Linux writes them and bad ones are usage errors;
`specmesh up --engine-cpus` runs the engine process on those CPUs and every other process of the mesh on the rest,
and the mesh still answers."""

from __future__ import annotations

import argparse
import json
import os
import urllib.request
from pathlib import Path

import pytest

from services.cpu_affinity import format_cpu_list, parse_cpu_list, rest_of_mesh
from services.mesh_process import start_mesh
from services.startup_checks import UsageError

CPUS = sorted(os.sched_getaffinity(0))
ENGINE_MARK = "multiprocessing.spawn"  # the engine process's command line (the worker spawns it)
HELPER_MARK = "multiprocessing.resource_tracker"  # the standard library's helper beside it, never busy


def test_cpu_lists_parse_as_linux_writes_them() -> None:
    first = CPUS[0]
    assert parse_cpu_list(str(first)) == {first}
    assert parse_cpu_list(f"{first}-{first}") == {first}
    assert parse_cpu_list(format_cpu_list(set(CPUS))) == set(CPUS)
    assert parse_cpu_list(f"{CPUS[0]}-{CPUS[-1]}") >= set(CPUS)


@pytest.mark.parametrize("text", ["x", "1-0", "-1", "0,,1", str(max(CPUS) + 1)])
def test_a_bad_cpu_list_is_a_usage_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_cpu_list(text)


def test_engine_cpus_must_leave_some_for_the_rest() -> None:
    assert rest_of_mesh(None) is None
    with pytest.raises(UsageError, match="leaves no CPU"):
        rest_of_mesh(frozenset(CPUS))


@pytest.mark.e2e
@pytest.mark.skipif(len(CPUS) < 2, reason="pinning needs a CPU for the engine and one for the rest")
def test_up_pins_the_engine_and_the_rest_of_the_mesh_apart(tmp_path: Path) -> None:
    engine_cpu = CPUS[0]
    mesh = start_mesh(tmp_path, "--engine-cpus", str(engine_cpu), "--max-num-seqs", "2")
    try:
        children = mesh.children()
        engines = [pid for pid, cmd in children.items() if ENGINE_MARK in cmd]
        services = [pid for pid, cmd in children.items() if ENGINE_MARK not in cmd and HELPER_MARK not in cmd]
        assert len(engines) == 1 and os.sched_getaffinity(engines[0]) == {engine_cpu}
        names = " ".join(children[pid] for pid in services)
        for service in ("nats-server", "gateway", "detokenizer", "worker"):
            assert service in names
        for pid in services:
            assert engine_cpu not in os.sched_getaffinity(pid), children[pid]
        body = json.dumps({"model": mesh.model, "prompt": "def", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{mesh.base_url}/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert len(json.load(response)["choices"][0]["text"]) > 0
    finally:
        assert mesh.stop() == 0

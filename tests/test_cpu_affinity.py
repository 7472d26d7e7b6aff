"""--engine-cpus (services/cpu_affinity.py): CPU lists parse as Linux writes them and bad ones are usage errors;
`specmesh up` with no options runs the engine process on the CPUs its plan chooses (services/cpu_plan.py) and every
other process of the mesh on the rest, and the mesh still answers."""

from __future__ import annotations

import argparse
import json
import os
import urllib.request
from pathlib import Path

import pytest

from services.cpu_affinity import format_cpu_list, parse_cpu_list
from services.cpu_budget import CpuBudget
from services.cpu_plan import plan_cpus, requested_threads
from services.mesh_process import start_mesh

CPUS = sorted(os.sched_getaffinity(0))
ENGINE_MARK = "multiprocessing.spawn"  # the engine process's command line (the worker spawns it)
HELPER_MARK = "multiprocessing.resource_tracker"  # the standard library's helper beside it, never busy


def test_cpu_lists_parse_as_linux_writes_them() -> None:
    first = CPUS[0]
    assert parse_cpu_list(str(first)) == {first}
    assert parse_cpu_list(f"{first}-{first}") == {first}
    assert parse_cpu_list(format_cpu_list(set(CPUS))) == set(CPUS)
    assert parse_cpu_list(f"{CPUS[0]}-{CPUS[-1]}") >= set(CPUS)
    assert format_cpu_list({0, 1, 2, 3, 5, 7, 8}) == "0-3,5,7-8"


@pytest.mark.parametrize("text", ["x", "1-0", "-1", "0,,1", str(max(CPUS) + 1)])
def test_a_bad_cpu_list_is_a_usage_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_cpu_list(text)


@pytest.mark.e2e
def test_up_on_its_defaults_pins_the_engine_and_the_rest_of_the_mesh_apart(tmp_path: Path) -> None:
    plan = plan_cpus(CpuBudget.of_this_process(), 1, "cpu", torch_threads=requested_threads(0, os.environ))
    if plan.engine_cpus[0] is None:
        pytest.skip(f"the plan pins nothing on this machine: {plan.describe()}")
    mesh = start_mesh(tmp_path, "--max-num-seqs", "2")
    try:
        assert mesh.cpu_plan == plan.describe()
        children = mesh.children()
        engines = [pid for pid, cmd in children.items() if ENGINE_MARK in cmd]
        services = [pid for pid, cmd in children.items() if ENGINE_MARK not in cmd and HELPER_MARK not in cmd]
        assert len(engines) == 1 and os.sched_getaffinity(engines[0]) == plan.engine_cpus[0]
        names = " ".join(children[pid] for pid in services)
        for service in ("nats-server", "gateway", "detokenizer", "worker"):
            assert service in names
        for pid in services:
            assert not plan.engine_cpus[0] & os.sched_getaffinity(pid), children[pid]
        body = json.dumps({"model": mesh.model, "prompt": "def", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{mesh.base_url}/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert len(json.load(response)["choices"][0]["text"]) > 0
    finally:
        assert mesh.stop() == 0

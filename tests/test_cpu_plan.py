"""The CPU plan (services/cpu_plan.py) and the budget it starts from (services/cpu_budget.py): the cores a process
may use, read from its affinity mask and its cgroup's CPU limit (v1 and v2 layouts, a parent's limit binding its
children, and a real cgroup where this machine lets the test make one), and how they are shared out between the
engines and the rest of the mesh."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from services.cpu_budget import CpuBudget, cgroup_cpu_limit, cgroup_memory_headroom
from services.cpu_plan import AUTO, MAX_ENGINE_THREADS, UNPINNED, engine_cpus_option, plan_cpus, requested_threads
from services.startup_checks import UsageError

CGROUP1_CPU_ROOT = Path("/sys/fs/cgroup/cpu")


def cpus(n: int) -> frozenset[int]:
    return frozenset(range(n))


def test_two_cores_put_the_engine_on_one_and_the_mesh_on_the_other() -> None:
    plan = plan_cpus(CpuBudget(cpus(2)), 1, "cpu")
    assert plan.engine_cpus == (frozenset({0}),) and plan.rest_cpus == {1} and plan.torch_threads == 1
    assert "1 engine on CPUs 0, 1 torch thread each; the rest of the mesh on CPUs 1" in plan.describe()


def test_engines_get_disjoint_cores_and_the_mesh_keeps_some() -> None:
    plan = plan_cpus(CpuBudget(cpus(16)), 3, "cpu")
    assert plan.engine_cpus == (frozenset(range(0, 5)), frozenset(range(5, 10)), frozenset(range(10, 15)))
    assert plan.torch_threads == 5 and plan.rest_cpus == {15}
    assert plan.worker_cpus(1) == frozenset(range(5, 10)) | {15}
    many = plan_cpus(CpuBudget(cpus(16)), 4, "cpu")  # four workers: a second core for the mesh
    assert many.torch_threads == 3 and many.rest_cpus == {12, 13, 14, 15}


def test_cores_beyond_what_an_engine_uses_stay_free() -> None:
    plan = plan_cpus(CpuBudget(cpus(64)), 1, "cpu")
    assert plan.torch_threads == MAX_ENGINE_THREADS and plan.engine_cpus == (cpus(MAX_ENGINE_THREADS),)
    assert plan.rest_cpus == cpus(64) - cpus(MAX_ENGINE_THREADS)


@pytest.mark.parametrize("n, workers", [(1, 1), (2, 2), (4, 4)])
def test_too_few_cores_leave_placement_to_the_kernel_with_one_thread(n: int, workers: int) -> None:
    plan = plan_cpus(CpuBudget(cpus(n)), workers, "cpu")
    assert plan.engine_cpus == (None,) * workers and plan.rest_cpus is None and plan.torch_threads == 1


def test_a_cgroup_limit_sets_the_threads_but_pins_nothing() -> None:
    plan = plan_cpus(CpuBudget(cpus(16), limit=4.5), 1, "cpu")
    assert plan.engine_cpus == (None,) and plan.rest_cpus is None and plan.torch_threads == 3
    assert "cgroup CPU limit 4.5" in plan.describe()
    assert CpuBudget(cpus(16), limit=0.5).cores == 1
    assert CpuBudget(cpus(2), limit=8).owns_its_cpus


def test_explicit_options_win() -> None:
    budget = CpuBudget(cpus(8))
    assert plan_cpus(budget, 1, "cpu", torch_threads=2).torch_threads == 2
    assert plan_cpus(budget, 1, "cpu", UNPINNED).engine_cpus == (None,)
    listed = plan_cpus(budget, 2, "cpu", frozenset({0, 1, 2, 3}))
    assert listed.engine_cpus == (frozenset({0, 1}), frozenset({2, 3})) and listed.torch_threads == 2
    assert listed.rest_cpus == {4, 5, 6, 7}
    uneven = plan_cpus(budget, 2, "cpu", frozenset({0, 1, 2}))  # CPU 2 is no engine's: the rest of the mesh gets it
    assert uneven.engine_cpus == (frozenset({0}), frozenset({1})) and uneven.rest_cpus == {2, 3, 4, 5, 6, 7}
    with pytest.raises(UsageError, match="leaves no CPU"):
        plan_cpus(budget, 1, "cpu", budget.cpus)
    with pytest.raises(UsageError, match="--torch-threads -1"):
        plan_cpus(budget, 1, "cpu", torch_threads=-1)


def test_omp_num_threads_counts_as_torch_threads() -> None:
    assert requested_threads(0, {}) == 0 and requested_threads(0, {"OMP_NUM_THREADS": ""}) == 0
    assert requested_threads(0, {"OMP_NUM_THREADS": "3"}) == 3
    assert requested_threads(2, {"OMP_NUM_THREADS": "3"}) == 2
    assert requested_threads(0, {"OMP_NUM_THREADS": "4,2"}) == 4  # nested levels: the first is the engine's
    for text in ("many", "-1", "0"):
        with pytest.raises(UsageError, match=f"OMP_NUM_THREADS='{text}'"):
            requested_threads(0, {"OMP_NUM_THREADS": text})


def test_cuda_pins_nothing_and_sizes_threads_only_by_a_cgroup_limit() -> None:
    plan = plan_cpus(CpuBudget(cpus(16)), 2, "cuda")
    assert plan.engine_cpus == (None, None) and plan.torch_threads == 0 and plan.rest_cpus is None
    assert plan_cpus(CpuBudget(cpus(64), limit=4), 1, "cuda").torch_threads == 4


def test_engine_cpus_option() -> None:
    assert engine_cpus_option(AUTO) == AUTO and engine_cpus_option(UNPINNED) == UNPINNED
    first = min(os.sched_getaffinity(0))
    assert engine_cpus_option(str(first)) == {first}
    with pytest.raises(argparse.ArgumentTypeError, match="'some' is not 'auto', 'none' or a CPU list"):
        engine_cpus_option("some")
    with pytest.raises(argparse.ArgumentTypeError, match="not a CPU list"):
        engine_cpus_option("1-0")


def _fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> tuple[Path, Path]:
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mountinfo").write_text(mountinfo)
    return tmp_path / "cgroup", tmp_path / "mountinfo"


def test_cgroup_v2_limit_is_the_tightest_of_the_cgroup_and_its_parents(tmp_path: Path) -> None:
    mount = tmp_path / "unified"
    (mount / "pod" / "container").mkdir(parents=True)
    (mount / "pod" / "cpu.max").write_text("150000 100000\n")  # the pod: 1.5 CPUs
    (mount / "pod" / "container" / "cpu.max").write_text("max 100000\n")
    files = _fake_proc(tmp_path, "0::/pod/container\n",
                       f"30 23 0:26 / {mount} rw,relatime shared:4 - cgroup2 cgroup2 rw\n")
    assert cgroup_cpu_limit(*files) == 1.5
    (mount / "pod" / "container" / "cpu.max").write_text("50000 100000\n")
    assert cgroup_cpu_limit(*files) == 0.5


def test_cgroup_memory_headroom_is_the_least_any_ancestor_leaves(tmp_path: Path) -> None:
    """What the KV cache's default budget may take at most (services/worker/engine/kv_budget.py)."""
    mount = tmp_path / "unified"
    (mount / "pod" / "container").mkdir(parents=True)
    (mount / "pod" / "memory.max").write_text("2147483648\n")  # the pod: 2 GiB, 1.5 used
    (mount / "pod" / "memory.current").write_text("1610612736\n")
    (mount / "pod" / "container" / "memory.max").write_text("max\n")
    (mount / "pod" / "container" / "memory.current").write_text("1073741824\n")
    files = _fake_proc(tmp_path, "0::/pod/container\n",
                       f"30 23 0:26 / {mount} rw,relatime shared:4 - cgroup2 cgroup2 rw\n")
    assert cgroup_memory_headroom(*files) == 512 << 20
    (mount / "pod" / "memory.max").write_text("max\n")
    assert cgroup_memory_headroom(*files) is None
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory.usage_in_bytes").write_text("1073741824\n")
    mounts = f"35 25 0:30 /docker/abc {v1} ro,nosuid master:13 - cgroup cgroup rw,memory\n"
    assert cgroup_memory_headroom(*_fake_proc(tmp_path, "5:memory:/docker/abc\n", mounts)) is None
    (v1 / "memory.limit_in_bytes").write_text("2147483648\n")
    assert cgroup_memory_headroom(*_fake_proc(tmp_path, "5:memory:/docker/abc\n", mounts)) == 1 << 30


def test_a_container_mounted_at_its_own_cgroup_reads_its_limit(tmp_path: Path) -> None:
    """Docker on cgroup v1: /proc/self/cgroup says /docker/abc, and the hierarchy is mounted with that root."""
    mount = tmp_path / "cpu"
    mount.mkdir()
    (mount / "cpu.cfs_quota_us").write_text("200000\n")
    (mount / "cpu.cfs_period_us").write_text("100000\n")
    mounts = f"35 25 0:30 /docker/abc {mount} ro,nosuid master:13 - cgroup cgroup rw,cpu,cpuacct\n"
    assert cgroup_cpu_limit(*_fake_proc(tmp_path, "4:cpu,cpuacct:/docker/abc\n", mounts)) == 2.0


def test_unreadable_cgroup_files_mean_no_limit(tmp_path: Path) -> None:
    mount = tmp_path / "unified"
    mount.mkdir()
    (mount / "cpu.max").write_text("lots 100000\n")
    good = f"30 23 0:26 / {mount} rw - cgroup2 cgroup2 rw\n"
    assert cgroup_cpu_limit(*_fake_proc(tmp_path, "0::/\n", good)) is None
    garbage = "not a mount line\n" + good
    assert cgroup_cpu_limit(*_fake_proc(tmp_path, "junk\n0::/\n", garbage)) is None
    (tmp_path / "latin1").write_bytes(b"36 25 0:31 / /media/caf\xe9 rw - vfat /dev/sdb1 rw\n" + good.encode())
    (mount / "cpu.max").write_text("50000 100000\n")
    assert cgroup_cpu_limit(tmp_path / "cgroup", tmp_path / "latin1") == 0.5


def test_cgroup_v1_limit_and_no_limit(tmp_path: Path) -> None:
    mount = tmp_path / "cpu"
    (mount / "box").mkdir(parents=True)
    for directory, quota in ((mount, "-1"), (mount / "box", "300000")):
        (directory / "cpu.cfs_quota_us").write_text(quota + "\n")
        (directory / "cpu.cfs_period_us").write_text("100000\n")
    mounts = f"35 25 0:30 / {mount} rw,relatime shared:13 - cgroup cgroup rw,cpu\n"
    assert cgroup_cpu_limit(*_fake_proc(tmp_path, "3:cpu:/box\n1:memory:/\n", mounts)) == 3.0
    assert cgroup_cpu_limit(*_fake_proc(tmp_path, "3:cpu:/\n", mounts)) is None
    assert cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent") is None


def test_a_real_cgroup_limit_reaches_the_budget() -> None:
    """A child process placed in a cgroup v1 CPU group limited to 1.5 CPUs sees that limit, as a container would."""
    if not os.access(CGROUP1_CPU_ROOT, os.W_OK) or not (CGROUP1_CPU_ROOT / "cpu.cfs_quota_us").is_file():
        pytest.skip("no writable cgroup v1 cpu controller here")
    group = CGROUP1_CPU_ROOT / f"specmesh-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("150000")
        script = "from services.cpu_budget import CpuBudget; print(CpuBudget.of_this_process().limit)"
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
        assert float(done.stdout) == 1.5
    finally:
        group.rmdir()

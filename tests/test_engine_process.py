"""The engine process beside the worker's event loop (services/worker/engine_process.py): it runs on the CPUs it is
given, serves in step order and stops with what it had not finished; a failure to load or a death mid-step reaches the worker as an EngineError that
says why; and it never outlives the worker process, even one killed by SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.worker.engine_process import SPOOL_PREFIX, EngineError, EngineProcess, remove_stale_spools
from services.worker.engine_protocol import Work, encode
from shared.config import EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from tests.modelfixture import tiny_model_dir  # noqa: F401  (fixtures are used by name)

WORKER_ID = 5
MAX_TOKENS = 24
EXIT_TIMEOUT_S = 30.0
RESULT_TIMEOUT_S = 30.0


def config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=model_dir, max_num_seqs=2, max_model_len=256, speculative=SpeculativeConfig(method="naive"))


def request(max_tokens: int = MAX_TOKENS) -> WorkRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return WorkRequest(request_id=os.urandom(16).hex(), prompt_token_ids=(1, 2, 3), sampling=sampling, created=0,
                       detok_id="d")


async def test_serves_in_step_order_and_stops_with_what_is_unfinished(tiny_model_dir: Path) -> None:  # noqa: F811
    cpu = min(os.sched_getaffinity(0))
    engine = await EngineProcess.start(config(tiny_model_dir), WORKER_ID, torch_threads=1, cpus=frozenset({cpu}))
    assert os.sched_getaffinity(engine.process.pid) == {cpu}
    done, running = request(), request(max_tokens=200)
    engine.send(Work(new=[done, running]))
    steps, finished = [], []
    async for result in engine.results():
        steps.append(result.step)
        finished += result.finished
        engine.published()
        if done.request_id in finished:
            engine.stop()
    await engine.close()
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert finished == [done.request_id]
    progress = engine.stopped.unfinished[running.request_id].progress
    assert [p.index for p in progress] == [0] and len(progress[0].output_token_ids) >= MAX_TOKENS
    assert engine.process.exitcode == 0


async def test_a_message_taken_before_the_loop_counts_it_is_served(tiny_model_dir: Path) -> None:  # noqa: F811
    """The loop counts a message after writing it; an idle engine may read it first. It must step it then, not
    wait for the count to catch up (which it would not, were no other message to follow)."""
    engine = await EngineProcess.start(config(tiny_model_dir), WORKER_ID, torch_threads=1)
    served = request(max_tokens=4)
    engine._inbox.send_bytes(encode(Work(new=[served])))  # in the pipe, not yet counted: as between send and ordered()
    results = engine.results()
    first = await asyncio.wait_for(anext(results), timeout=RESULT_TIMEOUT_S)
    assert first.step > 0
    engine._counters.ordered()
    engine.stop()
    async for _ in results:
        engine.published()
    await engine.close()


async def test_a_model_that_cannot_load_fails_start_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(EngineError, match="the engine process failed"):
        await EngineProcess.start(config(tmp_path), WORKER_ID, torch_threads=1)


async def test_an_engine_killed_mid_run_ends_results_with_its_exit_code(tiny_model_dir: Path) -> None:  # noqa: F811
    engine = await EngineProcess.start(config(tiny_model_dir), WORKER_ID, torch_threads=1)
    engine.send(Work(new=[request(max_tokens=200)]))
    os.kill(engine.process.pid, signal.SIGKILL)
    with pytest.raises(EngineError, match=f"died \\(exit code {-signal.SIGKILL}\\)"):
        async for _ in engine.results():
            pass
    await engine.close()


WORKER_STAND_IN = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from services.worker.engine_process import EngineProcess
    from tests.test_engine_process import config

    async def main():
        engine = await EngineProcess.start(config(Path(sys.argv[1])), 5, torch_threads=1)
        print(engine.process.pid, flush=True)
        await asyncio.sleep(3600)

    if __name__ == "__main__":
        asyncio.run(main())
""")


def test_the_engine_dies_with_a_worker_killed_by_sigkill(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    script = tmp_path / "worker_stand_in.py"
    script.write_text(WORKER_STAND_IN)
    root = Path(__file__).resolve().parent.parent
    worker = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir)], stdout=subprocess.PIPE, text=True,
                              cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        engine_pid = int(worker.stdout.readline())
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(EXIT_TIMEOUT_S)
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while _alive(engine_pid):
            assert time.monotonic() < deadline, "the engine process outlived its worker"
            time.sleep(0.05)
    finally:
        worker.kill()


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (its parent is gone: init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_spools_of_engines_no_longer_running_are_removed(tmp_path: Path) -> None:
    """A worker killed before its engine cleaned up leaves that engine's handoff spool; the next engine's start
    removes it, and leaves a running engine's alone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"{SPOOL_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{SPOOL_PREFIX}{os.getpid()}-def"
    for spool in (stale, live):
        spool.mkdir()
        (spool / "request").write_bytes(b"kv")
    remove_stale_spools(tmp_path)
    assert not stale.exists() and live.exists()

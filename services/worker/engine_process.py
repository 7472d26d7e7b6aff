"""The engine in a process of its own, beside the worker's event loop (as vLLM's EngineCore and SGLang's scheduler).

Why a process and not a thread: the event loop wakes at every step to publish its frames, and a Python thread that
wakes takes the GIL from the engine at its next tensor op; on the demo model that cost a quarter of the step time
(`python -m benchmarks.speculation`, mesh against in-process engine, 1 stream). In its own process the engine
steps back to back while the loop publishes on another core, and a long prefill cannot hold up the loop's
heartbeats either.

A pipe each way and two shared counters join them (engine_protocol.py). The engine process applies what came
(requests, cancels) between steps, sends each step's StepResult at once and may run MAX_UNSENT_STEPS steps ahead of
what the loop has published, so a stalled NATS connection stops the model instead of piling up frames. One-way
pipes and counters, not a duplex socket and a reply per step: each step costs the engine one write, no read. It
ignores SIGINT and SIGTERM (the worker drains it with Stop), dies with the worker process, even by SIGKILL, and is
killed by close() when the worker fails.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from pathlib import Path

from services.process_tree import is_running
from shared.config import EngineConfig
from services.worker.engine_protocol import (
    Counters, EngineFailed, EngineReady, StepResult, Stop, Stopped, Work, decode, encode,
)

log = logging.getLogger("specmesh.worker")

SPOOL_PREFIX = "specmesh-handoffs-"  # then the engine process's pid: a directory of handoffs on their way to it
JOIN_TIMEOUT_S = 10.0  # an engine told to stop exits at its next step's end


class EngineError(RuntimeError):
    """The engine process failed, or died."""


class EngineProcess:
    """The event loop's handle on the engine process: send() messages to it, iterate results() from it."""

    def __init__(self, process: multiprocessing.process.BaseProcess, inbox: Connection, outbox: Connection,
                 counters: Counters, config: EngineConfig, ready: EngineReady) -> None:
        self.process = process
        self.config = config
        self.ready = ready
        self.stopped: Stopped | None = None  # the engine's last word, once it stopped
        self._inbox = inbox  # our end: we write
        self._outbox = outbox  # our end: we read
        self._counters = counters
        self._stopping = False
        remove_stale_spools(Path(tempfile.gettempdir()))
        self._spool = tempfile.TemporaryDirectory(prefix=f"{SPOOL_PREFIX}{process.pid}-")

    @classmethod
    async def start(
        cls, config: EngineConfig, worker_id: int, torch_threads: int = 0, cpus: frozenset[int] | None = None
    ) -> EngineProcess:
        """Spawns the engine process, on `cpus` if given (cpu_affinity.py), and returns once its model is loaded
        and warmed up."""
        context = multiprocessing.get_context("spawn")  # never fork a process that runs an event loop and threads
        inbox_read, inbox = context.Pipe(duplex=False)
        outbox, outbox_write = context.Pipe(duplex=False)
        counters = Counters(context)
        process = context.Process(
            target=_engine_main, args=(config, worker_id, torch_threads, cpus, inbox_read, outbox_write, counters),
            name=f"specmesh-engine-{worker_id}",
        )
        process.start()
        # The child's ends live in the child only: its death is our end-of-file.
        inbox_read.close()
        outbox_write.close()
        try:
            first = decode(await asyncio.get_running_loop().run_in_executor(None, outbox.recv_bytes))
        except EOFError:
            first = None
        except BaseException:  # cancelled while the model loads (SIGTERM): the process must not outlive us
            process.kill()
            process.join()
            raise
        if not isinstance(first, EngineReady):
            process.join(JOIN_TIMEOUT_S)
            raise EngineError(_failure(first, process))
        return cls(process, inbox, outbox, counters, config, first)

    def send(self, message: Work | Stop) -> None:
        if self.stopped is not None:
            return  # it has exited: a late Work has no one to reach (hand_back settles such requests)
        if isinstance(message, Work) and message.handoffs:
            message = self._spooled(message)
        try:
            self._inbox.send_bytes(encode(message))
        except OSError as exc:
            raise EngineError(f"the engine process is gone (exit code {self.process.exitcode})") from exc
        self._counters.ordered()  # after the message is in the pipe, so the engine never waits for it

    def _spooled(self, work: Work) -> Work:
        """The work with each handoff's bytes in a file of the spool, named in `handoff_files`. A handoff is larger
        than the pipe's buffer, and the engine reads its inbox only between steps: written into the pipe, it would
        hold the event loop (heartbeats, frames, KV chunks) for the rest of the engine's step."""
        files = {}
        for request_id, payload in work.handoffs.items():
            path = Path(self._spool.name) / request_id
            path.write_bytes(payload)
            files[request_id] = str(path)
        return Work(new=work.new, cancels=work.cancels, handoff_files=files)

    def published(self) -> None:
        """One more of the engine's step results was sent on: it may run one more step ahead."""
        self._counters.step_published()

    def stop(self) -> None:
        """Asks the engine to stop after its step in progress; results() ends after its last step's result."""
        if not self._stopping:
            self._stopping = True
            self.send(Stop())

    async def results(self) -> AsyncIterator[StepResult]:
        """Each step's result in step order, until the engine stopped (then `stopped` holds its last word)."""
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue[object] = asyncio.Queue()
        fd = self._outbox.fileno()

        def on_readable() -> None:
            try:
                arrived.put_nowait(decode(self._outbox.recv_bytes()))
            except (EOFError, OSError):
                loop.remove_reader(fd)
                arrived.put_nowait(None)

        loop.add_reader(fd, on_readable)
        try:
            while True:
                message = await arrived.get()
                if isinstance(message, StepResult):
                    yield message
                elif isinstance(message, Stopped):
                    self.stopped = message
                    return
                else:
                    raise EngineError(_failure(message, self.process))
        finally:
            loop.remove_reader(fd)

    async def close(self) -> None:
        """Waits for a stopped engine's process to exit; kills it if it does not, or if it was never stopped (the
        worker is failing: nothing is left to hand back)."""
        if self.stopped is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.process.join, JOIN_TIMEOUT_S)
        if self.process.is_alive():
            if self.stopped is not None:
                log.warning("the engine process did not exit; killing it")
            self.process.kill()
            self.process.join()
        self._inbox.close()
        self._outbox.close()
        self._spool.cleanup()


def remove_stale_spools(directory: Path) -> None:
    """Removes the handoff spools of engine processes no longer running: one killed, or whose worker was killed
    before it could clean up (a stop past the launcher's grace), leaves its spool, and handoffs may be large."""
    for spool in directory.glob(f"{SPOOL_PREFIX}*-*"):
        pid = spool.name.removeprefix(SPOOL_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not is_running(int(pid)):
            shutil.rmtree(spool, ignore_errors=True)


def _failure(message: object, process: multiprocessing.process.BaseProcess) -> str:
    if isinstance(message, EngineFailed):
        return f"the engine process failed:\n{message.error}"
    process.join(JOIN_TIMEOUT_S)  # its end of the pipe closes before it can be reaped
    return f"the engine process died (exit code {process.exitcode})"


def _engine_main(
    config: EngineConfig, worker_id: int, torch_threads: int, cpus: frozenset[int] | None, inbox: Connection,
    outbox: Connection, counters: Counters,
) -> None:
    """The spawned process's entry. engine_loop is imported here, in the child: it imports torch and the model,
    which the worker's event loop, importing this module, has no use for."""
    from services.worker.engine_loop import serve

    serve(config, worker_id, torch_threads, cpus, inbox, outbox, counters)

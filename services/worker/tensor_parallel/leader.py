"""Rank 0 of a tensor-parallel group: the engine's runner, which starts the other ranks and mirrors to them every
call that touches the model or the KV cache (mirror.py).

`build_runner` is the engine's one way to a runner: the whole model in this process, or, with
tensor_parallel_size N > 1, this process's shard and N - 1 follower processes (follower.py) holding the others,
started here, each loading its own shard while this one loads. The engine sees a ModelRunner either way, and full
logits from it: sampling, verification and logprobs stay on this rank.

Failure is loud, never a hang: a follower that dies fails the collective the leader is in (gloo and NCCL both
return an error when a peer's connection closes), or, when the engine is idle, wakes its loop through `sentinels`;
either way the engine raises RankFailed, which ends the engine process and so the worker's engine. Any other
exception inside a mirrored call also ends the group, since the ranks can no longer be assumed to be at the same
op.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections.abc import Iterator, Sequence as Seq
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait

import torch

from shared.config import HIDDEN_STATE_DRAFTERS, EngineConfig
from services.cpu_affinity import pin
from services.worker.engine.forward_batch import ForwardBatch
from services.worker.drafting.eagle3 import attach_eagle3
from services.worker.engine.runner import ModelRunner, inference
from services.worker.model.config import ModelConfig
from services.worker.model.int8_linear import drafter_in_int8
from services.worker.model.loader import load_model
from services.worker.tensor_parallel.errors import RankFailed
from services.worker.tensor_parallel.follower import LOADED, follower_main
from services.worker.tensor_parallel.group import LEADER, TensorParallelGroup, rank_device
from services.worker.tensor_parallel.mirror import Op, RecordingKVCache
from services.worker.tensor_parallel.model import ShardedCausalLM, load_shard
from services.worker.tensor_parallel.placement import rank_cpus, rank_threads
from services.worker.tensor_parallel.divisible import check_shardable

# How long a follower that failed a collective may take to exit before the error names no exit code.
DEATH_WAIT_S = 2.0
STOP_WAIT_S = 10.0  # a follower told to stop exits after its op in progress


def build_runner(config: EngineConfig, num_blocks: int) -> ModelRunner:
    """The engine's runner over config.model: whole here, or split over config.tensor_parallel_size ranks."""
    dtype = getattr(torch, config.dtype)
    if config.tensor_parallel_size == 1:
        model = load_model(config.model, dtype, config.device, config.load_format, config.max_model_len)
        attach_eagle3(config, model)
        runner = ModelRunner(
            model, config.max_num_seqs, config.max_model_len, config.block_size, num_blocks, config.graph_query_lens
        )
        if config.speculative.method in HIDDEN_STATE_DRAFTERS and drafter_in_int8(config):
            runner.quantize_drafting()
        return runner
    size = config.tensor_parallel_size
    cfg = ModelConfig.from_dir(config.model)
    check_shardable(cfg, size, config.enable_expert_parallel)  # before any process starts
    group = TensorParallelGroup(LEADER, size, cfg.vocab_size)
    followers = Followers.start(config, num_blocks, group.open_rendezvous())
    try:
        model = load_shard(
            config.model, dtype, rank_device(config.device, LEADER), config.load_format, config.max_model_len, group,
            config.enable_expert_parallel,
        )
        attach_eagle3(config, model)
        followers.wait_loaded()
        group.connect(str(next(model.parameters()).device), 0)
        return LeaderRunner(model, config, num_blocks, followers)
    except BaseException:
        followers.close(at_once=True)
        raise


class Followers:
    """The leader's handle on ranks 1..N-1: their processes and the pipes it sends their ops down."""

    def __init__(self, processes: list[multiprocessing.process.BaseProcess], pipes: list[Connection],
                 restore: tuple[set[int], int] | None) -> None:
        self.processes = processes
        self.pipes = pipes
        self._restore = restore  # this process's CPUs and torch threads before it took its share

    @classmethod
    def start(cls, config: EngineConfig, num_blocks: int, port: int) -> Followers:
        size = config.tensor_parallel_size
        threads = rank_threads(torch.get_num_threads(), size)
        restore = None
        if torch.device(config.device).type == "cpu":
            restore = os.sched_getaffinity(0), torch.get_num_threads()
            shares: list[frozenset[int] | None] = list(rank_cpus(restore[0], size))
        else:
            shares = [None] * size
        context = multiprocessing.get_context("spawn")
        processes, pipes = [], []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=follower_main, args=(config, rank, num_blocks, port, theirs, shares[rank], threads),
                name=f"specmesh-tp-rank-{rank}", daemon=True,
            )
            process.start()
            theirs.close()  # the follower's end lives in the follower only: its death is our end-of-file
            processes.append(process)
            pipes.append(ours)
        if restore is not None:
            pin(shares[LEADER])
            torch.set_num_threads(threads)
        return cls(processes, pipes, restore)

    @property
    def sentinels(self) -> tuple[int, ...]:
        return tuple(p.sentinel for p in self.processes)

    def wait_loaded(self) -> None:
        """Returns once every follower has its shard loaded; raises RankFailed with the reason of one that failed."""
        waiting = dict(zip(self.pipes, range(1, len(self.pipes) + 1)))
        while waiting:
            for conn in wait(list(waiting)):
                rank = waiting.pop(conn)
                try:
                    word = conn.recv_bytes()
                except EOFError:
                    raise RankFailed(self._death(rank)) from None
                if word != LOADED:
                    raise RankFailed(f"tensor-parallel rank {rank} failed to load its shard:\n{word.decode()}")

    def send(self, op: Op, *args: object) -> None:
        message = pickle.dumps((op, *args), protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in self.pipes:
            pipe.send_bytes(message)

    def dead(self) -> list[str]:
        """A description of each follower that has exited or is exiting (its sentinel is ready before the kernel
        lets it be reaped)."""
        ending = set(wait(self.sentinels, timeout=0))
        return [
            self._death(rank) for rank, p in enumerate(self.processes, start=1)
            if p.sentinel in ending or not p.is_alive()
        ]

    def _death(self, rank: int) -> str:
        process = self.processes[rank - 1]
        process.join(DEATH_WAIT_S)
        return f"tensor-parallel rank {rank} died (exit code {process.exitcode})"

    def close(self, at_once: bool = False) -> None:
        """Stops every follower (kills one that does not stop, or every one at once: one may be waiting in a
        collective that will never come) and gives this process its CPUs back."""
        for pipe in self.pipes:
            try:
                pipe.send_bytes(pickle.dumps((Op.STOP,)))
            except OSError:
                pass  # already gone
        for process in self.processes:
            process.join(0 if at_once else STOP_WAIT_S)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()
        if self._restore is not None:
            pin(frozenset(self._restore[0]))
            torch.set_num_threads(self._restore[1])
            self._restore = None


class LeaderRunner(ModelRunner):
    cache_type = RecordingKVCache

    def __init__(self, model: ShardedCausalLM, config: EngineConfig, num_blocks: int, followers: Followers) -> None:
        super().__init__(
            model, config.max_num_seqs, config.max_model_len, config.block_size, num_blocks, config.graph_query_lens
        )
        self.followers = followers
        self.sentinels = followers.sentinels
        self._closed = False

    def check_alive(self) -> None:
        dead = self.followers.dead()
        if dead:
            self._close(at_once=True)
            raise RankFailed("; ".join(dead))

    @contextmanager
    def _mirrored(self) -> Iterator[None]:
        """Any failure inside a mirrored call ends the group, named by the ranks that died if any did."""
        if self._closed:
            raise RankFailed("the tensor-parallel group was closed")
        try:
            yield
        except Exception as exc:
            dead = self.followers.dead()
            self._close(at_once=True)
            reason = "; ".join(dead) if dead else f"a mirrored call failed on rank {LEADER}: {exc!r}"
            raise RankFailed(reason) from exc

    def _send_hidden(self, hidden: torch.Tensor) -> None:
        self.model.group.broadcast(hidden.contiguous())

    @inference
    def forward(
        self, rows: Seq[Seq[int]], starts: Seq[int], slots: Seq[int], quantized: bool = False
    ) -> tuple[torch.Tensor, ForwardBatch]:
        # quantized is ignored: a split engine builds no int8 twins (EngineConfig.quantizes_drafter)
        with self._mirrored():
            self.followers.send(Op.FORWARD, self.cache.take_changes(), rows, starts, slots)
            return super().forward(rows, starts, slots)

    @inference
    def logits(self, hidden: torch.Tensor, quantized: bool = False) -> torch.Tensor:
        # Trunk rows with an EAGLE-3 head carry its feature layers too; the LM head reads the hidden state alone
        hidden = hidden[..., : self.model.config.hidden_size]
        with self._mirrored():
            self.followers.send(Op.LOGITS, hidden.shape, hidden.dtype)
            self._send_hidden(hidden)
            return super().logits(hidden)

    def mtp_forward(
        self, index: int, prev_hidden: torch.Tensor, rows: Seq[Seq[int]], starts: Seq[int], slots: Seq[int],
        quantized: bool = False,
    ) -> torch.Tensor:
        with self._mirrored():
            self.followers.send(
                Op.MTP_FORWARD, self.cache.take_changes(), index, prev_hidden.shape, prev_hidden.dtype, rows, starts,
                slots,
            )
            self._send_hidden(prev_hidden)
            return super().mtp_forward(index, prev_hidden, rows, starts, slots)

    @inference
    def mtp_logits(self, index: int, hidden: torch.Tensor, quantized: bool = False) -> torch.Tensor:
        if self.model.eagle3 is not None:  # the head's LM head is whole on every rank: the leader's alone is read
            return super().mtp_logits(index, hidden)
        with self._mirrored():
            self.followers.send(Op.MTP_LOGITS, index, hidden.shape, hidden.dtype)
            self._send_hidden(hidden)
            return super().mtp_logits(index, hidden)

    @property
    def kv_position_shape(self) -> tuple[int, int]:
        heads, head_dim = self.cache.position_shape
        return heads * self.model.group.size, head_dim

    @inference
    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        with self._mirrored():
            self.followers.send(Op.READ_BLOCKS, self.cache.take_changes(), blocks)
            return self.model.group.gather_heads(self.cache.read_blocks(blocks))

    @inference
    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        # Moved before the followers are told: a copy that fails (out of device memory) then fails this handoff
        # alone, not the group in the middle of an op.
        data = data.to(self.device).contiguous()
        with self._mirrored():
            self.followers.send(Op.WRITE_BLOCKS, self.cache.take_changes(), blocks, data.shape, data.dtype)
            self.cache.write_blocks(blocks, self.model.group.head_shard(self.model.group.broadcast(data)))

    def close(self) -> None:
        """Stops the followers and leaves the group; the runner takes no more calls."""
        self._close()

    def _close(self, at_once: bool = False) -> None:
        if not self._closed:
            self._closed = True
            self.followers.close(at_once)
            self.model.group.leave()

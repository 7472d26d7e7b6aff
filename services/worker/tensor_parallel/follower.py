"""A follower rank's process: its shard of the model and of the KV cache, running each pass the leader sends.

Started by the leader (leader.py) and dying with it: SIGKILL when the leader's process ends, however it ends, and
a quiet exit when the leader's end of the pipe closes. A failure here (a raise, a lost collective) exits the
process with its traceback on stderr; the leader's next collective, or its wait on this process, then fails the
engine (RankFailed). Signals meant for the worker are ignored: the leader decides when the group stops.
"""

from __future__ import annotations

import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

import torch

from shared.config import EngineConfig
from services.cpu_affinity import pin
from services.supervisor import die_with_parent
from services.worker.drafting.eagle3 import attach_eagle3
from services.worker.engine.runner import ModelRunner
from services.worker.model.config import ModelConfig
from services.worker.tensor_parallel.group import TensorParallelGroup, rank_device
from services.worker.tensor_parallel.mirror import Op, replay
from services.worker.tensor_parallel.model import load_shard

LOADED = b"loaded"  # a follower's first word when its shard is in memory; otherwise its traceback


def follower_main(
    config: EngineConfig, rank: int, num_blocks: int, port: int, conn: Connection, cpus: frozenset[int] | None,
    threads: int,
) -> None:
    """The spawned process's entry."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    pin(cpus)
    torch.set_num_threads(threads)
    try:
        runner = _load(config, rank, num_blocks)
    except Exception:
        conn.send_bytes(traceback.format_exc().encode())
        raise SystemExit(1) from None
    conn.send_bytes(LOADED)
    try:
        runner.model.group.connect(str(runner.device), port)
        with torch.inference_mode():
            follow(conn, runner)
    except EOFError:
        return  # the leader is gone
    except Exception:
        print(f"tensor-parallel rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        runner.model.group.leave()


def _load(config: EngineConfig, rank: int, num_blocks: int) -> ModelRunner:
    size = config.tensor_parallel_size
    group = TensorParallelGroup(rank, size, ModelConfig.from_dir(config.model).vocab_size)
    model = load_shard(
        config.model, getattr(torch, config.dtype), rank_device(config.device, rank), config.load_format,
        config.max_model_len, group, config.enable_expert_parallel,
    )
    attach_eagle3(config, model)
    return ModelRunner(
        model, config.max_num_seqs, config.max_model_len, config.block_size, num_blocks, config.graph_query_lens
    )


def follow(conn: Connection, runner: ModelRunner) -> None:
    """Runs every op the leader sends, in order, until STOP."""
    group = runner.model.group

    def received(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return group.broadcast(torch.empty(shape, dtype=dtype, device=runner.device))

    while True:
        op, *args = pickle.loads(conn.recv_bytes())
        if op is Op.FORWARD:
            changes, rows, starts, slots = args
            replay(runner.cache, changes)
            runner.forward(rows, starts, slots)
        elif op is Op.LOGITS:
            runner.logits(received(*args))
        elif op is Op.MTP_FORWARD:
            changes, index, shape, dtype, rows, starts, slots = args
            replay(runner.cache, changes)
            runner.mtp_forward(index, received(shape, dtype), rows, starts, slots)
        elif op is Op.MTP_LOGITS:
            index, shape, dtype = args
            runner.mtp_logits(index, received(shape, dtype))
        elif op is Op.READ_BLOCKS:
            changes, blocks = args
            replay(runner.cache, changes)
            group.gather_heads(runner.cache.read_blocks(blocks))
        elif op is Op.WRITE_BLOCKS:
            changes, blocks, shape, dtype = args
            replay(runner.cache, changes)
            runner.cache.write_blocks(blocks, group.head_shard(received(shape, dtype)))
        elif op is Op.STOP:
            return
        else:
            raise ValueError(f"unknown op {op!r} from the leader")

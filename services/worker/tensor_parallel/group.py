"""The collectives a tensor-parallel model runs inside its forward pass, over torch.distributed.

Every rank of a group holds a shard of the model (shard.py) and runs the same pass on the same inputs; between
shards only these cross: one all-reduce after each row-parallel projection (o and down), one after the
vocab-parallel embedding lookup, and the LM head's vocabulary slices gathered on rank 0, the one rank that
samples and verifies. Backend: gloo on the CPU, NCCL on CUDA (each rank on its own GPU, cuda:<rank>).
"""

from __future__ import annotations

import datetime
import torch
import torch.distributed as dist
import torch.nn.functional as F

# A collective waits this long for a rank that neither answers nor dies (a rank that dies fails it at once).
COLLECTIVE_TIMEOUT_S = 300.0
LEADER = 0  # the rank that runs the engine: scheduling, sampling, verification
RENDEZVOUS_HOST = "127.0.0.1"  # a group's ranks are processes of one machine (one worker, one pod)


def backend_for(device: str) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones: the collectives run on the model's own device."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> str:
    """The device rank `rank` runs on: the CPU for all ranks, or GPU number `rank` of the machine."""
    # EngineConfig refuses an indexed CUDA device beside tensor parallelism
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)


class TensorParallelGroup:
    """This process's place in a group of `size` ranks, and the collectives over it."""

    def __init__(self, rank: int, size: int, vocab_size: int) -> None:
        self.rank = rank
        self.size = size
        self.vocab_size = vocab_size
        # The vocabulary is cut in equal slices, the last padded past vocab_size, so gathered slices line up.
        self.vocab_per_rank = -(-vocab_size // size)
        self.vocab_start = rank * self.vocab_per_rank
        self._store: dist.TCPStore | None = None  # the leader's rendezvous

    def connect(self, device: str, port: int) -> None:
        """Joins the group (blocks until every rank has) through the leader's rendezvous (open_rendezvous) on
        `port`; the leader passes its store's port, the others connect to it there."""
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a tensor-parallel group; it can hold one engine's")
        if self.is_leader:
            store = self._store
        else:
            store = dist.TCPStore(RENDEZVOUS_HOST, port, self.size, is_master=False, timeout=_timeout())
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend_for(device), store=store, rank=self.rank, world_size=self.size, timeout=_timeout()
        )

    def open_rendezvous(self) -> int:
        """The leader's store that every rank meets at (on a port of its own choosing, so no two groups collide);
        returns the port, for the other ranks."""
        self._store = dist.TCPStore(RENDEZVOUS_HOST, 0, self.size, is_master=True, wait_for_workers=False,
                                    timeout=_timeout())
        return self._store.port

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def is_leader(self) -> bool:
        return self.rank == LEADER

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's partial result (a row-parallel projection's), in place."""
        dist.all_reduce(partial)
        return partial

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The leader's tensor on every rank (the others pass one of its shape and dtype to fill)."""
        dist.broadcast(tensor, src=LEADER)
        return tensor

    def gather_heads(self, blocks: torch.Tensor) -> torch.Tensor | None:
        """Each rank's KV cache blocks [..., kv_heads_per_rank, head_dim] -> on the leader every head's
        [..., kv_heads, head_dim], in the checkpoint's head order (shard.py gives rank r the r-th equal run of heads);
        None on the other ranks. A KV handoff carries the unsplit blocks, so a prefill worker and a decode worker
        split over different numbers of ranks read each other's."""
        return self._gather(blocks, dim=-2)

    def head_shard(self, blocks: torch.Tensor) -> torch.Tensor:
        """Unsplit KV blocks [..., kv_heads, head_dim] -> this rank's heads of them, as gather_heads reads them."""
        return blocks.chunk(self.size, dim=-2)[self.rank]

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: weight [vocab_per_rank, hidden] is this rank's slice; a token outside it reads
        zeros here, so the all-reduce leaves each token the one rank's row that holds it, exactly."""
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        rows = F.embedding(local.masked_fill(outside, 0), weight)  # [..., hidden]
        return self.all_reduce(rows.masked_fill_(outside[..., None], 0.0))

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Each rank's logits over its vocabulary slice [..., vocab_per_rank] -> on the leader the whole
        distribution [..., vocab], on the other ranks None: only the leader samples, verifies and reports
        logprobs, so nothing else needs it."""
        whole = self._gather(logits, dim=-1)
        return None if whole is None else whole[..., : self.vocab_size]

    def _gather(self, piece: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's piece, rank after rank along `dim`, on the leader; None on the other ranks."""
        piece = piece.contiguous()
        if not self.is_leader:
            dist.gather(piece, None, dst=LEADER)
            return None
        pieces = [torch.empty_like(piece) for _ in range(self.size)]
        dist.gather(piece, pieces, dst=LEADER)
        return torch.cat(pieces, dim=dim)

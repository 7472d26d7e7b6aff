"""What carries a KV handoff from a prefill worker to a decode worker: the one interface the rest of the worker sees.

The embedded default is NATS (nats_transport.py): no other network, and the mesh's own credentials. A deployment
with RDMA would implement the same three calls over NIXL or UCX (docs/deploy.md, "KV transfer over RDMA"):
`send` writes the bytes into memory the receiver registered, `take` hands them to the engine. Nothing else changes:
the engine exports and imports handoff/format.py's bytes, and the request itself still travels over JetStream.
"""

from __future__ import annotations

from typing import Protocol


class TransferFailed(Exception):
    """A transfer that did not complete. `gone`: nobody receives for that worker (dead or leaving), so another is
    chosen; otherwise (busy, a bad chunk, a timeout) the receiver is alive and recomputes the request."""

    def __init__(self, reason: str, gone: bool = False, busy: bool = False) -> None:
        super().__init__(reason)
        self.gone = gone
        self.busy = busy


class KvTransport(Protocol):
    async def start(self) -> None:
        """Starts receiving (a decode worker)."""

    async def send(self, worker_id: int, transfer_id: str, payload: bytes) -> None:
        """Delivers `payload` to worker `worker_id` under `transfer_id`, complete and checked, or raises
        TransferFailed."""

    def take(self, transfer_id: str) -> bytes | None:
        """The bytes of a completed transfer to this worker, once; None if it never completed here (or expired).
        Whatever is held of the transfer is let go."""

    @property
    def num_held(self) -> int:
        """Transfers received, or being received, whose request has not come for them yet."""

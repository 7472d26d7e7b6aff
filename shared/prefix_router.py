"""Prefix-aware routing, the choosing side (the announcing side is services/worker/routing.py): which worker's prefix
cache holds the longest part of a request's prompt, from what the workers announce. Gateways choose among the
workers that take prompts (roles both and prefill); a prefill worker chooses among decode workers where to hand a
request off (services/worker/handoff/), and sends only the blocks its choice does not hold.

Each gateway replica listens to every worker's cache events (the names of the blocks it stored and evicted,
shared/cache_events.py) and state (alive, busy, draining, what its names are made of; schemas.WorkerState), and
keeps an approximate map from block name to the workers holding it. Approximate, and only ever a hint: a request
routed to a worker that evicted its prefix meanwhile is computed there, and one that goes to the shared queue is
served by whoever has room. A worker's names are forgotten when it restarts (a new epoch), when this gateway missed
one of its events (a gap in their numbers), and when its state stops coming. A worker this gateway meets (its own
start, the worker's, or after forgetting it) is asked for a snapshot of every name it holds.

The rule, for a prompt whose first (len - 1) // block_size blocks can be cached (a worker computes at least the
prompt's last token): the workers holding the longest run of its leading blocks take it, the least busy of them, if
that one holds no more than `busy_margin` sequences beyond the least busy worker of all; else the workers
holding the next longest run, and so on down to those holding none of it, among whom the least busy worker of all
is. So a prompt nobody holds (a conversation's first turn) goes to the least busy worker, which spreads new
conversations evenly and leaves each worker room for their next turns; a shared pull queue would hand them to
whichever worker asked first. Busy is (the sequences a worker holds + its routed backlog + what this gateway routed
to it since its last state) / max_num_seqs, so that workers of different sizes compare; the margin is counted in
those sequences rather than in batches, so that it means the same at any --max-num-seqs: half a batch of 64 would
let a burst sharing one prefix (an agent's system prompt) pile 32 sequences onto the worker holding it, and an
eighth of a batch of 4 would send a conversation's next turn away from its cache whenever this gateway had just
routed one request there. With fewer than two workers to choose from, the shared queue.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import ValidationError

from collections.abc import Callable

from shared import subjects
from shared.cache_events import CacheEventError, CacheEvents
from shared.prefix_hash import BlockHash, cacheable_blocks, extend_hashes, root_hash
from shared.schemas import WorkerState
from shared.natsutil import core_only

log = logging.getLogger("specmesh.gateway")

DEFAULT_BUSY_MARGIN = 8.0  # sequences: a burst sharing one prefix spreads after 8, each other worker then caching it
PROMPT_ROLES = frozenset({"both", "prefill"})  # the workers a gateway sends prompts to
STATE_FRESH_S = 2.0  # a worker whose state is older takes no routed request (workers send one every 0.5 s)
FORGET_AFTER_S = 30.0  # a worker silent this long is forgotten, names and all (a pod replaced under a new id)


@dataclass
class _Worker:
    state: WorkerState
    seen: float  # when its state last came
    next_event: int = 0  # the number of the event expected next
    names: set[BlockHash] = field(default_factory=set)
    routed_since_state: int = 0  # sequences this gateway routed to it since its last state

    @property
    def held(self) -> int:
        """Sequences it holds, has routed to it, or this gateway routed to it since its last state."""
        return self.state.in_flight + self.state.routed_backlog + self.routed_since_state

    @property
    def load(self) -> float:
        """How full it is: what it holds per batch slot (workers of different --max-num-seqs compare)."""
        return self.held / self.state.max_num_seqs


@dataclass(frozen=True)
class Placement:
    worker_id: int
    depth: int  # leading cacheable blocks of the prompt the worker holds, as far as its announcements tell


class PrefixRouter:
    def __init__(
        self, nc: Client, busy_margin: float = DEFAULT_BUSY_MARGIN, roles: frozenset[str] = PROMPT_ROLES,
        min_choices: int = 2, on_bad_message: Callable[[str], None] | None = None,
    ) -> None:
        """roles: the workers chosen among; min_choices: fewer fresh ones than this and `choose` answers None (a
        gateway then uses the shared queue); on_bad_message(kind) counts a malformed state or cache event."""
        self.nc = nc
        self.busy_margin = busy_margin
        self.roles = roles
        self.min_choices = min_choices
        self._on_bad_message = on_bad_message or (lambda kind: None)
        self._workers: dict[int, _Worker] = {}
        self._holders: dict[BlockHash, set[int]] = {}  # block name -> the workers holding it

    async def start(self) -> None:
        await self.nc.subscribe(subjects.worker_state("*"), cb=core_only(self._on_state))
        await self.nc.subscribe(subjects.cache_events("*"), cb=core_only(self._on_events))

    async def _on_state(self, msg: Msg) -> None:
        try:
            met = self.observe_state(WorkerState.from_bytes(msg.data))
        except (ValidationError, ValueError) as exc:
            log.warning("ignoring a malformed worker state: %s", exc)
            self._on_bad_message("state")
            return
        if met is not None:
            await self.nc.publish(subjects.cache_sync(met), b"")

    async def _on_events(self, msg: Msg) -> None:
        try:
            events = CacheEvents.decode(msg.data)
        except CacheEventError as exc:
            log.warning("ignoring a malformed cache event: %s", exc)
            self._on_bad_message("cache_event")
            return
        if self.observe_events(events):
            await self.nc.publish(subjects.cache_sync(events.worker_id), b"")

    def observe_state(self, state: WorkerState) -> int | None:
        """Takes a worker's state; returns its id when this gateway meets it (first state, or a new epoch): what it
        holds is then asked for (subjects.cache_sync)."""
        worker = self._workers.get(state.worker_id)
        if worker is None or worker.state.epoch != state.epoch:
            self._forget(state.worker_id)
            self._workers[state.worker_id] = _Worker(state, time.monotonic())
            return state.worker_id
        worker.state, worker.seen, worker.routed_since_state = state, time.monotonic(), 0
        return None

    def observe_events(self, events: CacheEvents) -> bool:
        """Takes a worker's cache events; True when an earlier one was missed, so that what it holds is asked for
        again (names that stay cached are never announced twice)."""
        worker = self._workers.get(events.worker_id)
        if worker is None or worker.state.epoch != events.epoch:
            return False  # its state comes first: until then, nothing is known of what it holds
        missed = events.seq != worker.next_event and not events.snapshot
        if missed or events.snapshot:
            self._forget_names(worker, events.worker_id)
        worker.next_event = events.seq + 1
        for name in events.removed:
            worker.names.discard(name)
            holders = self._holders.get(name)
            if holders is not None:
                holders.discard(events.worker_id)
                if not holders:
                    del self._holders[name]
        for name in events.stored:
            worker.names.add(name)
            self._holders.setdefault(name, set()).add(events.worker_id)
        return missed

    def _forget(self, worker_id: int) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._forget_names(worker, worker_id)

    def _forget_names(self, worker: _Worker, worker_id: int) -> None:
        for name in worker.names:
            holders = self._holders.get(name)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[name]
        worker.names.clear()

    def choose(self, prompt_ids: list[int], cache_salt: str | None, num_seqs: int = 1) -> int | None:
        """The worker to send this prompt to, or None for the shared queue (see the module docstring); counts the
        request against the chosen worker's load until its next state."""
        placement = self.place(prompt_ids, cache_salt, num_seqs)
        return None if placement is None else placement.worker_id

    def place(
        self, prompt_ids: list[int], cache_salt: str | None, num_seqs: int = 1, exclude: frozenset[int] = frozenset()
    ) -> Placement | None:
        """The chosen worker (none of `exclude`) with how much of the prompt it holds, or None."""
        now = time.monotonic()
        for worker_id in [w for w, worker in self._workers.items() if now - worker.seen > FORGET_AFTER_S]:
            self._forget(worker_id)
        eligible = {
            worker_id: worker for worker_id, worker in self._workers.items()
            if now - worker.seen <= STATE_FRESH_S and not worker.state.draining and worker.state.role in self.roles
            and (worker.state.caching or self.min_choices < 2) and worker_id not in exclude
        }
        if len(eligible) < max(self.min_choices, 1):
            return None
        matched: dict[int, int] = {}
        names_by_kind: dict[tuple[str, int], list[BlockHash]] = {}
        for worker_id, worker in eligible.items():
            kind = (worker.state.revision, worker.state.block_size)
            if kind not in names_by_kind:
                size = worker.state.block_size
                cacheable = cacheable_blocks(len(prompt_ids), size) * size  # as the worker looks it up
                names_by_kind[kind] = extend_hashes([], root_hash(kind[0], cache_salt), prompt_ids[:cacheable], size)
            names = names_by_kind[kind]
            depth = 0
            while depth < len(names) and worker_id in self._holders.get(names[depth], ()):
                depth += 1
            matched[worker_id] = depth
        least_busy = min(eligible.values(), key=lambda worker: worker.load)
        for depth in sorted(set(matched.values()), reverse=True):
            tier = [worker_id for worker_id, d in matched.items() if d == depth]
            chosen = min(tier, key=lambda worker_id: (eligible[worker_id].load, worker_id))
            if eligible[chosen].held <= least_busy.held + self.busy_margin:
                break
        eligible[chosen].routed_since_state += num_seqs
        return Placement(chosen, matched[chosen])

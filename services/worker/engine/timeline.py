"""When a sequence reached this worker's engine, was first scheduled and emitted its first token here: its request
phases as vLLM's metrics name them (queue, prefill, decode), observed once it finishes (metrics.py). Plain Python,
monotonic seconds; one clock read per phase, none per step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Timeline:
    arrived: float = field(default_factory=time.monotonic)  # added to the engine
    scheduled: float | None = None  # first given a cache slot (a preempted sequence keeps its first)
    first_token: float | None = None  # first token emitted by this engine
    outputs_before: int = 0  # output tokens it came with (taken over, handed back or handed off): another's

    def on_scheduled(self) -> None:
        if self.scheduled is None:
            self.scheduled = time.monotonic()

    def on_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()

    def phases(self, finished: float) -> tuple[float, float, float]:
        """(queue, prefill, decode) seconds of a sequence that finished at `finished`: waiting for a slot, from
        its slot to its first token, from its first token to its end."""
        scheduled = self.scheduled if self.scheduled is not None else finished
        first_token = self.first_token if self.first_token is not None else finished
        return scheduled - self.arrived, first_token - scheduled, finished - first_token

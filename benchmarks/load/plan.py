"""What benchmarks/soak.py asks of the load generator, and what the generator reports back, per request.

soak.py writes a LoadPlan to a JSON file and runs locust (benchmarks/load/locustfile.py) in its own process; the
locust users read the plan and append one Record per request, a JSON line, to the plan's records file. This module
is the contract between the two: standard library only, because it is imported under locust's gevent as well.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

GREEDY_SEED = None  # a Record's seed when the request was greedy (temperature 0)


@dataclass(frozen=True)
class LoadPlan:
    model: str
    prompts: list[str]
    max_tokens: int
    streams: int  # users that keep one stream each in flight, back to back
    duration_s: float  # the streams run this long; then no new request starts and the run ends when all are done
    sampled_share: float  # the share of requests sampled at `temperature` with a seed from `seeds`; the rest greedy
    seeds: list[int]
    temperature: float
    disconnects: int  # requests whose client leaves at a random time before the end
    leavers: int  # users making those requests, beside the streams
    disconnect_max_delay_s: float  # a leaving client waits uniform(0, this) after sending, then closes
    leave_max_tokens: int  # what a leaving client asks for: enough that its stream is still running when it leaves
    records_path: str
    started_path: str  # the generator writes its monotonic clock here when the users start
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("a load plan needs at least one prompt")
        if self.max_tokens < 1 or self.leave_max_tokens < 1 or self.streams < 1 or self.duration_s <= 0:
            raise ValueError(
                f"max_tokens, streams and duration_s must be positive, got {self.max_tokens}, {self.streams}, "
                f"{self.duration_s}"
            )
        if not 0.0 <= self.sampled_share <= 1.0:
            raise ValueError(f"sampled_share must lie in [0, 1], got {self.sampled_share}")
        if self.sampled_share > 0 and not self.seeds:
            raise ValueError("sampled requests need seeds (their outputs are compared by seed)")
        if self.disconnects < 0 or (self.disconnects > 0) != (self.leavers > 0):
            raise ValueError(f"{self.disconnects} disconnects need leaving users, and only then: got {self.leavers}")
        if self.disconnect_max_delay_s <= 0:
            raise ValueError(f"disconnect_max_delay_s must be positive, got {self.disconnect_max_delay_s}")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> "LoadPlan":
        return cls(**json.loads(path.read_text()))


STREAM = "stream"  # a request read to its end
LEFT = "left"  # a request whose client left on purpose
# How a request failed. The first two are clear answers (the mesh said what went wrong); the others are not.
REFUSED = "refused"  # an HTTP error status with its error body
ERROR_EVENT = "error_event"  # the stream ended with an error event
BROKEN = "broken"  # no response, a connection that broke or stalled, a stream without [DONE], a chunk not JSON
WRONG_LENGTH = "wrong_length"  # a stream that ended well with more or fewer tokens than asked (EOS is ignored)
CLEAR_ERRORS = (REFUSED, ERROR_EVENT)


@dataclass
class Record:
    """One request as its client saw it. Times are time.monotonic() (one clock for every process of the machine),
    so soak.py can set them against the moment it killed a process."""

    kind: str  # STREAM or LEFT
    prompt: int  # index into LoadPlan.prompts
    seed: int | None  # GREEDY_SEED for a greedy request
    sent: float
    arrivals: list[float] = field(default_factory=list)  # each chunk that carried text, seconds after `sent`
    ended: float | None = None  # seconds after `sent` the stream ended (or the client left)
    status: int | None = None  # the HTTP status, None if no response came
    tokens: int | None = None  # usage.completion_tokens of the last chunk
    text_digest: str | None = None  # sha256 of the streamed text, to compare outputs of equal requests
    finished: bool = False  # the stream ended with [DONE] (for a leaving client: before it left)
    error: str | None = None  # why this request failed; None when it did not
    error_kind: str | None = None  # REFUSED, ERROR_EVENT, BROKEN or WRONG_LENGTH

    def fail(self, kind: str, error: str) -> None:
        self.error_kind, self.error = kind, error

    def to_line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":")) + "\n"

    @classmethod
    def from_line(cls, line: str) -> "Record":
        return cls(**json.loads(line))


def read_records(path: Path) -> list[Record]:
    if not path.exists():
        return []
    return [Record.from_line(line) for line in path.read_text().splitlines() if line]

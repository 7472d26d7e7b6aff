"""The failure of a tensor-parallel group, which no request is to blame for."""

from __future__ import annotations


class RankFailed(RuntimeError):
    """A rank of the engine's tensor-parallel group died or failed: the engine cannot compute another step.

    Not a request's failure: the step guard (services/worker/step_guard.py) lets it end the engine process, which
    the worker reports and fails on, instead of blaming and retrying the step's requests."""

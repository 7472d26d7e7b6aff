"""Why the worker terminated a work-queue message without serving it to the end."""

from __future__ import annotations

from enum import StrEnum


class FailReason(StrEnum):
    """The `reason` label of FAILED_REQUESTS: a closed set, so no client value becomes a label."""

    MALFORMED = "malformed"  # not a WorkRequest: bad JSON, or a field outside the request schema
    NO_DETOKENIZER = "no_detokenizer"  # names no detokenizer to send its output to
    OUT_OF_LIMITS = "out_of_limits"  # outside the model: a token id past the vocabulary, no room in the context
    REFUSED = "refused"  # the engine refused it for another reason
    ENGINE_ERROR = "engine_error"  # an engine step raised and the request failed it alone (or none could be blamed)

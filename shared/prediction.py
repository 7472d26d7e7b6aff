"""How much of a request's prediction (OpenAI's predicted outputs) its answer used: usage's
`completion_tokens_details`, counted where the answer's tokens are known (the detokenizer).

OpenAI counts the prediction's tokens that appear in the completion as accepted and the others as rejected. Here
they are the tokens of the matching blocks difflib finds between the two, in order: a token of the prediction is
accepted at most once, where the answer has it in the same order as the prediction around it.
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import SequenceMatcher

from shared.schemas import CompletionTokensDetails


def prediction_usage(prediction: Sequence[int], output: Sequence[int]) -> CompletionTokensDetails:
    matcher = SequenceMatcher(None, list(prediction), list(output), autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return CompletionTokensDetails(
        accepted_prediction_tokens=accepted, rejected_prediction_tokens=len(prediction) - accepted
    )

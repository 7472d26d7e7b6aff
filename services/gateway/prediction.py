"""OpenAI's predicted outputs on chat: `prediction: {"type": "content", "content": ...}`, the text the answer is
expected to mostly repeat. Its tokens become the request's drafts wherever the answer follows them (services/worker/
drafting/prediction.py), so an answer that repeats most of its prediction takes far fewer steps; verification keeps
the answer the one it would be without a prediction. Usage reports how many of its tokens the answer used
(`completion_tokens_details`, shared/prediction.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, field_validator

from services.gateway.errors import bad_request
from services.gateway.protocol import Body, joined_text_parts
from shared.tokenizer import Tokenizer

PARAM = "prediction"


class Prediction(Body):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["content"]
    # Normalized to a string: text parts are joined with line breaks, as a message's are.
    content: str

    _text = field_validator("content", mode="before")(joined_text_parts)


def prediction_token_ids(prediction: Prediction, tokenizer: Tokenizer, max_model_len: int) -> tuple[int, ...]:
    """The prediction's tokens as the answer would write them (no special tokens); a 400 for one longer than any
    answer could be."""
    ids = tokenizer.encode(prediction.content, add_special_tokens=False)
    if len(ids) >= max_model_len:
        raise bad_request(
            f"The prediction has {len(ids)} tokens; an answer of this model holds fewer than {max_model_len}",
            param=PARAM,
        )
    return tuple(ids)

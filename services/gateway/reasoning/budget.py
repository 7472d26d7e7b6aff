"""vLLM's thinking_token_budget at the gateway: the budget, with the reasoning block's tags as the worker matches them
(shared/schemas.ThinkingBudget; the worker holds it in services/worker/sampling/thinking_budget.py)."""

from __future__ import annotations

import functools
from services.gateway.errors import bad_request
from services.gateway.reasoning.parser import ReasoningFormat
from shared.schemas import MAX_LAYOUT_IDS, ThinkingBudget
from shared.tokenizer import Tokenizer

PARAM = "thinking_token_budget"
LAYOUT_BYTES = frozenset(b"\n")  # what the tokens before a block may hold (reasoning/parser.py's LAYOUT)


def thinking_budget(budget: int, api: str, reasoning: ReasoningFormat | None, tokenizer: Tokenizer) -> (
    ThinkingBudget | None
):
    """The budget the worker holds; None where the prompt closed the block (there is no thinking to cut). A 400 naming
    the parameter where no block can be told apart: a completion, a server without --reasoning-parser, a tokenizer
    that writes a tag in several tokens (the worker forces the closing tag as one)."""
    if api != "chat":
        raise bad_request(f"{PARAM} holds the reasoning block of a chat answer; a completion has none", param=PARAM)
    if reasoning is None:
        raise bad_request(
            f"{PARAM} needs the reasoning set apart from the content: start the server with --reasoning-parser",
            param=PARAM,
        )
    if reasoning.closed:
        return None
    open_id, close_id = (tokenizer.single_token_id(tag) for tag in (reasoning.open_tag, reasoning.close_tag))
    if open_id is None or close_id is None:
        raise bad_request(
            f"{PARAM} needs {reasoning.open_tag} and {reasoning.close_tag} to be single tokens of the model's "
            "vocabulary, and this tokenizer spells one of them in several",
            param=PARAM,
        )
    return ThinkingBudget(
        budget=budget, open_id=open_id, close_id=close_id, starts_inside=reasoning.starts_inside,
        layout_ids=layout_ids(tokenizer),
    )


@functools.cache  # a gateway has one tokenizer, whose whole vocabulary this reads
def layout_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The tokens of line breaks alone (the first MAX_LAYOUT_IDS)."""
    found = [i for i, raw in enumerate(tokenizer.token_bytes) if raw and set(raw) <= LAYOUT_BYTES]
    return tuple(found[:MAX_LAYOUT_IDS])

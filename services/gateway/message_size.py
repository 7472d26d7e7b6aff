"""A request must fit in one NATS message: refused with a 400 that says so before it is sent, never a 503.

The NATS server announces its max_payload (1 MiB by default) when the gateway connects; a message larger than
that is refused by the client library itself. The work request carries the prompt's token ids and the sampling
parameters (stop strings, logit bias), the detokenizer's DetokOpen the stop strings and, for echo, the prompt.
"""

from __future__ import annotations

from services.gateway.errors import bad_request

REQUEST_TOO_LARGE = "request_too_large"


def check_message_size(what: str, data: bytes, max_payload: int, prompt_param: str) -> None:
    """Raises a 400 when `data`, the request's `what` message, exceeds the server's max_payload."""
    if len(data) > max_payload:
        raise bad_request(
            f"The request is too large for the mesh: its {what} would be {len(data)} bytes, and the NATS server "
            f"carries messages of at most {max_payload} bytes (max_payload). Shorten the prompt, the stop strings "
            "or logit_bias.",
            param=prompt_param,
            code=REQUEST_TOO_LARGE,
        )

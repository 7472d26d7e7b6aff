"""Hypothesis strategies for tests/test_fuzz_requests.py: request bodies and work-queue messages as a well-behaved
client or gateway writes them, the same with fields replaced by anything (wrong types, huge or negative numbers,
out-of-vocabulary ids, unicode, nothing), and bytes that are no JSON at all.

Valid bodies name a small max_tokens, so that none runs to the end of the context and many fit in the suite's time.
"""

from __future__ import annotations

import json

import orjson
from hypothesis import strategies as st

from shared.schemas import MAX_INT32
from shared.tokenizer import Tokenizer
from tests.test_e2e import E2E_MODEL

VOCAB_SIZE = Tokenizer(E2E_MODEL).vocab_size
MODEL = E2E_MODEL.name
MAX_NEW_TOKENS = 12
MAX_REPLACED = 2  # fields of a valid body replaced at once
LONG_PROMPT = 5000  # tokens: past the demo model's context
HEX = "0123456789abcdef"
NESTING = 200  # brackets of a deeply nested body

# Integers around every boundary a field could overflow: int32, int64, uint64, and far past them.
EDGE_INTS = st.sampled_from(
    [-1, 0, 1, 2**15, 2**16, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63)]
)
INTS = st.one_of(st.integers(-3, 40), EDGE_INTS, st.integers(-(2**70), 2**70))
IN_VOCAB = st.integers(0, VOCAB_SIZE - 1)
PAST_VOCAB = st.integers(VOCAB_SIZE, MAX_INT32)  # inside the schema, outside the model
TOKEN_IDS = st.one_of(IN_VOCAB, st.integers(VOCAB_SIZE, VOCAB_SIZE + 10), INTS)
FLOATS = st.one_of(st.floats(-3.0, 3.0), st.floats(allow_nan=False), st.sampled_from([1e308, -1e308, 5e-324]))
TEXT = st.text(max_size=40)  # every plane of unicode, surrogates aside (JSON cannot carry them)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=8))
ANY_VALUE = st.one_of(
    SCALARS, TEXT, st.lists(TOKEN_IDS, max_size=6), st.lists(SCALARS, max_size=3),
    st.lists(st.one_of(TEXT, st.lists(TOKEN_IDS, max_size=4)), max_size=3),
    st.dictionaries(st.text(max_size=4), SCALARS, max_size=2),
)

SAMPLING = {
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "stop_token_ids": st.lists(IN_VOCAB, max_size=3),
    "n": st.integers(1, 2),
    "logit_bias": st.dictionaries(IN_VOCAB.map(str), st.floats(-100.0, 100.0), max_size=2),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "user": st.text(max_size=8),
}
VALID_COMPLETIONS = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(IN_VOCAB, min_size=1, max_size=6)),
        "max_tokens": st.integers(1, MAX_NEW_TOKENS),
    },
    optional={**SAMPLING, "logprobs": st.integers(0, 5), "echo": st.booleans()},
)
VALID_CHATS = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}),
            min_size=1, max_size=3,
        ),
        "max_tokens": st.integers(1, MAX_NEW_TOKENS),
    },
    optional={**SAMPLING, "logprobs": st.just(True), "top_logprobs": st.integers(0, 5)},
)
BODY_FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "echo",
    "prompt_logprobs", "speculative", "stream_options", *SAMPLING,
]
# Bodies that are not JSON objects, or JSON no request model could hold.
RAW_BODIES = st.one_of(
    st.binary(max_size=64), TEXT.map(str.encode), st.just(b"[" * NESTING + b"]" * NESTING),
    st.just(b'{"model": "' + b"\xff" * 8 + b'"}'),
)


def to_json(value: object) -> bytes:
    """JSON of the value; integers past 64 bits, which orjson refuses, written by the standard library."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value).encode()


def _replaced(valid: st.SearchStrategy[dict], fields: list[str]) -> st.SearchStrategy[dict]:
    """A valid body with up to MAX_REPLACED of these fields (or unknown ones) replaced by anything."""
    replacements = st.dictionaries(st.one_of(st.sampled_from(fields), st.text(max_size=6)), ANY_VALUE, min_size=1,
                                   max_size=MAX_REPLACED)
    return st.builds(lambda body, changes: {**body, **changes}, valid, replacements)


def bodies() -> st.SearchStrategy[tuple[str, bytes]]:
    """(path under /v1, body): half valid, half with fields replaced, and a share that is no JSON object."""
    completions = st.one_of(VALID_COMPLETIONS, _replaced(VALID_COMPLETIONS, BODY_FIELDS))
    chats = st.one_of(VALID_CHATS, _replaced(VALID_CHATS, BODY_FIELDS))
    return st.one_of(
        st.tuples(st.just("/completions"), completions.map(to_json)),
        st.tuples(st.just("/chat/completions"), chats.map(to_json)),
        st.tuples(st.sampled_from(["/completions", "/chat/completions"]), RAW_BODIES),
    )


def _valid_work(detok_id: str) -> st.SearchStrategy[dict]:
    sampling = st.fixed_dictionaries(
        {"temperature": st.floats(0.0, 2.0), "max_tokens": st.integers(1, MAX_NEW_TOKENS)},
        optional={key: SAMPLING[key] for key in ("top_p", "top_k", "stop_token_ids", "logit_bias", "ignore_eos")}
        | {"seed": st.integers(0, 2**63 - 1), "logprobs": st.integers(0, 5)},
    )
    return st.fixed_dictionaries(
        {
            "request_id": st.text(HEX, min_size=32, max_size=32),
            "prompt_token_ids": st.lists(IN_VOCAB, min_size=1, max_size=8),
            "detok_id": st.just(detok_id),
            "sampling": sampling,
            "created": st.floats(0.0, 2e9),
        },
        optional={"n": st.integers(1, 2)},
    )


def _with(work: dict, fields: dict, sampling_fields: dict) -> dict:
    if isinstance(work.get("sampling"), dict):
        work = {**work, "sampling": {**work["sampling"], **sampling_fields}}
    return {**work, **fields}


WORK_FIELDS = ["request_id", "prompt_token_ids", "detok_id", "sampling", "created", "n", "surplus"]
SAMPLING_FIELDS = [
    "max_tokens", "top_k", "top_p", "temperature", "seed", "logprobs", "prompt_logprobs", "stop_token_ids",
    "logit_bias", "min_tokens", "repetition_penalty", "min_p", "speculative", "surplus",
]
PROGRESS = st.lists(
    st.fixed_dictionaries(
        {"index": st.one_of(st.integers(0, 2), INTS)},
        optional={"output_token_ids": st.lists(TOKEN_IDS, max_size=4), "next_seq_no": INTS},
    ),
    max_size=2,
)
WORK_REPLACEMENTS = st.one_of(
    st.dictionaries(st.sampled_from(WORK_FIELDS), ANY_VALUE, min_size=1, max_size=MAX_REPLACED),
    st.fixed_dictionaries({"progress": PROGRESS}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(TOKEN_IDS, min_size=1, max_size=8)}),
)
SAMPLING_REPLACEMENTS = st.dictionaries(
    st.sampled_from(SAMPLING_FIELDS),
    st.one_of(ANY_VALUE, TOKEN_IDS.map(lambda t: {str(t): 1.0}), st.lists(TOKEN_IDS, max_size=3)),
    min_size=1, max_size=MAX_REPLACED,
)
# Inside the schema, outside the model: what only the worker's own check against its model catches.
OUT_OF_MODEL = st.one_of(
    st.tuples(st.fixed_dictionaries({"prompt_token_ids": st.lists(PAST_VOCAB, min_size=1, max_size=3)}), st.just({})),
    st.tuples(st.just({"prompt_token_ids": [1] * LONG_PROMPT}), st.just({})),
    st.tuples(
        st.just({}),
        st.one_of(
            st.fixed_dictionaries({"top_k": PAST_VOCAB}),
            st.fixed_dictionaries({"stop_token_ids": st.lists(PAST_VOCAB, min_size=1, max_size=2)}),
            st.fixed_dictionaries(
                {"logit_bias": st.dictionaries(PAST_VOCAB.map(str), st.just(1.0), min_size=1, max_size=2)}
            ),
        ),
    ),
)


def work_messages(detok_id: str) -> st.SearchStrategy[bytes]:
    """WorkRequests as a gateway writes them (for the detokenizer `detok_id`), the same with fields of the request or
    of its sampling replaced by anything, with values inside the schema but outside the model, and bytes."""
    valid = _valid_work(detok_id)
    changes = st.one_of(
        st.tuples(WORK_REPLACEMENTS, st.just({})),
        st.tuples(st.one_of(st.just({}), WORK_REPLACEMENTS), SAMPLING_REPLACEMENTS),
        OUT_OF_MODEL,
    )
    changed = st.builds(lambda work, change: _with(work, *change), valid, changes)
    return st.one_of(valid.map(to_json), changed.map(to_json), st.binary(max_size=64))

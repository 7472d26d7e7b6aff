"""Gemma 3 on the engine: its sliding layer (a window of MISTRAL_WINDOW positions) beside its full layer, over
contexts many windows long, prefilled in pieces beside running streams and continued from the prefix cache, yields
transformers' greedy tokens under each drafting method a checkpoint without MTP modules allows. Unlike Mistral's,
its cache keeps every block: the full layers read them all (engine/window.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.worker.drafting.checkpoints import DRAFT_SUFFIX
from services.worker.engine.block_manager import DROPPED
from tests.methodfixture import (
    GREEDY, METHODS, PROMPT_TEXTS, encode_prompts, make_engine, make_request, outputs_of, run, tokens_of,
    transformers_continuations,
)
from tests.modelfixture import MISTRAL_WINDOW, make_tiny_model_dir

pytest.importorskip("transformers")

NUM_TOKENS = 48  # generated: contexts of ~60 positions, several windows
BLOCK_SIZE = 4
PIECE = 16  # rows a step computes: prompts arrive in pieces beside the streams already decoding
FIRST_TURN = 24  # output tokens of a request whose blocks the next turn starts from
SIZES = dict(max_model_len=128, block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3, with a copy beside it as its draft model."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3")
    shutil.copytree(path, Path(f"{path}{DRAFT_SUFFIX}"))
    return path


@pytest.fixture(scope="module")
def prompts(gemma_dir: Path) -> list[list[int]]:
    return encode_prompts(gemma_dir, PROMPT_TEXTS)


@pytest.fixture(scope="module")
def expected(gemma_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt."""
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["sliding_window"] == MISTRAL_WINDOW
    assert set(config["layer_types"]) == {"sliding_attention", "full_attention"}
    return transformers_continuations(gemma_dir, prompts, NUM_TOKENS)


@pytest.mark.parametrize("name", ["naive", "ngram", "draft_model"])
def test_streams_side_by_side_prefilled_in_pieces_yield_transformers_tokens(
    gemma_dir: Path, prompts: list[list[int]], expected: list[list[int]], name: str
) -> None:
    engine = make_engine(gemma_dir, METHODS[name], max_num_batched_tokens=PIECE, **SIZES)
    requests = [make_request(prompt, max_tokens=NUM_TOKENS, **GREEDY) for prompt in prompts]

    def keeps_every_block(outputs: list) -> None:
        for seq in engine.scheduler.running:
            assert DROPPED not in engine.scheduler.blocks.table(seq.slot)

    steps = run(engine, {0: requests[:2], 3: requests[2:]}, on_step=keeps_every_block)
    for request, tokens in zip(requests, expected):
        assert tokens_of(steps, request) == tokens


def test_a_next_turn_starts_from_the_prefix_cache_and_goes_on_as_transformers(
    gemma_dir: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    engine = make_engine(gemma_dir, METHODS["ngram"], **SIZES)
    first = make_request(prompts[1], max_tokens=FIRST_TURN, **GREEDY)
    assert tokens_of(run(engine, {0: [first]}), first) == expected[1][:FIRST_TURN]
    following = make_request(prompts[1] + expected[1][:FIRST_TURN], max_tokens=NUM_TOKENS - FIRST_TURN, **GREEDY)
    steps = run(engine, {0: [following]})
    assert tokens_of(steps, following) == expected[1][FIRST_TURN:]
    cacheable = (len(following.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert outputs_of(steps, following)[0].seq.num_cached_tokens == cacheable

"""Blocks a sliding window leaves behind (Mistral): which positions a running sequence's caches still reach, without a
model; and on the tiny Mistral (window MISTRAL_WINDOW), long greedy generations under every drafting method that let
go of those blocks, in a pool too small for their whole contexts, and still yield transformers' tokens: alone or
side by side, recomputed from their output (as after preemption), continued from the prefix cache, or handed from a
prefill worker to a decode worker."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.worker.drafting.checkpoints import DRAFT_SUFFIX, default_eagle3_dir
from services.worker.engine.block_manager import DROPPED, blocks_for
from services.worker.engine.engine import Engine, SeqOutput
from services.worker.engine.sequence import Sequence
from services.worker.engine.window import window_reach
from shared.schemas import ChoiceProgress, SamplingParams
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, PROMPT_TEXTS, Steps, encode_prompts, make_engine, make_request, outputs_of, run, single_thread,
    tokens_of, transformers_continuations,
)
from tests.modelfixture import MISTRAL_WINDOW, make_tiny_model_dir
from tests.eagle3fixture import QUICK_FIT, write_eagle3_head
from tests.mtpfixture import fit_mtp_module, write_mtp_checkpoint

transformers = pytest.importorskip("transformers")

WINDOW = 8
BLOCK_SIZE = 4
MAX_MODEL_LEN = 128  # 32 blocks of 4: the tight pool holds one full-length sequence
NUM_TOKENS = 96  # generated: a context of ~110 positions, over ten windows
# A pool of one sequence's blocks: four sequences of ~110 positions would need ~110 blocks without dropping
TIGHT = dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=blocks_for(MAX_MODEL_LEN, BLOCK_SIZE))
WINDOW_METHODS = ("naive", "ngram", "mtp", "draft_model")
RESUMED_AFTER = 60  # output tokens a resumed request brings
SHORTER_TURN = 20  # output tokens in the prompt of a request that reuses the start of a longer one's blocks
PIECE = 16  # rows a step computes when recomputing in pieces


def _seq(num_computed: int, num_tokens: int, prefill_start: int = 0) -> Sequence:
    seq = Sequence("ab" * 16, list(range(num_tokens)), SamplingParams(max_tokens=4), 0, frozenset())
    seq.num_computed, seq.prefill_start = num_computed, prefill_start
    return seq


def _drafter(computed_until: int, window: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(computed_until=lambda seq: computed_until, window=window)


def test_nothing_is_out_of_reach_where_some_cache_layer_has_no_window() -> None:
    assert window_reach(None) is None
    assert window_reach(WINDOW, draft=_drafter(0, window=None)) is None
    assert window_reach(WINDOW, mtp=_drafter(0, window=None)) is None  # an EAGLE-3 head's layer


def test_the_reach_is_the_lowest_key_any_cache_layers_next_query_sees() -> None:
    seq = _seq(num_computed=20, num_tokens=21)
    assert window_reach(WINDOW)(seq) == 13  # the trunk's next query, at 20, sees 13..20
    assert window_reach(WINDOW, mtp=_drafter(20, window=WINDOW))(seq) == 13
    assert window_reach(WINDOW, mtp=_drafter(15, window=WINDOW))(seq) == 8  # MTP lags: its next entry is written at 16
    assert window_reach(WINDOW, draft=_drafter(21, window=4))(seq) == 13  # it catches up from its last token, 20
    assert window_reach(WINDOW, draft=_drafter(10, window=4))(seq) == 7
    assert window_reach(WINDOW)(_seq(num_computed=20, num_tokens=21, prefill_start=20)) == 0  # nothing computed yet


@pytest.fixture(scope="module")
def mistral_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Mistral with its draft model beside it (a copy: the same window), and a copy with a fitted MTP module,
    by the method that runs on each."""
    trunk = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-mistral"), "mistral")
    shutil.copytree(trunk, Path(f"{trunk}{DRAFT_SUFFIX}"))
    write_eagle3_head(trunk, default_eagle3_dir(trunk), QUICK_FIT)
    with_mtp = write_mtp_checkpoint(
        trunk, tmp_path_factory.mktemp("tiny-mistral-mtp") / "specmesh", fit_mtp_module(trunk), "specmesh"
    )
    return {name: with_mtp if METHODS[name].needs_mtp else trunk for name in (*WINDOW_METHODS, "eagle3")}


@pytest.fixture(scope="module")
def prompts(mistral_dirs: dict[str, Path]) -> list[list[int]]:
    return encode_prompts(mistral_dirs["naive"], PROMPT_TEXTS)


@pytest.fixture(scope="module")
def expected(mistral_dirs: dict[str, Path], prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt."""
    assert json.loads((mistral_dirs["naive"] / "config.json").read_text())["sliding_window"] == MISTRAL_WINDOW == WINDOW
    return transformers_continuations(mistral_dirs["naive"], prompts, NUM_TOKENS)


def _window_bound(engine: Engine, name: str) -> int:
    """The most blocks a decoding sequence holds: positions from its reach to its last token plus the step's
    lookahead, in at most one block more than they fill. The reach is num_computed - window + 1, or a draft model's
    where its cache lags: it ends where the last step's tokens began, up to the drafts accepted before."""
    lag = METHODS[name].num_speculative_tokens if name == "draft_model" else 0
    return blocks_for(WINDOW + lag + engine.scheduler.lookahead, BLOCK_SIZE) + 1


def _checked_run(engine: Engine, name: str, requests: list) -> Steps:
    """Runs the requests together, checking after every step that nothing is preempted and that a sequence that has
    decoded before holds no more than a window's worth of blocks (its first decode catches a draft model up with
    its prompt); at the end every block is back in the pool."""
    bound = _window_bound(engine, name)
    decoded: set[str] = set()
    peak = 0

    def check(outputs: list[SeqOutput]) -> None:
        nonlocal peak
        assert engine.last_preempted == []
        for seq in engine.scheduler.running:
            if seq.key in decoded:
                held = sum(block != DROPPED for block in engine.scheduler.blocks.table(seq.slot))
                assert held <= bound, (seq.num_computed, engine.scheduler.blocks.table(seq.slot))
                peak = max(peak, held)
        decoded.update(o.seq.key for o in outputs if o.offset > 0)

    steps = run(engine, {0: requests}, on_step=check)
    assert 0 < peak <= bound
    assert engine.scheduler.blocks.num_used == 0
    return steps


@pytest.mark.parametrize("name", WINDOW_METHODS)
def test_long_generations_side_by_side_hold_a_window_of_blocks_and_yield_transformers_tokens(
    mistral_dirs, prompts, expected, name: str
) -> None:
    engine = make_engine(mistral_dirs[name], METHODS[name], **TIGHT)
    requests = [make_request(prompt, max_tokens=NUM_TOKENS, **GREEDY) for prompt in prompts]
    steps = _checked_run(engine, name, requests)
    for request, tokens in zip(requests, expected):
        assert tokens_of(steps, request) == tokens


def test_an_eagle3_head_without_a_window_keeps_every_block_and_yields_transformers_tokens(
    mistral_dirs, prompts, expected
) -> None:
    """The head's layer is a Llama's: it attends to every position, so a sequence drafting with it drops nothing."""
    engine = make_engine(mistral_dirs["eagle3"], METHODS["eagle3"], max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
    requests = [make_request(prompt, max_tokens=NUM_TOKENS, **GREEDY) for prompt in prompts]

    def check(outputs: list[SeqOutput]) -> None:
        for seq in engine.scheduler.running:
            assert DROPPED not in engine.scheduler.blocks.table(seq.slot)

    steps = run(engine, {0: requests}, on_step=check)
    for request, tokens in zip(requests, expected):
        assert tokens_of(steps, request) == tokens
    assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("name", WINDOW_METHODS)
def test_a_recomputed_sequence_drops_blocks_between_its_pieces_and_goes_on_as_before(
    mistral_dirs, prompts, expected, name: str
) -> None:
    """A request that comes back with output (as a preempted one does) recomputes its context in pieces. A draft
    model keeps every block until its first draft catches it up with the whole context."""
    engine = make_engine(mistral_dirs[name], METHODS[name], max_num_batched_tokens=PIECE, **TIGHT)
    request = make_request(prompts[0], expected[0][:RESUMED_AFTER], max_tokens=NUM_TOKENS, **GREEDY)
    dropped_while_recomputing = []

    def watch(outputs: list[SeqOutput]) -> None:
        for seq in engine.scheduler.running:
            if seq.is_prefilling:
                dropped_while_recomputing.append(engine.scheduler.blocks.table(seq.slot)[0] == DROPPED)

    steps = run(engine, {0: [request]}, on_step=watch)
    assert any(dropped_while_recomputing) == (name != "draft_model")
    assert tokens_of(steps, request) == expected[0][RESUMED_AFTER:]


@pytest.mark.parametrize("pool", ["tight", "default"])
def test_a_next_turn_starts_from_the_dropped_blocks_left_in_the_prefix_cache(
    mistral_dirs, prompts, expected, pool: str
) -> None:
    """The default pool gives each slot a home region, where the CPU copies a hit found elsewhere."""
    sizes = TIGHT if pool == "tight" else dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
    engine = make_engine(mistral_dirs["ngram"], METHODS["ngram"], **sizes)
    first = make_request(prompts[1], max_tokens=RESUMED_AFTER, **GREEDY)
    assert tokens_of(run(engine, {0: [first]}), first) == expected[1][:RESUMED_AFTER]
    following = make_request(prompts[1] + expected[1][:RESUMED_AFTER], max_tokens=NUM_TOKENS - RESUMED_AFTER, **GREEDY)
    steps = run(engine, {0: [following]})
    assert tokens_of(steps, following) == expected[1][RESUMED_AFTER:]
    cacheable = (len(following.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert outputs_of(steps, following)[0].seq.num_cached_tokens == cacheable


@pytest.mark.parametrize("name", ["naive", "mtp"])
def test_a_prefill_worker_hands_off_every_block_and_the_decode_worker_drops_them_after(
    mistral_dirs, prompts, expected, name: str
) -> None:
    """The handoff carries the whole context's blocks (with MTP, the module's entries and state too), though the
    prompt is computed in pieces, and the decode worker names them in its prefix cache: a later request with a shorter
    prefix of that prompt starts from them and reads blocks the window had long left behind."""
    method = METHODS[name]
    prefill, decode_engine = (
        make_engine(mistral_dirs[name], method, role=role, max_num_batched_tokens=PIECE, **TIGHT)
        for role in ("prefill", "decode")
    )
    assert prefill.scheduler.reach is None and decode_engine.scheduler.reach is not None
    prompt = prompts[2] + expected[2][:RESUMED_AFTER]  # many windows long
    request = make_request(prompt, max_tokens=NUM_TOKENS - RESUMED_AFTER, **GREEDY)
    prefill.add_request(request)
    first, handoffs = [], []
    while not handoffs:
        first += prefill.step()
        handoffs = prefill.hand_off_ready()
    ((seqs, payload),) = handoffs
    progress = ChoiceProgress(index=0, output_token_ids=tuple(seqs[0].output_ids), next_seq_no=seqs[0].target_seq_no)
    continued = request.model_copy(update={"progress": (progress,), "sampling": seqs[0].sampling})
    decode_engine.add_request(continued, payload)
    steps = _checked_run(decode_engine, name, [])
    assert [t for o in first for t in o.tokens] + tokens_of(steps, continued) == expected[2][RESUMED_AFTER:]
    shorter = prompts[2] + expected[2][:SHORTER_TURN]
    again = make_request(shorter, max_tokens=NUM_TOKENS - SHORTER_TURN, **GREEDY)
    steps = run(decode_engine, {0: [again]})
    assert tokens_of(steps, again) == expected[2][SHORTER_TURN:]
    cacheable = (len(shorter) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert outputs_of(steps, again)[0].seq.num_cached_tokens == cacheable

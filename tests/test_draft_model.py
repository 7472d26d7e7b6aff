"""method draft_model with a draft that disagrees with the target (a different random Llama with the same
tokenizer): verification with its real q samples exactly the target's distribution (chi-square), the drafts'
reported logprobs are q's, not point masses, and a missing draft checkpoint is refused by name. The generic method
tests (METHODS in methodfixture.py) run draft_model too, with the shipped-beside copy of the target as its draft."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.config import EngineConfig
from services.worker.engine.engine import Engine
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    METHODS, MAX_MODEL_LEN, assert_second_tokens_follow_the_target, encode_prompts, make_request, outputs_of,
    reference_model, run, single_thread, tokens_of,
    tiny_model_dir,
)
from tests.modelfixture import make_draft_model_dir

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def other_draft(tiny_model_dir, tmp_path_factory):  # noqa: F811
    return make_draft_model_dir(tiny_model_dir, tmp_path_factory.mktemp("other-draft"))


@pytest.fixture(scope="module")
def parallel_draft(tiny_model_dir, tmp_path_factory):  # noqa: F811
    return make_draft_model_dir(tiny_model_dir, tmp_path_factory.mktemp("parallel-draft"), parallel=True)


def _engine(target, draft, max_num_seqs: int = 8, draft_q: str = "model") -> Engine:
    """An engine drafting with the draft checkpoint `draft` (the speculative config's "model")."""
    return Engine(EngineConfig(
        model=target, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
        speculative=METHODS["draft_model"].config(model=draft, draft_q=draft_q),
    ))


@pytest.fixture(scope="module")
def prompt(tiny_model_dir) -> list[int]:  # noqa: F811
    return encode_prompts(tiny_model_dir, ["The cache holds "])[0]


@pytest.mark.parametrize("draft_q", ["model", "point_mass", "parallel"])
def test_verified_drafts_of_a_disagreeing_draft_model_sample_the_target(
    draft_q, tiny_model_dir, other_draft, parallel_draft, prompt, reference_model  # noqa: F811
) -> None:
    """A request resumed after one token decodes its next one by verifying the draft model's drafts: over many
    seeds that token follows the target's softmax, whatever q was, verified against q or as a point mass, or
    drafted in parallel from mask tokens."""
    draft = parallel_draft if draft_q == "parallel" else other_draft
    engine = _engine(tiny_model_dir, draft, max_num_seqs=32, draft_q="model" if draft_q == "parallel" else draft_q)
    assert_second_tokens_follow_the_target(engine, reference_model, prompt)


def test_draft_logprobs_are_the_draft_models_q(tiny_model_dir, other_draft, prompt) -> None:  # noqa: F811
    engine = _engine(tiny_model_dir, other_draft)
    request = make_request(prompt, max_tokens=12, temperature=1.0, seed=1, logprobs=1, include_draft_logprobs=True)
    drafted = [o for o in outputs_of(run(engine, {0: [request]}), request) if o.draft_tokens]
    assert drafted
    logprobs = np.concatenate([o.draft.logprobs[:, 0] for o in drafted])
    assert (logprobs < 0).all() and (logprobs > -30).all()  # a distribution's, not a point mass's 0.0


def test_a_missing_draft_checkpoint_is_refused_by_name(tiny_model_dir, tmp_path) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="needs a draft checkpoint"):
        _engine(tiny_model_dir, tmp_path / "nothing")


def test_a_parallel_draft_model_drafts_a_step_in_one_pass_and_keeps_the_output(
    tiny_model_dir, parallel_draft, prompt  # noqa: F811
) -> None:
    """PARD: the pass that catches the draft cache up drafts all k tokens, from the last token and k - 1 mask
    tokens; greedy output is plain decoding's, and sampled drafts report their q."""
    engine = _engine(tiny_model_dir, parallel_draft)
    passes = []
    forward = engine.draft.runner.forward
    engine.draft.runner.forward = lambda rows, *args, **kwargs: passes.append(rows) or forward(rows, *args, **kwargs)
    greedy = make_request(prompt, max_tokens=16, temperature=0.0)
    steps = run(engine, {0: [greedy]})
    drafted = [o for o in outputs_of(steps, greedy) if o.draft_tokens]
    assert drafted and all(len(o.draft_tokens) <= engine.config.speculative.num_speculative_tokens for o in drafted)
    mask = engine.draft.pard_token
    assert all(rows[0][-2:] == [mask, mask] for rows in passes[:3])  # k = 3: two masks after the last token
    assert len(passes) == len(drafted)  # one pass a step
    plain = Engine(EngineConfig(model=tiny_model_dir, max_num_seqs=8, max_model_len=MAX_MODEL_LEN))
    assert tokens_of(steps, greedy) == tokens_of(run(plain, {0: [greedy]}), greedy)
    sampled = make_request(prompt, max_tokens=12, temperature=1.0, seed=1, logprobs=1, include_draft_logprobs=True)
    logprobs = np.concatenate(
        [o.draft.logprobs[:, 0] for o in outputs_of(run(engine, {0: [sampled]}), sampled) if o.draft_tokens]
    )
    assert (logprobs < 0).all() and (logprobs > -30).all()

"""min_draft_confidence: a model drafter's chain stops right after a draft less likely than the threshold under the
drafter's own distribution, never before one at least that likely; the output stays the target's; and the key is
refused where no model drafts."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from shared.config import DEFAULT_MIN_DRAFT_CONFIDENCE, SpeculativeConfig
from services.worker.engine.engine import SeqOutput
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, greedy_reference, make_engine, make_request, model_dirs, mtp_model_dir, mtp_model_dirs, prompts,
    reference_model, run, tiny_model_dir, tokens_of,
)

pytest.importorskip("transformers")

THRESHOLD = 0.5
NUM_DRAFTS = 4


@pytest.mark.parametrize("name", ["mtp", "draft_model", "eagle3"])
def test_a_chain_stops_after_the_first_unlikely_draft(
    name, model_dirs, prompts, greedy_reference  # noqa: F811
) -> None:
    method = METHODS[name]
    options = dict(num_speculative_tokens=NUM_DRAFTS, min_draft_confidence=THRESHOLD)
    if name == "mtp":
        options["num_model_steps"] = NUM_DRAFTS
    engine = make_engine(model_dirs(method), method, **options)
    requests = [make_request(prompt, max_tokens=24, logprobs=0, include_draft_logprobs=True, **GREEDY)
                for prompt in prompts[:2]]
    lengths: list[int] = []

    def check(outputs: list[SeqOutput]) -> None:
        for out in outputs:
            if not out.draft_tokens:
                continue
            # a greedy draft reports the drafter's own logprobs: each draft's confidence is exp of its entry
            confidences = [float(x) for x in out.draft.logprobs[:, 0]]
            likely = [c >= math.log(THRESHOLD) for c in confidences]
            assert all(likely[:-1])  # every draft before the last was likely enough to go on from
            room = out.seq.sampling.max_tokens - len(out.seq.output_ids)  # after this step's tokens
            if len(out.draft_tokens) < NUM_DRAFTS and room > NUM_DRAFTS + 1:  # not cut by the length budget
                assert not likely[-1]
            lengths.append(len(out.draft_tokens))

    steps = run(engine, {0: requests}, on_step=check)
    for request, prompt in zip(requests, prompts):
        assert tokens_of(steps, request) == greedy_reference(prompt, 24)
    assert 1 in lengths  # some chains were cut at their first draft


def test_the_key_is_refused_where_no_model_drafts() -> None:
    assert SpeculativeConfig(method="eagle3").min_draft_confidence == DEFAULT_MIN_DRAFT_CONFIDENCE
    with pytest.raises(ValidationError, match="min_draft_confidence applies to the model drafters"):
        SpeculativeConfig(method="ngram", min_draft_confidence=0.5)
    with pytest.raises(ValidationError):
        SpeculativeConfig(method="mtp", min_draft_confidence=1.0)

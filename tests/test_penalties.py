"""Penalties, logit_bias, allowed_token_ids, min_tokens and min_p in the engine, under every drafting method: greedy
output equals a step-by-step reference computed here from transformers' logits (the penalties applied to the full
logits one token at a time), sampled output keeps the penalised target distribution (chi-square against plain
decoding), and a seeded request gives the same tokens alone or in any batch."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.sampling.penalties import LogitPenalties, apply_penalties
from services.worker.engine.sequence import Sequence
from shared.schemas import SamplingParams, WorkRequest
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    METHOD_NAMES, METHODS, greedy_reference, make_engine, make_request, model_dirs, mtp_model_dir, mtp_model_dirs,
    prompts, reference_model, run, single_thread, tiny_model_dir, tokens_alone, tokens_of,
)
from tests.test_reproducibility import (  # noqa: F401  (looping_prompt is a fixture, used by name)
    CHI_SQUARE_TEMPERATURE, CHI_SQUARE_TOP_K, DISTRIBUTION_MAX_MODEL_LEN, NUM_SEEDS, chi_square_critical,
    chi_square_homogeneity, looping_prompt,
)

pytest.importorskip("transformers")

NUM_TOKENS = 24
# The tiny random model's logits have a standard deviation of ~0.16 and gaps of ~0.05 between the top tokens, so
# penalties of this size change the greedy text without drowning the model.
PENALTY_CASES = {
    # Negative penalties favour repeating: the text loops, so drafts do get accepted under the penalties.
    "repeat": dict(presence_penalty=-0.1, frequency_penalty=-0.05),
    "penalise": dict(presence_penalty=0.05, frequency_penalty=0.1, repetition_penalty=1.5),
    # Biases on tokens of each prompt's own greedy text (filled in by _sampling); min-p changes no greedy choice.
    "bias": dict(min_p=0.5),
    # Only the prompt's own tokens (filled in by _sampling), one of them biased away: the text loops over the prompt,
    # so prompt lookup's drafts are accepted, and a bias never brings back a token outside the set.
    "allowed": dict(),
    # Words of each prompt's greedy text (filled in by _sampling): one token, two tokens whose first the text
    # generates, and two whose first is only in the prompt (the prompt does not count).
    "bad_words": dict(),
}
BANNED_AT, FAVOURED_AT = 2, 5  # positions in the greedy text whose tokens get a bias of -100 and of FAVOUR
FAVOUR = 0.1
MIN_TOKENS = 10
MASKED = float("-inf")
# A negative presence penalty makes the token after an accepted draft favour the draft's token: the check below then
# tells this penalised distribution from the raw one by far, and (measured once, by making the penalties ignore the
# drafts) a verifier that did not count the drafts before a row at 79 against a critical value of 65.
CHI_SQUARE_PRESENCE = -0.3


def penalised_logits(logits: torch.Tensor, prompt: list[int], output: list[int], sampling: dict,
                     stop_ids: set[int]) -> torch.Tensor:
    """The reference rules on one row of logits [V], token by token."""
    logits = logits.clone().float()
    for token, bias in sampling.get("logit_bias", {}).items():
        logits[token] += bias
    if sampling.get("allowed_token_ids") is not None:
        outside = torch.ones_like(logits, dtype=torch.bool)
        outside[list(sampling["allowed_token_ids"])] = False
        logits[outside] = MASKED
    for word in sampling.get("bad_words_token_ids", ()):
        *before, last = word
        if len(before) <= len(output) and list(output[len(output) - len(before) :]) == before:
            logits[last] = MASKED
    if len(output) < sampling.get("min_tokens", 0):
        for token in stop_ids:
            logits[token] = MASKED
    repetition = sampling.get("repetition_penalty", 1.0)
    for token in set(prompt) | set(output):
        value = float(logits[token])
        logits[token] = value / repetition if value > 0 else value * repetition
    for token, count in Counter(output).items():
        logits[token] -= count * sampling.get("frequency_penalty", 0.0) + sampling.get("presence_penalty", 0.0)
    return logits


def reference_tokens(model, prompt: list[int], sampling: dict, num_tokens: int, stop_ids: set[int]) -> list[int]:
    """Greedy decoding of the penalised logits, one full forward pass per token."""
    output: list[int] = []
    while len(output) < num_tokens:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
        output.append(int(penalised_logits(logits, prompt, output, sampling, stop_ids).argmax()))
        if output[-1] in stop_ids:
            break
    return output


# reference_tokens of each (case, prompt), computed for the first method and compared with every method's: the
# sampling is a function of the two, and so is the reference
_REFERENCES: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def _reference(model, case: str, prompt: list[int], sampling: dict) -> list[int]:
    key = (case, tuple(prompt))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_tokens(model, prompt, sampling, NUM_TOKENS, set())
    return _REFERENCES[key]


def _sampling(case: str, prompt: list[int], greedy: list[int]) -> dict:
    sampling = dict(PENALTY_CASES[case])
    if case == "bias":
        sampling["logit_bias"] = {greedy[BANNED_AT]: -100.0, greedy[FAVOURED_AT]: FAVOUR}
    if case == "bad_words":
        sampling["bad_words_token_ids"] = [
            [greedy[BANNED_AT]], [greedy[FAVOURED_AT - 1], greedy[FAVOURED_AT]], [prompt[-1], greedy[0]],
        ]
    if case == "allowed":
        outside = next(t for t in greedy if t not in prompt)
        sampling["allowed_token_ids"] = sorted(set(prompt[1:]))  # not the BOS token
        sampling["logit_bias"] = {prompt[1]: -100.0, outside: 100.0}
    return sampling


@pytest.mark.parametrize("case", PENALTY_CASES)
@pytest.mark.parametrize("name", METHOD_NAMES)
def test_greedy_output_with_penalties_equals_the_step_by_step_reference(
    model_dirs, prompts, reference_model, greedy_reference, name, case
) -> None:
    method = METHODS[name]
    samplings = [_sampling(case, p, greedy_reference(p, NUM_TOKENS)) for p in prompts]
    requests = [
        make_request(p, max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **sampling)
        for p, sampling in zip(prompts, samplings)
    ]
    engine = make_engine(model_dirs(method), method)
    steps = run(engine, {0: requests[:2], 2: requests[2:]})
    for request, sampling in zip(requests, samplings):
        prompt = list(request.prompt_token_ids)
        expected = _reference(reference_model, case, prompt, sampling)
        assert tokens_of(steps, request) == expected
        assert expected != greedy_reference(prompt, NUM_TOKENS), "the penalties must change the greedy text"
        if "allowed_token_ids" in sampling:
            assert set(expected) <= set(sampling["allowed_token_ids"]) - {prompt[1]}
    if case in ("repeat", "allowed") and method.drafts:
        assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_min_tokens_masks_the_stop_tokens_until_reached(model_dirs, prompts, reference_model, greedy_reference,
                                                         name) -> None:
    """The stop token is one the greedy text reaches early; min_tokens keeps it (and EOS) out until then."""
    method = METHODS[name]
    prompt = prompts[0]
    stop = greedy_reference(prompt, NUM_TOKENS)[1]
    sampling = dict(min_tokens=MIN_TOKENS, presence_penalty=-0.1)  # the penalty brings the stop token back later
    request = make_request(prompt, max_tokens=NUM_TOKENS, temperature=0.0, stop_token_ids=[stop], **sampling)
    engine = make_engine(model_dirs(method), method)
    tokens = tokens_alone(engine, request)
    stop_ids = {stop, *engine.eos_token_ids}
    assert tokens == reference_tokens(reference_model, prompt, sampling, NUM_TOKENS, stop_ids)
    assert stop not in tokens[:MIN_TOKENS]


def _seeded(prompts: list[list[int]], seed: int) -> list[WorkRequest]:
    return [
        make_request(prompts[0], max_tokens=20, temperature=0.8, seed=seed, ignore_eos=True,
                     presence_penalty=0.3, frequency_penalty=0.2, logit_bias={5: 0.5}),
        make_request(prompts[2], max_tokens=16, temperature=1.0, seed=seed + 2, ignore_eos=True,
                     allowed_token_ids=tuple(sorted(set(prompts[2]))), logit_bias={prompts[2][1]: 1.0}),
        make_request(prompts[1], max_tokens=16, temperature=1.0, top_k=50, seed=seed + 1, ignore_eos=True,
                     repetition_penalty=1.3, min_p=0.1, min_tokens=6),
    ]


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_seeded_penalised_request_yields_the_same_tokens_alone_or_in_any_batch(model_dirs, prompts, name) -> None:
    method = METHODS[name]
    model_dir = model_dirs(method)
    requests = _seeded(prompts, seed=31)
    alone = [tokens_alone(make_engine(model_dir, method), r) for r in requests]
    copies = [make_request(list(r.prompt_token_ids), **r.sampling.model_dump()) for r in requests]
    others = [
        make_request(prompts[2], max_tokens=12, temperature=0.0, ignore_eos=True),
        make_request(prompts[3], max_tokens=9, temperature=0.9, seed=2, ignore_eos=True, frequency_penalty=1.0),
    ]
    arrivals = {0: [others[0], copies[1]], 1: [others[1], copies[0]], 2: [copies[2]]}
    steps = run(make_engine(model_dir, method, max_num_seqs=3), arrivals)
    assert [tokens_of(steps, r) for r in copies] == alone


def _pair_tokens(engine: Engine, prompt: list[int], first_seed: int, **sampling) -> list[tuple[int, int]]:
    """Output tokens 1 and 2 of NUM_SEEDS seeded requests: with one draft per step, token 2 is the bonus token
    scored by the row that counts the draft before it, whenever that draft was accepted."""
    requests = [
        make_request(prompt, max_tokens=4, temperature=CHI_SQUARE_TEMPERATURE, top_k=CHI_SQUARE_TOP_K,
                     seed=first_seed + i, ignore_eos=True, **sampling)
        for i in range(NUM_SEEDS)
    ]
    steps = run(engine, {0: requests})
    return [tuple(tokens_of(steps, r)[1:3]) for r in requests]


def test_rejection_with_penalties_keeps_the_penalised_target_distribution(tiny_model_dir, looping_prompt) -> None:  # noqa: F811
    def engine(method: str) -> Engine:
        return make_engine(
            tiny_model_dir, METHODS[method], num_speculative_tokens=1, max_num_seqs=NUM_SEEDS,
            max_model_len=DISTRIBUTION_MAX_MODEL_LEN, **({"min_ngram_size": 1} if method == "ngram" else {}),
        )

    penalty = dict(presence_penalty=CHI_SQUARE_PRESENCE)
    plain = _pair_tokens(engine("naive"), looping_prompt, 0, **penalty)
    speculative_engine = engine("ngram")
    speculative = _pair_tokens(speculative_engine, looping_prompt, NUM_SEEDS, **penalty)
    stats = speculative_engine.stats
    # Non-vacuous: many bonus tokens follow an accepted draft, and many drafts are rejected.
    assert NUM_SEEDS / 10 < stats.num_accepted_tokens < stats.num_draft_tokens - NUM_SEEDS / 10
    statistic, dof = chi_square_homogeneity(plain, speculative)
    assert dof >= 3 and statistic < chi_square_critical(dof), (statistic, dof)

    # The same check tells the penalised distribution from the raw one.
    unpenalised = _pair_tokens(engine("naive"), looping_prompt, 2 * NUM_SEEDS)
    statistic, dof = chi_square_homogeneity(plain, unpenalised)
    assert statistic > chi_square_critical(dof), (statistic, dof)


def _sequence(prompt: list[int], output: list[int], stop_ids: frozenset[int] = frozenset(), **sampling) -> Sequence:
    return Sequence(uuid.uuid4().hex, prompt, SamplingParams(max_tokens=64, **sampling), 0, stop_ids, output_ids=output)


def test_each_row_counts_the_drafts_before_it() -> None:
    """LogitPenalties over [B * width, V] rows equals the reference applied to each row's own history: row j of a
    sequence has its output plus drafts 0..j-1 generated (rows past its drafts: all of them)."""
    vocab, width = 32, 4
    generator = torch.Generator().manual_seed(5)
    seqs = [
        _sequence([1, 2, 3], [4, 4, 9], presence_penalty=0.7, frequency_penalty=-0.3, repetition_penalty=1.4),
        _sequence([5], [], ignore_eos=True),  # asks for nothing: its rows stay raw
        _sequence([6, 7], [7], frozenset({0, 2}), min_tokens=3, logit_bias={3: 2.5, 0: 50.0}, frequency_penalty=0.5),
        # A bias on a token outside the allowed ones leaves it out; min_tokens masks an allowed stop token.
        _sequence([8], [3], frozenset({2}), min_tokens=2, allowed_token_ids=(2, 3, 9), logit_bias={4: 50.0, 9: 1.0}),
        # Bad words ending in the output, in the drafts, across both, longer than the history so far.
        _sequence([1], [4, 6], bad_words_token_ids=((11,), (6, 12), (6, 7, 13), (7, 8, 14), (1, 2, 3, 4, 15))),
    ]
    drafts = [[9, 9, 2], [1, 2, 3], [2, 5], [9, 2], [7, 8, 6]]
    logits = torch.randn(len(seqs) * width, vocab, generator=generator)  # [B * width, V]
    got = apply_penalties(logits, LogitPenalties.build(seqs, drafts, width, vocab, logits.device))
    for b, seq in enumerate(seqs):
        for j in range(width):
            row = logits[b * width + j]
            if not seq.sampling.adjusts_logits:
                assert torch.equal(got[b * width + j], row)
                continue
            history = seq.output_ids + drafts[b][:j]
            sampling = seq.sampling.model_dump()
            expected = penalised_logits(row, seq.prompt_ids, history, sampling, set(seq.stop_ids))
            assert torch.allclose(got[b * width + j], expected), (b, j)
    # min_tokens 3 with one token of output: rows 0 and 1 are below it, row 2 (after both drafts) is not.
    assert got[2 * width + 1, 0] == MASKED and got[2 * width + 2, 0] > MASKED
    assert (got[3 * width : 4 * width].isfinite().sum(dim=1) == torch.tensor([2, 3, 3, 3])).all()  # stop 2 at row 0
    banned = [set(torch.nonzero(got[4 * width + j] == MASKED).flatten().tolist()) for j in range(width)]
    assert banned == [{11, 12}, {11, 13}, {11, 14}, {11, 12}]
    assert apply_penalties(logits, LogitPenalties.build([seqs[1]], None, 1, vocab, logits.device)) is logits


def test_a_bad_word_gives_way_where_it_would_leave_no_token() -> None:
    """allowed 7 and 9, 9 a stop token that min_tokens holds back, and the bad word "7 7": after a 7 nothing would be
    left, so the word gives way there (a row without a token would emit token 0, allowed or not)."""
    vocab, width = 16, 3
    seq = _sequence([1], [7], frozenset({9}), min_tokens=4, allowed_token_ids=(7, 9), bad_words_token_ids=((7, 7),))
    logits = torch.randn(width, vocab, generator=torch.Generator().manual_seed(2))
    got = apply_penalties(logits, LogitPenalties.build([seq], [[9, 7]], width, vocab, logits.device))
    finite = [torch.nonzero(row > MASKED).flatten().tolist() for row in got]
    assert finite == [[7], [7], [7]]  # row 2 follows the draft 7: the word gives way again

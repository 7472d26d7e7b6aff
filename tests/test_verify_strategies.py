"""Verification strategies beyond the rejection rule: target_match (lossless, identical to plain decoding),
greedy and topp (lossy), and the packed output offsets every strategy returns."""

from __future__ import annotations

import random

import pytest
import torch

from services.worker.sampling.random import Purpose
from services.worker.sampling.rejection import PAD_TOKEN, VerifyInput, verify
from services.worker.sampling.sample import sample
from tests.test_rejection import ACCEPT_P_VALUE, P, Q, _chi2_p_value, _inputs

VOCAB = 11
TOY_CONTEXT = 2  # the toy target's distribution depends on this many last tokens


def _toy_target(context: list[int], greedy: bool) -> torch.Tensor:
    """A fixed, peaked distribution per last-two-token context: a stand-in for a model (one-hot when greedy)."""
    generator = torch.Generator().manual_seed(hash(tuple(context[-TOY_CONTEXT:])) % (1 << 31))
    probs = torch.softmax(3 * torch.randn(VOCAB, generator=generator, dtype=torch.float64), dim=0)
    return torch.nn.functional.one_hot(probs.argmax(), VOCAB).double() if greedy else probs


def _naive(prompt: list[int], seed: int, greedy: bool, length: int) -> list[int]:
    tokens = list(prompt)
    for position in range(length):
        probs = _toy_target(tokens, greedy).unsqueeze(0)
        tokens.append(int(sample(probs, torch.tensor([seed]), torch.tensor([position]))))
    return tokens[len(prompt) :]


def _speculative(prompt: list[int], seed: int, greedy: bool, length: int, drafter: random.Random) -> list[int]:
    """target_match steps with drafts that are right or wrong at random and a random number of them per step."""
    reference = _naive(prompt, seed, greedy, length + 8)
    output: list[int] = []
    while len(output) < length:
        k = drafter.randint(0, 4)
        drafts = [t if drafter.random() < 0.7 else drafter.randrange(VOCAB) for t in reference[len(output) :][:k]]
        context = prompt + output
        target = torch.stack([_toy_target(context + drafts[:j], greedy) for j in range(k + 1)]).unsqueeze(0)
        out = verify(
            VerifyInput(
                target_probs=target,
                draft_tokens=torch.tensor([drafts], dtype=torch.int64).reshape(1, k),
                num_drafts=torch.tensor([k]),
                draft_probs=None,
                greedy=torch.tensor([greedy]),
                seeds=torch.tensor([seed]),
                positions=torch.tensor([len(output)]),
            ),
            verify_strategy="target_match",
        )
        output += out.output_tokens[0, : int(out.num_emitted[0])].tolist()
    return output[:length]


@pytest.mark.parametrize("greedy", [False, True])
def test_target_match_emits_exactly_what_plain_decoding_emits(greedy: bool) -> None:
    drafter = random.Random(7)
    for seed in range(6):
        prompt = [seed % VOCAB, 3]
        assert _speculative(prompt, seed, greedy, 24, drafter) == _naive(prompt, seed, greedy, 24), seed


def test_target_match_is_lossless_at_every_position() -> None:
    p_rows = [P, P.flip(0), torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)]
    out = verify(_inputs(p_rows, [Q, Q]), verify_strategy="target_match")
    for position, p in enumerate(p_rows):
        reached = out.num_accepted >= position
        counts = torch.bincount(out.output_tokens[reached, position], minlength=5)
        assert int(counts.sum()) > 500  # position 2 needs two matches in a row (about 4% of the trials)
        assert _chi2_p_value(counts, p) > ACCEPT_P_VALUE, position
    # A draft from q matches the target's own sample with probability sum_x p(x) q(x).
    expected_acceptance = float((P * Q).sum())
    assert abs(float((out.num_accepted >= 1).double().mean()) - expected_acceptance) < 0.02


def _sampled_rows(rows: list[torch.Tensor], drafts: list[list[int]], top_p: float = 1.0) -> VerifyInput:
    batch, num_slots = len(drafts), len(drafts[0])
    return VerifyInput(
        target_probs=torch.stack(rows).unsqueeze(0).expand(batch, -1, -1).contiguous(),
        draft_tokens=torch.tensor(drafts, dtype=torch.int64),
        num_drafts=torch.tensor([sum(t != PAD_TOKEN for t in d) for d in drafts]),
        draft_probs=None,
        greedy=torch.zeros(batch, dtype=torch.bool),
        seeds=torch.arange(batch, dtype=torch.int64) + 40,
        positions=torch.full((batch,), 5, dtype=torch.int64),
        top_p=torch.full((batch,), top_p),
    )


def test_greedy_strategy_accepts_argmax_drafts_of_sampled_rows_then_samples() -> None:
    # argmax of P is 0, of P.flip(0) is 4.
    inp = _sampled_rows([P, P.flip(0), P], [[0, 4], [0, 3], [1, 4], [0, PAD_TOKEN]])
    out = verify(inp, verify_strategy="greedy")
    assert out.num_accepted.tolist() == [2, 1, 0, 1]
    for b, accepted in enumerate(out.num_accepted.tolist()):
        after = inp.target_probs[b, accepted].unsqueeze(0)
        expected = sample(after, inp.seeds[b : b + 1], inp.positions[b : b + 1] + accepted, Purpose.SAMPLE)
        assert int(out.output_tokens[b, accepted]) == int(expected), b


def test_greedy_strategy_is_deterministic_acceptance() -> None:
    out = verify(_inputs([P, P], None, trials=2_000), verify_strategy="greedy")  # every draft is token 0 = argmax
    assert bool((out.num_accepted == 1).all())


def test_topp_accepts_drafts_inside_the_nucleus() -> None:
    # P = (0.40, 0.25, 0.20, 0.10, 0.05): with top_p 0.6 the nucleus is {0, 1} (mass above token 2 is 0.65).
    inp = _sampled_rows([P, P, P], [[1, 0], [2, 0], [0, 4], [4, 4]], top_p=0.6)
    assert verify(inp, verify_strategy="topp").num_accepted.tolist() == [2, 0, 1, 0]
    inp.top_p[:] = 1.0  # the whole support
    assert verify(inp, verify_strategy="topp").num_accepted.tolist() == [2, 2, 2, 2]


def test_topp_keeps_tokens_tied_at_the_boundary() -> None:
    flat = torch.tensor([0.3, 0.3, 0.3, 0.1], dtype=torch.float64)
    inp = _sampled_rows([flat, flat], [[2], [3]], top_p=0.5)
    assert verify(inp, verify_strategy="topp").num_accepted.tolist() == [1, 0]


def test_topp_needs_top_p_and_unknown_strategies_are_refused() -> None:
    inp = _sampled_rows([P, P], [[0]])
    inp.top_p = None
    with pytest.raises(ValueError, match="top_p"):
        verify(inp, verify_strategy="topp")
    with pytest.raises(ValueError, match="verify_strategy"):
        verify(inp, verify_strategy="typical")


@pytest.mark.parametrize("strategy", ["rejection", "target_match", "greedy", "topp"])
def test_greedy_rows_take_argmax_under_every_strategy(strategy: str) -> None:
    inp = _sampled_rows([P, P.flip(0), P], [[0, 4], [0, 1], [3, 4]], top_p=0.9)
    inp.greedy[:] = True
    out = verify(inp, verify_strategy=strategy)
    assert out.output_tokens.tolist() == [[0, 4, 0], [0, 4, PAD_TOKEN], [0, PAD_TOKEN, PAD_TOKEN]]


@pytest.mark.parametrize("strategy", ["rejection", "target_match", "greedy", "topp"])
def test_offsets_pack_the_emitted_tokens(strategy: str) -> None:
    inp = _inputs([P, P, P], [Q, Q], trials=64)
    inp.num_drafts[::3] = 0
    inp.top_p = torch.full((64,), 0.7)
    out = verify(inp, verify_strategy=strategy)
    assert torch.equal(out.num_emitted, out.num_accepted + 1)
    assert out.offsets.tolist() == [sum(out.num_emitted[:b].tolist()) for b in range(64)]

"""The frame-logprobs kernel, run by Triton's interpreter on CPU tensors, against its torch twin: the same ids and
ranks, logprobs within 1e-5."""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import pytest
import torch

pytest.importorskip("triton")

from kernels.logprobs import BLOCK, token_logprobs_launch  # noqa: E402
from services.worker.sampling.logprobs import token_logprobs, token_logprobs_torch  # noqa: E402

LOGPROB_TOLERANCE = 1e-5
# The log of a float32 sum of 152k exponentials, summed in another order: measured 1.7e-5 off the twin here.
LARGE_VOCAB_TOLERANCE = 5e-5
QWEN_VOCAB = 151936


def _assert_same(
    logits: torch.Tensor, chosen: torch.Tensor, top_k: int, tolerance: float = LOGPROB_TOLERANCE
) -> None:
    ids, logprobs, ranks = token_logprobs_launch(logits, chosen, top_k)
    want_ids, want_logprobs, want_ranks = token_logprobs_torch(logits, chosen, top_k)
    assert torch.equal(ids, want_ids)
    assert torch.equal(ranks, want_ranks)
    assert torch.allclose(logprobs, want_logprobs, atol=tolerance, rtol=0.0)


@pytest.mark.parametrize(("vocab", "top_k"), [(97, 0), (97, 20), (1000, 1), (4099, 5)])
def test_kernel_matches_twin(vocab: int, top_k: int) -> None:
    generator = torch.Generator().manual_seed(vocab + top_k)
    logits = 4 * torch.randn(5, vocab, generator=generator)
    logits[0, 10:20] = float("-inf")  # masked vocabulary entries
    chosen = torch.randint(0, vocab, (5,), generator=generator)
    chosen[1] = logits[1].argmax()  # rank 1
    chosen[2] = logits[2].argmin()  # rank V
    _assert_same(logits, chosen, top_k)


def test_a_qwen_sized_vocabulary_with_a_masked_first_block() -> None:
    """Qwen2.5's 151,936 ids (148 full blocks and a partial one): ids above 2^16 and the masked tail. The second row's
    first blocks are all -inf, which once made the online sum -inf - -inf = NaN. Two rows and top-2 keep the
    interpreter's run to about a second."""
    generator = torch.Generator().manual_seed(152)
    logits = 4 * torch.randn(2, QWEN_VOCAB, generator=generator)
    logits[1, : 2 * BLOCK] = float("-inf")
    chosen = torch.tensor([5, QWEN_VOCAB - 1])
    _assert_same(logits, chosen, 2, LARGE_VOCAB_TOLERANCE)


def test_half_precision_logits_and_an_empty_batch() -> None:
    # bfloat16 logits tie often: ranks and logprobs are equal, top-K ids may differ only inside a tie group.
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    chosen = torch.tensor([0, 500, 999])
    ids, logprobs, ranks = token_logprobs_launch(logits, chosen, 4)
    want_ids, want_logprobs, want_ranks = token_logprobs_torch(logits, chosen, 4)
    assert torch.equal(ranks, want_ranks)
    assert torch.allclose(logprobs, want_logprobs, atol=LOGPROB_TOLERANCE, rtol=0.0)
    assert torch.equal(logits.gather(1, ids.long()), logits.gather(1, want_ids.long()))
    ids, logprobs, ranks = token_logprobs_launch(torch.empty(0, 50), torch.empty(0, dtype=torch.int64), 3)
    assert ids.shape == (0, 4) and logprobs.shape == (0, 4) and ranks.shape == (0,)


def test_ties_rank_the_group_first_and_list_lowest_id_first() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.5]])
    ids, logprobs, ranks = token_logprobs_launch(logits, torch.tensor([4]), 4)
    assert ids.tolist() == [[4, 1, 3, 4, 2]]  # the kernel's documented order inside a tie group
    assert ranks.tolist() == [1] and int(token_logprobs_torch(logits, torch.tensor([4]), 4)[2]) == 1
    assert torch.allclose(logprobs[0, :4], logprobs[0, 0].expand(4))


def test_dispatcher_runs_the_twin_on_cpu_and_launcher_checks_shapes() -> None:
    logits = torch.randn(2, 30)
    chosen = torch.tensor([1, 2])
    for got, want in zip(token_logprobs(logits, chosen, 3), token_logprobs_torch(logits, chosen, 3)):
        assert torch.equal(got, want)
    with pytest.raises(AssertionError, match="chosen"):
        token_logprobs_launch(logits, chosen[:1], 3)
    with pytest.raises(AssertionError, match="top_k"):
        token_logprobs_launch(logits, chosen, 31)

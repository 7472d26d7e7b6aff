"""The frame-logprobs kernels, run by Triton's interpreter on CPU tensors, against their torch twin: the same ids
and ranks, logprobs within 1e-5. Small `chunk`s cut small vocabularies into many chunks, so the per-chunk
candidates and the merge are exercised without the interpreter walking a large row."""

from __future__ import annotations

from tests.kernelfixture import single_thread  # noqa: F401  (first: it puts triton in interpreter mode)

import pytest
import torch

pytest.importorskip("triton")

from kernels.logprobs import CHUNK, token_logprobs_launch  # noqa: E402
from services.worker.sampling.logprobs import token_logprobs, token_logprobs_torch  # noqa: E402

LOGPROB_TOLERANCE = 1e-5
# The log of a float32 sum of 152k exponentials, summed in another order: measured 1.7e-5 off the twin here.
LARGE_VOCAB_TOLERANCE = 5e-5
QWEN_VOCAB = 151936
API_TOP_K = 20  # the largest top_logprobs the API accepts


def _assert_same(
    logits: torch.Tensor, chosen: torch.Tensor, top_k: int, chunk: int = CHUNK, tolerance: float = LOGPROB_TOLERANCE
) -> None:
    ids, logprobs, ranks = token_logprobs_launch(logits, chosen, top_k, chunk)
    want_ids, want_logprobs, want_ranks = token_logprobs_torch(logits, chosen, top_k)
    assert torch.equal(ids, want_ids)
    assert torch.equal(ranks, want_ranks)
    assert torch.allclose(logprobs, want_logprobs, atol=tolerance, rtol=0.0, equal_nan=True)


def _lowest_id_first(logits: torch.Tensor, chosen: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ids the kernel must give when logits tie: the chosen one, then the top-K by (logit desc, id asc)."""
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    return torch.cat([chosen.unsqueeze(1), order], dim=1).to(torch.int32)


@pytest.mark.parametrize(
    ("vocab", "top_k", "chunk"),
    [(97, 0, CHUNK), (97, 1, CHUNK), (97, 20, CHUNK), (97, 20, 16), (97, 97, 32), (1000, 1, 64), (1000, 20, 64),
     (4099, 5, CHUNK), (4099, 20, 512)],
)  # fmt: skip
def test_kernel_matches_twin(vocab: int, top_k: int, chunk: int) -> None:
    """One chunk or many, top_k above a chunk's size (97, 20, 16) and up to the whole vocabulary."""
    generator = torch.Generator().manual_seed(vocab + top_k + chunk)
    logits = 4 * torch.randn(5, vocab, generator=generator)
    if top_k < vocab:
        # Masked vocabulary entries (a top-K of the whole row would hold them as a tie group, in torch.topk's order
        # in the twin: test_minus_infinity_and_nan_rows covers that).
        logits[0, 10:20] = float("-inf")
    chosen = torch.randint(0, vocab, (5,), generator=generator)
    chosen[1] = logits[1].argmax()  # rank 1
    chosen[2] = logits[2].argmin()  # rank V
    _assert_same(logits, chosen, top_k, chunk)


@pytest.mark.parametrize("chunk", [8, 64, CHUNK])
def test_exact_ties_across_chunks_list_lowest_id_first(chunk: int) -> None:
    """Logits of three values: every top-K entry sits in a tie group spread over many chunks (or one)."""
    generator = torch.Generator().manual_seed(chunk)
    logits = torch.randint(0, 3, (3, 200), generator=generator).float()
    logits[2, 150:] = 5.0  # the whole top-20 is one tie group in the last chunks
    chosen = torch.tensor([0, 101, 199])
    ids, logprobs, ranks = token_logprobs_launch(logits, chosen, API_TOP_K, chunk)
    _, want_logprobs, want_ranks = token_logprobs_torch(logits, chosen, API_TOP_K)
    assert torch.equal(ids, _lowest_id_first(logits, chosen, API_TOP_K))
    assert torch.equal(ranks, want_ranks)
    assert torch.allclose(logprobs, want_logprobs, atol=LOGPROB_TOLERANCE, rtol=0.0)


# The interpreter computes -inf - -inf and log(0) in numpy, which warns: those are the NaN and -inf expected here.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_minus_infinity_and_nan_rows() -> None:
    """Rows that are all -inf (NaN logprobs, as log_softmax gives), -inf but for one logit in the last chunk, with
    -inf ties inside the top-K, and with a NaN (which orders first and makes the row's logprobs NaN)."""
    generator = torch.Generator().manual_seed(4)
    logits = 4 * torch.randn(4, 100, generator=generator)
    logits[0] = float("-inf")
    logits[1, :99] = float("-inf")
    logits[2, :90] = float("-inf")  # top-20 = the 10 finite logits, then the first ten -inf ids
    logits[3, 42] = float("nan")
    chosen = torch.tensor([3, 99, 5, 42])
    for chunk in (16, CHUNK):
        for top_k in (0, 1, API_TOP_K):
            ids, logprobs, ranks = token_logprobs_launch(logits, chosen, top_k, chunk)
            _, want_logprobs, want_ranks = token_logprobs_torch(logits, chosen, top_k)
            assert torch.equal(ids, _lowest_id_first(logits, chosen, top_k))
            assert torch.equal(ranks, want_ranks)
            assert torch.allclose(logprobs, want_logprobs, atol=LOGPROB_TOLERANCE, rtol=0.0, equal_nan=True)
            assert logprobs[0].isnan().all() and logprobs[3].isnan().all()


def test_a_qwen_sized_vocabulary_with_a_masked_first_chunk() -> None:
    """Qwen2.5's 151,936 ids (74 full chunks and a partial one): ids above 2^16 and the masked tail. The second
    row's first chunks are all -inf, which once made the online sum -inf - -inf = NaN. Two rows keep the
    interpreter's run to a few seconds."""
    generator = torch.Generator().manual_seed(152)
    logits = 4 * torch.randn(2, QWEN_VOCAB, generator=generator)
    logits[1, : 2 * CHUNK] = float("-inf")
    chosen = torch.tensor([5, QWEN_VOCAB - 1])
    _assert_same(logits, chosen, API_TOP_K, tolerance=LARGE_VOCAB_TOLERANCE)


def test_half_precision_logits_and_an_empty_batch() -> None:
    # bfloat16 logits tie often: the ids are the lowest-id-first order, ranks and logprobs the twin's.
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    chosen = torch.tensor([0, 500, 999])
    ids, logprobs, ranks = token_logprobs_launch(logits, chosen, 4, 64)
    _, want_logprobs, want_ranks = token_logprobs_torch(logits, chosen, 4)
    assert torch.equal(ranks, want_ranks)
    assert torch.allclose(logprobs, want_logprobs, atol=LOGPROB_TOLERANCE, rtol=0.0)
    assert torch.equal(ids, _lowest_id_first(logits, chosen, 4))
    ids, logprobs, ranks = token_logprobs_launch(torch.empty(0, 50), torch.empty(0, dtype=torch.int64), 3)
    assert ids.shape == (0, 4) and logprobs.shape == (0, 4) and ranks.shape == (0,)


def test_ties_rank_the_group_first_and_list_lowest_id_first() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.5]])
    for chunk in (2, CHUNK):
        ids, logprobs, ranks = token_logprobs_launch(logits, torch.tensor([4]), 4, chunk)
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
    with pytest.raises(AssertionError, match="power of two"):
        token_logprobs_launch(logits, chosen, 3, 24)

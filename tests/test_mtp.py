"""MTP drafting on a tiny Llama with a fitted MTP module: greedy output equals transformers' generate, the
drafter's cache after each step equals a from-scratch MTP computation, seeded sampling does not depend on the
batch, draft logprobs are the module's distribution, the three weight layouts draft alike, and a checkpoint
without MTP modules is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.engine.engine import Engine, SeqOutput
from services.worker.publisher import step_frames
from services.worker.engine.sequence import Sequence
from shared.frames import FrameKind, decode
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, Method, greedy_reference, make_engine, make_request, mtp_model_dir, mtp_model_dirs, outputs_of,
    prompts, reference_model, run, single_thread, tiny_model_dir, tokens_alone, tokens_of,
)
from tests.mtpfixture import LAYOUTS

pytest.importorskip("transformers")

LOGIT_TOLERANCE = 1e-4
WORKER_ID = 5
# (num_speculative_tokens, num_model_steps, mtp_strategy)
CONFIGS = [(1, 1, "default"), (2, 1, "default"), (2, 2, "default"), (3, 1, "default"), (3, 3, "default"),
           (3, 1, "with_ngram"), (3, 2, "with_ngram")]


def _mtp(k: int = 3, num_steps: int = 1, strategy: str = "default", **options) -> Method:
    """MTP drafting k tokens, num_steps of them by the module feeding itself (strategy "with_ngram": the rest by
    n-gram lookup)."""
    return Method(
        f"mtp-{k}-{num_steps}-{strategy}", "mtp", k, dict(num_model_steps=num_steps, mtp_strategy=strategy, **options)
    )


@pytest.mark.parametrize("k,num_steps,strategy", CONFIGS)
def test_greedy_alone_matches_transformers(mtp_model_dir, prompts, greedy_reference, k, num_steps, strategy) -> None:
    engine = make_engine(mtp_model_dir, _mtp(k, num_steps, strategy))
    request = make_request(prompts[0], max_tokens=40, **GREEDY)
    steps = run(engine, {0: [request]})
    assert tokens_of(steps, request) == greedy_reference(prompts[0], 40)
    drafted = [len(o.draft_tokens) for o in outputs_of(steps, request)[1:]]
    assert max(drafted) == k if strategy == "with_ngram" else all(1 <= n <= num_steps for n in drafted)
    assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("k,num_steps,strategy", [(2, 1, "default"), (3, 3, "default"), (3, 2, "with_ngram")])
def test_mixed_batch_greedy_matches_transformers_and_sampling_matches_alone(
    mtp_model_dir, prompts, greedy_reference, k, num_steps, strategy
) -> None:
    greedy = [
        make_request(prompts[0], max_tokens=30, **GREEDY),
        make_request(prompts[2], max_tokens=20, logprobs=2, **GREEDY),
        make_request(prompts[1], max_tokens=25, **GREEDY),
    ]
    sampled = [
        make_request(prompts[3], max_tokens=20, temperature=0.8, seed=7, ignore_eos=True),
        make_request(prompts[1], max_tokens=16, temperature=1.0, top_k=40, top_p=0.9, seed=3, ignore_eos=True),
    ]
    engine = make_engine(mtp_model_dir, _mtp(k, num_steps, strategy))
    steps = run(engine, {0: [greedy[0], sampled[0], greedy[1]], 3: [sampled[1], greedy[2]]})
    for request in greedy:
        expected = greedy_reference(list(request.prompt_token_ids), request.sampling.max_tokens)
        assert tokens_of(steps, request) == expected
    for request in sampled:
        alone = make_engine(mtp_model_dir, _mtp(k, num_steps, strategy))
        assert tokens_of(steps, request) == tokens_alone(alone, request)
    assert engine.stats.num_accepted_tokens > 0


def _scratch_drafts(engine: Engine, seq: Sequence, num_drafts: int) -> tuple[list[int], torch.Tensor]:
    """Greedy MTP drafts and the first draft's logits computed without any cache, over the whole sequence."""
    model = engine.runner.model
    ids = torch.tensor([seq.token_ids])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        prev = model(ids, positions)[:, :-1]  # h_{p-1} for the MTP entries at p = 1..N-1
        tokens, first_logits = ids[:, 1:], None
        drafts: list[int] = []
        for _ in range(num_drafts):
            out = model.mtp_forward(0, prev, tokens, torch.arange(1, tokens.shape[1] + 1)[None])
            logits = model.mtp_logits(0, out[:, -1])
            first_logits = logits[0] if first_logits is None else first_logits
            drafts.append(int(logits.argmax()))
            prev = torch.cat([prev, out[:, -1:]], dim=1)  # the module's own hidden state feeds the next step
            tokens = torch.cat([tokens, torch.tensor([[drafts[-1]]])], dim=1)
    return drafts, first_logits


class DraftsEveryThirdStep(Engine):
    """Drafts on one step in three, as adaptive speculation may decide: the MTP cache lags in between."""

    def _draft_budget(self, seq: Sequence, next_step: bool = False) -> int:
        step = self.step_no + int(next_step)
        return super()._draft_budget(seq, next_step) if step % 3 == 0 else 0


@pytest.mark.parametrize("lagging", [False, True], ids=["every-step", "lagging"])
@pytest.mark.parametrize("num_steps", [1, 3])
def test_drafts_after_each_step_equal_a_from_scratch_mtp_computation(
    mtp_model_dir, prompts, num_steps, lagging
) -> None:
    """The drafter's cache after prefill and after every verify (accepted, rejected, ragged batch) holds what a
    cache-free pass over the whole sequence computes: this is what catches bookkeeping errors. When drafting
    skips steps, the cache catches up late and must hold the same. In float32: int8 drafting rounds its
    activations to bfloat16, whose last bit may differ between a one-row and a many-row product."""
    engine = make_engine(mtp_model_dir, _mtp(3, num_steps, draft_quantization="none"))
    if lagging:
        engine = DraftsEveryThirdStep(engine.config)
    requests = [make_request(prompts[i], max_tokens=24, **GREEDY) for i in (0, 2, 3)]
    checked = 0

    def check(outputs: list[SeqOutput]) -> None:
        nonlocal checked
        for out in outputs:
            seq = out.seq
            if seq.is_finished:
                continue
            pending = engine.mtp.pending(seq, engine._draft_budget(seq, next_step=True))
            if not pending.tokens:  # one token left to emit: nothing to draft
                continue
            expected, first_logits = _scratch_drafts(engine, seq, len(pending.tokens))
            assert pending.tokens == expected
            assert torch.allclose(pending.report_logits[0], first_logits, atol=LOGIT_TOLERANCE)
            checked += 1

    run(engine, {0: requests[:2], 2: requests[2:]}, on_step=check)
    assert checked > (6 if lagging else 20)
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens  # both outcomes were exercised


def test_draft_logprobs_are_the_mtp_distribution_and_join_their_target_record(mtp_model_dir, prompts) -> None:
    top_k = 4
    sampled = make_request(prompts[0], max_tokens=30, temperature=0.9, seed=12, logprobs=top_k,
                       include_draft_logprobs=True, ignore_eos=True)
    greedy = make_request(prompts[3], max_tokens=30, logprobs=top_k, include_draft_logprobs=True, **GREEDY)
    engine = make_engine(mtp_model_dir, _mtp(3, 2, "with_ngram"))
    joined: dict[str, int] = {}

    def publish(outputs: list[SeqOutput]) -> None:
        frames = [decode(raw) for raw in step_frames(outputs, WORKER_ID, engine.step_no)]
        records = {(f.kind, rid): (rec, ids, lps) for f in frames for rid, rec, ids, lps, _ in f.rows()}
        for out in outputs:
            if out.draft is None:
                continue
            rec, ids, logprobs = records[FrameKind.DRAFT, out.seq.request_id]
            target = records[FrameKind.TARGET, out.seq.request_id][0]
            assert int(rec["offset"]) == int(target["offset"]) and int(rec["num_accepted"]) == out.num_accepted
            assert ids[:, 0].tolist() == out.draft_tokens
            assert np.array_equal(logprobs, out.draft.logprobs)
            joined[out.seq.request_id] = joined.get(out.seq.request_id, 0) + 1

    steps = run(engine, {0: [sampled, greedy]}, on_step=publish)
    assert joined.get(sampled.request_id) and joined.get(greedy.request_id)
    for request in (sampled, greedy):
        for out in outputs_of(steps, request):
            if out.draft is None:
                continue
            modelled = min(2, len(out.draft_tokens))  # num_model_steps; n-gram fills the rest
            lps, ids, ranks = out.draft.logprobs, out.draft.token_ids, out.draft.ranks
            assert (lps[:modelled, 0] < 0).all() and (ranks >= 1).all()
            assert (np.diff(lps[:modelled, 1:], axis=1) <= 0).all()
            assert (np.exp(lps[:modelled, 1:]).sum(axis=1) <= 1 + 1e-5).all()  # top-K of a distribution
            assert (lps[modelled:, 0] == 0.0).all()  # n-gram drafts are point masses
            if request is greedy:  # the raw module distribution, whose argmax the greedy draft is
                assert (ranks[:modelled] == 1).all() and (ids[:modelled, 0] == ids[:modelled, 1]).all()


def test_layouts_load_to_identical_drafts(mtp_model_dirs, prompts) -> None:  # noqa: F811
    drafts = {}
    for layout in LAYOUTS:
        request = make_request(prompts[2], max_tokens=24, **GREEDY)
        steps = run(make_engine(mtp_model_dirs[layout], _mtp(3, 2)), {0: [request]})
        drafts[layout] = [o.draft_tokens for o in outputs_of(steps, request)]
    assert any(drafts["specmesh"]) and drafts["deepseek"] == drafts["specmesh"] == drafts["mimo"]


def test_reject_all_reproduces_plain_decoding_for_sampled_requests(mtp_model_dir, prompts) -> None:
    """Whatever q the drafts came from, rejecting them all leaves each emitted token as plain decoding draws it."""
    request = make_request(prompts[1], max_tokens=24, temperature=0.7, seed=4, ignore_eos=True)
    plain = tokens_alone(make_engine(mtp_model_dir, METHODS["naive"]), request)
    engine = make_engine(mtp_model_dir, _mtp(3, 3), accept_policy="reject_all")
    assert tokens_alone(engine, request) == plain and engine.stats.num_draft_tokens > 0


def test_mtp_on_a_checkpoint_without_mtp_modules_is_refused(tiny_model_dir) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="needs a checkpoint with MTP modules"):
        make_engine(tiny_model_dir, _mtp())

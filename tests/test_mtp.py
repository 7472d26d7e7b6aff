"""MTP drafting on a tiny Llama with a fitted MTP module: greedy output equals transformers' generate, the
drafter's cache after each step equals a from-scratch MTP computation, seeded sampling does not depend on the
batch, draft logprobs are the module's distribution, the three weight layouts draft alike, and a checkpoint
without MTP modules is refused."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.engine import Engine, SeqOutput
from services.worker.publisher import step_frames
from services.worker.sequence import Sequence
from shared.config import EngineConfig, SpeculativeConfig
from shared.frames import FrameKind, decode
from shared.schemas import SamplingParams, WorkRequest
from shared.tokenizer import Tokenizer
from tests.modelfixture import tiny_model_dir  # noqa: F401  (fixtures are used by name)
from tests.mtpfixture import LAYOUTS, mtp_model_dirs  # noqa: F401

transformers = pytest.importorskip("transformers")

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
MAX_STEPS = 500
REFERENCE_TOKENS = 40
LOGIT_TOLERANCE = 1e-4
WORKER_ID = 5
PROMPT_TEXTS = (
    "def wrap(text, width=70):\n    return text",
    "import os\n",
    "class Template:\n    delimiter = '$'\n",
    "for i in range(10):\n    print(i, i * i)\n",
)
GREEDY = dict(temperature=0.0, ignore_eos=True)
# (num_speculative_tokens, num_model_steps, mtp_strategy)
CONFIGS = [(1, 1, "default"), (2, 1, "default"), (2, 2, "default"), (3, 1, "default"), (3, 3, "default"),
           (3, 1, "with_ngram"), (3, 2, "with_ngram")]
Steps = list[list[SeqOutput]]


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(mtp_model_dirs: dict[str, Path]) -> Path:  # noqa: F811
    return mtp_model_dirs["specmesh"]


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    tok = Tokenizer(model_dir)
    return [tok.encode(text) for text in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def greedy_reference(tiny_model_dir: Path) -> Callable[[list[int], int], list[int]]:  # noqa: F811
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    memo: dict[tuple[int, ...], list[int]] = {}

    def generate(prompt: list[int], num_tokens: int) -> list[int]:
        if tuple(prompt) not in memo:
            ids = torch.tensor([prompt])
            # An explicit mask: the prompt starts with the BOS token, which is also the pad id.
            with torch.no_grad():
                out = reference.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=REFERENCE_TOKENS,
                    eos_token_id=None, pad_token_id=0,
                )
            memo[tuple(prompt)] = out[0, len(prompt) :].tolist()
        return memo[tuple(prompt)][:num_tokens]

    return generate


def _engine(model_dir: Path, k: int = 3, steps: int = 1, strategy: str = "default", **spec) -> Engine:
    speculative = SpeculativeConfig(
        method="mtp", num_speculative_tokens=k, num_model_steps=steps, mtp_strategy=strategy, **spec
    )
    return Engine(EngineConfig(model=model_dir, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                               speculative=speculative))


def _request(prompt: list[int], **sampling) -> WorkRequest:
    return WorkRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=SamplingParams(**sampling),
                       created=0.0)


def _run(engine: Engine, arrivals: dict[int, list[WorkRequest]],
         on_step: Callable[[list[SeqOutput]], None] | None = None) -> Steps:
    steps: Steps = []
    pending = dict(arrivals)
    while pending or engine.has_work():
        assert len(steps) < MAX_STEPS, "the engine stopped making progress"
        for request in pending.pop(len(steps), []):
            engine.add_request(request)
        outputs = engine.step() if engine.has_work() else []
        if on_step is not None:
            on_step(outputs)
        steps.append(outputs)
    return steps


def _outputs(steps: Steps, request: WorkRequest) -> list[SeqOutput]:
    return [o for outputs in steps for o in outputs if o.seq.request_id == request.request_id]


def _tokens(steps: Steps, request: WorkRequest) -> list[int]:
    return [t for o in _outputs(steps, request) for t in o.tokens]


@pytest.mark.parametrize("k,num_steps,strategy", CONFIGS)
def test_greedy_alone_matches_transformers(model_dir, prompts, greedy_reference, k, num_steps, strategy) -> None:
    engine = _engine(model_dir, k, num_steps, strategy)
    request = _request(prompts[0], max_tokens=40, **GREEDY)
    steps = _run(engine, {0: [request]})
    assert _tokens(steps, request) == greedy_reference(prompts[0], 40)
    drafted = [len(o.draft_tokens) for o in _outputs(steps, request)[1:]]
    assert max(drafted) == k if strategy == "with_ngram" else all(1 <= n <= num_steps for n in drafted)
    assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("k,num_steps,strategy", [(2, 1, "default"), (3, 3, "default"), (3, 2, "with_ngram")])
def test_mixed_batch_greedy_matches_transformers_and_sampling_matches_alone(
    model_dir, prompts, greedy_reference, k, num_steps, strategy
) -> None:
    greedy = [_request(prompts[0], max_tokens=30, **GREEDY), _request(prompts[2], max_tokens=20, logprobs=2, **GREEDY),
              _request(prompts[1], max_tokens=25, **GREEDY)]
    sampled = [_request(prompts[3], max_tokens=20, temperature=0.8, seed=7, ignore_eos=True),
               _request(prompts[1], max_tokens=16, temperature=1.0, top_k=40, top_p=0.9, seed=3, ignore_eos=True)]
    engine = _engine(model_dir, k, num_steps, strategy)
    steps = _run(engine, {0: [greedy[0], sampled[0], greedy[1]], 3: [sampled[1], greedy[2]]})
    for request in greedy:
        assert _tokens(steps, request) == greedy_reference(list(request.prompt_token_ids), request.sampling.max_tokens)
    for request in sampled:
        alone = _engine(model_dir, k, num_steps, strategy)
        assert _tokens(steps, request) == _tokens(_run(alone, {0: [request]}), request)
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


@pytest.mark.parametrize("num_steps", [1, 3])
def test_drafts_after_each_step_equal_a_from_scratch_mtp_computation(model_dir, prompts, num_steps) -> None:
    """The drafter's cache after prefill and after every verify (accepted, rejected, ragged batch) holds what a
    cache-free pass over the whole sequence computes: this is what catches bookkeeping errors."""
    engine = _engine(model_dir, 3, num_steps)
    requests = [_request(prompts[i], max_tokens=24, **GREEDY) for i in (0, 2, 3)]
    checked = 0

    def check(outputs: list[SeqOutput]) -> None:
        nonlocal checked
        for out in outputs:
            seq = out.seq
            if seq.is_finished:
                continue
            pending = engine.mtp.pending(seq, engine._draft_budget(seq))
            if not pending.tokens:  # one token left to emit: nothing to draft
                continue
            expected, first_logits = _scratch_drafts(engine, seq, len(pending.tokens))
            assert pending.tokens == expected
            assert torch.allclose(pending.report_logits[0], first_logits, atol=LOGIT_TOLERANCE)
            checked += 1

    _run(engine, {0: requests[:2], 2: requests[2:]}, on_step=check)
    assert checked > 20
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens  # both outcomes were exercised


def test_draft_logprobs_are_the_mtp_distribution_and_join_their_target_record(model_dir, prompts) -> None:
    top_k = 4
    sampled = _request(prompts[0], max_tokens=30, temperature=0.9, seed=12, logprobs=top_k,
                       include_draft_logprobs=True, ignore_eos=True)
    greedy = _request(prompts[3], max_tokens=30, logprobs=top_k, include_draft_logprobs=True, **GREEDY)
    engine = _engine(model_dir, 3, 2, "with_ngram")
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

    steps = _run(engine, {0: [sampled, greedy]}, on_step=publish)
    assert joined.get(sampled.request_id) and joined.get(greedy.request_id)
    for request in (sampled, greedy):
        for out in _outputs(steps, request):
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
        request = _request(prompts[2], max_tokens=24, **GREEDY)
        steps = _run(_engine(mtp_model_dirs[layout], 3, 2), {0: [request]})
        drafts[layout] = [o.draft_tokens for o in _outputs(steps, request)]
    assert any(drafts["specmesh"]) and drafts["deepseek"] == drafts["specmesh"] == drafts["mimo"]


def test_reject_all_reproduces_plain_decoding_for_sampled_requests(model_dir, prompts) -> None:
    """Whatever q the drafts came from, rejecting them all leaves each emitted token as plain decoding draws it."""
    request = _request(prompts[1], max_tokens=24, temperature=0.7, seed=4, ignore_eos=True)
    plain = _tokens(_run(Engine(EngineConfig(model=model_dir, speculative=SpeculativeConfig(method="naive"))),
                         {0: [request]}), request)
    engine = _engine(model_dir, 3, 3, accept_policy="reject_all")
    assert _tokens(_run(engine, {0: [request]}), request) == plain and engine.stats.num_draft_tokens > 0


def test_mtp_on_a_checkpoint_without_mtp_modules_is_refused(tiny_model_dir) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="needs a checkpoint with MTP modules"):
        _engine(tiny_model_dir)

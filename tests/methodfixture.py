"""The engine tests' shared helpers: every drafting method on the tiny test checkpoints (the method table), an
engine builder, requests, a step loop and its outputs, and transformers' greedy continuation to compare with.

Methods that need no MTP module run on tests/modelfixture.py's tiny Llama (draft_model and eagle3 with the drafters
beside it); "mtp" and "mtp+with_ngram" run on tests/mtpfixture.py's copy of the same trunk with a fitted MTP module,
so one reference serves all of them.
Import the fixtures by name into a test module (`from tests.methodfixture import ...`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.engine.engine import Engine, SeqOutput
from shared.config import MODEL_DRAFTERS, EngineConfig, SpeculativeConfig
from shared.schemas import ChoiceProgress, SamplingParams, WorkRequest
from shared.tokenizer import Tokenizer
from tests.eagle3fixture import head_beside
from tests.modelfixture import tiny_model_dir  # noqa: F401  (fixtures are used by name)
from tests.mtpfixture import mtp_model_dirs  # noqa: F401
from tests.threadfixture import single_thread  # noqa: F401

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
MAX_STEPS = 500  # far more than any test needs: a scheduler that stalls fails instead of hanging
REFERENCE_TOKENS = 40  # the longest greedy continuation a test compares
SAMPLED_SEEDS = 600  # samples of a distribution a chi-square test compares
PROMPT_TEXTS = (
    "def wrap(text, width=70):\n    return text",
    "import os\n",
    "class Template:\n    delimiter = '$'\n",
    "for i in range(10):\n    print(i, i * i)\n",
)
GREEDY = dict(temperature=0.0, ignore_eos=True)
Steps = list[list[SeqOutput]]
OnStep = Callable[[list[SeqOutput]], None]


@dataclass(frozen=True)
class Method:
    """One drafting method as a test names it, with the speculative config keys that select it."""

    name: str
    method: str
    num_speculative_tokens: int
    options: dict = field(default_factory=dict)

    @property
    def needs_mtp(self) -> bool:
        return self.method == "mtp"

    @property
    def drafts(self) -> bool:
        return self.method != "naive"

    def config(self, **overrides) -> SpeculativeConfig:
        """The method's config, with a fixed number of drafts: these tests check what drafting does, which adaptive
        speculation (on by default for ngram and suffix) would thin by the step timings. Overrides replace any key,
        num_speculative_tokens (none under naive) and adaptive included. A model drafter's chains are not cut by
        confidence either."""
        keys = dict(
            method=self.method, num_speculative_tokens=self.num_speculative_tokens, adaptive=False, **self.options
        )
        if self.method in MODEL_DRAFTERS:
            keys["min_draft_confidence"] = 0.0
        keys |= overrides
        if not self.drafts:  # a test's drafts per step, for every method it runs, are none under naive
            keys["num_speculative_tokens"] = 0
        return SpeculativeConfig(**keys)


METHODS = {
    m.name: m
    for m in (
        Method("naive", "naive", 0),
        Method("ngram", "ngram", 3),
        Method("suffix", "suffix", 3),
        Method("mtp", "mtp", 2, dict(num_model_steps=2)),
        Method("mtp+with_ngram", "mtp", 3, dict(num_model_steps=1, mtp_strategy="with_ngram")),
        Method("draft_model", "draft_model", 3),  # the tiny model's draft beside it (modelfixture.py)
        Method("eagle3", "eagle3", 3),  # the tiny model's fitted EAGLE-3 head beside it (eagle3fixture.py)
    )
}
METHOD_NAMES = tuple(METHODS)
DRAFTING_METHOD_NAMES = tuple(name for name, m in METHODS.items() if m.drafts)


@pytest.fixture(scope="session")
def mtp_model_dir(mtp_model_dirs: dict[str, Path]) -> Path:  # noqa: F811
    """The specmesh-layout MTP checkpoint."""
    return mtp_model_dirs["specmesh"]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, mtp_model_dir: Path) -> Callable[[Method], Path]:  # noqa: F811
    """The checkpoint a method runs on (eagle3's head lies beside the tiny Llama)."""
    head_beside(tiny_model_dir)
    return lambda method: mtp_model_dir if method.needs_mtp else tiny_model_dir


def encode_prompts(model_dir: Path, texts: Sequence[str]) -> list[list[int]]:
    tok = Tokenizer(model_dir)
    return [tok.encode(text) for text in texts]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:  # noqa: F811
    """PROMPT_TEXTS as token ids (every test checkpoint shares the tiny Llama's tokenizer)."""
    return encode_prompts(tiny_model_dir, PROMPT_TEXTS)


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path):  # noqa: F811
    """transformers' own model of the tiny Llama (the trunk of the MTP checkpoints too)."""
    import transformers  # a dev dependency: test modules that use it importorskip it

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy_reference(reference_model) -> Callable[[list[int], int], list[int]]:
    """transformers' greedy continuation with EOS disabled, generated once per prompt (a greedy continuation
    of n tokens is the first n of a longer one)."""
    memo: dict[tuple[int, ...], list[int]] = {}

    def generate(prompt: list[int], num_tokens: int) -> list[int]:
        assert num_tokens <= REFERENCE_TOKENS
        if tuple(prompt) not in memo:
            ids = torch.tensor([prompt])
            # An explicit mask: the prompt starts with the BOS token, which is also the pad id transformers
            # would otherwise mask out.
            with torch.no_grad():
                out = reference_model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=REFERENCE_TOKENS,
                    eos_token_id=None, pad_token_id=0,
                )
            memo[tuple(prompt)] = out[0, len(prompt) :].tolist()
            assert len(memo[tuple(prompt)]) == REFERENCE_TOKENS
        return memo[tuple(prompt)][:num_tokens]

    return generate


def transformers_continuations(model_dir: Path, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt on the checkpoint in model_dir, EOS disabled."""
    import transformers  # a dev dependency: test modules that use it importorskip it

    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    continuations = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = reference.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=num_tokens,
                eos_token_id=None, pad_token_id=0,
            )
        continuations.append(out[0, len(prompt):].tolist())
    return continuations


def make_engine(model_dir: Path, method: Method, **overrides) -> Engine:
    """An engine running `method` with MAX_NUM_SEQS slots of MAX_MODEL_LEN; overrides replace EngineConfig keys
    (max_num_seqs, max_model_len, block_size, num_kv_blocks, ...) or the method's speculative config keys
    (num_speculative_tokens, verify_strategy, accept_policy, ...)."""
    engine_keys = {key: value for key, value in overrides.items() if key in EngineConfig.model_fields}
    speculative_keys = {key: value for key, value in overrides.items() if key not in engine_keys}
    engine_keys = dict(max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN) | engine_keys
    return Engine(EngineConfig(model=model_dir, speculative=method.config(**speculative_keys), **engine_keys))


def make_request(prompt: list[int], output_token_ids: Sequence[int] = (), **sampling) -> WorkRequest:
    """A request under a fresh id; output_token_ids are tokens already emitted, for a request that resumes."""
    progress = (ChoiceProgress(index=0, output_token_ids=tuple(output_token_ids)),) if output_token_ids else ()
    return WorkRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=prompt, progress=progress, sampling=SamplingParams(**sampling),
        created=0.0,
    )


def run(engine: Engine, arrivals: dict[int, list[WorkRequest]], on_step: OnStep | None = None) -> Steps:
    """Steps until every request finished; requests in arrivals[i] are added before step i (0-based), and
    on_step sees each step's outputs as soon as the step returns them."""
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


def outputs_of(steps: Steps, request: WorkRequest) -> list[SeqOutput]:
    return [o for outputs in steps for o in outputs if o.seq.request_id == request.request_id]


def tokens_of(steps: Steps, request: WorkRequest) -> list[int]:
    """The request's emitted tokens, checking that each step's offset continues where the last one ended."""
    offset = len(request.choices()[0].output_token_ids)
    tokens: list[int] = []
    for out in outputs_of(steps, request):
        assert out.offset == offset
        offset += len(out.tokens)
        tokens += out.tokens
    return tokens


def assert_second_tokens_follow_the_target(engine: Engine, reference_model, prompt: list[int]) -> None:
    """Requests resumed after the target's greedy first token decode their second one through the engine's drafts,
    over SAMPLED_SEEDS seeds at temperature 1: a chi-square test over the target's 12 likeliest tokens and the rest
    checks that it follows the target's softmax, whatever the drafts' q (a wrong q or a point mass taken for a
    distribution would be far off)."""
    first = int(reference_model(torch.tensor([prompt])).logits[0, -1].argmax())
    requests = [make_request(prompt, [first], max_tokens=5, temperature=1.0, seed=s) for s in range(SAMPLED_SEEDS)]
    steps = run(engine, {0: requests})
    seconds = [outputs_of(steps, r)[0].tokens[0] for r in requests]
    assert engine.stats.num_draft_tokens > 0
    with torch.no_grad():
        p = torch.softmax(reference_model(torch.tensor([prompt + [first]])).logits[0, -1], -1).numpy()
    top = np.argsort(-p)[:12]
    observed = np.array([seconds.count(int(t)) for t in top] + [sum(s not in top for s in seconds)], dtype=float)
    expected = np.append(p[top], 1 - p[top].sum()) * SAMPLED_SEEDS
    keep = expected >= 5
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert statistic < 3 * keep.sum() + 15, statistic


def tokens_alone(engine: Engine, request: WorkRequest) -> list[int]:
    """The tokens `request` gets as the only request of `engine`."""
    return tokens_of(run(engine, {0: [request]}), request)

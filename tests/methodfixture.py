"""Every drafting method on the tiny test checkpoints, for engine-level tests of speculation: the method table,
an engine builder, a step loop, and transformers' greedy continuation to compare with.

Methods that need no MTP module run on tests/modelfixture.py's tiny Llama; "mtp" and "mtp+with_ngram" run on
tests/mtpfixture.py's copy of the same trunk with a fitted MTP module, so one reference serves all of them.
Import the fixtures by name into a test module (`from tests.methodfixture import ...`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from services.worker.engine import Engine, SeqOutput
from shared.config import EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from shared.tokenizer import Tokenizer
from tests.modelfixture import tiny_model_dir  # noqa: F401  (fixtures are used by name)
from tests.mtpfixture import mtp_model_dirs  # noqa: F401

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
MAX_STEPS = 1000  # far more than any test needs: a scheduler that stalls fails instead of hanging
REFERENCE_TOKENS = 40  # the longest greedy continuation a test compares
PROMPT_TEXTS = (
    "def wrap(text, width=70):\n    return text",
    "import os\n",
    "class Template:\n    delimiter = '$'\n",
    "for i in range(10):\n    print(i, i * i)\n",
)
GREEDY = dict(temperature=0.0, ignore_eos=True)
Steps = list[list[SeqOutput]]


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
        """The method's config; overrides replace any key, num_speculative_tokens included."""
        keys = dict(method=self.method, num_speculative_tokens=self.num_speculative_tokens, **self.options)
        return SpeculativeConfig(**(keys | overrides))


METHODS = {
    m.name: m
    for m in (
        Method("naive", "naive", 0),
        Method("ngram", "ngram", 3),
        Method("suffix", "suffix", 3),
        Method("mtp", "mtp", 2, dict(num_model_steps=2)),
        Method("mtp+with_ngram", "mtp", 3, dict(num_model_steps=1, mtp_strategy="with_ngram")),
    )
}
METHOD_NAMES = tuple(METHODS)
DRAFTING_METHOD_NAMES = tuple(name for name, m in METHODS.items() if m.drafts)


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """One intra-op thread: the tiny matrices gain nothing from more, and the CPU is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def mtp_model_dir(request: pytest.FixtureRequest) -> Path:
    """The specmesh-layout MTP checkpoint. Fitting its module is ~10x slower with two threads on a busy CPU,
    and session fixtures are built before any module's single_thread, so the fit is made single-threaded here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return request.getfixturevalue("mtp_model_dirs")["specmesh"]
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, mtp_model_dir: Path) -> Callable[[Method], Path]:  # noqa: F811
    """The checkpoint a method runs on."""
    return lambda method: mtp_model_dir if method.needs_mtp else tiny_model_dir


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:  # noqa: F811
    tok = Tokenizer(tiny_model_dir)
    return [tok.encode(text) for text in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def greedy_reference(tiny_model_dir: Path) -> Callable[[list[int], int], list[int]]:  # noqa: F811
    """transformers' greedy continuation with EOS disabled, generated once per prompt (a greedy continuation
    of n tokens is the first n of a longer one)."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    memo: dict[tuple[int, ...], list[int]] = {}

    def generate(prompt: list[int], num_tokens: int) -> list[int]:
        assert num_tokens <= REFERENCE_TOKENS
        if tuple(prompt) not in memo:
            ids = torch.tensor([prompt])
            # An explicit mask: the prompt starts with the BOS token, which is also the pad id transformers
            # would otherwise mask out.
            with torch.no_grad():
                out = reference.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=REFERENCE_TOKENS,
                    eos_token_id=None, pad_token_id=0,
                )
            memo[tuple(prompt)] = out[0, len(prompt) :].tolist()
        return memo[tuple(prompt)][:num_tokens]

    return generate


def make_engine(
    model_dir: Path, method: Method, max_num_seqs: int = MAX_NUM_SEQS, max_model_len: int = MAX_MODEL_LEN,
    **overrides,
) -> Engine:
    """An engine running `method`; overrides replace speculative config keys (verify_strategy, k, ...)."""
    config = EngineConfig(
        model=model_dir, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        speculative=method.config(**overrides),
    )
    return Engine(config)


def make_request(prompt: list[int], **sampling) -> WorkRequest:
    return WorkRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=SamplingParams(**sampling), created=0.0
    )


def run(engine: Engine, arrivals: dict[int, list[WorkRequest]]) -> Steps:
    """Steps until every request finished; requests in arrivals[i] are added before step i (0-based)."""
    steps: Steps = []
    pending = dict(arrivals)
    while pending or engine.has_work():
        assert len(steps) < MAX_STEPS, "the engine stopped making progress"
        for request in pending.pop(len(steps), []):
            engine.add_request(request)
        steps.append(engine.step() if engine.has_work() else [])
    return steps


def outputs_of(steps: Steps, request: WorkRequest) -> list[SeqOutput]:
    return [o for outputs in steps for o in outputs if o.seq.request_id == request.request_id]


def tokens_of(steps: Steps, request: WorkRequest) -> list[int]:
    """The request's emitted tokens, checking that each step's offset continues where the last one ended."""
    offset = 0
    tokens: list[int] = []
    for out in outputs_of(steps, request):
        assert out.offset == offset
        offset += len(out.tokens)
        tokens += out.tokens
    return tokens

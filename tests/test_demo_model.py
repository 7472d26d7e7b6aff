"""The shipped demo model: a real Hugging Face checkpoint, small, and with drafters that earn their place (its MTP
module, and beside it its draft model and EAGLE-3 head)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from shared.tokenizer import Tokenizer
from services.worker.demo_model.data import encode_documents, load_corpus
from services.worker.demo_model.teacher_text import TeacherText, teacher_continuations
from services.worker.drafting.checkpoints import default_draft_dir, default_eagle3_dir
from services.worker.engine.engine import Engine
from services.worker.model.loader import load_model

transformers = pytest.importorskip("transformers")

MAX_CHECKPOINT_BYTES = 15 * 1024 * 1024
MAX_DRAFTER_BYTES = 5 * 1024 * 1024
# Greedy drafts accepted, k=1: a third is what a draft must earn for its pass to pay on this CPU
MIN_ACCEPTANCE = {"mtp": 1 / 3, "draft_model": 1 / 3, "eagle3": 1 / 3}
NUM_PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 6, 64, 48


def test_checkpoint_is_small_and_reports_its_training() -> None:
    size = sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.glob("*.safetensors"))
    assert 0 < size <= MAX_CHECKPOINT_BYTES
    report = json.loads((DEFAULT_MODEL_DIR / "training_report.json").read_text())
    assert {"held_out_loss", "mtp_top1_accuracy", "mtp_greedy_agreement"} <= report.keys()


def test_transformers_loads_it_as_a_causal_lm_with_our_logits() -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    ours = load_model(DEFAULT_MODEL_DIR)
    ids = torch.tensor([Tokenizer(DEFAULT_MODEL_DIR).encode("import os\n\ndef main(argv):\n    return 0\n")])
    with torch.no_grad():
        expected = reference(ids, attention_mask=torch.ones_like(ids)).logits
        got = ours.logits(ours(ids, torch.arange(ids.shape[1])[None]))
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("directory", [default_draft_dir(DEFAULT_MODEL_DIR), default_eagle3_dir(DEFAULT_MODEL_DIR)])
def test_the_shipped_drafters_are_small_and_report_their_training(directory) -> None:
    assert 0 < sum(p.stat().st_size for p in directory.glob("*.safetensors")) <= MAX_DRAFTER_BYTES
    assert "greedy_agreement" in " ".join(json.loads((directory / "training_report.json").read_text()))


@pytest.mark.parametrize("method", MIN_ACCEPTANCE)
def test_greedy_drafts_are_accepted_at_least_a_third_of_the_time(method: str) -> None:
    """On held-out standard-library code, which the model and its drafters never trained on."""
    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=1)
    engine = Engine(EngineConfig(model=DEFAULT_MODEL_DIR, max_num_seqs=NUM_PROMPTS, speculative=spec))
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    texts = [t for t in load_corpus().held_out if len(t) > 4000][:NUM_PROMPTS]
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)[:PROMPT_TOKENS]
        engine.add_request(WorkRequest(request_id=f"{i:032x}", prompt_token_ids=ids, sampling=sampling, created=0))
    while engine.has_work():
        engine.step()
    stats = engine.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens / stats.num_draft_tokens >= MIN_ACCEPTANCE[method]


def test_the_teacher_text_continues_corpus_prompts_as_the_teacher_would() -> None:
    """The draft model's on-policy data (demo_model/teacher_text.py): corpus prompts, then the teacher's own tokens,
    argmax for greedy rows; the same rows on every call."""
    tokenizer, documents = Tokenizer(DEFAULT_MODEL_DIR), load_corpus().held_out[:3]
    stream = encode_documents(tokenizer, documents)
    assert stream.tolist() == [t for d in documents for t in tokenizer.encode(d)]  # batched as one by one
    cfg = TeacherText(num_sequences=3, new_tokens=8, sampled_every=2, batch=2)
    seq_len = 24
    rows = teacher_continuations(DEFAULT_MODEL_DIR, stream, seq_len, cfg)
    assert rows.shape == (3, seq_len + 1)
    assert torch.equal(rows, teacher_continuations(DEFAULT_MODEL_DIR, stream, seq_len, cfg))
    prompt_len = seq_len + 1 - cfg.new_tokens
    text = " ".join(map(str, stream.tolist()))
    assert all(" ".join(map(str, row[:prompt_len].tolist())) in text for row in rows)
    teacher = load_model(DEFAULT_MODEL_DIR)
    with torch.no_grad():
        greedy = teacher.logits(teacher(rows[:, :-1], torch.arange(seq_len).expand(3, seq_len))).argmax(-1)
    for index in (0, 2):  # sampled_every=2: row 1 is sampled
        assert torch.equal(greedy[index, prompt_len - 1 :], rows[index, prompt_len:])


def test_engines_build_without_importing_torchs_compiler() -> None:
    """Models are built on the meta device; an op run there goes through torch's Python references, whose first use
    imports torch._dynamo, a second of every worker's start. A fresh process builds an engine of each model drafter
    and steps it."""
    script = (
        "import sys, uuid; from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig; "
        "from shared.schemas import SamplingParams, WorkRequest; "
        "from services.worker.engine.engine import Engine\n"
        "for method in ('mtp', 'eagle3', 'draft_model'):\n"
        "    engine = Engine(EngineConfig(model=DEFAULT_MODEL_DIR, speculative=SpeculativeConfig(method=method)))\n"
        "    engine.add_request(WorkRequest(request_id=uuid.uuid4().hex, prompt_token_ids=[1, 2, 3], "
        "sampling=SamplingParams(max_tokens=4), created=0.0))\n"
        "    [engine.step() for _ in range(4)]\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

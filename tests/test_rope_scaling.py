"""Every supported rope type gives transformers' logits on tiny random checkpoints, at positions well past the
scaling's original context, however config.json spells it: under `rope_scaling` (with `type` or `rope_type`) or
`rope_parameters` (transformers 5). Both models read the same config.json. The engine's greedy tokens, with
speculative verify passes over the paged cache, equal transformers' generate for the scaled types, and dynamic
NTK is refused past max_position_embeddings, where transformers' frequencies depend on each forward pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.worker.model.config import UnsupportedModelError
from services.worker.model.loader import load_model
from tests.methodfixture import GREEDY, METHODS, make_engine, make_request, tokens_alone
from tests.modelfixture import MODEL_SHAPE, random_causal_lm
from tests.threadfixture import single_thread  # noqa: F401  (fixtures are used by name)

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
VOCAB_SIZE = 97
MAX_POSITIONS = 64  # max_position_embeddings: dynamic NTK is served up to here
ORIGINAL_POSITIONS = 16  # original_max_position_embeddings of yarn and llama3: prompts run well past it
PROMPT_LEN = 40
NEW_TOKENS = 16
ROPE_THETA = 5000.0
DECOY_THETA = 123.0  # a top-level rope_theta beside rope_parameters' own, which wins in transformers
QK_GAIN = 10.0  # sharper attention, so that a wrong rotation moves the logits far past TOLERANCE (~0.4)
SEED = 0

ROPES = {  # name: (rope_type, its parameters, the family that runs it)
    "default": ("default", {}, "llama"),
    "linear": ("linear", {"factor": 2.0}, "llama"),
    "dynamic": ("dynamic", {"factor": 2.0}, "qwen2"),
    "yarn": ("yarn", {"factor": 4.0, "original_max_position_embeddings": ORIGINAL_POSITIONS}, "qwen2"),
    "yarn-tuned": ("yarn", {
        "factor": 3.0, "original_max_position_embeddings": ORIGINAL_POSITIONS, "beta_fast": 8, "beta_slow": 2,
        "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5,
    }, "llama"),
    "llama3": ("llama3", {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL_POSITIONS,
    }, "llama"),
}
# (config key, the name of its type field): older configs, Llama 3.x's, and what transformers 5 saves.
SPELLINGS = (("rope_scaling", "type"), ("rope_scaling", "rope_type"), ("rope_parameters", "rope_type"))


def _checkpoint(path: Path, rope: str, key: str = "rope_parameters", type_field: str = "rope_type"):
    """A tiny random checkpoint with the rope written as (key, type_field) say; transformers' model read back
    from the same directory."""
    rope_type, params, kind = ROPES[rope]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = random_causal_lm(kind, **MODEL_SHAPE | dict(vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(QK_GAIN)
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.pop("rope_scaling", None)
    written = {type_field: rope_type, **params}
    if key == "rope_parameters":
        config[key], config["rope_theta"] = written | {"rope_theta": ROPE_THETA}, DECOY_THETA
    else:
        config[key], config["rope_theta"] = written, ROPE_THETA
    (path / "config.json").write_text(json.dumps(config))
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt(length: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("key,type_field", SPELLINGS)
@pytest.mark.parametrize("rope", list(ROPES))
def test_logits_match_transformers(tmp_path: Path, rope: str, key: str, type_field: str) -> None:
    reference = _checkpoint(tmp_path, rope, key, type_field)
    ours = load_model(tmp_path)
    assert ours.config.rope_scaling.rope_type == ROPES[rope][0]
    assert ours.rotary.attention_scaling == pytest.approx(reference.model.rotary_emb.attention_scaling, abs=0.0)
    ids = torch.tensor([_prompt(PROMPT_LEN)])
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours.logits(ours(ids, torch.arange(PROMPT_LEN)[None]))
    assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("rope", ["yarn", "llama3"])
def test_engine_greedy_tokens_match_transformers(tmp_path: Path, rope: str) -> None:
    reference = _checkpoint(tmp_path, rope)
    prompt = _prompt(PROMPT_LEN - NEW_TOKENS)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    for method in (METHODS["naive"], METHODS["ngram"]):
        engine = make_engine(tmp_path, method, max_model_len=MAX_POSITIONS)
        assert tokens_alone(engine, make_request(prompt, max_tokens=NEW_TOKENS, **GREEDY)) == expected, method.name


def test_dynamic_rope_is_refused_past_max_position_embeddings(tmp_path: Path) -> None:
    _checkpoint(tmp_path, "dynamic")
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        load_model(tmp_path, max_model_len=MAX_POSITIONS + 1)
    ours = load_model(tmp_path, max_model_len=MAX_POSITIONS)
    ids = torch.tensor([_prompt(MAX_POSITIONS + 1)])
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="dynamic"):
        ours(ids, torch.arange(MAX_POSITIONS + 1)[None])


@pytest.mark.parametrize("rope", ["llama3", "yarn"])
def test_the_table_holds_what_the_engine_serves(tmp_path: Path, rope: str) -> None:
    """Loaded for an engine, the cos/sin table has max_model_len rows, not max_position_embeddings; a longer
    context (a training pass) grows it to the same values."""
    reference = _checkpoint(tmp_path, rope)
    served = PROMPT_LEN // 2
    ours = load_model(tmp_path, max_model_len=served)
    assert ours.rotary.cos_sin.shape[0] == served < MAX_POSITIONS
    assert torch.equal(ours.rotary.cos_sin, load_model(tmp_path).rotary.cos_sin[:served])
    ids = torch.tensor([_prompt(PROMPT_LEN)])
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours.logits(ours(ids, torch.arange(PROMPT_LEN)[None]))
    assert (got - expected).abs().max().item() <= TOLERANCE

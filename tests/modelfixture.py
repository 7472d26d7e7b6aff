"""A tiny random Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3, Granite, Seed-OSS or Gemma 3 checkpoint with a real tokenizer, for tests
that run the engine.

Use the fixture by importing it into a test module (`from tests.modelfixture import tiny_model_dir`), or call
`make_tiny_model_dir(path)` directly. The fixture builds the directory once per test session.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from services.worker.demo_model.tokenizer import END_OF_TEXT, train_tokenizer
from services.worker.drafting.checkpoints import DRAFT_SUFFIX
from tests.sessioncache import once

TOKENIZER_VOCAB_SIZE = 512
# A few stdlib modules of different styles: enough text for the BPE merges, read in well under a second.
TOKENIZER_CORPUS = ("textwrap.py", "bisect.py", "colorsys.py", "fnmatch.py", "shlex.py", "string.py")
MODEL_SEED = 0
MODEL_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
MODEL_KINDS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "phi3", "granite", "seed_oss", "gemma3")
# A tiny Granite's scalars, none of them 1, so that each is read and applied
GRANITE_SCALARS = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0)
MISTRAL_WINDOW = 8  # a tiny Mistral's sliding window: shorter than the tests' prompts and outputs
# A tiny Gemma 3: a sliding layer then a full one, each kind with its own rope (the full one's scaled), and a query
# scale that is not head_dim's
GEMMA3_LAYER_TYPES = ["sliding_attention", "full_attention"]
GEMMA3_QUERY_SCALAR = 24
GEMMA3_SLIDING_THETA = 1000.0
GEMMA3_FULL_ROPE = {"rope_type": "linear", "factor": 2.0}
# A tiny Qwen3-MoE's experts (with MODEL_SHAPE's two layers, both sparse unless the config says otherwise)
MOE_SHAPE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_path("stdlib"))
    return [(stdlib / name).read_text(encoding="utf-8") for name in TOKENIZER_CORPUS]


def random_causal_lm(kind: str, **config):
    """A transformers Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3, Granite, Seed-OSS or Gemma 3 with these config keys, its
    weights drawn from torch's global RNG."""
    import transformers  # a dev dependency: only tests that build a model need it

    if kind not in MODEL_KINDS:
        raise ValueError(f"kind must be one of {MODEL_KINDS}, got {kind!r}")
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    if kind == "mistral":
        config = dict(sliding_window=MISTRAL_WINDOW) | config
        return transformers.MistralForCausalLM(transformers.MistralConfig(**config))
    if kind == "granite":
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(**(GRANITE_SCALARS | config)))
    if kind == "phi3":  # with a window too, as Phi-3-mini-4k's (2047); Phi3Config's token ids are its 32k vocab's
        config = dict(sliding_window=MISTRAL_WINDOW, bos_token_id=0, eos_token_id=0, pad_token_id=0) | config
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**config))
    if kind == "gemma3":  # head_dim defaults to 256
        head_dim = config.pop("head_dim", config["hidden_size"] // config["num_attention_heads"])
        full = GEMMA3_FULL_ROPE | {"rope_theta": config.pop("rope_theta", 10000.0)}
        ropes = {"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                                "rope_theta": GEMMA3_SLIDING_THETA}}
        config = dict(sliding_window=MISTRAL_WINDOW, layer_types=GEMMA3_LAYER_TYPES,
                      query_pre_attn_scalar=GEMMA3_QUERY_SCALAR) | config
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            head_dim=head_dim, rope_parameters=ropes, **config))
    if kind == "seed_oss":  # head_dim defaults to 128 too; q/k/v biases on, as SeedOssConfig's default
        head_dim = config.pop("head_dim", config["hidden_size"] // config["num_attention_heads"])
        return transformers.SeedOssForCausalLM(transformers.SeedOssConfig(head_dim=head_dim, **config))
    if kind in ("qwen3", "qwen3_moe"):  # Qwen3's head_dim defaults to 128, not hidden_size / heads
        head_dim = config.pop("head_dim", config["hidden_size"] // config["num_attention_heads"])
        if kind == "qwen3":
            return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=head_dim, **config))
        config = MOE_SHAPE | config
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(head_dim=head_dim, **config))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))


def _build_model(kind: str, vocab_size: int, eos_id: int):
    common = dict(
        MODEL_SHAPE, vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        torch_dtype=torch.float32,
    )
    # A private RNG state, so building the fixture does not shift the random streams of the tests around it.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        return random_causal_lm(kind, **common)


def make_tiny_model_dir(
    path: Path, kind: str = "llama", special_tokens: tuple[str, ...] = (), chat_template: str | None = None
) -> Path:
    """Writes tokenizer files, config.json (eos = <|endoftext|>) and float32 random weights to `path`; the tokenizer
    with more special tokens (a family's control tokens) and another chat template, if given."""
    path = Path(path)
    tok = train_tokenizer(_corpus(), TOKENIZER_VOCAB_SIZE, path)
    if special_tokens:
        tok.add_special_tokens(list(special_tokens))
        tok.save(str(path / "tokenizer.json"))
    if chat_template is not None:
        config_path = path / "tokenizer_config.json"
        config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"chat_template": chat_template}))
    eos_id = tok.token_to_id(END_OF_TEXT)
    model = _build_model(kind, tok.get_vocab_size(with_added_tokens=True), eos_id)
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    if config.get("eos_token_id") != eos_id:
        raise AssertionError(f"config.json eos_token_id {config.get('eos_token_id')!r}, expected {eos_id}")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with a trained byte-level BPE tokenizer, shared by the whole session, and beside
    it its draft model (method draft_model's default, `<dir>-draft`): a copy, so that its drafts are accepted as a
    trained draft model's would be (test_draft_model.py drafts with a different one too)."""
    def build() -> Path:
        path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))
        shutil.copytree(path, Path(f"{path}{DRAFT_SUFFIX}"))
        return path

    return once("tiny_model_dir", build)


def make_draft_model_dir(target: Path, path: Path, parallel: bool = False) -> Path:
    """A random Llama of one layer with the target's tokenizer files and vocabulary: a draft model that disagrees
    with the target. parallel: a PARD draft model, its mask token one id past the target's vocabulary."""
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    vocab = config["vocab_size"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED + 1)
        model = random_causal_lm(
            "llama", **dict(MODEL_SHAPE, num_hidden_layers=1), vocab_size=vocab + parallel,
            bos_token_id=config["eos_token_id"], eos_token_id=config["eos_token_id"],
            pad_token_id=config["eos_token_id"], torch_dtype=torch.float32,
            **({"pard_token": vocab} if parallel else {}),
        )
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (target / name).is_file():
            shutil.copy(target / name, path / name)
    return path

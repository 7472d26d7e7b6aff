"""Our decoder's logits equal transformers' on the same tiny random checkpoints (Llama, Qwen2, Qwen3, Qwen3-MoE,
Mistral, Phi-3, Granite, Seed-OSS and Gemma 3; the Gemma 3 and Mistral 3 vision-language models on text),
and the engine's greedy tokens under every drafting method the checkpoint allows equal transformers' generate."""

import functools
import json
from dataclasses import replace
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.engine.forward_batch import InputBuffers, pack
from services.worker.engine.kv_cache import KVCache
from services.worker.model.config import ModelConfig, UnsupportedModelError
from services.worker.model.loader import load_model
from shared.tokenizer import config_eos_ids
from services.worker.drafting.checkpoints import default_draft_dir, default_eagle3_dir
from tests.eagle3fixture import QUICK_FIT, write_eagle3_head
from tests.methodfixture import GREEDY, METHODS, PROMPT_TEXTS, encode_prompts, make_engine, make_request, tokens_alone
from tests.modelfixture import MODEL_SHAPE, make_tiny_model_dir, random_causal_lm

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
VOCAB_SIZE = 311  # not a power of two on purpose
# The engine tests' tiny shape with odd sizes and non-default rope and norm settings, so that loading reads them.
SHAPE = MODEL_SHAPE | dict(
    vocab_size=VOCAB_SIZE, intermediate_size=136, max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-5
)
SEED = 0


def _save_tiny(kind: str, tied: bool, path: Path, **config) -> "transformers.PreTrainedModel":
    torch.manual_seed(SEED)
    model = random_causal_lm(kind, **SHAPE, tie_word_embeddings=tied, **config)
    with torch.no_grad():  # random biases and norms, so their loading is really checked
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("kind,tied", [
    ("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True),
    ("mistral", False), ("phi3", False), ("phi3", True), ("granite", False), ("granite", True), ("seed_oss", False),
    ("gemma3", False), ("gemma3", True),
])
def test_logits_match_transformers(tmp_path: Path, kind: str, tied: bool) -> None:
    reference = _save_tiny(kind, tied, tmp_path)
    ours = load_model(tmp_path)
    ids = torch.randint(0, VOCAB_SIZE, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        positions = torch.arange(23).expand(2, 23)
        got = ours.logits(ours(ids, positions))
    assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "phi3", "granite", "seed_oss", "gemma3"])
def test_cached_prefill_then_verify_matches_full_forward(tmp_path: Path, kind: str) -> None:
    """Prefill 10 tokens, then score 4 more in one pass against the cache: same logits as one full pass."""
    reference = _save_tiny(kind, False, tmp_path)
    ours = load_model(tmp_path)
    cfg = ours.config
    ids = torch.randint(0, VOCAB_SIZE, (1, 14), generator=torch.Generator().manual_seed(2))
    cache = KVCache(ours.num_cache_layers, 2, 64, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    slot = 1

    def run(chunk: torch.Tensor, start: int) -> torch.Tensor:
        batch = pack(cache, [chunk[0].tolist()], [start], [slot], InputBuffers(torch.device("cpu")))
        return ours.logits(ours(batch.input_ids, batch.positions, batch))[None]

    with torch.no_grad():
        expected = reference(ids).logits
        got = torch.cat([run(ids[:, :10], 0), run(ids[:, 10:], 10)], dim=1)
    assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_moe"])
def test_sliding_layers_of_qwen_match_transformers(tmp_path: Path, kind: str) -> None:
    """use_sliding_window with layers from max_window_layers on sliding (Qwen3-MoE: every layer, whatever
    max_window_layers says): a window of 8 over 23 positions, in one pass, and prefilled into the cache then
    verified against it."""
    reference = _save_tiny(kind, False, tmp_path, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if kind != "qwen3_moe":
        assert reference.config.layer_types == ["full_attention", "sliding_attention"]
    ours = load_model(tmp_path)
    ids = torch.randint(0, VOCAB_SIZE, (1, 23), generator=torch.Generator().manual_seed(3))
    cache = KVCache(ours.num_cache_layers, 4, 64, ours.config.num_key_value_heads, ours.config.head_dim,
                    torch.float32, "cpu")

    def run(chunk: torch.Tensor, start: int) -> torch.Tensor:
        batch = pack(cache, [chunk[0].tolist()], [start], [0], InputBuffers(torch.device("cpu")))
        return ours.logits(ours(batch.input_ids, batch.positions, batch))[None]

    with torch.no_grad():
        expected = reference(ids).logits
        whole = ours.logits(ours(ids, torch.arange(23)[None]))
        cached = torch.cat([run(ids[:, :15], 0), run(ids[:, 15:], 15)], dim=1)
    assert (whole - expected).abs().max().item() <= TOLERANCE
    assert (cached - expected).abs().max().item() <= TOLERANCE


def test_gemma3_scales_its_embeddings_in_the_models_dtype(tmp_path: Path) -> None:
    """sqrt(72) is 8.485 in float32 and 8.5 in bfloat16, where transformers scales by the latter."""
    torch.manual_seed(SEED)
    random_causal_lm("gemma3", **SHAPE | dict(hidden_size=72)).save_pretrained(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    ids = torch.arange(40)[None]
    with torch.no_grad():
        assert torch.equal(ours.embed(ids), reference.model.embed_tokens(ids))


@pytest.mark.parametrize("tied", [True, False])
def test_a_vision_language_gemma3_serves_its_language_model(tmp_path: Path, tied: bool) -> None:
    """Gemma3ForConditionalGeneration: the language model's tensors read from under `language_model.`, the vision
    tower's left out, the head tied as the top-level config says (transformers 5 writes text_config's as true
    either way); on text its logits are transformers' vision-language model's."""
    torch.manual_seed(SEED)
    text = random_causal_lm("gemma3", **SHAPE).config
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    reference = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB_SIZE - 3,
        boi_token_index=VOCAB_SIZE - 2, eoi_token_index=VOCAB_SIZE - 1, tie_word_embeddings=tied))
    _randomise_norms(reference)
    reference.save_pretrained(tmp_path)
    # transformers 5 writes the EOS id under text_config alone, which is where a shape without a tokenizer finds it
    assert config_eos_ids(tmp_path) == {reference.config.text_config.eos_token_id}
    _assert_text_logits_match(reference, load_model(tmp_path), VOCAB_SIZE - 3)


def _assert_text_logits_match(reference, ours, num_text_tokens: int) -> None:
    """A vision-language reference's logits on text (ids below its image tokens) are ours, to TOLERANCE."""
    ids = torch.randint(0, num_text_tokens, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.eval()(input_ids=ids).logits
        got = ours.logits(ours(ids, torch.arange(23).expand(2, 23)))
    assert (got - expected).abs().max().item() <= TOLERANCE


def _randomise_norms(model) -> None:
    """Norm weights away from their initial ones, so that reading them (and any offset they are stored as) counts."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)


def _without_top_level_tie(model_dir: Path) -> None:
    """config.json as published checkpoints write it: no top-level tie_word_embeddings (Mistral3Config reads true)."""
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("layout", ["tied", "published", "transformers-4"])
def test_a_vision_language_mistral3_serves_its_language_model(tmp_path: Path, layout: str) -> None:
    """Mistral3ForConditionalGeneration (Mistral Small 3.1, 3.2): its Mistral language model read from under
    `model.language_model.` (transformers 5) or `language_model.model.` (4), the Pixtral tower left out. "published"
    says nothing of tying, which Mistral3Config reads as tied, yet stores its own head, which transformers 5 keeps:
    specmesh keeps it too. On text its logits are transformers' vision-language model's."""
    torch.manual_seed(SEED)
    text = random_causal_lm("mistral", **SHAPE).config
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=28, patch_size=14, head_dim=16)
    reference = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=VOCAB_SIZE - 1, tie_word_embeddings=layout == "tied"))
    _randomise_norms(reference)
    reference.save_pretrained(tmp_path)
    if layout != "tied":
        _without_top_level_tie(tmp_path)
    if layout == "transformers-4":
        state = load_file(str(tmp_path / "model.safetensors"))
        renamed = {"language_model.lm_head." + k[len("lm_head."):] if k.startswith("lm_head.") else
                   "language_model.model." + k[len("model.language_model."):]
                   if k.startswith("model.language_model.") else k.removeprefix("model."): v for k, v in state.items()}
        save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    else:
        reference = transformers.Mistral3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    assert (reference.lm_head.weight is reference.model.language_model.embed_tokens.weight) == (layout == "tied")
    ours = load_model(tmp_path)
    assert ours.config.tie_word_embeddings == (layout == "tied")
    _assert_text_logits_match(reference, ours, VOCAB_SIZE - 1)


def test_a_head_stored_beside_a_tied_config_is_the_head(tmp_path: Path) -> None:
    """A Llama whose config.json says tied but whose checkpoint stores a head of its own: transformers 5 keeps the
    stored head (it ties only one the checkpoint leaves out), and so does specmesh."""
    _save_tiny("llama", False, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert reference.lm_head.weight is not reference.model.embed_tokens.weight
    ours = load_model(tmp_path)
    assert not ours.config.tie_word_embeddings
    ids = torch.arange(12)[None]
    with torch.no_grad():
        assert (ours.logits(ours(ids, torch.arange(12)[None])) - reference(ids).logits).abs().max().item() <= TOLERANCE


def test_a_vision_language_model_of_another_text_type_is_refused() -> None:
    raw = {"architectures": ["Mistral3ForConditionalGeneration"],
           "text_config": {"model_type": "ministral3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 1, "num_attention_heads": 4}}
    with pytest.raises(UnsupportedModelError, match="ministral3"):
        ModelConfig.from_dict(raw)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["MambaForCausalLM"], "model_type": "mamba"}')
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM"):
        load_model(tmp_path)


def test_phi3_config_reads_as_transformers_does() -> None:
    """Phi3Config's rms_norm_eps where config.json is silent, and the rope types it reads as longrope refused."""
    raw = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4}
    assert ModelConfig.from_dict(raw).rms_norm_eps == transformers.Phi3Config().rms_norm_eps
    for kind in ("longrope", "su", "yarn"):
        with pytest.raises(UnsupportedModelError, match="Phi-3"):
            ModelConfig.from_dict(raw | {"rope_scaling": {"type": kind, "factor": 2.0, "short_factor": [1.0],
                                                          "long_factor": [1.0]}})


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    reference = _save_tiny("qwen2", False, tmp_path / "whole")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    ids = torch.arange(12)[None]
    with torch.no_grad():
        whole, sharded = load_model(tmp_path / "whole"), load_model(tmp_path / "sharded")
        positions = torch.arange(12)[None]
        assert torch.equal(whole.logits(whole(ids, positions)), sharded.logits(sharded(ids, positions)))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny checkpoint, with beside it a copy as its draft model and a fitted EAGLE-3 head."""
    dirs = {}
    for kind in ("qwen3", "qwen3_moe", "mistral", "phi3", "granite", "gemma3"):
        dirs[kind] = make_tiny_model_dir(tmp_path_factory.mktemp(f"tiny-{kind}"), kind)
        shutil.copytree(dirs[kind], default_draft_dir(dirs[kind]))
        # Tokens are checked, not acceptance: a head fitted for a moment, which a draft now and then passes
        write_eagle3_head(dirs[kind], default_eagle3_dir(dirs[kind]), replace(QUICK_FIT, steps=30), num_batches=3)
    return dirs


@pytest.mark.parametrize("name", ["naive", "ngram", "suffix", "draft_model", "eagle3"])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "mistral", "phi3", "granite", "gemma3"])
def test_greedy_tokens_equal_transformers_under_every_method(family_dirs, kind: str, name: str) -> None:
    """Every drafting method but MTP, which needs a checkpoint with MTP modules (these families ship none); the
    Mistral's window (8 positions), and Gemma 3's sliding layer's, are shorter than every prompt and output, in
    prefill, decode and verify (the EAGLE-3 head's own layer, a Llama's, attends to every position)."""
    model_dir = family_dirs[kind]
    engine = make_engine(model_dir, METHODS[name])
    for prompt, expected in _transformers_greedy(model_dir):
        assert tokens_alone(engine, make_request(prompt, max_tokens=24, **GREEDY)) == expected


@functools.cache
def _transformers_greedy(model_dir: Path) -> list[tuple[list[int], list[int]]]:
    """Each prompt and transformers' greedy tokens after it, once per checkpoint for every method."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pairs = []
    for prompt in encode_prompts(model_dir, PROMPT_TEXTS[:2]):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = reference.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt):].tolist()
        pairs.append((prompt, expected))
    return pairs


@pytest.mark.parametrize("experts", [
    dict(norm_topk_prob=False),
    dict(norm_topk_prob=True),
    dict(decoder_sparse_step=2),  # layer 0 dense, layer 1 sparse
    dict(mlp_only_layers=[1]),
])
def test_qwen3_moe_logits_match_transformers(tmp_path: Path, experts: dict) -> None:
    reference = _save_tiny("qwen3_moe", False, tmp_path, **experts)
    ours = load_model(tmp_path)
    sparse = [layer.mlp.__class__.__name__ == "SparseMoE" for layer in ours.model.layers]
    assert sparse == [reference.config.num_experts > 0 and i not in reference.config.mlp_only_layers
                      and (i + 1) % reference.config.decoder_sparse_step == 0 for i in range(len(sparse))]
    ids = torch.randint(0, VOCAB_SIZE, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours.logits(ours(ids, torch.arange(23).expand(2, 23)))
    assert torch.allclose(got, expected, atol=TOLERANCE), (got - expected).abs().max()

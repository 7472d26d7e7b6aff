"""Load format "dummy": random weights from config.json alone, deterministic, in the requested dtype, served by
the engine without a tokenizer; the benchmark shapes have their published sizes, and transformers' twin of a
dummy model (benchmarks/shape.py) holds the same weights."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from benchmarks import shape
from services import launcher
from services.worker.engine.engine import Engine
from services.worker.model.config import ModelConfig
from services.worker.model.dummy import DUMMY_INIT_STD
from services.worker.model.layers import RMSNorm
from services.worker.model.llama import CausalLM
from services.worker.model.loader import load_model
from shared.config import EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from tests.modelfixture import MODEL_SHAPE, MOE_SHAPE
from tests.threadfixture import single_thread  # noqa: F401  (fixtures are used by name)

VOCAB_SIZE = 300
EOS_ID = 7
MAX_MODEL_LEN = 64
NEW_TOKENS = 4
STD_TOLERANCE = 0.1  # relative, on the empirical std of the largest matrix's ~19k draws
# Published parameter counts (embeddings and, where untied, the LM head included).
PUBLISHED_PARAMETERS = {
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512,
    "llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248,
    # The model cards give 0.6B (0.44B without embeddings) and 8.2B (6.95B): these are the exact sums of those shapes.
    "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360,
    "qwen3-30b-a3b": 30_532_122_624,  # the model card's 30.5B (3.3B active)
    "mistral-7b": 7_248_023_552,  # Mistral-7B-v0.3
    "gemma-3-1b": 999_885_952,
}
ROPE_TYPES = {"qwen2.5-0.5b": "default", "qwen2.5-1.5b": "default", "qwen2.5-7b": "default",
              "llama-3.2-1b": "llama3", "llama-3.1-8b": "llama3", "qwen3-0.6b": "default", "qwen3-8b": "default",
              "qwen3-30b-a3b": "default", "mistral-7b": "default", "gemma-3-1b": "default"}
SLIDING_WINDOWS = {"gemma-3-1b": 512}  # five of every six layers; the other shapes window none


def _config_dir(path: Path, kind: str = "qwen2", **overrides) -> Path:
    """config.json alone: no weights, no tokenizer."""
    arch = {
        "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM",
    }[kind]
    config = MODEL_SHAPE | dict(architectures=[arch], model_type=kind, vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID,
                                bos_token_id=EOS_ID, tie_word_embeddings=False) | overrides
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_dummy_weights_are_deterministic_finite_and_in_dtype(tmp_path: Path) -> None:
    model_dir = _config_dir(tmp_path)
    first = load_model(model_dir, torch.bfloat16, "cpu", load_format="dummy")
    second = load_model(model_dir, torch.bfloat16, "cpu", load_format="dummy")
    state, again = first.state_dict(), second.state_dict()
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state)
    assert all(p.dtype == torch.bfloat16 for p in first.parameters())
    for name, module in first.named_modules():
        if isinstance(module, RMSNorm):
            assert torch.all(module.weight == 1), name
    biases = [p for name, p in first.named_parameters() if name.endswith("bias")]
    assert biases and all(torch.all(b == 0) for b in biases)  # Qwen2's q/k/v biases
    largest = max(first.parameters(), key=torch.Tensor.numel).float()
    assert abs(largest.std().item() / DUMMY_INIT_STD - 1) < STD_TOLERANCE
    with torch.no_grad():
        ids = torch.arange(16)[None]
        assert torch.isfinite(first.logits(first(ids, torch.arange(16)[None]))).all()


def test_a_parameter_does_not_depend_on_the_others(tmp_path: Path) -> None:
    """Adding MTP modules leaves every trunk weight as it was: values come from each parameter's name."""
    trunk = load_model(_config_dir(tmp_path / "trunk", "llama"), load_format="dummy").state_dict()
    with_mtp = load_model(
        _config_dir(tmp_path / "mtp", "llama", num_nextn_predict_layers=1), load_format="dummy"
    ).state_dict()
    assert any(k.startswith("model.mtp_layers.") for k in with_mtp)
    assert all(torch.equal(value, with_mtp[k]) for k, value in trunk.items())


def test_engine_steps_a_dummy_model_without_a_tokenizer(tmp_path: Path) -> None:
    model_dir = _config_dir(tmp_path, "llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    })
    engine = Engine(EngineConfig(model=model_dir, load_format="dummy", max_num_seqs=2, max_model_len=MAX_MODEL_LEN,
                                 speculative=SpeculativeConfig(method="naive")))
    assert engine.eos_token_ids == {EOS_ID}  # from config.json: there is no tokenizer to ask
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request(WorkRequest(request_id="a" * 32, prompt_token_ids=list(range(20, 40)), sampling=sampling,
                                   created=0))
    first = engine.step()
    assert [len(out.tokens) for out in first] == [1]
    assert all(0 <= t < VOCAB_SIZE for t in first[0].tokens)


def test_transformers_twin_holds_the_dummy_weights(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    for kind, tied in (("llama", True), ("qwen2", False), ("qwen3", False), ("qwen3_moe", False), ("gemma3", True)):
        extra = MOE_SHAPE if kind == "qwen3_moe" else {}
        if kind == "gemma3":  # its norms are offsets in transformers' model; a window the prompt outgrows
            extra = dict(model_type="gemma3_text", head_dim=16, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"])
        model_dir = _config_dir(tmp_path / kind, kind, tie_word_embeddings=tied, **extra)
        ours = load_model(model_dir, load_format="dummy")
        twin = shape.transformers_model(model_dir, "dummy", torch.float32, "cpu")
        ids = torch.tensor([shape.random_prompt(VOCAB_SIZE, 24)])
        with torch.no_grad():
            expected = twin(ids).logits
            got = ours.logits(ours(ids, torch.arange(24)[None]))
        assert torch.allclose(got, expected, atol=1e-5), kind


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_benchmark_shapes_have_their_published_sizes(name: str) -> None:
    cfg = ModelConfig.from_dir(shape.shape_dir(name))
    with torch.device("meta"):
        model = CausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]
    assert cfg.rope_scaling.rope_type == ROPE_TYPES[name]
    assert cfg.sliding_window == SLIDING_WINDOWS.get(name)


def test_the_mesh_refuses_a_model_directory_without_a_tokenizer(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(["--model", str(_config_dir(tmp_path)), "--load-format", "dummy"])
    with pytest.raises(SystemExit, match="tokenizer"):
        launcher.run(args)

"""Int8 drafters (SpeculativeConfig.draft_quantization, model/int8_linear.py): the projection multiplies by its
dequantized weight, widths the kernel cannot take stay float, CPU engines quantize their model drafter (never the
target) unless told not to, the output stays the target's, and the key is refused where it means nothing."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from shared.config import EngineConfig, SpeculativeConfig
from services.worker.engine.engine import Engine
from services.worker.model.int8_linear import INPUT_BLOCK, INT8_MAX, Int8Linear, quantize_projections
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, greedy_reference, make_engine, make_request, model_dirs, mtp_model_dir, mtp_model_dirs, prompts,
    reference_model, run, tiny_model_dir, tokens_of,
)

pytest.importorskip("transformers")

MODEL_DRAFTERS = ("mtp", "draft_model", "eagle3")


@pytest.mark.parametrize("out_features,in_features", [(4096, 256), (1408, 256), (256, 704), (6, 64)])
def test_int8_linear_multiplies_by_its_dequantized_weight(out_features: int, in_features: int) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    linear = Int8Linear(weight, bias)
    steps = linear.scales.float()[:, None]
    assert (steps <= weight.abs().amax(dim=1, keepdim=True) / INT8_MAX * 1.01).all()
    # each weight within half a step of its row's grid (a little more where a bfloat16 step rounded down clamps it)
    assert ((linear.dequantized() - weight).abs() <= 0.51 * steps).all()
    for rows in (1, 3, 8):
        x = torch.randn(rows, in_features)
        expected = x.bfloat16().float() @ linear.dequantized().T + bias
        got = linear(x)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        torch.testing.assert_close(got, expected, atol=2e-2 * expected.abs().max().item(), rtol=0)
        assert torch.equal(linear(x[:1]), got[:1])  # a row's result does not depend on the rows beside it


def test_widths_the_kernel_cannot_take_stay_float() -> None:
    module = nn.Sequential(nn.Linear(2 * INPUT_BLOCK, 8), nn.Linear(INPUT_BLOCK + 8, 8))
    quantize_projections(module)
    assert isinstance(module[0], Int8Linear)
    assert isinstance(module[1], nn.Linear)


def _int8_modules(engine: Engine) -> list[nn.Module]:
    models = [engine.runner.model] + ([engine.draft.runner.model] if engine.draft is not None else [])
    return [m for model in models for m in model.modules() if isinstance(m, Int8Linear)]


@pytest.mark.parametrize("name", MODEL_DRAFTERS)
def test_a_cpu_engine_drafts_in_int8_and_keeps_the_targets_output(
    name, model_dirs, prompts, greedy_reference  # noqa: F811
) -> None:
    method = METHODS[name]
    engine = make_engine(model_dirs(method), method)
    assert engine.config.quantizes_drafter
    assert _int8_modules(engine)
    target_layer = engine.runner.trunk.layers[0]
    assert all(isinstance(w, torch.Tensor) for w in (target_layer.qkv, target_layer.o, target_layer.down))
    if name == "draft_model":
        assert isinstance(engine.draft.runner.trunk.layers[0].gate_up, Int8Linear)
    else:
        assert isinstance(engine.runner.drafter.layer.gate_up, Int8Linear)
    request = make_request(prompts[0], max_tokens=24, **GREEDY)
    assert tokens_of(run(engine, {0: [request]}), request) == greedy_reference(prompts[0], 24)
    assert engine.stats.num_accepted_tokens > 0

    as_loaded = make_engine(model_dirs(method), method, draft_quantization="none")
    assert not as_loaded.config.quantizes_drafter and not _int8_modules(as_loaded)


def test_the_key_is_resolved_and_refused_by_name() -> None:
    def engine_config(**keys) -> EngineConfig:
        return EngineConfig(speculative=SpeculativeConfig(method="mtp", **keys.pop("spec", {})), **keys)

    assert engine_config().quantizes_drafter
    assert not engine_config(device="cuda").quantizes_drafter
    assert not engine_config(tensor_parallel_size=2).quantizes_drafter
    assert not engine_config(spec={"draft_quantization": "none"}).quantizes_drafter
    assert not EngineConfig(speculative=SpeculativeConfig(method="ngram")).quantizes_drafter
    with pytest.raises(ValidationError, match="draft_quantization applies to the model drafters"):
        SpeculativeConfig(method="ngram", draft_quantization="int8")
    for keys in ({"device": "cuda"}, {"tensor_parallel_size": 2}):
        with pytest.raises(ValidationError, match='draft_quantization "int8"'):
            engine_config(spec={"draft_quantization": "int8"}, **keys)

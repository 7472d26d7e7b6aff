"""Int8 drafting (SpeculativeConfig.draft_quantization, model/int8_linear.py): the projection multiplies by its
dequantized weight, widths the kernel cannot take get no twin, CPU engines build int8 twins of their model drafter
(never of the target), greedy output stays the target's, sampled requests' seeded output is the float drafter's
exactly, and the key is refused where it means nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from shared.config import EngineConfig, SpeculativeConfig
from services.worker.engine.engine import Engine
from services.worker.model.int8_linear import INPUT_BLOCK, INT8_MAX, Int8Linear, int8_twin
from tests.methodfixture import (  # noqa: F401  (fixtures are used by name)
    GREEDY, METHODS, greedy_reference, make_engine, make_request, model_dirs, mtp_model_dir, mtp_model_dirs,
    outputs_of, prompts, reference_model, run, tiny_model_dir, tokens_of,
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


def test_widths_the_kernel_cannot_take_get_no_twin() -> None:
    assert isinstance(int8_twin(torch.randn(8, 2 * INPUT_BLOCK)), Int8Linear)
    assert int8_twin(torch.randn(8, INPUT_BLOCK + 8)) is None


def _twins(engine: Engine) -> list[Int8Linear]:
    """Every int8 twin the engine built: its drafting layer's (or a draft model's layers') and LM heads'."""
    runner = engine.runner if engine.draft is None else engine.draft.runner
    layers = runner.trunk.quantized_layers if engine.draft is not None else [runner.drafter.quantized_layer]
    heads = [runner.model.int8_head] + ([runner.model.eagle3.int8_lm_head] if runner.model.eagle3 is not None else [])
    found = [w for layer in layers or [] if layer is not None for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return [w for w in found + heads if isinstance(w, Int8Linear)]


def _sampled(prompts: list[list[int]]) -> list:
    return [
        make_request(p, max_tokens=24, temperature=1.0, seed=7 + i, ignore_eos=True, logprobs=0,
                     include_draft_logprobs=True)
        for i, p in enumerate(prompts)
    ]


def _draft_logprobs(steps, request) -> list:
    return [out.draft.logprobs.tolist() for out in outputs_of(steps, request) if out.draft_tokens]


@pytest.mark.parametrize("name", MODEL_DRAFTERS)
def test_greedy_requests_draft_in_int8_and_sampled_ones_as_loaded(
    name, model_dirs, prompts, greedy_reference  # noqa: F811
) -> None:
    method = METHODS[name]
    engine = make_engine(model_dirs(method), method)
    assert engine.config.quantizes_drafter
    assert _twins(engine)
    target_layer = engine.runner.trunk.layers[0]
    assert all(isinstance(w, torch.Tensor) for w in (target_layer.qkv, target_layer.o, target_layer.down))
    greedy = make_request(prompts[0], max_tokens=24, **GREEDY)
    assert tokens_of(run(engine, {0: [greedy]}), greedy) == greedy_reference(prompts[0], 24)
    assert engine.stats.num_accepted_tokens > 0

    as_loaded = make_engine(model_dirs(method), method, draft_quantization="none")
    assert not as_loaded.config.quantizes_drafter and not _twins(as_loaded)
    # sampled passes read the float weights: q, as draft_logprobs report it, and the seeded tokens are the float
    # drafter's, bit for bit
    sampled, reference = _sampled(prompts[:2]), _sampled(prompts[:2])
    steps, reference_steps = run(engine, {0: sampled}), run(as_loaded, {0: reference})
    for request, expected in zip(sampled, reference):
        assert tokens_of(steps, request) == tokens_of(reference_steps, expected)
        assert _draft_logprobs(steps, request) == _draft_logprobs(reference_steps, expected)
        assert _draft_logprobs(steps, request)


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


@pytest.mark.parametrize("name", MODEL_DRAFTERS)
def test_what_a_request_drafts_does_not_depend_on_its_batch(name, model_dirs, prompts) -> None:  # noqa: F811
    """A greedy request drafts through the twins and a sampled one through the float weights, each in a group of its
    own kind: batched together, each drafts what it does alone and reports it within float32 summation order (a
    greedy request drafting in float32 beside a sampled one would report ~1e-2 away)."""
    method = METHODS[name]

    def both() -> list:
        greedy = make_request(prompts[0], max_tokens=16, logprobs=0, include_draft_logprobs=True, **GREEDY)
        return [greedy, *_sampled(prompts[1:2])]

    together = both()
    together_steps = run(make_engine(model_dirs(method), method), {0: together})
    for i, alone in enumerate(both()):
        alone_steps = run(make_engine(model_dirs(method), method), {0: [alone]})
        assert tokens_of(alone_steps, alone) == tokens_of(together_steps, together[i])
        expected, got = _draft_logprobs(alone_steps, alone), _draft_logprobs(together_steps, together[i])
        assert len(expected) == len(got)
        for a, b in zip(expected, got):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-4)

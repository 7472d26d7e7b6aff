"""method eagle3 against a reference written from the EAGLE-3 paper: transformers' target gives the features (the
inputs of three decoder layers), and plain torch runs the head from its published tensors, entry by entry, each
attending to every entry before it. The engine's drafts and their logits, after the prefill and after decoding,
are the reference's. Also: both published weight namings load, a head that does not fit its target is refused by
the key responsible, and sampling through the head's real q (or as point masses) keeps the target's distribution.
The generic method tests (METHODS in methodfixture.py) run eagle3 too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from shared.config import EngineConfig, SpeculativeConfig
from services.worker.drafting.eagle3 import load_eagle3_head
from services.worker.engine.engine import Engine
from services.worker.model.config import UnsupportedModelError
from services.worker.model.loader import CheckpointError, load_model
from tests.eagle3fixture import eagle3_head_dir  # noqa: F401  (fixtures are used by name)
from tests.methodfixture import (  # noqa: F401
    MAX_MODEL_LEN, METHODS, assert_second_tokens_follow_the_target, encode_prompts, make_request, outputs_of,
    reference_model, run, single_thread,
    tiny_model_dir,
)

pytest.importorskip("transformers")

NUM_DRAFTS = 3
TOLERANCE = 1e-4


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """Rotary embedding of one position, heads [n, head_dim], in Llama's half-split layout."""
    half = x.shape[-1] // 2
    angles = position / theta ** (torch.arange(half, dtype=torch.float32) * 2 / x.shape[-1])
    cos, sin = torch.cat((angles.cos(), angles.cos())), torch.cat((angles.sin(), angles.sin()))
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class ReferenceHead:
    """The head of the paper, from its published tensors: entries appended one by one, each attending to all."""

    def __init__(self, head_dir: Path, embedding: torch.Tensor) -> None:
        self.w = {k: v.float() for k, v in load_file(str(head_dir / "model.safetensors")).items()}
        self.cfg = json.loads((head_dir / "config.json").read_text())
        self.embedding = embedding
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def features(self, layer_inputs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(layer_inputs, dim=-1) @ self.w["fc.weight"].T

    def entry(self, feature: torch.Tensor, token: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, logits over the target's vocabulary) of the entry pairing `feature` with `token` at `position`."""
        cfg, w, eps = self.cfg, self.w, self.cfg["rms_norm_eps"]
        heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        x = torch.cat((_rms(self.embedding[token], w["midlayer.input_layernorm.weight"], eps),
                       _rms(feature, w["midlayer.hidden_norm.weight"], eps)))
        q = (w["midlayer.self_attn.q_proj.weight"] @ x).view(heads, head_dim)
        k = (w["midlayer.self_attn.k_proj.weight"] @ x).view(kv_heads, head_dim)
        v = (w["midlayer.self_attn.v_proj.weight"] @ x).view(kv_heads, head_dim)
        self.keys.append(_rotate(k, position, cfg["rope_theta"]))
        self.values.append(v)
        keys = torch.stack(self.keys).repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, head_dim]
        values = torch.stack(self.values).repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", _rotate(q, position, cfg["rope_theta"]), keys) / head_dim**0.5
        attended = torch.einsum("hn,nhd->hd", scores.softmax(-1), values).flatten()
        h = feature + w["midlayer.self_attn.o_proj.weight"] @ attended
        normed = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
        gate, up = w["midlayer.mlp.gate_proj.weight"] @ normed, w["midlayer.mlp.up_proj.weight"] @ normed
        a = h + w["midlayer.mlp.down_proj.weight"] @ (F.silu(gate) * up)
        draft_logits = w["lm_head.weight"] @ _rms(a, w["norm.weight"], eps)
        logits = torch.full((cfg["vocab_size"],), float("-inf"))
        logits[torch.arange(len(draft_logits)) + w["d2t"].long()] = draft_logits
        return a, logits


@torch.no_grad()
def reference_drafts(reference_model, head_dir: Path, tokens: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy chain drafts after `tokens`, and their logits [NUM_DRAFTS, vocab]."""
    head = ReferenceHead(head_dir, reference_model.model.embed_tokens.weight)
    layers = json.loads((head_dir / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    states = reference_model(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # inputs of layer i
    features = head.features([states[i][0] for i in layers])  # [N, hidden]
    for p in range(1, len(tokens)):  # the prompt's entries: g at p - 1 with the token at p
        a, logits = head.entry(features[p - 1], tokens[p], p)
    drafts, rows = [], []
    for j in range(NUM_DRAFTS):
        draft = int(logits.argmax())
        drafts.append(draft)
        rows.append(logits)
        if j + 1 < NUM_DRAFTS:
            a, logits = head.entry(a, draft, len(tokens) + j)
    return drafts, torch.stack(rows)


def _engine(target: Path, **speculative) -> Engine:
    config = METHODS["eagle3"].config(num_speculative_tokens=NUM_DRAFTS, **speculative)
    return Engine(EngineConfig(model=target, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, speculative=config))


def test_drafts_and_their_logits_are_the_papers_after_prefill_and_after_decoding(
    tiny_model_dir, eagle3_head_dir, reference_model  # noqa: F811
) -> None:
    engine = _engine(tiny_model_dir, draft_quantization="none")  # the reference runs the head as published
    prompt = encode_prompts(tiny_model_dir, ["class Template:\n    delimiter = '$'\n"])[0]
    [seq] = engine.add_request(make_request(prompt, max_tokens=40, temperature=0.0, ignore_eos=True))
    checked = 0
    for _ in range(4):
        engine.step()
        pending = engine.mtp.pending(seq, NUM_DRAFTS)
        drafts, logits = reference_drafts(reference_model, eagle3_head_dir, seq.token_ids)
        assert pending.tokens == drafts
        got = pending.report_logits.cpu()  # a greedy draft reports the head's logits
        assert torch.equal(torch.isinf(got), torch.isinf(logits))
        finite = torch.isfinite(logits)
        torch.testing.assert_close(got[finite], logits[finite], atol=TOLERANCE, rtol=TOLERANCE)
        checked += 1
    assert checked and engine.stats.num_accepted_tokens > 0  # decoding accepted some of them on the way


def _renamed(head_dir: Path, out: Path, rename) -> Path:
    shutil.copytree(head_dir, out)
    state = load_file(str(out / "model.safetensors"))
    save_file({rename(k): v for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def test_the_layer_named_as_a_models_first_loads_the_same(
    tiny_model_dir, eagle3_head_dir, tmp_path  # noqa: F811
) -> None:
    target = load_model(tiny_model_dir)
    vllm_style = _renamed(eagle3_head_dir, tmp_path / "head", lambda k: k.replace("midlayer.", "model.layers.0."))
    ours = load_eagle3_head(eagle3_head_dir, target, torch.float32, "auto", MAX_MODEL_LEN).state_dict()
    theirs = load_eagle3_head(vllm_style, target, torch.float32, "auto", MAX_MODEL_LEN).state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def _with_config(head_dir: Path, out: Path, **changes) -> Path:
    shutil.copytree(head_dir, out)
    config = json.loads((out / "config.json").read_text()) | changes
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("changes", "refusal"), [
    (dict(num_key_value_heads=4), "num_key_value_heads"),
    (dict(head_dim=32), "head_dim"),
    (dict(vocab_size=1024), "vocab_size"),
    (dict(target_hidden_size=128), "target_hidden_size"),
    (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}), "eagle_aux_hidden_state_layer_ids"),
    (dict(num_hidden_layers=2), "num_hidden_layers"),
    (dict(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 head"),
])
def test_a_head_that_does_not_fit_its_target_is_refused_by_key(
    tiny_model_dir, eagle3_head_dir, tmp_path, changes, refusal  # noqa: F811
) -> None:
    head = _with_config(eagle3_head_dir, tmp_path / "head", **changes)
    with pytest.raises(UnsupportedModelError, match=refusal):
        load_eagle3_head(head, load_model(tiny_model_dir), torch.float32, "auto", MAX_MODEL_LEN)


def test_a_broken_vocabulary_map_or_a_missing_tensor_is_refused(
    tiny_model_dir, eagle3_head_dir, tmp_path  # noqa: F811
) -> None:
    target = load_model(tiny_model_dir)
    state = load_file(str(eagle3_head_dir / "model.safetensors"))
    clashing = tmp_path / "clash"
    shutil.copytree(eagle3_head_dir, clashing)
    d2t = state["d2t"].clone()
    d2t[1] = d2t[0] - 1  # draft ids 0 and 1 both name the same target token
    save_file(state | {"d2t": d2t}, str(clashing / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="same target token"):
        load_eagle3_head(clashing, target, torch.float32, "auto", MAX_MODEL_LEN)
    missing = _renamed(eagle3_head_dir, tmp_path / "missing", lambda k: "unknown" if k == "fc.weight" else k)
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_eagle3_head(missing, target, torch.float32, "auto", MAX_MODEL_LEN)


def test_configurations_eagle3_cannot_honour_are_refused(tiny_model_dir, tmp_path) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="num_model_steps"):
        SpeculativeConfig(method="eagle3", num_model_steps=2)
    with pytest.raises(ValueError, match="needs an EAGLE-3 head"):
        _engine(tiny_model_dir, model=tmp_path / "nothing")
    assert SpeculativeConfig(method="eagle3", model=tmp_path, draft_q="point_mass").model == tmp_path


@pytest.mark.parametrize("draft_q", ["model", "point_mass"])
def test_verified_drafts_sample_the_target(
    draft_q, tiny_model_dir, eagle3_head_dir, reference_model  # noqa: F811
) -> None:
    """A request resumed after one token decodes its next one by verifying the head's drafts: over many seeds that
    token follows the target's softmax, whatever q was (zero outside the draft vocabulary, or a point mass)."""
    engine = Engine(EngineConfig(
        model=tiny_model_dir, max_num_seqs=32, max_model_len=MAX_MODEL_LEN,
        speculative=METHODS["eagle3"].config(draft_q=draft_q),
    ))
    prompt = encode_prompts(tiny_model_dir, ["The cache holds "])[0]
    assert_second_tokens_follow_the_target(engine, reference_model, prompt)


def test_sampled_drafts_report_q_which_is_zero_outside_the_draft_vocabulary(
    tiny_model_dir, eagle3_head_dir  # noqa: F811
) -> None:
    engine = _engine(tiny_model_dir)
    prompt = encode_prompts(tiny_model_dir, ["import os\n"])[0]
    request = make_request(prompt, max_tokens=12, temperature=1.0, seed=1, logprobs=1, include_draft_logprobs=True)
    [seq] = engine.add_request(request)
    engine.step()
    pending = engine.mtp.pending(seq, NUM_DRAFTS)
    in_draft_vocab = torch.zeros(pending.probs.shape[-1], dtype=torch.bool)
    in_draft_vocab[engine.runner.model.eagle3.target_ids.cpu()] = True
    assert (pending.probs[:, ~in_draft_vocab] == 0).all()
    torch.testing.assert_close(pending.probs.sum(-1), torch.ones(len(pending.tokens)))
    drafted = [o for o in outputs_of(run(engine, {}), request) if o.draft_tokens]
    assert drafted
    logprobs = np.concatenate([o.draft.logprobs[:, 0] for o in drafted])
    assert (logprobs < 0).all() and (logprobs > -30).all()  # a distribution's, not a point mass's 0.0

"""The parallel draft model's training layout (demo_model/parallel_draft.py): every mask group of a training row sees
what the same masks see after the same tokens in a serving pass, so what training teaches is what serving reads."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import torch

from services.worker.demo_model.draft import DRAFT_SHAPE, DistillConfig, distill
from services.worker.demo_model.parallel_draft import ParallelConfig, add_mask_token, mask_layout
from services.worker.demo_model.teacher_text import TeacherText
from services.worker.engine.engine import Engine
from shared.config import DEFAULT_MODEL_DIR, EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest
from services.worker.demo_model.train import TrainConfig
from services.worker.model.config import ModelConfig
from services.worker.model.llama import CausalLM

SHAPE = TrainConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    mtp_layers=0)


def test_the_layout_places_each_group_after_its_anchor() -> None:
    positions, allowed, targets = mask_layout(6, np.array([1, 3]), levels=2)
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 2, 4, 3, 5]
    assert targets.tolist() == [2, 4, 3, 5]
    assert torch.equal(allowed[:6, :6], torch.ones(6, 6, dtype=torch.bool).tril())
    assert allowed[6].nonzero().flatten().tolist() == [0, 1, 6]  # anchor 1, level 1
    assert allowed[9].nonzero().flatten().tolist() == [0, 1, 2, 3, 7, 9]  # anchor 3, level 2


def test_mask_rows_equal_a_serving_pass_over_the_same_tokens() -> None:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(SHAPE.hf_config())).eval()
    mask = add_mask_token(model)
    assert mask == SHAPE.vocab_size and model.config.vocab_size == SHAPE.vocab_size + 1
    tokens = torch.randint(0, SHAPE.vocab_size, (1, 12))
    anchors, levels = np.array([2, 5, 8]), 3
    positions, allowed, _ = mask_layout(12, anchors, levels)
    rows = torch.cat([tokens, tokens.new_full((1, anchors.size * levels), mask)], dim=1)
    with torch.no_grad():
        trained = model.logits(model(rows, positions[None], attention_mask=allowed))
        for g, anchor in enumerate(anchors.tolist()):
            served = torch.cat([tokens[:, : anchor + 1], tokens.new_full((1, levels), mask)], dim=1)
            expected = model.logits(model(served, torch.arange(anchor + 1 + levels)[None]))[:, -levels:]
            got = trained[:, [12 + level * anchors.size + g for level in range(levels)]]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_draft_trainer_with_parallel_writes_a_checkpoint_the_engine_drafts_in_one_pass(tmp_path) -> None:
    """`specmesh demo-model --draft --parallel`, shortened to a few steps of each phase."""
    cfg = DistillConfig(
        replace(DRAFT_SHAPE, steps=2, batch_size=2, eval_windows=2),
        teacher_text=TeacherText(num_sequences=2, new_tokens=16, batch=2),
        teacher_rows=1, parallel=ParallelConfig(steps=2, anchors=4),
        held_out_text=TeacherText(num_sequences=2, new_tokens=16, sampled_every=0, batch=2),
    )
    report = distill(cfg, DEFAULT_MODEL_DIR, tmp_path)
    assert len(report["greedy_agreement_teacher_text_by_draft"]) == 1 + cfg.parallel.levels
    config = json.loads((tmp_path / "config.json").read_text())
    target_vocab = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["vocab_size"]
    assert config["vocab_size"] == target_vocab + 1 and config["pard_token"] == target_vocab
    engine = Engine(EngineConfig(model=DEFAULT_MODEL_DIR, max_num_seqs=1, speculative=SpeculativeConfig(
        method="draft_model", model=tmp_path, num_speculative_tokens=3, min_draft_confidence=0.0,
    )))
    assert engine.draft.pard_token == target_vocab
    passes = []
    forward = engine.draft.runner.forward
    engine.draft.runner.forward = lambda rows, *args, **kwargs: passes.append(rows) or forward(rows, *args, **kwargs)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request(WorkRequest(request_id="0" * 32, prompt_token_ids=[0, 5, 6, 7], sampling=sampling, created=0))
    while engine.has_work():
        engine.step()
    # k = 3: two masks after the last token while the request has three tokens to go (its budget, then, fewer)
    assert len(passes) > 3 and all(rows[0][-2:] == [target_vocab] * 2 for rows in passes[:3])

"""The CPU's flat trunk (model/flat_trunk.py) against the module tree it flattens: the same hidden states bit for bit
over passes that prefill, decode, verify and mix the three, per sequence, gathered and over the slots' home
regions, over blocks in one run and scattered, for a Llama and a Qwen2 (q/k/v biases) checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine.forward_batch import pack
from services.worker.model.loader import load_model
from services.worker.model.paged_attention import GATHER_MIN_SEQS
from services.worker.engine.runner import ModelRunner
from tests.modelfixture import MODEL_KINDS, make_tiny_model_dir

MAX_MODEL_LEN = 128
BLOCK_SIZE = 16
NUM_BLOCKS = 64
SEQS = 8


def _rows(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 400, (count, length), generator=generator).tolist()


@pytest.mark.parametrize("kind", [kind for kind in MODEL_KINDS if kind != "qwen3_moe"])  # routed experts: modules
def test_flat_trunk_equals_the_modules(tmp_path: Path, kind: str) -> None:
    model = load_model(make_tiny_model_dir(tmp_path, kind), max_model_len=MAX_MODEL_LEN)
    runner = ModelRunner(model, SEQS, MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS)
    blocks = MAX_MODEL_LEN // BLOCK_SIZE
    for slot in range(SEQS):  # one run each, but slot 1's blocks scattered and backwards
        table = list(range(slot * blocks, (slot + 1) * blocks))
        runner.cache.set_block_table(slot, table[::-1] if slot == 1 else table)
    passes = [  # (rows, start positions, slots)
        (_rows(3, 40, 0), [0, 0, 0], [0, 1, 2]),  # prefill
        ([[7], [8, 9, 10, 11], [12, 13]], [40, 40, 40], [0, 1, 2]),  # decode, verify, a short verify
        (_rows(1, 20, 1) + [[5], [6, 7, 8]], [0, 41, 44], [3, 0, 1]),  # a prefill beside decode and verify
        ([[t] for t in range(SEQS)], [1] * SEQS, list(range(SEQS))),  # the batched gather's case
        ([[t, t + 1] for t in range(SEQS)], [2] * SEQS, list(range(SEQS))),
    ]
    assert len(passes[3][0]) >= GATHER_MIN_SEQS
    _check_passes(model, runner, passes)
    runner.cache.set_block_table(1, list(range(blocks, 2 * blocks)))  # now every slot in its home region
    _check_passes(model, runner, [  # decode and verify rows attended in one call over the regions
        ([[t] for t in range(SEQS)], [3] * SEQS, list(range(SEQS))),
        ([[9], [10], [11]], [4, 4, 4], [5, 2, 7]),
        ([[9, 10, 11], [12], [13, 14]], [5, 5, 5], [5, 2, 7]),
    ])


def _check_passes(model, runner: ModelRunner, passes: list) -> None:
    with torch.inference_mode():
        for rows, starts, slots in passes:
            batch = pack(runner.cache, rows, starts, slots, runner.buffers)
            want = model(batch.input_ids, batch.positions, batch)
            got = runner.trunk(batch.input_ids, batch.positions, batch)  # writes the same keys and values again
            assert torch.equal(got, want), (rows, (got - want).abs().max())

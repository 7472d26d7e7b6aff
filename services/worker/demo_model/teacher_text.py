"""The teacher's own text, for on-policy distillation of the draft model.

A draft model drafts continuations of what the target itself wrote: at temperature 0 the target's greedy text, at
temperature 1 its samples. Distilling only on the corpus teaches the student the teacher's distribution at contexts
the teacher seldom produces; adding the teacher's continuations of corpus prompts (DistillSpec's on-policy data)
teaches it where it is used. On the shipped models, the student's greedy agreement on the teacher's greedy text is
the figure that predicts acceptance (training_report.json has both).

The continuations are served by the engine itself, batched: a few seconds on the CPU. Deterministic: greedy rows
and seeded sampled rows, whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.worker.engine.engine import Engine
from shared.config import EngineConfig, SpeculativeConfig
from shared.schemas import SamplingParams, WorkRequest


@dataclass(frozen=True)
class TeacherText:
    num_sequences: int = 2048
    new_tokens: int = 192  # each sequence is a corpus prompt and this many of the teacher's tokens
    sampled_every: int = 2  # every n-th sequence is sampled (temperature 1), the others greedy; 0: none is
    batch: int = 64  # sequences the engine serves at once
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_sequences < 1 or self.new_tokens < 1 or self.sampled_every < 0 or self.batch < 1:
            raise ValueError(f"TeacherText fields must be positive: {self}")


@torch.inference_mode()
def teacher_continuations(target_dir: Path, stream: np.ndarray, seq_len: int, cfg: TeacherText) -> torch.Tensor:
    """[num_sequences, seq_len + 1] token rows, like the corpus windows training reads: a prompt cut from `stream`
    at a seeded offset, then the teacher's new_tokens continuation of it."""
    prompt_len = seq_len + 1 - cfg.new_tokens
    if prompt_len < 1:
        raise ValueError(f"new_tokens ({cfg.new_tokens}) must be shorter than a training window ({seq_len + 1})")
    rng = np.random.default_rng(cfg.seed)
    starts = rng.integers(0, len(stream) - prompt_len, cfg.num_sequences)
    engine = Engine(EngineConfig(
        model=target_dir, max_num_seqs=cfg.batch, speculative=SpeculativeConfig.model_validate({"method": "naive"}),
    ))
    rows: list[list[int]] = []
    for first in range(0, cfg.num_sequences, cfg.batch):
        prompts = [stream[s : s + prompt_len].tolist() for s in starts[first : first + cfg.batch]]
        outputs: list[list[int]] = [[] for _ in prompts]
        for i, prompt in enumerate(prompts):
            index = first + i
            sampled = cfg.sampled_every > 0 and index % cfg.sampled_every == cfg.sampled_every - 1
            sampling = SamplingParams(
                temperature=1.0 if sampled else 0.0, max_tokens=cfg.new_tokens, ignore_eos=True,
                seed=cfg.seed + index if sampled else None,
            )
            engine.add_request(
                WorkRequest(request_id=f"{i:032x}", prompt_token_ids=prompt, sampling=sampling, created=0)
            )
        while engine.has_work():
            for out in engine.step():
                outputs[int(out.seq.request_id, 16)] += out.tokens
        rows += [prompt + output for prompt, output in zip(prompts, outputs)]
    return torch.tensor(rows, dtype=torch.int64)

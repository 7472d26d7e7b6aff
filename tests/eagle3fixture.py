"""A tiny EAGLE-3 head for tests/modelfixture.py's tiny Llama, written beside it (`<dir>-eagle3`, method eagle3's
default) in the published layout.

A random head would almost never agree with the trunk, so the fixture fits one briefly, with the same trainer as
the demo model's (services/worker/demo_model/eagle3_training.py), to the trunk's greedy continuations of random
prompts (a fresh batch for each of FIT_BATCHES steps in turn, so that it generalises to the tests' prompts: about
45% of its greedy drafts match the trunk's choice on unseen continuations). Its draft vocabulary is the
DRAFT_VOCAB_SIZE tokens most frequent in those continuations (fewer than the target's, so that d2t maps draft ids to
target ids as published heads do). The trunk has two layers: the head reads
the inputs of layers 0, 1 and 1.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.worker.demo_model.eagle3_training import HeadTrainConfig, head_config, save_head, train_head
from services.worker.drafting.checkpoints import default_eagle3_dir
from services.worker.model.eagle3 import draft_vocabulary
from services.worker.model.loader import load_model
from tests.modelfixture import tiny_model_dir  # noqa: F401  (the fixture is used by name)
from tests.mtpfixture import FIT_PROMPT_LEN, FIT_SEED, _greedy_texts
from tests.sessioncache import once
from tests.threadfixture import one_torch_thread

FEATURE_LAYERS = (0, 1, 1)
DRAFT_VOCAB_SIZE = 384
FIT_BATCHES = 8
FIT = HeadTrainConfig(
    steps=300, batch_size=16, lr=3e-3, warmup_steps=10, ttt_steps=2, seed=FIT_SEED, bfloat16=False,
    label_temperature=0.05,
)
# For tests that check tokens only, where a head accepted now and then is enough
QUICK_FIT = replace(FIT, steps=60)


def write_eagle3_head(
    target_dir: Path, out_dir: Path, fit: HeadTrainConfig = FIT, num_batches: int = FIT_BATCHES
) -> Path:
    """Fits the head to the trunk in target_dir (on `num_batches` batches of its greedy text) and writes it to out_dir
    (float32)."""
    with one_torch_thread(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(FIT_SEED)
        target = load_model(target_dir)
        batches = [_greedy_texts(target, torch.Generator().manual_seed(FIT_SEED + i)) for i in range(num_batches)]
        generated = torch.cat(batches)[:, FIT_PROMPT_LEN:]
        d2t, t2d = draft_vocabulary(torch.bincount(generated.flatten(), minlength=target.config.vocab_size),
                                    DRAFT_VOCAB_SIZE)
        config = head_config(target.config, FEATURE_LAYERS, DRAFT_VOCAB_SIZE)
        head = train_head(target, config, d2t, lambda step: batches[step % num_batches], fit)
        save_head(head, config, t2d, out_dir, torch.float32)
    return out_dir


def head_beside(tiny_model_dir: Path) -> Path:
    """The tiny Llama's fitted head, at the path method eagle3 looks for by default (fitted once per process)."""
    return once("eagle3_head_dir", lambda: write_eagle3_head(tiny_model_dir, default_eagle3_dir(tiny_model_dir)))


@pytest.fixture(scope="session")
def eagle3_head_dir(tiny_model_dir: Path) -> Path:  # noqa: F811
    return head_beside(tiny_model_dir)

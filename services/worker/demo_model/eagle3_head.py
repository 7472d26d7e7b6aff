"""`specmesh demo-model --eagle3`: trains the demo model's EAGLE-3 head (method eagle3's default, shipped beside it as
specmesh-demo-eagle3) on the demo model's features over the training corpus, with the paper's training-time test
(demo_model/eagle3_training.py). Deterministic; CPU."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from shared.tokenizer import Tokenizer
from services.worker.demo_model.data import encode_documents, load_corpus
from services.worker.demo_model.eagle3_training import (
    HeadTrainConfig, head_config, save_head, target_pass, train_head, unrolled_logits,
)
from services.worker.demo_model.train import _windows
from services.worker.drafting.checkpoints import default_eagle3_dir
from services.worker.model.eagle3 import Eagle3Head, draft_vocabulary
from services.worker.model.llama import CausalLM
from services.worker.model.loader import load_model

# The demo model has 4 layers: EAGLE-3's default (2, L // 2, L - 3) would read layer 2 twice, so the head reads
# the inputs of its last three, low to high.
FEATURE_LAYERS = (1, 2, 3)
DRAFT_VOCAB_SIZE = 3072  # of 4,096: the most frequent tokens of the corpus (published heads keep 32k of 128k)
SEQ_LEN = 128
EVAL_WINDOWS = 64
HEAD_TRAINING = HeadTrainConfig(steps=2400, batch_size=16, ttt_steps=3)


@torch.no_grad()
def agreement(head: Eagle3Head, target: CausalLM, tokens: torch.Tensor, num_steps: int) -> dict[str, float]:
    """How often each unrolled step's greedy draft is the target's greedy choice, on held-out text."""
    target_logits, layer_inputs = target_pass(target, head.config.feature_layers, tokens)
    features = head.features(layer_inputs[:, :-2])
    logits = unrolled_logits(head, target.embed(tokens[:, 1:-1]), features, num_steps)
    draft_ids = torch.arange(head.config.draft_vocab_size) + head.d2t
    choice = target_logits[:, 1:-1].argmax(-1)
    agreement = [(draft_ids[step.argmax(-1)][:, k:] == choice[:, k:]).float().mean().item() for k, step in
                 enumerate(logits)]
    return {f"greedy_agreement_step_{k}": round(value, 4) for k, value in enumerate(agreement)}


def train(cfg: HeadTrainConfig, target_dir: Path, out_dir: Path) -> dict:
    torch.manual_seed(cfg.seed)
    target = load_model(target_dir, torch.float32, "cpu", "auto", 2048).eval()
    corpus = load_corpus()
    tokenizer = Tokenizer(target_dir)
    train_stream = encode_documents(tokenizer, corpus.train)
    held_out_stream = encode_documents(tokenizer, corpus.held_out)
    counts = torch.bincount(torch.from_numpy(train_stream.astype(np.int64)), minlength=target.config.vocab_size)
    d2t, t2d = draft_vocabulary(counts, DRAFT_VOCAB_SIZE)
    coverage = counts[t2d].sum().item() / counts.sum().item()
    config = head_config(target.config, FEATURE_LAYERS, DRAFT_VOCAB_SIZE)
    rng = np.random.default_rng(cfg.seed)
    starts = rng.integers(0, len(train_stream) - SEQ_LEN - 1, (cfg.steps, cfg.batch_size))
    bar = tqdm(total=cfg.steps, desc="training the EAGLE-3 head", unit="step")

    def progress(step: int, loss: float) -> None:
        bar.update()
        bar.set_postfix(loss=f"{loss:.3f}")

    started = time.time()
    head = train_head(target, config, d2t, lambda step: _windows(train_stream, starts[step], SEQ_LEN), cfg, progress)
    bar.close()
    eval_starts = np.linspace(0, len(held_out_stream) - SEQ_LEN - 2, EVAL_WINDOWS).astype(np.int64)
    metrics = agreement(head, target, _windows(held_out_stream, eval_starts, SEQ_LEN), cfg.ttt_steps)
    metrics |= {
        "draft_vocab_coverage": round(coverage, 4),
        "train_seconds": round(time.time() - started),
        "num_parameters": sum(p.numel() for p in head.parameters()),
        "train_config": cfg.__dict__,
    }
    save_head(head, config, t2d, out_dir, torch.bfloat16, metrics)
    return metrics


def run(args: argparse.Namespace) -> dict:
    return train(replace(HEAD_TRAINING, steps=args.steps), args.target, default_eagle3_dir(args.target))

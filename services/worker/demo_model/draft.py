"""`specmesh demo-model --draft`: trains the demo model's draft model (method draft_model's default, shipped beside
it as specmesh-demo-draft) by distillation: a Llama a fraction of the demo model's size, with its tokenizer, learns
the demo model's next-token distributions (KL to the teacher, plus a little cross-entropy) on the same corpus and on
the teacher's own continuations of it (teacher_text.py), the text it drafts for at serving time. Deterministic;
CPU."""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from shared.tokenizer import TOKENIZER_FILE, Tokenizer
from services.worker.demo_model.data import encode_documents, load_corpus
from services.worker.demo_model.parallel_draft import ParallelConfig, adapt, add_mask_token, parallel_agreement
from services.worker.demo_model.teacher_text import TeacherText, teacher_continuations
from services.worker.demo_model.train import TrainConfig, _lr, _windows, save_checkpoint
from services.worker.drafting.checkpoints import default_draft_dir
from services.worker.model.config import PARD_TOKEN_KEY, ModelConfig
from services.worker.model.llama import CausalLM
from services.worker.model.loader import load_model

TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json")
# A quarter of the demo model's width, half its depth: about a fifth of its parameters, most of them the embedding.
DRAFT_SHAPE = TrainConfig(
    hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4, num_kv_heads=2, steps=2400, mtp_layers=0,
)
# What the student's greedy agreement on the teacher's text is measured on: greedy continuations of held-out prompts.
HELD_OUT_TEACHER_TEXT = TeacherText(num_sequences=64, sampled_every=0)
PARALLEL_EVAL_ROWS = 16  # of those, the rows each mask is measured on (every anchor of a row at once: long rows)


@dataclass(frozen=True)
class DistillConfig:
    shape: TrainConfig = DRAFT_SHAPE
    kl_weight: float = 1.0
    ce_weight: float = 0.1  # the corpus' own tokens keep the student honest where the teacher is unsure
    teacher_text: TeacherText = TeacherText()
    teacher_rows: int = 8  # of each batch's rows, how many are the teacher's text (the rest corpus windows)
    held_out_text: TeacherText = HELD_OUT_TEACHER_TEXT
    # then taught to draft in parallel (demo_model/parallel_draft.py); None, the shipped model: autoregressive, which
    # drafts better on this CPU (README)
    parallel: ParallelConfig | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.teacher_rows <= self.shape.batch_size:
            raise ValueError(f"teacher_rows ({self.teacher_rows}) must be within the batch ({self.shape.batch_size})")


@torch.no_grad()
def agreement(student: CausalLM, teacher: CausalLM, tokens: torch.Tensor, first: int = 0) -> tuple[float, float]:
    """How often the student's greedy next token is the teacher's, and the mean KL between them per token, on
    held-out rows tokens [B, L+1], counting predictions from position `first` on."""
    inputs = tokens[:, :-1]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    t_logits = teacher.logits(teacher(inputs, positions))[:, first:]
    s_logits = student.logits(student(inputs, positions))[:, first:, : t_logits.shape[-1]]  # a mask token's column off
    kl = F.kl_div(F.log_softmax(s_logits, -1), F.log_softmax(t_logits, -1), log_target=True, reduction="batchmean")
    return (round((s_logits.argmax(-1) == t_logits.argmax(-1)).float().mean().item(), 4),
            round(kl.item() / s_logits.shape[1], 4))


def distill(cfg: DistillConfig, target_dir: Path, out_dir: Path) -> dict:
    torch.manual_seed(cfg.shape.seed)
    teacher = load_model(target_dir, torch.float32, "cpu", "auto", 2048).eval()
    tokenizer = Tokenizer(target_dir)
    corpus = load_corpus()
    train_stream = encode_documents(tokenizer, corpus.train)
    held_out_stream = encode_documents(tokenizer, corpus.held_out)
    shape = replace(cfg.shape, vocab_size=teacher.config.vocab_size)
    teacher_rows = teacher_continuations(target_dir, train_stream, shape.seq_len, cfg.teacher_text)

    def next_batch(rng: np.random.Generator) -> torch.Tensor:
        """[batch, seq_len + 1]: corpus windows, then rows of the teacher's text."""
        corpus_rows = shape.batch_size - cfg.teacher_rows
        return torch.cat([
            _windows(train_stream, rng.integers(0, len(train_stream) - shape.seq_len - 1, corpus_rows), shape.seq_len),
            teacher_rows[torch.from_numpy(rng.integers(0, len(teacher_rows), cfg.teacher_rows))],
        ])

    student = CausalLM(ModelConfig.from_dict(shape.hf_config()))
    with torch.no_grad():
        for p in student.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(student.parameters(), lr=shape.lr, betas=(0.9, 0.95), weight_decay=shape.weight_decay)
    rng = np.random.default_rng(shape.seed)
    started = time.time()
    for step in (bar := tqdm(range(shape.steps), desc="distilling the draft model", unit="step")):
        for group in opt.param_groups:
            group["lr"] = _lr(shape, step)
        tokens = next_batch(rng)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1]).expand_as(inputs)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            teacher_logp = F.log_softmax(teacher.logits(teacher(inputs, positions)).float(), -1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = student.logits(student(inputs, positions)).float()
        logp = F.log_softmax(logits, -1)
        kl = F.kl_div(logp.flatten(0, 1), teacher_logp.flatten(0, 1), log_target=True, reduction="batchmean")
        ce = F.nll_loss(logp.flatten(0, 1), targets.flatten())
        loss = cfg.kl_weight * kl + cfg.ce_weight * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        bar.set_postfix(kl=f"{kl.item():.3f}", ce=f"{ce.item():.3f}")
    metrics: dict = {}
    if cfg.parallel is not None:
        # PARD adapts an autoregressive draft model as its checkpoint holds it (bfloat16)
        with torch.no_grad():
            for p in student.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        add_mask_token(student)
        metrics |= adapt(student, teacher, next_batch, shape, cfg.parallel)
    starts = np.linspace(0, len(held_out_stream) - shape.seq_len - 2, shape.eval_windows).astype(np.int64)
    student.eval()
    corpus_agreement, corpus_kl = agreement(student, teacher, _windows(held_out_stream, starts, shape.seq_len))
    held_out_text = teacher_continuations(target_dir, held_out_stream, shape.seq_len, cfg.held_out_text)
    first = shape.seq_len - cfg.held_out_text.new_tokens
    text_agreement, text_kl = agreement(student, teacher, held_out_text, first=first)
    metrics |= {
        "greedy_agreement": corpus_agreement, "held_out_kl": corpus_kl,
        "greedy_agreement_teacher_text": text_agreement, "teacher_text_kl": text_kl,
        "teacher_text": {**asdict(cfg.teacher_text), "rows_per_batch": cfg.teacher_rows},
    }
    if cfg.parallel is not None:
        # by draft: the autoregressive one, then each mask's
        metrics["greedy_agreement_teacher_text_by_draft"] = parallel_agreement(
            student, teacher, held_out_text[:PARALLEL_EVAL_ROWS], first, cfg.parallel.levels
        )
    metrics["train_seconds"] = round(time.time() - started)
    metrics["num_parameters"] = sum(p.numel() for p in student.parameters())
    out_dir.mkdir(parents=True, exist_ok=True)
    pard = student.config.pard_token
    grown = {} if pard is None else {"vocab_size": student.config.vocab_size, PARD_TOKEN_KEY: pard}
    save_checkpoint(student, shape, out_dir, metrics, grown)
    for name in TOKENIZER_FILES:
        shutil.copy(target_dir / name, out_dir / name)
    return metrics


def run(args: argparse.Namespace) -> dict:
    parallel = ParallelConfig() if args.parallel else None
    return distill(
        DistillConfig(replace(DRAFT_SHAPE, steps=args.steps), parallel=parallel), args.target,
        default_draft_dir(args.target),
    )

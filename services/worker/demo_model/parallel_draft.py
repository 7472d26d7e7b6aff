"""Turns the demo model's autoregressive draft model into a parallel one (PARD, AMD 2025): one pass drafts k
tokens. Besides its own tokens, the draft model learns a mask token (config key `pard_token`, one id past the
target's vocabulary): fed at positions n+1 .. n+k-1 after the last real token at n, the mask at n+l predicts the token
at n+l+1, so the pass that catches the draft cache up also drafts every token of the step (drafting/draft_model.py).
On this CPU a draft pass is mostly fixed cost, so k-1 chained passes a step become none.

Training rows are the distillation rows (demo_model/draft.py) with mask groups appended: for anchors t, masks at
positions t+1 .. t+levels, each seeing the real tokens up to t and the masks of its own group before it, the layout a
serving pass has. The targets are the teacher's distributions at t+l (its prediction of token t+l+1 given the real
tokens), by KL as in distillation; the real tokens keep their autoregressive KL, since the first draft of a step is
still the autoregressive one."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from services.worker.demo_model.train import TrainConfig, _lr
from services.worker.model.llama import CausalLM

@dataclass(frozen=True)
class ParallelConfig:
    steps: int = 800
    lr: float = 1e-3
    min_lr: float = 5e-5
    warmup_steps: int = 50
    anchors: int = 32  # mask groups per row
    levels: int = 3  # masks per group: drafts k = levels + 1 in one pass

    def schedule(self, shape: TrainConfig) -> TrainConfig:
        """The learning-rate schedule as _lr reads it."""
        return replace(shape, steps=self.steps, lr=self.lr, min_lr=self.min_lr, warmup_steps=self.warmup_steps)


def add_mask_token(student: CausalLM) -> int:
    """Grows the student's (tied) embedding by one row, the mask token's, initialised to the mean embedding; returns
    its id."""
    embed = student.model.embed_tokens
    old = embed.weight.data
    grown = torch.cat([old, old.mean(0, keepdim=True)])
    embed.weight = torch.nn.Parameter(grown)
    embed.num_embeddings = grown.shape[0]
    token = old.shape[0]
    student.config = replace(student.config, vocab_size=grown.shape[0], pard_token=token)
    return token


def mask_layout(length: int, anchors: np.ndarray, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For `length` real positions and mask groups at `anchors` [G]: (positions [length + G * levels], attention mask
    [same, same] bool, the teacher position each mask row learns [G * levels]). Mask rows are laid out level by
    level: row length + l * G + g is anchor g's mask at level l + 1."""
    num = anchors.shape[0]
    total = length + num * levels
    anchor = torch.from_numpy(anchors).long()
    level = torch.arange(1, levels + 1)
    mask_positions = (anchor[None, :] + level[:, None]).flatten()  # [levels * G]
    positions = torch.cat([torch.arange(length), mask_positions])
    allowed = torch.zeros(total, total, dtype=torch.bool)
    allowed[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    group_anchor = anchor.repeat(levels)  # [levels * G]
    allowed[length:, :length] = torch.arange(length)[None, :] <= group_anchor[:, None]
    group_of_row = torch.arange(num).repeat(levels)
    level_of_row = level.repeat_interleave(num)
    same_group = group_of_row[:, None] == group_of_row[None, :]
    earlier_or_self = level_of_row[None, :] <= level_of_row[:, None]
    allowed[length:, length:] = same_group & earlier_or_self
    return positions, allowed, mask_positions


def adapt(student: CausalLM, teacher: CausalLM, next_batch, shape: TrainConfig, cfg: ParallelConfig) -> dict:
    """Trains the student's mask token (add_mask_token first) for cfg.steps on rows from next_batch(rng) [B, L+1];
    returns the held-out-free training summary."""
    mask_token = student.config.pard_token
    vocab = teacher.config.vocab_size
    schedule = cfg.schedule(shape)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=shape.weight_decay)
    rng = np.random.default_rng(shape.seed + 1)
    started = time.time()
    student.train()
    for step in (bar := tqdm(range(cfg.steps), desc="teaching the draft model to draft in parallel", unit="step")):
        for group in opt.param_groups:
            group["lr"] = _lr(schedule, step)
        tokens = next_batch(rng)
        inputs = tokens[:, :-1]
        batch, length = inputs.shape
        anchors = np.sort(rng.choice(length - cfg.levels, cfg.anchors, replace=False))
        positions, allowed, targets = mask_layout(length, anchors, cfg.levels)
        extended = torch.cat([inputs, inputs.new_full((batch, anchors.shape[0] * cfg.levels), mask_token)], dim=1)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            teacher_logp = F.log_softmax(
                teacher.logits(teacher(inputs, torch.arange(length).expand_as(inputs))).float(), -1
            )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = student(extended, positions.expand(batch, -1), attention_mask=allowed)
            logp = F.log_softmax(student.logits(hidden).float()[..., :vocab], -1)
        autoregressive = F.kl_div(
            logp[:, :length].flatten(0, 1), teacher_logp.flatten(0, 1), log_target=True, reduction="batchmean"
        )
        parallel = F.kl_div(
            logp[:, length:].flatten(0, 1), teacher_logp[:, targets].flatten(0, 1), log_target=True,
            reduction="batchmean",
        )
        loss = autoregressive + parallel
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        bar.set_postfix(ar=f"{autoregressive.item():.3f}", parallel=f"{parallel.item():.3f}")
    student.eval()
    return {"parallel_train_seconds": round(time.time() - started), "parallel_steps": cfg.steps,
            "parallel_levels": cfg.levels}


@torch.no_grad()
def parallel_agreement(student: CausalLM, teacher: CausalLM, tokens: torch.Tensor, first: int, levels: int
                       ) -> list[float]:
    """On held-out rows [B, L+1], from position `first` on: how often the mask at each level's greedy token is the
    teacher's greedy next token there (level 0: the student's own autoregressive prediction)."""
    inputs = tokens[:, :-1]
    batch, length = inputs.shape
    anchors = np.arange(first, length - levels)
    positions, allowed, targets = mask_layout(length, anchors, levels)
    extended = torch.cat(
        [inputs, inputs.new_full((batch, anchors.shape[0] * levels), student.config.pard_token)], dim=1
    )
    vocab = teacher.config.vocab_size
    guess = student.logits(student(extended, positions.expand(batch, -1), attention_mask=allowed))[..., :vocab]
    guess = guess.argmax(-1)
    truth = teacher.logits(teacher(inputs, torch.arange(length).expand_as(inputs))).argmax(-1)
    own = (guess[:, first : length - levels] == truth[:, first : length - levels]).float().mean().item()
    result = [round(own, 4)]
    for level in range(levels):
        rows = slice(length + level * anchors.shape[0], length + (level + 1) * anchors.shape[0])
        result.append(round((guess[:, rows] == truth[:, targets[rows.start - length : rows.stop - length]])
                            .float().mean().item(), 4))
    return result

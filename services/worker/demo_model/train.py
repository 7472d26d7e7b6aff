"""`specmesh demo-model`: trains the embedded default model, deterministically, on the standard library source.

The result is a Hugging Face `LlamaForCausalLM` checkpoint (bfloat16 safetensors) plus one MTP module under
`model.mtp_layers.0.*`, which transformers ignores and specmesh uses for drafting. Training runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import Tokenizer
from services.worker.demo_model.data import encode_documents, load_corpus
from services.worker.demo_model.tokenizer import train_tokenizer
from services.worker.model.config import ModelConfig
from services.worker.model.llama import CausalLM
from services.worker.model.weights import split_projections

IGNORE = -100  # cross-entropy target that contributes nothing


@dataclass(frozen=True)
class TrainConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 2500
    lr: float = 3e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.05
    mtp_loss_weight: float = 0.5  # DeepSeek-V3 weights its MTP loss 0.1-0.3; a small model needs a stronger drafter
    eval_windows: int = 64
    seed: int = 0
    mtp_layers: int = 1  # MTP modules (num_nextn_predict_layers); the draft model has none

    def hf_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.hidden_size // self.num_heads,
            "hidden_act": "silu",
            "max_position_embeddings": 2048,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "pad_token_id": 0,
            "torch_dtype": "bfloat16",
            "num_nextn_predict_layers": self.mtp_layers,
        }


def losses(model: CausalLM, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, L+1] -> (next-token loss, MTP loss, trunk logits [B, L, V], MTP logits [B, L-1, V])."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, length = inputs.shape
    positions = torch.arange(length).expand(b, length)
    hidden = model(inputs, positions)  # [B, L, hidden]
    logits = model.logits(hidden)
    main = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    # MTP: hidden at i and token i+1 predict token i+2.
    mtp_hidden = model.mtp_forward(0, hidden[:, :-1], inputs[:, 1:], positions[:, 1:])
    mtp_logits = model.mtp_logits(0, mtp_hidden)  # [B, L-1, V]
    mtp = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]), targets[:, 1:].reshape(-1))
    return main, mtp, logits, mtp_logits


def _windows(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: CausalLM, stream: np.ndarray, cfg: TrainConfig) -> dict[str, float]:
    """Held-out next-token loss, MTP top-1 accuracy, and how often the MTP guess equals the trunk's greedy choice."""
    model.eval()
    starts = np.linspace(0, len(stream) - cfg.seq_len - 2, cfg.eval_windows).astype(np.int64)
    tokens = _windows(stream, starts, cfg.seq_len)
    main, mtp, logits, mtp_logits = losses(model, tokens)
    mtp_guess = mtp_logits.argmax(-1)  # predicts token i+2
    mtp_acc = (mtp_guess == tokens[:, 2:]).float().mean().item()
    agreement = (mtp_guess == logits[:, 1:].argmax(-1)).float().mean().item()
    model.train()
    return {
        "held_out_loss": round(main.item(), 4),
        "held_out_mtp_loss": round(mtp.item(), 4),
        "mtp_top1_accuracy": round(mtp_acc, 4),
        "mtp_greedy_agreement": round(agreement, 4),
    }


def save_checkpoint(model: CausalLM, cfg: TrainConfig, out_dir: Path, metrics: dict, config: dict | None = None
                    ) -> None:
    """config: keys of config.json over cfg's (a parallel draft model's grown vocabulary and mask token)."""
    state = split_projections(model.state_dict(), model.config)  # HF names, so transformers loads it
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg.hf_config() | (config or {}), indent=2) + "\n")
    generation = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    report = {"train_config": asdict(cfg), **metrics}
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


def train(cfg: TrainConfig, out_dir: Path) -> dict:
    torch.manual_seed(cfg.seed)
    corpus = load_corpus()
    tokenizer_dir = out_dir
    train_tokenizer(corpus.train, cfg.vocab_size, tokenizer_dir)
    tokenizer = Tokenizer(tokenizer_dir)
    train_stream = encode_documents(tokenizer, corpus.train)
    held_out_stream = encode_documents(tokenizer, corpus.held_out)
    print(f"corpus: {len(train_stream):,} train tokens, {len(held_out_stream):,} held-out tokens")

    model = CausalLM(ModelConfig.from_dict(cfg.hf_config()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    rng = np.random.default_rng(cfg.seed)
    started = time.time()
    bar = tqdm(range(cfg.steps), desc="training demo model", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        starts = rng.integers(0, len(train_stream) - cfg.seq_len - 1, cfg.batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            main, mtp, _, _ = losses(model, _windows(train_stream, starts, cfg.seq_len))
        loss = main + cfg.mtp_loss_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{main.item():.3f}", mtp=f"{mtp.item():.3f}")
    metrics = evaluate(model, held_out_stream, cfg)
    metrics["train_seconds"] = round(time.time() - started)
    metrics["num_parameters"] = sum(p.numel() for p in model.parameters())
    save_checkpoint(model, cfg, out_dir, metrics)
    return metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR, help="checkpoint directory to write")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: each model's own)")
    drafters = parser.add_mutually_exclusive_group()
    drafters.add_argument(
        "--draft", action="store_true",
        help="train only the draft model (method draft_model), by distillation from the model in --out, into the "
        "directory beside it (<out>-draft)",
    )
    drafters.add_argument(
        "--eagle3", action="store_true",
        help="train only the EAGLE-3 head (method eagle3) of the model in --out, into the directory beside it "
        "(<out>-eagle3); without --draft or --eagle3 the demo model is trained, then its draft model and its head",
    )
    parser.add_argument(
        "--parallel-draft", action="store_true",
        help="then teach the draft model to draft k tokens in one pass (PARD mask token, demo_model/parallel_draft.py)",
    )


def run(args: argparse.Namespace) -> None:
    # The drafters' trainers load the trained model: imported when wanted.
    from services.worker.demo_model import draft, eagle3_head

    only = args.draft or args.eagle3
    if not only:
        args.out.mkdir(parents=True, exist_ok=True)
        metrics = train(TrainConfig(steps=args.steps or TrainConfig.steps), args.out)
        print(json.dumps(metrics, indent=2))
    if args.draft or not only:
        steps = args.steps if args.draft and args.steps else draft.DRAFT_SHAPE.steps
        print(json.dumps(draft.run(argparse.Namespace(target=args.out, steps=steps, parallel=args.parallel_draft)),
                         indent=2))
    if args.eagle3 or not only:
        steps = args.steps if args.eagle3 and args.steps else eagle3_head.HEAD_TRAINING.steps
        print(json.dumps(eagle3_head.run(argparse.Namespace(target=args.out, steps=steps)), indent=2))

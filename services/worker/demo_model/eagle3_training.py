"""Trains an EAGLE-3 head (model/eagle3.py) on a frozen target, with the paper's training-time test, and writes it
in the published layout. `specmesh demo-model --eagle3` trains the demo model's; the tests fit a tiny one with it.

Training-time test: serving feeds the head its own output a in place of the target's feature g from the second
draft on, so training unrolls the same way. Step 0 runs on the target's features; step k > 0 on step k-1's
outputs, shifted one position, with the true tokens. The entry of step k at position p attends as it would while
drafting: to step 0's entries up to p - k (the cache), to step j's entry at p - k + j for 0 < j < k (the earlier
self-fed drafts) and to itself. Every entry learns the target's next-token distribution over the draft vocabulary
(soft labels), step k weighted STEP_DECAY ** k.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from services.worker.demo_model.train import _lr  # the same warmup and cosine decay as the demo model's
from services.worker.model.config import ModelConfig
from services.worker.model.eagle3 import D2T, EAGLE3_ARCHITECTURES, T2D, Eagle3Config, Eagle3Head
from services.worker.model.llama import CausalLM
from services.worker.model.rotary_apply import apply_rotary
from services.worker.model.weights import split_projections

STEP_DECAY = 0.8  # the paper's weight of each further unrolled step


@dataclass(frozen=True)
class HeadTrainConfig:
    steps: int = 800
    batch_size: int = 16
    lr: float = 3e-3
    min_lr: float = 1e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    ttt_steps: int = 3  # unrolled draft steps: what a head drafting k tokens meets
    seed: int = 0
    bfloat16: bool = True  # autocast; a tiny test head trains faster in float32
    # Soft labels at 1 (the paper's); lower sharpens them towards the target's greedy choice, which a random target's
    # near-flat distributions need for a test head to learn anything
    label_temperature: float = 1.0


def head_config(target: ModelConfig, feature_layers: tuple[int, ...], draft_vocab_size: int) -> dict:
    """The head's config.json: a one-layer Llama of the target's attention shape, as EAGLE-3 heads are published."""
    return {
        "architectures": [EAGLE3_ARCHITECTURES[0]],
        "model_type": "llama",
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": target.max_position_embeddings,
        "rope_theta": target.rope_theta,
        "rms_norm_eps": target.rms_norm_eps,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(feature_layers)},
    }


def new_head(target: CausalLM, config: dict, generator: torch.Generator) -> Eagle3Head:
    cfg = Eagle3Config.from_dict(config, target.config)
    head = Eagle3Head(cfg, target.eagle3_cache_layer, own_embedding=False)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02, generator=generator)
    return head


@torch.no_grad()
def target_pass(target: CausalLM, feature_layers: tuple[int, ...], tokens: Tensor) -> tuple[Tensor, Tensor]:
    """tokens [B, L] -> (the target's logits [B, L, vocab], its features' layer inputs [B, L, 3 * hidden])."""
    target.feature_layers = feature_layers
    try:
        rows = target(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))
    finally:
        target.feature_layers = ()
    width = target.config.hidden_size
    return target.logits(rows[..., :width]), rows[..., width:]


def unrolled_logits(head: Eagle3Head, embeds: Tensor, features: Tensor, num_steps: int) -> list[Tensor]:
    """The head's draft logits [B, n, draft vocab] of each unrolled step. Entry i of every step consumes token
    i + 1 (embeds [B, n, hidden]); step 0's reads features[:, i] (g at position i, [B, n, hidden]). Step k's
    entries below k have no real input (they read zeros) and must not be scored."""
    layer = head.midlayer
    attention = layer.self_attn
    b, n, _ = embeds.shape
    positions = torch.arange(1, n + 1).expand(b, n)
    cos_sin = head.rotary(positions, n + 1)
    normed_embeds = layer.input_layernorm(embeds)
    keys: list[Tensor] = []
    values: list[Tensor] = []
    logits = []
    inputs = features
    for k in range(num_steps):
        x = torch.cat((normed_embeds, layer.hidden_norm(inputs)), dim=-1)
        qkv = attention.qkv_proj(x).view(b, n, -1, attention.head_dim)
        rotated = attention.num_heads + attention.num_kv_heads
        qk = apply_rotary(qkv[:, :, :rotated], cos_sin)
        q = qk[:, :, : attention.num_heads]
        keys.append(qk[:, :, attention.num_heads :])
        values.append(qkv[:, :, rotated:])
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2), torch.cat(values, 1).transpose(1, 2),
            attn_mask=training_time_mask(n, k, embeds.device), enable_gqa=True,
        ).transpose(1, 2)
        h, residual = layer.post_attention_layernorm(attention.o_proj(out.flatten(-2)), inputs)
        a = layer.mlp(h) + residual  # [B, n, hidden]
        logits.append(head.lm_head(head.norm(a)))
        inputs = F.pad(a[:, :-1], (0, 0, 1, 0))  # entry i of the next step reads a at i - 1
    return logits


def training_time_mask(n: int, k: int, device: torch.device) -> Tensor:
    """[n, (k + 1) * n] bool: which keys of steps 0..k the step-k entry at each position attends to."""
    i = torch.arange(n, device=device)[:, None]
    m = torch.arange(n, device=device)[None, :]
    blocks = [m <= i - k] + [m == i - k + j for j in range(1, k + 1)]
    return torch.cat(blocks, dim=1)


def head_loss(
    head: Eagle3Head, target: CausalLM, tokens: Tensor, draft_ids: Tensor, num_steps: int, label_temperature: float
) -> Tensor:
    """tokens [B, L] -> the weighted soft cross-entropy of every unrolled step against the target."""
    target_logits, layer_inputs = target_pass(target, head.config.feature_layers, tokens)
    with torch.no_grad():  # entry i predicts token i + 2
        labels = F.softmax(target_logits[:, 1:-1, draft_ids].float() / label_temperature, dim=-1)
    features = head.features(layer_inputs[:, :-2])  # g at positions 0..n-1
    embeds = target.embed(tokens[:, 1:-1]).detach()
    total, weight_sum = 0.0, 0.0
    for k, logits in enumerate(unrolled_logits(head, embeds, features, num_steps)):
        ce = -(labels[:, k:] * F.log_softmax(logits[:, k:].float(), dim=-1)).sum(-1).mean()
        total = total + STEP_DECAY**k * ce
        weight_sum += STEP_DECAY**k
    return total / weight_sum


def train_head(
    target: CausalLM, config: dict, d2t: Tensor, batches: Callable[[int], Tensor], cfg: HeadTrainConfig,
    progress: Callable[[int, float], None] | None = None,
) -> Eagle3Head:
    """Fits a head of `config` (head_config's) with draft vocabulary d2t to the frozen target on batches(step)
    [B, L] of tokens."""
    generator = torch.Generator().manual_seed(cfg.seed)
    head = new_head(target, config, generator)
    head.d2t.copy_(d2t)
    draft_ids = torch.arange(len(d2t)) + d2t  # target ids, in draft order
    target.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bfloat16):
            loss = head_loss(head, target, batches(step), draft_ids, cfg.ttt_steps, cfg.label_temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if progress is not None:
            progress(step, loss.item())
    return head.eval()


def save_head(head: Eagle3Head, config: dict, t2d: Tensor, out_dir: Path, dtype: torch.dtype,
              report: dict | None = None) -> None:
    """Writes the head as published heads are laid out: config.json and model.safetensors with fc, midlayer.*
    (q/k/v and gate/up split), norm, lm_head, d2t and t2d."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in head.state_dict().items() if k != D2T}
    state = split_projections(state, head.config.layer)
    state = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
    state[D2T] = head.d2t.detach().clone()
    state[T2D] = t2d.clone()
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = config | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if report is not None:
        (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


"""EAGLE-3 draft heads (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"), in the layout of the heads published for Llama-3.1-8B and Qwen3.

The head drafts from the target's own features. For the token x_p at position p it reads:
- g_{p-1}: the target's hidden states at position p-1 taken at three depths (the inputs of three decoder layers,
  low, middle and high: `eagle_aux_hidden_state_layer_ids`, by default 2, L // 2 and L - 3 of L layers), concatenated
  and projected to the head's width by `fc` [3 * target hidden -> hidden];
- e_p: the embedding of x_p (the target's embedding, unless the head ships its own).

One decoder layer (`midlayer`) runs on them: its attention reads [input_layernorm(e_p), hidden_norm(g_{p-1})]
(twice the width, so its q/k/v read 2 * hidden), its residual stream starts from g_{p-1}. Its output a_p, before
the head's `norm`, predicts x_{p+1} through `lm_head` over a draft vocabulary of `draft_vocab_size` tokens, draft
token i being target token i + d2t[i]. To draft further, a_p takes the place of g: the next draft d pairs with
(a_p, d), which is the "training-time test" the head was trained under.

That is the pairing of an MTP module, (h_{p-1}, x_p) at position p (model/llama.py), with g in place of h: the
same drafter drives both (drafting/mtp.py), and the head's layer attends to its own KV-cache layer after the
trunk's and the MTP modules'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.worker.engine.forward_batch import ForwardBatch
from services.worker.model.config import ModelConfig, UnsupportedModelError
from services.worker.model.layers import Attention, DecoderLayer, RMSNorm, Rotary, TokenEmbedding
from services.worker.model.plain_module import PlainModule

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_FEATURE_LAYERS = 3  # low, middle, high
D2T = "d2t"  # draft id -> target id minus draft id
T2D = "t2d"  # target id -> whether it is in the draft vocabulary (read by trainers, not by drafting)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose inputs a head reads when its config names none (EAGLE-3's and vLLM's choice)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's decoder layer, rope and norms (its config.json read as a one-layer Llama)
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]  # the target layers whose inputs g concatenates, in this order

    @classmethod
    def from_dict(cls, raw: dict, target: ModelConfig) -> "Eagle3Config":
        """The head's config.json, checked against the target it drafts for; a mismatch is refused by key."""
        archs = raw.get("architectures") or []
        if not set(archs) & set(EAGLE3_ARCHITECTURES):
            raise UnsupportedModelError(
                f"not an EAGLE-3 head: architectures {archs!r}; specmesh reads {', '.join(EAGLE3_ARCHITECTURES)}"
            )
        layer = ModelConfig.from_dict(
            {k: v for k, v in raw.items() if k != "num_nextn_predict_layers"} | {"architectures": ["LlamaForCausalLM"]}
        )
        if raw.get("num_hidden_layers", 1) != 1:
            raise UnsupportedModelError(
                f"num_hidden_layers {raw['num_hidden_layers']}: an EAGLE-3 head has one decoder layer"
            )
        for key in ("num_key_value_heads", "head_dim"):  # its KV entries live in the target's cache
            if getattr(layer, key) != getattr(target, key):
                raise UnsupportedModelError(
                    f"the EAGLE-3 head's {key} ({getattr(layer, key)}) differs from the target's "
                    f"({getattr(target, key)}): its KV entries share the target's cache layout"
                )
        if layer.vocab_size != target.vocab_size:
            raise UnsupportedModelError(
                f"the EAGLE-3 head's vocab_size ({layer.vocab_size}) differs from the target's ({target.vocab_size})"
            )
        draft_vocab_size = int(raw.get("draft_vocab_size") or layer.vocab_size)
        if not 0 < draft_vocab_size <= layer.vocab_size:
            raise UnsupportedModelError(f"draft_vocab_size {draft_vocab_size} must be in 1..{layer.vocab_size}")
        target_hidden_size = int(raw.get("target_hidden_size") or layer.hidden_size)
        if target_hidden_size != target.hidden_size:
            raise UnsupportedModelError(
                f"the EAGLE-3 head reads target features of width {target_hidden_size} (target_hidden_size), "
                f"the target's hidden_size is {target.hidden_size}"
            )
        eagle = raw.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or default_feature_layers(target.num_hidden_layers)
        ids = tuple(int(i) for i in ids)
        if len(ids) != NUM_FEATURE_LAYERS or not all(0 <= i < target.num_hidden_layers for i in ids):
            raise UnsupportedModelError(
                f"eagle_aux_hidden_state_layer_ids {list(ids)}: {NUM_FEATURE_LAYERS} layers of the target's "
                f"{target.num_hidden_layers} are needed"
            )
        return cls(layer, draft_vocab_size, target_hidden_size, ids)

    @classmethod
    def from_dir(cls, head_dir: Path, target: ModelConfig) -> "Eagle3Config":
        path = Path(head_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {head_dir}")
        return cls.from_dict(json.loads(path.read_text()), target)


class FusedInputAttention(Attention):
    """The midlayer's attention: q, k and v read the 2 * hidden concatenation of the embedding and the feature."""

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__(cfg, layer_index)
        qkv_heads = self.num_heads + 2 * self.num_kv_heads
        self.qkv_proj = nn.Linear(2 * cfg.hidden_size, qkv_heads * self.head_dim, bias=False)


class Eagle3Layer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__(cfg, layer_index)
        self.self_attn = FusedInputAttention(cfg, layer_index)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(  # type: ignore[override]
        self, embeds: torch.Tensor, features: torch.Tensor, cos_sin: torch.Tensor, batch: ForwardBatch | None
    ) -> torch.Tensor:
        """embeds e_p, features g_{p-1} [..., hidden] -> a_p [..., hidden], before the head's norm."""
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(features)), dim=-1)
        x = self.self_attn(x, cos_sin, batch)
        x, residual = self.post_attention_layernorm(x, features)
        return self.mlp(x) + residual


class Eagle3Head(PlainModule):
    """Parameter names are the published checkpoints' (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, and
    `embed_tokens` when the head has its own)."""

    def __init__(self, cfg: Eagle3Config, layer_index: int, own_embedding: bool) -> None:
        """layer_index: the KV-cache layer of the midlayer's attention."""
        super().__init__()
        hidden = cfg.layer.hidden_size
        self.config = cfg
        self.fc = nn.Linear(NUM_FEATURE_LAYERS * cfg.target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3Layer(cfg.layer, layer_index)
        self.norm = RMSNorm(hidden, cfg.layer.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, cfg.draft_vocab_size, bias=False)
        self.register_buffer(D2T, torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.embed_tokens = TokenEmbedding(cfg.layer.vocab_size, hidden) if own_embedding else None
        self.rotary = Rotary(cfg.layer)
        # The target ids of the draft vocabulary, in draft order (None: the draft vocabulary is the target's).
        self.target_ids: torch.Tensor | None = None
        self.int8_lm_head: nn.Module | None = None  # lm_head's int8 twin (model/int8_linear.py), when built

    def map_vocabulary(self) -> None:
        """Reads d2t into target_ids, refusing a map that leaves the vocabulary or sends two drafts to one token."""
        target_ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        vocab_size = self.config.layer.vocab_size
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size:
            raise UnsupportedModelError(f"d2t maps draft ids outside the target's {vocab_size} tokens")
        if len(torch.unique(target_ids)) != len(target_ids):
            raise UnsupportedModelError("d2t maps two draft ids to the same target token")
        identity = len(target_ids) == vocab_size and bool((self.d2t == 0).all())
        self.target_ids = None if identity else target_ids

    def features(self, layer_inputs: torch.Tensor) -> torch.Tensor:
        """The target's layer inputs [..., 3 * target hidden], concatenated in feature_layers order -> g
        [..., hidden]."""
        return self.fc(layer_inputs)

    def forward(
        self,
        features: torch.Tensor,  # [..., hidden] g_{p-1}, or a_{p-1} when drafting on
        embeds: torch.Tensor,  # [..., hidden] e_p
        positions: torch.Tensor,  # [...] p
        batch: ForwardBatch | None,
    ) -> torch.Tensor:
        """-> a_p [..., hidden], before the norm; its logits predict x_{p+1}."""
        num_positions = batch.max_context_len if batch is not None else int(positions.max()) + 1
        return self.midlayer(embeds, features, self.rotary(positions, num_positions), batch)

    def logits(self, hidden: torch.Tensor, quantized: bool = False) -> torch.Tensor:
        """a [..., hidden] -> logits [..., target vocab] in float32, -inf at tokens outside the draft vocabulary
        (quantized: through lm_head's int8 twin, when built)."""
        lm_head = self.int8_lm_head if quantized and self.int8_lm_head is not None else self.lm_head
        draft_logits = lm_head(self.norm(hidden)).float()  # [..., draft vocab]
        if self.target_ids is None:
            return draft_logits
        logits = draft_logits.new_full((*draft_logits.shape[:-1], self.config.layer.vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.target_ids, draft_logits)


def draft_vocabulary(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The published d2t and t2d of a draft vocabulary made of the draft_vocab_size most frequent target tokens
    (token_counts [vocab]): d2t [draft vocab] long, t2d [vocab] bool."""
    chosen = torch.sort(torch.topk(token_counts.float(), draft_vocab_size, sorted=True).indices).values
    t2d = torch.zeros(len(token_counts), dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(draft_vocab_size), t2d


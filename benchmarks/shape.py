"""Real-size model shapes without their weights, for the benchmarks' `--shape NAME`.

benchmarks/shapes/<name>/config.json holds a published checkpoint's hyperparameters (Qwen2.5-0.5B, -1.5B, -7B,
Llama-3.2-1B, Llama-3.1-8B, Qwen3-0.6B, Qwen3-8B, Qwen3-30B-A3B, Mistral-7B-v0.3, Gemma-3-1B); the engine loads it
with random weights (load format "dummy",
services/worker/model/dummy.py), and transformers gets a twin with the same values, so the two still decode the
same greedy tokens. Only speed means anything with random weights: text is noise and drafts are rarely accepted.

The shapes ship no tokenizer: their vocabularies (128k-152k ids) are far larger than the demo tokenizer's 4,096,
whose table could not decode what they emit. Prompts are token ids from a seeded generator instead, and the
engine takes its EOS ids from config.json (shared/tokenizer.model_eos_ids); the mesh (gateway, detokenizer)
needs a tokenizer and does not serve these directories.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from services.worker.model.config import ModelConfig
from services.worker.model.dummy import dummy_state_dict
from services.worker.model.llama import CausalLM
from services.worker.model.loader import NORM_WEIGHT, load_model
from services.worker.model.weights import split_projections

SHAPES_DIR = Path(__file__).resolve().parent / "shapes"
PROMPT_SEED = 0
# Ids below this are left out of random prompts: special and byte tokens sit at the start of most vocabularies.
FIRST_PROMPT_ID = 256
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shape_names() -> list[str]:
    return sorted(p.parent.name for p in SHAPES_DIR.glob("*/config.json"))


def shape_dir(name: str) -> Path:
    path = SHAPES_DIR / name
    if not (path / "config.json").is_file():
        raise ValueError(f"unknown shape {name!r}; benchmarks/shapes has {', '.join(shape_names())}")
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--shape and --dtype, beside a benchmark's own --model."""
    parser.add_argument(
        "--shape", choices=shape_names(), default=None,
        help="a real-size shape with random weights (benchmarks/shapes) instead of --model's checkpoint",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=list(DTYPES), help="the engine's (and transformers') dtype"
    )


def model_source(args: argparse.Namespace) -> tuple[Path, str]:
    """(model directory, load format) that --shape or --model name."""
    return (shape_dir(args.shape), "dummy") if args.shape else (Path(args.model), "auto")


def dummy_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    """Shape `name` as specmesh's model, with random weights made on `device`."""
    return load_model(shape_dir(name), dtype, device, load_format="dummy")


def transformers_model(model_dir: Path, load_format: str, dtype: torch.dtype, device: str):
    """transformers' model of the directory: the checkpoint, or for a dummy load the same random weights that
    specmesh's engine draws on this device."""
    import transformers  # a dev dependency, as in every benchmark that compares against it

    if load_format == "auto":
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        shell = CausalLM(cfg)
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        twin = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    state = split_projections(_stacked_experts(_offset_norms(dummy_state_dict(shell, dtype, device), cfg), cfg), cfg)
    loaded = twin.load_state_dict(state, strict=False)
    # A tied head is the embedding itself in both models; MTP modules have no place in transformers'.
    missing = set(loaded.missing_keys) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    unexpected = [k for k in loaded.unexpected_keys if ".mtp_layers." not in k]
    if missing or unexpected:
        raise ValueError(f"dummy weights do not fit transformers' model: missing {sorted(missing)[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return twin.eval()


def _offset_norms(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Norm weights as a checkpoint stores them where they are offsets (Gemma's): specmesh folds the offset in at
    load (model/loader.py), so its dummy weights are the factors."""
    if not cfg.norm_weight_offset:
        return state
    return {k: v - cfg.norm_weight_offset if k.endswith(NORM_WEIGHT) else v for k, v in state.items()}


def _stacked_experts(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Routed experts as transformers 5 holds them in memory: each layer's [experts, 2 x intermediate, hidden] gate/up
    (gate rows first, as specmesh merges them) and [experts, hidden, intermediate] down projections."""
    stacked = dict(state)
    for layer in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        if f"{prefix}0.gate_up_proj.weight" not in state:
            continue
        for name in ("gate_up_proj", "down_proj"):
            stacked[f"{prefix}{name}"] = torch.stack(
                [stacked.pop(f"{prefix}{e}.{name}.weight") for e in range(cfg.num_experts)]
            )
    return stacked


def random_prompt(vocab_size: int, length: int, seed: int = PROMPT_SEED) -> list[int]:
    """length token ids drawn uniformly from [FIRST_PROMPT_ID, vocab_size), the same for the same arguments."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PROMPT_ID, vocab_size, (length,), generator=generator).tolist()

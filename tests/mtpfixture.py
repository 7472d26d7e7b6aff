"""Tiny checkpoints with one MTP module, in each weight layout specmesh reads (services/worker/model/mtp_layout.py).

The trunk is tests/modelfixture.py's tiny random Llama. A random MTP module would almost never agree with it,
so the fixture fits one briefly to the trunk's own greedy choices: MTP(h_{p-1}, x_p) learns argmax logits(h_p),
which is what drafting needs for drafts to be accepted. The same module is then written three ways.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from services.worker.model.llama import MTPLayer
from services.worker.model.loader import load_model
from services.worker.model.weights import split_projections
from tests.modelfixture import tiny_model_dir  # noqa: F401  (the fixture is used by name)
from tests.sessioncache import once
from tests.threadfixture import one_torch_thread

LAYOUTS = ("specmesh", "deepseek", "mimo")
WEIGHTS_FILE = "model.safetensors"
FIT_SEED = 1
FIT_PROMPTS = 16
FIT_PROMPT_LEN = 8
FIT_GENERATED = 56  # greedy tokens per prompt: the kind of text the tests draft on
FIT_STEPS = 300
FIT_LR = 3e-3


@torch.no_grad()
def _greedy_texts(model, generator: torch.Generator) -> torch.Tensor:
    """[FIT_PROMPTS, FIT_PROMPT_LEN + FIT_GENERATED] random prompts continued greedily by the trunk."""
    ids = torch.randint(model.config.vocab_size, (FIT_PROMPTS, FIT_PROMPT_LEN), generator=generator)
    for _ in range(FIT_GENERATED):
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        next_ids = model.logits(model(ids, positions)[:, -1]).argmax(-1)
        ids = torch.cat([ids, next_ids[:, None]], dim=1)
    return ids


def fit_mtp_module(model_dir: Path) -> dict[str, torch.Tensor]:
    """An MTP module's tensors (names relative to the module) fitted to the trunk of model_dir.

    Single-threaded: on a shared 2-core machine two threads make these small ops about ten times slower.
    """
    with one_torch_thread():
        return _fit(model_dir)


def _fit(model_dir: Path) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(FIT_SEED)
        generator = torch.Generator().manual_seed(FIT_SEED)
        model = load_model(model_dir)
        cfg = model.config
        ids = _greedy_texts(model, generator)
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        with torch.no_grad():
            hidden = model(ids, positions)
            targets = model.logits(hidden).argmax(-1)[:, 1:]  # the trunk's choice after token p, p >= 1
            embeds = model.model.embed_tokens(ids[:, 1:])
        module = MTPLayer(cfg, cfg.num_hidden_layers)
        rope = model.rotary(positions[:, 1:], ids.shape[1])
        optimizer = torch.optim.Adam(module.parameters(), lr=FIT_LR)
        for _ in range(FIT_STEPS):
            x = module.eh_proj(torch.cat((module.enorm(embeds), module.hnorm(hidden[:, :-1])), dim=-1))
            out = module.final_layernorm(sum(module(x, None, rope, None)))  # layer output + residual
            logits = model._head(out)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    # Hugging Face's names (separate q/k/v, gate/up), as a real checkpoint stores them.
    return {k: v.detach().clone() for k, v in split_projections(module.state_dict(), cfg).items()}


def _layout(module: dict[str, torch.Tensor], layout: str, trunk: dict[str, torch.Tensor], num_layers: int):
    """The module's tensors under the names (and the fusion column order) of one checkpoint layout."""
    if layout == "specmesh":
        return {f"model.mtp_layers.0.{k}": v for k, v in module.items()}
    if layout == "deepseek":
        renamed = {("shared_head.norm.weight" if k == "final_layernorm.weight" else k): v for k, v in module.items()}
        renamed["embed_tokens.weight"] = trunk["model.embed_tokens.weight"].clone()
        renamed["shared_head.head.weight"] = trunk["lm_head.weight"].clone()
        return {f"model.layers.{num_layers}.{k}": v for k, v in renamed.items()}
    names = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight"}
    renamed = {names.get(k, k): v for k, v in module.items() if k != "eh_proj.weight"}
    embed_part, hidden_part = module["eh_proj.weight"].chunk(2, dim=1)
    renamed["input_proj.weight"] = torch.cat([hidden_part, embed_part], dim=1).contiguous()  # reads [hidden, embeds]
    return {f"model.mtp_layers.0.{k}": v for k, v in renamed.items()}


def write_mtp_checkpoint(trunk_dir: Path, out_dir: Path, module: dict[str, torch.Tensor], layout: str) -> Path:
    """A copy of trunk_dir with the module appended to its weights and num_nextn_predict_layers set."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    shutil.copytree(trunk_dir, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    trunk = load_file(str(out_dir / WEIGHTS_FILE))
    save_file({**trunk, **_layout(module, layout, trunk, config["num_hidden_layers"])}, str(out_dir / WEIGHTS_FILE))
    return out_dir


@pytest.fixture(scope="session")
def mtp_model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # noqa: F811
    """The tiny Llama with the same fitted MTP module, one checkpoint per layout."""

    def build() -> dict[str, Path]:
        module = fit_mtp_module(tiny_model_dir)
        root = tmp_path_factory.mktemp("tiny-llama-mtp")
        return {layout: write_mtp_checkpoint(tiny_model_dir, root / layout, module, layout) for layout in LAYOUTS}

    return once("mtp_model_dirs", build)

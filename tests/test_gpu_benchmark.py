"""benchmarks/gpu.py, run on the CPU over a tiny config.json (the GPU rows come from a GPU run): it writes its
JSON, PNG and table with every field the README's rows are read from, specmesh's greedy tokens equal
transformers' on the same dummy weights, and the weight-read floor counts the bytes a decode step reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu
from tests.modelfixture import MODEL_SHAPE
from tests.threadfixture import single_thread  # noqa: F401  (fixtures are used by name)

pytest.importorskip("transformers")

VOCAB_SIZE = 512  # past benchmarks/shape.FIRST_PROMPT_ID, where random prompt ids start
BATCHES, CONTEXTS = (1, 2), (8, 16)
ROW_FIELDS = {"shape", "system", "batch", "context", "cuda_graphs", "ms_per_step", "tokens_per_s"}


def _tiny_shape(path: Path, **overrides) -> Path:
    config = MODEL_SHAPE | dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB_SIZE,
                                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False) | overrides
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_benchmark_runs_on_the_cpu_and_writes_its_report(tmp_path: Path) -> None:
    untied, tied = _tiny_shape(tmp_path / "tiny-llama"), _tiny_shape(tmp_path / "tiny-tied", tie_word_embeddings=True)
    out = tmp_path / "out"
    gpu.main([
        "--shape-dir", str(untied), "--shape-dir", str(tied), "--device", "cpu", "--dtype", "float32",
        "--batches", *map(str, BATCHES), "--contexts", *map(str, CONTEXTS), "--warmup-steps", "1", "--steps", "2",
        "--repeats", "1", "--copy-mib", "4", "--out", str(out),
    ])
    report = json.loads((out / "gpu.json").read_text())
    assert (out / "gpu.png").stat().st_size > 0 and "| tiny-llama |" in (out / "table.md").read_text()
    assert report["copy_bandwidth_gb_s"] > 0 and report["transformers_mode"].startswith("static cache, eager")
    rows = report["rows"]
    assert all(ROW_FIELDS <= r.keys() and r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    for name in ("tiny-llama", "tiny-tied"):
        cases = {(r["system"], r["batch"], r["context"]) for r in rows if r["shape"] == name}
        grid = {(b, c) for b in BATCHES for c in CONTEXTS}
        assert cases == ({(gpu.GRAPHS, b, c) for b, c in grid} | {(gpu.TRANSFORMERS, b, c) for b, c in grid}
                         | {(gpu.EAGER, 1, c) for c in CONTEXTS})
    assert all(r["same_tokens"] == 1.0 for r in rows if r["system"] != gpu.TRANSFORMERS)
    assert not any(r["cuda_graphs"] for r in rows)  # the CPU runs every pass eagerly

    hidden, inter = MODEL_SHAPE["hidden_size"], MODEL_SHAPE["intermediate_size"]
    layers = MODEL_SHAPE["num_hidden_layers"]
    head_dim = hidden // MODEL_SHAPE["num_attention_heads"]
    qkv = (MODEL_SHAPE["num_attention_heads"] + 2 * MODEL_SHAPE["num_key_value_heads"]) * head_dim
    layer = hidden * qkv + hidden * hidden + 3 * hidden * inter + 2 * hidden  # projections and two norms
    read = 4 * (layers * layer + hidden + VOCAB_SIZE * hidden)  # float32: layers, final norm, head
    floors = {s["shape"]: s for s in report["shapes"]}
    for name, embedding in (("tiny-llama", VOCAB_SIZE * hidden), ("tiny-tied", 0)):
        floor = floors[name]["floor"]
        assert floor["read_bytes_per_step"] == read and floor["weight_bytes"] == read + 4 * embedding
        assert floor["ms_per_step"] == pytest.approx(1e3 * read / (1e9 * report["copy_bandwidth_gb_s"]))
        assert set(floors[name]["graphs_speedup_batch1"]) == {str(c) for c in CONTEXTS}

"""Configuration models, validated where they are built and handed to each component whole."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "specmesh-demo"
# Rows a step computes with chunked prefill: measured on a 2-core CPU with the demo model (README, "Chunked prefill")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
MIN_NUM_BATCHED_TOKENS = 16  # a block of prompt tokens, the least a step may compute
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # EngineConfig.dtype's choices, torch-free
MAX_TENSOR_PARALLEL_SIZE = 64
DEFAULT_MODEL_STEPS = 1
DEFAULT_MIN_DRAFT_CONFIDENCE = 0.2  # see min_draft_confidence
MODEL_DRAFTERS = ("mtp", "draft_model", "eagle3")  # methods whose drafts are drawn from a model's q
DRAFTING_METHODS = ("ngram", "suffix", "mtp", "draft_model", "eagle3")  # every method but naive
NUM_DRAFTS_KEY = "num_speculative_tokens"  # 0 under naive says what naive does
# Keys only some methods read (SpeculativeConfig._readers), with who reads them, for the refusal
METHOD_KEYS = {
    NUM_DRAFTS_KEY: 'every method but "naive"',
    "max_ngram_size": 'method "ngram" and every method\'s predicted-output drafts (not "naive", which drafts none)',
    "min_ngram_size": 'method "ngram", and "mtp" with mtp_strategy "with_ngram"',
    **{
        f"suffix_decoding_{name}": 'method "suffix"'
        for name in ("max_tree_depth", "max_cached_requests", "max_spec_factor", "min_token_prob")
    },
}
HIDDEN_STATE_DRAFTERS = ("mtp", "eagle3")  # drafters that read the target's hidden states (drafting/mtp.py)


class SpeculativeConfig(BaseModel):
    """`--speculative-config` JSON. Keys follow FastDeploy's speculative decoding options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["naive", "ngram", "suffix", "mtp", "draft_model", "eagle3"] = "ngram"
    num_speculative_tokens: int = Field(3, ge=0, le=8)
    # ngram (prompt lookup), also the filler of mtp_strategy "with_ngram"
    max_ngram_size: int = Field(5, ge=1)
    min_ngram_size: int = Field(2, ge=1)
    # mtp: how many tokens the MTP module drafts by feeding itself; "with_ngram" fills the rest with ngram
    num_model_steps: int = Field(DEFAULT_MODEL_STEPS, ge=1)
    mtp_strategy: Literal["default", "with_ngram"] = "default"
    # draft_model: the draft checkpoint (the target's tokenizer); None: the one shipped beside the target,
    # `<model>-draft` (services/worker/drafting/draft_model.py). eagle3: the EAGLE-3 head's directory; None:
    # `<model>-eagle3` (services/worker/drafting/eagle3.py). eagle3 drafts num_speculative_tokens by feeding itself.
    model: Path | None = None
    # suffix decoding over this request's tokens and recent requests' outputs. Depth 24, not 64: every token a
    # request appends (and every token of a finished output, inserted at once) walks up to depth open suffixes;
    # suffix k=8, greedy, one engine thread: +4% tok/s at batch 8 and +8% at 32 (held-out standard-library
    # prompts, in-process), +3% through the mesh at one stream on aiohttp's code; tokens accepted per step within 1%.
    suffix_decoding_max_tree_depth: int = Field(24, ge=1)
    suffix_decoding_max_cached_requests: int = Field(1000, ge=0)
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0.0)
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0.0, le=1.0)
    # verification: rejection and target_match are lossless; greedy and topp are not (see docs/api.md)
    verify_strategy: Literal["rejection", "target_match", "greedy", "topp"] = "rejection"
    accept_policy: Literal["normal", "accept_all", "reject_all"] = "normal"
    # adaptive: choose each request's number of drafts per step from its acceptance, the batch size and the step's
    # measured cost (drafting/adaptive.py). None (the default): on for the point-mass drafters (ngram, suffix), whose
    # output, seeded samples included, does not depend on how many drafts a step verifies; off for MTP, whose seeded
    # samples under `rejection` would then depend on the step timings. At temperature 1 (the API's default, and what
    # load generators send) fixed ngram drafts cost 25-28% of plain decoding's throughput at batch 8 on this CPU,
    # adaptive 4-13%; at temperature 0 it matches fixed drafts at batch 1 and 8 on held-out code.
    adaptive: bool | None = None
    # Structured output: draft the tokens a request's grammar forces (a schema's keys and punctuation) on top of the
    # method's drafts, with q = 1 (services/worker/grammar/constrain.py); off only to measure what it gains
    grammar_drafts: bool = True
    # How a model drafter's (mtp, draft_model) drafts are verified: against their real q (the default), or as point
    # masses (q(x) = 1), as most servers do; lossless either way, the real q accepts more when sampling (seed 003)
    draft_q: Literal["model", "point_mass"] = "model"
    # "int8": greedy requests draft through int8 twins of the model drafter's weights, one scale per output row
    # (services/worker/model/int8_linear.py: 2.2-2.8x faster projections on the CPU), for their logits and the chain
    # passes after the first draft, apart from sampled requests; those and the catch-up passes keep the float
    # weights, so seeded samples and cached drafter entries are what they were. "none": float throughout. "auto"
    # (the default): int8 for a CPU engine not split over ranks, none elsewhere. Lossless either way: drafts only
    # propose.
    draft_quantization: Literal["auto", "none", "int8"] = "auto"
    # A model drafter stops a sequence's chain after a draft whose probability under its own distribution (at
    # temperature 1) is below this, as EAGLE-2 sizes its drafts: an unlikely draft is likely rejected, and the
    # drafting passes after it and their verify rows would be spent for nothing. 0: always num_speculative_tokens.
    # 0.2 against 0, demo model, batch 1, k=3, in-process on held-out code: greedy eagle3 626 -> 679 tok/s, mtp
    # 640 -> 670, draft_model 455 -> 556; at temperature 1, 343 -> 436, 355 -> 434, 337 -> 456.
    min_draft_confidence: float = Field(DEFAULT_MIN_DRAFT_CONFIDENCE, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.min_ngram_size > self.max_ngram_size and self.method in self._readers("min_ngram_size"):
            raise ValueError(
                f"min_ngram_size ({self.min_ngram_size}) must not exceed max_ngram_size ({self.max_ngram_size})"
            )
        if self.method == "mtp" and self.num_model_steps > max(1, self.num_speculative_tokens):
            raise ValueError(
                f"num_model_steps ({self.num_model_steps}) must not exceed "
                f"num_speculative_tokens ({self.num_speculative_tokens})"
            )
        if self.draft_q != "model" and self.method not in MODEL_DRAFTERS:
            raise ValueError(f"draft_q applies to the model drafters only (method {', '.join(MODEL_DRAFTERS)})")
        if self.draft_quantization != "auto" and self.method not in MODEL_DRAFTERS:
            raise ValueError(
                f"draft_quantization applies to the model drafters only (method {', '.join(MODEL_DRAFTERS)})"
            )
        if self.min_draft_confidence != DEFAULT_MIN_DRAFT_CONFIDENCE and self.method not in MODEL_DRAFTERS:
            raise ValueError(
                f"min_draft_confidence applies to the model drafters only (method {', '.join(MODEL_DRAFTERS)})"
            )
        if self.model is not None and self.method not in ("draft_model", "eagle3"):
            raise ValueError('"model" names a draft checkpoint: it applies to methods "draft_model" and "eagle3" only')
        # Checked by value, not by whether the key was given: a whole config, dumped and read back, carries it.
        if self.num_model_steps != DEFAULT_MODEL_STEPS and self.method != "mtp":
            raise ValueError(
                'num_model_steps applies to method "mtp" only (draft_model and eagle3 draft num_speculative_tokens '
                "by feeding themselves)"
            )
        if self.mtp_strategy != "default" and self.method != "mtp":
            raise ValueError('mtp_strategy applies to method "mtp" only')
        self._check_method_keys()
        return self

    def _check_method_keys(self) -> None:
        """A key the method never reads, set away from its default, is refused by name rather than ignored."""
        for key in METHOD_KEYS:
            value = getattr(self, key)
            if value == type(self).model_fields[key].default or (key == NUM_DRAFTS_KEY and value == 0):
                continue
            if key != NUM_DRAFTS_KEY and self.num_speculative_tokens == 0:
                raise ValueError(f"{key} ({value}) is not read with {NUM_DRAFTS_KEY} 0: no drafts are made")
            readers = self._readers(key)
            if self.method not in readers:
                raise ValueError(
                    f'{key} ({value}) is not read by method "{self.method}": it applies to {METHOD_KEYS[key]}'
                )

    def _readers(self, key: str) -> tuple[str, ...]:
        if key == "min_ngram_size":
            return ("ngram", "mtp") if self.mtp_strategy == "with_ngram" else ("ngram",)
        return ("suffix",) if key.startswith("suffix_decoding_") else DRAFTING_METHODS

    @property
    def adaptive_drafts(self) -> bool:
        """Whether the number of drafts adapts (`adaptive`, or by default whether the drafter proposes point masses)."""
        return self.method in ("ngram", "suffix") if self.adaptive is None else self.adaptive

    @property
    def num_drafter_steps(self) -> int:
        """Drafts a hidden-state drafter (the MTP module, an EAGLE-3 head) makes per step by feeding itself."""
        return self.num_model_steps if self.method == "mtp" else self.num_speculative_tokens

    @property
    def num_drafts(self) -> int:
        """Drafts proposed per sequence and step (naive proposes none)."""
        return 0 if self.method == "naive" else self.num_speculative_tokens

    @classmethod
    def from_json(cls, text: str | None) -> "SpeculativeConfig":
        return cls() if not text else cls.model_validate(orjson.loads(text))


WorkerRole = Literal["both", "prefill", "decode"]
DEVICE_PATTERN = r"cpu|cuda(:[0-9]+)?"


class EngineConfig(BaseModel):
    """Everything the worker's engine needs to load a model and schedule sequences."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path = DEFAULT_MODEL_DIR
    max_num_seqs: int = Field(64, ge=1, le=1024)
    max_model_len: int = Field(1024, ge=16)
    device: str = "cpu"  # cpu, cuda or cuda:N (unsplit)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    speculative: SpeculativeConfig = SpeculativeConfig()
    # KV cache blocks of block_size positions; None: enough for max_num_seqs full-length sequences (no preemption)
    # if kv_cache_memory holds them, else as many as it holds (services/worker/engine/kv_budget.py)
    num_kv_blocks: int | None = Field(None, ge=1)
    # Bytes the KV cache may take per worker process; None: a default from the device's memory (kv_budget.py)
    kv_cache_memory: int | None = Field(None, ge=1)
    # CUDA: the share of the device's free memory the default KV budget starts from (vLLM's option of the same name)
    gpu_memory_utilization: float = Field(DEFAULT_GPU_MEMORY_UTILIZATION, gt=0.0, le=1.0)
    block_size: int = Field(16, ge=1)
    # auto: the checkpoint's weights; dummy: random weights from config.json alone (speed measurements only)
    load_format: Literal["auto", "dummy"] = "auto"
    # CUDA: decode and verify passes run as CUDA graphs unless this is set (the CPU always runs eagerly)
    enforce_eager: bool = False
    # Keep computed prompt (and output) blocks for later requests that start the same way
    enable_prefix_caching: bool = True
    # Chunked prefill: a step computes at most max_num_batched_tokens rows, decoding sequences' first, so that a long
    # prompt is prefilled over several steps instead of stalling every running stream for one long one
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = Field(DEFAULT_MAX_NUM_BATCHED_TOKENS, ge=MIN_NUM_BATCHED_TOKENS)
    # Prefill/decode disaggregation (services/worker/handoff/): "prefill" computes prompts and their first token and
    # hands each request, with its KV blocks, to a "decode" worker; "both" does the whole request
    role: WorkerRole = "both"
    # Ranks the model is split over (services/worker/tensor_parallel/): processes of one machine, one GPU each on
    # CUDA; their passes run eagerly (no CUDA graphs)
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_TENSOR_PARALLEL_SIZE)
    # Routed experts split over the tensor-parallel ranks by expert, each rank holding num_experts / size whole
    # experts, instead of a slice of every expert (vLLM's --enable-expert-parallel)
    enable_expert_parallel: bool = False

    @field_validator("device")
    @classmethod
    def _a_torch_device(cls, value: str) -> str:
        if not re.fullmatch(DEVICE_PATTERN, value):
            raise ValueError("must be cpu, cuda or cuda:N")
        return value

    @model_validator(mode="after")
    def _splits_what_can_be_split(self) -> "EngineConfig":
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda:"):
            raise ValueError(f"with tensor_parallel_size {self.tensor_parallel_size} rank r runs on cuda:r: give "
                             f"device cuda, not {self.device!r}")
        if self.gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION and (
            not self.device.startswith("cuda") or self.kv_cache_memory is not None
        ):
            raise ValueError(
                f"gpu_memory_utilization ({self.gpu_memory_utilization}) sizes the default KV budget on CUDA: on "
                f"device {self.device!r}, or beside kv_cache_memory, nothing reads it (give kv_cache_memory alone)"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens != DEFAULT_MAX_NUM_BATCHED_TOKENS:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) bounds the pieces of chunked "
                             "prefill; without it a step prefills whole prompts, whatever this says")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("enable_expert_parallel splits experts over tensor-parallel ranks: it needs "
                             "tensor_parallel_size above 1")
        if self.speculative.draft_quantization == "int8" and (self.device != "cpu" or self.tensor_parallel_size > 1):
            raise ValueError(
                f'draft_quantization "int8" on device {self.device!r} with tensor_parallel_size '
                f'{self.tensor_parallel_size}: int8 drafters run on the CPU, unsplit; use "none" or "auto"'
            )
        return self

    @property
    def quantizes_drafter(self) -> bool:
        """Whether the model drafter's weights are stored as int8 (SpeculativeConfig.draft_quantization)."""
        spec = self.speculative
        if spec.draft_quantization == "auto":
            return spec.method in MODEL_DRAFTERS and self.device == "cpu" and self.tensor_parallel_size == 1
        return spec.draft_quantization == "int8"

    @property
    def graph_query_lens(self) -> tuple[int, ...]:
        """Rows per sequence of the passes captured as CUDA graphs: decode (1) and every verify width up to
        1 + num_drafts (adaptive speculation drafts fewer); none when the passes run eagerly, as they do split over
        tensor-parallel ranks (a captured graph would hold the collectives of one group's communicators)."""
        if self.enforce_eager or not self.device.startswith("cuda") or self.tensor_parallel_size > 1:
            return ()
        return tuple(range(1, 2 + self.speculative.num_drafts))

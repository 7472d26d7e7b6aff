"""Configuration models, validated where they are built and handed to each component whole."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "specmesh-demo"


class SpeculativeConfig(BaseModel):
    """`--speculative-config` JSON. Keys follow FastDeploy's speculative decoding options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["naive", "ngram"] = "ngram"
    num_speculative_tokens: int = Field(3, ge=0, le=8)
    max_ngram_size: int = Field(5, ge=1)
    min_ngram_size: int = Field(2, ge=1)
    verify_strategy: Literal["rejection"] = "rejection"
    accept_policy: Literal["normal", "accept_all", "reject_all"] = "normal"

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.min_ngram_size > self.max_ngram_size:
            raise ValueError(
                f"min_ngram_size ({self.min_ngram_size}) must not exceed max_ngram_size ({self.max_ngram_size})"
            )
        return self

    @property
    def num_drafts(self) -> int:
        """Drafts proposed per sequence and step (naive proposes none)."""
        return 0 if self.method == "naive" else self.num_speculative_tokens

    @classmethod
    def from_json(cls, text: str | None) -> "SpeculativeConfig":
        return cls() if not text else cls.model_validate(orjson.loads(text))


class EngineConfig(BaseModel):
    """Everything the worker's engine needs to load a model and schedule sequences."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path = DEFAULT_MODEL_DIR
    max_num_seqs: int = Field(8, ge=1, le=1024)
    max_model_len: int = Field(1024, ge=16)
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    speculative: SpeculativeConfig = SpeculativeConfig()

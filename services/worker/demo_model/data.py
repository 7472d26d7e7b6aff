"""The demo model's corpus: the Python standard library source that ships with every Python install.

Files are read in sorted order and split into train and held-out sets by a hash of their path, so the same
Python version yields the same corpus everywhere.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.tokenizer import Tokenizer

HELD_OUT_EVERY = 20  # one file in twenty is held out
_SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    train: list[str]
    held_out: list[str]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(root: Path | None = None) -> Corpus:
    root = root or stdlib_root()
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIPPED_DIRS.intersection(rel.parts):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        digest = int.from_bytes(hashlib.sha1(str(rel).encode()).digest()[:4], "little")
        (held_out if digest % HELD_OUT_EVERY == 0 else train).append(text)
    return Corpus(train, held_out)


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream: each document starts with the end-of-text token, as prompts do at serving time."""
    ids = tokenizer.encode_batch(texts, add_special_tokens=True)
    return np.concatenate([np.asarray(x, dtype=np.int32) for x in ids])

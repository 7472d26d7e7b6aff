"""One torch intra-op thread for the tests that run small tensor ops.

The tiny matrices gain nothing from more threads, and on a busy shared CPU the threads of every small op wait on
each other (an engine step runs ~30x slower with two threads than with one). Import `single_thread` into a test
module (`from tests.threadfixture import single_thread`) to run the whole module on one thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread inside the block, on as many as before after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    with one_torch_thread():
        yield

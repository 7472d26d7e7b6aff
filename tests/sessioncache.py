"""Test checkpoints built once per test process.

Test modules import the shared fixtures by name (there is no conftest.py), and pytest gives every module that holds a
fixture its own instance of it, session scope or not: without this memo each module would train its own tiny model
and fit its own MTP module and EAGLE-3 head (~12 s a module). The checkpoints are read, never written, by the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_BUILT: dict[str, object] = {}


def once(key: str, build: Callable[[], T]) -> T:
    """build()'s result, built at the first call with this key in this process."""
    if key not in _BUILT:
        _BUILT[key] = build()
    return _BUILT[key]  # type: ignore[return-value]

"""argparse types for the numeric options of every command and of the options the services share: a value out of
range is refused by argparse, in one line naming the option, before anything starts (a zero --max-num-seqs was a
traceback from a config model, a --port 70000 a gateway dying after the rest of the mesh had started)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

MAX_PORT = 65535


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer option of `minimum` or more."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its own message for a value that is no integer
    return parse


def between(minimum: int, maximum: int) -> Callable[[str], int]:
    """An integer option from `minimum` to `maximum`."""

    def parse(text: str) -> int:
        value = int(text)
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be between {minimum} and {maximum}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def seconds(text: str) -> float:
    """A duration option: more than zero seconds."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def non_negative_seconds(text: str) -> float:
    """A duration option where 0 turns what it times off."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return value


def port(text: str) -> int:
    """A TCP port to listen on."""
    value = int(text)
    if not 1 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be a port between 1 and {MAX_PORT}, got {value}")
    return value


def port_or_any(text: str) -> int:
    """A TCP port to listen on, or 0 for one the system picks."""
    return 0 if int(text) == 0 else port(text)


seconds.__name__ = non_negative_seconds.__name__ = port.__name__ = port_or_any.__name__ = "number"

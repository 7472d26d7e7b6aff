"""Cancelling a task and waiting for it to end, where one cancellation may be lost.

Python 3.11's asyncio.wait_for, which every nats-py request waits in, returns the reply instead of raising when the
cancellation lands in the step its reply arrived (fixed in 3.12): the task goes on as if never cancelled. A task
waited for after its cancel (a background response's run, a request's prompts still being submitted) would then
hold its waiter until it ended on its own, ten minutes for a request no worker takes. (The worker's fetch loops,
which hold no deep call paths, check `cancelling()` after each fetch instead: queue_worker.fetch_loop.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

CANCEL_REPEAT_S = 0.5  # how long a task has to take a cancellation before it is cancelled again


async def cancel_until_done(task: asyncio.Task, cancellable: Callable[[], bool] = lambda: True) -> None:
    """Cancels `task` until it ends; not again once `cancellable()` is false (it took the cancellation and is
    ending, which another cancellation would cut short). An error it ended with is the owner's to read, if any: it
    is not logged as never retrieved."""
    while not task.done():
        if cancellable():
            task.cancel()
        await asyncio.wait([task], timeout=CANCEL_REPEAT_S)
    if not task.cancelled():
        task.exception()


async def to_the_end(aw: Awaitable[T]) -> T:
    """Awaits `aw`, on a task of its own, to its end however often the caller is cancelled meanwhile (asyncio.shield
    alone returns at the first cancellation, the clean-up still running); then raises the cancellation, if any."""
    inner = asyncio.ensure_future(aw)
    cancelled = False
    while not inner.done():
        try:
            await asyncio.shield(inner)
        except asyncio.CancelledError:
            if inner.cancelled():
                raise
            cancelled = True
    if cancelled:
        if not inner.cancelled():
            inner.exception()  # retrieved: the cancellation is what the caller hears
        raise asyncio.CancelledError
    return inner.result()

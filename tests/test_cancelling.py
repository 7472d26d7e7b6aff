"""cancel_until_done: a task whose first cancellation Python 3.11's asyncio.wait_for drops (its awaited reply
arrived in the same step) still ends, and a task that took the cancellation finishes its ending uncut. to_the_end:
clean-up awaited through repeated cancellations finishes before its task ends (asyncio.shield returns at the
first)."""

from __future__ import annotations

import asyncio

from services.gateway.cancelling import cancel_until_done, to_the_end

WAIT_S = 10.0


async def test_a_task_that_dropped_its_cancellation_is_cancelled_again() -> None:
    reply = asyncio.get_running_loop().create_future()
    asked = asyncio.Event()

    async def request_then_wait() -> None:
        asked.set()
        await asyncio.wait_for(reply, timeout=60)  # as nats-py's request waits
        await asyncio.sleep(3600)

    task = asyncio.create_task(request_then_wait())
    await asked.wait()
    reply.set_result(b"reply")  # lands with the cancellation: wait_for returns it on 3.11
    await asyncio.wait_for(cancel_until_done(task), WAIT_S)
    assert task.cancelled()


async def test_an_ending_is_not_cut_short() -> None:
    ending, ended = asyncio.Event(), asyncio.Event()

    async def ends_slowly() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            ending.set()
            await asyncio.sleep(1.5)  # longer than CANCEL_REPEAT_S: a second cancellation would land here
            ended.set()
            raise

    task = asyncio.create_task(ends_slowly())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_until_done(task, cancellable=lambda: not ending.is_set()), WAIT_S)
    assert ended.is_set() and task.cancelled()


async def test_clean_up_awaited_to_the_end_finishes_before_its_task_ends() -> None:
    """As generate() closes a submission: the repeated cancellations land while the close still runs (it waits out
    a dropped cancellation of its own), and the task ends only once the close is done."""
    closed = asyncio.Event()

    async def close() -> None:
        await asyncio.sleep(1.2)  # past two repeats of the cancellation
        closed.set()

    async def serve() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await to_the_end(close())

    task = asyncio.create_task(serve())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_until_done(task), WAIT_S)
    assert task.cancelled() and closed.is_set()

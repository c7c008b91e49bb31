"""`cancel_and_wait` ends its tasks, keeps their errors to them, never swallows a
cancellation of the task that calls it, and ends a task that lost its first cancel."""

from __future__ import annotations

import asyncio

import pytest

from shell.tasks import Shared, cancel_and_wait
from tests.support import wait_for


async def test_children_end_and_their_errors_stay_theirs() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("cleanup went wrong") from None

    forever = asyncio.create_task(asyncio.Event().wait())
    failing = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)  # both are waiting
    await cancel_and_wait(forever, failing, None)
    assert forever.cancelled()
    assert isinstance(failing.exception(), RuntimeError)


async def test_a_cancel_of_the_caller_while_a_child_winds_down_is_not_swallowed() -> None:
    winding_down = asyncio.Event()
    release = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            winding_down.set()
            await release.wait()  # e.g. a last write on the way out
            raise

    child = asyncio.create_task(slow_to_stop())
    carried_on = False

    async def caller() -> None:
        nonlocal carried_on
        await cancel_and_wait(child)
        carried_on = True  # what the swallowing idiom did: step down, then stand by again

    task = asyncio.create_task(caller())
    await winding_down.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not carried_on
    release.set()
    await asyncio.wait({child})
    assert child.cancelled()


async def test_a_task_that_lost_its_first_cancel_is_cancelled_again() -> None:
    lost = asyncio.Event()

    async def loses_one_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            lost.set()  # as Python 3.11's asyncio.wait_for can drop a cancel
        await asyncio.sleep(30)  # runs on (bounded, so a failing run still ends)

    child = asyncio.create_task(loses_one_cancel())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(child, again_s=0.05), 5)
    assert lost.is_set() and child.cancelled()


async def test_a_shared_run_answers_every_caller_and_outlives_one_cancelled() -> None:
    runs: list[str] = []
    release = asyncio.Event()

    async def read(key: str) -> str:
        runs.append(key)
        await release.wait()
        return f"{key}#{len(runs)}"

    shared: Shared[str, str] = Shared()
    first = asyncio.ensure_future(shared.run("a", lambda: read("a")))
    second = asyncio.ensure_future(shared.run("a", lambda: read("a")))
    other = asyncio.ensure_future(shared.run("b", lambda: read("b")))
    await wait_for(lambda: len(runs) == 2, 5.0, what="the two runs started")
    assert sorted(runs) == ["a", "b"] and shared.under_way("a")
    first.cancel()  # one caller gives up: the run goes on for the other
    await wait_for(first.done, 5.0, what="the first caller cancelled")
    release.set()
    assert await second == "a#2" and await other == "b#2"
    assert first.cancelled() and not shared.under_way("a")
    # Once ended nothing is kept: the next caller starts a new run.
    assert await shared.run("a", lambda: read("a")) == "a#3"

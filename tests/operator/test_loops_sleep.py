"""The fleet loops' sleep (operator/loops.py sleep_until) with kopf's own daemon stopper."""

import asyncio

from kopf._core.intents.stoppers import DaemonStopper, DaemonStoppingReason

from adpfleet.operator.loops import sleep_until


def failed_tasks_of(sleep) -> list[BaseException]:
    """Every task started while `sleep` ran that ended in an exception: what kopf, stopping the operator,
    re-raises from the tasks it finds (kopf/_core/reactor/running.py run_tasks, `hung` tasks)."""
    async def main():
        before = asyncio.all_tasks()
        running = asyncio.ensure_future(sleep())
        seen: set[asyncio.Task] = set()
        while not running.done():
            seen |= asyncio.all_tasks() - before
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # what it started has ended
        return [t.exception() for t in seen if t.done() and not t.cancelled() and t.exception() is not None]
    return asyncio.run(main())


def test_a_sleep_that_times_out_leaves_no_task_ended_in_an_error():
    stopper = DaemonStopper()
    assert failed_tasks_of(lambda: sleep_until(asyncio.Event(), stopper.async_waiter, 0.05)) == []


def test_the_sleep_ends_when_woken_or_stopped():
    async def woken():
        wake, stopper = asyncio.Event(), DaemonStopper()
        asyncio.get_running_loop().call_later(0.02, wake.set)
        started = asyncio.get_running_loop().time()
        await sleep_until(wake, stopper.async_waiter, 30)
        woke = asyncio.get_running_loop().time() - started
        asyncio.get_running_loop().call_later(0.02, stopper.set, DaemonStoppingReason.OPERATOR_EXITING)
        started = asyncio.get_running_loop().time()
        await sleep_until(asyncio.Event(), stopper.async_waiter, 30)
        return woke, asyncio.get_running_loop().time() - started
    woke, stopped = asyncio.run(woken())
    assert woke < 5 and stopped < 5

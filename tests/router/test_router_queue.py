"""The router's queue alone (queue.py): bounded, a deadline, woken by pool changes and cool-downs.
The queue in front of real servers: test_router_queue_real.py."""

import asyncio

import pytest

from adpfleet.runtime.router.metrics import RouterMetrics
from adpfleet.runtime.router.queue import RequestQueue


def sample(metrics: RouterMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def run(coro):
    return asyncio.run(coro)


def test_a_waiter_goes_on_when_the_pool_changes_and_not_before():
    async def scenario():
        metrics = RouterMetrics()
        queue, ready = RequestQueue(4, 60, metrics), []
        waiter = asyncio.create_task(queue.wait(lambda: bool(ready), asyncio.get_running_loop().time() + 60))
        await asyncio.sleep(0.05)
        queue.notify()  # a change that does not help: still waiting
        await asyncio.sleep(0.05)
        assert not waiter.done() and queue.waiting == 1 and sample(metrics, "adpfleet_router_queue_waiting") == 1
        ready.append(True)
        queue.notify()
        assert await asyncio.wait_for(waiter, 1) == "placed"
        assert queue.waiting == 0 and sample(metrics, "adpfleet_router_queue_waiting") == 0
        assert sample(metrics, "adpfleet_router_queued_total", outcome="placed") == 1
    run(scenario())


def test_a_full_queue_refuses_at_once_and_a_wait_ends_at_its_deadline():
    async def scenario():
        metrics, loop = RouterMetrics(), asyncio.get_running_loop()
        queue = RequestQueue(1, 60, metrics)
        first = asyncio.create_task(queue.wait(lambda: False, loop.time() + 0.3))
        await asyncio.sleep(0.01)
        t0 = loop.time()
        assert await queue.wait(lambda: False, loop.time() + 60) == "full"
        assert loop.time() - t0 < 0.05
        assert await first == "timeout" and 0.25 <= loop.time() - t0 < 1
        assert sample(metrics, "adpfleet_router_queued_total", outcome="full") == 1
        assert sample(metrics, "adpfleet_router_queued_total", outcome="timeout") == 1
        assert sample(metrics, "adpfleet_router_queue_wait_seconds_count") == 1  # the refused one never waited
    run(scenario())


def test_a_queue_of_size_zero_holds_nothing():
    async def scenario():
        return await RequestQueue(0, 60, RouterMetrics()).wait(lambda: False, asyncio.get_running_loop().time() + 9)
    assert run(scenario()) == "full"


def test_the_end_of_a_cool_down_wakes_a_waiter_without_a_notify():
    async def scenario():
        loop = asyncio.get_running_loop()
        cooled_at = loop.time() + 0.2
        outcome = await asyncio.wait_for(queue.wait(lambda: loop.time() >= cooled_at, loop.time() + 60,
                                                    lambda: cooled_at - loop.time()), 2)
        return outcome, loop.time() - cooled_at
    queue = RequestQueue(4, 60, RouterMetrics())
    outcome, late = run(scenario())
    assert outcome == "placed" and late < 0.1


def test_a_client_leaving_frees_its_place():
    async def scenario():
        metrics = RouterMetrics()
        queue = RequestQueue(1, 60, metrics)
        waiter = asyncio.create_task(queue.wait(lambda: False, asyncio.get_running_loop().time() + 60))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert queue.waiting == 0 and sample(metrics, "adpfleet_router_queued_total", outcome="left") == 1
    run(scenario())


def test_the_bodies_waiting_take_at_most_max_bytes_and_one_more_is_refused_at_once():
    async def scenario():
        metrics, loop = RouterMetrics(), asyncio.get_running_loop()
        queue = RequestQueue(10, 60, metrics, max_bytes=1000)

        def waiter(body_bytes):
            return asyncio.create_task(queue.wait(lambda: False, loop.time() + 60, body_bytes=body_bytes))
        first = waiter(600)
        await asyncio.sleep(0.01)
        assert queue.held_bytes == 600 and sample(metrics, "adpfleet_router_queue_bytes") == 600
        t0 = loop.time()
        assert await asyncio.wait_for(queue.wait(lambda: False, loop.time() + 60, body_bytes=401), 1) == "over_bytes"
        assert loop.time() - t0 < 0.05 and sample(metrics, "adpfleet_router_queued_total", outcome="over_bytes") == 1
        second = waiter(400)  # fits exactly
        await asyncio.sleep(0.01)
        assert queue.held_bytes == 1000 and queue.waiting == 2
        for task in (first, second):  # leaving gives the bytes back
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert queue.held_bytes == 0 and sample(metrics, "adpfleet_router_queue_bytes") == 0
    run(scenario())


def test_the_router_help_states_the_queues_byte_default():
    from adpfleet.cli import build_parser
    from adpfleet.runtime.router.queue import DEFAULT_MAX_BYTES

    text = " ".join(build_parser()._subparsers._group_actions[0].choices["router"].format_help().split())
    assert f"(default {DEFAULT_MAX_BYTES >> 20} MiB)" in text

"""CacheTask: awaiting, blocking waits, cancellation, timeouts, finalize."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import datadist_aio as dd
from support.cache_bytes import fill_random, slot_bytes, tensor_bytes
from support.options import MiB

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS


def blocks_cache(cache_manager, blocks=64, block_bytes=256, tensors=2):
    desc = dd.CacheDesc(tensors, [blocks, block_bytes], dd.DataType.DT_UINT8, dd.Placement.HOST)
    return cache_manager.allocate_blocks_cache(desc)


def big_slots(cache_manager, slot_bytes_=128 * MiB):
    """A contiguous cache of two slots whose slot copy takes many milliseconds."""
    desc = dd.CacheDesc(2, [2, slot_bytes_], dd.DataType.DT_UINT8, dd.Placement.HOST)
    cache = cache_manager.allocate_cache(desc)
    for t in range(2):
        slot_bytes(cache, t, 0)[:] = 0xAB
        slot_bytes(cache, t, 1)[:] = 0
    return cache


async def test_await_returns_statuses(cache_manager):
    cache = blocks_cache(cache_manager)
    data = fill_random(cache, np.random.default_rng(1))
    task = cache_manager.copy_blocks_async(cache, {0: [5, 6]})
    assert isinstance(task, dd.CacheTask)
    assert await task == [SUCCESS]
    assert task.done() and not task.cancelled()
    assert await task == [SUCCESS]  # awaiting again gives the same outcome
    assert task.get_results() == [SUCCESS]
    assert task.synchronize() is SUCCESS
    for t in range(2):
        np.testing.assert_array_equal(slot_bytes(cache, t, 5), data[t][:256])
        np.testing.assert_array_equal(slot_bytes(cache, t, 6), data[t][:256])


async def test_thousand_concurrent_awaits(cache_manager):
    cache = blocks_cache(cache_manager, blocks=2000, block_bytes=512)
    data = fill_random(cache, np.random.default_rng(2))
    tasks = [cache_manager.copy_blocks_async(cache, {i: [1000 + i]}) for i in range(1000)]
    results = await asyncio.gather(*tasks)
    assert results == [[SUCCESS]] * 1000
    for t in range(2):
        view = tensor_bytes(cache, t).reshape(2000, 512)
        np.testing.assert_array_equal(view[1000:], data[t].reshape(2000, 512)[:1000])


async def test_many_awaiting_coroutines_and_threads(cache_manager):
    cache = blocks_cache(cache_manager, blocks=400)
    fill_random(cache, np.random.default_rng(3))

    async def one(i: int) -> list:
        return await cache_manager.copy_blocks_async(cache, {i: [200 + i]})

    results = await asyncio.gather(*(one(i) for i in range(200)))
    assert all(r == [SUCCESS] for r in results)
    # The same tasks waited for from plain threads with no event loop.
    tasks = [cache_manager.copy_blocks_async(cache, {i: [200 + i]}) for i in range(50)]
    seen: list = []
    threads = [threading.Thread(target=lambda t=t: seen.append(t.synchronize(5000))) for t in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == [SUCCESS] * 50


async def test_awaited_from_another_loop(cache_manager):
    cache = blocks_cache(cache_manager)
    task = cache_manager.copy_blocks_async(cache, {1: [2]})
    first = asyncio.ensure_future(asyncio.sleep(0))
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(asyncio.run(_await(task))))
    thread.start()
    await first
    assert await task == [SUCCESS]
    thread.join(10)
    assert outcome == [[SUCCESS]]


async def _await(task):
    return await task


async def test_cancel_stops_the_engine(big_datadist):
    cache_manager = big_datadist.cache_manager
    cache = big_slots(cache_manager)
    task = cache_manager.copy_cache_async(cache, cache, dst_batch_index=1, src_batch_index=0)
    assert task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.done() and task.cancelled()
    assert task.get_results() == [dd.LLMStatusCode.LLM_FAILED]
    assert task.synchronize() is dd.LLMStatusCode.LLM_FAILED
    assert not task.cancel()  # already settled
    copied = sum(int(np.count_nonzero(slot_bytes(cache, t, 1))) for t in range(2))
    assert copied < 2 * 128 * MiB  # stopped before the end
    with pytest.raises(asyncio.CancelledError):
        task.result()


@pytest.mark.parametrize("how", ["timeout", "wait_for"])
async def test_timeout_cancels_and_settles(big_datadist, how):
    cache_manager = big_datadist.cache_manager
    cache = big_slots(cache_manager, 256 * MiB)
    task = cache_manager.copy_cache_async(cache, cache, dst_batch_index=1, src_batch_index=0)
    with pytest.raises(TimeoutError):
        if how == "timeout":
            async with asyncio.timeout(0.001):
                await task
        else:
            await asyncio.wait_for(task, 0.001)
    assert task.done(), "the await returned before the engine settled"
    assert task.cancelled()
    assert big_datadist._engine.requests_in_flight() == 0


async def test_cancelling_an_awaiting_task(big_datadist):
    cache_manager = big_datadist.cache_manager
    cache = big_slots(cache_manager, 256 * MiB)
    task = cache_manager.copy_cache_async(cache, cache, 1, 0)
    waiter = asyncio.ensure_future(_await(task))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert task.done() and task.cancelled()


async def test_cancel_after_completion_keeps_success(cache_manager):
    cache = blocks_cache(cache_manager)
    task = cache_manager.copy_blocks_async(cache, {0: [1]})
    assert await task == [SUCCESS]
    assert not task.cancel()
    assert not task.cancelled()


async def test_synchronize_timeout_does_not_cancel(big_datadist):
    cache_manager = big_datadist.cache_manager
    cache = big_slots(cache_manager, 256 * MiB)
    task = cache_manager.copy_cache_async(cache, cache, 1, 0)
    assert task.synchronize(0) is dd.LLMStatusCode.LLM_TIMEOUT
    assert task.get_results(0) == [dd.LLMStatusCode.LLM_TIMEOUT]
    assert await task == [SUCCESS]
    for t in range(2):
        assert (slot_bytes(cache, t, 1) == 0xAB).all()


async def test_completed_at_is_when_the_engine_completed_the_task(big_datadist):
    cache_manager = big_datadist.cache_manager
    cache = big_slots(cache_manager, 64 * MiB)
    submitted = time.perf_counter()
    task = cache_manager.copy_cache_async(cache, cache, 1, 0)
    early = task.completed_at  # None unless the copy has already completed
    called: list[tuple[float, float | None]] = []
    task.add_done_callback(lambda t: called.append((time.perf_counter(), t.completed_at)))
    assert await task == [SUCCESS]
    seen = time.perf_counter()
    at = task.completed_at
    assert at is not None and submitted <= at <= seen, (submitted, at, seen)
    assert early is None or early == at
    assert task.completed_at == at  # taken once
    async with asyncio.timeout(30):  # the callback runs on this loop, maybe after the await resumed
        while not called:
            await asyncio.sleep(0.01)
    assert called[0][1] == at and at <= called[0][0]


async def test_completed_at_of_a_cancelled_task(big_datadist):
    cache_manager = big_datadist.cache_manager
    cache = big_slots(cache_manager, 64 * MiB)
    submitted = time.perf_counter()
    task = cache_manager.copy_cache_async(cache, cache, 1, 0)
    if task.cancel():  # else the copy had already completed
        with pytest.raises(asyncio.CancelledError):
            await task
    at = task.completed_at
    assert at is not None and submitted <= at <= time.perf_counter()


def test_blocking_use_without_event_loop(cache_manager):
    cache = blocks_cache(cache_manager)
    data = fill_random(cache, np.random.default_rng(4))
    task = cache_manager.copy_blocks_async(cache, {3: [4]})
    assert task.synchronize() is SUCCESS
    assert task.get_results() == [SUCCESS]
    assert task.result() == [SUCCESS]
    np.testing.assert_array_equal(slot_bytes(cache, 1, 4), data[1][3 * 256 : 4 * 256])
    with pytest.raises(TypeError):
        task.synchronize(1.5)
    with pytest.raises(ValueError):
        task.get_results(-1)


def test_result_before_done_raises(big_datadist):
    cache_manager = big_datadist.cache_manager
    cache = big_slots(cache_manager, 256 * MiB)
    task = cache_manager.copy_cache_async(cache, cache, 1, 0)
    with pytest.raises(asyncio.InvalidStateError):
        task.result()
    assert task.synchronize() is SUCCESS


async def test_finalize_fails_pending_work(big_datadist):
    cache_manager = big_datadist.cache_manager
    cache = big_slots(cache_manager, 64 * MiB)
    tasks = [cache_manager.copy_cache_async(cache, cache, 1, 0) for _ in range(8)]
    big_datadist.finalize()
    finalized = 0
    for task in tasks:
        assert task.done()
        try:
            assert await task == [SUCCESS]
        except dd.LLMException as exc:
            assert exc.status_code is dd.LLMStatusCode.LLM_ENGINE_FINALIZED
            finalized += 1
    assert finalized > 0
    with pytest.raises(dd.LLMException):
        cache_manager.copy_cache_async(cache, cache, 1, 0)


async def test_finalize_while_awaiting(big_datadist):
    cache_manager = big_datadist.cache_manager
    cache = big_slots(cache_manager, 128 * MiB)
    tasks = [cache_manager.copy_cache_async(cache, cache, 1, 0) for _ in range(4)]
    waiters = [asyncio.ensure_future(_await(t)) for t in tasks]
    await asyncio.sleep(0)
    big_datadist.finalize()
    outcomes = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 10)
    assert any(
        isinstance(o, dd.LLMException) and o.status_code is dd.LLMStatusCode.LLM_ENGINE_FINALIZED for o in outcomes
    )
    assert all(o == [SUCCESS] or isinstance(o, dd.LLMException) for o in outcomes)


async def test_validation_errors_raise_before_a_task_exists(cache_manager):
    cache = blocks_cache(cache_manager)
    with pytest.raises(dd.LLMException) as info:
        cache_manager.copy_blocks_async(cache, {0: [64]})
    assert info.value.status_code is dd.LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        cache_manager.copy_blocks_async(None, {0: [1]})

"""Checked by mypy and pyright in CI (.ci/run), never run: uses of the public
API that must type-check as a user writes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import numpy as np

import datadist_aio as dd


class ModelProgress(dd.LayerSynchronizer):
    """An ``async def`` override, as the README shows."""

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        return True


class Blocking(dd.LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        return True


def register(cm: dd.CacheManager, desc: dd.CacheDesc) -> dd.Cache:
    arrays: list[np.ndarray] = [np.zeros(desc.shape, dtype=desc.data_type.numpy_dtype) for _ in range(desc.num_tensors)]
    cm.register_cache(desc, arrays)
    addresses: list[int] = [1, 2]
    cm.register_cache(desc, addresses)
    return cm.register_blocks_cache(desc, arrays, dd.BlocksCacheKey(2, 0))


def blocking_twins(cm: dd.CacheManager) -> None:
    """The blocking twins keep their async twin's parameters and return None."""
    push: Callable[[dd.BlocksCacheKey, dd.Cache, list[int], list[int]], None] = cm.push_blocks
    pull: Callable[[dd.BlocksCacheKey, dd.Cache, list[int], list[int]], None] = cm.pull_blocks
    copy: Callable[[dd.Cache, dict[int, list[int]]], None] = cm.copy_blocks
    print(push, pull, copy)


async def awaited(cm: dd.CacheManager, cache: dd.Cache) -> list[dd.LLMStatusCode]:
    task: dd.CacheTask = cm.push_blocks_async(dd.BlocksCacheKey(2, 0), cache, [0], [1])
    return await task


async def released_by_events(datadist: dd.LLMDataDist, cache: dd.Cache, events: list[int]) -> list[dd.LLMStatusCode]:
    sync = dd.CudaEventSynchronizer(datadist, events[:1])
    sync.record(1, events[1])
    config = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 2), range(0, 2))
    return await datadist.cache_manager.transfer_cache_async(cache, sync, [config], [0], [1])

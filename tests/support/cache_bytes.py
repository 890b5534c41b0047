"""Byte-level views of caches for tests."""

from __future__ import annotations

import numpy as np

import datadist_aio as dd


def tensor_bytes(cache: dd.Cache, tensor: int) -> np.ndarray:
    """Tensor ``tensor`` of ``cache`` as a flat writable uint8 view."""
    return cache.as_numpy(tensor).reshape(-1).view(np.uint8)


def slot_bytes(cache: dd.Cache, tensor: int, slot: int) -> np.ndarray:
    """Slot (batch index or block) ``slot`` of one tensor as a uint8 view."""
    size = cache.cache_desc.slot_size
    return tensor_bytes(cache, tensor)[slot * size : (slot + 1) * size]


def fill_random(cache: dd.Cache, rng: np.random.Generator) -> list[np.ndarray]:
    """Fills every tensor with random bytes; returns copies of what was written."""
    written = []
    for t in range(cache.cache_desc.num_tensors):
        data = rng.integers(0, 256, size=cache.cache_desc.size, dtype=np.uint8)
        tensor_bytes(cache, t)[:] = data
        written.append(data)
    return written


def snapshot(cache: dd.Cache) -> list[np.ndarray]:
    return [tensor_bytes(cache, t).copy() for t in range(cache.cache_desc.num_tensors)]

"""A cache: tensors described by a `CacheDesc`, one base address each."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from ._checks import check_isinstance, check_list_uint64, raise_if_false, raise_if_true
from .cache_desc import CacheDesc
from .enums import Placement

__all__ = ["Cache"]


class Cache:
    """Tensors of one cache, identified by a process-local id.

    Caches come from the cache manager (allocate/register) or from
    `create_cpu_cache`; they are not meant to be constructed directly.

    Args:
        cache_id: Engine id, or -1 for a cache unknown to the engine.
        cache_desc: Geometry of the tensors.
        tensor_addrs: Base address of each tensor.
        is_blocks_cache: Whether dimension 0 counts blocks.
        buffers: Objects owning the memory (e.g. registered numpy arrays),
            kept alive as long as the cache holds its addresses.
    """

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        tensor_addrs: Sequence[int],
        is_blocks_cache: bool = False,
        *,
        buffers: Optional[Sequence[Any]] = None,
        memory: Any = None,
    ) -> None:
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = list(tensor_addrs)
        self._is_blocks_cache = is_blocks_cache
        self._buffers = list(buffers) if buffers is not None else None
        # What keeps the tensors' memory alive: the engine's pin of an
        # allocated cache, or the buffers a registered one was made from.
        self._memory = memory

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        """Wraps host memory unknown to the engine, for `swap_blocks`.

        Args:
            cache_desc: Geometry; placement must be HOST.
            addrs: One base address per tensor (a list of int).

        Returns:
            A blocks cache with `cache_id == -1`.

        Raises:
            TypeError: If `cache_desc` is not a `CacheDesc` or `addrs` is not
                a list of int.
            ValueError: If an address is outside uint64.
            LLMException: `LLM_PARAM_INVALID` if the placement is not HOST or
                `len(addrs) != cache_desc.num_tensors`.
        """
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("addrs", addrs, list, int, allow_none=False)
        raise_if_false(
            cache_desc.placement is Placement.HOST,
            "cache_desc.placement must be HOST for a cpu cache, got {}",
            cache_desc.placement,
        )
        raise_if_false(
            len(addrs) == cache_desc.num_tensors,
            "len(addrs) must equal cache_desc.num_tensors ({}), got {}",
            cache_desc.num_tensors,
            len(addrs),
        )
        check_list_uint64("addrs", addrs)
        return cls(-1, cache_desc, addrs, True)

    @property
    def cache_id(self) -> int:
        """Engine id; -1 for a cache unknown to the engine."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """Geometry of the tensors."""
        return self._cache_desc

    @property
    def tensor_addrs(self) -> list[int]:
        """A copy of the tensor base addresses; empty once deallocated."""
        return list(self._tensor_addrs)

    @property
    def is_blocks_cache(self) -> bool:
        """Whether dimension 0 counts blocks rather than batch slots."""
        return self._is_blocks_cache

    def as_numpy(self, tensor_index: int) -> np.ndarray:
        """Returns a writable zero-copy view of one tensor.

        The view has the desc's shape and numpy dtype and keeps the memory
        behind it alive: an allocated cache's memory stays mapped (and out of
        the pool) while a view of it exists, past `deallocate_cache` and
        `LLMDataDist.finalize()`; a registered cache's buffers likewise. Only
        memory registered as raw integer addresses is the caller's to keep.

        Args:
            tensor_index: Index into `tensor_addrs`; negative values count
                from the end.

        Returns:
            The tensor as a numpy array.

        Raises:
            TypeError: If `tensor_index` is not an int.
            LLMException: `LLM_PARAM_INVALID` if the cache holds no addresses
                (deallocated) or its shape has a dimension <= 0.
            IndexError: If `tensor_index` is out of range.
        """
        check_isinstance("tensor_index", tensor_index, int, allow_none=False)
        raise_if_false(
            self._tensor_addrs, "cache {} holds no tensor addresses", self._cache_id
        )
        raise_if_true(
            self._cache_desc.placement is Placement.DEVICE,
            "cache {} is in CUDA device memory, which numpy cannot view; copy it to a HOST cache "
            "(copy_cache, swap_blocks) or read it with torch or CuPy from tensor_addrs",
            self._cache_id,
        )
        count = len(self._tensor_addrs)
        if not -count <= tensor_index < count:
            raise IndexError(f"tensor_index must be in [-{count}, {count}), got {tensor_index}")
        desc = self._cache_desc
        raw: Any = (ctypes.c_ubyte * desc.size).from_address(self._tensor_addrs[tensor_index])
        raw._owner = (self._memory, self._buffers)
        return np.frombuffer(raw, dtype=np.uint8).view(desc.data_type.numpy_dtype).reshape(
            desc.shape
        )

    def _invalidate(self) -> None:
        """Forgets the addresses and the memory after deallocation: views made
        before keep what they point at."""
        self._tensor_addrs = []
        self._buffers = None
        self._memory = None

    def __repr__(self) -> str:
        return (
            f"Cache(cache_id={self._cache_id}, cache_desc={self._cache_desc!r}, "
            f"tensor_addrs=[{', '.join(f'{addr:#x}' for addr in self._tensor_addrs)}], "
            f"is_blocks_cache={self._is_blocks_cache})"
        )

"""Per-destination settings of a layer-wise `transfer_cache_async`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

from ._checks import (
    check_isinstance,
    check_layer_range,
    check_list_uint64,
    check_uint32,
    check_uint64,
    raise_if_false,
)
from .cache_key import BlocksCacheKey, CacheKeyByIdAndIndex

__all__ = ["TransferConfig", "TransferWithCacheKeyConfig"]

TransferCacheKey = Union[BlocksCacheKey, CacheKeyByIdAndIndex]


class TransferConfig:
    """Destination given by raw addresses (remote-cache-accessible mode off).

    Args:
        dst_cluster_id: Cluster id of the destination (uint64).
        dst_addrs: Destination base addresses, two per transferred layer
            (list or tuple of uint64). For a contiguous destination and a
            non-zero batch slot, the addresses must already be offset.
        src_layer_range: Source layers, `range(start, stop)` with step 1, or
            `None` for all layers.
        src_batch_index: Source batch slot (uint32).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an integer is outside its range.
        LLMException: `LLM_PARAM_INVALID` for a bad layer range.
    """

    def __init__(
        self,
        dst_cluster_id: int,
        dst_addrs: Sequence[int],
        src_layer_range: Optional[range] = None,
        src_batch_index: int = 0,
    ) -> None:
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = dst_addrs
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index
        self.dst_layer_range: Optional[range] = None

    @property
    def dst_cluster_id(self) -> int:
        """Cluster id of the destination."""
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, value: int) -> None:
        check_uint64("dst_cluster_id", value)
        self._dst_cluster_id = value

    @property
    def dst_addrs(self) -> list[int]:
        """A copy of the destination base addresses."""
        return list(self._dst_addrs)

    @dst_addrs.setter
    def dst_addrs(self, value: Sequence[int]) -> None:
        check_isinstance("dst_addrs", value, (list, tuple), int, allow_none=False)
        check_list_uint64("dst_addrs", value)
        self._dst_addrs = list(value)

    @property
    def src_layer_range(self) -> Optional[range]:
        """Source layers, or `None` for all."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: Optional[range]) -> None:
        check_layer_range("src_layer_range", value)
        self._src_layer_range = value

    @property
    def src_batch_index(self) -> int:
        """Source batch slot."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        check_uint32("src_batch_index", value)
        self._src_batch_index = value

    def __repr__(self) -> str:
        return (
            f"TransferConfig(dst_cluster_id={self._dst_cluster_id}, "
            f"dst_addrs=[{', '.join(f'{addr:#x}' for addr in self._dst_addrs)}], "
            f"src_layer_range={self._src_layer_range}, "
            f"src_batch_index={self._src_batch_index})"
        )


class TransferWithCacheKeyConfig:
    """Destination given by a cache key (remote-cache-accessible mode on).

    Both layer ranges are required although they default to `None`, and
    must have the same length. Each setter checks its own field (and the
    blocks-key rule); `_validate()` re-checks the two ranges together and
    is run by the constructor and before a transfer.

    Args:
        cache_key: Destination cache on the peer.
        src_layer_range: Source layers, `range(start, stop)` with step 1.
        dst_layer_range: Destination layers, same length as the source.
        src_batch_index: Source batch slot (uint32); must be 0 with a
            `BlocksCacheKey`.

    Raises:
        TypeError: If `cache_key` is not a `BlocksCacheKey` or
            `CacheKeyByIdAndIndex`, a range is missing or not a `range`, or
            `src_batch_index` is not an int.
        ValueError: If `src_batch_index` is outside uint32.
        LLMException: `LLM_PARAM_INVALID` for a bad range, ranges of
            different lengths, or a non-zero batch slot with a blocks key.
    """

    def __init__(
        self,
        cache_key: TransferCacheKey,
        src_layer_range: Optional[range] = None,
        dst_layer_range: Optional[range] = None,
        src_batch_index: int = 0,
    ) -> None:
        _check_cache_key(cache_key)
        check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        assert src_layer_range is not None and dst_layer_range is not None  # checked just above
        self._cache_key = cache_key
        self._src_layer_range = src_layer_range
        self._dst_layer_range = dst_layer_range
        self._src_batch_index = 0
        self._validate()
        self.src_batch_index = src_batch_index

    @property
    def cache_key(self) -> TransferCacheKey:
        """Destination cache on the peer."""
        return self._cache_key

    @cache_key.setter
    def cache_key(self, value: TransferCacheKey) -> None:
        _check_cache_key(value)
        _check_blocks_batch_index(value, self._src_batch_index)
        self._cache_key = value

    @property
    def dst_cluster_id(self) -> int:
        """Cluster id of the destination, taken from `cache_key`."""
        return self._cache_key.cluster_id

    @property
    def src_layer_range(self) -> range:
        """Source layers."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: range) -> None:
        check_layer_range("src_layer_range", value, allow_none=False)
        self._src_layer_range = value

    @property
    def dst_layer_range(self) -> range:
        """Destination layers."""
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, value: range) -> None:
        check_layer_range("dst_layer_range", value, allow_none=False)
        self._dst_layer_range = value

    @property
    def src_batch_index(self) -> int:
        """Source batch slot; 0 with a `BlocksCacheKey`."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        check_uint32("src_batch_index", value)
        _check_blocks_batch_index(self._cache_key, value)
        self._src_batch_index = value

    def _validate(self) -> None:
        """Checks that the two layer ranges have the same length.

        Raises:
            LLMException: `LLM_PARAM_INVALID` if the lengths differ.
        """
        raise_if_false(
            len(self._src_layer_range) == len(self._dst_layer_range),
            "src_layer_range {} and dst_layer_range {} must have the same length",
            self._src_layer_range,
            self._dst_layer_range,
        )

    def __repr__(self) -> str:
        return (
            f"TransferWithCacheKeyConfig(cache_key={self._cache_key!r}, "
            f"src_layer_range={self._src_layer_range}, "
            f"dst_layer_range={self._dst_layer_range}, "
            f"src_batch_index={self._src_batch_index})"
        )


def _check_cache_key(value: object) -> None:
    check_isinstance(
        "cache_key", value, (BlocksCacheKey, CacheKeyByIdAndIndex), allow_none=False
    )


def _check_blocks_batch_index(cache_key: TransferCacheKey, batch_index: int) -> None:
    raise_if_false(
        not isinstance(cache_key, BlocksCacheKey) or batch_index == 0,
        "src_batch_index must be 0 with a BlocksCacheKey, got {}",
        batch_index,
    )

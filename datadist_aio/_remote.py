"""How the engine names a cache of a peer, shared by every transfer call."""

from __future__ import annotations

from typing import Union

from .cache_key import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex

__all__ = ["INVALID_ID", "TENSORS_PER_LAYER", "RemoteName", "remote_name"]

INVALID_ID = 2**64 - 1
TENSORS_PER_LAYER = 2  # K and V, upstream's default tensor_num_per_layer

_BY_ID, _BY_KEY, _BLOCKS_OF_MODEL = 1, 2, 3

# (kind, cache_id, req_id, model_id, prefix_id, slot), as the extension takes it.
RemoteName = tuple[int, int, int, int, int, int]


def remote_name(key: Union[CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey]) -> RemoteName:
    """The engine's name of the peer cache ``key`` designates."""
    if isinstance(key, CacheKeyByIdAndIndex):
        return (_BY_ID, key.cache_id, INVALID_ID, 0, INVALID_ID, key.batch_index)
    if isinstance(key, BlocksCacheKey):
        return (_BLOCKS_OF_MODEL, -1, INVALID_ID, key.model_id, INVALID_ID, 0)
    return (_BY_KEY, -1, key.req_id, key.model_id, key.prefix_id, 0)

"""Keys naming a cache, or one of its batch slots, on an instance."""

from __future__ import annotations

from typing import Any

from ._checks import UINT64_MAX, check_int64, check_uint32, check_uint64, raise_if_false

__all__ = ["CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey"]

_CLUSTER_ALIAS = "prompt_cluster_id"


def _parse_key_args(
    kind: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    names: tuple[str, ...],
    required: tuple[str, ...],
) -> dict[str, Any]:
    """Merges positional and keyword arguments of a key constructor.

    `names` gives the positional order; `cluster_id` may also be passed as
    `prompt_cluster_id` (`cluster_id` wins) and positional values override
    keywords of the same name. Every failure is `LLM_PARAM_INVALID`.
    """
    raise_if_false(
        len(args) + len(kwargs) <= len(names),
        "{} takes at most {} arguments, got {}",
        kind,
        len(names),
        len(args) + len(kwargs),
    )
    unknown = sorted(set(kwargs) - set(names) - {_CLUSTER_ALIAS})
    raise_if_false(not unknown, "{} got unknown keyword arguments {}", kind, unknown)
    values = dict(kwargs)
    if _CLUSTER_ALIAS in values:
        values.setdefault("cluster_id", values.pop(_CLUSTER_ALIAS))
    values.update(zip(names, args))
    for name in required:
        raise_if_false(name in values, "{} requires {}", kind, name)
    return values


class _Key:
    """Value semantics shared by the key classes: equal when of the same
    class with the same fields."""

    __slots__ = ()

    def _fields(self) -> tuple[int, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self._fields() == other._fields()  # type: ignore[attr-defined]
        return NotImplemented

    def __hash__(self) -> int:
        return hash((type(self).__name__, *self._fields()))


class CacheKey(_Key):
    """Names one batch slot of a contiguous cache, by request id or prefix id.

    Accepts `(cluster_id, req_id, model_id=0, prefix_id=2**64 - 1)`
    positionally or by keyword; `prompt_cluster_id` is an alias of
    `cluster_id`. A `req_id` (or `prefix_id`) of `2**64 - 1` means unset.

    Raises:
        LLMException: `LLM_PARAM_INVALID` for more than 4 arguments, an
            unknown keyword, or a missing `cluster_id` or `req_id`.
        TypeError: If a value is not an int.
        ValueError: If a value is outside uint64.
    """

    __slots__ = ("_cluster_id", "_req_id", "_model_id", "_prefix_id")

    _NAMES = ("cluster_id", "req_id", "model_id", "prefix_id")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        values = _parse_key_args("CacheKey", args, kwargs, self._NAMES, ("cluster_id", "req_id"))
        values.setdefault("model_id", 0)
        values.setdefault("prefix_id", UINT64_MAX)
        for name in self._NAMES:
            check_uint64(name, values[name])
        self._cluster_id: int = values["cluster_id"]
        self._req_id: int = values["req_id"]
        self._model_id: int = values["model_id"]
        self._prefix_id: int = values["prefix_id"]

    @property
    def cluster_id(self) -> int:
        """Cluster id of the instance owning the cache."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Alias of `cluster_id`."""
        return self._cluster_id

    @property
    def req_id(self) -> int:
        """Request id; `2**64 - 1` if unset."""
        return self._req_id

    @property
    def model_id(self) -> int:
        """Model id."""
        return self._model_id

    @property
    def prefix_id(self) -> int:
        """Prefix id; `2**64 - 1` if unset."""
        return self._prefix_id

    def _fields(self) -> tuple[int, int, int, int]:
        return (self._cluster_id, self._req_id, self._model_id, self._prefix_id)

    def __repr__(self) -> str:
        return (
            f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
            f"model_id={self._model_id}, prefix_id={self._prefix_id})"
        )


class CacheKeyByIdAndIndex(_Key):
    """Names a cache on a peer by its id, plus a batch slot.

    Args:
        cluster_id: Cluster id of the peer (uint64).
        cache_id: Id of the cache on the peer (int64).
        batch_index: Batch slot (uint32).

    Raises:
        TypeError: If a value is not an int.
        ValueError: If a value is outside its integer range.
    """

    __slots__ = ("_cluster_id", "_cache_id", "_batch_index")

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_uint64("cluster_id", cluster_id)
        check_int64("cache_id", cache_id)
        check_uint32("batch_index", batch_index)
        self._cluster_id = cluster_id
        self._cache_id = cache_id
        self._batch_index = batch_index

    @property
    def cluster_id(self) -> int:
        """Cluster id of the peer."""
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        """Id of the cache on the peer."""
        return self._cache_id

    @property
    def batch_index(self) -> int:
        """Batch slot."""
        return self._batch_index

    def _fields(self) -> tuple[int, int, int]:
        return (self._cluster_id, self._cache_id, self._batch_index)

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, "
            f"cache_id={self._cache_id}, batch_index={self._batch_index})"
        )


class BlocksCacheKey(_Key):
    """Names the blocks cache bound to `model_id` on an instance.

    Accepts `(cluster_id, model_id=0)` positionally or by keyword;
    `prompt_cluster_id` is an alias of `cluster_id`.

    Raises:
        LLMException: `LLM_PARAM_INVALID` for more than 2 arguments, an
            unknown keyword, or a missing `cluster_id`.
        TypeError: If a value is not an int.
        ValueError: If a value is outside uint64.
    """

    __slots__ = ("_cluster_id", "_model_id")

    _NAMES = ("cluster_id", "model_id")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        values = _parse_key_args("BlocksCacheKey", args, kwargs, self._NAMES, ("cluster_id",))
        values.setdefault("model_id", 0)
        for name in self._NAMES:
            check_uint64(name, values[name])
        self._cluster_id: int = values["cluster_id"]
        self._model_id: int = values["model_id"]

    @property
    def cluster_id(self) -> int:
        """Cluster id of the instance owning the cache."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Alias of `cluster_id`."""
        return self._cluster_id

    @property
    def model_id(self) -> int:
        """Model id the blocks cache is bound to."""
        return self._model_id

    def _fields(self) -> tuple[int, int]:
        return (self._cluster_id, self._model_id)

    def __repr__(self) -> str:
        return f"BlocksCacheKey(cluster_id={self._cluster_id}, model_id={self._model_id})"

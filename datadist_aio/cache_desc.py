"""Geometry of a cache: tensor count, shape, element type and placement."""

from __future__ import annotations

import math
from typing import Optional, Union

from ._checks import (
    UINT64_MAX,
    check_int32,
    check_int64,
    check_isinstance,
    check_list_int64,
    check_uint32,
    raise_if_false,
)
from .data_type import DataType
from .enums import Placement

__all__ = ["CacheDesc"]


class CacheDesc:
    """Describes `num_tensors` tensors of identical shape and element type.

    The engine always slices dimension 0 of `shape`: into batch slots for a
    contiguous cache, into blocks for a blocks cache. `batch_dim_index` only
    affects `batch_size`.

    Args:
        num_tensors: Number of tensors (uint32; 0 is accepted here and
            rejected when allocating).
        shape: Dimensions of each tensor (list or tuple of int64).
        data_type: Element type.
        placement: Host or device memory.
        batch_dim_index: Index of the batch dimension in `shape`.
        seq_len_dim_index: Index of the sequence dimension, or -1.
        kv_tensor_format: Optional free-form layout label.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If `num_tensors`, `seq_len_dim_index` or a dimension is
            outside its integer range.
        LLMException: `LLM_PARAM_INVALID` if `batch_dim_index` is not in
            `[0, len(shape))` or `seq_len_dim_index` is neither -1 nor in it.
    """

    def __init__(
        self,
        num_tensors: int,
        shape: Union[tuple[int, ...], list[int]],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: Optional[str] = None,
    ) -> None:
        check_uint32("num_tensors", num_tensors)
        check_isinstance("shape", shape, (list, tuple), int, allow_none=False)
        check_isinstance("data_type", data_type, DataType, allow_none=False)
        check_isinstance("placement", placement, Placement, allow_none=False)
        check_isinstance("batch_dim_index", batch_dim_index, int, allow_none=False)
        check_int32("seq_len_dim_index", seq_len_dim_index)
        check_isinstance("kv_tensor_format", kv_tensor_format, str)
        raise_if_false(
            0 <= batch_dim_index < len(shape),
            "batch_dim_index must be in [0, {}) for shape {}, got {}",
            len(shape),
            list(shape),
            batch_dim_index,
        )
        raise_if_false(
            seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
            "seq_len_dim_index must be -1 or in [0, {}) for shape {}, got {}",
            len(shape),
            list(shape),
            seq_len_dim_index,
        )
        check_list_int64("shape", shape)
        self._num_tensors = num_tensors
        self._shape = list(shape)
        self._data_type = data_type
        self._placement = placement
        self._batch_dim_index = batch_dim_index
        self._batch_size = self._shape[batch_dim_index]
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format
        self._size: Optional[int] = None
        self._is_blocks = False

    @property
    def num_tensors(self) -> int:
        """Number of tensors."""
        return self._num_tensors

    @property
    def shape(self) -> list[int]:
        """A copy of the shape of each tensor."""
        return list(self._shape)

    @property
    def data_type(self) -> DataType:
        """Element type."""
        return self._data_type

    @property
    def placement(self) -> Placement:
        """Host or device memory."""
        return self._placement

    @property
    def batch_dim(self) -> int:
        """Index of the batch dimension (LLM-DataDist's spelling)."""
        return self._batch_dim_index

    @property
    def batch_dim_index(self) -> int:
        """Index of the batch dimension."""
        return self._batch_dim_index

    @property
    def batch_size(self) -> int:
        """`shape[batch_dim_index]` at construction; `update_dim` leaves it unchanged."""
        return self._batch_size

    @property
    def seq_len_dim_index(self) -> int:
        """Index of the sequence dimension, or -1."""
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> Optional[str]:
        """Free-form layout label."""
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes of one tensor: product of the shape times the element size.

        Raises:
            LLMException: `LLM_PARAM_INVALID` if a dimension is <= 0 or the
                size does not fit in uint64.
        """
        if self._size is None:
            raise_if_false(
                all(dim > 0 for dim in self._shape),
                "every dimension of shape must be > 0 to compute a size, got {}",
                self._shape,
            )
            size = math.prod(self._shape) * self._data_type.itemsize
            raise_if_false(
                size <= UINT64_MAX, "tensor size of shape {} exceeds uint64", self._shape
            )
            self._size = size
        return self._size

    @property
    def slot_size(self) -> int:
        """Bytes of one slice along dimension 0: a batch slot, or a block.

        Raises:
            LLMException: `LLM_PARAM_INVALID` as `size`.
        """
        return self.size // self._shape[0]

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Sets `shape[dim_index]` in place and resets the cached size.

        Args:
            dim_index: Dimension to change, in `[0, len(shape))`.
            dim_value: New value (int64).

        Raises:
            TypeError: If an argument is not an int.
            ValueError: If `dim_value` is outside int64.
            LLMException: `LLM_PARAM_INVALID` if `dim_index` is out of range.
        """
        check_isinstance("dim_index", dim_index, int, allow_none=False)
        check_int64("dim_value", dim_value)
        raise_if_false(
            0 <= dim_index < len(self._shape),
            "dim_index must be in [0, {}), got {}",
            len(self._shape),
            dim_index,
        )
        self._shape[dim_index] = dim_value
        self._size = None

    def __repr__(self) -> str:
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, "
            f"data_type={self._data_type}, placement={self._placement}, "
            f"batch_dim_index={self._batch_dim_index}, "
            f"seq_len_dim_index={self._seq_len_dim_index}, "
            f"kv_tensor_format={self._kv_tensor_format!r})"
        )

"""Element types of cache tensors."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

__all__ = ["DataType"]


class DataType(enum.Enum):
    """Tensor element type; values are the engine's data-type codes (5 is reserved)."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27

    @property
    def itemsize(self) -> int:
        """Bytes per element, as the engine counts them (`DT_STRING` is 16)."""
        return _NUMPY_DTYPES[self].itemsize

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """The matching numpy dtype.

        `DT_BF16` has no numpy equivalent and maps to float16 (same size);
        `DT_STRING` maps to 16-byte strings (`S16`).
        """
        return _NUMPY_DTYPES[self]


_NUMPY_DTYPES: dict[DataType, np.dtype[Any]] = {
    DataType.DT_FLOAT: np.dtype(np.float32),
    DataType.DT_FLOAT16: np.dtype(np.float16),
    DataType.DT_INT8: np.dtype(np.int8),
    DataType.DT_INT32: np.dtype(np.int32),
    DataType.DT_UINT8: np.dtype(np.uint8),
    DataType.DT_INT16: np.dtype(np.int16),
    DataType.DT_UINT16: np.dtype(np.uint16),
    DataType.DT_UINT32: np.dtype(np.uint32),
    DataType.DT_INT64: np.dtype(np.int64),
    DataType.DT_UINT64: np.dtype(np.uint64),
    DataType.DT_DOUBLE: np.dtype(np.float64),
    DataType.DT_BOOL: np.dtype(np.bool_),
    DataType.DT_STRING: np.dtype("S16"),
    DataType.DT_BF16: np.dtype(np.float16),
}

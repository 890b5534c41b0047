"""Description of one memory region."""

from __future__ import annotations

from ._checks import check_isinstance
from .enums import Memtype

__all__ = ["MemInfo"]


class MemInfo:
    """A memory region: its type, base address and size.

    Args:
        mem_type: Kind of memory.
        addr: Base address.
        size: Size in bytes.

    Raises:
        TypeError: If an argument has the wrong type.
    """

    __slots__ = ("_mem_type", "_addr", "_size")

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_isinstance("mem_type", mem_type, Memtype, allow_none=False)
        check_isinstance("addr", addr, int, allow_none=False)
        check_isinstance("size", size, int, allow_none=False)
        self._mem_type = mem_type
        self._addr = addr
        self._size = size

    @property
    def mem_type(self) -> Memtype:
        """Kind of memory."""
        return self._mem_type

    @property
    def addr(self) -> int:
        """Base address."""
        return self._addr

    @property
    def size(self) -> int:
        """Size in bytes."""
        return self._size

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MemInfo):
            return (self._mem_type, self._addr, self._size) == (
                other._mem_type,
                other._addr,
                other._size,
            )
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._mem_type, self._addr, self._size))

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type}, addr={self._addr:#x}, size={self._size})"

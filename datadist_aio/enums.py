"""Small enums of the public API."""

from __future__ import annotations

import enum

__all__ = ["Placement", "LLMRole", "Memtype", "RegisterMemStatus"]


class Placement(enum.Enum):
    """Where a cache's memory lives."""

    HOST = 0
    DEVICE = 1


class LLMRole(enum.Enum):
    """Role label of an instance; in cache-manager mode either role may pull or push."""

    PROMPT = 1
    DECODER = 2
    MIX = 3


class Memtype(enum.Enum):
    """Kind of memory described by a `MemInfo`."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class RegisterMemStatus(enum.Enum):
    """Memory-registration state of a legacy two-sided link."""

    OK = 0
    PREPARING = 1
    FAILED = 2

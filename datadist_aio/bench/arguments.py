"""Argument types of the benchmark's command lines (``python -m
datadist_aio.bench`` and its ``--device`` run)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from typing import Any, Optional

__all__ = ["address", "bounded", "byte_size", "listed", "positive"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def byte_size(text: str) -> int:
    """'16K', '256KiB', '4M', '1G' or a plain number of bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 16K, 4M, 1G)")
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive: {text!r}")
    return value


def listed(kind: Callable[[str], Any], choices: Optional[Sequence[str]] = None) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        items = [kind(part) for part in text.split(",") if part.strip()]
        if not items:
            raise argparse.ArgumentTypeError("give at least one value")
        bad = [i for i in items if choices is not None and i not in choices]
        if bad and choices is not None:
            raise argparse.ArgumentTypeError(f"{', '.join(map(str, bad))}: choose from {', '.join(choices)}")
        return items

    return parse


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected IP:PORT, got {text!r}")
    return host, int(port)


def bounded(kind: Callable[[str], Any], low: float, high: float = float("inf")) -> Callable[[str], Any]:
    """An argument type: a ``kind`` number from ``low`` to ``high``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low:g} to {high:g}, got {text}")
        return value

    return parse


positive: Callable[[str], Any] = bounded(int, 1)

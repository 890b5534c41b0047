"""The baseline: the cache as one buffer, sent over ``streams`` plain TCP
connections (native/bench/raw_tcp.cpp), each share acknowledged by the
receiver. Nothing a transfer engine over TCP does can beat it."""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from ... import _native
from ..layout import Layout, aligned_tensors
from .base import PUSH


class _Memory:
    def __init__(self) -> None:
        self.memory: Optional[np.ndarray] = None
        self.views: list[np.ndarray] = []

    def allocate(self, layout: Layout) -> np.ndarray:
        self.memory, self.views = aligned_tensors(layout)
        return self.memory


def _streams(variant: dict[str, Any], layout: Layout) -> int:
    """The variant's stream count; one for a layout too small to share (the 4 KiB latency run)."""
    streams = int(variant.get("streams", 1))
    return streams if layout.total_bytes >= streams * 65536 else 1


class Target:
    def __init__(self, variant: dict[str, Any], host: str) -> None:
        self.variant = variant
        self.host = host
        self.sink: Optional[Any] = None
        self.memory = _Memory()

    def open(self) -> Any:
        return self.host

    def prepare(self, layout: Layout) -> Any:
        self.close()
        memory = self.memory.allocate(layout)
        self.sink = _native.RawTcpSink(self.host, memory, _streams(self.variant, layout))
        return self.sink.port

    def tensors(self) -> list[np.ndarray]:
        return self.memory.views

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
            self.sink = None


class Initiator:
    ops = (PUSH,)
    contiguous = True

    def __init__(self, variant: dict[str, Any], opened: Any) -> None:
        self.variant = variant
        self.host = opened
        self.source: Optional[Any] = None
        self.memory = _Memory()

    def prepare(self, layout: Layout, prepared: Any) -> None:
        self.close()
        memory = self.memory.allocate(layout)
        self.source = _native.RawTcpSource(self.host, prepared, memory, _streams(self.variant, layout))

    def tensors(self) -> list[np.ndarray]:
        return self.memory.views

    def batch(self, op: str, table: list[int]) -> None:
        self.source.send_round()

    def latency(self, ops: int) -> list[float]:
        seconds = []
        for _ in range(ops):
            start = time.perf_counter()
            self.source.send_round()
            seconds.append(time.perf_counter() - start)
        return seconds

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None

"""The baseline: the cache as one buffer, sent over ``streams`` plain TCP
connections (native/bench/raw_tcp.cpp), each share acknowledged by the
receiver. Nothing a transfer engine over TCP does can beat it."""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from ... import _native
from ..layout import Layout
from .base import PUSH, Memory


def _streams(variant: dict[str, Any], layout: Layout) -> int:
    """The variant's stream count; one for a layout too small to share (the 4 KiB latency run)."""
    streams = int(variant.get("streams", 1))
    return streams if layout.total_bytes >= streams * 65536 else 1


class Target:
    def __init__(self, variant: dict[str, Any], host: str) -> None:
        self.variant = variant
        self.host = host
        self.sink: Optional[Any] = None
        self.memory = Memory()

    def open(self) -> Any:
        return self.host

    def prepare(self, layout: Layout) -> Any:
        self.close()
        self.memory.prepare(layout)
        self.sink = _native.RawTcpSink(self.host, self.memory.memory, _streams(self.variant, layout))
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
        self.memory = Memory()

    def prepare(self, layout: Layout, prepared: Any) -> None:
        self.close()
        self.memory.prepare(layout)
        self.source = _native.RawTcpSource(self.host, prepared, self.memory.memory, _streams(self.variant, layout))

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

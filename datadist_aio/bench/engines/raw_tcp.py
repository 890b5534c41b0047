"""The baseline: the cache as one buffer, sent over ``streams`` plain TCP
connections (native/bench/raw_tcp.cpp), each share acknowledged by the
receiver. Nothing a transfer engine over TCP does can beat it.

With one stream the latency run is a ping-pong on one connection, from the
calling thread to the receiver's thread, both living as long as the
connection. The ``busy_poll`` variant spins on non-blocking reads at both
ends instead of sleeping: the round trip without thread wake-ups. The
``unix`` variant runs the ping-pong over a Unix stream socket: the floor of
a round trip between two processes of one host without the TCP/IP stack."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Optional

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
        self.memory: Memory = Memory()

    def open(self) -> Any:
        return self.host

    def prepare(self, layout: Layout) -> Any:
        self.close()
        self.memory.prepare(layout)
        where = "unix" if self.variant.get("unix") else self.host
        self.sink = _native.RawTcpSink(where, self.memory.memory, _streams(self.variant, layout),
                                       bool(self.variant.get("busy_poll", False)))
        return self.sink.address, self.sink.port

    def tensors(self) -> list[np.ndarray]:
        return self.memory.views

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
            self.sink = None


class Initiator:
    ops: ClassVar[tuple[str, ...]] = (PUSH,)
    contiguous = True

    def __init__(self, variant: dict[str, Any], opened: Any) -> None:
        self.variant = variant
        self.host = opened
        self.source: Optional[Any] = None
        self.memory: Memory = Memory()

    def prepare(self, layout: Layout, prepared: Any) -> None:
        self.close()
        self.memory.prepare(layout)
        address, port = prepared
        self.source = _native.RawTcpSource(address, port, self.memory.memory, _streams(self.variant, layout),
                                           bool(self.variant.get("busy_poll", False)))

    def tensors(self) -> list[np.ndarray]:
        return self.memory.views

    def _source(self) -> Any:
        if self.source is None:
            raise RuntimeError("no layout is prepared")
        return self.source

    def batch(self, op: str, table: list[int]) -> None:
        self._source().send_round()

    def latency(self, ops: int) -> list[float]:
        seconds = []
        source = self._source()
        for _ in range(ops):
            start = time.perf_counter()
            source.send_round()
            seconds.append(time.perf_counter() - start)
        return seconds

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None

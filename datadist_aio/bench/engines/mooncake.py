"""Mooncake Transfer Engine over its TCP transport.

Both sides run an engine in P2P-handshake mode (no metadata server): the
target's segment is named ``host:rpc_port`` and the initiator fetches its
descriptor from that port on the first transfer. Each side registers its one
page-aligned allocation; a batch is a ``batch_transfer_sync_*`` call with a
descriptor per block (local address, remote address, length).

Environment, set in the constructor before the engine exists and only where
the user has not set it already:

* ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` and
  ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``: the TCP transport queues each
  descriptor of a batch on the peer's lanes, holds a second lot waiting for
  admission and fails the batch beyond that (1024 each by default); a batch
  has one descriptor per block of every tensor, thousands of them, so both go
  to the largest value it accepts (65535). A batch of more descriptors than
  the queue holds is moved as consecutive calls of at most that many.
* ``MC_LOG_LEVEL``: the engine logs every step of its start at INFO; ERROR
  keeps the benchmark's output readable.

Mooncake takes no variant settings.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, ClassVar

import numpy as np

from ..layout import Layout
from .base import PULL, PUSH, Memory, Unavailable

# The largest per-peer queue and admission limits the TCP transport accepts.
_QUEUED = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
_ENVIRONMENT = {
    _QUEUED: "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_LOG_LEVEL": "ERROR",
}


def _queue_limit() -> int:
    """Descriptors the peer's queue holds, as the transport reads it (1024 when unparsable)."""
    value = os.environ.get(_QUEUED, "")
    return int(value) if value.isdigit() and 1 <= int(value) <= 65535 else 1024


def _engine(host: str) -> Any:
    """A started engine on ``host`` (TCP transport, P2P handshake)."""
    for name, value in _ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found]  # pyright: ignore[reportMissingImports]
    except ImportError as e:
        raise Unavailable(f"mooncake is not installed ({e})") from e
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise Unavailable(f"mooncake cannot start its TCP transport on {host}")
    return engine


def _local_address(segment: str) -> str:
    """This machine's address on the route to the target's ``host:port`` (no packet is sent)."""
    host, _, port = segment.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, int(port)))
        return probe.getsockname()[0]


class _Memory(Memory):
    """Memory registered with a Mooncake engine."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine

    def register(self, layout: Layout) -> None:
        if self.engine.register_memory(self.address, layout.total_bytes) != 0:
            raise RuntimeError(f"mooncake cannot register {layout.total_bytes} bytes")

    def unregister(self) -> None:
        self.engine.unregister_memory(self.address)


class Target:
    def __init__(self, variant: dict[str, Any], host: str) -> None:
        self.host = host
        self.engine: Any = _engine(host)
        self.memory: _Memory = _Memory(self.engine)

    def open(self) -> str:
        """The segment name the initiator addresses: ``host:rpc_port``."""
        return f"{self.host}:{self.engine.get_rpc_port()}"

    def prepare(self, layout: Layout) -> int:
        """The address of the registered memory."""
        self.memory.prepare(layout)
        return self.memory.address

    def tensors(self) -> list[np.ndarray]:
        return self.memory.views

    def close(self) -> None:
        self.memory.release()


class Initiator:
    ops: ClassVar[tuple[str, ...]] = (PUSH, PULL)

    def __init__(self, variant: dict[str, Any], opened: str) -> None:
        self.segment = opened
        self.engine: Any = _engine(_local_address(opened))
        self.memory: _Memory = _Memory(self.engine)
        self.remote: int = 0
        self.chunk: int = _queue_limit()

    def prepare(self, layout: Layout, prepared: int) -> None:
        self.memory.prepare(layout)
        self.remote = prepared

    def tensors(self) -> list[np.ndarray]:
        return self.memory.views

    def batch(self, op: str, table: list[int]) -> None:
        layout = self.memory.layout
        assert layout is not None, "prepare() first"
        if op not in self.ops:
            raise ValueError(f"mooncake does not support {op!r}")
        move = self.engine.batch_transfer_sync_write if op == PUSH else self.engine.batch_transfer_sync_read
        # Block i of tensor t, local and remote: memory + tensor offset + block offset.
        size = np.uint64(layout.block_size)
        tensors = np.arange(layout.tensors, dtype=np.uint64)[:, None] * np.uint64(layout.tensor_bytes)
        local = (tensors + np.arange(layout.blocks, dtype=np.uint64) * size + np.uint64(self.memory.address)).ravel()
        remote = (tensors + np.asarray(table, dtype=np.uint64) * size + np.uint64(self.remote)).ravel()
        for start in range(0, local.size, self.chunk):
            part = slice(start, start + self.chunk)
            sources, destinations = local[part].tolist(), remote[part].tolist()
            if move(self.segment, sources, destinations, [layout.block_size] * len(sources)) != 0:
                raise RuntimeError(f"mooncake {op} of {len(sources)} blocks to {self.segment} failed")

    def latency(self, ops: int) -> list[float]:
        layout = self.memory.layout
        assert layout is not None, "prepare() first"
        local, remote, size = self.memory.address, self.remote, layout.block_size  # block 0 to block 0
        write, segment = self.engine.transfer_sync_write, self.segment
        seconds = []
        for _ in range(ops):
            start = time.perf_counter()
            if write(segment, local, remote, size) != 0:
                raise RuntimeError(f"mooncake write to {segment} failed")
            seconds.append(time.perf_counter() - start)
        return seconds

    def close(self) -> None:
        self.memory.release()

"""What an engine plugs into the benchmark.

An engine is two classes, each living in its own spawned process:

* ``Target`` (the decode side) owns the remote memory. The benchmark calls
  ``open()`` once, then for each layout ``prepare(layout, seed)``, ``fill``
  and ``digest`` as the run needs them, and finally ``close()``.
* ``Initiator`` (the prefill side) owns the local memory and moves the bytes.
  It gets what ``Target.open()`` and ``Target.prepare()`` returned (plain
  picklable values: ports, addresses, metadata) and never touches remote
  memory except through the engine.

``batch(op, table)`` moves the whole cache once and returns only when every byte
has landed; the benchmark times it. ``latency(ops)`` returns the seconds of
``ops`` sequential single-block writes, each waited for before the next.
An initiator whose ``contiguous`` is true moves the memory as it lies (the
raw socket baseline): it is given the identity table.

A target whose engine has no thread of its own to take in what arrives may
have a ``drive()`` method: its process then calls it in a loop whenever it
is not answering a request.

``variant`` is a dict of engine settings (event loop, transports, progress
thread); ``label`` names the variant in tables and plots. A class may raise
``Unavailable`` from its constructor when the engine is not installed or
cannot run here; the benchmark then reports it as skipped, with the reason.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any, ClassVar, Protocol

import numpy as np

from ..layout import Layout, aligned_tensors

PUSH, PULL, LAYERWISE = "push", "pull", "layerwise"

# UCX transports of the UCX comparison, by the name a variant gives them, as
# UCX_TLS. Both engines ask UCX for peer-failure handling, which none of its
# shared-memory transports offers; with "shm" alone UCX finds no transport
# for its own messages and refuses the endpoint, so "shm" adds TCP for those.
# Which transport then carries the bytes is UCX's choice: cma (one kernel
# copy) with UCX 1.23, TCP with UCX 1.13, whose cma has no peer-failure
# handling either (docs/benchmarks.md, "The UCX comparison").
UCX_TLS = {"tcp": "tcp", "shm": "shm,self,tcp"}


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def set_ucx_tls(name: str, host: str) -> None:
    """Set ``UCX_TLS`` for the transports named ``name`` (a key of ``UCX_TLS``)
    for a peer on ``host``, before anything in the process reads UCX's
    configuration; on loopback also ``UCX_NET_DEVICES=lo`` unless set, or
    UCX would stripe its network transports over every interface it finds."""
    if name not in UCX_TLS:
        raise ValueError(f"ucx tls must be one of {tuple(UCX_TLS)}, not {name!r}")
    os.environ["UCX_TLS"] = UCX_TLS[name]
    if loopback(host):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


class Unavailable(RuntimeError):
    """The engine is not installed or cannot run on this machine."""


class Target(Protocol):
    def __init__(self, variant: dict[str, Any], host: str) -> None: ...

    def open(self) -> Any:
        """Start listening; returns what the initiator needs to reach this side."""
        ...

    def prepare(self, layout: Layout) -> Any:
        """Allocate (or reuse) remote memory for ``layout``; returns what the
        initiator needs to address it."""
        ...

    def tensors(self) -> list[np.ndarray]:
        """The remote memory of the current layout, one ``[blocks, block_size]`` view per tensor."""
        ...

    def close(self) -> None: ...


class Initiator(Protocol):
    ops: ClassVar[tuple[str, ...]]  # the operations it supports, of PUSH, PULL, LAYERWISE
    contiguous: ClassVar[bool] = False

    def __init__(self, variant: dict[str, Any], opened: Any) -> None: ...

    def prepare(self, layout: Layout, prepared: Any) -> None:
        """Allocate local memory for ``layout``; ``prepared`` is what ``Target.prepare`` returned."""
        ...

    def tensors(self) -> list[np.ndarray]:
        """The local memory of the current layout."""
        ...

    def batch(self, op: str, table: list[int]) -> None:
        """Move every tensor's block ``i`` to/from remote block ``table[i]``; return once all landed."""
        ...

    def latency(self, ops: int) -> list[float]:
        """Seconds of each of ``ops`` sequential writes of local block 0 into remote block 0
        of the current layout (one tensor of one 4 KiB block), each waited for."""
        ...

    def close(self) -> None: ...


def label(engine: str, variant: dict[str, Any]) -> str:
    """``engine`` followed by the variant's settings, for tables and plots."""
    if not variant:
        return engine
    return engine + " (" + ", ".join(f"{k}={v}" if not isinstance(v, bool) else (k if v else f"no {k}")
                                     for k, v in variant.items()) + ")"


class Memory:
    """The memory of one layout on one side: one page-aligned allocation
    holding every tensor. Engines that must know about it override
    ``register`` and ``unregister``."""

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self.memory: np.ndarray | None = None
        self.views: list[np.ndarray] = []

    @property
    def address(self) -> int:
        assert self.memory is not None, "prepare() first"
        return self.memory.ctypes.data

    def prepare(self, layout: Layout) -> None:
        """Allocate and register memory for ``layout`` (kept when it is the current one)."""
        ...
        if layout == self.layout:
            return
        self.release()
        self.memory, self.views = aligned_tensors(layout)
        self.layout = layout
        self.register(layout)

    def release(self) -> None:
        if self.memory is not None:
            self.unregister()
        self.layout, self.memory, self.views = None, None, []

    def register(self, layout: Layout) -> None:
        pass

    def unregister(self) -> None:
        pass

"""NIXL with its UCX backend, on host memory.

Each side runs an agent and registers its one page-aligned allocation as
``DRAM``. The initiator loads the target's agent metadata (what ``open`` and
``prepare`` return; ``prepare`` returns it again after registering, since it
then carries the memory's keys) and moves a batch as one transfer request:
two ``N x 3`` descriptor lists, one row per block of every tensor, built with
numpy, then ``initialize_xfer`` / ``transfer`` / polling ``check_xfer_state``.

Variant settings:

* ``tls``: ``"default"`` leaves ``UCX_TLS`` alone, so UCX picks what suits
  two processes of one machine (cross-memory attach for the bytes, TCP on
  ``lo`` for its own messages); ``"tcp"`` and ``"shm"`` set ``UCX_TLS`` as
  ``base.UCX_TLS`` says.
* ``progress_thread``: whether the initiator's agent runs NIXL's progress
  thread; without it, polling ``check_xfer_state`` drives UCX. NIXL's
  Python agent runs that thread without a delay, so it keeps a core busy.
* ``target_progress_thread`` (default true): the same on the target. The
  target makes no call during a transfer, yet UCX needs its worker driven
  to finish one (to answer the flush that completes a transfer; over TCP
  even to take in the bytes), or the initiator waits forever. Without the
  thread, the target's process drives it with ``drive()`` whenever it is
  not answering a request: a loop that polls NIXL's notifications.

Environment, set in the constructor before the agent exists (only where the
user has not set it, except ``UCX_TLS`` for a ``tls`` other than
``"default"``):

* ``UCX_NET_DEVICES=lo`` when the target's host is a loopback address: both
  sides share the machine, and UCX would otherwise stripe its network
  transports over every interface it finds.
* ``NIXL_LOG_LEVEL=WARN``: NIXL announces each agent and backend at INFO.

A process that has created a UCX backend crashes in NIXL's teardown at
interpreter exit, so it must leave through ``os._exit`` (the benchmark's
session processes do). ``close()`` releases the memory and the remote agent
and leaves the agent itself to that exit.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import numpy as np

from ..layout import Layout
from .base import PULL, PUSH, UCX_TLS, Memory, Unavailable, loopback, set_ucx_tls

TLS = ("default", *UCX_TLS)
_OPERATION = {PUSH: "WRITE", PULL: "READ"}
_CONNECT_SECONDS = 10.0


def _agent(variant: dict[str, Any], role: str, host: str, progress_thread: bool) -> Any:
    """A NIXL agent with a UCX backend, on the transports ``variant`` names, for a target on ``host``."""
    tls = variant.get("tls", "default")
    if tls not in TLS:
        raise ValueError(f"nixl: tls must be one of {TLS}, not {tls!r}")
    if loopback(host):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if tls != "default":
        set_ucx_tls(tls, host)
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]  # pyright: ignore[reportMissingImports]
    except ImportError as e:
        raise Unavailable(f"nixl is not installed ({e})") from e
    config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    agent = nixl_agent(f"datadist-bench-{role}-{os.getpid()}", config)
    if "UCX" not in agent.backends:
        raise Unavailable("nixl has no UCX backend here")
    return agent


def _post(agent: Any, handle: Any) -> None:
    """Post ``handle`` and poll it until it is done."""
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"nixl transfer failed ({state})")


def _request(agent: Any, operation: str, local: Any, remote: Any, peer: str) -> Any:
    """A transfer request, with NIXL's errors (which are not RuntimeErrors) turned into one."""
    try:
        return agent.initialize_xfer(operation, local, remote, peer)
    except Exception as e:
        raise RuntimeError(f"nixl cannot set up a {operation} of {local.descCount()} blocks: {e!r}") from e


class _Memory(Memory):
    """Memory registered with a NIXL agent as ``DRAM``."""

    def __init__(self, agent: Any) -> None:
        super().__init__()
        self.agent = agent
        self.registered: Any = None

    def register(self, layout: Layout) -> None:
        region = np.array([[self.address, layout.total_bytes, 0]], dtype=np.uint64)
        self.registered = self.agent.register_memory(region, "DRAM", backends=["UCX"])

    def unregister(self) -> None:
        if self.registered is not None:
            self.agent.deregister_memory(self.registered, backends=["UCX"])
            self.registered = None


class Target:
    def __init__(self, variant: dict[str, Any], host: str) -> None:
        # UCX advertises its own addresses; ``host`` only tells whether the run is local.
        self.host = host
        thread = bool(variant.get("target_progress_thread", True))
        self.agent: Any = _agent(variant, "target", host, progress_thread=thread)
        self.memory: _Memory = _Memory(self.agent)
        if not thread:
            self.drive = self._drive

    def _drive(self) -> None:
        """Progress the agent's UCX worker once (fetching notifications does)."""
        self.agent.get_new_notifs()

    def open(self) -> list[Any]:
        """The agent's metadata (its name and how to connect to it) and the host."""
        return [self.agent.get_agent_metadata(), self.host]

    def prepare(self, layout: Layout) -> list[Any]:
        """The agent's metadata, now with the registered memory, and that memory's address."""
        self.memory.prepare(layout)
        return [self.agent.get_agent_metadata(), self.memory.address]

    def tensors(self) -> list[np.ndarray]:
        return self.memory.views

    def close(self) -> None:
        self.memory.release()


class Initiator:
    ops: ClassVar[tuple[str, ...]] = (PUSH, PULL)

    def __init__(self, variant: dict[str, Any], opened: list[Any]) -> None:
        metadata, host = opened
        self.agent: Any = _agent(variant, "initiator", host, progress_thread=bool(variant.get("progress_thread", False)))
        self.memory: _Memory = _Memory(self.agent)
        self.remote: int = 0
        self.peer: str | None = None
        self._load(metadata)

    def _load(self, metadata: bytes) -> None:
        """Load the target's metadata, replacing what was loaded before (whose memory keys
        are stale), and connect, so that the first batch does not pay for it."""
        if self.peer is not None:
            self.agent.remove_remote_agent(self.peer)
        self.peer = self.agent.add_remote_agent(metadata)
        deadline = time.monotonic() + _CONNECT_SECONDS
        while not self.agent.check_remote_metadata(self.peer):
            if time.monotonic() > deadline:
                raise RuntimeError(f"nixl: metadata of {self.peer} did not load")
            time.sleep(0.001)
        self.agent.make_connection(self.peer)

    def prepare(self, layout: Layout, prepared: list[Any]) -> None:
        metadata, self.remote = prepared
        self.memory.prepare(layout)
        self._load(metadata)

    def tensors(self) -> list[np.ndarray]:
        return self.memory.views

    def _descriptors(self, base: int, blocks: np.ndarray) -> Any:
        """A ``DRAM`` descriptor list of ``blocks`` (block numbers) of every tensor in memory at ``base``."""
        layout = self.memory.layout
        assert layout is not None, "prepare() first"
        tensors = np.arange(layout.tensors, dtype=np.uint64)[:, None] * np.uint64(layout.tensor_bytes)
        rows = np.empty((layout.tensors * blocks.size, 3), dtype=np.uint64)
        rows[:, 0] = (tensors + blocks * np.uint64(layout.block_size) + np.uint64(base)).ravel()
        rows[:, 1] = layout.block_size
        rows[:, 2] = 0
        return self.agent.get_xfer_descs(rows, "DRAM")

    def batch(self, op: str, table: list[int]) -> None:
        layout = self.memory.layout
        assert layout is not None and self.peer is not None, "prepare() first"
        local = self._descriptors(self.memory.address, np.arange(layout.blocks, dtype=np.uint64))
        remote = self._descriptors(self.remote, np.asarray(table, dtype=np.uint64))
        handle = _request(self.agent, _OPERATION[op], local, remote, self.peer)
        try:
            _post(self.agent, handle)
        finally:
            self.agent.release_xfer_handle(handle)

    def latency(self, ops: int) -> list[float]:
        layout = self.memory.layout
        assert layout is not None and self.peer is not None, "prepare() first"
        agent, seconds = self.agent, []
        local, remote = ([[address, layout.block_size, 0]] for address in (self.memory.address, self.remote))
        # One request, posted again for each op once the previous one is done.
        handle = _request(agent, "WRITE", agent.get_xfer_descs(np.array(local, dtype=np.uint64), "DRAM"),
                          agent.get_xfer_descs(np.array(remote, dtype=np.uint64), "DRAM"), self.peer)
        try:
            for _ in range(ops):
                start = time.perf_counter()
                _post(agent, handle)
                seconds.append(time.perf_counter() - start)
        finally:
            agent.release_xfer_handle(handle)
        return seconds

    def close(self) -> None:
        self.memory.release()
        if self.peer is not None:
            self.agent.remove_remote_agent(self.peer)
            self.peer = None

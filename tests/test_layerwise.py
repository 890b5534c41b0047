"""transfer_cache_async: a layer-wise transfer paced by a LayerSynchronizer.

The test process is the prefill side: an in-process LLMDataDist, made and
linked for each test, either in remote-cache-accessible mode ("key": the
configs are ``TransferWithCacheKeyConfig``) or not ("raw": ``TransferConfig``
with addresses the peer gave). The decode side is two peer processes, B and
C, shared by the module. The synchronizers record every call and can hold a
layer until the test releases it, so a test sees which layers were asked for
and which have arrived on a peer in between. Every test checks the bytes that
arrived and that every other byte of the destination kept what it held. The
async tests run under asyncio and uvloop; the checks of the arguments and the
blocking use run without an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Optional, Union

import numpy as np
import pytest

import datadist_aio as dd
from support.cache_bytes import fill_random, snapshot
from support.peer import (HAVE_UCX, LOOPBACK, UCX_WHY, MiB, CacheRef, Peer, PeerGroup, cluster_info, pool_cfg,
                          raises_status, ucx_loopback_devices)

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
FAILED = dd.LLMStatusCode.LLM_FAILED
PARAM_INVALID = dd.LLMStatusCode.LLM_PARAM_INVALID
NOT_EXIST = dd.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
NOT_YET_LINK = dd.LLMStatusCode.LLM_NOT_YET_LINK
TIMEOUT = dd.LLMStatusCode.LLM_TIMEOUT
A, B, C, UNLINKED = 1, 2, 3, 99

LAYERS = 4  # of every source cache: 8 tensors, layer l = tensors 2l and 2l + 1
SLOT = 512  # bytes of a batch slot of a contiguous cache
BLOCK = 256  # bytes of a block
CHUNK = 192  # dst_block_memory_size of contiguous -> blocks: a slot is 192 + 192 + 128 bytes
SRC_BLOCKS = [3, 4, 5, 0, 9]
DST_BLOCKS = [20, 21, 22, 7, 13]
CHUNK_BLOCKS = [7, 0, 4]
WAIT = 10.0  # seconds any one wait of a test may take
WAIT_MS = int(WAIT * 1000)
QUIET = 0.05  # seconds left for a call or a write that must not happen
SYNC_KV_TIMEOUT = 5000  # ms, of the prefill side: what synchronize_layer gets as timeout_in_millis

pytestmark = pytest.mark.timeout(60)

_model_ids = itertools.count(300)

Move = tuple[int, int, int]  # (source offset, destination offset, length) inside one tensor
Tensors = Sequence[np.ndarray]


# -- synchronizers ---------------------------------------------------------------------


class _Recorder:
    """What both synchronizers note: the calls, the layers released, the threads and loops.

    Args:
        hold: ``True`` to hold every layer, or the layers to hold, until ``release``.
        verdicts: What ``synchronize_layer`` gives for a layer instead of True:
            False, or an exception instance to raise.
    """

    def __init__(self, hold: Union[bool, Iterable[int]] = (), verdicts: Optional[dict[int, Any]] = None) -> None:
        self.hold_all = hold is True
        self.held = set() if isinstance(hold, bool) else set(hold)
        self.verdicts = dict(verdicts or {})
        self.calls: list[tuple[int, Optional[int]]] = []
        self.returned: list[int] = []
        self.threads: set[int] = set()
        self.loops: set[asyncio.AbstractEventLoop] = set()
        self.violations: list[str] = []

    @property
    def layers(self) -> list[int]:
        """The layers asked for, in order."""
        return [layer for layer, _ in self.calls]

    def _enter(self, layer: int, timeout: Optional[int]) -> None:
        pending = [asked for asked, _ in self.calls if asked not in self.returned]
        if pending:
            self.violations.append(f"layer {layer} asked for while layers {pending} were not released")
        if self.calls and layer <= self.calls[-1][0]:
            self.violations.append(f"layer {layer} asked for after layer {self.calls[-1][0]}")
        self.calls.append((layer, timeout))
        self.threads.add(threading.get_ident())

    def _holds(self, layer: int) -> bool:
        return self.hold_all or layer in self.held

    def _verdict(self, layer: int) -> bool:
        self.returned.append(layer)
        verdict = self.verdicts.get(layer, True)
        if isinstance(verdict, BaseException):
            raise verdict
        return verdict


class Gate(_Recorder, dd.LayerSynchronizer):
    """A coroutine synchronizer; a held layer waits on an ``asyncio.Event``.

    ``release`` must be called on the loop that runs the transfer.
    """

    def __init__(self, hold: Union[bool, Iterable[int]] = (), verdicts: Optional[dict[int, Any]] = None) -> None:
        super().__init__(hold, verdicts)
        self._events: dict[int, asyncio.Event] = {}

    def release(self, layer: int) -> None:
        self._events.setdefault(layer, asyncio.Event()).set()

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        self._enter(layer_index, timeout_in_millis)
        self.loops.add(asyncio.get_running_loop())
        if self._holds(layer_index):
            await self._events.setdefault(layer_index, asyncio.Event()).wait()
        return self._verdict(layer_index)


class ThreadGate(_Recorder, dd.LayerSynchronizer):
    """A plain (blocking) synchronizer; a held layer waits on a ``threading.Event``.

    A layer never released gives False after ``WAIT`` seconds and is noted
    as a violation, so a lost release cannot hang a worker thread.
    """

    def __init__(self, hold: Union[bool, Iterable[int]] = (), verdicts: Optional[dict[int, Any]] = None) -> None:
        super().__init__(hold, verdicts)
        self._lock = threading.Lock()
        self._events: dict[int, threading.Event] = {}
        self._open = False

    def _event(self, layer: int) -> threading.Event:
        with self._lock:
            event = self._events.setdefault(layer, threading.Event())
            if self._open:
                event.set()
            return event

    def release(self, layer: int) -> None:
        self._event(layer).set()

    def release_all(self) -> None:
        """Lets every layer through, now and later."""
        with self._lock:
            self._open = True
            for event in self._events.values():
                event.set()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        self._enter(layer_index, timeout_in_millis)
        if self._holds(layer_index) and not self._event(layer_index).wait(WAIT):
            self.violations.append(f"layer {layer_index} was never released")
            return False
        return self._verdict(layer_index)


class WatchedGate(_Recorder, dd.LayerGate):
    """A ``LayerGate``, which the transfer watches instead of awaiting: a
    layer not held is decided as the transfer asks for it; a held one by
    ``release``, on a thread of its own, where the transfer then sends it.
    Verdicts are True or False only (a gate cannot raise)."""

    def __init__(self, hold: Union[bool, Iterable[int]] = (), verdicts: Optional[dict[int, Any]] = None) -> None:
        _Recorder.__init__(self, hold, verdicts)
        dd.LayerGate.__init__(self)

    def watch_layer(self, layer_index: int, on_decided: Callable[[bool], None]) -> Optional[bool]:
        self._enter(layer_index, None)
        if not self._holds(layer_index):
            self._decide(layer_index, self._verdict(layer_index))
        return super().watch_layer(layer_index, on_decided)

    def release(self, layer: int) -> None:
        def decide() -> None:
            self._decide(layer, self._verdict(layer))

        thread = threading.Thread(target=decide, name=f"model-layer-{layer}")
        thread.start()
        thread.join(WAIT)


STYLES = ["async", "thread", "watched"]  # a coroutine synchronizer, a plain one, a gate


def assert_ran_as(gate: _Recorder, style: str) -> None:
    """A coroutine synchronizer ran on the test's loop, a plain one off its thread."""
    if style == "async":
        assert gate.loops == {asyncio.get_running_loop()}
    elif style == "watched":
        assert isinstance(gate, WatchedGate) and not gate.loops
    else:
        assert threading.get_ident() not in gate.threads, "a plain synchronizer ran on the event loop's thread"
    assert not gate.violations, gate.violations


# -- the two sides -----------------------------------------------------------------------


class Prefill:
    """The in-process side: its cache manager, the decode peers it linked, its synchronizers."""

    def __init__(self, mode: str, datadist: dd.LLMDataDist, peers: Sequence[Peer]) -> None:
        self.mode = mode  # "key": TransferWithCacheKeyConfig; "raw": TransferConfig
        self.datadist = datadist
        self.cm = datadist.cache_manager
        self.peers = peers
        self.rng = np.random.default_rng(7)
        self._thread_gates: list[ThreadGate] = []

    @property
    def b(self) -> Peer:
        return self.peers[0]

    @property
    def c(self) -> Peer:
        return self.peers[1]

    def source(self, desc: dd.CacheDesc, blocks: bool = False) -> tuple[dd.Cache, list[np.ndarray]]:
        """A cache filled with random bytes, and those bytes."""
        cache = self.cm.allocate_blocks_cache(desc) if blocks else self.cm.allocate_cache(desc)
        return cache, fill_random(cache, self.rng)

    def synchronizer(
        self, style: str = "async", hold: Union[bool, Iterable[int]] = (), verdicts: Optional[dict[int, Any]] = None
    ) -> Union[Gate, ThreadGate, WatchedGate]:
        if style == "async":
            return Gate(hold, verdicts)
        if style == "watched":
            return WatchedGate(hold, verdicts)
        gate = ThreadGate(hold, verdicts)
        self._thread_gates.append(gate)
        return gate

    def release_threads(self) -> None:
        for gate in self._thread_gates:
            gate.release_all()


@contextlib.contextmanager
def prefill_side(
    mode: str, peers: Sequence[Peer], link: bool = True, local: str = LOOPBACK, path: Optional[str] = None,
    access: Optional[str] = None, sync_kv_timeout: int = SYNC_KV_TIMEOUT,
) -> Iterator[Prefill]:
    """An initialised PROMPT instance, cluster A, linked to ``peers`` from the
    address ``local``; finalized on exit and every cache of the peers freed.
    Each link's path is checked: ``path``, else the one the mode asks for.
    ``access``: its ``LLMConfig.access`` (unset: the default, one-sided)."""
    mode, _, transport = mode.partition("-")
    assert mode in ("key", "raw") and transport in ("", "tcp", "ucx"), (mode, transport)
    config = dd.LLMConfig()
    if transport:
        config.transport = transport
    if access is not None:
        config.access = access
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = mode == "key"
    config.host_mem_pool_cfg = pool_cfg(64 * MiB)
    config.sync_kv_timeout = sync_kv_timeout
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, A)
    datadist.init(config.generate_options())
    side = Prefill(mode, datadist, peers)
    try:
        if link and peers:
            clusters = [cluster_info(peer.cluster_id, peer.listen_port, peer.address, local) for peer in peers]
            assert datadist.link_clusters(clusters, 3000) == (SUCCESS, [SUCCESS] * len(peers))
            for peer in peers:
                assert datadist.link_transport(peer.cluster_id) == (path or transport or "same_host")
        yield side
    finally:
        side.release_threads()
        datadist.finalize()
        for peer in peers:
            peer.free_all()


@pytest.fixture(scope="module")
def decoders() -> Iterator[tuple[Peer, Peer]]:
    """The decode processes B and C, shared by the module."""
    with PeerGroup() as group:
        yield group.start("b", dd.LLMRole.DECODER, B), group.start("c", dd.LLMRole.DECODER, C)


@pytest.fixture(scope="module")
def ucx_decoders() -> Iterator[tuple[Peer, Peer]]:
    """B and C with transport "ucx", for a prefill side that says "ucx" too."""
    if not HAVE_UCX:
        pytest.skip(f"no UCX: {UCX_WHY}")
    options = {"transport": "ucx"}
    with PeerGroup() as group:
        yield (group.start("b-ucx", dd.LLMRole.DECODER, B, options=options),
               group.start("c-ucx", dd.LLMRole.DECODER, C, options=options))


@pytest.fixture
def prefill(request: pytest.FixtureRequest, decoders: tuple[Peer, Peer]) -> Iterator[Prefill]:
    """The prefill side linked to B and C; "key" mode unless parametrized with "raw"."""
    with prefill_side(getattr(request, "param", "key"), decoders) as side:
        yield side


@pytest.fixture(params=["key", "raw"])
def ucx_prefill(request: pytest.FixtureRequest, ucx_decoders: tuple[Peer, Peer],
                monkeypatch: pytest.MonkeyPatch) -> Iterator[Prefill]:
    """The prefill side linked to B and C over UCX, in each mode, its UCX on
    the devices the peers' is (``ucx_loopback_devices()``)."""
    devices = ucx_loopback_devices()
    if devices is not None and "UCX_NET_DEVICES" not in os.environ:
        monkeypatch.setenv("UCX_NET_DEVICES", devices)
    with prefill_side(request.param + "-ucx", ucx_decoders) as side:
        yield side


# -- geometry and the expected bytes ---------------------------------------------------------


def slots_desc(batch: int, layers: int = LAYERS, slot: int = SLOT) -> dd.CacheDesc:
    return dd.CacheDesc(2 * layers, [batch, slot], dd.DataType.DT_UINT8, dd.Placement.HOST)


def blocks_desc(num_blocks: int, layers: int = LAYERS, block: int = BLOCK) -> dd.CacheDesc:
    return dd.CacheDesc(2 * layers, [num_blocks, block], dd.DataType.DT_UINT8, dd.Placement.HOST)


def slot_moves(src_slot: int, dst_slot: int, size: int = SLOT) -> list[Move]:
    return [(src_slot * size, dst_slot * size, size)]


def block_moves(src_blocks: Sequence[int], dst_blocks: Sequence[int], size: int = BLOCK) -> list[Move]:
    return [(s * size, d * size, size) for s, d in zip(src_blocks, dst_blocks, strict=True)]


def chunk_moves(src_slot: int, dst_blocks: Sequence[int], chunk: int = CHUNK, slot: int = SLOT) -> list[Move]:
    """Chunk j of the source slot, ``[j*chunk, min((j+1)*chunk, slot))``, to block ``dst_blocks[j]``."""
    return [
        (src_slot * slot + j * chunk, d * chunk, min(chunk, slot - j * chunk)) for j, d in enumerate(dst_blocks)
    ]


def expect(
    before: Tensors, source: Tensors, layers: Iterable[tuple[int, int]], moves: Sequence[Move]
) -> list[np.ndarray]:
    """``before`` after every move of source layer ``s`` into destination layer ``d``, for each ``(s, d)``."""
    expected = [t.copy() for t in before]
    for src_layer, dst_layer in layers:
        for i in range(2):
            src, dst = source[2 * src_layer + i], expected[2 * dst_layer + i]
            for src_offset, dst_offset, length in moves:
                dst[dst_offset : dst_offset + length] = src[src_offset : src_offset + length]
    return expected


def pairs(src: range, dst: Optional[range] = None) -> list[tuple[int, int]]:
    return list(zip(src, src if dst is None else dst, strict=True))


def same(got: Tensors, expected: Tensors) -> bool:
    return len(got) == len(expected) and all(np.array_equal(g, e) for g, e in zip(got, expected))


def assert_tensors(got: Tensors, expected: Tensors, where: str = "") -> None:
    assert len(got) == len(expected)
    for t, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(g, e, err_msg=f"tensor {t} {where}")


def raw(addrs: Sequence[int], dst_layers: Iterable[int], offset: int = 0) -> list[int]:
    """``TransferConfig.dst_addrs``: K and V of each destination layer, at ``offset`` into the tensor."""
    return [addrs[2 * layer + i] + offset for layer in dst_layers for i in range(2)]


def remote(
    peer: Peer,
    desc: dd.CacheDesc,
    seed: int,
    blocks: bool = False,
    registered: bool = False,
    remote_accessible: Optional[bool] = None,
) -> tuple[CacheRef, list[np.ndarray]]:
    """A cache of the peer (a blocks cache is bound to a fresh model id), filled; its bytes."""
    model_id = next(_model_ids) if blocks else None
    if registered:
        ref = peer.register(desc, blocks=blocks, model_id=model_id, remote_accessible=remote_accessible)
    else:
        ref = peer.allocate(desc, blocks=blocks, model_id=model_id)
    return ref, peer.fill(ref, seed)


class Kind(NamedTuple):
    """One kind of transfer: source and destination geometry and the call's block arguments."""

    source: Callable[[], dd.CacheDesc]
    source_blocks: bool
    dest: Callable[[], dd.CacheDesc]
    dest_blocks: bool
    kwargs: dict[str, Any]

    def moves(self, src_slot: int, dst_slot: int) -> list[Move]:
        if not self.dest_blocks:
            return slot_moves(src_slot, dst_slot)
        if self.source_blocks:
            return block_moves(SRC_BLOCKS, DST_BLOCKS)
        return chunk_moves(src_slot, CHUNK_BLOCKS)

    def key(self, ref: CacheRef, dst_slot: int) -> Union[dd.BlocksCacheKey, dd.CacheKeyByIdAndIndex]:
        return ref.blocks_key() if self.dest_blocks else ref.key(dst_slot)

    def offset(self, dst_slot: int) -> int:
        """Where a raw destination address points into a tensor."""
        return 0 if self.dest_blocks else dst_slot * SLOT


KINDS = {
    "slots": Kind(lambda: slots_desc(3), False, lambda: slots_desc(4), False, {}),
    "blocks": Kind(
        lambda: blocks_desc(16), True, lambda: blocks_desc(24), True,
        {"src_block_indices": SRC_BLOCKS, "dst_block_indices": DST_BLOCKS},
    ),
    "slots-to-blocks": Kind(
        lambda: slots_desc(3), False, lambda: blocks_desc(10, block=CHUNK), True,
        {"dst_block_indices": CHUNK_BLOCKS, "dst_block_memory_size": CHUNK},
    ),
}


# -- waiting, bounded ----------------------------------------------------------------------


async def settled(task: Awaitable[Any]) -> Any:
    async with asyncio.timeout(WAIT):
        return await task


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.005)


async def read(peer: Peer, ref: CacheRef) -> list[np.ndarray]:
    """The peer's cache, read off the event loop's thread so that transfers go on meanwhile."""
    return await asyncio.to_thread(peer.read, ref)


async def arrived(peer: Peer, ref: CacheRef, expected: Tensors, what: str) -> None:
    """Waits until the peer's cache holds exactly ``expected``."""
    deadline = time.monotonic() + WAIT
    while not same(got := await read(peer, ref), expected):
        if time.monotonic() > deadline:
            assert_tensors(got, expected, f"after waiting for {what}")
        await asyncio.sleep(0.005)


# -- pacing ------------------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
async def test_layers_released_one_at_a_time(prefill, style):
    b = prefill.b
    src, sent = prefill.source(slots_desc(3))
    dst, before = remote(b, slots_desc(4), 1)
    gate = prefill.synchronizer(style, hold=True)
    # Source layers 1..3 to destination layers 0..2: layer 0 is needed by no config.
    config = dd.TransferWithCacheKeyConfig(dst.key(1), range(1, 4), range(0, 3), src_batch_index=2)
    task = prefill.cm.transfer_cache_async(src, gate, [config])
    assert isinstance(task, dd.CacheTask)
    moves = slot_moves(2, 1)
    for step, layer in enumerate(range(1, 4)):
        await eventually(lambda: len(gate.calls) > step, f"synchronize_layer({layer})")
        await asyncio.sleep(QUIET)
        assert gate.layers == list(range(1, layer + 1)), f"asked for {gate.layers} while layer {layer} is held"
        assert not task.done()
        so_far = expect(before, sent, pairs(range(1, layer), range(0, layer - 1)), moves)
        assert_tensors(await read(b, dst), so_far, f"before layer {layer} was released")
        gate.release(layer)
        now = expect(before, sent, pairs(range(1, layer + 1), range(0, layer)), moves)
        await arrived(b, dst, now, f"layer {layer}")
    assert await settled(task) == [SUCCESS]
    timeout = None if style == "watched" else SYNC_KV_TIMEOUT  # a watch has no timeout of its own
    assert gate.calls == [(layer, timeout) for layer in (1, 2, 3)]
    assert_ran_as(gate, style)
    assert task.get_results() == [SUCCESS]
    assert task.synchronize() is SUCCESS


@pytest.mark.parametrize("access", ["owner", "one_sided"])
async def test_layers_do_not_wait_for_acknowledgements(decoders, access):
    # Owner-served, B acknowledges nothing while stopped (well within
    # sync_kv_timeout), and every layer still goes. One-sided, the prefill
    # writes B's memory itself: the whole transfer completes while B is stopped.
    with prefill_side("key", decoders, access=access) as prefill:
        b = prefill.b
        src, sent = prefill.source(slots_desc(3))
        dst, before = remote(b, slots_desc(4), 23)
        await eventually(lambda: access == "owner" or prefill.datadist._engine.link_stats(B)["grants_held"] > 0,
                         "B's grant of its cache", 2.0)
        gate = prefill.synchronizer()
        config = dd.TransferWithCacheKeyConfig(dst.key(2), range(0, 4), range(0, 4), 1)
        b.stop()
        try:
            task = prefill.cm.transfer_cache_async(src, gate, [config])
            await eventually(lambda: gate.layers == [0, 1, 2, 3], "every layer asked for while B is stopped", 2.0)
            if access == "owner":
                assert not task.done()
            else:
                assert await asyncio.wait_for(settled(task), 2.0) == [SUCCESS]
        finally:
            b.cont()
        assert await settled(task) == [SUCCESS]
        assert_tensors(b.read(dst), expect(before, sent, pairs(range(0, 4)), slot_moves(1, 2)))
        moved = prefill.datadist._engine.link_stats(B)["one_sided_bytes_written"]
        assert (moved > 0) == (access == "one_sided"), moved


@pytest.mark.parametrize("style", STYLES)
async def test_a_blocking_wait_on_the_driving_loop_is_refused(prefill, style):
    # As in a notebook cell: the loop that releases the layers is this
    # thread's; a blocking wait here would stop it, and the transfer with it.
    b = prefill.b
    src, sent = prefill.source(slots_desc(3))
    dst, before = remote(b, slots_desc(4), 24)
    gate = prefill.synchronizer(style, hold={1})
    config = dd.TransferWithCacheKeyConfig(dst.key(0), range(0, 4), range(0, 4), 0)
    task = prefill.cm.transfer_cache_async(src, gate, [config])
    await eventually(lambda: len(gate.calls) > 1, "synchronize_layer(1)")
    with pytest.raises(RuntimeError, match="await task"):
        task.synchronize()
    with pytest.raises(RuntimeError, match="await task"):
        task.get_results(1000)
    assert task.get_results(0) == [TIMEOUT]  # a look does not block
    assert not task.done()
    gate.release(1)
    assert await settled(task) == [SUCCESS]
    assert task.synchronize() is SUCCESS  # done: returns at once
    assert_tensors(b.read(dst), expect(before, sent, pairs(range(0, 4)), slot_moves(0, 0)))


async def test_a_gate_hands_each_layer_over_on_the_thread_that_opens_it(prefill):
    # The model's thread opens layers 1 to 3 while the event loop's thread
    # is busy (this test blocks it): each layer's bytes still arrive before
    # the next is opened, as the transfer hands a layer to the engine inside
    # ``open``. Awaiting the synchronizer instead, nothing would move.
    b = prefill.b
    src, sent = prefill.source(slots_desc(3))
    dst, before = remote(b, slots_desc(4), 26)
    gate = dd.LayerGate()
    task = prefill.cm.transfer_cache_async(src, gate, [dd.TransferWithCacheKeyConfig(dst.key(1), range(0, 4),
                                                                                     range(0, 4), 2)])
    gate.open(0)
    moves = slot_moves(2, 1)
    await arrived(b, dst, expect(before, sent, [(0, 0)], moves), "layer 0")
    for layer in range(1, 4):
        model = threading.Thread(target=gate.open, args=(layer,), name=f"model-layer-{layer}")
        model.start()
        model.join(WAIT)
        now = expect(before, sent, pairs(range(0, layer + 1)), moves)
        deadline = time.monotonic() + WAIT
        while not same(got := b.read(dst), now):  # the loop's thread waits here, blocked
            if time.monotonic() > deadline:
                assert_tensors(got, now, f"layer {layer}, opened while the event loop was blocked")
            time.sleep(0.002)
    assert await settled(task) == [SUCCESS]
    assert [gate.verdict(layer) for layer in range(5)] == [True] * 4 + [None]


async def test_a_failure_sending_a_gated_layer_fails_the_task_not_the_model(prefill, monkeypatch):
    # A bug in handing layer 2 over, on the model's thread: its ``open``
    # returns as usual, and the task fails with the driver's error.
    from datadist_aio import layerwise

    b = prefill.b
    src, sent = prefill.source(slots_desc(3))
    dst, before = remote(b, slots_desc(4), 29)
    real = layerwise.LayerwiseTransfer._start_step

    def start_step(self: Any, index: int, config: Any, layer: int) -> tuple[int, str]:
        if layer == 2:
            raise RuntimeError("a bug in the driver")
        return real(self, index, config, layer)

    monkeypatch.setattr(layerwise.LayerwiseTransfer, "_start_step", start_step)
    gate = dd.LayerGate()
    task = prefill.cm.transfer_cache_async(src, gate, [dd.TransferWithCacheKeyConfig(dst.key(0), range(0, 4),
                                                                                     range(0, 4), 1)])
    gate.open(0)
    gate.open(1)
    model = threading.Thread(target=gate.open, args=(2,))
    model.start()
    model.join(WAIT)
    with raises_status(FAILED) as raised:
        await settled(task)
    assert "the layer-wise driver failed" in str(raised.value) and "a bug in the driver" in str(raised.value)
    gate.open(3)  # after the walk ended: nothing more goes
    await asyncio.sleep(QUIET)
    assert_tensors(b.read(dst), expect(before, sent, pairs(range(0, 2)), slot_moves(1, 0)), "on B")


@pytest.mark.parametrize("style", STYLES)
async def test_a_layer_not_released_within_sync_kv_timeout_fails_what_needs_it(decoders, style):
    with prefill_side("key", decoders, sync_kv_timeout=300) as prefill:
        b, c = prefill.b, prefill.c
        src, sent = prefill.source(slots_desc(3))
        x, x_before = remote(b, slots_desc(4), 27)
        y, y_before = remote(c, slots_desc(4), 28)
        configs = [
            dd.TransferWithCacheKeyConfig(x.key(0), range(0, 4), range(0, 4), 0),  # needs layer 2
            dd.TransferWithCacheKeyConfig(y.key(1), range(0, 2), range(0, 2), 1),  # does not
        ]
        gate = prefill.synchronizer(style, hold={2})
        task = prefill.cm.transfer_cache_async(src, gate, configs)
        with raises_status(TIMEOUT) as raised:
            await settled(task)
        assert "sync_kv_timeout (300 ms)" in str(raised.value), raised.value
        assert task.get_results() == [TIMEOUT, SUCCESS]
        # Layer 3 was needed by the config that timed out only: nobody asks for it.
        assert gate.layers == [0, 1, 2]
        assert not gate.violations, gate.violations
        assert_tensors(b.read(x), expect(x_before, sent, pairs(range(0, 2)), slot_moves(0, 0)), "on B")
        assert_tensors(c.read(y), expect(y_before, sent, pairs(range(0, 2)), slot_moves(1, 1)), "on C")


async def test_done_callbacks_run_once_on_their_loop_or_the_callback_thread(prefill):
    b = prefill.b
    src, sent = prefill.source(slots_desc(3))
    dst, before = remote(b, slots_desc(4), 25)
    gate = prefill.synchronizer(hold={2})
    config = dd.TransferWithCacheKeyConfig(dst.key(3), range(0, 4), range(0, 4), 2)
    task = prefill.cm.transfer_cache_async(src, gate, [config])
    await eventually(lambda: len(gate.calls) > 2, "synchronize_layer(2)")
    calls: list[tuple[str, Any, bool]] = []
    on_loop = asyncio.Event()
    off_loop = threading.Event()

    def note(where: str, event: Any) -> Callable[[dd.CacheTask], None]:
        def callback(t: dd.CacheTask) -> None:
            calls.append((where, threading.current_thread().name, t is task and t.done()))
            event.set()

        return callback

    task.add_done_callback(note("loop", on_loop))
    # From a thread that runs no loop: the library's callback thread runs it.
    await asyncio.to_thread(task.add_done_callback, note("thread", off_loop))

    def fails(t: dd.CacheTask) -> None:
        raise ValueError("a callback's own failure")

    loop = asyncio.get_running_loop()
    handler = loop.get_exception_handler()
    handled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: handled.append(context))
    task.add_done_callback(fails)  # goes to the loop's exception handler, stops nothing
    await asyncio.sleep(QUIET)
    assert calls == [] and not task.done()
    with pytest.raises(TypeError, match="callable"):
        task.add_done_callback(None)  # type: ignore[arg-type]
    gate.release(2)
    await asyncio.wait_for(on_loop.wait(), WAIT)
    assert await asyncio.to_thread(off_loop.wait, WAIT)
    assert sorted(calls) == [("loop", "MainThread", True), ("thread", "datadist-aio-callbacks", True)]
    await asyncio.sleep(0)
    loop.set_exception_handler(handler)
    assert [type(context.get("exception")) for context in handled] == [ValueError], handled
    # On a task that is done: at once from a thread with no loop, soon on a loop.
    done_now: list[str] = []
    await asyncio.to_thread(task.add_done_callback, lambda t: done_now.append(threading.current_thread().name))
    assert len(done_now) == 1 and done_now[0] != "datadist-aio-callbacks"
    task.add_done_callback(lambda t: done_now.append("loop"))
    assert done_now[1:] == []
    await asyncio.sleep(0)
    assert done_now[1:] == ["loop"]
    assert await settled(task) == [SUCCESS]
    assert_tensors(b.read(dst), expect(before, sent, pairs(range(0, 4)), slot_moves(2, 3)))


@pytest.mark.parametrize("prefill", ["key", "raw", "key-tcp", "raw-tcp"], indirect=True)
@pytest.mark.parametrize("kind", list(KINDS))
async def test_each_kind(prefill, kind):
    await each_kind(prefill, kind)


@pytest.mark.parametrize("kind", list(KINDS))
async def test_each_kind_over_ucx(ucx_prefill, kind):
    await each_kind(ucx_prefill, kind)
    stats = ucx_prefill.datadist._engine.link_stats(B)
    # UCX moved the bytes: the peer's gets and puts (frames naming this
    # end's memory), or this end's own under the peer's grants.
    assert stats["ucx_frames"] + stats["ucx_one_sided_ops"] > 0 and stats["ucx_fallbacks"] == 0, stats


async def each_kind(prefill: Prefill, kind: str) -> None:
    """Every layer of each kind into B, and layers 1..2 into 2..3, every byte checked."""
    spec = KINDS[kind]
    b = prefill.b
    src, sent = prefill.source(spec.source(), spec.source_blocks)
    whole, whole_before = remote(b, spec.dest(), 2, spec.dest_blocks)
    part, part_before = remote(b, spec.dest(), 3, spec.dest_blocks)
    # Every layer, and source layers 1..2 into destination layers 2..3 (lengths
    # equal, starts differ: refused upstream, see docs/differences.md).
    src_slots = (0, 0) if spec.source_blocks else (2, 1)
    dst_slots = (3, 0)
    kwargs = dict(spec.kwargs)
    if kind == "blocks" and prefill.mode == "raw":
        kwargs["dst_block_memory_size"] = 0  # the same as leaving it out
    if prefill.mode == "key":
        keys = [spec.key(whole, 3), spec.key(part, 0)]
        if kind == "slots-to-blocks":
            # A BlocksCacheKey takes source slot 0 only; by its id the blocks cache takes another.
            src_slots = (0, 1)
            keys[1] = dd.CacheKeyByIdAndIndex(B, part.cache_id)
        configs = [
            dd.TransferWithCacheKeyConfig(keys[0], range(0, 4), range(0, 4), src_slots[0]),
            dd.TransferWithCacheKeyConfig(keys[1], range(1, 3), range(2, 4), src_slots[1]),
        ]
    else:
        whole_addrs, part_addrs = b.tensor_addrs(whole), b.tensor_addrs(part)
        configs = [
            dd.TransferConfig(B, raw(whole_addrs, range(0, 4), spec.offset(3)), None, src_slots[0]),
            dd.TransferConfig(B, raw(part_addrs, range(2, 4), spec.offset(0)), range(1, 3), src_slots[1]),
        ]
    gate = prefill.synchronizer()
    task = prefill.cm.transfer_cache_async(src, gate, configs, **kwargs)
    assert await settled(task) == [SUCCESS, SUCCESS]
    assert task.done() and not task.cancelled()
    assert task.get_results() == [SUCCESS, SUCCESS]
    assert task.synchronize() is SUCCESS
    assert gate.calls == [(layer, SYNC_KV_TIMEOUT) for layer in range(LAYERS)]
    assert_ran_as(gate, "async")
    moves = [spec.moves(s, d) for s, d in zip(src_slots, dst_slots)]
    assert_tensors(b.read(whole), expect(whole_before, sent, pairs(range(0, 4)), moves[0]), "(every layer)")
    assert_tensors(b.read(part), expect(part_before, sent, pairs(range(1, 3), range(2, 4)), moves[1]), "(layers 1..2)")
    assert_tensors(snapshot(src), sent, "of the source")


@pytest.mark.parametrize("prefill", ["key", "raw"], indirect=True)
async def test_fan_out_to_two_decode_processes(prefill):
    b, c = prefill.b, prefill.c
    src, sent = prefill.source(slots_desc(3))
    x, x_before = remote(b, slots_desc(4), 4)
    y, y_before = remote(c, slots_desc(4), 5)
    # (peer, cache, source slot, destination slot, source layers, destination layers)
    plan = [
        (b, x, 0, 0, range(0, 4), range(0, 4)),
        (c, y, 1, 2, range(1, 3), range(0, 2)),
        (b, x, 2, 3, range(2, 4), range(2, 4)),  # a second config to B
        (c, y, 0, 1, range(0, 1), range(3, 4)),
    ]
    if prefill.mode == "key":
        configs = [
            dd.TransferWithCacheKeyConfig(ref.key(dst_slot), src_layers, dst_layers, src_slot)
            for _, ref, src_slot, dst_slot, src_layers, dst_layers in plan
        ]
    else:
        addrs = {B: b.tensor_addrs(x), C: c.tensor_addrs(y)}
        configs = [
            dd.TransferConfig(
                peer.cluster_id, raw(addrs[peer.cluster_id], dst_layers, dst_slot * SLOT), src_layers, src_slot
            )
            for peer, _, src_slot, dst_slot, src_layers, dst_layers in plan
        ]
    gate = prefill.synchronizer()
    task = prefill.cm.transfer_cache_async(src, gate, configs)
    assert await settled(task) == [SUCCESS] * 4
    assert task.get_results() == [SUCCESS] * 4
    # Each layer is asked for once, however many configs need it.
    assert gate.calls == [(layer, SYNC_KV_TIMEOUT) for layer in range(LAYERS)]
    x_expected, y_expected = x_before, y_before
    for peer, _, src_slot, dst_slot, src_layers, dst_layers in plan:
        if peer is b:
            x_expected = expect(x_expected, sent, pairs(src_layers, dst_layers), slot_moves(src_slot, dst_slot))
        else:
            y_expected = expect(y_expected, sent, pairs(src_layers, dst_layers), slot_moves(src_slot, dst_slot))
    assert_tensors(b.read(x), x_expected, "on B")
    assert_tensors(c.read(y), y_expected, "on C")


# -- byte ranges inside blocks ---------------------------------------------------------------

# (src_block, src_offset, dst_block, dst_offset, length, count, src_stride, dst_stride): the second
# half of a block into the first half of another (a head's share, for a decode of a larger TP
# size), a head's slice of each of 8 tokens (16 bytes of every 32) packed side by side, and a
# piece at odd offsets.
PUSHED_RANGES = np.array([(3, 128, 20, 0, 128, 1, 0, 0), (4, 16, 21, 8, 16, 8, 32, 16),
                          (0, 7, 7, 200, 56, 1, 0, 0)], dtype=np.uint64)


def ranges_moves(rows: np.ndarray, size: int = BLOCK) -> list[Move]:
    """The rows unrolled: (source offset, destination offset, length) inside one tensor."""
    return [(sb * size + so + j * ss, db * size + do + j * ds, n)
            for sb, so, db, do, n, count, ss, ds in rows.tolist() for j in range(count)]


@pytest.mark.parametrize("prefill", ["key", "key-tcp"], indirect=True)
async def test_block_ranges_go_layer_by_layer(prefill):
    """``block_ranges``: byte ranges inside blocks, each layer as its
    synchronizer lets it go (layers 2 and 3 are held while 0 and 1 land),
    every byte of the destination checked."""
    b = prefill.b
    src, sent = prefill.source(blocks_desc(16), blocks=True)
    dest, before = remote(b, blocks_desc(24), 2, blocks=True)
    gate = prefill.synchronizer(hold=[2])
    config = dd.TransferWithCacheKeyConfig(dest.blocks_key(), range(0, 4), range(0, 4))
    task = prefill.cm.transfer_cache_async(src, gate, [config], block_ranges=PUSHED_RANGES)
    moves = ranges_moves(PUSHED_RANGES)
    await arrived(b, dest, expect(before, sent, pairs(range(0, 2)), moves), "layers 0 and 1")
    assert gate.layers == [0, 1, 2] and not task.done()
    gate.release(2)
    assert await settled(task) == [SUCCESS]
    assert_tensors(b.read(dest), expect(before, sent, pairs(range(0, 4)), moves))


@pytest.mark.parametrize("prefill", ["key"], indirect=True)
@pytest.mark.parametrize("case, why", [
    ("past-the-source-block", "leaves the local block"),
    ("source-block-out-of-range", "src_block 16 is out of range"),
    ("destinations-overlap", "overlap in destination block 20"),
    ("past-the-destination-block", ""),
])
async def test_block_ranges_refused_write_nothing(prefill, case, why):
    """A range this side's blocks do not hold, or that overlaps another's
    destination, is refused before anything moves; one past the peer's
    block, the peer refuses. Nothing of the transfer lands either way."""
    b = prefill.b
    src, _sent = prefill.source(blocks_desc(16), blocks=True)
    dest, before = remote(b, blocks_desc(24), 3, blocks=True)
    bad = {
        "past-the-source-block": (5, 200, 9, 0, 64, 1, 0, 0),
        "source-block-out-of-range": (16, 0, 9, 0, 8, 1, 0, 0),
        "destinations-overlap": (5, 0, 20, 100, 64, 1, 0, 0),  # onto [0, 128) of block 20
        "past-the-destination-block": (5, 0, 9, 250, 8, 1, 0, 0),
    }[case]
    rows = np.array([tuple(row) for row in PUSHED_RANGES.tolist()] + [bad], dtype=np.uint64)
    config = dd.TransferWithCacheKeyConfig(dest.blocks_key(), range(0, 4), range(0, 4))
    task = prefill.cm.transfer_cache_async(src, prefill.synchronizer(), [config], block_ranges=rows)
    with raises_status(PARAM_INVALID) as refused:
        await settled(task)
    assert why in str(refused.value)
    assert_tensors(b.read(dest), before, "of the refused destination")


def test_block_ranges_are_checked_as_the_call_is_made(decoders):
    with prefill_side("key", decoders) as prefill:
        src, _sent = prefill.source(blocks_desc(16), blocks=True)
        dest, _before = remote(prefill.b, blocks_desc(24), 4, blocks=True)
        config = dd.TransferWithCacheKeyConfig(dest.blocks_key(), range(0, 4), range(0, 4))
        with raises_status(PARAM_INVALID):  # with block lists as well
            prefill.cm.transfer_cache_async(src, prefill.synchronizer("thread"), [config], src_block_indices=[1],
                                            dst_block_indices=[2], block_ranges=PUSHED_RANGES)
        with raises_status(PARAM_INVALID):  # rows of three
            prefill.cm.transfer_cache_async(src, prefill.synchronizer("thread"), [config],
                                            block_ranges=np.zeros((2, 3), dtype=np.uint64))
        slots, _ = prefill.source(slots_desc(3))
        with raises_status(PARAM_INVALID):  # from a cache without blocks
            prefill.cm.transfer_cache_async(slots, prefill.synchronizer("thread"), [config],
                                            block_ranges=PUSHED_RANGES)


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("prefill", ["key", "raw"], indirect=True)
async def test_refusal_at_a_middle_layer(prefill):
    b, c = prefill.b, prefill.c
    src, sent = prefill.source(slots_desc(3))
    short, short_before = remote(b, slots_desc(4, layers=3), 6)  # layers 0..2 only
    other, other_before = remote(b, slots_desc(4), 7)
    y, y_before = remote(c, slots_desc(4), 8)
    if prefill.mode == "key":
        # Source layers 0..3 to destination layers 1..4: layers 3 and 4 do not exist there.
        doomed = dd.TransferWithCacheKeyConfig(short.key(1), range(0, 4), range(1, 5), 2)
        configs = [
            doomed,
            dd.TransferWithCacheKeyConfig(y.key(0), range(0, 4), range(0, 4), 0),
            dd.TransferWithCacheKeyConfig(other.key(2), range(0, 4), range(0, 4), 1),
        ]
    else:
        addrs = b.tensor_addrs(short)
        end_of_last = addrs[5] + slots_desc(4).size  # past the last tensor of the short cache
        bad = [end_of_last - SLOT // 2, 4096, 2**64 - SLOT // 2, addrs[0] - SLOT // 2]
        doomed = dd.TransferConfig(B, raw(addrs, range(1, 3), SLOT) + bad, range(0, 4), 2)
        configs = [
            doomed,
            dd.TransferConfig(C, raw(c.tensor_addrs(y), range(0, 4)), range(0, 4), 0),
            dd.TransferConfig(B, raw(b.tensor_addrs(other), range(0, 4), 2 * SLOT), range(0, 4), 1),
        ]
    if prefill.mode == "key":
        # With B's grants here, this side refuses layer 2 itself (one-sided)
        # and the rest of the config after it, as B would.
        engine = prefill.datadist._engine
        await eventually(lambda: engine.link_stats(B)["grants_held"] == 2, "B's grants of both caches", 5.0)
        moved_before = engine.link_stats(B)["one_sided_ops"]
    task = prefill.cm.transfer_cache_async(src, prefill.synchronizer(), configs)
    with raises_status(PARAM_INVALID):
        await settled(task)
    assert task.done() and not task.cancelled()
    assert task.get_results() == [PARAM_INVALID, SUCCESS, SUCCESS]
    assert task.synchronize() is PARAM_INVALID
    if prefill.mode == "key":
        assert engine.link_stats(B)["one_sided_ops"] - moved_before == 4 + 2, "layers 0-3 to other, 0-1 to short"
    # Layers 0 and 1 went to destination layers 1 and 2; nothing else changed.
    assert_tensors(b.read(short), expect(short_before, sent, [(0, 1), (1, 2)], slot_moves(2, 1)), "(refused)")
    assert_tensors(c.read(y), expect(y_before, sent, pairs(range(0, 4)), slot_moves(0, 0)), "on C")
    assert_tensors(b.read(other), expect(other_before, sent, pairs(range(0, 4)), slot_moves(1, 2)), "on B")


@pytest.mark.parametrize("prefill", ["raw"], indirect=True)
async def test_layers_after_a_refused_layer_never_land(prefill):
    """Layer 1's addresses point nowhere; layers 2 and 3 are valid but must not
    land once layer 1 was refused (the config's steps are ordered)."""
    b = prefill.b
    src, sent = prefill.source(slots_desc(3))
    dest, before = remote(b, slots_desc(4), 9)
    good = raw(b.tensor_addrs(dest), range(0, 4), SLOT)  # slot 1 of layers 0..3
    forged = good[:2] + [4096, 4096] + good[4:]
    task = prefill.cm.transfer_cache_async(src, prefill.synchronizer(), [dd.TransferConfig(B, forged, range(0, 4), 2)])
    with raises_status(PARAM_INVALID):
        await settled(task)
    assert task.get_results() == [PARAM_INVALID]
    assert_tensors(b.read(dest), expect(before, sent, [(0, 0)], slot_moves(2, 1)), "(after the refused layer)")


# (kind, destination cache on B, the refused config's key (None: the kind's own), expected status)
REFUSED = [
    pytest.param("slots", lambda: slots_desc(4), lambda ref: ref.key(4), PARAM_INVALID, id="slot-past-batch"),
    pytest.param("slots", lambda: slots_desc(4, slot=2 * SLOT), None, PARAM_INVALID, id="slot-size-differs"),
    pytest.param("slots", lambda: slots_desc(4, layers=2), None, PARAM_INVALID, id="layers-past-end"),
    pytest.param("blocks", lambda: blocks_desc(24, block=2 * BLOCK), None, PARAM_INVALID, id="block-size-differs"),
    pytest.param("blocks", lambda: blocks_desc(16), None, PARAM_INVALID, id="block-past-end"),
    pytest.param(
        "slots-to-blocks", lambda: blocks_desc(10, block=BLOCK), None, PARAM_INVALID, id="block-size-not-chunk"
    ),
    pytest.param(
        "slots-to-blocks", lambda: blocks_desc(4, block=CHUNK), None, PARAM_INVALID, id="chunk-block-past-end"
    ),
    pytest.param(
        "slots", lambda: slots_desc(4), lambda ref: dd.CacheKeyByIdAndIndex(B, 10**6), NOT_EXIST, id="no-such-cache"
    ),
    pytest.param(
        "blocks", lambda: blocks_desc(24), lambda ref: dd.BlocksCacheKey(B, next(_model_ids)), NOT_EXIST,
        id="no-such-model",
    ),
    pytest.param(
        "slots", lambda: slots_desc(4), lambda ref: dd.CacheKeyByIdAndIndex(UNLINKED, ref.cache_id), NOT_YET_LINK,
        id="not-linked",
    ),
    pytest.param("slots", "hidden", None, PARAM_INVALID, id="not-remote-accessible"),
]


@pytest.mark.parametrize("kind, dest, key, status", REFUSED)
async def test_refused_config_writes_nothing(prefill, kind, dest, key, status):
    spec = KINDS[kind]
    b, c = prefill.b, prefill.c
    src, sent = prefill.source(spec.source(), spec.source_blocks)
    if dest == "hidden":
        target, before = remote(b, slots_desc(4), 9, registered=True, remote_accessible=False)
    else:
        target, before = remote(b, dest(), 9, spec.dest_blocks)
    fine, fine_before = remote(c, spec.dest(), 10, spec.dest_blocks)
    # The refused config's layers (2..3) exist in every destination but the 2-layer one.
    refused = dd.TransferWithCacheKeyConfig(
        key(target) if key is not None else spec.key(target, 1), range(2, 4), range(2, 4)
    )
    configs = [dd.TransferWithCacheKeyConfig(spec.key(fine, 2), range(0, 4), range(0, 4)), refused]
    task = prefill.cm.transfer_cache_async(src, prefill.synchronizer(), configs, **spec.kwargs)
    with raises_status(status):
        await settled(task)
    assert task.get_results() == [SUCCESS, status]
    assert task.synchronize() is status
    assert_tensors(b.read(target), before, "of the refused destination")
    assert_tensors(c.read(fine), expect(fine_before, sent, pairs(range(0, 4)), spec.moves(0, 2)), "on C")


# The bad address a TransferConfig gives for V of one layer (K is fine), from the
# target cache's tensor addresses and tensor size.
FORGED = {
    "unregistered": lambda addrs, size: 4096,
    "past-the-cache": lambda addrs, size: addrs[-1] + size,
    "wraps-around": lambda addrs, size: 2**64 - SLOT // 2,
    "straddles-two-tensors": lambda addrs, size: addrs[3] + size - SLOT // 2,  # allocated tensors are adjacent
    "starts-before-a-tensor": lambda addrs, size: addrs[0] - SLOT // 2,
    "ends-past-a-tensor": lambda addrs, size: addrs[-1] + size - SLOT + 1,
}


@pytest.mark.parametrize("prefill", ["raw"], indirect=True)
@pytest.mark.parametrize("case", list(FORGED) + ["not-remote-accessible", "freed"])
async def test_raw_address_outside_a_tensor_is_refused(prefill, case):
    b, c = prefill.b, prefill.c
    src, sent = prefill.source(slots_desc(3))
    target, before = remote(b, slots_desc(4), 11)
    y, y_before = remote(c, slots_desc(4), 12)
    addrs = b.tensor_addrs(target)
    size = slots_desc(4).size
    untouched = [(target, before)]
    if case == "not-remote-accessible":
        hidden, hidden_before = remote(b, slots_desc(4), 13, registered=True, remote_accessible=False)
        untouched.append((hidden, hidden_before))
        bad = b.tensor_addrs(hidden)[3]
    elif case == "freed":
        gone = b.allocate(slots_desc(4))
        bad = b.tensor_addrs(gone)[3]
        b.free(gone)
    else:
        bad = FORGED[case](addrs, size)
    # Source layer 1: K to slot 1 of tensor 2 of the target (fine), V to the bad address.
    refused = dd.TransferConfig(B, [addrs[2] + SLOT, bad], range(1, 2), 2)
    fine = dd.TransferConfig(C, raw(c.tensor_addrs(y), range(0, 4)), None, 0)
    task = prefill.cm.transfer_cache_async(src, prefill.synchronizer(), [refused, fine])
    with raises_status(PARAM_INVALID):
        await settled(task)
    assert task.get_results() == [PARAM_INVALID, SUCCESS]
    for ref, old in untouched:
        assert_tensors(b.read(ref), old, f"on B ({case})")
    assert_tensors(c.read(y), expect(y_before, sent, pairs(range(0, 4)), slot_moves(0, 0)), "on C")


@pytest.mark.parametrize(
    "style, verdict, layer",
    [
        pytest.param("async", False, 1, id="async-false-at-1"),
        pytest.param("thread", False, 2, id="thread-false-at-2"),
        pytest.param("thread", RuntimeError("the model failed"), 1, id="thread-raises-at-1"),
        pytest.param("async", RuntimeError("the model failed"), 2, id="async-raises-at-2"),
        pytest.param("watched", False, 1, id="watched-refused-at-1"),
        pytest.param("watched", False, 2, id="watched-refused-at-2"),
    ],
)
async def test_synchronizer_refuses_a_layer(prefill, style, verdict, layer):
    b, c = prefill.b, prefill.c
    status = PARAM_INVALID if verdict is False else FAILED
    src, sent = prefill.source(slots_desc(3))
    x, x_before = remote(b, slots_desc(4), 14)
    y, y_before = remote(c, slots_desc(4), 15)
    configs = [
        dd.TransferWithCacheKeyConfig(x.key(0), range(0, 4), range(0, 4), 0),
        dd.TransferWithCacheKeyConfig(y.key(1), range(2, 4), range(2, 4), 1),  # needs layers 2 and 3 only
    ]
    gate = prefill.synchronizer(style, verdicts={layer: verdict})
    task = prefill.cm.transfer_cache_async(src, gate, configs)
    with raises_status(status):
        await settled(task)
    assert task.done() and not task.cancelled()
    await asyncio.sleep(QUIET)
    if layer == 1:
        # Only B's config needed layer 1; C's goes on with layers 2 and 3.
        assert task.get_results() == [status, SUCCESS]
        assert gate.layers == [0, 1, 2, 3]
        x_expected = expect(x_before, sent, [(0, 0)], slot_moves(0, 0))
        y_expected = expect(y_before, sent, pairs(range(2, 4)), slot_moves(1, 1))
    else:
        # Both needed layer 2; no config is left to need layer 3.
        assert task.get_results() == [status, status]
        assert gate.layers == [0, 1, 2]
        x_expected = expect(x_before, sent, pairs(range(0, 2)), slot_moves(0, 0))
        y_expected = y_before
    assert task.synchronize() is status
    assert_ran_as(gate, style)
    assert_tensors(b.read(x), x_expected, "on B")
    assert_tensors(c.read(y), y_expected, "on C")


# -- cancellation --------------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("how", ["cancel", "timeout", "wait_for"])
async def test_cancel_mid_way(prefill, how, style):
    b, c = prefill.b, prefill.c
    src, sent = prefill.source(blocks_desc(16), blocks=True)
    x, x_before = remote(b, blocks_desc(24), 16, blocks=True)
    y, y_before = remote(c, blocks_desc(24), 17, blocks=True)
    configs = [
        dd.TransferWithCacheKeyConfig(x.blocks_key(), range(0, 4), range(0, 4)),
        dd.TransferWithCacheKeyConfig(y.blocks_key(), range(1, 4), range(1, 4)),
    ]
    gate = prefill.synchronizer(style, hold={2})
    task = prefill.cm.transfer_cache_async(
        src, gate, configs, src_block_indices=SRC_BLOCKS, dst_block_indices=DST_BLOCKS
    )
    moves = block_moves(SRC_BLOCKS, DST_BLOCKS)
    x_expected = expect(x_before, sent, pairs(range(0, 2)), moves)
    y_expected = expect(y_before, sent, [(1, 1)], moves)
    await eventually(lambda: gate.layers == [0, 1, 2], "synchronize_layer(2)")
    await arrived(b, x, x_expected, "layers 0 and 1 on B")
    await arrived(c, y, y_expected, "layer 1 on C")
    assert not task.done()
    if how == "cancel":
        assert task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await settled(task)
    elif how == "timeout":
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await task
    else:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(task, 0.2)
    assert task.done(), "the await returned before the task settled"
    assert task.cancelled()
    assert task.get_results() == [FAILED, FAILED]
    assert task.synchronize() is FAILED
    assert not task.cancel()
    # Releasing the held layer now moves nothing and asks for nothing more.
    gate.release(2)
    await asyncio.sleep(QUIET)
    assert gate.layers == [0, 1, 2]
    assert_tensors(b.read(x), x_expected, "on B after the cancel")
    assert_tensors(c.read(y), y_expected, "on C after the cancel")
    # The link still works.
    assert await settled(prefill.cm.push_blocks_async(x.blocks_key(), src, [1, 2], [0, 23])) == [SUCCESS]
    assert_tensors(b.read(x), expect(x_expected, sent, pairs(range(0, 4)), block_moves([1, 2], [0, 23])), "pushed")


# -- concurrency -----------------------------------------------------------------------------


async def test_transfers_and_pushes_at_once_on_one_link(prefill):
    b, c = prefill.b, prefill.c
    slots, slots_sent = prefill.source(slots_desc(3))
    blocks, blocks_sent = prefill.source(blocks_desc(16), blocks=True)
    x, x_before = remote(b, slots_desc(4), 18)
    z, z_before = remote(b, blocks_desc(24), 19, blocks=True)
    y, y_before = remote(c, slots_desc(4), 20)
    cm = prefill.cm
    held = Gate(hold={1})
    first = cm.transfer_cache_async(slots, held, [dd.TransferWithCacheKeyConfig(x.key(0), range(0, 4), range(0, 4))])
    others = [
        cm.transfer_cache_async(
            slots,
            Gate(),
            [
                dd.TransferWithCacheKeyConfig(x.key(1), range(0, 2), range(2, 4), 1),
                dd.TransferWithCacheKeyConfig(y.key(3), range(0, 4), range(0, 4), 2),
            ],
        ),
        cm.transfer_cache_async(
            blocks,
            prefill.synchronizer("thread"),
            [dd.TransferWithCacheKeyConfig(z.blocks_key(), range(0, 4), range(0, 4))],
            src_block_indices=[0, 1, 2],
            dst_block_indices=[0, 1, 2],
        ),
        *(cm.push_blocks_async(z.blocks_key(), blocks, [8 + i], [10 + i]) for i in range(6)),
        cm.push_cache_async(x.key(2), slots, 2),
    ]
    # Everything else finishes while the first transfer waits for its layer 1.
    assert await settled(asyncio.gather(*others)) == [[SUCCESS, SUCCESS], [SUCCESS]] + [[SUCCESS]] * 7
    await eventually(lambda: held.layers == [0, 1], "synchronize_layer(1) of the first transfer")
    assert not first.done()
    held.release(1)
    assert await settled(first) == [SUCCESS]
    every = pairs(range(0, 4))
    x_expected = expect(x_before, slots_sent, every, slot_moves(0, 0))
    x_expected = expect(x_expected, slots_sent, pairs(range(0, 2), range(2, 4)), slot_moves(1, 1))
    x_expected = expect(x_expected, slots_sent, every, slot_moves(2, 2))
    z_moves = block_moves([0, 1, 2], [0, 1, 2]) + block_moves(range(8, 14), range(10, 16))
    assert_tensors(b.read(x), x_expected, "slots on B")
    assert_tensors(b.read(z), expect(z_before, blocks_sent, every, z_moves), "blocks on B")
    assert_tensors(c.read(y), expect(y_before, slots_sent, every, slot_moves(2, 3)), "on C")


# -- without an event loop ---------------------------------------------------------------------


def test_blocking_use_without_an_event_loop(decoders):
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    with prefill_side("key", decoders) as prefill:
        b, c = prefill.b, prefill.c
        src, sent = prefill.source(slots_desc(3))
        x, x_before = remote(b, slots_desc(4), 21)
        y, y_before = remote(c, slots_desc(4), 22)
        configs = [
            dd.TransferWithCacheKeyConfig(x.key(0), range(0, 4), range(0, 4), 0),
            dd.TransferWithCacheKeyConfig(y.key(1), range(1, 4), range(0, 3), 1),
        ]
        gate = prefill.synchronizer("thread", hold={2})
        task = prefill.cm.transfer_cache_async(src, gate, configs)
        assert task.synchronize(100) is TIMEOUT
        assert task.get_results(10) == [TIMEOUT, TIMEOUT]
        assert not task.done()
        gate.release(2)
        assert task.synchronize(WAIT_MS) is SUCCESS
        assert task.get_results(WAIT_MS) == [SUCCESS, SUCCESS]
        assert task.done() and not task.cancelled()
        assert gate.calls == [(layer, SYNC_KV_TIMEOUT) for layer in range(LAYERS)]
        assert not gate.violations
        x_expected = expect(x_before, sent, pairs(range(0, 4)), slot_moves(0, 0))
        y_expected = expect(y_before, sent, pairs(range(1, 4), range(0, 3)), slot_moves(1, 1))
        assert_tensors(b.read(x), x_expected, "on B")
        assert_tensors(c.read(y), y_expected, "on C")

        # A synchronizer that refuses layer 1, seen through the blocking calls.
        configs = [
            dd.TransferWithCacheKeyConfig(x.key(2), range(0, 4), range(0, 4), 2),
            dd.TransferWithCacheKeyConfig(y.key(3), range(2, 4), range(2, 4), 0),
        ]
        task = prefill.cm.transfer_cache_async(src, prefill.synchronizer("thread", verdicts={1: False}), configs)
        assert task.synchronize(WAIT_MS) is PARAM_INVALID
        assert task.get_results(WAIT_MS) == [PARAM_INVALID, SUCCESS]
        assert_tensors(b.read(x), expect(x_expected, sent, [(0, 0)], slot_moves(2, 2)), "on B")
        assert_tensors(c.read(y), expect(y_expected, sent, pairs(range(2, 4)), slot_moves(0, 3)), "on C")
    # The drivers ran on loops of their own threads, which finalize waited for (their loops closed).
    assert not [t for t in threading.enumerate() if t.name == "datadist-layerwise"]


# -- arguments checked before the call returns -------------------------------------------------


class Sources(NamedTuple):
    slots: dd.Cache  # contiguous, 4 layers, batch 3
    blocks: dd.Cache  # 4 layers of 16 blocks
    odd: dd.Cache  # 3 tensors: not whole layers
    gate: ThreadGate


def by_id(src: range = range(0, LAYERS), dst: Optional[range] = None, batch: int = 0) -> list[Any]:
    return [dd.TransferWithCacheKeyConfig(dd.CacheKeyByIdAndIndex(B, 1), src, dst or src, batch)]


def by_model() -> list[Any]:
    return [dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(B, 7), range(0, LAYERS), range(0, LAYERS))]


def by_addr(count: int = 2 * LAYERS, layers: Optional[range] = None, batch: int = 0) -> list[Any]:
    return [dd.TransferConfig(B, [0x7F0000000000 + 0x1000 * i for i in range(count)], layers, batch)]


def _lengths_changed() -> list[Any]:
    configs = by_id()
    configs[0].dst_layer_range = range(0, LAYERS - 1)  # the setter alone does not compare lengths
    return configs


Build = Callable[[Sources], tuple[tuple[Any, ...], dict[str, Any]]]


def call(source: Any, configs: Callable[[], Any], sync: Any = "gate", **kwargs: Any) -> Build:
    """The arguments of one call: a source (a field name of ``Sources``, else the value
    itself), the configs ``configs()`` gives, the synchronizer (the gate unless given)
    and keywords."""

    def build(s: Sources) -> tuple[tuple[Any, ...], dict[str, Any]]:
        cache = getattr(s, source) if source in Sources._fields else source
        synchronizer = s.gate if isinstance(sync, str) and sync == "gate" else sync
        return (cache, synchronizer, configs()), kwargs

    return build


TE, VE, LE = TypeError, ValueError, PARAM_INVALID
K, R = "key", "raw"

CHECKS = [
    # The source cache.
    pytest.param(K, TE, call("cache", by_id), id="source-not-a-cache"),
    pytest.param(K, TE, call(None, by_id), id="source-none"),
    pytest.param(R, TE, call(None, by_addr), id="source-none-raw"),
    pytest.param(K, LE, call("odd", lambda: by_id(range(0, 1))), id="odd-tensors"),
    pytest.param(R, LE, call("odd", lambda: by_addr(2, range(0, 1))), id="odd-tensors-raw"),
    # Block indices and block memory size: types and ranges.
    pytest.param(K, TE, call("blocks", by_model, src_block_indices="0", dst_block_indices=[0]), id="src-blocks-str"),
    pytest.param(K, TE, call("blocks", by_model, src_block_indices=[0.0], dst_block_indices=[0]), id="src-block-float"),
    pytest.param(K, TE, call("blocks", by_model, src_block_indices=[0], dst_block_indices={0}), id="dst-blocks-set"),
    pytest.param(K, TE, call("blocks", by_model, src_block_indices=[0], dst_block_indices=["0"]), id="dst-block-str"),
    pytest.param(K, VE, call("blocks", by_model, src_block_indices=[-1], dst_block_indices=[0]), id="src-block-neg"),
    pytest.param(K, VE, call("blocks", by_model, src_block_indices=[0], dst_block_indices=[2**64]), id="dst-block-big"),
    pytest.param(K, TE, call("slots", by_model, dst_block_indices=[0], dst_block_memory_size="192"), id="size-str"),
    pytest.param(K, TE, call("slots", by_model, dst_block_indices=[0], dst_block_memory_size=192.0), id="size-float"),
    pytest.param(K, VE, call("slots", by_model, dst_block_indices=[0], dst_block_memory_size=-1), id="size-negative"),
    pytest.param(K, VE, call("slots", by_model, dst_block_indices=[0], dst_block_memory_size=2**64), id="size-big"),
    # Block layouts.
    pytest.param(K, LE, call("blocks", by_model, src_block_indices=[0, 1]), id="blocks-to-slot"),
    pytest.param(K, LE, call("blocks", by_model, src_block_indices=[0, 1], dst_block_indices=[]), id="no-dst-blocks"),
    pytest.param(
        K, LE, call("blocks", by_model, src_block_indices=[0, 1], dst_block_indices=[0]), id="block-lists-differ"
    ),
    pytest.param(K, LE, call("slots", by_model, dst_block_indices=[0, 1]), id="chunks-without-size"),
    pytest.param(K, LE, call("slots", by_id, dst_block_memory_size=256), id="size-without-dst-blocks"),
    pytest.param(R, LE, call("slots", by_addr, dst_block_memory_size=256), id="size-without-dst-blocks-raw"),
    # The synchronizer.
    pytest.param(K, TE, call("slots", by_id, sync=None), id="synchronizer-none"),
    pytest.param(K, TE, call("slots", by_id, sync=object()), id="synchronizer-object"),
    pytest.param(K, TE, call("slots", by_id, sync=lambda layer, timeout: True), id="synchronizer-function"),
    pytest.param(K, TE, call("slots", by_id, sync=ThreadGate), id="synchronizer-class"),
    # The configs: container and kind (TransferWithCacheKeyConfig only with remote-cache-accessible mode).
    pytest.param(K, TE, call("slots", lambda: None), id="configs-none"),
    pytest.param(K, TE, call("slots", lambda: by_id()[0]), id="configs-not-a-list"),
    pytest.param(K, TE, call("slots", lambda: iter(by_id())), id="configs-iterator"),
    pytest.param(K, TE, call("slots", by_addr), id="transfer-config-in-key-mode"),
    pytest.param(R, TE, call("slots", by_id), id="key-config-in-raw-mode"),
    pytest.param(K, TE, call("slots", lambda: by_id() + by_addr()), id="configs-mixed"),
    pytest.param(K, TE, call("slots", lambda: by_id() + ["config"]), id="configs-other"),
    # Layer ranges and addresses.
    pytest.param(K, LE, call("slots", lambda: by_id(range(0, LAYERS + 1))), id="range-past-layers"),
    pytest.param(K, LE, call("slots", lambda: by_id(range(LAYERS, LAYERS + 1), range(0, 1))), id="range-after-layers"),
    pytest.param(K, LE, call("slots", lambda: by_id() + by_id(range(0, LAYERS + 1))), id="second-config-bad"),
    pytest.param(K, LE, call("slots", _lengths_changed), id="range-lengths-changed"),
    pytest.param(R, LE, call("slots", lambda: by_addr(10, range(0, LAYERS + 1))), id="raw-range-past-layers"),
    pytest.param(R, LE, call("slots", lambda: by_addr(6)), id="raw-too-few-addrs"),
    pytest.param(R, LE, call("slots", lambda: by_addr(10)), id="raw-too-many-addrs"),
    pytest.param(R, LE, call("slots", lambda: by_addr(8, range(1, 3))), id="raw-addrs-not-for-range"),
    # A blocks source has one slot.
    pytest.param(
        K, LE, call("blocks", lambda: by_id(batch=1), src_block_indices=[0], dst_block_indices=[0]),
        id="blocks-batch-index",
    ),
    pytest.param(
        R, LE, call("blocks", lambda: by_addr(batch=1), src_block_indices=[0], dst_block_indices=[0]),
        id="blocks-batch-index-raw",
    ),
]


@pytest.mark.parametrize("mode, expected, build", CHECKS)
def test_arguments_checked_before_it_returns(mode, expected, build):
    with prefill_side(mode, ()) as prefill:
        odd = prefill.cm.allocate_cache(dd.CacheDesc(3, [3, SLOT], dd.DataType.DT_UINT8, dd.Placement.HOST))
        gate = prefill.synchronizer("thread")
        sources = Sources(prefill.source(slots_desc(3))[0], prefill.source(blocks_desc(16), True)[0], odd, gate)
        args, kwargs = build(sources)
        try:
            task = prefill.cm.transfer_cache_async(*args, **kwargs)
        except dd.LLMException as exc:
            got: Any = exc.status_code
        except (TypeError, ValueError) as exc:
            got = type(exc)
        else:
            got = f"a CacheTask ({task.synchronize(WAIT_MS)!r})"
        assert got == expected
        assert gate.calls == [], "the synchronizer was called although the arguments were refused"

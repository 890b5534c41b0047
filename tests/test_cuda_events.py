"""CudaEventSynchronizer on the CUDA driver stand-in (tests/cuda_standin):
layer-wise transfers released by CUDA events a "model" records on its own
stream, in spawned children as tests/test_device_transfer.py runs them.

The model's stream holds, per layer, a host function that waits for a gate
the test opens, a copy of the layer's new bytes into the source cache, and
the record of the layer's event. Until the event has completed the source
holds other bytes: a layer sent early would bring those to the peer.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cuda_standin.build import build  # noqa: E402
from datadist_aio.bench.cuda_driver import HOST_FN, CudaDriver  # noqa: E402
from support.device import _recv, run_pair  # noqa: E402

OWNER, INITIATOR = 7, 5
LAYERS, PER_LAYER = 4, 2
TENSORS = LAYERS * PER_LAYER
SLOTS, SLOT = 2, 64 << 10
SYNC_KV_TIMEOUT = 3000  # ms
GATE_S = 10.0  # the longest a gate's host function waits

pytestmark = pytest.mark.timeout(90)



@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("cuda-standin"))


class Model:
    """A model's stream on the stand-in: gated copies into device memory, then event records."""

    def __init__(self, cuda: CudaDriver) -> None:
        lib = cuda.lib
        self.lib = lib
        stream = ctypes.c_void_p()
        CudaDriver.check(lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
        self.stream = stream
        self.events: list[int] = []
        self.gates: list[threading.Event] = []
        self.opened: list[float] = []  # when each gate was opened (monotonic)
        self.keep: list[Any] = []  # host buffers and callbacks the stream still uses
        self.host_fn = HOST_FN(self._gate)

    def _gate(self, data: Any) -> None:
        self.gates[int(data or 0)].wait(GATE_S)

    def layer(self, copies: list[tuple[int, np.ndarray]]) -> int:
        """Queues a gated layer: the gate's wait, ``copies`` (device address, bytes), the record of a new event."""
        index = len(self.gates)
        self.gates.append(threading.Event())
        CudaDriver.check(self.lib.cuLaunchHostFunc(self.stream, self.host_fn, ctypes.c_void_p(index)), "cuLaunchHostFunc")
        for addr, data in copies:
            self.keep.append(data)
            CudaDriver.check(self.lib.cuMemcpyHtoDAsync_v2(addr, data.ctypes.data, data.nbytes, self.stream), "HtoDAsync")
        event = ctypes.c_void_p()
        CudaDriver.check(self.lib.cuEventCreate(ctypes.byref(event), 0), "cuEventCreate")
        CudaDriver.check(self.lib.cuEventRecord(event, self.stream), "cuEventRecord")
        self.events.append(int(event.value or 0))
        return self.events[-1]

    def open(self, index: int) -> None:
        self.opened.append(time.monotonic())
        self.gates[index].set()

    def complete(self, index: int) -> bool:
        return bool(self.lib.cuEventQuery(ctypes.c_void_p(self.events[index])) == 0)

    def close(self) -> None:
        for gate in self.gates:
            gate.set()
        CudaDriver.check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        for event in self.events:
            self.lib.cuEventDestroy_v2(ctypes.c_void_p(event))
        self.lib.cuStreamDestroy_v2(self.stream)


def _engine(role: Any, cluster_id: int, listen: bool, transport: str = "tcp") -> Any:
    import datadist_aio as dd
    from support.peer import pool_cfg

    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = pool_cfg(16 << 20)
    config.transport = transport
    config.sync_kv_timeout = SYNC_KV_TIMEOUT
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    datadist = dd.LLMDataDist(role, cluster_id)
    datadist.init(config.generate_options())
    return datadist


def _desc() -> Any:
    import datadist_aio as dd

    return dd.CacheDesc(TENSORS, [SLOTS, SLOT], dd.DataType.DT_UINT8, dd.Placement.DEVICE)


def _pattern(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, SLOTS * SLOT, dtype=np.uint8) for _ in range(TENSORS)]


def owner_receives(conn: Any, transport: str) -> None:
    """The decode side: a device cache the initiator writes into; read back when asked."""
    import datadist_aio as dd

    cuda = CudaDriver()
    datadist = _engine(dd.LLMRole.DECODER, OWNER, listen=True, transport=transport)
    cache = datadist.cache_manager.allocate_cache(_desc())
    conn.send((datadist.listen_port, cache.cache_id))
    while True:
        command, *args = _recv(conn)
        if command == "fill":
            for t, data in enumerate(_pattern(args[0])):
                cuda.write(cache.tensor_addrs[t], data)
            conn.send("filled")
        elif command == "read":
            conn.send([cuda.read(addr, SLOTS * SLOT) for addr in cache.tensor_addrs])
        else:
            break
    datadist.cache_manager.deallocate_cache(cache)
    datadist.finalize()


def initiator_sends_as_events_complete(conn: Any, transport: str) -> None:
    """The prefill side: layer k leaves once event k has completed, then a layer whose event never does times out."""
    import datadist_aio as dd
    from support.peer import cluster_info

    code = dd.LLMStatusCode
    cuda = CudaDriver()
    port, owner_cache = _recv(conn)
    datadist = _engine(dd.LLMRole.PROMPT, INITIATOR, listen=False, transport=transport)
    cm = datadist.cache_manager
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == code.LLM_SUCCESS
    cache = cm.allocate_cache(_desc())
    old, new = _pattern(1), _pattern(2)
    for t in range(TENSORS):
        cuda.write(cache.tensor_addrs[t], old[t])
    conn.send(("fill", 3))
    assert _recv(conn) == "filled"
    theirs = _pattern(3)
    model = Model(cuda)

    def copies(layer: int) -> list[tuple[int, np.ndarray]]:
        ts = range(layer * PER_LAYER, (layer + 1) * PER_LAYER)
        return [(cache.tensor_addrs[t], new[t].reshape(SLOTS, SLOT)[0].copy()) for t in ts]

    # Layer 0's event is recorded (gate still shut) and given before the transfer starts;
    # the others are recorded by the model's thread once the transfer waits.
    sync = dd.CudaEventSynchronizer(datadist, [model.layer(copies(0))])
    arrived_at: list[float] = []

    class Watched(dd.LayerSynchronizer):
        """Notes when each layer was released."""

        async def synchronize_layer(self, layer_index: int, timeout_in_millis: Any) -> bool:
            ready = await sync.synchronize_layer(layer_index, timeout_in_millis)
            arrived_at.append(time.monotonic())
            assert model.complete(layer_index), f"layer {layer_index} released before its event completed"
            return ready

    ticks = [0]  # the event loop's ticks while the transfer runs

    def forward() -> None:
        cuda.use(0)
        for layer in range(1, LAYERS):
            sync.record(layer, model.layer(copies(layer)))
        for layer in range(LAYERS):
            # The loop ticks twice while this layer waits, unless it is blocked.
            seen, deadline = ticks[0], time.monotonic() + GATE_S / 2
            while ticks[0] < seen + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            model.open(layer)

    key = dd.CacheKeyByIdAndIndex(OWNER, owner_cache, 0)
    config = dd.TransferWithCacheKeyConfig(key, range(0, LAYERS), range(0, LAYERS), 0)

    async def transfer() -> Any:
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                ticks[0] += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        task = cm.transfer_cache_async(cache, Watched(), [config])
        model_thread = threading.Thread(target=forward)
        model_thread.start()
        try:
            return await asyncio.wait_for(task, 20)
        finally:
            stop.set()
            await ticking
            model_thread.join(GATE_S)

    results = asyncio.run(transfer())
    assert results == [code.LLM_SUCCESS], results
    conn.send(("read",))
    got = _recv(conn)
    for t in range(TENSORS):
        np.testing.assert_array_equal(got[t][:SLOT], new[t][:SLOT], err_msg=f"tensor {t}: slot 0 (sent)")
        np.testing.assert_array_equal(got[t][SLOT:], theirs[t][SLOT:], err_msg=f"tensor {t}: slot 1 (untouched)")
    assert len(arrived_at) == LAYERS and all(a >= o for a, o in zip(arrived_at, model.opened)), (arrived_at, model.opened)
    # Each gate opened once the loop had ticked twice more: a loop blocked
    # while the layers waited would not have.
    assert ticks[0] >= 2 * LAYERS, ticks
    assert datadist._engine.requests_in_flight() == 0

    # Layer 1's event never completes (its gate stays shut): the config fails with LLM_TIMEOUT.
    stuck = Model(cuda)
    sync = dd.CudaEventSynchronizer(datadist, [stuck.layer([])])
    stuck.open(0)
    sync.record(1, stuck.layer([]))

    async def timed_out() -> Any:
        return await asyncio.wait_for(cm.transfer_cache_async(cache, sync, [config]), 20)

    begun = time.monotonic()
    with pytest.raises(dd.LLMException) as failed:
        asyncio.run(timed_out())
    assert failed.value.status_code is code.LLM_TIMEOUT and "synchronize_layer(1)" in str(failed.value), failed.value
    assert time.monotonic() - begun >= SYNC_KV_TIMEOUT / 1000 * 0.9
    assert not stuck.complete(1)
    assert datadist._engine.requests_in_flight() == 0  # the engine stopped watching
    stuck.close()
    model.close()
    conn.send(("quit",))
    cm.deallocate_cache(cache)
    datadist.finalize()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_layers_leave_as_their_events_complete(standin: Path, transport: str) -> None:
    run_pair(standin, owner_receives, initiator_sends_as_events_complete, transport)


def alone_watches(conn: Any) -> None:
    """One engine: a refused handle, waits before and after the record, an idle watch, timeouts."""
    import datadist_aio as dd

    conn.close()
    code = dd.LLMStatusCode
    cuda = CudaDriver()
    datadist = _engine(dd.LLMRole.PROMPT, INITIATOR, listen=False)
    engine = datadist._engine
    model = Model(cuda)

    # A handle the driver does not know, and things that are no event.
    sync = dd.CudaEventSynchronizer(datadist)
    with pytest.raises(dd.LLMException) as refused:
        sync.record(0, 0xDEAD0)
    assert refused.value.status_code is code.LLM_PARAM_INVALID, refused.value
    assert "CUDA_ERROR_INVALID_HANDLE" in str(refused.value), refused.value
    with pytest.raises(TypeError):
        sync.record(0, "event")
    with pytest.raises(TypeError):
        dd.CudaEventSynchronizer(datadist, [1.5])
    assert engine.requests_in_flight() == 0

    class Event:  # what torch.cuda.Event offers
        def __init__(self, handle: int) -> None:
            self.cuda_event = handle

    async def scenario() -> None:
        loop_cpu: list[float] = []
        # Asked for before its event is recorded; the event handed over as a torch-like object.
        sync = dd.CudaEventSynchronizer(datadist)
        waiting = asyncio.ensure_future(sync.synchronize_layer(0, 5000))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        sync.record(0, Event(model.layer([])))
        # A watched event that is still pending: no thread of the engine's spins.
        await asyncio.sleep(0.05)
        assert engine.requests_in_flight() == 1
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(0.5)
        loop_cpu.append(time.process_time() - cpu)
        assert time.monotonic() - wall >= 0.5
        assert loop_cpu[0] < 0.15, f"{loop_cpu[0]:.3f} s of CPU over 0.5 s idle"  # a spinning thread: 0.5
        assert not waiting.done()
        model.open(0)
        assert await asyncio.wait_for(waiting, 5) is True
        # Given before it is asked for, already complete.
        event = model.layer([])
        model.open(1)
        sync.record(1, event)
        assert await sync.synchronize_layer(1, 5000) is True
        # Timeouts: an event that never completes, a layer never given one.
        sync.record(2, model.layer([]))
        with pytest.raises(asyncio.TimeoutError):
            await sync.synchronize_layer(2, 200)
        with pytest.raises(asyncio.TimeoutError):
            await sync.synchronize_layer(3, 100)
        assert engine.requests_in_flight() == 0
        with pytest.raises(ValueError):
            sync.record(1, model.events[1])

    asyncio.run(scenario())
    # A watch still pending when the engine stops is settled by finalize.
    sync = dd.CudaEventSynchronizer(datadist, [model.layer([])])
    assert engine.requests_in_flight() == 1
    datadist.finalize()
    model.close()


def no_driver_refuses(conn: Any) -> None:
    import datadist_aio as dd

    conn.close()
    datadist = _engine(dd.LLMRole.PROMPT, INITIATOR, listen=False)
    with pytest.raises(dd.LLMException) as refused:
        dd.CudaEventSynchronizer(datadist, [0x1000])
    assert refused.value.status_code is dd.LLMStatusCode.LLM_FEATURE_NOT_ENABLED, refused.value
    datadist.finalize()


def _idle(conn: Any) -> None:
    conn.close()


def test_watches_on_one_engine(standin: Path) -> None:
    run_pair(standin, _idle, alone_watches)


def test_no_driver_refuses_events(standin: Path, tmp_path: Path) -> None:
    missing = {"DATADIST_AIO_CUDA_DRIVER": str(tmp_path / "no-libcuda.so.1")}
    run_pair(standin, _idle, no_driver_refuses, initiator_env=missing)

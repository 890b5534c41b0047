"""Device caches on a real GPU: torch CUDA tensors in two spawned processes
on one GPU, registered with Placement.DEVICE, moved by every operation kind
between every mix of host and device memory, over same-host links (CUDA IPC)
and over TCP (staging through pinned host buffers).

Each scenario takes the memory it runs on by name, so the same code runs:

- ``torch``: torch's caching allocator (cudaMalloc, legacy IPC export);
- ``torch-expandable``: torch with ``expandable_segments:True`` (cuMemCreate
  memory), set in the children's environment before torch starts CUDA;
- ``standin``: the CUDA driver stand-in (tests/cuda_standin), with device
  memory of its own and no torch: the variant CI runs.

The torch variants carry the ``gpu`` marker and are skipped, with the reason,
where torch or a CUDA device is missing (``pytest -m gpu tests/test_gpu.py``
on a GPU machine; tools/gpu_check.sh runs them there).
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cuda_standin.build import build  # noqa: E402
from support.peer import HAVE_UCX, UCX_WHY  # noqa: E402
from support.device import _child, _pattern, _recv, run_pair, wait_for_grants  # noqa: E402

OWNER, INITIATOR = 7, 5
MODEL = {"host": 1, "device": 2}  # the owner's blocks caches, by placement
LAYERS, PER_LAYER = 2, 2
TENSORS = LAYERS * PER_LAYER
BLOCKS, BLOCK = 24, 96 << 10  # operations of several staging chunks, edges inside blocks
SLOTS, SLOT = 2, 3 << 19
MIXES = [("host", "device"), ("device", "host"), ("device", "device")]  # (initiator's, owner's)
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}

pytestmark = pytest.mark.timeout(180)


def _no_gpu() -> Optional[str]:
    """Why the torch variants cannot run here, or None. Asked in the pytest
    process only (it makes no CUDA context there): a child imports torch
    itself, after its environment is set."""
    if multiprocessing.parent_process() is not None:
        return None
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    return None


NO_GPU = _no_gpu()
_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU: {NO_GPU}")]
TORCH = pytest.param("torch", marks=_ON_GPU, id="torch")
TORCH_EXPANDABLE = pytest.param("torch-expandable", marks=_ON_GPU, id="torch-expandable")
STANDIN = pytest.param("standin", id="standin")
UCX = pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason=UCX_WHY), id="ucx")
ONE_SIDED = "one_sided"  # a transport here: "auto" with access "one_sided" (_engine)


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("cuda-standin"))


def _pair(memory: str, standin: Path, owner: Any, initiator: Any, *args: Any, **kwargs: Any) -> None:
    """run_pair on ``memory``: the torch variants load the system's driver
    (by its name, as the engine does by default), with torch's allocator
    settings in both children's environment."""
    driver = standin if memory == "standin" else Path("libcuda.so.1")
    env = EXPANDABLE if memory == "torch-expandable" else {}
    run_pair(driver, owner, initiator, memory, *args, owner_env=env, initiator_env=env, **kwargs)


# -- in the children: the memory a scenario runs on ----------------------------------------------------


class Memory:
    """Device tensors, their bytes, and a model stream, on torch or on the stand-in.

    A device tensor is what the scenario registers: a torch CUDA tensor, or
    an int address on the stand-in. Host tensors are numpy arrays."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.keep: list[Any] = []  # what queued stand-in work still reads
        if kind == "standin":
            from test_cuda_events import Model
            from datadist_aio.bench.cuda_driver import CudaDriver

            self.cuda = CudaDriver()
            self.model = Model(self.cuda)
        else:
            import torch

            self.torch = torch
            torch.cuda.init()
            self.stream = torch.cuda.Stream()
            self.cycles_per_s = self._clock()

    def _clock(self) -> float:
        """GPU cycles per second of torch.cuda._sleep, measured."""
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm up
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / (start.elapsed_time(end) / 1000)

    def device(self, nbytes: int) -> Any:
        if self.kind == "standin":
            return self.cuda.alloc(nbytes)
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda")

    def free(self, tensor: Any) -> None:
        if self.kind == "standin" and isinstance(tensor, int):
            self.cuda.free(tensor)

    def write(self, tensor: Any, data: np.ndarray, offset: int = 0) -> None:
        if isinstance(tensor, np.ndarray):
            tensor.reshape(-1)[offset:offset + data.size] = data
        elif self.kind == "standin":
            self.cuda.write(tensor + offset, data)
        else:
            tensor[offset:offset + data.size].copy_(self.torch.from_numpy(data))
            self.torch.cuda.synchronize()

    def equal(self, tensor: Any, expected: np.ndarray) -> bool:
        """Whether ``tensor`` holds ``expected``: torch.equal on the GPU, numpy elsewhere."""
        if isinstance(tensor, np.ndarray):
            return bool(np.array_equal(tensor.reshape(-1), expected))
        if self.kind == "standin":
            return bool(np.array_equal(self.cuda.read(tensor, expected.size), expected))
        return bool(self.torch.equal(tensor, self.torch.from_numpy(expected).to(tensor.device)))

    def busy_layer(self, tensors: list[Any], data: list[np.ndarray], offset: int, seconds: float) -> Any:
        """On the model's stream: ``seconds`` of work, then ``data[i]`` into
        ``tensors[i]`` at ``offset``, then an event recorded and returned."""
        if self.kind == "standin":
            layer = self.model.layer([(t + offset, d) for t, d in zip(tensors, data)])
            index = len(self.model.gates) - 1
            opener = _Timer(seconds, self.model.open, index)
            self.keep.append(opener)
            return layer
        torch = self.torch
        event = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            sources = [torch.from_numpy(d).pin_memory().cuda(non_blocking=True) for d in data]
            torch.cuda._sleep(int(seconds * self.cycles_per_s))
            for tensor, source in zip(tensors, sources):
                tensor[offset:offset + source.numel()].copy_(source, non_blocking=True)
            event.record(self.stream)
        self.keep.append(sources)
        return event

    def event_done(self, event: Any) -> bool:
        if self.kind == "standin":
            return self.model.complete(self.model.events.index(event))
        return bool(event.query())

    def close(self) -> None:
        if self.kind == "standin":
            for timer in self.keep:
                if isinstance(timer, _Timer):
                    timer.cancel()
            self.model.close()
        else:
            self.stream.synchronize()


class _Timer:
    """Calls ``fn(arg)`` after ``seconds`` on a thread of its own."""

    def __init__(self, seconds: float, fn: Any, arg: Any) -> None:
        import threading

        self.timer = threading.Timer(seconds, fn, (arg,))
        self.timer.daemon = True
        self.timer.start()

    def cancel(self) -> None:
        self.timer.cancel()


def _engine(role: Any, cluster_id: int, transport: str, listen: bool, device_id: int = 0) -> Any:
    import datadist_aio as dd
    from support.peer import pool_cfg

    config = dd.LLMConfig()
    config.device_id = device_id
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = pool_cfg(64 << 20)
    # ONE_SIDED: the same-host link, the initiator moving the bytes under
    # the owner's grants; every other transport with the owner serving.
    config.transport = "auto" if transport == ONE_SIDED else transport
    config.access = "one_sided" if transport == ONE_SIDED else "owner"
    config.sync_kv_timeout = 10000
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    datadist = dd.LLMDataDist(role, cluster_id)
    datadist.init(config.generate_options())
    return datadist


def _desc(placement: str, blocks: bool) -> Any:
    import datadist_aio as dd

    where = dd.Placement.DEVICE if placement == "device" else dd.Placement.HOST
    return dd.CacheDesc(TENSORS, [BLOCKS, BLOCK] if blocks else [SLOTS, SLOT], dd.DataType.DT_UINT8, where)


class Caches:
    """One side's caches, a blocks and a slots cache per placement, registered
    on memory of its own (torch tensors, stand-in addresses, numpy arrays)."""

    def __init__(self, cm: Any, memory: Memory, bind_blocks: bool) -> None:
        import datadist_aio as dd

        self.cm, self.memory = cm, memory
        self.tensors: dict[str, list[Any]] = {}
        self.caches: dict[str, Any] = {}
        for placement in ("host", "device"):
            for kind in ("blocks", "slots"):
                name = f"{kind}-{placement}"
                desc = _desc(placement, kind == "blocks")
                if placement == "host":
                    tensors: list[Any] = [np.zeros(desc.shape, np.uint8) for _ in range(TENSORS)]
                else:
                    tensors = [memory.device(desc.size) for _ in range(TENSORS)]
                self.tensors[name] = tensors
                if kind == "blocks":
                    key = dd.BlocksCacheKey(OWNER, MODEL[placement]) if bind_blocks else None
                    self.caches[name] = cm.register_blocks_cache(desc, list(tensors), key)
                else:
                    self.caches[name] = cm.register_cache(desc, list(tensors))

    def fill(self, name: str, seed: int) -> list[np.ndarray]:
        data = _pattern(seed, self.caches[name].cache_desc.size)
        for tensor, d in zip(self.tensors[name], data):
            self.memory.write(tensor, d)
        return data

    def differ(self, name: str, expected: list[np.ndarray]) -> list[int]:
        """The tensors of ``name`` that do not hold ``expected``."""
        return [t for t, tensor in enumerate(self.tensors[name]) if not self.memory.equal(tensor, expected[t])]

    def free(self) -> None:
        for name, cache in self.caches.items():
            self.cm.unregister_cache(cache.cache_id)
            for tensor in self.tensors[name]:
                self.memory.free(tensor)


def owner_serves(conn: Any, memory_kind: str, transport: str) -> None:
    """Holds host and device caches; fills and checks them when asked."""
    import datadist_aio as dd

    memory = Memory(memory_kind)
    datadist = _engine(dd.LLMRole.PROMPT, OWNER, transport, listen=True)
    caches = Caches(datadist.cache_manager, memory, bind_blocks=True)
    conn.send((datadist.listen_port, os.getpid(), {name: c.cache_id for name, c in caches.caches.items()}))
    while True:
        command, *args = _recv(conn)
        if command == "fill":
            caches.fill(*args)
            conn.send("filled")
        elif command == "differ":
            conn.send(caches.differ(*args))
        elif command == "stats":
            conn.send(datadist._engine.link_stats(INITIATOR))
        else:
            break
    caches.free()
    datadist.finalize()
    memory.close()


class Remote:
    """The owner's caches as the initiator drives them, with the bytes they should hold."""

    def __init__(self, conn: Any, ids: dict[str, int]) -> None:
        self.conn, self.ids = conn, ids
        self.expect: dict[str, list[np.ndarray]] = {}

    def fill(self, name: str, seed: int) -> None:
        self.conn.send(("fill", name, seed))
        assert _recv(self.conn) == "filled"
        self.expect[name] = _pattern(seed, (BLOCKS * BLOCK) if name.startswith("blocks") else SLOTS * SLOT)

    def check(self, name: str, what: str) -> None:
        self.conn.send(("differ", name, self.expect[name]))
        wrong = _recv(self.conn)
        assert not wrong, f"{what}: the owner's tensors {wrong} do not hold the expected bytes"


def _check(caches: Caches, name: str, expected: list[np.ndarray], what: str) -> None:
    wrong = caches.differ(name, expected)
    assert not wrong, f"{what}: tensors {wrong} here do not hold the expected bytes"


def _rows(data: np.ndarray, size: int) -> np.ndarray:
    return data.reshape(-1, size)


def _stats(conn: Any, datadist: Any) -> tuple[dict[str, int], dict[str, int]]:
    conn.send(("stats",))
    return datadist._engine.link_stats(OWNER), _recv(conn)


def _check_paths(before: Any, after: Any, transport: str, mine: str, theirs: str, memory_kind: str) -> None:
    """Same host: the initiator's device memory goes through CUDA IPC and
    nothing is staged: cuMemCreate memory (expandable segments) exported as
    POSIX file descriptors, the rest as legacy IPC handles. TCP: every device
    end stages, nothing goes by IPC."""
    (mine0, theirs0), (mine1, theirs1) = before, after
    delta = {k: mine1[k] - mine0[k] for k in mine1} | {"owner_" + k: theirs1[k] - theirs0[k] for k in theirs1}
    what = f"{transport}, initiator {mine}, owner {theirs}: {delta}"
    if transport == ONE_SIDED:
        # No frame: the owner's device memory opened from its grants and
        # copied on this end's streams; its host memory reached by the
        # kernel, from this end's device memory staged.
        assert delta["framed_ops"] == 0 and delta["owner_owner_served_ops"] == 0, what
        assert (delta["one_sided_device_bytes"] > 0) == (theirs == "device"), what
        assert (delta["one_sided_staged_bytes"] > 0) == (theirs == "host"), what
        assert delta["ipc_frames"] == 0 and delta["owner_ipc_bytes_served"] == 0, what
        return
    if transport == "ucx":
        # UCX moves host memory, and device memory where both ends' UCX
        # reach it (built with CUDA, NVIDIA's driver found, an RDMA
        # transport: over UCX's tcp it would emulate the device's gets and
        # puts, which a dying peer turns into an abort). Elsewhere a device
        # end's bytes go inline, staged: the initiator's from the start, the
        # owner's once it has turned the UCX frame down.
        assert delta["ipc_frames"] == 0 and delta["owner_ipc_bytes_served"] == 0, what
        if os.environ.get("DATADIST_AIO_TEST_UCX_DEVICE") == "1":  # a UCX built with CUDA, on a GPU with RDMA
            assert mine1["ucx_device"] and theirs1["ucx_device"], f"UCX does not reach device memory here: {what}"
        if mine1["ucx_device"] and theirs1["ucx_device"]:
            assert delta["ucx_frames"] > 0 and delta["owner_ucx_bytes_served"] > 0, what
            assert delta["staged_frames"] == 0 and delta["ucx_fallbacks"] == 0, what
            assert delta["owner_staged_bytes_served"] == 0, what
        else:
            assert delta["owner_ucx_bytes_served"] == 0, what
            assert (delta["staged_frames"] > 0) == (mine == "device"), what
            assert (delta["ucx_fallbacks"] > 0) == (mine == "host" and theirs == "device"), what
            assert (delta["owner_staged_bytes_served"] > 0) == (theirs == "device"), what
        assert delta["ipc_fallbacks"] == 0, what
        return
    if transport == "auto" and mine == "device":
        assert delta["ipc_frames"] > 0 and delta["staged_frames"] == 0, what
        assert delta["owner_ipc_bytes_served"] > 0 and delta["owner_staged_bytes_served"] == 0, what
        if memory_kind == "torch-expandable":
            assert delta["fd_frames"] > 0 and delta["owner_fd_bytes_served"] > 0, what
        else:
            assert delta["fd_frames"] == 0, what
    else:
        assert delta["ipc_frames"] == 0 and delta["owner_ipc_bytes_served"] == 0, what
        assert (delta["staged_frames"] > 0) == (mine == "device"), what
        assert (delta["owner_staged_bytes_served"] > 0) == (theirs == "device"), what
    assert delta["ipc_fallbacks"] == 0, what


# -- every operation, every mix --------------------------------------------------------------------------


def initiator_moves_everything(conn: Any, memory_kind: str, transport: str) -> None:
    import datadist_aio as dd
    from support.peer import cluster_info

    class Released(dd.LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: Any) -> bool:
            return True

    code = dd.LLMStatusCode
    memory = Memory(memory_kind)
    port, _, ids = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, transport, listen=False)
    cm = datadist.cache_manager
    status, statuses = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == code.LLM_SUCCESS and statuses == [code.LLM_SUCCESS], (status, statuses)
    assert datadist.link_transport(OWNER) == {"tcp": "tcp", "ucx": "ucx"}.get(transport, "same_host")
    if transport == ONE_SIDED:
        wait_for_grants(datadist, len(ids))
    local = Caches(cm, memory, bind_blocks=False)
    remote = Remote(conn, ids)
    src, dst = [0, 1, 2, 3, 9, 10, 23], [5, 6, 7, 8, 0, 22, 11]
    seed = 100
    for mine, theirs in MIXES:
        what = f"{memory_kind}, {transport}, initiator {mine}, owner {theirs}"
        before_stats = _stats(conn, datadist)
        lb, rb, ls, rs = f"blocks-{mine}", f"blocks-{theirs}", f"slots-{mine}", f"slots-{theirs}"
        blocks_key = dd.BlocksCacheKey(OWNER, MODEL[theirs])

        sent = local.fill(lb, seed := seed + 1)
        remote.fill(rb, seed := seed + 1)
        cm.push_blocks(blocks_key, local.caches[lb], src, dst)
        for t in range(TENSORS):
            _rows(remote.expect[rb][t], BLOCK)[dst] = _rows(sent[t], BLOCK)[src]
        remote.check(rb, f"push_blocks ({what})")

        expect = local.fill(lb, seed := seed + 1)
        remote.fill(rb, seed := seed + 1)
        cm.pull_blocks(blocks_key, local.caches[lb], src, dst)
        for t in range(TENSORS):
            _rows(expect[t], BLOCK)[dst] = _rows(remote.expect[rb][t], BLOCK)[src]
        _check(local, lb, expect, f"pull_blocks ({what})")

        sent = local.fill(ls, seed := seed + 1)
        remote.fill(rs, seed := seed + 1)
        cm.push_cache(dd.CacheKeyByIdAndIndex(OWNER, ids[rs], 1), local.caches[ls], 0)
        for t in range(TENSORS):
            _rows(remote.expect[rs][t], SLOT)[1] = _rows(sent[t], SLOT)[0]
        remote.check(rs, f"push_cache ({what})")

        expect = local.fill(ls, seed := seed + 1)
        cm.pull_cache(dd.CacheKeyByIdAndIndex(OWNER, ids[rs], 0), local.caches[ls], 1)
        for t in range(TENSORS):
            _rows(expect[t], SLOT)[1] = _rows(remote.expect[rs][t], SLOT)[0]
        _check(local, ls, expect, f"pull_cache ({what})")

        # Layer-wise: slot 1's layer 0 here into the owner's slot 0 of layer 1.
        sent = local.fill(ls, seed := seed + 1)
        remote.fill(rs, seed := seed + 1)
        config = dd.TransferWithCacheKeyConfig(dd.CacheKeyByIdAndIndex(OWNER, ids[rs], 0), range(0, 1), range(1, 2), 1)

        async def layer_wise() -> Any:
            return await cm.transfer_cache_async(local.caches[ls], Released(), [config])

        assert asyncio.run(layer_wise()) == [code.LLM_SUCCESS]
        for t in range(PER_LAYER):
            _rows(remote.expect[rs][PER_LAYER + t], SLOT)[0] = _rows(sent[t], SLOT)[1]
        remote.check(rs, f"transfer_cache_async ({what})")
        _check_paths(before_stats, _stats(conn, datadist), transport, mine, theirs, memory_kind)
    conn.send(("quit",))
    local.free()
    datadist.finalize()
    memory.close()


@pytest.mark.parametrize("transport", ["auto", ONE_SIDED, "tcp", UCX])
@pytest.mark.parametrize("memory", [TORCH, TORCH_EXPANDABLE, STANDIN])
def test_every_operation_between_host_and_device(standin: Path, memory: str, transport: str) -> None:
    _pair(memory, standin, owner_serves, initiator_moves_everything, transport)


# -- layer-wise, released by CUDA events behind a busy model stream ---------------------------------------


LAYER_S = 0.4  # the model's work before each layer's bytes are written


def initiator_waits_for_events(conn: Any, memory_kind: str, transport: str) -> None:
    """Each layer's new bytes are written by the model's stream after
    LAYER_S of work, then its event is recorded; the transfer starts at once
    with a CudaEventSynchronizer. A layer sent before its event would bring
    the old bytes; none may be seen at the owner before the event completed."""
    import datadist_aio as dd
    from support.peer import cluster_info

    code = dd.LLMStatusCode
    memory = Memory(memory_kind)
    port, _, ids = _recv(conn)
    datadist = _engine(dd.LLMRole.PROMPT, INITIATOR, transport, listen=False)
    cm = datadist.cache_manager
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == code.LLM_SUCCESS
    local = Caches(cm, memory, bind_blocks=False)
    remote = Remote(conn, ids)
    old = local.fill("slots-device", 1)
    remote.fill("slots-device", 2)
    new = _pattern(3, SLOT)  # slot 0 of every tensor, once its layer's work is done
    tensors = local.tensors["slots-device"]
    events = []
    for layer in range(LAYERS):
        ts = range(layer * PER_LAYER, (layer + 1) * PER_LAYER)
        events.append(memory.busy_layer([tensors[t] for t in ts], [new[t] for t in ts], 0, LAYER_S))
    sync = dd.CudaEventSynchronizer(datadist, events)
    released: list[bool] = []

    class Watched(dd.LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: Any) -> bool:
            ready = await sync.synchronize_layer(layer_index, timeout_in_millis)
            released.append(memory.event_done(events[layer_index]))
            return ready

    key = dd.CacheKeyByIdAndIndex(OWNER, ids["slots-device"], 1)
    config = dd.TransferWithCacheKeyConfig(key, range(LAYERS), range(LAYERS), 0)
    started = time.monotonic()

    async def transfer() -> Any:
        task = asyncio.ensure_future(cm.transfer_cache_async(local.caches["slots-device"], Watched(), [config]))
        while not task.done():  # the owner holds nothing of the new or the old bytes while the model works
            # The owner's bytes first, then the events: a layer that has
            # arrived must find its event complete.
            conn.send(("differ", "slots-device", remote.expect["slots-device"]))
            wrong = _recv(conn)
            pending = [layer for layer in range(LAYERS) if not memory.event_done(events[layer])]
            assert not any(t // PER_LAYER in pending for t in wrong), (
                f"layer(s) {pending} not done, yet the owner's tensors {wrong} changed")
            await asyncio.sleep(0.05)
        return await task

    assert asyncio.run(transfer()) == [code.LLM_SUCCESS]
    assert released == [True] * LAYERS, released
    took = time.monotonic() - started
    assert took >= LAYER_S * 0.9, f"the transfer ended {took:.2f} s after it began, before the model's work"
    for t in range(TENSORS):
        _rows(remote.expect["slots-device"][t], SLOT)[1] = new[t]
        _rows(old[t], SLOT)[0] = new[t]
    remote.check("slots-device", f"layers released by events ({memory_kind}, {transport})")
    _check(local, "slots-device", old, "the model's writes")
    conn.send(("quit",))
    local.free()
    datadist.finalize()
    memory.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("memory", [TORCH, STANDIN])
def test_layers_are_released_by_cuda_events_of_a_busy_stream(standin: Path, memory: str, transport: str) -> None:
    _pair(memory, standin, owner_serves, initiator_waits_for_events, transport)


# -- a peer killed mid-transfer ------------------------------------------------------------------------


def initiator_outlives_its_owner(conn: Any, memory_kind: str, transport: str) -> None:
    """The owner is killed while device blocks move both ways: the transfer
    fails with LLM_LINK_FAILED or LLM_TIMEOUT in bounded time, and this engine
    then links to a new owner and moves bytes to it."""
    import datadist_aio as dd
    from support.peer import cluster_info

    code = dd.LLMStatusCode
    memory = Memory(memory_kind)
    port, pid, ids = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, transport, listen=False)
    cm = datadist.cache_manager
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == code.LLM_SUCCESS
    local = Caches(cm, memory, bind_blocks=False)
    key = dd.BlocksCacheKey(OWNER, MODEL["device"])
    every = list(range(BLOCKS))

    async def until_it_fails() -> BaseException:
        killed = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rounds = 1 if killed else 4  # several operations in flight both ways when the kill lands
            tasks = [op(key, local.caches["blocks-device"], every, every)
                     for _ in range(rounds) for op in (cm.push_blocks_async, cm.pull_blocks_async)]
            if not killed:
                await asyncio.sleep(0.01)
                os.kill(pid, signal.SIGKILL)
                killed = True
            done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
            failed = [e for e in done if isinstance(e, BaseException)]
            if failed:
                return failed[0]
        raise AssertionError("no transfer failed after the owner was killed")

    began = time.monotonic()
    try:
        error = asyncio.run(until_it_fails())
    except dd.LLMException as e:  # refused at once: the link is already down
        error = e
    assert isinstance(error, dd.LLMException), error
    assert error.status_code in (code.LLM_LINK_FAILED, code.LLM_TIMEOUT, code.LLM_NOT_YET_LINK), error
    assert time.monotonic() - began < 25

    # A new owner, in a process of its own: this engine links and pushes again.
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    report, child = ctx.Pipe(duplex=False)
    late = ctx.Process(target=_child, args=(child, {}, owner_serves, (theirs, memory_kind, transport)))
    late.start()
    child.close()
    theirs.close()
    try:
        port, _, ids = _recv(mine)
        deadline = time.monotonic() + 20
        while datadist.link_clusters([cluster_info(OWNER, port)], 5000)[1] != [code.LLM_SUCCESS]:
            assert time.monotonic() < deadline, "could not link to a new owner"
            datadist.unlink_clusters([cluster_info(OWNER, None)], 2000, force=True)
        remote = Remote(mine, ids)
        sent = local.fill("blocks-device", 41)
        remote.fill("blocks-device", 42)
        cm.push_blocks(key, local.caches["blocks-device"], every, every)
        remote.expect["blocks-device"] = sent
        remote.check("blocks-device", "a push to a new owner after the first was killed")
        mine.send(("quit",))
        assert report.poll(30) and report.recv() == "ok", "the new owner failed"
    finally:
        late.join(10)
        if late.is_alive():
            late.kill()
            late.join(10)
        report.close()
        mine.close()
    local.free()
    datadist.finalize()
    memory.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("memory", [TORCH, STANDIN])
def test_a_peer_killed_mid_transfer_leaves_the_survivor_usable(standin: Path, memory: str, transport: str) -> None:
    _pair(memory, standin, owner_serves, initiator_outlives_its_owner, transport, killed=owner_serves)


# -- registrations refused ---------------------------------------------------------------------------


def _refused(call: Any, words: str) -> None:
    import datadist_aio as dd

    with pytest.raises(dd.LLMException) as refused:
        call()
    assert refused.value.status_code is dd.LLMStatusCode.LLM_PARAM_INVALID, refused.value
    assert words in str(refused.value), refused.value


def registrations_are_checked(conn: Any, memory_kind: str, transport: str) -> None:
    """A tensor of another device, one too small and host memory given as
    DEVICE: each refused with LLM_PARAM_INVALID, nothing registered, nothing
    written; the same engine then registers good tensors."""
    import datadist_aio as dd

    memory = Memory(memory_kind)
    datadist = _engine(dd.LLMRole.PROMPT, OWNER, transport, listen=False)
    cm = datadist.cache_manager
    desc = _desc("device", True)
    good = [memory.device(desc.size) for _ in range(TENSORS)]
    data = _pattern(5, desc.size)
    for tensor, d in zip(good, data):
        memory.write(tensor, d)
    if memory_kind == "standin":
        host = np.zeros(desc.size, np.uint8)
        small = memory.device(desc.size - 4096)
        _refused(lambda: cm.register_blocks_cache(desc, good[:-1] + [host]), "is host memory (ndarray)")
        _refused(lambda: cm.register_blocks_cache(desc, good[:-1] + [host.ctypes.data]), "is not CUDA device memory")
        _refused(lambda: cm.register_blocks_cache(desc, good[:-1] + [small]), "runs past its allocation")
        memory.cuda.use(1)
        other = memory.cuda.alloc(desc.size)
        memory.cuda.use(0)
        _refused(lambda: cm.register_blocks_cache(desc, good[:-1] + [other]), "is memory of device 1, not of device_id 0")
        assert np.array_equal(host, np.zeros_like(host)), "a refused registration wrote into host memory"
    else:
        torch = memory.torch
        pinned = torch.zeros(desc.size, dtype=torch.uint8, pin_memory=True)
        small = memory.device(desc.size - 1)
        _refused(lambda: cm.register_blocks_cache(desc, good[:-1] + [pinned]), "is host memory")
        _refused(lambda: cm.register_blocks_cache(desc, good[:-1] + [pinned.data_ptr()]), "not CUDA device memory")
        _refused(lambda: cm.register_blocks_cache(desc, good[:-1] + [small]), f"holds {desc.size - 1} bytes")
        # An address inside a tensor whose allocation ends before a whole tensor does.
        tail = memory.device(64 << 10)
        _refused(lambda: cm.register_blocks_cache(desc, good[:-1] + [tail.data_ptr()]), "runs past its allocation")
        assert not torch.count_nonzero(pinned), "a refused registration wrote into host memory"
        if torch.cuda.device_count() > 1:
            other = torch.empty(desc.size, dtype=torch.uint8, device="cuda:1")
            _refused(lambda: cm.register_blocks_cache(desc, good[:-1] + [other]),
                     "is memory of device 1, not of device_id 0")
    for tensor, d in zip(good, data):
        assert memory.equal(tensor, d), "a refused registration wrote into device memory"
    cache = cm.register_blocks_cache(desc, good)  # nothing of the refused ones was left registered
    cm.unregister_cache(cache.cache_id)
    datadist.finalize()
    if memory_kind != "standin" and memory.torch.cuda.device_count() == 1:
        # One GPU: an engine of device_id 1 has no device to check against.
        import datadist_aio as dd

        other_engine = _engine(dd.LLMRole.PROMPT, OWNER, transport, listen=False, device_id=1)
        with pytest.raises(dd.LLMException) as refused:
            other_engine.cache_manager.register_blocks_cache(desc, good)
        assert refused.value.status_code is dd.LLMStatusCode.LLM_FEATURE_NOT_ENABLED, refused.value
        assert "device_id 1 is not a CUDA device" in str(refused.value), refused.value
        other_engine.finalize()
    memory.close()


@pytest.mark.parametrize("memory", [TORCH, STANDIN])
def test_bad_device_registrations_are_refused(standin: Path, memory: str) -> None:
    from support.device import in_child

    if memory == "standin":
        in_child(registrations_are_checked, standin, 2, None, memory, "tcp")
    else:
        in_child(registrations_are_checked, Path("libcuda.so.1"), 1, None, memory, "tcp")


# -- the stand-in suites' scenarios on NVIDIA's driver ------------------------------------------------
#
# The scenarios of test_device_transfer.py, test_device_ipc.py,
# test_cuda_events.py and test_device_memory.py that hold for any driver,
# run on libcuda.so.1 with device memory of the driver's own (cuMemAlloc).
# Left out: those that need the stand-in's knobs or hooks (two devices,
# STANDIN_CUDA_IPC=0, its allocation count), free memory under a queued
# copy, or hand the driver an event handle it never made.


def _no_driver() -> Optional[str]:
    """Why NVIDIA's driver cannot run the scenarios here, or None (asked in the pytest process only)."""
    if multiprocessing.parent_process() is not None:
        return None
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"no CUDA driver (libcuda.so.1: {e})"
    if hasattr(lib, "standin_cuda_live_allocations"):
        return "libcuda.so.1 is the test stand-in"
    count = ctypes.c_int()
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return "the CUDA driver sees no device"
    return None


NO_DRIVER = _no_driver()
on_nvidia_driver = pytest.mark.skipif(NO_DRIVER is not None, reason=f"needs NVIDIA's driver and a GPU: {NO_DRIVER}")
NVIDIA = Path("libcuda.so.1")


@pytest.mark.gpu
@on_nvidia_driver
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_standin_suite_transfers_on_the_nvidia_driver(transport: str) -> None:
    import test_cuda_events as events
    import test_device_transfer as transfer

    run_pair(NVIDIA, transfer.owner_serves, transfer.initiator_moves_everything, transport)
    if transport == "auto":
        run_pair(NVIDIA, transfer.owner_serves, transfer.initiator_moves_everything, transport, "one_sided")
    run_pair(NVIDIA, transfer.owner_serves, transfer.initiator_sends_layers_to_addresses, transport)
    run_pair(NVIDIA, transfer.owner_dies, transfer.initiator_outlives, transport, killed=transfer.owner_dies)
    run_pair(NVIDIA, transfer.owner_outlives, transfer.initiator_dies, transport, killed=transfer.initiator_dies)
    run_pair(NVIDIA, events.owner_receives, events.initiator_sends_as_events_complete, transport)


@pytest.mark.gpu
@on_nvidia_driver
def test_standin_suite_ipc_and_memory_on_the_nvidia_driver(tmp_path: Path) -> None:
    import test_device_ipc as ipc
    import test_device_memory as memory
    import test_device_transfer as transfer

    run_pair(NVIDIA, ipc.owner_without_driver, ipc.initiator_meets_an_owner_without_driver, "auto",
             owner_env={"DATADIST_AIO_CUDA_DRIVER": str(tmp_path / "no-libcuda.so.1")})
    run_pair(NVIDIA, transfer.owner_serves, ipc.hostile_initiator, "auto")
    memory.in_child(memory.scenario_a_raw_peer_reads_and_writes_a_device_cache, NVIDIA)
    memory.in_child(memory.scenario_refusal, NVIDIA, 1, 64, "device_id 64 is not a CUDA device")

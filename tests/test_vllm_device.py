"""The vLLM connector with KV tensors in CUDA device memory, registered in
place (``kv_buffer_device="cuda"``), without vLLM.

On the CUDA driver stand-in (tests/cuda_standin): a prefill worker and a
decode worker, each one ``WorkerSide`` in a spawned process whose engine
loads the stand-in. Their "KV tensors" are objects over stand-in device
allocations exposing what the connector reads of a torch CUDA tensor
(``device``, ``dtype``, ``shape``, ``data_ptr()``, ``__cuda_array_interface__``),
shaped as vLLM's CUDA attention lays a layer out (``[2, num_blocks,
block_size, kv_heads, head_dim]``). The stand-in maps device memory without
host access (a host read or write of it kills the process), so every byte
the test sees went through the driver: written and read back with its
copies, and moved by the engine device to device or through its staging
buffers. Each pair runs in both transfer modes and in every mix of host and
device tensors; in the layer-wise push a prefill with device tensors writes
each layer on a gated "model stream" and saves it before the stream has run,
so a layer sent before its CUDA event completed would carry the old bytes.
Prefill blocks are also read into decode blocks of twice the tokens (byte
ranges, not whole blocks).

The last test runs the same pairs with torch CUDA tensors where a GPU is
present.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cuda_standin.build import build  # noqa: E402
from test_device_memory import Cuda  # noqa: E402
from test_device_transfer import _recv, run_pair  # noqa: E402

from datadist_aio.integrations.vllm.host_buffer import kv_placement  # noqa: E402
from datadist_aio.integrations.vllm.worker import WorkerSettings, WorkerSide, cluster_id_for  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 16, 16, 2, 32
SHAPE = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)  # K and V of one layer, float16
BLOCK_BYTES = BLOCK_SIZE * HEADS * HEAD_DIM * 2  # one block of K (or of V)
LAYER_BYTES = 2 * BLOCKS * BLOCK_BYTES
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
REMOTE, LOCAL = [5, 2, 11], [3, 7, 12]  # the request's blocks at the prefill, at the decode
GATE_S = 10.0

HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("cuda-standin"))


# -- tensors as the connector reads them -----------------------------------------------------------


class CudaDevice:
    """``torch.device("cuda", index)``, as far as the connector reads it."""

    type = "cuda"

    def __init__(self, index: int) -> None:
        self.index = index

    def __str__(self) -> str:
        return f"cuda:{self.index}"


class CpuDevice:
    """``torch.device("cpu")``."""

    type = "cpu"
    index = None

    def __str__(self) -> str:
        return "cpu"


class DeviceTensor:
    """A contiguous float16 tensor over device memory at ``ptr``."""

    dtype = "torch.float16"

    def __init__(self, ptr: int, shape: tuple[int, ...], device: int = 0) -> None:
        self.ptr, self.shape, self.device = ptr, shape, CudaDevice(device)

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return self.ptr

    def __getitem__(self, index: int) -> "DeviceTensor":
        inner = self.shape[1:]
        return DeviceTensor(self.ptr + index * int(np.prod(inner)) * 2, inner, self.device.index)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"data": (self.ptr, False), "shape": self.shape, "typestr": "<f2", "version": 3}


class HostTensor:
    """A contiguous float16 tensor over a numpy array (host memory)."""

    dtype = "torch.float16"
    device = CpuDevice()

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.shape = array, array.shape

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def __getitem__(self, index: int) -> "HostTensor":
        return HostTensor(self.array[index])


def _old(layer: int) -> np.ndarray:
    return np.random.default_rng(100 + layer).integers(0, 256, LAYER_BYTES, dtype=np.uint8)


def _new(layer: int) -> np.ndarray:
    """What the step writes into the request's blocks: K then V of each block of REMOTE."""
    return np.random.default_rng(200 + layer).integers(0, 256, 2 * len(REMOTE) * BLOCK_BYTES, dtype=np.uint8)


def _ranges(blocks: list[int], block_bytes: int = BLOCK_BYTES) -> list[int]:
    """Byte offsets in a layer of each block of ``blocks``, K's then V's."""
    return [kv * LAYER_BYTES // 2 + block * block_bytes for kv in range(2) for block in blocks]


# -- the memory of one side: stand-in or torch -----------------------------------------------------


class StandinMemory:
    """KV tensors over stand-in device allocations (or numpy), and a model stream.

    The model's stream holds, per saved layer, a host function waiting for a
    gate that ``open_gates`` opens, then the layer's writes: until then the
    device memory holds the old bytes.
    """

    def __init__(self, device: int = 0) -> None:
        self.cuda = Cuda(device)
        self.device = device
        self.allocations: list[int] = []
        self.stream: Optional[ctypes.c_void_p] = None
        self.gate = threading.Event()
        self.events: list[int] = []
        self.keep: list[Any] = []

    def tensor(self, placement: str, data: np.ndarray, shape: tuple[int, ...] = SHAPE) -> Any:
        if placement == "host":
            return HostTensor(data.copy().view(np.float16).reshape(shape))
        ptr = self.cuda.alloc(LAYER_BYTES)
        self.allocations.append(ptr)
        self.cuda.write(ptr, data)
        return DeviceTensor(ptr, shape, self.device)

    def read(self, tensor: Any) -> np.ndarray:
        if isinstance(tensor, HostTensor):
            return tensor.array.view(np.uint8).reshape(-1).copy()
        return self.cuda.read(tensor.data_ptr(), LAYER_BYTES)

    def _model_stream(self) -> ctypes.c_void_p:
        if self.stream is None:
            lib = self.cuda.lib
            lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, HOST_FN, ctypes.c_void_p]
            lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
            lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
            lib.cuEventDestroy_v2.argtypes = [ctypes.c_void_p]
            stream = ctypes.c_void_p()
            Cuda.check(lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
            self.stream = stream
            self.host_fn = HOST_FN(lambda _data: self.gate.wait(GATE_S))
        return self.stream

    def write_blocks(self, tensor: Any, blocks: list[int], data: np.ndarray, on_stream: bool) -> None:
        """Writes ``data`` into ``blocks`` of ``tensor`` (K's then V's); on
        the model's stream behind its gate where ``on_stream``."""
        chunks = data.reshape(-1, BLOCK_BYTES)
        if isinstance(tensor, HostTensor):
            flat = tensor.array.view(np.uint8).reshape(-1)
            for chunk, offset in zip(chunks, _ranges(blocks)):
                flat[offset:offset + BLOCK_BYTES] = chunk
            return
        if not on_stream:
            for chunk, offset in zip(chunks, _ranges(blocks)):
                self.cuda.write(tensor.data_ptr() + offset, chunk)
            return
        stream, lib = self._model_stream(), self.cuda.lib
        Cuda.check(lib.cuLaunchHostFunc(stream, self.host_fn, None), "cuLaunchHostFunc")
        for chunk, offset in zip(chunks, _ranges(blocks)):
            chunk = np.ascontiguousarray(chunk)
            self.keep.append(chunk)
            Cuda.check(lib.cuMemcpyHtoDAsync_v2(tensor.data_ptr() + offset, chunk.ctypes.data, BLOCK_BYTES, stream),
                       "cuMemcpyHtoDAsync")

    def record_event(self) -> int:
        """An event recorded on the model's stream (the connector's ``record_event``)."""
        lib, stream = self.cuda.lib, self._model_stream()
        event = ctypes.c_void_p()
        Cuda.check(lib.cuEventCreate(ctypes.byref(event), 0), "cuEventCreate")
        Cuda.check(lib.cuEventRecord(event, stream), "cuEventRecord")
        self.events.append(int(event.value or 0))
        return self.events[-1]

    def open_gates(self) -> None:
        self.gate.set()

    def synchronize(self) -> None:
        """Waits for the model's stream (as vLLM's step waits for its sampled tokens)."""
        if self.stream is not None:
            Cuda.check(self.cuda.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def close(self) -> None:
        self.gate.set()
        if self.stream is not None:
            Cuda.check(self.cuda.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
            for event in self.events:
                self.cuda.lib.cuEventDestroy_v2(ctypes.c_void_p(event))
            self.cuda.lib.cuStreamDestroy_v2(self.stream)
        for ptr in self.allocations:
            self.cuda.free(ptr)


class TorchMemory:
    """KV tensors as torch makes them: on ``cuda:<device>`` or on the cpu.

    The model's stream is torch's current stream; a layer's writes queue
    behind a spin of the GPU, so the bytes land well after the save returns.
    """

    record_event = None  # the connector's default: a torch.cuda.Event on the current stream

    def __init__(self, device: int = 0) -> None:
        import torch

        self.torch = torch
        self.device = device
        torch.cuda.set_device(device)

    def tensor(self, placement: str, data: np.ndarray, shape: tuple[int, ...] = SHAPE) -> Any:
        torch = self.torch
        host = torch.from_numpy(data.copy()).view(torch.float16).reshape(shape)
        return host if placement == "host" else host.to(f"cuda:{self.device}")

    def read(self, tensor: Any) -> np.ndarray:
        torch = self.torch
        return tensor.cpu().contiguous().view(torch.uint8).reshape(-1).numpy().copy()

    def write_blocks(self, tensor: Any, blocks: list[int], data: np.ndarray, on_stream: bool) -> None:
        torch = self.torch
        flat = tensor.view(torch.uint8).reshape(-1)
        chunks = torch.from_numpy(data.copy()).reshape(-1, BLOCK_BYTES).to(tensor.device)
        if on_stream and tensor.is_cuda:
            torch.cuda._sleep(200_000_000)  # the model still computing
        for chunk, offset in zip(chunks, _ranges(blocks)):
            flat[offset:offset + BLOCK_BYTES] = chunk
        if not on_stream and tensor.is_cuda:
            torch.cuda.synchronize()

    def open_gates(self) -> None:
        return None

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def close(self) -> None:
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()


def _memory(backend: str, device: int) -> Any:
    return StandinMemory(device) if backend == "standin" else TorchMemory(device)


# -- the two workers, each in its own process --------------------------------------------------------


def _wait_for(side: WorkerSide, what: str, timeout_s: float = 20.0) -> set[str]:
    """Polls ``get_finished`` until the request ``what`` shows up (freed on
    the prefill side, settled on the decode side)."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    failed: set[str] = set()
    while time.monotonic() < deadline:
        sending, recving, fail = side.get_finished()
        seen |= sending | recving
        failed |= fail
        if what in seen:
            return failed
        time.sleep(0.005)
    raise AssertionError(f"{what} did not show up within {timeout_s} s")


def decode_worker(conn: Any, backend: str, placements: tuple[str, str], mode: str, device: int = 0,
                  event: str = "recorded", wide: bool = False) -> None:
    """Loads the request's blocks into its KV tensors (zeros), then checks
    every byte. ``wide``: blocks of twice the prefill's tokens (half as many),
    decode block k holding prefill blocks 2k and 2k + 1."""
    from datadist_aio.integrations.vllm.metadata import LoadSpec, StepPlan

    placement = placements[1]
    memory = _memory(backend, device)
    block_size, blocks = (2 * BLOCK_SIZE, BLOCKS // 2) if wide else (BLOCK_SIZE, BLOCKS)
    shape = (2, blocks, block_size, HEADS, HEAD_DIM)
    local = LOCAL[:2] if wide else LOCAL
    kv = {name: memory.tensor(placement, np.zeros(LAYER_BYTES, np.uint8), shape) for name in NAMES}
    side = WorkerSide(WorkerSettings(engine_id="decode", is_producer=False, transfer_mode=mode, load_timeout_s=10.0,
                                     kv_heads=HEADS, block_size=block_size, inbox_blocks=8, inbox_share_blocks=8,
                                     kv_buffer_device="cuda"))
    try:
        side.register(kv, blocks)
        assert side.device == (device if placement == "device" else None)
        if mode == "push_layerwise":
            inbox = side._inbox_caches[0].cache_desc.placement
            assert inbox.name == ("DEVICE" if placement == "device" else "HOST"), "the inbox is where the KV tensors are"
        conn.send(side.side_channel_port)
        prefill_port = _recv(conn)
        spec = LoadSpec("a", local, REMOTE, "prefill", "127.0.0.1", prefill_port, "p-a")
        side.start_loads(StepPlan(loads={"a": spec}))
        failed = _wait_for(side, "a")
        assert not failed and not side.load_errors(), f"the load failed: {failed}"
        # Where each prefill block's K and V land: with blocks as wide, at
        # the start of the matching decode block; twice as wide, in its
        # first or second half ([tokens, heads, head_dim] per block).
        width = BLOCK_BYTES * block_size // BLOCK_SIZE
        targets = [kv * LAYER_BYTES // 2 + local[i * BLOCK_SIZE // block_size] * width
                   + (i * BLOCK_BYTES) % width for kv in range(2) for i in range(len(REMOTE))]
        for layer, name in enumerate(NAMES):
            got = memory.read(kv[name])
            new = _new(layer).reshape(-1, BLOCK_BYTES)
            for chunk, offset in zip(new, targets):
                assert got[offset:offset + BLOCK_BYTES].tobytes() == chunk.tobytes(), \
                    f"{name}: bytes at {offset} differ from the prefill's"
            rest = np.ones(LAYER_BYTES, bool)
            for offset in targets:
                rest[offset:offset + BLOCK_BYTES] = False
            assert not got[rest].any(), f"{name}: a byte nobody asked for was written"
        if mode == "pull" and placement == "device":
            datadist = side._datadist
            assert datadist is not None
            stats = datadist._engine.link_stats(cluster_id_for("prefill", 0))
            # No staged frame: the decode's own copies under the prefill's
            # grant (on its streams from the prefill's device memory, staged
            # by itself from its host memory), or (a pull before the grant
            # came) the prefill's from the decode's memory opened by CUDA IPC.
            assert stats["staged_frames"] == 0, stats
            assert stats["one_sided_device_bytes"] + stats["one_sided_staged_bytes"] == \
                stats["one_sided_bytes_read"], stats
            assert stats["one_sided_bytes_read"] + stats["ipc_frames"] > 0, stats
        conn.send("loaded")
        assert _recv(conn) == "freed"
    finally:
        side.shutdown()
        memory.close()


def prefill_worker(conn: Any, backend: str, placements: tuple[str, str], mode: str, device: int = 0,
                   event: str = "recorded", wide: bool = False) -> None:
    """Holds the request's blocks (writing them in a step, pushed layer by
    layer in ``push_layerwise``) until the decode side releases them.
    ``event="refused"``: each saved layer's event is a handle the driver
    refuses, which fails the push (the decode side then pulls)."""
    from datadist_aio.integrations.vllm.metadata import SaveSpec, StepPlan

    placement = placements[0]
    memory = _memory(backend, device)
    kv = {name: memory.tensor(placement, _old(layer)) for layer, name in enumerate(NAMES)}
    decode_port = _recv(conn)
    # A refused event must fail the push at once: with a push timeout longer
    # than the test may run, only that lets finish_step return.
    timeout_s = 10.0 if event == "recorded" else 600.0
    side = WorkerSide(WorkerSettings(engine_id="prefill", is_consumer=False, transfer_mode=mode,
                                     load_timeout_s=timeout_s,
                                     kv_heads=HEADS, block_size=BLOCK_SIZE, push_port=decode_port,
                                     kv_buffer_device="cuda",
                                     record_event=memory.record_event if event == "recorded" else lambda: 0xDEAD0))
    try:
        side.register(kv, BLOCKS)
        assert side.device == (device if placement == "device" else None)
        leases = {"p-a": time.monotonic() + 60}
        if mode == "pull":
            for layer, name in enumerate(NAMES):
                memory.write_blocks(kv[name], REMOTE, _new(layer), on_stream=False)
            side.start_loads(StepPlan(leases=leases))
        else:
            # One step: each layer written on the model's stream, then saved
            # (save_kv_layer returns before the stream has run the writes).
            plan = StepPlan(leases=leases, saves={"p-a": SaveSpec("p-a", REMOTE, 0, len(REMOTE), True)})
            side.begin_step(plan)
            for layer, name in enumerate(NAMES):
                memory.write_blocks(kv[name], REMOTE, _new(layer), on_stream=True)
                side.save_layer(name)
            side.start_loads(plan)
            if isinstance(memory, StandinMemory) and placement == "device" and event == "recorded":
                time.sleep(0.3)
                assert side.take_records() == [], "pushed before the model's stream wrote the layers"
            memory.open_gates()
            side.finish_step()
            records = [(r.nbytes, r.blocks, r.ok) for r in side.take_records()]
            if event == "recorded":
                assert records == [(2 * LAYERS * len(REMOTE) * BLOCK_BYTES, len(REMOTE), True)], records
            else:
                assert records == [(0, len(REMOTE), False)], records
            memory.synchronize()
        conn.send(side.side_channel_port)
        assert _recv(conn) == "loaded"
        _wait_for(side, "p-a")
        conn.send("freed")
    finally:
        side.shutdown()
        memory.close()


MIXES = [("device", "device"), ("host", "device"), ("device", "host")]  # (prefill's, decode's)


@pytest.mark.parametrize("mode", ["pull", "push_layerwise"])
@pytest.mark.parametrize("placements", MIXES, ids=[f"prefill_{p}-decode_{d}" for p, d in MIXES])
def test_blocks_move_between_workers_in_place(standin: Path, placements: tuple[str, str], mode: str) -> None:
    run_pair(standin, decode_worker, prefill_worker, "standin", placements, mode)


def test_a_push_whose_events_the_driver_refuses_is_pulled_instead(standin: Path) -> None:
    run_pair(standin, decode_worker, prefill_worker, "standin", ("device", "device"), "push_layerwise", 0, "refused")


@pytest.mark.parametrize("placements", MIXES, ids=[f"prefill_{p}-decode_{d}" for p, d in MIXES])
def test_decode_blocks_of_twice_the_tokens_read_in_place(standin: Path, placements: tuple[str, str]) -> None:
    """Prefill blocks of 16 tokens into decode blocks of 32: the engine reads
    byte ranges (pull_block_ranges) into and out of device memory."""
    run_pair(standin, decode_worker, prefill_worker, "standin", placements, "pull", 0, "recorded", True)


def test_a_worker_registers_the_device_its_tensors_are_on(standin: Path) -> None:
    """Decode tensors on device 1 of two: the engine's device_id follows them
    (the driver refuses memory of another device than device_id)."""
    run_pair(standin, decode_worker, prefill_worker, "standin", ("device", "device"), "pull", 1,
             owner_env={"STANDIN_CUDA_DEVICES": "2"}, initiator_env={"STANDIN_CUDA_DEVICES": "2"})


def decode_first_decode(conn: Any, backend: str) -> None:
    """A decode-first request into device tensors (zeros): the prefill says
    pull, and every byte read must be the one its step wrote."""
    from datadist_aio.integrations.vllm.metadata import LoadSpec, StepPlan

    memory = _memory(backend, 0)
    kv = {name: memory.tensor("device", np.zeros(LAYER_BYTES, np.uint8)) for name in NAMES}
    side = WorkerSide(WorkerSettings(engine_id="decode", is_producer=False, load_timeout_s=20.0,
                                     kv_heads=HEADS, block_size=BLOCK_SIZE, kv_buffer_device="cuda"))
    try:
        side.register(kv, BLOCKS)
        prefill_port = _recv(conn)
        spec = LoadSpec("a", LOCAL, [], "prefill", "127.0.0.1", prefill_port, "", transfer_id="x-a")
        side.start_loads(StepPlan(loads={"a": spec}))
        failed = _wait_for(side, "a", 30.0)
        assert not failed and not side.load_errors(), f"the load failed: {failed}"
        targets = [kv * LAYER_BYTES // 2 + block * BLOCK_BYTES for kv in range(2) for block in LOCAL]
        for layer, name in enumerate(NAMES):
            got = memory.read(kv[name])
            for chunk, offset in zip(_new(layer).reshape(-1, BLOCK_BYTES), targets):
                assert got[offset:offset + BLOCK_BYTES].tobytes() == chunk.tobytes(), \
                    f"{name}: the decode read the block at {offset} before the prefill's forward wrote it"
        conn.send("loaded")
        assert _recv(conn) == "freed"
    finally:
        side.shutdown()
        memory.close()


def decode_first_prefill(conn: Any, backend: str) -> None:
    """Computes the request on the model's stream, which runs its writes
    only a second after the forward returned (the gate); in transfer mode
    "pull" it names the blocks for the decode to read."""
    from datadist_aio.integrations.vllm.metadata import SaveSpec, StepPlan

    memory = _memory(backend, 0)
    kv = {name: memory.tensor("device", _old(layer)) for layer, name in enumerate(NAMES)}
    side = WorkerSide(WorkerSettings(engine_id="prefill", is_consumer=False, transfer_mode="pull",
                                     load_timeout_s=20.0, kv_heads=HEADS, block_size=BLOCK_SIZE,
                                     kv_buffer_device="cuda", record_event=memory.record_event))
    try:
        side.register(kv, BLOCKS)
        conn.send(side.side_channel_port)
        assert side.pusher is not None
        directs = side.pusher.directs._directs
        deadline = time.monotonic() + 20
        while not ("x-a" in directs and directs["x-a"].expected):  # the decode's expect came
            assert time.monotonic() < deadline, "no expect from the decode"
            time.sleep(0.01)
        plan = StepPlan(saves={"p-a": SaveSpec("p-a", REMOTE, 0, len(REMOTE), True, "x-a", "t-a")})
        side.begin_step(plan)
        for layer, name in enumerate(NAMES):
            memory.write_blocks(kv[name], REMOTE, _new(layer), on_stream=True)
            side.save_layer(name)
        side.start_loads(plan)
        opener = threading.Timer(1.0, memory.open_gates)
        opener.start()
        try:
            side.finish_step()
        finally:
            opener.join()
        side.start_loads(StepPlan(leases={"p-a": time.monotonic() + 60}, lease_tokens={"p-a": "t-a"}))
        assert _recv(conn) == "loaded"
        _wait_for(side, "p-a")
        conn.send("freed")
    finally:
        side.shutdown()
        memory.close()


def test_a_decode_told_to_pull_reads_what_the_device_wrote(standin: Path) -> None:
    """Decode-first on device tensors: the decode is told to pull once the
    prefill's forward is over on the device (its end event completed), not
    when the forward returned with its writes still queued on the stream."""
    run_pair(standin, decode_first_decode, decode_first_prefill, "standin")


def test_torch_cuda_tensors_move_between_workers() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch finds no CUDA device: the same pairs with torch CUDA tensors need a GPU")
    for placements in MIXES:
        for mode in ("pull", "push_layerwise"):
            # The engine loads the real driver (libcuda.so.1), as torch does.
            run_pair(Path("libcuda.so.1"), decode_worker, prefill_worker, "torch", placements, mode)


# -- refusals --------------------------------------------------------------------------------------------


def test_placement_follows_the_tensors_and_kv_buffer_device() -> None:
    on = {f"l{i}": DeviceTensor(1 << 40, SHAPE, 1) for i in range(2)}
    host = {"l0": HostTensor(np.zeros(SHAPE, np.float16))}
    assert kv_placement(host, "cuda") == ("host", None)
    assert kv_placement(on, "cuda") == ("device", 1)
    assert kv_placement(on, None) == ("device", 1)
    assert kv_placement(on, "cpu") == ("host_buffer", None)


@pytest.mark.parametrize("tensors, buffer, words", [
    ({"l0": DeviceTensor(1 << 40, SHAPE, 0), "l1": DeviceTensor(1 << 41, SHAPE, 1)}, "cuda",
     "KV tensors are on cuda:0 and cuda:1: one worker registers the memory of one device"),
    ({"l0": DeviceTensor(1 << 40, SHAPE, 0), "l1": HostTensor(np.zeros(SHAPE, np.float16))}, "cuda",
     "KV tensors are on cpu and cuda:0: one worker"),
    ({"l0": DeviceTensor(1 << 40, SHAPE, 0)}, "xpu", "kv_buffer_device is 'xpu'"),
], ids=["two devices", "device and host", "unknown buffer device"])
def test_tensors_the_connector_cannot_register_are_refused(tensors: dict[str, Any], buffer: str, words: str) -> None:
    side = WorkerSide(WorkerSettings(engine_id="decode", is_producer=False, kv_buffer_device=buffer))
    with pytest.raises(ValueError, match=words):
        side.register(tensors, BLOCKS)
    assert side.device is None and side._loop is None, "refused before anything started"

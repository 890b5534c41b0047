"""The stand-in CUDA driver (tests/cuda_standin): the driver's rules it keeps,
checked through ctypes alone, in this process and in spawned children.

This process initialises the stand-in with two devices of 64 MiB each; the
environment is read once, at the first cuInit, so the other configurations
(the defaults, no device, bad values) run in children of their own.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import random
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from datadist_aio.bench import cuda_driver
from datadist_aio.bench.cuda_driver import (
    HOST_FN,
    SIGNATURES,
    AccessDesc,
    AllocationProp,
    IpcHandle,
    Memcpy2D,
    MemLocation,
)

pytestmark = pytest.mark.timeout(180)

HERE = Path(__file__).resolve().parent
_SPAWN = multiprocessing.get_context("spawn")
CHILD_TIMEOUT = 60.0  # a spawned child starts slowly on 2 busy cores
MiB = 1 << 20
PAGE = os.sysconf("SC_PAGESIZE")

# CUresult values.
SUCCESS = 0
INVALID_VALUE = 1
OUT_OF_MEMORY = 2
NOT_INITIALIZED = 3
NO_DEVICE = 100
INVALID_DEVICE = 101
INVALID_CONTEXT = 201
MAP_FAILED = 205
INVALID_HANDLE = 400
NOT_FOUND = 500
NOT_READY = 600
ILLEGAL_ADDRESS = 700
HOST_MEMORY_ALREADY_REGISTERED = 712
HOST_MEMORY_NOT_REGISTERED = 713
NOT_PERMITTED = 800
NOT_SUPPORTED = 801

ERROR_NAMES = {
    SUCCESS: "CUDA_SUCCESS",
    INVALID_VALUE: "CUDA_ERROR_INVALID_VALUE",
    OUT_OF_MEMORY: "CUDA_ERROR_OUT_OF_MEMORY",
    NOT_INITIALIZED: "CUDA_ERROR_NOT_INITIALIZED",
    NO_DEVICE: "CUDA_ERROR_NO_DEVICE",
    INVALID_DEVICE: "CUDA_ERROR_INVALID_DEVICE",
    INVALID_CONTEXT: "CUDA_ERROR_INVALID_CONTEXT",
    MAP_FAILED: "CUDA_ERROR_MAP_FAILED",
    INVALID_HANDLE: "CUDA_ERROR_INVALID_HANDLE",
    NOT_FOUND: "CUDA_ERROR_NOT_FOUND",
    NOT_READY: "CUDA_ERROR_NOT_READY",
    ILLEGAL_ADDRESS: "CUDA_ERROR_ILLEGAL_ADDRESS",
    HOST_MEMORY_ALREADY_REGISTERED: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
    HOST_MEMORY_NOT_REGISTERED: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
    NOT_PERMITTED: "CUDA_ERROR_NOT_PERMITTED",
    NOT_SUPPORTED: "CUDA_ERROR_NOT_SUPPORTED",
}

# CUpointer_attribute values, each with the size of the value it writes.
ATTR_CONTEXT = 1
ATTR_MEMORY_TYPE = 2
ATTR_BUFFER_ID = 7
ATTR_DEVICE_ORDINAL = 9
ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
ATTR_RANGE_START_ADDR = 11
ATTR_RANGE_SIZE = 12
ATTR_MAPPED = 13
ATTRIBUTES = {
    ATTR_CONTEXT: ctypes.c_void_p,
    ATTR_MEMORY_TYPE: ctypes.c_uint,
    ATTR_DEVICE_ORDINAL: ctypes.c_int,
    ATTR_IS_LEGACY_CUDA_IPC_CAPABLE: ctypes.c_int,
    ATTR_RANGE_START_ADDR: ctypes.c_ulonglong,
    ATTR_RANGE_SIZE: ctypes.c_size_t,
    ATTR_MAPPED: ctypes.c_int,
}
MEMORYTYPE_HOST = 1
MEMORYTYPE_DEVICE = 2

STREAM_DEFAULT = 0
STREAM_NON_BLOCKING = 1
EVENT_DISABLE_TIMING = 2
EVENT_INTERPROCESS = 4
IPC_LAZY_ENABLE_PEER_ACCESS = 1
GET_PROC_ADDRESS_SUCCESS = 0
GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1

ENV_DEVICES = "STANDIN_CUDA_DEVICES"
ENV_MEMORY = "STANDIN_CUDA_MEMORY_MB"
ENV_IPC = "STANDIN_CUDA_IPC"


# Virtual memory management values.
GRANULARITY = 2 * MiB  # the stand-in's
HANDLE_NONE, HANDLE_POSIX_FD, HANDLE_WIN32 = 0, 1, 2
ALLOCATION_PINNED = 1
LOCATION_DEVICE = 1
ACCESS_NONE, ACCESS_READWRITE = 0, 3

_i = ctypes.c_int
_ull = ctypes.c_ulonglong
_sz = ctypes.c_size_t
_vp = ctypes.c_void_p
_P = ctypes.POINTER


def load(path: str) -> ctypes.CDLL:
    """The stand-in, with every entry point's argument and result types."""
    return cuda_driver.load(path, complete=True)


def name_of(result: int) -> str:
    return ERROR_NAMES.get(result, f"CUresult {result}")


def buffer(data: bytes) -> ctypes.Array[ctypes.c_char]:
    """A host buffer holding ``data`` (no terminating NUL)."""
    return (ctypes.c_char * len(data)).from_buffer_copy(data)


def addr(buf: ctypes.Array[Any]) -> int:
    return ctypes.addressof(buf)


class Cu:
    """The loaded stand-in and a few helpers that insist on success."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.contexts: list[int] = []

    def ok(self, result: int) -> None:
        assert result == SUCCESS, name_of(result)

    def retain(self, device: int) -> int:
        ctx = _vp()
        self.ok(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
        assert ctx.value
        return ctx.value

    def current(self) -> Optional[int]:
        ctx = _vp()
        self.ok(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)))
        return ctx.value

    def alloc(self, size: int) -> int:
        ptr = _ull()
        self.ok(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), size))
        return ptr.value

    def try_alloc(self, size: int) -> int:
        return int(self.lib.cuMemAlloc_v2(ctypes.byref(_ull()), size))

    def free(self, ptr: int) -> None:
        self.ok(self.lib.cuMemFree_v2(ptr))

    def htod(self, ptr: int, data: bytes) -> None:
        src = buffer(data)  # alive until the copy is done
        self.ok(self.lib.cuMemcpyHtoD_v2(ptr, addr(src), len(data)))

    def dtoh(self, ptr: int, size: int) -> bytes:
        out = (ctypes.c_char * size)()
        self.ok(self.lib.cuMemcpyDtoH_v2(addr(out), ptr, size))
        return out.raw

    def live(self) -> int:
        return int(self.lib.standin_cuda_live_allocations())

    def copied(self) -> int:
        return int(self.lib.standin_cuda_bytes_copied())

    @contextlib.contextmanager
    def stream(self, flags: int = STREAM_NON_BLOCKING) -> Iterator[int]:
        handle = _vp()
        self.ok(self.lib.cuStreamCreate(ctypes.byref(handle), flags))
        try:
            yield handle.value or 0
        finally:
            self.ok(self.lib.cuStreamDestroy_v2(handle))

    @contextlib.contextmanager
    def event(self, flags: int = EVENT_DISABLE_TIMING) -> Iterator[int]:
        handle = _vp()
        self.ok(self.lib.cuEventCreate(ctypes.byref(handle), flags))
        try:
            yield handle.value or 0
        finally:
            self.ok(self.lib.cuEventDestroy_v2(handle))

    @contextlib.contextmanager
    def device_memory(self, *sizes: int) -> Iterator[list[int]]:
        ptrs = [self.alloc(size) for size in sizes]
        try:
            yield ptrs
        finally:
            for ptr in ptrs:
                self.free(ptr)

    @contextlib.contextmanager
    def on_context(self, ctx: Optional[int]) -> Iterator[None]:
        before = self.current()
        self.ok(self.lib.cuCtxSetCurrent(ctx))
        try:
            yield
        finally:
            self.ok(self.lib.cuCtxSetCurrent(before))

    def buffer_id(self, ptr: int) -> int:
        """The driver's buffer id of the allocation (or mapping) at ``ptr``."""
        value = ctypes.c_ulonglong()
        kinds = (ctypes.c_int * 1)(ATTR_BUFFER_ID)
        data = (_vp * 1)(addr(value))
        self.ok(self.lib.cuPointerGetAttributes(1, kinds, data, ptr))
        return value.value

    def attributes(self, ptr: int) -> dict[int, int]:
        """Every attribute of ATTRIBUTES for ``ptr``, after checking that each
        value was written with exactly its documented size."""
        ids = list(ATTRIBUTES)
        slots = [(ctypes.c_ubyte * 16)(*([0xA5] * 16)) for _ in ids]
        kinds = (ctypes.c_int * len(ids))(*ids)
        data = (_vp * len(ids))(*[addr(slot) for slot in slots])
        self.ok(self.lib.cuPointerGetAttributes(len(ids), kinds, data, ptr))
        values = {}
        for attribute, slot in zip(ids, slots):
            size = ctypes.sizeof(ATTRIBUTES[attribute])
            assert bytes(slot[size:]) == b"\xa5" * (16 - size), f"attribute {attribute} wrote past {size} bytes"
            value: Any = ATTRIBUTES[attribute].from_buffer_copy(bytes(slot[:size]))
            values[attribute] = value.value or 0
        return values

    def vmm_create(self, size: int = GRANULARITY, types: int = HANDLE_POSIX_FD, device: int = 0) -> int:
        handle = _ull()
        prop = AllocationProp(ALLOCATION_PINNED, types, MemLocation(LOCATION_DEVICE, device))
        self.ok(self.lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0))
        return handle.value

    def vmm_reserve(self, size: int) -> int:
        ptr = _ull()
        self.ok(self.lib.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0))
        return ptr.value

    def vmm_access(self, ptr: int, size: int, flags: int = ACCESS_READWRITE, device: int = 0) -> int:
        desc = AccessDesc(MemLocation(LOCATION_DEVICE, device), flags)
        return int(self.lib.cuMemSetAccess(ptr, size, ctypes.byref(desc), 1))

    def vmm_export(self, handle: int) -> tuple[int, int]:
        fd = ctypes.c_int(-1)
        r = self.lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, HANDLE_POSIX_FD, 0)
        return r, fd.value

    def vmm_import(self, fd: int) -> tuple[int, int]:
        handle = _ull()
        r = self.lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), HANDLE_POSIX_FD)
        return r, handle.value

    def live_vmm(self) -> int:
        return int(self.lib.standin_cuda_live_vmm_allocations())

    def ipc_handle(self, ptr: int) -> bytes:
        handle = IpcHandle()
        self.ok(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), ptr))
        return bytes(handle)


def _load_build_module() -> Any:
    spec = importlib.util.spec_from_file_location("cuda_standin_build", HERE / "cuda_standin" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


IN_PROCESS_SONAME = "libcuda-standin-in-process.so.1"


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Spawning starts multiprocessing's resource tracker once per process and
    # keeps a descriptor to it: started here, it stays out of the fd checks.
    multiprocessing.resource_tracker.ensure_running()
    return tmp_path_factory.mktemp("cuda_standin")


@pytest.fixture(scope="session")
def standin_path(build_dir: Path) -> str:
    """libcuda.so.1, as the children load it."""
    return str(_load_build_module().build(build_dir))


@pytest.fixture(scope="session")
def driver(build_dir: Path) -> Cu:
    """The stand-in in this process, initialised with two devices of 64 MiB.
    The copy loaded here has another soname: with libcuda.so.1 loaded, any
    later dlopen("libcuda.so.1") in this process (the engine's, other tests')
    would find the stand-in instead of looking for a real driver."""
    path = _load_build_module().build(build_dir, soname=IN_PROCESS_SONAME)
    saved = {name: os.environ.get(name) for name in (ENV_DEVICES, ENV_MEMORY)}
    os.environ[ENV_DEVICES] = "2"
    os.environ[ENV_MEMORY] = "64"
    try:
        cu = Cu(load(str(path)))
        cu.ok(cu.lib.cuInit(0))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    cu.contexts = [cu.retain(0), cu.retain(1)]
    return cu


@pytest.fixture
def cu(driver: Cu) -> Iterator[Cu]:
    """The stand-in with device 0's context current on this thread; fails a
    test that leaves device memory allocated or IPC mappings open."""
    driver.ok(driver.lib.cuCtxSetCurrent(driver.contexts[0]))
    before = driver.live()
    yield driver
    driver.ok(driver.lib.cuCtxSetCurrent(driver.contexts[0]))
    assert driver.live() == before, "device allocations or IPC mappings left behind"


def run_in_thread(body: Callable[[], Any], timeout: float = 10.0) -> Any:
    """body() on a new thread (which has no current context); its result."""
    out: dict[str, Any] = {}

    def main() -> None:
        try:
            out["value"] = body()
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    thread = threading.Thread(target=main)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the thread did not finish"
    if "error" in out:
        raise out["error"]
    return out["value"]


class Gate:
    """A host function that holds its stream until opened (at most 10 s)."""

    def __init__(self, log: Optional[list[str]] = None, label: str = "gate") -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.log = log
        self.label = label
        self.fn = HOST_FN(self._run)

    def _run(self, _user: Any) -> None:
        self.entered.set()
        self.opened.wait(10)
        if self.log is not None:
            self.log.append(self.label)

    def open(self) -> None:
        self.opened.set()


def worker_tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


# ---------------------------------------------------------------------------
# Children
# ---------------------------------------------------------------------------


def _child_env(env: dict[str, Optional[str]]) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _child_uninitialised(conn: multiprocessing.connection.Connection, path: str) -> None:
    """Every call before cuInit, then the defaults of the environment."""
    try:
        _child_env({ENV_DEVICES: None, ENV_MEMORY: None})
        cu = Cu(load(path))
        i, p, ull, sz, text = _i(), _vp(), _ull(), _sz(), ctypes.c_char_p()
        buf = (ctypes.c_char * 64)()
        handle = IpcHandle()
        kinds = (ctypes.c_int * 1)(ATTR_MEMORY_TYPE)
        data = (_vp * 1)(addr(buf))
        noop = HOST_FN(lambda _user: None)
        calls: dict[str, Callable[[], int]] = {
            "cuDeviceGetCount": lambda: cu.lib.cuDeviceGetCount(ctypes.byref(i)),
            "cuDeviceGet": lambda: cu.lib.cuDeviceGet(ctypes.byref(i), 0),
            "cuDevicePrimaryCtxRetain": lambda: cu.lib.cuDevicePrimaryCtxRetain(ctypes.byref(p), 0),
            "cuDevicePrimaryCtxRelease_v2": lambda: cu.lib.cuDevicePrimaryCtxRelease_v2(0),
            "cuCtxSetCurrent": lambda: cu.lib.cuCtxSetCurrent(None),
            "cuCtxGetCurrent": lambda: cu.lib.cuCtxGetCurrent(ctypes.byref(p)),
            "cuPointerGetAttributes": lambda: cu.lib.cuPointerGetAttributes(1, kinds, data, addr(buf)),
            "cuMemGetAddressRange_v2": lambda: cu.lib.cuMemGetAddressRange_v2(
                ctypes.byref(ull), ctypes.byref(sz), 4096
            ),
            "cuMemAlloc_v2": lambda: cu.lib.cuMemAlloc_v2(ctypes.byref(ull), 4096),
            "cuMemFree_v2": lambda: cu.lib.cuMemFree_v2(4096),
            "cuMemAllocHost_v2": lambda: cu.lib.cuMemAllocHost_v2(ctypes.byref(p), 4096),
            "cuMemFreeHost": lambda: cu.lib.cuMemFreeHost(addr(buf)),
            "cuMemHostRegister_v2": lambda: cu.lib.cuMemHostRegister_v2(addr(buf), 64, 0),
            "cuMemHostUnregister": lambda: cu.lib.cuMemHostUnregister(addr(buf)),
            "cuMemsetD8_v2": lambda: cu.lib.cuMemsetD8_v2(4096, 0, 1),
            "cuMemcpyHtoD_v2": lambda: cu.lib.cuMemcpyHtoD_v2(4096, addr(buf), 1),
            "cuMemcpyDtoH_v2": lambda: cu.lib.cuMemcpyDtoH_v2(addr(buf), 4096, 1),
            "cuMemcpy2DAsync_v2": lambda: cu.lib.cuMemcpy2DAsync_v2(ctypes.byref(Memcpy2D()), None),
            "cuMemcpyDtoD_v2": lambda: cu.lib.cuMemcpyDtoD_v2(4096, 8192, 1),
            "cuMemcpyHtoDAsync_v2": lambda: cu.lib.cuMemcpyHtoDAsync_v2(4096, addr(buf), 1, None),
            "cuMemcpyDtoHAsync_v2": lambda: cu.lib.cuMemcpyDtoHAsync_v2(addr(buf), 4096, 1, None),
            "cuMemcpyDtoDAsync_v2": lambda: cu.lib.cuMemcpyDtoDAsync_v2(4096, 8192, 1, None),
            "cuStreamCreate": lambda: cu.lib.cuStreamCreate(ctypes.byref(p), 0),
            "cuStreamDestroy_v2": lambda: cu.lib.cuStreamDestroy_v2(addr(buf)),
            "cuStreamSynchronize": lambda: cu.lib.cuStreamSynchronize(None),
            "cuStreamQuery": lambda: cu.lib.cuStreamQuery(None),
            "cuStreamWaitEvent": lambda: cu.lib.cuStreamWaitEvent(None, addr(buf), 0),
            "cuLaunchHostFunc": lambda: cu.lib.cuLaunchHostFunc(None, noop, None),
            "cuEventCreate": lambda: cu.lib.cuEventCreate(ctypes.byref(p), 0),
            "cuEventRecord": lambda: cu.lib.cuEventRecord(addr(buf), None),
            "cuEventQuery": lambda: cu.lib.cuEventQuery(addr(buf)),
            "cuEventSynchronize": lambda: cu.lib.cuEventSynchronize(addr(buf)),
            "cuEventDestroy_v2": lambda: cu.lib.cuEventDestroy_v2(addr(buf)),
            "cuIpcGetMemHandle": lambda: cu.lib.cuIpcGetMemHandle(ctypes.byref(handle), 4096),
            "cuIpcOpenMemHandle_v2": lambda: cu.lib.cuIpcOpenMemHandle_v2(
                ctypes.byref(ull), handle, IPC_LAZY_ENABLE_PEER_ACCESS
            ),
            "cuIpcCloseMemHandle": lambda: cu.lib.cuIpcCloseMemHandle(4096),
            "cuMemGetAllocationGranularity": lambda: cu.lib.cuMemGetAllocationGranularity(
                ctypes.byref(sz), ctypes.byref(prop), 0
            ),
            "cuMemCreate": lambda: cu.lib.cuMemCreate(ctypes.byref(ull), GRANULARITY, ctypes.byref(prop), 0),
            "cuMemRelease": lambda: cu.lib.cuMemRelease(1),
            "cuMemAddressReserve": lambda: cu.lib.cuMemAddressReserve(ctypes.byref(ull), GRANULARITY, 0, 0, 0),
            "cuMemAddressFree": lambda: cu.lib.cuMemAddressFree(GRANULARITY, GRANULARITY),
            "cuMemMap": lambda: cu.lib.cuMemMap(GRANULARITY, GRANULARITY, 0, 1, 0),
            "cuMemUnmap": lambda: cu.lib.cuMemUnmap(GRANULARITY, GRANULARITY),
            "cuMemSetAccess": lambda: cu.vmm_access(GRANULARITY, GRANULARITY),
            "cuMemRetainAllocationHandle": lambda: cu.lib.cuMemRetainAllocationHandle(ctypes.byref(ull), addr(buf)),
            "cuMemExportToShareableHandle": lambda: cu.vmm_export(1)[0],
            "cuMemImportFromShareableHandle": lambda: cu.vmm_import(0)[0],
        }
        prop = AllocationProp(ALLOCATION_PINNED, HANDLE_POSIX_FD, MemLocation(LOCATION_DEVICE, 0))
        before = {name: call() for name, call in calls.items()}
        pfn = _vp()
        status = _i(-1)
        exempt = {
            "cuDriverGetVersion": cu.lib.cuDriverGetVersion(ctypes.byref(i)),
            "cuGetErrorName": cu.lib.cuGetErrorName(INVALID_VALUE, ctypes.byref(text)),
            "cuGetErrorString": cu.lib.cuGetErrorString(INVALID_VALUE, ctypes.byref(text)),
            "cuGetProcAddress_v2": cu.lib.cuGetProcAddress_v2(b"cuInit", ctypes.byref(pfn), 12000, 0, ctypes.byref(status)),
        }
        bad_flags = cu.lib.cuInit(1)
        still = cu.lib.cuDeviceGetCount(ctypes.byref(i))
        init = cu.lib.cuInit(0)
        again = cu.lib.cuInit(0)
        count = _i(-1)
        cu.ok(cu.lib.cuDeviceGetCount(ctypes.byref(count)))
        beyond = cu.lib.cuDeviceGet(ctypes.byref(i), 1)
        cu.ok(cu.lib.cuCtxSetCurrent(cu.retain(0)))
        over = cu.try_alloc(1024 * MiB + 1)
        ptr = cu.alloc(1024 * MiB)  # the whole default capacity: the memfd is sparse
        full = cu.try_alloc(1)
        cu.free(ptr)
        conn.send(
            {
                "before": before,
                "exempt": exempt,
                "bad_flags": bad_flags,
                "still": still,
                "init": init,
                "again": again,
                "count": count.value,
                "beyond": beyond,
                "over": over,
                "full": full,
                "live": cu.live(),
            }
        )
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def _child_devices(conn: multiprocessing.connection.Connection, path: str) -> None:
    """Bad values of the environment, then no device at all."""
    try:
        cu = Cu(load(path))
        results: dict[str, Any] = {}
        count = _i(-1)
        for label, devices, memory in (
            ("devices_word", "two", None),
            ("devices_negative", "-1", None),
            ("devices_too_many", "65", None),
            ("memory_zero", "1", "0"),
            ("memory_word", "1", "lots"),
        ):
            _child_env({ENV_DEVICES: devices, ENV_MEMORY: memory})
            results[label] = (cu.lib.cuInit(0), cu.lib.cuDeviceGetCount(ctypes.byref(count)))
        _child_env({ENV_DEVICES: "0", ENV_MEMORY: None})
        results["init"] = cu.lib.cuInit(0)
        results["count"] = (cu.lib.cuDeviceGetCount(ctypes.byref(count)), count.value)
        device = _i()
        results["get"] = cu.lib.cuDeviceGet(ctypes.byref(device), 0)
        results["retain"] = cu.lib.cuDevicePrimaryCtxRetain(ctypes.byref(_vp()), 0)
        conn.send(results)
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def _child_without_ipc(conn: multiprocessing.connection.Connection, path: str) -> None:
    """A bad value of STANDIN_CUDA_IPC, then 0: memory legacy IPC cannot export."""
    try:
        cu = Cu(load(path))
        results: dict[str, Any] = {}
        _child_env({ENV_DEVICES: None, ENV_MEMORY: None, ENV_IPC: "no"})
        results["word"] = cu.lib.cuInit(0)
        _child_env({ENV_IPC: "0"})
        results["init"] = cu.lib.cuInit(0)
        cu.ok(cu.lib.cuCtxSetCurrent(_vp(cu.retain(0))))
        ptr = cu.alloc(4096)
        results["capable"] = cu.attributes(ptr)[ATTR_IS_LEGACY_CUDA_IPC_CAPABLE]
        results["export"] = cu.lib.cuIpcGetMemHandle(ctypes.byref(IpcHandle()), _ull(ptr))
        cu.free(ptr)
        conn.send(results)
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def _child_touch(conn: multiprocessing.connection.Connection, path: str, kind: str) -> None:
    """Reads one byte of device memory (or of pinned host memory) from host code."""
    cu = Cu(load(path))
    cu.ok(cu.lib.cuInit(0))
    cu.ok(cu.lib.cuCtxSetCurrent(cu.retain(0)))
    if kind == "device":
        ptr = cu.alloc(4096)
        cu.htod(ptr, b"\x7f" * 4096)
    else:
        host = _vp()
        cu.ok(cu.lib.cuMemAllocHost_v2(ctypes.byref(host), 4096))
        ptr = host.value or 0
        ctypes.memset(ptr, 0x7F, 4096)
    conn.send("touching")
    value = ctypes.string_at(ptr, 1)
    conn.send(("survived", value))


def _child_illegal_address(conn: multiprocessing.connection.Connection, path: str) -> None:
    """Frees memory that a queued copy still targets."""
    try:
        cu = Cu(load(path))
        cu.ok(cu.lib.cuInit(0))
        cu.ok(cu.lib.cuCtxSetCurrent(cu.retain(0)))
        results: dict[str, Any] = {}
        gate = Gate()
        src = buffer(b"\x01" * 4096)
        handle = _vp()
        cu.ok(cu.lib.cuStreamCreate(ctypes.byref(handle), STREAM_NON_BLOCKING))
        stream = handle.value
        ptr = cu.alloc(4096)
        cu.ok(cu.lib.cuLaunchHostFunc(stream, gate.fn, None))
        results["queued"] = cu.lib.cuMemcpyHtoDAsync_v2(ptr, addr(src), 4096, stream)
        results["free"] = cu.lib.cuMemFree_v2(ptr)
        gate.open()
        results["sync"] = cu.lib.cuStreamSynchronize(stream)
        results["query"] = cu.lib.cuStreamQuery(stream)
        results["alloc_after"] = cu.try_alloc(4096)
        # A primary context released by everyone and retained again is new.
        cu.ok(cu.lib.cuDevicePrimaryCtxRelease_v2(0))
        cu.ok(cu.lib.cuCtxSetCurrent(cu.retain(0)))
        results["alloc_fresh"] = cu.try_alloc(4096)
        results["copied"] = cu.copied()
        conn.send(results)
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def _peer_main(conn: multiprocessing.connection.Connection, path: str) -> None:
    """A second process using the stand-in: runs the parent's commands."""
    _child_env({ENV_DEVICES: None, ENV_MEMORY: None})
    cu = Cu(load(path))
    try:
        cu.ok(cu.lib.cuInit(0))
        cu.ok(cu.lib.cuCtxSetCurrent(cu.retain(0)))
        conn.send(("ok", os.getpid()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return

    def open_handle(raw: bytes, flags: int = IPC_LAZY_ENABLE_PEER_ACCESS) -> tuple[int, int]:
        ptr = _ull()
        r = cu.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), IpcHandle.from_buffer_copy(raw), flags)
        return r, ptr.value

    def read(ptr: int, size: int) -> tuple[int, bytes]:
        out = (ctypes.c_char * size)()
        return cu.lib.cuMemcpyDtoH_v2(addr(out), ptr, size), out.raw

    def write(ptr: int, data: bytes) -> int:
        src = buffer(data)
        return int(cu.lib.cuMemcpyHtoD_v2(ptr, addr(src), len(data)))

    def address_range(ptr: int) -> tuple[int, int, int]:
        base, size = _ull(), _sz()
        r = cu.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
        return r, base.value, size.value

    commands: dict[str, Callable[..., Any]] = {
        "open": open_handle,
        "close": lambda ptr: cu.lib.cuIpcCloseMemHandle(ptr),
        "read": read,
        "write": write,
        "range": address_range,
        "attributes": cu.attributes,
        "alloc": cu.alloc,
        "free": cu.free,
        "handle": cu.ipc_handle,
        "live": cu.live,
    }
    while conn.poll(CHILD_TIMEOUT):
        command, *args = conn.recv()
        if command == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", commands[command](*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class Child:
    """A spawned process and the parent's end of its pipe; always reaped."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        self.conn, child_end = _SPAWN.Pipe()
        self.process = _SPAWN.Process(target=target, args=(child_end, *args), daemon=True)
        try:
            self.process.start()
        finally:
            child_end.close()

    def receive(self, timeout: float = CHILD_TIMEOUT) -> Any:
        assert self.conn.poll(timeout), "the child did not answer in time"
        return self.conn.recv()

    def call(self, command: str, *args: Any) -> Any:
        self.conn.send((command, *args))
        status, value = self.receive()
        assert status == "ok", value
        return value

    def wait(self, timeout: float = CHILD_TIMEOUT) -> Optional[int]:
        self.process.join(timeout)
        return self.process.exitcode

    def close(self) -> None:
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.process.close()
        self.conn.close()


@contextlib.contextmanager
def child(target: Callable[..., None], *args: Any) -> Iterator[Child]:
    process = Child(target, *args)
    try:
        yield process
    finally:
        process.close()


def child_result(target: Callable[..., None], *args: Any) -> dict[str, Any]:
    with child(target, *args) as proc:
        result: dict[str, Any] = proc.receive()
        assert proc.wait() == 0
    assert "error" not in result, result["error"]
    return result


# ---------------------------------------------------------------------------
# Initialisation and devices
# ---------------------------------------------------------------------------


def test_every_call_needs_cuinit_first(standin_path: str) -> None:
    got = child_result(_child_uninitialised, standin_path)
    refused = {name: name_of(r) for name, r in got["before"].items() if r != NOT_INITIALIZED}
    assert not refused, f"answered before cuInit: {refused}"
    assert set(got["before"]) | set(got["exempt"]) == set(SIGNATURES) - {"cuInit"}
    assert got["exempt"] == dict.fromkeys(got["exempt"], SUCCESS)
    assert got["bad_flags"] == INVALID_VALUE and got["still"] == NOT_INITIALIZED
    assert got["init"] == SUCCESS and got["again"] == SUCCESS
    # The defaults: one device of 1024 MiB.
    assert got["count"] == 1 and got["beyond"] == INVALID_DEVICE
    assert got["over"] == OUT_OF_MEMORY and got["full"] == OUT_OF_MEMORY
    assert got["live"] == 0


def test_devices_come_from_the_environment(standin_path: str) -> None:
    got = child_result(_child_devices, standin_path)
    for label in ("devices_word", "devices_negative", "devices_too_many", "memory_zero", "memory_word"):
        assert got[label] == (INVALID_VALUE, NOT_INITIALIZED), label
    assert got["init"] == SUCCESS
    assert got["count"] == (SUCCESS, 0)
    assert got["get"] == NO_DEVICE
    assert got["retain"] == INVALID_DEVICE


def test_ipc_export_can_be_turned_off(standin_path: str) -> None:
    got = child_result(_child_without_ipc, standin_path)
    assert got == {"word": INVALID_VALUE, "init": SUCCESS, "capable": 0, "export": NOT_SUPPORTED}


def test_this_process_leaves_libcuda_so_1_to_a_real_driver(cu: Cu) -> None:
    try:
        found = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return  # nothing answers to the name
    assert not hasattr(found, "standin_cuda_live_allocations"), "dlopen('libcuda.so.1') finds the stand-in"


def test_two_devices_and_their_contexts(cu: Cu) -> None:
    count = _i()
    cu.ok(cu.lib.cuDeviceGetCount(ctypes.byref(count)))
    assert count.value == 2
    device = _i(-1)
    cu.ok(cu.lib.cuDeviceGet(ctypes.byref(device), 1))
    assert device.value == 1
    for ordinal in (2, -1, 64):
        assert cu.lib.cuDeviceGet(ctypes.byref(device), ordinal) == INVALID_DEVICE
    assert cu.lib.cuDevicePrimaryCtxRetain(ctypes.byref(_vp()), 2) == INVALID_DEVICE
    assert cu.lib.cuDevicePrimaryCtxRetain(None, 0) == INVALID_VALUE
    # One primary context per device, the same on every retain.
    assert cu.retain(0) == cu.contexts[0] and cu.retain(1) == cu.contexts[1]
    assert cu.contexts[0] != cu.contexts[1]
    cu.ok(cu.lib.cuDevicePrimaryCtxRelease_v2(0))
    cu.ok(cu.lib.cuDevicePrimaryCtxRelease_v2(1))
    version = _i()
    cu.ok(cu.lib.cuDriverGetVersion(ctypes.byref(version)))
    assert version.value >= 12000


def test_a_released_primary_context_is_unusable_until_retained(cu: Cu) -> None:
    ctx = cu.contexts[1]
    with cu.on_context(ctx):
        cu.ok(cu.lib.cuDevicePrimaryCtxRelease_v2(1))  # the session's retain
        try:
            assert cu.try_alloc(4096) == INVALID_CONTEXT
            assert cu.lib.cuCtxSetCurrent(ctx) == INVALID_CONTEXT
            assert cu.lib.cuDevicePrimaryCtxRelease_v2(1) == INVALID_CONTEXT
        finally:
            assert cu.retain(1) == ctx
        ptr = cu.alloc(4096)
        cu.free(ptr)


def test_the_current_context_belongs_to_one_thread(cu: Cu) -> None:
    src = buffer(b"x" * 16)

    def without_context() -> dict[str, int]:
        assert cu.current() is None
        ptr, stream, event, host, handle = _ull(), _vp(), _vp(), _vp(), IpcHandle()
        return {
            "alloc": cu.lib.cuMemAlloc_v2(ctypes.byref(ptr), 4096),
            "free": cu.lib.cuMemFree_v2(4096),
            "htod": cu.lib.cuMemcpyHtoD_v2(4096, addr(src), 16),
            "htod_async": cu.lib.cuMemcpyHtoDAsync_v2(4096, addr(src), 16, None),
            "memset": cu.lib.cuMemsetD8_v2(4096, 0, 16),
            "stream": cu.lib.cuStreamCreate(ctypes.byref(stream), 0),
            "sync": cu.lib.cuStreamSynchronize(None),
            "event": cu.lib.cuEventCreate(ctypes.byref(event), 0),
            "host": cu.lib.cuMemAllocHost_v2(ctypes.byref(host), 4096),
            "register": cu.lib.cuMemHostRegister_v2(addr(src), 16, 0),
            "ipc_get": cu.lib.cuIpcGetMemHandle(ctypes.byref(handle), 4096),
            "ipc_open": cu.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, IPC_LAZY_ENABLE_PEER_ACCESS),
            "ipc_close": cu.lib.cuIpcCloseMemHandle(4096),
            "host_fn": cu.lib.cuLaunchHostFunc(None, HOST_FN(lambda _user: None), None),
        }

    results = run_in_thread(without_context)
    assert results == dict.fromkeys(results, INVALID_CONTEXT)

    def on_device_1() -> tuple[int, int, Optional[int]]:
        cu.ok(cu.lib.cuCtxSetCurrent(cu.contexts[1]))
        ptr = cu.alloc(4096)
        ordinal = cu.attributes(ptr)[ATTR_DEVICE_ORDINAL]
        cu.free(ptr)
        cu.ok(cu.lib.cuCtxSetCurrent(None))
        return ordinal, cu.try_alloc(4096), cu.current()

    # The thread's context decides the device; this thread's is untouched.
    assert run_in_thread(on_device_1) == (1, INVALID_CONTEXT, None)
    assert cu.current() == cu.contexts[0]
    ptr = cu.alloc(4096)
    assert cu.attributes(ptr)[ATTR_DEVICE_ORDINAL] == 0
    cu.free(ptr)
    assert cu.lib.cuCtxSetCurrent(0x1234) == INVALID_CONTEXT


# ---------------------------------------------------------------------------
# Device memory
# ---------------------------------------------------------------------------


def test_alloc_free_and_the_live_count(cu: Cu) -> None:
    before = cu.live()
    ptrs = [cu.alloc(size) for size in (1, PAGE, 3 * PAGE + 5)]
    assert len(set(ptrs)) == 3 and cu.live() == before + 3
    base, size = _ull(), _sz()
    cu.ok(cu.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptrs[2] + 2 * PAGE))
    assert (base.value, size.value) == (ptrs[2], 3 * PAGE + 5)
    cu.ok(cu.lib.cuMemGetAddressRange_v2(None, ctypes.byref(size), ptrs[0]))
    assert size.value == 1
    assert cu.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptrs[0] + 1) == NOT_FOUND
    assert cu.lib.cuMemFree_v2(ptrs[2] + 1) == INVALID_VALUE  # not the base
    assert cu.try_alloc(0) == INVALID_VALUE
    assert cu.lib.cuMemAlloc_v2(None, 16) == INVALID_VALUE
    for ptr in ptrs:
        cu.free(ptr)
    assert cu.live() == before
    assert cu.lib.cuMemFree_v2(ptrs[0]) == INVALID_VALUE  # twice
    assert cu.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptrs[1]) == NOT_FOUND


def test_each_device_has_its_capacity(cu: Cu) -> None:
    assert cu.try_alloc(64 * MiB + 1) == OUT_OF_MEMORY
    with cu.device_memory(40 * MiB):
        assert cu.try_alloc(40 * MiB) == OUT_OF_MEMORY
        with cu.on_context(cu.contexts[1]), cu.device_memory(40 * MiB):
            pass
    with cu.device_memory(40 * MiB):
        pass


def test_host_code_that_reads_device_memory_faults(standin_path: str) -> None:
    with child(_child_touch, standin_path, "device") as proc:
        assert proc.receive() == "touching"
        assert proc.wait() == -signal.SIGSEGV
    # The same read of pinned host memory is fine.
    with child(_child_touch, standin_path, "pinned") as proc:
        assert proc.receive() == "touching"
        assert proc.receive() == ("survived", b"\x7f")
        assert proc.wait() == 0


def test_synchronous_copies_and_memset(cu: Cu) -> None:
    size = 3 * PAGE + 5
    data = random.Random(1).randbytes(size)
    with cu.device_memory(size, size) as (a, b):
        before = cu.copied()
        cu.htod(a, data)
        cu.ok(cu.lib.cuMemcpyDtoD_v2(b, a, size))
        assert cu.dtoh(b, size) == data
        cu.ok(cu.lib.cuMemcpyDtoD_v2(b + 100, a + 7, 1000))
        assert cu.dtoh(b + 100, 1000) == data[7:1007]
        cu.ok(cu.lib.cuMemsetD8_v2(b + 10, 0xEE, 20))
        got = cu.dtoh(b, size)
        assert got[:10] == data[:10] and got[10:30] == b"\xee" * 20 and got[30:100] == data[30:100]
        # Overlapping ranges of one allocation move like memmove.
        cu.ok(cu.lib.cuMemcpyDtoD_v2(a + 1, a, 100))
        assert cu.dtoh(a, 101) == data[:1] + data[:100]
        assert cu.copied() - before == size * 3 + 1000 + 1000 + size + 100 + 101


def test_asynchronous_copies(cu: Cu) -> None:
    size = 2 * PAGE + 9
    data = random.Random(2).randbytes(size)
    src = buffer(data)
    out = (ctypes.c_char * size)()
    with cu.device_memory(size, size) as (a, b), cu.stream() as stream:
        cu.ok(cu.lib.cuMemcpyHtoDAsync_v2(a, addr(src), size, stream))
        cu.ok(cu.lib.cuMemcpyDtoDAsync_v2(b, a, size, stream))
        cu.ok(cu.lib.cuMemcpyDtoHAsync_v2(addr(out), b, size, stream))
        cu.ok(cu.lib.cuStreamSynchronize(stream))
        assert out.raw == data
        assert cu.lib.cuStreamQuery(stream) == SUCCESS
        # On the NULL stream they have run when the call returns.
        ctypes.memset(out, 0, size)
        cu.ok(cu.lib.cuMemsetD8_v2(a, 0x42, size))
        cu.ok(cu.lib.cuMemcpyDtoHAsync_v2(addr(out), a, size, None))
        assert out.raw == b"\x42" * size
        assert cu.lib.cuMemcpyHtoDAsync_v2(a, addr(src), size, 0x1234) == INVALID_HANDLE


def _rows(src: Any, dst: Any, width: int, height: int, src_pitch: int, dst_pitch: int) -> Memcpy2D:
    """A CUDA_MEMCPY2D between (kind, address) pairs: ("host", addr) or ("device", ptr)."""
    p = Memcpy2D()
    for end, (kind, at) in (("src", src), ("dst", dst)):
        setattr(p, f"{end}MemoryType", MEMORYTYPE_DEVICE if kind == "device" else MEMORYTYPE_HOST)
        setattr(p, f"{end}Device" if kind == "device" else f"{end}Host", at)
    p.srcPitch, p.dstPitch, p.WidthInBytes, p.Height = src_pitch, dst_pitch, width, height
    return p


def test_2d_copies_move_strided_rows_in_order_and_check_every_row_first(cu: Cu) -> None:
    # 9 rows of 100 bytes, 300 apart in host memory, gathered 128 apart in
    # device memory, then scattered 256 apart in another allocation and read
    # back 256 apart into host memory; each row where the pitches put it.
    width, height = 100, 9
    data = random.Random(3).randbytes(300 * height)
    src = buffer(data)
    out = (ctypes.c_char * (256 * height))()
    before = int(cu.lib.standin_cuda_copies_2d())
    with cu.device_memory(128 * height, 256 * height) as (a, b), cu.stream() as stream:
        cu.ok(cu.lib.cuMemsetD8_v2(b, 0x55, 256 * height))
        cu.ok(cu.lib.cuMemcpy2DAsync_v2(ctypes.byref(_rows(("host", addr(src)), ("device", a), width, height, 300, 128)),
                                        stream))
        cu.ok(cu.lib.cuMemcpy2DAsync_v2(ctypes.byref(_rows(("device", a), ("device", b), width, height, 128, 256)),
                                        stream))
        cu.ok(cu.lib.cuMemcpy2DAsync_v2(ctypes.byref(_rows(("device", b), ("host", addr(out)), 256, height, 256, 256)),
                                        stream))
        cu.ok(cu.lib.cuStreamSynchronize(stream))
        for row in range(height):
            got = out.raw[row * 256:(row + 1) * 256]
            assert got[:width] == data[row * 300:row * 300 + width], row
            assert got[width:] == b"\x55" * (256 - width), f"row {row}: bytes past the width were written"
        assert int(cu.lib.standin_cuda_copies_2d()) == before + 3
        # A pitch shorter than a row, host memory at both ends, and a last
        # row past its allocation are refused; the refused copy writes no row.
        ctypes.memset(out, 0, len(out))
        short = _rows(("device", b), ("host", addr(out)), width, height, width - 1, 256)
        assert cu.lib.cuMemcpy2DAsync_v2(ctypes.byref(short), stream) == INVALID_VALUE
        both_host = _rows(("host", addr(src)), ("host", addr(out)), width, height, 300, 256)
        assert cu.lib.cuMemcpy2DAsync_v2(ctypes.byref(both_host), stream) == NOT_SUPPORTED
        past = _rows(("device", b), ("host", addr(out)), width, height + 1, 256, 256)
        assert cu.lib.cuMemcpy2DAsync_v2(ctypes.byref(past), stream) == INVALID_VALUE
        cu.ok(cu.lib.cuStreamSynchronize(stream))
        assert out.raw == b"\0" * len(out), "a refused 2D copy wrote a row"
        assert int(cu.lib.standin_cuda_copies_2d()) == before + 3


def test_async_copies_touch_host_memory_when_they_run(cu: Cu) -> None:
    size = 4096
    staging = buffer(b"A" * size)
    landing = (ctypes.c_char * size)()
    gate = Gate()
    with cu.device_memory(size) as (dev,), cu.stream() as stream:
        try:
            cu.ok(cu.lib.cuLaunchHostFunc(stream, gate.fn, None))
            cu.ok(cu.lib.cuMemcpyHtoDAsync_v2(dev, addr(staging), size, stream))
            cu.ok(cu.lib.cuMemcpyDtoHAsync_v2(addr(landing), dev, size, stream))
            assert gate.entered.wait(5)
            # The staging buffer is reused before the copy ran: the copy sees the new bytes.
            ctypes.memmove(staging, b"B" * size, size)
            time.sleep(0.05)
            assert landing.raw == b"\0" * size, "a queued copy wrote host memory before its turn"
            assert cu.lib.cuStreamQuery(stream) == NOT_READY
        finally:
            gate.open()
        cu.ok(cu.lib.cuStreamSynchronize(stream))
    assert landing.raw == b"B" * size


def test_a_stream_runs_copies_host_functions_and_events_in_order(cu: Cu) -> None:
    rounds, size = 24, 8192
    payloads = [bytes([i]) * size for i in range(1, rounds + 1)]
    sources = [buffer(p) for p in payloads]
    landings = [(ctypes.c_char * size)() for _ in range(rounds)]
    seen: list[tuple[int, bool]] = []

    def checker(i: int) -> Any:
        # Runs after the copies queued before it: their bytes have landed.
        return HOST_FN(lambda _user: seen.append((i, landings[i].raw == payloads[i])))

    functions = [checker(i) for i in range(rounds)]
    threads: set[str] = set()

    def on_worker(_user: Any) -> None:
        threads.add(str(threading.get_native_id()))

    worker_fn = HOST_FN(on_worker)
    gate = Gate()
    with cu.device_memory(size) as (dev,), cu.stream() as stream, cu.event() as event:
        try:
            cu.ok(cu.lib.cuLaunchHostFunc(stream, gate.fn, None))
            for i in range(rounds):
                cu.ok(cu.lib.cuMemcpyHtoDAsync_v2(dev, addr(sources[i]), size, stream))
                cu.ok(cu.lib.cuMemcpyDtoHAsync_v2(addr(landings[i]), dev, size, stream))
                cu.ok(cu.lib.cuLaunchHostFunc(stream, functions[i], None))
                cu.ok(cu.lib.cuLaunchHostFunc(stream, worker_fn, None))
            cu.ok(cu.lib.cuEventRecord(event, stream))
            assert cu.lib.cuEventQuery(event) == NOT_READY
            assert cu.lib.cuStreamQuery(stream) == NOT_READY
            assert seen == []
        finally:
            gate.open()
        cu.ok(cu.lib.cuEventSynchronize(event))
        assert cu.lib.cuEventQuery(event) == SUCCESS
        assert seen == [(i, True) for i in range(rounds)]
        cu.ok(cu.lib.cuStreamSynchronize(stream))
    # Host functions run on the stream's own thread.
    assert len(threads) == 1 and threads != {str(threading.get_native_id())}


def test_events(cu: Cu) -> None:
    with cu.event() as never_recorded:
        assert cu.lib.cuEventQuery(never_recorded) == SUCCESS
        cu.ok(cu.lib.cuEventSynchronize(never_recorded))
    for flags in (0, EVENT_DISABLE_TIMING):
        with cu.event(flags):
            pass
    assert cu.lib.cuEventCreate(ctypes.byref(_vp()), EVENT_INTERPROCESS) == INVALID_VALUE
    assert cu.lib.cuEventCreate(None, 0) == INVALID_VALUE
    gate = Gate()
    with cu.stream() as stream, cu.event() as event:
        cu.ok(cu.lib.cuEventRecord(event, None))  # on the NULL stream: reached at once
        assert cu.lib.cuEventQuery(event) == SUCCESS
        try:
            cu.ok(cu.lib.cuLaunchHostFunc(stream, gate.fn, None))
            cu.ok(cu.lib.cuEventRecord(event, stream))
            time.sleep(0.05)
            assert cu.lib.cuEventQuery(event) == NOT_READY
        finally:
            gate.open()
        cu.ok(cu.lib.cuEventSynchronize(event))
        assert cu.lib.cuEventQuery(event) == SUCCESS
        assert cu.lib.cuEventRecord(event, 0x1234) == INVALID_HANDLE
        assert cu.lib.cuEventQuery(event) == SUCCESS  # a refused record changes nothing
        destroyed = event
    assert cu.lib.cuEventQuery(destroyed) == INVALID_HANDLE
    assert cu.lib.cuEventRecord(destroyed, None) == INVALID_HANDLE


def test_a_stream_waits_for_an_event_of_another(cu: Cu) -> None:
    log: list[str] = []
    gate = Gate(log, "A")
    after = HOST_FN(lambda _user: log.append("B"))
    size = 4096
    src = buffer(b"w" * size)
    with cu.device_memory(size) as (dev,), cu.stream() as a, cu.stream() as b, cu.event() as event:
        try:
            cu.ok(cu.lib.cuLaunchHostFunc(a, gate.fn, None))
            cu.ok(cu.lib.cuEventRecord(event, a))
            cu.ok(cu.lib.cuStreamWaitEvent(b, event, 0))
            cu.ok(cu.lib.cuMemcpyHtoDAsync_v2(dev, addr(src), size, b))
            cu.ok(cu.lib.cuLaunchHostFunc(b, after, None))
            assert cu.lib.cuStreamWaitEvent(b, event, 1) == INVALID_VALUE
            time.sleep(0.1)
            assert log == [] and cu.lib.cuStreamQuery(b) == NOT_READY
        finally:
            gate.open()
        cu.ok(cu.lib.cuStreamSynchronize(b))
        assert log == ["A", "B"]
        assert cu.dtoh(dev, size) == b"w" * size
        # Waiting for an event never recorded, or already reached, holds nothing up.
        with cu.event() as idle:
            cu.ok(cu.lib.cuStreamWaitEvent(b, idle, 0))
            cu.ok(cu.lib.cuStreamWaitEvent(b, event, 0))
            cu.ok(cu.lib.cuStreamSynchronize(b))


def test_the_null_stream_waits_for_blocking_streams_only(cu: Cu) -> None:
    size = 64
    src = buffer(b"n" * size)
    for flags, waits in ((STREAM_DEFAULT, True), (STREAM_NON_BLOCKING, False)):
        gate = Gate()
        with cu.device_memory(size) as (dev,), cu.stream(flags) as stream:
            # A copy that waits for the stream returns only once the gate is
            # open; one that does not returns with it still shut (it would
            # open by itself after 10 s).
            opener = threading.Timer(0.6, gate.open)
            try:
                cu.ok(cu.lib.cuLaunchHostFunc(stream, gate.fn, None))
                assert gate.entered.wait(60)
                if waits:
                    opener.start()
                cu.ok(cu.lib.cuMemcpyHtoD_v2(dev, addr(src), size))
                returned_after_open = gate.opened.is_set()
            finally:
                gate.open()
                opener.cancel()
                if opener.is_alive():
                    opener.join()
            assert returned_after_open == waits, flags
            cu.ok(cu.lib.cuStreamSynchronize(stream))


def test_destroying_a_stream_finishes_its_work_and_its_thread(cu: Cu) -> None:
    log: list[str] = []

    def take_time(_user: Any) -> None:
        time.sleep(0.1)
        log.append("ran")

    slow = HOST_FN(take_time)
    size = 4096
    src = buffer(b"d" * size)
    tasks = worker_tids()
    with cu.device_memory(size) as (dev,):
        handle = _vp()
        cu.ok(cu.lib.cuStreamCreate(ctypes.byref(handle), STREAM_NON_BLOCKING))
        assert len(worker_tids() - tasks) == 1
        cu.ok(cu.lib.cuLaunchHostFunc(handle, slow, None))
        cu.ok(cu.lib.cuMemcpyHtoDAsync_v2(dev, addr(src), size, handle))
        cu.ok(cu.lib.cuStreamDestroy_v2(handle))
        assert log == ["ran"]
        assert cu.dtoh(dev, size) == b"d" * size
    assert worker_tids() - tasks == set()
    assert cu.lib.cuStreamDestroy_v2(handle) == INVALID_HANDLE
    assert cu.lib.cuStreamSynchronize(handle) == INVALID_HANDLE
    assert cu.lib.cuStreamCreate(ctypes.byref(handle), 2) == INVALID_VALUE


def test_an_idle_stream_uses_no_cpu(cu: Cu) -> None:
    tasks = worker_tids()
    with cu.stream():
        (tid,) = worker_tids() - tasks
        time.sleep(0.3)
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
    assert ticks <= 2, f"an idle stream's thread used {ticks} clock ticks in 0.3 s"


def test_host_functions_may_not_call_the_driver(cu: Cu) -> None:
    results: list[int] = []

    def body(_user: Any) -> None:
        results.append(cu.lib.cuStreamQuery(None))
        results.append(cu.try_alloc(4096))
        results.append(cu.lib.cuCtxSetCurrent(None))

    fn = HOST_FN(body)
    with cu.stream() as stream:
        cu.ok(cu.lib.cuLaunchHostFunc(stream, fn, None))
        cu.ok(cu.lib.cuStreamSynchronize(stream))
    cu.ok(cu.lib.cuLaunchHostFunc(None, fn, None))
    assert results == [NOT_PERMITTED] * 6
    assert cu.current() == cu.contexts[0]
    assert cu.lib.cuLaunchHostFunc(None, HOST_FN(), None) == INVALID_VALUE  # a NULL function


def test_queued_work_on_freed_memory_is_an_illegal_address(standin_path: str) -> None:
    got = child_result(_child_illegal_address, standin_path)
    assert got["queued"] == SUCCESS and got["free"] == SUCCESS
    assert got["sync"] == ILLEGAL_ADDRESS and got["query"] == ILLEGAL_ADDRESS
    assert got["alloc_after"] == ILLEGAL_ADDRESS  # sticky: the context is lost
    assert got["alloc_fresh"] == SUCCESS
    assert got["copied"] == 0


def test_many_threads_at_once(cu: Cu) -> None:
    before = cu.live()
    errors: list[str] = []

    def worker(seed: int) -> None:
        try:
            cu.ok(cu.lib.cuCtxSetCurrent(cu.contexts[seed % 2]))
            rng = random.Random(seed)
            with cu.stream() as stream:
                for _ in range(15):
                    size = rng.randrange(1, 3 * PAGE)
                    data = rng.randbytes(size)
                    src, out = buffer(data), (ctypes.c_char * size)()
                    with cu.device_memory(size, size) as (a, b):
                        cu.ok(cu.lib.cuMemcpyHtoDAsync_v2(a, addr(src), size, stream))
                        cu.ok(cu.lib.cuMemcpyDtoDAsync_v2(b, a, size, stream))
                        cu.ok(cu.lib.cuMemcpyDtoHAsync_v2(addr(out), b, size, stream))
                        cu.ok(cu.lib.cuStreamSynchronize(stream))
                    assert out.raw == data
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert cu.live() == before


# ---------------------------------------------------------------------------
# Range checks
# ---------------------------------------------------------------------------


def test_device_ranges_are_checked(cu: Cu) -> None:
    size = 5000
    host = buffer(b"h" * 64)
    out = (ctypes.c_char * 64)()
    with cu.device_memory(size, size) as (dev, other), cu.stream() as stream:
        before = cu.copied()
        cu.ok(cu.lib.cuMemcpyHtoD_v2(dev + size - 1, addr(host), 1))  # the last byte
        refused = {
            "past the end": cu.lib.cuMemcpyHtoD_v2(dev + size - 10, addr(host), 20),
            "one too many": cu.lib.cuMemcpyHtoD_v2(dev, addr(host), size + 1),
            "at the end": cu.lib.cuMemcpyHtoD_v2(dev + size, addr(host), 1),
            "in the page padding": cu.lib.cuMemcpyHtoD_v2(dev + size + 8, addr(host), 1),
            "before the start": cu.lib.cuMemcpyHtoD_v2(dev - 1, addr(host), 2),
            "unknown": cu.lib.cuMemcpyHtoD_v2(addr(host), addr(host), 1),
            "null": cu.lib.cuMemcpyHtoD_v2(0, addr(host), 1),
            "host source in device memory": cu.lib.cuMemcpyHtoD_v2(dev, other, 16),
            "host source in device padding": cu.lib.cuMemcpyHtoD_v2(dev, other + size + 8, 16),
            "host source runs into device memory": cu.lib.cuMemcpyHtoD_v2(dev, other - 8, 16),
            "host destination in device memory": cu.lib.cuMemcpyDtoH_v2(other, dev, 16),
            "null host": cu.lib.cuMemcpyDtoH_v2(None, dev, 16),
            "d2h past the end": cu.lib.cuMemcpyDtoH_v2(addr(out), dev + size - 4, 8),
            "d2d source past the end": cu.lib.cuMemcpyDtoD_v2(other, dev + 1, size),
            "d2d destination past the end": cu.lib.cuMemcpyDtoD_v2(other + 1, dev, size),
            "memset past the end": cu.lib.cuMemsetD8_v2(dev, 0, size + 1),
            "memset unknown": cu.lib.cuMemsetD8_v2(addr(host), 0, 1),
            "async past the end": cu.lib.cuMemcpyHtoDAsync_v2(dev + 1, addr(host), size, stream),
            "async host in device memory": cu.lib.cuMemcpyDtoHAsync_v2(other, dev, 16, stream),
            "async d2d unknown": cu.lib.cuMemcpyDtoDAsync_v2(addr(host), dev, 16, stream),
        }
        assert refused == dict.fromkeys(refused, INVALID_VALUE)
        cu.ok(cu.lib.cuStreamSynchronize(stream))
        assert cu.copied() - before == 1
    assert cu.lib.cuMemcpyDtoH_v2(addr(out), dev, 1) == INVALID_VALUE  # freed


# ---------------------------------------------------------------------------
# Pointer attributes, pinned and registered host memory
# ---------------------------------------------------------------------------


def test_pointer_attributes(cu: Cu) -> None:
    unknown = (ctypes.c_char * 256)()
    assert cu.attributes(addr(unknown) + 8) == {
        ATTR_CONTEXT: 0,
        ATTR_MEMORY_TYPE: 0,
        ATTR_DEVICE_ORDINAL: -2,
        ATTR_IS_LEGACY_CUDA_IPC_CAPABLE: 0,
        ATTR_RANGE_START_ADDR: 0,
        ATTR_RANGE_SIZE: 0,
        ATTR_MAPPED: 0,
    }
    with cu.on_context(cu.contexts[1]), cu.device_memory(3 * PAGE + 1) as (dev,):
        assert cu.attributes(dev + PAGE) == {
            ATTR_CONTEXT: cu.contexts[1],
            ATTR_MEMORY_TYPE: MEMORYTYPE_DEVICE,
            ATTR_DEVICE_ORDINAL: 1,
            ATTR_IS_LEGACY_CUDA_IPC_CAPABLE: 1,
            ATTR_RANGE_START_ADDR: dev,
            ATTR_RANGE_SIZE: 3 * PAGE + 1,
            ATTR_MAPPED: 1,
        }
        assert cu.attributes(dev + 3 * PAGE + 1)[ATTR_MEMORY_TYPE] == 0  # just past it
    assert cu.attributes(dev)[ATTR_MEMORY_TYPE] == 0  # freed

    host = _vp()
    cu.ok(cu.lib.cuMemAllocHost_v2(ctypes.byref(host), 10000))
    pinned = host.value or 0
    try:
        assert cu.attributes(pinned + 9999) == {
            ATTR_CONTEXT: cu.contexts[0],
            ATTR_MEMORY_TYPE: MEMORYTYPE_HOST,
            ATTR_DEVICE_ORDINAL: 0,
            ATTR_IS_LEGACY_CUDA_IPC_CAPABLE: 0,
            ATTR_RANGE_START_ADDR: pinned,
            ATTR_RANGE_SIZE: 10000,
            ATTR_MAPPED: 1,
        }
        ctypes.memset(pinned, 1, 10000)  # ordinary host memory
    finally:
        cu.ok(cu.lib.cuMemFreeHost(pinned))
    assert cu.attributes(pinned)[ATTR_MEMORY_TYPE] == 0
    assert cu.lib.cuMemFreeHost(pinned) == INVALID_VALUE

    registered = (ctypes.c_char * 10000)()
    cu.ok(cu.lib.cuMemHostRegister_v2(addr(registered) + 100, 5000, 0))
    try:
        values = cu.attributes(addr(registered) + 200)
        assert values[ATTR_MEMORY_TYPE] == MEMORYTYPE_HOST
        assert (values[ATTR_RANGE_START_ADDR], values[ATTR_RANGE_SIZE]) == (addr(registered) + 100, 5000)
        assert cu.attributes(addr(registered) + 5100)[ATTR_MEMORY_TYPE] == 0
    finally:
        cu.ok(cu.lib.cuMemHostUnregister(addr(registered) + 100))

    kinds = (ctypes.c_int * 1)(6)  # CU_POINTER_ATTRIBUTE_P2P_TOKENS: not kept
    slot = (ctypes.c_char * 64)()
    data = (_vp * 1)(addr(slot))
    assert cu.lib.cuPointerGetAttributes(1, kinds, data, addr(unknown)) == INVALID_VALUE
    assert cu.lib.cuPointerGetAttributes(0, kinds, data, addr(unknown)) == INVALID_VALUE


def test_host_register_and_unregister(cu: Cu) -> None:
    memory = (ctypes.c_char * (4 * PAGE))()
    base = addr(memory)
    cu.ok(cu.lib.cuMemHostRegister_v2(base, 2 * PAGE, 0))
    try:
        assert cu.lib.cuMemHostRegister_v2(base, 2 * PAGE, 0) == HOST_MEMORY_ALREADY_REGISTERED
        assert cu.lib.cuMemHostRegister_v2(base + PAGE, 2 * PAGE, 0) == HOST_MEMORY_ALREADY_REGISTERED
        cu.ok(cu.lib.cuMemHostRegister_v2(base + 2 * PAGE, PAGE, 1))  # beside it: fine
        cu.ok(cu.lib.cuMemHostUnregister(base + 2 * PAGE))
        assert cu.lib.cuMemHostUnregister(base + 8) == HOST_MEMORY_NOT_REGISTERED
    finally:
        cu.ok(cu.lib.cuMemHostUnregister(base))
    assert cu.lib.cuMemHostUnregister(base) == HOST_MEMORY_NOT_REGISTERED
    assert cu.lib.cuMemHostRegister_v2(None, 16, 0) == INVALID_VALUE
    assert cu.lib.cuMemHostRegister_v2(base, 0, 0) == INVALID_VALUE
    assert cu.lib.cuMemHostRegister_v2(base, 16, 0x100) == INVALID_VALUE
    with cu.device_memory(PAGE) as (dev,):
        assert cu.lib.cuMemHostRegister_v2(dev, 16, 0) == INVALID_VALUE
    host = _vp()
    cu.ok(cu.lib.cuMemAllocHost_v2(ctypes.byref(host), PAGE))
    try:
        assert cu.lib.cuMemHostRegister_v2(host.value, 16, 0) == HOST_MEMORY_ALREADY_REGISTERED
    finally:
        cu.ok(cu.lib.cuMemFreeHost(host))
    # Memory that is no longer mapped cannot be registered.
    assert cu.lib.cuMemHostRegister_v2(host.value, 16, 0) == INVALID_VALUE
    # Pinned memory works with async copies like any host memory.
    cu.ok(cu.lib.cuMemAllocHost_v2(ctypes.byref(host), PAGE))
    try:
        ctypes.memset(host, 0x33, PAGE)
        with cu.device_memory(PAGE) as (dev,), cu.stream() as stream:
            cu.ok(cu.lib.cuMemcpyHtoDAsync_v2(dev, host, PAGE, stream))
            cu.ok(cu.lib.cuStreamSynchronize(stream))
            assert cu.dtoh(dev, PAGE) == b"\x33" * PAGE
    finally:
        cu.ok(cu.lib.cuMemFreeHost(host))


# ---------------------------------------------------------------------------
# IPC
# ---------------------------------------------------------------------------


def memfd_descriptors() -> dict[int, str]:
    """This process's descriptors that are stand-in device memory."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("/memfd:standin-cuda-"):
                out[int(name)] = target
    return out


@contextlib.contextmanager
def descriptor_as(fd: int, source: int) -> Iterator[None]:
    """Makes descriptor number ``fd`` name what ``source`` names, for a while."""
    if source == fd:  # the lowest free number went to it already
        yield
        return
    os.dup2(source, fd)
    try:
        yield
    finally:
        os.close(fd)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_virtual_memory_management(cu: Cu) -> None:
    """cuMemCreate memory: granularity, reservations, mappings side by side,
    access, what the pointer queries say, retain and release."""
    G = GRANULARITY
    lib = cu.lib
    size = _sz()
    prop = AllocationProp(ALLOCATION_PINNED, HANDLE_POSIX_FD, MemLocation(LOCATION_DEVICE, 1))
    cu.ok(lib.cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(prop), 0))
    assert size.value == G
    assert lib.cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(AllocationProp()), 0) == INVALID_VALUE
    handle = _ull()
    assert lib.cuMemCreate(ctypes.byref(handle), G + PAGE, ctypes.byref(prop), 0) == INVALID_VALUE
    assert lib.cuMemCreate(ctypes.byref(handle), G, ctypes.byref(prop), 1) == INVALID_VALUE
    win32 = AllocationProp(ALLOCATION_PINNED, HANDLE_WIN32, MemLocation(LOCATION_DEVICE, 0))
    assert lib.cuMemCreate(ctypes.byref(handle), G, ctypes.byref(win32), 0) == NOT_SUPPORTED
    assert lib.cuMemCreate(ctypes.byref(handle), 64 * MiB + G, ctypes.byref(prop), 0) == OUT_OF_MEMORY

    vmm_before, live_before = cu.live_vmm(), cu.live()
    first, second = cu.vmm_create(), cu.vmm_create(types=HANDLE_NONE)
    assert cu.live_vmm() == vmm_before + 2
    base = cu.vmm_reserve(3 * G)
    assert base % G == 0
    assert lib.cuMemMap(base + PAGE, G, 0, first, 0) == INVALID_VALUE  # not aligned
    assert lib.cuMemMap(base, G, PAGE, first, 0) == INVALID_VALUE  # the offset must be 0
    assert lib.cuMemMap(base, 2 * G, 0, first, 0) == INVALID_VALUE  # past the allocation
    assert lib.cuMemMap(base + 2 * G, 2 * G, 0, first, 0) == INVALID_VALUE  # past the reservation
    assert lib.cuMemMap(base, G, 0, 12345, 0) == INVALID_HANDLE
    cu.ok(lib.cuMemMap(base, G, 0, first, 0))
    cu.ok(lib.cuMemMap(base + G, G, 0, second, 0))
    assert lib.cuMemMap(base + G, G, 0, first, 0) == INVALID_VALUE  # already mapped
    # The mappings hold the memory once the handles are released.
    cu.ok(lib.cuMemRelease(first))
    cu.ok(lib.cuMemRelease(second))
    assert lib.cuMemRelease(second) == INVALID_VALUE
    assert cu.live_vmm() == vmm_before + 2 and cu.live() == live_before + 2

    # No access until cuMemSetAccess; then one range across both mappings.
    data = random.Random(3).randbytes(G)
    src = buffer(data)
    assert lib.cuMemcpyHtoD_v2(base + G // 2, addr(src), G) == INVALID_VALUE
    assert cu.vmm_access(base, 3 * G) == INVALID_VALUE  # the third piece is not mapped
    assert cu.vmm_access(base, 2 * G, device=5) == INVALID_DEVICE
    cu.ok(cu.vmm_access(base, 2 * G))
    cu.htod(base + G // 2, data)
    assert cu.dtoh(base + G // 2, G) == data
    assert lib.cuMemcpyDtoH_v2(addr((ctypes.c_char * G)()), base + G + G // 2, G) == INVALID_VALUE  # past the end

    # The range reported is every piece mapped side by side (as NVIDIA's
    # driver reports torch's expandable segments), each piece with a buffer
    # id of its own; legacy IPC refuses them.
    values = cu.attributes(base + G + 5)
    assert values[ATTR_MEMORY_TYPE] == MEMORYTYPE_DEVICE and values[ATTR_DEVICE_ORDINAL] == 0
    assert (values[ATTR_RANGE_START_ADDR], values[ATTR_RANGE_SIZE]) == (base, 2 * G)
    assert cu.buffer_id(base + G + 5) not in (0, cu.buffer_id(base + 5))
    assert values[ATTR_IS_LEGACY_CUDA_IPC_CAPABLE] == 0 and values[ATTR_MAPPED] == 1
    start, length = _ull(), _sz()
    cu.ok(lib.cuMemGetAddressRange_v2(ctypes.byref(start), ctypes.byref(length), base + G + 7))
    assert (start.value, length.value) == (base, 2 * G)
    assert cu.attributes(base + 2 * G)[ATTR_MEMORY_TYPE] == 0  # reserved, not mapped
    assert lib.cuIpcGetMemHandle(ctypes.byref(IpcHandle()), base) == INVALID_VALUE

    # Retain gives the handle mapped at any address of a mapping.
    retained = _ull()
    cu.ok(lib.cuMemRetainAllocationHandle(ctypes.byref(retained), ctypes.c_void_p(base + G + 100)))
    assert retained.value == second
    assert lib.cuMemRetainAllocationHandle(ctypes.byref(_ull()), ctypes.c_void_p(base + 2 * G)) == INVALID_VALUE
    # Exported only as a type it was made with.
    assert cu.vmm_export(retained.value)[0] == INVALID_VALUE
    cu.ok(lib.cuMemRelease(retained.value))
    cu.ok(lib.cuMemRetainAllocationHandle(ctypes.byref(retained), ctypes.c_void_p(base)))
    r, fd = cu.vmm_export(retained.value)
    cu.ok(lib.cuMemRelease(retained.value))
    assert r == SUCCESS and fd >= 0
    # Imported (here too), mapped elsewhere: the same bytes.
    r, imported = cu.vmm_import(fd)
    os.close(fd)
    assert r == SUCCESS and cu.live_vmm() == vmm_before + 3
    assert cu.vmm_import(0)[0] == INVALID_HANDLE  # not an exported allocation
    other = cu.vmm_reserve(G)
    cu.ok(lib.cuMemMap(other, G, 0, imported, 0))
    cu.ok(lib.cuMemRelease(imported))
    cu.ok(cu.vmm_access(other, G))
    assert cu.dtoh(other + G // 2, G // 2) == data[: G // 2]
    cu.htod(other, b"written through the import")
    assert cu.dtoh(base, 26) == b"written through the import"

    # Unmapping: whole mappings only; a reservation is freed once unmapped.
    assert lib.cuMemUnmap(base, G // 2) == INVALID_VALUE
    assert lib.cuMemAddressFree(base, 3 * G) == INVALID_VALUE
    cu.ok(lib.cuMemUnmap(other, G))
    cu.ok(lib.cuMemAddressFree(other, G))
    assert cu.live_vmm() == vmm_before + 2
    cu.ok(lib.cuMemUnmap(base, 2 * G))
    assert lib.cuMemAddressFree(base, 2 * G) == INVALID_VALUE  # not the reserved size
    cu.ok(lib.cuMemAddressFree(base, 3 * G))
    assert cu.live_vmm() == vmm_before and cu.live() == live_before


def _vmm_peer(conn: multiprocessing.connection.Connection, path: str, pid: int, fd: int) -> None:
    """Takes descriptor `fd` out of process `pid`, imports and maps it, sends
    what it reads there, writes its own bytes, and lets go of it all."""
    _child_env({ENV_DEVICES: None, ENV_MEMORY: None})
    try:
        cu = Cu(load(path))
        cu.ok(cu.lib.cuInit(0))
        cu.ok(cu.lib.cuCtxSetCurrent(cu.retain(0)))
        libc = ctypes.CDLL(None, use_errno=True)
        pidfd = os.pidfd_open(pid)
        taken = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
        os.close(pidfd)
        assert taken >= 0, os.strerror(ctypes.get_errno())
        r, handle = cu.vmm_import(taken)
        os.close(taken)
        assert r == SUCCESS, name_of(r)
        ptr = cu.vmm_reserve(GRANULARITY)
        cu.ok(cu.lib.cuMemMap(ptr, GRANULARITY, 0, handle, 0))
        cu.ok(cu.vmm_access(ptr, GRANULARITY))
        seen = cu.dtoh(ptr, 4096)
        cu.htod(ptr + 4096, b"from the child")
        cu.ok(cu.lib.cuMemUnmap(ptr, GRANULARITY))
        cu.ok(cu.lib.cuMemAddressFree(ptr, GRANULARITY))
        cu.ok(cu.lib.cuMemRelease(handle))
        conn.send({"seen": seen, "live": cu.live_vmm()})
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def test_an_exported_descriptor_maps_the_same_memory_in_another_process(cu: Cu, standin_path: str) -> None:
    handle = cu.vmm_create()
    base = cu.vmm_reserve(GRANULARITY)
    cu.ok(cu.lib.cuMemMap(base, GRANULARITY, 0, handle, 0))
    cu.ok(cu.vmm_access(base, GRANULARITY))
    data = random.Random(4).randbytes(4096)
    cu.htod(base, data)
    r, fd = cu.vmm_export(handle)
    assert r == SUCCESS
    try:
        result = child_result(_vmm_peer, standin_path, os.getpid(), fd)
    finally:
        os.close(fd)
    assert result["seen"] == data and result["live"] == 0
    assert cu.dtoh(base + 4096, 14) == b"from the child"
    cu.ok(cu.lib.cuMemUnmap(base, GRANULARITY))
    cu.ok(cu.lib.cuMemAddressFree(base, GRANULARITY))
    cu.ok(cu.lib.cuMemRelease(handle))


def test_ipc_in_the_exporting_process_is_refused(cu: Cu) -> None:
    with cu.device_memory(PAGE) as (dev,):
        raw = cu.ipc_handle(dev)
        ptr = _ull()
        handle = IpcHandle.from_buffer_copy(raw)
        assert cu.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, IPC_LAZY_ENABLE_PEER_ACCESS) == INVALID_CONTEXT
        assert cu.lib.cuIpcGetMemHandle(ctypes.byref(IpcHandle()), dev + 1) == INVALID_VALUE
        assert cu.lib.cuIpcGetMemHandle(None, dev) == INVALID_VALUE
        assert cu.ipc_handle(dev) == raw  # the same handle every time
    assert cu.lib.cuIpcGetMemHandle(ctypes.byref(IpcHandle()), dev) == INVALID_VALUE  # freed
    assert cu.lib.cuIpcCloseMemHandle(dev) == INVALID_VALUE


def test_ipc_between_two_processes(cu: Cu, standin_path: str) -> None:
    size = 2 * PAGE + 100
    first, second, third = (random.Random(seed).randbytes(size) for seed in (10, 11, 12))
    known = memfd_descriptors()
    live_before = cu.live()
    with child(_peer_main, standin_path) as peer:
        status, _pid = peer.receive()
        assert status == "ok", _pid
        with cu.device_memory(size) as (dev,):
            (fd,) = set(memfd_descriptors()) - set(known)
            cu.htod(dev, first)
            raw = cu.ipc_handle(dev)

            # The child opens it: the same memory, as device memory of its own.
            r, theirs = peer.call("open", raw)
            assert r == SUCCESS
            assert peer.call("open", raw) == (SUCCESS, theirs)  # the same mapping
            assert peer.call("live") == 1
            r, data = peer.call("read", theirs, size)
            assert r == SUCCESS and digest(data) == digest(first)
            attributes = peer.call("attributes", theirs + PAGE)
            assert attributes[ATTR_MEMORY_TYPE] == MEMORYTYPE_DEVICE
            assert (attributes[ATTR_RANGE_START_ADDR], attributes[ATTR_RANGE_SIZE]) == (theirs, size)
            assert peer.call("range", theirs + 5) == (SUCCESS, theirs, size)
            assert peer.call("write", theirs + size - 4, b"12345678") == INVALID_VALUE
            assert peer.call("write", theirs, second) == SUCCESS
            assert digest(cu.dtoh(dev, size)) == digest(second)
            cu.htod(dev, third)
            r, data = peer.call("read", theirs, size)
            assert digest(data) == digest(third)

            # Two opens, two closes.
            assert peer.call("close", theirs) == SUCCESS and peer.call("live") == 1
            assert peer.call("close", theirs) == SUCCESS and peer.call("live") == 0
            assert peer.call("close", theirs) == INVALID_VALUE
            assert peer.call("read", theirs, 1)[0] == INVALID_VALUE

            # Bad handles and flags.
            garbage = random.Random(3).randbytes(64)
            assert peer.call("open", garbage) == (INVALID_HANDLE, 0)
            assert peer.call("open", bytes(64))[0] == INVALID_HANDLE
            for position in (0, 5, 12, 20, 31, 47, 63):
                flipped = bytearray(raw)
                flipped[position] ^= 0x10
                assert peer.call("open", bytes(flipped))[0] == INVALID_HANDLE, position
            assert peer.call("open", raw, 0)[0] == INVALID_VALUE
            assert peer.call("open", raw, 2)[0] == INVALID_VALUE

            # The other way: the parent opens what the child exported.
            theirs_own = peer.call("alloc", PAGE)
            assert peer.call("write", theirs_own, b"c" * PAGE) == SUCCESS
            child_raw = peer.call("handle", theirs_own)
            ptr = _ull()
            cu.ok(cu.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), IpcHandle.from_buffer_copy(child_raw), 1))
            assert cu.live() == live_before + 2
            assert cu.dtoh(ptr.value, PAGE) == b"c" * PAGE
            cu.htod(ptr.value, b"p" * PAGE)
            assert cu.lib.cuMemFree_v2(ptr.value) == INVALID_VALUE  # closed, not freed
            cu.ok(cu.lib.cuIpcCloseMemHandle(ptr.value))
            assert peer.call("read", theirs_own, PAGE) == (SUCCESS, b"p" * PAGE)

        # The exporter freed it: its descriptor is closed...
        assert peer.call("open", raw)[0] == MAP_FAILED
        # ...or now names another file, or another allocation of the same size.
        with tempfile.TemporaryFile() as other, descriptor_as(fd, other.fileno()):
            assert peer.call("open", raw)[0] == INVALID_HANDLE
        with cu.device_memory(size) as (replacement,):
            (replacement_fd,) = set(memfd_descriptors()) - set(known)
            with descriptor_as(fd, replacement_fd):
                assert peer.call("open", raw)[0] == INVALID_HANDLE
        assert peer.call("live") == 1  # its own allocation; no mapping opened

        # An exporter that is gone.
        peer.call("exit")
        assert peer.wait() == 0
    assert cu.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), IpcHandle.from_buffer_copy(child_raw), 1) == MAP_FAILED


# ---------------------------------------------------------------------------
# cuGetProcAddress and error strings
# ---------------------------------------------------------------------------


def test_get_proc_address(cu: Cu) -> None:
    def lookup(name: bytes, version: int = 12000, flags: int = 0) -> tuple[int, Optional[int], int]:
        pfn = _vp()
        status = _i(-1)
        r = cu.lib.cuGetProcAddress_v2(name, ctypes.byref(pfn), version, flags, ctypes.byref(status))
        return r, pfn.value, status.value

    def address(symbol: str) -> int:
        return ctypes.cast(getattr(cu.lib, symbol), _vp).value or 0

    for base in SIGNATURES:
        plain = base.removesuffix("_v2").encode()
        assert lookup(plain) == (SUCCESS, address(base), GET_PROC_ADDRESS_SUCCESS), plain
        assert lookup(base.encode())[1] == address(base)
    assert lookup(b"cuMemAlloc", 12000, 2)[1] == address("cuMemAlloc_v2")
    assert lookup(b"cuLaunchKernel") == (NOT_FOUND, None, GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
    assert lookup(b"standin_cuda_live_allocations")[0] == NOT_FOUND
    assert lookup(b"cuInit", 12000, 8)[0] == INVALID_VALUE
    assert cu.lib.cuGetProcAddress_v2(b"cuInit", ctypes.byref(_vp()), 12000, 0, None) == SUCCESS
    # What it gives can be called.
    found = lookup(b"cuDriverGetVersion")[1]
    assert found is not None
    get_version = ctypes.CFUNCTYPE(ctypes.c_int, _P(_i))(found)
    version = _i()
    assert get_version(ctypes.byref(version)) == SUCCESS and version.value >= 12000


def test_error_strings(cu: Cu) -> None:
    for code, name in ERROR_NAMES.items():
        text = ctypes.c_char_p()
        cu.ok(cu.lib.cuGetErrorName(code, ctypes.byref(text)))
        assert text.value == name.encode()
        text = ctypes.c_char_p()
        cu.ok(cu.lib.cuGetErrorString(code, ctypes.byref(text)))
        assert text.value
    for code in (9999, -1):
        text = ctypes.c_char_p(b"left alone?")
        assert cu.lib.cuGetErrorName(code, ctypes.byref(text)) == INVALID_VALUE and text.value is None
        text = ctypes.c_char_p(b"left alone?")
        assert cu.lib.cuGetErrorString(code, ctypes.byref(text)) == INVALID_VALUE and text.value is None
    assert cu.lib.cuGetErrorName(0, None) == INVALID_VALUE

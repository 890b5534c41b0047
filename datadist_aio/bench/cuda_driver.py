"""The CUDA driver API through ctypes: the device benchmark's and the tests'
one way to reach device memory without torch.

``load(path)`` opens a driver library (NVIDIA's libcuda.so.1, or the test
stand-in of tests/cuda_standin) with the argument and result types of every
entry point in ``SIGNATURES``; ``CudaDriver`` holds one device's primary
context and fills, reads, allocates and frees device memory through it, as
a framework's tensors would.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional

import numpy as np

DRIVER_ENV = "DATADIST_AIO_CUDA_DRIVER"  # the library the engine loads, where set


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", ctypes.c_ubyte * 8)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D: ``Height`` rows of ``WidthInBytes`` bytes, a pitch apart at each end."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_ulonglong), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_ulonglong),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t),
                ("Height", ctypes.c_size_t)]


HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_u = ctypes.c_uint
_i = ctypes.c_int
_ull = ctypes.c_ulonglong
_sz = ctypes.c_size_t
_vp = ctypes.c_void_p
_P = ctypes.POINTER

# Every entry point used here or by the tests, with its argument types (each
# returns a CUresult).
SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [_u],
    "cuDriverGetVersion": [_P(_i)],
    "cuDeviceGetCount": [_P(_i)],
    "cuDeviceGet": [_P(_i), _i],
    "cuDevicePrimaryCtxRetain": [_P(_vp), _i],
    "cuDevicePrimaryCtxRelease_v2": [_i],
    "cuCtxSetCurrent": [_vp],
    "cuCtxGetCurrent": [_P(_vp)],
    "cuGetErrorString": [_i, _P(ctypes.c_char_p)],
    "cuGetErrorName": [_i, _P(ctypes.c_char_p)],
    "cuPointerGetAttributes": [_u, _P(_i), _P(_vp), _ull],
    "cuMemGetAddressRange_v2": [_P(_ull), _P(_sz), _ull],
    "cuMemAlloc_v2": [_P(_ull), _sz],
    "cuMemFree_v2": [_ull],
    "cuMemAllocHost_v2": [_P(_vp), _sz],
    "cuMemFreeHost": [_vp],
    "cuMemHostRegister_v2": [_vp, _sz, _u],
    "cuMemHostUnregister": [_vp],
    "cuMemsetD8_v2": [_ull, ctypes.c_ubyte, _sz],
    "cuMemcpyHtoD_v2": [_ull, _vp, _sz],
    "cuMemcpyDtoH_v2": [_vp, _ull, _sz],
    "cuMemcpyDtoD_v2": [_ull, _ull, _sz],
    "cuMemcpyHtoDAsync_v2": [_ull, _vp, _sz, _vp],
    "cuMemcpyDtoHAsync_v2": [_vp, _ull, _sz, _vp],
    "cuMemcpyDtoDAsync_v2": [_ull, _ull, _sz, _vp],
    "cuMemcpy2DAsync_v2": [_P(Memcpy2D), _vp],
    "cuStreamCreate": [_P(_vp), _u],
    "cuStreamDestroy_v2": [_vp],
    "cuStreamSynchronize": [_vp],
    "cuStreamQuery": [_vp],
    "cuStreamWaitEvent": [_vp, _vp, _u],
    "cuLaunchHostFunc": [_vp, HOST_FN, _vp],
    "cuEventCreate": [_P(_vp), _u],
    "cuEventRecord": [_vp, _vp],
    "cuEventQuery": [_vp],
    "cuEventSynchronize": [_vp],
    "cuEventDestroy_v2": [_vp],
    "cuIpcGetMemHandle": [_P(IpcHandle), _ull],
    "cuIpcOpenMemHandle_v2": [_P(_ull), IpcHandle, _u],
    "cuIpcCloseMemHandle": [_ull],
    "cuGetProcAddress_v2": [ctypes.c_char_p, _P(_vp), _i, ctypes.c_uint64, _P(_i)],
    "cuMemGetAllocationGranularity": [_P(_sz), _P(AllocationProp), _i],
    "cuMemCreate": [_P(_ull), _sz, _P(AllocationProp), _ull],
    "cuMemRelease": [_ull],
    "cuMemAddressReserve": [_P(_ull), _sz, _sz, _ull, _ull],
    "cuMemAddressFree": [_ull, _sz],
    "cuMemMap": [_ull, _sz, _sz, _ull, _ull],
    "cuMemUnmap": [_ull, _sz],
    "cuMemSetAccess": [_ull, _sz, _P(AccessDesc), _sz],
    "cuMemRetainAllocationHandle": [_P(_ull), _vp],
    "cuMemExportToShareableHandle": [_vp, _ull, _i, _ull],
    "cuMemImportFromShareableHandle": [_P(_ull), _vp, _i],
}
# The stand-in's own counters, with their result types.
HOOKS: dict[str, Any] = {
    "standin_cuda_live_allocations": ctypes.c_int,
    "standin_cuda_bytes_copied": ctypes.c_ulonglong,
    "standin_cuda_copies_2d": ctypes.c_ulonglong,
    "standin_cuda_live_vmm_allocations": ctypes.c_int,
}


def load(path: str, complete: bool = False) -> ctypes.CDLL:
    """The driver library at ``path`` with the types of every entry point of
    ``SIGNATURES`` and ``HOOKS`` it has; with ``complete`` (the stand-in's
    tests), every one of ``SIGNATURES`` must be there.

    Raises:
        OSError: If the library cannot be loaded.
        AttributeError: With ``complete``, if an entry point is missing.
    """
    lib = ctypes.CDLL(path)
    for name, argtypes in SIGNATURES.items():
        if not complete and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    for name, restype in HOOKS.items():
        if complete or hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes = []
            fn.restype = restype
    return lib


class CudaError(RuntimeError):
    """A driver call that did not return CUDA_SUCCESS."""


class CudaDriver:
    """A driver library (``path``, else $DATADIST_AIO_CUDA_DRIVER, else
    libcuda.so.1), initialised, with ``device``'s primary context current on
    the calling thread. The engine loads the same library (so the same
    primary context) where ``path`` is its $DATADIST_AIO_CUDA_DRIVER.

    Raises:
        OSError: If the library cannot be loaded.
        CudaError: If the driver or the device fails to initialise.
    """

    GRANULARITY = 2 << 20  # the stand-in's, for vmm_alloc

    def __init__(self, device: int = 0, path: Optional[str] = None) -> None:
        self.path = path or os.environ.get(DRIVER_ENV) or "libcuda.so.1"
        self.lib = load(self.path)
        self.check(self.lib.cuInit(0), "cuInit")
        self.standin = hasattr(self.lib, "standin_cuda_live_allocations")
        self.contexts: dict[int, ctypes.c_void_p] = {}
        self.handles: dict[int, int] = {}  # CUdevice of each device used
        self.device = device
        self.use(device)

    @staticmethod
    def check(result: int, what: str) -> None:
        if result != 0:
            raise CudaError(f"{what} failed: CUresult {result}")

    def use(self, device: int) -> None:
        """Makes ``device``'s primary context current on this thread (and
        ``device`` the one ``current`` names)."""
        if device not in self.contexts:
            handle = ctypes.c_int()
            self.check(self.lib.cuDeviceGet(ctypes.byref(handle), device), f"cuDeviceGet({device})")
            context = ctypes.c_void_p()
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
            self.contexts[device], self.handles[device] = context, handle.value
        self.check(self.lib.cuCtxSetCurrent(self.contexts[device]), "cuCtxSetCurrent")
        self.device = device

    def current(self) -> None:
        """Makes the last used device's primary context current on this thread."""
        self.use(self.device)

    def sync(self) -> None:
        """Waits for the context's work (the stand-in, which has no
        cuCtxSynchronize, copies from pageable memory at once)."""
        if hasattr(self.lib, "cuCtxSynchronize"):
            self.check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")

    def alloc(self, size: int) -> int:
        ptr = ctypes.c_ulonglong()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), size), "cuMemAlloc")
        return ptr.value

    def free(self, ptr: int) -> None:
        self.check(self.lib.cuMemFree_v2(ptr), "cuMemFree")

    def write(self, ptr: int, data: np.ndarray) -> None:
        """Copies ``data`` to device memory at ``ptr``, landed on return
        (NVIDIA's driver may return before a copy from pageable memory has)."""
        data = np.ascontiguousarray(data)
        self.check(self.lib.cuMemcpyHtoD_v2(ptr, data.ctypes.data, data.nbytes), "cuMemcpyHtoD")
        self.sync()

    def read_into(self, ptr: int, out: np.ndarray) -> None:
        """Copies ``out.nbytes`` bytes of device memory at ``ptr`` into ``out`` (contiguous)."""
        self.check(self.lib.cuMemcpyDtoH_v2(out.ctypes.data, ptr, out.nbytes), "cuMemcpyDtoH")

    def read(self, ptr: int, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes of device memory at ``ptr``."""
        out = np.empty(nbytes, np.uint8)
        self.read_into(ptr, out)
        return out

    # Memory of the driver's virtual memory management, as torch's expandable
    # segments make it: one reserved range backed by physical allocations
    # (cuMemCreate) mapped side by side.

    def vmm_alloc(self, pieces: int, posix_fd: bool = True, device: int = 0) -> int:
        """A range of ``pieces`` physical allocations of GRANULARITY bytes,
        each made with the POSIX-fd handle type when ``posix_fd``, mapped in
        order and read-write on ``device``; its base."""
        size = pieces * self.GRANULARITY
        base = ctypes.c_ulonglong()
        self.check(self.lib.cuMemAddressReserve(ctypes.byref(base), size, 0, 0, 0), "cuMemAddressReserve")
        prop = AllocationProp(type=1, requestedHandleTypes=1 if posix_fd else 0, location=MemLocation(1, device))
        for i in range(pieces):
            handle = ctypes.c_ulonglong()
            self.check(self.lib.cuMemCreate(ctypes.byref(handle), self.GRANULARITY, ctypes.byref(prop), 0),
                       "cuMemCreate")
            self.check(self.lib.cuMemMap(base.value + i * self.GRANULARITY, self.GRANULARITY, 0, handle, 0),
                       "cuMemMap")
            # The mapping holds the memory from here.
            self.check(self.lib.cuMemRelease(handle), "cuMemRelease")
        access = AccessDesc(MemLocation(1, device), 3)
        self.check(self.lib.cuMemSetAccess(base.value, size, ctypes.byref(access), 1), "cuMemSetAccess")
        return base.value

    def vmm_free(self, base: int, pieces: int) -> None:
        size = pieces * self.GRANULARITY
        self.check(self.lib.cuMemUnmap(base, size), "cuMemUnmap")
        self.check(self.lib.cuMemAddressFree(base, size), "cuMemAddressFree")

    # The stand-in's counters.

    def live(self) -> int:
        """Device allocations and IPC mappings alive in this process."""
        return int(self.lib.standin_cuda_live_allocations())

    def copies_2d(self) -> int:
        """2D copies (strided rows, cuMemcpy2DAsync) queued in this process."""
        return int(self.lib.standin_cuda_copies_2d())

    def live_vmm(self) -> int:
        """Physical allocations of cuMemCreate or imported, alive in this process."""
        return int(self.lib.standin_cuda_live_vmm_allocations())

    def describe(self) -> dict[str, Any]:
        """Which driver this is: library, stand-in or not, version, device name."""
        version = ctypes.c_int()
        self.check(self.lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        name = "stand-in device"
        if hasattr(self.lib, "cuDeviceGetName"):
            buf = ctypes.create_string_buffer(256)
            if self.lib.cuDeviceGetName(buf, 256, self.handles[self.device]) == 0:
                name = buf.value.decode(errors="replace")
        return {"library": self.path, "standin": self.standin, "version": version.value, "device": name,
                "what": "the CUDA driver stand-in (tests/cuda_standin): host memory, no GPU" if self.standin
                else "NVIDIA's CUDA driver"}

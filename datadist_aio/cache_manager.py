"""CacheManager: registration, allocation and movement of KV caches."""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import numpy as np

from ._checks import (
    UINT32_MAX,
    UINT64_MAX,
    check_dict,
    check_int64,
    check_isinstance,
    check_layer_range,
    check_list_uint64,
    check_uint32,
    check_uint64,
    raise_if_false,
    raise_if_true,
)
from .cache import Cache
from .cache_desc import CacheDesc
from .cache_key import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from .cache_task import CacheTask
from .completions import CompletionDispatcher
from .enums import Placement
from .layer_synchronizer import LayerSynchronizer
from ._remote import INVALID_ID, TENSORS_PER_LAYER, remote_name
from .layerwise import BlockPlan, LayerwiseTransfer
from .status import LLMException, LLMStatusCode, raise_for_status
from .transfer_config import TransferConfig, TransferWithCacheKeyConfig

__all__ = ["CacheManager"]

_Buffer = Union["np.ndarray[Any, Any]", memoryview, bytearray]
# One entry per tensor: a raw address or a writable C-contiguous buffer
# (numpy arrays, memoryviews, bytearrays; other buffer objects work too).
# Spelled as a union of list types so that a list[np.ndarray] passes.
Addresses = Union[
    list[int], list["np.ndarray[Any, Any]"], list[memoryview], list[bytearray], list[Union[int, _Buffer]]
]


_DRIVER_JOIN_S = 5.0  # how long finalize waits for the layer-wise drivers' own threads, in all
_DLPACK_CUDA = 2  # DLDeviceType kDLCUDA
_DLPACK_HOST = (1, 3)  # kDLCPU, kDLCUDAHost (pinned)


def _device_address(name: str, entry: Any, cache_desc: CacheDesc) -> int:
    """The device address of one tensor given for a DEVICE cache: an int, or
    an object with ``__cuda_array_interface__`` (torch, CuPy, Numba) or
    DLPack (``__dlpack_device__``), C-contiguous and one tensor long. The
    engine then asks the driver whether it is device memory of this engine's
    device and large enough."""
    if isinstance(entry, int) and not isinstance(entry, bool):
        check_uint64(name, entry)
        raise_if_true(entry == 0, f"{name} is 0")
        return entry
    host = LLMException(f"{name} is host memory ({type(entry).__name__}); a DEVICE cache takes device "
                        "addresses or CUDA tensors: use Placement.HOST for host memory",
                        status_code=LLMStatusCode.LLM_PARAM_INVALID)
    interface = getattr(entry, "__cuda_array_interface__", None)
    dlpack_device = getattr(entry, "__dlpack_device__", None)
    if interface is None and dlpack_device is not None:
        kind = int(dlpack_device()[0])
        if kind != _DLPACK_CUDA:
            if kind in _DLPACK_HOST:
                raise host
            raise LLMException(f"{name} is DLPack memory of device type {kind}, not CUDA device memory",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        interface = _dlpack_interface(name, entry)
    if interface is None:
        if isinstance(entry, (np.ndarray, memoryview, bytearray)):
            raise host
        raise TypeError(f"{name} must be an int device address or a CUDA tensor (__cuda_array_interface__ or "
                        f"DLPack), got {type(entry).__name__}")
    shape = tuple(int(n) for n in interface["shape"])
    itemsize = np.dtype(interface["typestr"]).itemsize
    nbytes = itemsize * int(np.prod(shape, dtype=np.int64))
    strides = interface.get("strides")
    if strides is not None:
        expected: list[int] = []
        step = itemsize
        for n in reversed(shape):
            expected.insert(0, step)
            step *= n
        raise_if_false(all(n <= 1 or s == e for n, s, e in zip(shape, strides, expected)),
                       f"{name} is not C-contiguous (strides {tuple(strides)})")
    raise_if_false(nbytes == cache_desc.size,
                   f"{name} holds {nbytes} bytes but one tensor of the cache is {cache_desc.size} bytes")
    address = int(interface["data"][0])
    raise_if_true(address == 0, f"{name} has no memory (address 0)")
    return address


def _dlpack_interface(name: str, entry: Any) -> dict[str, Any]:
    """A ``__cuda_array_interface__``-like dict of a DLPack CUDA object, read
    through torch or CuPy when one is installed (DLPack capsules have no
    Python reader of their own)."""
    for module in ("torch", "cupy"):
        try:
            lib = __import__(module)
        except ImportError:
            continue
        try:
            array = lib.from_dlpack(entry)
        except Exception:  # noqa: BLE001 - not a type this library reads
            continue
        interface = getattr(array, "__cuda_array_interface__", None)
        if interface is not None:
            return dict(interface)
    raise TypeError(f"{name} is a DLPack CUDA object, but neither torch nor CuPy could read it; pass its "
                    "device address as an int")


def _check_addr_count(addrs: Sequence[Any], cache_desc: CacheDesc) -> None:
    count, tensors = len(addrs), cache_desc.num_tensors
    raise_if_false(
        count == tensors,
        f"too {'few' if count < tensors else 'many'} entries in addrs: {count} given, "
        f"cache_desc.num_tensors is {tensors} (one address or array per tensor)",
    )


def _check_array(name: str, array: np.ndarray[Any, Any], cache_desc: CacheDesc) -> None:
    """A numpy array registered as a tensor has the description's dtype and shape."""
    expected = cache_desc.data_type.numpy_dtype
    raise_if_false(
        array.dtype == expected,
        f"{name} has dtype {array.dtype}, but cache_desc.data_type {cache_desc.data_type.name} "
        f"needs {expected}",
    )
    raise_if_false(
        list(array.shape) == list(cache_desc.shape),
        f"{name} has shape {tuple(array.shape)}, but cache_desc.shape is {tuple(cache_desc.shape)}",
    )


def _key_tuple(key: CacheKey) -> tuple[int, int, int]:
    return (key.req_id, key.model_id, key.prefix_id)


def _check_pull_key(key: CacheKey) -> None:
    valid = [0 <= ident < INVALID_ID for ident in (key.req_id, key.prefix_id)]
    raise_if_false(valid.count(True) == 1, f"{key!r} must have exactly one of req_id and prefix_id set")


def _check_tensor_num_per_layer(value: Any) -> None:
    check_uint32("tensor_num_per_layer", value)
    raise_if_false(value > 0, f"tensor_num_per_layer must be > 0, got {value}")


def _range_rows(ranges: Any) -> np.ndarray:
    """``ranges`` as the engine takes them: C-contiguous uint64, shape (n, 5) or (n, 8)."""
    given = isinstance(ranges, np.ndarray)
    if given and ranges.dtype.kind not in "iu":
        raise TypeError(f"ranges must hold integers, got dtype {ranges.dtype}")
    rows = ranges if given else np.array(ranges, dtype=object)
    raise_if_false(rows.ndim == 2 and rows.shape[1] in (5, 8) and rows.shape[0] > 0,
                   f"ranges must be n > 0 rows of five or eight ints, got shape {rows.shape}")
    if not given:
        for value in rows.flat:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"ranges must hold ints, got {type(value).__name__}")
    if int(rows.min()) < 0 or int(rows.max()) > UINT64_MAX:
        raise ValueError("every value of ranges must be in [0, 2**64 - 1]")
    return np.ascontiguousarray(rows, dtype=np.uint64)


def _layer_span(
    src_range: Optional[range], dst_range: Optional[range], per_layer: int, local: Cache, local_is_src: bool
) -> tuple[int, int, int, int]:
    """(local_first, remote_first, count, per_layer) for the engine.

    A missing range takes the other one; with neither, every layer of the
    local cache moves, and a pull moves every tensor, whether or not their
    count is a multiple of ``per_layer`` (as upstream: an MLA cache holds one
    tensor per layer, often an odd number of them).
    """
    check_layer_range("src_layer_range", src_range)
    check_layer_range("dst_layer_range", dst_range)
    if src_range is None and dst_range is None and not local_is_src:
        return (0, 0, local.cache_desc.num_tensors, 1)
    if src_range is None and dst_range is None:
        src_range = dst_range = range(local.cache_desc.num_tensors // per_layer)
    src = src_range if src_range is not None else dst_range
    dst = dst_range if dst_range is not None else src_range
    assert src is not None and dst is not None
    raise_if_false(len(src) == len(dst), f"src and dst layer ranges differ in length: {len(src)} != {len(dst)}")
    local_range, remote_range = (src, dst) if local_is_src else (dst, src)
    return (local_range.start, remote_range.start, len(src), per_layer)


def _default_span(cache: Cache, per_layer: Any) -> Optional[tuple[int, int, int, int]]:
    """``_layer_span`` of a push of every layer, or None when ``per_layer``
    is not a plain int in (0, 2**32) (the full checks then say why)."""
    if type(per_layer) is not int or not 0 < per_layer <= UINT32_MAX:
        return None
    return (0, 0, cache._cache_desc.num_tensors // per_layer, per_layer)


def _view(cache: Cache) -> tuple[int, int, list[int], int, int, list[int]]:
    desc = cache.cache_desc
    return (
        cache.cache_id,
        desc.num_tensors,
        list(desc.shape),
        desc.data_type.value,
        desc.placement.value,
        list(cache.tensor_addrs),
    )


def _wait(task: CacheTask) -> None:
    """Waits for ``task``; raises ``LLMException`` with its first failure."""
    task.synchronize()
    task.result()


class CacheManager:
    """Caches of one ``LLMDataDist``; obtained from ``LLMDataDist.cache_manager``.

    Every data-moving method ``X`` blocks until the data has moved and raises
    ``LLMException`` on failure; ``X_async`` checks its arguments the same
    way, starts the work and returns a ``CacheTask`` at once.
    """

    def __init__(self, engine: Any, dispatcher: CompletionDispatcher, *, remote_cache_accessible: bool) -> None:
        self._engine: Any = engine  # None once finalized
        self._dispatcher = dispatcher
        self._remote_cache_accessible = remote_cache_accessible
        self._valid = True
        # Buffers of registered caches stay alive (and exported) while registered.
        self._buffers: dict[int, list[memoryview]] = {}
        # Running layer-wise transfers; each leaves the set when it finishes.
        self._transfers: set[LayerwiseTransfer] = set()
        # The threads of the drivers started without a running loop, until joined.
        self._driver_threads: list[threading.Thread] = []
        # Allocated caches, invalidated with the engine (weakly held).
        self._allocated: weakref.WeakSet[Cache] = weakref.WeakSet()

    def _check_valid(self) -> None:
        raise_if_false(self._valid, "the cache manager is finalized", status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)

    def _abandon_transfers(self) -> None:
        """Lets every layer-wise transfer's request complete (before finalize),
        and waits (a bounded while) for the drivers' own threads to end: their
        loops are closed once finalize returns."""
        for transfer in list(self._transfers):
            transfer.abandon(LLMStatusCode.LLM_ENGINE_FINALIZED)
        deadline = time.monotonic() + _DRIVER_JOIN_S
        for thread in self._driver_threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        self._driver_threads = [thread for thread in self._driver_threads if thread.is_alive()]

    def _invalidate(self) -> None:
        self._valid = False
        # Every use of the engine checks _valid first; letting go of it lets
        # the finalized engine close its descriptors while this object lives on.
        self._engine = None
        self._buffers.clear()
        # Caches of a finalized engine hold no addresses; views made before
        # keep their memory.
        for cache in list(self._allocated):
            cache._invalidate()
        self._allocated.clear()

    # -- allocation ---------------------------------------------------------

    def _allocate(
        self, cache_desc: CacheDesc, keys: Sequence[CacheKey], blocks_key: Optional[BlocksCacheKey], is_blocks: bool
    ) -> Cache:
        self._check_valid()
        raise_if_false(cache_desc.num_tensors > 0, "cache_desc.num_tensors must be > 0")
        raise_if_false(
            cache_desc.placement is Placement.DEVICE or self._engine.has_host_pool,
            "allocating a HOST cache needs a host memory pool: set LLMConfig.host_mem_pool_cfg",
        )
        status, cache_id, addrs = self._engine.allocate_cache(
            cache_desc.num_tensors,
            list(cache_desc.shape),
            cache_desc.data_type.value,
            cache_desc.placement.value,
            is_blocks,
            [_key_tuple(k) for k in keys],
            None if blocks_key is None else blocks_key.model_id,
        )
        raise_for_status(status, f"allocate {cache_desc!r}")
        cache = Cache(cache_id, cache_desc, list(addrs), is_blocks, memory=self._engine.pin_memory(cache_id))
        self._allocated.add(cache)
        return cache

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Union[tuple[CacheKey, ...], list[CacheKey]] = ()) -> Cache:
        """Allocates a contiguous cache from the host pool; ``cache_keys[i]`` names batch slot i."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("cache_keys", cache_keys, (list, tuple), CacheKey, allow_none=False)
        return self._allocate(cache_desc, cache_keys, None, False)

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: Optional[BlocksCacheKey] = None) -> Cache:
        """Allocates a blocks (paged) cache from the host pool."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        cache_desc._is_blocks = True
        return self._allocate(cache_desc, (), blocks_cache_key, True)

    def _deallocate(self, cache: Cache, blocks: bool) -> None:
        check_isinstance("cache", cache, Cache, allow_none=False)
        kind = "a blocks" if blocks else "a contiguous"
        raise_if_false(cache.is_blocks_cache == blocks, f"cache {cache.cache_id} is not {kind} cache")
        self._check_valid()
        if cache.cache_id > 0:
            raise_for_status(self._engine.deallocate_cache(cache.cache_id), f"deallocate cache {cache.cache_id}")
        cache._invalidate()
        self._allocated.discard(cache)

    def deallocate_cache(self, cache: Cache) -> None:
        """Frees an allocated contiguous cache once no bound key refers to it."""
        self._deallocate(cache, False)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Frees an allocated blocks cache and unbinds its blocks key."""
        self._deallocate(cache, True)

    # -- registration -------------------------------------------------------

    def _addresses(self, cache_desc: CacheDesc, addrs: Addresses) -> tuple[list[int], list[memoryview]]:
        from . import _native

        out: list[int] = []
        buffers: list[memoryview] = []
        entry: Any  # a buffer of any kind, checked at run time
        for index, entry in enumerate(addrs):
            addr = entry
            if isinstance(addr, int) and not isinstance(addr, bool):
                check_uint64(f"addrs[{index}]", addr)
                raise_if_true(addr == 0, f"addrs[{index}] is 0")
                out.append(addr)
                continue
            try:
                view = memoryview(entry)
            except TypeError:
                raise TypeError(
                    f"addrs[{index}] must be an int address or a writable buffer, got {type(addr).__name__}"
                ) from None
            address, nbytes = _native.buffer_address(view)
            if isinstance(addr, np.ndarray):
                _check_array(f"addrs[{index}]", addr, cache_desc)
            raise_if_false(
                nbytes == cache_desc.size,
                f"addrs[{index}] holds {nbytes} bytes but one tensor of the cache is {cache_desc.size} bytes",
            )
            out.append(address)
            buffers.append(view)
        return out, buffers

    def _register(
        self,
        cache_desc: CacheDesc,
        addrs: Addresses,
        keys: Sequence[CacheKey],
        blocks_key: Optional[BlocksCacheKey],
        remote_accessible: Optional[bool],
        is_blocks: bool,
    ) -> Cache:
        self._check_valid()
        raise_if_false(len(addrs) > 0, "addrs must not be empty")
        if cache_desc.placement is Placement.DEVICE:
            _check_addr_count(addrs, cache_desc)
            raw = [_device_address(f"addrs[{i}]", a, cache_desc) for i, a in enumerate(addrs)]
            buffers: list[memoryview] = []
        else:
            raw, buffers = self._addresses(cache_desc, addrs)
        if remote_accessible is None:
            remote_accessible = True
        status, cache_id = self._engine.register_cache(
            cache_desc.num_tensors,
            list(cache_desc.shape),
            cache_desc.data_type.value,
            cache_desc.placement.value,
            is_blocks,
            raw,
            [_key_tuple(k) for k in keys],
            None if blocks_key is None else blocks_key.model_id,
            remote_accessible,
        )
        raise_for_status(status, f"register {cache_desc!r}")
        if buffers:
            self._buffers[cache_id] = buffers
        return Cache(cache_id, cache_desc, raw, is_blocks, buffers=buffers or None)

    @staticmethod
    def _check_register_args(cache_desc: Any, addrs: Any, remote_accessible: Any) -> None:
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("addrs", addrs, list, allow_none=False)
        check_isinstance("remote_accessible", remote_accessible, bool)

    def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Addresses,
        cache_keys: Union[tuple[CacheKey, ...], list[CacheKey]] = (),
        remote_accessible: Optional[bool] = None,
    ) -> Cache:
        """Registers user memory as a contiguous cache.

        ``addrs`` holds one entry per tensor: a raw address, or a writable
        C-contiguous buffer (a numpy array, ...) of exactly one tensor's size,
        which stays referenced while the cache is registered.
        """
        self._check_register_args(cache_desc, addrs, remote_accessible)
        check_isinstance("cache_keys", cache_keys, (list, tuple), CacheKey, allow_none=False)
        _check_addr_count(addrs, cache_desc)
        return self._register(cache_desc, addrs, cache_keys, None, remote_accessible, False)

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Addresses,
        blocks_cache_key: Optional[BlocksCacheKey] = None,
        remote_accessible: Optional[bool] = None,
    ) -> Cache:
        """Registers user memory as a blocks (paged) cache; ``addrs`` as in ``register_cache``."""
        self._check_register_args(cache_desc, addrs, remote_accessible)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        _check_addr_count(addrs, cache_desc)
        cache_desc._is_blocks = True
        return self._register(cache_desc, addrs, (), blocks_cache_key, remote_accessible, True)

    def unregister_cache(self, cache_id: int) -> None:
        """Forgets a registered cache; an unknown id is not an error.

        Returns once no peer's operation can touch the cache's memory: one
        the engine was serving from it or into it is waited for, and one
        that has not ended within 2 s has its link cut (docs/security.md).
        """
        check_int64("cache_id", cache_id)
        self._check_valid()
        raise_for_status(self._engine.unregister_cache(cache_id), f"unregister cache {cache_id}")
        self._buffers.pop(cache_id, None)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbinds a key from its allocated cache; unknown keys are ignored."""
        check_isinstance("cache_key", cache_key, CacheKey, allow_none=False)
        self._check_valid()
        raise_for_status(self._engine.remove_cache_key(*_key_tuple(cache_key)), f"remove {cache_key!r}")

    # -- local data movement --------------------------------------------------

    def _task(self, started: tuple[int, Any], operation: Callable[[], str]) -> CacheTask:
        """The task of a started request; ``operation`` names it, formatted only when needed."""
        status, request = started
        if status != 0:
            raise_for_status(status, operation())
        return CacheTask(request, self._dispatcher, operation)

    def copy_cache_async(
        self,
        dst: Cache,
        src: Cache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: Optional[int] = None,
    ) -> CacheTask:
        """Starts copying bytes ``[offset, offset + size)`` of a batch slot, every tensor."""
        check_isinstance("dst", dst, Cache, allow_none=False)
        check_isinstance("src", src, Cache, allow_none=False)
        check_uint32("dst_batch_index", dst_batch_index)
        check_uint32("src_batch_index", src_batch_index)
        check_uint64("offset", offset)
        check_int64("size", size)
        if req_id is not None:
            check_uint64("req_id", req_id)
        raise_if_true(dst.is_blocks_cache or src.is_blocks_cache, "copy_cache does not take blocks caches")
        raise_if_false(size == -1 or size > 0, f"size must be -1 or > 0, got {size}")
        self._check_valid()
        started = self._engine.copy_cache(dst.cache_id, src.cache_id, dst_batch_index, src_batch_index, offset, size)
        return self._task(started, lambda: f"copy_cache({src.cache_id}[{src_batch_index}] -> {dst.cache_id}[{dst_batch_index}])")

    def copy_cache(
        self,
        dst: Cache,
        src: Cache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: Optional[int] = None,
    ) -> None:
        """``copy_cache_async``, waited for; raises ``LLMException`` on failure."""
        _wait(self.copy_cache_async(dst, src, dst_batch_index, src_batch_index, offset, size, req_id))

    def copy_blocks_async(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> CacheTask:
        """Starts copying, inside one blocks cache, each source block to its listed destinations."""
        check_isinstance("cache", cache, Cache, allow_none=False)
        check_dict("copy_block_info", copy_block_info, int, list, int)
        raise_if_false(cache.is_blocks_cache, "copy_blocks needs a blocks cache")
        pairs = []
        for src_block, dst_blocks in copy_block_info.items():
            check_uint64("copy_block_info key", src_block)
            for dst_block in dst_blocks:
                check_uint64("copy_block_info value", dst_block)
                pairs.append((src_block, dst_block))
        self._check_valid()
        view = _view(cache)
        return self._task(self._engine.copy_blocks(view, view, pairs), lambda: f"copy_blocks(cache {cache.cache_id})")

    def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> None:
        """``copy_blocks_async``, waited for; raises ``LLMException`` on failure."""
        _wait(self.copy_blocks_async(cache, copy_block_info))

    def swap_blocks_async(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> CacheTask:
        """Starts copying block ``k`` of ``src_cache`` to block ``src_to_dst[k]`` of ``dst_cache``.

        Either cache may be in host or in CUDA device memory (the driver
        copies where one is).
        """
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        check_isinstance("dst_cache", dst_cache, Cache, allow_none=False)
        check_dict("src_to_dst", src_to_dst, int, int)
        raise_if_false(src_cache.is_blocks_cache and dst_cache.is_blocks_cache, "swap_blocks needs two blocks caches")
        src_desc, dst_desc = src_cache.cache_desc, dst_cache.cache_desc
        raise_if_false(
            src_desc.slot_size == dst_desc.slot_size,
            f"block sizes differ: {src_desc.slot_size} != {dst_desc.slot_size}",
        )
        raise_if_false(
            src_desc.num_tensors == dst_desc.num_tensors,
            f"the caches have different tensor counts: {src_desc.num_tensors} != {dst_desc.num_tensors}",
        )
        for src_block, dst_block in src_to_dst.items():
            raise_if_false(
                0 <= src_block < src_desc.shape[0],
                f"source block {src_block} is out of range: src_cache has {src_desc.shape[0]} blocks",
            )
            raise_if_false(
                0 <= dst_block < dst_desc.shape[0],
                f"destination block {dst_block} is out of range: dst_cache has {dst_desc.shape[0]} blocks",
            )
        self._check_valid()
        started = self._engine.copy_blocks(_view(dst_cache), _view(src_cache), list(src_to_dst.items()))
        return self._task(started, lambda: f"swap_blocks({src_cache.cache_id} -> {dst_cache.cache_id})")

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> None:
        """``swap_blocks_async``, waited for; raises ``LLMException`` on failure."""
        _wait(self.swap_blocks_async(src_cache, dst_cache, src_to_dst))

    # -- transfers with a linked peer --------------------------------------------

    def _check_rca(self, operation: str) -> None:
        raise_if_false(
            self._remote_cache_accessible,
            f"{operation} needs remote-cache-accessible mode: set LLMConfig.enable_remote_cache_accessible = True",
        )

    def push_cache_async(
        self,
        dst_cache_key: CacheKeyByIdAndIndex,
        src_cache: Cache,
        src_batch_index: int = 0,
        src_layer_range: Optional[range] = None,
        dst_layer_range: Optional[range] = None,
        size: int = -1,
        tensor_num_per_layer: int = TENSORS_PER_LAYER,
    ) -> CacheTask:
        """Starts pushing batch slot ``src_batch_index`` of every selected layer
        into slot ``dst_cache_key.batch_index`` of the peer's cache ``dst_cache_key.cache_id``."""
        self._check_rca("push_cache")
        check_isinstance("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex, allow_none=False)
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        check_uint32("src_batch_index", src_batch_index)
        raise_if_true(src_cache.is_blocks_cache, "push_cache needs a contiguous source cache; use push_blocks")
        _check_tensor_num_per_layer(tensor_num_per_layer)
        span = _layer_span(src_layer_range, dst_layer_range, tensor_num_per_layer, src_cache, True)
        check_int64("size", size)
        raise_if_false(size == -1, f"push_cache moves whole slots: size must be -1, got {size}")
        self._check_valid()
        started = self._engine.push_cache(
            src_cache.cache_id,
            src_batch_index,
            dst_cache_key.cluster_id,
            dst_cache_key.cache_id,
            dst_cache_key.batch_index,
            span,
        )
        return self._task(started, lambda: f"push_cache(cache {src_cache.cache_id} -> {dst_cache_key!r})")

    def push_cache(
        self,
        dst_cache_key: CacheKeyByIdAndIndex,
        src_cache: Cache,
        src_batch_index: int = 0,
        src_layer_range: Optional[range] = None,
        dst_layer_range: Optional[range] = None,
        size: int = -1,
        tensor_num_per_layer: int = TENSORS_PER_LAYER,
    ) -> None:
        """``push_cache_async``, waited for; raises ``LLMException`` on failure."""
        task = self.push_cache_async(
            dst_cache_key, src_cache, src_batch_index, src_layer_range, dst_layer_range, size, tensor_num_per_layer
        )
        _wait(task)

    def push_blocks_async(
        self,
        dst_cache_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: Optional[Union[tuple[int, ...], list[int]]] = (),
        dst_blocks: Union[tuple[int, ...], list[int]] = (),
        src_layer_range: Optional[range] = None,
        dst_layer_range: Optional[range] = None,
        tensor_num_per_layer: int = TENSORS_PER_LAYER,
    ) -> CacheTask:
        """Starts pushing block ``src_blocks[k]`` to block ``dst_blocks[k]`` of the
        peer's blocks cache, for every selected layer, as one operation."""
        # The usual call goes straight to the engine, which takes the block
        # lists only when every element is an int in uint64 range; any other
        # call, or lists it did not take, go through every check below.
        if (
            type(dst_cache_key) is BlocksCacheKey
            and type(src_cache) is Cache
            and src_cache._is_blocks_cache
            and src_layer_range is None
            and dst_layer_range is None
            and self._valid
            and self._remote_cache_accessible
        ):
            span = _default_span(src_cache, tensor_num_per_layer)
            if span is not None:
                started = self._engine.push_blocks(
                    src_cache._cache_id, dst_cache_key._cluster_id, dst_cache_key._model_id, src_blocks, dst_blocks,
                    span,
                )
                if started is not None:
                    return self._task(started, lambda: f"push_blocks(cache {src_cache.cache_id} -> {dst_cache_key!r})")
        self._check_rca("push_blocks")
        check_isinstance("dst_cache_key", dst_cache_key, BlocksCacheKey, allow_none=False)
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        check_isinstance("src_blocks", src_blocks, (list, tuple), int)
        check_isinstance("dst_blocks", dst_blocks, (list, tuple), int, allow_none=False)
        raise_if_false(src_cache.is_blocks_cache, "push_blocks needs a blocks source cache")
        raise_if_false(len(dst_blocks) > 0, "dst_blocks must not be empty")
        src_blocks = list(src_blocks or ())
        check_list_uint64("src_blocks", src_blocks)
        check_list_uint64("dst_blocks", dst_blocks)
        _check_tensor_num_per_layer(tensor_num_per_layer)
        span = _layer_span(src_layer_range, dst_layer_range, tensor_num_per_layer, src_cache, True)
        self._check_valid()
        started = self._engine.push_blocks(
            src_cache.cache_id, dst_cache_key.cluster_id, dst_cache_key.model_id, src_blocks, list(dst_blocks), span
        )
        return self._task(started, lambda: f"push_blocks(cache {src_cache.cache_id} -> {dst_cache_key!r})")

    def push_blocks(
        self,
        dst_cache_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: Optional[Union[tuple[int, ...], list[int]]] = (),
        dst_blocks: Union[tuple[int, ...], list[int]] = (),
        src_layer_range: Optional[range] = None,
        dst_layer_range: Optional[range] = None,
        tensor_num_per_layer: int = TENSORS_PER_LAYER,
    ) -> None:
        """``push_blocks_async``, waited for; raises ``LLMException`` on failure."""
        task = self.push_blocks_async(
            dst_cache_key, src_cache, src_blocks, dst_blocks, src_layer_range, dst_layer_range, tensor_num_per_layer
        )
        _wait(task)

    @staticmethod
    def _pull_span(cache: Cache, kwargs: dict[str, Any]) -> tuple[int, int, int, int]:
        per_layer = kwargs.get("tensor_num_per_layer", TENSORS_PER_LAYER)
        _check_tensor_num_per_layer(per_layer)
        return _layer_span(kwargs.get("src_layer_range"), kwargs.get("dst_layer_range"), per_layer, cache, False)

    def pull_cache_async(
        self,
        cache_key: Union[CacheKey, CacheKeyByIdAndIndex],
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        **kwargs: Any,
    ) -> CacheTask:
        """Starts pulling the peer's batch slot named by ``cache_key`` into slot
        ``batch_index`` of ``cache`` (the first ``size`` bytes of each tensor's
        slot, or all of it with -1). Keywords: ``src_layer_range``,
        ``dst_layer_range``, ``tensor_num_per_layer``."""
        key_kinds = (CacheKeyByIdAndIndex,) if self._remote_cache_accessible else (CacheKey, CacheKeyByIdAndIndex)
        check_isinstance("cache_key", cache_key, key_kinds, allow_none=False)
        check_isinstance("cache", cache, Cache, allow_none=False)
        check_uint32("batch_index", batch_index)
        check_int64("size", size)
        raise_if_true(cache.is_blocks_cache, "pull_cache needs a contiguous destination; use pull_blocks")
        raise_if_false(size == -1 or size > 0, f"size must be -1 or > 0, got {size}")
        if isinstance(cache_key, CacheKey):
            _check_pull_key(cache_key)
        span = self._pull_span(cache, kwargs)
        self._check_valid()
        started = self._engine.pull_cache(
            cache.cache_id, batch_index, cache_key.cluster_id, remote_name(cache_key), size, span
        )
        return self._task(started, lambda: f"pull_cache({cache_key!r} -> cache {cache.cache_id})")

    def pull_cache(
        self,
        cache_key: Union[CacheKey, CacheKeyByIdAndIndex],
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        **kwargs: Any,
    ) -> None:
        """``pull_cache_async``, waited for; raises ``LLMException`` on failure."""
        _wait(self.pull_cache_async(cache_key, cache, batch_index, size, **kwargs))

    def pull_blocks_async(
        self,
        src_cache_key: Union[CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey],
        dst_cache: Cache,
        src_blocks: Union[tuple[int, ...], list[int]] = (),
        dst_blocks: Union[tuple[int, ...], list[int]] = (),
        **kwargs: Any,
    ) -> CacheTask:
        """Starts pulling into blocks ``dst_blocks`` of ``dst_cache``: the peer's
        blocks ``src_blocks`` (a ``BlocksCacheKey``), or the peer's batch slot
        cut into blocks (a ``CacheKey`` / ``CacheKeyByIdAndIndex``, no
        ``src_blocks``). Keywords as ``pull_cache``."""
        # As push_blocks_async: the usual call with a BlocksCacheKey (no
        # keyword but a plain tensor_num_per_layer, which a pull of every
        # layer does not use) goes straight to the engine; any other, through
        # every check below.
        if (
            type(src_cache_key) is BlocksCacheKey
            and type(dst_cache) is Cache
            and dst_cache._is_blocks_cache
            and (not kwargs or (len(kwargs) == 1 and _default_span(dst_cache, kwargs.get("tensor_num_per_layer"))))
            and type(src_blocks) in (list, tuple)
            and src_blocks
            and self._valid
        ):
            started = self._engine.pull_blocks(
                dst_cache._cache_id, src_cache_key._cluster_id, remote_name(src_cache_key), src_blocks, dst_blocks,
                (0, 0, dst_cache._cache_desc.num_tensors, 1),
            )
            if started is not None:
                return self._task(started, lambda: f"pull_blocks({src_cache_key!r} -> cache {dst_cache.cache_id})")
        check_isinstance(
            "src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey), allow_none=False
        )
        check_isinstance("dst_cache", dst_cache, Cache, allow_none=False)
        check_isinstance("src_blocks", src_blocks, (list, tuple), int, allow_none=False)
        check_isinstance("dst_blocks", dst_blocks, (list, tuple), int, allow_none=False)
        check_list_uint64("src_blocks", src_blocks)
        check_list_uint64("dst_blocks", dst_blocks)
        raise_if_false(dst_cache.is_blocks_cache, "pull_blocks needs a blocks destination cache")
        raise_if_false(len(dst_blocks) > 0, "dst_blocks must not be empty")
        span = self._pull_span(dst_cache, kwargs)
        if isinstance(src_cache_key, BlocksCacheKey):
            raise_if_false(len(src_blocks) > 0, "src_blocks must not be empty with a BlocksCacheKey")
        else:
            raise_if_false(len(src_blocks) == 0, "src_blocks must be empty when pulling a contiguous slot")
            if isinstance(src_cache_key, CacheKey):
                _check_pull_key(src_cache_key)
        self._check_valid()
        started = self._engine.pull_blocks(
            dst_cache.cache_id,
            src_cache_key.cluster_id,
            remote_name(src_cache_key),
            list(src_blocks),
            list(dst_blocks),
            span,
        )
        return self._task(started, lambda: f"pull_blocks({src_cache_key!r} -> cache {dst_cache.cache_id})")

    def pull_blocks(
        self,
        src_cache_key: Union[CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey],
        dst_cache: Cache,
        src_blocks: Union[tuple[int, ...], list[int]] = (),
        dst_blocks: Union[tuple[int, ...], list[int]] = (),
        **kwargs: Any,
    ) -> None:
        """``pull_blocks_async``, waited for; raises ``LLMException`` on failure."""
        _wait(self.pull_blocks_async(src_cache_key, dst_cache, src_blocks, dst_blocks, **kwargs))

    def pull_block_ranges_async(
        self,
        src_cache_key: BlocksCacheKey,
        dst_cache: Cache,
        ranges: Any,
        **kwargs: Any,
    ) -> CacheTask:
        """Starts pulling byte ranges inside blocks, for every selected layer.

        Not in LLM-DataDist: it serves peers whose blocks are cut differently
        (another block size, another share of the KV heads). ``ranges`` is an
        integer array of shape ``(n, 5)`` (or ``n`` sequences of five ints):
        ``(src_block, src_offset, dst_block, dst_offset, length)``, offsets
        and length in bytes, each range inside one block on both sides. Rows
        of eight add ``(count, src_stride, dst_stride)``: the range repeats
        ``count`` times, each repeat that many bytes further on both sides
        (strides at least the length), and travels as one strided range: a
        head's slice of every token of a block, or a transposed key's rows.
        The same ranges apply to each tensor; keywords as ``pull_blocks``.
        The peer checks every range against its own blocks; destination
        ranges may not overlap.
        """
        check_isinstance("src_cache_key", src_cache_key, BlocksCacheKey, allow_none=False)
        check_isinstance("dst_cache", dst_cache, Cache, allow_none=False)
        raise_if_false(dst_cache.is_blocks_cache, "pull_block_ranges needs a blocks destination cache")
        rows = _range_rows(ranges)
        span = self._pull_span(dst_cache, kwargs)
        self._check_valid()
        started = self._engine.pull_ranges(
            dst_cache.cache_id, src_cache_key.cluster_id, remote_name(src_cache_key), rows, span
        )
        return self._task(started, lambda: f"pull_block_ranges({src_cache_key!r} -> cache {dst_cache.cache_id})")

    def pull_block_ranges(self, src_cache_key: BlocksCacheKey, dst_cache: Cache, ranges: Any, **kwargs: Any) -> None:
        """``pull_block_ranges_async``, waited for; raises ``LLMException`` on failure."""
        _wait(self.pull_block_ranges_async(src_cache_key, dst_cache, ranges, **kwargs))

    # -- layer-wise transfer -----------------------------------------------------

    def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: Union[
            list[Union[TransferConfig, TransferWithCacheKeyConfig]], tuple[Union[TransferConfig, TransferWithCacheKeyConfig], ...]
        ],
        src_block_indices: Optional[Union[list[int], tuple[int, ...]]] = None,
        dst_block_indices: Optional[Union[list[int], tuple[int, ...]]] = None,
        dst_block_memory_size: Optional[int] = None,
        *,
        block_ranges: Any = None,
    ) -> CacheTask:
        """Sends ``src_cache`` layer by layer, as ``layer_synchronizer`` releases
        each layer, to every destination in ``transfer_configs``.

        Returns a ``CacheTask`` at once, with one result per config in the
        order given. With ``TransferWithCacheKeyConfig`` (remote-cache-accessible
        mode) the destination is a cache of the peer; with ``TransferConfig``
        it is raw addresses, which the peer accepts only inside memory it
        registered. Source layer ``l`` of a config goes to destination layer
        ``dst_layer_range.start + (l - src_layer_range.start)``. Block lists:
        none moves the batch slot ``src_batch_index``; both move blocks to
        blocks; destination blocks alone cut the slot into chunks of
        ``dst_block_memory_size`` bytes.

        ``block_ranges`` (not in LLM-DataDist; keyword only, without block
        lists, with ``TransferWithCacheKeyConfig`` into a blocks cache):
        byte ranges inside blocks instead of whole blocks, rows as
        ``pull_block_ranges`` takes them with ``src_block`` this cache's
        and ``dst_block`` the peer's (a share of the KV heads of each
        block, for a peer of another TP size). This side checks its own
        ranges, the peer its own.
        """
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        for name, blocks in (("dst_block_indices", dst_block_indices), ("src_block_indices", src_block_indices)):
            check_isinstance(name, blocks, (list, tuple), int)
            check_list_uint64(name, blocks or ())
        if dst_block_memory_size is not None:
            check_uint64("dst_block_memory_size", dst_block_memory_size)
        src_blocks, dst_blocks = list(src_block_indices or ()), list(dst_block_indices or ())
        if src_blocks:
            raise_if_false(len(dst_blocks) > 0, "blocks to a contiguous cache are not supported: give dst_block_indices")
            raise_if_false(
                len(src_blocks) == len(dst_blocks),
                f"src_block_indices and dst_block_indices differ in length: {len(src_blocks)} != {len(dst_blocks)}",
            )
        elif dst_blocks:
            raise_if_true(dst_block_memory_size is None, "dst_block_indices without src blocks need dst_block_memory_size")
        check_isinstance("layer_synchronizer", layer_synchronizer, LayerSynchronizer, allow_none=False)
        config_kind = TransferWithCacheKeyConfig if self._remote_cache_accessible else TransferConfig
        check_isinstance("transfer_configs", transfer_configs, (list, tuple), config_kind, allow_none=False)
        raise_if_false(0 < len(transfer_configs) < 2**16, "transfer_configs must hold 1 to 65535 configs")
        if not dst_blocks:
            raise_if_false(
                dst_block_memory_size in (None, 0), "dst_block_memory_size is only used with dst_block_indices"
            )
        rows: Optional[np.ndarray] = None
        if block_ranges is not None:
            rows = _range_rows(block_ranges)
            raise_if_true(bool(src_blocks or dst_blocks), "block_ranges move without block index lists")
            raise_if_false(src_cache.is_blocks_cache, "block_ranges need a blocks source cache")
            raise_if_false(self._remote_cache_accessible, "block_ranges need TransferWithCacheKeyConfig configs")
        num_tensors = src_cache.cache_desc.num_tensors
        raise_if_false(num_tensors % TENSORS_PER_LAYER == 0, f"src_cache has an odd tensor count {num_tensors}")
        layers = num_tensors // TENSORS_PER_LAYER
        for index, config in enumerate(transfer_configs):
            if config.src_layer_range is None:
                config.src_layer_range = range(layers)
            rng = config.src_layer_range
            raise_if_true(src_blocks and config.src_batch_index != 0, f"transfer_configs[{index}]: src_batch_index must be 0 with src blocks")
            raise_if_false(
                0 <= rng.start < rng.stop <= layers,
                f"transfer_configs[{index}]: src_layer_range {rng} is outside the {layers} layers of src_cache",
            )
            if isinstance(config, TransferWithCacheKeyConfig):
                config._validate()
            else:
                raise_if_false(
                    len(config.dst_addrs) == TENSORS_PER_LAYER * len(rng),
                    f"transfer_configs[{index}]: dst_addrs needs {TENSORS_PER_LAYER * len(rng)} addresses, "
                    f"got {len(config.dst_addrs)}",
                )
        self._check_valid()
        request = self._engine.create_request(len(transfer_configs))
        transfer = LayerwiseTransfer(
            self._engine,
            request,
            src_cache,
            layer_synchronizer,
            transfer_configs,
            BlockPlan(src_blocks, dst_blocks, dst_block_memory_size or 0, rows),
            self._engine.sync_kv_timeout_ms,
            on_finished=self._transfers.discard,
        )
        self._transfers.add(transfer)
        self._driver_threads = [thread for thread in self._driver_threads if thread.is_alive()]
        task = CacheTask(
            request,
            self._dispatcher,
            f"transfer_cache_async(cache {src_cache.cache_id})",
            transfer.stop,
            transfer.driver_loop,
        )
        transfer.start()
        if transfer.thread is not None:
            self._driver_threads.append(transfer.thread)
        return task

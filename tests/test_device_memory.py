"""Caches in CUDA device memory (Placement.DEVICE), end to end on the CUDA
driver stand-in (tests/cuda_standin): the engine loads it as it would load
libcuda.so.1, through $DATADIST_AIO_CUDA_DRIVER.

These runs prove the engine's logic against the driver's documented rules
(a context current on every calling thread, device memory the host never
touches: the stand-in maps it without access, so a stray read kills the
process), never NVIDIA's driver. Each scenario runs in a spawned process of
its own: the driver is loaded once per process, and which one (or none) is
part of what a scenario sets up.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from datadist_aio.bench.cuda_driver import CudaDriver  # noqa: E402
from support.device import in_child, standin  # noqa: E402,F401  (standin: the fixture)

Cuda = CudaDriver  # the name tests/test_vllm_device.py imports from here


def _datadist(device_id: int = 0, pool: bool = True) -> Any:
    import datadist_aio as dd
    from support.peer import pool_cfg

    config = dd.LLMConfig()
    config.device_id = device_id
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    if pool:
        config.host_mem_pool_cfg = pool_cfg(8 << 20)
    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, 5)
    datadist.init(config.generate_options())
    return datadist


def _raises(code: Any, words: str, call: Callable[[], Any]) -> None:
    import datadist_aio as dd

    try:
        call()
    except dd.LLMException as e:
        assert e.status_code is code, f"{e.status_code}: {e}"
        assert words in str(e), f"{words!r} not in {e}"
        return
    raise AssertionError(f"no LLMException ({code}, {words!r})")


BLOCKS, BLOCK = 8, 256  # a blocks cache of 8 blocks of 256 bytes per tensor


def _desc(placement: Any, tensors: int = 2) -> Any:
    import datadist_aio as dd

    return dd.CacheDesc(tensors, [BLOCKS, BLOCK], dd.DataType.DT_UINT8, placement)


def scenario_registration_checks_every_address() -> None:
    import datadist_aio as dd

    code = dd.LLMStatusCode
    cuda = CudaDriver(device=1)
    mine = [cuda.alloc(BLOCKS * BLOCK) for _ in range(2)]
    small = cuda.alloc(BLOCKS * BLOCK - 1)
    cuda.use(0)
    other = cuda.alloc(BLOCKS * BLOCK)
    host = np.zeros(BLOCKS * BLOCK, np.uint8)
    datadist = _datadist(device_id=1)
    cm = datadist.cache_manager
    desc = _desc(dd.Placement.DEVICE)
    cache = cm.register_blocks_cache(desc, mine, dd.BlocksCacheKey(5, 1))
    assert cache.tensor_addrs == mine
    _raises(code.LLM_PARAM_INVALID, "which numpy cannot view", lambda: cache.as_numpy(0))
    _raises(code.LLM_PARAM_INVALID, "is memory of device 0, not of device_id 1",
            lambda: cm.register_blocks_cache(desc, [mine[0], other]))
    _raises(code.LLM_PARAM_INVALID, "runs past its allocation", lambda: cm.register_blocks_cache(desc, [mine[0], small]))
    _raises(code.LLM_PARAM_INVALID, "is not CUDA device memory",
            lambda: cm.register_blocks_cache(desc, [mine[0], host.ctypes.data]))
    _raises(code.LLM_PARAM_INVALID, "is host memory (ndarray)", lambda: cm.register_blocks_cache(desc, [mine[0], host]))
    _raises(code.LLM_PARAM_INVALID, "runs past its allocation",
            lambda: cm.register_blocks_cache(desc, [mine[0], mine[1] + 1]))
    # An object exposing __cuda_array_interface__ (as torch and CuPy tensors do).
    class Tensor:
        def __init__(self, ptr: int, shape: tuple[int, ...]) -> None:
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": "|u1", "version": 3}

    by_interface = cm.register_blocks_cache(desc, [Tensor(mine[0], (BLOCKS, BLOCK)), Tensor(mine[1], (BLOCKS * BLOCK,))])
    assert by_interface.tensor_addrs == mine
    _raises(code.LLM_PARAM_INVALID, "holds 2047 bytes",
            lambda: cm.register_blocks_cache(desc, [mine[0], Tensor(mine[1], (BLOCKS * BLOCK - 1,))]))
    cm.unregister_cache(cache.cache_id)
    cm.unregister_cache(by_interface.cache_id)
    datadist.finalize()
    cuda.use(1)
    for ptr in mine + [small]:
        cuda.free(ptr)


def scenario_copies_between_host_and_device() -> None:
    import datadist_aio as dd

    cuda = CudaDriver()
    baseline = cuda.live()
    datadist = _datadist()
    cm = datadist.cache_manager
    device = cm.allocate_blocks_cache(_desc(dd.Placement.DEVICE))
    assert cuda.live() == baseline + 2, "one device allocation per tensor"
    host = cm.allocate_blocks_cache(_desc(dd.Placement.HOST))
    back = cm.allocate_blocks_cache(_desc(dd.Placement.HOST))
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, (BLOCKS, BLOCK), dtype=np.uint8) for _ in range(2)]
    for t in range(2):
        host.as_numpy(t)[:] = data[t]
        back.as_numpy(t)[:] = 0
    # HOST -> DEVICE (blocks 0..3 to 4..7), DEVICE -> DEVICE (4..7 to 0..3), DEVICE -> HOST.
    cm.swap_blocks(host, device, {0: 4, 1: 5, 2: 6, 3: 7})
    for t in range(2):
        got = cuda.read(device.tensor_addrs[t] + 4 * BLOCK, 4 * BLOCK).reshape(4, BLOCK)
        np.testing.assert_array_equal(got, data[t][:4])
    cm.swap_blocks(device, device, {4: 0, 5: 1, 6: 2, 7: 3})
    cm.swap_blocks(device, back, {i: i for i in range(BLOCKS)})
    for t in range(2):
        np.testing.assert_array_equal(back.as_numpy(t)[:4], data[t][:4])
        np.testing.assert_array_equal(back.as_numpy(t)[4:], data[t][:4])
    # Awaited too: the copy's completion reaches the event loop.
    import asyncio

    async def awaited() -> list[Any]:
        return await cm.swap_blocks_async(host, device, {7: 0})

    assert asyncio.run(awaited()) == [dd.LLMStatusCode.LLM_SUCCESS]
    np.testing.assert_array_equal(cuda.read(device.tensor_addrs[1], BLOCK), data[1][7])
    cm.deallocate_blocks_cache(device)
    # The last copy's worker lets go of the cache just after settling it.
    deadline = time.monotonic() + 10
    while cuda.live() != baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cuda.live() == baseline, "the engine freed its device memory"
    datadist.finalize()


def scenario_a_raw_peer_reads_and_writes_a_device_cache() -> None:
    import socket

    import datadist_aio as dd
    from support.wire_frames import (BY_ID, HELLO, HELLO_T, RAW_ADDRESS, READ_DATA_T, READ_T, WRITE_ACK_T, WRITE_T, frame,
                             recv_frame, request)

    code = dd.LLMStatusCode
    cuda = CudaDriver()
    datadist = _datadist()
    cm = datadist.cache_manager
    device = cm.allocate_blocks_cache(_desc(dd.Placement.DEVICE), dd.BlocksCacheKey(5, 3))
    # Not refused for its placement any more: there is no link to cluster 6.
    _raises(code.LLM_NOT_YET_LINK, "link_clusters first", lambda: cm.push_blocks(dd.BlocksCacheKey(6, 3), device, [0], [0]))
    datadist.finalize()
    # The owner stages a device cache's bytes for a peer, both ways, and
    # still checks every range.
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.listen_ip_info = "127.0.0.1:0"
    owner = dd.LLMDataDist(dd.LLMRole.PROMPT, 7)
    owner.init(config.generate_options())
    cache = owner.cache_manager.allocate_blocks_cache(_desc(dd.Placement.DEVICE))
    host = [np.zeros(BLOCKS * BLOCK, np.uint8) for _ in range(2)]
    host_cache = owner.cache_manager.register_blocks_cache(_desc(dd.Placement.HOST), [a.ctypes.data for a in host])
    data = np.random.default_rng(5).integers(0, 256, BLOCKS * BLOCK, dtype=np.uint8)
    cuda.write(cache.tensor_addrs[1], data)
    with socket.create_connection(("127.0.0.1", owner.listen_port), timeout=10) as sock:
        sock.sendall(frame(HELLO_T, HELLO.pack(99, 7, 1, 1, 0, 1, 0)))
        assert recv_frame(sock)[1] == 0
        sock.sendall(frame(READ_T, request([(1, 2, 0, 3 * BLOCK)], kind=BY_ID, cache_id=cache.cache_id), op_id=4))
        kind, status, op_id, body, got = recv_frame(sock)
        assert (kind, status, op_id) == (READ_DATA_T, 0, 4), (kind, status, body)
        assert got == data[2 * BLOCK:5 * BLOCK].tobytes()
        new = bytes(range(256)) * (BLOCK // 256)
        sock.sendall(frame(WRITE_T, request([(0, 6, 0, BLOCK)], kind=BY_ID, cache_id=cache.cache_id), new, op_id=5))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 5)
        assert cuda.read(cache.tensor_addrs[0] + 6 * BLOCK, BLOCK).tobytes() == new
        # A range past the cache: refused, nothing read or written.
        sock.sendall(frame(READ_T, request([(1, 7, 0, 2 * BLOCK)], kind=BY_ID, cache_id=cache.cache_id), op_id=6))
        kind, status, op_id, body, got = recv_frame(sock)
        assert (kind, status, op_id, got) == (READ_DATA_T, code.LLM_PARAM_INVALID.value, 6, b""), (kind, status, body)
        sock.sendall(frame(WRITE_T, request([(0, 7, 0, 2 * BLOCK)], kind=BY_ID, cache_id=cache.cache_id),
                           b"\xff" * 2 * BLOCK, op_id=7))
        kind, status, op_id, body, _ = recv_frame(sock)
        assert (kind, status, op_id) == (WRITE_ACK_T, code.LLM_PARAM_INVALID.value, 7) and b"ends past" in body, body
        assert not cuda.read(cache.tensor_addrs[0] + 7 * BLOCK, BLOCK).any()
        # Raw addresses: in a device tensor, staged; a request mixing host and device memory, refused whole.
        device_at = cache.tensor_addrs[0] + 3 * BLOCK
        sock.sendall(frame(WRITE_T, request([(0, 0, device_at, BLOCK)], kind=RAW_ADDRESS), new, op_id=8))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 8)
        assert cuda.read(device_at, BLOCK).tobytes() == new
        mixed = request([(0, 0, host_cache.tensor_addrs[0], BLOCK), (0, 0, device_at + BLOCK, BLOCK)], kind=RAW_ADDRESS)
        sock.sendall(frame(WRITE_T, mixed, new * 2, op_id=9))
        kind, status, op_id, body, _ = recv_frame(sock)
        assert (kind, status, op_id) == (WRITE_ACK_T, code.LLM_PARAM_INVALID.value, 9) and b"one kind of memory" in body
        assert not host[0].any() and not cuda.read(device_at + BLOCK, BLOCK).any()
    owner.cache_manager.unregister_cache(host_cache.cache_id)
    owner.finalize()


def scenario_refusal(device_id: int, words: str) -> None:
    import datadist_aio as dd

    datadist = _datadist(device_id=device_id, pool=False)
    for call in (lambda: datadist.cache_manager.allocate_blocks_cache(_desc(dd.Placement.DEVICE)),
                 lambda: datadist.cache_manager.register_blocks_cache(_desc(dd.Placement.DEVICE), [1 << 40, 1 << 41])):
        _raises(dd.LLMStatusCode.LLM_FEATURE_NOT_ENABLED, words, call)
    datadist.finalize()


# -- the tests ------------------------------------------------------------------------------------


def test_registration_checks_every_address_with_the_driver(standin: Path) -> None:
    in_child(scenario_registration_checks_every_address, standin, 2)


def test_copies_between_host_and_device_caches(standin: Path) -> None:
    in_child(scenario_copies_between_host_and_device, standin)


def test_a_raw_peer_reads_and_writes_a_device_cache_through_staging(standin: Path) -> None:
    in_child(scenario_a_raw_peer_reads_and_writes_a_device_cache, standin)


@pytest.mark.parametrize(
    "driver, devices, device_id, words",
    [
        ("missing", 1, 0, "could not be loaded"),
        ("standin", 0, 0, "sees no device"),
        ("standin", 2, 5, "device_id 5 is not a CUDA device: the driver sees 2 devices"),
    ],
)
def test_device_placement_without_a_driver_or_device_says_which(standin: Path, tmp_path: Path, driver: str,
                                                                devices: int, device_id: int, words: str) -> None:
    path = standin if driver == "standin" else tmp_path / "libcuda.so.1"
    in_child(scenario_refusal, path, devices, device_id, words)

"""Local cache operations on the engine: allocation, registration, copies."""

from __future__ import annotations

import os

import numpy as np
import pytest

import datadist_aio as dd
from support.cache_bytes import fill_random, slot_bytes, snapshot, tensor_bytes
from support.options import MiB, make_options

PARAM_INVALID = dd.LLMStatusCode.LLM_PARAM_INVALID


def host_desc(num_tensors: int = 4, shape: tuple[int, ...] = (8, 16, 32), dtype=dd.DataType.DT_FLOAT16) -> dd.CacheDesc:
    return dd.CacheDesc(num_tensors, list(shape), dtype, dd.Placement.HOST)


def _has_cuda_driver() -> bool:
    import ctypes

    try:
        ctypes.CDLL(os.environ.get("DATADIST_AIO_CUDA_DRIVER") or "libcuda.so.1")
    except OSError:
        return False
    return True


def raises_status(code: dd.LLMStatusCode):
    class _Check:
        def __enter__(self):
            self._ctx = pytest.raises(dd.LLMException)
            self._info = self._ctx.__enter__()
            return self._info

        def __exit__(self, *exc):
            handled = self._ctx.__exit__(*exc)
            assert self._info.value.status_code is code, self._info.value
            return handled

    return _Check()


# -- allocation -----------------------------------------------------------------


def test_allocate_cache_geometry(cache_manager):
    desc = host_desc()
    cache = cache_manager.allocate_cache(desc)
    assert cache.cache_id >= 1
    assert not cache.is_blocks_cache
    assert len(cache.tensor_addrs) == 4
    assert all(addr % 64 == 0 for addr in cache.tensor_addrs)
    assert len(set(cache.tensor_addrs)) == 4
    other = cache_manager.allocate_cache(host_desc())
    assert other.cache_id == cache.cache_id + 1
    cache_manager.deallocate_cache(cache)
    assert cache.tensor_addrs == []
    cache_manager.deallocate_cache(other)


def test_cache_ids_start_at_one():
    with dd.LLMDataDist(dd.LLMRole.DECODER, 9) as datadist:
        datadist.init(make_options())
        cache = datadist.cache_manager.allocate_blocks_cache(host_desc())
        assert cache.cache_id == 1
        assert cache.is_blocks_cache


@pytest.mark.skipif(_has_cuda_driver(), reason="a CUDA driver is installed: DEVICE placement works here")
def test_allocate_device_placement_says_to_use_host(cache_manager):
    desc = dd.CacheDesc(2, [4, 8], dd.DataType.DT_FLOAT, dd.Placement.DEVICE)
    with raises_status(dd.LLMStatusCode.LLM_FEATURE_NOT_ENABLED) as info:
        cache_manager.allocate_cache(desc)
    assert "Placement.HOST" in str(info.value)
    with raises_status(dd.LLMStatusCode.LLM_FEATURE_NOT_ENABLED):
        cache_manager.register_cache(desc, [1, 2])


def test_allocate_without_host_pool():
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    with dd.LLMDataDist(dd.LLMRole.PROMPT, 3) as datadist:
        datadist.init(config.generate_options())
        with raises_status(PARAM_INVALID) as info:
            datadist.cache_manager.allocate_cache(host_desc())
        assert "host_mem_pool_cfg" in str(info.value)


def test_allocate_checks_arguments(cache_manager):
    with pytest.raises(TypeError):
        cache_manager.allocate_cache("desc")
    with pytest.raises(TypeError):
        cache_manager.allocate_cache(host_desc(), [1])
    with pytest.raises(TypeError):
        cache_manager.allocate_blocks_cache(host_desc(), dd.CacheKey(1, 2))
    with raises_status(PARAM_INVALID):
        cache_manager.allocate_cache(dd.CacheDesc(0, [4], dd.DataType.DT_INT8, dd.Placement.HOST))


def test_pool_exhaustion_and_reuse(cache_manager):
    desc = dd.CacheDesc(2, [16, MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)  # 32 MiB
    first = cache_manager.allocate_cache(desc)
    first_addrs = list(first.tensor_addrs)
    second = cache_manager.allocate_cache(desc)
    with raises_status(dd.LLMStatusCode.LLM_OUT_OF_MEMORY):
        cache_manager.allocate_cache(desc)
    cache_manager.deallocate_cache(first)
    third = cache_manager.allocate_cache(desc)
    assert third.tensor_addrs == first_addrs
    cache_manager.deallocate_cache(second)
    cache_manager.deallocate_cache(third)


def test_keys_bound_at_allocation(cache_manager):
    desc = host_desc(shape=(2, 8))
    with raises_status(PARAM_INVALID):  # more keys than slots
        cache_manager.allocate_cache(desc, [dd.CacheKey(1, r) for r in range(3)])
    with raises_status(PARAM_INVALID):  # the same key twice
        cache_manager.allocate_cache(desc, [dd.CacheKey(1, 5), dd.CacheKey(1, 5)])
    cache = cache_manager.allocate_cache(desc, [dd.CacheKey(1, 5), dd.CacheKey(1, 6)])
    with raises_status(PARAM_INVALID):  # bound to another cache
        cache_manager.allocate_cache(desc, [dd.CacheKey(1, 6)])
    # Another model id is another key; placeholders skip a slot and never clash.
    placeholder = dd.CacheKey(1, 2**64 - 1)
    other = cache_manager.allocate_cache(desc, [placeholder, dd.CacheKey(1, 6, 1)])
    again = cache_manager.allocate_cache(desc, [placeholder, placeholder])
    cache_manager.remove_cache_key(dd.CacheKey(1, 6))
    reused = cache_manager.allocate_cache(desc, [dd.CacheKey(1, 6)])
    cache_manager.remove_cache_key(dd.CacheKey(1, 12345))  # unknown: no error
    for c in (cache, other, again, reused):
        cache_manager.deallocate_cache(c)


def test_blocks_key_is_unique_per_model(cache_manager):
    first = cache_manager.allocate_blocks_cache(host_desc(), dd.BlocksCacheKey(1, 0))
    with raises_status(PARAM_INVALID):
        cache_manager.allocate_blocks_cache(host_desc(), dd.BlocksCacheKey(1, 0))
    cache_manager.deallocate_blocks_cache(first)
    second = cache_manager.allocate_blocks_cache(host_desc(), dd.BlocksCacheKey(1, 0))
    cache_manager.deallocate_blocks_cache(second)


def test_deallocate_checks_kind(cache_manager):
    blocks = cache_manager.allocate_blocks_cache(host_desc())
    contiguous = cache_manager.allocate_cache(host_desc())
    with raises_status(PARAM_INVALID):
        cache_manager.deallocate_cache(blocks)
    with raises_status(PARAM_INVALID):
        cache_manager.deallocate_blocks_cache(contiguous)
    with pytest.raises(TypeError):
        cache_manager.deallocate_cache(None)
    cache_manager.deallocate_blocks_cache(blocks)
    cache_manager.deallocate_cache(contiguous)
    cache_manager.deallocate_cache(contiguous)  # again: nothing left to do


# -- registration ---------------------------------------------------------------


def test_register_numpy_arrays(cache_manager):
    desc = host_desc(num_tensors=2, shape=(4, 8), dtype=dd.DataType.DT_FLOAT)
    arrays = [np.arange(32, dtype=np.float32).reshape(4, 8) + 100 * t for t in range(2)]
    cache = cache_manager.register_cache(desc, arrays)
    assert cache.tensor_addrs == [a.ctypes.data for a in arrays]
    np.testing.assert_array_equal(cache.as_numpy(1), arrays[1])
    cache_manager.copy_cache(cache, cache, dst_batch_index=3, src_batch_index=0)
    np.testing.assert_array_equal(arrays[1][3], arrays[1][0])
    np.testing.assert_array_equal(arrays[0][1:3], np.arange(8, 24, dtype=np.float32).reshape(2, 8))
    cache_manager.unregister_cache(cache.cache_id)
    cache_manager.unregister_cache(cache.cache_id)  # unknown id: no error


def test_register_raw_addresses(cache_manager):
    arrays = [np.zeros((4, 8), dtype=np.float16) for _ in range(2)]
    desc = host_desc(num_tensors=2, shape=(4, 8))
    cache = cache_manager.register_cache(desc, [a.ctypes.data for a in arrays], [dd.CacheKey(1, 1)])
    assert cache.tensor_addrs == [a.ctypes.data for a in arrays]
    blocks = cache_manager.register_blocks_cache(
        host_desc(num_tensors=2, shape=(4, 8)), [a.ctypes.data for a in arrays], dd.BlocksCacheKey(1, 3)
    )
    assert blocks.is_blocks_cache
    cache_manager.unregister_cache(cache.cache_id)
    cache_manager.unregister_cache(blocks.cache_id)


def test_register_checks(cache_manager):
    desc = host_desc(num_tensors=2, shape=(4, 8), dtype=dd.DataType.DT_FLOAT)
    good = [np.zeros((4, 8), dtype=np.float32) for _ in range(2)]
    with pytest.raises(TypeError):
        cache_manager.register_cache(desc, tuple(good))
    with pytest.raises(TypeError):
        cache_manager.register_cache(desc, ["not a buffer", good[1]])
    with pytest.raises(TypeError):  # read-only buffer
        cache_manager.register_cache(desc, [bytes(128), good[1]])
    with pytest.raises(TypeError):
        cache_manager.register_cache(desc, good, remote_accessible=1)
    with raises_status(PARAM_INVALID):
        cache_manager.register_cache(desc, [])
    with raises_status(PARAM_INVALID):
        cache_manager.register_cache(desc, good[:1])
    with raises_status(PARAM_INVALID):
        cache_manager.register_cache(desc, [0, good[1]])
    with raises_status(PARAM_INVALID) as info:  # wrong size, a buffer without dtype
        cache_manager.register_cache(desc, [bytearray(124), good[1]])
    assert "124 bytes" in str(info.value) and "128 bytes" in str(info.value)
    with raises_status(PARAM_INVALID) as info:  # a numpy array: dtype and shape, not only the size
        cache_manager.register_cache(desc, [np.zeros(31, dtype=np.float32), good[1]])
    assert "shape (31,)" in str(info.value)
    with raises_status(PARAM_INVALID) as info:
        cache_manager.register_cache(desc, [good[0], np.zeros((4, 8), dtype=np.int32)])
    assert "addrs[1] has dtype int32" in str(info.value) and "float32" in str(info.value)
    with raises_status(PARAM_INVALID) as info:  # same size, transposed shape
        cache_manager.register_blocks_cache(desc, [np.zeros((8, 4), dtype=np.float32), good[1]])
    assert "addrs[0] has shape (8, 4)" in str(info.value) and "(4, 8)" in str(info.value)
    with raises_status(PARAM_INVALID) as info:  # blocks registration: too few arrays
        cache_manager.register_blocks_cache(desc, good[:1])
    assert "too few" in str(info.value) and "1 given" in str(info.value) and "num_tensors is 2" in str(info.value)
    with raises_status(PARAM_INVALID) as info:
        cache_manager.register_cache(desc, good + good[:1])
    assert "too many" in str(info.value) and "3 given" in str(info.value)
    with pytest.raises(TypeError):  # not C-contiguous
        cache_manager.register_cache(desc, [np.zeros((8, 8), dtype=np.float32)[:, ::2], good[1]])


# -- copies ---------------------------------------------------------------------


def test_copy_cache_slot_range(cache_manager):
    rng = np.random.default_rng(1)
    src = cache_manager.allocate_cache(host_desc())
    dst = cache_manager.allocate_cache(host_desc())
    src_data = fill_random(src, rng)
    before = [t.copy() for t in fill_random(dst, rng)]
    slot = src.cache_desc.slot_size
    cache_manager.copy_cache(dst, src, dst_batch_index=5, src_batch_index=2, offset=100, size=300)
    for t in range(4):
        expected = before[t].copy()
        expected[5 * slot + 100 : 5 * slot + 400] = src_data[t][2 * slot + 100 : 2 * slot + 400]
        np.testing.assert_array_equal(tensor_bytes(dst, t), expected)
    cache_manager.copy_cache(dst, src, 1, 7)
    for t in range(4):
        np.testing.assert_array_equal(slot_bytes(dst, t, 1), src_data[t][7 * slot : 8 * slot])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dst_batch_index": 8},  # past the last slot
        {"src_batch_index": 8},
        {"offset": 1024},  # slot is 1024 bytes
        {"offset": 1000, "size": 25},
        {"size": 1025},
    ],
)
def test_copy_cache_refused_writes_nothing(cache_manager, kwargs):
    rng = np.random.default_rng(2)
    src = cache_manager.allocate_cache(host_desc())
    dst = cache_manager.allocate_cache(host_desc())
    fill_random(src, rng)
    fill_random(dst, rng)
    before = snapshot(dst)
    with raises_status(PARAM_INVALID):
        cache_manager.copy_cache(dst, src, **kwargs)
    for t, data in enumerate(before):
        np.testing.assert_array_equal(tensor_bytes(dst, t), data)


def test_copy_cache_argument_kinds(cache_manager):
    cache = cache_manager.allocate_cache(host_desc())
    blocks = cache_manager.allocate_blocks_cache(host_desc())
    with pytest.raises(TypeError):
        cache_manager.copy_cache(cache, "src")
    with pytest.raises(TypeError):
        cache_manager.copy_cache(cache, cache, 1.0)
    with pytest.raises(ValueError):
        cache_manager.copy_cache(cache, cache, -1)
    with pytest.raises(ValueError):
        cache_manager.copy_cache(cache, cache, req_id=-1)
    with raises_status(PARAM_INVALID):
        cache_manager.copy_cache(cache, cache, size=0)
    with raises_status(PARAM_INVALID):
        cache_manager.copy_cache(cache, blocks)
    other = cache_manager.allocate_cache(host_desc(num_tensors=2))
    with raises_status(PARAM_INVALID):  # tensor counts differ
        cache_manager.copy_cache(cache, other)
    cache_manager.deallocate_cache(other)
    with raises_status(dd.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST):
        cache_manager.copy_cache(cache, other)


def test_copy_blocks_random_map(cache_manager):
    rng = np.random.default_rng(3)
    desc = host_desc(num_tensors=6, shape=(64, 4, 16))
    cache = cache_manager.allocate_blocks_cache(desc)
    original = fill_random(cache, rng)
    order = rng.permutation(64)
    sources, dests = order[:20], order[20:50]
    info = {int(s): [] for s in sources}
    for i, d in enumerate(dests):
        info[int(sources[i % 20])].append(int(d))
    cache_manager.copy_blocks(cache, info)
    size = desc.slot_size
    expected = [o.reshape(64, size).copy() for o in original]
    for s, ds in info.items():
        for d in ds:
            for t in range(6):
                expected[t][d] = original[t].reshape(64, size)[s]
    for t in range(6):
        np.testing.assert_array_equal(tensor_bytes(cache, t).reshape(64, size), expected[t])


@pytest.mark.parametrize(
    "info",
    [
        {0: [1], 2: [1]},  # block 1 written twice
        {0: [1], 1: [2]},  # block 1 is both written and read
        {0: [64]},  # out of range
        {64: [0]},
    ],
)
def test_copy_blocks_refused_writes_nothing(cache_manager, info):
    cache = cache_manager.allocate_blocks_cache(host_desc(shape=(64, 16)))
    fill_random(cache, np.random.default_rng(4))
    before = snapshot(cache)
    with raises_status(PARAM_INVALID):
        cache_manager.copy_blocks(cache, info)
    for t, data in enumerate(before):
        np.testing.assert_array_equal(tensor_bytes(cache, t), data)


def test_copy_blocks_argument_kinds(cache_manager):
    cache = cache_manager.allocate_blocks_cache(host_desc())
    contiguous = cache_manager.allocate_cache(host_desc())
    with pytest.raises(TypeError):
        cache_manager.copy_blocks(cache, {0: 1})
    with pytest.raises(TypeError):
        cache_manager.copy_blocks(cache, [(0, [1])])
    with pytest.raises(ValueError):
        cache_manager.copy_blocks(cache, {0: [-1]})
    with raises_status(PARAM_INVALID):
        cache_manager.copy_blocks(contiguous, {0: [1]})
    cache_manager.copy_blocks(cache, {})


def test_swap_blocks_between_host_caches(cache_manager):
    rng = np.random.default_rng(5)
    desc = host_desc(num_tensors=2, shape=(16, 64))
    pool_cache = cache_manager.allocate_blocks_cache(desc)
    arrays = [np.zeros((32, 64), dtype=np.float16) for _ in range(2)]
    cpu_desc = host_desc(num_tensors=2, shape=(32, 64))
    cpu_cache = dd.Cache.create_cpu_cache(cpu_desc, [a.ctypes.data for a in arrays])
    data = fill_random(pool_cache, rng)
    mapping = {3: 30, 4: 31, 0: 2}
    cache_manager.swap_blocks(pool_cache, cpu_cache, mapping)
    size = desc.slot_size
    for t in range(2):
        view = arrays[t].reshape(-1).view(np.uint8).reshape(32, size)
        for s, d in mapping.items():
            np.testing.assert_array_equal(view[d], data[t].reshape(16, size)[s])
        untouched = [b for b in range(32) if b not in mapping.values()]
        assert not view[untouched].any()
    arrays[0][5] = 7
    cache_manager.swap_blocks(cpu_cache, pool_cache, {5: 9})
    np.testing.assert_array_equal(slot_bytes(pool_cache, 0, 9), arrays[0][5].view(np.uint8))


def test_swap_blocks_checks(cache_manager):
    blocks = cache_manager.allocate_blocks_cache(host_desc(num_tensors=2, shape=(16, 64)))
    wider = cache_manager.allocate_blocks_cache(host_desc(num_tensors=2, shape=(16, 128)))
    more = cache_manager.allocate_blocks_cache(host_desc(num_tensors=4, shape=(16, 64)))
    contiguous = cache_manager.allocate_cache(host_desc(num_tensors=2, shape=(16, 64)))
    with raises_status(PARAM_INVALID):
        cache_manager.swap_blocks(blocks, wider, {0: 0})
    with raises_status(PARAM_INVALID):
        cache_manager.swap_blocks(blocks, more, {0: 0})
    with raises_status(PARAM_INVALID):
        cache_manager.swap_blocks(blocks, contiguous, {0: 0})
    with raises_status(PARAM_INVALID):
        cache_manager.swap_blocks(blocks, blocks, {16: 0})
    with pytest.raises(TypeError):
        cache_manager.swap_blocks(blocks, wider, {0: "1"})
    device = dd.Cache.create_cpu_cache(host_desc(num_tensors=2, shape=(16, 64)), [1, 2])
    device_desc = dd.CacheDesc(2, [16, 64], dd.DataType.DT_FLOAT16, dd.Placement.DEVICE)
    device_view = dd.Cache(-1, device_desc, [1, 2], True)
    if _has_cuda_driver():  # 1 and 2 are no device memory
        with raises_status(PARAM_INVALID) as info:
            cache_manager.swap_blocks(device, device_view, {0: 0})
        assert "not CUDA device memory" in str(info.value)
    else:
        with raises_status(dd.LLMStatusCode.LLM_FEATURE_NOT_ENABLED) as info:
            cache_manager.swap_blocks(device, device_view, {0: 0})
        assert "no CUDA driver" in str(info.value) and "Placement.HOST" in str(info.value)



def test_large_copy_uses_every_worker(big_datadist):
    cache_manager = big_datadist.cache_manager
    desc = dd.CacheDesc(2, [2, 48 * MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)
    cache = cache_manager.allocate_cache(desc)
    rng = np.random.default_rng(6)
    data = [rng.integers(0, 256, size=48 * MiB, dtype=np.uint8) for _ in range(2)]
    for t in range(2):
        slot_bytes(cache, t, 0)[:] = data[t]
    cache_manager.copy_cache(cache, cache, dst_batch_index=1, src_batch_index=0)
    for t in range(2):
        np.testing.assert_array_equal(slot_bytes(cache, t, 1), data[t])


# -- LLMDataDist lifecycle --------------------------------------------------------


def test_calls_before_init_raise_runtime_error():
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
    with pytest.raises(RuntimeError, match="not initialized"):
        datadist.cache_manager
    datadist.finalize()  # not initialised: no-op
    assert datadist.cluster_id == 1


def test_constructor_checks():
    with pytest.raises(TypeError):
        dd.LLMDataDist(1, 1)
    with pytest.raises(ValueError):
        dd.LLMDataDist(dd.LLMRole.PROMPT, -1)
    with pytest.raises(TypeError):
        dd.LLMDataDist(dd.LLMRole.PROMPT, "1")


def test_one_initialised_instance_per_process(datadist):
    other = dd.LLMDataDist(dd.LLMRole.DECODER, 2)
    with raises_status(dd.LLMStatusCode.LLM_FAILED):
        other.init(make_options())
    datadist.init(make_options())  # already initialised: no-op
    datadist.finalize()
    datadist.finalize()
    other.init(make_options())
    other.finalize()


def test_init_options(monkeypatch):
    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, 4)
    with pytest.raises(TypeError):
        datadist.init([("llm.EnableCacheManager", "1")])
    with raises_status(dd.LLMStatusCode.LLM_FEATURE_NOT_ENABLED):
        datadist.init({})
    with raises_status(PARAM_INVALID):
        datadist.init(make_options() | {"ge.flowGraphMemMaxSize": "1,2"})
    with raises_status(PARAM_INVALID):
        datadist.init({"llm.EnableCacheManager": "1", "llm.HostMemPoolConfig": '{"memory_size": }'})
    with raises_status(PARAM_INVALID):
        datadist.init({"llm.EnableCacheManager": "1", "llm.HostMemPoolConfig": '{"memory_size": 1024, "page_shift": 40}'})
    with raises_status(PARAM_INVALID):
        datadist.init({"llm.EnableCacheManager": "1", "llm.listenIpInfo": "127.0.0.1"})
    options = make_options()
    datadist.init(options)
    assert options["llm.Role"] == "Decoder"
    assert dd.LLMDataDist._live is datadist
    datadist.finalize()
    assert dd.LLMDataDist._live is None


def test_context_manager_finalizes():
    with dd.LLMDataDist(dd.LLMRole.MIX, 5) as datadist:
        datadist.init(make_options())
        cache_manager = datadist.cache_manager
        cache = cache_manager.allocate_cache(host_desc())
    with pytest.raises(RuntimeError):
        datadist.cache_manager
    with raises_status(dd.LLMStatusCode.LLM_ENGINE_FINALIZED):
        cache_manager.copy_cache(cache, cache, 1, 0)


def test_native_data_type_sizes_match():
    from datadist_aio import _native

    for data_type in dd.DataType:
        assert _native.data_type_size(data_type.value) == data_type.itemsize, data_type


def test_upstream_calls_without_meaning_here_raise(datadist):
    with raises_status(PARAM_INVALID):
        datadist.kv_cache_manager
    with raises_status(PARAM_INVALID):
        datadist.check_link_status(2)
    with pytest.raises(RuntimeError, match="not initialized"):
        dd.LLMDataDist(dd.LLMRole.PROMPT, 5).link("comm", {}, "")

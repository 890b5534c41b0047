"""Enums, status codes, exceptions, CacheDesc, Cache and MemInfo."""

import logging
import pickle

import numpy as np
import pytest

from datadist_aio import (
    Cache,
    CacheDesc,
    DataType,
    LLMException,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    Status,
)
from datadist_aio.status import code_from_native, raise_for_status

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID


def assert_llm_error(excinfo, code=PARAM_INVALID):
    assert excinfo.value.status_code is code


# Enums


@pytest.mark.parametrize(
    "enum_cls, members",
    [
        (Placement, {"HOST": 0, "DEVICE": 1}),
        (LLMRole, {"PROMPT": 1, "DECODER": 2, "MIX": 3}),
        (Memtype, {"MEM_TYPE_DEVICE": 0, "MEM_TYPE_HOST": 1}),
        (RegisterMemStatus, {"OK": 0, "PREPARING": 1, "FAILED": 2}),
    ],
)
def test_small_enums(enum_cls, members):
    assert {m.name: m.value for m in enum_cls} == members


DATA_TYPES = [
    ("DT_FLOAT", 0, 4, np.float32),
    ("DT_FLOAT16", 1, 2, np.float16),
    ("DT_INT8", 2, 1, np.int8),
    ("DT_INT32", 3, 4, np.int32),
    ("DT_UINT8", 4, 1, np.uint8),
    ("DT_INT16", 6, 2, np.int16),
    ("DT_UINT16", 7, 2, np.uint16),
    ("DT_UINT32", 8, 4, np.uint32),
    ("DT_INT64", 9, 8, np.int64),
    ("DT_UINT64", 10, 8, np.uint64),
    ("DT_DOUBLE", 11, 8, np.float64),
    ("DT_BOOL", 12, 1, np.bool_),
    ("DT_STRING", 13, 16, "S16"),
    ("DT_BF16", 27, 2, np.float16),
]


@pytest.mark.parametrize("name, value, itemsize, dtype", DATA_TYPES)
def test_data_type(name, value, itemsize, dtype):
    member = DataType[name]
    assert member.value == value
    assert DataType(value) is member
    assert member.itemsize == itemsize
    assert member.numpy_dtype == np.dtype(dtype)
    assert member.numpy_dtype.itemsize == itemsize


def test_data_type_members_complete():
    assert len(DataType) == 14
    with pytest.raises(ValueError):
        DataType(5)


# Status codes


STATUS_CODES = {
    "LLM_SUCCESS": 0,
    "LLM_FAILED": 0xFFFFFFFF,
    "LLM_WAIT_PROCESS_TIMEOUT": 0x5010B001,
    "LLM_KV_CACHE_NOT_EXIST": 0x5010B002,
    "LLM_REPEAT_REQUEST": 0x5010B003,
    "LLM_REQUEST_ALREADY_COMPLETED": 0x5010B004,
    "LLM_PARAM_INVALID": 0x5010B005,
    "LLM_ENGINE_FINALIZED": 0x5010B006,
    "LLM_NOT_YET_LINK": 0x5010B007,
    "LLM_ALREADY_LINK": 0x5010B008,
    "LLM_LINK_FAILED": 0x5010B009,
    "LLM_UNLINK_FAILED": 0x5010B00A,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 0x5010B00B,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": 0x5010B00C,
    "LLM_PROCESSING_LINK": 0x5010B00D,
    "LLM_DEVICE_OUT_OF_MEMORY": 0x5010B00E,
    "LLM_PREFIX_ALREADY_EXIST": 0x5010B00F,
    "LLM_PREFIX_NOT_EXIST": 0x5010B010,
    "LLM_SEQ_LENOVERLIMIT": 0x5010B011,
    "LLM_NO_FREE_BLOCK": 0x5010B012,
    "LLM_BLOCKS_OUT_OF_MEMORY": 0x5010B013,
    "LLM_EXIST_LINK": 0x5010B018,
    "LLM_FEATURE_NOT_ENABLED": 0x5010B019,
    "LLM_TIMEOUT": 0x5010B01A,
    "LLM_LINK_BUSY": 0x5010B01B,
    "LLM_OUT_OF_MEMORY": 0x5010B01C,
    "LLM_AUTH_FAILED": 0x5010B080,  # not upstream
    "LLM_DEVICE_MEM_ERROR": 507053,
    "LLM_SUSPECT_REMOTE_ERROR": 507057,
    "LLM_UNKNOWN_ERROR": -1,
}


def test_status_code_members():
    assert {m.name: m.value for m in LLMStatusCode} == STATUS_CODES
    assert LLMStatusCode.LLM_TIMEOUT.value == 1343270912 + 0x1A


@pytest.mark.parametrize(
    "name", [n for n in STATUS_CODES if n != "LLM_UNKNOWN_ERROR"]
)
def test_code_from_native_known(name):
    assert code_from_native(STATUS_CODES[name]) is LLMStatusCode[name]


@pytest.mark.parametrize(
    "code", [-1, 0x5010B014, 0x5010B017, 0x5010B01D, 1, 12345, 2**40]
)
def test_code_from_native_unknown_is_failed(code):
    assert code_from_native(code) is LLMStatusCode.LLM_FAILED


def test_raise_for_status():
    raise_for_status(0, "nothing")
    with pytest.raises(LLMException) as excinfo:
        raise_for_status(0x5010B01A, "pull_cache failed")
    assert excinfo.value.status_code is LLMStatusCode.LLM_TIMEOUT
    assert "pull_cache failed" in str(excinfo.value)
    assert "0x5010b01a" in str(excinfo.value)
    assert "LLM_TIMEOUT" in str(excinfo.value)
    with pytest.raises(LLMException) as excinfo:
        raise_for_status(0x5010B015, "x")
    assert excinfo.value.status_code is LLMStatusCode.LLM_FAILED


# LLMException and Status


def test_llm_exception():
    err = LLMException("boom", status_code=LLMStatusCode.LLM_LINK_FAILED)
    assert isinstance(err, RuntimeError)
    assert err.status_code is LLMStatusCode.LLM_LINK_FAILED
    assert err.args == ("boom",)
    assert "boom" in str(err) and "LLM_LINK_FAILED" in str(err)
    assert LLMException().status_code is LLMStatusCode.LLM_SUCCESS
    assert "LLM_SUCCESS" in str(LLMException())
    with pytest.raises(AttributeError):
        err.status_code = PARAM_INVALID
    with pytest.raises(TypeError):
        LLMException("x", status_code=5)


def test_llm_exception_pickles():
    err = pickle.loads(pickle.dumps(LLMException("a", 1, status_code=LLMStatusCode.LLM_TIMEOUT)))
    assert type(err) is LLMException
    assert err.args == ("a", 1)
    assert err.status_code is LLMStatusCode.LLM_TIMEOUT


@pytest.mark.parametrize(
    "code, ok",
    [(LLMStatusCode.LLM_SUCCESS, True), (LLMStatusCode.LLM_FAILED, False), (PARAM_INVALID, False)],
)
def test_status(code, ok):
    status = Status(code)
    assert status.status_code is code
    assert status.is_ok() is ok
    assert status == Status(code)


def test_status_rejects_non_code():
    with pytest.raises(TypeError):
        Status(0)


# MemInfo


def test_mem_info():
    info = MemInfo(Memtype.MEM_TYPE_HOST, 0x1000, 4096)
    assert (info.mem_type, info.addr, info.size) == (Memtype.MEM_TYPE_HOST, 0x1000, 4096)
    assert info == MemInfo(Memtype.MEM_TYPE_HOST, 0x1000, 4096)
    assert "0x1000" in repr(info)
    with pytest.raises(AttributeError):
        info.addr = 1


@pytest.mark.parametrize(
    "args",
    [(0, 1, 1), (None, 1, 1), (Memtype.MEM_TYPE_DEVICE, "1", 1), (Memtype.MEM_TYPE_DEVICE, 1, 1.0)],
)
def test_mem_info_type_errors(args):
    with pytest.raises(TypeError):
        MemInfo(*args)


# CacheDesc


def test_cache_desc_defaults_and_properties():
    desc = CacheDesc(4, (8, 16, 2), DataType.DT_FLOAT16)
    assert desc.num_tensors == 4
    assert desc.shape == [8, 16, 2]
    assert desc.data_type is DataType.DT_FLOAT16
    assert desc.placement is Placement.DEVICE
    assert desc.batch_dim == desc.batch_dim_index == 0
    assert desc.batch_size == 8
    assert desc.seq_len_dim_index == -1
    assert desc.kv_tensor_format is None
    assert desc.size == 8 * 16 * 2 * 2
    assert desc.slot_size == 16 * 2 * 2
    assert desc._is_blocks is False
    assert "DT_FLOAT16" in repr(desc) and "[8, 16, 2]" in repr(desc)


def test_cache_desc_explicit_arguments():
    desc = CacheDesc(
        0, [2, 3, 5], DataType.DT_STRING, Placement.HOST, 1, 2, kv_tensor_format="BSH"
    )
    assert desc.num_tensors == 0
    assert desc.batch_dim_index == 1
    assert desc.batch_size == 3
    assert desc.seq_len_dim_index == 2
    assert desc.kv_tensor_format == "BSH"
    assert desc.placement is Placement.HOST
    assert desc.size == 2 * 3 * 5 * 16
    assert desc.slot_size == 3 * 5 * 16


@pytest.mark.parametrize("prop", ["num_tensors", "shape", "batch_dim", "batch_size", "size"])
def test_cache_desc_read_only(prop):
    desc = CacheDesc(1, [1], DataType.DT_INT8)
    with pytest.raises(AttributeError):
        setattr(desc, prop, 1)


def test_cache_desc_shape_is_a_copy():
    desc = CacheDesc(1, [4, 4], DataType.DT_INT8)
    desc.shape.append(9)
    assert desc.shape == [4, 4]


@pytest.mark.parametrize(
    "args, kwargs, exc",
    [
        (("1", [1], DataType.DT_FLOAT), {}, TypeError),
        ((1.0, [1], DataType.DT_FLOAT), {}, TypeError),
        ((-1, [1], DataType.DT_FLOAT), {}, ValueError),
        ((2**32, [1], DataType.DT_FLOAT), {}, ValueError),
        ((1, 4, DataType.DT_FLOAT), {}, TypeError),
        ((1, None, DataType.DT_FLOAT), {}, TypeError),
        ((1, [4, 2.0], DataType.DT_FLOAT), {}, TypeError),
        ((1, [4], 0), {}, TypeError),
        ((1, [4], None), {}, TypeError),
        ((1, [4], DataType.DT_FLOAT), {"placement": 1}, TypeError),
        ((1, [4], DataType.DT_FLOAT), {"batch_dim_index": 0.0}, TypeError),
        ((1, [4], DataType.DT_FLOAT), {"seq_len_dim_index": "0"}, TypeError),
        ((1, [4], DataType.DT_FLOAT), {"seq_len_dim_index": 2**31}, ValueError),
        ((1, [4], DataType.DT_FLOAT), {"kv_tensor_format": 1}, TypeError),
        ((1, [4], DataType.DT_FLOAT), {"batch_dim_index": 1}, LLMException),
        ((1, [4], DataType.DT_FLOAT), {"batch_dim_index": -1}, LLMException),
        ((1, [], DataType.DT_FLOAT), {}, LLMException),
        ((1, [4, 2], DataType.DT_FLOAT), {"seq_len_dim_index": 2}, LLMException),
        ((1, [4, 2], DataType.DT_FLOAT), {"seq_len_dim_index": -2}, LLMException),
        ((1, [4, 2**63], DataType.DT_FLOAT), {}, ValueError),
        ((1, [4, -(2**63) - 1], DataType.DT_FLOAT), {}, ValueError),
    ],
)
def test_cache_desc_errors(args, kwargs, exc):
    with pytest.raises(exc) as excinfo:
        CacheDesc(*args, **kwargs)
    if exc is LLMException:
        assert_llm_error(excinfo)


def test_cache_desc_check_order():
    with pytest.raises(TypeError):
        CacheDesc(1, [], DataType.DT_FLOAT, kv_tensor_format=3)
    with pytest.raises(LLMException):
        CacheDesc(1, [2**63], DataType.DT_FLOAT, batch_dim_index=1)


def test_cache_desc_error_message_names_argument():
    with pytest.raises(TypeError, match="data_type"):
        CacheDesc(1, [1], "fp16")
    with pytest.raises(ValueError, match=r"shape\[1\]"):
        CacheDesc(1, [1, 2**64], DataType.DT_FLOAT)


def test_cache_desc_semantic_error_is_raised_not_logged(caplog):
    """The exception carries the reason; it is not logged at ERROR as well."""
    with caplog.at_level(logging.DEBUG, logger="datadist_aio"):
        with pytest.raises(LLMException, match="batch_dim_index"):
            CacheDesc(1, [4], DataType.DT_FLOAT, batch_dim_index=3)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_cache_desc_negative_dims_are_accepted_but_have_no_size():
    desc = CacheDesc(1, [4, 0, -1], DataType.DT_FLOAT)
    with pytest.raises(LLMException) as excinfo:
        desc.size
    assert_llm_error(excinfo)
    with pytest.raises(LLMException) as excinfo:
        desc.slot_size
    assert_llm_error(excinfo)


def test_cache_desc_size_overflow():
    desc = CacheDesc(1, [2**62, 8], DataType.DT_FLOAT)
    with pytest.raises(LLMException) as excinfo:
        desc.size
    assert_llm_error(excinfo)


def test_cache_desc_update_dim():
    desc = CacheDesc(2, [4, 8], DataType.DT_INT32)
    assert desc.size == 128
    desc.update_dim(1, 16)
    assert desc.shape == [4, 16]
    assert desc.size == 256
    desc.update_dim(0, 2)
    assert desc.batch_size == 4
    assert desc.slot_size == 64
    desc.update_dim(1, 0)
    with pytest.raises(LLMException):
        desc.size


@pytest.mark.parametrize(
    "dim_index, dim_value, exc",
    [
        ("0", 1, TypeError),
        (0, 1.5, TypeError),
        (0, 2**63, ValueError),
        (2, 1, LLMException),
        (-1, 1, LLMException),
    ],
)
def test_cache_desc_update_dim_errors(dim_index, dim_value, exc):
    desc = CacheDesc(2, [4, 8], DataType.DT_INT32)
    with pytest.raises(exc):
        desc.update_dim(dim_index, dim_value)
    assert desc.shape == [4, 8]


# Cache


def host_desc(num_tensors=2, shape=(4, 3), data_type=DataType.DT_FLOAT):
    return CacheDesc(num_tensors, list(shape), data_type, Placement.HOST)


def test_create_cpu_cache():
    desc = host_desc()
    cache = Cache.create_cpu_cache(desc, [0x1000, 0x2000])
    assert cache.cache_id == -1
    assert cache.is_blocks_cache is True
    assert cache.cache_desc is desc
    assert cache.tensor_addrs == [0x1000, 0x2000]
    assert "0x1000" in repr(cache)


@pytest.mark.parametrize(
    "desc, addrs, exc",
    [
        (None, [1, 2], TypeError),
        ("desc", [1, 2], TypeError),
        (host_desc(), (1, 2), TypeError),
        (host_desc(), None, TypeError),
        (host_desc(), [1, "2"], TypeError),
        (host_desc(), [1, 2.0], TypeError),
        (CacheDesc(2, [4], DataType.DT_FLOAT), [1, 2], LLMException),
        (host_desc(), [1], LLMException),
        (host_desc(), [1, 2, 3], LLMException),
        (host_desc(), [1, -2], ValueError),
    ],
)
def test_create_cpu_cache_errors(desc, addrs, exc):
    with pytest.raises(exc) as excinfo:
        Cache.create_cpu_cache(desc, addrs)
    if exc is LLMException:
        assert_llm_error(excinfo)


def test_cache_properties_are_read_only_and_copied():
    cache = Cache(7, host_desc(), [1, 2])
    assert cache.cache_id == 7
    assert cache.is_blocks_cache is False
    cache.tensor_addrs.append(3)
    assert cache.tensor_addrs == [1, 2]
    for prop in ("cache_id", "cache_desc", "tensor_addrs", "is_blocks_cache"):
        with pytest.raises(AttributeError):
            setattr(cache, prop, None)


def numpy_cache(data_type=DataType.DT_FLOAT, shape=(4, 3), num_tensors=2):
    desc = host_desc(num_tensors, shape, data_type)
    arrays = [np.zeros(shape, dtype=data_type.numpy_dtype) for _ in range(num_tensors)]
    cache = Cache(5, desc, [a.ctypes.data for a in arrays], buffers=arrays)
    return cache, arrays


def test_as_numpy_is_a_writable_zero_copy_view():
    cache, arrays = numpy_cache()
    view = cache.as_numpy(1)
    assert view.shape == (4, 3)
    assert view.dtype == np.float32
    assert view.flags.writeable
    view[2, 1] = 7.5
    assert arrays[1][2, 1] == 7.5
    assert arrays[0].sum() == 0
    arrays[1][0, 0] = -1.0
    assert view[0, 0] == -1.0
    assert cache.as_numpy(-1)[2, 1] == 7.5


@pytest.mark.parametrize("name, _value, _itemsize, dtype", DATA_TYPES)
def test_as_numpy_dtypes(name, _value, _itemsize, dtype):
    cache, arrays = numpy_cache(DataType[name], shape=(2, 5), num_tensors=1)
    view = cache.as_numpy(0)
    assert view.dtype == np.dtype(dtype)
    assert view.shape == (2, 5)
    assert view.nbytes == cache.cache_desc.size
    assert view.ctypes.data == arrays[0].ctypes.data


def test_as_numpy_keeps_cache_alive():
    cache, arrays = numpy_cache()
    view = cache.as_numpy(0)
    del cache, arrays
    view[...] = 3.0
    assert float(view.sum()) == 36.0


@pytest.mark.parametrize("index", [2, -3, 100])
def test_as_numpy_bad_index(index):
    cache, _ = numpy_cache()
    with pytest.raises(IndexError):
        cache.as_numpy(index)


def test_as_numpy_index_type():
    cache, _ = numpy_cache()
    with pytest.raises(TypeError):
        cache.as_numpy(0.0)


def test_as_numpy_after_invalidate():
    cache, _ = numpy_cache()
    cache._invalidate()
    assert cache.tensor_addrs == []
    assert cache._buffers is None
    with pytest.raises(LLMException) as excinfo:
        cache.as_numpy(0)
    assert_llm_error(excinfo)

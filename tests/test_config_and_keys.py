"""LLMConfig, LLMClusterInfo, cache keys, transfer configs and LayerSynchronizer."""

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Optional

import pytest

from datadist_aio import (
    BlocksCacheKey,
    CacheKey,
    CacheKeyByIdAndIndex,
    LayerGate,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LlmConfig,
    LLMException,
    LLMRole,
    LLMStatusCode,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

U64 = 2**64 - 1
LE = LLMException


def raises(exc, func, *args, **kwargs):
    """Calls func and checks the error kind; LLMException must carry LLM_PARAM_INVALID."""
    with pytest.raises(exc) as excinfo:
        func(*args, **kwargs)
    if exc is LLMException:
        assert excinfo.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    return excinfo.value


# LLMConfig


def test_llm_config_alias_and_defaults():
    assert LlmConfig is LLMConfig
    config = LLMConfig()
    assert config.ge_options == {}
    assert config.listen_ip_info == ""
    assert config.device_id is None
    assert config.sync_kv_timeout is None
    assert config.mem_pool_cfg == ""
    assert config.host_mem_pool_cfg == ""
    assert config.enable_cache_manager is False
    assert config.enable_remote_cache_accessible is False
    assert config.local_comm_res == ""
    assert config.link_total_time == 0
    assert config.link_retry_count == 1
    assert config.rdma_traffic_class is None
    assert config.rdma_service_level is None
    assert config.deploy_res_path == ""
    assert config.buf_pool_cfg == ""
    assert config.cluster_info == ""
    assert config.output_max_size == ""
    assert config.enable_switch_role is False
    assert config.mem_utilization == 0.95
    assert config.tcp_connections_per_peer is None
    assert config.engine_threads is None
    assert config.generate_options() == {"llm.MemoryUtilization": "0.95"}


GOOD_OPTIONS = [
    ("listen_ip_info", "127.0.0.1:26000", {"llm.listenIpInfo": "127.0.0.1:26000"}),
    ("listen_ip_info", "", {}),
    ("device_id", 3, {"ge.exec.deviceId": "3", "ge.session_device_id": "3"}),
    ("device_id", [2, 5], {"ge.exec.deviceId": "2;5", "ge.session_device_id": "2"}),
    ("device_id", (0,), {"ge.exec.deviceId": "0", "ge.session_device_id": "0"}),
    ("sync_kv_timeout", 500, {"llm.SyncKvCacheWaitTime": "500"}),
    ("sync_kv_timeout", "2000", {"llm.SyncKvCacheWaitTime": "2000"}),
    ("sync_kv_timeout", 2**31 - 1, {"llm.SyncKvCacheWaitTime": str(2**31 - 1)}),
    ("mem_pool_cfg", '{"memory_size": 1024}', {"llm.MemPoolConfig": '{"memory_size": 1024}'}),
    ("mem_pool_cfg", "", {}),
    ("host_mem_pool_cfg", '{"memory_size": 8}', {"llm.HostMemPoolConfig": '{"memory_size": 8}'}),
    ("enable_cache_manager", True, {"llm.EnableCacheManager": "1"}),
    ("enable_cache_manager", False, {"llm.EnableCacheManager": "0"}),
    ("enable_remote_cache_accessible", True, {"llm.EnableRemoteCacheAccessible": "1"}),
    ("enable_remote_cache_accessible", False, {"llm.EnableRemoteCacheAccessible": "0"}),
    ("local_comm_res", "", {"llm.LocalCommRes": ""}),
    ("local_comm_res", '{"x": 1}', {"llm.LocalCommRes": '{"x": 1}'}),
    ("link_total_time", 0, {"llm.LinkTotalTime": "0"}),
    ("link_total_time", 2**32 - 1, {"llm.LinkTotalTime": str(2**32 - 1)}),
    ("link_retry_count", 1, {"llm.LinkRetryCount": "1"}),
    ("link_retry_count", 100, {"llm.LinkRetryCount": "100"}),
    ("rdma_traffic_class", 0, {"llm.RdmaTrafficClass": "0"}),
    ("rdma_traffic_class", 100, {"llm.RdmaTrafficClass": "100"}),
    ("rdma_traffic_class", 132, {"llm.RdmaTrafficClass": "132"}),
    ("rdma_traffic_class", 252, {"llm.RdmaTrafficClass": "252"}),
    ("rdma_service_level", 0, {"llm.RdmaServiceLevel": "0"}),
    ("rdma_service_level", 7, {"llm.RdmaServiceLevel": "7"}),
    ("deploy_res_path", "/opt/res", {"llm.deployResPath": "/opt/res"}),
    ("deploy_res_path", "", {}),
    ("buf_pool_cfg", "cfg", {"llm.BufPoolCfg": "cfg"}),
    ("buf_pool_cfg", "", {}),
    ("cluster_info", "", {}),
    ("output_max_size", 4096, {"llm.OutputMaxSize": "4096"}),
    ("enable_switch_role", True, {"llm.EnableSwitchRole": "1"}),
    ("enable_switch_role", False, {}),
    ("tcp_connections_per_peer", 1, {"llm.TcpConnectionsPerPeer": "1"}),
    ("tcp_connections_per_peer", 64, {"llm.TcpConnectionsPerPeer": "64"}),
    ("engine_threads", 1, {"llm.EngineThreads": "1"}),
    ("engine_threads", 64, {"llm.EngineThreads": "64"}),
]


@pytest.mark.parametrize("prop, value, emitted", GOOD_OPTIONS)
def test_llm_config_option_emits(prop, value, emitted):
    config = LLMConfig()
    setattr(config, prop, value)
    expected = value if not isinstance(value, tuple) else list(value)
    assert getattr(config, prop) == expected
    assert config.generate_options() == {**emitted, "llm.MemoryUtilization": "0.95"}


@pytest.mark.parametrize("value", [0.0, 1.0, 0.5])
def test_llm_config_mem_utilization(value):
    config = LLMConfig()
    config.mem_utilization = value
    assert config.mem_utilization == value
    assert config.generate_options() == {"llm.MemoryUtilization": str(value)}


BAD_OPTIONS = [
    ("ge_options", None, TypeError),
    ("ge_options", [("a", "b")], TypeError),
    ("ge_options", {"a": 1}, TypeError),
    ("ge_options", {1: "a"}, TypeError),
    ("listen_ip_info", None, TypeError),
    ("listen_ip_info", 26000, TypeError),
    ("listen_ip_info", "127.0.0.1", LE),
    ("listen_ip_info", "1.2.3.4:1:2", LE),
    ("listen_ip_info", "127.0.0.1:port", ValueError),
    ("listen_ip_info", "127.0.0.1:65536", ValueError),
    ("device_id", None, TypeError),
    ("device_id", "0", TypeError),
    ("device_id", 1.0, TypeError),
    ("device_id", [0, "1"], TypeError),
    ("device_id", {0}, TypeError),
    ("device_id", -1, LE),
    ("device_id", [0, -1], LE),
    ("device_id", [], LE),
    ("device_id", -(2**40), LE),
    ("device_id", 2**31, ValueError),
    ("device_id", [1, 2**31], ValueError),
    ("sync_kv_timeout", None, TypeError),
    ("sync_kv_timeout", 1.5, TypeError),
    ("sync_kv_timeout", "1.5", LE),
    ("sync_kv_timeout", "-5", LE),
    ("sync_kv_timeout", "", LE),
    ("sync_kv_timeout", "0", LE),
    ("sync_kv_timeout", 0, LE),
    ("sync_kv_timeout", -1, LE),
    ("sync_kv_timeout", 2**31, ValueError),
    ("sync_kv_timeout", str(2**31), ValueError),
    ("mem_pool_cfg", None, TypeError),
    ("mem_pool_cfg", {"memory_size": 1}, TypeError),
    ("host_mem_pool_cfg", 1, TypeError),
    ("enable_cache_manager", 1, TypeError),
    ("enable_cache_manager", "1", TypeError),
    ("enable_remote_cache_accessible", None, TypeError),
    ("local_comm_res", None, TypeError),
    ("link_total_time", "1", TypeError),
    ("link_total_time", 1.0, TypeError),
    ("link_total_time", -1, LE),
    ("link_total_time", 2**32, LE),
    ("link_retry_count", None, TypeError),
    ("link_retry_count", 0, LE),
    ("link_retry_count", 101, LE),
    ("rdma_traffic_class", "4", TypeError),
    ("rdma_traffic_class", -4, ValueError),
    ("rdma_traffic_class", 2**32, ValueError),
    ("rdma_traffic_class", 102, LE),
    ("rdma_traffic_class", 256, LE),
    ("rdma_traffic_class", 1, LE),
    ("rdma_service_level", 1.0, TypeError),
    ("rdma_service_level", -1, ValueError),
    ("rdma_service_level", 8, LE),
    ("deploy_res_path", None, TypeError),
    ("buf_pool_cfg", 0, TypeError),
    ("cluster_info", None, TypeError),
    ("cluster_info", "{not json", json.JSONDecodeError),
    ("cluster_info", "[1, 2]", TypeError),
    ("cluster_info", '{"listen_ip_info": [{"ip": "1.2.3", "port": 1}]}', RuntimeError),
    ("output_max_size", "1", TypeError),
    ("enable_switch_role", 0, TypeError),
    ("mem_utilization", 1, TypeError),
    ("mem_utilization", "0.5", TypeError),
    ("mem_utilization", -0.1, LE),
    ("mem_utilization", 1.5, LE),
    ("mem_utilization", float("nan"), LE),
    ("tcp_connections_per_peer", "2", TypeError),
    ("tcp_connections_per_peer", 0, LE),
    ("tcp_connections_per_peer", 65, LE),
    ("engine_threads", 2.0, TypeError),
    ("engine_threads", 0, LE),
    ("engine_threads", 65, LE),
]


@pytest.mark.parametrize("prop, value, exc", BAD_OPTIONS)
def test_llm_config_option_rejects(prop, value, exc):
    config = LLMConfig()
    before = getattr(config, prop)
    error = raises(exc, setattr, config, prop, value)
    if exc in (TypeError, ValueError, LLMException):
        assert prop.split("_")[0] in str(error)
    assert getattr(config, prop) == before


def test_llm_config_ge_options_merged_first():
    config = LLMConfig()
    config.ge_options = {"ge.custom": "x", "llm.SyncKvCacheWaitTime": "1"}
    config.sync_kv_timeout = 300
    options = config.generate_options()
    assert options["ge.custom"] == "x"
    assert options["llm.SyncKvCacheWaitTime"] == "300"


def test_llm_config_options_accumulate_in_one_dict():
    config = LLMConfig()
    config.listen_ip_info = "10.0.0.1:100"
    first = config.generate_options()
    config.listen_ip_info = ""
    config.enable_cache_manager = True
    second = config.gen_options()
    assert second is first
    assert second["llm.listenIpInfo"] == "10.0.0.1:100"
    assert second["llm.EnableCacheManager"] == "1"


def test_llm_config_bool_for_int_emits_number():
    config = LLMConfig()
    config.device_id = True
    config.sync_kv_timeout = True
    options = config.generate_options()
    assert options["ge.exec.deviceId"] == "1"
    assert options["llm.SyncKvCacheWaitTime"] == "1"


def test_llm_config_cluster_info_encodes_ips():
    raw = json.dumps(
        {
            "cluster_id": 1,
            "listen_ip_info": [{"ip": "1.2.3.4", "port": 26000}, {"ip": 7, "port": 1}],
        }
    )
    config = LLMConfig()
    config.cluster_info = raw
    assert config.cluster_info == raw
    emitted = json.loads(config.generate_options()["llm.ClusterInfo"])
    assert emitted == {
        "cluster_id": 1,
        "listen_ip_info": [{"ip": 0x04030201, "port": 26000}, {"ip": 7, "port": 1}],
    }


def test_llm_config_full_server_options():
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = "127.0.0.1:26000"
    config.enable_cache_manager = True
    config.mem_pool_cfg = '{"memory_size": 104857600}'
    config.sync_kv_timeout = 1000
    config.engine_threads = 4
    config.tcp_connections_per_peer = 2
    assert config.generate_options() == {
        "ge.exec.deviceId": "0",
        "ge.session_device_id": "0",
        "llm.listenIpInfo": "127.0.0.1:26000",
        "llm.EnableCacheManager": "1",
        "llm.MemPoolConfig": '{"memory_size": 104857600}',
        "llm.SyncKvCacheWaitTime": "1000",
        "llm.EngineThreads": "4",
        "llm.TcpConnectionsPerPeer": "2",
        "llm.MemoryUtilization": "0.95",
    }


# LLMClusterInfo


def test_cluster_info_defaults():
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None
    assert info.local_ip_info_list == []
    assert info.remote_ip_info_list == []


@pytest.mark.parametrize(
    "ip, encoded",
    [
        ("1.2.3.4", 0x04030201),
        ("127.0.0.1", 0x0100007F),
        ("0.0.0.0", 0),
        ("255.255.255.255", 0xFFFFFFFF),
        ("192.168.1.10", 0x0A01A8C0),
        (0x0100007F, 0x0100007F),
    ],
)
def test_cluster_info_ip_encoding(ip, encoded):
    info = LLMClusterInfo()
    info.append_local_ip_info(ip, 26000)
    info.append_remote_ip_info(ip, 0)
    assert info.local_ip_info_list == [(encoded, 26000)]
    assert info.remote_ip_info_list == [(encoded, 0)]


def test_cluster_info_lists_are_copies_and_read_only():
    info = LLMClusterInfo()
    info.append_remote_ip_info("10.0.0.2", 1)
    info.append_remote_ip_info("10.0.0.3", 2)
    info.remote_ip_info_list.clear()
    assert len(info.remote_ip_info_list) == 2
    with pytest.raises(AttributeError):
        info.remote_ip_info_list = []


@pytest.mark.parametrize(
    "ip, port, exc",
    [
        (None, 1, TypeError),
        (1.0, 1, TypeError),
        (b"1.2.3.4", 1, TypeError),
        ("1.2.3.4", "1", TypeError),
        ("1.2.3.4", None, TypeError),
        ("1.2.3.4", -1, ValueError),
        ("1.2.3.4", 65536, ValueError),
        (-1, 1, ValueError),
        (2**32, 1, ValueError),
        ("1.2.3", 1, RuntimeError),
        ("1.2.3.256", 1, RuntimeError),
        ("localhost", 1, RuntimeError),
        ("::1", 1, RuntimeError),
        ("[::1]", 1, RuntimeError),
        ("", 1, RuntimeError),
    ],
)
def test_cluster_info_append_errors(ip, port, exc):
    info = LLMClusterInfo()
    raises(exc, info.append_local_ip_info, ip, port)
    raises(exc, info.append_remote_ip_info, ip, port)
    assert info.local_ip_info_list == [] and info.remote_ip_info_list == []


def test_cluster_info_ipv6_message():
    error = raises(RuntimeError, LLMClusterInfo().append_remote_ip_info, "fe80::1", 1)
    assert "IPv4" in str(error) and "fe80::1" in str(error)


def test_cluster_info_remote_fields():
    info = LLMClusterInfo()
    info.remote_cluster_id = U64
    assert info.remote_cluster_id == U64
    info.remote_role_type = LLMRole.DECODER
    assert info.remote_role_type is LLMRole.DECODER
    info.remote_role_type = 1
    assert info.remote_role_type == 1


@pytest.mark.parametrize(
    "prop, value, exc",
    [
        ("remote_cluster_id", None, TypeError),
        ("remote_cluster_id", "1", TypeError),
        ("remote_cluster_id", -1, ValueError),
        ("remote_cluster_id", 2**64, ValueError),
        ("remote_role_type", "PROMPT", TypeError),
        ("remote_role_type", None, TypeError),
    ],
)
def test_cluster_info_remote_field_errors(prop, value, exc):
    raises(exc, setattr, LLMClusterInfo(), prop, value)


# CacheKey


@pytest.mark.parametrize(
    "args, kwargs, expected",
    [
        ((1, 2), {}, (1, 2, 0, U64)),
        ((1, 2, 3, 4), {}, (1, 2, 3, 4)),
        ((), {"cluster_id": 1, "req_id": 2}, (1, 2, 0, U64)),
        ((), {"prompt_cluster_id": 1, "req_id": 2, "model_id": 5}, (1, 2, 5, U64)),
        ((), {"cluster_id": 1, "prompt_cluster_id": 9, "req_id": 2}, (1, 2, 0, U64)),
        ((1,), {"req_id": 2, "prefix_id": 7}, (1, 2, 0, 7)),
        ((1, 2), {"cluster_id": 8, "req_id": 9}, (1, 2, 0, U64)),
        ((1,), {"prompt_cluster_id": 8, "req_id": 2}, (1, 2, 0, U64)),
        ((0, U64, U64, U64), {}, (0, U64, U64, U64)),
        ((True, False), {}, (1, 0, 0, U64)),
    ],
)
def test_cache_key(args, kwargs, expected):
    key = CacheKey(*args, **kwargs)
    assert (key.cluster_id, key.req_id, key.model_id, key.prefix_id) == expected
    assert key.prompt_cluster_id == key.cluster_id


@pytest.mark.parametrize(
    "args, kwargs, exc",
    [
        ((1, 2, 3, 4, 5), {}, LE),
        ((1, 2, 3, 4), {"prefix_id": 4}, LE),
        (
            (),
            {"cluster_id": 1, "prompt_cluster_id": 1, "req_id": 2, "model_id": 0, "prefix_id": 1},
            LE,
        ),
        ((), {"req_id": 2}, LE),
        ((), {}, LE),
        ((1,), {}, LE),
        ((1,), {"model_id": 3}, LE),
        ((1, 2), {"batch_index": 0}, LE),
        ((1.0, 2), {}, TypeError),
        ((1, "2"), {}, TypeError),
        ((1, 2, None), {}, TypeError),
        ((None, 2), {}, TypeError),
        ((), {"prompt_cluster_id": None, "req_id": 2}, TypeError),
        ((-1, 2), {}, ValueError),
        ((1, 2**64), {}, ValueError),
        ((1, 2, -1), {}, ValueError),
        ((1, 2, 0, 2**64), {}, ValueError),
    ],
)
def test_cache_key_errors(args, kwargs, exc):
    raises(exc, CacheKey, *args, **kwargs)


def test_cache_key_equality_and_hash():
    key = CacheKey(1, 2, 3)
    assert key == CacheKey(cluster_id=1, req_id=2, model_id=3)
    assert key != CacheKey(1, 2, 4)
    assert key != CacheKey(1, 2, 3, 0)
    assert key != (1, 2, 3, U64)
    assert len({key, CacheKey(prompt_cluster_id=1, req_id=2, model_id=3)}) == 1
    assert repr(key) == f"CacheKey(cluster_id=1, req_id=2, model_id=3, prefix_id={U64})"
    with pytest.raises(AttributeError):
        key.req_id = 5


# CacheKeyByIdAndIndex


def test_cache_key_by_id_and_index():
    key = CacheKeyByIdAndIndex(U64, -(2**63), 2**32 - 1)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (U64, -(2**63), 2**32 - 1)
    key = CacheKeyByIdAndIndex(cluster_id=2, cache_id=1)
    assert key.batch_index == 0
    assert key == CacheKeyByIdAndIndex(2, 1, 0)
    assert hash(key) == hash(CacheKeyByIdAndIndex(2, 1, 0))
    assert key != CacheKeyByIdAndIndex(2, 1, 1)
    assert repr(key) == "CacheKeyByIdAndIndex(cluster_id=2, cache_id=1, batch_index=0)"


@pytest.mark.parametrize(
    "args, exc",
    [
        ((None, 1), TypeError),
        ((1, 1.0), TypeError),
        ((1, 1, "0"), TypeError),
        ((-1, 1), ValueError),
        ((2**64, 1), ValueError),
        ((1, 2**63), ValueError),
        ((1, -(2**63) - 1), ValueError),
        ((1, 1, -1), ValueError),
        ((1, 1, 2**32), ValueError),
    ],
)
def test_cache_key_by_id_and_index_errors(args, exc):
    raises(exc, CacheKeyByIdAndIndex, *args)


def test_cache_key_by_id_and_index_arity():
    with pytest.raises(TypeError):
        CacheKeyByIdAndIndex(1)
    with pytest.raises(TypeError):
        CacheKeyByIdAndIndex(1, 2, 3, 4)


# BlocksCacheKey


@pytest.mark.parametrize(
    "args, kwargs, expected",
    [
        ((1,), {}, (1, 0)),
        ((1, 2), {}, (1, 2)),
        ((), {"cluster_id": 1, "model_id": 2}, (1, 2)),
        ((), {"prompt_cluster_id": 4}, (4, 0)),
        ((), {"cluster_id": 1, "prompt_cluster_id": 4}, (1, 0)),
        ((3,), {"cluster_id": 9}, (3, 0)),
        ((U64, U64), {}, (U64, U64)),
    ],
)
def test_blocks_cache_key(args, kwargs, expected):
    key = BlocksCacheKey(*args, **kwargs)
    assert (key.cluster_id, key.model_id) == expected
    assert key.prompt_cluster_id == key.cluster_id


@pytest.mark.parametrize(
    "args, kwargs, exc",
    [
        ((1, 2, 3), {}, LE),
        ((1, 2), {"cluster_id": 1}, LE),
        ((), {"cluster_id": 1, "prompt_cluster_id": 1, "model_id": 0}, LE),
        ((), {}, LE),
        ((), {"model_id": 1}, LE),
        ((1,), {"req_id": 1}, LE),
        (("1",), {}, TypeError),
        ((1, 0.0), {}, TypeError),
        ((None,), {}, TypeError),
        ((-1,), {}, ValueError),
        ((1, -1), {}, ValueError),
        ((1, 2**64), {}, ValueError),
    ],
)
def test_blocks_cache_key_errors(args, kwargs, exc):
    raises(exc, BlocksCacheKey, *args, **kwargs)


def test_blocks_cache_key_equality_and_hash():
    key = BlocksCacheKey(1, 2)
    assert key == BlocksCacheKey(prompt_cluster_id=1, model_id=2)
    assert key != BlocksCacheKey(1, 3)
    assert key != CacheKeyByIdAndIndex(1, 2)
    assert hash(key) == hash(BlocksCacheKey(1, 2))
    assert repr(key) == "BlocksCacheKey(cluster_id=1, model_id=2)"


# TransferConfig


def test_transfer_config():
    config = TransferConfig(5, (0x10, 0x20), range(1, 3), 2)
    assert config.dst_cluster_id == 5
    assert config.dst_addrs == [0x10, 0x20]
    assert config.src_layer_range == range(1, 3)
    assert config.src_batch_index == 2
    assert config.dst_layer_range is None
    default = TransferConfig(1, [])
    assert default.src_layer_range is None and default.src_batch_index == 0


@pytest.mark.parametrize(
    "args, exc",
    [
        ((None, [1]), TypeError),
        ((-1, [1]), ValueError),
        ((2**64, [1]), ValueError),
        ((1, None), TypeError),
        ((1, 5), TypeError),
        ((1, {1}), TypeError),
        ((1, [1, "2"]), TypeError),
        ((1, [1, -2]), ValueError),
        ((1, [2**64]), ValueError),
        ((1, [1], (0, 1)), TypeError),
        ((1, [1], range(0, 4, 2)), LE),
        ((1, [1], range(2, 2)), LE),
        ((1, [1], range(3, 1)), LE),
        ((1, [1], range(-1, 2)), LE),
        ((1, [1], None, -1), ValueError),
        ((1, [1], None, 2**32), ValueError),
        ((1, [1], None, "0"), TypeError),
    ],
)
def test_transfer_config_errors(args, exc):
    raises(exc, TransferConfig, *args)


@pytest.mark.parametrize(
    "prop, value, exc",
    [
        ("dst_cluster_id", -1, ValueError),
        ("dst_addrs", None, TypeError),
        ("dst_addrs", [-1], ValueError),
        ("src_layer_range", [0, 1], TypeError),
        ("src_layer_range", range(1, 0), LE),
        ("src_batch_index", 1.0, TypeError),
    ],
)
def test_transfer_config_setters_validate(prop, value, exc):
    config = TransferConfig(1, [1, 2], range(0, 1))
    raises(exc, setattr, config, prop, value)
    assert config.dst_cluster_id == 1 and config.dst_addrs == [1, 2]
    assert config.src_layer_range == range(0, 1) and config.src_batch_index == 0


def test_transfer_config_setters_accept():
    config = TransferConfig(1, [1])
    config.dst_cluster_id = 9
    config.dst_addrs = (3, 4)
    config.src_layer_range = None
    config.src_batch_index = 7
    config.dst_layer_range = range(0, 1)
    assert (config.dst_cluster_id, config.dst_addrs, config.src_batch_index) == (9, [3, 4], 7)
    assert config.src_layer_range is None and config.dst_layer_range == range(0, 1)


# TransferWithCacheKeyConfig


BY_ID = CacheKeyByIdAndIndex(7, 1, 0)
BLOCKS = BlocksCacheKey(8, 0)


def test_transfer_with_cache_key_config():
    config = TransferWithCacheKeyConfig(BY_ID, range(0, 2), range(0, 2), 3)
    assert config.cache_key is BY_ID
    assert config.dst_cluster_id == 7
    assert config.src_layer_range == range(0, 2)
    assert config.dst_layer_range == range(0, 2)
    assert config.src_batch_index == 3


@pytest.mark.parametrize(
    "src, dst",
    [(range(0, 2), range(2, 4)), (range(3, 4), range(0, 1)), (range(0, 40), range(0, 40))],
)
def test_transfer_with_cache_key_config_equal_lengths_accepted(src, dst):
    config = TransferWithCacheKeyConfig(BLOCKS, src, dst)
    assert (config.src_layer_range, config.dst_layer_range) == (src, dst)


@pytest.mark.parametrize(
    "src, dst",
    [(range(2, 4), range(0, 4)), (range(0, 1), range(0, 2)), (range(0, 4), range(2, 4))],
)
def test_transfer_with_cache_key_config_length_mismatch(src, dst):
    raises(LE, TransferWithCacheKeyConfig, BY_ID, src, dst)


@pytest.mark.parametrize(
    "args, kwargs, exc",
    [
        ((None, range(0, 1), range(0, 1)), {}, TypeError),
        ((CacheKey(1, 2), range(0, 1), range(0, 1)), {}, TypeError),
        ((BY_ID,), {}, TypeError),
        ((BY_ID, range(0, 1)), {}, TypeError),
        ((BY_ID, None, range(0, 1)), {}, TypeError),
        ((BY_ID, (0, 1), range(0, 1)), {}, TypeError),
        ((BY_ID, range(0, 4, 2), range(0, 2)), {}, LE),
        ((BY_ID, range(0, 1), range(1, 1)), {}, LE),
        ((BY_ID, range(-1, 1), range(0, 2)), {}, LE),
        ((BY_ID, range(0, 1), range(0, 1), -1), {}, ValueError),
        ((BY_ID, range(0, 1), range(0, 1)), {"src_batch_index": 2**32}, ValueError),
        ((BY_ID, range(0, 1), range(0, 1)), {"src_batch_index": None}, TypeError),
        ((BLOCKS, range(0, 1), range(0, 1), 1), {}, LE),
    ],
)
def test_transfer_with_cache_key_config_errors(args, kwargs, exc):
    raises(exc, TransferWithCacheKeyConfig, *args, **kwargs)


def test_transfer_with_cache_key_config_dst_cluster_follows_key():
    config = TransferWithCacheKeyConfig(BY_ID, range(0, 1), range(0, 1))
    config.cache_key = BLOCKS
    assert config.cache_key is BLOCKS
    assert config.dst_cluster_id == 8
    with pytest.raises(AttributeError):
        config.dst_cluster_id = 1


@pytest.mark.parametrize(
    "prop, value, exc",
    [
        ("cache_key", None, TypeError),
        ("cache_key", CacheKey(1, 2), TypeError),
        ("cache_key", BLOCKS, LE),
        ("src_layer_range", None, TypeError),
        ("src_layer_range", range(0, 3, 3), LE),
        ("dst_layer_range", 2, TypeError),
        ("dst_layer_range", range(5, 5), LE),
        ("src_batch_index", -1, ValueError),
        ("src_batch_index", "1", TypeError),
    ],
)
def test_transfer_with_cache_key_config_setters(prop, value, exc):
    config = TransferWithCacheKeyConfig(BY_ID, range(0, 1), range(0, 1), 2)
    raises(exc, setattr, config, prop, value)
    assert config.cache_key is BY_ID and config.src_batch_index == 2
    assert config.src_layer_range == config.dst_layer_range == range(0, 1)


def test_transfer_with_cache_key_config_blocks_batch_rule_on_setter():
    config = TransferWithCacheKeyConfig(BLOCKS, range(0, 1), range(0, 1))
    raises(LE, setattr, config, "src_batch_index", 1)
    config.src_batch_index = 0
    config.cache_key = BY_ID
    config.src_batch_index = 4
    assert config.src_batch_index == 4


def test_transfer_with_cache_key_config_validate_after_setters():
    config = TransferWithCacheKeyConfig(BY_ID, range(0, 2), range(0, 2))
    config.src_layer_range = range(0, 4)
    raises(LE, config._validate)
    config.dst_layer_range = range(4, 8)
    config._validate()


# LayerSynchronizer


def test_layer_synchronizer_is_abstract():
    with pytest.raises(TypeError):
        LayerSynchronizer()

    class Incomplete(LayerSynchronizer):
        pass

    with pytest.raises(TypeError):
        Incomplete()


def test_layer_synchronizer_sync_subclass():
    class Ready(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
            return layer_index < 2

    sync = Ready()
    assert isinstance(sync, LayerSynchronizer)
    assert sync.synchronize_layer(1, None) is True
    assert sync.synchronize_layer(2, None) is False


async def test_layer_synchronizer_async_subclass():
    class AsyncReady(LayerSynchronizer):
        async def synchronize_layer(
            self, layer_index: int, timeout_in_millis: Optional[int]
        ) -> bool:
            return layer_index == 0

    sync = AsyncReady()
    assert await sync.synchronize_layer(0, None) is True
    assert await sync.synchronize_layer(1, None) is False


def test_a_layer_synchronizer_is_not_watchable_by_default():
    class Ready(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
            return True

    assert Ready().watchable is False
    with pytest.raises(NotImplementedError, match="Ready is not watchable"):
        Ready().watch_layer(0, lambda verdict: None)


def test_layer_gate_decides_each_layer_once_and_calls_its_watchers_on_the_deciding_thread():
    gate = LayerGate()
    assert gate.watchable and gate.verdict(0) is None
    seen: list[tuple[int, bool, str]] = []

    def watcher(layer: int) -> Callable[[bool], None]:
        return lambda verdict: seen.append((layer, verdict, threading.current_thread().name))

    assert gate.watch_layer(0, watcher(0)) is None
    assert gate.watch_layer(0, watcher(0)) is None
    assert gate.watch_layer(1, watcher(1)) is None
    model = threading.Thread(target=lambda: (gate.open(0), gate.refuse(1), gate.refuse(0), gate.open(1)),
                             name="model")
    model.start()
    model.join(10)
    # Both watchers of layer 0 once, on the model's thread; the first call decided each layer.
    assert seen == [(0, True, "model"), (0, True, "model"), (1, False, "model")]
    assert (gate.verdict(0), gate.verdict(1)) == (True, False)
    assert gate.watch_layer(0, watcher(0)) is True and gate.watch_layer(1, watcher(1)) is False
    assert len(seen) == 3  # a decided layer's verdict is returned, nothing called
    for bad in (-1, True, 1.0, "2"):
        with pytest.raises(ValueError, match="layer_index must be an int >= 0"):
            gate.open(bad)  # type: ignore[arg-type]


async def test_layer_gate_synchronize_layer_awaits_a_verdict_from_another_thread():
    gate = LayerGate()
    gate.refuse(3)
    assert await gate.synchronize_layer(3, None) is False
    waiting = asyncio.ensure_future(gate.synchronize_layer(0, 5000))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    threading.Thread(target=gate.open, args=(0,)).start()
    assert await asyncio.wait_for(waiting, 5) is True
    with pytest.raises(asyncio.TimeoutError):
        await gate.synchronize_layer(1, 20)
    gate.open(1)  # a verdict after the wait gave up goes nowhere
    assert await gate.synchronize_layer(1, 20) is True

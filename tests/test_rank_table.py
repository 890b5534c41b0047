"""Two-sided links over a rank table: link / query_register_mem_status / unlink
between processes on loopback."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import pytest

import datadist_aio as dd
from datadist_aio.rank_table import parse_rank_table
from support.peer import LOOPBACK, Peer, PeerGroup, free_port, raises_status

OK = dd.RegisterMemStatus.OK
PREPARING = dd.RegisterMemStatus.PREPARING
FAILED = dd.RegisterMemStatus.FAILED
PARAM_INVALID = dd.LLMStatusCode.LLM_PARAM_INVALID

pytestmark = pytest.mark.timeout(90)


def rank_table(members: list[tuple[int, Optional[int]]], ip: str = LOOPBACK, **extra: Any) -> str:
    """A v1.2 rank table with one server per member: ``(rank, device_port)``
    in order (``None``: no ``device_port``)."""
    servers = []
    for index, (rank, port) in enumerate(members):
        device: dict[str, Any] = {"device_id": str(index), "device_ip": ip, "rank_id": str(rank)}
        if port is not None:
            device["device_port"] = port
        servers.append({"server_id": f"node-{index}", "device": [device]})
    table = {"version": "1.2", "server_count": str(len(servers)), "status": "completed", "server_list": servers}
    table.update(extra)
    return json.dumps(table)


def table_of(peers: list[Peer]) -> tuple[dict[int, int], str]:
    """cluster_rank_info and rank table naming ``peers`` in rank order."""
    info = {peer.cluster_id: rank for rank, peer in enumerate(peers)}
    return info, rank_table([(rank, peer.listen_port) for rank, peer in enumerate(peers)])


def wait_state(peer: Peer, comm_id: int, seconds: float = 20.0) -> dd.RegisterMemStatus:
    """Polls ``query_register_mem_status`` until it is no longer PREPARING."""
    deadline = time.monotonic() + seconds
    while True:
        state = peer.datadist("query_register_mem_status", comm_id)
        if state is not PREPARING or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


def link_all(peers: list[Peer], name: str = "comm") -> list[int]:
    """Every peer calls link (each returns at once), then all are polled to OK."""
    info, table = table_of(peers)
    comm_ids = [peer.datadist("link", name, info, table) for peer in peers]
    for peer, comm_id in zip(peers, comm_ids):
        assert wait_state(peer, comm_id) is OK, peer
    return comm_ids


def blocks_desc() -> dd.CacheDesc:
    return dd.CacheDesc(2, [4, 32], dd.DataType.DT_UINT8, dd.Placement.HOST)


def assert_pull_blocks(puller: Peer, owner: Peer, seed: int) -> None:
    """``puller`` pulls blocks 1 and 2 of the owner's blocks cache of model ``seed``."""
    remote = owner.allocate(blocks_desc(), blocks=True, model_id=seed)
    local = puller.allocate(blocks_desc(), blocks=True)
    data = owner.fill(remote, seed)
    puller.cm("pull_blocks", dd.BlocksCacheKey(prompt_cluster_id=owner.cluster_id, model_id=seed), local, [1, 2], [0, 3])
    for got, sent in zip(puller.read(local), data):
        np.testing.assert_array_equal(got[:32], sent[32:64])
        np.testing.assert_array_equal(got[96:], sent[64:96])
    owner.free(remote)
    puller.free(local)


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


def start(group: PeerGroup, count: int, **options: Any) -> list[Peer]:
    return [
        group.start(f"m{i}", dd.LLMRole.PROMPT if i == 0 else dd.LLMRole.DECODER, 10 + i, options=options)
        for i in range(count)
    ]


def test_two_members_link_at_once_then_move_data_both_ways(group):
    a, b = start(group, 2)
    link_all([a, b])
    assert_pull_blocks(b, a, 1)
    assert_pull_blocks(a, b, 2)  # a only accepted


def test_four_members_link_at_once_and_every_pair_moves_data(group):
    peers = start(group, 4)
    link_all(peers)
    for i, puller in enumerate(peers):
        for j, owner in enumerate(peers):
            if i != j:
                assert_pull_blocks(puller, owner, 4 * i + j)


def test_unlink_removes_both_ends_and_link_again_works(group):
    a, b = start(group, 2)
    comm_a, comm_b = link_all([a, b])
    a.datadist("unlink", comm_a)
    with raises_status(PARAM_INVALID):
        a.datadist("query_register_mem_status", comm_a)
    # b's end is gone as well, though b still holds its comm id.
    deadline = time.monotonic() + 5
    while True:
        try:
            assert_pull_blocks(b, a, 3)
        except dd.LLMException as exc:
            assert exc.status_code is dd.LLMStatusCode.LLM_NOT_YET_LINK
            break
        assert time.monotonic() < deadline, "b can still pull after a unlinked"
        time.sleep(0.02)
    b.datadist("unlink", comm_b)  # its end is already gone: no error
    comm_a, comm_b = link_all([a, b])
    assert_pull_blocks(b, a, 4)
    a.datadist("unlink", comm_a)
    b.datadist("unlink", comm_b)


# The codes on which the public clients try a pull again (omni-infer's list).
RETRIED = {
    dd.LLMStatusCode.LLM_REPEAT_REQUEST, dd.LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
    dd.LLMStatusCode.LLM_PROCESSING_LINK, dd.LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY, dd.LLMStatusCode.LLM_TIMEOUT,
    dd.LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, dd.LLMStatusCode.LLM_LINK_BUSY,
}


@pytest.mark.parametrize("held", ["accepting", "connecting"])
def test_a_pull_that_timed_out_succeeds_when_retried_once_the_peer_is_back(group, held):
    # The owner is held up (SIGSTOP) past sync_kv_timeout: the pull fails with
    # LLM_TIMEOUT and the timeout closes the link. The comm links the pair
    # again once the owner runs; meanwhile a pull fails with a code the
    # clients retry on, and a retried pull then moves the bytes.
    # Owner-served: a one-sided pull needs no owner (test_one_sided.py).
    a, b = start(group, 2, sync_kv_timeout=1000, access="owner")  # a has rank 0 and accepts, b connects
    comm_a, comm_b = link_all([a, b])
    owner, puller = (a, b) if held == "accepting" else (b, a)
    remote = owner.allocate(blocks_desc(), blocks=True, model_id=5)
    local = puller.allocate(blocks_desc(), blocks=True)
    data = owner.fill(remote, 5)
    key = dd.BlocksCacheKey(prompt_cluster_id=owner.cluster_id, model_id=5)
    owner.stop()
    try:
        with raises_status(dd.LLMStatusCode.LLM_TIMEOUT):
            puller.cm("pull_blocks", key, local, [1, 2], [0, 3])
    finally:
        owner.cont()
    deadline = time.monotonic() + 20
    while True:
        try:
            puller.cm("pull_blocks", key, local, [1, 2], [0, 3])
            break
        except dd.LLMException as exc:
            assert exc.status_code in RETRIED, exc
        assert time.monotonic() < deadline, "the pull never succeeded again"
        time.sleep(0.1)
    for got, sent in zip(puller.read(local), data):
        np.testing.assert_array_equal(got[:32], sent[32:64])
        np.testing.assert_array_equal(got[96:], sent[64:96])
    assert wait_state(a, comm_a) is OK and wait_state(b, comm_b) is OK
    assert_pull_blocks(owner, puller, 6)  # both directions again
    a.datadist("unlink", comm_a)
    b.datadist("unlink", comm_b)


def test_a_member_that_never_comes_fails_after_link_total_time(group):
    # Rank 0 waits to accept; rank 1 connects to a port where nobody listens.
    a, b = start(group, 2, link_total_time=1)
    absent = 99
    for peer, info, table in [
        (a, {a.cluster_id: 0, absent: 1}, rank_table([(0, a.listen_port), (1, free_port())])),
        (b, {absent: 0, b.cluster_id: 1}, rank_table([(0, free_port()), (1, b.listen_port)])),
    ]:
        started = time.monotonic()
        comm_id = peer.datadist("link", "lonely", info, table)
        assert peer.datadist("query_register_mem_status", comm_id) is PREPARING
        assert wait_state(peer, comm_id, seconds=10) is FAILED
        elapsed = time.monotonic() - started
        assert 0.9 < elapsed < 1 + 10, f"FAILED after {elapsed:.2f} s with link_total_time 1 s"
        peer.datadist("unlink", comm_id)


def test_repeated_link_is_already_link(group):
    a, b = start(group, 2)
    info, table = table_of([a, b])
    comm_a, comm_b = link_all([a, b])
    with raises_status(dd.LLMStatusCode.LLM_ALREADY_LINK):
        a.datadist("link", "comm", info, table)
    with raises_status(dd.LLMStatusCode.LLM_ALREADY_LINK):
        b.datadist("link", "other-name", info, table)  # the same peer
    assert a.datadist("query_register_mem_status", comm_a) is OK


def test_device_port_defaults_to_the_members_own_listen_port(group):
    # Members on different loopback addresses, one port: the table names no port.
    port = free_port()
    a = group.start("a", dd.LLMRole.PROMPT, 1, options={"listen_ip_info": f"127.0.0.1:{port}"})
    b = group.start("b", dd.LLMRole.DECODER, 2, options={"listen_ip_info": f"127.0.0.2:{port}"})
    servers = [
        {"server_id": "s0", "device": [{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": "0"}]},
        {"server_id": "s1", "device": [{"device_id": "1", "device_ip": "127.0.0.2", "rank_id": "1"}]},
    ]
    table = json.dumps({"version": "1.0", "server_count": "2", "server_list": servers, "status": "completed"})
    info = {1: 0, 2: 1}
    comm_ids = [a.datadist("link", "pd", info, table), b.datadist("link", "pd", info, table)]
    assert [wait_state(p, c) for p, c in zip([a, b], comm_ids)] == [OK, OK]
    assert_pull_blocks(b, a, 5)


def test_a_member_without_listener_listens_at_its_table_entry(group):
    # Rank 0 was started without listen_ip_info: it listens where the table says.
    port = free_port()
    a = group.start("a", dd.LLMRole.PROMPT, 1, listen=False)
    b = group.start("b", dd.LLMRole.DECODER, 2, listen=False)
    table = rank_table([(0, port), (1, free_port())])
    comm_ids = [a.datadist("link", "pd", {1: 0, 2: 1}, table), b.datadist("link", "pd", {1: 0, 2: 1}, table)]
    assert [wait_state(p, c) for p, c in zip([a, b], comm_ids)] == [OK, OK]
    assert a.listen_port == port
    assert_pull_blocks(b, a, 6)


@pytest.mark.parametrize(
    "table",
    [
        "not json",
        "[]",
        "{}",
        '{"server_list": []}',
        '{"server_list": [{"device": []}]}',
        '{"server_list": [{"device": [{"device_id": "0", "rank_id": "0"}]}]}',
        '{"server_list": [{"device": [{"device_ip": "127.0.0.1", "rank_id": "0"}]}]}',
        '{"server_list": [{"device": [{"device_id": "0", "device_ip": "127.0.0.1"}]}]}',
        '{"server_list": [{"device": [{"device_id": "0", "device_ip": "localhost", "rank_id": "0"}]}]}',
        '{"server_list": [{"device": [{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": "x"}]}]}',
        rank_table([(0, 1000), (0, 1001)]),
        rank_table([(0, 1000), (1, 70000)]),
        rank_table([(0, 1000), (1, 1001)], server_count="3"),
        rank_table([(0, 1000), (1, 1001)], super_pod_list=[{"server_list": []}]),
    ],
)
def test_malformed_rank_table_is_param_invalid(table):
    with raises_status(PARAM_INVALID):
        parse_rank_table(table)


def test_link_arguments_are_checked_as_upstream(group):
    (a,) = start(group, 1)
    good = rank_table([(0, a.listen_port), (1, 1000), (2, 1001), (3, 1002), (4, 1003)])
    cases = [
        ({a.cluster_id: 0}, good),  # one member
        ({a.cluster_id: 0, 2: 1, 3: 2, 4: 3, 5: 4}, good),  # five
        ({a.cluster_id: 1, 2: 0}, good),  # ranks not ascending
        ({2: 0, 3: 1}, good),  # this cluster is not a member
        ({a.cluster_id: 0, 2: 7}, good),  # rank 7 is not in the table
        ({a.cluster_id: 0, 2: 1}, "{"),
    ]
    for info, table in cases:
        with raises_status(PARAM_INVALID):
            a.datadist("link", "comm", info, table)
    with raises_status(PARAM_INVALID):
        a.datadist("link", "", {a.cluster_id: 0, 2: 1}, good)
    with pytest.raises(TypeError):
        a.datadist("link", "comm", [(a.cluster_id, 0)], good)
    with pytest.raises(TypeError):
        a.datadist("link", "comm", {a.cluster_id: 0, 2: 1}, json.loads(good))
    with pytest.raises(ValueError):
        a.datadist("link", "comm", {a.cluster_id: 0, 2: -1}, good)
    for method in ("query_register_mem_status", "unlink"):
        with raises_status(PARAM_INVALID):
            a.datadist(method, 12345)


def test_switch_role_waits_for_comm_links_to_go(group):
    options = {"enable_switch_role": True}
    a = group.start("a", dd.LLMRole.MIX, 1, options=options)
    b = group.start("b", dd.LLMRole.DECODER, 2, options=options)
    comm_a, comm_b = link_all([a, b])
    with raises_status(dd.LLMStatusCode.LLM_EXIST_LINK):
        a.datadist("switch_role", dd.LLMRole.PROMPT, {"llm.listenIpInfo": f"{LOOPBACK}:{a.listen_port}"})
    b.datadist("unlink", comm_b)
    a.datadist("unlink", comm_a)
    a.datadist("switch_role", dd.LLMRole.PROMPT, {"llm.listenIpInfo": f"{LOOPBACK}:{a.listen_port}"})
    link_all([a, b], name="again")


def test_options_of_the_clients_are_accepted_and_recorded():
    config = dd.LLMConfig()
    config.device_id = 3
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.enable_switch_role = True
    config.link_total_time = 1080
    config.link_retry_count = 80
    config.sync_kv_timeout = 20000
    options = config.generate_options()
    options["llm.RdmaServiceLevel"] = "4"
    options["llm.RdmaTrafficClass"] = "100"
    with dd.LLMDataDist(dd.LLMRole.MIX, 77) as datadist:
        datadist.init(options)
        recorded = datadist._engine.options_recorded
    assert recorded == {
        "link_total_time_s": 1080,
        "link_retry_count": 80,
        "rdma_service_level": 4,
        "rdma_traffic_class": 100,
        "enable_switch_role": True,
        "sync_kv_timeout_ms": 20000,
    }
    with dd.LLMDataDist(dd.LLMRole.PROMPT, 78) as datadist:
        with raises_status(PARAM_INVALID):
            datadist.init({**options, "llm.LinkRetryCount": "0"})

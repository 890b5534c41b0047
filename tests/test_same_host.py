"""The same-host path between processes: chosen by the handshake, reported by
the link, refused by the kernel or by an option (and then TCP), and robust to
a peer that dies while its memory is being copied.

Every operation kind also runs over both paths in test_transfer.py,
test_layerwise.py and test_peer_failure.py; bytes are checked end to end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import datadist_aio as dd
from support.peer import MiB, PeerGroup, pool_cfg, raises_status, unread_socket_bytes, wait_until
from support.links import accepted_connections, assert_both_ways, blocks_desc, wait_for_path

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINKED = (SUCCESS, [SUCCESS])
A, B, C = 1, 2, 3

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


@pytest.mark.parametrize(
    "initiator, acceptor, path",
    [
        ("auto", "auto", "same_host"),
        ("tcp", "auto", "tcp"),
        ("auto", "tcp", "tcp"),
    ],
)
def test_the_link_reports_its_path_and_both_directions_move_bytes(group, initiator, acceptor, path):
    a = group.start("a", dd.LLMRole.PROMPT, A, options={"transport": initiator})
    b = group.start("b", dd.LLMRole.DECODER, B, options={"transport": acceptor})
    assert a.link(b) == LINKED
    assert a.datadist("link_transport", B) == path
    assert wait_for_path(b, A, path)
    # A same-host link runs on Unix socket pairs, one per connection; its
    # TCP connections carried the handshake only.
    connections = a.engine("link_stats", B)["connections"]
    local = connections if path == "same_host" else 0
    assert connections >= 2
    for x, y in ((a, B), (b, A)):
        stats = x.engine("link_stats", y)
        assert (stats["connections"], stats["local_sockets"]) == (connections, local)
    tcp = connections - local
    assert established_on(b.listen_port, expected=tcp) == tcp
    assert_both_ways(a, b, (10, 11), seed=1)
    with raises_status(dd.LLMStatusCode.LLM_NOT_YET_LINK):
        a.datadist("link_transport", 77)


def established_on(port: int, expected: int, settle_s: float = 30.0) -> int:
    """``accepted_connections(port)``: `expected` as soon as the count is
    that, else the count after `settle_s` (connections that carried a
    handshake only close just after it)."""
    deadline = time.monotonic() + settle_s
    while True:
        count = accepted_connections(port)
        if count == expected or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


def test_a_kernel_refusal_falls_back_to_tcp_for_that_direction(group):
    # B cannot reach A's memory, or A cannot reach B's (which one depends on
    # whether the tests run as root): that direction's operations go over
    # TCP, the other's by kernel copy, and both work.
    a = group.start("a", dd.LLMRole.PROMPT, A)
    b = group.start("b", dd.LLMRole.DECODER, B, prepare="deny_memory_access")
    assert a.link(b) == LINKED
    # The acceptor's path is settled by the link's first frame.
    wait_until(lambda: {a.datadist("link_transport", B), b.datadist("link_transport", A)} == {"tcp", "same_host"},
               "one direction on TCP, the other by kernel copy")
    assert_both_ways(a, b, (20, 21), seed=2)


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_an_initiator_killed_while_the_owner_copies_leaves_the_owner_serving(group, direction):
    # The owner copies out of (push) or into (pull) the initiator's memory
    # when the initiator dies: the owner's copy fails, the owner lives on and
    # serves the next peer. Owner-served ("owner" access): one-sided, the
    # initiator would copy itself, and as fast as it may (test_one_sided.py).
    big = {"host_mem_pool_cfg": pool_cfg(520 * MiB), "access": "owner"}
    initiator = group.start("initiator", dd.LLMRole.PROMPT, A, options=big)
    owner = group.start("owner", dd.LLMRole.DECODER, B, options=big)
    assert initiator.link(owner) == LINKED
    desc = dd.CacheDesc(2, [1, 256 * MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)
    local, remote = initiator.allocate(desc), owner.allocate(desc)
    method = "push_cache" if direction == "push" else "pull_cache"
    handles = [initiator.start_task(method, remote.key(), local) for _ in range(4)]
    assert not all(initiator.task_done(h) for h in handles)
    initiator.kill()
    newcomer = group.start("newcomer", dd.LLMRole.PROMPT, C)
    assert newcomer.link(owner) == LINKED
    assert_both_ways(newcomer, owner, (30, 31), seed=3)


def test_an_owner_held_up_past_the_timeout_writes_nothing_afterwards(group):
    # The owner is stopped with the pull's request already in its socket; the
    # initiator's timeout closes the link and fails the pull. When the owner
    # runs again it must see the closed link before it copies: the
    # initiator's memory, told the pull failed, keeps what it had.
    # Owner-served ("owner" access): a one-sided pull needs no owner (test_one_sided.py).
    initiator = group.start("initiator", dd.LLMRole.DECODER, A, options={"sync_kv_timeout": 1000, "access": "owner"})
    owner = group.start("owner", dd.LLMRole.PROMPT, B, options={"access": "owner"})
    assert initiator.link(owner) == LINKED
    wait_for_path(initiator, B, "same_host")
    remote = owner.allocate(blocks_desc(), blocks=True, model_id=5)
    local = initiator.allocate(blocks_desc(), blocks=True)
    owner.fill(remote, 7)
    before = initiator.fill(local, 8)
    owner.stop()
    try:
        handle = initiator.start_task("pull_blocks", remote.blocks_key(), local, [0, 1, 2], [3, 4, 5])
        with raises_status(dd.LLMStatusCode.LLM_TIMEOUT):
            initiator.wait_task(handle)
    finally:
        owner.cont()
    # The owner's receive thread meets the queued request, then the closed link.
    wait_until(lambda: unread_socket_bytes(owner.pid) == 0 and not owner.engine("has_link", A),
               "the owner reads the queued request and drops the closed link")
    got = initiator.read(local)
    for t in range(4):
        np.testing.assert_array_equal(got[t], before[t])
    assert initiator.link(owner) == LINKED  # the link was closed by the timeout; a new one serves as before
    assert_both_ways(initiator, owner, (10, 11), seed=4)


def test_the_transport_option():
    config = dd.LLMConfig()
    assert config.transport is None and "llm.Transport" not in config.generate_options()
    config.transport = "tcp"
    assert config.generate_options()["llm.Transport"] == "tcp"
    with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID):
        config.transport = "shm"
    with pytest.raises(TypeError):
        config.transport = 1  # type: ignore[assignment]
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, A)
    with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID):
        datadist.init({"llm.EnableCacheManager": "1", "llm.Transport": "udp"})

"""link_clusters / unlink_clusters / switch_role between processes on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import datadist_aio as dd
from support.peer import LOOPBACK, Peer, PeerGroup, cluster_info, free_port, raises_status

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINKED = (SUCCESS, [SUCCESS])
NOT_YET_LINK = dd.LLMStatusCode.LLM_NOT_YET_LINK

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


@pytest.fixture
def a(group: PeerGroup) -> Peer:
    return group.start("a", dd.LLMRole.PROMPT, 1)


@pytest.fixture
def b(group: PeerGroup) -> Peer:
    return group.start("b", dd.LLMRole.DECODER, 2)


def slots_desc() -> dd.CacheDesc:
    return dd.CacheDesc(2, [2, 64], dd.DataType.DT_UINT8, dd.Placement.HOST)


def assert_push_works(src: Peer, dst: Peer, seed: int) -> None:
    """``src`` pushes slot 0 into slot 1 of a fresh cache of ``dst``; only that slot changes."""
    local, remote = src.allocate(slots_desc()), dst.allocate(slots_desc())
    sent = src.fill(local, seed)
    before = dst.fill(remote, seed + 1000)
    src.cm("push_cache", remote.key(1), local)
    for got, data, old in zip(dst.read(remote), sent, before):
        np.testing.assert_array_equal(got[:64], old[:64])
        np.testing.assert_array_equal(got[64:], data[:64])
    src.free(local)
    dst.free(remote)


def assert_pull_works(puller: Peer, owner: Peer, seed: int) -> None:
    """``puller`` pulls slot 1 of a fresh cache of ``owner`` into its own slot 0."""
    remote, local = owner.allocate(slots_desc()), puller.allocate(slots_desc())
    data = owner.fill(remote, seed)
    puller.cm_async("pull_cache", remote.key(1), local, 0)
    for got, sent in zip(puller.read(local), data):
        np.testing.assert_array_equal(got[:64], sent[64:])
    owner.free(remote)
    puller.free(local)


def assert_not_linked(src: Peer, dst: Peer) -> None:
    remote, local = dst.allocate(slots_desc()), src.allocate(slots_desc())
    with raises_status(NOT_YET_LINK):
        src.cm("push_cache", remote.key(), local)
    with raises_status(NOT_YET_LINK):
        src.cm_async("pull_cache", remote.key(), local)
    src.free(local)
    dst.free(remote)


def test_listen_port(group):
    a = group.start("a", dd.LLMRole.PROMPT, 1)
    b = group.start("b", dd.LLMRole.DECODER, 2)
    client = group.start("client", dd.LLMRole.DECODER, 3, listen=False)
    assert type(a.listen_port) is int and type(b.listen_port) is int
    assert 0 < a.listen_port < 65536 and 0 < b.listen_port < 65536
    assert a.listen_port != b.listen_port
    assert client.listen_port is None


def test_link_then_either_side_moves_data(group, a, b):
    assert a.link(b) == LINKED
    assert_push_works(a, b, 1)
    assert_push_works(b, a, 2)  # b only accepted the link
    assert_pull_works(a, b, 3)
    assert_pull_works(b, a, 4)
    # A client that does not listen is reachable over the link it opened.
    client = group.start("client", dd.LLMRole.DECODER, 3, listen=False)
    assert client.link(b) == LINKED
    assert_push_works(b, client, 5)
    assert_pull_works(b, client, 6)
    assert_push_works(client, b, 7)


def test_link_several_clusters_in_one_call(group, a, b):
    c = group.start("c", dd.LLMRole.DECODER, 3)
    clusters = [cluster_info(2, b.listen_port), cluster_info(3, c.listen_port), cluster_info(4, free_port())]
    status, statuses = a.datadist("link_clusters", clusters, 2000)
    assert statuses[:2] == [SUCCESS, SUCCESS]
    assert statuses[2] in (dd.LLMStatusCode.LLM_LINK_FAILED, dd.LLMStatusCode.LLM_TIMEOUT)
    assert status is not SUCCESS
    assert_push_works(a, b, 1)
    assert_push_works(a, c, 2)


def test_link_twice_is_already_link(a, b):
    assert a.link(b) == LINKED
    _, statuses = a.link(b)
    assert statuses == [dd.LLMStatusCode.LLM_ALREADY_LINK]
    _, statuses = b.link(a)  # the link exists on both ends
    assert statuses == [dd.LLMStatusCode.LLM_ALREADY_LINK]
    assert_push_works(a, b, 1)
    assert_push_works(b, a, 2)


def test_wrong_cluster_id_fails_and_leaves_no_link(a, b):
    status, statuses = a.link(99, port=b.listen_port)
    assert statuses == [dd.LLMStatusCode.LLM_LINK_FAILED]
    assert status is not SUCCESS
    assert_not_linked(a, b)
    assert a.link(b) == LINKED
    assert_push_works(a, b, 1)


def test_nobody_listening(a):
    started = time.monotonic()
    status, statuses = a.link(7, port=free_port(), timeout=1000)
    elapsed = time.monotonic() - started
    assert statuses[0] in (dd.LLMStatusCode.LLM_LINK_FAILED, dd.LLMStatusCode.LLM_TIMEOUT)
    assert status is not SUCCESS
    # Bounded by the timeout, not by a wait of its own (slack for a loaded machine).
    assert elapsed < 1 + 10, f"link_clusters took {elapsed:.2f} s with a 1000 ms timeout"


def test_unlink_then_not_yet_link_then_relink(a, b):
    assert a.link(b) == LINKED
    assert_push_works(a, b, 1)
    assert a.unlink(b) == LINKED
    assert_not_linked(a, b)
    # The peer dropped its end as well; it may learn of it just after unlink returns.
    deadline = time.monotonic() + 30
    while True:
        try:
            assert_not_linked(b, a)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert a.link(b) == LINKED
    assert_push_works(a, b, 2)
    assert_push_works(b, a, 3)


def test_force_unlink_on_both_ends_then_relink(a, b):
    assert a.link(b) == LINKED
    assert a.unlink(b, force=True) == LINKED
    assert_not_linked(a, b)
    b.unlink(a, force=True)  # its end may already be gone; only the outcome matters
    assert_not_linked(b, a)
    assert a.link(b) == LINKED
    assert_push_works(a, b, 1)
    assert_push_works(b, a, 2)


def test_switch_role_refused_while_linked(a, b):
    assert a.link(b) == LINKED
    with raises_status(dd.LLMStatusCode.LLM_EXIST_LINK):
        a.datadist("switch_role", dd.LLMRole.DECODER)
    with raises_status(dd.LLMStatusCode.LLM_EXIST_LINK):
        b.datadist("switch_role", dd.LLMRole.PROMPT, {"llm.listenIpInfo": f"{LOOPBACK}:{b.listen_port}"})
    assert_push_works(a, b, 1)  # the refused switches changed nothing
    assert a.unlink(b) == LINKED
    port = b.listen_port
    b.datadist("switch_role", dd.LLMRole.PROMPT, {"llm.listenIpInfo": f"{LOOPBACK}:{port}"})
    assert b.listen_port == port
    a.datadist("switch_role", dd.LLMRole.DECODER)  # no listen address: a stops listening
    assert a.listen_port is None
    assert a.link(b) == LINKED
    assert_push_works(b, a, 2)


def test_link_argument_checks(datadist):
    good = cluster_info(2, 40000)
    unset = dd.LLMClusterInfo()
    unset.append_local_ip_info(LOOPBACK, 0)
    unset.append_remote_ip_info(LOOPBACK, 40000)
    for link in (datadist.link_clusters, datadist.unlink_clusters):
        with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID):
            link([good], 0)
        with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID):
            link([good], -5)
        with pytest.raises(ValueError):
            link([good], 2**31)
        with pytest.raises(TypeError):
            link([good], "3000")
        with pytest.raises(TypeError):
            link([good], 1.5)
        with pytest.raises(TypeError):
            link(good)
        with pytest.raises(TypeError):
            link(None)
        with pytest.raises(TypeError):
            link(["127.0.0.1:40000"])
        with pytest.raises(TypeError):
            link([unset])
    no_local = dd.LLMClusterInfo()
    no_local.remote_cluster_id = 2
    no_local.append_remote_ip_info(LOOPBACK, 40000)
    with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID):
        datadist.link_clusters([no_local])
    with pytest.raises(TypeError):
        datadist.unlink_clusters([good], force="yes")
    two_remotes = cluster_info(2, 40000)
    two_remotes.append_remote_ip_info(LOOPBACK, 40001)
    status, statuses = datadist.link_clusters([two_remotes])  # reported, not raised
    assert statuses == [dd.LLMStatusCode.LLM_PARAM_INVALID] and status is not SUCCESS

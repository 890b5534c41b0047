"""A peer that dies or stalls mid-transfer, and the harness that runs peers."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

import datadist_aio as dd
from support.links import assert_blocks_push, kill_mid_transfer
from support.peer import HAVE_UCX, UCX_PEER_DEATH, UCX_WHY, MiB, Peer, PeerError, PeerGroup, PeerTimeout, pool_cfg, raises_status

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINKED = (SUCCESS, [SUCCESS])
LINK_LOST = (dd.LLMStatusCode.LLM_LINK_FAILED, dd.LLMStatusCode.LLM_TIMEOUT)


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


# -- a peer killed mid-transfer ------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["auto", "tcp", pytest.param("ucx", marks=UCX_PEER_DEATH)])
@pytest.mark.parametrize("direction", ["push", "pull"])
def test_peer_killed_mid_transfer(group, direction, transport):
    timeout_ms = 3000
    big = {"host_mem_pool_cfg": pool_cfg(288 * MiB)}
    options = big | {"sync_kv_timeout": timeout_ms, "transport": transport}
    # UCX links only with peers that say "ucx" too.
    theirs = {"transport": "ucx"} if transport == "ucx" else {}
    survivor = group.start("survivor", dd.LLMRole.PROMPT, 1, options=options)
    victim = group.start("victim", dd.LLMRole.DECODER, 2, options=big | theirs)
    third = group.start("third", dd.LLMRole.DECODER, 3, options=theirs)
    assert survivor.link(victim) == LINKED
    assert survivor.datadist("link_transport", 2) == {"auto": "same_host"}.get(transport, transport)
    assert survivor.link(third) == LINKED
    kill_mid_transfer(survivor, victim, third, direction, timeout_ms)

    # The same cluster comes back on another port and is linked again.
    again = group.start("victim-again", dd.LLMRole.DECODER, 2, options=theirs)
    assert survivor.link(again) == LINKED
    assert_blocks_push(survivor, again, 7, 3)
    assert_blocks_push(again, survivor, 8, 4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "transport", ["auto", pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason=f"no UCX: {UCX_WHY}"))]
)
@pytest.mark.parametrize("via", ["sync", "async"])
def test_stopped_peer_times_out(group, via, transport):
    timeout_ms = 1000
    a = group.start("a", dd.LLMRole.PROMPT, 1, options={"sync_kv_timeout": timeout_ms, "transport": transport})
    b = group.start("b", dd.LLMRole.DECODER, 2, options={"transport": transport})
    assert a.link(b) == LINKED
    assert a.datadist("link_transport", 2) == {"auto": "same_host"}.get(transport, transport)
    desc = dd.CacheDesc(2, [1, 8 * MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)
    local, remote = a.allocate(desc), b.allocate(desc)
    sent = a.fill(local, 5)
    b.stop()
    started = time.monotonic()
    with raises_status(dd.LLMStatusCode.LLM_TIMEOUT):
        a.run(via, "push_cache", remote.key(), local)
    elapsed = time.monotonic() - started
    assert timeout_ms / 1000 <= elapsed < timeout_ms / 1000 + 10, f"timed out after {elapsed:.2f} s"
    b.cont()
    # Recovery: both ends drop whatever is left of the link, then link again.
    a.unlink(b, force=True)
    b.unlink(a, force=True)
    assert a.link(b) == LINKED
    a.run(via, "push_cache", remote.key(), local)
    for got, data in zip(b.read(remote), sent):
        np.testing.assert_array_equal(got, data)
    assert a.close() == 0
    assert b.close() == 0


# -- the harness itself (no network needed) ---------------------------------------------


def test_harness_round_trip_and_cleanup():
    with PeerGroup() as group:
        peer = group.start("solo", dd.LLMRole.PROMPT, 1, listen=False, loop="asyncio")
        desc = dd.CacheDesc(3, [8, 4, 8], dd.DataType.DT_FLOAT16, dd.Placement.HOST)
        ref = peer.allocate(desc, blocks=True, model_id=0)
        assert ref.cache_id == 1 and ref.blocks and ref.cluster_id == 1
        data = peer.fill(ref, 42)
        for got, sent in zip(peer.read(ref), data):
            np.testing.assert_array_equal(got, sent)
        np.testing.assert_array_equal(peer.read(ref, 2), data[2])
        assert peer.cm_async("copy_blocks", ref, {0: [5]}) == [SUCCESS]
        np.testing.assert_array_equal(peer.read(ref, 1)[5 * 64 : 6 * 64], data[1][:64])
        # Errors come back as the same kind, with the status code and the child's traceback.
        with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID) as refused:
            peer.cm("copy_blocks", ref, {0: [8]})
        assert "copy_blocks" in refused.value.__notes__[0]
        with pytest.raises(TypeError):
            peer.cm("copy_blocks", ref, {0: 1})
        with pytest.raises(PeerError):  # a reference to a cache of another process
            peer.cm("copy_blocks", ref._replace(cluster_id=2), {0: [5]})
        registered = peer.register(desc)
        assert registered.cache_id == 2 and not registered.blocks
        peer.free_all()
        with pytest.raises(PeerError, match="no cache"):
            peer.read(ref)
        pid = peer.pid
    assert peer.close() is None  # already closed by the group
    assert not multiprocessing.active_children()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_harness_reports_dead_and_hung_peers():
    with Peer("victim") as victim:
        victim.start(dd.LLMRole.PROMPT, 1, listen=False)
        victim.kill()
        with pytest.raises(PeerError, match="not running"):
            victim.free_all()
    with Peer("hung") as hung:
        hung.start(dd.LLMRole.PROMPT, 1, listen=False)  # a start may take long on a loaded machine
        hung.command_timeout = 0.5
        os.kill(hung.pid, signal.SIGSTOP)  # behind the harness's back: the command cannot be answered
        started = time.monotonic()
        with pytest.raises(PeerTimeout, match="killed"):
            hung.free_all()
        assert time.monotonic() - started < hung.command_timeout + 10
        with pytest.raises(PeerError):
            hung.free_all()
    with Peer("stopped") as stopped:
        stopped.start(dd.LLMRole.PROMPT, 1, listen=False)
        stopped.stop()
        with pytest.raises(PeerError, match="stopped"):
            stopped.free_all()
    assert stopped.close() is None
    assert not multiprocessing.active_children()

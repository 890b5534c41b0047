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
from support.peer import HAVE_UCX, UCX_WHY, MiB, Peer, PeerError, PeerGroup, PeerTimeout, pool_cfg, raises_status

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINKED = (SUCCESS, [SUCCESS])
LINK_LOST = (dd.LLMStatusCode.LLM_LINK_FAILED, dd.LLMStatusCode.LLM_TIMEOUT)


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


# -- a peer killed mid-transfer ------------------------------------------------------


UCX = pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason=f"no UCX: {UCX_WHY}"))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["auto", "tcp", UCX])
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


# Peers killed in a row by test_peer_killed_amid_many_small_ranges (each
# kill a chance for the survivor's end to meet a request of the dead peer).
KILLS = int(os.environ.get("DATADIST_AIO_TEST_KILLS", "20"))


@pytest.mark.timeout(60 + 20 * KILLS)
@pytest.mark.parametrize("transport", ["tcp", UCX])
def test_peer_killed_amid_many_small_ranges(group, transport):
    """Peers killed one after the other while each reads and writes many
    small ranges of the survivor's memory (over UCX each range is a request
    of its own that the survivor's end answers): the survivor's operations
    complete or fail, and it lives on to link again and move checked bytes."""
    desc = dd.CacheDesc(2, [2048, 4096], dd.DataType.DT_UINT8, dd.Placement.HOST)
    # Timeouts are not what this is about: a kill ends the operations at once.
    options = {"sync_kv_timeout": 30000, "transport": transport, "host_mem_pool_cfg": pool_cfg(64 * MiB)}
    theirs = {"transport": "ucx"} if transport == "ucx" else {}
    survivor = group.start("survivor", dd.LLMRole.PROMPT, 1, options=options)
    mine = [survivor.allocate(desc, blocks=True) for _ in range(2)]
    # Blocks in reverse order: no two ranges merge, 4,096 of them an operation.
    backwards, forwards = list(range(2047, -1, -1)), list(range(2048))
    for kill in range(KILLS):
        victim = group.start(f"victim-{kill}", dd.LLMRole.DECODER, 2,
                             options={"host_mem_pool_cfg": pool_cfg(64 * MiB)} | theirs)
        assert survivor.link(victim) == LINKED, f"kill {kill}"
        assert survivor.datadist("link_transport", 2) == transport
        remote = victim.allocate(desc, blocks=True, model_id=5)
        tasks = [
            survivor.start_task(("push_blocks", "pull_blocks")[i % 2], remote.blocks_key(), mine[i % 2], backwards,
                                forwards)
            for i in range(16)
        ]
        assert not survivor.task_done(tasks[-1]), "the operations ended before the peer was killed; make them more"
        victim.kill()
        for task in tasks:
            try:
                assert survivor.wait_task(task) == [SUCCESS]
            except dd.LLMException as exc:
                assert exc.status_code in LINK_LOST, exc
    # The survivor links to the cluster again and moves checked bytes both ways.
    again = group.start("victim-again", dd.LLMRole.DECODER, 2, options=theirs)
    assert survivor.link(again) == LINKED
    assert_blocks_push(survivor, again, 7, 3)
    assert_blocks_push(again, survivor, 8, 4)
    assert survivor.close() == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", UCX])
def test_peer_frozen_mid_operation_then_resumed(group, transport):
    """The owner freezes while it reads and writes many small ranges of the
    survivor's memory; the survivor's operations time out and its link goes
    down. Then the owner resumes, its reads and writes still queued toward
    the survivor, which closed its end: they are dropped, the survivor lives
    on and links again, and no late byte lands in its memory."""
    timeout_ms = 1000
    desc = dd.CacheDesc(2, [2048, 4096], dd.DataType.DT_UINT8, dd.Placement.HOST)
    # The owner moves the bytes (access "owner"): one-sided, the survivor
    # would move them itself, and the owner's freeze would hold nothing.
    options = {"sync_kv_timeout": timeout_ms, "transport": transport, "host_mem_pool_cfg": pool_cfg(64 * MiB),
               "access": "owner"}
    theirs = {"transport": "ucx"} if transport == "ucx" else {}
    survivor = group.start("survivor", dd.LLMRole.PROMPT, 1, options=options)
    victim = group.start("victim", dd.LLMRole.DECODER, 2, options={"host_mem_pool_cfg": pool_cfg(64 * MiB)} | theirs)
    assert survivor.link(victim) == LINKED
    mine = [survivor.allocate(desc, blocks=True) for _ in range(2)]
    remote = victim.allocate(desc, blocks=True, model_id=5)
    victim.fill(remote, 9)
    backwards, forwards = list(range(2047, -1, -1)), list(range(2048))
    tasks = []
    failed = 0
    for i in range(16):
        method = ("push_blocks", "pull_blocks")[i % 2]
        try:
            tasks.append(survivor.start_task(method, remote.blocks_key(), mine[i % 2], backwards, forwards))
        except dd.LLMException as exc:
            # On a loaded machine the first may time out before the last starts.
            assert exc.status_code is dd.LLMStatusCode.LLM_NOT_YET_LINK, exc
            failed += 1
    victim.stop()
    for task in tasks:
        try:
            assert survivor.wait_task(task) == [SUCCESS]
        except dd.LLMException as exc:
            assert exc.status_code in LINK_LOST, exc
            failed += 1
    assert failed > 0, "every operation ended before the peer froze; make them more"
    # New bytes in the memory the peer was writing, once its operations
    # ended: nothing the resumed peer still had queued may change them.
    pulled = mine[1]
    survivor.fill(pulled, 11)
    before = survivor.read(pulled)
    victim.cont()
    # The peer's end learns that the link is gone (its connections closed).
    victim.unlink(survivor, force=True)
    assert survivor.link(victim) == LINKED
    assert_blocks_push(survivor, victim, 7, 3)
    assert_blocks_push(victim, survivor, 8, 4)
    for got, held in zip(survivor.read(pulled), before):
        np.testing.assert_array_equal(got, held)
    assert survivor.close() == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["auto", UCX])
@pytest.mark.parametrize("via", ["sync", "async"])
def test_stopped_peer_times_out(group, via, transport):
    # Owner-served: the stopped owner moves nothing (one-sided pushes need no
    # owner: test_one_sided.py).
    timeout_ms = 1000
    a = group.start("a", dd.LLMRole.PROMPT, 1,
                    options={"sync_kv_timeout": timeout_ms, "transport": transport, "access": "owner"})
    b = group.start("b", dd.LLMRole.DECODER, 2, options={"transport": transport, "access": "owner"})
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
    # The push lands. Its 1 s bound is the stopped peer's: on a machine busy
    # with other work one attempt may exceed it (the link is then made again).
    for attempt in range(3):
        try:
            a.run(via, "push_cache", remote.key(), local)
            break
        except dd.LLMException as exc:
            if exc.status_code is not dd.LLMStatusCode.LLM_TIMEOUT or attempt == 2:
                raise
            a.unlink(b, force=True)
            b.unlink(a, force=True)
            assert a.link(b) == LINKED
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

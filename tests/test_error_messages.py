"""Every LLMException says in words what was wrong: the argument, the index,
the size against its limit, on which side.

The local cases need no peer; the transfer cases run the test process as the
prefill side (cluster A) linked to one decode process (B). A layer-wise
transfer whose peer dies while the synchronizer holds a layer fails with
LLM_LINK_FAILED.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional
from collections.abc import Iterator

import numpy as np
import pytest

import datadist_aio as dd
from datadist_aio import _native
from datadist_aio.cache_task import CacheTask
from support.peer import MiB, Peer, PeerGroup, cluster_info, pool_cfg, raises_status

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
PARAM_INVALID = dd.LLMStatusCode.LLM_PARAM_INVALID
OUT_OF_MEMORY = dd.LLMStatusCode.LLM_OUT_OF_MEMORY
LINK_FAILED = dd.LLMStatusCode.LLM_LINK_FAILED
NOT_YET_LINK = dd.LLMStatusCode.LLM_NOT_YET_LINK
A, B, C = 1, 2, 3
BLOCKS, BLOCK, LAYERS = 8, 256, 2

pytestmark = pytest.mark.timeout(60)


def _datadist(cluster_id: int, rca: bool = True, pool: int = 4 * MiB, access: Optional[str] = None) -> dd.LLMDataDist:
    config = dd.LLMConfig()
    if access is not None:
        config.access = access
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = rca
    config.host_mem_pool_cfg = pool_cfg(pool)
    config.sync_kv_timeout = 5000
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, cluster_id)
    datadist.init(config.generate_options())
    return datadist


def _desc(blocks: int = BLOCKS, layers: int = LAYERS) -> dd.CacheDesc:
    return dd.CacheDesc(2 * layers, [blocks, BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)


@pytest.fixture
def local() -> Iterator[dd.LLMDataDist]:
    datadist = _datadist(A)
    yield datadist
    datadist.finalize()


# -- refused on this side, no peer -----------------------------------------------------


def test_out_of_memory_names_the_sizes(local):
    desc = dd.CacheDesc(2, [1024, 4096], dd.DataType.DT_UINT8, dd.Placement.HOST)  # 8 MiB, the pool has 4
    with raises_status(OUT_OF_MEMORY) as info:
        local.cache_manager.allocate_cache(desc)
    text = str(info.value)
    assert "8388608 bytes" in text and "4194304" in text, text


def test_local_copy_names_the_block(local):
    cm = local.cache_manager
    cache = cm.allocate_blocks_cache(_desc())
    with raises_status(PARAM_INVALID) as info:
        cm.copy_blocks(cache, {9: [1]})
    assert "source block 9 is out of range" in str(info.value) and f"{BLOCKS} blocks" in str(info.value)
    with raises_status(PARAM_INVALID) as info:
        cm.copy_blocks(cache, {0: [1], 2: [1]})
    assert "destination block 1 is named twice" in str(info.value)


@pytest.mark.parametrize("method", ["push_blocks_async", "pull_blocks_async"])
@pytest.mark.parametrize(
    "src, dst, kind, words",
    [
        ([0], [0, -1], ValueError, "dst_blocks[1] must be a uint64 in [0, 18446744073709551615], got -1"),
        ([2**64], [0], ValueError, "src_blocks[0] must be a uint64 in [0, 18446744073709551615], got 18446744073709551616"),
        ([0], [np.int64(0)], TypeError, "dst_blocks[0] must be int, got int64"),
        ([0], (0, 1.0), TypeError, "dst_blocks[1] must be int, got float"),
        ([0], None, TypeError, "dst_blocks must be list or tuple, got NoneType"),
        ([0], [], dd.LLMException, "dst_blocks must not be empty"),
    ],
    ids=["negative", "past-64-bits", "numpy-int", "float-in-tuple", "none", "empty"],
)
def test_block_lists_are_checked_before_the_engine(local, method, src, dst, kind, words):
    """The engine takes block lists only when they pass every check; any other
    list gets the checks' own exception, before any link is looked for."""
    cm = local.cache_manager
    cache = cm.allocate_blocks_cache(_desc())
    with pytest.raises(kind) as info:
        getattr(cm, method)(dd.BlocksCacheKey(C, 0), cache, src, dst)
    assert words in str(info.value), str(info.value)


def test_swap_blocks_names_the_limit(local):
    cm = local.cache_manager
    src, dst = cm.allocate_blocks_cache(_desc()), cm.allocate_blocks_cache(_desc(blocks=4))
    with raises_status(PARAM_INVALID) as info:
        cm.swap_blocks(src, dst, {1: 6})
    assert "destination block 6 is out of range: dst_cache has 4 blocks" in str(info.value)


def test_bad_option_names_it():
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.host_mem_pool_cfg = '{"memory_size": 1024, "page_shift": 40}'
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, A)
    with raises_status(PARAM_INVALID) as info:
        datadist.init(config.generate_options())
    assert "page_shift 40" in str(info.value)
    datadist.finalize()


def test_stale_reason_is_not_reused(local):
    """A refusal's reason belongs to the call that refused: the next call starts clean."""
    cm = local.cache_manager
    cache = cm.allocate_blocks_cache(_desc())
    with raises_status(PARAM_INVALID):
        cm.copy_blocks(cache, {9: [1]})
    cm.copy_blocks(cache, {0: [1]})
    assert _native.last_error_message() == ""


def test_task_raises_with_the_reason_given_for_its_result(local):
    engine = local._engine  # a request settled by hand, as the transport settles one from a peer's answer
    request = engine.create_request(2)
    request.hold()
    request.release(1, PARAM_INVALID.value, False, "peer refused: dst block 7 is out of range (4 blocks)")
    request.release(0, SUCCESS.value)
    task = CacheTask(request, local._dispatcher, "transfer")
    with raises_status(PARAM_INVALID) as info:
        task.result()
    assert "transfer_configs[1]" in str(info.value)
    assert "dst block 7 is out of range (4 blocks)" in str(info.value)
    assert task.get_results() == [SUCCESS, PARAM_INVALID]


def test_a_long_reason_is_cut(local):
    request = local._engine.create_request(1)
    request.hold()
    request.release(0, PARAM_INVALID.value, False, "x" * 5000)
    request.release(0, SUCCESS.value)
    assert len(request.messages()[0]) == 512


# -- refused before a byte goes to the peer ----------------------------------------------


@pytest.fixture(scope="module")
def decoder() -> Iterator[Peer]:
    with PeerGroup() as group:
        yield group.start("b", dd.LLMRole.DECODER, B)


@pytest.fixture
def linked(decoder: Peer) -> Iterator[tuple[dd.LLMDataDist, dd.Cache, dd.BlocksCacheKey]]:
    datadist = _datadist(A)
    try:
        ref = decoder.allocate(_desc(), blocks=True, model_id=7)
        assert datadist.link_clusters([cluster_info(B, decoder.listen_port)], 3000) == (SUCCESS, [SUCCESS])
        cache = datadist.cache_manager.allocate_blocks_cache(_desc())
        yield datadist, cache, ref.blocks_key()
    finally:
        datadist.finalize()
        decoder.free_all()


@pytest.mark.parametrize(
    "src, dst, words",
    [
        ([0, 1, 2], [0, 1], ["differ in length", "3 != 2"]),
        ([0, 99], [0, 1], ["src_blocks[1] = 99 is out of range", f"local cache has {BLOCKS} blocks"]),
        ([0, 1, 2], [5, 6, 5], ["duplicated destination block", "dst_blocks[2] = 5 repeats dst_blocks[0]"]),
    ],
    ids=["lengths", "source-range", "duplicate-destination"],
)
async def test_push_blocks_refusal_names_the_index(linked, src, dst, words):
    datadist, cache, key = linked
    with raises_status(PARAM_INVALID) as info:
        datadist.cache_manager.push_blocks_async(key, cache, src, dst)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_layer_range_too_long(linked):
    datadist, cache, key = linked
    with raises_status(PARAM_INVALID) as info:
        datadist.cache_manager.push_blocks(key, cache, [0], [0], src_layer_range=range(1, 3), dst_layer_range=range(0, 2))
    text = str(info.value)
    assert "layer range too long" in text and f"{LAYERS} layers" in text, text


def test_not_linked_names_the_cluster(linked):
    datadist, cache, _ = linked
    with raises_status(NOT_YET_LINK) as info:
        datadist.cache_manager.push_blocks(dd.BlocksCacheKey(C, 7), cache, [0], [0])
    assert f"no link to cluster {C}" in str(info.value)


@pytest.mark.parametrize("access", ["owner", "one_sided"])
async def test_the_peers_refusal_reaches_the_exception(decoder, access):
    """The owner checks the destination and says why it refused, and the
    awaiting side raises with its words; one-sided, this side checks it
    against the owner's grant of its cache, in the same words."""
    datadist = _datadist(A, access=access)
    try:
        key = decoder.allocate(_desc(), blocks=True, model_id=7).blocks_key()
        assert datadist.link_clusters([cluster_info(B, decoder.listen_port)], 3000) == (SUCCESS, [SUCCESS])
        cache = datadist.cache_manager.allocate_blocks_cache(_desc())
        deadline = time.monotonic() + 10
        while access == "one_sided" and datadist._engine.link_stats(B)["grants_held"] == 0:
            assert time.monotonic() < deadline, "no grant of the decoder's cache"
            await asyncio.sleep(0.01)
        refused = "the peer refused" if access == "owner" else "refused here under the peer's grant"
        with raises_status(PARAM_INVALID) as info:
            await datadist.cache_manager.push_blocks_async(key, cache, [0, 1], [3, 99])
        text = str(info.value)
        assert refused in text and f"ends past the {BLOCKS} slots" in text, text
        with raises_status(PARAM_INVALID) as info:
            await datadist.cache_manager.pull_blocks_async(key, cache, [99], [0])
        text = str(info.value)
        assert refused in text and f"ends past the {BLOCKS} slots" in text, text
        await datadist.cache_manager.push_blocks_async(key, cache, [0], [0])  # the link stays usable
        moved = datadist._engine.link_stats(B)["one_sided_ops"]
        assert (moved == 1) == (access == "one_sided"), moved
    finally:
        datadist.finalize()
        decoder.free_all()


# -- a layer-wise transfer whose peer dies ------------------------------------------------


class _HoldFirstLayer(dd.LayerSynchronizer):
    """Holds layer 0 until released: nothing is sent before the test lets it."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self.go = asyncio.Event()

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        if layer_index == 0:
            self.reached.set()
            await self.go.wait()
        return True


async def test_layerwise_peer_death_is_link_failed():
    with PeerGroup() as group:
        victim = group.start("victim", dd.LLMRole.DECODER, C)
        ref = victim.allocate(_desc(), blocks=True, model_id=9)
        datadist = _datadist(A, access="owner")  # the stopped victim must leave the push in flight
        try:
            assert datadist.link_clusters([cluster_info(C, victim.listen_port)], 3000) == (SUCCESS, [SUCCESS])
            cache = datadist.cache_manager.allocate_blocks_cache(_desc())
            sync = _HoldFirstLayer()
            config = dd.TransferWithCacheKeyConfig(ref.blocks_key(), range(LAYERS), range(LAYERS))
            task = datadist.cache_manager.transfer_cache_async(cache, sync, [config], [0, 1], [2, 3])
            await asyncio.wait_for(sync.reached.wait(), 10)
            victim.kill()
            for _ in range(200):  # the link notices the peer's death
                if not datadist._engine.has_link(C):
                    break
                await asyncio.sleep(0.05)
            sync.go.set()
            with raises_status(LINK_FAILED) as info:
                await asyncio.wait_for(task, 10)
            assert f"the link to cluster {C} was lost before layer 0" in str(info.value)
            assert task.get_results() == [LINK_FAILED]
        finally:
            datadist.finalize()


# -- engine messages through logging ------------------------------------------------------


def test_engine_messages_go_to_logging(caplog):
    from datadist_aio import _logging

    caplog.set_level(logging.DEBUG, logger="datadist_aio")
    _native.log_message(30, "a warning from the engine")
    assert _logging.flush(5.0)
    records = [r for r in caplog.records if r.name == "datadist_aio.native"]
    assert [(r.levelno, r.getMessage()) for r in records] == [(logging.WARNING, "a warning from the engine")]


def test_engine_listen_failure_is_logged_once_not_as_error(caplog):
    caplog.set_level(logging.DEBUG, logger="datadist_aio")
    config = dd.LLMConfig()
    config.listen_ip_info = "203.0.113.1:1"  # an address this host does not have
    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, B)
    with pytest.raises(dd.LLMException) as info:
        datadist.init(config.generate_options())
    datadist.finalize()
    from datadist_aio import _logging

    _logging.flush(5.0)
    assert "203.0.113.1" in str(info.value) or info.value.status_code is not SUCCESS
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_engine_thread_logs_while_python_is_busy(caplog):
    """A link going down is logged by a transport thread. It never waits for
    the interpreter: the transfer fails at once even while the loop's thread
    keeps the GIL busy, and the message reaches logging afterwards."""
    from datadist_aio import _logging

    caplog.set_level(logging.WARNING, logger="datadist_aio")
    with PeerGroup() as group:
        victim = group.start("victim", dd.LLMRole.DECODER, C)
        ref = victim.allocate(_desc(), blocks=True, model_id=11)
        datadist = _datadist(A, access="owner")  # the stopped victim must leave the push in flight
        try:
            assert datadist.link_clusters([cluster_info(C, victim.listen_port)], 3000) == (SUCCESS, [SUCCESS])
            cache = datadist.cache_manager.allocate_blocks_cache(_desc())
            datadist.cache_manager.push_blocks(ref.blocks_key(), cache, [0], [0])
            victim.stop()  # the next push stays unanswered: in flight when the peer dies
            task = datadist.cache_manager.push_blocks_async(ref.blocks_key(), cache, [1], [1])
            victim.kill()
            deadline = time.monotonic() + 10
            while datadist._engine.has_link(C):  # the GIL stays busy here: no await, no sleep
                assert time.monotonic() < deadline, "the link never noticed the peer's death"
            with raises_status(LINK_FAILED):
                await asyncio.wait_for(task, 10)
            assert _logging.flush(5.0)
        finally:
            datadist.finalize()
    native = [r for r in caplog.records if r.name == "datadist_aio.native"]
    assert any(f"link to cluster {C}" in r.getMessage() and r.levelno == logging.WARNING for r in native), native

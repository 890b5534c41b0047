"""One connection, many I/O threads: two threads never handle one
connection's frames at once.

A connection is armed again from off the I/O loop (a frame queued by the
caller's thread, the end of a staged send or of a blocking receive) while
an earlier event of the same connection may still be on its way to an I/O
thread. The second event must leave the connection to the thread that runs
it: two threads reading one connection would handle a frame twice (an
answer to a push settled already fails the link).

Both ends run 16 I/O threads over a single TCP connection, and 16 pushes
are in flight at a time, each larger than a direct send (so its frame is
queued and the connection armed by the caller's thread) while the acks of
the others arrive. Every push must succeed, and the owner's cache holds the
bytes of the last round. Slow (about a minute): it takes tens of thousands
of pushes for the race to show on two cores.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.resource_tracker
import traceback
from typing import Any

import numpy as np
import pytest

import datadist_aio as dd

BLOCKS, BLOCK = 64, 128 << 10  # frames of 4 blocks: past a direct send (64 KiB)
IN_FLIGHT = 16
PUSHES = 80_000
OWNER, INITIATOR = 2, 1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
multiprocessing.resource_tracker.ensure_running()


def _engine(role: Any, cluster_id: int, listen: bool) -> Any:
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = f'{{"memory_size": {64 << 20}}}'
    config.transport = "tcp"
    config.io_threads = 16
    config.tcp_connections_per_peer = 1
    config.sync_kv_timeout = 30000
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    datadist = dd.LLMDataDist(role, cluster_id)
    datadist.init(config.generate_options())
    return datadist


def _desc() -> Any:
    return dd.CacheDesc(2, [BLOCKS, BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)


def _owner(conn: Any) -> None:
    try:
        datadist = _engine(dd.LLMRole.PROMPT, OWNER, listen=True)
        cache = datadist.cache_manager.allocate_blocks_cache(_desc(), dd.BlocksCacheKey(OWNER, 1))
        conn.send(datadist.listen_port)
        if conn.poll(540) and conn.recv() == "read":
            conn.send([cache.as_numpy(t).copy() for t in range(2)])
            conn.recv()
        datadist.finalize()
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send(traceback.format_exc())


async def _push_all(datadist: Any, port: int) -> tuple[int, list[str], list[np.ndarray]]:
    cluster = dd.LLMClusterInfo()
    cluster.remote_cluster_id = OWNER
    cluster.append_remote_ip_info("127.0.0.1", port)
    cluster.append_local_ip_info("127.0.0.1", 0)
    ret, rets = datadist.link_clusters([cluster], 10000)
    assert ret == dd.LLMStatusCode.LLM_SUCCESS, rets
    cm = datadist.cache_manager
    cache = cm.allocate_blocks_cache(_desc())
    mine = [cache.as_numpy(t) for t in range(2)]
    rng = np.random.default_rng(7)
    for t in range(2):
        mine[t][:] = rng.integers(0, 256, mine[t].shape, dtype=np.uint8)
    key = dd.BlocksCacheKey(OWNER, 1)
    failures: list[str] = []
    done = 0

    async def push(i: int) -> None:
        nonlocal done
        blocks = [(i * 4 + j) % BLOCKS for j in range(4)]
        try:
            await cm.push_blocks_async(key, cache, blocks, blocks)
            done += 1
        except dd.LLMException as exc:
            failures.append(f"push {i}: {exc}")

    for first in range(0, PUSHES, IN_FLIGHT):
        await asyncio.gather(*(push(first + k) for k in range(IN_FLIGHT)))
        if failures:
            break
    return done, failures, mine


def test_two_threads_never_handle_one_connection() -> None:
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(theirs,))
    owner.start()
    theirs.close()
    datadist = None
    try:
        assert mine.poll(60), "the owner did not start"
        port = mine.recv()
        assert isinstance(port, int), port
        datadist = _engine(dd.LLMRole.DECODER, INITIATOR, listen=False)
        done, failures, expect = asyncio.run(_push_all(datadist, port))
        assert not failures, f"{len(failures)} pushes failed after {done} succeeded; the first: {failures[0]}"
        assert done == PUSHES
        # Every block was pushed in the rounds: the owner holds this end's bytes.
        mine.send("read")
        assert mine.poll(120), "the owner did not answer"
        got = mine.recv()
        assert not isinstance(got, str), got
        for t in range(2):
            np.testing.assert_array_equal(got[t], expect[t], err_msg=f"tensor {t}")
        mine.send("done")
    finally:
        if datadist is not None:
            datadist.finalize()
        owner.join(30)
        if owner.is_alive():
            owner.kill()
            owner.join(10)
        mine.close()

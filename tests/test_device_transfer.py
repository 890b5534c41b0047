"""Transfers of DEVICE caches between two engines, on the CUDA driver
stand-in (tests/cuda_standin): every operation (push and pull of caches and
of blocks, layer ranges, transfer_cache_async) between every mix of host and
device memory, over TCP links and over same-host links.

The stand-in maps device memory without host access, so a host read or
write of a device address kills the process: a transfer that completes here
moved its device bytes through staging buffers. The bytes that arrived are
checked by reading device memory back with the stand-in's cuMemcpyDtoH, and
once through swap_blocks into a HOST cache.

Each test runs an owner and an initiator, each in a spawned process of its
own (the driver is loaded once per process), talking over a Pipe.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from datadist_aio.bench.cuda_driver import CudaDriver  # noqa: E402
from support.device import (  # noqa: E402,F401  (standin: the fixture)
    BLOCK,
    BLOCKS,
    INITIATOR,
    MIXES,
    MODEL,
    OWNER,
    PER_LAYER,
    SLOT,
    TENSORS,
    TIMEOUT_S,
    Caches,
    Remote,
    _blocks,
    _check_local,
    _child,
    _desc,
    _engine,
    _pattern,
    _recv,
    _slots,
    frames_sent,
    owner_serves,
    run_pair,
    standin,
    wait_for_grants,
)

def initiator_moves_everything(conn: Any, transport: str, access: str = "owner") -> None:
    import datadist_aio as dd
    from support.peer import cluster_info

    class Released(dd.LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: Any) -> bool:
            return True

    code = dd.LLMStatusCode
    cuda = CudaDriver()
    port, ids, _ = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, transport, listen=False, access=access)
    cm = datadist.cache_manager
    status, statuses = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == code.LLM_SUCCESS and statuses == [code.LLM_SUCCESS], (status, statuses)
    expected_path = "tcp" if transport == "tcp" else "same_host"
    assert datadist.link_transport(OWNER) == expected_path
    if access == "one_sided":
        wait_for_grants(datadist, len(ids))  # each of the owner's caches, before the first operation
    local = Caches(cm, cuda, bind_blocks=False)
    remote = Remote(conn, ids)
    seed = 100
    src_blocks, dst_blocks = [0, 1, 2, 3, 9, 10, 23], [5, 6, 7, 8, 0, 22, 11]
    # Every byte the operations of one mix move (those refused move none).
    moved = (2 * len(src_blocks) * TENSORS + PER_LAYER + TENSORS) * BLOCK + TENSORS * 20 * 1000 + (
        2 * TENSORS + PER_LAYER) * SLOT
    for mine, theirs in MIXES:
        what = f"{transport}, initiator {mine}, owner {theirs}"
        before_stats = _stats(conn, datadist)
        copies_2d = cuda.copies_2d()
        lb, rb, ls, rs = f"blocks-{mine}", f"blocks-{theirs}", f"slots-{mine}", f"slots-{theirs}"
        blocks_key = dd.BlocksCacheKey(OWNER, MODEL[theirs])

        # push_blocks: every layer, then one layer into another.
        sent = local.fill(lb, seed := seed + 1)
        remote.fill(rb, seed := seed + 1)
        cm.push_blocks(blocks_key, local.caches[lb], src_blocks, dst_blocks)
        for t in range(TENSORS):
            _blocks(remote.expect[rb][t])[dst_blocks] = _blocks(sent[t])[src_blocks]
        remote.check(rb, f"push_blocks ({what})")
        cm.push_blocks(blocks_key, local.caches[lb], [4], [12], src_layer_range=range(1, 2), dst_layer_range=range(0, 1))
        for t in range(PER_LAYER):
            _blocks(remote.expect[rb][t])[12] = _blocks(sent[PER_LAYER + t])[4]
        remote.check(rb, f"push_blocks of layer 1 into layer 0 ({what})")

        # pull_blocks.
        before = local.fill(lb, seed := seed + 1)
        remote.fill(rb, seed := seed + 1)
        cm.pull_blocks(blocks_key, local.caches[lb], src_blocks, dst_blocks)
        for t in range(TENSORS):
            _blocks(before[t])[dst_blocks] = _blocks(remote.expect[rb][t])[src_blocks]
        _check_local(local.read(lb), before, f"pull_blocks ({what})")

        # pull_block_ranges: a whole block, and a strided row (a slice of every "token").
        rows = [(0, 0, 1, 0, BLOCK, 1, 0, 0), (3, 100, 7, 50, 1000, 20, 4000, 4096)]
        cm.pull_block_ranges(blocks_key, local.caches[lb], rows)
        for t in range(TENSORS):
            theirs_t, mine_t = _blocks(remote.expect[rb][t]), _blocks(before[t])
            mine_t[1] = theirs_t[0]
            for j in range(20):
                mine_t[7, 50 + j * 4096:50 + j * 4096 + 1000] = theirs_t[3, 100 + j * 4000:100 + j * 4000 + 1000]
        _check_local(local.read(lb), before, f"pull_block_ranges ({what})")

        # push_cache (slot 0 into the owner's slot 1), pull_cache (its slot 0 into slot 1 here).
        slots_key = dd.CacheKeyByIdAndIndex(OWNER, ids[rs], 1)
        sent = local.fill(ls, seed := seed + 1)
        remote.fill(rs, seed := seed + 1)
        cm.push_cache(slots_key, local.caches[ls], 0)
        for t in range(TENSORS):
            _slots(remote.expect[rs][t])[1] = _slots(sent[t])[0]
        remote.check(rs, f"push_cache ({what})")
        before = local.read(ls)
        cm.pull_cache(dd.CacheKeyByIdAndIndex(OWNER, ids[rs], 0), local.caches[ls], 1)
        for t in range(TENSORS):
            _slots(before[t])[1] = _slots(remote.expect[rs][t])[0]
        _check_local(local.read(ls), before, f"pull_cache ({what})")

        # transfer_cache_async: layer by layer, slot 1 here into the owner's slot 0, layers swapped.
        sent = local.fill(ls, seed := seed + 1)
        remote.fill(rs, seed := seed + 1)
        config = dd.TransferWithCacheKeyConfig(dd.CacheKeyByIdAndIndex(OWNER, ids[rs], 0), range(0, 1), range(1, 2), 1)

        async def layer_wise() -> Any:
            return await cm.transfer_cache_async(local.caches[ls], Released(), [config])

        assert asyncio.run(layer_wise()) == [code.LLM_SUCCESS]
        for t in range(PER_LAYER):
            _slots(remote.expect[rs][PER_LAYER + t])[0] = _slots(sent[t])[1]
        remote.check(rs, f"transfer_cache_async ({what})")

        # A range the owner does not have: refused by the owner, nothing written on either side.
        remote.fill(rb, seed := seed + 1)
        with pytest.raises(dd.LLMException) as refused:
            cm.push_blocks(blocks_key, local.caches[lb], [0, 1], [2, BLOCKS])
        assert refused.value.status_code is code.LLM_PARAM_INVALID, refused.value
        remote.check(rb, f"a refused push_blocks ({what})")
        before = local.fill(lb, seed := seed + 1)
        with pytest.raises(dd.LLMException) as refused:
            cm.pull_blocks(blocks_key, local.caches[lb], [1, BLOCKS + 5], [0, 1])
        assert refused.value.status_code is code.LLM_PARAM_INVALID, refused.value
        _check_local(local.read(lb), before, f"a refused pull_blocks ({what})")
        _check_paths(before_stats, _stats(conn, datadist), transport, access, mine, theirs, moved)
        if transport != "tcp" and access == "one_sided" and theirs == "device":
            # The strided rows of pull_block_ranges went as 2D copies on this end's streams.
            assert cuda.copies_2d() > copies_2d, what

    # Device memory read back through a HOST cache too (swap_blocks), as a user would.
    back = cm.allocate_blocks_cache(_desc("host", True))
    cm.swap_blocks(local.caches["blocks-device"], back, {i: i for i in range(BLOCKS)})
    _check_local([back.as_numpy(t).reshape(-1) for t in range(TENSORS)], local.read("blocks-device"), "swap_blocks")
    cm.deallocate_blocks_cache(back)
    conn.send(("transport",))
    assert _recv(conn) == expected_path
    conn.send(("quit",))
    local.free()
    datadist.finalize()


def _stats(conn: Any, datadist: Any) -> tuple[dict[str, int], dict[str, int]]:
    """Both ends' counts of the paths device bytes took on the link (this end's, the owner's)."""
    conn.send(("stats",))
    return datadist._engine.link_stats(OWNER), _recv(conn)


def _check_paths(before: Any, after: Any, transport: str, access: str, mine: str, theirs: str, moved: int) -> None:
    """Which path the bytes of one mix took: on a same-host link, device
    memory of the initiator moves device to device through CUDA IPC, every
    byte of it, and nothing is staged; device memory of the owner alone is
    staged by the owner. Over TCP, everything on a device is staged.
    One-sided (same host): no frame at all, the owner serving nothing; the
    initiator opens the owner's device memory and copies on its own
    streams, or stages its own device memory into the owner's host memory."""
    (mine0, theirs0), (mine1, theirs1) = before, after
    delta = {key: mine1[key] - mine0[key] for key in mine1} | {
        "owner_" + key: theirs1[key] - theirs0[key] for key in theirs1}
    what = f"{transport}, access {access}, initiator {mine}, owner {theirs}: {delta}"
    if transport != "tcp" and access == "one_sided":
        assert delta["framed_ops"] == 0 and delta["owner_owner_served_ops"] == 0, what
        assert delta["one_sided_bytes_written"] + delta["one_sided_bytes_read"] == moved, what
        assert delta["one_sided_device_bytes"] == (moved if theirs == "device" else 0), what
        assert delta["one_sided_staged_bytes"] == (moved if theirs == "host" else 0), what
        assert delta["ipc_frames"] == delta["staged_frames"] == 0, what
        assert delta["owner_ipc_bytes_served"] == delta["owner_staged_bytes_served"] == 0, what
    elif transport != "tcp" and mine == "device":
        assert delta["ipc_frames"] > 0 and delta["staged_frames"] == 0, what
        assert delta["owner_ipc_bytes_served"] == moved and delta["owner_staged_bytes_served"] == 0, what
        # Served from the stream: every frame whose copies were queued (those
        # refused before are not) answered by its callback, no owner thread waiting.
        assert 0 < delta["owner_device_frames_served"] <= delta["ipc_frames"], what
        assert delta["owner_device_answers_from_stream"] == delta["owner_device_frames_served"], what
        assert delta["owner_device_stream_waits"] == 0, what
    else:
        assert delta["ipc_frames"] == 0 and delta["owner_ipc_bytes_served"] == 0, what
        assert (delta["staged_frames"] > 0) == (mine == "device"), what
        assert (delta["owner_staged_bytes_served"] > 0) == (theirs == "device"), what
        # Staged by the owner: its threads wait for the staging copies, chunk by chunk.
        assert (delta["owner_device_stream_waits"] > 0) == (theirs == "device"), what
        assert delta["owner_device_frames_served"] == 0, what
    assert delta["ipc_fallbacks"] == 0, what


@pytest.mark.parametrize("transport,access", [("tcp", "owner"), ("auto", "owner"), ("auto", "one_sided")])
def test_every_operation_between_host_and_device_caches(standin: Path, transport: str, access: str) -> None:
    run_pair(standin, owner_serves, initiator_moves_everything, transport, access)


def initiator_sends_layers_to_addresses(conn: Any, transport: str) -> None:
    """transfer_cache_async with TransferConfig: the owner's raw tensor
    addresses, device or host, which it accepts only inside its own tensors."""
    import datadist_aio as dd
    from support.peer import cluster_info

    class Released(dd.LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: Any) -> bool:
            return True

    code = dd.LLMStatusCode
    cuda = CudaDriver()
    port, _, addrs = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, transport, listen=False, rca=False)
    cm = datadist.cache_manager
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == code.LLM_SUCCESS
    local = Caches(cm, cuda, bind_blocks=False)
    remote = Remote(conn, {})
    seed = 500
    for mine, theirs in MIXES:
        what = f"{transport}, initiator {mine}, owner {theirs}"
        ls, rs = f"slots-{mine}", f"slots-{theirs}"
        sent = local.fill(ls, seed := seed + 1)
        remote.fill(rs, seed := seed + 1)
        # Source layer 1 (slot 0) into the owner's layer 0, slot 1; source layer 0 (slot 1) into layer 1, slot 0.
        to_slot1 = [addrs[rs][i] + SLOT for i in range(PER_LAYER)]
        to_slot0 = [addrs[rs][PER_LAYER + i] for i in range(PER_LAYER)]
        configs = [dd.TransferConfig(OWNER, to_slot1, range(1, 2), 0), dd.TransferConfig(OWNER, to_slot0, range(0, 1), 1)]

        async def layer_wise() -> Any:
            return await cm.transfer_cache_async(local.caches[ls], Released(), configs)

        assert asyncio.run(layer_wise()) == [code.LLM_SUCCESS, code.LLM_SUCCESS]
        for i in range(PER_LAYER):
            _slots(remote.expect[rs][i])[1] = _slots(sent[PER_LAYER + i])[0]
            _slots(remote.expect[rs][PER_LAYER + i])[0] = _slots(sent[i])[1]
        remote.check(rs, f"transfer_cache_async to addresses ({what})")
        # One byte past the owner's tensor: refused, nothing written.
        remote.fill(rs, seed := seed + 1)
        bad = [addrs[rs][0] + SLOT + 1, addrs[rs][1]]
        configs = [dd.TransferConfig(OWNER, bad, range(0, 1), 1)]
        with pytest.raises(dd.LLMException) as refused:
            asyncio.run(layer_wise())
        assert refused.value.status_code is code.LLM_PARAM_INVALID and "not inside one tensor" in str(refused.value)
        remote.check(rs, f"a refused transfer to addresses ({what})")
    conn.send(("quit",))
    local.free()
    datadist.finalize()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_layer_wise_transfers_to_device_addresses(standin: Path, transport: str) -> None:
    run_pair(standin, owner_serves, initiator_sends_layers_to_addresses, transport)


# -- a peer that dies mid-transfer -------------------------------------------------------------------


def owner_dies(conn: Any, transport: str) -> None:
    """Serves device caches until it is killed by the test."""
    import datadist_aio as dd

    datadist = _engine(dd.LLMRole.PROMPT, OWNER, transport, listen=True)
    big = dd.CacheDesc(TENSORS, [16, 1 << 20], dd.DataType.DT_UINT8, dd.Placement.DEVICE)
    cache = datadist.cache_manager.allocate_blocks_cache(big, dd.BlocksCacheKey(OWNER, MODEL["device"]))
    conn.send((datadist.listen_port, os.getpid(), cache.cache_id))
    _recv(conn)  # never answered: the test kills this process
    raise AssertionError("the owner was not killed")


def initiator_outlives(conn: Any, transport: str) -> None:
    import datadist_aio as dd
    from support.peer import cluster_info

    code = dd.LLMStatusCode
    port, pid, _ = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, transport, listen=False)
    cm = datadist.cache_manager
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == code.LLM_SUCCESS
    big = dd.CacheDesc(TENSORS, [16, 1 << 20], dd.DataType.DT_UINT8, dd.Placement.DEVICE)
    cache = cm.allocate_blocks_cache(big)
    key = dd.BlocksCacheKey(OWNER, MODEL["device"])
    every = list(range(16))

    async def until_it_fails() -> BaseException:
        started = time.monotonic()
        killed = False
        while time.monotonic() - started < 30:
            tasks = [cm.push_blocks_async(key, cache, every, every), cm.pull_blocks_async(key, cache, every, every)]
            if not killed:
                async with asyncio.timeout(30):  # bytes are moving both ways
                    while not frames_sent(datadist):
                        await asyncio.sleep(0.005)
                if transport == "auto":  # device to device through CUDA IPC
                    assert datadist._engine.link_stats(OWNER)["ipc_frames"] > 0
                os.kill(pid, signal.SIGKILL)
                killed = True
            for task in tasks:
                try:
                    await asyncio.wait_for(task, 20)
                except dd.LLMException as e:
                    return e
        raise AssertionError("no transfer failed after the owner was killed")

    began = time.monotonic()
    try:
        error = asyncio.run(until_it_fails())
    except dd.LLMException as e:  # a call refused at once (the link is already down)
        error = e
    assert isinstance(error, dd.LLMException), error
    assert error.status_code in (code.LLM_LINK_FAILED, code.LLM_TIMEOUT, code.LLM_NOT_YET_LINK), error
    assert time.monotonic() - began < 25
    cm.deallocate_blocks_cache(cache)
    datadist.finalize()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_peer_killed_mid_transfer_fails_the_transfer(standin: Path, transport: str) -> None:
    run_pair(standin, owner_dies, initiator_outlives, transport, killed=owner_dies)


def owner_outlives(conn: Any, transport: str) -> None:
    """Serves device caches to an initiator that dies mid-transfer, then
    serves a new peer (another engine of this process, host memory only)."""
    import datadist_aio as dd

    cuda = CudaDriver()
    datadist = _engine(dd.LLMRole.PROMPT, OWNER, transport, listen=True)
    big = dd.CacheDesc(TENSORS, [16, 1 << 20], dd.DataType.DT_UINT8, dd.Placement.DEVICE)
    cache = datadist.cache_manager.allocate_blocks_cache(big, dd.BlocksCacheKey(OWNER, MODEL["device"]))
    conn.send(datadist.listen_port)
    assert _recv(conn) == "dying"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # until this end has seen the link go down
        try:
            datadist.link_transport(INITIATOR)
        except dd.LLMException:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the link to the killed initiator is still up")
    # A new peer, in a process of its own, pushes host bytes into the device cache.
    ctx = multiprocessing.get_context("spawn")
    report, child = ctx.Pipe(duplex=False)
    late = ctx.Process(target=_child, args=(child, {}, late_peer, (datadist.listen_port, transport)))
    late.start()
    child.close()
    try:
        assert report.poll(TIMEOUT_S / 2), "the late peer did not finish"
        outcome = report.recv()
        assert outcome == "ok", outcome
    finally:
        late.join(10)
        if late.is_alive():
            late.kill()
            late.join(10)
        report.close()
    data = _pattern(9, 16 << 20)
    for t in range(TENSORS):
        got = cuda.read(cache.tensor_addrs[t] + (13 << 20), 3 << 20)
        np.testing.assert_array_equal(got, data[t][: 3 << 20], err_msg=f"tensor {t} after the initiator died")
    datadist.cache_manager.deallocate_blocks_cache(cache)
    datadist.finalize()


def late_peer(port: int, transport: str) -> None:
    import datadist_aio as dd
    from support.peer import cluster_info

    datadist = _engine(dd.LLMRole.DECODER, 9, transport, listen=False)
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == dd.LLMStatusCode.LLM_SUCCESS
    host = datadist.cache_manager.allocate_blocks_cache(
        dd.CacheDesc(TENSORS, [16, 1 << 20], dd.DataType.DT_UINT8, dd.Placement.HOST))
    data = _pattern(9, 16 << 20)
    for t in range(TENSORS):
        host.as_numpy(t).reshape(-1)[:] = data[t]
    datadist.cache_manager.push_blocks(dd.BlocksCacheKey(OWNER, MODEL["device"]), host, [0, 1, 2], [13, 14, 15])
    datadist.cache_manager.deallocate_blocks_cache(host)
    datadist.finalize()


def initiator_dies(conn: Any, transport: str) -> None:
    import datadist_aio as dd
    from support.peer import cluster_info

    port = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, transport, listen=False)
    cm = datadist.cache_manager
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == dd.LLMStatusCode.LLM_SUCCESS
    big = dd.CacheDesc(TENSORS, [16, 1 << 20], dd.DataType.DT_UINT8, dd.Placement.DEVICE)
    cache = cm.allocate_blocks_cache(big)
    key = dd.BlocksCacheKey(OWNER, MODEL["device"])
    every = list(range(16))
    tasks = [cm.push_blocks_async(key, cache, every, every), cm.pull_blocks_async(key, cache, every, every)]
    deadline = time.monotonic() + 30
    while not frames_sent(datadist):  # bytes are moving both ways
        assert time.monotonic() < deadline, "no device frame was sent"
        time.sleep(0.005)
    if transport == "auto":  # device to device through CUDA IPC
        assert datadist._engine.link_stats(OWNER)["ipc_frames"] > 0
    conn.send("dying")
    os.kill(os.getpid(), signal.SIGKILL)
    del tasks


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_an_owner_outlives_an_initiator_killed_mid_transfer(standin: Path, transport: str) -> None:
    run_pair(standin, owner_outlives, initiator_dies, transport, killed=initiator_dies)


# -- the driver fails mid-copy -------------------------------------------------------------------------


def _broken_cache(cm: Any, cuda: Any, key: Any = None) -> tuple[Any, list[int]]:
    """A device blocks cache registered on the test's own allocations, whose
    third tensor's memory is then freed: every copy touching it fails in the
    driver (CUDA_ERROR_INVALID_VALUE) while the others still work."""
    addrs = [cuda.alloc(BLOCKS * BLOCK) for _ in range(TENSORS)]
    cache = cm.register_blocks_cache(_desc("device", True), addrs, key)
    return cache, addrs


def owner_breaks(conn: Any, transport: str) -> None:
    import datadist_aio as dd

    cuda = CudaDriver()
    datadist = _engine(dd.LLMRole.PROMPT, OWNER, transport, listen=True)
    cm = datadist.cache_manager
    good = cm.allocate_blocks_cache(_desc("device", True), dd.BlocksCacheKey(OWNER, MODEL["device"]))
    broken, addrs = _broken_cache(cm, cuda, dd.BlocksCacheKey(OWNER, 3))
    conn.send(datadist.listen_port)
    assert _recv(conn) == "break"
    cuda.free(addrs[2])
    conn.send("broken")
    assert _recv(conn) == "quit"
    cm.unregister_cache(broken.cache_id)
    cm.deallocate_blocks_cache(good)
    datadist.finalize()
    for addr in addrs[:2] + addrs[3:]:
        cuda.free(addr)


def initiator_meets_driver_failures(conn: Any, transport: str) -> None:
    import datadist_aio as dd
    from support.peer import cluster_info

    code = dd.LLMStatusCode
    cuda = CudaDriver()
    port = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, transport, listen=False)
    cm = datadist.cache_manager
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == code.LLM_SUCCESS
    good = cm.allocate_blocks_cache(_desc("device", True))
    host = cm.allocate_blocks_cache(_desc("host", True))
    broken, addrs = _broken_cache(cm, cuda)
    cuda.free(addrs[2])
    good_key, broken_key = dd.BlocksCacheKey(OWNER, MODEL["device"]), dd.BlocksCacheKey(OWNER, 3)
    every = list(range(BLOCKS))

    def fails(words: str, call: Callable[[], Any], *codes: Any) -> None:
        with pytest.raises(dd.LLMException) as failed:
            call()
        assert failed.value.status_code in (codes or (code.LLM_FAILED,)), failed.value
        if failed.value.status_code is code.LLM_FAILED:
            assert words in str(failed.value), failed.value

    def still_linked() -> None:
        cm.push_blocks(good_key, good, every, every)
        cm.pull_blocks(good_key, good, every, every)

    # Device memory of the initiator: the copy out (a push, failing after
    # its first tensors left) and the copy in (a pull) fail here.
    fails("cuMemcpyDtoHAsync", lambda: cm.push_blocks(good_key, broken, every, every))
    fails("cuMemcpyHtoDAsync", lambda: cm.pull_blocks(good_key, broken, every, every))
    still_linked()
    # Device memory of the owner.
    conn.send("break")
    assert _recv(conn) == "broken"
    fails("device memory on the peer failed", lambda: cm.push_blocks(broken_key, good, every, every))
    fails("device memory on the peer failed", lambda: cm.push_blocks(broken_key, host, every, every))
    # Its failing tensor first: the owner answers with the failure before any byte.
    fails("device memory on the peer failed",
          lambda: cm.pull_blocks(broken_key, good, every, every, src_layer_range=range(1, 2), dst_layer_range=range(1, 2)))
    fails("device memory on the peer failed",
          lambda: cm.pull_blocks(broken_key, host, every, every, src_layer_range=range(1, 2), dst_layer_range=range(1, 2)))
    still_linked()
    if transport == "tcp":
        # Every layer: the failing tensor comes after others whose bytes have
        # left under a success status, so the owner fails the link instead.
        fails("", lambda: cm.pull_blocks(broken_key, good, every, every), code.LLM_LINK_FAILED)
    else:
        # Same host, device to device (CUDA IPC): the owner copies every
        # tensor before it answers, so it answers with the failure.
        fails("device memory on the peer failed", lambda: cm.pull_blocks(broken_key, good, every, every))
    conn.send("quit")
    cm.unregister_cache(broken.cache_id)
    cm.deallocate_blocks_cache(good)
    cm.deallocate_blocks_cache(host)
    datadist.finalize()
    for addr in addrs[:2] + addrs[3:]:
        cuda.free(addr)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_driver_failure_mid_copy_fails_the_operation(standin: Path, transport: str) -> None:
    run_pair(standin, owner_breaks, initiator_meets_driver_failures, transport)

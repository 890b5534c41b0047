"""Unregistering a cache while a peer's operation on it is in flight.

Registered memory is the caller's: once ``unregister_cache`` returns, the
caller may free it or fill it with other data, and no byte of a peer's may
land in it, nor may a byte written there afterwards reach a peer. So the
call waits for a peer's write or read that the engine was serving from the
cache, and cuts the link of one that does not end in time (2 s).

A raw client of this process plays the peer (support/raw_client.py), so a
write's data can stop half-way and a read's answer can be left unread. An
operation that ended holds nothing: the last case, between two processes,
over each data path.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import datadist_aio as dd
from support.links import assert_blocks_push, small_desc
from support.options import make_options
from support.peer import HAVE_UCX, UCX_WHY, MiB, PeerGroup, pool_cfg
from support.raw_client import SERVER_ID, linked
from support.wire_frames import HEADER, READ_T, WRITE_ACK_T, WRITE_T, frame, recv_frame
from support.wire_frames import request as encode_request

pytestmark = pytest.mark.timeout(60)

UCX = pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason=f"no UCX: {UCX_WHY}"))
BLOCKS = 16
PATIENCE_S = 2.0  # the engine's wait before it cuts the link (engine.cpp, kServedUsePatience)
ORIGINAL, WRITTEN, AFTER = 0x11, 0x07, 0xAA  # the cache's bytes, the peer's, the caller's once unregistered


@pytest.fixture
def registered(request: pytest.FixtureRequest) -> Iterator[tuple[dd.LLMDataDist, dd.Cache, list[np.ndarray], int]]:
    """A listening engine with a registered blocks cache (2 tensors x 16
    blocks of `block` bytes) of numpy arrays this test owns."""
    block: int = request.param
    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, SERVER_ID)
    datadist.init(make_options(listen_ip_info="127.0.0.1:0", enable_remote_cache_accessible=True))
    arrays = [np.full((BLOCKS, block), ORIGINAL, np.uint8) for _ in range(2)]
    desc = dd.CacheDesc(2, [BLOCKS, block], dd.DataType.DT_UINT8, dd.Placement.HOST)
    cache = datadist.cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays],
                                                         dd.BlocksCacheKey(SERVER_ID, 0))
    try:
        yield datadist, cache, arrays, block
    finally:
        datadist.finalize()


def _unregister_in_thread(datadist: dd.LLMDataDist, cache: dd.Cache) -> tuple[threading.Thread, list[float]]:
    took: list[float] = []

    def run() -> None:
        start = time.monotonic()
        datadist.cache_manager.unregister_cache(cache.cache_id)
        took.append(time.monotonic() - start)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, took


def _unregister_by_a_cut(datadist: dd.LLMDataDist, cache: dd.Cache, arrays: list[np.ndarray]) -> None:
    """Unregisters the cache while a peer stalls in an operation on it: the
    call returns once it cut the link, after its patience; the caller then
    fills the memory with other bytes."""
    thread, took = _unregister_in_thread(datadist, cache)
    thread.join(15)
    assert not thread.is_alive()
    assert PATIENCE_S - 0.1 < took[0] < PATIENCE_S + 5, took
    for a in arrays:
        a[:] = AFTER


def _write_frame(block: int) -> tuple[bytes, int]:
    """A write of the whole of tensor 0, and where its data start."""
    data = bytes([WRITTEN]) * (BLOCKS * block)
    whole = frame(WRITE_T, encode_request([(0, 0, 0, len(data))], expected=block), data, op_id=5)
    return whole, len(whole) - len(data)


@pytest.mark.parametrize("registered", [4096], indirect=True)
def test_unregister_waits_for_a_write_in_flight(registered):
    """Half a write is in; the unregister waits while the rest comes (0.3 s
    later): the write lands whole and is acknowledged before the call
    returns, and nothing the caller writes afterwards is touched."""
    datadist, cache, arrays, block = registered
    whole, data_at = _write_frame(block)
    with linked(datadist.listen_port) as sock:
        half = data_at + (len(whole) - data_at) // 2
        sock.sendall(whole[:half])
        time.sleep(0.2)  # the engine is inside the write's data
        thread, took = _unregister_in_thread(datadist, cache)
        time.sleep(0.3)
        assert thread.is_alive(), "unregister_cache returned while a peer's write into the cache was half done"
        sock.sendall(whole[half:])
        thread.join(10)
        assert not thread.is_alive()
        assert (arrays[0] == WRITTEN).all(), "the write had not landed whole when unregister_cache returned"
        assert (arrays[1] == ORIGINAL).all()
        assert 0.25 < took[0] < PATIENCE_S, took
        kind, status, op_id, _, _ = recv_frame(sock)
        assert (kind, status, op_id) == (WRITE_ACK_T, 0, 5)
        for a in arrays:
            a[:] = AFTER
        # The same write again: the cache is gone, the peer told so, nothing written.
        sock.sendall(whole)
        kind, status, op_id, body, _ = recv_frame(sock)
        assert (kind, op_id) == (WRITE_ACK_T, 5)
        assert status == dd.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST.value, body
    assert all((a == AFTER).all() for a in arrays)


@pytest.mark.parametrize("registered", [4096], indirect=True)
def test_unregister_cuts_a_stalled_write(registered):
    """Half a write is in and the peer stalls: after 2 s the unregister cuts
    the link and returns; the rest of the data, sent then, lands nowhere."""
    datadist, cache, arrays, block = registered
    whole, data_at = _write_frame(block)
    half = data_at + (len(whole) - data_at) // 2
    with linked(datadist.listen_port) as sock:
        sock.sendall(whole[:half])
        time.sleep(0.2)
        _unregister_by_a_cut(datadist, cache, arrays)
        try:
            sock.sendall(whole[half:])
            sock.settimeout(5)
            assert sock.recv(HEADER.size) == b"", "the cut link answered the stalled write"
        except (BrokenPipeError, ConnectionResetError):
            pass
    time.sleep(0.2)
    for a in arrays:
        assert (a == AFTER).all(), f"{int((a != AFTER).sum())} bytes of the stalled write landed after unregister"


@pytest.mark.parametrize("registered", [MiB], indirect=True)
def test_unregister_cuts_a_stalled_read(registered):
    """A peer asks to read 16 MiB and reads none of the answer, which fills
    the sockets' buffers: after 2 s the unregister cuts the link; what the
    peer then reads holds only bytes of before the call, none the caller
    wrote after it."""
    datadist, cache, arrays, block = registered
    with linked(datadist.listen_port) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.sendall(frame(READ_T, encode_request([(0, 0, 0, BLOCKS * block)], expected=block), op_id=9))
        time.sleep(0.3)  # the answer's first bytes fill the buffers
        _unregister_by_a_cut(datadist, cache, arrays)
        received = bytearray()
        sock.settimeout(5)
        try:
            while chunk := sock.recv(1 << 20):
                received += chunk
        except ConnectionResetError:
            pass
    assert HEADER.size < len(received) < HEADER.size + BLOCKS * block, len(received)
    data = bytes(received[HEADER.size:])
    assert AFTER not in data, "bytes the caller wrote after unregister_cache reached the peer"
    assert set(data) == {ORIGINAL}


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


@pytest.mark.parametrize("transport", ["tcp", "auto", UCX])
def test_unregister_after_finished_operations_is_at_once_and_keeps_the_link(group, transport):
    """Operations that ended hold nothing: with owner-served pushes and
    pulls done (over TCP, the same-host path or UCX), unregistering the
    owner's registered cache takes no wait and cuts nothing; the link still
    moves bytes."""
    theirs = {"transport": "ucx"} if transport == "ucx" else {}
    initiator = group.start("initiator", dd.LLMRole.PROMPT, 1,
                            options={"transport": transport, "access": "owner", "host_mem_pool_cfg": pool_cfg(16 * MiB)})
    owner = group.start("owner", dd.LLMRole.DECODER, 2, options={"host_mem_pool_cfg": pool_cfg(16 * MiB)} | theirs)
    assert initiator.link(owner) == (dd.LLMStatusCode.LLM_SUCCESS, [dd.LLMStatusCode.LLM_SUCCESS])
    mine = initiator.allocate(small_desc(), blocks=True)
    registered = owner.register(small_desc(), blocks=True, model_id=5)
    sent = initiator.fill(mine, 3)
    initiator.cm_async("push_blocks", registered.blocks_key(), mine, [1, 2], [4, 5])
    initiator.cm_async("pull_blocks", registered.blocks_key(), mine, [4, 5], [6, 7])
    got = initiator.read(mine)
    for t in range(2):  # blocks of 256 bytes: 1 and 2 went there and came back as 6 and 7
        np.testing.assert_array_equal(got[t][6 * 256 : 8 * 256], sent[t][1 * 256 : 3 * 256])
    start = time.monotonic()
    owner.free(registered)
    assert time.monotonic() - start < 1.0, "unregister waited for operations that had ended"
    assert_blocks_push(initiator, owner, 6, 4)

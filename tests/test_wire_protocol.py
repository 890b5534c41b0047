"""The wire protocol as a hostile peer sees it: forged and malformed frames.

A raw socket speaks the protocol to a listening engine in this process. Every
refused request must leave the target memory untouched; a malformed frame
closes only that connection.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

import datadist_aio as dd
from support.raw_client import (  # noqa: F401  (server: the fixture)
    BLOCK,
    BLOCKS,
    SERVER_ID,
    connect,
    linked,
    request,
    server,
    untouched,
)
from support.wire_frames import (
    BLOCKS_OF_MODEL,
    BY_ID,
    HEADER,
    HELLO_ACK_T,
    MAGIC,
    READ_DATA_T,
    READ_T,
    UNASSIGNED_T,
    VERSION,
    WITHIN_SLOT,
    WRITE_ACK_T,
    WRITE_T,
    frame,
    recv_frame,
)

Code = dd.LLMStatusCode


def test_handshake_to_the_wrong_cluster_is_refused(server):
    datadist, _ = server
    with connect(datadist.listen_port, expected=SERVER_ID + 1) as sock:
        kind, status, _, _, _ = recv_frame(sock)
        assert kind == HELLO_ACK_T
        assert status == Code.LLM_LINK_FAILED.value


@pytest.mark.parametrize(
    "ranges, expected, code",
    [
        ([(0, 3, 0, BLOCK), (1, BLOCKS, 0, BLOCK)], BLOCK, Code.LLM_PARAM_INVALID),  # second range past the end
        ([(0, BLOCKS - 1, 0, 2 * BLOCK)], BLOCK, Code.LLM_PARAM_INVALID),  # straddles the end
        ([(2, 0, 0, BLOCK)], BLOCK, Code.LLM_PARAM_INVALID),  # no tensor 2
        ([(0, 0, 0, BLOCK)], 2 * BLOCK, Code.LLM_PARAM_INVALID),  # block size mismatch
        ([(0, 2**62, 0, BLOCK)], BLOCK, Code.LLM_PARAM_INVALID),  # offset overflows
    ],
)
def test_forged_write_is_refused_whole(server, ranges, expected, code):
    datadist, cache = server
    with linked(datadist.listen_port) as sock:
        data = b"\xff" * sum(r[3] for r in ranges)
        sock.sendall(frame(WRITE_T, request(ranges, expected=expected), data, op_id=5))
        kind, status, op_id, _, _ = recv_frame(sock)
        assert (kind, op_id) == (WRITE_ACK_T, 5)
        assert status == code.value
        assert untouched(cache)
        # The connection stays usable: a valid write lands.
        sock.sendall(frame(WRITE_T, request([(1, 4, 0, BLOCK)]), b"\x07" * BLOCK, op_id=6))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 6)
        assert (cache.as_numpy(1)[4] == 7).all()
        assert not cache.as_numpy(0).any()


def test_unknown_cache_is_reported(server):
    datadist, cache = server
    with linked(datadist.listen_port) as sock:
        sock.sendall(frame(WRITE_T, request([(0, 0, 0, BLOCK)], kind=BY_ID, cache_id=12345), b"\x01" * BLOCK))
        assert recv_frame(sock)[1] == Code.LLM_KV_CACHE_NOT_EXIST.value
        assert untouched(cache)


def test_read_outside_the_cache_is_refused(server):
    datadist, cache = server
    cache.as_numpy(0)[:] = 3
    with linked(datadist.listen_port) as sock:
        sock.sendall(frame(READ_T, request([(0, BLOCKS - 1, 0, 2 * BLOCK)]), op_id=9))
        kind, status, op_id, _, data = recv_frame(sock)
        assert (kind, op_id, data) == (READ_DATA_T, 9, b"")
        assert status == Code.LLM_PARAM_INVALID.value
        sock.sendall(frame(READ_T, request([(0, 2, 0, BLOCK)]), op_id=10))
        kind, status, op_id, _, data = recv_frame(sock)
        assert (kind, status, op_id) == (READ_DATA_T, 0, 10)
        assert data == b"\x03" * BLOCK


def test_memory_not_remote_accessible_is_refused(server):
    datadist, _ = server
    private = np.zeros((4, BLOCK), dtype=np.uint8)
    desc = dd.CacheDesc(1, [4, BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)
    cache = datadist.cache_manager.register_cache(desc, [private], remote_accessible=False)
    with linked(datadist.listen_port) as sock:
        sock.sendall(frame(WRITE_T, request([(0, 0, 0, BLOCK)], kind=BY_ID, cache_id=cache.cache_id), b"\x01" * BLOCK))
        assert recv_frame(sock)[1] == Code.LLM_PARAM_INVALID.value
    assert not private.any()
    datadist.cache_manager.unregister_cache(cache.cache_id)


def test_strided_ranges_land_row_by_row(server):
    """A strided range stands for its rows: 4 rows of 16 bytes, 64 apart,
    then one plain range; a strided read gives the same rows back."""
    datadist, cache = server
    rows = bytes(range(64)) + b"\xee" * 8
    strided = request([(0, 2, 8, 16), (1, 5, 0, 8)], strides=[(4, 64, 0), (1, 0, 0)], flags=WITHIN_SLOT)
    with linked(datadist.listen_port) as sock:
        sock.sendall(frame(WRITE_T, strided, rows, op_id=3))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 3)
        expected = np.zeros((2, BLOCKS, BLOCK), dtype=np.uint8)
        for j in range(4):
            expected[0, 2, 8 + 64 * j : 24 + 64 * j] = np.frombuffer(rows[16 * j : 16 * j + 16], np.uint8)
        expected[1, 5, :8] = 0xEE
        assert all((cache.as_numpy(t).reshape(BLOCKS, BLOCK) == expected[t]).all() for t in range(2))
        sock.sendall(frame(READ_T, strided, op_id=4))
        kind, status, op_id, _, data = recv_frame(sock)
        assert (kind, status, op_id) == (READ_DATA_T, 0, 4)
        assert data == rows


@pytest.mark.parametrize(
    "ranges, strides, flags, data_len",
    [
        ([(0, 2, 0, 16)], [(17, 16, 0)], WITHIN_SLOT, 17 * 16),  # the 17th row leaves the block
        ([(0, 2, 200, 16)], [(2, 48, 0)], WITHIN_SLOT, 32),  # the second row crosses into block 3
        ([(1, BLOCKS - 1, 0, 16)], [(17, 16, 0)], 0, 17 * 16),  # the last row passes the tensor's end
        ([(0, 0, 0, 16), (0, 1, 0, 16)], [(1, 0, 0), (2, BLOCK * BLOCKS, 0)], 0, 48),  # a later row is far off
    ],
)
def test_forged_strided_write_is_refused_whole(server, ranges, strides, flags, data_len):
    """Every row a strided range stands for is checked: one bad row refuses
    the request, and no byte of its good rows lands."""
    datadist, cache = server
    with linked(datadist.listen_port) as sock:
        sock.sendall(frame(WRITE_T, request(ranges, strides=strides, flags=flags), b"\xff" * data_len, op_id=5))
        kind, status, op_id, _, _ = recv_frame(sock)
        assert (kind, op_id, status) == (WRITE_ACK_T, 5, Code.LLM_PARAM_INVALID.value)
    assert untouched(cache)


@pytest.mark.parametrize(
    "payload",
    [
        frame(WRITE_T, request([(0, 0, 0, BLOCK)]), b"\x01" * BLOCK, magic=0xDEADBEEF),  # bad magic
        HEADER.pack(MAGIC, VERSION, 77, 0, 0, 1, 0),  # unknown frame type
        HEADER.pack(MAGIC, VERSION, UNASSIGNED_T, 0, 0, 1, 0),  # the type no frame has
        frame(WRITE_T, request([(0, 0, 0, BLOCK)]), b"\x01" * BLOCK, version=VERSION - 1),  # an older protocol
        HEADER.pack(MAGIC, VERSION, WRITE_T, 1 << 30, 0, 1, 0),  # body over the limit
        frame(WRITE_T, request([(0, 0, 0, BLOCK)]), b"\x01" * (BLOCK - 1)) + b"\x00" * 64,  # data length mismatch
        frame(WRITE_T, request([(0, 0, 0, BLOCK)])[:-8], b""),  # truncated range table
        frame(WRITE_ACK_T, op_id=424242),  # an answer nobody asked for
        # Strided ranges: no rows; rows that overlap; a segment stride with no
        # segments; more rows than a frame may unroll; the stride table cut.
        frame(WRITE_T, request([(0, 0, 0, 16)], strides=[(0, 16, 0)]), b""),
        frame(WRITE_T, request([(0, 0, 0, 16)], strides=[(2, 8, 0)]), b"\x01" * 32),
        frame(WRITE_T, request([(0, 0, 0, 16)], strides=[(2, 16, 16)]), b"\x01" * 32),
        frame(READ_T, request([(0, 0, 0, 1), (0, 1, 0, 1)], strides=[(1 << 15, 1, 0), (1 + (1 << 15), 1, 0)])),
        frame(WRITE_T, request([(0, 0, 0, 16)], strides=[(2, 16, 0)])[:-8], b"\x01" * 32),
    ],
)
def test_malformed_frame_closes_only_that_connection(server, payload):
    datadist, cache = server
    with linked(datadist.listen_port, nonce=11) as sock:
        sock.sendall(payload)
        sock.settimeout(5)
        with pytest.raises(ConnectionError):
            recv_frame(sock)
    assert untouched(cache)
    # The process keeps serving: a new link works and its writes land.
    with linked(datadist.listen_port, nonce=12) as sock:
        sock.sendall(frame(WRITE_T, request([(0, 1, 0, BLOCK)]), b"\x05" * BLOCK, op_id=2))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 2)
    assert (cache.as_numpy(0)[1] == 5).all()


def test_garbage_instead_of_a_handshake(server):
    datadist, _ = server
    with socket.create_connection(("127.0.0.1", datadist.listen_port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 64)
        with pytest.raises(ConnectionError):
            recv_frame(sock)
    with linked(datadist.listen_port, nonce=13):
        pass


def test_a_refused_request_refuses_the_rest_of_its_group(server):
    datadist, cache = server
    with linked(datadist.listen_port, nonce=14) as sock:
        sock.sendall(frame(WRITE_T, request([(0, 0, 0, BLOCK)], group=3), b"\x01" * BLOCK, op_id=1))
        assert recv_frame(sock)[1] == 0
        sock.sendall(frame(WRITE_T, request([(0, BLOCKS, 0, BLOCK)], group=3), b"\x02" * BLOCK, op_id=2))
        assert recv_frame(sock)[1] == Code.LLM_PARAM_INVALID.value
        sock.sendall(frame(WRITE_T, request([(1, 1, 0, BLOCK)], group=3), b"\x03" * BLOCK, op_id=3))
        assert recv_frame(sock)[1] == Code.LLM_FAILED.value
        sock.sendall(frame(WRITE_T, request([(1, 2, 0, BLOCK)], group=4), b"\x04" * BLOCK, op_id=4))
        assert recv_frame(sock)[1] == 0
    assert (cache.as_numpy(0)[0] == 1).all()
    assert not cache.as_numpy(1)[1].any()
    assert (cache.as_numpy(1)[2] == 4).all()


@pytest.mark.parametrize(
    "ranges, kind, cache_id, expected, words",
    [
        ([(0, 3, 0, BLOCK), (1, BLOCKS, 0, BLOCK)], BLOCKS_OF_MODEL, -1, BLOCK,
         ["range 1 (tensor 1, slot 16", "ends past the 16 slots (blocks) of 256 bytes", "blocks cache of model 0"]),
        ([(2, 0, 0, BLOCK)], BLOCKS_OF_MODEL, -1, BLOCK, ["range 0 (tensor 2", "has 2 tensors"]),
        ([(0, 0, 0, BLOCK)], BLOCKS_OF_MODEL, -1, 2 * BLOCK, ["block size differs: 512 bytes here, 256 bytes"]),
        ([(0, 0, 0, BLOCK)], BY_ID, 12345, BLOCK, ["cache 12345 does not exist on the peer"]),
    ],
)
def test_a_refusal_carries_the_owners_reason(server, ranges, kind, cache_id, expected, words):
    datadist, cache = server
    with linked(datadist.listen_port, nonce=15) as sock:
        data = b"\xff" * sum(r[3] for r in ranges)
        sock.sendall(frame(WRITE_T, request(ranges, kind=kind, cache_id=cache_id, expected=expected), data, op_id=3))
        kind_, status, op_id, body, _ = recv_frame(sock)
        assert (kind_, op_id) == (WRITE_ACK_T, 3) and status != 0
        reason = body.decode()
        assert all(w in reason for w in words), reason
        sock.sendall(frame(READ_T, request(ranges, kind=kind, cache_id=cache_id, expected=expected), op_id=4))
        kind_, status, op_id, body, data = recv_frame(sock)
        assert (kind_, op_id, data) == (READ_DATA_T, 4, b"") and status != 0
        assert all(w in body.decode() for w in words), body
    assert untouched(cache)


def every_block(fill_base: int) -> tuple[list[tuple[int, int, int, int]], bytes]:
    """Ranges over every block of both tensors (8 KiB) and their data, a byte
    value per block."""
    ranges = [(t, b, 0, BLOCK) for t in range(2) for b in range(BLOCKS)]
    data = b"".join(bytes([(fill_base + i) % 251 + 1]) * BLOCK for i in range(len(ranges)))
    return ranges, data


def landed(cache: dd.Cache, data: bytes) -> bool:
    got = b"".join(cache.as_numpy(t)[b].tobytes() for t in range(2) for b in range(BLOCKS))
    return got == data


@pytest.mark.parametrize("how", ["trickled", "data_later", "back_to_back"])
def test_frames_are_read_whole_however_their_bytes_arrive(server, how):
    # One byte at a time, the data after a pause (so it is read straight into
    # the cache), or several frames in one send (read from one buffer).
    datadist, cache = server
    with linked(datadist.listen_port) as sock:
        frames = []
        for op_id in range(3):
            ranges, data = every_block(fill_base=17 * op_id)
            frames.append((frame(WRITE_T, request(ranges), data, op_id=10 + op_id), data))
        if how == "trickled":
            whole, data = frames[0]
            for i in range(0, len(whole), 97):
                sock.sendall(whole[i : i + 97])
                if i < 2000:
                    time.sleep(0.001)
            assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 10)
            assert landed(cache, data)
        elif how == "data_later":
            whole, data = frames[1]
            sock.sendall(whole[: len(whole) - len(data)])
            time.sleep(0.1)
            sock.sendall(whole[len(whole) - len(data) :])
            assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 11)
            assert landed(cache, data)
        else:
            sock.sendall(b"".join(whole for whole, _ in frames) + frame(READ_T, request([(1, 15, 0, BLOCK)]), op_id=20))
            for op_id in range(3):
                assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 10 + op_id)
            kind, status, op_id, _, data = recv_frame(sock)
            assert (kind, status, op_id) == (READ_DATA_T, 0, 20)
            assert data == frames[2][1][-BLOCK:]
            assert landed(cache, frames[2][1])

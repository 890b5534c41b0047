"""A raw client of a listening engine in the test's own process: the
``server`` fixture (cluster SERVER_ID, a zeroed blocks cache of 2 tensors x
BLOCKS blocks of BLOCK bytes), and a forger (FORGER_ID) that connects and
links by hand."""

from __future__ import annotations

import socket

import pytest

import datadist_aio as dd
from support.options import make_options
from support.wire_frames import BLOCKS_OF_MODEL, HELLO, HELLO_ACK, HELLO_ACK_T, HELLO_T, frame, recv_frame
from support.wire_frames import request as encode_request

SERVER_ID, FORGER_ID = 7, 99
BLOCKS, BLOCK = 16, 256


def request(
    ranges: list[tuple[int, int, int, int]], kind=BLOCKS_OF_MODEL, cache_id=-1, expected=BLOCK, group=0,
    strides=(), flags=0,
) -> bytes:
    return encode_request(ranges, kind=kind, cache_id=cache_id, expected=expected, group=group, strides=strides,
                          flags=flags)


@pytest.fixture
def server():
    """A listening engine with a zeroed blocks cache (2 tensors x 16 blocks of 256 bytes)."""
    options = make_options(listen_ip_info="127.0.0.1:0", enable_remote_cache_accessible=True)
    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, SERVER_ID)
    datadist.init(options)
    desc = dd.CacheDesc(2, [BLOCKS, BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)
    cache = datadist.cache_manager.allocate_blocks_cache(desc, dd.BlocksCacheKey(SERVER_ID, 0))
    for t in range(2):
        cache.as_numpy(t)[:] = 0
    yield datadist, cache
    datadist.finalize()


def connect(port: int, expected: int = SERVER_ID, nonce: int = 1) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(frame(HELLO_T, HELLO.pack(FORGER_ID, expected, nonce, 1, 0, 1, 0)))
    return sock


def linked(port: int, nonce: int = 1) -> socket.socket:
    sock = connect(port, nonce=nonce)
    kind, status, _, body, _ = recv_frame(sock)
    assert kind == HELLO_ACK_T and status == 0
    assert HELLO_ACK.unpack(body)[0] == SERVER_ID
    return sock


def untouched(cache: dd.Cache) -> bool:
    return all(not cache.as_numpy(t).any() for t in range(2))


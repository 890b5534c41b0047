"""The wire protocol as a raw client speaks it: frame layouts, the handshake
frames, and helpers to send and read frames on a plain socket. Shared by the
tests that play a hostile or hand-written peer against a listening engine.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

HEADER = struct.Struct("<IHHIIQQ")
HELLO = struct.Struct("<QQQIIII")
HELLO_ACK = struct.Struct("<QII")
TARGET = struct.Struct("<BBHIqQQQQQ")
RANGE = struct.Struct("<IIQQQ")
MAGIC, VERSION = 0x4F414444, 1
HELLO_T, HELLO_ACK_T, WRITE_T, WRITE_ACK_T, READ_T, READ_DATA_T = 1, 2, 3, 4, 5, 6
BY_ID, BY_KEY, BLOCKS_OF_MODEL = 1, 2, 3
INVALID = 2**64 - 1


def frame(kind: int, body: bytes = b"", data: bytes = b"", op_id: int = 1, magic: int = MAGIC) -> bytes:
    return HEADER.pack(magic, VERSION, kind, len(body), 0, op_id, len(data)) + body + data


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def recv_frame(sock: socket.socket) -> tuple[int, int, int, bytes, bytes]:
    magic, version, kind, body_len, status, op_id, data_len = HEADER.unpack(recv_exact(sock, HEADER.size))
    assert (magic, version) == (MAGIC, VERSION)
    return kind, status, op_id, recv_exact(sock, body_len), recv_exact(sock, data_len)


def request(
    ranges: list[tuple[int, int, int, int]], kind=BLOCKS_OF_MODEL, cache_id=-1, expected=256, group=0
) -> bytes:
    body = TARGET.pack(kind, 0, 0, len(ranges), cache_id, INVALID, 0, INVALID, expected, group)
    return body + b"".join(RANGE.pack(t, 0, slot, off, length) for t, slot, off, length in ranges)


CHALLENGE_T, PROOF_T = 14, 15
OFFERS_SAME_HOST, COPIES_FOR_YOU, AUTHENTICATED, GRANTS_CONNECTIONS = 1, 2, 4, 8
INITIATOR = b"datadist_aio link v1 initiator\0"
ACCEPTOR = b"datadist_aio link v1 acceptor\0"


def proof(key: str, label: bytes, transcript: bytes) -> bytes:
    """An HMAC-SHA256 proof of `key` over `label` and the handshake transcript."""
    return hmac.new(key.encode(), label + transcript, hashlib.sha256).digest()

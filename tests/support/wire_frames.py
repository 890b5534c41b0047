"""The wire protocol as a raw socket speaks it (native/src/transport/wire.h).

Shared by the tests that play a hostile or hand-made peer and by the fuzz
corpus generator (tests/fuzz/make_corpus.py). Needs nothing but the standard
library.
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
SEGMENT = struct.Struct("<QQ")
DEVICE_EXPORT = struct.Struct("<64sQiI")  # handle, base, ordinal, kind
DEVICE_FD = struct.Struct("<iIQQ")  # the handle of a descriptor export: fd, zero, size, serial
STRIDE = struct.Struct("<IIQQ")
LOOKUP_REPLY = struct.Struct("<qIIQQQ")
PATH_PART = struct.Struct("<HHI")  # path number, zero, length
MAGIC, VERSION = 0x4F414444, 3

# Frame types.
HELLO_T, HELLO_ACK_T, WRITE_T, WRITE_ACK_T, READ_T, READ_DATA_T = 1, 2, 3, 4, 5, 6
LOOKUP_T, LOOKUP_REPLY_T, UNLINK_T, UNLINK_ACK_T = 7, 8, 9, 10
WRITE_FROM_T, READ_INTO_T = 11, 12
UNASSIGNED_T = 13  # no frame has this type
CHALLENGE_T, PROOF_T = 14, 15
PATH_MESSAGE_T = 16
# Hello flags.
AUTHENTICATED, GRANTS_CONNECTIONS, CONNECTIONS_MOVED, ANSWER_SOCKET = 4, 8, 16, 32
ENCRYPTED, ENCRYPTION_DIFFERS, CERTIFICATES, PATH_PARTS = 1024, 2048, 4096, 8192
# Path numbers (native/src/transport/paths/*/*_kind.h).
SAME_HOST_PATH, UCX_PATH = 1, 2
# The same-host path's part of a hello or an ack: who the sender is on its
# host (boot id, pid, probe address, probe bytes), its caps, and in a hello
# the descriptors the acceptor may move the link to
# (native/src/transport/paths/same_host/same_host_kind.h).
SAME_HOST_INFO = struct.Struct("<16sQQ24s")
# The same-host path's messages (paths/same_host/grants.h), each opening with
# its kind: the first one says the sender reaches the receiver's memory.
REACHES_YOU, GRANT_TABLE, GRANT, DEVICE_GRANT, TABLE_TAKEN = range(0x53480000, 0x53480005)
REACHES_YOU_MESSAGE = struct.pack("<I", REACHES_YOU)
SAME_HOST_PART = struct.Struct("<56sIIII")
OPENS_DEVICE, TAKES_FDS, BIG_DEVICE_FRAMES, COPIES_FOR_YOU, LOCAL_SOCKET, ANSWER_SOCKET_CAP = 1, 2, 4, 8, 16, 32
# Device export kinds.
EXPORT_IPC, EXPORT_FD = 0, 1
# Target kinds and flags.
BY_ID, BY_KEY, BLOCKS_OF_MODEL, RAW_ADDRESS = 1, 2, 3, 4
WITHIN_SLOT, RELEASE_KEY, STRIDED, PATH_TRAILER = 1, 2, 4, 8

INVALID = 2**64 - 1
MAX_BODY_BYTES = 1 << 20
MAX_FRAME_DATA = 64 << 20
INITIATOR = b"datadist_aio link v1 initiator\0"
ACCEPTOR = b"datadist_aio link v1 acceptor\0"

Range = tuple[int, int, int, int]  # tensor, slot, offset, length


def frame(
    kind: int,
    body: bytes = b"",
    data: bytes = b"",
    op_id: int = 1,
    magic: int = MAGIC,
    status: int = 0,
    version: int = VERSION,
) -> bytes:
    return HEADER.pack(magic, version, kind, len(body), status, op_id, len(data)) + body + data


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def recv_frame(sock: socket.socket) -> tuple[int, int, int, bytes, bytes]:
    """(type, status, op id, body, data) of the next frame."""
    magic, version, kind, body_len, status, op_id, data_len = HEADER.unpack(recv_exact(sock, HEADER.size))
    assert (magic, version) == (MAGIC, VERSION)
    return kind, status, op_id, recv_exact(sock, body_len), recv_exact(sock, data_len)


def request(
    ranges: list[Range],
    kind: int = BLOCKS_OF_MODEL,
    cache_id: int = -1,
    expected: int = 0,
    group: int = 0,
    flags: int = 0,
    req_id: int = INVALID,
    model_id: int = 0,
    prefix_id: int = INVALID,
    bounds: list[Range] = (),  # type: ignore[assignment]
    segments: list[tuple[int, int]] = (),  # type: ignore[assignment]
    strides: list[tuple[int, int, int]] = (),  # type: ignore[assignment]
) -> bytes:
    """A request body: the target, its ranges, its bounds, then (with
    ``strides``, which sets STRIDED) one (count, stride, segment stride) per
    range, then (same-host frames) one (address, length) segment per range."""
    if strides:
        flags |= STRIDED
    body = TARGET.pack(kind, flags, len(bounds), len(ranges), cache_id, req_id, model_id, prefix_id, expected, group)
    body += b"".join(RANGE.pack(t, 0, slot, off, length) for t, slot, off, length in [*ranges, *bounds])
    body += b"".join(STRIDE.pack(count, 0, stride, segment_stride) for count, stride, segment_stride in strides)
    return body + b"".join(SEGMENT.pack(addr, length) for addr, length in segments)


def path_parts(parts: list[tuple[int, bytes]]) -> bytes:
    """The path parts of a hello or an ack (with PATH_PARTS): a count, then
    each (path number, bytes)."""
    out = struct.pack("<I", len(parts))
    return out + b"".join(PATH_PART.pack(path, 0, len(part)) + part for path, part in parts)


def same_host_part(info: bytes, caps: int = 0, local_socket: int = 0, answer_socket: int = 0) -> bytes:
    return SAME_HOST_PART.pack(info, caps, local_socket, answer_socket, 0)


def read_parts(rest: bytes) -> tuple[dict[int, bytes], bytes]:
    """The path parts at the start of `rest`, and what follows them."""
    (count,) = struct.unpack_from("<I", rest)
    at, parts = 4, {}
    for _ in range(count):
        path, zero, length = PATH_PART.unpack_from(rest, at)
        assert zero == 0
        at += PATH_PART.size
        parts[path] = rest[at : at + length]
        at += length
    return parts, rest[at:]


def ack_parts(ack: bytes) -> dict[int, bytes]:
    """The path parts of an ack body (none when it has none)."""
    _cluster, _role, flags = HELLO_ACK.unpack_from(ack)
    rest = ack[HELLO_ACK.size + (4 if flags & GRANTS_CONNECTIONS else 0) :]
    return read_parts(rest)[0] if flags & PATH_PARTS else {}


def trailer(path: int, data: bytes) -> bytes:
    """A path's trailer of a frame by reference (after its segments, with
    PATH_TRAILER)."""
    return PATH_PART.pack(path, 0, len(data)) + data


def export_table(exports: list[bytes]) -> bytes:
    """The CUDA IPC path's trailer bytes: a count, then packed DEVICE_EXPORTs
    (native/src/transport/paths/device/exports.h)."""
    return struct.pack("<II", len(exports), 0) + b"".join(exports)


def same_host_caps(ack: bytes) -> int | None:
    """The caps of an ack's same-host part (None without one)."""
    part = ack_parts(ack).get(SAME_HOST_PATH)
    return None if part is None else SAME_HOST_PART.unpack(part)[1]


def hello(
    cluster_id: int,
    expected_peer: int,
    link_nonce: int = 1,
    flags: int = 0,
    parts: list[tuple[int, bytes]] = (),  # type: ignore[assignment]
    nonce: bytes = b"",
    index: int = 0,
    count: int = 1,
    role: int = 1,
) -> bytes:
    """A hello body: the path `parts` (which set PATH_PARTS) and `nonce`
    follow, in that order."""
    if parts:
        flags |= PATH_PARTS
    fixed = HELLO.pack(cluster_id, expected_peer, link_nonce, role, index, count, flags)
    return fixed + (path_parts(list(parts)) if parts else b"") + nonce


def proof(key: str, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(key.encode(), label + transcript, hashlib.sha256).digest()

"""Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/)
and their dictionary: valid frames of every type, as the targets
(tests/fuzz/fuzz_*.cpp) read them.

    python tests/fuzz/make_corpus.py

Regression inputs (corpus/<target>/regress-*) are kept; seeds are rewritten.
"""

from __future__ import annotations

import pathlib
import struct
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from support.wire_frames import (  # noqa: E402
    ANSWER_SOCKET_CAP,
    AUTHENTICATED,
    BLOCKS_OF_MODEL,
    BY_ID,
    BY_KEY,
    CHALLENGE_T,
    DEVICE_EXPORT,
    DEVICE_FD,
    DEVICE_GRANT,
    EXPORT_FD,
    GRANT,
    GRANT_TABLE,
    HEADER,
    HELLO_ACK,
    HELLO_ACK_T,
    HELLO_T,
    LOCAL_SOCKET,
    LOOKUP_REPLY,
    LOOKUP_REPLY_T,
    LOOKUP_T,
    MAGIC,
    PATH_MESSAGE_T,
    PATH_TRAILER,
    PROOF_T,
    RAW_ADDRESS,
    REACHES_YOU_MESSAGE,
    READ_DATA_T,
    READ_INTO_T,
    READ_T,
    RELEASE_KEY,
    SAME_HOST_INFO,
    SAME_HOST_PATH,
    TABLE_TAKEN,
    UCX_PATH,
    UNASSIGNED_T,
    UNLINK_ACK_T,
    UNLINK_T,
    VERSION,
    WITHIN_SLOT,
    WRITE_ACK_T,
    WRITE_FROM_T,
    WRITE_T,
    frame,
    hello,
    request,
    export_table,
    same_host_part,
    trailer,
)

# As fuzz_link.cpp lays out its memory.
ARENA = 0x6A0000000000
PEER = 0x6B0000000000
CACHE_A0 = ARENA + 0x1000
# Mode bits of fuzz_link.cpp.
OFFERED, PEER_COPIES, REACHES, ANNOUNCE, SUBMIT, INITIATED, ONE_SIDED = 1, 2, 4, 8, 16, 32, 64
EXPORT_IPC, EXPORT_FD = 0, 1  # wire::DeviceExportKind
LLM_PARAM_INVALID = 0x2000  # any non-zero status refuses


def device_request(ranges, segments, exports, fd_size=0, **target) -> bytes:
    """A request by reference whose segments lie in exported device memory:
    the CUDA IPC path's trailer, its export table (handle, base), follows
    the segments. With `fd_size`, each export is a descriptor export of
    that many bytes."""
    body = request(ranges, flags=PATH_TRAILER, segments=segments, **target)
    if fd_size:
        handles = [DEVICE_FD.pack(3 + i, 0, fd_size, i + 1).ljust(64, b"\0") for i in range(len(exports))]
        table = b"".join(DEVICE_EXPORT.pack(h, base, 0, EXPORT_FD) for h, base in zip(handles, exports))
    else:
        table = b"".join(DEVICE_EXPORT.pack(bytes([i + 1]) * 64, base, 0, 0) for i, base in enumerate(exports))
    return body + trailer(SAME_HOST_PATH, export_table([table[i : i + 80] for i in range(0, len(table), 80)]))


def ucx_keys(keys) -> bytes:
    """The UCX path's trailer bytes: a count, then per key (base, length,
    packed bytes) its head and its bytes padded to 8
    (native/src/transport/paths/ucx/ucx_path.h)."""
    out = struct.pack("<II", len(keys), 0)
    for base, length, packed in keys:
        out += struct.pack("<QQII", base, length, len(packed), 0) + packed + bytes(-len(packed) % 8)
    return out


def wire_seeds() -> dict[str, bytes]:
    """Flags byte (1: the body has segments), header, body."""
    plain, segmented = b"\x00", b"\x01"
    write = request([(0, 1, 0, 64), (1, 2, 0, 64)], kind=BY_ID, cache_id=1, expected=64)
    return {
        "write": plain + frame(WRITE_T, write),
        "read-bounds": plain
        + frame(READ_T, request([(0, 1, 0, 32)], bounds=[(0, 0, 0, 64), (0, 3, 0, 64)], flags=WITHIN_SLOT)),
        "read-key": plain + frame(READ_T, request([(0, 0, 0, 64)], kind=BY_KEY, req_id=7, model_id=1, flags=RELEASE_KEY)),
        "lookup": plain + frame(LOOKUP_T, request([], kind=BLOCKS_OF_MODEL, model_id=3)),
        "raw": plain + frame(WRITE_T, request([(0, 0, CACHE_A0, 16)], kind=RAW_ADDRESS)),
        "write-from": segmented
        + frame(WRITE_FROM_T, request([(0, 0, 0, 32), (0, 1, 0, 32)], kind=BY_ID, cache_id=2,
                                      segments=[(PEER, 32), (PEER + 64, 32)])),
        "read-into": segmented + frame(READ_INTO_T, request([(0, 0, 0, 32)], kind=BY_ID, cache_id=2, segments=[(PEER, 32)])),
        "write-from-device": segmented
        + frame(WRITE_FROM_T, device_request([(0, 0, 0, 32), (0, 1, 0, 32)], [(PEER, 32), (PEER + 4096, 32)],
                                             [PEER, PEER + 4096], kind=BY_ID, cache_id=2)),
        "write-from-device-fd": segmented
        + frame(WRITE_FROM_T, device_request([(0, 0, 0, 64)], [(PEER + 4096 - 32, 64)], [PEER, PEER + 4096],
                                             fd_size=4096, kind=BY_ID, cache_id=2)),
        "read-into-ucx": segmented
        + frame(READ_INTO_T, request([(0, 0, 0, 32)], kind=BY_ID, cache_id=2, flags=PATH_TRAILER, segments=[(PEER, 32)])
                + trailer(UCX_PATH, ucx_keys([(PEER, 4096, b"packed-key"), (PEER + 8192, 64, b"k" * 8)]))),
        "read-strided": plain
        + frame(READ_T, request([(0, 1, 0, 8), (1, 1, 4, 4)], strides=[(8, 16, 0), (1, 0, 0)], flags=WITHIN_SLOT)),
        "read-into-strided": segmented
        + frame(READ_INTO_T, request([(0, 0, 0, 16)], kind=BY_ID, cache_id=2, strides=[(4, 16, 64)],
                                     segments=[(PEER, 16)])),
        "hello": plain + frame(HELLO_T, hello(1, 2, flags=AUTHENTICATED, nonce=bytes(16),
                                              parts=[(SAME_HOST_PATH, same_host_part(SAME_HOST_INFO.pack(bytes(16), 1, 2, bytes(24))))])),
        "hello-ack": plain + frame(HELLO_ACK_T, HELLO_ACK.pack(2, 1, 0)),
        "challenge": plain + frame(CHALLENGE_T, bytes(16)),
        "proof": plain + frame(PROOF_T, bytes(32)),
        "write-ack": plain + frame(WRITE_ACK_T, b"refused", status=LLM_PARAM_INVALID),
        "read-data": plain + HEADER.pack(MAGIC, VERSION, READ_DATA_T, 0, 0, 1, 64),
        "lookup-reply": plain + frame(LOOKUP_REPLY_T, LOOKUP_REPLY.pack(1, 2, 1, 64, 4, 0)),
        "unlink": plain + frame(UNLINK_T) + frame(UNLINK_ACK_T),
        "reaches-you": plain + frame(PATH_MESSAGE_T, REACHES_YOU_MESSAGE),
        # UCX grant path messages (flags bit 2): a grant of cache 5 (two
        # tensors, blocks of model 3), a revocation, a request for grants.
        "ucx-grant": b"\x02" + ucx_grant(number=1, cache_id=5, tensor_size=4096, slot_size=1024, slots=4,
                                          model=3, tensors=[(PEER, b"packed-key"), (PEER + 8192, b"k" * 8)]),
        "ucx-revoke": b"\x02" + struct.pack("<IIQ", 0x55430003, 0, 1),
        "ucx-want": b"\x02" + struct.pack("<IIq", 0x55430001, 2, 1234),
    }


def ucx_grant(number, cache_id, tensor_size, slot_size, slots, model, tensors) -> bytes:
    """A UCX grant message to a FENCED holder (ucx_grants.cpp's GrantHead,
    slot and state 0, then each tensor's address, key length and key padded
    to 8 bytes)."""
    out = struct.pack("<IIQqQQQQIIQ", 0x55430002, len(tensors), number, cache_id, tensor_size, slot_size, slots,
                      model, 1, 0, 0)
    for addr, key in tensors:
        out += struct.pack("<QII", addr, len(key), 0) + key + bytes(-len(key) % 8)
    return out


def grant_messages() -> bytes:
    """An owner's grant table (descriptor 0 of the peer: not a table), a grant
    of cache 5 (two tensors in the peer's memory, blocks of model 3), and the
    answer to this end's own table."""
    table = struct.pack("<IIII", GRANT_TABLE, 1024, 0, 0)
    grant = struct.pack("<IIqQQQQQII", GRANT, 7, 5, 2, 4096, 64, 64, 3, 1, 2) + struct.pack("<QQ", PEER, PEER + 4096)
    taken = struct.pack("<IIII", TABLE_TAKEN, 1, 0, 0)
    return b"".join(frame(PATH_MESSAGE_T, body) for body in (table, grant, taken))


def device_grant_messages() -> bytes:
    """As grant_messages(), with a grant of cache 6 in device memory: two
    tensors, each inside an allocation the owner exported (a legacy IPC
    handle, and a descriptor of cuMemCreate memory)."""
    table = struct.pack("<IIII", GRANT_TABLE, 1024, 0, 0)
    grant = struct.pack("<IIqQQQQQII", DEVICE_GRANT, 8, 6, 4, 4096, 64, 64, 0, 0, 2)
    grant += struct.pack("<QQ", PEER, PEER + 8192)
    grant += b"\x11" * 64 + struct.pack("<QiI", PEER, 0, EXPORT_IPC)
    grant += struct.pack("<iIQQ", 3, 0, 8192, 1).ljust(64, b"\0") + struct.pack("<QiI", PEER + 8192, 0, EXPORT_FD)
    return b"".join(frame(PATH_MESSAGE_T, body) for body in (table, grant))


def link_seeds() -> dict[str, bytes]:
    """Mode byte, then what the peer sends."""
    tcp = bytes([0])
    a = dict(kind=BY_ID, cache_id=1, expected=64)
    return {
        "write-read": tcp
        + frame(WRITE_T, request([(0, 1, 0, 64), (1, 3, 0, 64)], **a), b"\xab" * 128, op_id=1)
        + frame(READ_T, request([(1, 0, 0, 256)], **a), op_id=2),
        "write-refused": tcp
        + frame(WRITE_T, request([(0, 0, 0, 64)], kind=BY_ID, cache_id=3), b"\x01" * 64, op_id=1)
        + frame(WRITE_T, request([(0, 4, 0, 64)], **a), b"\x02" * 64, op_id=2),
        "group": tcp
        + frame(WRITE_T, request([(0, 9, 0, 64)], group=5, **a), b"\x03" * 64, op_id=1)
        + frame(WRITE_T, request([(0, 0, 0, 64)], group=5, **a), b"\x04" * 64, op_id=2),
        "keys": tcp
        + frame(READ_T, request([(0, 0, 0, 64), (1, 0, 0, 64)], kind=BY_KEY, req_id=7, model_id=1, flags=RELEASE_KEY))
        + frame(READ_T, request([(0, 0, 0, 64)], kind=BY_KEY, req_id=9, model_id=1), op_id=2),
        "blocks-bounds": tcp
        + frame(WRITE_T, request([(0, 2, 0, 32)], kind=BLOCKS_OF_MODEL, model_id=3, flags=WITHIN_SLOT,
                                 bounds=[(0, 0, 0, 32), (0, 7, 0, 32)]), b"\x05" * 32),
        "raw": tcp
        + frame(WRITE_T, request([(0, 0, CACHE_A0 + 16, 32)], kind=RAW_ADDRESS), b"\x06" * 32)
        + frame(READ_T, request([(0, 0, CACHE_A0, 64)], kind=RAW_ADDRESS), op_id=2),
        "lookup": tcp
        + frame(LOOKUP_T, request([], kind=BLOCKS_OF_MODEL, model_id=3))
        + frame(LOOKUP_T, request([], kind=BY_KEY, req_id=8, model_id=1), op_id=2),
        "unlink": tcp + frame(UNLINK_T, op_id=3),
        "same-host": bytes([OFFERED | REACHES])
        + frame(WRITE_FROM_T, request([(0, 0, 0, 32), (0, 1, 0, 32)], kind=BY_ID, cache_id=2,
                                      segments=[(PEER, 32), (PEER + 64, 32)]))
        + frame(READ_INTO_T, request([(0, 2, 0, 32)], kind=BY_ID, cache_id=2, segments=[(PEER + 4096, 32)]), op_id=2),
        "strided": tcp
        + frame(READ_T, request([(0, 1, 0, 8), (1, 2, 8, 8)], flags=WITHIN_SLOT, strides=[(4, 16, 0), (3, 16, 0)], **a))
        + frame(READ_T, request([(0, 1, 0, 8)], flags=WITHIN_SLOT, strides=[(9, 8, 0)], **a), op_id=2),
        "same-host-strided": bytes([OFFERED | REACHES])
        + frame(READ_INTO_T, request([(0, 2, 0, 8)], kind=BY_ID, cache_id=2, strides=[(4, 8, 32)],
                                     segments=[(PEER + 4096, 8)])),
        "same-host-device": bytes([OFFERED | REACHES])
        + frame(WRITE_FROM_T, device_request([(0, 0, 0, 32)], [(PEER, 32)], [PEER], kind=BY_ID, cache_id=2))
        + frame(READ_INTO_T, device_request([(0, 2, 0, 8)], [(PEER + 64, 8)], [PEER], kind=BY_ID, cache_id=2,
                                            strides=[(4, 8, 32)]), op_id=2),
        "same-host-device-fd": bytes([OFFERED | REACHES])
        + frame(WRITE_FROM_T, device_request([(0, 0, 0, 64)], [(PEER + 4096 - 32, 64)], [PEER, PEER + 4096],
                                             fd_size=4096, kind=BY_ID, cache_id=2)),
        "reaches-you": bytes([OFFERED | REACHES | ANNOUNCE]) + frame(PATH_MESSAGE_T, REACHES_YOU_MESSAGE),
        "answers": bytes([SUBMIT])
        + HEADER.pack(MAGIC, VERSION, READ_DATA_T, 0, 0, 1, 64) + b"\x07" * 64
        + frame(WRITE_ACK_T, b"the peer says no", op_id=2, status=LLM_PARAM_INVALID),
        "answers-same-host": bytes([SUBMIT | OFFERED | PEER_COPIES | INITIATED])
        + frame(READ_DATA_T, op_id=1) + frame(WRITE_ACK_T, op_id=2),
        "lookup-reply": tcp + frame(LOOKUP_REPLY_T, LOOKUP_REPLY.pack(1, 2, 1, 64, 4, 0)),
        "grants": bytes([SUBMIT | OFFERED | PEER_COPIES | REACHES | ONE_SIDED]) + grant_messages(),
        "grants-device": bytes([SUBMIT | OFFERED | PEER_COPIES | REACHES | ONE_SIDED]) + device_grant_messages(),
        "grants-given": bytes([OFFERED | PEER_COPIES | REACHES | ONE_SIDED | INITIATED])
        + frame(WRITE_FROM_T, request([(0, 0, 0, 32)], kind=BY_ID, cache_id=2, segments=[(PEER, 32)])),
    }


def client_hello(identity: bytes = b"datadist_aio link") -> bytes:
    """A TLS 1.3 ClientHello record offering an external PSK (its binder
    zeros, so the acceptor must refuse it) with x25519, as an initiator's
    first TLS bytes look."""

    def ext(kind: int, body: bytes) -> bytes:
        return kind.to_bytes(2, "big") + len(body).to_bytes(2, "big") + body

    def vec(body: bytes, width: int) -> bytes:
        return len(body).to_bytes(width, "big") + body

    extensions = (
        ext(0x002B, vec(b"\x03\x04", 1))  # supported_versions: TLS 1.3
        + ext(0x000A, vec(b"\x00\x1d", 2))  # supported_groups: x25519
        + ext(0x0033, vec(b"\x00\x1d" + vec(bytes(range(32)), 2), 2))  # key_share
        + ext(0x002D, vec(b"\x01", 1))  # psk_key_exchange_modes: psk_dhe_ke
        + ext(0x0029, vec(vec(identity, 2) + bytes(4), 2) + vec(vec(bytes(32), 1), 2))  # pre_shared_key, last
    )
    body = b"\x03\x03" + bytes(32) + vec(b"", 1) + vec(b"\x13\x01", 2) + vec(b"\x00", 1) + vec(extensions, 2)
    handshake = b"\x01" + vec(body, 3)
    return b"\x16\x03\x01" + vec(handshake, 2)


def listen_seeds() -> dict[str, bytes]:
    """Mode byte (1: the listener wants a secret; 2: it encrypts, and the
    harness has proven the secret before the input; 4: the harness has made
    the TLS handshake too and the input goes through it; 8: the input goes
    raw after that handshake), then what one connection sends."""
    plain, secret = b"\x00", b"\x01"
    tls_handshake, through_tls, raw_after_tls = b"\x03", b"\x07", b"\x0f"
    a = dict(kind=BY_ID, cache_id=1, expected=64)
    write = frame(WRITE_T, request([(0, 1, 0, 64)], **a), b"\x11" * 64, op_id=1)
    read = frame(READ_T, request([(1, 3, 0, 64)], **a), op_id=2)
    info = SAME_HOST_INFO.pack(bytes(16), 1, 0x1000, b"DDAOPRB1" + bytes(16))
    return {
        "link-write-read": plain + frame(HELLO_T, hello(9, 1, link_nonce=1)) + write + read,
        "wrong-cluster": plain + frame(HELLO_T, hello(9, 2, link_nonce=2)),
        "two-connections": plain + frame(HELLO_T, hello(9, 1, link_nonce=3, index=1, count=2)),
        "same-host-offer": plain + frame(HELLO_T, hello(9, 1, link_nonce=4, parts=[(SAME_HOST_PATH, same_host_part(info))]))
        + write,
        "unknown-paths": plain + frame(HELLO_T, hello(9, 1, link_nonce=10, parts=[(0x55, b"x" * 9), (UCX_PATH, b"addr")]))
        + write,
        "secret": secret + frame(HELLO_T, hello(9, 1, link_nonce=5, flags=AUTHENTICATED, nonce=bytes(16)))
        + frame(PROOF_T, bytes(32)),
        "secret-missing": secret + frame(HELLO_T, hello(9, 1, link_nonce=6)) + write,
        "frames-first": plain + write + frame(HELLO_T, hello(9, 1, link_nonce=7)),
        "local-socket": plain
        + frame(HELLO_T, hello(9, 1, link_nonce=8, parts=[(SAME_HOST_PATH, same_host_part(info, LOCAL_SOCKET, 3))]))
        + write,
        "answer-socket": plain
        + frame(HELLO_T, hello(9, 1, link_nonce=9, parts=[(SAME_HOST_PATH, same_host_part(
            info, LOCAL_SOCKET | ANSWER_SOCKET_CAP, 3, 4))]))
        + write,
        "tls-client-hello": tls_handshake + client_hello(),
        "tls-client-hello-stranger": tls_handshake + client_hello(b"someone else"),
        "tls-frames": through_tls + write + read,
        "tls-record-altered": raw_after_tls + b"\x17\x03\x03\x00\x30" + bytes(range(48)),
    }


def dictionary() -> list[bytes]:
    entries = [HEADER.pack(MAGIC, VERSION, kind, 0, 0, 0, 0)[:8] for kind in range(1, 17) if kind != UNASSIGNED_T]
    entries += [ARENA.to_bytes(8, "little"), CACHE_A0.to_bytes(8, "little"), PEER.to_bytes(8, "little")]
    return entries


def main() -> None:
    for target, seeds in (("wire", wire_seeds()), ("link", link_seeds()), ("listen", listen_seeds())):
        folder = HERE / "corpus" / target
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("seed-*"):
            old.unlink()
        for name, data in seeds.items():
            (folder / f"seed-{name}").write_bytes(data)
    lines = ['"' + "".join(f"\\x{b:02x}" for b in entry) + '"' for entry in dictionary()]
    (HERE / "wire.dict").write_text("# Frame headers' first 8 bytes (magic, version, type) and fixed addresses.\n"
                                    + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""The same-host path as a hostile peer sees it.

A raw socket offers the same-host path to a listening engine in this process,
naming this process and a probe buffer it made, so the engine copies from and
into this process's memory by kernel calls. Source or destination memory that
the initiator does not have mapped refuses the operation whole, with nothing
written; same-host frames on a link that did not agree to them close it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket

import numpy as np
import pytest

import datadist_aio as dd
from test_wire_protocol import (
    BLOCK,
    BLOCKS,
    FORGER_ID,
    SERVER_ID,
    request,
    server,  # noqa: F401  (the fixture)
    untouched,
)
from wire_frames import (
    COPIES_FOR_YOU,
    HEADER,
    HELLO,
    HELLO_ACK,
    HELLO_ACK_T,
    HELLO_T,
    LOCAL_SOCKET,
    OFFERS_SAME_HOST,
    PEER_COPIES_T,
    READ_DATA_T,
    READ_INTO_T,
    SAME_HOST_INFO,
    SEGMENT,
    WRITE_ACK_T,
    WRITE_FROM_T,
    frame,
    recv_exact,
    recv_frame,
)
PROBE_MAGIC = b"DDAOPRB1"
PAGE = mmap.PAGESIZE

Code = dd.LLMStatusCode
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def boot_id() -> bytes:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return bytes.fromhex(f.read().strip().replace("-", ""))


class Prober:
    """This process's side of the offer: a probe buffer and the info naming it."""

    def __init__(self, token: bytes = b"0123456789abcdef") -> None:
        self.buffer = ctypes.create_string_buffer(PROBE_MAGIC + token, 24)
        self.pid = os.getpid()

    def info(self, pid: int | None = None, probe: bytes | None = None) -> bytes:
        return SAME_HOST_INFO.pack(
            boot_id(), self.pid if pid is None else pid, ctypes.addressof(self.buffer), probe or self.buffer.raw
        )


def offer(
    port: int, hello_info: bytes | None, nonce: int, local_socket: int | None = None
) -> tuple[socket.socket, int, bytes]:
    """Links with a hello that offers `hello_info` (none: no offer) and names
    descriptor `local_socket` of this process; returns the socket, the ack's
    flags and the info the ack carried."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    flags = OFFERS_SAME_HOST if hello_info is not None else 0
    named = b""
    if local_socket is not None:
        flags |= LOCAL_SOCKET
        named = local_socket.to_bytes(4, "little")
    body = HELLO.pack(FORGER_ID, SERVER_ID, nonce, 1, 0, 1, flags) + (hello_info or b"") + named
    sock.sendall(frame(HELLO_T, body))
    kind, status, _, ack, _ = recv_frame(sock)
    assert (kind, status) == (HELLO_ACK_T, 0)
    cluster_id, _role, ack_flags = HELLO_ACK.unpack(ack[: HELLO_ACK.size])
    assert cluster_id == SERVER_ID
    return sock, ack_flags, ack[HELLO_ACK.size :]


def copy_frame(kind: int, ranges, segments, op_id: int) -> bytes:
    body = request(ranges) + b"".join(SEGMENT.pack(addr, length) for addr, length in segments)
    return frame(kind, body, op_id=op_id)


class Mapping:
    """Three anonymous pages with the middle one unmapped: a hole to run into."""

    def __init__(self) -> None:
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self.base = libc.mmap(None, 3 * PAGE, prot, flags, -1, 0)
        assert self.base not in (None, ctypes.c_void_p(-1).value)
        assert libc.munmap(self.base + PAGE, PAGE) == 0
        ctypes.memset(self.base, 0x5A, PAGE)

    def close(self) -> None:
        libc.munmap(self.base, PAGE)
        libc.munmap(self.base + 2 * PAGE, PAGE)


@pytest.fixture
def hole():
    mapping = Mapping()
    yield mapping
    mapping.close()


def test_the_engine_reaches_a_prober_and_offers_itself(server):
    datadist, _ = server
    prober = Prober()
    sock, flags, info = offer(datadist.listen_port, prober.info(), nonce=31)
    with sock:
        assert flags == OFFERS_SAME_HOST | COPIES_FOR_YOU
        boot, pid, probe_addr, probe = SAME_HOST_INFO.unpack(info)
        assert boot == boot_id() and pid == os.getpid()
        assert probe.startswith(PROBE_MAGIC)
        # The probe buffer is where the engine said: this process is that engine's.
        assert ctypes.string_at(probe_addr, 24) == probe


@pytest.mark.parametrize(
    "info",
    [
        lambda p: p.info(probe=PROBE_MAGIC + b"x" * 16),  # the buffer does not read back
        lambda p: p.info(probe=b"NOTMAGIC" + b"x" * 16),  # no probe magic
        lambda p: p.info(pid=2**31 - 2),  # no such process
        lambda p: b"\x01" * 16 + p.info()[16:],  # another host
    ],
)
def test_an_offer_that_does_not_probe_is_not_served(server, info):
    datadist, cache = server
    sock, flags, _ = offer(datadist.listen_port, info(Prober()), nonce=32)
    with sock:
        assert flags == OFFERS_SAME_HOST  # offered back, but no copies for this peer
        source = ctypes.create_string_buffer(b"\x09" * BLOCK, BLOCK)
        sock.sendall(copy_frame(WRITE_FROM_T, [(0, 1, 0, BLOCK)], [(ctypes.addressof(source), BLOCK)], 1))
        sock.settimeout(5)
        with pytest.raises(ConnectionError):
            recv_frame(sock)
    assert untouched(cache)


def test_same_host_write_and_read_land(server):
    datadist, cache = server
    prober = Prober()
    sock, flags, _ = offer(datadist.listen_port, prober.info(), nonce=33)
    with sock:
        assert flags & COPIES_FOR_YOU
        source = np.arange(2 * BLOCK, dtype=np.uint32).view(np.uint8)[: 2 * BLOCK].copy()
        addr = source.ctypes.data
        sock.sendall(
            copy_frame(WRITE_FROM_T, [(0, 3, 0, BLOCK), (1, 9, 0, BLOCK)], [(addr, BLOCK), (addr + BLOCK, BLOCK)], 4)
        )
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 4)
        np.testing.assert_array_equal(cache.as_numpy(0)[3], source[:BLOCK])
        np.testing.assert_array_equal(cache.as_numpy(1)[9], source[BLOCK:])
        into = np.zeros(BLOCK, dtype=np.uint8)
        sock.sendall(copy_frame(READ_INTO_T, [(1, 9, 0, BLOCK)], [(into.ctypes.data, BLOCK)], 5))
        kind, status, op_id, body, data = recv_frame(sock)
        assert (kind, status, op_id, data) == (READ_DATA_T, 0, 5, b"")
        np.testing.assert_array_equal(into, source[BLOCK:])


@pytest.mark.parametrize("where", ["unmapped", "into_the_hole", "wraps"])
def test_a_source_the_initiator_does_not_have_refuses_the_write_whole(server, hole, where):
    datadist, cache = server
    good = ctypes.create_string_buffer(b"\x07" * BLOCK, BLOCK)
    bad = {
        "unmapped": (hole.base + PAGE, BLOCK),  # the hole itself
        "into_the_hole": (hole.base + PAGE - BLOCK // 2, BLOCK),  # starts mapped, runs into the hole
        "wraps": (2**64 - BLOCK // 2, BLOCK),
    }[where]
    prober = Prober()
    sock, _, _ = offer(datadist.listen_port, prober.info(), nonce=34)
    with sock:
        # The first range is fine; the second is not: nothing of either lands.
        sock.sendall(copy_frame(WRITE_FROM_T, [(0, 2, 0, BLOCK), (1, 5, 0, BLOCK)], [(ctypes.addressof(good), BLOCK), bad], 6))
        if where == "wraps":  # malformed: the connection closes
            sock.settimeout(5)
            with pytest.raises(ConnectionError):
                recv_frame(sock)
        else:
            assert recv_frame(sock)[:3] == (WRITE_ACK_T, Code.LLM_PARAM_INVALID.value, 6)
    assert untouched(cache)


def test_a_destination_the_initiator_does_not_have_refuses_the_read(server, hole):
    datadist, cache = server
    cache.as_numpy(0)[:] = 3
    prober = Prober()
    sock, _, _ = offer(datadist.listen_port, prober.info(), nonce=35)
    with sock:
        sock.sendall(copy_frame(READ_INTO_T, [(0, 1, 0, BLOCK)], [(hole.base + PAGE - 8, BLOCK)], 7))
        kind, status, op_id, _, data = recv_frame(sock)
        assert (kind, status, op_id, data) == (READ_DATA_T, Code.LLM_PARAM_INVALID.value, 7, b"")
        # Nothing was written into the page before the hole either.
        assert ctypes.string_at(hole.base, PAGE) == b"\x5a" * PAGE
        # A read-only page is no destination.
        ro = libc.mmap(None, PAGE, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        try:
            sock.sendall(copy_frame(READ_INTO_T, [(0, 1, 0, BLOCK)], [(ro, BLOCK)], 8))
            assert recv_frame(sock)[1] == Code.LLM_PARAM_INVALID.value
        finally:
            libc.munmap(ro, PAGE)


def test_owner_ranges_are_still_checked_on_the_same_host_path(server):
    datadist, cache = server
    source = ctypes.create_string_buffer(b"\x01" * 2 * BLOCK, 2 * BLOCK)
    prober = Prober()
    sock, _, _ = offer(datadist.listen_port, prober.info(), nonce=36)
    with sock:
        sock.sendall(copy_frame(WRITE_FROM_T, [(0, BLOCKS - 1, 0, 2 * BLOCK)], [(ctypes.addressof(source), 2 * BLOCK)], 9))
        assert recv_frame(sock)[1] == Code.LLM_PARAM_INVALID.value
    assert untouched(cache)


def test_same_host_frames_on_a_tcp_link_close_it(server):
    datadist, cache = server
    source = ctypes.create_string_buffer(b"\x01" * BLOCK, BLOCK)
    sock, flags, info = offer(datadist.listen_port, None, nonce=37)
    with sock:
        assert (flags, info) == (0, b"")
        sock.sendall(copy_frame(WRITE_FROM_T, [(0, 0, 0, BLOCK)], [(ctypes.addressof(source), BLOCK)], 1))
        sock.settimeout(5)
        with pytest.raises(ConnectionError):
            recv_frame(sock)
    assert untouched(cache)


def test_an_announcement_without_an_offer_closes_the_link(server):
    datadist, _ = server
    sock, _, _ = offer(datadist.listen_port, None, nonce=38)
    with sock:
        sock.sendall(frame(PEER_COPIES_T))
        sock.settimeout(5)
        with pytest.raises(ConnectionError):
            recv_exact(sock, HEADER.size)


def test_a_hello_with_a_truncated_offer_is_refused(server):
    datadist, _ = server
    body = HELLO.pack(FORGER_ID, SERVER_ID, 39, 1, 0, 1, OFFERS_SAME_HOST) + Prober().info()[:20]
    with socket.create_connection(("127.0.0.1", datadist.listen_port), timeout=5) as sock:
        sock.sendall(frame(HELLO_T, body))
        with pytest.raises(ConnectionError):
            recv_frame(sock)


def write_from_lands(sock: socket.socket, cache, op_id: int, fill: int) -> None:
    """A same-host write of one block over `sock` is answered and lands."""
    source = ctypes.create_string_buffer(bytes([fill]) * BLOCK, BLOCK)
    sock.sendall(copy_frame(WRITE_FROM_T, [(0, 7, 0, BLOCK)], [(ctypes.addressof(source), BLOCK)], op_id))
    assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, op_id)
    assert bytes(cache.as_numpy(0)[7]) == bytes([fill]) * BLOCK


def test_a_named_local_socket_carries_the_link(server):
    datadist, cache = server
    prober = Prober()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with mine, theirs:
        sock, flags, _ = offer(datadist.listen_port, prober.info(), nonce=41, local_socket=theirs.fileno())
        with sock:
            assert flags == OFFERS_SAME_HOST | COPIES_FOR_YOU | LOCAL_SOCKET
            sock.settimeout(5)
            assert sock.recv(1) == b""  # the TCP connection carried the handshake only
        theirs.close()  # the engine holds its own copy of that end
        mine.settimeout(5)
        write_from_lands(mine, cache, op_id=3, fill=0x31)


@pytest.mark.parametrize("named", ["tcp_socket", "file", "closed", "huge"])
def test_a_named_descriptor_that_is_not_a_local_socket_keeps_tcp(server, tmp_path, named):
    datadist, cache = server
    prober = Prober()
    with open(tmp_path / "not-a-socket", "wb") as file:
        probe = socket.create_connection(("127.0.0.1", datadist.listen_port), timeout=5)
        with probe:
            closed = os.dup(file.fileno())
            os.close(closed)
            number = {"tcp_socket": probe.fileno(), "file": file.fileno(), "closed": closed, "huge": 2**32 - 1}[named]
            sock, flags, _ = offer(datadist.listen_port, prober.info(), nonce=42, local_socket=number)
    with sock:
        assert flags == OFFERS_SAME_HOST | COPIES_FOR_YOU  # no local socket: the link stays on TCP
        sock.settimeout(5)
        write_from_lands(sock, cache, op_id=4, fill=0x42)


def test_a_local_socket_named_without_the_same_host_offer_is_not_taken(server):
    datadist, cache = server
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with mine, theirs:
        sock = socket.create_connection(("127.0.0.1", datadist.listen_port), timeout=5)
        with sock:
            # The flag without the same-host info: the number is not part of
            # the hello, so four more bytes make it malformed and it is refused.
            body = HELLO.pack(FORGER_ID, SERVER_ID, 43, 1, 0, 1, LOCAL_SOCKET) + theirs.fileno().to_bytes(4, "little")
            sock.sendall(frame(HELLO_T, body))
            sock.settimeout(5)
            with pytest.raises(ConnectionError):
                recv_frame(sock)
    assert untouched(cache)

"""The same-host path as a hostile peer sees it.

A raw socket offers the same-host path to a listening engine in this process,
naming this process and a probe buffer it made, so the engine copies from and
into this process's memory by kernel calls. Source or destination memory that
the initiator does not have mapped refuses the operation whole, with nothing
written; same-host frames on a link that did not agree to them close it.
Answers without data travel on the link's answer socket when the engine took
one, in both directions; a malformed one there fails the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import select
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import datadist_aio as dd
from datadist_aio import _logging
from support.raw_client import (
    BLOCK,
    BLOCKS,
    FORGER_ID,
    SERVER_ID,
    request,
    server,  # noqa: F401  (the fixture)
    untouched,
)
from support.wire_frames import (
    ANSWER_SOCKET,
    ANSWER_SOCKET_CAP,
    CONNECTIONS_MOVED,
    COPIES_FOR_YOU,
    HEADER,
    HELLO,
    HELLO_ACK,
    HELLO_ACK_T,
    HELLO_T,
    LOCAL_SOCKET,
    LOOKUP_REPLY,
    LOOKUP_REPLY_T,
    MAGIC,
    PATH_PARTS,
    PATH_TRAILER,
    PATH_MESSAGE_T,
    READ_DATA_T,
    READ_INTO_T,
    READ_T,
    REACHES_YOU_MESSAGE,
    SAME_HOST_INFO,
    SAME_HOST_PART,
    SAME_HOST_PATH,
    SEGMENT,
    UCX_PATH,
    VERSION,
    WRITE_ACK_T,
    WRITE_FROM_T,
    WRITE_T,
    ack_parts,
    frame,
    hello,
    path_parts,
    recv_exact,
    recv_frame,
    trailer,
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
    port: int,
    hello_info: bytes | None,
    nonce: int,
    local_socket: int | None = None,
    answer_socket: int | None = None,
    caps: int = 0,
    flags: int = 0,
) -> tuple[socket.socket, int, int | None, bytes]:
    """Links with a hello whose same-host part offers `hello_info` (none: no
    part) and names descriptors `local_socket` and `answer_socket` of this
    process, each with its cap (`caps` and the hello's `flags` are set
    besides); returns the socket, the ack's flags, and the caps and info of
    the ack's same-host part (None and b"" without one)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    caps |= LOCAL_SOCKET if local_socket is not None else 0
    caps |= ANSWER_SOCKET_CAP if answer_socket is not None else 0
    parts = []
    if hello_info is not None:
        part = SAME_HOST_PART.pack(hello_info, caps, local_socket or 0, answer_socket or 0, 0)
        parts.append((SAME_HOST_PATH, part))
    sock.sendall(frame(HELLO_T, hello(FORGER_ID, SERVER_ID, nonce, flags, parts)))
    kind, status, _, ack, _ = recv_frame(sock)
    assert (kind, status) == (HELLO_ACK_T, 0)
    cluster_id, _role, ack_flags = HELLO_ACK.unpack(ack[: HELLO_ACK.size])
    assert cluster_id == SERVER_ID
    said = ack_parts(ack).get(SAME_HOST_PATH)
    if said is None:
        return sock, ack_flags, None, b""
    info, said_caps, local, answer, zero = SAME_HOST_PART.unpack(said)
    assert (local, answer, zero) == (0, 0, 0)
    return sock, ack_flags, said_caps, info


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
    sock, flags, caps, info = offer(datadist.listen_port, prober.info(), nonce=31)
    with sock:
        assert (flags, caps) == (PATH_PARTS, COPIES_FOR_YOU)
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
    sock, flags, caps, _ = offer(datadist.listen_port, info(Prober()), nonce=32)
    with sock:
        assert (flags, caps) == (PATH_PARTS, 0)  # offered back, but no copies for this peer
        source = ctypes.create_string_buffer(b"\x09" * BLOCK, BLOCK)
        sock.sendall(copy_frame(WRITE_FROM_T, [(0, 1, 0, BLOCK)], [(ctypes.addressof(source), BLOCK)], 1))
        sock.settimeout(5)
        with pytest.raises(ConnectionError):
            recv_frame(sock)
    assert untouched(cache)


def test_same_host_write_and_read_land(server):
    datadist, cache = server
    prober = Prober()
    sock, _, caps, _ = offer(datadist.listen_port, prober.info(), nonce=33)
    with sock:
        assert caps & COPIES_FOR_YOU
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
    sock, *_ = offer(datadist.listen_port, prober.info(), nonce=34)
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
    sock, *_ = offer(datadist.listen_port, prober.info(), nonce=35)
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
    sock, *_ = offer(datadist.listen_port, prober.info(), nonce=36)
    with sock:
        sock.sendall(copy_frame(WRITE_FROM_T, [(0, BLOCKS - 1, 0, 2 * BLOCK)], [(ctypes.addressof(source), 2 * BLOCK)], 9))
        assert recv_frame(sock)[1] == Code.LLM_PARAM_INVALID.value
    assert untouched(cache)


def test_same_host_frames_on_a_tcp_link_close_it(server):
    datadist, cache = server
    source = ctypes.create_string_buffer(b"\x01" * BLOCK, BLOCK)
    sock, flags, caps, info = offer(datadist.listen_port, None, nonce=37)
    with sock:
        assert (flags, caps, info) == (0, None, b"")
        sock.sendall(copy_frame(WRITE_FROM_T, [(0, 0, 0, BLOCK)], [(ctypes.addressof(source), BLOCK)], 1))
        sock.settimeout(5)
        with pytest.raises(ConnectionError):
            recv_frame(sock)
    assert untouched(cache)


@pytest.mark.parametrize(
    "path, table",
    [
        (0x55, b"no path has this number"),
        (UCX_PATH, struct.pack("<II", 1, 0)),  # UCX's, on a link without UCX
        (SAME_HOST_PATH, struct.pack("<II", 0, 0)),  # the CUDA IPC path's, with no export
        (SAME_HOST_PATH, struct.pack("<II", 1, 0)),  # one export said, none there
    ],
)
def test_a_trailer_no_path_of_the_link_reads_closes_it(server, path, table):
    datadist, cache = server
    source = ctypes.create_string_buffer(b"\x02" * BLOCK, BLOCK)
    prober = Prober()  # its probe buffer lives while the engine reads it
    sock, _, caps, _ = offer(datadist.listen_port, prober.info(), nonce=49)
    with sock:
        assert caps == COPIES_FOR_YOU  # the engine serves this process's frames by reference
        body = request([(0, 0, 0, BLOCK)], flags=PATH_TRAILER) + SEGMENT.pack(ctypes.addressof(source), BLOCK)
        sock.sendall(frame(WRITE_FROM_T, body + trailer(path, table), op_id=1))
        sock.settimeout(5)
        with pytest.raises(ConnectionError):
            recv_frame(sock)
    assert untouched(cache)


def test_an_announcement_without_an_offer_closes_the_link(server):
    datadist, _ = server
    sock, *_ = offer(datadist.listen_port, None, nonce=38)
    with sock:
        sock.sendall(frame(PATH_MESSAGE_T, REACHES_YOU_MESSAGE))
        sock.settimeout(5)
        with pytest.raises(ConnectionError):
            recv_exact(sock, HEADER.size)


def test_a_hello_with_a_truncated_part_is_refused(server):
    datadist, _ = server
    # The parts say more bytes than the hello has: no valid handshake.
    body = HELLO.pack(FORGER_ID, SERVER_ID, 39, 1, 0, 1, PATH_PARTS) + path_parts([(SAME_HOST_PATH, Prober().info())])
    with socket.create_connection(("127.0.0.1", datadist.listen_port), timeout=5) as sock:
        sock.sendall(frame(HELLO_T, body[:-20]))
        with pytest.raises(ConnectionError):
            recv_frame(sock)


def test_parts_of_paths_this_end_lacks_are_ignored(server):
    datadist, cache = server
    # A path nobody has, and UCX's, which this engine (transport "auto", no
    # RDMA device) does not offer: linked on TCP, and the ack has no parts.
    parts = [(0x55, b"whatever it is"), (UCX_PATH, b"a worker address")]
    with socket.create_connection(("127.0.0.1", datadist.listen_port), timeout=5) as sock:
        sock.sendall(frame(HELLO_T, hello(FORGER_ID, SERVER_ID, 48, parts=parts)))
        kind, status, _, ack, _ = recv_frame(sock)
        assert (kind, status) == (HELLO_ACK_T, 0)
        assert HELLO_ACK.unpack(ack[: HELLO_ACK.size])[2] & PATH_PARTS == 0
        assert ack_parts(ack) == {}
        sock.sendall(frame(WRITE_T, request([(0, 3, 0, BLOCK)]), b"\x48" * BLOCK, op_id=2))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 2)
        assert bytes(cache.as_numpy(0)[3]) == b"\x48" * BLOCK


def test_a_same_host_part_of_the_wrong_size_refuses_the_link(server):
    datadist, _ = server
    # Framed whole, but the same-host path cannot read its part: the link is refused.
    body = hello(FORGER_ID, SERVER_ID, 40, parts=[(SAME_HOST_PATH, Prober().info()[:20])])
    with socket.create_connection(("127.0.0.1", datadist.listen_port), timeout=5) as sock:
        sock.sendall(frame(HELLO_T, body))
        kind, status, *_ = recv_frame(sock)
        assert (kind, status) == (HELLO_ACK_T, Code.LLM_LINK_FAILED.value)
    assert datadist._engine.link_stats(FORGER_ID) == {}


def write_from_lands(sock: socket.socket, cache, op_id: int, fill: int, answers: socket.socket | None = None) -> None:
    """A same-host write of one block over `sock` is answered (on `answers`
    if given, else on `sock`) and lands."""
    source = ctypes.create_string_buffer(bytes([fill]) * BLOCK, BLOCK)
    sock.sendall(copy_frame(WRITE_FROM_T, [(0, 7, 0, BLOCK)], [(ctypes.addressof(source), BLOCK)], op_id))
    if answers is None:
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, op_id)
    else:
        assert recv_answer(answers) == (WRITE_ACK_T, 0, op_id, b"")
    assert bytes(cache.as_numpy(0)[7]) == bytes([fill]) * BLOCK


def test_a_named_local_socket_carries_the_link(server):
    datadist, cache = server
    prober = Prober()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with mine, theirs:
        sock, flags, caps, _ = offer(datadist.listen_port, prober.info(), nonce=41, local_socket=theirs.fileno())
        with sock:
            assert (flags, caps) == (PATH_PARTS | CONNECTIONS_MOVED, COPIES_FOR_YOU)
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
            sock, flags, caps, _ = offer(datadist.listen_port, prober.info(), nonce=42, local_socket=number)
    with sock:
        assert (flags, caps) == (PATH_PARTS, COPIES_FOR_YOU)  # no local socket: the link stays on TCP
        sock.settimeout(5)
        write_from_lands(sock, cache, op_id=4, fill=0x42)


def test_a_local_socket_named_outside_the_same_host_part_is_not_taken(server):
    datadist, cache = server
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with mine, theirs:
        sock = socket.create_connection(("127.0.0.1", datadist.listen_port), timeout=5)
        with sock:
            # The ack's flag in a hello: nothing follows it, so four more
            # bytes make the hello malformed and it is refused.
            body = HELLO.pack(FORGER_ID, SERVER_ID, 43, 1, 0, 1, CONNECTIONS_MOVED) + theirs.fileno().to_bytes(4, "little")
            sock.sendall(frame(HELLO_T, body))
            sock.settimeout(5)
            with pytest.raises(ConnectionError):
                recv_frame(sock)
    assert untouched(cache)


def unix_pair(stack: contextlib.ExitStack, kind: int) -> tuple[socket.socket, socket.socket]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, kind)
    return stack.enter_context(mine), stack.enter_context(theirs)


@contextlib.contextmanager
def answered_link(port: int, nonce: int) -> Iterator[tuple[socket.socket, socket.socket]]:
    """A same-host link on a local socket, with an answer socket: this
    process's ends of both."""
    prober = Prober()
    with contextlib.ExitStack() as stack:
        local, their_local = unix_pair(stack, socket.SOCK_STREAM)
        answers, their_answers = unix_pair(stack, socket.SOCK_SEQPACKET)
        named = {"local_socket": their_local.fileno(), "answer_socket": their_answers.fileno()}
        sock, flags, caps, _ = offer(port, prober.info(), nonce, **named)
        sock.close()
        their_local.close()  # the engine holds its own copies of these ends
        their_answers.close()
        assert (flags, caps) == (PATH_PARTS | CONNECTIONS_MOVED | ANSWER_SOCKET, COPIES_FOR_YOU)
        local.settimeout(5)
        answers.settimeout(5)
        yield local, answers


def recv_answer(answers: socket.socket) -> tuple[int, int, int, bytes]:
    """(type, status, op id, body) of the next message on an answer socket:
    one whole frame, without data."""
    message = answers.recv(HEADER.size + 4096)
    magic, version, kind, body_len, status, op_id, data_len = HEADER.unpack(message[: HEADER.size])
    assert (magic, version, data_len, len(message)) == (MAGIC, VERSION, 0, HEADER.size + body_len)
    return kind, status, op_id, message[HEADER.size :]


def nothing_waiting(sock: socket.socket) -> bool:
    return not select.select([sock], [], [], 0.1)[0]


def test_a_named_answer_socket_carries_the_answers_without_data(server):
    datadist, cache = server
    source = ctypes.create_string_buffer(b"\x44" * BLOCK, BLOCK)
    segment = [(ctypes.addressof(source), BLOCK)]
    with answered_link(datadist.listen_port, nonce=44) as (local, answers):
        assert datadist._engine.link_stats(FORGER_ID)["answer_socket"] == 1
        local.sendall(copy_frame(WRITE_FROM_T, [(0, 7, 0, BLOCK)], segment, 5))
        assert recv_answer(answers) == (WRITE_ACK_T, 0, 5, b"")
        assert bytes(cache.as_numpy(0)[7]) == b"\x44" * BLOCK
        local.sendall(frame(WRITE_T, request([(1, 2, 0, BLOCK)]), b"\x45" * BLOCK, op_id=6))
        assert recv_answer(answers) == (WRITE_ACK_T, 0, 6, b"")
        assert bytes(cache.as_numpy(1)[2]) == b"\x45" * BLOCK
        # A refusal comes there too, with its reason.
        local.sendall(copy_frame(WRITE_FROM_T, [(0, BLOCKS, 0, BLOCK)], segment, 7))
        kind, status, op_id, reason = recv_answer(answers)
        assert (kind, status, op_id) == (WRITE_ACK_T, Code.LLM_PARAM_INVALID.value, 7)
        assert reason
        into = ctypes.create_string_buffer(BLOCK)
        local.sendall(copy_frame(READ_INTO_T, [(1, 2, 0, BLOCK)], [(ctypes.addressof(into), BLOCK)], 8))
        assert recv_answer(answers) == (READ_DATA_T, 0, 8, b"")
        assert into.raw == b"\x45" * BLOCK
        # An answer with data comes on the local socket.
        local.sendall(frame(READ_T, request([(1, 2, 0, BLOCK)]), op_id=9))
        assert recv_frame(local) == (READ_DATA_T, 0, 9, b"", b"\x45" * BLOCK)
        assert nothing_waiting(local) and nothing_waiting(answers)


def seqpacket_of_another_process(stack: contextlib.ExitStack) -> socket.socket:
    """One end of a seqpacket pair that a child process made and handed over."""
    mine, theirs = unix_pair(stack, socket.SOCK_STREAM)
    code = (
        "import socket, sys; a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET); "
        "socket.send_fds(socket.socket(fileno=int(sys.argv[1])), [b'x'], [a.fileno()])"
    )
    fd = theirs.fileno()
    subprocess.run([sys.executable, "-c", code, str(fd)], pass_fds=[fd], check=True, timeout=60)
    _, fds, _, _ = socket.recv_fds(mine, 1, 1)
    return stack.enter_context(socket.socket(fileno=fds[0]))


@pytest.mark.parametrize("named", ["stream_socket", "datagram_socket", "file", "another_process"])
def test_a_named_descriptor_that_is_not_our_seqpacket_socket_is_no_answer_socket(server, tmp_path, named):
    datadist, cache = server
    prober = Prober()
    with contextlib.ExitStack() as stack:
        local, their_local = unix_pair(stack, socket.SOCK_STREAM)
        descriptor = {
            "stream_socket": lambda: unix_pair(stack, socket.SOCK_STREAM)[1],
            "datagram_socket": lambda: unix_pair(stack, socket.SOCK_DGRAM)[1],
            "file": lambda: stack.enter_context(open(tmp_path / "not-a-socket", "wb")),
            "another_process": lambda: seqpacket_of_another_process(stack),
        }[named]()
        named = {"local_socket": their_local.fileno(), "answer_socket": descriptor.fileno()}
        sock, flags, caps, _ = offer(datadist.listen_port, prober.info(), 45, **named)
        sock.close()
        assert (flags, caps) == (PATH_PARTS | CONNECTIONS_MOVED, COPIES_FOR_YOU)  # the link moved, its answers did not
        assert datadist._engine.link_stats(FORGER_ID)["answer_socket"] == 0
        local.settimeout(5)
        write_from_lands(local, cache, op_id=5, fill=0x45)


@pytest.mark.parametrize("offered", [True, False])
def test_the_answer_socket_flag_without_a_local_socket_names_nothing(server, offered):
    datadist, cache = server
    prober = Prober()
    # The cap without a local socket (no part: the ack's flag in a hello).
    info = prober.info() if offered else None
    sock, flags, caps, _ = offer(datadist.listen_port, info, 46, caps=ANSWER_SOCKET_CAP, flags=0 if offered else ANSWER_SOCKET)
    with sock:
        assert (flags, caps) == ((PATH_PARTS, COPIES_FOR_YOU) if offered else (0, None))
        stats = datadist._engine.link_stats(FORGER_ID)
        assert {key: stats[key] for key in ("answer_socket", "connections", "local_sockets", "refused_groups")} == {
            "answer_socket": 0, "connections": 1, "local_sockets": 0, "refused_groups": 0
        }
        sock.sendall(frame(WRITE_T, request([(0, 3, 0, BLOCK)]), b"\x46" * BLOCK, op_id=2))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 2)
        assert bytes(cache.as_numpy(0)[3]) == b"\x46" * BLOCK


def test_an_answer_socket_named_without_a_local_socket_is_not_taken(server):
    datadist, cache = server
    prober = Prober()
    with contextlib.ExitStack() as stack:
        _, theirs = unix_pair(stack, socket.SOCK_SEQPACKET)
        sock, flags, caps, _ = offer(datadist.listen_port, prober.info(), 47, answer_socket=theirs.fileno())
        stack.enter_context(sock)
        assert (flags, caps) == (PATH_PARTS, COPIES_FOR_YOU)
        stats = datadist._engine.link_stats(FORGER_ID)
        assert (stats["answer_socket"], stats["local_sockets"]) == (0, 0)
        sock.settimeout(5)
        write_from_lands(sock, cache, op_id=6, fill=0x47)


def push(datadist: dd.LLMDataDist, cache: dd.Cache) -> dd.CacheTask:
    """The engine pushes block 0 of both its tensors to block 0 of this process's cache."""
    return datadist.cache_manager.push_blocks_async(dd.BlocksCacheKey(FORGER_ID, 0), cache, [0], [0])


def answers_read(datadist: dd.LLMDataDist) -> int:
    """Answers the engine has read from answer sockets so far."""
    return sum(datadist._engine.answer_counts().values())


async def soon(condition: Callable[[], bool]) -> bool:
    for _ in range(100):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return False


async def pushed_and_answered(
    datadist: dd.LLMDataDist, cache: dd.Cache, local: socket.socket, answers: socket.socket
) -> None:
    """A push from the engine, answered on the answer socket, succeeds."""
    read = answers_read(datadist)
    task = push(datadist, cache)
    kind, _, op_id, _, data = recv_frame(local)
    assert (kind, data) == (WRITE_T, bytes(cache.as_numpy(0)[0]) + bytes(cache.as_numpy(1)[0]))
    answers.send(frame(WRITE_ACK_T, op_id=op_id))
    assert await asyncio.wait_for(task, 5) == [Code.LLM_SUCCESS]
    # Counted by whoever read it (a look, this loop's drain, or the sweep).
    assert await soon(lambda: answers_read(datadist) == read + 1)


async def test_the_engine_takes_the_answers_to_its_own_operations_from_the_answer_socket(server):
    datadist, cache = server
    cache.as_numpy(0)[0], cache.as_numpy(1)[0] = 0x51, 0x52
    with answered_link(datadist.listen_port, nonce=48) as (local, answers):
        await pushed_and_answered(datadist, cache, local, answers)
        # A refusal there fails the push with its status and reason; the link stays.
        task = push(datadist, cache)
        op_id = recv_frame(local)[2]
        answers.send(frame(WRITE_ACK_T, b"no room here", op_id=op_id, status=Code.LLM_PARAM_INVALID.value))
        with pytest.raises(dd.LLMException, match="no room here") as refused:
            await asyncio.wait_for(task, 5)
        assert refused.value.status_code is Code.LLM_PARAM_INVALID
        await pushed_and_answered(datadist, cache, local, answers)
        assert nothing_waiting(local) and nothing_waiting(answers)


async def test_a_closed_answer_socket_sends_the_answers_back_to_the_connection(server):
    datadist, cache = server
    with answered_link(datadist.listen_port, nonce=49) as (local, answers):
        answers.close()
        write_from_lands(local, cache, op_id=3, fill=0x49)
        read = answers_read(datadist)
        task = push(datadist, cache)
        op_id = recv_frame(local)[2]
        local.sendall(frame(WRITE_ACK_T, op_id=op_id))
        assert await asyncio.wait_for(task, 5) == [Code.LLM_SUCCESS]
        assert answers_read(datadist) == read
        # The close is seen at the next read of answers: a second push, its
        # answer sent late on the connection, is waited for by this loop.
        task = push(datadist, cache)
        op_id = recv_frame(local)[2]
        assert not task.done()  # a look: it reads the socket and finds it closed
        assert datadist._engine.link_stats(FORGER_ID)["answer_socket"] == 0
        local.sendall(frame(WRITE_ACK_T, op_id=op_id))
        assert await asyncio.wait_for(task, 5) == [Code.LLM_SUCCESS]
        assert answers_read(datadist) == read
        assert datadist._engine.link_stats(FORGER_ID)["local_sockets"] == 1


@pytest.mark.parametrize(
    "answer, words",
    [
        (lambda op: b"abc", "an answer of 3 bytes"),
        (lambda op: frame(WRITE_ACK_T, b"x" * 513, op_id=op, status=1), "an answer of 545 bytes"),
        (lambda op: frame(WRITE_ACK_T, op_id=op, magic=0), "bad magic"),
        (lambda op: frame(LOOKUP_REPLY_T, LOOKUP_REPLY.pack(0, 0, 0, 0, 0, 0), op_id=op), "frame type 8"),
        (lambda op: HEADER.pack(MAGIC, VERSION, WRITE_ACK_T, 0, 0, op, 8), "unexpected data"),
        (lambda op: HEADER.pack(MAGIC, VERSION, READ_DATA_T, 0, 0, op, 8), "lengths do not match"),
        (lambda op: HEADER.pack(MAGIC, VERSION, WRITE_ACK_T, 4, 0, op, 0), "lengths do not match"),
        (lambda op: frame(WRITE_ACK_T, op_id=op + 1000), "unexpected answer"),
        (lambda op: frame(READ_DATA_T, op_id=op), "unexpected answer"),  # a read's answer to a write
    ],
    ids=[
        "short",
        "long",
        "no_magic",
        "lookup_reply",
        "write_ack_data",
        "read_data_data",
        "missing_body",
        "unknown_op",
        "read_answer_to_a_write",
    ],
)
async def test_a_malformed_answer_fails_the_engines_operation_and_the_link(server, caplog, answer, words):
    datadist, cache = server
    caplog.set_level(logging.WARNING, logger=_logging.NATIVE_LOGGER)
    with answered_link(datadist.listen_port, nonce=50) as (local, answers):
        task = push(datadist, cache)
        op_id = recv_frame(local)[2]
        answers.send(answer(op_id))
        with pytest.raises(dd.LLMException) as failed:
            await asyncio.wait_for(task, 5)
        assert failed.value.status_code is Code.LLM_LINK_FAILED
        assert words in str(failed.value)  # the task says why the link failed
        assert local.recv(1) == b""  # the engine closed the link
    assert _logging.flush(5)
    assert any(words in record.getMessage() for record in caplog.records)
    # The engine goes on serving: the next link works both ways.
    assert await soon(lambda: not datadist._engine.link_stats(FORGER_ID))
    with answered_link(datadist.listen_port, nonce=51) as (local, answers):
        write_from_lands(local, cache, op_id=2, fill=0x51, answers=answers)
        await pushed_and_answered(datadist, cache, local, answers)


async def test_a_write_ack_answering_the_engines_read_fails_it_and_writes_nothing(server):
    # The engine pulls over the link; the answer is a write's ack, which
    # carries no data: the pull fails with the link and its destination
    # keeps what it had.
    datadist, cache = server
    cache.as_numpy(0)[3], cache.as_numpy(1)[3] = 0x33, 0x34
    with answered_link(datadist.listen_port, nonce=52) as (local, answers):
        task = datadist.cache_manager.pull_blocks_async(dd.BlocksCacheKey(FORGER_ID, 0), cache, [0], [3])
        kind, _, op_id, _, _ = recv_frame(local)
        assert kind == READ_T
        local.sendall(frame(WRITE_ACK_T, op_id=op_id))
        with pytest.raises(dd.LLMException, match="unexpected answer") as failed:
            await asyncio.wait_for(task, 5)
        assert failed.value.status_code is Code.LLM_LINK_FAILED
        assert local.recv(1) == b""
    assert (cache.as_numpy(0)[3] == 0x33).all() and (cache.as_numpy(1)[3] == 0x34).all()

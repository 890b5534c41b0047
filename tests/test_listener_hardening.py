"""A listener that hostile clients cannot stall or kill.

Raw sockets on loopback play the attackers: idle connections, a client that
drips its hello a byte at a time, a flood past the descriptor limit, a peer
asking for 64 connections, a flood of refused reads, a stranger claiming a
linked peer's cluster id. Legitimate peers (child processes) link and move
bytes through all of it.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import datadist_aio as dd
from support.options import make_options
from support.peer import Peer, PeerGroup, raises_status
from support.links import accepted_connections, assert_both_ways
from support.raw_client import BLOCK, BLOCKS, FORGER_ID, SERVER_ID, linked
from support.wire_frames import (
    AUTHENTICATED,
    CHALLENGE_T,
    GRANTS_CONNECTIONS,
    HELLO,
    HELLO_ACK,
    HELLO_ACK_T,
    HELLO_T,
    INITIATOR,
    PROOF_T,
    READ_DATA_T,
    READ_T,
    WRITE_ACK_T,
    WRITE_T,
    frame,
    proof,
    recv_frame,
    request,
)

Code = dd.LLMStatusCode
SUCCESS = Code.LLM_SUCCESS
LINKED = (SUCCESS, [SUCCESS])
SECRET = "listener hardening secret"
A, B, C = 1, 2, 3

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """Raw client sockets, closed after the test whatever happened."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def connect(port: int, into: list[socket.socket], timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    into.append(sock)
    return sock


def hello(cluster_id: int, expected: int, nonce: int, index: int = 0, count: int = 1, auth: bytes = b"") -> bytes:
    """A whole hello frame; with `auth`, the initiator's nonce of an authenticated one."""
    flags = AUTHENTICATED if auth else 0
    return frame(HELLO_T, HELLO.pack(cluster_id, expected, nonce, 1, index, count, flags) + auth)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the other end closes `sock` within `seconds` (what it sends first is dropped)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if select.select([sock], [], [], left)[0]:
            try:
                if sock.recv(4096) == b"":
                    return True
            except ConnectionError:
                return True
    return False


def wait_until(predicate: Callable[[], Any], seconds: float = 30.0) -> Any:
    end = time.monotonic() + seconds
    while not (value := predicate()):
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)
    return value


def timed_link(initiator: Peer, acceptor: Peer, timeout: int = 3000) -> float:
    start = time.monotonic()
    assert initiator.link(acceptor, timeout=timeout) == LINKED
    return time.monotonic() - start


@pytest.fixture
def server() -> Iterator[dd.LLMDataDist]:
    """A listening engine in this process, with a 1 s handshake deadline."""
    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, SERVER_ID)
    datadist.init(
        make_options(listen_ip_info="127.0.0.1:0", enable_remote_cache_accessible=True, handshake_timeout_ms=1000)
    )
    desc = dd.CacheDesc(2, [BLOCKS, BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)
    datadist.cache_manager.allocate_blocks_cache(desc, dd.BlocksCacheKey(SERVER_ID, 0))
    yield datadist
    datadist.finalize()


# -- deadlines ---------------------------------------------------------------------------------


def test_idle_and_dripping_clients_do_not_delay_a_link(group, sockets):
    b = group.start("b", dd.LLMRole.DECODER, B, options={"handshake_timeout_ms": 1500})
    a = group.start("a", dd.LLMRole.PROMPT, A)
    c = group.start("c", dd.LLMRole.PROMPT, C)
    quiet = timed_link(a, b)
    port = b.listen_port
    idle = [connect(port, sockets) for _ in range(16)]
    dripper = connect(port, sockets)
    started = time.monotonic()
    body = hello(FORGER_ID, B, 5)
    dripper.sendall(body[:1])
    # Before, each idle socket held the only accepting thread to its
    # deadline: 16 of them would add 24 s.
    busy = timed_link(c, b, timeout=60000)
    assert busy < quiet + 10, (quiet, busy)
    assert_both_ways(c, b, (40, 41), seed=1)
    # The dripper never finishes its hello: it is cut at its deadline.
    sent, closed_at = 1, None
    while time.monotonic() - started < 1.5 + 10:
        if closed_within(dripper, 0.1):
            closed_at = time.monotonic() - started
            break
        try:
            dripper.send(body[sent : sent + 1])
        except ConnectionError:
            closed_at = time.monotonic() - started
            break
        sent += 1
    assert closed_at is not None and 1.3 <= closed_at < 1.5 + 10, closed_at
    assert sent < len(body)
    assert all(closed_within(sock, 30.0) for sock in idle)


def test_a_link_missing_connections_is_dropped_at_its_deadline(server, sockets):
    # One of two connections comes; the engine is idle otherwise.
    sock = connect(server.listen_port, sockets)
    started = time.monotonic()
    sock.sendall(hello(FORGER_ID, SERVER_ID, 7, index=0, count=2))
    wait_until(lambda: server._engine.listener_stats()["forming"] == 1)
    assert closed_within(sock, 30.0)
    assert 0.8 <= time.monotonic() - started < 1 + 10
    wait_until(lambda: server._engine.listener_stats()["forming"] == 0)


def test_the_oldest_waiting_connection_makes_room(sockets):
    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, SERVER_ID)
    datadist.init(make_options(listen_ip_info="127.0.0.1:0", handshake_timeout_ms=120000))
    try:
        port = datadist.listen_port
        flood = [connect(port, sockets) for _ in range(260)]
        wait_until(lambda: datadist._engine.listener_stats()["accepted"] == 260)
        stats = datadist._engine.listener_stats()
        assert (stats["waiting"], stats["evicted"]) == (256, 4)
        assert all(closed_within(sock, 30.0) for sock in flood[:4])
        assert not any(closed_within(sock, 0.0) for sock in flood[4:])
    finally:
        datadist.finalize()


# -- resources ---------------------------------------------------------------------------------


def test_the_listener_accepts_again_after_the_fd_limit(group, sockets):
    b = group.start("b", dd.LLMRole.DECODER, B)
    a = group.start("a", dd.LLMRole.PROMPT, A)
    b.set_rlimit("RLIMIT_NOFILE", len(os.listdir(f"/proc/{b.pid}/fd")) + 4)
    port = b.listen_port
    flood = [connect(port, sockets) for _ in range(24)]
    wait_until(lambda: b.engine("listener_stats")["accept_pauses"] > 0)
    for sock in flood:
        sock.close()
    assert a.link(b, timeout=5000) == LINKED
    assert_both_ways(a, b, (40, 41), seed=2)
    b.set_rlimit("RLIMIT_NOFILE", None)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
def test_the_listener_decides_the_connection_count(group, secret):
    # Over TCP, so the connections show in the kernel's table (a same-host
    # link moves to local sockets).
    keyed = {"auth_key": secret, "transport": "tcp"} if secret else {"transport": "tcp"}
    b = group.start("b", dd.LLMRole.DECODER, B, options={**keyed, "tcp_connections_per_peer": 2})
    a = group.start("a", dd.LLMRole.PROMPT, A, options={**keyed, "tcp_connections_per_peer": 64})
    assert a.link(b) == LINKED
    assert b.engine("link_stats", A)["connections"] == 2
    assert a.engine("link_stats", B)["connections"] == 2
    assert accepted_connections(b.listen_port) == 2
    assert_both_ways(a, b, (40, 41), seed=3)


def test_a_connection_past_the_grant_is_told_the_count(server, sockets):
    sock = connect(server.listen_port, sockets)
    sock.sendall(hello(FORGER_ID, SERVER_ID, 8, index=5, count=64))
    kind, status, _, body, _ = recv_frame(sock)
    assert (kind, status) == (HELLO_ACK_T, 0)
    assert HELLO_ACK.unpack(body[: HELLO_ACK.size]) == (0, 0, GRANTS_CONNECTIONS)  # names nothing else
    assert int.from_bytes(body[HELLO_ACK.size :], "little") == 2
    assert closed_within(sock, 30.0)


def test_a_thread_that_cannot_start_fails_the_link_not_the_process(group):
    # RLIMIT_NPROC counts the threads of the user and root is exempt from it:
    # the child runs as nobody when the tests run as root.
    b = group.start("b", dd.LLMRole.DECODER, B, prepare="run_unprivileged")
    a = group.start("a", dd.LLMRole.PROMPT, A)
    c = group.start("c", dd.LLMRole.DECODER, C)
    b.set_rlimit("RLIMIT_NPROC", 0)
    assert a.link(b) == (Code.LLM_LINK_FAILED, [Code.LLM_LINK_FAILED])  # b accepts
    assert b.link(c)[1] == [Code.LLM_LINK_FAILED]  # b initiates
    with raises_status(Code.LLM_NOT_YET_LINK):
        b.datadist("link_transport", A)
    b.set_rlimit("RLIMIT_NPROC", None)
    assert a.link(b) == LINKED
    assert b.link(c) == LINKED
    assert_both_ways(a, b, (40, 41), seed=4)


def test_the_refused_group_table_stays_bounded(server):
    groups, chunk = 3000, 250
    with linked(server.listen_port) as sock:
        for first in range(1, groups + 1, chunk):
            # Reads past the end of the cache, each naming a new ordered transfer.
            batch = range(first, min(first + chunk, groups + 1))
            sock.sendall(b"".join(frame(READ_T, request([(0, BLOCKS, 0, BLOCK)], expected=BLOCK, group=g), op_id=g) for g in batch))
            for g in batch:
                kind, status, op_id, _, _ = recv_frame(sock)
                assert (kind, op_id) == (READ_DATA_T, g) and status != 0
        assert server._engine.link_stats(FORGER_ID)["refused_groups"] == 1024
        # The newest refusals are remembered, the oldest forgotten.
        sock.sendall(frame(READ_T, request([(0, 0, 0, BLOCK)], expected=BLOCK, group=groups), op_id=1))
        assert recv_frame(sock)[1] != 0
        sock.sendall(frame(READ_T, request([(0, 0, 0, BLOCK)], expected=BLOCK, group=1), op_id=2))
        assert recv_frame(sock)[:3] == (READ_DATA_T, 0, 2)


def test_the_link_count_is_capped(server, sockets):
    # 512 links (each its own cluster, one connection): the next is refused
    # with LLM_CLUSTER_NUM_EXCEED_LIMIT, and one that goes makes room.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    try:
        port, cap = server.listen_port, 512
        for i in range(cap):
            sock = connect(port, sockets)
            sock.sendall(hello(10_000 + i, SERVER_ID, nonce=i + 1))
            assert recv_frame(sock)[:2] == (HELLO_ACK_T, 0), f"link {i} refused"
        assert wait_until(lambda: server._engine.listener_stats()["links"] == cap)
        extra = connect(port, sockets)
        extra.sendall(hello(20_000, SERVER_ID, nonce=cap + 1))
        assert recv_frame(extra)[:2] == (HELLO_ACK_T, Code.LLM_CLUSTER_NUM_EXCEED_LIMIT.value)
        extra.settimeout(2.0)  # then closed (select() cannot watch descriptors this high)
        try:
            assert extra.recv(4096) == b""
        except ConnectionResetError:
            pass
        sockets[0].close()
        wait_until(lambda: server._engine.listener_stats()["links"] == cap - 1)
        again = connect(port, sockets)
        again.sendall(hello(20_000, SERVER_ID, nonce=cap + 2))
        assert recv_frame(again)[:2] == (HELLO_ACK_T, 0)
        # The newcomer's link works: a write lands.
        again.sendall(frame(WRITE_T, request([(1, 2, 0, BLOCK)], expected=BLOCK), b"\x05" * BLOCK, op_id=9))
        assert recv_frame(again)[:3] == (WRITE_ACK_T, 0, 9)
    finally:
        for sock in sockets:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- who a peer is -----------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
def test_a_stranger_claiming_a_linked_peer_does_not_replace_it(group, sockets, secret):
    keyed = {"auth_key": secret} if secret else {}
    # A handshake deadline far past the wait for the close below: the close
    # comes from the refusal.
    b = group.start("b", dd.LLMRole.DECODER, B, options={**keyed, "handshake_timeout_ms": 120000})
    a = group.start("a", dd.LLMRole.PROMPT, A, options=keyed)
    assert a.link(b) == LINKED
    sock = connect(b.listen_port, sockets)
    if secret:
        nonce = os.urandom(16)
        sock.sendall(hello(A, B, 9, auth=nonce))
        kind, _, _, challenge, _ = recv_frame(sock)
        assert kind == CHALLENGE_T
        transcript = HELLO.pack(A, B, 9, 1, 0, 1, AUTHENTICATED) + nonce + challenge
        sock.sendall(frame(PROOF_T, proof("a guess", INITIATOR, transcript)))
        expected = Code.LLM_AUTH_FAILED
    else:
        sock.sendall(hello(A, B, 9))
        expected = Code.LLM_ALREADY_LINK
    kind, status, _, _, _ = recv_frame(sock)
    assert (kind, status) == (HELLO_ACK_T, expected.value)
    assert closed_within(sock, 30.0)
    assert b.engine("link_stats", A)["connections"] == 2  # the real peer's link
    assert_both_ways(a, b, (40, 41), seed=5)


def test_a_newcomer_that_proves_the_secret_replaces_the_link(group, sockets):
    b = group.start("b", dd.LLMRole.DECODER, B, options={"auth_key": SECRET})
    a = group.start("a", dd.LLMRole.PROMPT, A, options={"auth_key": SECRET})
    assert a.link(b) == LINKED
    sock = connect(b.listen_port, sockets)
    nonce = os.urandom(16)
    sock.sendall(hello(A, B, 10, auth=nonce))
    challenge = recv_frame(sock)[3]
    transcript = HELLO.pack(A, B, 10, 1, 0, 1, AUTHENTICATED) + nonce + challenge
    sock.sendall(frame(PROOF_T, proof(SECRET, INITIATOR, transcript)))
    assert recv_frame(sock)[:2] == (HELLO_ACK_T, 0)
    assert b.engine("link_stats", A)["connections"] == 1  # the newcomer's


def test_a_restarted_peer_relinks(group):
    b = group.start("b", dd.LLMRole.DECODER, B)
    a = group.start("a", dd.LLMRole.PROMPT, A)
    assert a.link(b) == LINKED
    a.kill()
    again = group.start("a again", dd.LLMRole.PROMPT, A)
    # The old link is seen down as soon as the kernel closes its sockets.
    wait_until(lambda: again.link(b) == LINKED, seconds=10)
    assert_both_ways(again, b, (40, 41), seed=6)


# -- a crowd -----------------------------------------------------------------------------------


_SPAWN = multiprocessing.get_context("spawn")


def _crowd(port: int, ready: Any, stop: Any) -> None:
    """2,000 idle clients and 200 that trickle a hello, one byte each every
    0.5 s (36 s for a whole one), until `stop`; then every socket closes."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    opened: list[socket.socket] = []
    try:
        for _ in range(2000):
            connect(port, opened)
        trickling = [connect(port, opened) for _ in range(200)]
        ready.set()
        body = hello(FORGER_ID, B, 12)
        for sent in range(len(body)):
            for sock in trickling:
                try:
                    sock.send(body[sent : sent + 1])
                except OSError:
                    pass
            if stop.wait(0.5):
                break
    finally:
        for sock in opened:
            sock.close()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_crowd_of_idle_and_trickling_clients(group):
    """2,000 idle and 200 trickling clients while a peer links and pushes 256 MiB."""
    import resource

    from support.peer import MiB, pool_cfg

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard < 4096:
        pytest.skip(f"needs 4096 descriptors, the hard limit is {hard}")
    options = {"host_mem_pool_cfg": pool_cfg(320 * MiB), "transport": "tcp", "sync_kv_timeout": 20000}
    b = group.start("b", dd.LLMRole.DECODER, B, options={**options, "handshake_timeout_ms": 20000})
    a = group.start("a", dd.LLMRole.PROMPT, A, options=options)
    b.set_rlimit("RLIMIT_NOFILE", None)
    desc = dd.CacheDesc(4, [64, MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)  # 256 MiB
    local = a.allocate(desc, blocks=True)
    remote = b.allocate(desc, blocks=True, model_id=1)
    a.fill(local, 11)
    blocks = list(range(64))

    def link_and_push() -> tuple[float, float]:
        link_s = timed_link(a, b, timeout=10000)
        start = time.monotonic()
        assert a.cm_async("push_blocks", remote.blocks_key(), local, blocks, blocks) == [SUCCESS]
        push_s = time.monotonic() - start
        assert a.unlink(b) == LINKED
        wait_until(lambda: not b.engine("link_stats", A))
        return link_s, 256 / push_s

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    link_and_push()  # warm up
    quiet = [link_and_push() for _ in range(5)]
    fds_before, rss_before = len(os.listdir(f"/proc/{b.pid}/fd")), _rss(b.pid)

    # The crowd is a process of its own, so that its work does not
    # share this process's interpreter with the timing.
    ready, stop = _SPAWN.Event(), _SPAWN.Event()
    crowd = _SPAWN.Process(target=_crowd, args=(b.listen_port, ready, stop), daemon=True)
    crowd.start()
    try:
        assert ready.wait(60), "the crowd did not gather"
        busy = [link_and_push() for _ in range(5)]
        stats = b.engine("listener_stats")
    finally:
        stop.set()
        crowd.join(30)
        if crowd.is_alive():
            crowd.kill()
            crowd.join()
    assert crowd.exitcode == 0
    wait_until(lambda: b.engine("listener_stats")["waiting"] == 0, seconds=10)
    fds_after = wait_until(lambda: (n := len(os.listdir(f"/proc/{b.pid}/fd"))) <= fds_before and n, seconds=10)
    rss_after = _rss(b.pid)

    quiet_link, busy_link = median([q[0] for q in quiet]), median([q[0] for q in busy])
    quiet_rate, busy_rate = median([q[1] for q in quiet]), median([q[1] for q in busy])
    print(
        f"\nlink: quiet {quiet_link * 1000:.1f} ms, crowded {busy_link * 1000:.1f} ms; "
        f"push 256 MiB: quiet {quiet_rate:.0f} MiB/s, crowded {busy_rate:.0f} MiB/s; "
        f"(quiet rounds {quiet}, crowded rounds {busy}); listener {stats}; acceptor fds {fds_before} -> {fds_after}, "
        f"RSS {rss_before / MiB:.1f} -> {rss_after / MiB:.1f} MiB"
    )
    assert stats["accepted"] >= 2200 + 4 and stats["evicted"] >= 2200 - 256
    # Within 1.5x of the quiet figures (plus 20 ms for the link: a few
    # milliseconds on loopback, where scheduling noise alone is that much).
    assert busy_link <= 1.5 * quiet_link + 0.02
    assert busy_rate >= quiet_rate / 1.5
    assert rss_after <= rss_before + 16 * MiB

"""The listener and the links of a live engine under a stream of hostile frames.

An engine runs in a child process with three caches: a victim the frames aim
at (remotely accessible), a private one (registered with
remote_accessible=False) and one that a legitimate peer, another child, keeps
pushing to and pulling from while the frames arrive. Raw sockets send a few
thousand frames from a fixed random seed: valid ones and ones with mutated
headers, bodies and ranges, truncated and oversized frames, same-host frames
on links that never agreed to them, handshakes that are mutated, missing or
out of place. Afterwards:

- the private cache and the legitimate peer's cache hold exactly what they
  should (digests compared), so no byte outside the ranges a request may
  name was written;
- every transfer of the legitimate peer, during and after, moved the right
  bytes;
- the engine's memory (the child's RSS) is back near its level before.
"""

from __future__ import annotations

import hashlib
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import datadist_aio as dd
from support.peer import LOOPBACK, CacheRef, Peer, PeerGroup
from support.wire_frames import (
    AUTHENTICATED,
    BLOCKS_OF_MODEL,
    BY_ID,
    BY_KEY,
    CHALLENGE_T,
    HEADER,
    HELLO,
    HELLO_T,
    LOOKUP_T,
    MAX_BODY_BYTES,
    MAX_FRAME_DATA,
    PATH_MESSAGE_T,
    PROOF_T,
    RANGE,
    RAW_ADDRESS,
    REACHES_YOU_MESSAGE,
    RELEASE_KEY,
    READ_DATA_T,
    READ_INTO_T,
    READ_T,
    SAME_HOST_INFO,
    SAME_HOST_PATH,
    TARGET,
    UCX_PATH,
    UNLINK_T,
    WITHIN_SLOT,
    WRITE_ACK_T,
    WRITE_FROM_T,
    WRITE_T,
    frame,
    hello,
    request,
    same_host_part,
)

pytestmark = pytest.mark.timeout(120)

SEED = 20240614
CONNECTIONS = 900  # about 4,000 frames
WARMUP = 100  # connections before the memory baseline is taken
ENGINE_ID, LEGIT_ID, FORGER_ID = 1, 2, 99
VICTIM_MODEL, PRIVATE_MODEL, LEGIT_MODEL = 0, 1, 5
BLOCKS, BLOCK = 16, 256
SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
RSS_TOLERANCE = 24 << 20

DESC = dd.CacheDesc(2, [BLOCKS, BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)
U64 = struct.Struct("<Q")
EXTREMES = [0, 1, BLOCK - 1, BLOCK, BLOCKS, BLOCKS * BLOCK, 2**31, 2**32 - 1, 2**63, 2**64 - 1]


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Forger:
    """Makes the hostile stream: one connection's bytes at a time, from `rng` alone."""

    def __init__(self, rng: random.Random, victim: CacheRef, private: CacheRef, addrs: dict[str, list[int]]) -> None:
        self.rng = rng
        self.victim = victim
        self.private = private
        self.addrs = addrs
        self.link_nonce = 0
        self.frames = 0
        self.legit_cache_id = -1

    # -- valid frames

    def ranges(self) -> list[tuple[int, int, int, int]]:
        r = self.rng
        return [(r.randrange(2), r.randrange(BLOCKS), r.choice([0, 0, 64]), r.choice([64, BLOCK])) for _ in
                range(r.randint(1, 4))]

    def target(self, ranges: list[tuple[int, int, int, int]]) -> bytes:
        r = self.rng
        pick = r.randrange(6)
        if pick == 0:
            return request(ranges, kind=BY_ID, cache_id=self.victim.cache_id, expected=BLOCK)
        if pick == 1:
            return request(ranges, kind=BY_ID, cache_id=self.private.cache_id)
        if pick == 2:
            return request(ranges, kind=BLOCKS_OF_MODEL, model_id=PRIVATE_MODEL, flags=WITHIN_SLOT)
        if pick == 3:
            # Raw addresses in the victim's tensors, or in the private cache's.
            tensors = self.addrs["victim" if r.random() < 0.5 else "private"]
            raw = [(0, 0, tensors[t] + slot * BLOCK + off, n) for t, slot, off, n in ranges]
            return request(raw, kind=RAW_ADDRESS)
        if pick == 4:
            return request(ranges, kind=BY_KEY, req_id=r.randrange(4), model_id=VICTIM_MODEL, flags=RELEASE_KEY)
        bounds = [(0, 0, 0, BLOCK), (1, BLOCKS - 1, 0, BLOCK)]
        return request(ranges, kind=BLOCKS_OF_MODEL, model_id=VICTIM_MODEL, expected=BLOCK, bounds=bounds,
                       group=r.randrange(3))

    def valid_frame(self) -> bytes:
        r = self.rng
        op = r.randrange(1, 1000)
        kind = r.choice([WRITE_T] * 4 + [READ_T] * 3 + [LOOKUP_T, WRITE_FROM_T, READ_INTO_T, PATH_MESSAGE_T,
                                                          UNLINK_T, WRITE_ACK_T, READ_DATA_T, HELLO_T, CHALLENGE_T,
                                                          PROOF_T])
        if kind in (WRITE_T, READ_T):
            ranges = self.ranges()
            body = self.target(ranges)
            data = bytes([r.randrange(256)]) * sum(n for *_, n in ranges) if kind == WRITE_T else b""
            return frame(kind, body, data, op_id=op)
        if kind == LOOKUP_T:
            return frame(kind, request([], kind=BLOCKS_OF_MODEL, model_id=r.choice([0, 1, 5, 7])), op_id=op)
        if kind in (WRITE_FROM_T, READ_INTO_T):
            ranges = self.ranges()
            segments = [(r.choice([0x1000, 2**47, self.addrs["victim"][0]]), n) for *_, n in ranges]
            return frame(kind, request(ranges, kind=BY_ID, cache_id=self.victim.cache_id, segments=segments),
                         op_id=op)
        if kind in (WRITE_ACK_T, READ_DATA_T):
            return frame(kind, b"no" if r.random() < 0.5 else b"", op_id=op, status=r.choice([0, 1]))
        if kind == HELLO_T:
            return frame(kind, self.hello_body())
        if kind == CHALLENGE_T:
            return frame(kind, r.randbytes(16))
        if kind == PROOF_T:
            return frame(kind, r.randbytes(32))
        if kind == PATH_MESSAGE_T:
            return frame(kind, REACHES_YOU_MESSAGE if r.random() < 0.5 else r.randbytes(r.randrange(4, 40)))
        return frame(kind, op_id=op)

    def big_frame(self) -> bytes:
        """A body near the limit: thousands of small ranges into the victim."""
        count = self.rng.choice([2000, 4000])
        ranges = [(i % 2, (i // 2) % BLOCKS, (i * 16) % BLOCK, 16) for i in range(count)]
        body = request(ranges, kind=BLOCKS_OF_MODEL, model_id=VICTIM_MODEL)
        return frame(WRITE_T, body, b"\x5a" * (16 * count))

    def hello_body(self) -> bytes:
        self.link_nonce += 1
        r = self.rng
        flags = r.choice([0, 0, 0, AUTHENTICATED])
        info = SAME_HOST_INFO.pack(r.randbytes(16), r.randrange(1, 2**22), r.randrange(2**47), r.randbytes(24))
        # No part, a same-host part naming a stranger, a part of a path nobody has, or both.
        parts = r.choice([[], [], [(SAME_HOST_PATH, same_host_part(info, r.randrange(64), r.randrange(2**32)))],
                          [(0x55, r.randbytes(r.randrange(64)))],
                          [(SAME_HOST_PATH, same_host_part(info)), (UCX_PATH, r.randbytes(r.randrange(1, 200)))]])
        return hello(FORGER_ID, ENGINE_ID, self.link_nonce, flags, parts, r.randbytes(16) if flags & AUTHENTICATED else b"")

    # -- mutations

    def mutate(self, data: bytes) -> bytes:
        r = self.rng
        b = bytearray(data)
        how = r.randrange(9)
        if how == 0 and len(b) >= HEADER.size:  # one header field
            field = r.choice([(0, "I"), (4, "H"), (6, "H"), (8, "I"), (12, "I"), (16, "Q"), (24, "Q")])
            offset, fmt = field
            size = struct.calcsize(fmt)
            value = r.choice([0, 1, 2**(8 * size) - 1, r.randrange(2**(8 * size)),
                              MAX_BODY_BYTES + 1 if fmt == "I" else MAX_FRAME_DATA + 1])
            b[offset:offset + size] = struct.pack("<" + fmt, value % 2**(8 * size))
        elif how == 1:  # flip bytes anywhere
            for _ in range(r.randint(1, 8)):
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
        elif how == 2:  # truncate
            del b[r.randrange(len(b)):]
        elif how == 3:  # trailing junk
            b += r.randbytes(r.randint(1, 64))
        elif how in (4, 5) and len(b) >= HEADER.size + TARGET.size + RANGE.size:  # one range field, to an extreme
            at = HEADER.size + TARGET.size + r.randrange((len(b) - HEADER.size - TARGET.size) // RANGE.size) * RANGE.size
            offset = r.choice([0, 8, 16, 24])  # tensor (and reserved), slot, offset, length
            b[at + offset:at + offset + 8] = U64.pack(r.choice(EXTREMES))
        elif how == 6 and len(b) >= HEADER.size + TARGET.size:  # target fields
            at = HEADER.size
            offset = r.choice([0, 1, 2, 4, 8, 16, 24, 32, 40, 48])
            b[at + offset] = r.randrange(256)
        elif how == 7:  # declared body longer than what follows
            if len(b) >= HEADER.size:
                b[8:12] = struct.pack("<I", r.choice([len(b), MAX_BODY_BYTES, MAX_BODY_BYTES + 1, 2**32 - 1]))
        else:  # declared data that never comes, or too much of it
            if len(b) >= HEADER.size:
                b[24:32] = U64.pack(r.choice([1, 2**20, MAX_FRAME_DATA, MAX_FRAME_DATA + 1, 2**64 - 1]))
        self.guard(b)
        return bytes(b)

    def guard(self, b: bytearray) -> None:
        """Keeps the stream off what the legitimate peer uses: its cluster id in
        a hello (which would replace its link) and its cache."""
        if len(b) >= HEADER.size + HELLO.size and b[6] == HELLO_T:
            if U64.unpack_from(b, HEADER.size)[0] == LEGIT_ID:
                U64.pack_into(b, HEADER.size, FORGER_ID)
        if len(b) >= HEADER.size + TARGET.size and b[6] != HELLO_T:
            kind, _, _, _, cache_id, _, model_id = struct.unpack_from("<BBHIqQQ", b, HEADER.size)
            if model_id == LEGIT_MODEL or cache_id == self.legit_cache_id:
                struct.pack_into("<Q", b, HEADER.size + 24, VICTIM_MODEL)
                struct.pack_into("<q", b, HEADER.size + 8, self.victim.cache_id)

    def connection(self) -> tuple[bytes, bool]:
        """The bytes one connection sends, and whether it starts with a valid hello."""
        r = self.rng
        pick = r.random()
        handshake = pick < 0.75
        out = b""
        if handshake:
            out = frame(HELLO_T, self.hello_body_plain())
        elif pick < 0.9:
            out = self.mutate(frame(HELLO_T, self.hello_body()))
        for _ in range(r.randint(1, 8)):
            self.frames += 1
            one = self.big_frame() if r.random() < 0.02 else self.valid_frame()
            out += one if r.random() < 0.4 else self.mutate(one)
        return out, handshake

    def hello_body_plain(self) -> bytes:
        self.link_nonce += 1
        return hello(FORGER_ID, ENGINE_ID, self.link_nonce)


def send_connection(port: int, data: bytes, handshake: bool) -> None:
    """Sends `data` on a fresh connection, then drains what comes back for a
    moment; the engine may close at any point."""
    with socket.create_connection((LOOPBACK, port), timeout=2) as sock:
        try:
            if handshake:
                hello_len = HEADER.size + HELLO.size
                sock.sendall(data[:hello_len])
                data = data[hello_len:]
                sock.settimeout(2)
                sock.recv(HEADER.size + 64)  # the ack, once the link is in place
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(0.2)
            while sock.recv(1 << 16):
                pass
        except OSError:  # closed by the engine, reset, or it waits for more: all fine
            pass


class LegitPeer:
    """Pushes seeded blocks into the engine's cache and pulls them back, in a
    thread, checking every byte; records failures instead of raising."""

    def __init__(self, peer: Peer, remote: CacheRef, remote_bytes: list[np.ndarray]) -> None:
        self.peer = peer
        self.remote = remote
        self.expected = [a.copy() for a in remote_bytes]  # what the remote cache must hold
        self.send = peer.allocate(DESC, blocks=True)
        self.back = peer.allocate(DESC, blocks=True)
        self.rounds = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="legit-peer")

    def one_round(self, seed: int) -> None:
        sent = self.peer.fill(self.send, seed)
        src = [(seed + i) % BLOCKS for i in range(4)]
        dst = [(seed * 3 + i) % BLOCKS for i in range(4)]
        status = self.peer.cm_async("push_blocks", self.remote.blocks_key(), self.send, src, dst)
        if status != [SUCCESS]:
            self.failures.append(f"round {seed}: push {status}")
            return
        for t in range(2):
            for s, d in zip(src, dst):
                self.expected[t][d * BLOCK:(d + 1) * BLOCK] = sent[t][s * BLOCK:(s + 1) * BLOCK]
        status = self.peer.cm_async("pull_blocks", self.remote.blocks_key(), self.back, dst, src)
        if status != [SUCCESS]:
            self.failures.append(f"round {seed}: pull {status}")
            return
        got = self.peer.read(self.back)
        for t in range(2):
            for s in src:
                if not np.array_equal(got[t][s * BLOCK:(s + 1) * BLOCK], sent[t][s * BLOCK:(s + 1) * BLOCK]):
                    self.failures.append(f"round {seed}: tensor {t} block {s} came back wrong")
        self.rounds += 1

    def _run(self) -> None:
        seed = 1000
        while not self._stop.is_set():
            try:
                self.one_round(seed)
            except Exception as exc:  # recorded, and the test fails on it
                self.failures.append(f"round {seed}: {exc!r}")
                return
            seed += 1

    def __enter__(self) -> "LegitPeer":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@pytest.fixture
def engines() -> Iterator[tuple[Peer, Peer]]:
    with PeerGroup() as group:
        engine = group.start("engine", dd.LLMRole.DECODER, ENGINE_ID)
        legit = group.start("legit", dd.LLMRole.PROMPT, LEGIT_ID, listen=False)
        yield engine, legit


def run_connections(port: int, forger: Forger, count: int, on_each: Callable[[], None] = lambda: None) -> None:
    for _ in range(count):
        data, handshake = forger.connection()
        send_connection(port, data, handshake)
        on_each()


def test_hostile_frames_change_nothing_they_may_not_and_stop_no_one(engines):
    engine, legit = engines
    victim = engine.allocate(DESC, blocks=True, model_id=VICTIM_MODEL)
    private = engine.register(DESC, blocks=True, model_id=PRIVATE_MODEL, remote_accessible=False)
    target = engine.allocate(DESC, blocks=True, model_id=LEGIT_MODEL)
    victim_digest = digest(engine.fill(victim, 1))
    private_digest = digest(engine.fill(private, 2))
    target_bytes = engine.fill(target, 3)
    addrs = {"victim": engine.tensor_addrs(victim), "private": engine.tensor_addrs(private)}
    port = engine.listen_port
    assert port is not None
    assert legit.link(engine) == (SUCCESS, [SUCCESS])

    forger = Forger(random.Random(SEED), victim, private, addrs)
    forger.legit_cache_id = target.cache_id
    peer = LegitPeer(legit, target, target_bytes)
    peer.one_round(1)
    run_connections(port, forger, WARMUP)
    time.sleep(0.3)
    baseline = rss(engine.pid)

    started = time.monotonic()
    with peer:
        run_connections(port, forger, CONNECTIONS - WARMUP)
        # The attack goes on until the legitimate peer has had its rounds (a
        # loaded host may run the forger faster than the peer).
        deadline = time.monotonic() + 60
        while peer.rounds < 3 and time.monotonic() < deadline:
            run_connections(port, forger, 10)
    elapsed = time.monotonic() - started
    rounds_during = peer.rounds
    peer.one_round(2)  # and after
    assert not peer.failures, peer.failures[:5]
    assert rounds_during >= 3, f"the legitimate peer made {rounds_during} rounds in {elapsed:.1f} s"
    assert forger.frames >= 3500

    # The stream reached the links (valid writes landed in the victim), and
    # nothing outside what a request may name changed.
    assert digest(engine.read(victim)) != victim_digest
    assert digest(engine.read(private)) == private_digest
    assert digest(engine.read(target)) == digest(peer.expected)

    # The engine's memory returns to its level once the links are gone.
    deadline = time.monotonic() + 30
    while rss(engine.pid) > baseline + RSS_TOLERANCE and time.monotonic() < deadline:
        time.sleep(0.1)
    grown = rss(engine.pid) - baseline
    print(f"{forger.frames} frames on {CONNECTIONS} connections; {rounds_during} legitimate rounds in "
          f"{elapsed:.1f} s; engine RSS {baseline >> 20} MiB, then {grown / 2**20:+.1f} MiB")
    assert grown <= RSS_TOLERANCE, f"the engine's RSS grew by {grown >> 20} MiB"

"""The SGLang backend's control messages under a link secret, over real ZMQ sockets on loopback.

The framing and the guard's checks run anywhere pyzmq is; the cases that
drive the backend's own manager and receiver (a forged done before the
decode confirmed: the prefill's pages stay held) need SGLang and skip
without it.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from typing import Any, Iterator

import pytest

from datadist_aio.integrations.message_guard import MessageGuard
from datadist_aio.integrations.sglang import sealed_messages as sm

zmq = pytest.importorskip("zmq")

SECRET = "the secret of this test's SGLang workers"
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
if HAVE_SGLANG:  # imported here: SGLang opens descriptors of its own as it loads
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import AbortNotification

    from datadist_aio.integrations.sglang import conn

    # SGLang's receivers share one ZMQ context for the process, which opens
    # its I/O thread's descriptors with its first socket: opened here, not
    # inside a test that counts descriptors.
    conn.DatadistAioKVReceiver._ctx.socket(zmq.PUSH).close(linger=0)


@pytest.fixture
def pull() -> Iterator[tuple[Any, Any, int]]:
    """A context, a PULL socket bound on loopback, its port."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield ctx, sock, port
    finally:
        sock.close(linger=0)
        ctx.term()


def _push(ctx: Any, port: int, *messages: list[bytes]) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for message in messages:
        sock.send_multipart(message)
    sock.close()


def _next(sock: Any, guard: MessageGuard, port: int, timeout_s: float = 5.0) -> Any:
    """The next message the guard opens, or None once every received one was refused and none came for a while."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        received = sm.receive(sock, 200)
        if received is None:
            continue
        msg, sender = received
        parts = sm.open_parts(guard, msg, port, sender)
        if parts is not None:
            return parts
    return None


def test_pack_and_unpack() -> None:
    parts = [b"DDA_DONE", b"17", b"", b"\x00" * 300]
    assert sm.unpack(sm.pack(parts)) == parts
    assert sm.unpack(b"") == []
    for bad in (b"\x00\x00\x00\x05abc", b"\x00\x00", sm.pack([b"x"] * sm.MAX_PARTS) + b"\x00\x00\x00\x00"):
        with pytest.raises(ValueError):
            sm.unpack(bad)
    with pytest.raises(ValueError):
        sm.pack([b""] * (sm.MAX_PARTS + 1))
    assert sm.port_of("tcp://10.0.0.1:4567") == 4567 and sm.port_of("tcp://[::1]:99") == 99


@pytest.mark.parametrize("encryption", ["off", "tls"])
def test_sealed_messages_pass_and_forged_replayed_or_misaddressed_ones_do_not(
        pull: tuple[Any, Any, int], encryption: str, caplog: pytest.LogCaptureFixture) -> None:
    ctx, sock, port = pull
    guard = MessageGuard(SECRET, encryption)
    done = [b"DDA_DONE", b"4242", b"2", b"", b"10.1.2.3:7000"]
    sealed = sm.seal_parts(MessageGuard(SECRET, encryption), done, port)
    assert sealed[0] == sm.SEALED_TAG and len(sealed) == 2
    if encryption == "tls":
        for clear in (b"DDA_DONE", b"4242", b"10.1.2.3"):
            assert clear not in sealed[1]
    with caplog.at_level(logging.WARNING, logger="datadist_aio.integrations.message_guard"):
        _push(ctx, port,
              done,  # plain, as SGLang's own
              sm.seal_parts(MessageGuard("a guessed secret", encryption), done, port),
              sm.seal_parts(MessageGuard(SECRET, encryption), done, port + 1),  # for another worker
              sealed)
        assert _next(sock, guard, port) == done
        _push(ctx, port, sealed)  # the same again: a replay
        assert _next(sock, guard, port, timeout_s=1.0) is None
    assert guard.refusals == 4
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "127.0.0.1" in lines[0] and "SGLang backend" in lines[0], lines


def test_without_a_secret_messages_cross_as_they_are(pull: tuple[Any, Any, int]) -> None:
    ctx, sock, port = pull
    guard = MessageGuard(None)
    done = [b"DDA_DONE", b"1", b"2", b"", b"s"]
    assert sm.seal_parts(guard, done, port) == done
    _push(ctx, port, done)
    assert _next(sock, guard, port) == done


# -- the backend's manager and receiver (SGLang's environment) ---------------------------------


@pytest.mark.skipif(not HAVE_SGLANG, reason="needs SGLang")
@pytest.mark.parametrize("encryption", ["off", "tls"])
def test_a_forged_done_leaves_the_prefills_pages_held(pull: tuple[Any, Any, int], encryption: str) -> None:
    """A prefill manager waiting for its decode's confirmation: a done from a
    process without the secret (plain, or sealed under a guess; Success or
    Failed, either of which lets SGLang free the pages) changes nothing;
    the decode manager's own done concludes the request."""
    ctx, sock, port = pull
    room, session = 4242, "127.0.0.1:7000"
    prefill = conn.DatadistAioKVManager.__new__(conn.DatadistAioKVManager)
    prefill._guard = MessageGuard(SECRET, encryption)
    prefill.server_socket, prefill.rank_port, prefill.deferred_bootstrap = sock, port, None
    prefill.request_status = {room: KVPoll.Transferring}
    prefill.transfer_infos = {room: {session: conn._TransferInfo(room, "127.0.0.1", 7000, session,
                                                                 np.zeros(1, np.int32), 0, 1, False)}}
    prefill._confirmed, prefill._last_sent, prefill.failure_records = {}, {room: time.monotonic()}, {}
    prefill._stopped = False
    handled: list[list[bytes]] = []

    def handle(msg: list[bytes]) -> None:
        handled.append(msg)
        prefill._on_prefill_message(msg)

    control = threading.Thread(target=prefill._control_loop, args=(handle,), daemon=True)
    control.start()
    decode = conn.DatadistAioKVManager.__new__(conn.DatadistAioKVManager)
    decode._guard = MessageGuard(SECRET, encryption)
    decode._zmq_ctx, decode._socket_lock = ctx, threading.Lock()
    decode._socket_cache, decode._monitor_cache, decode._socket_send_locks = {}, {}, {}
    decode.defer_decode_allocation = False
    decode.local_ip, decode.rank_port = "127.0.0.1", 7000
    try:
        for status in (KVPoll.Success, KVPoll.Failed):
            forged = [conn.DONE_TAG, str(room).encode(), str(int(status)).encode(), b"", session.encode()]
            _push(ctx, port, forged, sm.seal_parts(MessageGuard("a guessed secret", encryption), forged, port))
        time.sleep(1.0)
        assert handled == [], "a forged done reached the backend"
        assert prefill.request_status[room] == KVPoll.Transferring, "a forged done concluded the request"
        assert prefill._guard.refusals == 4
        decode._send_done(("127.0.0.1", port), room, KVPoll.Success)
        deadline = time.monotonic() + 5
        while prefill.request_status[room] != KVPoll.Success and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prefill.request_status[room] == KVPoll.Success, "the decode's own done was not taken"

        # SGLang's receiver sends through the backend's sealing socket too (its aborts here).
        receiver = conn.DatadistAioKVReceiver.__new__(conn.DatadistAioKVReceiver)
        receiver.kv_mgr = decode
        target, lock = receiver._connect_to_bootstrap_server({"rank_ip": "127.0.0.1", "rank_port": port})
        with lock:
            target.send_multipart(AbortNotification(room=room + 1, decode_ip="127.0.0.1", decode_port=7000,
                                                    generation=0).to_zmq())
        deadline = time.monotonic() + 5
        while len(handled) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(handled) == 2 and AbortNotification.from_zmq(handled[-1]).room == room + 1
    finally:
        prefill._stopped = True
        control.join(timeout=5)
        conn.DatadistAioKVReceiver.close_all_sockets()
        for cached in decode._socket_cache.values():
            cached.close(linger=0)
        for monitor in decode._monitor_cache.values():
            monitor.close(linger=0)

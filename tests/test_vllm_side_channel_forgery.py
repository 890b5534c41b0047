"""Forged side-channel messages between two workers, without vLLM.

A prefill process and a decode process, each one ``WorkerSide`` over numpy
arrays shaped like vLLM's CPU KV tensors, share a link secret; a third
process that does not know it sends them what would free or take blocks:
to the prefill a ``done`` (its lease freed before the decode read it), a
lease claim and a cancel; to the decode a share, claim and commit of its
inbox (the decode would copy unwritten inbox blocks instead of pulling).
Each is refused, changes nothing, and the decode then reads exact bytes.
Without a secret the same messages are acted on: the control that shows
they are well formed.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import socket
import time
from typing import Any, Optional

import numpy as np
import pytest

from datadist_aio.integrations.message_guard import AUTH_KEY_ENV, ENCRYPTION_ENV, MessageGuard
from datadist_aio.integrations.vllm.metadata import LoadSpec, StepPlan
from datadist_aio.integrations.vllm.side_channel import encode_body, encode_frame, frame
from datadist_aio.integrations.vllm.worker import WorkerSettings, WorkerSide
from test_vllm_push import _ask, _commands, _start, wait_loaded
from test_vllm_worker_side import BLOCKS, SHAPE, FakeTensor, _stop, layer_arrays

REQ, TOKEN = "p-a", "t-a"
LOCAL, REMOTE = [5, 6, 7], [3, 9, 4]


def _environment(secret: Optional[str]) -> None:
    os.environ.pop(ENCRYPTION_ENV, None)
    if secret is None:
        os.environ.pop(AUTH_KEY_ENV, None)
    else:
        os.environ[AUTH_KEY_ENV] = secret


def _prefill(conn: Any, secret: Optional[str], encryption: str) -> None:
    _environment(secret)
    arrays = layer_arrays(1)
    side = WorkerSide(WorkerSettings(engine_id="prefill", is_consumer=False, load_timeout_s=5.0,
                                     link_encryption=encryption))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    conn.send(side.side_channel_port)
    try:
        for command, value in _commands(conn):
            if command == "lease":
                side.start_loads(StepPlan(leases={REQ: time.monotonic() + 60}, lease_tokens={REQ: TOKEN}))
                conn.send("ok")
            elif command == "freed_within":  # the requests freed within value[0] s (sooner once value[1] are)
                freed: set[str] = set()
                deadline = time.monotonic() + value[0]
                while time.monotonic() < deadline and not (value[1] and set(value[1]) <= freed):
                    freed |= side.get_finished()[0]
                    time.sleep(0.01)
                conn.send(sorted(freed))
            elif command == "refusals":
                conn.send(side.guard.refusals)
    finally:
        side.shutdown()


def _decode(conn: Any, secret: Optional[str], encryption: str) -> None:
    _environment(secret)
    arrays = {name: np.zeros(SHAPE, np.float32) for name in layer_arrays(0)}
    side = WorkerSide(WorkerSettings(engine_id="decode", is_producer=False, transfer_mode="push_layerwise",
                                     inbox_blocks=8, inbox_share_blocks=4, load_timeout_s=5.0,
                                     link_encryption=encryption))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    conn.send(side.side_channel_port)
    try:
        for command, value in _commands(conn):
            if command == "state":
                assert side._inbox is not None
                conn.send(side._inbox.state("prefill", REQ))
            elif command == "refusals":
                conn.send(side.guard.refusals)
            elif command == "load":
                spec = LoadSpec("a", LOCAL, REMOTE, "prefill", "127.0.0.1", value, REQ, lease_token=TOKEN)
                side.start_loads(StepPlan(loads={"a": spec}))
                done, failed = wait_loaded(side, 30)
                conn.send({"done": done, "failed": failed, "arrays": {name: a.copy() for name, a in arrays.items()}})
    finally:
        side.shutdown()


def _forge(conn: Any, sends: list[tuple[int, bytes]]) -> None:
    """The third process: each frame on a connection of its own; what came back for each."""
    answers = []
    for port, data in sends:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            received = b""
            try:
                while chunk := sock.recv(65536):
                    received += chunk
            except OSError:
                pass
            answers.append(received)
    conn.send(answers)


def _forgeries(pport: int, dport: int) -> list[tuple[int, bytes]]:
    """What a process without the secret sends: plain, and sealed under a guessed secret."""
    to_prefill = [
        {"op": "done", "req_ids": [REQ], "readers": 1},
        {"op": "hold", "requests": {REQ: TOKEN}, "engine_id": "prefill", "hold_s": 3600},
        {"op": "cancel", "transfer_id": "x-" + REQ},
    ]
    # One connection: the share, then the claim of blocks of it, then the commit.
    to_decode = [
        {"op": "share", "engine_id": "prefill", "blocks": 4},
        {"op": "claim", "engine_id": "prefill", "claims": {REQ: [0, 1, 2]}, "hold_s": 60},
        {"op": "commit", "engine_id": "prefill", "req_ids": [REQ]},
    ]
    guessed = MessageGuard("a guessed secret")
    sends = [(pport, encode_frame(message)) for message in to_prefill]
    sends += [(pport, frame(guessed.seal_request(encode_body(m), pport)[0])) for m in to_prefill]
    sends.append((dport, b"".join(encode_frame(message) for message in to_decode)))
    sends.append((dport, b"".join(frame(guessed.seal_request(encode_body(m), dport)[0]) for m in to_decode)))
    return sends


@pytest.mark.parametrize("secret,encryption", [(secrets.token_hex(16), "off"), (secrets.token_hex(16), "tls"),
                                               (None, "off")], ids=["secret", "encrypted", "no-secret"])
def test_forged_messages_free_nothing_and_the_decode_reads_exact_bytes(secret: Optional[str],
                                                                       encryption: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    prefill, pconn, pport = _start(ctx, _prefill, secret, encryption)
    try:
        decode, dconn, dport = _start(ctx, _decode, secret, encryption)
    except BaseException:
        _stop(prefill, pconn)
        raise
    try:
        assert _ask(pconn, "lease", None) == "ok"
        parent, child = ctx.Pipe()
        forger = ctx.Process(target=_forge, args=(child, _forgeries(pport, dport)), daemon=True)
        forger.start()
        child.close()
        try:
            assert parent.poll(60), "the forging process did not finish"
            answers = parent.recv()
        finally:
            forger.join(timeout=10)
            if forger.is_alive():
                forger.kill()
                forger.join()
            forger.close()
            parent.close()
        freed = _ask(pconn, "freed_within", (1.0, []))
        state = _ask(dconn, "state", None)
        if secret is None:
            # The control: unauthenticated, the forger frees the prefill's
            # blocks and commits unwritten inbox blocks as the request's KV.
            assert freed == [REQ] and state == "committed"
            assert all(answers[i] for i in (0, 1, 2)), "the plain forgeries were not answered"
            return
        assert freed == [], "a forged done freed the prefill's blocks"
        assert state is None, "a forged claim or commit took inbox blocks"
        assert answers == [b""] * len(answers), "a forged message got an answer"
        assert _ask(pconn, "refusals", None) == 6 and _ask(dconn, "refusals", None) == 2
        result = _ask(dconn, "load", pport, timeout=60)
        assert result["done"] == ["a"] and result["failed"] == []
        source = layer_arrays(1)
        untouched = [b for b in range(BLOCKS) if b not in LOCAL]
        for name, array in result["arrays"].items():
            np.testing.assert_array_equal(array[LOCAL], source[name][REMOTE])
            assert not array[untouched].any()
        assert _ask(pconn, "freed_within", (10.0, [REQ])) == [REQ], "the decode's own done did not free the blocks"
    finally:
        _stop(decode, dconn)
        _stop(prefill, pconn)

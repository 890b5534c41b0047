"""Authenticated links: a shared secret proven both ways before anything else.

Between processes: matching secrets link and move bytes; a missing or wrong
secret on either side fails `link_clusters` with LLM_AUTH_FAILED; the
environment variable stands in for the option, which wins over it. Against a
listening engine in this process, a raw socket speaking the handshake with
Python's own hmac module links when it knows the secret; without it, with a
wrong one, replaying a captured handshake or reflecting the engine's
challenge, it learns nothing and writes nothing.
"""

from __future__ import annotations

import hmac
import os
import socket

import pytest

import datadist_aio as dd
from support.options import make_options
from support.peer import PeerGroup, raises_status
from support.links import assert_both_ways
from support.raw_client import BLOCK, FORGER_ID, SERVER_ID, request, untouched
from support.wire_frames import (
    ACCEPTOR,
    AUTHENTICATED,
    CHALLENGE_T,
    HELLO_ACK,
    HELLO_ACK_T,
    HELLO_T,
    INITIATOR,
    PROOF_T,
    WRITE_ACK_T,
    WRITE_T,
    frame,
    recv_frame,
)
from support.wire_frames import hello as hello_body
from support.wire_frames import proof as hmac_proof

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
AUTH_FAILED = dd.LLMStatusCode.LLM_AUTH_FAILED
SECRET = "correct horse battery staple"
A, B = 1, 2

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def group():
    with PeerGroup() as peers:
        yield peers


@pytest.mark.parametrize(
    "a_key, b_key, expected",
    [
        (SECRET, SECRET, SUCCESS),
        (None, SECRET, AUTH_FAILED),  # the initiator has no secret
        (SECRET, None, AUTH_FAILED),  # the acceptor has none
        (SECRET, "another secret", AUTH_FAILED),
    ],
)
def test_link_needs_the_same_secret_on_both_ends(group, a_key, b_key, expected):
    a = group.start("a", dd.LLMRole.PROMPT, A, options={"auth_key": a_key} if a_key else {})
    b = group.start("b", dd.LLMRole.DECODER, B, options={"auth_key": b_key} if b_key else {})
    status, per_cluster = a.link(b)
    assert (status, per_cluster) == (expected, [expected])
    if expected is SUCCESS:
        assert_both_ways(a, b, (40, 41), seed=4)
    else:
        # Nothing was linked on either end.
        with raises_status(dd.LLMStatusCode.LLM_NOT_YET_LINK):
            a.datadist("link_transport", B)
        with raises_status(dd.LLMStatusCode.LLM_NOT_YET_LINK):
            b.datadist("link_transport", A)


def test_the_environment_variable_and_the_option(group, monkeypatch):
    # The children inherit the variable; B's option wins over it.
    monkeypatch.setenv("DATADIST_AIO_AUTH_KEY", "from the environment")
    a = group.start("a", dd.LLMRole.PROMPT, A)
    b = group.start("b", dd.LLMRole.DECODER, B, options={"auth_key": "from the option"})
    c = group.start("c", dd.LLMRole.DECODER, 3)
    assert a.link(b) == (AUTH_FAILED, [AUTH_FAILED])
    assert a.link(c) == (SUCCESS, [SUCCESS])
    assert_both_ways(a, c, (42, 43), seed=5)


# -- the handshake as a raw client speaks it -------------------------------------------------


@pytest.fixture
def server():
    """A listening engine with a secret and a zeroed blocks cache (2 tensors x 16 blocks of 256 bytes)."""
    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, SERVER_ID)
    datadist.init(make_options(listen_ip_info="127.0.0.1:0", enable_remote_cache_accessible=True, auth_key=SECRET))
    desc = dd.CacheDesc(2, [16, BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)
    cache = datadist.cache_manager.allocate_blocks_cache(desc, dd.BlocksCacheKey(SERVER_ID, 0))
    for t in range(2):
        cache.as_numpy(t)[:] = 0
    yield datadist, cache
    datadist.finalize()


def hello(nonce: bytes, link_nonce: int = 1, flags: int = AUTHENTICATED) -> bytes:
    return hello_body(FORGER_ID, SERVER_ID, link_nonce, flags, nonce=nonce if flags & AUTHENTICATED else b"")


def proof(label: bytes, transcript: bytes, key: str = SECRET) -> bytes:
    return hmac_proof(key, label, transcript)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def assert_refused(sock: socket.socket) -> None:
    """An ack with LLM_AUTH_FAILED that names nothing, then the close."""
    kind, status, _, body, _ = recv_frame(sock)
    assert (kind, status) == (HELLO_ACK_T, AUTH_FAILED.value)
    assert HELLO_ACK.unpack(body) == (0, 0, 0)  # not even the cluster id
    with pytest.raises(ConnectionError):
        recv_frame(sock)


def test_a_client_that_knows_the_secret_links_and_writes(server):
    datadist, cache = server
    with connect(datadist.listen_port) as sock:
        body = hello(os.urandom(16), link_nonce=51)
        sock.sendall(frame(HELLO_T, body))
        kind, status, _, challenge, _ = recv_frame(sock)
        assert (kind, status, len(challenge)) == (CHALLENGE_T, 0, 16)
        transcript = body + challenge
        sock.sendall(frame(PROOF_T, proof(INITIATOR, transcript)))
        kind, status, _, ack, _ = recv_frame(sock)
        assert (kind, status) == (HELLO_ACK_T, 0)
        cluster_id, _role, flags = HELLO_ACK.unpack(ack[: HELLO_ACK.size])
        assert cluster_id == SERVER_ID and flags & AUTHENTICATED
        # The engine proves the secret back over the same transcript and its ack.
        assert hmac.compare_digest(ack[-32:], proof(ACCEPTOR, transcript + ack[:-32]))
        sock.sendall(frame(WRITE_T, request([(1, 4, 0, BLOCK)]), b"\x07" * BLOCK, op_id=6))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 6)
    assert (cache.as_numpy(1)[4] == 7).all()


def test_a_client_without_the_secret_learns_nothing(server):
    datadist, cache = server
    with connect(datadist.listen_port) as sock:
        sock.sendall(frame(HELLO_T, hello(b"", flags=0)))
        assert_refused(sock)
    assert untouched(cache)


@pytest.mark.parametrize("attack", ["wrong_key", "replay", "reflect", "no_proof"])
def test_forged_proofs_are_refused(server, attack):
    datadist, cache = server
    port = datadist.listen_port
    body = hello(os.urandom(16), link_nonce=52)
    if attack == "replay":
        # A handshake captured in full (the secret known to the first client)...
        with connect(port) as first:
            first.sendall(frame(HELLO_T, body))
            challenge = recv_frame(first)[3]
            captured = proof(INITIATOR, body + challenge)
            first.sendall(frame(PROOF_T, captured))
            assert recv_frame(first)[:2] == (HELLO_ACK_T, 0)
    with connect(port) as sock:
        sock.sendall(frame(HELLO_T, body))
        kind, _, _, challenge, _ = recv_frame(sock)
        assert kind == CHALLENGE_T
        if attack == "wrong_key":
            sock.sendall(frame(PROOF_T, proof(INITIATOR, body + challenge, key="guess")))
        elif attack == "replay":  # ...played again: the engine's new challenge makes it worthless
            sock.sendall(frame(PROOF_T, captured))
        elif attack == "reflect":  # the engine's own challenge, and its own label, sent back
            sock.sendall(frame(PROOF_T, challenge * 2))
        else:
            sock.sendall(frame(WRITE_T, request([(0, 0, 0, BLOCK)]), b"\x01" * BLOCK))
        assert_refused(sock)
    if attack != "replay":
        assert untouched(cache)


def test_a_proof_made_with_the_acceptors_label_is_refused(server):
    # The acceptor's proof is bound to its direction: a client cannot pass
    # one off as its own.
    datadist, _ = server
    with connect(datadist.listen_port) as sock:
        body = hello(os.urandom(16), link_nonce=53)
        sock.sendall(frame(HELLO_T, body))
        challenge = recv_frame(sock)[3]
        sock.sendall(frame(PROOF_T, proof(ACCEPTOR, body + challenge)))
        assert_refused(sock)


def test_the_key_option_is_checked():
    config = dd.LLMConfig()
    with pytest.raises(TypeError):
        config.auth_key = b"bytes"  # type: ignore[assignment]
    with pytest.raises(dd.LLMException):
        config.auth_key = ""
    config.auth_key = "s"
    assert config.generate_options()["llm.AuthKey"] == "s"

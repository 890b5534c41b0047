"""Link encryption: TLS 1.3 on every TCP connection of a link, keyed from the
link secret.

Through an on-path relay between a prompt engine (this process) and a decode
engine (another process) on loopback ports: with encryption, nothing of a
pushed KV cache can be read off the wire (and without it, it can, so the check
can fail); one byte altered after the handshake fails the push with
LLM_LINK_FAILED, drops the link, lands no altered byte, and the peers link
again; a recorded session replayed to the decode is refused and writes
nothing. Besides: the switch's errors at init, the refusal of a peer whose
setting differs (naming both), and what link_transport and link_stats say.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

import datadist_aio as dd
from datadist_aio import _native
from support.cache_bytes import tensor_bytes
from support.options import make_options
from support.peer import Peer, PeerGroup, cluster_info, raises_status, wait_until
from support.relay import Relay

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINK_FAILED = dd.LLMStatusCode.LLM_LINK_FAILED
PARAM_INVALID = dd.LLMStatusCode.LLM_PARAM_INVALID
SECRET = "a link secret of this test"
PROMPT, DECODE = 1, 2
MODEL = 7
CIPHER = "TLS_AES_128_GCM_SHA256"
MARKER = b"\x8dKV-CACHE-MARK\x8e\xa7"  # 16 bytes, none of them zero
TENSORS, BLOCKS, BLOCK_BYTES = 2, 64, 32 * 1024  # 4 MiB of blocks: a layer's K and V
TLS = {"auth_key": SECRET, "link_encryption": "tls", "transport": "tcp"}
PLAIN = {"auth_key": SECRET, "transport": "tcp"}

pytestmark = pytest.mark.timeout(120)

assert len(MARKER) == 16


def desc() -> dd.CacheDesc:
    return dd.CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], dd.DataType.DT_UINT8, dd.Placement.HOST)


@pytest.fixture
def group():
    with PeerGroup() as peers:
        yield peers


class Prompt:
    """The prompt engine in this process, with a blocks cache full of MARKER."""

    def __init__(self, **options: object) -> None:
        self.datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, PROMPT)
        self.datadist.init(make_options(pool_bytes=16 << 20, enable_remote_cache_accessible=True, **options))
        self.cache = self.datadist.cache_manager.allocate_blocks_cache(desc())
        self.content = np.frombuffer(MARKER * (BLOCKS * BLOCK_BYTES // len(MARKER)), dtype=np.uint8)
        for t in range(TENSORS):
            tensor_bytes(self.cache, t)[:] = self.content

    def link(self, port: int, timeout_ms: int = 10000) -> dd.LLMStatusCode:
        status, _ = self.datadist.link_clusters([cluster_info(DECODE, port)], timeout_ms)
        return status

    def push(self) -> None:
        blocks = list(range(BLOCKS))
        self.datadist.cache_manager.push_blocks(dd.BlocksCacheKey(DECODE, MODEL), self.cache, blocks, blocks)

    def close(self) -> None:
        self.datadist.finalize()


@pytest.fixture
def prompt_factory():
    made: list[Prompt] = []

    def make(**options: object) -> Prompt:
        made.append(Prompt(**options))
        return made[-1]

    yield make
    for prompt in made:
        prompt.close()


def start_decode(group: PeerGroup, options: dict) -> tuple[Peer, object, np.ndarray]:
    """The decode engine, its blocks cache filled with seeded bytes (its old content)."""
    decode = group.start("decode", dd.LLMRole.DECODER, DECODE, options=options)
    ref = decode.allocate(desc(), blocks=True, model_id=MODEL)
    old = np.stack(decode.fill(ref, seed=11))
    return decode, ref, old


def landed(decode: Peer, ref: object) -> np.ndarray:
    return np.stack(decode.read(ref))


def links_on(decode: Peer) -> int:
    return decode.engine("listener_stats")["links"]


# -- reading the wire


@pytest.mark.parametrize("options, readable", [(TLS, False), (PLAIN, True)], ids=["tls", "plain"])
def test_nothing_of_the_cache_crosses_the_relay_in_the_clear(group, prompt_factory, options, readable):
    decode, ref, _ = start_decode(group, options)
    prompt = prompt_factory(**options)
    with Relay(decode.listen_port) as relay:
        assert prompt.link(relay.port) == SUCCESS
        prompt.push()
        wire = relay.stream_to_acceptor()
    # The push went through the relay whole...
    assert len(wire) > TENSORS * BLOCKS * BLOCK_BYTES
    np.testing.assert_array_equal(landed(decode, ref), np.stack([prompt.content] * TENSORS))
    # ... and only the plain link shows the marker on the wire.
    assert (MARKER in wire) is readable
    assert (MARKER[:8] in wire) is readable


# -- altering the wire


def test_a_byte_altered_after_the_handshake_fails_the_push_and_lands_nothing(group, prompt_factory):
    decode, ref, old = start_decode(group, TLS)
    prompt = prompt_factory(**TLS)
    new = np.stack([prompt.content] * TENSORS)
    with Relay(decode.listen_port, flip_at=256 * 1024) as relay:
        assert prompt.link(relay.port) == SUCCESS
        with raises_status(LINK_FAILED) as info:
            prompt.push()
        assert relay.flipped
    assert "link" in str(info.value)
    # The link is dropped on both ends...
    wait_until(lambda: links_on(decode) == 0, "the decode drops the link")
    with raises_status(dd.LLMStatusCode.LLM_NOT_YET_LINK):
        prompt.datadist.link_transport(DECODE)
    # ... and no altered byte landed: each is the block's old byte or its new one.
    got = landed(decode, ref)
    assert np.all((got == old) | (got == new)), "an altered byte landed in the destination cache"
    # Linked again (no relay in the way), the push lands whole.
    assert prompt.link(decode.listen_port) == SUCCESS
    prompt.push()
    np.testing.assert_array_equal(landed(decode, ref), new)


def test_a_byte_altered_on_the_way_back_fails_the_pull_and_lands_nothing(group, prompt_factory):
    """A pull's data come from the acceptor: the initiator's end checks them."""
    decode, ref, old = start_decode(group, TLS)
    prompt = prompt_factory(**TLS)
    before = np.stack([tensor_bytes(prompt.cache, t).copy() for t in range(TENSORS)])
    blocks = list(range(BLOCKS))
    with Relay(decode.listen_port, flip_at=256 * 1024, flip_to_initiator=True) as relay:
        assert prompt.link(relay.port) == SUCCESS
        with raises_status(LINK_FAILED) as info:
            prompt.datadist.cache_manager.pull_blocks(dd.BlocksCacheKey(DECODE, MODEL), prompt.cache, blocks, blocks)
        assert relay.flipped
    assert "TLS" in str(info.value) and "altered" in str(info.value), str(info.value)
    got = np.stack([tensor_bytes(prompt.cache, t) for t in range(TENSORS)])
    assert np.all((got == before) | (got == old)), "an altered byte landed in the destination cache"
    wait_until(lambda: links_on(decode) == 0, "the decode drops the link")
    assert prompt.link(decode.listen_port) == SUCCESS
    prompt.datadist.cache_manager.pull_blocks(dd.BlocksCacheKey(DECODE, MODEL), prompt.cache, blocks, blocks)
    np.testing.assert_array_equal(np.stack([tensor_bytes(prompt.cache, t) for t in range(TENSORS)]), old)


def test_an_acceptor_that_grants_fewer_connections_keys_each_it_keeps(group, prompt_factory):
    decode, ref, _ = start_decode(group, {**TLS, "tcp_connections_per_peer": 1})
    prompt = prompt_factory(**TLS, tcp_connections_per_peer=3)
    assert prompt.link(decode.listen_port) == SUCCESS
    prompt.push()
    np.testing.assert_array_equal(landed(decode, ref), np.stack([prompt.content] * TENSORS))
    stats = prompt.datadist._engine.link_stats(DECODE)
    assert stats["connections"] == stats["encrypted"] == 1


def test_a_byte_altered_in_the_tls_handshake_fails_the_link(group, prompt_factory):
    decode, ref, old = start_decode(group, TLS)
    prompt = prompt_factory(**TLS)
    # Past the hello and the proof (well under 200 bytes): inside the ClientHello.
    with Relay(decode.listen_port, flip_at=200) as relay:
        assert prompt.link(relay.port) == LINK_FAILED
        assert relay.flipped
    message = _native.last_error_message()
    assert "TLS handshake" in message, message
    wait_until(lambda: links_on(decode) == 0, "the decode drops the link")
    np.testing.assert_array_equal(landed(decode, ref), old)
    assert prompt.link(decode.listen_port) == SUCCESS
    prompt.push()
    np.testing.assert_array_equal(landed(decode, ref), np.stack([prompt.content] * TENSORS))


# -- replaying the wire


def test_a_replayed_session_is_refused_and_writes_nothing(group, prompt_factory):
    decode, ref, _ = start_decode(group, TLS)
    prompt = prompt_factory(**TLS)
    with Relay(decode.listen_port) as relay:
        assert prompt.link(relay.port) == SUCCESS
        prompt.push()
        recorded = [bytes(stream) for stream in relay.to_acceptor]
    # The link went with the relay; the decode's cache back to other bytes.
    wait_until(lambda: links_on(decode) == 0, "the decode drops the link")
    before = np.stack(decode.fill(ref, seed=12))
    # Every connection's recorded bytes, sent again at once to the decode.
    socks = [socket.create_connection(("127.0.0.1", decode.listen_port), timeout=10) for _ in recorded]
    try:
        for sock, stream in zip(socks, recorded):
            try:
                sock.sendall(stream)
            except OSError:
                pass  # reset by the decode once it refused the replayed proof
        for sock in socks:
            try:
                while sock.recv(1 << 16):
                    pass
            except OSError:
                pass  # likewise
    finally:
        for sock in socks:
            sock.close()
    time.sleep(0.2)
    assert links_on(decode) == 0
    np.testing.assert_array_equal(landed(decode, ref), before)


def test_a_peer_that_proves_the_secret_but_never_starts_tls_is_dropped():
    """The acceptor's TLS handshakes have the handshake timeout: a peer that
    proved the secret and then sends nothing holds the link no longer."""
    import hmac
    import os

    from support.wire_frames import (
        ACCEPTOR, AUTHENTICATED, CHALLENGE_T, HELLO_ACK, HELLO_ACK_T, HELLO_T, INITIATOR, PROOF_T, frame, recv_frame,
    )
    from support.wire_frames import hello as hello_body
    from support.wire_frames import proof as hmac_proof

    encrypted = 1024  # the hello's and the ack's kEncrypted
    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, DECODE)
    try:
        datadist.init(make_options(listen_ip_info="127.0.0.1:0", handshake_timeout_ms=500, **TLS))
        with socket.create_connection(("127.0.0.1", datadist.listen_port), timeout=10) as sock:
            body = hello_body(PROMPT, DECODE, 77, AUTHENTICATED | encrypted, nonce=os.urandom(16))
            sock.sendall(frame(HELLO_T, body))
            kind, status, _, challenge, _ = recv_frame(sock)
            assert (kind, status) == (CHALLENGE_T, 0)
            transcript = body + challenge
            sock.sendall(frame(PROOF_T, hmac_proof(SECRET, INITIATOR, transcript)))
            kind, status, _, ack, _ = recv_frame(sock)
            assert (kind, status) == (HELLO_ACK_T, 0)
            assert HELLO_ACK.unpack(ack[: HELLO_ACK.size])[2] & encrypted
            assert hmac.compare_digest(ack[-32:], hmac_proof(SECRET, ACCEPTOR, transcript + ack[:-32]))
            # No ClientHello follows: the link goes at the handshake timeout.
            wait_until(lambda: datadist._engine.listener_stats()["links"] == 0, "the acceptor drops the link", 10)
            assert sock.recv(1) == b""
    finally:
        datadist.finalize()


# -- the switch


def init_fails(options: dict[str, str], status: dd.LLMStatusCode = PARAM_INVALID) -> str:
    """Why init with `options` fails with `status` (the instance finalized either way)."""
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, PROMPT)
    try:
        with raises_status(status) as info:
            datadist.init(options)
    finally:
        datadist.finalize()
    return str(info.value)


def test_tls_without_a_secret_is_refused_at_init(monkeypatch):
    monkeypatch.delenv("DATADIST_AIO_AUTH_KEY", raising=False)
    assert "needs the link secret" in init_fails(make_options(link_encryption="tls"))


def test_the_environment_variable_switches_it(monkeypatch):
    monkeypatch.delenv("DATADIST_AIO_AUTH_KEY", raising=False)
    monkeypatch.setenv("DATADIST_AIO_LINK_ENCRYPTION", "tls")
    assert "needs the link secret" in init_fails(make_options())
    # The option wins over it.
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, PROMPT)
    try:
        datadist.init(make_options(link_encryption="off"))
    finally:
        datadist.finalize()
    monkeypatch.setenv("DATADIST_AIO_LINK_ENCRYPTION", "rot13")
    assert "must be off or tls, got 'rot13'" in init_fails(make_options())


def test_the_config_checks_its_values():
    config = dd.LLMConfig()
    assert config.link_encryption is None and config.allow_unencrypted_ucx is None
    with raises_status(PARAM_INVALID):
        config.link_encryption = "on"
    with pytest.raises(TypeError):
        config.link_encryption = True  # type: ignore[assignment]
    with pytest.raises(TypeError):
        config.allow_unencrypted_ucx = "1"  # type: ignore[assignment]
    config.link_encryption = "tls"
    config.allow_unencrypted_ucx = True
    options = config.generate_options()
    assert options["llm.LinkEncryption"] == "tls" and options["llm.AllowUnencryptedUcx"] == "1"


def test_ucx_is_refused_with_encryption_unless_allowed():
    why = init_fails(make_options(auth_key=SECRET, link_encryption="tls", transport="ucx"))
    assert "allow_unencrypted_ucx" in why and "unencrypted" in why
    # Allowed, the switch lets it by: UCX starts where it is installed.
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, PROMPT)
    try:
        datadist.init(
            make_options(auth_key=SECRET, link_encryption="tls", transport="ucx", allow_unencrypted_ucx=True)
        )
    except dd.LLMException as error:
        assert error.status_code == dd.LLMStatusCode.LLM_FEATURE_NOT_ENABLED, error
    finally:
        datadist.finalize()


# -- agreement


@pytest.mark.parametrize("here, there", [("tls", "off"), ("off", "tls")])
def test_peers_that_disagree_are_not_linked_and_told_why(group, prompt_factory, here, there):
    decode = group.start("decode", dd.LLMRole.DECODER, DECODE, options={**PLAIN, "link_encryption": there})
    prompt = prompt_factory(**PLAIN, link_encryption=here)
    assert prompt.link(decode.listen_port) == LINK_FAILED
    message = _native.last_error_message()
    assert "link encryption differs" in message, message
    assert f'"{here}" on this end, cluster {PROMPT}' in message, message
    assert f'"{there}" on cluster {DECODE}' in message, message
    assert links_on(decode) == 0
    with raises_status(dd.LLMStatusCode.LLM_NOT_YET_LINK):
        decode.datadist("link_transport", PROMPT)


# -- what a link says of itself


def test_link_transport_and_link_stats_say_how_a_link_is_protected(group, prompt_factory):
    decode, ref, _ = start_decode(group, TLS)
    prompt = prompt_factory(**TLS)
    assert prompt.link(decode.listen_port) == SUCCESS
    prompt.push()  # every connection's handshake has ended at both ends once a push went by
    np.testing.assert_array_equal(landed(decode, ref), np.stack([prompt.content] * TENSORS))
    for path, stats in (
        (prompt.datadist.link_transport(DECODE), prompt.datadist._engine.link_stats(DECODE)),
        (decode.datadist("link_transport", PROMPT), decode.engine("link_stats", PROMPT)),
    ):
        assert path == "tcp" and isinstance(path, str)
        assert path.encrypted is True and path.cipher == CIPHER
        assert stats["encrypted"] == stats["connections"] >= 1
        assert stats["ktls"] == (stats["connections"] if path.kernel_tls else 0)


def test_an_unencrypted_link_says_so(group, prompt_factory):
    decode = group.start("decode", dd.LLMRole.DECODER, DECODE, options=PLAIN)
    prompt = prompt_factory(**PLAIN)
    assert prompt.link(decode.listen_port) == SUCCESS
    path = prompt.datadist.link_transport(DECODE)
    assert path == "tcp" and path.encrypted is False and path.cipher == "" and path.kernel_tls is False
    stats = prompt.datadist._engine.link_stats(DECODE)
    assert stats["encrypted"] == 0 and stats["ktls"] == 0


def test_a_same_host_link_keeps_its_kernel_copies(group, prompt_factory):
    """On one host the link moves to Unix sockets where the kernel lets it,
    and those carry no TLS; what stays on TCP is encrypted."""
    options = {**TLS, "transport": "auto"}
    decode, ref, _ = start_decode(group, options)
    prompt = prompt_factory(**options)
    assert prompt.link(decode.listen_port) == SUCCESS
    stats = prompt.datadist._engine.link_stats(DECODE)
    on_tcp = stats["connections"] - stats["local_sockets"]
    assert stats["encrypted"] == on_tcp
    assert prompt.datadist.link_transport(DECODE).encrypted is (on_tcp > 0)
    prompt.push()
    np.testing.assert_array_equal(landed(decode, ref), np.stack([prompt.content] * TENSORS))


# -- the benchmark


def test_the_encryption_benchmark_runs_and_checks_its_bytes(tmp_path):
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "datadist_aio.bench", "--encryption", "--cache-size", "8M", "--rounds", "1",
         "--iterations", "1", "--small-ops", "20", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "datadist_bench_encryption.json").read_text())
    rounds = {row["variant"]: row for row in report["rounds"]}
    assert rounds["tls"]["encrypted"] is True and rounds["tls"]["cipher"] == CIPHER
    assert rounds["off"]["encrypted"] is False
    assert all(row["verified"] for row in report["rounds"])
    assert "tls/plain" in done.stdout

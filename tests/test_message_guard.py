"""The side channels' message guard (``message_guard.py``) and libcrypto's AES-256-GCM under it."""

from __future__ import annotations

import logging

import pytest

from datadist_aio.integrations import aes_gcm
from datadist_aio.integrations.message_guard import MessageGuard, Refused

SECRET = "a link secret of this test"


class _Clock:
    def __init__(self) -> None:
        self.ns = 1_800_000_000 * 10**9

    def __call__(self) -> int:
        return self.ns


def test_aes_gcm_known_answers_and_tamper() -> None:
    # The GCM specification's test cases 13 and 14 (AES-256, zero key and IV).
    assert aes_gcm.seal(bytes(32), bytes(12), b"", b"").hex() == "530f8afbc74536b9a963b4f1c4cb738b"
    assert aes_gcm.seal(bytes(32), bytes(12), bytes(16), b"").hex() == (
        "cea7403d4d606b6e074ec5d3baf39d18" "d0d1c8a799996bf0265b98b5d48ab919")
    key, iv = bytes(range(32)), bytes(range(12))
    sealed = aes_gcm.seal(key, iv, b"prompt KV" * 100, b"header")
    assert aes_gcm.open_sealed(key, iv, sealed, b"header") == b"prompt KV" * 100
    for index in (0, 450, len(sealed) - 1):
        altered = bytearray(sealed)
        altered[index] ^= 1
        assert aes_gcm.open_sealed(key, iv, bytes(altered), b"header") is None
    assert aes_gcm.open_sealed(key, iv, sealed, b"headeR") is None
    assert aes_gcm.open_sealed(bytes(32), iv, sealed, b"header") is None
    assert aes_gcm.open_sealed(key, iv, sealed[:10], b"header") is None
    with pytest.raises(ValueError, match="32 bytes"):
        aes_gcm.seal(bytes(16), iv, b"", b"")


@pytest.mark.parametrize("encryption", ["off", "tls"])
def test_request_and_answer_round_trip(encryption: str) -> None:
    sender, receiver = MessageGuard(SECRET, encryption), MessageGuard(SECRET, encryption)
    body, nonce = sender.seal_request(b'{"op":"done","req_ids":["r-17"]}', 4000)
    payload, seen = receiver.open_request(body, 4000)
    assert (payload, seen) == (b'{"op":"done","req_ids":["r-17"]}', nonce)
    answer = receiver.seal_answer(b'{"ok":true}', nonce)
    assert sender.open_answer(answer, nonce) == b'{"ok":true}'
    assert (b"done" in body, b"r-17" in body) == ((encryption == "off"),) * 2
    assert receiver.refusals == 0


@pytest.mark.parametrize("encryption", ["off", "tls"])
def test_forged_altered_and_foreign_messages_are_refused(encryption: str) -> None:
    receiver = MessageGuard(SECRET, encryption)
    body, _ = MessageGuard("another secret", encryption).seal_request(b'{"op":"done"}', 4000)
    with pytest.raises(Refused, match="does not prove"):
        receiver.open_request(body, 4000)
    with pytest.raises(Refused, match="not sealed"):
        receiver.open_request(b'{"op":"done","req_ids":["r-1"]}', 4000)
    good, _ = MessageGuard(SECRET, encryption).seal_request(b'{"op":"done","req_ids":["r-1"]}', 4000)
    for index in (5, 20, 60, len(good) - 1):
        altered = bytearray(good)
        altered[index] ^= 0x40
        with pytest.raises(Refused):
            receiver.open_request(bytes(altered), 4000)
    other = "tls" if encryption == "off" else "off"
    mixed, _ = MessageGuard(SECRET, other).seal_request(b'{"op":"done"}', 4000)
    with pytest.raises(Refused, match="link encryption"):
        receiver.open_request(mixed, 4000)
    with pytest.raises(Refused, match="not this worker's"):
        receiver.open_request(good, 4001)  # to another rank's port
    receiver.open_request(good, 4000)  # the untouched one still passes


def test_replayed_and_stale_requests_are_refused() -> None:
    clock = _Clock()
    sender, receiver = MessageGuard(SECRET, clock=clock), MessageGuard(SECRET, clock=clock)
    body, _ = sender.seal_request(b'{"op":"done"}', 7)
    receiver.open_request(body, 7)
    with pytest.raises(Refused, match="replayed"):
        receiver.open_request(body, 7)
    clock.ns += 61 * 10**9  # past the window: its nonce forgotten, its time too old
    with pytest.raises(Refused, match="from this host's clock"):
        receiver.open_request(body, 7)
    ahead = MessageGuard(SECRET, clock=lambda: clock.ns + 90 * 10**9)
    with pytest.raises(Refused, match="from this host's clock"):
        receiver.open_request(ahead.seal_request(b"{}", 7)[0], 7)
    within = MessageGuard(SECRET, clock=lambda: clock.ns - 30 * 10**9)
    receiver.open_request(within.seal_request(b"{}", 7)[0], 7)


def test_remembered_nonces_are_bounded_and_nothing_older_is_taken() -> None:
    clock = _Clock()
    sender, receiver = MessageGuard(SECRET, clock=clock), MessageGuard(SECRET, clock=clock, max_nonces=4)
    first = [sender.seal_request(b"{}", 7)[0] for _ in range(2)]
    clock.ns += 1
    later = [sender.seal_request(b"{}", 7)[0] for _ in range(5)]
    for body in first + later[:2]:
        receiver.open_request(body, 7)
    receiver.open_request(later[2], 7)  # the first nonce goes: its time is the floor now
    with pytest.raises(Refused, match="replayed"):
        receiver.open_request(first[1], 7)
    with pytest.raises(Refused):
        receiver.open_request(first[0], 7)  # forgotten, yet refused: as old as the floor
    receiver.open_request(later[3], 7)
    receiver.open_request(later[4], 7)


def test_answers_are_bound_to_their_request() -> None:
    asker, answerer = MessageGuard(SECRET), MessageGuard(SECRET)
    _, first = asker.seal_request(b"{}", 7)
    _, second = asker.seal_request(b"{}", 7)
    answer = answerer.seal_answer(b'{"ok":true,"granted":["r-1"]}', first)
    with pytest.raises(Refused, match="another request"):
        asker.open_answer(answer, second)
    request, nonce = asker.seal_request(b'{"ok":true}', 7)
    with pytest.raises(Refused, match="request sent as an answer"):
        asker.open_answer(request, nonce)  # a request reflected back
    with pytest.raises(Refused, match="answer sent as a request"):
        answerer.open_request(answer, 7)
    assert asker.open_answer(answer, first).startswith(b'{"ok"')


def test_no_secret_passes_payloads_as_they_are() -> None:
    guard = MessageGuard(None)
    assert not guard.enabled
    assert guard.seal_request(b'{"op":"hello"}', 7) == (b'{"op":"hello"}', b"")
    assert guard.open_request(b'{"op":"hello"}', 7) == (b'{"op":"hello"}', b"")
    assert guard.seal_answer(b"{}", b"") == b"{}" and guard.open_answer(b"{}", b"") == b"{}"


def test_settings_from_the_environment() -> None:
    assert not MessageGuard.from_environment(environ={}).enabled
    guard = MessageGuard.from_environment(environ={"DATADIST_AIO_AUTH_KEY": SECRET})
    assert guard.enabled and not guard.encrypted
    guard = MessageGuard.from_environment(environ={"DATADIST_AIO_AUTH_KEY": SECRET,
                                                   "DATADIST_AIO_LINK_ENCRYPTION": "tls"})
    assert guard.encrypted
    assert not MessageGuard.from_environment("off", environ={"DATADIST_AIO_AUTH_KEY": SECRET,
                                                             "DATADIST_AIO_LINK_ENCRYPTION": "tls"}).encrypted
    with pytest.raises(ValueError, match="DATADIST_AIO_AUTH_KEY"):
        MessageGuard.from_environment(environ={"DATADIST_AIO_LINK_ENCRYPTION": "tls"})
    with pytest.raises(ValueError, match="one of"):
        MessageGuard(SECRET, "aes")
    with pytest.raises(ValueError, match="empty"):
        MessageGuard("")


def test_refusals_are_logged_once_per_sender(caplog: pytest.LogCaptureFixture) -> None:
    guard = MessageGuard(SECRET)
    with caplog.at_level(logging.WARNING, logger="datadist_aio.integrations.message_guard"):
        for _ in range(50):
            guard.refused("10.0.0.5", Refused("a message not sealed"))
        guard.refused("10.0.0.6", Refused("a replayed request"))
    lines = [r.getMessage() for r in caplog.records]
    assert guard.refusals == 51
    assert len(lines) == 2, lines
    assert "10.0.0.5" in lines[0] and "not sealed" in lines[0] and "10.0.0.6" in lines[1]

"""Side-channel messages that prove who sent them, and to whom.

The integrations' own messages (the vLLM connector's side channel, the
SGLang backend's control messages) are sealed under the link secret, the
one the engine's links prove (``DATADIST_AIO_AUTH_KEY``). A sealed message
is a header, the payload, and a tag:

    magic "DDA" 1 | mode | kind | recipient port (2) | time, ns (8) | nonce (16) | answers (16)

- mode ``M``: the payload in the clear, the tag HMAC-SHA256 over header and
  payload (32 bytes); mode ``E`` (link encryption on): the payload
  encrypted with AES-256-GCM, the header its associated data, the IV the
  nonce's first 12 bytes, the tag GCM's (16 bytes).
- kind ``Q`` (a request) names the port its recipient listens on, so a
  request to one worker cannot be replayed to another, and carries a fresh
  16-byte random nonce and the sender's wall-clock time. Its recipient
  refuses it unless the tag proves it, its time is within ``max_skew_s`` of
  its own, and the nonce was not seen in that window (the nonces are kept
  until their time is past the window; a bounded number: past it, the
  oldest go and nothing as old is taken any more).
- kind ``A`` (an answer) names the nonce of the request it answers; the
  asker takes only an answer to its own request.

Keys are derived from the secret (HKDF-SHA256, labels of their own), never
the secret itself; with the mode and kind in every tag, a request cannot be
passed off as an answer, nor a frame of one mode as the other.

A refused message is counted, and logged once per sender address; the
caller drops it (the vLLM side channel closes the connection). Without a
secret nothing is sealed: a payload crosses as it is, unauthenticated, as
links without a secret are.

Thread rules: one guard may be shared by any threads.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Optional, Union

from . import aes_gcm

__all__ = [
    "AUTH_KEY_ENV",
    "ENCRYPTION_ENV",
    "ENCRYPTIONS",
    "MessageGuard",
    "Refused",
    "SEAL_OVERHEAD",
    "UNSEALED",
]

log: logging.Logger = logging.getLogger(__name__)

AUTH_KEY_ENV = "DATADIST_AIO_AUTH_KEY"
ENCRYPTION_ENV = "DATADIST_AIO_LINK_ENCRYPTION"
ENCRYPTIONS = ("off", "tls")
MAX_SKEW_S = 60.0
MAX_NONCES = 1 << 17
MAX_SENDERS_LOGGED = 1024

_MAGIC = b"DDA\x01"
_HEADER = struct.Struct(">4sBBHQ16s16s")
_MODE_MAC, _MODE_AEAD = ord("M"), ord("E")
_REQUEST, _ANSWER = ord("Q"), ord("A")
_MAC_BYTES = 32
_NO_NONCE = bytes(16)
# The most bytes sealing adds to a payload.
SEAL_OVERHEAD = _HEADER.size + max(_MAC_BYTES, aes_gcm.TAG_BYTES)


class Refused(Exception):
    """A message this guard does not take; the text says which check failed."""


def _hkdf(secret: bytes, label: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) of ``secret``: one 32-byte key for ``label``."""
    prk = hmac.new(b"datadist_aio side channels", secret, hashlib.sha256).digest()
    return hmac.new(prk, label + b"\x01", hashlib.sha256).digest()


class MessageGuard:
    """Seals and opens one process's side-channel messages.

    ``secret``: the link secret (None: nothing is sealed). ``encryption``:
    ``"off"`` (authenticated only) or ``"tls"`` (encrypted too; needs the
    secret). ValueError for anything else.
    """

    def __init__(self, secret: Optional[Union[str, bytes]], encryption: str = "off", *,
                 max_skew_s: float = MAX_SKEW_S, max_nonces: int = MAX_NONCES,
                 clock: Callable[[], int] = time.time_ns) -> None:
        if encryption not in ENCRYPTIONS:
            raise ValueError(f"link encryption must be one of {ENCRYPTIONS}, got {encryption!r}")
        if isinstance(secret, str):
            secret = secret.encode("utf-8")
        if secret is not None and not secret:
            raise ValueError("the link secret must not be empty")
        if encryption == "tls" and secret is None:
            raise ValueError(
                f"link encryption 'tls' encrypts the side channels under the link secret, and none is set: set "
                f"{AUTH_KEY_ENV} on every worker (or turn encryption off)")
        self.encryption: str = encryption
        self._mode = _MODE_AEAD if encryption == "tls" else _MODE_MAC
        self._mac_key = _hkdf(secret, b"hmac-sha256") if secret is not None else b""
        self._aead_key = _hkdf(secret, b"aes-256-gcm") if secret is not None and encryption == "tls" else b""
        if self._aead_key:
            aes_gcm.seal(self._aead_key, bytes(aes_gcm.IV_BYTES), b"", b"")  # libcrypto there, or say so now
        self._skew_ns = int(max_skew_s * 1e9)
        self._max_nonces = max_nonces
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> its time, in arrival order
        self._floor = 0  # a request at or before this time is refused (its nonce may have been dropped)
        self._logged: OrderedDict[str, None] = OrderedDict()
        self._logged_overflow = False
        self.refusals: int = 0

    @classmethod
    def from_environment(cls, encryption: Optional[str] = None,
                         environ: Optional[Mapping[str, str]] = None) -> "MessageGuard":
        """The guard of the link secret in ``DATADIST_AIO_AUTH_KEY`` (unset or
        empty: none) and of ``encryption``, else of
        ``DATADIST_AIO_LINK_ENCRYPTION`` (unset or empty: ``"off"``)."""
        env = os.environ if environ is None else environ
        secret = env.get(AUTH_KEY_ENV) or None
        chosen = encryption or env.get(ENCRYPTION_ENV) or "off"
        return cls(secret, chosen.strip().lower())

    @property
    def enabled(self) -> bool:
        """Whether messages are sealed (a secret is set)."""
        return bool(self._mac_key)

    @property
    def encrypted(self) -> bool:
        return bool(self._aead_key)

    # -- sealing --------------------------------------------------------------------

    def seal_request(self, payload: bytes, to_port: int) -> tuple[bytes, bytes]:
        """(the sealed request to the worker listening on ``to_port``, its nonce);
        without a secret (``payload``, b"")."""
        if not self.enabled:
            return payload, b""
        nonce = secrets.token_bytes(16)
        return self._seal(_REQUEST, to_port, nonce, _NO_NONCE, payload), nonce

    def seal_answer(self, payload: bytes, nonce: bytes) -> bytes:
        """The sealed answer to the request of ``nonce``; without a secret ``payload``."""
        if not self.enabled:
            return payload
        return self._seal(_ANSWER, 0, secrets.token_bytes(16), nonce, payload)

    def _seal(self, kind: int, port: int, nonce: bytes, answers: bytes, payload: bytes) -> bytes:
        header = _HEADER.pack(_MAGIC, self._mode, kind, port & 0xFFFF, self._clock(), nonce, answers)
        if self._aead_key:
            return header + aes_gcm.seal(self._aead_key, nonce[:aes_gcm.IV_BYTES], payload, header)
        return header + payload + hmac.new(self._mac_key, header + payload, hashlib.sha256).digest()

    # -- opening --------------------------------------------------------------------

    def open_request(self, body: bytes, port: int) -> tuple[bytes, bytes]:
        """(payload, nonce) of a request to the worker listening on ``port``;
        ``Refused`` unless sealed under this secret, in this mode, to this
        port, in time, and never seen. Without a secret (``body``, b"")."""
        if not self.enabled:
            return body, b""
        kind, to_port, stamp, nonce, _answers, payload = self._open(body)
        if kind != _REQUEST:
            raise Refused("an answer sent as a request")
        if to_port != port & 0xFFFF:
            raise Refused(f"a request to port {to_port}, not this worker's {port}")
        now = self._clock()
        if abs(now - stamp) > self._skew_ns:
            raise Refused(f"a request stamped {(stamp - now) / 1e9:+.1f} s from this host's clock (at most "
                          f"{self._skew_ns / 1e9:g} s either way: a replay, or clocks apart)")
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - self._skew_ns:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise Refused("a replayed request (its nonce was seen)")
            if stamp <= self._floor:
                raise Refused("a request older than the nonces still remembered")
            while len(self._seen) >= self._max_nonces:
                _, dropped = self._seen.popitem(last=False)
                self._floor = max(self._floor, dropped)
            self._seen[nonce] = stamp
        return payload, nonce

    def open_answer(self, body: bytes, nonce: bytes) -> bytes:
        """The payload of the answer to the request of ``nonce``; ``Refused``
        unless sealed under this secret, in this mode, for that request."""
        if not self.enabled:
            return body
        kind, _port, _stamp, _nonce, answers, payload = self._open(body)
        if kind != _ANSWER:
            raise Refused("a request sent as an answer")
        if not hmac.compare_digest(answers, nonce):
            raise Refused("an answer to another request")
        return payload

    def _open(self, body: bytes) -> tuple[int, int, int, bytes, bytes, bytes]:
        if len(body) < _HEADER.size or body[:len(_MAGIC)] != _MAGIC:
            raise Refused("a message not sealed (a peer without the link secret)")
        _magic, mode, kind, port, stamp, nonce, answers = _HEADER.unpack_from(body)
        header = body[:_HEADER.size]
        if mode != self._mode:
            theirs = "on" if mode == _MODE_AEAD else "off" if mode == _MODE_MAC else f"unknown ({mode})"
            raise Refused(f"a message sealed with link encryption {theirs}, which is "
                          f"{'on' if self._aead_key else 'off'} here")
        if self._aead_key:
            payload = aes_gcm.open_sealed(self._aead_key, nonce[:aes_gcm.IV_BYTES], body[_HEADER.size:], header)
            if payload is None:
                raise Refused("a message whose tag does not prove it (another link secret, or altered)")
        else:
            if len(body) < _HEADER.size + _MAC_BYTES:
                raise Refused("a message too short for its tag")
            payload, tag = body[_HEADER.size:-_MAC_BYTES], body[-_MAC_BYTES:]
            expected = hmac.new(self._mac_key, header + payload, hashlib.sha256).digest()
            if not hmac.compare_digest(tag, expected):
                raise Refused("a message whose tag does not prove it (another link secret, or altered)")
        return kind, port, stamp, nonce, answers, payload

    # -- refusals -------------------------------------------------------------------

    def refused(self, sender: str, why: Union[str, Exception], where: str = "side channel") -> None:
        """Counts a refused message; the first from each sender address is
        logged (at most ``MAX_SENDERS_LOGGED`` addresses, then one line more)."""
        with self._lock:
            self.refusals += 1
            if sender in self._logged:
                return
            if len(self._logged) >= MAX_SENDERS_LOGGED:
                if self._logged_overflow:
                    return
                self._logged_overflow = True
                overflow = True
            else:
                self._logged[sender] = None
                overflow = False
        if overflow:
            log.warning("datadist_aio %s: refused messages from more than %d addresses; no more are logged",
                        where, MAX_SENDERS_LOGGED)
            return
        log.warning("datadist_aio %s: refused a message from %s: %s; nothing of it was acted on (further "
                    "refusals from this address are not logged)", where, sender, why)


UNSEALED: MessageGuard = MessageGuard(None)
"""The guard of no secret: payloads cross as they are."""

"""The backend's control messages, sealed under the link secret.

SGLang's control sockets carry ZMQ multipart messages between the workers
of a pair: the decode's registration, metadata and aborts, the prefill's
pulls, status messages and abort acks, the decode's done. With a link
secret (``DATADIST_AIO_AUTH_KEY``) every one crosses as two frames,
``SEALED_TAG`` and the ``MessageGuard``'s sealed body of all its frames
(each a 4-byte big-endian length and its bytes), addressed to the port of
the control socket it is for; with link encryption on
(``DATADIST_AIO_LINK_ENCRYPTION=tls``) encrypted as well. A worker takes
only messages its guard opens: anything else is dropped unread, counted,
and logged once per sender address (ZMQ's ``Peer-Address`` of the
message). Without a secret, messages cross as SGLang's own do.

Nothing here imports SGLang: the manager (``conn.py``) sends and receives
through these functions.
"""

from __future__ import annotations

import logging
import struct
from typing import Any, Optional

from ..message_guard import MessageGuard, Refused

__all__ = ["MAX_PARTS", "SEALED_TAG", "open_parts", "pack", "port_of", "receive", "seal_parts", "unpack"]

log: logging.Logger = logging.getLogger(__name__)

SEALED_TAG = b"DDA_SEALED"
MAX_PARTS = 64
_LENGTH = struct.Struct(">I")
WHERE = "SGLang backend"


def pack(parts: list[bytes]) -> bytes:
    """The frames of one message as one payload."""
    if len(parts) > MAX_PARTS:
        raise ValueError(f"a control message of {len(parts)} frames (at most {MAX_PARTS})")
    return b"".join(_LENGTH.pack(len(part)) + bytes(part) for part in parts)


def unpack(payload: bytes) -> list[bytes]:
    """``pack``'s frames again; ValueError for anything that is not its output."""
    parts: list[bytes] = []
    at = 0
    while at < len(payload):
        if len(parts) == MAX_PARTS or at + _LENGTH.size > len(payload):
            raise ValueError("a sealed control message of more frames than allowed, or cut short")
        (length,) = _LENGTH.unpack_from(payload, at)
        at += _LENGTH.size
        if at + length > len(payload):
            raise ValueError("a sealed control message whose frame runs past its end")
        parts.append(payload[at:at + length])
        at += length
    return parts


def port_of(endpoint: str) -> int:
    """The port of a ZMQ TCP endpoint (``tcp://host:port``, ``tcp://[v6]:port``)."""
    return int(endpoint.rsplit(":", 1)[1])


def seal_parts(guard: MessageGuard, parts: list[bytes], port: int) -> list[bytes]:
    """The frames to send for ``parts`` to the control socket on ``port``."""
    if not guard.enabled:
        return parts
    body, _nonce = guard.seal_request(pack(parts), port)
    return [SEALED_TAG, body]


def open_parts(guard: MessageGuard, msg: list[bytes], port: int, sender: str) -> Optional[list[bytes]]:
    """The frames of a message received on the control socket on ``port``,
    or None where the guard refuses it (counted and logged once per sender)."""
    if not guard.enabled:
        return msg
    try:
        if len(msg) != 2 or msg[0] != SEALED_TAG:
            raise Refused("a message not sealed (a peer without the link secret)")
        payload, _nonce = guard.open_request(bytes(msg[1]), port)
        try:
            return unpack(payload)
        except ValueError as exc:  # sealed under the secret, yet malformed: a bug, not a forgery
            log.warning("datadist_aio %s: dropping a sealed control message from %s: %s", WHERE, sender, exc)
            return None
    except Refused as exc:
        guard.refused(sender, exc, WHERE)
        return None


def receive(socket: Any, timeout_ms: int) -> Optional[tuple[list[bytes], str]]:
    """One message of a ZMQ socket and its sender's address, or None after
    ``timeout_ms`` without one."""
    if not socket.poll(timeout_ms):
        return None
    frames = socket.recv_multipart(copy=False)
    try:
        sender = str(frames[0].get("Peer-Address"))
    except Exception:  # a transport without the property
        sender = "an unknown address"
    return [frame.bytes for frame in frames], sender

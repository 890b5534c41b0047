"""A small, bounded request/answer channel between the two workers of a pair.

The decode side asks the prefill side who it is (its cluster id, the port its
``LLMDataDist`` listens on, the layout of its KV cache) before linking, and
tells it which requests it has finished reading so their blocks can be freed.
Bytes move on the library's link, never here.

Frames are a 4-byte big-endian length and a body of at most ``MAX_FRAME``
bytes: a UTF-8 JSON object, sealed by the workers' ``MessageGuard`` where a
link secret is set (``message_guard.py``: each request authenticated, fresh
and addressed to the port it reaches, each answer bound to its request;
with link encryption on, encrypted too). Anything else closes the
connection; a request the guard refuses is logged once per sender address
and acted on in no way. Nothing received is unpickled or evaluated. The
server caps its connections and every read waits at most ``idle_timeout``
seconds.

All coroutines run on the connector's one event loop; ``ask`` is the
blocking form of one request, for a thread that must not wait for that loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, Optional

from ..message_guard import UNSEALED, MessageGuard, Refused

__all__ = ["MAX_FRAME", "ProtocolError", "SideChannelClient", "SideChannelPortError", "SideChannelServer", "ask"]

log = logging.getLogger(__name__)

MAX_FRAME = 64 * 1024
_LENGTH = struct.Struct(">I")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


class SideChannelPortError(OSError):
    """The side channel's server cannot listen on its address (the port is
    taken, most often): the message names the address and the settings that
    chose it, ``errno`` is the bind's and ``__cause__`` the original error."""


async def read_body(reader: asyncio.StreamReader) -> bytes:
    """One frame's body, as it crossed (sealed or not)."""
    header = await reader.readexactly(_LENGTH.size)
    (length,) = _LENGTH.unpack(header)
    if length == 0 or length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes (limit {MAX_FRAME})")
    return await reader.readexactly(length)


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    """One unsealed frame's JSON object."""
    return decode_body(await read_body(reader))


def open_answer(guard: MessageGuard, body: bytes, nonce: bytes, where: str) -> dict[str, Any]:
    """The JSON object of the answer to the request of ``nonce``;
    ``ProtocolError`` where the guard refuses it."""
    try:
        return decode_body(guard.open_answer(body, nonce))
    except Refused as exc:
        raise ProtocolError(f"{where} answered with {exc}") from None


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"frame is not UTF-8 JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a JSON object")
    return message


def ask(host: str, port: int, message: dict[str, Any], timeout: float,
        guard: MessageGuard = UNSEALED) -> dict[str, Any]:
    """One request on a connection of its own, in the calling thread, all of
    it within ``timeout`` s: the answer; ``TimeoutError`` past it, ``OSError``
    where the peer cannot be reached, ``ProtocolError`` for a bad or refusing
    answer."""
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no answer from {host}:{port} within {timeout:g} s")
        return remaining

    def read(sock: socket.socket, count: int) -> bytes:
        data = bytearray()
        while len(data) < count:
            sock.settimeout(left())
            chunk = sock.recv(count - len(data))
            if not chunk:
                raise ProtocolError(f"{host}:{port} closed the connection{_closed_hint(guard)}")
            data += chunk
        return bytes(data)

    try:
        with socket.create_connection((host, port), timeout=left()) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(left())
            body, nonce = guard.seal_request(encode_body(message), port)
            sock.sendall(frame(body))
            (length,) = _LENGTH.unpack(read(sock, _LENGTH.size))
            if length == 0 or length > MAX_FRAME:
                raise ProtocolError(f"frame of {length} bytes (limit {MAX_FRAME})")
            answer = open_answer(guard, read(sock, length), nonce, f"{host}:{port}")
    except socket.timeout:
        raise TimeoutError(f"no answer from {host}:{port} within {timeout:g} s") from None
    if not answer.get("ok", False):
        raise ProtocolError(f"{host}:{port} refused {message.get('op')!r}: {answer.get('error')}")
    return answer


def _closed_hint(guard: MessageGuard) -> str:
    if not guard.enabled:
        return ""
    return (" (a side channel refuses a request it cannot authenticate: another link secret, another link "
            "encryption setting, or clocks more than a minute apart; its log names this address)")


def encode_body(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode("utf-8")


def frame(body: bytes) -> bytes:
    """``body`` (sealed or not) as a frame; ``ProtocolError`` past ``MAX_FRAME``."""
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes (limit {MAX_FRAME})")
    return _LENGTH.pack(len(body)) + body


def encode_frame(message: dict[str, Any]) -> bytes:
    """An unsealed frame of ``message``."""
    return frame(encode_body(message))


class SideChannelServer:
    """Answers each frame with ``await handler(message)``; ``guard`` opens the
    requests and seals the answers (by default nothing is sealed)."""

    def __init__(self, handler: Handler, *, max_connections: int = 64, idle_timeout: float = 300.0,
                 guard: MessageGuard = UNSEALED) -> None:
        self._handler = handler
        self._guard = guard
        self._port = 0
        self._max_connections = max_connections
        self._idle_timeout = idle_timeout
        self._server: Optional[asyncio.Server] = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens on ``host:port`` (0: any free port); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        self._port = int(self._server.sockets[0].getsockname()[1])
        return self._port

    async def close(self) -> None:
        """Stops listening and ends every connection; returns once their handlers have."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()
        if self._handlers:
            # A closed transport ends each handler's read; none is cancelled.
            await asyncio.wait(list(self._handlers), timeout=5)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self._max_connections:
            writer.close()
            return
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        self._connections.add(writer)
        try:
            while True:
                try:
                    async with asyncio.timeout(self._idle_timeout):
                        body = await read_body(reader)
                    payload, nonce = self._guard.open_request(body, self._port)
                    message = decode_body(payload)
                except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                    return
                except Refused as exc:
                    # Unproven: acted on in no way, and the connection goes.
                    peer = writer.get_extra_info("peername")
                    self._guard.refused(str(peer[0]) if peer else "an unknown address", exc)
                    return
                except ProtocolError as exc:
                    log.warning("side channel: closing a connection: %s", exc)
                    return
                try:
                    answer = await self._handler(message)
                except Exception as exc:  # a bad request gets an error answer, not a dead server
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:512]}
                writer.write(frame(self._guard.seal_answer(encode_body(answer), nonce)))
                await writer.drain()
        except ConnectionError:
            return
        finally:
            self._connections.discard(writer)
            self._handlers.discard(handler)
            writer.close()


class SideChannelClient:
    """One connection to a peer's server, one request at a time, reopened after an error."""

    def __init__(self, host: str, port: int, guard: MessageGuard = UNSEALED) -> None:
        self.host = host
        self.port = port
        self._guard = guard
        self._lock = asyncio.Lock()
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None

    async def request(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Sends ``message`` and returns the answer; raises on error or after ``timeout`` s."""
        async with asyncio.timeout(timeout):
            async with self._lock:
                try:
                    if self._writer is None:
                        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
                    assert self._reader is not None
                    body, nonce = self._guard.seal_request(encode_body(message), self.port)
                    self._writer.write(frame(body))
                    await self._writer.drain()
                    try:
                        answer = open_answer(self._guard, await read_body(self._reader), nonce,
                                             f"{self.host}:{self.port}")
                    except asyncio.IncompleteReadError:
                        if not self._guard.enabled:
                            raise
                        raise ProtocolError(f"{self.host}:{self.port} closed the connection"
                                            f"{_closed_hint(self._guard)}") from None
                except BaseException:
                    self.close()
                    raise
        if not answer.get("ok", False):
            raise ProtocolError(f"{self.host}:{self.port} refused {message.get('op')!r}: {answer.get('error')}")
        return answer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

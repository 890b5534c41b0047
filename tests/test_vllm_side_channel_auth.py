"""The vLLM connector's side channel with a link secret: who may speak, and what crosses.

Real sockets on loopback: a server and its clients (``SideChannelClient``,
``ask``, the claim channel), a forger that knows no secret, a relay that
records (and replays) every byte, and an answerer that answers another
request.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from typing import Any

import pytest

from datadist_aio.integrations.message_guard import MessageGuard
from datadist_aio.integrations.vllm.claims import ClaimChannel
from datadist_aio.integrations.vllm.side_channel import (
    ProtocolError,
    SideChannelClient,
    SideChannelServer,
    ask,
    encode_body,
    encode_frame,
    frame,
)

SECRET = "the secret of this test's workers"
GUARD_LOG = "datadist_aio.integrations.message_guard"


class _Handler:
    """Records what it acted on."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> dict[str, Any]:
        self.seen.append(message)
        if message.get("op") == "hold":
            return {"ok": True, "granted": list(message.get("requests", {})), "refused": []}
        return {"ok": True, "echo": message.get("op")}


class _Relay:
    """Forwards one port to another, recording each direction's bytes."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.up = bytearray()  # client to server
        self.down = bytearray()
        self._server: Any = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, record: bytearray) -> None:
            try:
                while chunk := await source.read(65536):
                    record += chunk
                    sink.write(chunk)
                    await sink.drain()
            except ConnectionError:
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer, self.up), pipe(up_reader, writer, self.down))

    async def close(self) -> None:
        self._server.close()
        await self._server.wait_closed()


async def _send_raw(port: int, data: bytes) -> bytes:
    """Sends ``data`` on a fresh connection; whatever comes back before the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(5):
            return await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()


def _frames(data: bytes) -> list[bytes]:
    bodies, at = [], 0
    while at + 4 <= len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        bodies.append(data[at + 4:at + 4 + length])
        at += 4 + length
    return bodies


async def _serve(encryption: str = "off", handler: Any = None) -> tuple[SideChannelServer, int, MessageGuard, Any]:
    guard = MessageGuard(SECRET, encryption)
    handler = handler or _Handler()
    server = SideChannelServer(handler, guard=guard)
    return server, await server.start("127.0.0.1", 0), guard, handler


@pytest.mark.parametrize("encryption", ["off", "tls"])
async def test_sealed_requests_answer_through_every_client(encryption: str) -> None:
    server, port, _, handler = await _serve(encryption)
    client = SideChannelClient("127.0.0.1", port, MessageGuard(SECRET, encryption))
    try:
        for index in range(3):
            assert (await client.request({"op": "hello", "n": index}, 5.0))["echo"] == "hello"
        answer = await asyncio.to_thread(ask, "127.0.0.1", port, {"op": "hello"}, 5.0,
                                         MessageGuard(SECRET, encryption))
        assert answer["echo"] == "hello"
        claims = await asyncio.to_thread(ClaimChannel, "127.0.0.1", port, 5.0, MessageGuard(SECRET, encryption))
        settled: list[tuple[str, str, bool]] = []
        claims.send({"op": "hold", "requests": {"r-1": "t"}}, [("r-1", lambda why, refused: settled.append(
            ("r-1", why, refused)))])
        deadline = time.monotonic() + 5
        while not settled and time.monotonic() < deadline:
            claims.poll()
            await asyncio.sleep(0.01)
        claims.close()
        assert settled == [("r-1", "", False)]
        assert [m["op"] for m in handler.seen] == ["hello"] * 4 + ["hold"]
    finally:
        client.close()
        await server.close()


async def test_forged_requests_change_nothing_and_are_logged_once_per_sender(
        caplog: pytest.LogCaptureFixture) -> None:
    server, port, guard, handler = await _serve()
    forged = [
        encode_frame({"op": "done", "req_ids": ["r-1"], "readers": 1}),  # no seal at all
        frame(MessageGuard("not the secret").seal_request(encode_body({"op": "done", "req_ids": ["r-1"]}), port)[0]),
        frame(MessageGuard(SECRET).seal_request(encode_body({"op": "done", "req_ids": ["r-1"]}), port + 1)[0]),
    ]
    sealed = bytearray(MessageGuard(SECRET).seal_request(encode_body({"op": "claim", "claims": {}}), port)[0])
    sealed[-40] ^= 1  # altered in flight
    forged.append(frame(bytes(sealed)))
    try:
        with caplog.at_level(logging.WARNING, logger=GUARD_LOG):
            for data in forged * 3:
                assert await _send_raw(port, data) == b"", "a forged request got an answer"
        assert handler.seen == [], "a forged request was acted on"
        assert guard.refusals == len(forged) * 3
        lines = [r.getMessage() for r in caplog.records if r.name == GUARD_LOG]
        assert len(lines) == 1 and "127.0.0.1" in lines[0] and "not sealed" in lines[0], lines
        client = SideChannelClient("127.0.0.1", port, MessageGuard(SECRET))
        try:
            assert (await client.request({"op": "hello"}, 5.0))["ok"], "the server did not live on"
        finally:
            client.close()
    finally:
        await server.close()


@pytest.mark.parametrize("encryption", ["off", "tls"])
async def test_a_replayed_request_is_refused(encryption: str) -> None:
    server, port, guard, handler = await _serve(encryption)
    relay = _Relay(port)
    relay_port = await relay.start()
    client = SideChannelClient("127.0.0.1", relay_port, MessageGuard(SECRET, encryption))
    # The relay's port is not the server's: the request names the server's, as a worker's would.
    client.port = port
    try:
        client_reader, client_writer = await asyncio.open_connection("127.0.0.1", relay_port)
        client._reader, client._writer = client_reader, client_writer
        assert (await client.request({"op": "done", "req_ids": ["r-1"], "readers": 1}, 5.0))["ok"]
        (recorded,) = _frames(bytes(relay.up))
        assert await _send_raw(port, struct.pack(">I", len(recorded)) + recorded) == b""
        assert [m["op"] for m in handler.seen] == ["done"], "the replay was acted on"
        assert guard.refusals == 1
    finally:
        client.close()
        await relay.close()
        await server.close()


async def test_a_stale_request_is_refused_and_the_client_says_why() -> None:
    server, port, guard, handler = await _serve()
    behind = MessageGuard(SECRET, clock=lambda: time.time_ns() - 120 * 10**9)
    client = SideChannelClient("127.0.0.1", port, behind)
    try:
        with pytest.raises(ProtocolError, match="closed the connection .*clocks"):
            await client.request({"op": "done", "req_ids": ["r-1"]}, 5.0)
        with pytest.raises(ProtocolError, match="another link secret"):
            await asyncio.to_thread(ask, "127.0.0.1", port, {"op": "hello"}, 5.0, MessageGuard("wrong"))
        assert handler.seen == [] and guard.refusals == 2
    finally:
        client.close()
        await server.close()


async def test_an_answer_to_another_request_or_unsealed_is_refused() -> None:
    answerer = MessageGuard(SECRET)
    answers: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (length,) = struct.unpack(">I", await reader.readexactly(4))
        body = await reader.readexactly(length)
        answerer.open_request(body, port)
        writer.write(frame(answers.pop(0)))
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = int(listener.sockets[0].getsockname()[1])
    guard = MessageGuard(SECRET)
    _, other_nonce = guard.seal_request(b"{}", port)
    try:
        answers.append(answerer.seal_answer(encode_body({"ok": True, "granted": ["r-1"]}), other_nonce))
        with pytest.raises(ProtocolError, match="an answer to another request"):
            await SideChannelClient("127.0.0.1", port, guard).request({"op": "hold"}, 5.0)
        answers.append(encode_body({"ok": True, "granted": ["r-1"]}))
        with pytest.raises(ProtocolError, match="not sealed"):
            await asyncio.to_thread(ask, "127.0.0.1", port, {"op": "hold"}, 5.0, guard)
        answers.append(answerer.seal_answer(encode_body({"ok": True, "granted": ["r-1"]}), other_nonce))
        claims = await asyncio.to_thread(ClaimChannel, "127.0.0.1", port, 5.0, guard)
        settled: list[tuple[str, bool]] = []
        claims.send({"op": "hold", "requests": {"r-1": "t"}}, [("r-1", lambda why, refused: settled.append(
            (why, refused)))])
        deadline = time.monotonic() + 5
        while not settled and time.monotonic() < deadline:
            claims.poll()
            await asyncio.sleep(0.01)
        claims.close()
        assert len(settled) == 1 and not settled[0][1] and "another request" in settled[0][0], settled
    finally:
        listener.close()
        await listener.wait_closed()


async def test_without_a_secret_frames_are_plain_json_and_sealed_ones_are_not_taken() -> None:
    handler = _Handler()
    server = SideChannelServer(handler)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(encode_frame({"op": "hello"}))
        async with asyncio.timeout(5):
            (length,) = struct.unpack(">I", await reader.readexactly(4))
            assert await reader.readexactly(length) == b'{"ok":true,"echo":"hello"}'
        writer.close()
        await writer.wait_closed()
        sealed = frame(MessageGuard(SECRET).seal_request(encode_body({"op": "done"}), port)[0])
        assert await _send_raw(port, sealed) == b""  # not JSON to this server: the connection closes
        assert [m["op"] for m in handler.seen] == ["hello"]
    finally:
        await server.close()


async def test_with_encryption_nothing_of_a_message_crosses_in_the_clear() -> None:
    server, port, _, handler = await _serve("tls")
    relay = _Relay(port)
    relay_port = await relay.start()
    client = SideChannelClient("127.0.0.1", relay_port, MessageGuard(SECRET, "tls"))
    client.port = port
    client._reader, client._writer = await asyncio.open_connection("127.0.0.1", relay_port)
    message = {"op": "expect", "transfer_id": "xfer-5f3a9c", "blocks": [431, 977, 1205], "host": "10.9.8.7"}
    try:
        assert (await client.request(message, 5.0))["echo"] == "expect"
        assert handler.seen == [message]
        wire = bytes(relay.up) + bytes(relay.down)
        # Each fragment is as the message encodes it and at least four bytes long, so that ciphertext
        # cannot hold it by chance (a two-byte word would turn up in a few hundred random bytes).
        for clear in (b'"expect"', b'"op"', b'"transfer_id"', b"xfer-5f3a9c", b"[431,977,1205]", b'"blocks"',
                      b"10.9.8.7", b'"echo"', b'"ok"', b":true"):
            assert clear in encode_body(message) + encode_body({"ok": True, "echo": "expect"})
            assert clear not in wire[4:].replace(b"DDA\x01", b""), f"{clear!r} crossed in the clear"
    finally:
        client.close()
        await relay.close()
        await server.close()

"""The vLLM connector's side channel: answers, and what it refuses."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest

from datadist_aio.integrations.vllm.side_channel import (
    MAX_FRAME,
    ProtocolError,
    SideChannelClient,
    SideChannelServer,
    ask,
    encode_frame,
)


async def _echo(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("op") == "boom":
        raise ValueError("bad request")
    return {"ok": True, "seen": message}


async def _raw(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        async with asyncio.timeout(5):
            return await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()


async def test_request_answer_and_reuse() -> None:
    server = SideChannelServer(_echo)
    port = await server.start("127.0.0.1", 0)
    client = SideChannelClient("127.0.0.1", port)
    try:
        for index in range(3):
            answer = await client.request({"op": "hello", "n": index}, 5.0)
            assert answer == {"ok": True, "seen": {"op": "hello", "n": index}}
        with pytest.raises(ProtocolError, match="bad request"):
            await client.request({"op": "boom"}, 5.0)
        assert (await client.request({"op": "again"}, 5.0))["seen"] == {"op": "again"}
    finally:
        client.close()
        await server.close()


@pytest.mark.parametrize(
    "payload",
    [
        struct.pack(">I", MAX_FRAME + 1) + b"x" * 16,  # over the limit: not even read
        struct.pack(">I", 0),
        struct.pack(">I", 5) + b"\xff\xfe\x00ab",  # not UTF-8
        struct.pack(">I", 7) + b"[1,2,3]",  # JSON, but not an object
        struct.pack(">I", 12) + b"__import__('os')"[:12],
    ],
)
async def test_bad_frames_close_the_connection_and_the_server_lives(payload: bytes) -> None:
    server = SideChannelServer(_echo)
    port = await server.start("127.0.0.1", 0)
    try:
        assert await _raw(port, payload) == b"", "a bad frame got an answer"
        client = SideChannelClient("127.0.0.1", port)
        try:
            assert (await client.request({"op": "still"}, 5.0))["ok"] is True
        finally:
            client.close()
    finally:
        await server.close()


async def test_connection_cap() -> None:
    server = SideChannelServer(_echo, max_connections=1)
    port = await server.start("127.0.0.1", 0)
    first = SideChannelClient("127.0.0.1", port)
    second = SideChannelClient("127.0.0.1", port)
    try:
        assert (await first.request({"op": "a"}, 5.0))["ok"]
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await second.request({"op": "b"}, 5.0)
    finally:
        first.close()
        second.close()
        await server.close()


def test_oversized_frame_is_not_sent() -> None:
    with pytest.raises(ProtocolError):
        encode_frame({"op": "x" * (MAX_FRAME + 1)})


async def test_silent_peer_times_out() -> None:
    release = asyncio.Event()
    ended = asyncio.Event()

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        writer.close()
        ended.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = SideChannelClient("127.0.0.1", port)
    try:
        with pytest.raises(TimeoutError):
            await client.request({"op": "hello"}, 0.3)
    finally:
        client.close()
        release.set()
        await ended.wait()
        server.close()
        await server.wait_closed()


async def test_ask_in_a_thread_answers_refuses_and_times_out() -> None:
    """``ask``, the blocking request for a thread that must not wait for the loop."""
    server = SideChannelServer(_echo)
    port = await server.start("127.0.0.1", 0)
    try:
        assert await asyncio.to_thread(ask, "127.0.0.1", port, {"op": "hello"}, 5.0) == {
            "ok": True, "seen": {"op": "hello"}}
        with pytest.raises(ProtocolError, match="bad request"):
            await asyncio.to_thread(ask, "127.0.0.1", port, {"op": "boom"}, 5.0)
    finally:
        await server.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.to_thread(ask, "127.0.0.1", port, {"op": "hello"}, 5.0)

    release = asyncio.Event()
    ended = asyncio.Event()

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        writer.close()
        ended.set()

    quiet = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.to_thread(ask, "127.0.0.1", quiet.sockets[0].getsockname()[1], {"op": "hello"}, 0.3)
    finally:
        release.set()
        await ended.wait()
        quiet.close()
        await quiet.wait_closed()

"""A small disaggregation proxy: prefill on one vLLM, decode on another.

Prefill-first (the default) speaks the ``kv_transfer_params`` protocol of
vLLM's NixlConnector, so it works the same with NIXL and with datadist_aio's
connector:

1. the client's request goes to the prefill server with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``;
2. the prefill answers with ``kv_transfer_params`` naming its KV blocks;
3. the request goes to the decode server with those params (the decode then
   pulls, or copies what the prefill pushed into its inbox); its answer
   (streamed or not) goes back to the client.

Decode-first (``--decode-first``, datadist_aio's connector only; each
prefill's side channel given with ``--prefill-side-channel``): the request
goes to both servers at once with the same ``transfer_id``; the decode
tells the prefill where its blocks are, and the prefill writes each layer
into them while its forward runs. The decode's answer goes back to the
client; the prefill's only says it finished.

Several ``--prefill`` and ``--decode`` servers (xPyD) take requests in
turn.

    python proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    python proxy.py --decode-first --prefill http://127.0.0.1:8100 --prefill-side-channel 127.0.0.1:5600 \
        --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

import aiohttp  # pyright: ignore[reportMissingImports]  (vLLM brings it)
from aiohttp import web  # pyright: ignore[reportMissingImports]

_counter = itertools.count()


async def _forward(request: web.Request) -> web.StreamResponse:
    app = request.app
    session: aiohttp.ClientSession = app["session"]
    body: dict[str, Any] = await request.json()
    request_id = request.headers.get("X-Request-Id") or f"pd-{next(_counter)}-{uuid.uuid4().hex[:8]}"
    headers = {"X-Request-Id": request_id}
    turn = next(app["turns"])
    prefill, side_channel = app["prefills"][turn % len(app["prefills"])]
    decode = app["decodes"][turn % len(app["decodes"])]

    prefill_body = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    prefill_body.pop("max_completion_tokens", None)
    prefill_body.pop("stream_options", None)
    decode_body = dict(body)
    if app["decode_first"]:
        transfer_id = uuid.uuid4().hex
        host, port = side_channel
        prefill_body["kv_transfer_params"]["transfer_id"] = transfer_id
        decode_body["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": transfer_id,
                                             "remote_host": host, "remote_port": port, "tp_size": app["prefill_tp"]}
        prefilled = asyncio.ensure_future(_prefill(session, prefill + request.path, prefill_body, headers))
        try:
            return await _decode(request, session, decode + request.path, decode_body, headers, body)
        finally:
            await prefilled  # its blocks are the prefill's to free; the answer only says it finished

    answer_or_error = await _prefill(session, prefill + request.path, prefill_body, headers)
    if isinstance(answer_or_error, web.Response):
        return answer_or_error
    params = answer_or_error.get("kv_transfer_params")
    if params:
        decode_body["kv_transfer_params"] = params
    return await _decode(request, session, decode + request.path, decode_body, headers, body)


async def _prefill(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                   headers: dict[str, str]) -> Any:
    """The prefill's answer as JSON, or the error response to pass on."""
    async with session.post(url, json=body, headers=headers) as answer:
        if answer.status != 200:
            return web.Response(status=answer.status, body=await answer.read(), content_type="application/json")
        return await answer.json()


async def _decode(request: web.Request, session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                  headers: dict[str, str], client_body: dict[str, Any]) -> web.StreamResponse:
    async with session.post(url, json=body, headers=headers) as answer:
        if not client_body.get("stream"):
            return web.Response(status=answer.status, body=await answer.read(), content_type="application/json")
        response = web.StreamResponse(status=answer.status, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for chunk in answer.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app(prefills: list[str], decodes: list[str], side_channels: Optional[list[str]] = None,
             decode_first: bool = False, prefill_tp: int = 1) -> web.Application:
    """``side_channels``: each prefill's ``host:port`` (its rank 0's side
    channel), needed with ``decode_first``."""
    channels = [_host_port(value) for value in side_channels or []]
    if decode_first and len(channels) != len(prefills):
        raise SystemExit("--decode-first needs one --prefill-side-channel HOST:PORT for each --prefill")
    app = web.Application()
    app["prefills"] = [(url.rstrip("/"), channels[i] if channels else ("", 0)) for i, url in enumerate(prefills)]
    app["decodes"] = [url.rstrip("/") for url in decodes]
    app["decode_first"], app["prefill_tp"], app["turns"] = decode_first, prefill_tp, itertools.count()

    async def session(app: web.Application) -> AsyncIterator[None]:
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        yield
        await app["session"].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", _forward)
    app.router.add_post("/v1/chat/completions", _forward)
    app.router.add_get("/health", _health)
    return app


def _host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"a side channel is HOST:PORT, got {value!r}")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description="prefill/decode proxy for vLLM KV connectors")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", action="append", help="a prefill server's URL (repeat for several)")
    parser.add_argument("--decode", action="append", help="a decode server's URL (repeat for several)")
    parser.add_argument("--decode-first", action="store_true",
                        help="send each request to both at once; the prefill pushes into the decode's blocks")
    parser.add_argument("--prefill-side-channel", action="append", default=[],
                        help="HOST:PORT of each prefill's side channel (its rank 0's), in --prefill order")
    parser.add_argument("--prefill-tp", type=int, default=1, help="the prefills' tensor-parallel size")
    args = parser.parse_args()
    app = make_app(args.prefill or ["http://127.0.0.1:8100"], args.decode or ["http://127.0.0.1:8200"],
                   args.prefill_side_channel, args.decode_first, args.prefill_tp)
    web.run_app(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()

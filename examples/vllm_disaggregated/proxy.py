"""A small disaggregation proxy: prefill on one vLLM, decode on another.

It speaks the ``kv_transfer_params`` protocol of vLLM's NixlConnector, so it
works the same with NIXL and with datadist_aio's connector:

1. the client's request goes to the prefill server with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``;
2. the prefill answers with ``kv_transfer_params`` naming its KV blocks;
3. the request goes to the decode server with those params; its answer
   (streamed or not) goes back to the client.

    python proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp  # pyright: ignore[reportMissingImports]  (vLLM brings it)
from aiohttp import web  # pyright: ignore[reportMissingImports]

_counter = itertools.count()


async def _forward(request: web.Request) -> web.StreamResponse:
    app = request.app
    session: aiohttp.ClientSession = app["session"]
    body: dict[str, Any] = await request.json()
    request_id = request.headers.get("X-Request-Id") or f"pd-{next(_counter)}-{uuid.uuid4().hex[:8]}"
    headers = {"X-Request-Id": request_id}

    prefill_body = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    prefill_body.pop("max_completion_tokens", None)
    prefill_body.pop("stream_options", None)
    async with session.post(app["prefill"] + request.path, json=prefill_body, headers=headers) as answer:
        if answer.status != 200:
            return web.Response(status=answer.status, body=await answer.read(), content_type="application/json")
        prefilled = await answer.json()

    decode_body = dict(body)
    params = prefilled.get("kv_transfer_params")
    if params:
        decode_body["kv_transfer_params"] = params
    async with session.post(app["decode"] + request.path, json=decode_body, headers=headers) as answer:
        if not body.get("stream"):
            return web.Response(status=answer.status, body=await answer.read(), content_type="application/json")
        response = web.StreamResponse(status=answer.status, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for chunk in answer.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app(prefill: str, decode: str) -> web.Application:
    app = web.Application()
    app["prefill"], app["decode"] = prefill.rstrip("/"), decode.rstrip("/")

    async def session(app: web.Application) -> AsyncIterator[None]:
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        yield
        await app["session"].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", _forward)
    app.router.add_post("/v1/chat/completions", _forward)
    app.router.add_get("/health", _health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="prefill/decode proxy for vLLM KV connectors")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", default="http://127.0.0.1:8100")
    parser.add_argument("--decode", default="http://127.0.0.1:8200")
    args = parser.parse_args()
    web.run_app(make_app(args.prefill, args.decode), host=args.host, port=args.port)


if __name__ == "__main__":
    main()

"""Decode-first pushes: the prefill writes each layer straight into the decode's own blocks.

In the decode-first flow the proxy sends a request to a decode instance and
to a prefill instance at once, both carrying the same ``transfer_id`` (the
decode's params also name the prefill's side channel). The decode allocates
the request's blocks and, from its worker, tells the prefill rank it reads
(``expect``): its cluster id, the side channel it hears notices on, its KV
layout, its blocks for the prompt, how many leading prompt blocks it found
in its own prefix cache (``skip``: they do not move), and how long it waits.
The link is the decode's own (it links to the prefill as for a pull); the
prefill writes over it.

Prefill side (``DirectPushes``, run by ``Pusher``): each step's blocks of a
request the decode already expects go into the decode's blocks with the
step's layer-wise transfer, each layer as the forward saves it. Blocks
computed before the decode's ``expect`` came are pushed whole once it comes
(the prefill still holds them: its request is leased until the decode says
done). When the prompt's last block has landed the prefill sends
``landed`` (with its own request id, which the decode's ``done`` names).
Where it cannot push (the layouts differ, the push failed, the decode asked
to cancel) it sends ``pull`` once its request's params are known (the
``kv_transfer_params`` of the prefill-first flow): the decode then pulls as
in the pull mode, whatever the layouts.

A layer of a request is never started after the decode's deadline (less a
margin) nor after the decode cancelled it; the decode's side of that bound
(it drops the link of a prefill that does not answer its ``cancel``) is in
``worker.py``.

Thread rules: everything here runs on the connector's loop thread except
``announce``, which vLLM's worker thread calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import datadist_aio as dd

from .metadata import SaveSpec
from ..message_guard import UNSEALED, MessageGuard
from .side_channel import SideChannelClient

__all__ = ["DirectPushes", "MAX_TRANSFER_ID", "valid_transfer_id"]

log = logging.getLogger(__name__)

MAX_TRANSFER_ID = 128
_MARGIN_S = 1.0  # the prefill stops starting layers this long before the decode's deadline
_MAX_DIRECTS = 1 << 14  # decode-first requests one prefill worker tracks at once
_MAX_BLOCKS = 1 << 20


def valid_transfer_id(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_TRANSFER_ID


@dataclass
class _Direct:
    """One decode-first request on the prefill side."""

    transfer_id: str
    created: float
    req_id: str = ""  # this prefill's request
    # From the decode's expect (None until it came).
    cluster_id: Optional[int] = None
    notice_host: str = ""
    notice_port: int = 0
    blocks: list[int] = field(default_factory=list)
    skip: int = 0
    deadline: float = 0.0
    direct: bool = True  # False: the layouts differ, the decode pulls
    # Blocks computed before the expect came: (prompt block index, block id).
    owed: list[tuple[int, int]] = field(default_factory=list)
    # Blocks of steps under way when the expect had not come: the expect
    # joins them to the step's layer release (the layers still to be saved
    # then go as they are saved).
    waiting: list[tuple[list[tuple[int, int]], Any, "asyncio.Future[Optional[asyncio.Task[None]]]"]] = field(
        default_factory=list)
    last_computed: bool = False
    # Steps of the request whose forward is not over: its blocks are not
    # computed until then, so no decode is told to pull them.
    forwarding: int = 0
    forward_failed: bool = False  # a step's forward failed: its blocks are not to be read
    inflight: int = 0
    joining: int = 0  # pushes decided on but not yet under way (``_transfer`` counts ``inflight``)
    failed: str = ""
    cancelled: bool = False
    landed: bool = False
    settled: bool = False  # the decode was told (landed or pull)
    params: Optional[dict[str, Any]] = None  # this prefill's kv_transfer_params for the request
    # The request's blocks by prompt block index, its prompt blocks and the
    # token its lease will have, from its steps: the params for a decode
    # that pulls, as soon as the prompt is computed.
    computed: dict[int, int] = field(default_factory=dict)
    all_groups: Optional[list[list[int]]] = None  # with several KV cache groups: every group's blocks
    total_blocks: int = 0
    lease_token: str = ""
    # Further decode ranks that expect the request where the layouts differ
    # (a decode of a larger TP size): their side channels, told to pull too.
    also_tell: list[tuple[str, int]] = field(default_factory=list)

    @property
    def expected(self) -> bool:
        return self.cluster_id is not None

    def usable(self, now: float) -> bool:
        return self.expected and self.direct and not self.failed and not self.cancelled and now < self.deadline


class _Guard(dd.LayerSynchronizer):
    """A step's layer release, refused for a transfer once one of its requests
    is cancelled or past its deadline."""

    def __init__(self, release: dd.LayerSynchronizer, directs: Sequence[_Direct]) -> None:
        self._release = release
        self._directs = directs

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        ready = await self._release.synchronize_layer(layer_index, timeout_in_millis)  # type: ignore[misc]
        now = time.monotonic()
        return bool(ready) and all(d.usable(now) for d in self._directs)


class _Released(dd.LayerSynchronizer):
    """Every layer at once: blocks whose forward is over."""

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        return True


class DirectPushes:
    """The decode-first requests of one prefill worker."""

    def __init__(self, *, datadist: dd.LLMDataDist, cache: dd.Cache, group_layouts: list[dict[str, Any]],
                 layers: int, block_bytes: int, timeout_s: float, decode_model_id: int,
                 record: Callable[[float, int, int, bool], None], capable: bool = True,
                 unreachable: Callable[[str], None] = lambda req_id: None, engine_id: str = "",
                 single_group: bool = True, guard: MessageGuard = UNSEALED) -> None:
        """``capable``: whether this worker's KV tensors can be pushed layer by
        layer (one KV cache group, two tensors per transfer layer); where not,
        every decode-first request is pulled. ``unreachable(req_id)``: the
        request's decode cannot be told (it died): nobody will read it.
        ``single_group``: one vLLM KV cache group, whose blocks the steps name
        (a decode that pulls is told them as the prompt is computed; with
        several it waits for the finished request's params)."""
        self._datadist = datadist
        self._cache = cache
        self._group_layouts = group_layouts
        self._layers = layers
        self._block_bytes = block_bytes
        self._timeout_s = timeout_s
        self._model_id = decode_model_id
        self._capable = capable
        self._unreachable = unreachable
        self._engine_id = engine_id
        self._single_group = single_group
        self._settling: set[asyncio.Task[None]] = set()
        self._record = record
        self._directs: dict[str, _Direct] = {}
        self._clients: dict[tuple[str, int], SideChannelClient] = {}
        self._guard = guard  # seals the notices to the decodes
        self._idle = asyncio.Condition()

    # -- the decode's messages (side channel) ---------------------------------------------

    async def expect(self, message: dict[str, Any]) -> dict[str, Any]:
        """A decode worker waits for a request: where its blocks are."""
        transfer_id, cluster_id = message.get("transfer_id"), message.get("cluster_id")
        host, port, blocks = message.get("host"), message.get("port"), message.get("blocks")
        skip, deadline_s, layout = message.get("skip", 0), message.get("deadline_s"), message.get("layout")
        if not valid_transfer_id(transfer_id):
            raise ValueError(f"transfer_id must be a string of 1 to {MAX_TRANSFER_ID} characters")
        if type(cluster_id) is not int or not 0 <= cluster_id < 1 << 64:
            raise ValueError("cluster_id must be a 64-bit unsigned integer")
        if not isinstance(host, str) or not 0 < len(host) <= 256 or type(port) is not int or not 0 < port < 65536:
            raise ValueError("host and port must name the decode's side channel")
        if (not isinstance(blocks, list) or len(blocks) > _MAX_BLOCKS
                or not all(type(b) is int and b >= 0 for b in blocks)):
            raise ValueError(f"blocks must be a list of at most {_MAX_BLOCKS} block ids")
        if type(skip) is not int or not 0 <= skip <= _MAX_BLOCKS:
            raise ValueError("skip must be a block count")
        if not isinstance(deadline_s, (int, float)) or not 0 < deadline_s <= 3600:
            raise ValueError("deadline_s must be a number of seconds above 0, at most 3600")
        assert isinstance(transfer_id, str)
        d = self._direct(transfer_id)
        if d is None:
            raise ValueError(f"this prefill worker tracks {_MAX_DIRECTS} decode-first requests already")
        if d.expected:
            # Another decode rank reading this prefill rank: only where the
            # layouts differ, and then it pulls too.
            if cluster_id == d.cluster_id or d.direct or message.get("direct", True):
                raise ValueError(f"transfer {transfer_id} is expected already")
            d.also_tell.append((host, port))
            if d.settled and not d.landed and d.params is not None:
                await self._tell(d, {"op": "pull", "transfer_id": d.transfer_id, "params": d.params}, (host, port))
            return {"ok": True, "direct": False}
        d.cluster_id, d.notice_host, d.notice_port = cluster_id, host, port
        d.blocks, d.skip = list(blocks), skip
        d.deadline = time.monotonic() + max(0.0, float(deadline_s) - min(_MARGIN_S, 0.2 * float(deadline_s)))
        d.direct = self._capable and bool(message.get("direct", True)) and layout == self._group_layouts
        waiting, d.waiting = d.waiting, []
        for blocks, release, joined in waiting:
            task: Optional[asyncio.Task[None]] = None
            if d.usable(time.monotonic()):
                d.joining += 1  # before the task runs: the settle below must not find the request idle
                task = asyncio.get_running_loop().create_task(
                    self._counted(d, blocks, _Guard(release, [d]), counted=True))
            joined.set_result(task)
        if d.owed and d.usable(time.monotonic()):
            owed, d.owed = d.owed, []
            await self._counted(d, owed, _Guard(_Released(), [d]))
        await self._settle(d)
        return {"ok": True, "direct": d.direct}

    async def cancel(self, message: dict[str, Any]) -> dict[str, Any]:
        """The decode gives up on a request: no layer of it starts any more;
        answered once none is under way (whether it landed meanwhile)."""
        transfer_id = message.get("transfer_id")
        if not valid_transfer_id(transfer_id):
            raise ValueError(f"transfer_id must be a string of 1 to {MAX_TRANSFER_ID} characters")
        d = self._directs.get(str(transfer_id))
        if d is None:
            return {"ok": True, "landed": False}
        d.cancelled = not d.landed
        async with self._idle:
            await asyncio.wait_for(self._idle.wait_for(lambda: d.inflight == 0), self._timeout_s)
        return {"ok": True, "landed": d.landed}

    # -- the prefill's own steps ---------------------------------------------------------

    async def push_step(self, specs: list[SaveSpec], release: Any, forward_over: Awaitable[bool]) -> None:
        """One step's blocks of decode-first requests: into the blocks of the
        decodes that expect them, layer by layer; the rest owed until the
        forward is over (``forward_over``: whether it completed)."""
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        by_decode: dict[int, list[tuple[_Direct, list[tuple[int, int]]]]] = {}
        later: list[tuple[_Direct, list[tuple[int, int]], asyncio.Future[Optional[asyncio.Task[None]]]]] = []
        seen: list[_Direct] = []
        for spec in specs:
            d = self._direct(spec.transfer_id)
            if d is None:
                log.warning("datadist_aio connector: too many decode-first requests; %s is not pushed", spec.req_id)
                continue
            seen.append(d)
            d.forwarding += 1
            d.req_id = spec.req_id
            blocks = list(enumerate(spec.block_ids, spec.first_index))
            d.computed.update(blocks)
            d.total_blocks, d.lease_token = spec.total_blocks, spec.lease_token or d.lease_token
            if spec.last:
                d.last_computed = True
                d.all_groups = spec.all_groups
            if d.usable(now):
                assert d.cluster_id is not None
                by_decode.setdefault(d.cluster_id, []).append((d, blocks))
            elif not d.expected:
                joined: asyncio.Future[Optional[asyncio.Task[None]]] = loop.create_future()
                d.waiting.append((blocks, release, joined))
                later.append((d, blocks, joined))
        pushes = [self._transfer(items, _Guard(release, [d for d, _ in items]), cluster)
                  for cluster, items in by_decode.items()]
        try:
            complete, *_ = await asyncio.gather(forward_over, *pushes)
        finally:
            for d in seen:
                d.forwarding -= 1
        # What becomes of the blocks not pushed with the step is decided
        # before anything is awaited, so an expect coming meanwhile finds each
        # of them either owed or counted as on its way.
        joined_pushes: list[Awaitable[None]] = []
        for d, blocks, joined in later:
            if joined.done():  # the expect came during the forward and joined its release
                task = joined.result()
                if task is not None:
                    joined_pushes.append(task)
                continue
            d.waiting = [item for item in d.waiting if item[2] is not joined]
            if not complete:
                continue
            if d.usable(time.monotonic()):
                d.joining += 1
                joined_pushes.append(self._counted(d, blocks, _Guard(_Released(), [d]), counted=True))
            elif not d.expected:
                d.owed.extend(blocks)  # pushed once the decode expects the request
        for push in joined_pushes:
            await push
        for d in {id(d): d for d in seen}.values():
            if not complete:
                d.failed = d.failed or "the prefill's forward failed"
                d.forward_failed = True
            await self._settle(d)

    def announce(self, loop: asyncio.AbstractEventLoop, params: dict[str, dict[str, Any]]) -> None:
        """vLLM's worker thread: the params of finished decode-first requests
        (for the decodes that must pull them)."""
        loop.call_soon_threadsafe(self._announced, params)

    def _announced(self, params: dict[str, dict[str, Any]]) -> None:
        for transfer_id, value in params.items():
            d = self._direct(transfer_id)
            if d is not None:
                d.params = value
                if not d.req_id:
                    d.req_id = str(value.get("remote_request_id", ""))
                task = asyncio.get_running_loop().create_task(self._settle(d))
                self._settling.add(task)
                task.add_done_callback(self._settling.discard)

    def freed(self, req_ids: set[str]) -> None:
        """These requests' blocks were freed: their decode-first state goes."""
        for transfer_id in [x for x, d in self._directs.items() if d.req_id in req_ids]:
            del self._directs[transfer_id]

    async def close(self) -> None:
        for client in self._clients.values():
            client.close()

    # -- inside -------------------------------------------------------------------

    def _direct(self, transfer_id: str) -> Optional[_Direct]:
        d = self._directs.get(transfer_id)
        if d is None:
            if len(self._directs) >= _MAX_DIRECTS:
                self._expire()
                if len(self._directs) >= _MAX_DIRECTS:
                    return None
            d = self._directs[transfer_id] = _Direct(transfer_id, time.monotonic())
        return d

    def _expire(self) -> None:
        """Drops requests told or never expected for an hour (their leases are long over)."""
        old = time.monotonic() - 3600
        for transfer_id in [x for x, d in self._directs.items() if d.created < old]:
            del self._directs[transfer_id]

    async def _counted(self, d: _Direct, blocks: list[tuple[int, int]], sync: dd.LayerSynchronizer,
                       counted: bool = False) -> None:
        """Pushes blocks of one request, counted in ``joining`` from the call
        (``counted``: by the caller already) until it is under way or done."""
        if not counted:
            d.joining += 1
        try:
            assert d.cluster_id is not None
            await self._transfer([(d, blocks)], sync, d.cluster_id)
        finally:
            d.joining -= 1

    async def _transfer(self, items: list[tuple[_Direct, list[tuple[int, int]]]], sync: dd.LayerSynchronizer,
                        cluster_id: int) -> None:
        """Writes blocks of requests one decode worker expects into its blocks."""
        start = time.perf_counter()
        src: list[int] = []
        dst: list[int] = []
        moving: list[_Direct] = []
        for d, blocks in items:
            mine = [(index - d.skip, block) for index, block in blocks if index >= d.skip]
            if any(position >= len(d.blocks) for position, _ in mine):
                d.failed = f"the decode expects {d.skip + len(d.blocks)} prompt blocks, the prompt has more"
                continue
            src.extend(block for _, block in mine)
            dst.extend(d.blocks[position] for position, _ in mine)
            moving.append(d)
        if not src:
            return
        for d in moving:
            d.inflight += 1
        config = dd.TransferWithCacheKeyConfig(
            dd.BlocksCacheKey(cluster_id, self._model_id), range(self._layers), range(self._layers))
        ok = False
        try:
            task = self._datadist.cache_manager.transfer_cache_async(
                self._cache, sync, [config], src_block_indices=src, dst_block_indices=dst)
            async with asyncio.timeout(self._timeout_s):
                await task
            ok = True
        except (Exception, TimeoutError) as exc:
            for d in moving:
                d.failed = d.failed or f"push failed: {type(exc).__name__}: {exc}"
        finally:
            async with self._idle:
                for d in moving:
                    d.inflight -= 1
                self._idle.notify_all()
        self._record(time.perf_counter() - start, len(src) * self._block_bytes if ok else 0, len(src), ok)

    async def _settle(self, d: _Direct) -> None:
        """Tells the decode once the outcome is known: landed, or pull."""
        if d.settled or not d.expected or d.inflight or d.joining or d.waiting or d.forwarding:
            return
        if d.direct and not d.failed and not d.cancelled:
            if not d.last_computed or d.owed:
                return
            d.landed = d.settled = True
            await self._tell(d, {"op": "landed", "transfer_id": d.transfer_id, "remote_request_id": d.req_id})
            return
        if d.params is None and d.last_computed and not d.forward_failed and d.lease_token and d.req_id \
                and len(d.computed) >= d.total_blocks > 0 and (self._single_group or d.all_groups is not None):
            blocks: Any = [d.computed[index] for index in range(d.total_blocks)]
            d.params = {"remote_block_ids": blocks if self._single_group else d.all_groups,
                        "lease_token": d.lease_token, "remote_request_id": d.req_id,
                        "remote_engine_id": self._engine_id}
        if d.cancelled or d.params is None:
            return  # a cancel is answered there; a pull waits for the params
        d.settled = True
        if d.failed:
            log.info("datadist_aio connector: %s is pulled instead (%s)", d.transfer_id, d.failed)
        message = {"op": "pull", "transfer_id": d.transfer_id, "params": d.params}
        await asyncio.gather(self._tell(d, message), *(self._tell(d, message, where) for where in d.also_tell))

    async def _tell(self, d: _Direct, message: dict[str, Any], where: Optional[tuple[str, int]] = None) -> None:
        key = where or (d.notice_host, d.notice_port)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = SideChannelClient(*key, self._guard)
        try:
            await client.request(message, self._timeout_s)
        except (Exception, TimeoutError) as exc:
            # A decode that cannot be told will not read the request (a live
            # one ends the load at its deadline): its blocks need not wait for
            # their lease.
            log.warning("datadist_aio connector: %s of %s not confirmed by the decode at %s:%d, which will not "
                        "read it: %s", message["op"], d.transfer_id, key[0], key[1], exc)
            if d.req_id:
                self._unreachable(d.req_id)

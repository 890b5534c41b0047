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
step's layer-wise transfer, each layer as the forward saves it. Under vLLM's
hybrid KV cache manager each KV cache group goes as a transfer of its own
(``PushSpan``): its blocks, through the tensors its layers write, each
transfer layer once the last of its group's layers writing it was saved; a
sliding-window group's blocks are aligned to the prompt's end, so only the
tail the decode's window keeps moves. Blocks
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

__all__ = ["DirectPushes", "MAX_TRANSFER_ID", "PushSpan", "ReleaseView", "valid_transfer_id"]

log = logging.getLogger(__name__)

MAX_TRANSFER_ID = 128
_MARGIN_S = 1.0  # the prefill stops starting layers this long before the decode's deadline
_MAX_DIRECTS = 1 << 14  # decode-first requests one prefill worker tracks at once
_MAX_BLOCKS = 1 << 20


_MAX_KV_GROUPS = 64

# A request's blocks of one step, per KV cache group: (prompt block index, block id).
Blocks = list[list[tuple[int, int]]]


def valid_transfer_id(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_TRANSFER_ID


@dataclass(frozen=True)
class PushSpan:
    """What a push of one KV cache group's blocks moves through one blocks cache.

    ``model_id``: the cache's, alike on both sides; ``layers``: for each of
    its transfer layers, the step's layer (by vLLM's layer names) after
    which it holds the group's bytes (``groups.release_layers``), None where
    its tensors cannot go layer by layer; ``block_bytes``: one block across
    its tensors.
    """

    cache: dd.Cache
    model_id: int
    kv_group: int
    layers: Optional[tuple[int, ...]]
    block_bytes: int


@dataclass
class _Target:
    """Where one KV cache group's blocks go on the decode: ``blocks[k]``
    receives prompt block ``skip + k``, or with ``tail`` the blocks end at
    the prompt's last block (a sliding-window group's in-window tail)."""

    blocks: list[int]
    skip: int = 0
    tail: bool = False

    def position(self, index: int, total_blocks: int) -> int:
        """Where prompt block ``index`` goes in ``blocks``: below 0 where it does not move."""
        return index - (total_blocks - len(self.blocks) if self.tail else self.skip)


def _targets(message: dict[str, Any]) -> list[_Target]:
    """The decode's blocks per KV cache group from an expect: ``groups``
    where it names them, else its ``blocks`` and ``skip`` (one group)."""
    blocks, skip, groups = message.get("blocks"), message.get("skip", 0), message.get("groups")
    if groups is None:
        groups = [{"blocks": blocks, "skip": skip}]
    if not isinstance(groups, list) or not 0 < len(groups) <= _MAX_KV_GROUPS:
        raise ValueError(f"groups must be a list of 1 to {_MAX_KV_GROUPS} KV cache groups' blocks")
    targets: list[_Target] = []
    total = 0
    for group in groups:
        if not isinstance(group, dict):
            raise ValueError("each of groups must be a dict of blocks and skip or tail")
        blocks, skip, tail = group.get("blocks"), group.get("skip", 0), group.get("tail", False)
        if not isinstance(blocks, list) or not all(type(b) is int and b >= 0 for b in blocks):
            raise ValueError(f"blocks must be a list of at most {_MAX_BLOCKS} block ids")
        total += len(blocks)
        if total > _MAX_BLOCKS:
            raise ValueError(f"blocks must be a list of at most {_MAX_BLOCKS} block ids")
        if type(skip) is not int or not 0 <= skip <= _MAX_BLOCKS:
            raise ValueError("skip must be a block count")
        if type(tail) is not bool:
            raise ValueError("tail must be true or false")
        targets.append(_Target(list(blocks), skip, tail))
    return targets


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
    targets: list[_Target] = field(default_factory=list)  # per KV cache group
    deadline: float = 0.0
    direct: bool = True  # False: the layouts differ, the decode pulls
    # Blocks computed before the expect came.
    owed: Blocks = field(default_factory=list)
    # Blocks of steps under way when the expect had not come: the expect
    # joins them to the step's layer release (the layers still to be saved
    # then go as they are saved).
    waiting: list[tuple[Blocks, Any, "asyncio.Future[Optional[asyncio.Task[None]]]"]] = field(
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


class ReleaseView(dd.LayerSynchronizer):
    """One transfer's view of a step's ``LayerRelease``: its transfer layer
    ``i`` goes once the release lets layer ``layers[i]`` go (the last layer
    writing one of its tensors)."""

    def __init__(self, release: dd.LayerSynchronizer, layers: Sequence[int]) -> None:
        self._release = release
        self._layers = layers

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        ready = self._release.synchronize_layer(self._layers[layer_index], timeout_in_millis)
        return bool(await ready)  # type: ignore[misc]


class _Guard(dd.LayerSynchronizer):
    """A transfer's view of its step's layer release, refused once one of its
    requests is cancelled or past its deadline."""

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

    def __init__(self, *, datadist: dd.LLMDataDist, spans: Sequence[PushSpan], group_layouts: list[dict[str, Any]],
                 timeout_s: float, record: Callable[[float, int, int, bool], None], capable: bool = True,
                 unreachable: Callable[[str], None] = lambda req_id: None, engine_id: str = "",
                 guard: MessageGuard = UNSEALED) -> None:
        """``spans``: what a push of each KV cache group's blocks moves (one
        per blocks cache and KV cache group it serves); ``capable``: whether
        this worker's KV tensors can be pushed layer by layer (each span's
        ``layers`` known); where not, every decode-first request is pulled.
        ``unreachable(req_id)``: the request's decode cannot be told (it
        died): nobody will read it. With one vLLM KV cache group, whose
        blocks the steps name, a decode that pulls is told them as the
        prompt is computed; with several it is told every group's blocks
        named by the step that ends the prompt."""
        self._datadist = datadist
        self._spans = list(spans)
        self._kv_groups = 1 + max((span.kv_group for span in spans), default=0)
        self._group_layouts = group_layouts
        self._timeout_s = timeout_s
        self._capable = capable and all(span.layers is not None for span in spans)
        self._unreachable = unreachable
        self._engine_id = engine_id
        self._single_group = self._kv_groups == 1
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
        host, port = message.get("host"), message.get("port")
        deadline_s, layout = message.get("deadline_s"), message.get("layout")
        if not valid_transfer_id(transfer_id):
            raise ValueError(f"transfer_id must be a string of 1 to {MAX_TRANSFER_ID} characters")
        if type(cluster_id) is not int or not 0 <= cluster_id < 1 << 64:
            raise ValueError("cluster_id must be a 64-bit unsigned integer")
        if not isinstance(host, str) or not 0 < len(host) <= 256 or type(port) is not int or not 0 < port < 65536:
            raise ValueError("host and port must name the decode's side channel")
        targets = _targets(message)
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
        d.cluster_id, d.notice_host, d.notice_port, d.targets = cluster_id, host, port, targets
        d.deadline = time.monotonic() + max(0.0, float(deadline_s) - min(_MARGIN_S, 0.2 * float(deadline_s)))
        d.direct = (self._capable and bool(message.get("direct", True)) and layout == self._group_layouts
                    and len(targets) == self._kv_groups)
        waiting, d.waiting = d.waiting, []
        for blocks, release, joined in waiting:
            task: Optional[asyncio.Task[None]] = None
            if d.usable(time.monotonic()):
                d.joining += 1  # before the task runs: the settle below must not find the request idle
                task = asyncio.get_running_loop().create_task(self._counted(d, blocks, release, counted=True))
            joined.set_result(task)
        if any(d.owed) and d.usable(time.monotonic()):
            owed, d.owed = d.owed, []
            await self._counted(d, owed, _Released())
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
        by_decode: dict[int, list[tuple[_Direct, Blocks]]] = {}
        later: list[tuple[_Direct, Blocks, asyncio.Future[Optional[asyncio.Task[None]]]]] = []
        seen: list[_Direct] = []
        for spec in specs:
            d = self._direct(spec.transfer_id)
            if d is None:
                log.warning("datadist_aio connector: too many decode-first requests; %s is not pushed", spec.req_id)
                continue
            seen.append(d)
            d.forwarding += 1
            d.req_id = spec.req_id
            blocks = [list(enumerate(ids, spec.first_index)) for ids in (spec.block_ids, *spec.more_block_ids)]
            d.computed.update(blocks[0])
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
        pushes = [self._transfer(items, release, cluster) for cluster, items in by_decode.items()]
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
                joined_pushes.append(self._counted(d, blocks, _Released(), counted=True))
            elif not d.expected:
                # Pushed once the decode expects the request.
                d.owed.extend([] for _ in range(len(blocks) - len(d.owed)))
                for owed, more in zip(d.owed, blocks):
                    owed.extend(more)
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

    async def _counted(self, d: _Direct, blocks: Blocks, release: dd.LayerSynchronizer,
                       counted: bool = False) -> None:
        """Pushes blocks of one request, counted in ``joining`` from the call
        (``counted``: by the caller already) until it is under way or done."""
        if not counted:
            d.joining += 1
        try:
            assert d.cluster_id is not None
            await self._transfer([(d, blocks)], release, d.cluster_id)
        finally:
            d.joining -= 1

    def _pairs(self, d: _Direct, blocks: Blocks, kv_group: int) -> Optional[list[tuple[int, int]]]:
        """(source, destination) blocks of one KV cache group of a request;
        None (and the request failed) where the decode has no block for one."""
        if kv_group >= len(blocks) or kv_group >= len(d.targets):
            return []
        target = d.targets[kv_group]
        pairs: list[tuple[int, int]] = []
        for index, block in blocks[kv_group]:
            position = target.position(index, d.total_blocks)
            if position >= len(target.blocks):
                first = index - position
                d.failed = (f"the decode expects {first + len(target.blocks)} prompt blocks of KV cache group "
                            f"{kv_group}, the prompt has more")
                return None
            if position >= 0:
                pairs.append((block, target.blocks[position]))
        return pairs

    async def _transfer(self, items: list[tuple[_Direct, Blocks]], release: dd.LayerSynchronizer,
                        cluster_id: int) -> None:
        """Writes blocks of requests one decode worker expects into its
        blocks: one layer-wise transfer per ``PushSpan``, each layer as
        ``release`` lets the span's layers go (and its requests are still
        wanted)."""
        start = time.perf_counter()
        pairs: dict[int, list[tuple[int, int]]] = {}  # by KV cache group
        moving: list[_Direct] = []
        for d, blocks in items:
            mine = [self._pairs(d, blocks, kv_group) for kv_group in range(self._kv_groups)]
            if any(group is None for group in mine):
                continue
            for kv_group, group in enumerate(mine):
                pairs.setdefault(kv_group, []).extend(group or [])
            moving.append(d)
        spans = [span for span in self._spans if pairs.get(span.kv_group)]
        if not spans:
            return
        for d in moving:
            d.inflight += 1
        nbytes = sum(len(pairs[span.kv_group]) * span.block_bytes for span in spans)
        count = sum(len(pairs[span.kv_group]) for span in spans)
        ok = False
        try:
            async with asyncio.timeout(self._timeout_s):
                tasks: list[dd.CacheTask] = []
                errors: list[BaseException] = []
                try:
                    for span in spans:
                        assert span.layers is not None
                        layers = range(len(span.layers))
                        config = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(cluster_id, span.model_id),
                                                               layers, layers)
                        tasks.append(self._datadist.cache_manager.transfer_cache_async(
                            span.cache, _Guard(ReleaseView(release, span.layers), moving), [config],
                            src_block_indices=[source for source, _ in pairs[span.kv_group]],
                            dst_block_indices=[destination for _, destination in pairs[span.kv_group]]))
                except Exception as exc:  # refused: the transfers started are still awaited
                    errors.append(exc)
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                errors += [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
                if errors:
                    raise errors[0]
            ok = True
        except (Exception, TimeoutError) as exc:
            for d in moving:
                d.failed = d.failed or f"push failed: {type(exc).__name__}: {exc}"
        finally:
            async with self._idle:
                for d in moving:
                    d.inflight -= 1
                self._idle.notify_all()
        self._record(time.perf_counter() - start, nbytes if ok else 0, count, ok)

    async def _settle(self, d: _Direct) -> None:
        """Tells the decode once the outcome is known: landed, or pull."""
        if d.settled or not d.expected or d.inflight or d.joining or d.waiting or d.forwarding:
            return
        if d.direct and not d.failed and not d.cancelled:
            if not d.last_computed or any(d.owed):
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

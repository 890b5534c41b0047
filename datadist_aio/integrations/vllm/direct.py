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

import numpy as np

import datadist_aio as dd

from .leases import MAX_READERS
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
    its ``tensors``; ``cache_group``: the blocks cache's index.
    """

    cache: dd.Cache
    model_id: int
    kv_group: int
    layers: Optional[tuple[int, ...]]
    block_bytes: int
    cache_group: int = 0
    tensors: int = 2


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


_MAX_ROWS = 1 << 12  # rows of one block's ranges, per cache group


def _templates(message: dict[str, Any], groups: int) -> Optional[list[Optional[np.ndarray]]]:
    """Per cache group, the byte ranges one block of the prefill's moves into
    one of the decode's (rows as ``transfer_cache_async``'s ``block_ranges``
    with both blocks 0), None where whole blocks move; None for all where
    the expect names none."""
    rows = message.get("rows")
    if rows is None:
        return None
    if not isinstance(rows, list) or len(rows) != groups:
        raise ValueError(f"rows must name each of the {groups} cache groups' ranges, or null")
    templates: list[Optional[np.ndarray]] = []
    for group in rows:
        if group is None:
            templates.append(None)
            continue
        if (not isinstance(group, list) or not 0 < len(group) <= _MAX_ROWS
                or not all(isinstance(row, list) and len(row) == 8
                           and all(type(v) is int and 0 <= v < 1 << 62 for v in row) for row in group)
                or any(row[0] != 0 or row[2] != 0 for row in group)):
            raise ValueError(f"each group's rows must be 1 to {_MAX_ROWS} rows of eight ints, of block 0 on "
                             "both sides")
        templates.append(np.array(group, dtype=np.uint64))
    return templates


def _instantiate(template: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
    """The template's rows for each (source block, destination block) pair."""
    rows = np.tile(template, (len(pairs), 1))
    blocks = np.asarray(pairs, dtype=np.uint64)
    rows[:, 0] = np.repeat(blocks[:, 0], len(template))
    rows[:, 2] = np.repeat(blocks[:, 1], len(template))
    return rows


@dataclass
class _Reader:
    """A decode worker that expects a decode-first request (its ``expect``)."""

    cluster_id: int
    notice_host: str
    notice_port: int
    targets: list[_Target]  # per KV cache group
    deadline: float
    direct: bool  # False: the layouts differ or it asked to pull: it is told to
    # Per cache group, the ranges of a block pair (another TP size), None: whole blocks.
    templates: Optional[list[Optional[np.ndarray]]] = None
    inflight: int = 0
    joining: int = 0  # pushes decided on but not yet under way (``_transfer`` counts ``inflight``)
    failed: str = ""
    cancelled: bool = False
    landed: bool = False
    settled: bool = False  # told (landed or pull)

    def usable(self, now: float) -> bool:
        return self.direct and not self.failed and not self.cancelled and now < self.deadline


@dataclass
class _Direct:
    """One decode-first request on the prefill side, and the decode workers
    that expect it (several where the decode's TP size is larger)."""

    transfer_id: str
    created: float
    req_id: str = ""  # this prefill's request
    readers: list[_Reader] = field(default_factory=list)
    # Blocks of the steps whose forward is over (a reader that comes later
    # is pushed these), and of the steps under way with their layer release
    # (a reader that comes meanwhile joins it: the layers still to be saved
    # then go as they are saved).
    done: Blocks = field(default_factory=list)
    steps: list["_Step"] = field(default_factory=list)
    last_computed: bool = False
    # Steps of the request whose forward is not over: its blocks are not
    # computed until then, so no decode is told to pull them.
    forwarding: int = 0
    forward_failed: bool = False  # a step's forward failed: its blocks are not to be read
    params: Optional[dict[str, Any]] = None  # this prefill's kv_transfer_params for the request
    # The request's blocks by prompt block index, its prompt blocks and the
    # token its lease will have, from its steps: the params for a decode
    # that pulls, as soon as the prompt is computed.
    computed: dict[int, int] = field(default_factory=dict)
    all_groups: Optional[list[list[int]]] = None  # with several KV cache groups: every group's blocks
    total_blocks: int = 0
    lease_token: str = ""

    @property
    def expected(self) -> bool:
        """Whether a decode worker expects the request."""
        return bool(self.readers)

    def reader(self, cluster_id: int) -> Optional[_Reader]:
        return next((r for r in self.readers if r.cluster_id == cluster_id), None)


@dataclass(eq=False)
class _Step:
    """A step of a request under way: its blocks, its layer release, and the
    pushes of readers that joined it (the step waits for them too)."""

    blocks: Blocks
    release: Any
    joined: list["asyncio.Task[None]"] = field(default_factory=list)


def _extend(blocks: Blocks, more: Blocks) -> None:
    blocks.extend([] for _ in range(len(more) - len(blocks)))
    for have, new in zip(blocks, more):
        have.extend(new)


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

    @property
    def watchable(self) -> bool:
        return self._release.watchable

    def watch_layer(self, layer_index: int, on_decided: Callable[[bool], None]) -> Optional[bool]:
        return self._release.watch_layer(self._layers[layer_index], on_decided)


class _Guard(dd.LayerSynchronizer):
    """A transfer's view of its step's layer release, refused once one of its
    readers cancelled or is past its deadline."""

    def __init__(self, release: dd.LayerSynchronizer, readers: Sequence[_Reader]) -> None:
        self._release = release
        self._readers = readers

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        ready = await self._release.synchronize_layer(layer_index, timeout_in_millis)  # type: ignore[misc]
        return bool(ready) and self._usable()

    def _usable(self) -> bool:
        now = time.monotonic()
        return all(r.usable(now) for r in self._readers)

    @property
    def watchable(self) -> bool:
        return self._release.watchable

    def watch_layer(self, layer_index: int, on_decided: Callable[[bool], None]) -> Optional[bool]:
        verdict = self._release.watch_layer(layer_index, lambda ready: on_decided(ready and self._usable()))
        return None if verdict is None else verdict and self._usable()


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
        this worker's KV tensors can be pushed layer by layer (``Pusher``
        finds it: each span's ``layers`` known); where not, every decode-first request is pulled.
        ``unreachable(req_id)``: the request's decode cannot be told (it
        died): nobody will read it. With one vLLM KV cache group, whose
        blocks the steps name, a decode that pulls is told them as the
        prompt is computed; with several it is told every group's blocks
        named by the step that ends the prompt."""
        self._datadist = datadist
        self._spans = list(spans)
        self._kv_groups = 1 + max((span.kv_group for span in spans), default=0)
        self._cache_groups = 1 + max((span.cache_group for span in spans), default=0)
        self._group_layouts = group_layouts
        self._timeout_s = timeout_s
        self._capable = capable  # the caller's: every span's layers known, no stages
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
        """A decode worker waits for a request: where its blocks are, and
        (``rows``) which bytes of each block it takes where its TP size differs."""
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
        templates = _templates(message, self._cache_groups)
        if not isinstance(deadline_s, (int, float)) or not 0 < deadline_s <= 3600:
            raise ValueError("deadline_s must be a number of seconds above 0, at most 3600")
        assert isinstance(transfer_id, str)
        d = self._direct(transfer_id)
        if d is None:
            raise ValueError(f"this prefill worker tracks {_MAX_DIRECTS} decode-first requests already")
        if d.reader(cluster_id) is not None or len(d.readers) >= MAX_READERS:
            raise ValueError(f"transfer {transfer_id} is expected already")
        r = _Reader(cluster_id, host, port, targets,
                    time.monotonic() + max(0.0, float(deadline_s) - min(_MARGIN_S, 0.2 * float(deadline_s))),
                    direct=(self._capable and bool(message.get("direct", True))
                            and self._pairs_with(layout, templates) and len(targets) == self._kv_groups),
                    templates=templates)
        d.readers.append(r)
        if r.usable(time.monotonic()):
            # The steps under way join their releases; those over go whole.
            loop = asyncio.get_running_loop()
            for step in d.steps:
                r.joining += 1  # before the task runs: the settle below must not find the reader idle
                step.joined.append(loop.create_task(self._counted(d, r, step.blocks, step.release)))
            if any(d.done):
                r.joining += 1
                await self._counted(d, r, d.done, _Released())
        await self._settle(d, r)
        return {"ok": True, "direct": r.direct}

    def _pairs_with(self, layout: Any, templates: Optional[list[Optional[np.ndarray]]]) -> bool:
        """Whether a decode's cache groups take this worker's blocks: the same
        layout, or, where it names the ranges of a block it takes (another
        TP size), the same but for the block shape of those groups."""
        if not isinstance(layout, list) or len(layout) != len(self._group_layouts):
            return False
        for index, (theirs, mine) in enumerate(zip(layout, self._group_layouts)):
            ranged = templates is not None and templates[index] is not None
            if not isinstance(theirs, dict) or any(theirs.get(key) != value for key, value in mine.items()
                                                   if not (ranged and key == "block_shape")):
                return False
        return True

    async def cancel(self, message: dict[str, Any]) -> dict[str, Any]:
        """A decode worker (``cluster_id``; every one where it names none)
        gives up on a request: no layer of it starts any more; answered once
        none is under way (whether it landed meanwhile)."""
        transfer_id, cluster_id = message.get("transfer_id"), message.get("cluster_id")
        if not valid_transfer_id(transfer_id):
            raise ValueError(f"transfer_id must be a string of 1 to {MAX_TRANSFER_ID} characters")
        d = self._directs.get(str(transfer_id))
        readers = [] if d is None else [r for r in d.readers if cluster_id is None or r.cluster_id == cluster_id]
        if not readers:
            return {"ok": True, "landed": False}
        for r in readers:
            r.cancelled = not r.landed
        async with self._idle:
            await asyncio.wait_for(self._idle.wait_for(lambda: all(r.inflight == 0 for r in readers)),
                                   self._timeout_s)
        return {"ok": True, "landed": all(r.landed for r in readers)}

    # -- the prefill's own steps ---------------------------------------------------------

    async def push_step(self, specs: list[SaveSpec], release: Any, forward_over: Awaitable[bool],
                        armed: Callable[[], None] = lambda: None) -> None:
        """One step's blocks of decode-first requests: into the blocks of the
        decodes that expect them, layer by layer (a decode that comes during
        the forward joins it); the blocks go to a decode that comes later
        once the forward is over (``forward_over``: whether it completed).
        ``armed`` is called once the step's transfers were started."""
        now = time.monotonic()
        by_decode: dict[int, list[tuple[_Direct, _Reader, Blocks]]] = {}
        seen: list[tuple[_Direct, _Step]] = []
        for spec in specs:
            d = self._direct(spec.transfer_id)
            if d is None:
                log.warning("datadist_aio connector: too many decode-first requests; %s is not pushed", spec.req_id)
                continue
            d.forwarding += 1
            d.req_id = spec.req_id
            blocks = [list(enumerate(ids, spec.first_index)) for ids in (spec.block_ids, *spec.more_block_ids)]
            step = _Step(blocks, release)
            d.steps.append(step)
            seen.append((d, step))
            d.computed.update(blocks[0])
            d.total_blocks, d.lease_token = spec.total_blocks, spec.lease_token or d.lease_token
            if spec.last:
                d.last_computed = True
                d.all_groups = spec.all_groups
            for r in d.readers:
                if r.usable(now):
                    by_decode.setdefault(r.cluster_id, []).append((d, r, blocks))
        pushes = [self._transfer(items, release, cluster) for cluster, items in by_decode.items()]
        complete = False
        try:
            under_way = asyncio.gather(forward_over, *pushes)
            # After the first steps of the pushes' tasks, which start their transfers.
            asyncio.get_running_loop().call_soon(armed)
            outcome, *_ = await under_way
            complete = bool(outcome)
        finally:
            # At once, nothing awaited: a reader that comes from here on
            # finds the step's blocks over, or (its forward failed) nowhere.
            for d, step in seen:
                d.forwarding -= 1
                d.steps.remove(step)
                if complete:
                    _extend(d.done, step.blocks)
        for _d, step in seen:
            for task in step.joined:
                await task
        for d in {id(d): d for d, _ in seen}.values():
            if not complete:
                d.forward_failed = True
                for r in d.readers:
                    r.failed = r.failed or "the prefill's forward failed"
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

    async def _counted(self, d: _Direct, r: _Reader, blocks: Blocks, release: dd.LayerSynchronizer) -> None:
        """Pushes blocks of one request to one reader, counted in its
        ``joining`` (by the caller, from the decision) until under way or done."""
        try:
            await self._transfer([(d, r, blocks)], release, r.cluster_id)
        finally:
            r.joining -= 1
            await self._settle(d, r)

    def _pairs(self, d: _Direct, r: _Reader, blocks: Blocks, kv_group: int) -> Optional[list[tuple[int, int]]]:
        """(source, destination) blocks of one KV cache group of a request;
        None (and the reader failed) where the decode has no block for one."""
        if kv_group >= len(blocks) or kv_group >= len(r.targets):
            return []
        target = r.targets[kv_group]
        pairs: list[tuple[int, int]] = []
        for index, block in blocks[kv_group]:
            position = target.position(index, d.total_blocks)
            if position >= len(target.blocks):
                first = index - position
                r.failed = (f"the decode expects {first + len(target.blocks)} prompt blocks of KV cache group "
                            f"{kv_group}, the prompt has more")
                return None
            if position >= 0:
                pairs.append((block, target.blocks[position]))
        return pairs

    async def _transfer(self, items: list[tuple[_Direct, _Reader, Blocks]], release: dd.LayerSynchronizer,
                        cluster_id: int) -> None:
        """Writes blocks of requests into the blocks of one decode worker that
        expects them: one layer-wise transfer per ``PushSpan``, each layer as
        ``release`` lets the span's layers go (and its readers still want
        them); whole blocks, or each block's ranges the reader named."""
        start = time.perf_counter()
        # By KV cache group: (source, destination) pairs, and each pair's template.
        pairs: dict[int, list[tuple[int, int]]] = {}
        moving: list[_Reader] = []
        for d, r, blocks in items:
            mine = [self._pairs(d, r, blocks, kv_group) for kv_group in range(self._kv_groups)]
            if any(group is None for group in mine):
                continue
            for kv_group, group in enumerate(mine):
                pairs.setdefault(kv_group, []).extend(group or [])
            moving.append(r)
        spans = [span for span in self._spans if pairs.get(span.kv_group)]
        if not spans:
            return
        # One decode worker reads the same share of every block: its first reader's ranges.
        templates = moving[0].templates
        for r in moving:
            r.inflight += 1
        nbytes = 0
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
                        template = templates[span.cache_group] if templates is not None else None
                        chosen = pairs[span.kv_group]
                        if template is None:
                            where: dict[str, Any] = {"src_block_indices": [src for src, _ in chosen],
                                                     "dst_block_indices": [dst for _, dst in chosen]}
                            nbytes += len(chosen) * span.block_bytes
                        else:
                            rows = _instantiate(template, chosen)
                            where = {"block_ranges": rows}
                            nbytes += int((rows[:, 4] * rows[:, 5]).sum()) * span.tensors
                        tasks.append(self._datadist.cache_manager.transfer_cache_async(
                            span.cache, _Guard(ReleaseView(release, span.layers), moving), [config], **where))
                except Exception as exc:  # refused: the transfers started are still awaited
                    errors.append(exc)
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                errors += [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
                if errors:
                    raise errors[0]
            ok = True
        except (Exception, TimeoutError) as exc:
            for r in moving:
                r.failed = r.failed or f"push failed: {type(exc).__name__}: {exc}"
        finally:
            async with self._idle:
                for r in moving:
                    r.inflight -= 1
                self._idle.notify_all()
        self._record(time.perf_counter() - start, nbytes if ok else 0, count, ok)

    async def _settle(self, d: _Direct, only: Optional[_Reader] = None) -> None:
        """Tells each reader (or ``only``) once its outcome is known: landed, or pull."""
        for r in [only] if only is not None else list(d.readers):
            await self._settle_reader(d, r)

    async def _settle_reader(self, d: _Direct, r: _Reader) -> None:
        if r.settled or r.inflight or r.joining or d.forwarding:
            return
        if r.direct and not r.failed and not r.cancelled:
            if not d.last_computed:
                return
            r.landed = r.settled = True
            await self._tell(d, r, {"op": "landed", "transfer_id": d.transfer_id, "remote_request_id": d.req_id})
            return
        if d.params is None and d.last_computed and not d.forward_failed and d.lease_token and d.req_id \
                and len(d.computed) >= d.total_blocks > 0 and (self._single_group or d.all_groups is not None):
            blocks: Any = [d.computed[index] for index in range(d.total_blocks)]
            d.params = {"remote_block_ids": blocks if self._single_group else d.all_groups,
                        "lease_token": d.lease_token, "remote_request_id": d.req_id,
                        "remote_engine_id": self._engine_id}
        if r.cancelled or d.params is None:
            return  # a cancel is answered there; a pull waits for the params
        r.settled = True
        if r.failed:
            log.info("datadist_aio connector: %s is pulled instead (%s)", d.transfer_id, r.failed)
        await self._tell(d, r, {"op": "pull", "transfer_id": d.transfer_id, "params": d.params})

    async def _tell(self, d: _Direct, r: _Reader, message: dict[str, Any]) -> None:
        key = (r.notice_host, r.notice_port)
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

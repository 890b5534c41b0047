"""The prefill side of the layer-wise push (``transfer_mode="push_layerwise"``).

Each step that computes prompt blocks of requests bound for a remote decode
starts one ``transfer_cache_async`` of those blocks into the decode side's
inbox (see ``inbox.py``) when vLLM binds the step's metadata, before the
forward (``begin_step``; never from ``start_load_kv``, which vLLM 0.32 and
later call after the forward). Its ``LayerSynchronizer`` releases a layer
once the forward has saved it (``save_kv_layer``), so layer l's bytes leave
while layer l+1 computes; ``wait_for_save`` waits for the step's push and
its commit before the step's output leaves the instance. A forward that
fails or does not save every layer aborts the push: nothing of it is
committed. Each step's overlap is counted (``PushStep``). A request whose share is
exhausted, whose claim is refused or whose push fails is not pushed: its
decode side finds no committed claim and pulls it as in the pull mode.

The library moves two tensors per transfer layer: with K and V apart (two
tensors per model layer) a transfer layer is a model layer; with one tensor
per model layer (vLLM's CPU backend, MLA's latent cache) it is two model
layers, released once both were saved.

With KV tensors in device memory, ``save_kv_layer`` returns before the
model's stream has written the layer: each save records a CUDA event on the
stream (``EventRelease``), and the engine sends the layer once that event
has completed (``CudaEventSynchronizer``: no thread waits, no stream is
synchronized).

Thread rules: ``begin_step``, ``save_layer``, ``finish_step`` and ``freed``
are called from vLLM's worker thread; the coroutines run on the loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import datadist_aio as dd

from .direct import DirectPushes, PushSpan, ReleaseView
from .inbox import Share
from .metadata import SaveSpec
from ..message_guard import UNSEALED, MessageGuard
from .side_channel import SideChannelClient
from .stats import PushStep, TransferRecord

__all__ = ["INBOX_MODEL_ID", "EventRelease", "LayerRelease", "Pusher", "PushSettings", "ReleaseView"]

log = logging.getLogger(__name__)

INBOX_MODEL_ID = 1 << 20  # the decode side's inbox blocks cache, in its BlocksCacheKey
_RETRY_AFTER_S = 5.0  # after the decode side could not be reached, steps go unpushed this long
_EARLY_CONTACT_S = 600.0  # how long a starting prefill keeps trying to reach its decode side before any step
_ARM_WAIT_S = 0.05  # the most a step's forward waits for its push to be armed


class LayerRelease(dd.LayerGate):
    """Lets the step's layers go as the forward saves them: layer ``k``
    (vLLM's ``k``-th KV layer name) once layers 0 to ``k`` were saved.

    A transfer reads it through a ``ReleaseView``, which names for each of
    its transfer layers the last layer writing it. ``saved``, ``abort`` and
    ``end`` are called on vLLM's worker thread, and a layer's writes are
    handed to the engine there, inside ``saved`` (a ``LayerGate``): the
    event loop's thread, which may be waiting for the GIL while the forward
    runs, is not on the way. It also notes when the engine was first handed
    a layer (``first_handed``) and when the forward saved its last one
    (``last_saved``), both ``time.perf_counter()``: the step overlapped its
    forward when the first came before the second.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, model_layers: int) -> None:
        super().__init__()
        self._loop = loop
        self._model_layers = model_layers
        self._saved = [False] * model_layers
        self._done = 0  # model layers saved in a row from the first
        self._aborted = False
        self._ended = asyncio.Event()
        self.last_saved = 0.0
        self.first_handed: Optional[float] = None

    def saved(self, model_layer: int) -> None:
        if not 0 <= model_layer < self._model_layers or self.aborted:
            return
        self._saved[model_layer] = True
        self.last_saved = time.perf_counter()
        done = self._done
        while done < self._model_layers and self._saved[done]:
            done += 1
        if done > self._done:
            layers = range(self._done, done)
            self._done = done
            self._release(layers)

    def _release(self, layers: range) -> None:
        for layer in layers:
            self.open(layer)

    @property
    def complete(self) -> bool:
        """Whether the forward saved every model layer."""
        return self._done == self._model_layers

    @property
    def aborted(self) -> bool:
        return self._aborted

    def abort(self) -> None:
        """The forward failed, or ended without saving every layer: the
        layers not released yet are refused, and the push is never
        committed, whatever it had sent."""
        if self._aborted:
            return
        self._aborted = True
        for layer in range(self._done, self._model_layers):
            self.refuse(layer)

    def end(self) -> None:
        """The step's forward is over (after ``abort`` where it failed)."""
        self._loop.call_soon_threadsafe(self._ended.set)

    async def forward_ended(self) -> bool:
        """Once vLLM said the step's forward is over (``end``): whether it completed."""
        await self._ended.wait()
        return not self._aborted

    async def forward_over(self) -> bool:
        """Once the step's forward is over: whether it completed."""
        return await self.forward_ended()

    def watch_layer(self, layer_index: int, on_decided: Callable[[bool], None]) -> Optional[bool]:
        def handed(verdict: bool) -> None:
            if verdict:
                self._handed()
            on_decided(verdict)

        verdict = super().watch_layer(layer_index, handed)
        if verdict:
            self._handed()
        return verdict

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        ready = await super().synchronize_layer(layer_index, None)
        ready = ready and await self._layer_ready(layer_index, timeout_in_millis)
        if ready:
            self._handed()
        return ready

    def _handed(self) -> None:
        if self.first_handed is None:
            self.first_handed = time.perf_counter()

    async def _layer_ready(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        """Whether a released layer's bytes may go (they may at once in host memory)."""
        return True


class EventRelease(LayerRelease):
    """``LayerRelease`` for device memory: a transfer layer goes once the
    CUDA event recorded on the model's stream at its last save has completed.

    ``record_event`` records an event on the model's current stream and
    returns it (``torch.cuda.Event`` or a ``CUevent`` int); it is called on
    vLLM's worker thread, at the save that completes one or more transfer
    layers, which all take that event. A layer whose event the engine
    refuses fails the push (the decode side then pulls).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, model_layers: int,
                 sync: dd.CudaEventSynchronizer, record_event: Callable[[], Any], watch_end: bool = False) -> None:
        """``watch_end``: whether ``forward_over`` is awaited (decode-first
        requests in the step), which then waits for the device too."""
        super().__init__(loop, model_layers)
        self._watch_end = watch_end
        self._sync = sync
        self._record_event = record_event
        self._failed: set[int] = set()
        # Each layer's event is watched once, whatever number of transfers
        # (decodes, KV cache groups) wait for it.
        self._ready: dict[int, asyncio.Future[bool]] = {}
        self._keep: list[Any] = []  # this step's events, alive until the engine has watched them
        # The event recorded as the forward ended, watched as a layer past the
        # last: the forward is over on the device once it has completed.
        self._end_layer = model_layers
        self._end_recorded = False

    @property
    def watchable(self) -> bool:
        return False  # a layer goes once its event completed: awaited on the loop

    def _release(self, layers: range) -> None:
        event: Any = None
        try:
            event = self._record_event()
            self._keep.append(event)
        except Exception as exc:
            log.warning("datadist_aio connector: no CUDA event for saved layers %s: %s", layers, str(exc))
        for layer in layers:
            try:
                if event is None:
                    raise RuntimeError("no event was recorded")
                self._sync.record(layer, event)
            except Exception as exc:
                if event is not None:
                    log.warning("datadist_aio connector: the engine refused the event of layer %d: %s", layer, exc)
                self._failed.add(layer)
        super()._release(layers)

    async def _layer_ready(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        if layer_index in self._failed:
            return False
        ready = self._ready.get(layer_index)
        if ready is None:
            ready = self._ready[layer_index] = asyncio.ensure_future(self._sync.synchronize_layer(layer_index, None))
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        return await asyncio.wait_for(asyncio.shield(ready), timeout)

    def end(self) -> None:
        if self._watch_end and not self.aborted:
            try:
                event = self._record_event()
                self._keep.append(event)
                self._sync.record(self._end_layer, event)
                self._end_recorded = True
            except Exception as exc:
                log.warning("datadist_aio connector: no CUDA event for the end of the forward: %s", str(exc))
        super().end()

    async def forward_over(self) -> bool:
        """Once the forward is over on the device too (its work up to
        ``wait_for_save`` has completed): whether it completed. A forward
        whose end could not be watched counts as failed."""
        if not await super().forward_over() or not self._end_recorded:
            return False
        return await self._sync.synchronize_layer(self._end_layer, None)


@dataclass(frozen=True)
class PushSettings:
    """Where the prefill pushes and how long it waits."""

    engine_id: str
    decode_host: str
    decode_port: int
    share_blocks: int
    hold_s: float
    timeout_s: float
    link_timeout_ms: int


@dataclass
class _Decode:
    """The decode worker this prefill pushes to, once linked."""

    cluster_id: int
    share: Share


@dataclass
class _Step:
    release: LayerRelease
    future: "concurrent.futures.Future[None]"


class Pusher:
    """Pushes the blocks each step writes into the decode side's inbox."""

    def __init__(self, settings: PushSettings, datadist: dd.LLMDataDist, spans: Sequence[PushSpan],
                 layout: list[dict[str, Any]], layer_names: Sequence[str],
                 loop: asyncio.AbstractEventLoop, record_event: Optional[Callable[[], Any]] = None,
                 capable: bool = True, unreachable: Callable[[str], None] = lambda req_id: None,
                 guard: MessageGuard = UNSEALED) -> None:
        """``spans``: what a push of each KV cache group's blocks moves, the
        first one's the inbox's (one blocks cache, one KV cache group);
        ``settings.decode_port`` 0: no inbox (only decode-first pushes);
        ``capable``: whether the KV tensors can be pushed layer by layer at
        all (no pipeline stages)."""
        self.inbox: bool = settings.decode_port > 0
        if self.inbox and (len(spans) != 1 or spans[0].layers is None):
            raise ValueError(
                f"push_layerwise moves two tensors per transfer layer, of one blocks cache; {len(layer_names)} "
                f"layers in {len(spans)} blocks caches do not split so: use the pull mode"
            )
        self.capable: bool = capable and all(span.layers is not None for span in spans)
        self.settings = settings
        self._datadist = datadist
        self._spans = list(spans)
        self._layout = layout
        self._layers = {name: index for index, name in enumerate(layer_names)}
        self._loop = loop
        self._record_event = record_event  # device memory: layers go on CUDA events
        self._client = SideChannelClient(settings.decode_host, settings.decode_port, guard)
        self._decode: Optional[_Decode] = None
        self._connecting: Optional[asyncio.Lock] = None
        self._early: Optional[asyncio.Task[None]] = None
        self._retry_at = 0.0
        self._step: Optional[_Step] = None
        # Shared between the two threads.
        self._lock = threading.Lock()
        self._slots: dict[str, list[int]] = {}  # request -> its inbox blocks, by block index
        self._pushing: set[str] = set()  # claimed, more chunks to push
        self._records: list[TransferRecord] = []
        self._steps: list[PushStep] = []
        self.directs: DirectPushes = DirectPushes(
            datadist=datadist, spans=spans, group_layouts=layout, timeout_s=settings.timeout_s,
            record=self._record, capable=self.capable, unreachable=unreachable, engine_id=settings.engine_id,
            guard=guard)

    # -- worker thread -----------------------------------------------------------

    def begin_step(self, saves: dict[str, SaveSpec]) -> None:
        """Starts the step's push before its forward (vLLM's
        ``bind_connector_metadata``); its layers go as ``save_layer`` reports
        them. A step still open (its forward never reached ``wait_for_save``)
        is aborted first."""
        if self._step is not None:
            self.finish_step(forward_failed=True)
        inbox = [spec for spec in saves.values() if not spec.transfer_id] if self.inbox else []
        # Decode-first requests go to their steps here whatever this worker
        # can push: where it cannot, their blocks name them for a pull.
        direct = [spec for spec in saves.values() if spec.transfer_id]
        if not inbox and not direct:
            return
        release: LayerRelease
        if self._record_event is None:
            release = LayerRelease(self._loop, len(self._layers))
        else:
            release = EventRelease(self._loop, len(self._layers),
                                   dd.CudaEventSynchronizer(self._datadist), self._record_event,
                                   watch_end=bool(direct))
        armed = threading.Event()
        future = asyncio.run_coroutine_threadsafe(self._push(inbox, direct, release, armed.set), self._loop)
        self._step = _Step(release, future)
        # The forward starts once the step's transfers watch their first
        # layers (into the inbox: after its claim's round trip): the loop's
        # thread would otherwise wait for the GIL while the forward runs, and
        # a short forward could end before its push began.
        armed.wait(_ARM_WAIT_S)

    def save_layer(self, name: str) -> None:
        if self._step is not None:
            self._step.release.saved(self._layers.get(name, -1))

    def finish_step(self, forward_failed: bool = False) -> None:
        """The forward is over: waits for the step's push and its commit.

        A forward that failed, or saved fewer than all its layers, aborts the
        push: the layers not yet sent are refused and nothing is committed
        (the decode side then pulls)."""
        step, self._step = self._step, None
        if step is None:
            return
        release = step.release
        if forward_failed or not release.complete:
            release.abort()
        release.end()
        ended = time.perf_counter()
        try:
            step.future.result(timeout=self.settings.timeout_s + 5)
        except Exception as exc:  # the push bounds itself; this is a bug or a shutdown
            log.warning("datadist_aio connector: a step's push did not finish: %s", repr(exc))
        handed = release.first_handed
        with self._lock:
            self._steps.append(PushStep(
                overlapped=handed is not None and handed < release.last_saved,
                aborted=release.aborted,
                tail_seconds=time.perf_counter() - (ended if release.aborted else release.last_saved),
            ))

    def announce(self, params: dict[str, dict[str, Any]]) -> None:
        """The params of finished decode-first requests, by transfer id (worker thread)."""
        if params:
            self.directs.announce(self._loop, params)

    def freed(self, req_ids: set[str]) -> None:
        """These prefill requests are over (confirmed or leased out): their share blocks are free."""
        if req_ids:
            self._loop.call_soon_threadsafe(self.directs.freed, set(req_ids))
        with self._lock:
            blocks = [self._slots.pop(req_id) for req_id in req_ids if req_id in self._slots]
            self._pushing.difference_update(req_ids)
        if self._decode is not None:
            for item in blocks:
                self._decode.share.free(item)

    def take_records(self) -> list[TransferRecord]:
        with self._lock:
            records, self._records = self._records, []
        return records

    def take_steps(self) -> list[PushStep]:
        with self._lock:
            steps, self._steps = self._steps, []
        return steps

    # -- loop thread ---------------------------------------------------------------

    def _record(self, seconds: float, nbytes: int, blocks: int, ok: bool) -> None:
        with self._lock:
            self._records.append(TransferRecord(seconds, nbytes, blocks, ok))

    def start(self) -> None:
        """Asks for the share and links in the background (loop thread), so
        that the first step's push finds them made: the decode instance may
        start later than this one, so it is tried for ``_EARLY_CONTACT_S``."""
        if self.inbox:
            self._early = asyncio.get_running_loop().create_task(self._connect_early())

    async def _connect_early(self) -> None:
        deadline = time.monotonic() + _EARLY_CONTACT_S
        while self._decode is None and time.monotonic() < deadline:
            try:
                await self._connect()
            except (Exception, TimeoutError) as exc:
                log.debug("datadist_aio connector: the decode side is not reachable yet: %s", exc)
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._early is not None:
            self._early.cancel()
            await asyncio.gather(self._early, return_exceptions=True)
        self._client.close()
        await self.directs.close()
        await asyncio.sleep(0)  # the transport closes its socket on the next loop iteration

    async def _connect(self) -> _Decode:
        """Asks the decode side for a share and links to it, once."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._decode is not None:
                return self._decode
            answer = await self._client.request(
                {"op": "share", "engine_id": self.settings.engine_id, "blocks": self.settings.share_blocks},
                self.settings.timeout_s,
            )
            layout = answer.get("layout")
            numbers = [v for v in (answer.get(name) for name in ("cluster_id", "port", "first", "count"))
                       if isinstance(v, int)]
            if len(numbers) != 4 or not isinstance(layout, list):
                raise ValueError(f"the decode side answered share with {answer!r:.200}")
            cluster_id, port, first, count = numbers
            if layout != self._layout:
                raise ValueError(f"KV layout of the decode side {layout} differs from this side's {self._layout}")
            cluster = dd.LLMClusterInfo()
            cluster.remote_cluster_id = cluster_id
            cluster.append_local_ip_info("0.0.0.0", 0)
            cluster.append_remote_ip_info(self.settings.decode_host, port)
            _, per_cluster = await asyncio.get_running_loop().run_in_executor(
                None, self._datadist.link_clusters, [cluster], self.settings.link_timeout_ms
            )
            if per_cluster[0] not in (dd.LLMStatusCode.LLM_SUCCESS, dd.LLMStatusCode.LLM_ALREADY_LINK):
                raise dd.LLMException("link to the decode side failed", status_code=per_cluster[0])
            self._decode = _Decode(cluster_id, Share(first, count))
            with self._lock:
                # A share granted again starts empty on both sides.
                self._slots.clear()
                self._pushing.clear()
            return self._decode

    async def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        return await self._client.request({"op": op, "engine_id": self.settings.engine_id, **fields},
                                          self.settings.timeout_s)

    async def _push(self, inbox: list[SaveSpec], direct: list[SaveSpec], release: LayerRelease,
                    armed: Callable[[], None]) -> None:
        """The step's pushes: into the inbox, and into the decodes' own
        blocks. ``armed`` once each has started its transfer or given up
        (the inbox's after its claim was answered)."""
        pushes: list[Awaitable[None]] = []
        waiting = {name for name, saves in (("inbox", inbox), ("direct", direct)) if saves}

        def arm(name: str) -> Callable[[], None]:
            def started() -> None:
                waiting.discard(name)
                if not waiting:
                    armed()
            return started

        if inbox:
            pushes.append(self._push_inbox(inbox, release, arm("inbox")))
        if direct:
            pushes.append(self.directs.push_step(direct, release, release.forward_over(), arm("direct")))
        if not waiting:
            armed()
        try:
            for outcome in await asyncio.gather(*pushes, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    log.warning("datadist_aio connector: a step's push failed: %r", outcome)
        finally:
            armed()

    async def _push_inbox(self, saves: list[SaveSpec], release: LayerRelease, armed: Callable[[], None]) -> None:
        """The step's push into the inbox, all of it within ``timeout_s``; what
        it does not finish is not committed (the decode side then pulls).
        ``armed`` once its transfer started, or it gave up before."""
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await self._push_step(saves, release, armed)
        except (Exception, TimeoutError) as exc:
            log.warning("datadist_aio connector: no push this step (%s: %s)", type(exc).__name__, str(exc))
            with self._lock:
                self._pushing.difference_update(spec.req_id for spec in saves)
        finally:
            armed()

    async def _push_step(self, saves: list[SaveSpec], release: LayerRelease, armed: Callable[[], None]) -> None:
        start = time.perf_counter()
        if self._decode is None and time.monotonic() < self._retry_at:
            raise ConnectionError("the decode side was unreachable a moment ago")
        try:
            decode = await self._connect()
        except BaseException:
            self._retry_at = time.monotonic() + _RETRY_AFTER_S
            raise
        await self._claim(decode, saves)
        src: list[int] = []
        dst: list[int] = []
        pushed: list[SaveSpec] = []
        with self._lock:
            for spec in saves:
                if spec.req_id in self._pushing:
                    slots = self._slots[spec.req_id]
                    src.extend(spec.block_ids)
                    dst.extend(slots[spec.first_index:spec.first_index + len(spec.block_ids)])
                    pushed.append(spec)
        if not pushed:
            return
        ok = await self._transfer(decode, src, dst, release, armed)
        took = time.perf_counter() - start
        # Committed only once the forward is over and did not fail: a forward
        # that raises after its last layer went out still aborts the push
        # (the layers can have landed before vLLM's wait_for_save says so).
        ok = ok and await release.forward_ended()
        req_ids = [spec.req_id for spec in pushed if spec.last or not ok]
        with self._lock:
            self._pushing.difference_update(req_ids)
            self._records.append(TransferRecord(took, len(src) * self._spans[0].block_bytes if ok else 0, len(src),
                                                ok))
        try:
            await self._request("commit" if ok else "abort", req_ids=req_ids)
        except (Exception, TimeoutError) as exc:  # the decode side then waits for its load timeout and pulls
            log.warning("datadist_aio connector: %s of %d pushed requests not confirmed: %s",
                        "commit" if ok else "abort", len(req_ids), str(exc))

    async def _claim(self, decode: _Decode, saves: list[SaveSpec]) -> None:
        """Picks share blocks for the step's new requests and claims them."""
        claims: dict[str, list[int]] = {}
        with self._lock:
            for spec in saves:
                if spec.first_index == 0 and spec.req_id not in self._slots:
                    blocks = decode.share.allocate(spec.total_blocks)
                    if blocks is not None:
                        self._slots[spec.req_id] = claims[spec.req_id] = blocks
        if not claims:
            return
        granted: list[Any] = []
        try:
            answer = await self._request("claim", claims=claims, hold_s=self.settings.hold_s)
            granted = answer.get("granted") or []
        except (Exception, TimeoutError) as exc:
            log.warning("datadist_aio connector: claim of %d requests failed: %s", len(claims), str(exc))
        with self._lock:
            self._pushing.update(req_id for req_id in claims if req_id in granted)
            refused = [self._slots.pop(req_id) for req_id in claims if req_id not in granted]
        for blocks in refused:
            decode.share.free(blocks)

    async def _transfer(self, decode: _Decode, src: list[int], dst: list[int], release: LayerRelease,
                        armed: Callable[[], None]) -> bool:
        span = self._spans[0]
        assert span.layers is not None
        layers = len(span.layers)
        config = dd.TransferWithCacheKeyConfig(
            dd.BlocksCacheKey(decode.cluster_id, INBOX_MODEL_ID), range(layers), range(layers)
        )
        try:
            task = self._datadist.cache_manager.transfer_cache_async(
                span.cache, ReleaseView(release, span.layers), [config], src_block_indices=src,
                dst_block_indices=dst
            )
        except Exception as exc:
            log.warning("datadist_aio connector: push refused: %s", str(exc))
            return False
        armed()
        try:
            await task
            return True
        except Exception as exc:
            if release.aborted:
                log.info("datadist_aio connector: the step's forward ended without saving every layer: its push "
                         "of %d blocks stopped, not committed", len(src))
                return False
            log.warning("datadist_aio connector: push of %d blocks failed: %s", len(src), str(exc))
            self._decode = None  # link afresh on the next step
            return False

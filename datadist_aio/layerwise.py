"""The driver of a layer-wise ``transfer_cache_async``.

It walks the source layers in order. For each layer some config still needs,
it waits for the ``LayerSynchronizer`` (an ``async def synchronize_layer`` is
awaited on the loop, a plain one runs in a worker thread), then starts that
layer's steps for every such config without waiting for earlier layers'
acknowledgements, so the transfer overlaps the model's compute. All steps
settle into one native request with a result slot per config; the request
completes once the driver has finished and every write it issued has settled.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union, cast

from . import _native
from ._remote import INVALID_ID, TENSORS_PER_LAYER, RemoteName, remote_name
from .cache import Cache
from .layer_synchronizer import LayerSynchronizer
from .status import LLMStatusCode
from .transfer_config import TransferConfig, TransferWithCacheKeyConfig

__all__ = ["BlockPlan", "LayerwiseTransfer"]

_log = logging.getLogger("datadist_aio.layerwise")

_SUCCESS = LLMStatusCode.LLM_SUCCESS.value

AnyConfig = Union[TransferConfig, TransferWithCacheKeyConfig]


@dataclass(frozen=True)
class BlockPlan:
    """How each layer moves: block lists and the chunk size, as given, or
    byte ranges inside blocks (``ranges``: rows as the engine takes them)."""

    src_blocks: list[int]
    dst_blocks: list[int]
    chunk_size: int
    ranges: Optional[Any] = None


def _src_range(config: AnyConfig) -> range:
    """A config's source layers; ``transfer_cache_async`` filled in a missing range."""
    rng = config.src_layer_range
    assert rng is not None
    return rng


def _destination(config: AnyConfig) -> RemoteName:
    """The engine's name of a config's destination cache (unused for raw addresses)."""
    if isinstance(config, TransferConfig):
        return (1, -1, INVALID_ID, 0, INVALID_ID, 0)
    return remote_name(config.cache_key)


class LayerwiseTransfer:
    """One running ``transfer_cache_async``; see the module docstring.

    Thread rules: ``start`` on the caller's thread; ``stop`` from any thread.
    """

    def __init__(
        self,
        engine: Any,
        request: Any,
        src_cache: Cache,
        synchronizer: LayerSynchronizer,
        configs: Sequence[AnyConfig],
        blocks: BlockPlan,
        timeout_ms: int,
        on_finished: Callable[["LayerwiseTransfer"], None] = lambda _transfer: None,
    ) -> None:
        self._engine = engine
        self._on_finished = on_finished
        self._request = request
        self._src = src_cache
        self._synchronizer = synchronizer
        self._configs = list(configs)
        self._blocks = blocks
        self._timeout_ms = timeout_ms
        self._lock = threading.Lock()
        self._finished = False
        self._open = set(range(len(self._configs)))  # configs with layers still to start
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task[None]] = None
        self._watch: Optional[_Watched] = None  # a watchable synchronizer's walk, once armed
        # Without a running loop the driver runs on a loop of its own thread,
        # which closes that loop after the request completed.
        self.thread: Optional[threading.Thread] = None
        # A peer linked now whose link is gone at a later layer has failed:
        # its configs then fail with LLM_LINK_FAILED, not LLM_NOT_YET_LINK.
        self._linked = {config.dst_cluster_id: bool(engine.has_link(config.dst_cluster_id)) for config in configs}

    def start(self) -> None:
        """Runs the driver on the running loop, or on a loop of its own thread."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.thread = threading.Thread(target=asyncio.run, args=(self._drive(),), name="datadist-layerwise",
                                           daemon=True)
            self.thread.start()
            return
        self._loop = loop
        if self._synchronizer.watchable:
            # The first layer is watched before this call returns: a layer
            # decided from here on is sent by the thread that decides it,
            # whenever this loop's thread next runs.
            self._watch = self._arm(loop)
        self._task = loop.create_task(self._drive())

    def driver_loop(self) -> Optional[asyncio.AbstractEventLoop]:
        """The event loop the driver runs on (None until it has started)."""
        return self._loop

    def stop(self) -> None:
        """Stops asking for further layers (the request was cancelled)."""
        loop, task = self._loop, self._task
        if loop is None or task is None or task.done() or loop.is_closed():
            return
        if _running_loop() is loop:
            task.cancel()
        else:
            loop.call_soon_threadsafe(task.cancel)

    def abandon(self, status: LLMStatusCode) -> None:
        """Settles every config still open with ``status`` and lets the request
        complete (the engine is being finalized)."""
        self.stop()
        self._finish(status.value)

    async def _drive(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
        try:
            await self._walk_layers()
            failed = self._watch.error if self._watch is not None else None
            if failed is not None:  # on a deciding thread
                self._finish(LLMStatusCode.LLM_FAILED.value, f"the layer-wise driver failed: {failed!r}")
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a bug here must still settle the request
            _log.exception("layer-wise transfer driver failed")
            self._finish(LLMStatusCode.LLM_FAILED.value, f"the layer-wise driver failed: {exc!r}")
        self._finish(self._request.cancel_reason() if self._request.cancel_requested() else _SUCCESS)

    async def _walk_layers(self) -> None:
        if self._synchronizer.watchable:
            if self._watch is None:  # the driver's own loop: armed here
                self._watch = self._arm(asyncio.get_running_loop())
            await self._keep_time(self._watch)
            return
        for layer in self._layers():
            needing = self._needing(layer)
            if not needing:
                continue
            if self._request.cancel_requested():
                return
            status, reason = await self._wait_for_layer(layer)
            self._send_layer(layer, needing, status, reason)

    def _needing(self, layer: int) -> list[int]:
        """The configs still open that send ``layer``."""
        with self._lock:
            return [i for i in sorted(self._open) if layer in _src_range(self._configs[i])]

    def _send_layer(self, layer: int, needing: list[int], status: LLMStatusCode, reason: str) -> None:
        """Starts ``layer`` for the configs ``needing`` it (``_needing``), or
        fails them with the synchronizer's verdict (``status`` not a success)."""
        for index in needing:
            config = self._configs[index]
            if status is LLMStatusCode.LLM_SUCCESS:
                code, why = self._start_step(index, config, layer)
            else:
                code, why = status.value, reason
            if code != _SUCCESS:
                self._fail(index, code, why)
            elif layer == _src_range(config).stop - 1:
                with self._lock:
                    self._open.discard(index)

    def _layers(self) -> list[int]:
        """The source layers some config sends, in order."""
        last_layer = max(_src_range(config).stop for config in self._configs)
        return [layer for layer in range(last_layer) if any(layer in _src_range(config) for config in self._configs)]

    def _arm(self, loop: asyncio.AbstractEventLoop) -> _Watched:
        """Starts the walk with a watchable synchronizer: each layer is sent
        on the thread that decides it (inside a ``LayerGate.open``), or here
        where its verdict is known already; ``_keep_time`` then only keeps
        the time."""
        walk = _Watched(self._layers(), loop)
        if walk.over:
            return walk
        with walk.lock:
            verdict = self._synchronizer.watch_layer(walk.layers[0], functools.partial(self._decided, walk, 0))
        if verdict is not None:
            self._decided(walk, 0, verdict)
        return walk

    def _decided(self, walk: _Watched, position: int, verdict: bool) -> None:
        """A watch's callback, on the deciding thread: a bug here must not
        reach the model's ``open``; the walk ends and the driver fails the
        request with it."""
        try:
            self._decide(walk, position, *_verdict(walk.layers[position], verdict))
        except Exception as exc:
            _log.error("layer-wise transfer: sending layer %d failed:\n%s", walk.layers[position],
                       "".join(traceback.format_exception(exc)))
            exc.__traceback__ = None  # its frames would keep this transfer, and the engine, alive
            with walk.lock:
                walk.error = walk.error or exc
                walk.over = True
            walk.wake()

    def _decide(self, walk: _Watched, position: int, status: LLMStatusCode, reason: str) -> None:
        """Sends layers from ``position`` on while their verdicts are known
        (on the deciding thread; ``walk.lock`` orders it with the timer)."""
        layers = walk.layers
        with walk.lock:
            if walk.over or position != walk.next:
                return  # a verdict for a layer the walk is past
            needing = self._needing(layers[position])
            while True:
                if self._request.cancel_requested():
                    walk.over = True
                    break
                self._send_layer(layers[position], needing, status, reason)
                position += 1
                while position < len(layers) and not (needing := self._needing(layers[position])):
                    position += 1  # its configs failed: nobody waits for it
                walk.next = position
                if position == len(layers):
                    walk.over = True
                    break
                verdict = self._synchronizer.watch_layer(layers[position],
                                                         functools.partial(self._decided, walk, position))
                if verdict is None:
                    break
                status, reason = _verdict(layers[position], verdict)
        walk.wake()

    async def _keep_time(self, walk: _Watched) -> None:
        """Waits for a watched walk to end: a layer not decided within
        ``sync_kv_timeout`` of the one before (or of the start) fails its
        configs with ``LLM_TIMEOUT``, as a ``synchronize_layer`` past its
        timeout does, and the walk goes on with the next layer. However it
        ends, ``_drive`` then calls ``_finish``, which marks the walk over."""
        while True:
            walk.moved.clear()
            with walk.lock:
                if walk.over:
                    return
                waiting_for = walk.next
            if self._request.cancel_requested():
                return
            try:
                await asyncio.wait_for(walk.moved.wait(), self._timeout_ms / 1000)
            except asyncio.TimeoutError:
                layer = walk.layers[waiting_for]
                reason = f"layer {layer} was not decided within sync_kv_timeout ({self._timeout_ms} ms)"
                _log.debug("%s", reason)
                self._decide(walk, waiting_for, LLMStatusCode.LLM_TIMEOUT, reason)

    async def _wait_for_layer(self, layer: int) -> tuple[LLMStatusCode, str]:
        """The synchronizer's verdict on ``layer``, and the reason of a failure.

        A failure is reported to the caller through the task (its status and
        message), so it is logged only at DEBUG here.
        """
        sync = self._synchronizer.synchronize_layer
        try:
            pending: Awaitable[Any]
            if inspect.iscoroutinefunction(sync):
                pending = cast(Awaitable[Any], sync(layer, self._timeout_ms))
            else:
                pending = asyncio.get_running_loop().run_in_executor(None, sync, layer, self._timeout_ms)
            ready: Any = await asyncio.wait_for(pending, self._timeout_ms / 1000)
            if inspect.isawaitable(ready):
                ready = await asyncio.wait_for(ready, self._timeout_ms / 1000)
        except asyncio.TimeoutError:
            reason = f"synchronize_layer({layer}) did not answer within sync_kv_timeout ({self._timeout_ms} ms)"
            _log.debug("%s", reason)
            return LLMStatusCode.LLM_TIMEOUT, reason
        except Exception as exc:
            if _log.isEnabledFor(logging.DEBUG):
                _log.debug("synchronize_layer(%d) raised:\n%s", layer, "".join(traceback.format_exception(exc)))
            # Its traceback reaches this frame: an exception the caller keeps
            # (one instance raised again and again, say) would otherwise keep
            # this transfer, and the engine, alive.
            exc.__traceback__ = None
            return LLMStatusCode.LLM_FAILED, f"synchronize_layer({layer}) raised {exc!r}"
        if not ready:
            reason = f"synchronize_layer({layer}) returned {ready!r}: layer {layer} was not released"
            _log.debug("%s", reason)
            return LLMStatusCode.LLM_PARAM_INVALID, reason
        return LLMStatusCode.LLM_SUCCESS, ""

    def _start_step(self, index: int, config: AnyConfig, layer: int) -> tuple[int, str]:
        """Starts one layer of one config: its status, and the engine's reason for a refusal."""
        rng = _src_range(config)
        dst_layer = layer
        dst_addrs: list[int] = []
        if isinstance(config, TransferWithCacheKeyConfig):
            dst_layer = config.dst_layer_range.start + (layer - rng.start)
        else:
            first = TENSORS_PER_LAYER * (layer - rng.start)
            dst_addrs = list(config.dst_addrs[first : first + TENSORS_PER_LAYER])
        with self._lock:
            if self._finished:
                return LLMStatusCode.LLM_ENGINE_FINALIZED.value, "the engine was finalized"
            code = int(
                self._engine.transfer_step(
                    self._request,
                    index,
                    self._src.cache_id,
                    config.dst_cluster_id,
                    layer,
                    dst_layer,
                    config.src_batch_index,
                    self._blocks.src_blocks,
                    self._blocks.dst_blocks,
                    self._blocks.chunk_size,
                    _destination(config),
                    dst_addrs,
                    self._group(index),
                    self._blocks.ranges,
                )
            )
            reason = _native.last_error_message() if code != _SUCCESS else ""
        peer = config.dst_cluster_id
        if code == LLMStatusCode.LLM_NOT_YET_LINK.value and self._linked.get(peer):
            code = LLMStatusCode.LLM_LINK_FAILED.value
            reason = f"the link to cluster {peer} was lost before layer {layer} could be sent"
        elif code != _SUCCESS:
            reason = f"layer {layer} (to cluster {peer}, destination layer {dst_layer}): {reason}"
        return code, reason

    def _group(self, index: int) -> int:
        """Raw destination addresses are checked per layer by the peer: the
        config's steps then go out in order as one group, so after a refused
        layer the peer refuses the later ones and none of them lands. A named
        cache needs no group (a layer it refuses, it refuses for every later
        layer too), and its steps spread over all connections."""
        if not isinstance(self._configs[index], TransferConfig):
            return 0
        return (self._request.id << 16) | (index + 1)

    def _fail(self, index: int, code: int, reason: str) -> None:
        with self._lock:
            self._open.discard(index)
            if not self._finished:
                self._request.hold()
                self._request.release(index, code, False, reason)

    def _finish(self, code: int, reason: str = "") -> None:
        """Settles open configs with ``code`` (when it is a failure) and
        releases the driver's hold, once."""
        walk = self._watch
        if walk is not None:
            with walk.lock:
                walk.over = True  # a verdict that comes later sends nothing
        with self._lock:
            if self._finished:
                return
            self._finished = True
            if code != _SUCCESS:
                for index in self._open:
                    self._request.hold()
                    self._request.release(index, code, True, reason)
            self._request.release(0, _SUCCESS)
        self._on_finished(self)


class _Watched:
    """Where a watched walk stands: its layers, the position of the one it
    waits for, and whether it is over. ``lock`` orders the deciding threads
    and the timer; ``wake`` tells the timer (on ``loop``) that it moved."""

    def __init__(self, layers: list[int], loop: asyncio.AbstractEventLoop) -> None:
        self.layers = layers
        self.lock = threading.RLock()
        self.next = 0
        self.over = not layers
        self.error: Optional[Exception] = None  # a deciding thread's failure: the request fails with it
        self.moved = asyncio.Event()
        self._loop = loop

    def wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self.moved.set)
        except RuntimeError:  # the loop is closed: the walk is over
            pass


def _verdict(layer: int, verdict: bool) -> tuple[LLMStatusCode, str]:
    """A watched layer's verdict as ``_send_layer`` takes it."""
    if verdict:
        return LLMStatusCode.LLM_SUCCESS, ""
    return LLMStatusCode.LLM_PARAM_INVALID, f"layer {layer} was refused by its synchronizer"


def _running_loop() -> Optional[asyncio.AbstractEventLoop]:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

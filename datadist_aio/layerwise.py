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
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a bug here must still settle the request
            _log.exception("layer-wise transfer driver failed")
            self._finish(LLMStatusCode.LLM_FAILED.value, f"the layer-wise driver failed: {exc!r}")
        self._finish(self._request.cancel_reason() if self._request.cancel_requested() else _SUCCESS)

    async def _walk_layers(self) -> None:
        last_layer = max(_src_range(config).stop for config in self._configs)
        for layer in range(last_layer):
            needing = [i for i in sorted(self._open) if layer in _src_range(self._configs[i])]
            if not needing:
                continue
            if self._request.cancel_requested():
                return
            status, reason = await self._wait_for_layer(layer)
            for index in needing:
                config = self._configs[index]
                if status is LLMStatusCode.LLM_SUCCESS:
                    code, reason = self._start_step(index, config, layer)
                else:
                    code = status.value
                if code != _SUCCESS:
                    self._fail(index, code, reason)
                elif layer == _src_range(config).stop - 1:
                    with self._lock:
                        self._open.discard(index)

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


def _running_loop() -> Optional[asyncio.AbstractEventLoop]:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

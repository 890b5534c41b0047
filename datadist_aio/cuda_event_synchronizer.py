"""A ``LayerSynchronizer`` that releases each layer when a CUDA event completes.

The model records one event per layer on its own stream (``torch.cuda.Event``
or a raw ``CUevent`` handle) and hands it over, at construction or with
``record`` right after recording it. The engine then queues, on a stream of
its own, a wait for the event (``cuStreamWaitEvent``) and a host function
behind it (``cuLaunchHostFunc``) that completes a request through the
engine's completion fd. ``synchronize_layer`` awaits that request on the
event loop: no thread polls the event, and an engine waiting for events it
watches uses no CPU.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from .layer_synchronizer import LayerSynchronizer
from .status import LLMStatusCode, raise_for_status

if TYPE_CHECKING:
    from .llm_datadist import LLMDataDist

__all__ = ["CudaEventSynchronizer"]

_SUCCESS = LLMStatusCode.LLM_SUCCESS.value


def _event_handle(event: Any) -> int:
    """The ``CUevent`` handle of ``event``: an int, or the ``cuda_event`` of a ``torch.cuda.Event``."""
    handle = getattr(event, "cuda_event", event)
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(f"event must be a torch.cuda.Event or an int CUevent handle, not {type(event).__name__}")
    if not 0 < handle < 1 << 64:
        raise ValueError(f"event handle {handle:#x} is not a CUevent")
    return handle


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class CudaEventSynchronizer(LayerSynchronizer):
    """Releases layer ``i`` once the CUDA event given for it has completed.

    Every event belongs to the engine's device (``LLMConfig.device_id``) and
    must already be recorded when it is handed over: the engine waits for the
    work the event's latest record covers at that moment (an event never
    recorded counts as complete, as in CUDA). Use one synchronizer per
    transfer; a layer takes one event.

    Thread rules: ``record`` may be called from any thread (the model's,
    typically, while the transfer waits on the loop); ``synchronize_layer``
    runs on the event loop of the transfer.

    Args:
        datadist: An initialized ``LLMDataDist``; its engine watches the events.
        events: Events of layers ``0 .. len(events) - 1``, already recorded;
            more may come through ``record``.

    Raises:
        LLMException: ``LLM_FEATURE_NOT_ENABLED`` without a CUDA driver or
            device, ``LLM_PARAM_INVALID`` when the driver refuses an event.
        TypeError: An event that is neither a ``torch.cuda.Event`` nor an int.
    """

    def __init__(self, datadist: LLMDataDist, events: Optional[Sequence[Any]] = None) -> None:
        datadist._check_init()
        self._engine: Any = datadist._engine
        dispatcher = datadist._dispatcher
        assert dispatcher is not None
        self._dispatcher = dispatcher
        self._lock = threading.Lock()
        self._watches: dict[int, Any] = {}  # layer -> the engine's request, until asked for
        self._given: set[int] = set()  # layers given an event
        # Layers asked for before their event came: the loop and its future.
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        for layer, event in enumerate(events or ()):
            self.record(layer, event)

    def record(self, layer_index: int, event: Any) -> None:
        """Hands over the event of layer ``layer_index``, recorded just before.

        The engine starts watching it at once, so a later record of the same
        event (the next step's) does not move what this layer waits for.

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` when the driver refuses the
                event (with its words), ``LLM_FEATURE_NOT_ENABLED`` without a
                driver.
            ValueError: A negative layer, or one given an event already.
        """
        handle = _event_handle(event)
        if isinstance(layer_index, bool) or not isinstance(layer_index, int) or layer_index < 0:
            raise ValueError(f"layer_index must be an int >= 0, not {layer_index!r}")
        with self._lock:
            if layer_index in self._given:
                raise ValueError(f"layer {layer_index} already has its event")
            self._given.add(layer_index)
        code, request = self._engine.watch_event(handle)
        if code != _SUCCESS:
            with self._lock:
                self._given.discard(layer_index)
            raise_for_status(code, f"watching the CUDA event of layer {layer_index}")
        with self._lock:
            self._watches[layer_index] = request
            waiting = self._waiting.pop(layer_index, None)
        if waiting is not None:
            loop, future = waiting
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, future)

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        """Completes once the event of ``layer_index`` has completed.

        Waits for ``record`` first if the event has not come yet. Past
        ``timeout_in_millis`` (None: no limit) it raises
        ``asyncio.TimeoutError``, which a transfer reports as
        ``LLM_TIMEOUT``; the engine stops watching the event then.

        Returns:
            True once the event has completed; False if the engine stopped
            watching it first (finalize).
        """
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        return await asyncio.wait_for(self._wait(layer_index), timeout)

    async def _wait(self, layer: int) -> bool:
        loop = asyncio.get_running_loop()
        with self._lock:
            request = self._watches.pop(layer, None)
            came: Optional[asyncio.Future[None]] = None
            if request is None:
                came = loop.create_future()
                self._waiting[layer] = (loop, came)
        if came is not None:
            try:
                await came
            except BaseException:
                with self._lock:
                    self._waiting.pop(layer, None)
                    late = self._watches.pop(layer, None)
                if late is not None:  # came as the wait was cancelled
                    self._engine.unwatch_event(late.id)
                raise
            with self._lock:
                request = self._watches.pop(layer, None)
        assert request is not None
        try:
            await self._dispatcher.future_for(request)
        except BaseException:
            self._engine.unwatch_event(request.id)
            raise
        return bool(request.results()[0] == _SUCCESS)

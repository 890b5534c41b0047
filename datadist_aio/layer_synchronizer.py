"""Hooks that gate a layer-wise transfer on the model's progress."""

from __future__ import annotations

import abc
import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Optional, Union

__all__ = ["LayerGate", "LayerSynchronizer"]


class LayerSynchronizer(abc.ABC):
    """Tells a layer-wise transfer when a layer is ready to be sent.

    Subclasses implement `synchronize_layer`. It may be a plain method, which
    is run in a worker thread so that it may block, or an `async def`
    coroutine function, which is awaited on the event loop and must not
    block it.

    A synchronizer that can also be watched (``watchable``, as ``LayerGate``
    is) lets the transfer start a layer's sends on the thread that decides
    the layer, with no hop through the event loop.
    """

    @abc.abstractmethod
    def synchronize_layer(
        self, layer_index: int, timeout_in_millis: Optional[int]
    ) -> Union[bool, Awaitable[bool]]:
        """Waits until layer `layer_index` has been computed.

        Args:
            layer_index: Index of the layer about to be sent.
            timeout_in_millis: How long the transfer waits for this call
                (the instance's `sync_kv_timeout`); past it, the configs that
                need the layer fail with `LLM_TIMEOUT`.

        An ``async def`` override (returning ``bool``) type-checks too.

        Returns:
            True to send the layer; False fails the configs that need it
            (`LLM_PARAM_INVALID`), as does an exception (`LLM_FAILED`).
        """

    @property
    def watchable(self) -> bool:
        """Whether ``watch_layer`` may be called instead of ``synchronize_layer``."""
        return False

    def watch_layer(self, layer_index: int, on_decided: Callable[[bool], None]) -> Optional[bool]:
        """The verdict on ``layer_index`` if it is known now (True: send it;
        False: refused), else None, and then ``on_decided(verdict)`` is
        called once, on the thread that decides the layer. Only for a
        ``watchable`` synchronizer; ``on_decided`` must not block."""
        raise NotImplementedError(f"{type(self).__name__} is not watchable")


class LayerGate(LayerSynchronizer):
    """A synchronizer whose layers are opened by calls from any thread.

    The model's thread calls ``open(i)`` once layer ``i`` is computed, or
    ``refuse(i)`` when it will not be. A transfer driven by a gate hands a
    layer to the engine inside the ``open`` call, on the model's thread: it
    does not wait for the event loop's thread, which may be waiting for the
    GIL while the model computes. Handing a layer over queues its writes on
    the engine's threads; it does not wait for them.

    Each layer is decided once: the first ``open`` or ``refuse`` of it wins.
    ``synchronize_layer`` awaits the same verdict on the event loop (past
    ``timeout_in_millis`` it raises ``asyncio.TimeoutError``).
    """

    def __init__(self) -> None:
        self._gate_lock = threading.Lock()
        self._verdicts: dict[int, bool] = {}
        self._watchers: dict[int, list[Callable[[bool], None]]] = {}

    @property
    def watchable(self) -> bool:
        return True

    def open(self, layer_index: int) -> None:
        """Layer ``layer_index`` may be sent."""
        self._decide(layer_index, True)

    def refuse(self, layer_index: int) -> None:
        """Layer ``layer_index`` will not be computed: the configs that need it fail."""
        self._decide(layer_index, False)

    def verdict(self, layer_index: int) -> Optional[bool]:
        """The layer's verdict so far (None: not decided)."""
        with self._gate_lock:
            return self._verdicts.get(layer_index)

    def _decide(self, layer_index: int, verdict: bool) -> None:
        if isinstance(layer_index, bool) or not isinstance(layer_index, int) or layer_index < 0:
            raise ValueError(f"layer_index must be an int >= 0, not {layer_index!r}")
        with self._gate_lock:
            if layer_index in self._verdicts:
                return
            self._verdicts[layer_index] = verdict
            watchers = self._watchers.pop(layer_index, [])
        for on_decided in watchers:
            on_decided(verdict)

    def watch_layer(self, layer_index: int, on_decided: Callable[[bool], None]) -> Optional[bool]:
        """The layer's verdict if decided, else None and ``on_decided`` runs
        inside the ``open`` or ``refuse`` that decides it."""
        return self._watch(layer_index, on_decided)

    def _watch(self, layer_index: int, on_decided: Callable[[bool], None]) -> Optional[bool]:
        with self._gate_lock:
            verdict = self._verdicts.get(layer_index)
            if verdict is None:
                self._watchers.setdefault(layer_index, []).append(on_decided)
            return verdict

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        """Awaits the layer's verdict on the running loop (True: opened)."""
        loop = asyncio.get_running_loop()
        decided: asyncio.Future[bool] = loop.create_future()

        def resolve(verdict: bool) -> None:
            if not decided.done():
                decided.set_result(verdict)

        def on_decided(verdict: bool) -> None:
            try:
                loop.call_soon_threadsafe(resolve, verdict)
            except RuntimeError:  # the loop closed meanwhile: nobody waits
                pass

        verdict = self._watch(layer_index, on_decided)
        if verdict is not None:
            return verdict
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        return await asyncio.wait_for(decided, timeout)

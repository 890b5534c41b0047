"""Hook that gates a layer-wise transfer on the model's progress."""

from __future__ import annotations

import abc
from collections.abc import Awaitable
from typing import Optional, Union

__all__ = ["LayerSynchronizer"]


class LayerSynchronizer(abc.ABC):
    """Tells a layer-wise transfer when a layer is ready to be sent.

    Subclasses implement `synchronize_layer`. It may be a plain method, which
    is run in a worker thread so that it may block, or an `async def`
    coroutine function, which is awaited on the event loop and must not
    block it.
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


"""vLLM KV connector on datadist_aio.

``DatadistAioConnector`` needs vLLM (``pip install 'datadist_aio[vllm]'``);
it is imported on first use so the scheduler-side logic
(``scheduler.SchedulerSide``) stays importable without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DatadistAioConnector", "DatadistAioConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""SGLang disaggregation transfer backend on datadist_aio.

Installed with ``pip install 'datadist_aio[sglang]'``; SGLang loads it
through the ``sglang.srt.plugins`` entry point (``plugin.register``), and
``--disaggregation-transfer-backend datadist_aio`` chooses it. The classes
(``conn``) need SGLang and are imported on first use, so the buffer
layout logic (``buffers``) stays importable without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DatadistAioKVBootstrapServer", "DatadistAioKVManager", "DatadistAioKVReceiver", "DatadistAioKVSender"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import conn

        return getattr(conn, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

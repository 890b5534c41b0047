"""The engine's messages, delivered to Python's ``logging``.

Logger names (set levels and handlers the usual way):

- ``datadist_aio``: the package; every logger below is its child.
- ``datadist_aio.native``: messages of the C++ engine (a link going down,
  a malformed frame, a refused connection).
- ``datadist_aio.layerwise``: the driver of ``transfer_cache_async``.
- ``datadist_aio.bench``: the benchmark command.

The engine never calls into Python: it queues its messages (bounded, the
oldest dropped and counted when full) and one daemon thread, started with
the first ``LLMDataDist``, waits for them without the GIL and hands them to
``logging``. Before that thread starts, and for C++ users, the engine prints
to stderr unless ``DATADIST_AIO_LOG=off``. An error raised to the caller is
not logged as well.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
from typing import Optional

from . import _native

__all__ = ["NATIVE_LOGGER", "start", "flush"]

NATIVE_LOGGER = "datadist_aio.native"

_native_log = logging.getLogger(NATIVE_LOGGER)
_lock = threading.Lock()
_thread: Optional[threading.Thread] = None
_stopping = False
_flushes = itertools.count(1)
_flushed: dict[str, threading.Event] = {}
_FLUSH = "\x00flush:"  # a marker queued behind every earlier message


def start() -> None:
    """Routes engine messages to ``logging`` from now on (idempotent)."""
    global _thread
    with _lock:
        if _thread is not None and _thread.is_alive():
            return
        _native.capture_log(True)
        _thread = threading.Thread(target=_pump, name="datadist-log", daemon=True)
        _thread.start()


def flush(timeout: float = 5.0) -> bool:
    """Waits until every engine message queued before the call was logged."""
    start()
    name = f"{_FLUSH}{next(_flushes)}"
    done = _flushed[name] = threading.Event()
    _native.log_message(0, name)
    try:
        return done.wait(timeout)
    finally:
        _flushed.pop(name, None)


def _pump() -> None:
    while True:
        messages, dropped = _native.wait_log(-1)
        if dropped:
            _native_log.warning("%d engine messages were dropped: the log queue was full", dropped)
        for level, text in messages:
            if text.startswith(_FLUSH):
                event = _flushed.get(text)
                if event is not None:
                    event.set()
                continue
            _native_log.log(level, "%s", text)
        if _stopping:
            return


def _stop() -> None:
    """At exit: the engine prints to stderr again, and what is queued is logged."""
    global _stopping
    thread = _thread
    if thread is None:
        return
    _stopping = True
    _native.capture_log(False)
    thread.join(1.0)


def _after_fork_in_child() -> None:
    """A forked child has no pump thread: the next LLMDataDist starts one. (Nothing
    here calls the engine: a lock an engine thread held at the fork stays held.)"""
    global _thread, _lock
    _thread = None
    _lock = threading.Lock()


atexit.register(_stop)
os.register_at_fork(after_in_child=_after_fork_in_child)

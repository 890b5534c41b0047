"""Delivery of engine completions into asyncio event loops.

The engine pushes ``(request id, status)`` into one queue and writes an
eventfd when the queue goes from empty to non-empty. Each event loop that
awaits a request watches that fd with ``loop.add_reader``; one wake-up drains
the whole queue and resolves the waiting futures in a batch. A future that
belongs to another loop is resolved through that loop's
``call_soon_threadsafe``.

A done-callback registered from a thread that runs no event loop is run by
the dispatcher's callback thread (``datadist-aio-callbacks``), which polls
the fd while such callbacks are pending (and ``CALLBACK_LINGER`` after the
last, so a caller registering one after another finds it awake) and drains
it like a loop. Whichever thread drains a completion first hands the
callbacks to that thread.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import select
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Optional

__all__ = ["CALLBACK_LINGER", "CompletionDispatcher"]

_log = logging.getLogger("datadist_aio")

# Seconds the callback thread goes on polling the fd after its last callback.
CALLBACK_LINGER = 0.05


def _no_loop() -> None:
    return None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _resolve_all(futures: list[asyncio.Future[None]], loop: asyncio.AbstractEventLoop | None) -> None:
    """Resolves futures of ``loop`` (the caller's) directly, others through their own loop."""
    for future in futures:
        owner = future.get_loop()
        if owner is loop:
            _resolve(future)
        elif not owner.is_closed():
            owner.call_soon_threadsafe(_resolve, future)


class CompletionDispatcher:
    """Turns engine request completions into resolved asyncio futures.

    Thread rules: ``future_for`` must be called on the thread running the
    loop it creates the future for; ``close`` may be called from any thread.
    """

    def __init__(self, engine: Any) -> None:
        self._engine: Any = engine  # None once finalized
        self._fd: int = engine.completion_fd()
        self._lock = threading.Lock()
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
        # The loop that registered last: most calls come from it, and need
        # no look-up in the weak set.
        self._last_loop: Callable[[], Optional[asyncio.AbstractEventLoop]] = _no_loop
        self._closed = False
        # Callbacks registered from no loop, by request id, until completed;
        # then in _ready for the callback thread (started by the first).
        self._callbacks: dict[int, list[Callable[[], object]]] = {}
        self._ready: collections.deque[Callable[[], object]] = collections.deque()
        self._callback_thread: Optional[threading.Thread] = None
        self._callback_wake = -1  # an eventfd the callback thread polls
        self._callback_polling = False  # it polls the completion fd now

    def future_for(self, request: Any) -> asyncio.Future[None]:
        """A future of the running loop that resolves when ``request`` completes."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        request_id = request.id
        with self._lock:
            if self._closed:
                future.set_result(None)  # finalize settled every request
                return future
            waiting = self._waiters.get(request_id)
            if waiting is None:
                self._waiters[request_id] = [future]
            else:
                waiting.append(future)
            if self._last_loop() is not loop:
                if loop not in self._loops:
                    loop.add_reader(self._fd, self._on_readable, loop)
                    self._loops.add(loop)
                self._last_loop = weakref.ref(loop)
        # Registered before asking for the queue entry, so a drain on another
        # thread cannot miss it; if the request is already done no entry comes.
        if not request.watch():
            with self._lock:
                waiting = self._waiters.get(request_id, [])
                if future in waiting:
                    waiting.remove(future)
                    if not waiting:
                        del self._waiters[request_id]
            _resolve(future)
        return future

    def call_when_done(self, request: Any, callback: Callable[[], object]) -> None:
        """Calls ``callback()`` once ``request`` completes.

        On the running loop of the calling thread if there is one; else on
        the callback thread, or at once if ``request`` is done.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self.future_for(request).add_done_callback(lambda _: callback())
            return
        if request.done():
            callback()
            return
        request_id = request.id
        with self._lock:
            closed = self._closed
            if not closed:
                self._callbacks.setdefault(request_id, []).append(callback)
                wake = not self._callback_polling
                if self._callback_thread is None:
                    self._callback_wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                    self._callback_thread = threading.Thread(
                        target=self._serve_callbacks, args=(self._callback_wake,), name="datadist-aio-callbacks",
                        daemon=True,
                    )
                    self._callback_thread.start()
                elif wake:
                    os.eventfd_write(self._callback_wake, 1)
        if closed:
            callback()  # finalize has settled every request
            return
        # As future_for: registered first, so no drain can miss it.
        if not request.watch():
            with self._lock:
                waiting = self._callbacks.get(request_id, [])
                mine = callback in waiting
                if mine:
                    waiting.remove(callback)
                    if not waiting:
                        del self._callbacks[request_id]
            if mine:
                callback()

    def _serve_callbacks(self, wake: int) -> None:
        """The callback thread: polls the fd while callbacks wait, runs them."""
        poller = select.poll()
        poller.register(wake, select.POLLIN)
        polling = False
        idle_since: Optional[float] = None
        try:
            while True:
                while self._ready:
                    self._run_callback(self._ready.popleft())
                with self._lock:
                    if self._closed and not self._ready:
                        return
                    pending = bool(self._callbacks)
                    now = time.monotonic()
                    if pending:
                        idle_since = None
                    elif idle_since is None:
                        idle_since = now
                    linger = idle_since is not None and now - idle_since < CALLBACK_LINGER
                    want = pending or linger
                    if want != polling:
                        # Stops waking for completions other loops wait for once idle.
                        if want:
                            poller.register(self._fd, select.POLLIN)
                        else:
                            poller.unregister(self._fd)
                        polling = want
                    self._callback_polling = polling
                timeout = -1  # until a completion, a new callback or close
                if polling and not pending and idle_since is not None:
                    timeout = max(1, int((CALLBACK_LINGER - (now - idle_since)) * 1000))
                for fd, _ in poller.poll(timeout):
                    if fd == wake:
                        try:
                            os.eventfd_read(wake)
                        except BlockingIOError:
                            pass
                    else:
                        engine = self._engine
                        if engine is not None:
                            self._dispatch(engine.drain_completions(), None)
        finally:
            with self._lock:
                self._callback_polling = False
            os.close(wake)

    @staticmethod
    def _run_callback(callback: Callable[[], object]) -> None:
        try:
            callback()
        except Exception:
            _log.exception("a done-callback raised")

    def _on_readable(self, loop: asyncio.AbstractEventLoop) -> None:
        engine = self._engine
        if engine is not None:  # else closed: the loop's reader goes at its next turn
            self._dispatch(engine.drain_completions(), loop)

    def _dispatch(self, completions: list[tuple[int, int]], loop: asyncio.AbstractEventLoop | None) -> None:
        with self._lock:
            ready = [f for request_id, _ in completions for f in self._waiters.pop(request_id, ())]
            if self._callbacks:
                callbacks = [c for request_id, _ in completions for c in self._callbacks.pop(request_id, ())]
                if callbacks:
                    self._ready.extend(callbacks)
                    if threading.current_thread() is not self._callback_thread:
                        os.eventfd_write(self._callback_wake, 1)
        _resolve_all(ready, loop)

    def close(self) -> None:
        """Resolves what is left and stops watching the fd (after engine finalize)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loops = list(self._loops)
            self._loops.clear()
            self._last_loop = _no_loop
            callback_thread = self._callback_thread
            if callback_thread is not None:
                # finalize has settled every request: the callbacks still
                # waiting run now, on the callback thread, which then ends.
                self._ready.extend(c for waiting in self._callbacks.values() for c in waiting)
                os.eventfd_write(self._callback_wake, 1)
            self._callbacks.clear()
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        self._dispatch(self._engine.drain_completions(), current)
        with self._lock:
            leftover = [f for waiting in self._waiters.values() for f in waiting]
            self._waiters.clear()
        _resolve_all(leftover, current)
        for loop in loops:
            if loop.is_closed():
                continue
            if loop is current or not loop.is_running():
                # A loop that runs nowhere (between run_until_complete calls,
                # say) may be changed from here; one running elsewhere may not.
                loop.remove_reader(self._fd)
            else:
                # Keeps the engine (and so the fd) alive until the loop has let go.
                loop.call_soon_threadsafe(self._remove_reader, loop, self._engine)
        if callback_thread is not None and callback_thread is not threading.current_thread():
            callback_thread.join(timeout=10)
        # The finalized engine closes its descriptors once nothing else holds it.
        self._engine = None

    def _remove_reader(self, loop: asyncio.AbstractEventLoop, _engine: Any) -> None:
        loop.remove_reader(self._fd)

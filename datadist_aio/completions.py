"""Delivery of engine completions into asyncio event loops.

The engine pushes ``(request id, status)`` into one queue and writes an
eventfd when the queue goes from empty to non-empty. Each event loop that
awaits a request watches that fd with ``loop.add_reader``; one wake-up drains
the whole queue and resolves the waiting futures in a batch. A future that
belongs to another loop is resolved through that loop's
``call_soon_threadsafe``.

A done-callback registered from a thread that runs no event loop is waited
for by a loop of the dispatcher's own (thread ``datadist-aio-callbacks``),
which watches the fd only while such callbacks are pending.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any, Optional

__all__ = ["CompletionDispatcher"]


def _no_loop() -> None:
    return None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _run_callback_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


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
        # The callback loop: started by the first callback registered from
        # no loop; its reader is on the fd while _callbacks_pending > 0.
        self._callback_loop: Optional[asyncio.AbstractEventLoop] = None
        self._callback_thread: Optional[threading.Thread] = None
        self._callbacks_pending = 0

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
        the callback loop's thread, or at once if ``request`` is done.
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
        with self._lock:
            own = None if self._closed else self._start_callback_loop()
        if own is None:
            callback()  # finalize has settled every request
            return
        own.call_soon_threadsafe(self._attach_callback, request, callback)

    def _start_callback_loop(self) -> asyncio.AbstractEventLoop:
        """The callback loop, started if need be (under the lock)."""
        if self._callback_loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=_run_callback_loop, args=(loop,), name="datadist-aio-callbacks", daemon=True)
            thread.start()
            self._callback_loop, self._callback_thread = loop, thread
        return self._callback_loop

    def _attach_callback(self, request: Any, callback: Callable[[], object]) -> None:
        """On the callback loop: waits for ``request`` like an awaiting loop."""
        self._callbacks_pending += 1
        self.future_for(request).add_done_callback(lambda _: self._run_callback(callback))

    def _run_callback(self, callback: Callable[[], object]) -> None:
        try:
            callback()
        finally:
            self._callbacks_pending -= 1
            loop = self._callback_loop
            if self._callbacks_pending == 0 and loop is not None:
                # Idle: stop waking for completions other loops wait for.
                with self._lock:
                    watching = loop in self._loops
                    self._loops.discard(loop)
                    if self._last_loop() is loop:
                        self._last_loop = _no_loop
                if watching:
                    loop.remove_reader(self._fd)

    def _on_readable(self, loop: asyncio.AbstractEventLoop) -> None:
        engine = self._engine
        if engine is not None:  # else closed: the loop's reader goes at its next turn
            self._dispatch(engine.drain_completions(), loop)

    def _dispatch(self, completions: list[tuple[int, int]], loop: asyncio.AbstractEventLoop | None) -> None:
        with self._lock:
            ready = [f for request_id, _ in completions for f in self._waiters.pop(request_id, ())]
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
            own, own_thread = self._callback_loop, self._callback_thread
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
        if own is not None and own_thread is not None:
            # After the callbacks the resolutions above scheduled there.
            own.call_soon_threadsafe(own.call_soon, own.stop)
            if own_thread is not threading.current_thread():
                own_thread.join(timeout=10)
        # The finalized engine closes its descriptors once nothing else holds it.
        self._engine = None

    def _remove_reader(self, loop: asyncio.AbstractEventLoop, _engine: Any) -> None:
        loop.remove_reader(self._fd)

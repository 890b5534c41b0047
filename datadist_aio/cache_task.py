"""CacheTask: the awaitable handle of one asynchronous cache operation."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any, Optional, Union

from ._checks import check_uint32
from .completions import CompletionDispatcher
from .status import LLMException, LLMStatusCode, code_from_native

__all__ = ["CacheTask"]


class CacheTask:
    """Handle of an operation running in the engine, one result per config.

    ``await task`` returns the list of statuses when every part succeeded and
    raises ``LLMException`` with the first failing status otherwise.
    ``synchronize`` and ``get_results`` block the calling thread instead and
    work with or without an event loop; ``done()`` may be polled from any
    thread, and ``add_done_callback`` registers a callback. Every one of
    these reads the task's answer itself, so none waits on a timer.
    ``cancel()`` stops the work in the
    engine; the task is done only once everything it started has settled,
    and cancelling an ``await`` (``asyncio.timeout``, ``wait_for``) cancels
    the task the same way.
    """

    __slots__ = ("_request", "_dispatcher", "_operation", "_on_cancel", "_driver_loop")

    def __init__(
        self,
        request: Any,
        dispatcher: CompletionDispatcher,
        operation: Union[str, Callable[[], str]],
        on_cancel: Optional[Callable[[], None]] = None,
        driver_loop: Optional[Callable[[], Optional[asyncio.AbstractEventLoop]]] = None,
    ) -> None:
        self._request = request
        self._dispatcher = dispatcher
        self._operation = operation
        self._on_cancel = on_cancel
        # The loop a layer-wise transfer's driver runs on, which a blocking
        # wait on that loop's own thread would starve.
        self._driver_loop = driver_loop

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled() else "done" if self.done() else "pending"
        return f"<CacheTask {self._name()} {state}>"

    def _name(self) -> str:
        """What the task does, for messages (formatted on first use)."""
        if not isinstance(self._operation, str):
            self._operation = self._operation()
        return self._operation

    def done(self) -> bool:
        """True once every part has settled, whatever its outcome."""
        return bool(self._request.done())

    @property
    def completed_at(self) -> Optional[float]:
        """When the engine completed the task, in seconds of the clock of
        ``time.perf_counter()`` and ``time.monotonic()`` (CLOCK_MONOTONIC);
        None until it is done.

        The engine takes it when the last part settles, so it does not include
        the time until an awaiting caller or a done-callback sees the task.
        """
        return self._request.completed_at()

    def add_done_callback(self, fn: Callable[["CacheTask"], object]) -> None:
        """Calls ``fn(task)`` once the task is done, whatever its outcome.

        Registered from a thread running an event loop, ``fn`` runs on that
        loop, as asyncio's done-callbacks do, and an exception it raises goes
        to the loop's exception handler. Registered from any other thread,
        it runs on the library's callback thread (``datadist-aio-callbacks``),
        which logs an exception it raises, or at once in the calling thread
        if the task is already done. Either way it runs once, and is not
        called from an engine thread.
        """
        if not callable(fn):
            raise TypeError(f"add_done_callback needs a callable, got {type(fn).__name__}")
        self._dispatcher.call_when_done(self._request, lambda: fn(self))

    def cancelled(self) -> bool:
        """True if ``cancel()`` stopped work before it was carried out."""
        return bool(self._request.cancelled())

    def cancel(self) -> bool:
        """Stops the work still to do. False if the task had already finished."""
        if not self._request.cancel():
            return False
        if self._on_cancel is not None:
            self._on_cancel()
        return True

    def _statuses(self) -> list[LLMStatusCode]:
        return [code_from_native(code) for code in self._request.results()]

    def _wait(self, timeout_in_millis: Optional[int]) -> bool:
        if timeout_in_millis is not None:
            check_uint32("timeout_in_millis", timeout_in_millis)
        if timeout_in_millis != 0 and self._driver_loop is not None and not self._request.done():
            try:
                running: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not None and running is self._driver_loop():
                raise RuntimeError(
                    f"{self._name()}: a blocking wait on the thread of the event loop that drives its layers "
                    "would stop that loop, and the transfer with it; use 'await task' (or get_results(0) to look)"
                )
        return bool(self._request.wait(-1 if timeout_in_millis is None else timeout_in_millis))

    def synchronize(self, timeout_in_millis: Optional[int] = None) -> LLMStatusCode:
        """Waits for the task; the first failing status, else ``LLM_SUCCESS``.

        Returns ``LLM_TIMEOUT`` when the task is still running after
        ``timeout_in_millis``; the work goes on. Raises ``RuntimeError`` when
        called, with a timeout other than 0, on the thread of the event loop
        that drives a ``transfer_cache_async`` (the wait would stop the
        loop that releases its layers): ``await`` it there.
        """
        if not self._wait(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        for status in self._statuses():
            if status is not LLMStatusCode.LLM_SUCCESS:
                return status
        return LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: Optional[int] = None) -> list[LLMStatusCode]:
        """Waits for the task; one status per config, in the order given.

        On timeout every entry is ``LLM_TIMEOUT``; the work goes on. Raises
        ``RuntimeError`` where ``synchronize`` does.
        """
        if not self._wait(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * self._request.num_results
        return self._statuses()

    def result(self) -> list[LLMStatusCode]:
        """The outcome of a finished task, as ``await`` gives it."""
        if not self.done():
            raise asyncio.InvalidStateError(f"{self!r} is still running")
        if self.cancelled():
            raise asyncio.CancelledError(f"{self._name()} was cancelled")
        statuses = self._statuses()
        for index, status in enumerate(statuses):
            if status is not LLMStatusCode.LLM_SUCCESS:
                reason = self._request.messages()[index]
                where = f" (transfer_configs[{index}])" if len(statuses) > 1 else ""
                text = f"{self._name()} failed{where}: {reason}" if reason else f"{self._name()} failed{where}"
                raise LLMException(text, status_code=status)
        return statuses

    def __await__(self) -> Generator[Any, None, list[LLMStatusCode]]:
        # outcome(): 0 while running, n once all n results succeeded, -1
        # for anything result() has to say more about.
        outcome = self._request.outcome()
        if outcome == 0:
            try:
                yield from self._dispatcher.future_for(self._request).__await__()
            except asyncio.CancelledError:
                self.cancel()
                yield from self._settle().__await__()
                raise
            outcome = self._request.outcome()
            if outcome == 0:
                # finalize() resolves every waiting future once no request is
                # in flight, which may be a moment before a request marks
                # itself done.
                self._request.wait(-1)
                outcome = self._request.outcome()
        if outcome > 0:
            return [LLMStatusCode.LLM_SUCCESS] * outcome
        return self.result()

    async def _settle(self) -> None:
        """Waits, through further cancellations, until nothing is in flight."""
        while not self.done():
            try:
                await asyncio.shield(self._dispatcher.future_for(self._request))
            except asyncio.CancelledError:
                continue

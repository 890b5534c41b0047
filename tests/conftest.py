"""Shared fixtures: an initialised LLMDataDist, both event loops, leak checks."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import datadist_aio as dd
from support.options import MiB, make_options

try:
    import uvloop
except ImportError:  # uvloop is part of the test extra; without it only asyncio runs
    uvloop = None

_loop_errors: list[dict[str, Any]] = []


def _recording(factory: Callable[[], asyncio.AbstractEventLoop]) -> Callable[[], asyncio.AbstractEventLoop]:
    def make() -> asyncio.AbstractEventLoop:
        loop = factory()
        loop.set_exception_handler(lambda _loop, context: _loop_errors.append(context))
        return loop

    return make


def pytest_asyncio_loop_factories(config: Any, item: Any) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories = {"asyncio": _recording(asyncio.new_event_loop)}
    if uvloop is not None:
        factories["uvloop"] = _recording(uvloop.new_event_loop)
    return factories


@pytest.fixture(scope="session", autouse=True)
def _process_wide_descriptors() -> None:
    """Lets uvloop open the pipe it keeps for the whole process before any
    test counts descriptors."""
    if uvloop is not None:
        loop = uvloop.new_event_loop()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Moves what collection made (modules, test items, parameters) out of
    the collector's reach: ``no_leaks`` collects twice a test, and each
    collection then walks only what the tests made, not the whole run's
    ~100,000 objects (about 50 ms a collection, minutes a run)."""
    gc.collect()
    gc.freeze()


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fails a test that leaves an LLMDataDist initialised, a file descriptor
    open, or a call of a loop's exception handler behind."""
    gc.collect()
    before = _open_fds()
    _loop_errors.clear()
    yield
    gc.collect()
    live = dd.LLMDataDist._live
    if live is not None:
        live.finalize()
        pytest.fail(f"{live!r} was left initialised")
    leaked = _open_fds() - before
    # A descriptor opened and closed by the check itself shows up as missing.
    leaked = {fd for fd in leaked if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not leaked, f"file descriptors left open: {sorted(leaked)}"
    assert not _loop_errors, f"event loop exception handler called: {_loop_errors}"


@pytest.fixture
def datadist() -> Iterator[dd.LLMDataDist]:
    """An initialised PROMPT instance with a 64 MiB host pool."""
    instance = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
    instance.init(make_options())
    yield instance
    engine = instance._engine
    instance.finalize()
    if engine is not None:
        assert engine.requests_in_flight() == 0, "requests left in flight after finalize"


@pytest.fixture
def big_datadist() -> Iterator[dd.LLMDataDist]:
    """An initialised instance with a 1 GiB host pool, for long copies."""
    instance = dd.LLMDataDist(dd.LLMRole.PROMPT, 2)
    instance.init(make_options(1024 * MiB))
    yield instance
    instance.finalize()


@pytest.fixture
def cache_manager(datadist: dd.LLMDataDist) -> dd.CacheManager:
    return datadist.cache_manager

"""The event loops the benchmarks await on."""

from __future__ import annotations

import asyncio
import importlib.util

LOOPS = ("asyncio", "uvloop")


def available_loops() -> list[str]:
    """"asyncio", and "uvloop" when it is installed."""
    return ["asyncio", "uvloop"] if importlib.util.find_spec("uvloop") else ["asyncio"]


def loop_runner(name: str) -> asyncio.Runner:
    """An ``asyncio.Runner`` on the loop ``name`` names; ImportError when it is
    uvloop and uvloop is not installed, ValueError for another name."""
    if name == "uvloop":
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    if name != "asyncio":
        raise ValueError(f"unknown event loop {name!r}")
    return asyncio.Runner()

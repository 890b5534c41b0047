"""Event loops the benchmarks run under, and latency sampling on them."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable


def available_loops() -> list[str]:
    """"asyncio", and "uvloop" when it is installed."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return ["asyncio"]
    return ["asyncio", "uvloop"]


def runner(loop_name: str) -> asyncio.Runner:
    if loop_name == "uvloop":
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner()


def awaited_latency(loop_name: str, operation: Callable[[], Awaitable[object]], ops: int) -> list[float]:
    """Seconds taken by each of ``ops`` sequential awaits of ``operation()``,
    after one warm-up round, sorted."""

    async def sample() -> list[float]:
        samples = []
        for _ in range(ops):
            start = time.perf_counter()
            await operation()
            samples.append(time.perf_counter() - start)
        return samples

    with runner(loop_name) as r:
        r.run(sample())
        return sorted(r.run(sample()))


def median_p99_us(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e6, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6

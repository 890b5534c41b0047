"""Event loops the benchmarks run under, and latency sampling on them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable

from datadist_aio.bench.loops import available_loops, loop_runner
from datadist_aio.bench.runner import percentile

__all__ = ["available_loops", "awaited_latency", "loop_runner", "median_p99_us"]


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

    with loop_runner(loop_name) as r:
        r.run(sample())
        return sorted(r.run(sample()))


def median_p99_us(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e6, percentile(ordered, 0.99) * 1e6

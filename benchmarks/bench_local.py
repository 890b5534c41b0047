"""Local engine benchmarks: copy_blocks throughput and awaited-completion cost.

    python benchmarks/bench_local.py [--quick]

Throughput is reported as a ratio to numpy's memcpy (``np.copyto`` of the
same number of bytes, contiguous) measured in the same run. Completion
overhead is the latency of one awaited tiny copy, next to the same copy
waited for synchronously (no event loop), under asyncio and uvloop.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import datadist_aio as dd
from loops import available_loops, awaited_latency, median_p99_us

MiB = 1 << 20
KiB = 1 << 10


def make_datadist(pool_bytes: int) -> dd.LLMDataDist:
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.host_mem_pool_cfg = f'{{"memory_size": {pool_bytes}}}'
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
    datadist.init(config.generate_options())
    return datadist


def median_seconds(fn, iterations: int) -> float:
    fn()  # warm up: page faults, thread wake-ups
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_copy_blocks(cache_manager: dd.CacheManager, moved_bytes: int, block_bytes: int, iterations: int) -> dict:
    tensors = 2
    blocks = 2 * moved_bytes // (tensors * block_bytes)  # half the blocks are copied onto the other half
    desc = dd.CacheDesc(tensors, [blocks, block_bytes], dd.DataType.DT_UINT8, dd.Placement.HOST)
    cache = cache_manager.allocate_blocks_cache(desc)
    rng = np.random.default_rng(0)
    for t in range(tensors):
        cache.as_numpy(t)[:] = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
    order = rng.permutation(blocks)
    half = blocks // 2
    info = {int(s): [int(d)] for s, d in zip(order[:half], order[half:])}
    seconds = median_seconds(lambda: cache_manager.copy_blocks(cache, info), iterations)
    view = cache.as_numpy(0)
    for s, (d,) in list(info.items())[:64]:
        assert np.array_equal(view[s], view[d]), "copy_blocks moved the wrong bytes"

    src = np.ones(moved_bytes, dtype=np.uint8)
    dst = np.zeros(moved_bytes, dtype=np.uint8)
    memcpy_seconds = median_seconds(lambda: np.copyto(dst, src), iterations)
    cache_manager.deallocate_blocks_cache(cache)
    engine_gbps = moved_bytes / seconds / 1e9
    memcpy_gbps = moved_bytes / memcpy_seconds / 1e9
    return {
        "block": block_bytes,
        "engine_gbps": engine_gbps,
        "memcpy_gbps": memcpy_gbps,
        "ratio": engine_gbps / memcpy_gbps,
    }


def bench_completion(cache_manager: dd.CacheManager, loop_name: str, ops: int) -> dict:
    desc = dd.CacheDesc(1, [4, 64], dd.DataType.DT_UINT8, dd.Placement.HOST)
    cache = cache_manager.allocate_blocks_cache(desc)
    awaited = awaited_latency(loop_name, lambda: cache_manager.copy_blocks_async(cache, {0: [1]}), ops)
    blocking = []
    for _ in range(ops):
        start = time.perf_counter()
        cache_manager.copy_blocks(cache, {0: [1]})
        blocking.append(time.perf_counter() - start)
    cache_manager.deallocate_blocks_cache(cache)
    await_med, await_p99 = median_p99_us(awaited)
    block_med, block_p99 = median_p99_us(blocking)
    return {
        "loop": loop_name,
        "await_median_us": await_med,
        "await_p99_us": await_p99,
        "blocking_median_us": block_med,
        "blocking_p99_us": block_p99,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer iterations")
    args = parser.parse_args()
    moved = (32 if args.quick else 128) * MiB
    iterations = 5 if args.quick else 15
    ops = 500 if args.quick else 5000

    datadist = make_datadist(2 * moved + 64 * MiB)
    try:
        cache_manager = datadist.cache_manager
        print(f"copy_blocks, {moved // MiB} MiB moved per call, random block map, {iterations} iterations (median)")
        print(f"{'block':>9} {'engine GB/s':>12} {'memcpy GB/s':>12} {'ratio':>7}")
        for block in (16 * KiB, 256 * KiB, 4 * MiB):
            row = bench_copy_blocks(cache_manager, moved, block, iterations)
            print(f"{block // KiB:>6} KiB {row['engine_gbps']:>12.2f} {row['memcpy_gbps']:>12.2f} {row['ratio']:>7.2f}")
        print(f"\nawaited completion of one tiny copy, {ops} sequential operations")
        print(f"{'loop':>8} {'await med':>10} {'await p99':>10} {'block med':>10} {'block p99':>10}  (us)")
        for loop_name in available_loops():
            row = bench_completion(cache_manager, loop_name, ops)
            print(
                f"{loop_name:>8} {row['await_median_us']:>10.1f} {row['await_p99_us']:>10.1f} "
                f"{row['blocking_median_us']:>10.1f} {row['blocking_p99_us']:>10.1f}"
            )
    finally:
        datadist.finalize()


if __name__ == "__main__":
    main()

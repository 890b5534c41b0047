"""Transfers between two processes on loopback, against raw sockets.

    python benchmarks/bench_transfer.py [--quick] [--connections N]

For each block size: one push_blocks (and pull_blocks) call per iteration
moving a whole cache to a random permutation of destination blocks; GB/s is
the median over iterations, and the ratio is to the best raw loopback TCP
throughput (1, 2 and 4 streams of large sends) measured in the same run.
The raw baseline is benchmarks/raw_tcp.cpp (C++, compiled on first use):
its receivers read into memory the size of their share, as the engine does
into the destination cache. Also: the awaited latency of one 4 KiB block push under asyncio and uvloop,
and the CPU the library burns while linked and idle. Every transfer's bytes
are checked once (a digest computed on each side).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

import datadist_aio as dd
from loops import available_loops, awaited_latency, median_p99_us

MiB = 1 << 20
KiB = 1 << 10
TENSORS = 2


def options(pool_bytes: int, listen: bool, connections: int) -> dict[str, str]:
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = f'{{"memory_size": {pool_bytes}}}'
    config.sync_kv_timeout = 60000
    config.tcp_connections_per_peer = connections
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()


def digest(cache: dd.Cache, blocks: np.ndarray) -> str:
    h = hashlib.sha256()
    for t in range(cache.cache_desc.num_tensors):
        h.update(np.ascontiguousarray(cache.as_numpy(t)[blocks]).data)
    return h.hexdigest()


# -- the decode process -----------------------------------------------------------


def decode_main(conn, cache_bytes: int, connections: int) -> None:
    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, 2)
    datadist.init(options(cache_bytes + 64 * MiB, True, connections))
    cm = datadist.cache_manager
    cache = None
    conn.send(datadist.listen_port)
    while True:
        command, arg = conn.recv()
        if command == "layout":
            if cache is not None:
                cm.deallocate_blocks_cache(cache)
            block = arg
            blocks = cache_bytes // (TENSORS * block)
            desc = dd.CacheDesc(TENSORS, [blocks, block], dd.DataType.DT_UINT8, dd.Placement.HOST)
            cache = cm.allocate_blocks_cache(desc, dd.BlocksCacheKey(2, 0))
            rng = np.random.default_rng(block)
            for t in range(TENSORS):
                cache.as_numpy(t)[:] = rng.integers(0, 256, size=(blocks, block), dtype=np.uint8)
            conn.send(None)
        elif command == "digest":
            conn.send(digest(cache, np.asarray(arg)))
        elif command == "cpu":
            conn.send(time.process_time())
        else:
            break
    datadist.finalize()
    conn.send(None)


# -- raw sockets --------------------------------------------------------------------


def raw_throughput(streams: int, total: int, iterations: int) -> float:
    """GB/s of raw_tcp.cpp (compiled here with the C++ compiler the build uses)."""
    source = Path(__file__).with_name("raw_tcp.cpp")
    binary = Path(tempfile.gettempdir()) / f"datadist_raw_tcp_{os.getuid()}"
    if not binary.exists() or binary.stat().st_mtime < source.stat().st_mtime:
        subprocess.run([os.environ.get("CXX", "g++"), "-O2", "-pthread", str(source), "-o", str(binary)], check=True)
    out = subprocess.run([str(binary), str(streams), str(total), str(iterations)], check=True, capture_output=True)
    return float(out.stdout)


# -- engine transfers -------------------------------------------------------------------


def engine_rows(cm, conn, cache_bytes: int, block: int, iterations: int) -> dict:
    conn.send(("layout", block))
    conn.recv()
    blocks = cache_bytes // (TENSORS * block)
    desc = dd.CacheDesc(TENSORS, [blocks, block], dd.DataType.DT_UINT8, dd.Placement.HOST)
    cache = cm.allocate_blocks_cache(desc)
    rng = np.random.default_rng(0)
    for t in range(TENSORS):
        cache.as_numpy(t)[:] = rng.integers(0, 256, size=(blocks, block), dtype=np.uint8)
    src = list(range(blocks))
    dst = rng.permutation(blocks)
    key = dd.BlocksCacheKey(2, 0)

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return cache_bytes / statistics.median(samples) / 1e9

    push = timed(lambda: cm.push_blocks(key, cache, src, dst.tolist()))
    conn.send(("digest", dst.tolist()))
    assert conn.recv() == digest(cache, np.arange(blocks)), "pushed bytes differ"
    conn.send(("digest", dst.tolist()))
    remote = conn.recv()
    pull = timed(lambda: cm.pull_blocks(key, cache, dst.tolist(), src))
    assert digest(cache, np.arange(blocks)) == remote, "pulled bytes differ"
    cm.deallocate_blocks_cache(cache)
    return {"block": block, "push": push, "pull": pull}


def latency(cm, loop_name: str, ops: int) -> tuple[float, float]:
    desc = dd.CacheDesc(TENSORS, [4, 2 * KiB], dd.DataType.DT_UINT8, dd.Placement.HOST)  # 4 KiB per block
    cache = cm.allocate_blocks_cache(desc)
    key = dd.BlocksCacheKey(2, 0)
    samples = awaited_latency(loop_name, lambda: cm.push_blocks_async(key, cache, [0], [1]), ops)
    cm.deallocate_blocks_cache(cache)
    return median_p99_us(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--connections", type=int, default=2, help="TCP connections per peer")
    args = parser.parse_args()
    cache_bytes = (64 if args.quick else 256) * MiB
    iterations = 3 if args.quick else 7
    ctx = mp.get_context("spawn")

    raw = {n: raw_throughput(n, cache_bytes, iterations) for n in (1, 2, 4)}
    best_raw = max(raw.values())
    print("raw loopback TCP, large sends: " + ", ".join(f"{n} stream(s) {v:.2f} GB/s" for n, v in raw.items()))

    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_main, args=(child, cache_bytes, args.connections))
    proc.start()
    try:
        port = parent.recv()
        datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
        datadist.init(options(cache_bytes + 64 * MiB, False, args.connections))
        cluster = dd.LLMClusterInfo()
        cluster.remote_cluster_id = 2
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", port)
        status, _ = datadist.link_clusters([cluster], 5000)
        assert status is dd.LLMStatusCode.LLM_SUCCESS, status
        cm = datadist.cache_manager
        print(f"\n{cache_bytes // MiB} MiB cache, {TENSORS} tensors, random destination blocks, "
              f"{args.connections} connections, median of {iterations}")
        print(f"{'block':>9} {'push GB/s':>10} {'ratio':>6} {'pull GB/s':>10} {'ratio':>6}")
        for block in (16 * KiB, 256 * KiB, 4 * MiB):
            row = engine_rows(cm, parent, cache_bytes, block, iterations)
            print(f"{block // KiB:>6} KiB {row['push']:>10.2f} {row['push'] / best_raw:>6.2f} "
                  f"{row['pull']:>10.2f} {row['pull'] / best_raw:>6.2f}")

        parent.send(("layout", 2 * KiB))  # 2 tensors x 2 KiB: 4 KiB per block
        parent.recv()
        print("\nawaited push of one 4 KiB block (us)")
        for loop_name in available_loops():
            med, p99 = latency(cm, loop_name, 300 if args.quick else 2000)
            print(f"{loop_name:>8}: median {med:.1f}, p99 {p99:.1f}")

        idle = 2.0
        parent.send(("cpu", None))
        remote_before = parent.recv()
        local_before = time.process_time()
        time.sleep(idle)
        parent.send(("cpu", None))
        remote_cpu = parent.recv() - remote_before
        local_cpu = time.process_time() - local_before
        print(f"\nidle while linked, {idle:.0f} s: CPU {100 * local_cpu / idle:.2f}% (prefill), "
              f"{100 * remote_cpu / idle:.2f}% (decode)")
        datadist.finalize()
    finally:
        parent.send(("exit", None))
        parent.recv()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()

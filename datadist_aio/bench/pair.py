"""Two engines on loopback for the benchmarks that compare settings of one
library in the same run (``--encryption``, ``--access``): a target process
(the decode side, which owns the caches) and this process (the initiator).

One round, in fresh processes with the given ``LLMConfig`` settings on both
ends: push and pull of a blocks cache of 4 MiB blocks (K and V), each figure
the best of its batches, every pushed batch checked on the target (a digest
of its cache) and every pulled one here; the CPU time both processes spend
per GB pushed; and the awaited push of one 4 KiB block, one at a time. The
target may be kept busy by spinning processes beside it (a host whose cores
serve other work).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np

from .arguments import byte_size, positive

OWNER, INITIATOR = 2, 1
BULK_MODEL, SMALL_MODEL = 1, 2
TENSORS = 2  # one layer, K and V
BLOCK = 4 << 20
SMALL_BLOCK = 4096
SMALL_BLOCKS = 16
ANSWER_S = 300.0


class Workload(NamedTuple):
    cache_bytes: int
    rounds: int
    iterations: int
    small_ops: int


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The options every comparison of this kind takes."""
    p.add_argument("--quick", action="store_true", help="64 MiB per batch, 2 rounds of 3 batches, 200 small pushes")
    p.add_argument("--output", type=Path, metavar="DIR", default=Path("bench-results"),
                   help="directory for the JSON (default: %(default)s)")
    p.add_argument("--cache-size", type=byte_size, metavar="SIZE", help="bytes moved per batch (default 256M)")
    p.add_argument("--rounds", type=positive, help="rounds of each variant, alternating (default 3; quick 2)")
    p.add_argument("--iterations", type=positive, help="timed batches per figure of a round (default 5; quick 3)")
    p.add_argument("--small-ops", type=positive, help="awaited 4 KiB pushes per round (default 1000; quick 200)")


def workload(args: argparse.Namespace, p: argparse.ArgumentParser) -> Workload:
    """The workload the options ask for (`p` reports a cache size that does not split into blocks)."""
    cache_bytes = args.cache_size or ((64 << 20) if args.quick else (256 << 20))
    if cache_bytes % (TENSORS * BLOCK):
        p.error(f"--cache-size must be a multiple of {TENSORS * BLOCK >> 20} MiB")
    return Workload(cache_bytes, args.rounds or (2 if args.quick else 3), args.iterations or (3 if args.quick else 5),
                    args.small_ops or (200 if args.quick else 1000))


def _config(settings: dict[str, Any], secret: str, pool_bytes: int, listen: bool) -> Any:
    import datadist_aio as dd

    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = f'{{"memory_size": {pool_bytes}}}'
    config.sync_kv_timeout = 60000  # a whole batch is one operation
    config.auth_key = secret
    for name, value in settings.items():
        setattr(config, name, value)
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config


def descs(cache_bytes: int) -> tuple[Any, Any]:
    import datadist_aio as dd

    bulk = dd.CacheDesc(TENSORS, [cache_bytes // TENSORS // BLOCK, BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)
    small = dd.CacheDesc(1, [SMALL_BLOCKS, SMALL_BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)
    return bulk, small


def _digest(cache: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in range(cache.cache_desc.num_tensors):
        h.update(cache.as_numpy(t).data)
    return h.hexdigest()


def spinners(count: int) -> list[subprocess.Popen[bytes]]:
    """Processes that keep a core each busy until killed (`stop_spinners`)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop_spinners(running: list[subprocess.Popen[bytes]]) -> None:
    for spinner in running:
        spinner.kill()
        spinner.wait()


def target_main(conn: Any, settings: dict[str, Any], secret: str, cache_bytes: int, busy: int) -> None:
    """The decode side: listens, holds the caches, answers digests; `busy`
    spinning processes beside it."""
    import datadist_aio as dd

    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, OWNER)
    busy_ones: list[subprocess.Popen[bytes]] = []
    try:
        datadist.init(_config(settings, secret, cache_bytes + (32 << 20), True).generate_options())
        bulk, small = descs(cache_bytes)
        cm = datadist.cache_manager
        cache = cm.allocate_blocks_cache(bulk, dd.BlocksCacheKey(OWNER, BULK_MODEL))
        cm.allocate_blocks_cache(small, dd.BlocksCacheKey(OWNER, SMALL_MODEL))
        busy_ones = spinners(busy)
        conn.send(("ok", datadist.listen_port))
        while True:
            command, arg = conn.recv()
            if command == "stop":
                break
            if command == "digest":
                conn.send(("ok", _digest(cache)))
            elif command == "fill":
                for t in range(TENSORS):
                    cache.as_numpy(t)[:] = np.random.default_rng(arg + t).integers(0, 256, cache.as_numpy(t).shape,
                                                                                 dtype=np.uint8)
                conn.send(("ok", _digest(cache)))
            elif command == "stats":
                conn.send(("ok", datadist._engine.link_stats(INITIATOR)))
    except Exception as exc:  # noqa: BLE001 - told to the other side
        conn.send(("error", repr(exc)))
    finally:
        stop_spinners(busy_ones)
        datadist.finalize()
        conn.close()


def cpu_seconds(pid: int) -> float:
    """User and system time of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Target:
    """The decode side, in a process of its own."""

    def __init__(self, settings: dict[str, Any], secret: str, cache_bytes: int, busy: int = 0) -> None:
        ctx = mp.get_context("spawn")
        conn, theirs = ctx.Pipe()
        self.conn: Any = conn
        self.process: Any = ctx.Process(target=target_main, args=(theirs, settings, secret, cache_bytes, busy),
                                        daemon=True)
        self.process.start()
        theirs.close()
        self.port: int = int(self.call(None))

    def call(self, command: Optional[str], arg: Any = None) -> Any:
        if command is not None:
            self.conn.send((command, arg))
        if not self.conn.poll(ANSWER_S):
            raise RuntimeError(f"the target did not answer {command!r} within {ANSWER_S} s")
        kind, value = self.conn.recv()
        if kind != "ok":
            raise RuntimeError(f"the target failed: {value}")
        return value

    def close(self) -> None:
        try:
            self.conn.send(("stop", None))
        except OSError:
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


def one_round(settings: dict[str, Any], cache_bytes: int, iterations: int, small_ops: int,
              busy: int = 0) -> dict[str, Any]:
    """Push, pull and the awaited small push with `settings` on both ends, in fresh processes."""
    import datadist_aio as dd

    secret = secrets.token_hex(32)
    target = Target(settings, secret, cache_bytes, busy)
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, INITIATOR)
    try:
        datadist.init(_config(settings, secret, cache_bytes + (32 << 20), False).generate_options())
        info = dd.LLMClusterInfo()
        info.remote_cluster_id = OWNER
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", target.port)
        status, _ = datadist.link_clusters([info], 10000)
        if status is not dd.LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link failed: {status}")
        path = datadist.link_transport(OWNER)
        bulk, small = descs(cache_bytes)
        cm = datadist.cache_manager
        cache = cm.allocate_blocks_cache(bulk)
        small_cache = cm.allocate_blocks_cache(small)
        if settings.get("access") == "one_sided" and str(path) in ("same_host", "ucx"):
            deadline = time.monotonic() + 10  # the owner's grants follow the link
            while datadist._engine.link_stats(OWNER).get("grants_held", 0) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        blocks = list(range(bulk.shape[0]))
        remote, remote_small = dd.BlocksCacheKey(OWNER, BULK_MODEL), dd.BlocksCacheKey(OWNER, SMALL_MODEL)
        verified = True
        push_s, pull_s, push_cpu = [], [], []
        pid = target.process.pid
        assert pid is not None
        for i in range(iterations):
            for t in range(TENSORS):
                cache.as_numpy(t)[:] = np.random.default_rng(1000 * i + t).integers(0, 256, cache.as_numpy(t).shape,
                                                                                   dtype=np.uint8)
            sent = _digest(cache)
            cpu = time.process_time() + cpu_seconds(pid)
            start = time.perf_counter()
            cm.push_blocks(remote, cache, blocks, blocks)
            push_s.append(time.perf_counter() - start)
            push_cpu.append(time.process_time() + cpu_seconds(pid) - cpu)
            verified = verified and target.call("digest") == sent
            expected = target.call("fill", 7000 + i)
            start = time.perf_counter()
            cm.pull_blocks(remote, cache, blocks, blocks)
            pull_s.append(time.perf_counter() - start)
            verified = verified and _digest(cache) == expected

        async def small_pushes() -> list[float]:
            seconds = []
            for _ in range(small_ops):
                start = time.perf_counter()
                await cm.push_blocks_async(remote_small, small_cache, [0], [0], tensor_num_per_layer=1)
                seconds.append(time.perf_counter() - start)
            return seconds

        small_cache.as_numpy(0)[:] = 5
        small_s = asyncio.run(small_pushes())
        stats = datadist._engine.link_stats(OWNER)
        return {
            "path": str(path),
            "encrypted": path.encrypted,
            "cipher": path.cipher,
            "kernel_tls": path.kernel_tls,
            "connections": stats.get("connections"),
            # Moved by this end under the owner's grants: on one host, or over UCX.
            "one_sided_ops": stats.get("one_sided_ops", 0) + stats.get("ucx_one_sided_ops", 0),
            "framed_ops": stats.get("framed_ops", 0),
            "push_gbps": cache_bytes / min(push_s) / 1e9,
            "push_cpu_s_per_gb": min(push_cpu) / (cache_bytes / 1e9),
            "pull_gbps": cache_bytes / min(pull_s) / 1e9,
            "small_push_us_median": statistics.median(small_s) * 1e6,
            "small_push_us_p99": sorted(small_s)[int(0.99 * (len(small_s) - 1))] * 1e6,
            "small_push_us_max": max(small_s) * 1e6,
            "verified": verified,
        }
    finally:
        datadist.finalize()
        target.close()


def span(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values)}


def report(work: Workload, workload: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A run's JSON: when and where, the workload (`work`, and `workload`'s
    entries), then `fields`."""
    return {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "workload": {"cache_bytes": work.cache_bytes, "block_bytes": BLOCK, "tensors": TENSORS, "rounds": work.rounds,
                     "iterations": work.iterations, "small_ops": work.small_ops, **workload},
        **fields,
    }


def write(output: Path, name: str, data: dict[str, Any], text: str) -> None:
    """Writes `data` as OUTPUT/NAME and prints `text` and where it went."""
    output.mkdir(parents=True, exist_ok=True)
    path = output / name
    path.write_text(json.dumps(data, indent=2))
    print(text)
    print(f"wrote {path}")

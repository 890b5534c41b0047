"""The demo job: a prefill process pushes a paged multi-layer KV cache into a
decode process on loopback and the decode side checks every byte.

The decode process listens on a free port and registers a blocks cache
(K and V per layer). The prefill process fills its own cache with random
bytes, links, and pushes a request's blocks to a random block table with one
awaited ``push_blocks_async`` call; the decode side compares digests of the
blocks it received and checks that no other block was written.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import secrets
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Optional

import numpy as np

from .cache import Cache
from .cache_desc import CacheDesc
from .cache_key import BlocksCacheKey
from .cluster_info import LLMClusterInfo
from .config import LLMConfig
from .data_type import DataType
from .enums import LLMRole, Placement
from .llm_datadist import LLMDataDist
from .status import LLMStatusCode

PREFILL_ID, DECODE_ID = 1, 2
_TIMEOUT = 60.0
_POOL_SLACK = 16 << 20  # bytes of each side's pool beyond its cache


class DemoError(RuntimeError):
    """The demo cannot run as asked (arguments, memory, the decode process)."""


def needed_bytes(layers: int, blocks: int, block_bytes: int) -> int:
    """Memory a run takes: each process's pool holds its whole cache, and the
    prefill side fills its cache through one tensor-sized temporary."""
    tensor = blocks * block_bytes
    cache = 2 * layers * tensor
    return 2 * (cache + _POOL_SLACK) + tensor


def available_bytes() -> Optional[int]:
    """Memory this process may still use: MemAvailable, capped by a cgroup v2
    limit; None where neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as current:
            text = limit.read().strip()
            if text != "max":
                found.append(max(0, int(text) - int(current.read().strip())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_arguments(layers: int, blocks: int, block_bytes: int) -> None:
    """Raises DemoError, saying what to change, for a run that cannot work."""
    if layers < 1 or blocks < 2 or block_bytes < 1:
        raise DemoError(f"--layers must be >= 1 and --blocks >= 2 (got {layers} layers, {blocks} blocks)")
    need = needed_bytes(layers, blocks, block_bytes)
    free = available_bytes()
    if free is not None and need > free:
        raise DemoError(
            f"this run needs about {need / (1 << 30):.1f} GiB of memory ({layers} layers x 2 tensors x {blocks} "
            f"blocks x {block_bytes // 1024} KiB, on each side) but {free / (1 << 30):.1f} GiB are available; "
            "use fewer --blocks or --layers, or a smaller --block-kib"
        )


def _options(pool_bytes: int, listen: bool, secret: str, transport: str) -> dict[str, str]:
    config = LLMConfig()
    config.transport = transport
    config.auth_key = secret  # a fresh secret of this run: the two processes prove it to each other
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = f'{{"memory_size": {pool_bytes}}}'
    config.sync_kv_timeout = 30000
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()


def _desc(layers: int, blocks: int, block_bytes: int) -> CacheDesc:
    return CacheDesc(2 * layers, [blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)


def _digest(cache: Cache, blocks: list[int]) -> str:
    h = hashlib.sha256()
    for t in range(cache.cache_desc.num_tensors):
        h.update(np.ascontiguousarray(cache.as_numpy(t)[blocks]).data)
    return h.hexdigest()


def _decode_main(conn: Connection, layers: int, blocks: int, block_bytes: int, secret: str, transport: str) -> None:
    """The decode process: reports its failure to the parent instead of dying silently."""
    try:
        _decode(conn, layers, blocks, block_bytes, secret, transport)
    except BaseException as exc:
        try:
            conn.send(("error", "".join(traceback.format_exception_only(type(exc), exc)).strip()))
        except OSError:
            pass
        raise


def _decode(conn: Connection, layers: int, blocks: int, block_bytes: int, secret: str, transport: str) -> None:
    """The decode process: listen, register the KV cache, check what arrives."""
    desc = _desc(layers, blocks, block_bytes)
    with LLMDataDist(LLMRole.DECODER, DECODE_ID) as datadist:
        datadist.init(_options(desc.num_tensors * desc.size + _POOL_SLACK, listen=True, secret=secret, transport=transport))
        cache = datadist.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(DECODE_ID, 0))
        for t in range(desc.num_tensors):
            cache.as_numpy(t)[:] = 0
        conn.send(("port", datadist.listen_port))
        block_table = conn.recv()  # sent once the prefill side's push has completed
        others = sorted(set(range(blocks)) - set(block_table))
        untouched = all(not cache.as_numpy(t)[others].any() for t in range(desc.num_tensors))
        conn.send(("checked", (_digest(cache, block_table), untouched)))
        conn.recv()


async def _prefill(
    port: int, layers: int, blocks: int, block_bytes: int, seed: int, secret: str, transport: str
) -> tuple[float, list[int], str, str]:
    desc = _desc(layers, blocks, block_bytes)
    with LLMDataDist(LLMRole.PROMPT, PREFILL_ID) as datadist:
        datadist.init(_options(desc.num_tensors * desc.size + _POOL_SLACK, listen=False, secret=secret, transport=transport))
        cache_manager = datadist.cache_manager
        cache = cache_manager.allocate_blocks_cache(desc)
        rng = np.random.default_rng(seed)
        for t in range(desc.num_tensors):
            cache.as_numpy(t)[:] = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = DECODE_ID
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", port)
        status, per_cluster = datadist.link_clusters([cluster], timeout=5000)
        if status is not LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link to the decode process failed: {per_cluster}")
        path = datadist.link_transport(DECODE_ID)
        used = blocks // 2
        src_blocks = sorted(rng.choice(blocks, size=used, replace=False).tolist())
        block_table = rng.permutation(blocks)[:used].tolist()
        start = time.perf_counter()
        await cache_manager.push_blocks_async(BlocksCacheKey(DECODE_ID, 0), cache, src_blocks, block_table)
        seconds = time.perf_counter() - start
        sent = _digest(cache, src_blocks)
        # On one host, who copied: this side under the decode's grant
        # (one-sided), or the decode side, the owner of the blocks.
        how = str(path)
        if how == "same_host" and datadist._engine.link_stats(DECODE_ID).get("one_sided_ops", 0) > 0:
            how = "same_host_one_sided"
        datadist.unlink_clusters([cluster])
        return seconds, block_table, sent, how


def _recv(conn: Connection, decode: Any, expected: str) -> Any:
    """The decode process's next message; its error, or its death, at once."""
    deadline = time.monotonic() + _TIMEOUT
    while not conn.poll(0.1):
        if not decode.is_alive():
            if conn.poll(0):
                break
            raise DemoError(f"the decode process exited with code {decode.exitcode} before sending its {expected}")
        if time.monotonic() > deadline:
            raise DemoError(f"the decode process did not send its {expected} within {_TIMEOUT:.0f} s")
    try:
        kind, value = conn.recv()
    except EOFError:
        raise DemoError(f"the decode process exited (code {decode.exitcode}) before sending its {expected}") from None
    if kind == "error":
        raise DemoError(f"the decode process failed: {value}")
    return value


_PATHS = {
    "same_host": "same host: one kernel copy by the decode side",
    "same_host_one_sided": "same host: one kernel copy by the prefill side, under the decode side's grant",
    "tcp": "TCP on loopback",
    "ucx": "UCX on loopback",
}


def run_demo(layers: int, blocks: int, block_bytes: int, seed: int, transport: str = "auto") -> int:
    """Runs the demo on `transport` (LLMConfig.transport: "auto", "tcp" or
    "ucx"); raises DemoError when it cannot run as asked."""
    check_arguments(layers, blocks, block_bytes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    secret = secrets.token_hex(16)
    decode = ctx.Process(target=_decode_main, args=(child, layers, blocks, block_bytes, secret, transport),
                        name="decode")
    decode.start()
    try:
        port = _recv(parent, decode, "listen port")
        seconds, block_table, sent, path = asyncio.run(
            _prefill(port, layers, blocks, block_bytes, seed, secret, transport)
        )
        parent.send(block_table)
        received, untouched = _recv(parent, decode, "check of the received bytes")
        parent.send(None)
    finally:
        decode.join(_TIMEOUT if decode.exitcode is None and not parent.closed else 5)
        if decode.is_alive():
            decode.kill()
            decode.join()
    moved = len(block_table) * block_bytes * 2 * layers
    print(
        f"prefill -> decode ({_PATHS.get(path, path)}, authenticated link): {layers} layers x (K, V), "
        f"{len(block_table)} blocks of "
        f"{block_bytes // 1024} KiB to a random block table, {moved / (1 << 20):.1f} MiB in "
        f"{seconds * 1e3:.1f} ms ({moved / seconds / 1e9:.2f} GB/s)"
    )
    if received != sent or not untouched:
        print("FAILED: the decode side " + ("received other bytes" if received != sent else "has stray writes"))
        return 1
    print("decode side: every byte verified, no other block touched")
    return 0

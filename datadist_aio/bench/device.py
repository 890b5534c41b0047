"""The device benchmark: ``python -m datadist_aio.bench --device``.

Two processes on one GPU, each engine with its caches in device memory:

- same host (transport "auto", CUDA IPC): ``push_blocks`` of a whole
  device cache into the peer's device cache, against a copy of the same
  bytes between two device buffers inside one process (torch ``copy_``,
  synchronised; the driver's ``cuMemcpyDtoD`` where torch is missing);
- TCP (transport "tcp", staged through pinned host buffers): the same push
  with device caches at both ends, against host caches at both ends.

Every figure is the best of its timed batches, and every batch is checked:
the source alternates between two patterns, and the target reads its cache
back after each push. The report says which driver ran (NVIDIA's or the
test stand-in, ``--driver``) and, from ``link_stats``, which path moved the
bytes of each measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from .arguments import byte_size, listed, positive
from .cuda_driver import DRIVER_ENV, CudaDriver, IpcHandle

OWNER, INITIATOR = 2, 1
TENSORS = 2  # one layer, K and V
GOALS = {"d2d_vs_copy": 0.8, "tcp_device_vs_host": 0.9}
# The links measured, in order: (name, LLMConfig.transport, LLMConfig.access).
# "auto" is the same-host link where the push's initiator opens the
# target's device memory from its grants and copies on its own streams (no
# frame); "owner" the same link with the target serving every frame (it
# opens the initiator's memory by CUDA IPC); "tcp" staged at both ends.
LINKS = [("auto", "auto", "one_sided"), ("owner", "auto", "owner"), ("tcp", "tcp", "owner")]
ANSWER_S = 300.0  # the longest one request to the target may take


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m datadist_aio.bench --device",
        description="Device-memory transfers between two processes on one GPU: push on the same-host link "
        "(one-sided, and served by the target) against a copy inside one process, and TCP with staging "
        "against host memory over TCP. Writes "
        "DIR/datadist_bench_device.json.")
    p.add_argument("--device", action="store_true", help="this benchmark (required)")
    p.add_argument("--quick", action="store_true", help="256 MiB per batch and 3 batches")
    p.add_argument("--output", type=Path, metavar="DIR", default=Path("bench-results"),
                   help="directory for the JSON (default: %(default)s)")
    p.add_argument("--cache-size", type=byte_size, metavar="SIZE", help="bytes moved per batch (default 1G; quick 256M)")
    p.add_argument("--block-sizes", type=listed(byte_size), metavar="SIZES",
                   help="block sizes per tensor (default 256K,4M,64M)")
    p.add_argument("--iterations", type=positive, help="timed batches per figure (default 7; quick 3)")
    p.add_argument("--device-id", type=int, default=0, help="the GPU (LLMConfig.device_id; default 0)")
    p.add_argument("--driver", metavar="PATH",
                   help=f"the CUDA driver library to load (default: ${DRIVER_ENV}, else libcuda.so.1); "
                   "the test stand-in (tests/cuda_standin) runs the whole benchmark without a GPU")
    return p


# -- both sides ----------------------------------------------------------------------------------------


def _engine(role: Any, cluster_id: int, transport: str, device_id: int, pool_bytes: int, listen: bool,
            access: str = "one_sided") -> Any:
    import datadist_aio as dd

    config = dd.LLMConfig()
    config.device_id = device_id
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = f'{{"memory_size": {pool_bytes}}}'
    config.transport = transport
    config.access = access
    config.sync_kv_timeout = 120000
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    datadist = dd.LLMDataDist(role, cluster_id)
    datadist.init(config.generate_options())
    return datadist


def patterns(seed: int, nbytes: int) -> list[np.ndarray]:
    """The two patterns a source alternates between, each ``TENSORS`` x ``nbytes // TENSORS``."""
    first = np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8).reshape(TENSORS, -1)
    return [first, first ^ np.uint8(0x5A)]


class Caches:
    """One process's blocks caches of one layout, by placement, with their bytes written and read back."""

    def __init__(self, datadist: Any, driver: CudaDriver, block: int, blocks: int, bind: bool) -> None:
        import datadist_aio as dd

        self.cm, self.driver = datadist.cache_manager, driver
        self.caches = {}
        for placement, model in (("device", 2), ("host", 1)):
            where = dd.Placement.DEVICE if placement == "device" else dd.Placement.HOST
            desc = dd.CacheDesc(TENSORS, [blocks, block], dd.DataType.DT_UINT8, where)
            self.caches[placement] = self.cm.allocate_blocks_cache(desc, dd.BlocksCacheKey(OWNER, model) if bind else None)
        self.scratch = np.empty(blocks * block, np.uint8)

    def write(self, placement: str, data: np.ndarray) -> None:
        cache = self.caches[placement]
        for t in range(TENSORS):
            if placement == "device":
                self.driver.write(cache.tensor_addrs[t], data[t])
            else:
                cache.as_numpy(t).reshape(-1)[:] = data[t]

    def holds(self, placement: str, data: np.ndarray) -> bool:
        cache = self.caches[placement]
        for t in range(TENSORS):
            if placement == "device":
                self.driver.read_into(cache.tensor_addrs[t], self.scratch)
                got = self.scratch
            else:
                got = cache.as_numpy(t).reshape(-1)
            if not np.array_equal(got, data[t]):
                return False
        return True

    def free(self) -> None:
        for cache in self.caches.values():
            self.cm.deallocate_blocks_cache(cache)


def target_main(conn: Any, env: dict[str, str], transport: str, access: str, device_id: int, pool_bytes: int) -> None:
    """The decode side: caches the initiator pushes into, checked when asked."""
    os.environ.update(env)
    try:
        driver = CudaDriver(device_id, env[DRIVER_ENV])
        datadist = _engine(_role("PROMPT"), OWNER, transport, device_id, pool_bytes, listen=True, access=access)
        conn.send(("ok", datadist.listen_port))
        caches: Optional[Caches] = None
        expected: list[np.ndarray] = []
        while True:
            command, *args = conn.recv()
            if command == "layout":
                block, blocks, seed = args
                if caches is not None:
                    caches.free()
                driver.current()
                caches = Caches(datadist, driver, block, blocks, bind=True)
                expected = patterns(seed, TENSORS * blocks * block)
                for placement in caches.caches:
                    caches.write(placement, expected[1] ^ np.uint8(0xFF))  # neither pattern
                conn.send(("ok", None))
            elif command == "holds":
                placement, which = args
                assert caches is not None
                conn.send(("ok", caches.holds(placement, expected[which])))
            elif command == "stats":
                conn.send(("ok", datadist._engine.link_stats(INITIATOR)))
            elif command == "ipc_copies":
                driver.current()
                conn.send(("ok", ipc_copies_main(driver, *args)))
            else:
                break
        if caches is not None:
            caches.free()
        datadist.finalize()
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the command
        conn.send(("error", traceback.format_exc()))


def _role(name: str) -> Any:
    import datadist_aio as dd

    return getattr(dd.LLMRole, name)


class Target:
    """The target process of one transport, as the command drives it."""

    def __init__(self, env: dict[str, str], transport: str, access: str, device_id: int, pool_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=target_main, args=(theirs, env, transport, access, device_id, pool_bytes),
                                   daemon=True)
        self.process.start()
        theirs.close()
        self.port = self.call()

    def call(self, *request: Any) -> Any:
        if request:
            self.conn.send(request)
        if not self.conn.poll(ANSWER_S):
            raise TimeoutError(f"the target did not answer {request[:1]} within {ANSWER_S:.0f} s")
        kind, value = self.conn.recv()
        if kind != "ok":
            raise RuntimeError(f"the target failed:\n{value}")
        return value

    def close(self) -> None:
        try:
            if self.process.is_alive():
                self.call("quit")
        finally:
            self.process.join(30)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)
            self.conn.close()


# -- measurements --------------------------------------------------------------------------------------


def _path(before: tuple[dict[str, int], dict[str, int]], after: tuple[dict[str, int], dict[str, int]]) -> tuple[str, dict[str, int]]:
    """What moved the bytes, from both ends' link_stats."""
    (mine0, theirs0), (mine1, theirs1) = before, after
    delta = {k: mine1[k] - mine0[k] for k in mine1} | {"target_" + k: theirs1[k] - theirs0[k] for k in theirs1}
    if delta["one_sided_device_bytes"] > 0 and delta["framed_ops"] == 0:
        path = "one_sided"
    elif delta["ipc_frames"] > 0 and delta["staged_frames"] == 0 and delta["ipc_fallbacks"] == 0:
        path = "cuda_ipc"
    elif delta["staged_frames"] > 0 or delta["target_staged_bytes_served"] > 0:
        path = "staged" if delta["ipc_frames"] == 0 else "cuda_ipc+staged"
    else:
        path = "host memory"
    return path, delta


def push_figures(datadist: Any, target: Target, caches: Caches, pats: list[np.ndarray], placement: str,
                 blocks: int, iterations: int) -> dict[str, Any]:
    """Pushes the whole ``placement`` cache into the target's one of the
    same placement: one batch untimed, then ``iterations`` timed, each
    checked at the target."""
    import datadist_aio as dd

    cm = datadist.cache_manager
    key = dd.BlocksCacheKey(OWNER, 2 if placement == "device" else 1)
    every = list(range(blocks))
    seconds: list[float] = []
    verified = True
    before = (datadist._engine.link_stats(OWNER), target.call("stats"))
    for batch in range(iterations + 1):
        which = batch % 2
        caches.write(placement, pats[which])
        started = time.perf_counter()
        cm.push_blocks(key, caches.caches[placement], every, every)
        took = time.perf_counter() - started
        verified = verified and bool(target.call("holds", placement, which))
        if batch:
            seconds.append(took)
    path, delta = _path(before, (datadist._engine.link_stats(OWNER), target.call("stats")))
    return {"seconds": seconds, "best_s": min(seconds), "path": path, "link_stats": delta, "verified": verified,
            "owner_frame_us": _owner_frame_us(delta)}


def _owner_frame_us(delta: dict[str, int]) -> Optional[dict[str, float]]:
    """Where the owner's time per device frame went (µs, the mean over the
    batches): serving up to its copies, the driver's calls queueing them,
    and from those to the stream's callback; None where no frame went by
    CUDA IPC."""
    frames = delta.get("target_device_frames_served", 0)
    if not frames:
        return None
    return {"frames": frames} | {part: delta.get(f"target_device_{part}_ns", 0) / frames / 1e3
                                 for part in ("serve", "enqueue", "land")}


def _holds(driver: CudaDriver, addrs: list[int], data: Any) -> bool:
    """Whether device buffers ``addrs`` hold the rows of ``data``, read back."""
    out = np.empty(data.shape[1], np.uint8)
    verified = True
    for addr, row in zip(addrs, data):
        driver.read_into(addr, out)
        verified = verified and bool(np.array_equal(out, row))
    return verified


def copy_baseline(driver: CudaDriver, nbytes: int, iterations: int, device_id: int) -> dict[str, Any]:
    """The same bytes copied between two device buffers of one process: torch
    ``copy_`` on the real driver when torch is there, else ``cuMemcpyDtoD``."""
    per = nbytes // TENSORS
    seconds: list[float] = []
    torch: Any = None
    if not driver.standin and importlib.util.find_spec("torch") is not None:
        torch = importlib.import_module("torch")
    if torch is not None and torch.cuda.is_available():
        device = torch.device("cuda", device_id)
        src = [torch.randint(0, 256, (per,), dtype=torch.uint8, device=device) for _ in range(TENSORS)]
        dst = [torch.empty_like(s) for s in src]
        for batch in range(iterations + 1):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            for d, s in zip(dst, src):
                d.copy_(s)
            torch.cuda.synchronize(device)
            if batch:
                seconds.append(time.perf_counter() - started)
        verified = all(bool(torch.equal(d, s)) for d, s in zip(dst, src))
        kind = f"torch {torch.__version__} Tensor.copy_, synchronised"
        del src, dst
        torch.cuda.empty_cache()
        driver.current()
    else:
        data = patterns(7, nbytes)[0]
        src = [driver.alloc(per) for _ in range(TENSORS)]
        dst = [driver.alloc(per) for _ in range(TENSORS)]
        try:
            for s, d in zip(src, data):
                driver.write(s, d)
            for batch in range(iterations + 1):
                driver.sync()
                started = time.perf_counter()
                for d_addr, s_addr in zip(dst, src):
                    driver.check(driver.lib.cuMemcpyDtoD_v2(d_addr, s_addr, per), "cuMemcpyDtoD")
                driver.sync()
                if batch:
                    seconds.append(time.perf_counter() - started)
            verified = _holds(driver, dst, data)
        finally:
            for addr in src + dst:
                driver.free(addr)
        kind = "cuMemcpyDtoD, synchronised"
    best = min(seconds)
    return {"kind": kind, "bytes": nbytes, "seconds": seconds, "best_s": best, "gbps": nbytes / best / 1e9,
            "verified": verified}


def _timed_copies(driver: CudaDriver, dst: list[int], src: list[int], per: int, iterations: int,
                  streams: int) -> list[float]:
    """Seconds of each timed batch (one untimed first): ``src[i]`` copied to
    ``dst[i]`` with cuMemcpyDtoDAsync in pieces of the wire's 64 MiB frame
    spread over ``streams`` streams, then every stream synchronised."""
    lib, piece = driver.lib, 64 << 20
    handles = []
    seconds: list[float] = []
    try:
        for _ in range(streams):
            stream = ctypes.c_void_p()
            driver.check(lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
            handles.append(stream)
        pieces = [(d + off, s + off, min(piece, per - off)) for d, s in zip(dst, src) for off in range(0, per, piece)]
        for batch in range(iterations + 1):
            driver.sync()
            started = time.perf_counter()
            for i, (d, s, n) in enumerate(pieces):
                driver.check(lib.cuMemcpyDtoDAsync_v2(d, s, n, handles[i % streams]), "cuMemcpyDtoDAsync")
            for stream in handles:
                driver.check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
            if batch:
                seconds.append(time.perf_counter() - started)
    finally:
        for stream in handles:
            lib.cuStreamDestroy_v2(stream)
    return seconds


def _copy_row(kind: str, streams: int, nbytes: int, seconds: list[float], verified: bool) -> dict[str, Any]:
    best = min(seconds)
    return {"kind": f"{kind} on {streams} stream{'s' if streams > 1 else ''}", "streams": streams, "bytes": nbytes,
            "seconds": seconds, "best_s": best, "gbps": nbytes / best / 1e9, "verified": verified}


@contextlib.contextmanager
def _patterned(driver: CudaDriver, nbytes: int) -> Iterator[tuple[list[int], np.ndarray]]:
    """One device buffer per tensor holding its share of ``patterns(9,
    nbytes)``: (addresses, their bytes, one row per tensor); freed after."""
    per = nbytes // TENSORS
    data = patterns(9, nbytes)[0]
    src = [driver.alloc(per) for _ in range(TENSORS)]
    try:
        for s, d in zip(src, data):
            driver.write(s, d)
        yield src, data
    finally:
        for addr in src:
            driver.free(addr)


def driver_copy(driver: CudaDriver, nbytes: int, iterations: int, streams: int) -> dict[str, Any]:
    """The copies a push's owner makes, without the link: the same bytes
    between two device buffers of one process. Tells the driver's copy
    apart from what the link adds."""
    per = nbytes // TENSORS
    with _patterned(driver, nbytes) as (src, data):
        dst = [driver.alloc(per) for _ in range(TENSORS)]
        try:
            seconds = _timed_copies(driver, dst, src, per, iterations, streams)
            verified = _holds(driver, dst, data)
        finally:
            for addr in dst:
                driver.free(addr)
    return _copy_row("cuMemcpyDtoDAsync in 64 MiB pieces", streams, nbytes, seconds, verified)


def ipc_copies_main(driver: CudaDriver, handles: list[bytes], nbytes: int, iterations: int,
                    streams: list[int]) -> list[dict[str, Any]]:
    """The target's side of ``ipc_copy``: opens the other process's buffers
    by their CUDA IPC handles, as a push's owner does, and copies them into
    its own memory; each row checked."""
    lib, per = driver.lib, nbytes // TENSORS
    data = patterns(9, nbytes)[0]
    opened: list[int] = []
    dst = [driver.alloc(per) for _ in range(TENSORS)]
    rows = []
    try:
        for raw in handles:
            handle, ptr = IpcHandle(), ctypes.c_ulonglong()
            ctypes.memmove(ctypes.addressof(handle), raw, ctypes.sizeof(handle))
            driver.check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, 1), "cuIpcOpenMemHandle")
            opened.append(ptr.value)
        for n in streams:
            for d in dst:  # so that what is checked after was copied by this row
                driver.check(lib.cuMemsetD8_v2(d, 0, per), "cuMemsetD8")
            seconds = _timed_copies(driver, dst, opened, per, iterations, n)
            rows.append(_copy_row("cuMemcpyDtoDAsync from memory opened by CUDA IPC, in 64 MiB pieces", n, nbytes,
                                  seconds, _holds(driver, dst, data)))
    finally:
        for base in opened:
            lib.cuIpcCloseMemHandle(base)
        for addr in dst:
            driver.free(addr)
    return rows


def ipc_copy(driver: CudaDriver, target: "Target", nbytes: int, iterations: int, streams: list[int]) -> list[dict[str, Any]]:
    """The owner's copies as a push makes them, still without the link: the
    target copies this process's buffers, opened by CUDA IPC, into its own
    memory. Set beside driver_copy, it tells whether memory of another
    process copies slower than one's own."""
    lib = driver.lib
    with _patterned(driver, nbytes) as (src, _data):
        handles = []
        for s in src:
            handle = IpcHandle()
            driver.check(lib.cuIpcGetMemHandle(ctypes.byref(handle), s), "cuIpcGetMemHandle")
            handles.append(ctypes.string_at(ctypes.addressof(handle), ctypes.sizeof(handle)))
        return target.call("ipc_copies", handles, nbytes, iterations, streams)


def _gbps(row: dict[str, Any], nbytes: int) -> dict[str, Any]:
    row["gbps"] = nbytes / row["best_s"] / 1e9
    return row


def _note(text: str) -> None:
    print(f"[device bench] {text}", file=sys.stderr, flush=True)


def workload(args: argparse.Namespace) -> tuple[int, list[int], int]:
    """Bytes per batch, block sizes and timed batches, from the options and their defaults."""
    cache_bytes = args.cache_size or ((256 if args.quick else 1024) << 20)
    sizes = args.block_sizes or [256 << 10, 4 << 20, 64 << 20]
    return cache_bytes, sizes, args.iterations or (3 if args.quick else 7)


def measure(args: argparse.Namespace, driver_path: str, argv: list[str]) -> dict[str, Any]:
    import datadist_aio as dd

    cache_bytes, sizes, iterations = workload(args)
    env = {DRIVER_ENV: driver_path}
    os.environ.update(env)
    driver = CudaDriver(args.device_id, driver_path)
    pool = cache_bytes + (64 << 20)
    report: dict[str, Any] = {
        "command": ["python", "-m", "datadist_aio.bench", *argv],
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "datadist_aio": dd.__version__ if hasattr(dd, "__version__") else None,
        "driver": driver.describe(),
        "workload": {"cache_bytes": cache_bytes, "tensors": TENSORS, "block_sizes": sizes, "iterations": iterations,
                     "device_id": args.device_id},
        "goals": GOALS,
        "errors": [],
        "results": [],
    }
    described = report["driver"]
    _note(f"driver: {described['what']} ({driver_path}, version {described['version']}, {described['device']})")
    _note("baseline: a copy of the same bytes inside one process")
    report["baseline"] = copy_baseline(driver, cache_bytes, iterations, args.device_id)
    _note("the driver's own copies of those bytes, as a push's owner makes them (no link)")
    report["driver_copies"] = [driver_copy(driver, cache_bytes, iterations, n) for n in (1, 16)]
    rows: dict[int, dict[str, Any]] = {size: {"block_size": size} for size in sizes}
    for name, transport, access in LINKS:
        _note(f"link {name}: starting the target")
        target = Target(env, transport, access, args.device_id, pool)
        datadist = _engine(_role("DECODER"), INITIATOR, transport, args.device_id, pool, listen=False, access=access)
        try:
            status, statuses = datadist.link_clusters([_cluster(target.port)], 10000)
            if status != dd.LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"link to the target failed: {status} {statuses}")
            link = datadist.link_transport(OWNER)
            if name == "owner":
                _note("the owner's copies from memory opened by CUDA IPC (no link)")
                driver.current()
                report["driver_copies"] += ipc_copy(driver, target, cache_bytes, iterations, [1, 16])
            for seed, size in enumerate(sizes, 1):
                blocks = cache_bytes // (TENSORS * size)
                driver.current()
                target.call("layout", size, blocks, seed)
                if access == "one_sided":
                    _granted(datadist, 2)  # the target's host and device caches
                caches = Caches(datadist, driver, size, blocks, bind=False)
                pats = patterns(seed, cache_bytes)
                try:
                    row = rows[size]
                    if transport == "auto":
                        _note(f"{_size(size)} blocks: device to device over the {link} link, access {access}")
                        d2d = _gbps(push_figures(datadist, target, caches, pats, "device", blocks, iterations), cache_bytes)
                        d2d["link"] = link
                        suffix = "" if access == "one_sided" else "_owner"
                        row["d2d" + suffix] = d2d
                        row[f"ratio_d2d{suffix}_copy"] = d2d["gbps"] / report["baseline"]["gbps"]
                    else:
                        _note(f"{_size(size)} blocks: device and host caches over TCP")
                        dev = _gbps(push_figures(datadist, target, caches, pats, "device", blocks, iterations), cache_bytes)
                        host = _gbps(push_figures(datadist, target, caches, pats, "host", blocks, iterations), cache_bytes)
                        dev["link"] = host["link"] = link
                        row["tcp_device"], row["tcp_host"] = dev, host
                        row["ratio_tcp_device_host"] = dev["gbps"] / host["gbps"]
                finally:
                    caches.free()
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on to the report
            report["errors"].append(f"link {name}: {exc!r}")
            traceback.print_exc()
        finally:
            datadist.finalize()
            try:
                target.close()
            except Exception as exc:  # noqa: BLE001
                report["errors"].append(f"target of link {name}: {exc!r}")
    report["results"] = list(rows.values())
    return report


def _granted(datadist: Any, count: int) -> None:
    """Until the initiator holds ``count`` grants of the target's caches."""
    deadline = time.monotonic() + ANSWER_S
    while datadist._engine.link_stats(OWNER)["grants_held"] < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the target granted fewer than {count} caches within {ANSWER_S:.0f} s")
        time.sleep(0.01)


def _cluster(port: int) -> Any:
    import datadist_aio as dd

    info = dd.LLMClusterInfo()
    info.remote_cluster_id = OWNER
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    return info


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def verified(report: dict[str, Any]) -> bool:
    rows = [r.get(k) for r in report["results"] for k in ("d2d", "d2d_owner", "tcp_device", "tcp_host")]
    copies = report.get("driver_copies", [])
    return (report.get("baseline", {}).get("verified", False) and all(c["verified"] for c in copies)
            and all(r is not None and r["verified"] for r in rows))


def table(report: dict[str, Any]) -> str:
    work, base, drv = report["workload"], report.get("baseline"), report["driver"]
    lines = [f"driver: {drv['what']} ({drv['library']}, version {drv['version']}, {drv['device']})",
             f"{work['cache_bytes'] >> 20} MiB per batch, {work['tensors']} tensors, best of {work['iterations']} "
             "batches, every batch checked"]
    if base:
        lines.append(f"copy inside one process ({base['kind']}): {base['gbps']:.2f} GB/s")
    for copies in report.get("driver_copies", []):
        lines.append(f"  the owner's copies without the link ({copies['kind']}): {copies['gbps']:.2f} GB/s"
                     f"{'' if copies['verified'] else ' NOT VERIFIED'}")
    lines += ["", f"{'block':>8}  {'d2d push GB/s':>13} {'/copy':>6} {'path':>9}  {'owner-served':>12} {'/copy':>6}   "
              f"{'tcp device GB/s':>15} {'tcp host GB/s':>13} {'dev/host':>8} {'path':>7}  verified"]

    def cell(row: Optional[dict[str, Any]], width: int) -> str:
        return f"{row['gbps']:>{width}.2f}" if row else f"{'-':>{width}}"

    for r in report["results"]:
        d2d, served, dev, host = r.get("d2d"), r.get("d2d_owner"), r.get("tcp_device"), r.get("tcp_host")
        ok = all(x is not None and x["verified"] for x in (d2d, served, dev, host))
        lines.append(
            f"{_size(r['block_size']):>8}  {cell(d2d, 13)} {r.get('ratio_d2d_copy', float('nan')):>5.2f}x "
            f"{(d2d or {}).get('path', '-'):>9}  {cell(served, 12)} {r.get('ratio_d2d_owner_copy', float('nan')):>5.2f}x   "
            f"{cell(dev, 15)} {cell(host, 13)} "
            f"{r.get('ratio_tcp_device_host', float('nan')):>7.2f}x {(dev or {}).get('path', '-'):>7}  {'yes' if ok else 'NO'}")
    for r in report["results"]:
        frame = (r.get("d2d_owner") or {}).get("owner_frame_us")
        if frame:
            lines.append(f"{_size(r['block_size']):>8}  d2d owner per frame: {frame['serve']:.1f} us serving, "
                         f"{frame['enqueue']:.1f} us queueing copies, {frame['land']:.1f} us until the callback "
                         f"({frame['frames']} frames)")
    lines.append(f"goals: d2d push >= {GOALS['d2d_vs_copy']}x the copy; TCP device >= {GOALS['tcp_device_vs_host']}x "
                 "TCP host")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    cache_bytes, sizes, _ = workload(args)
    for size in sizes:
        if cache_bytes % (TENSORS * size):
            p.error(f"--cache-size {cache_bytes} is not a whole number of {TENSORS} x {size}-byte blocks")
    driver_path = args.driver or os.environ.get(DRIVER_ENV) or "libcuda.so.1"
    try:
        ctypes.CDLL(driver_path)
    except OSError as exc:
        print(f"error: the CUDA driver could not be loaded from {driver_path}: {exc}", file=sys.stderr)
        return 1
    report = measure(args, driver_path, argv)
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / "datadist_bench_device.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    for error in report["errors"]:
        print(f"error: {error}")
    print(f"\nwrote {path}")
    return 0 if verified(report) and not report["errors"] else 1

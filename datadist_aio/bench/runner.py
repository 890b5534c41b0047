"""One benchmark run: the plans, the sessions that carry them out, the baselines
and the report."""

from __future__ import annotations

import datetime
import importlib.metadata
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .engines.base import LAYERWISE, PULL, PUSH, UCX_TLS, label
from .layout import Layout
from .loops import available_loops
from .progress import Progress
from .session import LATENCY_LAYOUT, Plan, Result, engine_module, initiator_main

COMPARED = ("mooncake", "nixl")
NIXL_VARIANTS: list[dict[str, Any]] = [{"tls": tls, "progress_thread": thread} for tls in ("default", "tcp") for thread in (True, False)]
DISTRIBUTIONS = ("datadist_aio", "numpy", "uvloop", "mooncake-transfer-engine-non-cuda",
                 "mooncake-transfer-engine", "nixl", "nixl-cu12", "nixl-cu13", "matplotlib")


@dataclass
class Options:
    cache_bytes: int = 256 << 20
    block_sizes: list[int] = field(default_factory=lambda: [16 << 10, 256 << 10, 4 << 20])
    layers: int = 4
    ops: list[str] = field(default_factory=lambda: [PUSH, PULL, LAYERWISE])
    loops: list[str] = field(default_factory=lambda: ["asyncio", "uvloop"])
    iterations: int = 7
    latency_ops: int = 2000
    idle_seconds: float = 2.0
    streams: list[int] = field(default_factory=lambda: [1, 2, 4])
    connections: Optional[int] = None
    transports: list[str] = field(default_factory=lambda: ["auto", "tcp"])
    compare: list[str] = field(default_factory=list)  # of COMPARED
    ucx_tls: list[str] = field(default_factory=list)  # of UCX_TLS: the UCX comparison instead of the rest
    timeout: float = 300.0
    seed: int = 0


def ucx_variants(tls: str, loop: str = "asyncio") -> dict[str, dict[str, Any]]:
    """The two sides of the UCX comparison on the UCX transports ``tls``
    names: this library on transport "ucx", NIXL's UCX backend, neither with
    a progress thread."""
    return {"datadist_aio": {"loop": loop, "transport": "ucx", "ucx_tls": tls},
            "nixl": {"tls": tls, "progress_thread": False, "target_progress_thread": False}}


def plans(options: Options) -> list[Plan]:
    """Baselines first, then this library on each loop, then the other engines;
    with ``ucx_tls``, the baselines and the UCX comparison only."""
    layouts = [Layout.for_cache(options.cache_bytes, size, options.layers, options.seed) for size in options.block_sizes]
    uneven = [n for n in options.streams if options.cache_bytes % n]
    if uneven:
        raise ValueError(f"the cache size must split evenly over {uneven[0]} raw TCP streams")
    unknown = [tls for tls in options.ucx_tls if tls not in UCX_TLS]
    if unknown:
        raise ValueError(f"ucx tls must be of {', '.join(UCX_TLS)}, not {unknown[0]!r}")
    whole = Layout(1, 1, options.cache_bytes, options.seed)
    out = [Plan("raw_tcp", {"streams": n}, [whole], [PUSH], options.iterations,
                options.latency_ops if n == 1 else 0) for n in options.streams]
    if options.latency_ops:  # latency only: the round trip without thread wake-ups, and over a Unix socket
        out.append(Plan("raw_tcp", {"streams": 1, "busy_poll": True}, [], [], 0, options.latency_ops))
        out.append(Plan("raw_tcp", {"streams": 1, "unix": True}, [], [], 0, options.latency_ops))
    if options.ucx_tls:
        for tls in options.ucx_tls:
            out += [Plan("datadist_aio", ucx_variants(tls, loop)["datadist_aio"], layouts, options.ops,
                         options.iterations, options.latency_ops, options.idle_seconds) for loop in options.loops]
            out.append(Plan("nixl", ucx_variants(tls)["nixl"], layouts, options.ops, options.iterations,
                            options.latency_ops, options.idle_seconds))
        return out
    for loop in options.loops:
        for transport in options.transports:
            variant: dict[str, Any] = {"loop": loop}
            if transport != "auto":  # "auto" is the library's default
                variant["transport"] = transport
            if options.connections is not None:
                variant["connections"] = options.connections
            out.append(Plan("datadist_aio", variant, layouts, options.ops, options.iterations, options.latency_ops,
                            options.idle_seconds))
    if "mooncake" in options.compare:
        out.append(Plan("mooncake", {}, layouts, options.ops, options.iterations, options.latency_ops,
                        options.idle_seconds))
    if "nixl" in options.compare:
        out += [Plan("nixl", v, layouts, options.ops, options.iterations, options.latency_ops, options.idle_seconds)
                for v in NIXL_VARIANTS]
    return out


def steps(plan: Plan) -> int:
    """Progress steps of a plan: a tick per batch, one for the latency run, one for the idle reading."""
    supported = engine_module(plan.engine).Initiator.ops
    ops = sum(1 for op in plan.ops if op in supported)
    return len(plan.layouts) * ops * (plan.iterations + 1) + bool(plan.latency_ops) + bool(plan.idle_seconds)


@dataclass
class Outcome:
    results: list[Result] = field(default_factory=list)
    latency: list[dict[str, Any]] = field(default_factory=list)
    idle: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)


def run_plan(plan: Plan, address: Any, authkey: bytes, progress: Progress, timeout: float, outcome: Outcome) -> None:
    """Carry out one plan in a fresh initiator process; what it reports goes into ``outcome``."""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=initiator_main, args=(writer, address, authkey, plan))
    process.start()
    writer.close()
    expected = steps(plan)
    ticks = 0
    finished = False
    try:
        while not finished:
            if not reader.poll(timeout):
                outcome.errors.append({"label": plan.label, "error": f"no progress within {timeout:.0f} s"})
                break
            try:
                kind, value = reader.recv()
            except EOFError:
                outcome.errors.append({"label": plan.label,
                                       "error": f"the initiator process died (exit code {process.exitcode})"})
                break
            if kind == "tick":
                ticks += value
                progress.advance(value)
            elif kind == "phase":
                progress.set_phase(value)
            elif kind == "result":
                outcome.results.append(value)
                if not value.verified:
                    progress.note(f"{plan.label}: {value.op} {value.block_size} B: the bytes that arrived are WRONG")
            elif kind == "latency":
                outcome.latency.append(value)
            elif kind == "idle":
                outcome.idle.append(value)
                progress.advance()
                ticks += 1
            elif kind == "unavailable":
                outcome.skipped.append({"label": plan.label, "reason": value})
                progress.note(f"skipped {plan.label}: {value}")
                finished = True
            elif kind == "error":
                outcome.errors.append({"label": plan.label, "error": value})
                progress.note(f"{plan.label} failed:\n{value}")
                finished = True
            elif kind == "done":
                finished = True
    finally:
        reader.close()
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join(5)
        process.close()
        progress.advance(expected - ticks)


def memcpy_baseline(nbytes: int, iterations: int) -> dict[str, Any]:
    """Single-threaded memcpy (numpy.copyto of contiguous bytes), median GB/s; checks the copy."""
    src = np.frombuffer(np.random.default_rng(1).bytes(nbytes), dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    seconds = []
    for i in range(iterations + 1):
        start = time.perf_counter()
        np.copyto(dst, src)
        if i:
            seconds.append(time.perf_counter() - start)
    if not np.array_equal(src, dst):
        raise RuntimeError("memcpy baseline: the copy differs")
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / statistics.median(seconds) / 1e9}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
            info["memory_gib"] = round(kib / (1 << 20), 1)
    except (OSError, StopIteration, ValueError):
        pass
    return info


def versions() -> dict[str, str]:
    out = {}
    for name in DISTRIBUTIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def build_report(options: Options, outcome: Outcome, memcpy: dict[str, Any], peer: str, argv: list[str]) -> dict[str, Any]:
    raw = [r for r in outcome.results if r.engine == "raw_tcp"]
    best_raw = max((r.gbps for r in raw), default=None)
    results = []
    for r in outcome.results:
        row = r.to_json()
        row["ratio_raw_tcp"] = row["gbps"] / best_raw if best_raw else None
        row["ratio_memcpy"] = row["gbps"] / memcpy["gbps"]
        results.append(row)
    def raw_median(busy_poll: bool, unix: bool = False) -> Optional[float]:
        found = next((lat for lat in outcome.latency if lat["engine"] == "raw_tcp"
                      and bool(lat["variant"].get("busy_poll", False)) is busy_poll
                      and bool(lat["variant"].get("unix", False)) is unix), None)
        return statistics.median(found["seconds"]) if found else None

    blocking, busy, unix = raw_median(False), raw_median(True), raw_median(False, unix=True)
    latency = []
    for lat in outcome.latency:
        ordered = sorted(lat["seconds"])
        median = statistics.median(ordered)
        row = {
            "engine": lat["engine"], "variant": lat["variant"], "label": lat["label"], "verified": lat["verified"],
            "ops": len(ordered), "median_us": median * 1e6, "p90_us": percentile(ordered, 0.9) * 1e6,
            "p99_us": percentile(ordered, 0.99) * 1e6, "ratio_raw_tcp": median / blocking if blocking else None,
            "ratio_busy_poll": median / busy if busy else None,
            "ratio_raw_unix": median / unix if unix else None,
            "samples_us": [s * 1e6 for s in lat["seconds"]],
        }
        costs = lat.get("costs")
        if costs:  # both processes together, per operation
            ops = len(ordered)
            row["voluntary_switches_per_op"] = costs["voluntary_switches"] / ops
            row["involuntary_switches_per_op"] = costs["involuntary_switches"] / ops
            row["cpu_us_per_op"] = costs["cpu_seconds"] / ops * 1e6
        if lat.get("switches"):  # each process on its own, every thread, per operation
            row["wakeups_per_op"] = {side: n / len(ordered) for side, n in lat["switches"].items()}
        if lat.get("submit_seconds"):
            row["submit_median_us"] = statistics.median(lat["submit_seconds"]) * 1e6
        if lat.get("submit_parts"):
            row["submit_parts_us"] = lat["submit_parts"]
        if lat.get("threads"):  # where the time goes: per write, by side and thread name
            ops = len(ordered)
            row["threads_per_op"] = {
                side: {name: {"cpu_us": t["cpu_ns"] / ops / 1e3, "switches": t["switches"] / ops, "threads": t["threads"]}
                       for name, t in sorted(named.items()) if t["cpu_ns"] >= 100 * ops or t["switches"] >= ops // 100}
                for side, named in lat["threads"].items()}
        latency.append(row)
    report = {
        "schema": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": argv,
        "machine": machine(),
        "versions": versions(),
        "workload": {
            "cache_bytes": options.cache_bytes, "layers": options.layers, "tensors": 2 * options.layers,
            "block_sizes": options.block_sizes, "ops": options.ops, "iterations": options.iterations,
            "latency_ops": options.latency_ops, "idle_seconds": options.idle_seconds, "latency_bytes": LATENCY_LAYOUT.total_bytes,
            "destination_table": "random permutation", "peer": peer,
        },
        "baselines": {
            "memcpy": memcpy,
            "raw_tcp": [{"streams": r.variant["streams"], "gbps": r.gbps} for r in raw],
            "raw_tcp_best_gbps": best_raw,
        },
        "results": results,
        "latency": latency,
        "idle_cpu": outcome.idle,
        "skipped": outcome.skipped,
        "errors": outcome.errors,
    }
    if options.ucx_tls:
        from .._native import ucx_available

        report["ucx_comparison"] = ucx_comparison(options, report)
        report["ucx_ours"] = ucx_available()[1]  # the UCX this library loaded (DATADIST_AIO_UCX_LIB_DIR picks one)
    return report


def ucx_comparison(options: Options, report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per UCX transport setting: whether each side ran (or why not), the
    GB/s of each per operation and block size with the ratio ours / NIXL,
    and each side's 4 KiB latency with the wake-ups of each process."""
    out = []
    for tls in options.ucx_tls:
        entry: dict[str, Any] = {"tls": tls, "ucx_tls": UCX_TLS[tls], "engines": {}, "throughput": [], "latency": {}}
        for loop in options.loops:
            labels = {engine: label(engine, variant) for engine, variant in ucx_variants(tls, loop).items()}
            for engine, name in labels.items():
                if name in entry["engines"]:
                    continue
                skipped = next((s["reason"] for s in report["skipped"] if s["label"] == name), None)
                failed = next((e["error"] for e in report["errors"] if e["label"] == name), None)
                rows = [r for r in report["results"] if r["label"] == name]
                entry["engines"][name] = {
                    "engine": engine,
                    "ran": skipped is None and failed is None,
                    "reason": skipped or (failed.strip().splitlines()[-1] if failed else None),
                    "verified": bool(rows) and all(r["verified"] for r in rows),
                }
                lat = next((r for r in report["latency"] if r["label"] == name), None)
                if lat is not None:
                    entry["latency"][name] = {"median_us": lat["median_us"], "p99_us": lat["p99_us"],
                                              "verified": lat["verified"], "wakeups_per_op": lat.get("wakeups_per_op")}
            ours, theirs = labels["datadist_aio"], labels["nixl"]
            for op in options.ops:
                for size in options.block_sizes:
                    cells = {name: next((r for r in report["results"]
                                         if (r["label"], r["op"], r["block_size"]) == (name, op, size)), None)
                             for name in (ours, theirs)}
                    if not any(cells.values()):
                        continue
                    mine, other = (row["gbps"] if row is not None else None for row in (cells[ours], cells[theirs]))
                    entry["throughput"].append({
                        "op": op, "block_size": size, "ours": ours, "theirs": theirs,
                        "ours_gbps": mine, "theirs_gbps": other,
                        "ratio": mine / other if mine and other else None,
                        "verified": all(row["verified"] for row in cells.values() if row)})
        out.append(entry)
    return out


__all__ = ["Options", "Outcome", "available_loops", "build_report", "label", "memcpy_baseline", "plans", "run_plan",
           "ucx_variants"]

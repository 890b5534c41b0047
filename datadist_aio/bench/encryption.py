"""The cost of link encryption: ``python -m datadist_aio.bench --encryption``.

Two processes on loopback, linked over TCP (transport "tcp", the library's
default connections and I/O threads), each run plain and then with
``link_encryption = "tls"``, alternating, in the same run:

- push and pull throughput of a blocks cache of 4 MiB blocks (K and V);
- the awaited push of one 4 KiB block, one at a time;
- OpenSSL's own AES-128-GCM speed on this machine (``openssl speed -evp
  aes-128-gcm`` on 16 KiB records, one core), for the ceiling the I/O
  threads could reach: every byte is encrypted once and decrypted once, on
  the cores the two processes' I/O threads share here;
- the CPU time both processes spend per GB pushed (user and system, read
  around each push), so the bytes moved per core-second can be set against
  what OpenSSL encrypts and decrypts per core-second.

Every pushed batch is checked on the target (a digest of its cache), and
every pulled one here. The figures of each variant are given as the range
over its rounds (each round's figure is the best of its batches).
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
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .arguments import byte_size, positive

OWNER, INITIATOR = 2, 1
BULK_MODEL, SMALL_MODEL = 1, 2
TENSORS = 2  # one layer, K and V
BLOCK = 4 << 20
SMALL_BLOCK = 4096
SMALL_BLOCKS = 16
GOALS = {"throughput_vs_plain": 0.6, "throughput_vs_openssl": 0.8, "small_push_vs_plain": 1.3}
ANSWER_S = 300.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m datadist_aio.bench --encryption",
        description="Link encryption against plain links on loopback, in the same run: push and pull throughput "
        "(4 MiB blocks), an awaited 4 KiB push, and openssl speed for AES-128-GCM. Writes "
        "DIR/datadist_bench_encryption.json.")
    p.add_argument("--encryption", action="store_true", help="this benchmark (required)")
    p.add_argument("--quick", action="store_true", help="64 MiB per batch, 2 rounds of 3 batches, 200 small pushes")
    p.add_argument("--output", type=Path, metavar="DIR", default=Path("bench-results"),
                   help="directory for the JSON (default: %(default)s)")
    p.add_argument("--cache-size", type=byte_size, metavar="SIZE", help="bytes moved per batch (default 256M)")
    p.add_argument("--rounds", type=positive, help="rounds of each variant, alternating (default 3; quick 2)")
    p.add_argument("--iterations", type=positive, help="timed batches per figure of a round (default 5; quick 3)")
    p.add_argument("--small-ops", type=positive, help="awaited 4 KiB pushes per round (default 1000; quick 200)")
    return p


def _config(variant: str, secret: str, pool_bytes: int, listen: bool) -> Any:
    import datadist_aio as dd

    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = f'{{"memory_size": {pool_bytes}}}'
    config.transport = "tcp"
    config.sync_kv_timeout = 60000  # a whole batch is one operation
    config.auth_key = secret
    config.link_encryption = variant
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config


def _descs(cache_bytes: int) -> tuple[Any, Any]:
    import datadist_aio as dd

    bulk = dd.CacheDesc(TENSORS, [cache_bytes // TENSORS // BLOCK, BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)
    small = dd.CacheDesc(1, [SMALL_BLOCKS, SMALL_BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)
    return bulk, small


def _digest(cache: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in range(cache.cache_desc.num_tensors):
        h.update(cache.as_numpy(t).data)
    return h.hexdigest()


def target_main(conn: Any, variant: str, secret: str, cache_bytes: int) -> None:
    """The decode side: listens, holds the caches, answers digests."""
    import datadist_aio as dd

    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, OWNER)
    try:
        datadist.init(_config(variant, secret, cache_bytes + (32 << 20), True).generate_options())
        bulk, small = _descs(cache_bytes)
        cm = datadist.cache_manager
        cache = cm.allocate_blocks_cache(bulk, dd.BlocksCacheKey(OWNER, BULK_MODEL))
        cm.allocate_blocks_cache(small, dd.BlocksCacheKey(OWNER, SMALL_MODEL))
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
        datadist.finalize()
        conn.close()


def _cpu_seconds(pid: int) -> float:
    """User and system time of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Target:
    """The decode side of the encryption benchmark, in a process of its own."""

    def __init__(self, variant: str, secret: str, cache_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        conn, theirs = ctx.Pipe()
        self.conn: Any = conn
        self.process: Any = ctx.Process(target=target_main, args=(theirs, variant, secret, cache_bytes), daemon=True)
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


def one_round(variant: str, cache_bytes: int, iterations: int, small_ops: int) -> dict[str, Any]:
    """Push, pull and the awaited small push of one variant, in fresh processes."""
    import datadist_aio as dd

    secret = secrets.token_hex(32)
    target = Target(variant, secret, cache_bytes)
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, INITIATOR)
    try:
        datadist.init(_config(variant, secret, cache_bytes + (32 << 20), False).generate_options())
        info = dd.LLMClusterInfo()
        info.remote_cluster_id = OWNER
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", target.port)
        status, _ = datadist.link_clusters([info], 10000)
        if status is not dd.LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link failed: {status}")
        path = datadist.link_transport(OWNER)
        bulk, small = _descs(cache_bytes)
        cm = datadist.cache_manager
        cache = cm.allocate_blocks_cache(bulk)
        small_cache = cm.allocate_blocks_cache(small)
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
            cpu = time.process_time() + _cpu_seconds(pid)
            start = time.perf_counter()
            cm.push_blocks(remote, cache, blocks, blocks)
            push_s.append(time.perf_counter() - start)
            push_cpu.append(time.process_time() + _cpu_seconds(pid) - cpu)
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
            "variant": variant,
            "path": str(path),
            "encrypted": path.encrypted,
            "cipher": path.cipher,
            "kernel_tls": path.kernel_tls,
            "connections": stats.get("connections"),
            "push_gbps": cache_bytes / min(push_s) / 1e9,
            "push_cpu_s_per_gb": min(push_cpu) / (cache_bytes / 1e9),
            "pull_gbps": cache_bytes / min(pull_s) / 1e9,
            "small_push_us_median": statistics.median(small_s) * 1e6,
            "small_push_us_p99": sorted(small_s)[int(0.99 * (len(small_s) - 1))] * 1e6,
            "verified": verified,
        }
    finally:
        datadist.finalize()
        target.close()


def openssl_speed() -> Optional[dict[str, Any]]:
    """AES-128-GCM on 16 KiB buffers, one core, as `openssl speed` measures it; None without the tool."""
    tool = shutil.which("openssl")
    if tool is None:
        return None
    try:
        out = subprocess.run([tool, "speed", "-evp", "aes-128-gcm", "-seconds", "2", "-bytes", "16384"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^AES-128-GCM\s+([0-9.]+)k\s*$", out, re.MULTILINE | re.IGNORECASE)
    if not match:
        return None
    version = subprocess.run([tool, "version"], capture_output=True, text=True, check=False).stdout.strip()
    return {"gbps_one_core": float(match.group(1)) * 1000 / 1e9, "version": version}


def _span(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values)}


def summarise(rounds: list[dict[str, Any]], speed: Optional[dict[str, Any]]) -> dict[str, Any]:
    by = {v: [r for r in rounds if r["variant"] == v] for v in ("off", "tls")}
    out: dict[str, Any] = {}
    for v, rows in by.items():
        out[v] = {k: _span([r[k] for r in rows])
                  for k in ("push_gbps", "pull_gbps", "small_push_us_median", "push_cpu_s_per_gb")}
    ratios = {
        "push_tls_vs_plain": [t["push_gbps"] / p["push_gbps"] for p, t in zip(by["off"], by["tls"])],
        "pull_tls_vs_plain": [t["pull_gbps"] / p["pull_gbps"] for p, t in zip(by["off"], by["tls"])],
        "small_push_tls_vs_plain": [t["small_push_us_median"] / p["small_push_us_median"]
                                    for p, t in zip(by["off"], by["tls"])],
    }
    out["ratios"] = {k: _span(v) for k, v in ratios.items()}
    cores = os.cpu_count() or 1
    if speed:
        # Each byte is encrypted once (sender) and decrypted once (receiver),
        # on the cores both processes' I/O threads share on this host.
        ceiling = speed["gbps_one_core"] * cores / 2
        out["openssl_ceiling_gbps"] = ceiling
        out["ratios"]["tls_vs_openssl_ceiling"] = _span(
            [min(t["push_gbps"], t["pull_gbps"]) / ceiling for t in by["tls"]])
        # Bytes pushed per core-second of both processes, against what OpenSSL
        # encrypts and decrypts per core-second (two passes over each byte).
        out["ratios"]["tls_per_core_vs_openssl"] = _span(
            [(1 / t["push_cpu_s_per_gb"]) / (speed["gbps_one_core"] / 2) for t in by["tls"]])
    return out


def table(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [f"{report['workload']['cache_bytes'] >> 20} MiB per batch of 4 MiB blocks, K and V; transport tcp on "
             f"loopback, {report['workload']['connections']} connections, {report['cores']} cores; ranges over "
             f"{report['workload']['rounds']} rounds (each the best of {report['workload']['iterations']} batches)"]
    for v, name in (("off", "plain"), ("tls", "tls")):
        f = s[v]
        lines.append(f"{name:>6}: push {f['push_gbps']['min']:.2f}-{f['push_gbps']['max']:.2f} GB/s, "
                     f"pull {f['pull_gbps']['min']:.2f}-{f['pull_gbps']['max']:.2f} GB/s, awaited 4 KiB push "
                     f"{f['small_push_us_median']['min']:.0f}-{f['small_push_us_median']['max']:.0f} us (median); "
                     f"push CPU {f['push_cpu_s_per_gb']['min']:.2f}-{f['push_cpu_s_per_gb']['max']:.2f} s/GB "
                     "(both processes)")
    r = s["ratios"]
    lines.append(f"  tls/plain: push {r['push_tls_vs_plain']['min']:.2f}-{r['push_tls_vs_plain']['max']:.2f}x, "
                 f"pull {r['pull_tls_vs_plain']['min']:.2f}-{r['pull_tls_vs_plain']['max']:.2f}x, 4 KiB push "
                 f"{r['small_push_tls_vs_plain']['min']:.2f}-{r['small_push_tls_vs_plain']['max']:.2f}x")
    if report.get("openssl"):
        lines.append(f"openssl speed -evp aes-128-gcm (16 KiB): {report['openssl']['gbps_one_core']:.2f} GB/s on one "
                     f"core; ceiling for {report['cores']} cores encrypting and decrypting: "
                     f"{s['openssl_ceiling_gbps']:.2f} GB/s; tls reaches "
                     f"{r['tls_vs_openssl_ceiling']['min']:.2f}-{r['tls_vs_openssl_ceiling']['max']:.2f}x of it; per "
                     f"core-second used, {r['tls_per_core_vs_openssl']['min']:.2f}-"
                     f"{r['tls_per_core_vs_openssl']['max']:.2f}x of what OpenSSL encrypts and decrypts")
    tls = [x for x in report["rounds"] if x["variant"] == "tls"]
    if tls:
        lines.append(f"cipher {tls[0]['cipher']}, kernel TLS {'yes' if tls[0]['kernel_tls'] else 'no'}; "
                     f"every batch checked: {'yes' if all(x['verified'] for x in report['rounds']) else 'NO'}")
    lines.append(f"goals: throughput >= {GOALS['throughput_vs_plain']}x plain and >= "
                 f"{GOALS['throughput_vs_openssl']}x the openssl ceiling; 4 KiB push <= {GOALS['small_push_vs_plain']}x plain")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    cache_bytes = args.cache_size or ((64 << 20) if args.quick else (256 << 20))
    if cache_bytes % (TENSORS * BLOCK):
        parser().error(f"--cache-size must be a multiple of {TENSORS * BLOCK >> 20} MiB")
    rounds = args.rounds or (2 if args.quick else 3)
    iterations = args.iterations or (3 if args.quick else 5)
    small_ops = args.small_ops or (200 if args.quick else 1000)
    results = []
    for r in range(rounds):
        for variant in ("off", "tls"):
            row = one_round(variant, cache_bytes, iterations, small_ops)
            row["round"] = r
            results.append(row)
            print(f"round {r + 1}/{rounds} {variant}: push {row['push_gbps']:.2f} GB/s, pull {row['pull_gbps']:.2f} "
                  f"GB/s, 4 KiB push {row['small_push_us_median']:.0f} us", file=sys.stderr)
    speed = openssl_speed()
    report = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "workload": {"cache_bytes": cache_bytes, "block_bytes": BLOCK, "tensors": TENSORS, "rounds": rounds,
                     "iterations": iterations, "small_ops": small_ops,
                     "connections": results[0]["connections"]},
        "openssl": speed,
        "rounds": results,
        "summary": summarise(results, speed),
        "goals": GOALS,
    }
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / "datadist_bench_encryption.json"
    path.write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"wrote {path}")
    return 0 if all(x["verified"] for x in results) else 1

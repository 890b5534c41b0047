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
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Optional


from . import pair
from .pair import span as _span

GOALS = {"throughput_vs_plain": 0.6, "throughput_vs_openssl": 0.8, "small_push_vs_plain": 1.3}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m datadist_aio.bench --encryption",
        description="Link encryption against plain links on loopback, in the same run: push and pull throughput "
        "(4 MiB blocks), an awaited 4 KiB push, and openssl speed for AES-128-GCM. Writes "
        "DIR/datadist_bench_encryption.json.")
    p.add_argument("--encryption", action="store_true", help="this benchmark (required)")
    pair.add_workload_arguments(p)
    return p


def one_round(variant: str, cache_bytes: int, iterations: int, small_ops: int) -> dict[str, Any]:
    """Push, pull and the awaited small push of one variant over TCP, in fresh processes."""
    row = pair.one_round({"transport": "tcp", "link_encryption": variant}, cache_bytes, iterations, small_ops)
    return {"variant": variant, **row}


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
    work = pair.workload(args, parser())
    results = []
    for r in range(work.rounds):
        for variant in ("off", "tls"):
            row = one_round(variant, work.cache_bytes, work.iterations, work.small_ops)
            row["round"] = r
            results.append(row)
            print(f"round {r + 1}/{work.rounds} {variant}: push {row['push_gbps']:.2f} GB/s, pull "
                  f"{row['pull_gbps']:.2f} GB/s, 4 KiB push {row['small_push_us_median']:.0f} us", file=sys.stderr)
    speed = openssl_speed()
    report = pair.report(work, {"connections": results[0]["connections"]}, openssl=speed, rounds=results,
                         summary=summarise(results, speed), goals=GOALS)
    pair.write(args.output, "datadist_bench_encryption.json", report, table(report))
    return 0 if all(x["verified"] for x in results) else 1

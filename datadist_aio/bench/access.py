"""Who moves the bytes on one host: ``python -m datadist_aio.bench --access``.

Two processes on loopback linked on the same-host path (transport "auto"),
or with ``--transport ucx`` by UCX (one-sided: the initiator's own gets and
puts on an endpoint that reaches the target's memory by itself, from UCX
1.14 on; owner-served: the target's UCX moves them), each round in fresh
processes, alternating, in the same run:

- ``owner``: the owner of the memory (the target) moves every operation's
  bytes, as its frame arrives (``LLMConfig.access = "owner"``);
- ``one_sided``: the target grants its caches once and this process moves
  the bytes itself (``"one_sided"``, the default);

each with the target's host quiet, and busy: as many spinning processes as
there are cores beside it (the owner's threads then wait for a core, as on a
host whose cores serve a model). Per round (``pair.one_round``): push and
pull throughput of 4 MiB blocks, the CPU time both processes spend per GB
pushed, and the awaited push of one 4 KiB block, one at a time (median, 99th
percentile, largest). Every batch is checked at the other end.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from . import pair
from .pair import span

VARIANTS = ("owner", "one_sided")
LOADS = ("quiet", "busy")
FIGURES = ("push_gbps", "pull_gbps", "push_cpu_s_per_gb", "small_push_us_median", "small_push_us_p99",
           "small_push_us_max")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m datadist_aio.bench --access",
        description="One-sided access against owner-served transfers on one host, in the same run, with the "
        "owner's host quiet and busy: push and pull throughput (4 MiB blocks) and an awaited 4 KiB push. Writes "
        "DIR/datadist_bench_access.json.")
    p.add_argument("--access", action="store_true", help="this benchmark (required)")
    pair.add_workload_arguments(p)
    p.add_argument("--transport", choices=["auto", "ucx"], default="auto",
                   help="auto: the same-host path; ucx: transport ucx at both ends (default: %(default)s)")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 1,
                   help="spinning processes beside the owner when busy (default: the cores, %(default)s)")
    return p


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for load in LOADS:
        rows = {v: [r for r in rounds if r["variant"] == v and r["load"] == load] for v in VARIANTS}
        if not all(rows.values()):
            continue
        out[load] = {v: {k: span([r[k] for r in rows[v]]) for k in FIGURES} for v in VARIANTS}
        pairs = list(zip(rows["owner"], rows["one_sided"]))
        out[load]["one_sided_vs_owner"] = {
            k: span([o[k] / w[k] for w, o in pairs]) for k in ("push_gbps", "pull_gbps", "small_push_us_median",
                                                               "small_push_us_p99")}
    return out


def table(report: dict[str, Any]) -> str:
    w = report["workload"]
    path = "UCX" if w.get("transport") == "ucx" else "same-host path"
    lines = [f"{w['cache_bytes'] >> 20} MiB per batch of 4 MiB blocks, K and V; {path} on loopback, "
             f"{report['cores']} cores, busy = {w['busy']} spinning processes beside the owner; ranges over "
             f"{w['rounds']} rounds (each the best of {w['iterations']} batches, {w['small_ops']} small pushes)"]
    for load, by in report["summary"].items():
        for v in VARIANTS:
            f = by[v]
            lines.append(f"{load:>5} {v:>9}: push {f['push_gbps']['min']:.2f}-{f['push_gbps']['max']:.2f} GB/s, pull "
                         f"{f['pull_gbps']['min']:.2f}-{f['pull_gbps']['max']:.2f} GB/s, 4 KiB push median "
                         f"{f['small_push_us_median']['min']:.0f}-{f['small_push_us_median']['max']:.0f} us, p99 "
                         f"{f['small_push_us_p99']['min']:.0f}-{f['small_push_us_p99']['max']:.0f} us, largest "
                         f"{f['small_push_us_max']['min']:.0f}-{f['small_push_us_max']['max']:.0f} us")
        r = by["one_sided_vs_owner"]
        lines.append(f"{load:>5} one_sided/owner: push {r['push_gbps']['min']:.2f}-{r['push_gbps']['max']:.2f}x, "
                     f"pull {r['pull_gbps']['min']:.2f}-{r['pull_gbps']['max']:.2f}x, 4 KiB push median "
                     f"{r['small_push_us_median']['min']:.2f}-{r['small_push_us_median']['max']:.2f}x, p99 "
                     f"{r['small_push_us_p99']['min']:.2f}-{r['small_push_us_p99']['max']:.2f}x")
    lines.append(f"every batch checked: {'yes' if all(x['verified'] for x in report['rounds']) else 'NO'}; "
                 f"one-sided rounds moved by frames: {sum(x['framed_ops'] for x in report['rounds'] if x['variant'] == 'one_sided')}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    work = pair.workload(args, parser())
    results = []
    for r in range(work.rounds):
        for load in LOADS:
            for variant in VARIANTS:
                row = pair.one_round({"transport": args.transport, "access": variant}, work.cache_bytes, work.iterations,
                                     work.small_ops, busy=args.busy if load == "busy" else 0)
                row.update(variant=variant, load=load, round=r)
                results.append(row)
                print(f"round {r + 1}/{work.rounds} {load} {variant}: push {row['push_gbps']:.2f} GB/s, pull "
                      f"{row['pull_gbps']:.2f} GB/s, 4 KiB push {row['small_push_us_median']:.0f} us "
                      f"(p99 {row['small_push_us_p99']:.0f})", file=sys.stderr)
    report = pair.report(work, {"busy": args.busy, "transport": args.transport}, rounds=results,
                         summary=summarise(results))
    pair.write(args.output, "datadist_bench_access.json", report, table(report))
    expected = "ucx" if args.transport == "ucx" else "same_host"
    ok = all(x["verified"] and x["path"] == expected for x in results)
    ok = ok and all(x["framed_ops"] == 0 for x in results if x["variant"] == "one_sided")
    return 0 if ok else 1

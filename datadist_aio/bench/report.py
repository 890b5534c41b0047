"""The report of a run as text tables and as a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .session import size_text


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return f"{'-':>22}"
    mark = "" if row["verified"] else "!"
    tcp = f"{row['ratio_raw_tcp']:.2f}" if row["ratio_raw_tcp"] is not None else "-"
    return f"{row['gbps']:>7.2f}{mark:1} {tcp:>5} {row['ratio_memcpy']:>6.2f}"


def tables(report: dict[str, Any]) -> str:
    """Throughput per engine, operation and block size (GB/s, then its ratio to the
    best raw TCP and to memcpy), then the latency of one 4 KiB write."""
    base = report["baselines"]
    work = report["workload"]
    lines = [
        f"{work['cache_bytes'] >> 20} MiB cache, {work['tensors']} tensors, random destination table, "
        f"median of {work['iterations']} batches; peer {work['peer']}",
        f"memcpy {base['memcpy']['gbps']:.2f} GB/s; raw TCP "
        + ", ".join(f"{r['streams']} stream{'s' if r['streams'] > 1 else ''} {r['gbps']:.2f}" for r in base["raw_tcp"])
        + " GB/s",
        "",
    ]
    rows = [r for r in report["results"] if r["engine"] != "raw_tcp"]
    sizes = work["block_sizes"]
    keys = list(dict.fromkeys((r["label"], r["op"]) for r in rows))
    width = max([len(k[0]) for k in keys] + [6])
    head = f"{'engine':<{width}} {'op':<9}" + "".join(f" {size_text(s) + ': GB/s  tcp×  mem×':>22}" for s in sizes)
    lines.append(head)
    for name, op in keys:
        cells = [next((r for r in rows if (r["label"], r["op"], r["block_size"]) == (name, op, s)), None) for s in sizes]
        lines.append(f"{name:<{width}} {op:<9}" + "".join(f" {_cell(c)}" for c in cells))
    if report["latency"]:
        lines += ["", f"one {work['latency_bytes'] >> 10} KiB write, waited for, {report['latency'][0]['ops']} in a row (µs)"]
        width = max(len(lat["label"]) for lat in report["latency"])
        lines.append(f"{'engine':<{width}} {'median':>8} {'p90':>8} {'p99':>8} {'/raw':>6} {'/busy':>6} "
                     f"{'/unix':>6} {'vcsw/op':>8} {'cpu/op':>7} {'submit':>7}")

        def number(value: Any, digits: int) -> str:
            return f"{value:.{digits}f}" if value is not None else "-"

        for lat in report["latency"]:
            mark = "" if lat["verified"] else "  WRONG BYTES"
            lines.append(f"{lat['label']:<{width}} {lat['median_us']:>8.1f} {lat['p90_us']:>8.1f} "
                         f"{lat['p99_us']:>8.1f} {number(lat['ratio_raw_tcp'], 2):>6} "
                         f"{number(lat.get('ratio_busy_poll'), 2):>6} "
                         f"{number(lat.get('ratio_raw_unix'), 2):>6} "
                         f"{number(lat.get('voluntary_switches_per_op'), 2):>8} "
                         f"{number(lat.get('cpu_us_per_op'), 1):>7} {number(lat.get('submit_median_us'), 1):>7}{mark}")
        lines.append("/raw: to the blocking raw TCP round trip; /busy: to the busy-polling one; /unix: to the "
                     "blocking round trip over a Unix socket; vcsw/op: voluntary "
                     "context switches per write, both processes; cpu/op: µs of CPU per write, both processes; "
                     "submit: µs of the call before the await")
        for lat in report["latency"]:
            by_thread = lat.get("threads_per_op")
            if by_thread and lat["engine"] == "datadist_aio":
                sides = "; ".join(side + " " + ", ".join(f"{name} {t['cpu_us']:.1f} µs {t['switches']:.2f} sw"
                                                           for name, t in named.items())
                                  for side, named in by_thread.items())
                lines.append(f"{lat['label']}: per write, by thread (CPU, voluntary switches): {sides}")
        for lat in report["latency"]:
            parts = lat.get("submit_parts_us")
            if parts:
                lines.append(f"{lat['label']}: submit, timed apart: argument checks {parts['checks_us']:.1f} µs, "
                             f"task creation {parts['task_us']:.1f} µs, engine submit {parts['native_submit_us']:.1f} µs")
    if report["idle_cpu"]:
        lines += ["", f"CPU while connected and idle for {report['idle_cpu'][0]['seconds']:g} s (% of one core)"]
        width = max(len(idle["label"]) for idle in report["idle_cpu"])
        lines.append(f"{'engine':<{width}} {'initiator':>10} {'target':>8}")
        for idle in report["idle_cpu"]:
            lines.append(f"{idle['label']:<{width}} {idle['initiator_percent']:>10.2f} {idle['target_percent']:>8.2f}")
    if "ucx_comparison" in report:
        lines += ["", ucx_table(report["ucx_comparison"])]
        if "ucx_ours" in report:
            lines.append(f"this library's UCX: {report['ucx_ours']}")
    for skipped in report["skipped"]:
        lines.append(f"skipped {skipped['label']}: {skipped['reason']}")
    for error in report["errors"]:
        lines.append(f"FAILED {error['label']}: {error['error'].strip().splitlines()[-1]}")
    return "\n".join(lines)


def ucx_table(comparison: list[dict[str, Any]]) -> str:
    """The UCX comparison: per UCX_TLS, this library's GB/s against NIXL's and
    their ratio, then each side's 4 KiB latency and wake-ups per write."""

    def number(value: Any, digits: int) -> str:
        return f"{value:.{digits}f}" if value is not None else "-"

    lines = ["UCX: this library (transport ucx) against NIXL's UCX backend, no progress thread on either"]
    for entry in comparison:
        lines.append(f"UCX_TLS={entry['ucx_tls']} ({entry['tls']})")
        for name, state in entry["engines"].items():
            if not state["ran"]:
                lines.append(f"  not run: {name}: {state['reason']}")
        for row in entry["throughput"]:
            mark = "" if row["verified"] else "  WRONG BYTES"
            lines.append(f"  {row['op']:<9} {size_text(row['block_size']):>7}: ours {number(row['ours_gbps'], 2):>6} "
                         f"GB/s, NIXL {number(row['theirs_gbps'], 2):>6} GB/s, ours/NIXL {number(row['ratio'], 2):>5}{mark}")
        for name, lat in entry["latency"].items():
            wakeups = lat["wakeups_per_op"] or {}
            lines.append(f"  {name}: 4 KiB write {lat['median_us']:.1f} µs median, {lat['p99_us']:.1f} p99; "
                         f"wake-ups per write: initiator {number(wakeups.get('initiator'), 2)}, "
                         f"target {number(wakeups.get('target'), 2)}" + ("" if lat["verified"] else "  WRONG BYTES"))
    lines.append("wake-ups: context switches (voluntary and involuntary) of all of a process's threads over the "
                 "latency run, per write")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """GB/s against block size, one panel for writes (push and layer-wise) and
    one for reads (pull), one line per engine, the baselines as horizontal
    lines; then the latency distribution of each engine. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = [r for r in report["results"] if r["engine"] != "raw_tcp"]
    names = list(dict.fromkeys([r["label"] for r in rows] + [lat["label"] for lat in report["latency"]]))
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 6.2), gridspec_kw={"width_ratios": [1, 1, 1]})
    base = report["baselines"]
    sizes = report["workload"]["block_sizes"]
    ceiling = max([base["memcpy"]["gbps"]] + [r["gbps"] for r in rows]) * 1.08
    for ax, title, ops in ((axes[0], "push (write)", {"push": "-", "layerwise": ":"}), (axes[1], "pull (read)", {"pull": "-"})):
        for name in names:
            for op, style in ops.items():
                points = sorted((r["block_size"], r["gbps"]) for r in rows if (r["label"], r["op"]) == (name, op))
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", color=colors[name])
        if base["raw_tcp_best_gbps"]:
            ax.axhline(base["raw_tcp_best_gbps"], color="black", linewidth=1.2)
        ax.axhline(base["memcpy"]["gbps"], color="gray", linewidth=1.2, linestyle="-.")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [size_text(s) for s in sizes])
        ax.set_xlabel("block size")
        ax.set_ylabel("GB/s (median batch)")
        ax.set_ylim(0, ceiling)
        ax.set_title(f"{title}, {report['workload']['cache_bytes'] >> 20} MiB per batch, random blocks", fontsize=10)
        ax.grid(True, alpha=0.3)
    latency = axes[2]
    for lat in report["latency"]:
        ordered = sorted(lat["samples_us"])
        fraction = [(i + 1) / len(ordered) for i in range(len(ordered))]
        color = "black" if lat["engine"] == "raw_tcp" else colors[lat["label"]]
        busy = bool(lat["variant"].get("busy_poll", False))
        latency.plot(ordered, fraction, color=color, linestyle="--" if busy else "-")
    latency.set_xscale("log")
    latency.set_xlabel("µs per 4 KiB write, waited for")
    latency.set_ylabel("fraction of writes")
    latency.set_title("latency distribution", fontsize=10)
    latency.grid(True, alpha=0.3)
    handles = [Line2D([], [], color=colors[name], marker="o", label=name) for name in names if name in colors
               and not name.startswith("raw_tcp")]
    handles += [Line2D([], [], color="black", label="raw TCP (best stream count; 1 stream for latency)"),
                Line2D([], [], color="black", linestyle="--", label="raw TCP round trip, busy-polling"),
                Line2D([], [], color="gray", linestyle="-.", label="memcpy, 1 thread"),
                Line2D([], [], color="gray", linestyle=":", label="layer-wise transfer_cache_async")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    cpu = report["machine"].get("cpu") or report["machine"]["platform"]
    fig.suptitle(f"datadist_aio.bench, {report['created']}: {report['machine']['usable_cpus']} CPUs, {cpu}, "
                 f"peer {report['workload']['peer']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.05 + 0.03 * ((len(handles) + 3) // 4), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)

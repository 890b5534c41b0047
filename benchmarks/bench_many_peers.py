"""One decode process, N prefill processes: what each link costs as N grows.

    python benchmarks/bench_many_peers.py [--quick] [--peers 8,32,96,192]
        [--paths same_host,tcp] [--rounds 3] [--idle 3] [--output FILE]

The decode process (cluster 0) listens; the N prefill processes (clusters
1..N) link to it all at once, each timing its ``link_clusters``. Then, with
every link up and nothing moving, the decode process's CPU time over
``--idle`` seconds is read from /proc/self/task/*/schedstat while its event
loop sleeps.
Then every prefill pushes its blocks into its own part of the decode's
blocks cache from the same moment on (``push_blocks_async`` on an asyncio
loop, a common start time on CLOCK_MONOTONIC), ``--rounds`` times with other
bytes each round, the decode checking every byte after each round.

Paths: ``same_host`` (every process on this host, transport "auto": kernel
copies on Unix sockets) and ``tcp`` (the prefills in one network namespace,
each in a PID namespace of its own, the decode on this side of a veth pair:
tests/support/netns.py; the same-host proof fails and the links run over TCP as
between hosts; needs root, ``ip`` and ``unshare``). Both ends' paths are
checked.

Per N and path: link time (median, max), the connections this network
namespace (where the decode listens) dropped meanwhile because an accept
queue was full (TcpExt ListenOverflows, machine-wide within the namespace),
threads, RSS and descriptors of the
decode process and of the prefills (median, max), the decode's idle CPU, the
aggregate push throughput (a round's bytes over the time from the common
start to the last prefill's completion; best and median round) and the
slowest prefill's completion (median round). A run that fails to start, link
or push some prefills says so (``failures``) instead of stopping. JSON on
stdout's last line and in ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import resource
import statistics
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

import datadist_aio as dd
from datadist_aio.bench.engines.datadist import options

MiB = 1 << 20
DECODE = 0
BLOCKS = 16  # per prefill, 2 tensors of BLOCKS blocks: 1 MiB a prefill
BLOCK_BYTES = 32 * 1024
LINK_TIMEOUT_MS = 60000
PATHS = ("same_host", "tcp")


def desc(blocks: int) -> dd.CacheDesc:
    return dd.CacheDesc(2, [blocks, BLOCK_BYTES], dd.DataType.DT_UINT8, dd.Placement.HOST)


def payload(cluster_id: int, round_: int, tensor: int) -> np.ndarray:
    """The bytes prefill ``cluster_id`` pushes from ``tensor`` in ``round_``."""
    rng = np.random.default_rng([cluster_id, round_, tensor])
    return np.frombuffer(rng.bytes(BLOCKS * BLOCK_BYTES), dtype=np.uint8).reshape(BLOCKS, BLOCK_BYTES)


def process_stats() -> dict[str, int]:
    """Threads, resident memory and open descriptors of this process."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            fields[name] = value.split()[0] if value.split() else ""
    return {
        "threads": int(fields["Threads"]),
        "rss_kib": int(fields["VmRSS"]),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def listen_overflows() -> int:
    """TcpExt ListenOverflows of this network namespace: connections dropped
    because a listening socket's accept queue was full."""
    with open("/proc/net/netstat") as netstat:
        lines = [line.split() for line in netstat if line.startswith("TcpExt:")]
    return int(dict(zip(lines[0], lines[1]))["ListenOverflows"])


def _on_cpu_ns(tid: int) -> int:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as schedstat:
            return int(schedstat.read().split()[0])
    except FileNotFoundError:  # the thread has exited
        return 0


def cpu_seconds(reading_last: bool) -> float:
    """Time on a CPU of every thread of this process, from
    /proc/self/task/*/schedstat (nanoseconds). The calling thread is read last
    (``reading_last``) or first, so that reading the others is not counted
    between two calls."""
    me = threading.get_native_id()
    mine = 0 if reading_last else _on_cpu_ns(me)
    others = sum(_on_cpu_ns(int(tid)) for tid in os.listdir("/proc/self/task") if int(tid) != me)
    if reading_last:
        mine = _on_cpu_ns(me)
    return (mine + others) / 1e9


# -- the children -----------------------------------------------------------------------


def _serve(conn: multiprocessing.connection.Connection, handlers: dict[str, Any]) -> None:
    while True:
        try:
            command, *args = conn.recv()
        except EOFError:
            return
        try:
            answer = ("ok", handlers[command](*args))
        except BaseException as exc:  # noqa: BLE001 - said to the orchestrator
            answer = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(answer)
        if command == "close":
            return


def decode_main(conn: multiprocessing.connection.Connection) -> None:
    params = conn.recv()
    peers, host, transport = params["peers"], params["host"], params["transport"]
    datadist = dd.LLMDataDist(dd.LLMRole.DECODER, DECODE)
    datadist.init(options(2 * peers * BLOCKS * BLOCK_BYTES + 8 * MiB, host, 30000, transport=transport))
    cm = datadist.cache_manager
    cache = cm.allocate_blocks_cache(desc(peers * BLOCKS), dd.BlocksCacheKey(DECODE, 0))
    loop = asyncio.new_event_loop()

    def paths(clusters: list[int]) -> dict[str, int]:
        counted: dict[str, int] = {}
        for cluster in clusters:
            try:
                path = datadist.link_transport(cluster)
            except dd.LLMException as exc:
                path = exc.status_code.name
            counted[path] = counted.get(path, 0) + 1
        return counted

    def idle(seconds: float) -> float:
        before = cpu_seconds(reading_last=True)
        loop.run_until_complete(asyncio.sleep(seconds))
        return cpu_seconds(reading_last=False) - before

    def verify(round_: int, clusters: list[int]) -> list[int]:
        """The clusters whose blocks did not arrive exactly."""
        wrong = []
        for cluster in clusters:
            first = (cluster - 1) * BLOCKS
            for t in range(2):
                if not np.array_equal(cache.as_numpy(t)[first : first + BLOCKS], payload(cluster, round_, t)):
                    wrong.append(cluster)
                    break
        return wrong

    def close() -> None:
        datadist.finalize()
        loop.close()

    conn.send(("ok", datadist.listen_port))
    _serve(conn, {"stats": process_stats, "paths": paths, "idle": idle, "verify": verify, "close": close})


def prefill_main(conn: multiprocessing.connection.Connection) -> None:
    params = conn.recv()
    cluster, transport = params["cluster"], params["transport"]
    try:
        datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, cluster)
        datadist.init(options(4 * MiB, None, 30000, transport=transport))
        cm = datadist.cache_manager
        cache = cm.allocate_blocks_cache(desc(BLOCKS))
    except BaseException as exc:  # noqa: BLE001
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    loop = asyncio.new_event_loop()

    def link(host: str, port: int, local: str) -> tuple[str, float, str]:
        info = dd.LLMClusterInfo()
        info.remote_cluster_id = DECODE
        info.append_local_ip_info(local, 0)
        info.append_remote_ip_info(host, port)
        started = time.monotonic()
        _, (status,) = datadist.link_clusters([info], LINK_TIMEOUT_MS)
        took = time.monotonic() - started
        path = datadist.link_transport(DECODE) if status is dd.LLMStatusCode.LLM_SUCCESS else ""
        return status.name, took, path

    async def push_at(start: float) -> tuple[float, float]:
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        began = time.monotonic()
        first = (cluster - 1) * BLOCKS
        await cm.push_blocks_async(
            dd.BlocksCacheKey(DECODE, 0), cache, list(range(BLOCKS)), list(range(first, first + BLOCKS))
        )
        return began, time.monotonic()

    def push(round_: int, start: float) -> tuple[float, float]:
        for t in range(2):
            cache.as_numpy(t)[:] = payload(cluster, round_, t)
        return loop.run_until_complete(push_at(start))

    def close() -> None:
        datadist.finalize()
        loop.close()

    conn.send(("ok", None))
    _serve(conn, {"link": link, "stats": process_stats, "push": push, "close": close})


# -- the orchestrator --------------------------------------------------------------------


class Fleet:
    """The decode process and the prefills of one run; ``close`` ends every one of them."""

    def __init__(self, path: str, subnet: Any) -> None:
        self.path = path
        self.subnet = subnet
        self.ctx = multiprocessing.get_context("spawn")
        self.processes: list[tuple[str, Any]] = []
        self.prefills: dict[int, multiprocessing.connection.Connection] = {}
        self.failures: dict[str, list[str]] = {}

    def fail(self, stage: str, cluster: int, why: str) -> None:
        self.failures.setdefault(stage, []).append(f"cluster {cluster}: {why}")
        conn = self.prefills.pop(cluster, None)
        if conn is not None:
            conn.close()

    def start_decode(self, peers: int, host: str, transport: str) -> int:
        ours, theirs = self.ctx.Pipe()
        process = self.ctx.Process(target=decode_main, args=(theirs,), daemon=True)
        process.start()
        theirs.close()
        self.processes.append(("decode", process))
        self.decode = ours
        ours.send({"peers": peers, "host": host, "transport": transport})
        return self.ask_decode(None, 120)

    def ask_decode(self, message: Optional[tuple[Any, ...]], timeout: float) -> Any:
        if message is not None:
            self.decode.send(message)
        if not self.decode.poll(timeout):
            raise TimeoutError(f"the decode process gave no answer to {message} in {timeout:g} s")
        status, value = self.decode.recv()
        if status != "ok":
            raise RuntimeError(f"the decode process: {value}")
        return value

    def start_prefills(self, clusters: range, transport: str, timeout: float) -> None:
        here = os.path.abspath(__file__)
        for cluster in clusters:
            try:
                if self.path == "tcp":
                    from support.netns import spawn_in

                    process, conn = spawn_in(self.subnet, [here, "prefill"])
                else:
                    conn, theirs = self.ctx.Pipe()
                    process = self.ctx.Process(target=prefill_main, args=(theirs,), daemon=True)
                    process.start()
                    theirs.close()
            except OSError as exc:
                self.failures.setdefault("start", []).append(f"cluster {cluster}: {exc}")
                continue
            self.processes.append((f"cluster {cluster}", process))
            self.prefills[cluster] = conn
            conn.send({"cluster": cluster, "transport": transport})
        self.gather("start", None, timeout)

    def gather(self, stage: str, message: Optional[tuple[Any, ...]], timeout: float) -> dict[int, Any]:
        """Sends ``message`` to every prefill (none if None), then waits for every
        answer until ``timeout`` s from now; a prefill that errs, dies or stays
        silent is noted in ``failures`` and dropped."""
        if message is not None:
            for cluster, conn in list(self.prefills.items()):
                try:
                    conn.send(message)
                except OSError as exc:
                    self.fail(stage, cluster, f"{type(exc).__name__}: {exc}")
        waiting = {conn: cluster for cluster, conn in self.prefills.items()}
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while waiting:
            ready = multiprocessing.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for cluster in list(waiting.values()):
                    self.fail(stage, cluster, f"no answer in {timeout:g} s")
                break
            for conn in ready:
                cluster = waiting.pop(conn)  # type: ignore[call-overload]
                try:
                    status, value = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self.fail(stage, cluster, "the process exited")
                    continue
                if status == "ok":
                    answers[cluster] = value
                else:
                    self.fail(stage, cluster, value)
        return answers

    def close(self) -> None:
        try:
            if self.prefills:
                self.gather("close", ("close",), 60)
            self.ask_decode(("close",), 60)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        for name, process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(10)
            if process.exitcode != 0:  # a negative code: the signal that ended it (SIGABRT: -6)
                self.failures.setdefault("exit", []).append(f"{name}: exit code {process.exitcode}")
            process.close()
        for conn in [*self.prefills.values(), self.decode]:
            conn.close()


def spread(values: list[float]) -> dict[str, Optional[float]]:
    if not values:
        return {"median": None, "max": None}
    return {"median": statistics.median(values), "max": max(values)}


def run(path: str, peers: int, rounds: int, idle_s: float, subnet: Any) -> dict[str, Any]:
    host, local = (subnet.host_ip, subnet.peer_ip) if path == "tcp" else ("127.0.0.1", "127.0.0.1")
    transport = "auto"
    fleet = Fleet(path, subnet)
    result: dict[str, Any] = {"path": path, "peers": peers}
    try:
        started = time.monotonic()
        port = fleet.start_decode(peers, host, transport)
        fleet.start_prefills(range(1, peers + 1), transport, 60 + peers * 2.0)
        result["started"] = len(fleet.prefills)
        result["start_s"] = time.monotonic() - started

        overflows = listen_overflows()
        linked = fleet.gather("link", ("link", host, port, local), LINK_TIMEOUT_MS / 1000 + 30)
        result["listen_overflows"] = listen_overflows() - overflows
        for cluster, (status, _, link_path) in linked.items():
            if status != "LLM_SUCCESS":
                fleet.fail("link", cluster, status)
            elif link_path != path:
                fleet.fail("link", cluster, f"linked on {link_path}, not {path}")
        link_times = [took for cluster, (_, took, _) in linked.items() if cluster in fleet.prefills]
        result["linked"] = len(fleet.prefills)
        result["link_s"] = spread(link_times)
        time.sleep(0.5)  # the accepting end learns a link's path from its first frame
        result["decode_paths"] = fleet.ask_decode(("paths", sorted(fleet.prefills)), 60)

        decode = fleet.ask_decode(("stats",), 60)
        prefill_stats = list(fleet.gather("stats", ("stats",), 60).values())
        result["decode"] = decode
        result["prefill"] = {
            name: spread([float(s[name]) for s in prefill_stats]) for name in ("threads", "rss_kib", "fds")
        }
        idle_cpu = fleet.ask_decode(("idle", idle_s), idle_s + 60)
        result["decode_idle_cpu"] = {"seconds": idle_cpu, "over_s": idle_s, "percent": 100 * idle_cpu / idle_s}

        throughput, slowest, wrong = [], [], []
        for round_ in range(rounds):
            clusters = sorted(fleet.prefills)
            start = time.monotonic() + 1.0 + 0.01 * len(clusters)
            pushed = fleet.gather("push", ("push", round_, start), 120)
            done = sorted(pushed)
            bad = fleet.ask_decode(("verify", round_, done), 300)
            wrong += bad
            for cluster in bad:
                fleet.fail("verify", cluster, f"round {round_}: other bytes arrived")
            if not done or bad:
                continue
            last = max(end for _, end in pushed.values()) - start
            throughput.append(len(done) * 2 * BLOCKS * BLOCK_BYTES / last / MiB)
            slowest.append(last)
        result["push"] = {
            "bytes_per_prefill": 2 * BLOCKS * BLOCK_BYTES,
            "rounds": len(throughput),
            "aggregate_mib_s": {
                "best": max(throughput) if throughput else None,
                "median": statistics.median(throughput) if throughput else None,
            },
            "slowest_prefill_s": statistics.median(slowest) if slowest else None,
            "verified": not wrong and len(throughput) == rounds,
        }
    except (OSError, TimeoutError, RuntimeError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        fleet.close()
    result["failures"] = fleet.failures
    return result


def machine() -> dict[str, Any]:
    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return ""

    mem = read("/proc/meminfo").splitlines()
    return {
        "cpus": os.cpu_count(),
        "memory_kib": int(mem[0].split()[1]) if mem else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
        "nproc": resource.getrlimit(resource.RLIMIT_NPROC),
        "threads_max": read("/proc/sys/kernel/threads-max"),
        "pid_max": read("/proc/sys/kernel/pid_max"),
        "loadavg": read("/proc/loadavg"),
    }


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        f"{'path':>9} {'N':>4} {'linked':>6} {'link ms med/max':>16} {'dec thr':>7} {'dec RSS MiB':>11} "
        f"{'pre thr med/max':>15} {'pre RSS MiB med/max':>19} {'idle CPU %':>10} {'MiB/s best/med':>15} "
        f"{'slowest ms':>10} {'overflows':>9}"
    ]
    for r in results:
        if "error" in r and "push" not in r:
            rows.append(f"{r['path']:>9} {r['peers']:>4} failed: {r['error']}")
            continue

        def pair(d: dict[str, Optional[float]], scale: float = 1.0, fmt: str = ".0f") -> str:
            if d.get("median") is None:
                return "-"
            return f"{d['median'] * scale:{fmt}}/{d['max'] * scale:{fmt}}"

        push = r["push"]
        rate = push["aggregate_mib_s"]
        rates = f"{rate['best']:.0f}/{rate['median']:.0f}" if rate["best"] else "-"
        rows.append(
            f"{r['path']:>9} {r['peers']:>4} {r['linked']:>6} {pair(r['link_s'], 1e3, '.1f'):>16} "
            f"{r['decode']['threads']:>7} {r['decode']['rss_kib'] / 1024:>11.0f} {pair(r['prefill']['threads']):>15} "
            f"{pair(r['prefill']['rss_kib'], 1 / 1024):>19} {r['decode_idle_cpu']['percent']:>10.2f} "
            f"{rates:>15} "
            f"{(push['slowest_prefill_s'] or 0) * 1e3:>10.1f} {r.get('listen_overflows', '-'):>9}"
        )
        if r["failures"]:
            rows.append(f"{'':>9} failures: {json.dumps({k: v[:3] + ['...'] * (len(v) > 3) for k, v in r['failures'].items()})}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 4, one round, 1 s of idling")
    parser.add_argument("--peers", default="8,32,96,192", help="comma-separated prefill counts")
    parser.add_argument("--paths", default=",".join(PATHS), help="same_host, tcp or both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of idling measured")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args()
    counts = [4] if args.quick else [int(n) for n in args.peers.split(",")]
    rounds, idle_s = (1, 1.0) if args.quick else (args.rounds, args.idle)
    paths = [p for p in args.paths.split(",") if p]
    for p in paths:
        if p not in PATHS:
            parser.error(f"--paths: {p!r} is not one of {PATHS}")

    results = []
    for path in paths:
        subnet = None
        if path == "tcp":
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            from support.netns import Subnet, unavailable

            why = unavailable()
            if why is not None:
                results.append({"path": path, "skipped": why})
                print(f"tcp across namespaces skipped: {why}", file=sys.stderr)
                continue
            subnet = Subnet()
        try:
            for n in counts:
                result = run(path, n, rounds, idle_s, subnet)
                results.append(result)
                print(table([result]).splitlines()[-1 if not result["failures"] else -2], file=sys.stderr, flush=True)
        finally:
            if subnet is not None:
                subnet.close()
    report = {"benchmark": "many_peers", "machine": machine(), "rounds": rounds, "idle_s": idle_s,
              "results": results}
    print(table([r for r in results if "skipped" not in r]), file=sys.stderr)
    text = json.dumps(report)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["prefill"] and len(sys.argv) == 3:
        prefill_main(multiprocessing.connection.Connection(int(sys.argv[2])))
    else:
        main()

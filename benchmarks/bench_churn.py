"""Churn soak: one decode process and K prefill processes on this host, with
peers killed, frozen, unlinked and restarted while bytes move.

    python benchmarks/bench_churn.py [--seconds 60] [--prefills 3]
        [--transports auto,tcp,ucx] [--secret both|on|off] [--timeout-ms 1000]
        [--seed 1] [--output FILE] [--check]

Each leg runs one transport ("auto": the same-host path; "tcp"; "ucx" where
UCX is installed, else reported as skipped) with or without a link secret
(``--secret both`` runs a leg of each, ``--seconds`` split between them).
Every prefill process links to the decode process and loops over rounds of
three kinds, every byte checked: a push of its blocks into its own part of
the decode's blocks cache then a pull back; a pull of what its last push
left there; a layer-wise transfer (``transfer_cache_async``) then a pull
back. Meanwhile, at random moments (every kind at least once a leg):

- a prefill is killed (SIGKILL) and started again under the same cluster id;
- a prefill is frozen (SIGSTOP) past the operation timeout, then resumed;
- a prefill unlinks and links again;
- once a leg, the decode process is killed and a successor started, to which
  the prefills link again (same cluster id, a new port).

The last seconds of a leg are quiet: every prefill must complete rounds again
there (all relinks succeeded). Per leg: operations (successful transfers),
failures by status, corrupt (bytes that differ after a successful pull:
must be 0), hung (an operation unsettled past timeout + 5 s: must be 0),
relink time (median, max: a relink after a failure, an unlink, a restart or
the decode's restart, from the first attempt to the link), and the decode
process's threads, descriptors and RSS when warm and at the end (the decode
alive at the end: the successor). ``--check`` exits 1 unless corrupt and
hung are 0, every prefill recovered, no decode died unasked and the decode
grew within bounds. JSON on stdout's last line and in ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import secrets
import signal
import statistics
import sys
import time
from collections import Counter
from typing import Any, Optional

import numpy as np

import datadist_aio as dd

MiB = 1 << 20
DECODE = 100  # the decode's cluster id; prefills are 1..K
LAYERS = 2  # K and V each: 4 tensors
BLOCKS = 8  # blocks of each prefill's part of the decode's cache
BLOCK_BYTES = 16 * 1024  # a round moves 4 x 8 x 16 KiB = 512 KiB each way
QUIET_S = 6.0  # the chaos-free tail of a leg
REPORT_S = 0.25  # how often a prefill reports its counts
# Growth of the decode from warm to the end that --check accepts.
MAX_THREADS_GROWTH = 4
MAX_FDS_GROWTH = 16
MAX_RSS_GROWTH = 64 * MiB


def _desc(blocks: int) -> dd.CacheDesc:
    return dd.CacheDesc(2 * LAYERS, [blocks, BLOCK_BYTES], dd.DataType.DT_UINT8, dd.Placement.HOST)


def _options(transport: str, secret: str, timeout_ms: int, pool_bytes: int, listen: bool) -> dict[str, str]:
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.transport = transport
    if secret:
        config.auth_key = secret
    config.sync_kv_timeout = timeout_ms
    config.host_mem_pool_cfg = f'{{"memory_size": {pool_bytes}}}'
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# -- the decode process


def _published(cluster_id: int) -> list[np.ndarray]:
    """The bytes a prefill's published cache holds: a function of its cluster
    id alone, so that whoever reads them, whichever incarnation wrote them,
    knows what they must be."""
    rng = np.random.default_rng(cluster_id)
    return [rng.integers(0, 256, (BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(2 * LAYERS)]


def _new_counts() -> dict[str, Any]:
    return {"operations": Counter(), "failures": Counter(), "corrupt": 0, "hung": 0, "relinks": [], "linked": False}


async def _decode(conn: multiprocessing.connection.Connection, transport: str, secret: str, timeout_ms: int,
                  prefills: int) -> None:
    """Listens, holds the cache the prefills write into, and pulls every
    prefill's published blocks in turn (as a decode pulls a prefill's KV
    cache), checking each byte, until told to stop."""
    desc = _desc(prefills * BLOCKS)
    own = _desc(BLOCKS)
    with dd.LLMDataDist(dd.LLMRole.DECODER, DECODE) as datadist:
        datadist.init(_options(transport, secret, timeout_ms, (desc.size + own.size) * desc.num_tensors + 16 * MiB,
                               True))
        cm = datadist.cache_manager
        cm.allocate_blocks_cache(desc, dd.BlocksCacheKey(DECODE, 0))
        pulled = cm.allocate_blocks_cache(own)
        expected = {p: _published(p) for p in range(1, prefills + 1)}
        blocks = list(range(BLOCKS))
        counts = _new_counts()
        conn.send(datadist.listen_port)
        reported = time.monotonic()
        while not conn.poll(0):
            for prefill in range(1, prefills + 1):
                try:
                    async with asyncio.timeout(timeout_ms / 1000 + 5):
                        await cm.pull_blocks_async(dd.BlocksCacheKey(prefill, 0), pulled, blocks, blocks)
                    counts["operations"]["decode_pull"] += 1
                    if any(not np.array_equal(pulled.as_numpy(t), expected[prefill][t]) for t in range(own.num_tensors)):
                        counts["corrupt"] += 1
                except dd.LLMException as exc:
                    # Not linked (yet, or any more) is the prefill's churn, not a failure.
                    if exc.status_code is not dd.LLMStatusCode.LLM_NOT_YET_LINK:
                        counts["failures"][f"decode:{exc.status_code.name}"] += 1
                    await asyncio.sleep(0.01)
                except TimeoutError:
                    counts["hung"] += 1
            if time.monotonic() - reported >= REPORT_S:
                conn.send(counts)
                reported = time.monotonic()
        conn.send(counts)


def decode_main(conn: multiprocessing.connection.Connection, transport: str, secret: str, timeout_ms: int,
                prefills: int, quiet: bool) -> None:
    _die_with_parent()
    if quiet:
        logging.getLogger("datadist_aio").setLevel(logging.ERROR)
    try:
        asyncio.run(_decode(conn, transport, secret, timeout_ms, prefills))
    except (BrokenPipeError, EOFError):
        pass


# -- a prefill process


class _Released(dd.LayerSynchronizer):
    """Every layer ready at once, after a yield to the loop."""

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        await asyncio.sleep(0)
        return True


class _Prefill:
    def __init__(self, index: int, restarted: bool, port: Any, transport: str, secret: str, timeout_ms: int,
                 seed: int, conn: multiprocessing.connection.Connection) -> None:
        self.index = index
        self.restarted = restarted
        self.cluster_id = index + 1
        self.port = port  # a shared multiprocessing.Value: the decode's current port
        self.transport, self.secret, self.timeout_ms = transport, secret, timeout_ms
        self.rng = np.random.default_rng(seed)
        self.conn = conn
        self.region = [index * BLOCKS + b for b in range(BLOCKS)]
        self.blocks = list(range(BLOCKS))
        self.counts = _new_counts()
        self.relink_asked = False  # SIGUSR1: unlink and link again
        self.relink_needed = False  # an operation failed: the link may be gone
        self.linked_port = 0
        self.last_report = 0.0

    def report(self, now: bool = False) -> None:
        if now or time.monotonic() - self.last_report >= REPORT_S:
            self.conn.send(self.counts)
            self.last_report = time.monotonic()

    def cluster(self, port: int) -> dd.LLMClusterInfo:
        cluster = dd.LLMClusterInfo()
        cluster.remote_cluster_id = DECODE
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", port)
        return cluster

    def link(self, datadist: dd.LLMDataDist, record: bool) -> None:
        """Links to the decode at its current port, trying until it works."""
        started = time.perf_counter()
        while True:
            port = self.port.value
            datadist.unlink_clusters([self.cluster(port)], timeout=self.timeout_ms, force=True)
            status, _ = datadist.link_clusters([self.cluster(port)], timeout=3000)
            if status is dd.LLMStatusCode.LLM_SUCCESS:
                break
            self.counts["failures"][f"link:{status.name}"] += 1
            self.report()
            time.sleep(0.05)
        self.linked_port = port
        self.counts["linked"] = True
        if record:
            self.counts["relinks"].append(time.perf_counter() - started)
        self.report(now=True)

    async def checked(self, task: dd.CacheTask) -> None:
        async with asyncio.timeout(self.timeout_ms / 1000 + 5):
            await task

    async def rounds(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(self, "relink_asked", True))
        desc = _desc(BLOCKS)
        pool = 4 * desc.num_tensors * desc.size + 16 * MiB
        with dd.LLMDataDist(dd.LLMRole.PROMPT, self.cluster_id) as datadist:
            datadist.init(_options(self.transport, self.secret, self.timeout_ms, pool, False))
            cm = datadist.cache_manager
            src, back = cm.allocate_blocks_cache(desc), cm.allocate_blocks_cache(desc)
            published = cm.allocate_blocks_cache(desc, dd.BlocksCacheKey(self.cluster_id, 0))
            for t, data in enumerate(_published(self.cluster_id)):
                published.as_numpy(t)[:] = data
            key = dd.BlocksCacheKey(DECODE, 0)
            # The first link of a restarted prefill is a relink; a prefill's very first is not.
            self.link(datadist, record=self.restarted)
            expected: Optional[list[np.ndarray]] = None  # what this prefill's part of the decode holds
            while True:
                if self.relink_asked or self.relink_needed or self.port.value != self.linked_port:
                    if self.relink_asked:  # unlinks as a user would, asking the decode to drop its end
                        datadist.unlink_clusters([self.cluster(self.linked_port)], timeout=self.timeout_ms)
                    self.relink_asked = self.relink_needed = False
                    self.link(datadist, record=True)
                    expected = None  # the decode may be another one
                kind = ("push", "pull", "layerwise")[int(self.rng.integers(3))]
                if kind == "pull" and expected is None:
                    kind = "push"
                try:
                    if kind != "pull":
                        sent = [self.rng.integers(0, 256, (BLOCKS, BLOCK_BYTES), dtype=np.uint8)
                                for _ in range(desc.num_tensors)]
                        for t in range(desc.num_tensors):
                            src.as_numpy(t)[:] = sent[t]
                        expected = None  # unknown until the write is known to have landed
                        if kind == "push":
                            await self.checked(cm.push_blocks_async(key, src, self.blocks, self.region))
                        else:
                            config = dd.TransferWithCacheKeyConfig(key, range(LAYERS), range(LAYERS))
                            await self.checked(
                                cm.transfer_cache_async(src, _Released(), [config], self.blocks, self.region))
                        self.counts["operations"][kind] += 1
                        expected = sent
                    for t in range(desc.num_tensors):
                        back.as_numpy(t)[:] = 0
                    await self.checked(cm.pull_blocks_async(key, back, self.region, self.blocks))
                    self.counts["operations"]["pull"] += 1
                    assert expected is not None
                    if any(not np.array_equal(back.as_numpy(t), expected[t]) for t in range(desc.num_tensors)):
                        self.counts["corrupt"] += 1
                        self.report(now=True)
                except dd.LLMException as exc:
                    self.counts["failures"][exc.status_code.name] += 1
                    expected = None
                    self.relink_needed = True
                except TimeoutError:
                    self.counts["hung"] += 1
                    expected = None
                    self.relink_needed = True
                    self.report(now=True)
                self.report()
                await asyncio.sleep(0)


def prefill_main(index: int, restarted: bool, port: Any, transport: str, secret: str, timeout_ms: int, seed: int,
                 conn: multiprocessing.connection.Connection, quiet: bool) -> None:
    _die_with_parent()
    if quiet:
        logging.getLogger("datadist_aio").setLevel(logging.ERROR)
    prefill = _Prefill(index, restarted, port, transport, secret, timeout_ms, seed, conn)
    try:
        asyncio.run(prefill.rounds())
    except (BrokenPipeError, EOFError):
        pass


# -- the parent: processes, chaos, figures


def _proc_figures(pid: int) -> dict[str, int]:
    figures = {"threads": 0, "fds": len(os.listdir(f"/proc/{pid}/fd")), "rss": 0}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                figures["threads"] = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                figures["rss"] = int(line.split()[1]) * 1024
    return figures


def _signal(pid: int, number: int) -> bool:
    """Signals a child; False where it has already exited (found dead next)."""
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        return False
    return True


class _Leg:
    def __init__(self, transport: str, secret: bool, prefills: int, seconds: float, timeout_ms: int,
                 seed: int, quiet: bool) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.quiet = quiet
        self.transport, self.prefills, self.seconds, self.timeout_ms = transport, prefills, seconds, timeout_ms
        self.secret = secrets.token_hex(16) if secret else ""
        self.rng = random.Random(seed)
        self.seed = seed
        self.port = self.ctx.Value("i", 0)
        self.decode: Any = None
        self.decode_conn: Any = None
        self.decode_started = 0.0
        self.deaths: Counter = Counter()  # unasked, by exit code
        self.children: dict[int, tuple[Any, Any]] = {}  # index -> (process, conn)
        self.incarnations = 0
        self.decodes = 0  # incarnations of the decode
        # (prefill index or "decode", incarnation) -> the latest counts it sent
        self.latest: dict[tuple[Any, int], dict[str, Any]] = {}
        self.incarnation_of: dict[int, int] = {}
        self.events: Counter = Counter()
        self.samples: list[tuple[float, dict[str, int]]] = []

    # processes

    def start_decode(self) -> None:
        parent, child = self.ctx.Pipe()
        self.decode = self.ctx.Process(target=decode_main, name="decode", daemon=True,
                                       args=(child, self.transport, self.secret, self.timeout_ms, self.prefills,
                                             self.quiet))
        self.decode.start()
        child.close()
        if not parent.poll(120):
            raise RuntimeError("the decode process did not start within 120 s")
        self.decode_conn = parent
        self.decodes += 1
        self.decode_started = time.monotonic()
        self.samples = []
        self.port.value = parent.recv()

    def stop_decode(self, kill: bool) -> None:
        if kill:
            self.decode.kill()
        else:
            try:
                self.decode_conn.send("stop")
                deadline = time.monotonic() + 30
                while self.decode_conn.poll(max(deadline - time.monotonic(), 0)):
                    self.latest[("decode", self.decodes)] = self.decode_conn.recv()
            except (OSError, EOFError):
                pass
        self.decode.join(30)
        if self.decode.is_alive():
            self.decode.kill()
            self.decode.join(10)
        self.decode_conn.close()

    def start_prefill(self, index: int, restarted: bool) -> None:
        parent, child = self.ctx.Pipe(duplex=False)
        self.incarnations += 1
        process = self.ctx.Process(
            target=prefill_main, name=f"prefill-{index}", daemon=True,
            args=(index, restarted, self.port, self.transport, self.secret, self.timeout_ms,
                  self.seed * 1000 + self.incarnations, child, self.quiet),
        )
        process.start()
        child.close()
        self.children[index] = (process, parent)
        self.incarnation_of[index] = self.incarnations

    def take_counts(self, conn: Any, key: tuple[Any, int]) -> None:
        """The latest of the counts waiting on `conn` (an end that died may have left none)."""
        try:
            while conn.poll(0):
                self.latest[key] = conn.recv()
        except (EOFError, OSError):
            pass

    def drain(self) -> None:
        """Takes the counts the decode and the prefills sent since the last call."""
        if self.decode_conn is not None:
            self.take_counts(self.decode_conn, ("decode", self.decodes))
        for index, (_, conn) in list(self.children.items()):
            self.take_counts(conn, (index, self.incarnation_of[index]))

    def end_prefill(self, index: int) -> None:
        process, conn = self.children.pop(index)
        if process.is_alive():
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        process.join(10)
        self.take_counts(conn, (index, self.incarnation_of[index]))
        conn.close()

    # chaos

    def sample_decode(self) -> None:
        if self.decode is not None and self.decode.is_alive():
            try:
                self.samples.append((time.monotonic() - self.decode_started, _proc_figures(self.decode.pid)))
            except OSError:
                pass

    def event(self, kind: str) -> None:
        self.events[kind] += 1
        index = self.rng.randrange(self.prefills)
        if kind == "kill":
            self.end_prefill(index)
            self.start_prefill(index, restarted=True)
        elif kind == "stop":
            process, _ = self.children[index]
            if _signal(process.pid, signal.SIGSTOP):
                self.sleep(self.timeout_ms / 1000 * 1.5 + 0.5)
                _signal(process.pid, signal.SIGCONT)
        elif kind == "relink":
            # SIGUSR1 before the prefill has set its handler (it does before
            # it links) would end it: a prefill not linked yet is left alone.
            linked = [i for i in self.children if self.latest.get((i, self.incarnation_of[i]), {}).get("linked")]
            if not linked:
                self.events[kind] -= 1
                return
            process, _ = self.children[self.rng.choice(linked)]
            _signal(process.pid, signal.SIGUSR1)
        elif kind == "decode":
            self.stop_decode(kill=True)
            self.start_decode()

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            self.drain()
            self.sample_decode()
            if self.decode is not None and not self.decode.is_alive():
                self.deaths[f"decode exit {self.decode.exitcode}"] += 1
                self.stop_decode(kill=True)
                self.start_decode()
            for index, (process, _) in list(self.children.items()):
                if not process.is_alive():
                    self.deaths[f"prefill exit {process.exitcode}"] += 1
                    self.end_prefill(index)
                    self.start_prefill(index, restarted=True)
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.25))

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        self.start_decode()
        for index in range(self.prefills):
            self.start_prefill(index, restarted=False)
        chaos_until = started + max(self.seconds - QUIET_S, 0)
        kinds = ["kill", "stop", "relink"]
        self.rng.shuffle(kinds)
        decode_at = started + (chaos_until - started) * 0.4
        try:
            self.sleep(2.0)
            while time.monotonic() < chaos_until:
                if decode_at and time.monotonic() >= decode_at:
                    self.event("decode")
                    decode_at = 0
                else:
                    self.event(kinds.pop() if kinds else self.rng.choice(["kill", "stop", "relink"]))
                self.sleep(self.rng.uniform(1.0, 3.0))
            ends: list[Any] = [*self.children, "decode"]
            quiet_from = {end: self._ops(end) for end in ends}
            self.sleep(max(started + self.seconds - time.monotonic(), QUIET_S))
            recovered = {end: self._ops(end) > quiet_from[end] for end in ends}
        finally:
            for index in list(self.children):
                self.end_prefill(index)
            self.sample_decode()
            if self.decode is not None:
                self.stop_decode(kill=False)
        return self.figures(time.monotonic() - started, recovered)

    def _ops(self, end: Any) -> int:
        """Operations the current incarnation of a prefill (its index) or of the decode completed."""
        counts = self.latest.get((end, self.decodes if end == "decode" else self.incarnation_of[end]))
        return sum(counts["operations"].values()) if counts else 0

    def figures(self, seconds: float, recovered: dict[int, bool]) -> dict[str, Any]:
        operations: Counter = Counter()
        failures: Counter = Counter()
        corrupt = hung = 0
        relinks: list[float] = []
        for counts in self.latest.values():
            operations.update(counts["operations"])
            failures.update(counts["failures"])
            corrupt += counts["corrupt"]
            hung += counts["hung"]
            relinks.extend(counts["relinks"])
        warm = next((s for t, s in self.samples if t >= 5.0), self.samples[0][1] if self.samples else None)
        end = self.samples[-1][1] if self.samples else None
        return {
            "transport": self.transport,
            "secret": bool(self.secret),
            "prefills": self.prefills,
            "seconds": round(seconds, 1),
            "timeout_ms": self.timeout_ms,
            "operations": sum(operations.values()),
            "by_kind": dict(operations),
            "failures": dict(failures),
            "corrupt": corrupt,
            "hung": hung,
            "events": dict(self.events),
            "relinks": {
                "count": len(relinks),
                "median_ms": round(statistics.median(relinks) * 1e3, 1) if relinks else None,
                "max_ms": round(max(relinks) * 1e3, 1) if relinks else None,
            },
            "recovered": all(recovered.values()) and len(recovered) == self.prefills + 1,
            "deaths_unasked": dict(self.deaths),
            "decode": {"warm": warm, "end": end},
        }


def check(result: dict[str, Any]) -> list[str]:
    """What is wrong with a leg's figures (empty: nothing)."""
    if "skipped" in result:
        return []
    problems = []
    for name in ("corrupt", "hung", "deaths_unasked"):
        if result[name]:
            problems.append(f"{name}: {result[name]}")
    if not result["recovered"]:
        problems.append("a prefill, or the decode, completed no operation in the quiet tail")
    if result["operations"] == 0:
        problems.append("no operation completed")
    warm, end = result["decode"]["warm"], result["decode"]["end"]
    if warm is None or end is None:
        problems.append("the decode process was never measured")
    else:
        if end["threads"] - warm["threads"] > MAX_THREADS_GROWTH:
            problems.append(f"decode threads {warm['threads']} -> {end['threads']}")
        if end["fds"] - warm["fds"] > MAX_FDS_GROWTH:
            problems.append(f"decode fds {warm['fds']} -> {end['fds']}")
        if end["rss"] - warm["rss"] > MAX_RSS_GROWTH:
            problems.append(f"decode RSS {warm['rss'] >> 20} -> {end['rss'] >> 20} MiB")
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="per transport (split between secret legs)")
    parser.add_argument("--prefills", type=int, default=3)
    parser.add_argument("--transports", default="auto,tcp,ucx")
    parser.add_argument("--secret", choices=("both", "on", "off"), default="both")
    parser.add_argument("--timeout-ms", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output")
    parser.add_argument("--verbose", action="store_true", help="keep the engine's warnings (links going down...)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every leg's figures are sound")
    args = parser.parse_args(argv)
    if args.prefills < 1 or args.seconds <= 0 or args.timeout_ms < 100:
        parser.error("--prefills must be >= 1, --seconds > 0 and --timeout-ms >= 100")
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.secret]
    results = []
    for transport in args.transports.split(","):
        if transport not in ("auto", "tcp", "ucx"):
            parser.error(f"unknown transport {transport!r}")
        if transport == "ucx":
            ok, why = dd._native.ucx_available()
            if not ok:
                results.append({"transport": "ucx", "skipped": why})
                print(f"ucx: skipped ({why})", file=sys.stderr)
                continue
        for secret in modes:
            leg = _Leg(transport, secret, args.prefills, args.seconds / len(modes), args.timeout_ms,
                       args.seed + len(results), quiet=not args.verbose)
            result = leg.run()
            result["problems"] = check(result)
            results.append(result)
            print(json.dumps(result), file=sys.stderr)
    report = {"results": results}
    text = json.dumps(report)
    if args.output:
        with open(args.output, "w") as out:
            out.write(text + "\n")
    print(text)
    if args.check and any(r.get("problems") for r in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long a small pull takes to be seen complete, by the way its caller waits.

    python benchmarks/bench_waiting.py [--ops 200] [--rounds 3] [--poll-ms 1]

Two processes on one host (loopback, the same-host path): a prefill that
owns a blocks cache, and this process, the decode side, which pulls one
4 KiB block at a time (what the vLLM connector does per request, in small).
Each sample is the time from the call that starts the pull to the moment
the caller sees the task done, for each way of waiting:

- ``await`` under asyncio and uvloop (the reference of the run);
- ``synchronize``: a blocking wait on a thread with no event loop;
- ``poll``: ``done()`` polled every ``--poll-ms`` from a thread with no
  loop (vLLM's worker does this in ``get_finished``), ``poll_busy``: in a
  tight loop; ``get_results0``: ``get_results(0)`` every ``--poll-ms``;
- ``callback``: ``add_done_callback`` from a thread with no loop (the
  callback thread runs it), ``callback_loop``: from a running loop; both
  timed when the callback runs;
- ``blocking_in_loop``: ``synchronize`` on the thread of a running loop
  that watches the completion fd (as a notebook cell does).

The styles alternate within each round. Reported: the median and p90 per
style, their ratio to the awaited median of the same round (asyncio), and
for the polled styles the ratio to the poll interval plus that median (the
best a poller can see), and who read the answers (``answer_counts``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datadist_aio as dd
from datadist_aio.bench.engines.datadist import options
from loops import available_loops, loop_runner

BLOCK = 4096
BLOCKS = 64
MiB = 1 << 20


def desc() -> dd.CacheDesc:
    return dd.CacheDesc(2, [BLOCKS, BLOCK // 2], dd.DataType.DT_FLOAT16, dd.Placement.HOST)


def prefill_main(conn: Any) -> None:
    with dd.LLMDataDist(dd.LLMRole.PROMPT, 1) as prefill:
        prefill.init(options(16 * MiB, "127.0.0.1"))
        cache = prefill.cache_manager.allocate_blocks_cache(desc(), dd.BlocksCacheKey(1, 0))
        for t in range(2):
            cache.as_numpy(t)[:] = t + 1
        conn.send(prefill.listen_port)
        conn.recv()  # stop


class Decode:
    def __init__(self, port: int) -> None:
        self.datadist = dd.LLMDataDist(dd.LLMRole.DECODER, 2)
        self.datadist.init(options(16 * MiB))
        self.cm = self.datadist.cache_manager
        self.cache = self.cm.allocate_blocks_cache(desc(), dd.BlocksCacheKey(2, 0))
        cluster = dd.LLMClusterInfo()
        cluster.remote_cluster_id = 1
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", port)
        status, _ = self.datadist.link_clusters([cluster], timeout=5000)
        assert status is dd.LLMStatusCode.LLM_SUCCESS, status
        self.n = 0

    def start(self) -> dd.CacheTask:
        self.n += 1
        block = self.n % BLOCKS
        return self.cm.pull_blocks_async(dd.BlocksCacheKey(1, 0), self.cache, [block], [(block + 1) % BLOCKS])


def timed_thread(run: Callable[[], float]) -> float:
    """``run()`` on a fresh thread, which runs no event loop."""
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.append(run()))
    thread.start()
    thread.join()
    return out[0]


def styles(decode: Decode, poll_s: float) -> dict[str, Callable[[int], list[float]]]:
    def awaited(loop_name: str) -> Callable[[int], list[float]]:
        def run(ops: int) -> list[float]:
            async def sample() -> list[float]:
                out = []
                for _ in range(ops):
                    start = time.perf_counter()
                    await decode.start()
                    out.append(time.perf_counter() - start)
                return out

            with loop_runner(loop_name) as r:
                return r.run(sample())

        return run

    def on_thread(wait: Callable[[dd.CacheTask], None]) -> Callable[[int], list[float]]:
        def run(ops: int) -> list[float]:
            def one() -> float:
                start = time.perf_counter()
                wait(decode.start())
                return time.perf_counter() - start

            return [timed_thread(one) for _ in range(ops)]

        return run

    def callback(ops: int) -> list[float]:
        # Timed when the callback runs (on the callback thread), not when
        # this thread hears of it.
        def one() -> float:
            called = threading.Event()
            seen: list[float] = []
            start = time.perf_counter()
            decode.start().add_done_callback(lambda _: (seen.append(time.perf_counter()), called.set()))
            called.wait()
            return seen[0] - start

        return [timed_thread(one) for _ in range(ops)]

    def poll(task: dd.CacheTask) -> None:
        while not task.done():
            time.sleep(poll_s)

    def poll_busy(task: dd.CacheTask) -> None:
        while not task.done():
            pass

    def get_results0(task: dd.CacheTask) -> None:
        while task.get_results(0)[0] is dd.LLMStatusCode.LLM_TIMEOUT:
            time.sleep(poll_s)


    def in_loop(body: str) -> Callable[[int], list[float]]:
        def run(ops: int) -> list[float]:
            async def sample() -> list[float]:
                out = []
                for _ in range(ops):
                    start = time.perf_counter()
                    task = decode.start()
                    if body == "callback":
                        seen: asyncio.Future[float] = asyncio.get_running_loop().create_future()
                        task.add_done_callback(lambda _: seen.set_result(time.perf_counter()))
                        out.append(await seen - start)
                    else:
                        task.synchronize()
                        out.append(time.perf_counter() - start)
                return out

            async def first() -> None:
                await decode.start()  # the loop now watches the completion fd

            with loop_runner("asyncio") as r:
                r.run(first())
                return r.run(sample())

        return run

    out = {"await": awaited("asyncio")}
    if "uvloop" in available_loops():
        out["await_uvloop"] = awaited("uvloop")
    out.update(
        {
            "synchronize": on_thread(lambda task: task.synchronize() and None),
            "poll": on_thread(poll),
            "poll_busy": on_thread(poll_busy),
            "get_results0": on_thread(get_results0),
            "callback": callback,
            "callback_loop": in_loop("callback"),
            "blocking_in_loop": in_loop("blocking"),
        }
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=200, help="pulls per style and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--poll-ms", type=float, default=1.0)
    parser.add_argument("--output", type=Path, default=Path("build/bench-waiting.json"))
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=prefill_main, args=(child,), daemon=True)
    process.start()
    try:
        if not parent.poll(60):
            raise SystemExit("the prefill process did not start")
        decode = Decode(parent.recv())
        runs = styles(decode, args.poll_ms / 1000)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
        readers: dict[str, dict[str, int]] = {name: {} for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                time.sleep(0.1)  # the answer thread stops lingering after the previous style's blocking waits
                run(10)  # warm-up
                before = decode.datadist.answer_counts()
                samples = sorted(run(args.ops))
                after = decode.datadist.answer_counts()
                for key in after:
                    readers[name][key] = readers[name].get(key, 0) + after[key] - before.get(key, 0)
                results[name].append(
                    {"median_us": statistics.median(samples) * 1e6, "p90_us": samples[int(0.9 * len(samples))] * 1e6}
                )
        decode.datadist.finalize()
    finally:
        parent.send("stop")
        process.join(10)
        if process.is_alive():
            process.kill()

    print(f"one {BLOCK} B block pulled, same host; {args.ops} pulls x {args.rounds} rounds per style;"
          f" polls every {args.poll_ms:g} ms")
    print(f"{'style':18} {'median us':>18} {'p90 us':>18} {'/await':>12} {'/(poll+await)':>14}  readers")
    report: dict[str, Any] = {"ops": args.ops, "rounds": args.rounds, "poll_ms": args.poll_ms, "styles": {}}
    reference = [r["median_us"] for r in results["await"]]
    for name, rounds in results.items():
        medians = [r["median_us"] for r in rounds]
        p90s = [r["p90_us"] for r in rounds]
        ratios = [m / ref for m, ref in zip(medians, reference)]
        polled = name in ("poll", "get_results0")
        bound = [m / (args.poll_ms * 1000 + ref) for m, ref in zip(medians, reference)] if polled else []
        who = ", ".join(f"{k} {v}" for k, v in sorted(readers[name].items()) if v)
        print(f"{name:18} {min(medians):8.1f}-{max(medians):8.1f} {min(p90s):8.1f}-{max(p90s):8.1f}"
              f" {min(ratios):5.2f}-{max(ratios):5.2f}"
              f" {(f'{min(bound):5.2f}-{max(bound):5.2f}' if bound else ''):>14}  {who}")
        report["styles"][name] = {"rounds": rounds, "ratio_to_await": ratios, "readers": readers[name]}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

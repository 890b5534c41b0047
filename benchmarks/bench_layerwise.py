"""Overlap of layer-wise transfer with compute, between two processes.

    python benchmarks/bench_layerwise.py [--quick]

A synthetic model makes layer l ready at ``start + (l + 1) * c`` (a coroutine
sleeping to those deadlines, as an accelerator would be busy while the host
is free). ``transfer_cache_async`` sends each layer as its synchronizer
releases it. ``t`` is the transfer time per layer measured alone (one push of every layer,
median, divided by L).
With L layers the best possible total is ``L * max(c, t) + min(c, t)``; the
figure reported is that ideal divided by the measured total (1.0 = perfect
overlap), median over repetitions.

Then the model as a thread of this process that holds the GIL while it
computes (pure Python work for ``c`` per layer, as a forward launching its
kernels from Python does), signalling each layer two ways in the same run:
``coroutine``, a ``LayerSynchronizer`` whose ``synchronize_layer`` awaits an
event the model's thread sets with ``call_soon_threadsafe`` (the loop's
thread must win the GIL before the layer is handed over), and ``gate``, a
``LayerGate`` the model's thread opens (the layer is handed over inside the
call). Besides ideal/measured it reports the hand-over lag per layer: from
the model's signal until the transfer had the layer's verdict, median and
largest.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import threading
import time

import numpy as np

import datadist_aio as dd
from datadist_aio.bench.engines.datadist import options
from loops import available_loops, loop_runner

MiB = 1 << 20
BLOCK = 256 * 1024


def kv_desc(layers: int, blocks: int) -> dd.CacheDesc:
    return dd.CacheDesc(2 * layers, [blocks, BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)


def decode_main(conn, layers: int, blocks: int) -> None:
    desc = kv_desc(layers, blocks)
    with dd.LLMDataDist(dd.LLMRole.DECODER, 2) as decode:
        decode.init(options(desc.num_tensors * desc.size + 64 * MiB, "127.0.0.1", 30000))
        cache = decode.cache_manager.allocate_blocks_cache(desc, dd.BlocksCacheKey(2, 0))
        conn.send(decode.listen_port)
        expected = conn.recv()  # (layer, block) sample the prefill side wrote
        conn.send(bytes(cache.as_numpy(2 * expected[0])[expected[1]][:64]))
        conn.recv()


class Deadlines(dd.LayerSynchronizer):
    """Layer l is ready at start + (l + 1) * c."""

    def __init__(self, compute_s: float) -> None:
        self.compute_s = compute_s
        self.start = 0.0

    async def synchronize_layer(self, layer_index: int, timeout_in_millis) -> bool:
        delay = self.start + (layer_index + 1) * self.compute_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return True


async def measure(cm, cache, layers: int, blocks: int, compute_ms: float, repeats: int) -> float:
    key = dd.BlocksCacheKey(2, 0)
    all_blocks = list(range(blocks))
    totals = []
    for _ in range(repeats):
        sync = Deadlines(compute_ms / 1000)
        config = dd.TransferWithCacheKeyConfig(key, range(layers), range(layers))
        sync.start = time.perf_counter()
        await cm.transfer_cache_async(cache, sync, [config], all_blocks, all_blocks)
        totals.append(time.perf_counter() - sync.start)
    return statistics.median(totals)


def hold_the_gil(seconds: float) -> None:
    """Pure Python work: the GIL is let go only when another thread asks for it."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Signalled(dd.LayerSynchronizer):
    """Layers a model thread signals through the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, layers: int) -> None:
        self.loop = loop
        self.events = [asyncio.Event() for _ in range(layers)]
        self.handed = [0.0] * layers

    def ready(self, layer: int) -> None:
        self.loop.call_soon_threadsafe(self.events[layer].set)

    async def synchronize_layer(self, layer_index: int, timeout_in_millis) -> bool:
        await self.events[layer_index].wait()
        self.handed[layer_index] = time.perf_counter()
        return True


class TimedGate(dd.LayerGate):
    """A gate noting when the transfer had each layer's verdict."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.handed = [0.0] * layers

    def ready(self, layer: int) -> None:
        self.open(layer)

    def watch_layer(self, layer_index, on_decided):
        def decided(verdict: bool) -> None:
            self.handed[layer_index] = time.perf_counter()
            on_decided(verdict)

        verdict = super().watch_layer(layer_index, decided)
        if verdict is not None:
            self.handed[layer_index] = time.perf_counter()
        return verdict


async def measure_model_thread(cm, cache, layers: int, blocks: int, compute_ms: float, repeats: int,
                               style: str) -> tuple[float, float, float]:
    """Total (s), and the hand-over lag per layer (median, largest; s)."""
    key = dd.BlocksCacheKey(2, 0)
    all_blocks = list(range(blocks))
    loop = asyncio.get_running_loop()
    totals: list[float] = []
    lags: list[float] = []
    for _ in range(repeats):
        sync = Signalled(loop, layers) if style == "coroutine" else TimedGate(layers)
        ready_at = [0.0] * layers

        def model() -> None:
            for layer in range(layers):
                hold_the_gil(compute_ms / 1000)
                ready_at[layer] = time.perf_counter()
                sync.ready(layer)

        config = dd.TransferWithCacheKeyConfig(key, range(layers), range(layers))
        start = time.perf_counter()
        task = cm.transfer_cache_async(cache, sync, [config], all_blocks, all_blocks)
        thread = threading.Thread(target=model, name="model")
        thread.start()
        await task
        totals.append(time.perf_counter() - start)
        thread.join()
        lags.extend(handed - ready for handed, ready in zip(sync.handed, ready_at))
    return statistics.median(totals), statistics.median(lags), max(lags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--layer-mib", type=int, default=4, help="bytes per layer (K and V together)")
    args = parser.parse_args()
    layers = 8 if args.quick else args.layers
    repeats = 3 if args.quick else 7
    blocks = args.layer_mib * MiB // (2 * BLOCK)
    desc = kv_desc(layers, blocks)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_main, args=(child, layers, blocks))
    proc.start()
    try:
        port = parent.recv()
        with dd.LLMDataDist(dd.LLMRole.PROMPT, 1) as prefill:
            prefill.init(options(desc.num_tensors * desc.size + 64 * MiB, None, 30000))
            cluster = dd.LLMClusterInfo()
            cluster.remote_cluster_id = 2
            cluster.append_local_ip_info("127.0.0.1", 0)
            cluster.append_remote_ip_info("127.0.0.1", port)
            assert prefill.link_clusters([cluster], 5000)[0] is dd.LLMStatusCode.LLM_SUCCESS
            cm = prefill.cache_manager
            cache = cm.allocate_blocks_cache(desc)
            rng = np.random.default_rng(0)
            for t in range(desc.num_tensors):
                cache.as_numpy(t)[:] = rng.integers(0, 256, size=(blocks, BLOCK), dtype=np.uint8)
            all_blocks = list(range(blocks))
            key = dd.BlocksCacheKey(2, 0)
            whole = []
            for _ in range(repeats + 1):  # the first round also faults the decode side's pages in
                start = time.perf_counter()
                cm.push_blocks(key, cache, all_blocks, all_blocks)
                whole.append(time.perf_counter() - start)
            t_ms = statistics.median(whole[1:]) * 1e3 / layers
            print(f"{layers} layers of {args.layer_mib} MiB; transfer alone (all layers in one push): "
                  f"t = {t_ms:.2f} ms per layer")
            print(f"{'loop':>8} {'c ms':>6} {'ideal ms':>9} {'measured':>9} {'ideal/measured':>15}")
            for loop_name in available_loops():
                with loop_runner(loop_name) as r:
                    for compute_ms in (t_ms / 2, t_ms, 2 * t_ms):
                        measured = r.run(measure(cm, cache, layers, blocks, compute_ms, repeats)) * 1e3
                        ideal = layers * max(compute_ms, t_ms) + min(compute_ms, t_ms)
                        print(f"{loop_name:>8} {compute_ms:>6.2f} {ideal:>9.1f} {measured:>9.1f} {ideal / measured:>15.2f}")
            print("The model as a thread of this process that holds the GIL while it computes:")
            print(f"{'loop':>8} {'c ms':>6} {'signal':>10} {'ideal ms':>9} {'measured':>9} {'ideal/measured':>15} "
                  f"{'lag median ms':>14} {'lag max ms':>11}")
            for loop_name in available_loops():
                with loop_runner(loop_name) as r:
                    for compute_ms in (t_ms, 2 * t_ms):
                        ideal = layers * max(compute_ms, t_ms) + min(compute_ms, t_ms)
                        for style in ("coroutine", "gate"):
                            total, lag, worst = r.run(measure_model_thread(cm, cache, layers, blocks, compute_ms,
                                                                           repeats, style))
                            print(f"{loop_name:>8} {compute_ms:>6.2f} {style:>10} {ideal:>9.1f} {total * 1e3:>9.1f} "
                                  f"{ideal / (total * 1e3):>15.2f} {lag * 1e3:>14.3f} {worst * 1e3:>11.3f}")
            parent.send((layers - 1, blocks - 1))
            sample = parent.recv()
            assert sample == bytes(cache.as_numpy(2 * (layers - 1))[blocks - 1][:64]), "decode side got other bytes"
    finally:
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()

"""Layer-wise prefill to decode: the transfer of finished layers overlaps the
compute of the next ones.

    python examples/layerwise_prefill_decode.py [--layers 16] [--uvloop]

A toy model computes one layer at a time in a coroutine and writes that
layer's K and V blocks into the prefill cache; a LayerSynchronizer coroutine
releases each layer to ``transfer_cache_async`` as soon as it is computed.
The decode process (spawned, listening on loopback) checks every byte of
every layer it received against the model's output, and that no other block
was written.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing as mp
import time

import numpy as np

import datadist_aio as dd

PREFILL, DECODE = 1, 2
BLOCKS, BLOCK_BYTES = 64, 32 * 1024


def options(listen: bool) -> dict[str, str]:
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = '{"memory_size": 536870912}'
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()


def kv_desc(layers: int) -> dd.CacheDesc:
    return dd.CacheDesc(2 * layers, [BLOCKS, BLOCK_BYTES], dd.DataType.DT_UINT8, dd.Placement.HOST)


def digest(cache: dd.Cache, blocks: list[int]) -> str:
    h = hashlib.sha256()
    for t in range(cache.cache_desc.num_tensors):
        h.update(np.ascontiguousarray(cache.as_numpy(t)[blocks]).data)
    return h.hexdigest()


def decode_main(conn, layers: int) -> None:
    with dd.LLMDataDist(dd.LLMRole.DECODER, DECODE) as decode:
        decode.init(options(listen=True))
        cache = decode.cache_manager.allocate_blocks_cache(kv_desc(layers), dd.BlocksCacheKey(DECODE, 0))
        for t in range(2 * layers):
            cache.as_numpy(t)[:] = 0
        conn.send(decode.listen_port)
        block_table = conn.recv()
        others = sorted(set(range(BLOCKS)) - set(block_table))
        clean = all(not cache.as_numpy(t)[others].any() for t in range(2 * layers))
        conn.send((digest(cache, block_table), clean))


class ModelProgress(dd.LayerSynchronizer):
    """Releases layer l once the model has finished computing it."""

    def __init__(self, layers: int) -> None:
        self.done = [asyncio.Event() for _ in range(layers)]

    async def synchronize_layer(self, layer_index: int, timeout_in_millis) -> bool:
        await self.done[layer_index].wait()
        return True


async def toy_model(
    cache: dd.Cache, blocks: list[int], outputs: np.ndarray, progress: ModelProgress, layer_ms: float
) -> None:
    """Computes the layers in order: each takes ``layer_ms`` (the accelerator's
    time) and leaves its K and V (``outputs``) for the request's blocks in the cache."""
    for layer in range(len(progress.done)):
        await asyncio.sleep(layer_ms / 1000)
        for tensor in (2 * layer, 2 * layer + 1):
            cache.as_numpy(tensor)[blocks] = outputs[tensor]
        progress.done[layer].set()


async def prefill(port: int, layers: int, layer_ms: float) -> tuple[list[int], str, float]:
    with dd.LLMDataDist(dd.LLMRole.PROMPT, PREFILL) as prefill:
        prefill.init(options(listen=False))
        cluster = dd.LLMClusterInfo()
        cluster.remote_cluster_id = DECODE
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", port)
        status, _ = prefill.link_clusters([cluster], timeout=5000)
        assert status is dd.LLMStatusCode.LLM_SUCCESS, status
        cache = prefill.cache_manager.allocate_blocks_cache(kv_desc(layers))
        rng = np.random.default_rng(1)
        src_blocks = sorted(rng.choice(BLOCKS, size=24, replace=False).tolist())
        block_table = rng.permutation(BLOCKS)[:24].tolist()
        outputs = rng.integers(0, 256, size=(2 * layers, len(src_blocks), BLOCK_BYTES), dtype=np.uint8)
        progress = ModelProgress(layers)
        config = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(DECODE, 0), range(layers), range(layers))
        start = time.perf_counter()
        task = prefill.cache_manager.transfer_cache_async(cache, progress, [config], src_blocks, block_table)
        await toy_model(cache, src_blocks, outputs, progress, layer_ms)
        statuses = await task
        seconds = time.perf_counter() - start
        assert statuses == [dd.LLMStatusCode.LLM_SUCCESS], statuses
        return block_table, digest(cache, src_blocks), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--layer-ms", type=float, default=2.0, help="synthetic compute time per layer")
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    decode = ctx.Process(target=decode_main, args=(child, args.layers))
    decode.start()
    try:
        port = parent.recv()
        run = prefill(port, args.layers, args.layer_ms)
        if args.uvloop:
            import uvloop

            block_table, sent, seconds = uvloop.run(run)
        else:
            block_table, sent, seconds = asyncio.run(run)
        parent.send(block_table)
        received, clean = parent.recv()
    finally:
        decode.join(30)
        if decode.is_alive():
            decode.kill()
    print(f"{args.layers} layers computed and sent in {seconds * 1e3:.1f} ms "
          f"(compute alone {args.layers * args.layer_ms:.1f} ms)")
    print("decode side: " + ("every byte verified, no other block touched" if received == sent and clean else "MISMATCH"))


if __name__ == "__main__":
    main()

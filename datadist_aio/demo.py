"""The demo job: a paged multi-layer KV cache moved with a random block table.

The prefill cache (K and V per layer, ``blocks`` blocks each) is filled with
random bytes; ``swap_blocks_async`` moves the request's blocks into the
decode cache at a random block table, and every byte is checked.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from .cache_desc import CacheDesc
from .cache_key import BlocksCacheKey
from .config import LLMConfig
from .data_type import DataType
from .enums import LLMRole, Placement
from .llm_datadist import LLMDataDist


def _options(pool_bytes: int) -> dict[str, str]:
    config = LLMConfig()
    config.enable_cache_manager = True
    config.host_mem_pool_cfg = f'{{"memory_size": {pool_bytes}}}'
    return config.generate_options()


async def _move(layers: int, blocks: int, block_bytes: int, seed: int) -> tuple[float, int]:
    tensors = 2 * layers
    tensor_bytes = blocks * block_bytes
    datadist = LLMDataDist(LLMRole.MIX, 1)
    datadist.init(_options(2 * tensors * tensor_bytes + (64 << 20)))
    try:
        cache_manager = datadist.cache_manager
        desc = CacheDesc(tensors, [blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)
        prefill = cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        decode = cache_manager.allocate_blocks_cache(
            CacheDesc(tensors, [blocks, block_bytes], DataType.DT_UINT8, Placement.HOST), BlocksCacheKey(1, 1)
        )
        rng = np.random.default_rng(seed)
        for t in range(tensors):
            prefill.as_numpy(t)[:] = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
            decode.as_numpy(t)[:] = 0
        used = blocks // 2
        src_blocks = rng.choice(blocks, size=used, replace=False)
        block_table = rng.permutation(blocks)[:used]
        start = time.perf_counter()
        await cache_manager.swap_blocks_async(prefill, decode, dict(zip(src_blocks.tolist(), block_table.tolist())))
        seconds = time.perf_counter() - start
        for t in range(tensors):
            got, sent = decode.as_numpy(t), prefill.as_numpy(t)
            if not np.array_equal(got[block_table], sent[src_blocks]):
                raise AssertionError(f"tensor {t}: bytes differ")
            untouched = np.setdiff1d(np.arange(blocks), block_table)
            if got[untouched].any():
                raise AssertionError(f"tensor {t}: a block outside the block table was written")
        return seconds, used * block_bytes * tensors
    finally:
        datadist.finalize()


def run_demo(layers: int, blocks: int, block_bytes: int, seed: int) -> int:
    seconds, moved = asyncio.run(_move(layers, blocks, block_bytes, seed))
    print(
        f"moved {moved / (1 << 20):.1f} MiB ({layers} layers x K,V, {blocks // 2} blocks of "
        f"{block_bytes // 1024} KiB, random block table) in {seconds * 1e3:.1f} ms: "
        f"{moved / seconds / 1e9:.2f} GB/s; every byte verified"
    )
    return 0

"""C++ and Python engines moving KV blocks to each other, both directions.

    python examples/cpp/interop.py

Builds libllm_datadist, installs it under build/cpp-install, builds the two
C++ programs of this folder against the installed CMake package, then:
  1. a Python decode process receives blocks that the C++ ``cpp_prefill``
     pushes with ``PushKvBlocks``, and checks them;
  2. a Python prefill pushes blocks layer by layer (``transfer_cache_async``)
     into the C++ ``cpp_decode``, which checks them.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

import datadist_aio as dd

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
TENSORS, BLOCKS, BLOCK_BYTES = 8, 32, 4096


def kv_bytes(tensor: int, blocks: np.ndarray) -> np.ndarray:
    """kv_pattern.h's kv_byte(tensor, block, i) for each block, as (blocks, BLOCK_BYTES)."""
    i = np.arange(BLOCK_BYTES, dtype=np.int64)
    b = np.asarray(blocks, dtype=np.int64)[:, None]
    return ((tensor * 131 + b * 17 + i * 7 + (i >> 8)) & 0xFF).astype(np.uint8)


def run(*cmd: str | Path) -> None:
    subprocess.run([str(c) for c in cmd], check=True, stdout=subprocess.DEVNULL)


def build() -> Path:
    lib_build, install, examples = BUILD / "cpp", BUILD / "cpp-install", BUILD / "cpp-examples"
    run("cmake", "-S", ROOT, "-B", lib_build, "-DDATADIST_BUILD_TESTS=OFF")
    run("cmake", "--build", lib_build, "-j2")
    run("cmake", "--install", lib_build, "--prefix", install)
    run("cmake", "-S", ROOT / "examples" / "cpp", "-B", examples, f"-DCMAKE_PREFIX_PATH={install}")
    run("cmake", "--build", examples, "-j2")
    return examples


def options(listen: bool) -> dict[str, str]:
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = '{"memory_size": 67108864}'
    config.sync_kv_timeout = 5000
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()


def desc() -> dd.CacheDesc:
    return dd.CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], dd.DataType.DT_UINT8, dd.Placement.HOST)


def cpp_to_python(bin_dir: Path) -> bool:
    with dd.LLMDataDist(dd.LLMRole.DECODER, 2) as decode:
        decode.init(options(listen=True))
        cache = decode.cache_manager.allocate_blocks_cache(desc())
        for t in range(TENSORS):
            cache.as_numpy(t)[:] = 0
        run = subprocess.run([str(bin_dir / "cpp_prefill"), str(decode.listen_port), str(cache.cache_id)],
                             check=True, timeout=60, capture_output=True, text=True)
        print(f"C++ prefill -> Python decode, {run.stdout.splitlines()[0]}")  # "link: same_host" on one host
        table = np.arange(27, 19, -1)  # the C++ side sent blocks 0..7 to 27..20
        ok = True
        for t in range(TENSORS):
            got = cache.as_numpy(t)
            ok &= np.array_equal(got[table], kv_bytes(t, np.arange(8)))
            ok &= not got[np.setdiff1d(np.arange(BLOCKS), table)].any()
        return bool(ok)


class Ready(dd.LayerSynchronizer):
    def synchronize_layer(self, layer_index, timeout_in_millis):
        return True


def python_to_cpp(bin_dir: Path) -> bool:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    decode = subprocess.Popen(
        [str(bin_dir / "cpp_decode"), str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert decode.stdout is not None
    try:
        ready = decode.stdout.readline().split()
        assert ready[:2] == ["READY", str(port)], ready
        remote_cache = int(ready[2])
        with dd.LLMDataDist(dd.LLMRole.PROMPT, 1) as prefill:
            prefill.init(options(listen=False))
            cache = prefill.cache_manager.allocate_blocks_cache(desc())
            for t in range(TENSORS):
                cache.as_numpy(t)[:] = kv_bytes(t, np.arange(BLOCKS))
            cluster = dd.LLMClusterInfo()
            cluster.remote_cluster_id = 2
            cluster.append_local_ip_info("127.0.0.1", 0)
            cluster.append_remote_ip_info("127.0.0.1", port)
            status, _ = prefill.link_clusters([cluster], 5000)
            assert status is dd.LLMStatusCode.LLM_SUCCESS, status
            print(f"Python prefill -> C++ decode, link: {prefill.link_transport(2)}")
            config = dd.TransferWithCacheKeyConfig(
                dd.CacheKeyByIdAndIndex(2, remote_cache), range(TENSORS // 2), range(TENSORS // 2)
            )
            task = prefill.cache_manager.transfer_cache_async(
                cache, Ready(), [config], list(range(8)), list(range(10, 18))
            )
            asyncio.run(_await(task))
            prefill.unlink_clusters([cluster])
        out, _ = decode.communicate("done\n", timeout=60)
        return out.strip().endswith("VERIFIED") and decode.returncode == 0
    finally:
        if decode.poll() is None:
            decode.kill()


async def _await(task: dd.CacheTask) -> None:
    await task


def main() -> int:
    bin_dir = build()
    first = cpp_to_python(bin_dir)
    print(f"C++ PushKvBlocks -> Python decode: {'every byte verified' if first else 'MISMATCH'}")
    second = python_to_cpp(bin_dir)
    print(f"Python transfer_cache_async -> C++ decode: {'every byte verified' if second else 'MISMATCH'}")
    return 0 if first and second else 1


if __name__ == "__main__":
    sys.exit(main())

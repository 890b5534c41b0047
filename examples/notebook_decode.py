"""The decode side of ``examples/asyncio_notebook.ipynb``, run in a child process.

A process started with the ``spawn`` method imports the function it runs, and
a function defined in a notebook cell cannot be imported, so the decode side
lives here. ``serve`` listens on 127.0.0.1 (port 0: any free port), allocates
its KV cache, sends its port back through the pipe and then answers the
notebook's commands on the same pipe until told to stop or until the notebook's
kernel goes away (the pipe closes), finalizing its ``LLMDataDist`` either way.

Commands (tuples) and their answers (``("ok", value)`` or ``("error", text)``):

- ``("clear",)``: zeroes the whole cache.
- ``("verify", seed, src_blocks, dst_blocks)``: compares destination block
  ``dst_blocks[k]`` of every tensor with ``pattern(seed, tensor, src_blocks[k])``
  and checks that every other block is still zero; answers a ``Verdict``.
- ``("stop",)``: finalizes and exits (no answer).
"""

from __future__ import annotations

import signal
from multiprocessing.connection import Connection
from typing import TypedDict

import numpy as np

import datadist_aio as dd

DECODE = 2  # the decode side's cluster id
POOL_BYTES = 128 << 20  # the host pool of each side: room for a 64 MiB cache


class Verdict(TypedDict):
    """What ``("verify", ...)`` found."""

    bytes: int  # bytes compared and found as expected
    bad_blocks: list[tuple[int, int]]  # (tensor, destination block) that differ
    others_zero: bool  # every block not in dst_blocks still holds zeros


def kv_desc(layers: int, blocks: int, block_bytes: int) -> dd.CacheDesc:
    """A paged KV cache: K and V of each layer, ``blocks`` blocks of ``block_bytes``."""
    return dd.CacheDesc(2 * layers, [blocks, block_bytes], dd.DataType.DT_UINT8, dd.Placement.HOST)


def pattern(seed: int, tensor: int, block: int, block_bytes: int) -> np.ndarray:
    """The bytes the prefill writes into source ``block`` of ``tensor``."""
    return np.random.default_rng((seed, tensor, block)).integers(0, 256, block_bytes, dtype=np.uint8)


def verify(cache: dd.Cache, seed: int, src_blocks: list[int], dst_blocks: list[int]) -> Verdict:
    """Checks ``cache`` after ``src_blocks`` of the pattern ``seed`` went to ``dst_blocks``."""
    tensors = cache.cache_desc.num_tensors
    bad: list[tuple[int, int]] = []
    checked = 0
    for tensor in range(tensors):
        view = cache.as_numpy(tensor)
        for src, dst in zip(src_blocks, dst_blocks):
            if np.array_equal(view[dst], pattern(seed, tensor, src, view.shape[1])):
                checked += view[dst].nbytes
            else:
                bad.append((tensor, dst))
    others = sorted(set(range(cache.as_numpy(0).shape[0])) - set(dst_blocks))
    clean = all(not cache.as_numpy(tensor)[others].any() for tensor in range(tensors))
    return Verdict(bytes=checked, bad_blocks=bad, others_zero=clean)


def serve(conn: Connection, auth_key: str, layers: int, blocks: int, block_bytes: int) -> None:
    """The child process: the decode ``LLMDataDist`` and its command loop.
    ``auth_key`` is the secret both sides of the link share."""
    # Jupyter interrupts a kernel by signalling its process group, this child
    # included: an interrupted cell must not take the decode side down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = dd.LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = f'{{"memory_size": {POOL_BYTES}}}'
    config.listen_ip_info = "127.0.0.1:0"
    config.auth_key = auth_key
    try:
        with dd.LLMDataDist(dd.LLMRole.DECODER, DECODE) as decode:
            decode.init(config.generate_options())
            desc = kv_desc(layers, blocks, block_bytes)
            cache = decode.cache_manager.allocate_blocks_cache(desc, dd.BlocksCacheKey(DECODE, 0))
            for tensor in range(desc.num_tensors):
                cache.as_numpy(tensor)[:] = 0
            conn.send(("ok", decode.listen_port))
            while True:
                command, *args = conn.recv()
                if command == "stop":
                    return
                try:
                    if command == "clear":
                        for tensor in range(desc.num_tensors):
                            cache.as_numpy(tensor)[:] = 0
                        conn.send(("ok", None))
                    elif command == "verify":
                        conn.send(("ok", verify(cache, *args)))
                    else:
                        conn.send(("error", f"unknown command {command!r}"))
                except Exception as error:  # the notebook sees it instead of a silent child
                    conn.send(("error", repr(error)))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the notebook's kernel is gone: the with-block has finalized
    finally:
        conn.close()

"""The workload every engine moves, and how its bytes are checked.

A cache is ``tensors`` tensors (K and V of each layer), each ``blocks``
blocks of ``block_size`` bytes. A transfer pairs local block ``i`` of every
tensor with remote block ``table[i]`` of the same tensor, where ``table`` is
a random permutation: a push (write) copies local into remote, a pull (read)
remote into local. One batch moves the whole cache.

Both sides fill their memory from a seed before the transfer, with different
seeds, so a transfer that moves nothing (or the wrong blocks) cannot pass:
after a push the remote digest taken in table order must equal the local
digest taken in order, after a pull the reverse.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KiB = 1 << 10
MiB = 1 << 20


@dataclass(frozen=True)
class Layout:
    tensors: int
    blocks: int
    block_size: int
    seed: int = 0

    @classmethod
    def for_cache(cls, cache_bytes: int, block_size: int, layers: int, seed: int = 0) -> "Layout":
        """The layout of a ``cache_bytes`` cache of ``layers`` layers (K and V each)."""
        tensors = 2 * layers
        blocks = cache_bytes // (tensors * block_size)
        if blocks < 1:
            raise ValueError(f"a {cache_bytes}-byte cache has no room for a {block_size}-byte block "
                             f"in each of its {tensors} tensors ({layers} layers)")
        return cls(tensors, blocks, block_size, seed)

    @property
    def tensor_bytes(self) -> int:
        return self.blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.tensors * self.tensor_bytes

    def table(self) -> list[int]:
        """Remote block of each local block: a permutation fixed by the seed."""
        return np.random.default_rng(self.seed).permutation(self.blocks).tolist()


def fill(tensors: Sequence[np.ndarray], seed: int) -> None:
    """Fill each tensor (a ``[blocks, block_size]`` uint8 view) with bytes from ``seed``."""
    rng = np.random.default_rng(seed)
    for tensor in tensors:
        flat = tensor.reshape(-1)
        flat[:] = np.frombuffer(rng.bytes(flat.size), dtype=np.uint8)


def digest(tensors: Sequence[np.ndarray], order: Sequence[int] | None = None) -> str:
    """Digest of every tensor's blocks, taken in ``order`` (all blocks in order when None)."""
    h = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        view = tensor if order is None else tensor[np.asarray(order)]
        h.update(np.ascontiguousarray(view).data)
    return h.hexdigest()


def aligned_tensors(layout: Layout, alignment: int = 4096) -> tuple[np.ndarray, list[np.ndarray]]:
    """One page-aligned allocation holding every tensor; returns it and the per-tensor views."""
    raw = np.empty(layout.total_bytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    memory = raw[start : start + layout.total_bytes]
    views = [memory[t * layout.tensor_bytes : (t + 1) * layout.tensor_bytes].reshape(layout.blocks, layout.block_size)
             for t in range(layout.tensors)]
    return memory, views

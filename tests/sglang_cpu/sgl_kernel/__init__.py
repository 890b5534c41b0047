"""A pure-torch stand-in for ``sgl_kernel`` on a CPU without SGLang's CPU kernels.

SGLang's CPU path (``SGLANG_USE_CPU_ENGINE=1``) imports two ops from
``sgl_kernel``; the published wheel holds CUDA ops only. These two do the
same work with torch indexing. SGLang's CPU modules import more ops by
name at import time: any other public name is a function that raises
NotImplementedError when called (none is called on this path).
Put this folder's parent on ``PYTHONPATH`` of the SGLang processes.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__version__ = "0.0.0+datadist-aio-cpu-standin"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Row ``req_pool_indices[i]`` of ``req_to_token``, columns ``start[i]:end[i]``, takes the next
    ``end[i] - start[i]`` entries of ``out_cache_loc``."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[offset:offset + count].to(req_to_token.dtype)
        offset += count


def _rows(address: int, stride: int, rows: int) -> torch.Tensor:
    buffer = (ctypes.c_uint8 * (stride * rows)).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(rows, stride)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """In every buffer (``data_ptrs[i]``, ``strides[i]`` bytes per location), copies the
    locations ``src_loc`` to ``tgt_loc``."""
    if src_loc.numel() == 0:
        return
    src, tgt = src_loc.long(), tgt_loc.long()
    rows = int(max(int(src.max()), int(tgt.max()))) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        view = _rows(int(address), int(stride), rows)
        view[tgt] = view[src].clone()


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is not available on this CPU build")

    unavailable.__name__ = name
    return unavailable

"""vLLM's KV tensors as the connector registers them: cache groups and the layout peers are told.

A *cache group* is a set of KV tensors of one shape and dtype, registered as
one blocks cache. It is not vLLM's *KV cache group* (a block table): under
vLLM's hybrid KV cache manager several KV cache groups (sliding-window
layers beside full-attention ones, say) overlay the same tensors, each
layer of a tensor owning the blocks its KV cache group allocated. A cache
group records which KV cache groups its tensors serve (``kv_groups``), so a
load moves each KV cache group's blocks only through the tensors that hold
them.

This module imports nothing from vLLM or the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import datadist_aio as dd

from .layout import INTERIORS, GroupShape, WorkerLayout, heads_of

if TYPE_CHECKING:
    from .worker import WorkerSettings

__all__ = ["DATATYPES", "CacheGroup", "describe_kv_caches", "model_layer", "release_layers", "worker_layout"]

DATATYPES = {
    "torch.float32": dd.DataType.DT_FLOAT,
    "torch.float16": dd.DataType.DT_FLOAT16,
    "torch.bfloat16": dd.DataType.DT_BF16,
    "torch.int8": dd.DataType.DT_INT8,
    "torch.uint8": dd.DataType.DT_UINT8,
    "torch.float8_e4m3fn": dd.DataType.DT_UINT8,
    "torch.float8_e5m2": dd.DataType.DT_UINT8,
}


@dataclass
class CacheGroup:
    """KV tensors of one shape and dtype, registered as one blocks cache.

    ``block_shape`` is the shape of one block of one tensor; ``addresses``
    holds one address per tensor, layer by layer (``per_layer`` tensors each).
    ``kv_groups``: the vLLM KV cache groups whose blocks these tensors hold.
    """

    dtype: str
    block_shape: list[int]
    num_blocks: int
    per_layer: int
    addresses: list[int] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)
    kv_groups: tuple[int, ...] = (0,)
    # The model layer of each of its layers (the first layer naming each
    # tensor), read off vLLM's layer names; None where a name holds none.
    layers: list[Optional[int]] = field(default_factory=list)
    # Per tensor (not per part): the layer, by its index among vLLM's
    # layer names, that writes it for each KV cache group it serves; -1
    # where two layers of one KV cache group name it.
    writers: list[dict[int, int]] = field(default_factory=list)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every tensor of the group."""
        elements = 1
        for dim in self.block_shape:
            elements *= dim
        return elements * DATATYPES[self.dtype].itemsize * len(self.addresses)

    def layout(self) -> dict[str, Any]:
        """What must match on both sides (the block count may differ)."""
        return {
            "dtype": self.dtype,
            "block_shape": self.block_shape,
            "per_layer": self.per_layer,
            "tensors": len(self.addresses),
        }


def _split_blocks(tensor: Any, num_blocks: Optional[int]) -> tuple[list[Any], int]:
    """The block-major tensors a layer's KV tensor holds, and how many.

    A tensor whose first dimension is the block count is one tensor; one
    shaped ``[2, num_blocks, ...]`` (K and V apart) gives two.
    """
    shape = list(tensor.shape)
    if not tensor.is_contiguous():
        raise ValueError(f"KV tensor of shape {shape} is not contiguous; cannot register it in place")
    if num_blocks is None or shape[0] == num_blocks:
        return [tensor], shape[0]
    if len(shape) > 1 and shape[1] == num_blocks and shape[0] <= 4:
        return [tensor[i] for i in range(shape[0])], num_blocks
    raise ValueError(f"cannot find the block dimension ({num_blocks} blocks) in a KV tensor of shape {shape}")


def describe_kv_caches(kv_caches: Mapping[str, Any], num_blocks: Optional[int] = None,
                       layer_groups: Optional[Mapping[str, int]] = None) -> list[CacheGroup]:
    """Groups vLLM's per-layer KV tensors by shape, dtype and the KV cache
    groups they serve, in layer order.

    A tensor shared by several layers is registered once; under vLLM's
    hybrid KV cache manager the layers sharing it belong to different KV
    cache groups (``layer_groups``: layer name to KV cache group; None: one
    group, 0). Where the tensors are (host or one CUDA device) is
    ``kv_placement``'s to check.
    """
    serves: dict[int, set[int]] = {}
    writers: dict[int, dict[int, int]] = {}
    for index, (name, tensor) in enumerate(kv_caches.items()):
        kv_group = layer_groups.get(name, 0) if layer_groups is not None else 0
        serves.setdefault(tensor.data_ptr(), set()).add(kv_group)
        by_group = writers.setdefault(tensor.data_ptr(), {})
        by_group[kv_group] = -1 if kv_group in by_group else index
    groups: dict[tuple[str, tuple[int, ...], tuple[int, ...]], CacheGroup] = {}
    seen: set[int] = set()
    for name, tensor in kv_caches.items():
        dtype = str(tensor.dtype)
        if dtype not in DATATYPES:
            raise ValueError(f"KV tensor {name} has dtype {dtype}, which the connector does not map")
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        parts, blocks = _split_blocks(tensor, num_blocks)
        block_shape = list(parts[0].shape[1:])
        kv_groups = tuple(sorted(serves[tensor.data_ptr()]))
        key = (dtype, tuple(parts[0].shape), kv_groups)
        group = groups.get(key)
        if group is None:
            group = groups[key] = CacheGroup(dtype, block_shape, blocks, len(parts), kv_groups=kv_groups)
        if group.per_layer != len(parts):
            raise ValueError(f"KV tensor {name} splits into {len(parts)} tensors, others into {group.per_layer}")
        for part in parts:
            group.addresses.append(int(part.data_ptr()))
            group.keep.append(part)
        group.layers.append(model_layer(name))
        group.writers.append(writers[tensor.data_ptr()])
    return list(groups.values())


def release_layers(group: CacheGroup, kv_group: int, per_transfer_layer: int = 2) -> Optional[list[int]]:
    """When each transfer layer of ``group`` (``per_transfer_layer`` of its
    tensors, as a layer-wise transfer moves them) holds ``kv_group``'s bytes
    of a step: the index, among vLLM's layer names, of the last layer
    writing one of its tensors for that KV cache group. None where the
    tensors do not split into transfer layers or a tensor has no single
    writer in the group."""
    parts = len(group.addresses)
    if parts == 0 or parts % per_transfer_layer or len(group.writers) * group.per_layer != parts:
        return None
    layers: list[int] = []
    for first in range(0, parts, per_transfer_layer):
        names = [group.writers[part // group.per_layer].get(kv_group, -1)
                 for part in range(first, first + per_transfer_layer)]
        if min(names) < 0:
            return None
        layers.append(max(names))
    return layers


def model_layer(name: str) -> Optional[int]:
    """The model layer a vLLM attention layer's name holds (``model.layers.7.self_attn.attn``: 7), where
    exactly one of its dot-separated parts is a number; None otherwise."""
    numbers = [part for part in name.split(".") if part.isdigit()]
    return int(numbers[0]) if len(numbers) == 1 else None


def worker_layout(groups: list[CacheGroup], settings: "WorkerSettings") -> WorkerLayout:
    """This worker's KV layout, as its peers are told it.

    The block interior is read off each group's block shape against the
    heads this rank holds and the block size: ``[heads, tokens, channels]``
    is ``HNC``, or ``settings.head_major`` (``HKTV`` for vLLM's CPU
    backend), ``[tokens, channels]`` with MLA is ``NC``, ``[tokens, heads,
    channels]`` is ``NHC``. Where the settings do
    not give the heads or the block size, a 3-D block is taken as ``HNC``
    and a 2-D one as ``NC``.
    """
    first = groups[0].block_shape if groups else []
    kv_heads, block_size = settings.kv_heads, settings.block_size
    if settings.mla or (not kv_heads and len(first) == 2):
        kv_heads = 1
    elif not kv_heads:
        kv_heads = first[0] * settings.tp_size if len(first) == 3 else 1
    if not block_size:
        block_size = first[1] if len(first) == 3 else first[0] if len(first) == 2 else 1
    local_heads = len(heads_of(settings.rank, settings.tp_size, kv_heads))
    shapes = []
    for group in groups:
        shape = tuple(group.block_shape)
        if len(shape) == 3 and shape[:2] == (local_heads, block_size) and not settings.mla:
            interior = settings.head_major or "HNC"
        elif len(shape) == 2 and shape[0] == block_size and kv_heads == 1:
            interior = "NC"
        elif len(shape) == 3 and shape[:2] == (block_size, local_heads) and not settings.mla:
            interior = "NHC"
        else:
            interior = "opaque"
        assert interior in INTERIORS
        layers: tuple[int, ...] = ()
        if settings.pp_size > 1:
            # A stage holds a slice of the model's layers: which, by name.
            if None in group.layers or len(set(group.layers)) != len(group.layers):
                raise ValueError(
                    f"with pipeline parallelism the connector reads each KV tensor's model layer off its layer "
                    f"name; cannot for the tensors of {group.layers!r:.200}")
            layers = tuple(int(x) for x in group.layers if x is not None)
        shapes.append(GroupShape(group.dtype, shape, group.per_layer, len(group.addresses), interior,
                                 group.kv_groups, layers))
    return WorkerLayout(settings.tp_size, settings.rank, kv_heads, block_size, tuple(shapes),
                        pp_size=settings.pp_size, pp_rank=settings.pp_rank, stages=tuple(settings.stages))

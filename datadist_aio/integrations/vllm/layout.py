"""How a worker holds its KV cache, and how one worker's blocks map onto another's.

A prefill and a decode instance may differ in tensor-parallel size (each
rank holds a share of the KV heads), in block size (tokens per block) and in
pipeline-parallel size (each stage holds a slice of the model's layers).
Each worker describes itself with a ``WorkerLayout``, sent in the side
channel's hello; the decode side computes, once per prefill rank, which of
that rank's heads it reads into which of its own (``HeadMap``), from which
stage and into which of its layers (``map_stages``), and per load the byte
ranges that move (``plan_ranges``).

Block interiors, by the shape of one block of one tensor:

- ``"HNC"``: ``[heads, tokens, channels]``. A head's slice of a block is
  contiguous, so a share of the heads is one range per block, and so is a
  run of tokens of one head.
- ``"HKTV"``: vLLM's CPU backend. Its block is shaped ``[heads, tokens,
  2 * head_dim]`` but holds, per head, the keys transposed (``[head_dim,
  tokens]``) and then the values (``[tokens, head_dim]``). A head's slice
  is contiguous as in ``HNC``; a run of tokens of one head is one range of
  values and one strided range of keys (a piece of each of its rows).
- ``"NHC"``: ``[tokens, heads, channels]``, the layout of vLLM's GPU
  attention backends (K and V each a tensor). A share of the heads of a
  run of tokens is one strided range: a piece of every token.
- ``"NC"``: ``[tokens, channels]``, one latent vector per token (MLA): the same
  on every rank, read from one prefill rank.
- Anything else (``"opaque"``): only the same shape on both sides maps
  (whole blocks).

Rows are ``(src_block, src_offset, dst_block, dst_offset, length, count,
src_stride, dst_stride)``, as ``CacheManager.pull_block_ranges`` takes them:
``count`` pieces of ``length`` bytes, each ``src_stride`` and ``dst_stride``
bytes after the one before.

The SGLang transfer backend maps its pages with the same functions
(``integrations/sglang/buffers.py``: its page of one layer is ``NHC``).

This module imports nothing from vLLM or the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

__all__ = ["GroupShape", "HeadMap", "LayoutError", "WorkerLayout", "heads_of", "map_heads", "map_stages",
           "plan_ranges"]

_DTYPE_BYTES = {
    "torch.float32": 4,
    "torch.float16": 2,
    "torch.bfloat16": 2,
    "torch.int8": 1,
    "torch.uint8": 1,
    "torch.float8_e4m3fn": 1,
    "torch.float8_e5m2": 1,
}
INTERIORS = ("HNC", "HKTV", "NC", "NHC", "opaque")
_HEAD_MAJOR = ("HNC", "HKTV")
# The axis of a block's shape that counts its heads, by interior.
_HEADS_AXIS = {"HNC": 0, "HKTV": 0, "NHC": 1}


class LayoutError(ValueError):
    """No mapping exists between two workers' KV layouts; the message names both."""


_MAX_LAYERS = 1 << 20


@dataclass(frozen=True)
class GroupShape:
    """One cache group: its dtype, the shape of one block of one tensor, tensors per layer, tensors in all,
    the vLLM KV cache groups (block tables) whose blocks its tensors hold, and the model layer each of its
    layers is (``layers``; empty: 0, 1, 2, ..., as in an instance without pipeline parallelism)."""

    dtype: str
    block_shape: tuple[int, ...]
    per_layer: int
    tensors: int
    interior: str = "opaque"
    kv_groups: tuple[int, ...] = (0,)
    layers: tuple[int, ...] = ()

    def layer_ids(self) -> tuple[int, ...]:
        """The model layer of each of the group's layers (``tensors // per_layer`` of them), in order."""
        return self.layers or tuple(range(self.tensors // self.per_layer))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one tensor."""
        return int(np.prod(self.block_shape, dtype=np.int64)) * _DTYPE_BYTES.get(self.dtype, 1)


@dataclass(frozen=True)
class WorkerLayout:
    """What a worker tells its peers about its KV cache."""

    tp_size: int
    tp_rank: int
    kv_heads: int  # the model's KV heads, all ranks together (1 for MLA)
    block_size: int  # tokens per block
    groups: tuple[GroupShape, ...]
    # Pipeline parallelism: the stages, this worker's, and the model layers
    # [start, end) every stage holds (empty where not known).
    pp_size: int = 1
    pp_rank: int = 0
    stages: tuple[tuple[int, int], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """The layout as the hello carries it; without pipeline parallelism, as before it existed."""
        wire: dict[str, Any] = {
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "kv_heads": self.kv_heads,
            "block_size": self.block_size,
            "groups": [
                {"dtype": g.dtype, "block_shape": list(g.block_shape), "per_layer": g.per_layer,
                 "tensors": g.tensors, "interior": g.interior, "kv_groups": list(g.kv_groups),
                 **({"layers": list(g.layers)} if g.layers else {})}
                for g in self.groups
            ],
        }
        if self.pp_size > 1:
            wire.update(pp_size=self.pp_size, pp_rank=self.pp_rank, stages=[list(s) for s in self.stages])
        return wire

    @classmethod
    def from_wire(cls, value: Any) -> "WorkerLayout":
        """A peer's layout from its hello; ValueError if it is malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"a KV layout must be an object, got {type(value).__name__}")
        numbers = {}
        for name in ("tp_size", "tp_rank", "kv_heads", "block_size"):
            number = value.get(name)
            if type(number) is not int or not 0 <= number < 1 << 31:
                raise ValueError(f"KV layout field {name} must be a non-negative int, got {number!r:.40}")
            numbers[name] = number
        if numbers["tp_size"] < 1 or numbers["tp_rank"] >= numbers["tp_size"] or numbers["block_size"] < 1:
            raise ValueError(f"KV layout {value!r:.200} is inconsistent")
        groups = value.get("groups")
        if not isinstance(groups, list) or not 0 < len(groups) <= 64:
            raise ValueError("KV layout field groups must be a list of 1 to 64 groups")
        shapes = []
        for group in groups:
            if not isinstance(group, dict):
                raise ValueError("a KV layout group must be an object")
            shape = group.get("block_shape")
            if (not isinstance(shape, list) or not 0 < len(shape) <= 8
                    or not all(type(d) is int and 0 < d < 1 << 31 for d in shape)):
                raise ValueError(f"block_shape must be a list of positive ints, got {shape!r:.80}")
            per_layer, tensors = group.get("per_layer"), group.get("tensors")
            if type(per_layer) is not int or type(tensors) is not int or not 0 < per_layer <= tensors < 1 << 20:
                raise ValueError("per_layer and tensors must be positive ints, per_layer <= tensors")
            dtype, interior = group.get("dtype"), group.get("interior", "opaque")
            if dtype not in _DTYPE_BYTES or interior not in INTERIORS:
                raise ValueError(f"unknown dtype {dtype!r:.40} or interior {interior!r:.20}")
            kv_groups = group.get("kv_groups", [0])
            if (not isinstance(kv_groups, list) or not 0 < len(kv_groups) <= 64
                    or not all(type(k) is int and 0 <= k < 64 for k in kv_groups)
                    or kv_groups != sorted(set(kv_groups))):
                raise ValueError(f"kv_groups must be a sorted list of distinct KV cache group indices, "
                                 f"got {kv_groups!r:.80}")
            layers = group.get("layers", [])
            if (not isinstance(layers, list) or (layers and len(layers) != tensors // per_layer)
                    or not all(type(x) is int and 0 <= x < _MAX_LAYERS for x in layers)
                    or len(set(layers)) != len(layers)):
                raise ValueError(f"layers must list the distinct model layer of each of the group's "
                                 f"{tensors // per_layer} layers, got {layers!r:.80}")
            shapes.append(GroupShape(dtype, tuple(shape), per_layer, tensors, interior, tuple(kv_groups),
                                     tuple(layers)))
        pp_size, pp_rank, stages = value.get("pp_size", 1), value.get("pp_rank", 0), value.get("stages", [])
        if type(pp_size) is not int or type(pp_rank) is not int or not 0 <= pp_rank < pp_size <= 1024:
            raise ValueError(f"pp_size and pp_rank must be ints, 0 <= pp_rank < pp_size <= 1024, got "
                             f"{pp_size!r:.20} and {pp_rank!r:.20}")
        if (not isinstance(stages, list) or (stages and len(stages) != pp_size)
                or not all(isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
                           and 0 <= r[0] < r[1] <= _MAX_LAYERS for r in stages)
                or any(a[1] != b[0] for a, b in zip(stages, stages[1:]))):
            raise ValueError(f"stages must list each of the {pp_size} stages' model layers [start, end), "
                             f"contiguous and in order, got {stages!r:.120}")
        return cls(groups=tuple(shapes), pp_size=pp_size, pp_rank=pp_rank,
                   stages=tuple((r[0], r[1]) for r in stages), **numbers)

    @property
    def hybrid(self) -> bool:
        """Whether its tensors serve more than one vLLM KV cache group (hybrid KV cache manager)."""
        return any(g.kv_groups != (0,) for g in self.groups)

    def describe(self) -> str:
        """One line for messages: TP, block size, heads and block shapes."""
        groups = "; ".join(f"{g.interior} {list(g.block_shape)} {g.dtype} x{g.tensors}"
                           + (f" KV groups {list(g.kv_groups)}" if g.kv_groups != (0,) else "") for g in self.groups)
        text = (f"TP {self.tp_rank}/{self.tp_size}, block size {self.block_size}, {self.kv_heads} KV heads "
                f"[{groups}]")
        if self.pp_size > 1:
            held = sorted({x for g in self.groups for x in g.layer_ids()})
            stages = ", ".join(f"{a}-{b - 1}" for a, b in self.stages)
            text = (f"PP stage {self.pp_rank}/{self.pp_size} holding model layers {_spans(held)}"
                    + (f" (stages: {stages})" if stages else "") + ", " + text)
        return text

    def model_layers(self) -> int:
        """How many layers the whole model has, as far as this worker knows (its stages', else its own)."""
        if self.stages:
            return self.stages[-1][1]
        return max((max(g.layer_ids(), default=-1) for g in self.groups), default=-1) + 1


def _spans(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    spans: list[list[int]] = []
    for x in layers:
        if spans and spans[-1][1] + 1 == x:
            spans[-1][1] = x
        else:
            spans.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"


def heads_of(rank: int, tp_size: int, kv_heads: int) -> range:
    """The KV heads rank ``rank`` of ``tp_size`` holds (replicated when there are fewer heads than ranks)."""
    if kv_heads >= tp_size:
        share = kv_heads // tp_size
        return range(rank * share, (rank + 1) * share)
    head = rank * kv_heads // tp_size
    return range(head, head + 1)


@dataclass(frozen=True)
class HeadMap:
    """What one decode rank reads from one prefill rank, the same for every block.

    ``runs``: per cache group, ``(src_head, dst_head, count)`` runs of heads
    (local indices on each side); ``whole``: per group, whether the blocks
    map one to one, byte for byte (same shape, all heads, same block size).
    """

    src_rank: int
    runs: tuple[tuple[tuple[int, int, int], ...], ...]
    whole: tuple[bool, ...]
    # Pipeline parallelism: the prefill's stage of ``src_rank``, and per
    # cache group the ``(src_layer, dst_layer, count)`` runs of layers read
    # from it (indices into each side's layers of that group); None: every
    # layer into the same index (neither instance has stages).
    stage: int = 0
    layers: Optional[tuple[tuple[tuple[int, int, int], ...], ...]] = None


def _mismatch(mine: WorkerLayout, theirs: WorkerLayout, why: str) -> LayoutError:
    return LayoutError(f"cannot map the prefill's KV layout ({theirs.describe()}) onto this decode worker's "
                       f"({mine.describe()}): {why}")


def map_heads(mine: WorkerLayout, theirs: WorkerLayout,
              ranks: Optional[Sequence[int]] = None) -> dict[int, HeadMap]:
    """The prefill ranks this decode worker reads from, and what it reads from each.

    ``theirs`` is any one rank's layout of the prefill instance (the others
    differ only in ``tp_rank``). Where several prefill ranks hold a head
    (replicated heads, MLA's latent), the choice is spread over this
    worker's rank; ``ranks`` restricts it to those prefill ranks (a peer
    whose own rank mapping pairs this worker with some ranks only, as
    SGLang's). Raises ``LayoutError`` naming both layouts where no mapping
    exists.
    """
    if mine.kv_heads != theirs.kv_heads:
        raise _mismatch(mine, theirs, f"{theirs.kv_heads} KV heads against {mine.kv_heads}: not the same model")
    if len(mine.groups) != len(theirs.groups):
        raise _mismatch(mine, theirs, f"{len(theirs.groups)} cache groups against {len(mine.groups)}")
    small, large = sorted((mine.block_size, theirs.block_size))
    if large % small:
        raise _mismatch(mine, theirs, f"block sizes {theirs.block_size} and {mine.block_size}: neither divides "
                                      "the other")
    staged = mine.pp_size > 1 or theirs.pp_size > 1  # each side's share of the layers: map_stages checks them
    for ours, peer in zip(mine.groups, theirs.groups):
        if (ours.dtype, ours.per_layer) != (peer.dtype, peer.per_layer) or (
                not staged and ours.tensors != peer.tensors):
            raise _mismatch(mine, theirs, "dtypes or tensors per layer differ")
        if ours.kv_groups != peer.kv_groups:
            raise _mismatch(mine, theirs, "the KV cache groups differ (is the hybrid KV cache manager on for one "
                                          "instance only?)")
    if mine.hybrid and mine.block_size != theirs.block_size:
        raise _mismatch(mine, theirs, "several KV cache groups (a hybrid model) map only between equal block sizes")
    kv_heads = mine.kv_heads
    same_tp = mine.tp_size == theirs.tp_size
    maps: dict[int, list[list[tuple[int, int, int]]]] = {}
    whole: dict[int, list[bool]] = {}
    mine_heads = heads_of(mine.tp_rank, mine.tp_size, kv_heads)
    for index, (ours, peer) in enumerate(zip(mine.groups, theirs.groups)):
        if ours.interior == "NC" and peer.interior == "NC":
            if ours.block_shape[1:] != peer.block_shape[1:]:
                raise _mismatch(mine, theirs, "latent widths differ")
            # One latent tensor, the same on every rank: read from one rank.
            sources = {mine.tp_rank % theirs.tp_size if ranks is None else min(ranks): [(0, 0, 1)]}
        elif ours.interior in _HEADS_AXIS and peer.interior == ours.interior:
            axis = _HEADS_AXIS[ours.interior]
            if len(ours.block_shape) != 3 or len(peer.block_shape) != 3 or ours.block_shape[2] != peer.block_shape[2]:
                raise _mismatch(mine, theirs, "head widths differ")
            if ours.block_shape[axis] != len(mine_heads):
                raise _mismatch(mine, theirs, f"this worker's blocks hold {ours.block_shape[axis]} heads, "
                                              f"its share is {len(mine_heads)}")
            sources = {}
            for dst, head in enumerate(mine_heads):
                holders = [q for q in (range(theirs.tp_size) if ranks is None else ranks)
                           if head in heads_of(q, theirs.tp_size, kv_heads)]
                if not holders:
                    raise _mismatch(mine, theirs, f"KV head {head} is held by none of the prefill ranks "
                                                  f"{list(ranks or ())} paired with this worker")
                q = holders[mine.tp_rank % len(holders)]
                src = head - heads_of(q, theirs.tp_size, kv_heads).start
                if peer.block_shape[axis] != len(heads_of(q, theirs.tp_size, kv_heads)):
                    raise _mismatch(mine, theirs, f"the prefill's blocks hold {peer.block_shape[axis]} heads")
                runs = sources.setdefault(q, [])
                if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
                else:
                    runs.append((src, dst, 1))
        elif ours.block_shape == peer.block_shape and same_tp and mine.block_size == theirs.block_size:
            # A layout only mapped as is: whole blocks from the same rank.
            sources = {mine.tp_rank: [(0, 0, 1)]}
        else:
            raise _mismatch(mine, theirs, f"block interiors {peer.interior} and {ours.interior} map only when "
                                          "the TP sizes, block sizes and shapes are all equal")
        heads_axis = _HEADS_AXIS.get(ours.interior)
        for q, runs in sources.items():
            per_group = maps.setdefault(q, [[] for _ in mine.groups])
            per_group[index] = runs
            flags = whole.setdefault(q, [False] * len(mine.groups))
            flags[index] = (ours.block_shape == peer.block_shape and mine.block_size == theirs.block_size
                            and (heads_axis is None or runs == [(0, 0, ours.block_shape[heads_axis])]))
    return {q: HeadMap(q, tuple(tuple(r) for r in groups), tuple(whole[q])) for q, groups in sorted(maps.items())}


def map_stages(mine: WorkerLayout, stages: Mapping[int, WorkerLayout],
               ranks: Optional[Sequence[int]] = None) -> dict[tuple[int, int], HeadMap]:
    """The prefill workers this decode worker reads from, by ``(stage, TP
    rank)``, and what it reads from each: its heads (``map_heads``) and,
    where either instance has pipeline stages, which of the stage's layers
    go into which of its own.

    ``stages`` holds one rank's layout of every stage of the prefill (one
    layout, stage 0, without pipeline parallelism). Every model layer this
    worker holds is read from the one stage that holds it. Raises
    ``LayoutError`` naming both layouts where the stages do not pair: a
    stage missing or announced twice, stages that disagree on their number,
    TP size or layer split, a layer held by no stage or by two, another
    model's layer count, several KV cache groups (a hybrid model) with
    stages on either side.
    """
    if not stages:
        raise ValueError("map_stages needs the layout of at least one prefill stage")
    first = stages[min(stages)]
    if mine.pp_size == 1 and first.pp_size == 1 and list(stages) == [0]:
        return {(0, q): head_map for q, head_map in map_heads(mine, first, ranks).items()}

    def refuse(why: str, theirs: WorkerLayout = first) -> LayoutError:
        return _mismatch(mine, theirs, f"pipeline stages: {why}")

    pp = first.pp_size
    if sorted(stages) != list(range(pp)):
        raise refuse(f"the prefill has {pp} stages; layouts came from stages {sorted(stages)}")
    for s, theirs in stages.items():
        if (theirs.pp_size, theirs.pp_rank, theirs.tp_size) != (pp, s, first.tp_size):
            raise refuse(f"its stage {s} says PP stage {theirs.pp_rank} of {theirs.pp_size} with TP "
                         f"{theirs.tp_size}, its stage {first.pp_rank} PP size {pp} with TP {first.tp_size}",
                         theirs)
        if theirs.stages != first.stages:
            raise refuse(f"its stages {s} and {first.pp_rank} split the model's layers differently", theirs)
        if len(theirs.groups) != len(mine.groups):
            raise refuse(f"{len(theirs.groups)} cache groups against {len(mine.groups)}", theirs)
        if theirs.hybrid or mine.hybrid:
            raise refuse("several KV cache groups (a hybrid model) are not mapped across pipeline stages",
                         theirs)
    theirs_total = max(theirs.model_layers() for theirs in stages.values())
    if first.stages:
        theirs_total = first.stages[-1][1]
    mine_total = mine.model_layers()
    if mine.stages and theirs_total != mine_total:
        raise refuse(f"the prefill's model has {theirs_total} layers, this worker's {mine_total}: "
                     "not the same model")
    layers: dict[int, list[list[tuple[int, int, int]]]] = {s: [[] for _ in mine.groups] for s in stages}
    for index, ours in enumerate(mine.groups):
        where: dict[int, tuple[int, int]] = {}  # model layer: (stage, its index in that stage's group)
        for s, theirs in sorted(stages.items()):
            for position, layer in enumerate(theirs.groups[index].layer_ids()):
                if layer in where:
                    raise refuse(f"model layer {layer} is held by stages {where[layer][0]} and {s}", theirs)
                where[layer] = (s, position)
        if not mine.stages and max(where, default=-1) != max(ours.layer_ids(), default=-1):
            raise refuse(f"the prefill holds model layers {_spans(sorted(where))}, this worker "
                         f"{_spans(ours.layer_ids())}: not the same model")
        for dst, layer in enumerate(ours.layer_ids()):
            if layer not in where:
                raise refuse(f"model layer {layer} of this worker is held by no prefill stage (they hold "
                             f"{_spans(sorted(where))})")
            s, src = where[layer]
            runs = layers[s][index]
            if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((src, dst, 1))
    maps: dict[tuple[int, int], HeadMap] = {}
    for s, per_group in sorted(layers.items()):
        if not any(per_group):
            continue  # nothing of this worker's layers is there
        for q, head_map in map_heads(mine, stages[s], ranks).items():
            maps[(s, q)] = dataclasses.replace(head_map, stage=s, layers=tuple(tuple(runs) for runs in per_group))
    return maps


def _rows(src_block: np.ndarray, src_offset: Any, dst_block: np.ndarray, dst_offset: Any, length: int,
          count: int = 1, src_stride: int = 0, dst_stride: int = 0) -> np.ndarray:
    """Rows of ``plan_ranges``, one per chunk; scalars repeat down the column."""
    columns = [src_block, src_offset, dst_block, dst_offset, length, count, src_stride, dst_stride]
    return np.stack([np.broadcast_to(np.asarray(c, dtype=np.int64), src_block.shape) for c in columns], axis=1)


def plan_ranges(
    head_map: HeadMap,
    group: int,
    mine: WorkerLayout,
    theirs: WorkerLayout,
    src_blocks: list[int],
    dst_blocks: list[int],
    first_token: int,
) -> Optional[np.ndarray]:
    """The byte ranges of one load for one group, as rows ``(src_block,
    src_offset, dst_block, dst_offset, length, count, src_stride,
    dst_stride)``; None when this group reads nothing from this rank.

    ``src_blocks`` are the prefill's blocks of the whole prompt;
    ``dst_blocks`` the decode's blocks from token ``first_token`` on (a
    multiple of the decode's block size: the tokens before it were found
    in the local prefix cache).
    """
    runs = head_map.runs[group]
    if not runs:
        return None
    ours, peer = mine.groups[group], theirs.groups[group]
    n_src, n_dst = theirs.block_size, mine.block_size
    chunk = min(n_src, n_dst)
    # Both ends are multiples of the chunk: every range is one chunk of tokens.
    tokens = min(len(src_blocks) * n_src - first_token, len(dst_blocks) * n_dst)
    if tokens <= 0:
        return None
    starts = first_token + np.arange(0, tokens, chunk, dtype=np.int64)
    sb = np.asarray(src_blocks, dtype=np.int64)[starts // n_src]
    db = np.asarray(dst_blocks, dtype=np.int64)[(starts - first_token) // n_dst]
    s_tok, d_tok = starts % n_src, starts % n_dst  # the chunk's first token in each block
    item = _DTYPE_BYTES.get(ours.dtype, 1)
    rows = []
    if ours.interior == "NHC":
        # [tokens, heads, channels]: a run of heads is a piece of every token.
        head = ours.block_shape[2] * item
        src_token, dst_token = peer.block_shape[1] * head, ours.block_shape[1] * head
        for src, dst, count in runs:
            if count * head == src_token == dst_token:  # whole tokens on both sides: contiguous
                rows.append(_rows(sb, s_tok * src_token, db, d_tok * dst_token, chunk * src_token))
            else:
                rows.append(_rows(sb, s_tok * src_token + src * head, db, d_tok * dst_token + dst * head,
                                  count * head, chunk, src_token, dst_token))
    elif ours.interior in _HEAD_MAJOR:
        token = ours.block_bytes // (ours.block_shape[0] * n_dst)  # one head, one token
        src_head, dst_head = n_src * token, n_dst * token  # one head, one block
        for src, dst, count in runs:
            if n_src == n_dst:  # consecutive heads are one range per block
                rows.append(_rows(sb, src * src_head, db, dst * dst_head, count * src_head))
            elif ours.interior == "HNC":  # a run of tokens of each head: one range per head, strided by heads
                rows.append(_rows(sb, src * src_head + s_tok * token, db, dst * dst_head + d_tok * token,
                                  chunk * token, count, src_head, dst_head))
            else:  # HKTV: the values as in HNC, the keys a piece of each of a head's head_dim rows
                half = token // 2
                rows.append(_rows(sb, src * src_head + n_src * half + s_tok * half, db,
                                  dst * dst_head + n_dst * half + d_tok * half, chunk * half, count, src_head, dst_head))
                for k in range(count):
                    rows.append(_rows(sb, (src + k) * src_head + s_tok * item, db, (dst + k) * dst_head + d_tok * item,
                                      chunk * item, half // item, n_src * item, n_dst * item))
    else:  # a latent block, or whole blocks of another interior
        token = ours.block_bytes // n_dst
        rows.append(_rows(sb, s_tok * token, db, d_tok * token, chunk * token))
    out = np.concatenate(rows) if len(rows) > 1 else rows[0]
    return np.ascontiguousarray(out, dtype=np.uint64)

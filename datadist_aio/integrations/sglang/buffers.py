"""How an SGLang worker's transfer buffers become blocks caches, and how two workers' buffers are matched.

SGLang hands a transfer backend flat lists of buffers: one address, byte
length and item length per buffer (``KVArgs.kv_data_ptrs`` / ``_lens`` /
``_item_lens``, and the same for the aux buffers and, for hybrid
sliding-window models, the window layers' buffers as state). An item is one
KV page of one layer (K or V, or MLA's one latent buffer; kinds ``kv`` and,
the sliding-window layers', ``swa``), or one row of an aux buffer (a
request's first token and its metadata). Each buffer is
registered in place as a tensor of ``[items, item_len]`` bytes; buffers of
the same item length and item count form one blocks cache, so a request's
pages move with one pull per cache, every layer at once, and page ``p`` of
every tensor of a cache is block ``p``.

Both sides describe their groups (``BufferLayout``); the decode side pairs
the prefill's with its own before its first pull (``pair_with``): the same
page size, groups in the same order, the same buffers and aux item lengths
(the item counts may differ: each side sized its own pool). A KV page of
one layer is ``[page_size, heads, head_dim]`` (the ``NHC`` interior of the
vLLM connector's head mapping, ``integrations/vllm/layout.py``), the
rank's share of the model's KV heads; MLA's is ``[page_size, latent]``,
the same on every rank. Where the attention TP sizes differ, one divides
the other and the decode worker reads from each prefill rank SGLang pairs
it with the heads it needs: a piece of every token of a page, one strided
range per page (``Pairing.pulls``). A layout that does not pair raises
``LayoutMismatch`` naming both.

This module imports nothing from SGLang or the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..vllm.layout import GroupShape, HeadMap, LayoutError, WorkerLayout, heads_of, map_heads, plan_ranges

__all__ = ["BufferGroup", "BufferLayout", "LayoutMismatch", "Pairing", "Pull", "group_buffers", "paired_ranks"]

KINDS = ("kv", "aux", "swa")
# Kinds whose pages hold the rank's share of the KV heads: the head mapping applies to them.
HEAD_KINDS = ("kv", "swa")


class LayoutMismatch(ValueError):
    """Two workers' transfer buffers cannot be paired; the message names both layouts."""


@dataclass(frozen=True)
class BufferGroup:
    """Buffers of one kind, item length and item count: one blocks cache.

    ``members`` are the buffers' positions in SGLang's list of that kind.
    """

    kind: str
    item_len: int
    items: int
    members: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "item_len": self.item_len, "items": self.items, "members": list(self.members)}


def group_buffers(kind: str, addresses: Sequence[int], lengths: Sequence[int],
                  item_lens: Sequence[int]) -> list[BufferGroup]:
    """Groups one kind's buffers by (item length, item count), in the order they first appear.

    ValueError for lists of different lengths, an item length that is not
    positive, or a buffer whose length is not a whole number of items.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not len(addresses) == len(lengths) == len(item_lens):
        raise ValueError(f"{kind} buffers: {len(addresses)} addresses, {len(lengths)} lengths and "
                         f"{len(item_lens)} item lengths")
    order: list[tuple[int, int]] = []
    members: dict[tuple[int, int], list[int]] = {}
    for index, (address, length, item_len) in enumerate(zip(addresses, lengths, item_lens)):
        if type(item_len) is not int or item_len <= 0:
            raise ValueError(f"{kind} buffer {index}: item length must be a positive int, got {item_len!r}")
        if type(length) is not int or length <= 0 or length % item_len:
            raise ValueError(f"{kind} buffer {index}: {length!r} bytes is not a whole number of "
                             f"{item_len}-byte items")
        if type(address) is not int or address <= 0:
            raise ValueError(f"{kind} buffer {index}: address must be a positive int, got {address!r}")
        key = (item_len, length // item_len)
        if key not in members:
            order.append(key)
            members[key] = []
        members[key].append(index)
    return [BufferGroup(kind, item_len, items, tuple(members[(item_len, items)])) for item_len, items in order]


def paired_ranks(decode_tp: int, decode_rank: int, prefill_tp: int) -> range:
    """The prefill attention-TP ranks SGLang's common receiver pairs a decode rank with
    (``CommonKVManager._resolve_rank_mapping``): one where the decode's TP is at
    least the prefill's, else a run of ``prefill_tp // decode_tp``."""
    if decode_tp >= prefill_tp:
        q = decode_rank // (decode_tp // prefill_tp)
        return range(q, q + 1)
    share = prefill_tp // decode_tp
    return range(decode_rank * share, (decode_rank + 1) * share)


@dataclass(frozen=True)
class BufferLayout:
    """What a worker tells its peer about its buffers: page size, attention TP, the model's
    KV heads (all ranks together; ``latent``: MLA, one latent buffer per layer), its groups."""

    page_size: int
    tp_size: int
    tp_rank: int
    kv_heads: int
    groups: tuple[BufferGroup, ...]
    latent: bool = False
    # Pipeline parallelism: this worker's stage of ``pp_size``, whose KV
    # buffers hold the model's layers from ``start_layer`` on (a prefill's;
    # SGLang lists a stage's K buffers, then its V buffers, or with MLA one
    # latent buffer a layer).
    pp_rank: int = 0
    pp_size: int = 1
    start_layer: int = 0

    def of_kind(self, kind: str) -> list[tuple[int, BufferGroup]]:
        """(index among all groups, group) of one kind."""
        return [(index, group) for index, group in enumerate(self.groups) if group.kind == kind]

    def head_groups(self) -> list[tuple[int, BufferGroup]]:
        """(index among all groups, group) of the kinds that hold heads: the KV groups, then the
        sliding-window ones (hybrid SWA models), the order of the head mapping's positions."""
        return [entry for kind in HEAD_KINDS for entry in self.of_kind(kind)]

    def to_wire(self) -> dict[str, Any]:
        return {"page_size": self.page_size, "tp_size": self.tp_size, "tp_rank": self.tp_rank,
                "kv_heads": self.kv_heads, "latent": self.latent,
                "groups": [group.to_wire() for group in self.groups],
                "pp_rank": self.pp_rank, "pp_size": self.pp_size, "start_layer": self.start_layer}

    @classmethod
    def from_wire(cls, value: Any) -> "BufferLayout":
        """A peer's layout; ValueError if it is malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"a buffer layout must be an object, got {type(value).__name__}")
        numbers = {}
        for name in ("page_size", "tp_size", "tp_rank", "kv_heads"):
            number = value.get(name)
            if type(number) is not int or not 0 <= number < 1 << 31:
                raise ValueError(f"buffer layout field {name} must be a non-negative int, got {number!r:.40}")
            numbers[name] = number
        for name, default in (("pp_rank", 0), ("pp_size", 1), ("start_layer", 0)):  # absent: no stages
            number = value.get(name, default)
            if type(number) is not int or not 0 <= number < 1 << 20:
                raise ValueError(f"buffer layout field {name} must be a non-negative int, got {number!r:.40}")
            numbers[name] = number
        if (numbers["page_size"] < 1 or numbers["tp_size"] < 1 or numbers["kv_heads"] < 1
                or numbers["tp_rank"] >= numbers["tp_size"] or numbers["pp_size"] < 1
                or numbers["pp_rank"] >= numbers["pp_size"]):
            raise ValueError(f"buffer layout {value!r:.200} is inconsistent")
        latent = value.get("latent")
        if type(latent) is not bool:
            raise ValueError(f"buffer layout field latent must be a bool, got {latent!r:.40}")
        groups = value.get("groups")
        if not isinstance(groups, list) or not 0 < len(groups) <= 4096:
            raise ValueError("buffer layout field groups must be a list of 1 to 4096 groups")
        parsed = []
        for group in groups:
            if not isinstance(group, dict) or group.get("kind") not in KINDS:
                raise ValueError(f"a buffer group must be an object with kind in {KINDS}")
            item_len, items, members = group.get("item_len"), group.get("items"), group.get("members")
            if (type(item_len) is not int or type(items) is not int
                    or not 0 < item_len < 1 << 40 or not 0 < items < 1 << 40):
                raise ValueError("a buffer group's item_len and items must be positive ints")
            if (not isinstance(members, list) or not 0 < len(members) <= 1 << 16
                    or not all(type(m) is int and 0 <= m < 1 << 20 for m in members)):
                raise ValueError("a buffer group's members must be a list of buffer positions")
            parsed.append(BufferGroup(group["kind"], item_len, items, tuple(members)))
        return cls(groups=tuple(parsed), latent=latent, **numbers)

    def describe(self) -> str:
        """One line for messages."""
        groups = "; ".join(f"{g.kind} {len(g.members)}x{g.item_len} B" for g in self.groups)
        heads = "MLA latent" if self.latent else f"{self.kv_heads} KV heads"
        stage = (f"PP {self.pp_rank}/{self.pp_size} from layer {self.start_layer}, " if self.pp_size > 1 else "")
        return f"{stage}TP {self.tp_rank}/{self.tp_size}, page size {self.page_size}, {heads} [{groups}]"

    def kv_layers(self) -> int:
        """The model layers this worker's KV buffers hold."""
        buffers = sum(len(group.members) for _, group in self.of_kind("kv"))
        return buffers if self.latent else buffers // 2

    def head_layout(self) -> WorkerLayout:
        """The KV groups as the head mapping sees them: a page of one buffer is ``[page_size,
        heads, bytes of a head]`` (``NHC``, this rank's share of the heads) or, MLA, ``[page_size,
        bytes of a token]`` (``NC``). ValueError where an item is not cut so."""
        local = 1 if self.latent else len(heads_of(self.tp_rank, self.tp_size, self.kv_heads))
        shapes = []
        for _, group in self.head_groups():
            token, rest = divmod(group.item_len, self.page_size)
            head, rest_of_token = divmod(token, local)
            if rest or rest_of_token:
                raise ValueError(f"{group.kind} items of {group.item_len} B are not {self.page_size} tokens of "
                                 f"{local} heads")
            shape = (self.page_size, token) if self.latent else (self.page_size, local, head)
            shapes.append(GroupShape("torch.uint8", shape, 1, len(group.members), "NC" if self.latent else "NHC"))
        return WorkerLayout(self.tp_size, self.tp_rank, 1 if self.latent else self.kv_heads, self.page_size,
                            tuple(shapes))

    def pair_with(self, prefill: "BufferLayout") -> "Pairing":
        """What this (decode) worker reads from the prefill rank whose layout is ``prefill``;
        ``LayoutMismatch`` naming both layouts where they do not pair."""
        def mismatch(why: str) -> LayoutMismatch:
            return LayoutMismatch(f"cannot pair the prefill's buffers ({prefill.describe()}) with this decode "
                                  f"worker's ({self.describe()}): {why}")

        if prefill.page_size != self.page_size:
            raise mismatch(f"page sizes {prefill.page_size} and {self.page_size} differ")
        if max(prefill.tp_size, self.tp_size) % min(prefill.tp_size, self.tp_size):
            raise mismatch(f"TP sizes {prefill.tp_size} and {self.tp_size}: neither divides the other")
        if prefill.latent != self.latent:
            raise mismatch("one is MLA, the other not")
        for side in (prefill, self):
            if not side.latent and side.kv_heads % side.tp_size and side.tp_size % side.kv_heads:
                raise mismatch(f"{side.kv_heads} KV heads do not share out over TP {side.tp_size}")
        if len(prefill.groups) != len(self.groups):
            raise mismatch(f"{len(prefill.groups)} buffer groups against {len(self.groups)}")
        if prefill.pp_size > 1 and self.pp_size > 1 and (prefill.pp_size, prefill.pp_rank) != (self.pp_size,
                                                                                                self.pp_rank):
            raise mismatch(f"pipeline stage {prefill.pp_rank} of {prefill.pp_size} against stage {self.pp_rank} of "
                           f"{self.pp_size}: a decode with stages reads its own stage's")
        spans = self._stage_spans(prefill, mismatch) if prefill.pp_size > 1 and self.pp_size == 1 else None
        same_tp = prefill.tp_size == self.tp_size
        for index, (theirs, ours) in enumerate(zip(prefill.groups, self.groups)):
            item_lens_pair = theirs.item_len == ours.item_len or (ours.kind in HEAD_KINDS and not same_tp)
            members_pair = theirs.members == ours.members or (spans is not None and spans[index] is not None)
            if theirs.kind != ours.kind or not members_pair or not item_lens_pair:
                raise mismatch(f"{theirs.kind} buffers {list(theirs.members)[:8]} of {theirs.item_len} B items "
                               f"against {ours.kind} buffers {list(ours.members)[:8]} of {ours.item_len} B")
        # The heads are mapped as if the stage held every layer (its buffers are the decode's, head for head).
        heads_of_prefill = prefill if spans is None else dataclasses.replace(
            prefill, groups=tuple(dataclasses.replace(theirs, members=ours.members)
                                  for theirs, ours in zip(prefill.groups, self.groups)))
        try:
            mine, theirs_heads = self.head_layout(), heads_of_prefill.head_layout()
            maps = map_heads(mine, theirs_heads, paired_ranks(self.tp_size, self.tp_rank, prefill.tp_size))
        except (LayoutError, ValueError) as exc:
            raise mismatch(str(exc)) from None
        return Pairing(self, prefill, mine, theirs_heads, maps.get(prefill.tp_rank), frozenset(maps),
                       tuple(spans) if spans is not None else None)

    def _stage_spans(self, prefill: "BufferLayout", mismatch: Any) -> list[Optional[tuple[tuple[int, int, int], ...]]]:
        """Where a prefill stage's KV buffers go among this (decode) worker's, which holds every
        layer: per group, ``(first tensor of the stage's cache, first tensor of ours, count)``
        runs (None for groups that pair whole: aux). Raises ``mismatch(why)``."""
        if prefill.of_kind("swa"):
            raise mismatch("sliding-window buffers of a prefill with pipeline stages are not mapped")
        stage, layers, start = prefill.kv_layers(), self.kv_layers(), prefill.start_layer
        buffers = sum(len(group.members) for _, group in prefill.of_kind("kv"))
        if stage == 0 or (not prefill.latent and buffers % 2) or start + stage > layers:
            raise mismatch(f"the stage's {stage} layers from layer {start} do not fall within this worker's "
                           f"{layers}")
        if (prefill.pp_rank == 0 and start != 0) or (prefill.pp_rank == prefill.pp_size - 1
                                                     and start + stage != layers):
            raise mismatch(f"stage {prefill.pp_rank} of {prefill.pp_size} holds layers {start} to "
                           f"{start + stage - 1}, which does not begin or end this worker's {layers}")
        spans: list[Optional[tuple[tuple[int, int, int], ...]]] = []
        for theirs, ours in zip(prefill.groups, self.groups):
            if theirs.kind != "kv" or theirs.kind != ours.kind:
                spans.append(None)
                continue
            runs: list[tuple[int, int, int]] = []
            for tensor, member in enumerate(theirs.members):
                # K buffers first, then V (one latent buffer a layer with MLA), each in layer order.
                half, layer = divmod(member, stage) if not prefill.latent else (0, member)
                try:
                    target = ours.members.index(half * layers + start + layer)
                except ValueError:
                    raise mismatch(f"the stage's kv buffer {member} has no place among this worker's "
                                   f"{list(ours.members)[:8]}") from None
                if runs and runs[-1][0] + runs[-1][2] == tensor and runs[-1][1] + runs[-1][2] == target:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
                else:
                    runs.append((tensor, target, 1))
            spans.append(tuple(runs))
        return spans


def _page_pair(what: str, src_pages: Sequence[int], dst_pages: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} prefill {what}pages against {len(dst_pages)} decode {what}pages")
    return tuple(int(p) for p in src_pages), tuple(int(p) for p in dst_pages)


@dataclass(frozen=True)
class Pull:
    """One pull of a chunk into the blocks cache of group ``group``: whole pages
    ``src_blocks`` into ``dst_blocks`` (``rows`` None), or byte ranges inside pages (``rows``,
    as ``CacheManager.pull_block_ranges_async`` takes them); ``nbytes`` over all its buffers."""

    group: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    rows: Optional[np.ndarray]
    nbytes: int
    # A prefill stage's cache into ours: ``(first tensor of its cache, first of
    # ours, count)`` runs, each a pull of its own; None: tensor for tensor.
    spans: Optional[tuple[tuple[int, int, int], ...]] = None


@dataclass(frozen=True)
class Pairing:
    """What a decode worker (``mine``) reads from one prefill rank (``theirs``).

    ``head_map``: the heads it reads from that rank, None where it reads no
    KV from it (another rank holds its heads); ``sources``: every prefill
    rank it reads KV from, for the request to count as arrived.
    """

    mine: BufferLayout
    theirs: BufferLayout
    mine_heads: WorkerLayout
    theirs_heads: WorkerLayout
    head_map: Optional[HeadMap]
    sources: frozenset[int]
    # Per group, where a prefill stage's tensors go among ours (``Pull.spans``); None: no stages.
    stage_spans: Optional[tuple[Optional[tuple[tuple[int, int, int], ...]], ...]] = None

    def pulls(self, src_pages: Sequence[int], dst_pages: Sequence[int],
              aux: Optional[tuple[int, int]] = None,
              swa: Optional[tuple[Sequence[int], Sequence[int]]] = None) -> list[Pull]:
        """The pulls of one chunk: the prefill's pages ``src_pages`` into the decode's
        ``dst_pages`` (the same count), the aux row ``(src, dst)`` where given, and the
        sliding-window pages ``(src, dst)`` (hybrid SWA models' last chunk: the window's pages
        of each side's SWA pool, the same count) where given."""
        pages = {"kv": _page_pair("", src_pages, dst_pages), "swa": _page_pair("sliding-window ", *(swa or ((), ())))}
        out = []
        for position, (index, group) in enumerate(self.mine.head_groups()):
            src, dst = pages[group.kind]
            head_map = self.head_map if src else None
            if head_map is None or not head_map.runs[position]:
                continue
            spans = self.stage_spans[index] if self.stage_spans is not None else None
            tensors = sum(count for _, _, count in spans) if spans is not None else len(group.members)
            if head_map.whole[position]:
                out.append(Pull(index, src, dst, None, len(src) * group.item_len * tensors, spans))
                continue
            rows = plan_ranges(head_map, position, self.mine_heads, self.theirs_heads, list(src), list(dst), 0)
            if rows is not None:
                nbytes = int((rows[:, 4] * rows[:, 5]).sum()) * tensors
                out.append(Pull(index, src, dst, rows, nbytes, spans))
        if aux is not None:
            for index, group in self.mine.of_kind("aux"):
                out.append(Pull(index, (aux[0],), (aux[1],), None, group.item_len * len(group.members)))
        return out

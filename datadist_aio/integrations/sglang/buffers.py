"""How an SGLang worker's transfer buffers become blocks caches, and how two workers' buffers are matched.

SGLang hands a transfer backend flat lists of buffers: one address, byte
length and item length per buffer (``KVArgs.kv_data_ptrs`` / ``_lens`` /
``_item_lens``, and the same for the aux buffers). An item is one KV page
of one layer (K or V, or MLA's one latent buffer), or one row of an aux
buffer (a request's first token and its metadata). Each buffer is
registered in place as a tensor of ``[items, item_len]`` bytes; buffers of
the same item length and item count form one blocks cache, so a request's
pages move with one pull per cache, every layer at once, and page ``p`` of
every tensor of a cache is block ``p``.

Both sides describe their groups (``BufferLayout``); the decode side
checks the prefill's against its own before its first pull: the same
groups in the same order, the same item lengths and tensor counts (the
item counts may differ: each side sized its own pool). A layout that does
not match raises ``LayoutMismatch`` naming both.

This module imports nothing from SGLang or the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BufferGroup", "BufferLayout", "LayoutMismatch", "group_buffers"]

KINDS = ("kv", "aux")


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


@dataclass(frozen=True)
class BufferLayout:
    """What a worker tells its peer about its buffers: page size, TP, and its groups."""

    page_size: int
    tp_size: int
    tp_rank: int
    groups: tuple[BufferGroup, ...]

    def of_kind(self, kind: str) -> list[tuple[int, BufferGroup]]:
        """(index among all groups, group) of one kind."""
        return [(index, group) for index, group in enumerate(self.groups) if group.kind == kind]

    def to_wire(self) -> dict[str, Any]:
        return {"page_size": self.page_size, "tp_size": self.tp_size, "tp_rank": self.tp_rank,
                "groups": [group.to_wire() for group in self.groups]}

    @classmethod
    def from_wire(cls, value: Any) -> "BufferLayout":
        """A peer's layout; ValueError if it is malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"a buffer layout must be an object, got {type(value).__name__}")
        numbers = {}
        for name in ("page_size", "tp_size", "tp_rank"):
            number = value.get(name)
            if type(number) is not int or not 0 <= number < 1 << 31:
                raise ValueError(f"buffer layout field {name} must be a non-negative int, got {number!r:.40}")
            numbers[name] = number
        if numbers["page_size"] < 1 or numbers["tp_size"] < 1 or numbers["tp_rank"] >= numbers["tp_size"]:
            raise ValueError(f"buffer layout {value!r:.200} is inconsistent")
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
        return cls(groups=tuple(parsed), **numbers)

    def describe(self) -> str:
        """One line for messages."""
        groups = "; ".join(f"{g.kind} {len(g.members)}x{g.item_len} B" for g in self.groups)
        return f"TP {self.tp_rank}/{self.tp_size}, page size {self.page_size} [{groups}]"

    def check_pairs_with(self, prefill: "BufferLayout") -> None:
        """Raises ``LayoutMismatch`` unless this (decode) worker can read ``prefill``'s pages as its own.

        Differing TP sizes are not mapped yet: their KV items differ in length.
        """
        def mismatch(why: str) -> LayoutMismatch:
            return LayoutMismatch(f"cannot pair the prefill's buffers ({prefill.describe()}) with this decode "
                                  f"worker's ({self.describe()}): {why}")

        if prefill.page_size != self.page_size:
            raise mismatch(f"page sizes {prefill.page_size} and {self.page_size} differ")
        if prefill.tp_size != self.tp_size:
            raise mismatch(f"TP sizes {prefill.tp_size} and {self.tp_size} differ (not supported yet)")
        if len(prefill.groups) != len(self.groups):
            raise mismatch(f"{len(prefill.groups)} buffer groups against {len(self.groups)}")
        for theirs, ours in zip(prefill.groups, self.groups):
            if (theirs.kind, theirs.item_len, theirs.members) != (ours.kind, ours.item_len, ours.members):
                raise mismatch(f"{theirs.kind} buffers {list(theirs.members)[:8]} of {theirs.item_len} B items "
                               f"against {ours.kind} buffers {list(ours.members)[:8]} of {ours.item_len} B")

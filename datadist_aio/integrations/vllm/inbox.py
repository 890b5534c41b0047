"""The staging blocks a decode side lends to prefill sides for layer-wise pushes.

A prefill computes a request before the decode side has allocated blocks for
it, so it cannot push into the request's own blocks. The decode side
registers an inbox (a blocks cache of ``num_blocks`` blocks, the layout of
its KV cache) and grants each prefill that asks a share of it, a contiguous
range. The prefill picks blocks of its share for a request and claims them
before it pushes; the decode side grants a claim only for free blocks of
that prefill's share, so a push never lands in blocks another request still
holds. After the last layer is acknowledged the prefill commits the claim;
the decode side copies committed blocks into the request's own blocks when
it loads the request, then frees them.

States of a claim: ``CLAIMED`` (bytes may still arrive), ``COMMITTED`` (all
layers landed), ``IN_USE`` (being copied out). A claim whose prefill never
committed or aborted is dropped once its hold time has passed; blocks in use
are never dropped.

``Inbox`` (decode side) and ``Share`` (prefill side) hold no I/O and take one
lock each, so either thread of a worker may call them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

__all__ = ["CLAIMED", "COMMITTED", "IN_USE", "Inbox", "Share"]

CLAIMED, COMMITTED, IN_USE = "claimed", "committed", "in_use"


@dataclass
class _Claim:
    blocks: list[int]
    state: str
    expires: float


class Inbox:
    """The decode side's table of inbox blocks: shares, claims, their states.

    Claims are keyed by (prefill engine id, the prefill's request id).
    """

    def __init__(self, num_blocks: int, share_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks <= 0 or share_blocks <= 0:
            raise ValueError(f"inbox_blocks ({num_blocks}) and inbox_share_blocks ({share_blocks}) must be > 0")
        self.num_blocks = num_blocks
        self.share_blocks = share_blocks
        self._clock = clock
        self._lock = threading.Lock()
        self._shares: dict[str, tuple[int, int]] = {}
        self._claims: dict[tuple[str, str], _Claim] = {}
        self._owner: dict[int, tuple[str, str]] = {}

    def grant(self, peer: str, wanted: int) -> tuple[int, int]:
        """The share of ``peer``: (first block, count); count 0 when none is left.

        A peer asking again (a restarted prefill) keeps its range and loses
        its claims that are not being copied out.
        """
        with self._lock:
            share = self._shares.get(peer)
            if share is None:
                used = sum(count for _, count in self._shares.values())
                count = max(0, min(int(wanted), self.share_blocks, self.num_blocks - used))
                share = self._shares[peer] = (used, count)
            else:
                for key in [key for key, claim in self._claims.items() if key[0] == peer and claim.state != IN_USE]:
                    self._drop(key)
            return share

    def claim(self, peer: str, req_id: str, blocks: list[int], hold_s: float) -> bool:
        """Lends ``blocks`` of ``peer``'s share to one request; False if any is
        outside the share or held, or the request already has a claim."""
        with self._lock:
            self._expire()
            first, count = self._shares.get(peer, (0, 0))
            key = (peer, req_id)
            if not blocks or key in self._claims or len(set(blocks)) != len(blocks):
                return False
            if any(not first <= block < first + count or block in self._owner for block in blocks):
                return False
            self._claims[key] = _Claim(list(blocks), CLAIMED, self._clock() + hold_s)
            for block in blocks:
                self._owner[block] = key
            return True

    def commit(self, peer: str, req_id: str) -> bool:
        """Every layer of a claimed request landed."""
        with self._lock:
            claim = self._claims.get((peer, req_id))
            if claim is None or claim.state != CLAIMED:
                return False
            claim.state = COMMITTED
            return True

    def abort(self, peer: str, req_id: str) -> None:
        """The prefill gave up pushing a request: its blocks are free again."""
        with self._lock:
            claim = self._claims.get((peer, req_id))
            if claim is not None and claim.state == CLAIMED:
                self._drop((peer, req_id))

    def state(self, peer: str, req_id: str) -> Optional[str]:
        with self._lock:
            claim = self._claims.get((peer, req_id))
            return claim.state if claim is not None else None

    def take(self, peer: str, req_id: str) -> Optional[list[int]]:
        """The blocks of a committed request, now in use (None if not committed)."""
        with self._lock:
            claim = self._claims.get((peer, req_id))
            if claim is None or claim.state != COMMITTED:
                return None
            claim.state = IN_USE
            return list(claim.blocks)

    def finish(self, peer: str, req_id: str) -> None:
        """The decode side is done with a request: frees its blocks, unless
        its push may still be landing (claimed, never committed), which the
        hold time frees."""
        with self._lock:
            claim = self._claims.get((peer, req_id))
            if claim is not None and claim.state != CLAIMED:
                self._drop((peer, req_id))

    def held(self) -> int:
        """Blocks held by claims in any state."""
        with self._lock:
            return len(self._owner)

    def _expire(self) -> None:
        now = self._clock()
        for key in [key for key, claim in self._claims.items() if claim.state != IN_USE and claim.expires <= now]:
            self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        claim = self._claims.pop(key)
        for block in claim.blocks:
            self._owner.pop(block, None)


class Share:
    """The prefill side's view of its share: which blocks it has handed out.

    The decode side's ``Inbox`` is the authority: a block free here may still
    be held there, and the claim then fails (the request is pulled instead).
    """

    def __init__(self, first: int, count: int) -> None:
        self.first = first
        self.count = count
        self._lock = threading.Lock()
        self._free = list(range(first + count - 1, first - 1, -1))

    def allocate(self, count: int) -> Optional[list[int]]:
        """``count`` blocks, or None when fewer are free."""
        with self._lock:
            if count <= 0 or count > len(self._free):
                return None
            blocks = [self._free.pop() for _ in range(count)]
            return blocks

    def free(self, blocks: list[int]) -> None:
        with self._lock:
            self._free.extend(reversed(blocks))

    def available(self) -> int:
        with self._lock:
            return len(self._free)

"""Checks of two linked peers (support.peer) that several suites run: bytes
pushed and pulled both ways, the path a link took, the listener's
connections."""

from __future__ import annotations

import time

import numpy as np

import datadist_aio as dd
from support.peer import MiB, Peer

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS


def blocks_desc(blocks: int = 16, block: int = 4096) -> dd.CacheDesc:
    return dd.CacheDesc(4, [blocks, block], dd.DataType.DT_UINT8, dd.Placement.HOST)


def assert_both_ways(x: Peer, y: Peer, model_ids: tuple[int, int], seed: int) -> None:
    """x pushes and pulls blocks of y's cache, then y of x's: bytes checked."""
    for src, dst, model_id in ((x, y, model_ids[0]), (y, x, model_ids[1])):
        local = src.allocate(blocks_desc(), blocks=True)
        remote = dst.allocate(blocks_desc(), blocks=True, model_id=model_id)
        sent = src.fill(local, seed)
        assert src.cm_async("push_blocks", remote.blocks_key(), local, [0, 3, 4, 5], [9, 1, 2, 3]) == [SUCCESS]
        got = dst.read(remote)
        for t in range(4):
            for s, d in [(0, 9), (3, 1), (4, 2), (5, 3)]:
                np.testing.assert_array_equal(got[t][d * 4096 : (d + 1) * 4096], sent[t][s * 4096 : (s + 1) * 4096])
        back = src.allocate(blocks_desc(), blocks=True)
        assert src.cm_async("pull_blocks", remote.blocks_key(), back, [1, 2, 3], [10, 11, 12]) == [SUCCESS]
        pulled = src.read(back)
        for t in range(4):
            np.testing.assert_array_equal(pulled[t][10 * 4096 : 13 * 4096], sent[t][3 * 4096 : 6 * 4096])


def accepted_connections(port: int) -> int:
    """Established connections on loopback whose local end is `port` (the listener's side)."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if int(row[1].split(":")[1], 16) == port and row[3] == "01")



def wait_for_path(peer: Peer, other: int, path: str, seconds: float = 30.0) -> bool:
    """True once ``peer`` reports ``path`` toward ``other``: the accepting end
    learns that it may use the same-host path from the link's first frame."""
    deadline = time.monotonic() + seconds
    while peer.datadist("link_transport", other) != path:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True



def big_desc() -> dd.CacheDesc:
    """256 MiB in one layer: two tensors of one 128 MiB slot."""
    return dd.CacheDesc(2, [1, 128 * MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)


def small_desc() -> dd.CacheDesc:
    return dd.CacheDesc(2, [16, 256], dd.DataType.DT_UINT8, dd.Placement.HOST)


def assert_blocks_push(src: Peer, dst: Peer, model_id: int, seed: int) -> None:
    local = src.allocate(small_desc(), blocks=True)
    remote = dst.allocate(small_desc(), blocks=True, model_id=model_id)
    sent = src.fill(local, seed)
    src.cm_async("push_blocks", remote.blocks_key(), local, [1, 2, 7], [15, 0, 3])
    got = dst.read(remote)
    for t in range(2):
        for s, d in [(1, 15), (2, 0), (7, 3)]:
            np.testing.assert_array_equal(got[t][d * 256 : (d + 1) * 256], sent[t][s * 256 : (s + 1) * 256])


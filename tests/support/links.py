"""Checks of two linked peers (support.peer) that several suites run: bytes
pushed and pulled both ways, the path a link took, the listener's
connections."""

from __future__ import annotations

import time

import numpy as np

import datadist_aio as dd
from support.peer import MiB, Peer, raises_status

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINK_LOST = (dd.LLMStatusCode.LLM_LINK_FAILED, dd.LLMStatusCode.LLM_TIMEOUT)


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


def kill_mid_transfer(survivor: Peer, victim: Peer, third: Peer, direction: str, timeout_ms: int) -> None:
    """``survivor`` pushes or pulls (``direction``) a big_desc cache to or
    from ``victim``, killed meanwhile, while it pushes blocks to ``third``:
    the transfer fails (link lost, or timed out) within ``timeout_ms`` and
    10 s, the bystander's push lands, and ``third`` takes another after."""
    local, remote = survivor.allocate(big_desc()), victim.allocate(big_desc())
    side = survivor.allocate(small_desc(), blocks=True)
    side_remote = third.allocate(small_desc(), blocks=True, model_id=5)
    side_sent = survivor.fill(side, 1)

    doomed = survivor.start_task(f"{direction}_cache", remote.key(), local)
    # Another peer's transfer in flight at the same time is not affected.
    bystander = survivor.start_task("push_blocks", side_remote.blocks_key(), side, [0, 1], [8, 9])
    assert not survivor.task_done(doomed), "the transfer ended before the peer was killed; make it bigger"
    killed_at = time.monotonic()
    victim.kill()
    with raises_status(*LINK_LOST):
        survivor.wait_task(doomed)
    elapsed = time.monotonic() - killed_at
    assert elapsed < timeout_ms / 1000 + 10, f"the transfer failed {elapsed:.2f} s after the kill"

    assert survivor.wait_task(bystander) == [SUCCESS]
    got = third.read(side_remote)
    for t in range(2):
        np.testing.assert_array_equal(got[t][8 * 256 : 10 * 256], side_sent[t][: 2 * 256])
    assert_blocks_push(survivor, third, 6, 2)

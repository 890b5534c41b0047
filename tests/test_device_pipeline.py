"""Device-to-device transfers of 1 GiB over a same-host link, on the CUDA
driver stand-in (tests/cuda_standin, not NVIDIA's driver): the owner serves
the frames naming the initiator's exported device memory without a thread
waiting for the copies. Each frame's copies are queued on a stream and
answered from the stream's callback once they land, so the next frames'
copies are queued meanwhile; frames of device memory carry no bytes and go
up to 256 MiB (inline frames: 64 MiB).

What is asserted, from both ends' link counters: how many frames went by
CUDA IPC, that at least two had copies in flight at the owner at once, that
every one was answered from the stream and that no owner thread waited for
a stream; and every byte, checked where it landed. The stand-in's streams
run their copies on threads of their own, so copies really are in flight
while the owner reads the next frame.

An owner that cannot open the exports has such a frame sent again inline:
as frames the wire carries inline, each staged, every byte checked.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from support.device import (  # noqa: E402
    INITIATOR,
    OWNER,
    _engine as _shared_engine,
    _recv,
    run_pair,
    standin,  # noqa: F401  (the fixture)
)
from datadist_aio.bench.cuda_driver import CudaDriver  # noqa: E402

TENSORS = 2
BLOCK = 4 << 20
BLOCKS = 128  # 2 tensors x 128 blocks x 4 MiB: 1 GiB a cache
FRAME = 256 << 20  # the most a frame of device exports names
INLINE_FRAME = 64 << 20  # the most a frame carries
MODEL = 3
# The stand-in's device memory per process: a 1 GiB cache and room to spare.
MEMORY = {"STANDIN_CUDA_MEMORY_MB": "1536"}


def _pattern(seed: int, tensor: int) -> np.ndarray:
    """A tensor's bytes: every 8 bytes differ by position, seed and tensor (cheap to make for 512 MiB)."""
    words = np.arange(BLOCKS * BLOCK // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words += np.uint64(seed * 1000003 + tensor)
    return words.view(np.uint8)


def _engine(role: Any, cluster_id: int, listen: bool) -> Any:
    """An engine with a host pool for a 1 GiB cache, over "auto"."""
    return _shared_engine(role, cluster_id, "auto", listen, pool_bytes=TENSORS * BLOCKS * BLOCK + (64 << 20),
                          timeout_ms=20000)


def _desc(placement: str) -> Any:
    import datadist_aio as dd

    where = dd.Placement.DEVICE if placement == "device" else dd.Placement.HOST
    return dd.CacheDesc(TENSORS, [BLOCKS, BLOCK], dd.DataType.DT_UINT8, where)


class Cache:
    """One blocks cache of this process, filled and checked whole."""

    def __init__(self, cm: Any, cuda: CudaDriver, placement: str, key: Any = None) -> None:
        self.cm, self.cuda, self.placement = cm, cuda, placement
        self.cache = cm.allocate_blocks_cache(_desc(placement), key)

    def fill(self, seed: int) -> None:
        for t, addr in enumerate(self.cache.tensor_addrs):
            data = _pattern(seed, t)
            if self.placement == "device":
                self.cuda.write(addr, data)
            else:
                self.cache.as_numpy(t).reshape(-1)[:] = data

    def mismatch(self, seed: int) -> str:
        """Empty when the cache holds `seed`'s bytes; else where it does not."""
        for t, addr in enumerate(self.cache.tensor_addrs):
            if self.placement == "device":
                got = self.cuda.read(addr, BLOCKS * BLOCK)
            else:
                got = self.cache.as_numpy(t).reshape(-1)
            differ = np.flatnonzero(got != _pattern(seed, t))
            if differ.size:
                return f"tensor {t}: {differ.size} bytes differ, the first at {differ[0]}"
        return ""

    def free(self) -> None:
        self.cm.deallocate_blocks_cache(self.cache)


def owner_holds_device_and_host(conn: Any) -> None:
    """A device and a host blocks cache of 1 GiB each; fills, checks and counts when asked."""
    import datadist_aio as dd

    cuda = CudaDriver()
    datadist = _engine(dd.LLMRole.PROMPT, OWNER, listen=True)
    cm = datadist.cache_manager
    caches = {p: Cache(cm, cuda, p, dd.BlocksCacheKey(OWNER, MODEL + i)) for i, p in enumerate(("device", "host"))}
    conn.send(datadist.listen_port)
    while True:
        command, *args = _recv(conn)
        if command == "fill":
            caches[args[0]].fill(args[1])
            conn.send("filled")
        elif command == "check":
            conn.send(caches[args[0]].mismatch(args[1]))
        elif command == "stats":
            conn.send(datadist._engine.link_stats(INITIATOR))
        else:
            break
    for cache in caches.values():
        cache.free()
    datadist.finalize()


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after}


def initiator_pushes_and_pulls_a_gib(conn: Any) -> None:
    import datadist_aio as dd

    cuda = CudaDriver()
    port = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, listen=False)
    cluster = dd.LLMClusterInfo()
    cluster.remote_cluster_id = OWNER
    cluster.append_remote_ip_info("127.0.0.1", port)
    cluster.append_local_ip_info("127.0.0.1", 0)
    ret, rets = datadist.link_clusters([cluster], 10000)
    assert ret == dd.LLMStatusCode.LLM_SUCCESS and rets == [dd.LLMStatusCode.LLM_SUCCESS], rets
    assert datadist.link_transport(OWNER) == "same_host"
    cm = datadist.cache_manager
    mine = Cache(cm, cuda, "device")
    every = list(range(BLOCKS))
    frames = TENSORS * BLOCKS * BLOCK // FRAME

    def stats() -> tuple[dict[str, int], dict[str, int]]:
        conn.send(("stats",))
        return datadist._engine.link_stats(OWNER), _recv(conn)

    def moved(what: str, theirs: str, before: Any) -> None:
        after = stats()
        ours, owner = _delta(before[0], after[0]), _delta(before[1], after[1])
        seen = f"{what}: this end {ours}, the owner {owner}"
        # Every frame went by CUDA IPC, none staged, each of the largest
        # size (the owner copied device memory of the initiator's).
        assert ours["ipc_frames"] == frames and ours["staged_frames"] == 0, seen
        assert ours["ipc_fallbacks"] == 0, seen
        assert owner["ipc_bytes_served"] == TENSORS * BLOCKS * BLOCK, seen
        assert owner["device_frames_served"] == frames, seen
        # Answered from the stream, every one; no owner thread waited for it.
        assert owner["device_answers_from_stream"] == frames, seen
        assert owner["device_stream_waits"] == 0, seen
        # The owner read the next frames while copies were in flight.
        assert after[1]["device_frames_in_flight_max"] >= 2, seen

    # Push device to device: 1 GiB, then check it landed whole.
    mine.fill(11)
    before = stats()
    cm.push_blocks(dd.BlocksCacheKey(OWNER, MODEL), mine.cache, every, every)
    moved("push, device to device", "device", before)
    conn.send(("check", "device", 11))
    assert _recv(conn) == "", "push, device to device"

    # Pull device to device: the owner copies into the initiator's memory.
    conn.send(("fill", "device", 12))
    assert _recv(conn) == "filled"
    before = stats()
    cm.pull_blocks(dd.BlocksCacheKey(OWNER, MODEL), mine.cache, every, every)
    moved("pull, device to device", "device", before)
    assert mine.mismatch(12) == "", "pull, device to device"

    # Push into the owner's host memory: large frames of device exports copied to host.
    mine.fill(13)
    before = stats()
    cm.push_blocks(dd.BlocksCacheKey(OWNER, MODEL + 1), mine.cache, every, every)
    moved("push, device to host", "host", before)
    conn.send(("check", "host", 13))
    assert _recv(conn) == "", "push, device to host"

    conn.send(("done",))
    mine.free()
    datadist.finalize()


@pytest.mark.timeout(450)
def test_a_gib_device_to_device_is_served_from_the_stream(standin: Path) -> None:  # noqa: F811
    # Three GiB moved and read back on the stand-in's host copies: minutes on a loaded 2-core machine.
    run_pair(standin, owner_holds_device_and_host, initiator_pushes_and_pulls_a_gib,
             owner_env=MEMORY, initiator_env=MEMORY, timeout_s=400)


# -- an owner that cannot open the exports ---------------------------------------------------------------

SPLIT_BLOCKS = 32  # 2 tensors x 32 blocks x 4 MiB: 256 MiB, one frame of device exports


def _split_desc(placement: str) -> Any:
    import datadist_aio as dd

    where = dd.Placement.DEVICE if placement == "device" else dd.Placement.HOST
    return dd.CacheDesc(TENSORS, [SPLIT_BLOCKS, BLOCK], dd.DataType.DT_UINT8, where)


def owner_without_a_driver(conn: Any) -> None:
    """A host blocks cache of 256 MiB, and no CUDA driver to open the initiator's exports with."""
    import datadist_aio as dd

    datadist = _engine(dd.LLMRole.PROMPT, OWNER, listen=True)
    cm = datadist.cache_manager
    cache = cm.allocate_blocks_cache(_split_desc("host"), dd.BlocksCacheKey(OWNER, MODEL))
    conn.send(datadist.listen_port)
    while True:
        command, *args = _recv(conn)
        if command == "fill":
            for t in range(TENSORS):
                cache.as_numpy(t).reshape(-1)[:] = _pattern(args[0], t)[: SPLIT_BLOCKS * BLOCK]
            conn.send("filled")
        elif command == "check":
            differ = [int(np.count_nonzero(cache.as_numpy(t).reshape(-1) != _pattern(args[0], t)[: SPLIT_BLOCKS * BLOCK]))
                      for t in range(TENSORS)]
            conn.send(differ)
        elif command == "stats":
            conn.send(datadist._engine.link_stats(INITIATOR))
        else:
            break
    cm.deallocate_blocks_cache(cache)
    datadist.finalize()


def initiator_has_a_big_frame_sent_again_inline(conn: Any) -> None:
    import datadist_aio as dd
    from support.peer import cluster_info

    cuda = CudaDriver()
    port = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, listen=False)
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == dd.LLMStatusCode.LLM_SUCCESS
    cm = datadist.cache_manager
    mine = cm.allocate_blocks_cache(_split_desc("device"))
    every = list(range(SPLIT_BLOCKS))
    size = SPLIT_BLOCKS * BLOCK
    for t, addr in enumerate(mine.tensor_addrs):
        cuda.write(addr, _pattern(21, t)[:size])
    key = dd.BlocksCacheKey(OWNER, MODEL)
    # One frame of 256 MiB naming this end's exports, refused by the owner,
    # then sent again inline as four frames of 64 MiB, staged.
    cm.push_blocks(key, mine, every, every)
    conn.send(("check", 21))
    assert _recv(conn) == [0] * TENSORS, "the push sent again inline"
    stats = datadist._engine.link_stats(OWNER)
    assert stats["ipc_frames"] == 1 and stats["ipc_fallbacks"] == 1, stats
    assert stats["staged_frames"] == TENSORS * size // INLINE_FRAME, stats
    # Later operations on the link go inline at once, in the usual frames.
    conn.send(("fill", 22))
    assert _recv(conn) == "filled"
    cm.pull_blocks(key, mine, every, every)
    for t, addr in enumerate(mine.tensor_addrs):
        got = cuda.read(addr, size)
        assert np.array_equal(got, _pattern(22, t)[:size]), f"tensor {t} of the pull after the fallback"
    later = datadist._engine.link_stats(OWNER)
    assert later["ipc_frames"] == 1 and later["staged_frames"] > stats["staged_frames"], later
    conn.send(("stats",))
    assert _recv(conn)["ipc_bytes_served"] == 0
    conn.send(("quit",))
    cm.deallocate_blocks_cache(mine)
    datadist.finalize()


@pytest.mark.timeout(300)
def test_a_frame_of_exports_the_owner_cannot_open_goes_again_in_frames_the_wire_carries(standin: Path) -> None:  # noqa: F811
    run_pair(standin, owner_without_a_driver, initiator_has_a_big_frame_sent_again_inline,
             owner_env={"DATADIST_AIO_CUDA_DRIVER": "/nonexistent/libcuda.so.1"}, initiator_env=MEMORY, timeout_s=240)

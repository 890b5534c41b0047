"""Memory of the driver's virtual memory management (cuMemCreate), as
torch's expandable segments make it, moved between two engines of one host
on the driver stand-in: legacy CUDA IPC cannot export it, so each physical
allocation a frame touches goes to the owner as a POSIX file descriptor,
which the owner takes out of the initiator's process (pidfd_getfd), imports
and maps. Allocations made without that handle type are staged instead; a
hostile initiator's segments stay inside what the owner mapped; the owner
lets go of what it imported when the link goes.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from datadist_aio.bench.cuda_driver import CudaDriver  # noqa: E402
from support.device import (  # noqa: E402
    BLOCK,
    BLOCKS,
    INITIATOR,
    MODEL,
    OWNER,
    SLOT,
    SLOTS,
    TENSORS,
    Caches,
    Remote,
    _blocks,
    _check_local,
    _desc,
    _engine,
    _pattern,
    _recv,
    _slots,
    run_pair,
    standin,  # noqa: F401  (the fixture)
)

PIECE = CudaDriver.GRANULARITY
BLOCKS_BYTES, SLOTS_BYTES = BLOCKS * BLOCK, SLOTS * SLOT


def _pieces(nbytes: int) -> int:
    return -(-nbytes // PIECE)


class VmmCaches:
    """The initiator's caches in cuMemCreate memory: each kind's tensors side
    by side in one reserved range of 2 MiB pieces, so that tensors (and
    blocks) straddle the pieces."""

    def __init__(self, cm: Any, cuda: CudaDriver, posix_fd: bool) -> None:
        self.cm, self.cuda = cm, cuda
        self.ranges: list[tuple[int, int]] = []
        self.caches: dict[str, Any] = {}
        self.addrs: dict[str, list[int]] = {}
        for name, size in (("blocks-vmm", BLOCKS_BYTES), ("slots-vmm", SLOTS_BYTES)):
            pieces = _pieces(TENSORS * size)
            base = cuda.vmm_alloc(pieces, posix_fd)
            self.ranges.append((base, pieces))
            self.addrs[name] = [base + t * size for t in range(TENSORS)]
        self.caches["blocks-vmm"] = cm.register_blocks_cache(_desc("device", True), self.addrs["blocks-vmm"])
        self.caches["slots-vmm"] = cm.register_cache(_desc("device", False), self.addrs["slots-vmm"])

    def fill(self, name: str, seed: int) -> list[np.ndarray]:
        size = BLOCKS_BYTES if name.startswith("blocks") else SLOTS_BYTES
        data = _pattern(seed, size)
        for t, addr in enumerate(self.addrs[name]):
            self.cuda.write(addr, data[t])
        return data

    def read(self, name: str) -> list[np.ndarray]:
        size = BLOCKS_BYTES if name.startswith("blocks") else SLOTS_BYTES
        return [self.cuda.read(addr, size) for addr in self.addrs[name]]

    def free(self) -> None:
        for cache in self.caches.values():
            self.cm.unregister_cache(cache.cache_id)
        for base, pieces in self.ranges:
            self.cuda.vmm_free(base, pieces)


def owner_serves_and_counts(conn: Any, transport: str) -> None:
    """Host and device (cuMemAlloc) caches, filled and read when asked; also
    says how many cuMemCreate allocations it holds (its imports), and waits
    for them to go once the initiator has unlinked."""
    import datadist_aio as dd

    cuda = CudaDriver()
    datadist = _engine(dd.LLMRole.PROMPT, OWNER, transport, listen=True)
    caches = Caches(datadist.cache_manager, cuda, bind_blocks=True)
    conn.send((
        datadist.listen_port,
        {name: cache.cache_id for name, cache in caches.caches.items()},
        {name: cache.tensor_addrs for name, cache in caches.caches.items()},
    ))
    while True:
        command, *args = _recv(conn)
        if command == "fill":
            caches.fill(*args)
            conn.send("filled")
        elif command == "read":
            conn.send(caches.read(*args))
        elif command == "stats":
            conn.send(datadist._engine.link_stats(INITIATOR))
        elif command == "live_vmm":
            conn.send(cuda.live_vmm())
        elif command == "released":
            # The link is reaped a moment after the initiator's unlink.
            deadline = time.monotonic() + 10
            while (cuda.live_vmm() or datadist._engine.link_stats(INITIATOR)) and time.monotonic() < deadline:
                time.sleep(0.02)
            conn.send((cuda.live_vmm(), datadist._engine.link_stats(INITIATOR)))
        else:
            break
    caches.free()
    datadist.finalize()


def _link(conn: Any, transport: str) -> tuple[Any, Any, dict[str, int]]:
    import datadist_aio as dd
    from support.peer import cluster_info

    port, ids, _ = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, transport, listen=False)
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == dd.LLMStatusCode.LLM_SUCCESS
    assert datadist.link_transport(OWNER) == "same_host"
    return datadist, port, ids


def _move_everything(cm: Any, local: VmmCaches, remote: Remote, ids: dict[str, int], theirs: str, seed: int) -> int:
    """push_blocks, pull_blocks, push_cache and pull_cache between this end's
    cuMemCreate caches and the owner's `theirs` ones, every byte checked;
    the bytes moved."""
    import datadist_aio as dd

    what = f"cuMemCreate memory, owner {theirs}"
    rb, rs = f"blocks-{theirs}", f"slots-{theirs}"
    key = dd.BlocksCacheKey(OWNER, MODEL[theirs])
    every = list(range(BLOCKS))
    # Every block, reversed: whole tensors, each straddling two pieces here.
    sent = local.fill("blocks-vmm", seed)
    remote.fill(rb, seed + 1)
    cm.push_blocks(key, local.caches["blocks-vmm"], every, every[::-1])
    for t in range(TENSORS):
        _blocks(remote.expect[rb][t])[every[::-1]] = _blocks(sent[t])[every]
    remote.check(rb, f"push_blocks ({what})")
    before = local.fill("blocks-vmm", seed + 2)
    remote.fill(rb, seed + 3)
    src, dst = [0, 1, 2, 21, 9, 23], [5, 6, 7, 8, 18, 11]
    cm.pull_blocks(key, local.caches["blocks-vmm"], src, dst)
    for t in range(TENSORS):
        _blocks(before[t])[dst] = _blocks(remote.expect[rb][t])[src]
    _check_local(local.read("blocks-vmm"), before, f"pull_blocks ({what})")
    sent = local.fill("slots-vmm", seed + 4)
    remote.fill(rs, seed + 5)
    cm.push_cache(dd.CacheKeyByIdAndIndex(OWNER, ids[rs], 1), local.caches["slots-vmm"], 0)
    for t in range(TENSORS):
        _slots(remote.expect[rs][t])[1] = _slots(sent[t])[0]
    remote.check(rs, f"push_cache ({what})")
    before = local.read("slots-vmm")
    cm.pull_cache(dd.CacheKeyByIdAndIndex(OWNER, ids[rs], 0), local.caches["slots-vmm"], 1)
    for t in range(TENSORS):
        _slots(before[t])[1] = _slots(remote.expect[rs][t])[0]
    _check_local(local.read("slots-vmm"), before, f"pull_cache ({what})")
    return (BLOCKS + len(src)) * BLOCK * TENSORS + 2 * SLOT * TENSORS


def initiator_with_vmm_memory(conn: Any, transport: str) -> None:
    import datadist_aio as dd
    from support.peer import cluster_info

    datadist, port, ids = _link(conn, transport)
    cuda = CudaDriver()
    local = VmmCaches(datadist.cache_manager, cuda, posix_fd=True)
    # The layout straddles pieces: tensor 0's block 21, for one.
    block_21 = local.addrs["blocks-vmm"][0] + 21 * BLOCK
    assert block_21 // PIECE != (block_21 + BLOCK - 1) // PIECE
    remote = Remote(conn, ids)
    conn.send(("live_vmm",))
    assert _recv(conn) == 0
    seed = 40
    for theirs in ("device", "host"):
        conn.send(("stats",))
        owner0, mine0 = _recv(conn), datadist._engine.link_stats(OWNER)
        moved = _move_everything(datadist.cache_manager, local, remote, ids, theirs, seed := seed + 10)
        conn.send(("stats",))
        owner1, mine1 = _recv(conn), datadist._engine.link_stats(OWNER)
        delta = {k: mine1[k] - mine0[k] for k in mine1} | {"owner_" + k: owner1[k] - owner0[k] for k in owner1}
        what = f"owner {theirs}: {delta}"
        # Every frame went as a same-host frame naming descriptor exports;
        # the owner copied every byte against what it imported.
        assert delta["ipc_frames"] > 0 and delta["fd_frames"] == delta["ipc_frames"], what
        assert delta["staged_frames"] == 0 and delta["ipc_fallbacks"] == 0, what
        assert delta["owner_ipc_bytes_served"] == moved == delta["owner_fd_bytes_served"], what
        assert delta["owner_staged_bytes_served"] == 0, what
        # One import per piece the caches span, kept for the link.
        assert owner1["fd_imports"] == sum(p for _, p in local.ranges), owner1
    conn.send(("live_vmm",))
    assert _recv(conn) == sum(p for _, p in local.ranges)
    status, _ = datadist.unlink_clusters([cluster_info(OWNER, port)], 5000)
    assert status == dd.LLMStatusCode.LLM_SUCCESS
    conn.send(("released",))
    live, stats = _recv(conn)
    assert live == 0 and not stats, (live, stats)
    conn.send(("quit",))
    local.free()
    assert cuda.live_vmm() == 0
    datadist.finalize()


def test_cumemcreate_memory_moves_through_descriptor_exports(standin: Path) -> None:  # noqa: F811
    run_pair(standin, owner_serves_and_counts, initiator_with_vmm_memory, "auto")


def initiator_without_the_posix_handle_type(conn: Any, transport: str) -> None:
    """Its allocations cannot be exported as descriptors: their bytes are
    staged over the link, without an error."""
    datadist, _, ids = _link(conn, transport)
    local = VmmCaches(datadist.cache_manager, CudaDriver(), posix_fd=False)
    remote = Remote(conn, ids)
    _move_everything(datadist.cache_manager, local, remote, ids, "device", 70)
    mine = datadist._engine.link_stats(OWNER)
    conn.send(("stats",))
    owner = _recv(conn)
    assert mine["ipc_frames"] == 0 and mine["fd_frames"] == 0 and mine["staged_frames"] >= 4, mine
    assert owner["ipc_bytes_served"] == 0 and owner["staged_bytes_served"] > 0 and owner["fd_imports"] == 0, owner
    conn.send(("live_vmm",))
    assert _recv(conn) == 0
    conn.send(("quit",))
    local.free()
    datadist.finalize()


def test_cumemcreate_memory_without_the_posix_handle_type_is_staged(standin: Path) -> None:  # noqa: F811
    run_pair(standin, owner_serves_and_counts, initiator_without_the_posix_handle_type, "auto")


def initiator_meets_an_owner_that_cannot_import(conn: Any, transport: str) -> None:
    """The owner has no driver to import the descriptors with: the frame goes
    again inline, staged, with the same bytes."""
    import datadist_aio as dd

    datadist, _, ids = _link(conn, transport)
    local = VmmCaches(datadist.cache_manager, CudaDriver(), posix_fd=True)
    remote = Remote(conn, ids)
    key = dd.BlocksCacheKey(OWNER, MODEL["host"])
    sent = local.fill("blocks-vmm", 81)
    remote.fill("blocks-host", 82)
    datadist.cache_manager.push_blocks(key, local.caches["blocks-vmm"], [0, 21, 23], [1, 2, 3])
    for t in range(TENSORS):
        _blocks(remote.expect["blocks-host"][t])[[1, 2, 3]] = _blocks(sent[t])[[0, 21, 23]]
    remote.check("blocks-host", "push_blocks sent again inline")
    mine = datadist._engine.link_stats(OWNER)
    assert mine["fd_frames"] == mine["ipc_frames"] == mine["ipc_fallbacks"] >= 1, mine
    assert mine["staged_frames"] == mine["ipc_fallbacks"], mine
    conn.send(("stats",))
    owner = _recv(conn)
    assert owner["ipc_bytes_served"] == 0 and owner["fd_imports"] == 0, owner
    conn.send(("quit",))
    local.free()
    datadist.finalize()


def test_an_owner_that_cannot_import_has_the_bytes_staged(standin: Path) -> None:  # noqa: F811
    from test_device_ipc import owner_without_driver

    run_pair(standin, owner_without_driver, initiator_meets_an_owner_that_cannot_import, "auto",
             owner_env={"DATADIST_AIO_CUDA_DRIVER": "/nonexistent/libcuda.so.1"})


# -- a hostile initiator --------------------------------------------------------------------------------


def hostile_fd_initiator(conn: Any, transport: str) -> None:
    """Links by hand, saying it takes descriptors, and names two pieces of
    its own cuMemCreate memory with segments inside them, across them, and
    past them."""
    import datadist_aio as dd
    from support.wire_frames import (
        COPIES_FOR_YOU,
        DEVICE_EXPORT,
        DEVICE_FD,
        EXPORT_FD,
        HELLO_ACK_T,
        HELLO_T,
        OPENS_DEVICE,
        PATH_TRAILER,
        SAME_HOST_PATH,
        TAKES_FDS,
        READ_DATA_T,
        READ_INTO_T,
        SAME_HOST_INFO,
        WRITE_ACK_T,
        WRITE_FROM_T,
        frame,
        hello,
        recv_frame,
        request,
        export_table,
        same_host_caps,
        same_host_part,
        trailer,
    )

    code = dd.LLMStatusCode
    port, ids, _ = _recv(conn)
    remote = Remote(conn, ids)
    cuda = CudaDriver()
    base = cuda.vmm_alloc(2)
    mine = np.random.default_rng(5).integers(0, 256, 2 * PIECE, dtype=np.uint8)
    cuda.write(base, mine)
    fds = []
    for i in range(2):
        handle = ctypes.c_ulonglong()
        fd = ctypes.c_int(-1)
        cuda.check(cuda.lib.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(base + i * PIECE)),
                   "cuMemRetainAllocationHandle")
        cuda.check(cuda.lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, 1, ctypes.c_ulonglong(0)),
                   "cuMemExportToShareableHandle")
        cuda.check(cuda.lib.cuMemRelease(handle), "cuMemRelease")
        fds.append(fd.value)

    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = bytes.fromhex(f.read().strip().replace("-", ""))
    probe = ctypes.create_string_buffer(b"DDAOPRB1" + os.urandom(16), 24)
    info = SAME_HOST_INFO.pack(boot, os.getpid(), ctypes.addressof(probe), probe.raw)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    part = same_host_part(info, OPENS_DEVICE | TAKES_FDS)
    sock.sendall(frame(HELLO_T, hello(INITIATOR, OWNER, 78, parts=[(SAME_HOST_PATH, part)])))
    kind, status, _, ack, _ = recv_frame(sock)
    assert (kind, status) == (HELLO_ACK_T, 0)
    caps = same_host_caps(ack)
    assert caps is not None and caps & COPIES_FOR_YOU and caps & OPENS_DEVICE and caps & TAKES_FDS, caps

    def export(piece: int, size: int = PIECE, serial: int = 1) -> bytes:
        handle = DEVICE_FD.pack(fds[piece], 0, size, serial + piece).ljust(64, b"\0")
        return DEVICE_EXPORT.pack(handle, base + piece * PIECE, 0, EXPORT_FD)

    def device_frame(kind: int, block: int, addr: int, op_id: int, exports: list[bytes]) -> bytes:
        body = request([(0, block, 0, BLOCK)], model_id=MODEL["device"], flags=PATH_TRAILER,
                       segments=[(addr, BLOCK)])
        body += trailer(SAME_HOST_PATH, export_table(exports))
        return frame(kind, body, op_id=op_id)

    served = 0
    with sock:
        remote.fill("blocks-device", 51)
        # Past the end of the piece, with no export after it: refused, nothing written.
        sock.sendall(device_frame(WRITE_FROM_T, 3, base + PIECE - BLOCK // 2, 1, [export(0)]))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, code.LLM_PARAM_INVALID.value, 1)
        # A size past the allocation's: the driver maps no such thing, the owner cannot open it.
        sock.sendall(device_frame(WRITE_FROM_T, 3, base, 2, [export(0, size=2 * PIECE, serial=10)]))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, code.LLM_FEATURE_NOT_ENABLED.value, 2)
        remote.check("blocks-device", "refused writes")
        # A read whose destination runs past the second piece writes nothing here.
        sock.sendall(device_frame(READ_INTO_T, 5, base + 2 * PIECE - BLOCK + 1, 3, [export(0), export(1)]))
        assert recv_frame(sock)[:3] == (READ_DATA_T, code.LLM_PARAM_INVALID.value, 3)
        np.testing.assert_array_equal(cuda.read(base, 2 * PIECE), mine, err_msg="a refused read wrote here")
        # Inside one piece, and across both.
        sock.sendall(device_frame(WRITE_FROM_T, 3, base + 4096, 4, [export(0)]))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 4)
        _blocks(remote.expect["blocks-device"][0])[3] = mine[4096:4096 + BLOCK]
        across = base + PIECE - BLOCK // 3
        sock.sendall(device_frame(WRITE_FROM_T, 4, across, 5, [export(0), export(1)]))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 5)
        _blocks(remote.expect["blocks-device"][0])[4] = mine[across - base:across - base + BLOCK]
        remote.check("blocks-device", "writes inside the exports")
        sock.sendall(device_frame(READ_INTO_T, 5, across, 6, [export(1), export(0)]))
        assert recv_frame(sock)[:3] == (READ_DATA_T, 0, 6)
        got = cuda.read(across, BLOCK)
        np.testing.assert_array_equal(got, _blocks(remote.expect["blocks-device"][0])[5], err_msg="a read across")
        served = 3 * BLOCK
        conn.send(("stats",))
        stats = _recv(conn)
        assert stats["ipc_bytes_served"] == served == stats["fd_bytes_served"] and stats["fd_imports"] == 2, stats
        # A descriptor export whose unused bytes are not zero is malformed: the link closes.
        bad = bytearray(export(0))
        bad[40] = 1
        sock.sendall(device_frame(WRITE_FROM_T, 3, base, 7, [bytes(bad)]))
        with pytest.raises(ConnectionError):
            recv_frame(sock)
    remote.check("blocks-device", "a malformed frame")
    conn.send(("released",))
    assert _recv(conn) == (0, {})
    conn.send(("quit",))
    for fd in fds:
        os.close(fd)
    cuda.vmm_free(base, 2)


def test_an_owner_keeps_a_hostile_initiator_inside_its_descriptor_exports(standin: Path) -> None:  # noqa: F811
    run_pair(standin, owner_serves_and_counts, hostile_fd_initiator, "auto")

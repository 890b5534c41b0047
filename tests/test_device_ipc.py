"""CUDA IPC between two engines of one host, on the driver stand-in: where
it cannot be used, device memory goes through staging instead, without an
error; and what an owner that opens an initiator's device memory checks, as
a hostile initiator sees it.

Every operation between every mix of host and device caches over a
same-host link, with the path its bytes took, is in test_device_transfer.py
(and so are peers killed mid-transfer); this file holds what differs.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from support.device import (  # noqa: E402
    BLOCK,
    INITIATOR,
    MODEL,
    OWNER,
    TENSORS,
    Caches,
    Remote,
    _blocks,
    _check_local,
    _desc,
    _engine,
    _pattern,
    _recv,
    owner_serves,
    run_pair,
    standin,  # noqa: F401  (the fixture)
)
from datadist_aio.bench.cuda_driver import CudaDriver, IpcHandle  # noqa: E402

SRC, DST = [0, 1, 2, 3, 9, 10, 23], [5, 6, 7, 8, 0, 22, 11]


def _push_and_pull(cm: Any, local: Any, remote: Any, theirs: str, what: str) -> None:
    """push_blocks then pull_blocks between this end's device blocks cache
    and the owner's `theirs` one, every byte checked."""
    import datadist_aio as dd

    key = dd.BlocksCacheKey(OWNER, MODEL[theirs])
    sent = local.fill("blocks-device", 11)
    remote.fill(f"blocks-{theirs}", 12)
    cm.push_blocks(key, local.caches["blocks-device"], SRC, DST)
    for t in range(TENSORS):
        _blocks(remote.expect[f"blocks-{theirs}"][t])[DST] = _blocks(sent[t])[SRC]
    remote.check(f"blocks-{theirs}", f"push_blocks ({what})")
    before = local.fill("blocks-device", 13)
    cm.pull_blocks(key, local.caches["blocks-device"], SRC, DST)
    for t in range(TENSORS):
        _blocks(before[t])[DST] = _blocks(remote.expect[f"blocks-{theirs}"][t])[SRC]
    _check_local(local.read("blocks-device"), before, f"pull_blocks ({what})")


# -- fallbacks ----------------------------------------------------------------------------------------


def initiator_cannot_export(conn: Any, transport: str) -> None:
    """Its driver exports nothing (as memory of cuMemCreate): device memory
    goes inline, staged, on the same-host link."""
    import datadist_aio as dd
    from support.peer import cluster_info

    port, ids, _ = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, transport, listen=False)
    cm = datadist.cache_manager
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == dd.LLMStatusCode.LLM_SUCCESS
    assert datadist.link_transport(OWNER) == "same_host"
    local = Caches(cm, CudaDriver(), bind_blocks=False)
    remote = Remote(conn, ids)
    for theirs in ("device", "host"):
        _push_and_pull(cm, local, remote, theirs, f"no IPC export, owner {theirs}")
    mine = datadist._engine.link_stats(OWNER)
    conn.send(("stats",))
    owner = _recv(conn)
    assert mine["ipc_frames"] == 0 and mine["ipc_fallbacks"] == 0 and mine["staged_frames"] >= 4, mine
    assert owner["ipc_bytes_served"] == 0 and owner["staged_bytes_served"] > 0, owner
    conn.send(("quit",))
    local.free()
    datadist.finalize()


def test_an_initiator_that_cannot_export_stages_instead(standin: Path) -> None:  # noqa: F811
    run_pair(standin, owner_serves, initiator_cannot_export, "auto", initiator_env={"STANDIN_CUDA_IPC": "0"})


def owner_without_driver(conn: Any, transport: str) -> None:
    """Host caches only, and no CUDA driver to open a peer's device memory with."""
    import datadist_aio as dd

    datadist = _engine(dd.LLMRole.PROMPT, OWNER, transport, listen=True)
    cm = datadist.cache_manager
    cache = cm.allocate_blocks_cache(_desc("host", True), dd.BlocksCacheKey(OWNER, MODEL["host"]))
    conn.send((datadist.listen_port, {"blocks-host": cache.cache_id}, {}))
    while True:
        command, *args = _recv(conn)
        if command == "fill":
            data = _pattern(args[1], cache.cache_desc.size)
            for t in range(TENSORS):
                cache.as_numpy(t).reshape(-1)[:] = data[t]
            conn.send("filled")
        elif command == "read":
            conn.send([cache.as_numpy(t).reshape(-1).copy() for t in range(TENSORS)])
        elif command == "stats":
            conn.send(datadist._engine.link_stats(INITIATOR))
        else:
            break
    cm.deallocate_blocks_cache(cache)
    datadist.finalize()


def initiator_meets_an_owner_without_driver(conn: Any, transport: str) -> None:
    """The owner answers that it cannot open the exports: the frame goes
    again inline, and every later one on the link goes inline at once."""
    import datadist_aio as dd
    from support.peer import cluster_info

    port, ids, _ = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, transport, listen=False)
    cm = datadist.cache_manager
    status, _ = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == dd.LLMStatusCode.LLM_SUCCESS
    local = Caches(cm, CudaDriver(), bind_blocks=False)
    remote = Remote(conn, ids)
    key = dd.BlocksCacheKey(OWNER, MODEL["host"])
    sent = local.fill("blocks-device", 21)
    remote.fill("blocks-host", 22)
    cm.push_blocks(key, local.caches["blocks-device"], SRC, DST)
    for t in range(TENSORS):
        _blocks(remote.expect["blocks-host"][t])[DST] = _blocks(sent[t])[SRC]
    remote.check("blocks-host", "push_blocks sent again inline")
    first = datadist._engine.link_stats(OWNER)
    assert first["ipc_frames"] >= 1 and first["ipc_fallbacks"] == first["ipc_frames"], first
    assert first["staged_frames"] == first["ipc_fallbacks"], first
    _push_and_pull(cm, local, remote, "host", "after a fallback")
    later = datadist._engine.link_stats(OWNER)
    assert later["ipc_frames"] == first["ipc_frames"] and later["ipc_fallbacks"] == first["ipc_fallbacks"], later
    assert later["staged_frames"] > first["staged_frames"], later
    conn.send(("stats",))
    assert _recv(conn)["ipc_bytes_served"] == 0
    conn.send(("quit",))
    local.free()
    datadist.finalize()


def test_an_owner_that_cannot_open_the_exports_has_them_staged(standin: Path) -> None:  # noqa: F811
    run_pair(standin, owner_without_driver, initiator_meets_an_owner_without_driver, "auto",
             owner_env={"DATADIST_AIO_CUDA_DRIVER": "/nonexistent/libcuda.so.1"})


# -- a hostile initiator --------------------------------------------------------------------------------


def hostile_initiator(conn: Any, transport: str) -> None:
    """Links by hand, offering the same-host path and device handles, and
    names its own exported allocation with segments that run past it."""
    import datadist_aio as dd
    from support.wire_frames import (
        COPIES_FOR_YOU,
        DEVICE_EXPORT,
        HELLO_ACK_T,
        HELLO_T,
        OPENS_DEVICE,
        PATH_TRAILER,
        SAME_HOST_PATH,
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

    invalid = dd.LLMStatusCode.LLM_PARAM_INVALID.value
    port, ids, _ = _recv(conn)
    remote = Remote(conn, ids)
    cuda = CudaDriver()
    size = 2 * BLOCK
    base = cuda.alloc(size)
    mine = np.full(size, 0xA5, np.uint8)
    cuda.write(base, mine)
    handle = IpcHandle()
    cuda.check(cuda.lib.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")

    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = bytes.fromhex(f.read().strip().replace("-", ""))
    probe = ctypes.create_string_buffer(b"DDAOPRB1" + os.urandom(16), 24)
    info = SAME_HOST_INFO.pack(boot, os.getpid(), ctypes.addressof(probe), probe.raw)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    part = same_host_part(info, OPENS_DEVICE)
    sock.sendall(frame(HELLO_T, hello(INITIATOR, OWNER, 77, parts=[(SAME_HOST_PATH, part)])))
    kind, status, _, ack, _ = recv_frame(sock)
    assert (kind, status) == (HELLO_ACK_T, 0)
    caps = same_host_caps(ack)
    assert caps is not None and caps & COPIES_FOR_YOU and caps & OPENS_DEVICE, caps

    def device_frame(kind: int, block: int, addr: int, op_id: int, export_base: int = base) -> bytes:
        body = request([(0, block, 0, BLOCK)], model_id=MODEL["device"], flags=PATH_TRAILER, segments=[(addr, BLOCK)])
        body += trailer(SAME_HOST_PATH, export_table([DEVICE_EXPORT.pack(bytes(handle), export_base, 0, 0)]))
        return frame(kind, body, op_id=op_id)

    with sock:
        remote.fill("blocks-device", 31)
        # Past the end of the allocation, from its true base or from a base
        # said to lie lower: refused, and nothing written on the owner.
        sock.sendall(device_frame(WRITE_FROM_T, 3, base + size - BLOCK // 2, 1))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, invalid, 1)
        sock.sendall(device_frame(WRITE_FROM_T, 3, base + size - BLOCK, 2, export_base=base - 4096))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, invalid, 2)
        remote.check("blocks-device", "refused writes")
        # A read whose destination runs past the allocation writes nothing here.
        sock.sendall(device_frame(READ_INTO_T, 5, base + BLOCK + 1, 3))
        assert recv_frame(sock)[:3] == (READ_DATA_T, invalid, 3)
        np.testing.assert_array_equal(cuda.read(base, size), mine, err_msg="a refused read wrote into the initiator")
        # Inside it: the owner copies device to device.
        sock.sendall(device_frame(WRITE_FROM_T, 3, base, 4))
        assert recv_frame(sock)[:3] == (WRITE_ACK_T, 0, 4)
        _blocks(remote.expect["blocks-device"][0])[3] = mine[:BLOCK]
        remote.check("blocks-device", "a write inside the export")
        sock.sendall(device_frame(READ_INTO_T, 5, base + BLOCK, 5))
        assert recv_frame(sock)[:3] == (READ_DATA_T, 0, 5)
        got = cuda.read(base + BLOCK, BLOCK)
        np.testing.assert_array_equal(got, _blocks(remote.expect["blocks-device"][0])[5], err_msg="a read inside")
        conn.send(("stats",))
        assert _recv(conn)["ipc_bytes_served"] == 2 * BLOCK
        # A segment below every export is malformed: the link closes.
        sock.sendall(device_frame(WRITE_FROM_T, 3, base - BLOCK, 6))
        with pytest.raises(ConnectionError):
            recv_frame(sock)
    remote.check("blocks-device", "a malformed frame")
    conn.send(("quit",))
    cuda.free(base)


def test_an_owner_keeps_a_hostile_initiator_inside_its_export(standin: Path) -> None:  # noqa: F811
    run_pair(standin, owner_serves, hostile_initiator, "auto")

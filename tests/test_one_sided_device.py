"""One-sided access to device memory on one host, on the CUDA driver
stand-in (tests/cuda_standin; it proves this engine's logic, never
NVIDIA's): the owner grants its device caches as their allocations'
exports, and the initiator opens them and copies on streams of its own,
counted in the grant's slot until its stream says the copies landed.

Every operation between every mix of host and device caches, one-sided,
with no frame to the owner, is in test_device_transfer.py
(``auto-one_sided``); this file holds what only one-sided access has: an
owner frozen after linking, revocation under a stream of writes, and an
initiator that cannot open the owner's device memory.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from datadist_aio.bench.cuda_driver import CudaDriver  # noqa: E402
from support.device import (  # noqa: E402,F401  (standin: the fixture)
    BLOCK,
    INITIATOR,
    MODEL,
    OWNER,
    SLOT,
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
    standin,
    wait_for_grants,
)

SRC, DST = [0, 1, 2, 3, 9, 10, 23], [5, 6, 7, 8, 0, 22, 11]


def _linked(conn: Any, transport: str, access: str, timeout_ms: int = 10000) -> tuple[Any, dict[str, int], int]:
    import datadist_aio as dd
    from support.peer import cluster_info

    port, ids, _ = _recv(conn)
    datadist = _engine(dd.LLMRole.DECODER, INITIATOR, transport, listen=False, access=access, timeout_ms=timeout_ms)
    status, statuses = datadist.link_clusters([cluster_info(OWNER, port)], 10000)
    assert status == dd.LLMStatusCode.LLM_SUCCESS and statuses == [dd.LLMStatusCode.LLM_SUCCESS], statuses
    assert datadist.link_transport(OWNER) == "same_host"
    conn.send(("pid",))
    return datadist, ids, _recv(conn)


# -- the owner frozen -----------------------------------------------------------------------------------


def initiator_meets_a_frozen_owner(conn: Any, transport: str, access: str) -> None:
    """Pushes and pulls between device caches (and from the owner's device
    memory into host memory here) while the owner is stopped: one-sided,
    they complete, every byte checked once it runs again; owner-served, they
    time out."""
    import datadist_aio as dd

    cuda = CudaDriver()
    datadist, ids, pid = _linked(conn, transport, access, timeout_ms=1000)
    cm = datadist.cache_manager
    if access == "one_sided":
        wait_for_grants(datadist, len(ids))
    local = Caches(cm, cuda, bind_blocks=False)
    remote = Remote(conn, ids)
    key = dd.BlocksCacheKey(OWNER, MODEL["device"])
    remote.fill("blocks-device", 1)
    sent = local.fill("blocks-device", 2)
    back = local.fill("blocks-host", 3)
    os.kill(pid, signal.SIGSTOP)
    try:
        if access == "owner":
            with pytest.raises(dd.LLMException) as timed_out:
                cm.push_blocks(key, local.caches["blocks-device"], SRC, DST)
            assert timed_out.value.status_code is dd.LLMStatusCode.LLM_TIMEOUT, timed_out.value
        else:
            started = time.monotonic()
            cm.push_blocks(key, local.caches["blocks-device"], SRC, DST)
            cm.pull_blocks(key, local.caches["blocks-host"], [4, 5], [1, 2])
            assert time.monotonic() - started < 5
    finally:
        os.kill(pid, signal.SIGCONT)
    if access == "owner":
        conn.send(("quit",))
        local.free()
        datadist.finalize()
        return
    for t in range(TENSORS):  # the push first: block 5 is one of its destinations
        _blocks(remote.expect["blocks-device"][t])[DST] = _blocks(sent[t])[SRC]
        _blocks(back[t])[[1, 2]] = _blocks(remote.expect["blocks-device"][t])[[4, 5]]
    remote.check("blocks-device", "push_blocks into a frozen owner")
    _check_local(local.read("blocks-host"), back, "pull_blocks from a frozen owner")
    conn.send(("stats",))
    mine, theirs = datadist._engine.link_stats(OWNER), _recv(conn)
    assert mine["framed_ops"] == 0 and theirs["owner_served_ops"] == 0, (mine, theirs)
    assert mine["one_sided_device_bytes"] == (len(SRC) + 2) * TENSORS * BLOCK, mine
    conn.send(("quit",))
    local.free()
    datadist.finalize()


@pytest.mark.parametrize("access", ["one_sided", "owner"])
def test_a_frozen_owner_is_not_needed_for_its_device_memory(standin: Path, access: str) -> None:
    run_pair(standin, owner_serves, initiator_meets_a_frozen_owner, "auto", access)


# -- revocation -----------------------------------------------------------------------------------------


ROUNDS = 25


def initiator_streams_into_a_renewed_cache(conn: Any, transport: str, access: str) -> None:
    """Streams one-sided pushes into the owner's device slots cache while the
    owner frees it and, 50 ms later, makes a new one. No push started after
    the deallocation returned succeeds (its grant revoked: the owner answers
    the frame, the id refused), and the new cache keeps every byte."""
    import datadist_aio as dd

    cuda = CudaDriver()
    datadist, ids, _ = _linked(conn, transport, access)
    cm = datadist.cache_manager
    local = Caches(cm, cuda, bind_blocks=False)
    local.fill("slots-device", 7)
    target = ids["slots-device"]
    for r in range(ROUNDS):
        wait_for_grants(datadist, len(ids))
        outcomes: list[tuple[float, str]] = []
        stop = threading.Event()

        def stream(cache_id: int = target) -> None:
            key = dd.CacheKeyByIdAndIndex(OWNER, cache_id, 0)
            while not stop.is_set():
                started = time.monotonic()
                try:
                    cm.push_cache(key, local.caches["slots-device"], 1)
                    outcomes.append((started, "LLM_SUCCESS"))
                except dd.LLMException as exc:
                    outcomes.append((started, exc.status_code.name))

        thread = threading.Thread(target=stream)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while sum(1 for _, s in outcomes if s == "LLM_SUCCESS") < 3:
                assert time.monotonic() < deadline and thread.is_alive(), outcomes[-3:]
                time.sleep(0.001)
            conn.send(("renew", 100 + r))
            target, freed = _recv(conn)
            time.sleep(0.02)  # the stream goes on toward the freed cache's id
        finally:
            stop.set()
            thread.join(30)
        seen = Counter(s for _, s in outcomes)
        assert set(seen) <= {"LLM_SUCCESS", "LLM_KV_CACHE_NOT_EXIST"}, seen
        # Started once the deallocation had returned: refused, every one
        # (the owner waited out the copies in flight under the grant, and
        # the holder's next one found it revoked in the slot).
        late = [s for started, s in outcomes if started > freed]
        assert late and set(late) == {"LLM_KV_CACHE_NOT_EXIST"}, f"round {r}: {Counter(late)}"
        conn.send(("read", "slots-device"))
        got = _recv(conn)
        expected = _pattern(100 + r, 2 * SLOT)
        for t in range(TENSORS):
            np.testing.assert_array_equal(got[t], expected[t], err_msg=f"round {r}: tensor {t} of the new cache")
    conn.send(("stats",))
    mine, theirs = datadist._engine.link_stats(OWNER), _recv(conn)
    assert mine["one_sided_device_bytes"] > 0 and mine["one_sided_ops"] >= 3 * ROUNDS, mine
    assert theirs["grants_revoked"] == ROUNDS and theirs["grants_quarantined"] == 0, theirs
    conn.send(("quit",))
    local.free()
    datadist.finalize()


def test_a_device_cache_renewed_under_a_stream_of_writes_never_receives_one(standin: Path) -> None:
    run_pair(standin, owner_serves, initiator_streams_into_a_renewed_cache, "auto", "one_sided", timeout_s=240)


# -- an initiator that cannot open the owner's memory ---------------------------------------------------


def initiator_without_a_driver(conn: Any, transport: str, access: str) -> None:
    """No CUDA driver here: host memory pushed into the owner's device cache
    goes by frames, the owner staging it, every byte checked; the grant is
    held, and not used."""
    import datadist_aio as dd

    datadist, ids, _ = _linked(conn, transport, access)
    cm = datadist.cache_manager
    wait_for_grants(datadist, len(ids))
    local = cm.allocate_blocks_cache(_desc("host", True))
    remote = Remote(conn, ids)
    remote.fill("blocks-device", 1)
    sent = _pattern(2, local.cache_desc.size)
    for t in range(TENSORS):
        local.as_numpy(t).reshape(-1)[:] = sent[t]
    key = dd.BlocksCacheKey(OWNER, MODEL["device"])
    for _ in range(2):  # the second as the first: by frames
        cm.push_blocks(key, local, SRC, DST)
    for t in range(TENSORS):
        _blocks(remote.expect["blocks-device"][t])[DST] = _blocks(sent[t])[SRC]
    remote.check("blocks-device", "push_blocks from an initiator without a driver")
    conn.send(("stats",))
    mine, theirs = datadist._engine.link_stats(OWNER), _recv(conn)
    assert mine["one_sided_ops"] == 0 and mine["framed_ops"] == 2, mine
    assert theirs["owner_served_ops"] == 2 and theirs["staged_bytes_served"] == 2 * len(SRC) * TENSORS * BLOCK, theirs
    conn.send(("quit",))
    cm.deallocate_blocks_cache(local)
    datadist.finalize()


def test_an_initiator_that_cannot_open_device_memory_is_served(standin: Path) -> None:
    run_pair(standin, owner_serves, initiator_without_a_driver, "auto", "one_sided",
             initiator_env={"DATADIST_AIO_CUDA_DRIVER": "/nonexistent/libcuda.so.1"})

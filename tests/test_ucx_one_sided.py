"""One-sided access over UCX (transport "ucx", LLMConfig.access): the owner
grants a linked peer its caches as UCX keys, and the peer gets and puts
within them on its own endpoint.

Here the endpoint reaches the owner's memory with UCX's cma transport (this
host's kernel copies; "direct": nothing of the owner's stops them), which
UCX names for an endpoint from 1.14 on. With an older UCX no endpoint says
so, nothing is granted, and every operation is served by its owner: the
first case checks that, and the others are skipped. RDMA's rc and dc
("fenced": the owner's unmap ends them) need a NIC this suite does not have.

- The owner is out of the path: frozen (SIGSTOP) after linking, its peer's
  pushes and pulls still complete, every byte checked; with access "owner"
  they time out.
- The peer checks every range against the grant, with the owner's statuses.
- Revocation: a cache freed while the peer streams puts into it, and a new
  one allocated where it lay, never receives one of them; the owner waits
  for the peer's answer (or its slot to empty) before the memory goes, and
  a peer frozen inside a put leaves the memory held.
- A link that goes revokes its grants in their slots: the memory goes back
  at once when the peer was in no operation.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import datadist_aio as dd
from support.links import blocks_desc
from support.peer import (HAVE_UCX, UCX_WHY, CacheRef, MiB, Peer, PeerGroup, raises_status, seeded_tensors,
                          wait_until)

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINKED = (SUCCESS, [SUCCESS])
A, B = 1, 2
BLOCK = 4096
DIRECT = 2  # ucx_reach: the peer's memory by this process's own system calls (cma)

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(not HAVE_UCX, reason=f"no UCX: {UCX_WHY}")]


def ucx_names_transports() -> bool:
    """Whether the UCX loaded here names an endpoint's transports (1.14 on)."""
    found = re.match(r"UCX (\d+)\.(\d+)", UCX_WHY)
    return found is not None and (int(found.group(1)), int(found.group(2))) >= (1, 14)


needs_reach = pytest.mark.skipif(not ucx_names_transports(), reason=f"{UCX_WHY}: no endpoint names its transports")


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


def stats(peer: Peer, other: int) -> dict[str, int]:
    return peer.engine("link_stats", other)


def linked(group: PeerGroup, access: str = "one_sided", timeout_ms: int = 5000) -> tuple[Peer, Peer]:
    """A (the initiator, with `access`) linked to B (the owner) over UCX."""
    options: dict[str, Any] = {"transport": "ucx", "sync_kv_timeout": timeout_ms, "access": access}
    a = group.start("a", dd.LLMRole.PROMPT, A, options=options)
    b = group.start("b", dd.LLMRole.DECODER, B, options={"transport": "ucx"})
    assert a.link(b) == LINKED
    assert a.datadist("link_transport", B) == "ucx"
    return a, b


def wait_granted(a: Peer, count: int) -> None:
    wait_until(lambda: stats(a, B)["grants_held"] == count, f"A holds {count} UCX grants of B's")


def block_rows(tensor: np.ndarray, blocks: list[int]) -> np.ndarray:
    return np.concatenate([tensor[k * BLOCK : (k + 1) * BLOCK] for k in blocks])


def assert_holds(b: Peer, ref: CacheRef, seed: int, what: str) -> None:
    got = b.read(ref)
    for t, expected in enumerate(seeded_tensors(ref.desc, seed)):
        assert np.array_equal(got[t], expected), f"{what}: tensor {t} of the new cache changed"


def test_without_an_endpoint_that_reaches_the_owner_the_owner_serves(group):
    """Whatever UCX says of its endpoint, every byte arrives; where it names
    none that reaches the owner's memory, A asks for no grant and B serves."""
    a, b = linked(group)
    remote = b.allocate(blocks_desc(), blocks=True, model_id=5)
    held = b.fill(remote, 1)
    local = a.allocate(blocks_desc(), blocks=True)
    sent = a.fill(local, 2)
    reach = stats(a, B)["ucx_reach"]
    assert reach == (DIRECT if ucx_names_transports() else 0), (reach, UCX_WHY)
    if reach:
        wait_granted(a, 1)
    assert a.cm_async("push_blocks", remote.blocks_key(), local, [0, 1], [3, 4]) == [SUCCESS]
    got = b.read(remote)
    for t in range(4):
        np.testing.assert_array_equal(block_rows(got[t], [3, 4]), block_rows(sent[t], [0, 1]))
        np.testing.assert_array_equal(block_rows(got[t], [0, 1, 2, 5]), block_rows(held[t], [0, 1, 2, 5]))
    mine, theirs = stats(a, B), stats(b, A)
    if reach:
        assert mine["ucx_one_sided_ops"] == 1 and theirs["owner_served_ops"] == 0, (mine, theirs)
    else:
        assert mine["ucx_one_sided_ops"] == 0 and theirs["grants_given"] == 0, (mine, theirs)
        assert theirs["ucx_bytes_served"] == 2 * 4 * BLOCK, theirs


@needs_reach
@pytest.mark.parametrize("access", ["one_sided", "owner"])
def test_a_frozen_owner_is_not_needed(group, access):
    a, b = linked(group, access, timeout_ms=1000)
    slots_desc = dd.CacheDesc(2, [2, 64 * 1024], dd.DataType.DT_UINT8, dd.Placement.HOST)
    remote = b.allocate(blocks_desc(), blocks=True, model_id=5)
    slots = b.allocate(slots_desc)
    held = b.fill(remote, 1)
    held_slots = b.fill(slots, 2)
    local = a.allocate(blocks_desc(), blocks=True)
    sent = a.fill(local, 3)
    back = a.allocate(blocks_desc(), blocks=True)
    a.fill(back, 4)
    local_slots = a.allocate(slots_desc)
    sent_slots = a.fill(local_slots, 5)
    back_slots = a.allocate(slots_desc)
    if access == "one_sided":
        wait_granted(a, 2)
    else:
        assert stats(a, B)["ucx_reach"] == 0 and stats(b, A)["grants_given"] == 0
    b.stop()
    try:
        if access == "owner":
            with raises_status(dd.LLMStatusCode.LLM_TIMEOUT):
                a.cm_async("push_blocks", remote.blocks_key(), local, [0, 1, 2], [7, 8, 9])
            return
        started = time.monotonic()
        assert a.cm_async("push_blocks", remote.blocks_key(), local, [0, 1, 2], [7, 8, 9]) == [SUCCESS]
        assert a.cm("pull_blocks", remote.blocks_key(), back, [3, 4], [5, 6]) is None
        a.cm("pull_cache", slots.key(1), back_slots, batch_index=0)  # B's slot 1 before the push
        a.cm("push_cache", slots.key(1), local_slots, src_batch_index=1)
        assert time.monotonic() - started < 5
    finally:
        b.cont()
    got = b.read(remote)
    for t in range(4):
        np.testing.assert_array_equal(block_rows(got[t], [7, 8, 9]), block_rows(sent[t], [0, 1, 2]))
        np.testing.assert_array_equal(block_rows(got[t], list(range(7))), block_rows(held[t], list(range(7))))
    pulled = a.read(back)
    for t in range(4):
        np.testing.assert_array_equal(block_rows(pulled[t], [5, 6]), block_rows(held[t], [3, 4]))
    slot = 64 * 1024
    now_slots, pulled_slots = b.read(slots), a.read(back_slots)
    for t in range(2):
        np.testing.assert_array_equal(now_slots[t][slot:], sent_slots[t][slot:])
        np.testing.assert_array_equal(now_slots[t][:slot], held_slots[t][:slot])
        np.testing.assert_array_equal(pulled_slots[t][:slot], held_slots[t][slot:])
    mine, theirs = stats(a, B), stats(b, A)
    assert mine["ucx_one_sided_ops"] == 4 and mine["ucx_frames"] == 0, mine
    assert mine["ucx_one_sided_bytes_written"] == 3 * 4 * BLOCK + 2 * slot, mine
    assert mine["ucx_one_sided_bytes_read"] == 2 * 4 * BLOCK + 2 * slot, mine
    assert theirs["owner_served_ops"] == 0 and theirs["grants_given"] == 2, theirs


@needs_reach
def test_ranges_are_checked_against_the_grant_with_the_owners_statuses(group):
    a, b = linked(group)
    remote = b.allocate(blocks_desc(), blocks=True, model_id=5)
    held = b.fill(remote, 1)
    local = a.allocate(blocks_desc(blocks=32), blocks=True)
    a.fill(local, 2)
    bigger = a.allocate(blocks_desc(block=2 * BLOCK), blocks=True)
    wait_granted(a, 1)
    b.stop()  # the refusals come from A's own checks
    try:
        with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID) as refused:
            a.cm("push_blocks", remote.blocks_key(), local, [0, 1], [15, 16])  # block 16 of 16
        assert "ends past the 16 slots" in str(refused.value), refused.value
        with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID) as refused:
            a.cm("pull_blocks", remote.blocks_key(), bigger, [0], [0])
        assert "block size differs" in str(refused.value), refused.value
    finally:
        b.cont()
    got = b.read(remote)
    for t in range(4):
        np.testing.assert_array_equal(got[t], held[t])  # nothing of the refused push landed
    assert stats(b, A)["owner_served_ops"] == 0


@needs_reach
def test_a_cache_renewed_under_a_stream_of_puts_never_receives_one(group):
    # A streams one-sided puts into B's cache. B frees it and, in the same
    # command, allocates one like it (where the pool puts it: where the old
    # one lay, once A answered the revocation) and fills it. No put under
    # the old grant may land in the new cache.
    a, b = linked(group)
    desc = dd.CacheDesc(4, [1, 4 * MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)
    target = b.allocate(desc)
    local = a.allocate(desc)
    a.fill(local, 9)
    rounds, same_place = 100, 0
    for r in range(rounds):
        wait_granted(a, 1)
        a.stream("push_cache", target.key(0), local)
        wait_until(lambda: a.stream_counts().get("LLM_SUCCESS", 0) >= 3, "one-sided puts stream")
        renewed, same = b.renew(target, seed=100 + r)
        same_place += same
        time.sleep(0.005)  # the stream goes on toward the freed cache's id
        counts = a.stream_stop()
        assert set(counts) <= {"LLM_SUCCESS", "LLM_KV_CACHE_NOT_EXIST"}, counts
        assert_holds(b, renewed, 100 + r, f"round {r}")
        target = renewed
    assert same_place >= rounds * 9 // 10, same_place
    theirs = stats(b, A)
    assert theirs["grants_revoked"] == rounds and theirs["grants_quarantined"] == 0, theirs
    assert theirs["grant_revoke_waits"] > 0, theirs  # some revocations met a put in flight, and waited for it
    assert stats(a, B)["ucx_one_sided_ops"] > 3 * rounds


@needs_reach
def test_a_holder_frozen_in_a_put_leaves_the_memory_held(group):
    # A is stopped while it streams puts, sometimes inside one. Outside one,
    # B's revocation finds A's slot empty and goes on at once; inside one, it
    # waits its bound and leaves the old memory held: the new cache lies
    # elsewhere, and when A runs again the rest of its put lands in memory
    # nobody uses. No byte of the new cache changes.
    a, b = linked(group)
    desc = dd.CacheDesc(4, [1, 4 * MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)
    target = b.allocate(desc)
    local = a.allocate(desc)
    a.fill(local, 9)
    for attempt in range(20):
        wait_granted(a, 1)
        a.stream("push_cache", target.key(0), local)
        wait_until(lambda: a.stream_counts().get("LLM_SUCCESS", 0) >= 3, "one-sided puts stream")
        a.stop()
        try:
            started = time.monotonic()
            renewed, same = b.renew(target, seed=300 + attempt)
            took = time.monotonic() - started
            held = stats(b, A)["grants_quarantined"]
        finally:
            a.cont()
        target = renewed
        if held:
            break
        assert took < 1.5, took  # A was stopped outside a put: no wait
        a.stream_stop()
    else:
        pytest.fail("A was never stopped inside a put in 20 tries")
    assert held == 1 and not same, (held, same)
    assert 1.9 <= took < 10, took
    time.sleep(0.2)
    counts = a.stream_stop()
    assert set(counts) <= {"LLM_SUCCESS", "LLM_KV_CACHE_NOT_EXIST"}, counts
    assert_holds(b, renewed, 300 + attempt, "after A ran on")


@needs_reach
def test_an_unlinked_holder_reaches_nothing_and_holds_nothing(group):
    """A link that goes (A unlinks) revokes A's grants in their slots: A was
    in no operation, so B lets the memory go at once; a new cache may lie
    where the old one did, and A's later pushes to the id are refused as
    not linked. B's pool (64 MiB) holds two caches of 24 MiB: a third fits
    only once a freed one went back."""
    a, b = linked(group)
    desc = dd.CacheDesc(2, [1, 12 * MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)
    first = b.allocate(desc)
    local = a.allocate(desc)
    a.fill(local, 3)
    wait_granted(a, 1)
    assert a.cm("push_cache", first.key(0), local) is None
    a.unlink(b)
    wait_until(lambda: not b.engine("has_link", A), "B drops its link to A")
    with raises_status(dd.LLMStatusCode.LLM_NOT_YET_LINK):
        a.cm("push_cache", first.key(0), local)
    b.free(first)
    second = b.allocate(desc)
    third = b.allocate(desc)  # in the first cache's memory, let go
    b.fill(second, 4)
    b.fill(third, 5)
    assert_holds(b, second, 4, "the second cache")
    assert_holds(b, third, 5, "the cache in the memory let go")

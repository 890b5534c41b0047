"""One-sided access (LLMConfig.access): the owner grants a linked peer its
caches once, and the peer moves the bytes itself. The shared cases run on
the same-host path and over UCX (transport "ucx", where the peer's
endpoint reaches the owner's memory by itself: cma here, from UCX 1.14
on; test_ucx_one_sided.py holds UCX's own cases).

- The owner is out of the path: frozen (SIGSTOP) after linking, its peer's
  pushes and pulls still complete, every byte checked; with access "owner"
  they time out as before.
- The peer checks every range against the grant before a byte moves, with
  the owner's statuses.
- Revocation: a cache freed while the peer streams writes into it, and a new
  one allocated where it lay, never receives one of them.
- The grants follow the registry: unregistered, replaced and finalized
  caches stop being reached one-sided, and a new cache of a model is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import pytest

import datadist_aio as dd
from support.links import blocks_desc, wait_for_path
from support.peer import (HAVE_UCX, UCX_WHY, CacheRef, MiB, Peer, PeerGroup, raises_status, seeded_tensors,
                          ucx_names_transports, wait_until)

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINKED = (SUCCESS, [SUCCESS])
A, B = 1, 2
BLOCK = 4096

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


def stats(peer: Peer, other: int) -> dict[str, int]:
    return peer.engine("link_stats", other)


# The paths that move bytes one-sided here, and the counters of each.
PATHS = ["same_host", pytest.param("ucx", marks=pytest.mark.skipif(
    not (HAVE_UCX and ucx_names_transports()), reason=f"no UCX that names an endpoint's transports: {UCX_WHY}"))]


def moved(path: str, what: str) -> str:
    """The link_stats name of the one-sided `what` ("ops", "bytes_written", "bytes_read") on `path`."""
    return ("ucx_" if path == "ucx" else "") + "one_sided_" + what


def linked(group: PeerGroup, access: Optional[str] = "one_sided", timeout_ms: int = 5000,
           path: str = "same_host") -> tuple[Peer, Peer]:
    """A (the initiator, with ``access``; None: unset) linked to B (the owner,
    access unset) on the same-host path, or over UCX (``path`` "ucx")."""
    options: dict[str, Any] = {"sync_kv_timeout": timeout_ms}
    theirs: dict[str, Any] = {}
    if access is not None:
        options["access"] = access
    if path == "ucx":
        options["transport"] = theirs["transport"] = "ucx"
    a = group.start("a", dd.LLMRole.PROMPT, A, options=options)
    b = group.start("b", dd.LLMRole.DECODER, B, options=theirs)
    assert a.link(b) == LINKED
    if path == "ucx":
        assert a.datadist("link_transport", B) == "ucx"
    else:
        assert wait_for_path(b, A, "same_host")
    return a, b


def wait_granted(a: Peer, count: int) -> None:
    wait_until(lambda: stats(a, B)["grants_held"] == count, f"A holds {count} grants of B's")


def streaming_pair(group: PeerGroup, path: str) -> tuple[Peer, Peer, CacheRef, CacheRef]:
    """A linked to B on `path`, a cache of B's (4 tensors of 4 MiB) granted
    to A, and a filled cache of A's like it to write from."""
    a, b = linked(group, path=path)
    desc = dd.CacheDesc(4, [1, 4 * MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)
    target = b.allocate(desc)
    local = a.allocate(desc)
    a.fill(local, 9)
    wait_granted(a, 1)
    return a, b, target, local


def stream_writes(a: Peer, target: CacheRef, local: CacheRef) -> None:
    """Starts A's stream of pushes of `local` into slot 0 of `target`, once some landed."""
    a.stream("push_cache", target.key(0), local)
    wait_until(lambda: a.stream_counts().get("LLM_SUCCESS", 0) >= 3, "one-sided writes stream")


def assert_holds(b: Peer, ref: CacheRef, seed: int, what: str) -> None:
    """Every byte of B's cache `ref` is what filling it with `seed` wrote."""
    got = b.read(ref)
    for t, expected in enumerate(seeded_tensors(ref.desc, seed)):
        assert np.array_equal(got[t], expected), f"{what}: tensor {t} of the new cache changed"


def block_rows(tensors: list[np.ndarray], blocks: list[int]) -> list[np.ndarray]:
    return [np.concatenate([t[k * BLOCK : (k + 1) * BLOCK] for k in blocks]) for t in tensors]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("access", ["one_sided", "owner"])
def test_a_frozen_owner_is_not_needed(group, access, path):
    a, b = linked(group, access, timeout_ms=1000, path=path)
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
    if path == "same_host":
        wait_until(lambda: stats(b, A)["grants_given"] == 2, "B grants A what it made, whatever A's access")
    if access == "one_sided":
        wait_granted(a, 2)
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
    # Every byte where it belongs: B's blocks 7-9 from A's 0-2, the rest as
    # they were; A's blocks 5-6 from B's 3-4; B's slot 1 from A's slot 1,
    # after A's slot 0 took what it held.
    got = b.read(remote)
    for t in range(4):
        np.testing.assert_array_equal(block_rows([got[t]], [7, 8, 9])[0], block_rows([sent[t]], [0, 1, 2])[0])
        np.testing.assert_array_equal(block_rows([got[t]], [0, 1, 2, 3, 4, 5, 6])[0],
                                      block_rows([held[t]], [0, 1, 2, 3, 4, 5, 6])[0])
    pulled = a.read(back)
    for t in range(4):
        np.testing.assert_array_equal(block_rows([pulled[t]], [5, 6])[0], block_rows([held[t]], [3, 4])[0])
    slot = 64 * 1024
    now_slots, pulled_slots = b.read(slots), a.read(back_slots)
    for t in range(2):
        np.testing.assert_array_equal(now_slots[t][slot:], sent_slots[t][slot:])
        np.testing.assert_array_equal(now_slots[t][:slot], held_slots[t][:slot])
        np.testing.assert_array_equal(pulled_slots[t][:slot], held_slots[t][slot:])
    # No frame went to B: A moved every byte itself, B served nothing.
    mine, theirs = stats(a, B), stats(b, A)
    assert mine[moved(path, "ops")] >= 4 and mine["framed_ops"] == 0, mine
    assert mine[moved(path, "bytes_written")] == 3 * 4 * BLOCK + 2 * slot, mine
    assert mine[moved(path, "bytes_read")] == 2 * 4 * BLOCK + 2 * slot, mine
    assert theirs["owner_served_ops"] == 0 and theirs["grants_given"] == 2, theirs


def test_a_small_read_is_done_when_its_call_returns(group):
    """A read of up to 8 MiB is copied by the thread that starts it: done
    before its call returns, with no other thread to wait for (on a busy
    host, milliseconds for a core)."""
    a, b = linked(group)
    desc = dd.CacheDesc(2, [1, 4 * MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)  # 8 MiB in all
    theirs = b.allocate(desc)
    held = b.fill(theirs, 6)
    mine = a.allocate(desc)
    wait_granted(a, 1)
    before = stats(a, B)["one_sided_bytes_read"]
    handle, done = a.start_task_looked("pull_cache", theirs.key(0), mine)
    assert done, "the read was not copied in its call"
    assert a.wait_task(handle) == [SUCCESS]
    got = a.read(mine)
    for t in range(2):
        np.testing.assert_array_equal(got[t], held[t])
    assert stats(a, B)["one_sided_bytes_read"] - before == 8 * MiB


@pytest.mark.parametrize("path", PATHS)
def test_ranges_are_checked_against_the_grant_with_the_owners_statuses(group, path):
    a, b = linked(group, path=path)
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
            a.cm("pull_blocks", remote.blocks_key(), bigger, [0], [0])  # blocks of 8 KiB from blocks of 4 KiB
        assert "block size differs" in str(refused.value), refused.value
    finally:
        b.cont()
    got = b.read(remote)
    for t in range(4):
        np.testing.assert_array_equal(got[t], held[t])  # nothing of the refused push landed
    assert stats(b, A)["owner_served_ops"] == 0


@pytest.mark.parametrize("path", PATHS)
def test_a_cache_renewed_under_a_stream_of_writes_never_receives_one(group, path):
    # A streams one-sided writes into B's cache. B frees it and, in the same
    # command, allocates one like it (where the pool puts it: where the old
    # one lay, once the grant's copies in flight are out) and fills it. No
    # write under the old grant may land in the new cache: B's revocation
    # waits for the copy in flight, and A's next copy finds the grant revoked.
    # Over UCX the copies are A's puts (cma), and B also waits for A's answer.
    a, b, target, local = streaming_pair(group, path)
    # Rounds go on until 100 of them renewed the cache where the old one lay
    # (nearly every round does), so the writes had somewhere to land had
    # revocation failed; a round whose pool chose elsewhere still counts.
    rounds, same_place = 0, 0
    while same_place < 100:
        assert rounds < 150, f"the pool reused the place in only {same_place} of {rounds} rounds"
        stream_writes(a, target, local)
        renewed, same = b.renew(target, seed=100 + rounds)
        same_place += same
        time.sleep(0.005)  # the stream goes on toward the freed cache's id
        counts = a.stream_stop()
        assert set(counts) <= {"LLM_SUCCESS", "LLM_KV_CACHE_NOT_EXIST"}, counts
        assert_holds(b, renewed, 100 + rounds, f"round {rounds}")
        target = renewed
        rounds += 1
        wait_granted(a, 1)
    theirs = stats(b, A)
    assert theirs["grants_revoked"] == rounds and theirs["grants_quarantined"] == 0, theirs
    assert theirs["grant_revoke_waits"] > 0, theirs  # some revocations met a copy in flight, and waited it out
    # And A's copies found the revocation in the slot, before the new grant
    # came: the table stopped them, not the grant's arrival.
    assert stats(a, B)["grants_found_revoked"] > 0, stats(a, B)


@pytest.mark.parametrize("path", PATHS)
def test_a_holder_frozen_in_a_copy_leaves_the_memory_held(group, path):
    # A is stopped (SIGSTOP) while it streams one-sided writes into B's
    # cache, most likely inside a copy. B's revocation then waits its bound
    # and leaves the old memory held (quarantined): the new cache lies
    # elsewhere, and when A runs again the rest of its copy lands in memory
    # nobody uses. No byte of the new cache changes.
    a, b, target, local = streaming_pair(group, path)
    for attempt in range(20):
        wait_granted(a, 1)
        stream_writes(a, target, local)
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
        # A was stopped outside a copy: the revocation did not wait.
        assert took < 1.5, took
        a.stream_stop()
    else:
        pytest.fail("A was never stopped inside a copy in 20 tries")
    assert held == 1 and not same, (held, same)
    assert 1.9 <= took < 10, took  # the revocation waited out its 2 s bound, then returned
    time.sleep(0.2)  # A's stream goes on toward the freed cache's id
    counts = a.stream_stop()
    assert set(counts) <= {"LLM_SUCCESS", "LLM_KV_CACHE_NOT_EXIST"}, counts
    assert_holds(b, renewed, 300 + attempt, "after A ran on")


def test_grants_follow_the_registry(group):
    a, b = linked(group)
    first = b.allocate(blocks_desc(), blocks=True, model_id=5)
    registered = b.register(blocks_desc(), blocks=True, model_id=6, remote_accessible=True)
    private = b.register(blocks_desc(), blocks=True, model_id=7, remote_accessible=False)
    local = a.allocate(blocks_desc(), blocks=True)
    sent = a.fill(local, 1)
    wait_granted(a, 2)  # not the cache registered without remote access
    assert a.cm("push_blocks", registered.blocks_key(), local, [0], [0]) is None
    # Unregistered: its grant is revoked, and an operation on it fails as
    # the owner would fail it.
    b.free(registered)
    wait_granted(a, 1)
    with raises_status(dd.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST):
        a.cm("push_blocks", registered.blocks_key(), local, [0], [0])
    # A model's cache replaced: pushes to the model land in the new one.
    b.free(first)
    second = b.allocate(blocks_desc(), blocks=True, model_id=5)
    held = b.fill(second, 2)
    wait_granted(a, 1)
    before = stats(a, B)["one_sided_ops"]
    assert a.cm("push_blocks", second.blocks_key(), local, [1], [2]) is None
    assert stats(a, B)["one_sided_ops"] == before + 1
    got = b.read(second)
    for t in range(4):
        np.testing.assert_array_equal(got[t][2 * BLOCK : 3 * BLOCK], sent[t][BLOCK : 2 * BLOCK])
        np.testing.assert_array_equal(got[t][: 2 * BLOCK], held[t][: 2 * BLOCK])
    # The cache without remote access is refused by its owner, as ever.
    with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID):
        a.cm("push_blocks", private.blocks_key(), local, [0], [0])
    assert stats(b, A)["owner_served_ops"] == 2  # the unregistered cache's push and the private one's


def test_a_finalized_owner_is_reached_no_more(group):
    a, b = linked(group)
    remote = b.allocate(blocks_desc(), blocks=True, model_id=5)
    local = a.allocate(blocks_desc(), blocks=True)
    a.fill(local, 1)
    wait_granted(a, 1)
    assert a.cm("push_blocks", remote.blocks_key(), local, [0], [0]) is None
    b.datadist("finalize")
    wait_until(lambda: not a.engine("has_link", B), "A drops the link B closed")
    with raises_status(dd.LLMStatusCode.LLM_NOT_YET_LINK):
        a.cm("push_blocks", remote.blocks_key(), local, [0], [0])


def test_the_access_option():
    config = dd.LLMConfig()
    assert config.access is None and "llm.Access" not in config.generate_options()
    config.access = "owner"
    assert config.generate_options()["llm.Access"] == "owner"
    with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID):
        config.access = "shared"
    with pytest.raises(TypeError):
        config.access = 1  # type: ignore[assignment]
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, A)
    with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID):
        datadist.init({"llm.EnableCacheManager": "1", "llm.Access": "both"})


def test_the_access_environment_variable(group, monkeypatch):
    # Unset in the config, the engine takes DATADIST_AIO_ACCESS (the
    # children inherit it): owner-served, a frozen owner holds the push up.
    monkeypatch.setenv("DATADIST_AIO_ACCESS", "owner")
    a, b = linked(group, access=None, timeout_ms=1000)
    remote = b.allocate(blocks_desc(), blocks=True, model_id=5)
    local = a.allocate(blocks_desc(), blocks=True)
    assert a.cm("push_blocks", remote.blocks_key(), local, [0], [0]) is None
    mine, theirs = stats(a, B), stats(b, A)
    assert (mine["framed_ops"], mine["one_sided_ops"], theirs["grants_given"]) == (1, 0, 0), (mine, theirs)
    b.stop()
    try:
        with raises_status(dd.LLMStatusCode.LLM_TIMEOUT):
            a.cm("push_blocks", remote.blocks_key(), local, [0], [0])
    finally:
        b.cont()
    monkeypatch.setenv("DATADIST_AIO_ACCESS", "sideways")
    datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, A)
    with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID) as refused:
        datadist.init({"llm.EnableCacheManager": "1"})
    assert "DATADIST_AIO_ACCESS" in str(refused.value), refused.value


def test_the_access_benchmark_runs_and_checks_its_bytes(tmp_path):
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "datadist_aio.bench", "--access", "--cache-size", "8M", "--rounds", "1",
         "--iterations", "1", "--small-ops", "20", "--busy", "1", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "datadist_bench_access.json").read_text())
    rows = {(row["variant"], row["load"]): row for row in report["rounds"]}
    assert set(rows) == {(v, load) for v in ("owner", "one_sided") for load in ("quiet", "busy")}
    assert all(row["verified"] and row["path"] == "same_host" for row in rows.values())
    assert all(rows[("one_sided", load)]["framed_ops"] == 0 < rows[("one_sided", load)]["one_sided_ops"]
               for load in ("quiet", "busy"))
    assert all(rows[("owner", load)]["one_sided_ops"] == 0 < rows[("owner", load)]["framed_ops"]
               for load in ("quiet", "busy"))
    assert "one_sided/owner" in done.stdout


@pytest.mark.skipif(not HAVE_UCX, reason=f"no UCX: {UCX_WHY}")
def test_over_ucx_without_an_endpoint_that_reaches_the_owner_the_owner_serves(group):
    """Whatever UCX says of its endpoint, every byte arrives; where it names
    none that reaches the owner's memory (UCX before 1.14), A asks for no
    grant and B serves; here UCX 1.14 on reaches it with cma (DIRECT, 2)."""
    a, b = linked(group, path="ucx")
    remote = b.allocate(blocks_desc(), blocks=True, model_id=5)
    held = b.fill(remote, 1)
    local = a.allocate(blocks_desc(), blocks=True)
    sent = a.fill(local, 2)
    reach = stats(a, B)["ucx_reach"]
    assert reach == (2 if ucx_names_transports() else 0), (reach, UCX_WHY)
    if reach:
        wait_granted(a, 1)
    assert a.cm_async("push_blocks", remote.blocks_key(), local, [0, 1], [3, 4]) == [SUCCESS]
    got = b.read(remote)
    for t in range(4):
        np.testing.assert_array_equal(block_rows([got[t]], [3, 4])[0], block_rows([sent[t]], [0, 1])[0])
        np.testing.assert_array_equal(block_rows([got[t]], [0, 1, 2, 5])[0], block_rows([held[t]], [0, 1, 2, 5])[0])
    mine, theirs = stats(a, B), stats(b, A)
    if reach:
        assert mine["ucx_one_sided_ops"] == 1 and theirs["owner_served_ops"] == 0, (mine, theirs)
    else:
        assert mine["ucx_one_sided_ops"] == 0 and theirs["grants_given"] == 0, (mine, theirs)
        assert theirs["ucx_bytes_served"] == 2 * 4 * BLOCK, theirs


@pytest.mark.parametrize("path", PATHS)
def test_a_link_that_goes_revokes_its_grants_and_holds_nothing(group, path):
    """A link that goes (A unlinks) revokes A's grants in their slots: A was
    in no copy, so B lets the memory go at once, and A's later pushes to the
    id are refused as not linked. B's pool (64 MiB) holds two caches of 24
    MiB: a third fits only once the freed one went back."""
    a, b = linked(group, path=path)
    desc = dd.CacheDesc(2, [1, 12 * MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)
    first = b.allocate(desc)
    local = a.allocate(desc)
    a.fill(local, 3)
    wait_granted(a, 1)
    assert a.cm("push_cache", first.key(0), local) is None
    assert stats(a, B)[moved(path, "ops")] >= 1
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


@pytest.mark.parametrize("path", PATHS)
def test_a_link_lost_while_its_holder_is_in_a_copy_holds_the_memory_until_it_exits(group, path):
    """A is stopped while it streams writes into B's cache, and B drops the
    link (a forced unlink). Where A was inside a copy, B cannot know when it
    ends: the cache's memory stays held after B frees it (B's pool of 64 MiB
    takes no third cache of 24 MiB), until A has exited; then B's next
    revocation lets it go. No byte of what B holds changes meanwhile."""
    a, b = linked(group, path=path)
    desc = dd.CacheDesc(2, [1, 12 * MiB], dd.DataType.DT_UINT8, dd.Placement.HOST)
    target = b.allocate(desc)
    local = a.allocate(desc)
    a.fill(local, 9)
    wait_granted(a, 1)
    for attempt in range(20):
        a.stream("push_cache", target.key(0), local)
        wait_until(lambda: a.stream_counts().get("LLM_SUCCESS", 0) >= 3, "one-sided writes stream")
        a.stop()
        b.unlink(a, force=True)
        b.free(target)
        second = b.allocate(desc)
        try:
            third = b.allocate(desc)
        except dd.LLMException as exc:
            assert exc.status_code is dd.LLMStatusCode.LLM_OUT_OF_MEMORY, exc
            break  # held: A was inside a copy
        # A was stopped outside a copy: nothing held. Again, on a new link.
        a.cont()
        a.stream_stop()
        b.free(second)
        b.free(third)
        wait_until(lambda: not a.engine("has_link", B), "A drops the link B closed")
        assert a.link(b) == LINKED
        target = b.allocate(desc)
        wait_granted(a, 1)
    else:
        pytest.fail("A was never stopped inside a copy in 20 tries")
    held = b.fill(second, 4)
    a.kill()
    # A has exited: a revocation on B (of a cache granted to C, freed) looks
    # at the held memory again and lets it go.
    c_options: dict[str, Any] = {"transport": "ucx"} if path == "ucx" else {}
    c = group.start("c", dd.LLMRole.PROMPT, 3, options=c_options)
    assert c.link(b) == LINKED
    small = dd.CacheDesc(1, [1, 4096], dd.DataType.DT_UINT8, dd.Placement.HOST)

    def third_fits() -> bool:
        probe = b.allocate(small)
        wait_until(lambda: stats(c, B)["grants_held"] >= 1, "C holds B's grant")
        b.free(probe)
        try:
            b.free(b.allocate(desc))
        except dd.LLMException:
            return False
        return True

    wait_until(third_fits, "the memory A could reach goes back once A exited")
    assert_holds(b, second, 4, "the cache B kept")
    assert held

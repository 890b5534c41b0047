"""Answers on a same-host link's answer socket, and who reads them.

Whoever waits reads: an awaiting loop's drain (the completion fd includes
the answer sockets), a thread that looks at a task (``done()``,
``get_results(0)``), the engine's answer thread for a thread blocking in a
wait, the callback thread for a callback registered from no loop. An answer
nobody waits for is read by the housekeeper's sweep; one that came before
its link went down still counts. Every case checks the bytes that landed,
the result, and which reader took the answers (``answer_counts``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import pytest

import datadist_aio as dd
from support.peer import WAIT_STYLES, CacheRef, Peer, PeerGroup, main_thread_sleeps, unread_socket_bytes, wait_until
from support.links import blocks_desc, wait_for_path

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINKED = (SUCCESS, [SUCCESS])
A, B = 1, 2
BLOCK = 4096
OPS = 20

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


def linked_pair(
    group: PeerGroup, loop: str = "asyncio", transport: str = "auto", options: Optional[dict[str, Any]] = None
) -> tuple[Peer, Peer]:
    # Owner-served ("owner" access): answers are what these tests look at;
    # a one-sided operation has none.
    a = group.start("a", dd.LLMRole.PROMPT, A, loop=loop,
                    options={"transport": transport, "access": "owner", **(options or {})})
    b = group.start("b", dd.LLMRole.DECODER, B, options={"transport": transport})
    assert a.link(b) == LINKED
    return a, b


def prepared(
    group: PeerGroup,
    seed: int,
    loop: str = "asyncio",
    transport: str = "auto",
    options: Optional[dict[str, Any]] = None,
) -> tuple[Peer, Peer, CacheRef, CacheRef, list[np.ndarray]]:
    """A linked pair, a filled blocks cache on A (started with ``options``), a blocks cache of model 3 on B."""
    a, b = linked_pair(group, loop, transport, options)
    local = a.allocate(blocks_desc(), blocks=True)
    remote = b.allocate(blocks_desc(), blocks=True, model_id=3)
    return a, b, local, remote, a.fill(local, seed)


def counts(peer: Peer) -> dict[str, int]:
    return dict(peer.engine("answer_counts"))


def read_since(peer: Peer, before: dict[str, int]) -> dict[str, int]:
    now = counts(peer)
    return {name: now[name] - before[name] for name in now}


def assert_block_moved(a: Peer, b: Peer, local, remote, sent: list[np.ndarray], src: int, dst: int) -> None:
    got = b.read(remote)
    for t in range(4):
        np.testing.assert_array_equal(
            got[t][dst * BLOCK : (dst + 1) * BLOCK], sent[t][src * BLOCK : (src + 1) * BLOCK]
        )


def with_owner_held(initiator: Peer, owner: Peer, call: Any) -> Any:
    """``call()`` (a command to the initiator) run while ``owner`` is frozen
    (SIGSTOP) until the operation's request waits in the owner's socket and
    the initiator's main thread sleeps in its wait: the answer comes after the
    waiter waits, however loaded the machine (an unloaded one answers a 4 KiB
    push before the waiter would get there)."""
    result: list[Any] = []
    owner.stop()
    caller = threading.Thread(target=lambda: result.append(call()))
    try:
        caller.start()
        wait_until(lambda: unread_socket_bytes(owner.pid) > 0, "the request reaches the frozen owner")
        wait_until(lambda: main_thread_sleeps(initiator.pid), "the initiator waits for the answer")
    finally:
        owner.cont()
    caller.join(60)
    assert result, "the held call did not return"
    return result[0]


# Who may read the answers of each way of waiting (answer_hub.h): the waiter
# itself, at the moment it waits. With the sweep off (answer_sweep_ms=0) an
# answer no waiter reads would wait for sync_kv_timeout and be read by the
# link ("link"), so these counts are exact whatever the machine's load.
READERS = {
    "await": {"drain", "look"},
    "callback_in_loop": {"drain", "look"},
    "callback": {"drain", "look"},  # the callback thread's drain
    "poll_in_loop": {"drain", "look"},
    "poll": {"look", "thread"},  # "thread": the answer thread may linger after a blocking call
    "poll_results": {"look", "thread"},
    "synchronize": {"look", "thread"},
    "blocking_in_loop": {"look", "thread"},
}
NO_SWEEP = {"answer_sweep_ms": 0}


def test_every_way_of_waiting_the_harness_has_is_checked():
    assert set(READERS) == set(WAIT_STYLES)


@pytest.mark.parametrize(
    "style, loop",
    [(style, "asyncio") for style in READERS] + [("await", "uvloop"), ("callback_in_loop", "uvloop")],
)
def test_every_way_of_waiting_reads_its_own_answers(group, style, loop):
    a, b, local, remote, sent = prepared(group, 5, loop, options=NO_SWEEP)
    wait_for_path(a, B, "same_host")
    assert a.engine("link_stats", B)["answer_socket"] == 1
    assert b.engine("link_stats", A)["answer_socket"] == 1
    # One awaited write first, so the loop watches the completion fd as a
    # long-lived caller's would: the styles with no running loop must not
    # lean on it.
    assert a.cm_async("push_blocks", remote.blocks_key(), local, [0], [0]) == [SUCCESS]
    before = counts(a)
    threads = set()
    for i in range(OPS):
        def waited(i: int = i) -> tuple[Any, str]:
            return a.cm_waited(style, "push_blocks", remote.blocks_key(), local, [i % 16], [(i + 1) % 16])

        # The first operation's answer comes after its waiter waits: a
        # callback is then registered on a task that is not done yet.
        result, where = with_owner_held(a, b, waited) if i == 0 else waited()
        assert result == [SUCCESS]
        threads.add(where)
    read = read_since(a, before)
    assert sum(read.values()) == OPS, read
    assert {name for name, n in read.items() if n} <= READERS[style], read
    if style == "callback":
        # Run by the callback thread, or at once where the task was done when registered.
        assert threads <= {"datadist-aio-callbacks", "MainThread"} and "datadist-aio-callbacks" in threads, threads
    elif style == "callback_in_loop":
        assert threads == {"MainThread"}, threads
    for i in range(OPS - 16, OPS):
        assert_block_moved(a, b, local, remote, sent, i % 16, (i + 1) % 16)


def test_a_blocking_wait_has_the_answer_thread_read(group):
    # The answer comes after the blocking call's first look: the answer
    # thread reads it for the sleeping caller.
    a, b, local, remote, sent = prepared(group, 6, options=NO_SWEEP)
    before = counts(a)
    for i in range(OPS):
        def push(i: int = i) -> Any:
            return a.cm("push_blocks", remote.blocks_key(), local, [i % 16], [15 - i % 16])

        # The first answer comes while the caller sleeps in its wait.
        assert (with_owner_held(a, b, push) if i == 0 else push()) is None
    read = read_since(a, before)
    assert read["thread"] + read["look"] == OPS and read["thread"] > 0, read
    for i in range(OPS - 16, OPS):
        assert_block_moved(a, b, local, remote, sent, i % 16, 15 - i % 16)


def in_flight_settles(peer: Peer, seconds: float) -> None:
    """Waits, without looking at any task, until the peer has no request in flight."""
    deadline = time.monotonic() + seconds
    while peer.engine("requests_in_flight") != 0:
        assert time.monotonic() < deadline, "the answer was never read"
        time.sleep(0.01)


def test_an_answer_nobody_waits_for_is_read_by_the_sweep(group):
    a, b, local, remote, sent = prepared(group, 7)
    before = counts(a)
    # Started, never awaited nor looked at, no thread blocking on it.
    handle = a.start_task("push_blocks", remote.blocks_key(), local, [2, 3], [4, 5])
    in_flight_settles(a, 30.0)
    read = read_since(a, before)
    assert read == {"drain": 0, "look": 0, "thread": 0, "sweep": 1, "link": 0}, read
    assert a.wait_task(handle) == [SUCCESS]
    assert_block_moved(a, b, local, remote, sent, 2, 4)
    assert_block_moved(a, b, local, remote, sent, 3, 5)


def test_without_the_sweep_an_answer_waits_for_its_first_look(group):
    a, b, local, remote, sent = prepared(group, 10, options=NO_SWEEP)
    before = counts(a)
    handle = a.start_task("push_blocks", remote.blocks_key(), local, [2], [9])
    wait_until(lambda: unread_socket_bytes(a.pid) > 0, "the owner's answer waits in the answer socket")
    assert a.engine("requests_in_flight") == 1
    assert sum(read_since(a, before).values()) == 0
    assert a.task_done(handle) is True  # the look reads it
    assert read_since(a, before) == {"drain": 0, "look": 1, "thread": 0, "sweep": 0, "link": 0}
    assert a.wait_task(handle) == [SUCCESS]
    assert_block_moved(a, b, local, remote, sent, 2, 9)


def test_an_answer_that_came_before_the_link_went_down_counts(group):
    # The initiator is stopped with its push sent; the owner answers on the
    # answer socket and dies. Running again, the initiator finds the link
    # down and the answer waiting: the push succeeded, and says so.
    a, b, local, remote, sent = prepared(group, 8)
    handle = a.start_task("push_blocks", remote.blocks_key(), local, [1], [6])
    a.stop()
    try:
        # The owner copies from the stopped process and answers.
        wait_until(lambda: unread_socket_bytes(a.pid) > 0, "the owner's answer waits in the answer socket")
        landed = b.read(remote)
        b.kill()
    finally:
        a.cont()
    assert a.wait_task(handle) == [SUCCESS]
    for t in range(4):
        np.testing.assert_array_equal(landed[t][6 * BLOCK : 7 * BLOCK], sent[t][BLOCK : 2 * BLOCK])


def test_tcp_links_have_no_answer_socket(group):
    a, b, local, remote, sent = prepared(group, 9, transport="tcp")
    assert a.engine("link_stats", B)["answer_socket"] == 0
    before = counts(a)
    assert a.cm_async("push_blocks", remote.blocks_key(), local, [0], [1]) == [SUCCESS]
    assert read_since(a, before) == {"drain": 0, "look": 0, "thread": 0, "sweep": 0, "link": 0}
    assert_block_moved(a, b, local, remote, sent, 0, 1)

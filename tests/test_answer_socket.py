"""Answers on a same-host link's answer socket, and who reads them.

An awaited operation's answer is read by the awaiting loop's own thread (the
completion fd includes the answer sockets); a blocking wait has the engine's
answer thread read it; an answer nobody waits for is read by the
housekeeper's sweep; an answer that came before its link went down still
counts. Every case checks the bytes that landed, the result, and which
reader took the answers (``answer_counts``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import datadist_aio as dd
from peer import CacheRef, Peer, PeerGroup
from test_same_host import blocks_desc
from test_transfer import wait_for_path

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


def linked_pair(group: PeerGroup, loop: str = "asyncio", transport: str = "auto") -> tuple[Peer, Peer]:
    options = {"transport": transport}
    a = group.start("a", dd.LLMRole.PROMPT, A, loop=loop, options=options)
    b = group.start("b", dd.LLMRole.DECODER, B, options=options)
    assert a.link(b) == LINKED
    return a, b


def prepared(
    group: PeerGroup, seed: int, loop: str = "asyncio", transport: str = "auto"
) -> tuple[Peer, Peer, CacheRef, CacheRef, list[np.ndarray]]:
    """A linked pair, a filled blocks cache on A, a blocks cache of model 3 on B."""
    a, b = linked_pair(group, loop, transport)
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


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_awaited_answers_are_read_on_the_loop_thread(group, loop):
    a, b, local, remote, sent = prepared(group, 5, loop)
    wait_for_path(a, B, "same_host")
    assert a.engine("link_stats", B)["answer_socket"] == 1
    assert b.engine("link_stats", A)["answer_socket"] == 1
    before = counts(a)
    for i in range(OPS):
        assert a.cm_async("push_blocks", remote.blocks_key(), local, [i % 16], [(i + 1) % 16]) == [SUCCESS]
    read = read_since(a, before)
    # The sweep takes an answer when no one has read answers since its last
    # round (20 ms): on a loaded machine, one that comes right after a long
    # pause between commands may be read by it first.
    assert read["drain"] + read["sweep"] == OPS and read["drain"] >= OPS // 2, read
    assert read["thread"] == 0 and read["link"] == 0, read
    for i in range(OPS - 16, OPS):
        assert_block_moved(a, b, local, remote, sent, i % 16, (i + 1) % 16)


def test_blocking_waits_have_the_answer_thread_read(group):
    a, b, local, remote, sent = prepared(group, 6)
    before = counts(a)
    for i in range(OPS):
        assert a.cm("push_blocks", remote.blocks_key(), local, [i % 16], [15 - i % 16]) is None
    read = read_since(a, before)
    assert read["thread"] + read["sweep"] == OPS and read["thread"] >= OPS // 2, read
    assert read["drain"] == 0, read
    for i in range(OPS - 16, OPS):
        assert_block_moved(a, b, local, remote, sent, i % 16, 15 - i % 16)


def test_an_answer_nobody_waits_for_is_read_by_the_sweep(group):
    a, b, local, remote, sent = prepared(group, 7)
    before = counts(a)
    # Started, never awaited, no thread blocking on it: no loop reads the answer.
    handle = a.start_task("push_blocks", remote.blocks_key(), local, [2, 3], [4, 5])
    deadline = time.monotonic() + 2.0
    while not a.task_done(handle):
        assert time.monotonic() < deadline, "the answer was never read"
        time.sleep(0.01)
    read = read_since(a, before)
    assert read == {"drain": 0, "thread": 0, "sweep": 1, "link": 0}, read
    assert a.wait_task(handle) == [SUCCESS]
    assert_block_moved(a, b, local, remote, sent, 2, 4)
    assert_block_moved(a, b, local, remote, sent, 3, 5)


def test_an_answer_that_came_before_the_link_went_down_counts(group):
    # The initiator is stopped with its push sent; the owner answers on the
    # answer socket and dies. Running again, the initiator finds the link
    # down and the answer waiting: the push succeeded, and says so.
    a, b, local, remote, sent = prepared(group, 8)
    handle = a.start_task("push_blocks", remote.blocks_key(), local, [1], [6])
    a.stop()
    try:
        time.sleep(0.2)  # the owner copies from the stopped process and answers
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
    assert read_since(a, before) == {"drain": 0, "thread": 0, "sweep": 0, "link": 0}
    assert_block_moved(a, b, local, remote, sent, 0, 1)

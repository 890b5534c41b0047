"""The test path between processes (the cases within one process are
tests/cpp/test_test_path.cpp): engines of two processes, both with
``$DATADIST_AIO_TEST_PATH=1``, never take it. Each end's handshake part
names its process by a token of its own, and a part naming another process
gives the link no such path; the bytes go inline, every one of them checked.
"""

from __future__ import annotations

import pytest

import datadist_aio as dd
from support.links import assert_both_ways
from support.peer import PeerGroup

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
A, B = 1, 2

pytestmark = pytest.mark.timeout(60)


def test_engines_of_two_processes_never_take_it(monkeypatch):
    monkeypatch.setenv("DATADIST_AIO_TEST_PATH", "1")
    with PeerGroup() as group:
        a = group.start("a", dd.LLMRole.PROMPT, A, options={"transport": "tcp"})
        b = group.start("b", dd.LLMRole.DECODER, B, options={"transport": "tcp"})
        assert a.link(b) == (SUCCESS, [SUCCESS])
        assert_both_ways(a, b, (40, 41), seed=7)
        for peer, other in ((a, B), (b, A)):
            stats = peer.engine("link_stats", other)
            assert "test_moves" not in stats, stats
            assert stats["framed_ops"] > 0

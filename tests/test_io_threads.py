"""The transport's I/O threads: a fixed number of them read and write the
frames of every link, however many links a process has.

A decode process linked with several prefills keeps exactly its
``io_threads`` I/O threads, and no more threads at all, while the links
come; frames larger than a direct send and a socket buffer (the loop reads
and writes them as the socket allows) arrive whole in both directions,
bytes checked.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

import datadist_aio as dd
from support.peer import Peer, PeerGroup, raises_status

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
BLOCK = 1 << 20  # past a direct send and a socket buffer: the I/O loop writes each frame in turns
DECODE = 100

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


def thread_names(pid: int) -> Counter[str]:
    names: Counter[str] = Counter()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                names[f.read().strip()] += 1
        except FileNotFoundError:
            pass  # a thread that ended between the listing and the read
    return names


def settled_names(pid: int, io_threads: int, seconds: float = 30.0) -> Counter[str]:
    """The thread names once the I/O threads have named themselves (a thread
    just started still has its process's name for a moment)."""
    deadline = time.monotonic() + seconds
    names = thread_names(pid)
    while names["dd-io"] < io_threads and time.monotonic() < deadline:
        time.sleep(0.01)
        names = thread_names(pid)
    return names


def blocks(count: int = 8) -> dd.CacheDesc:
    return dd.CacheDesc(2, [count, BLOCK], dd.DataType.DT_UINT8, dd.Placement.HOST)


def test_io_threads_option_is_checked() -> None:
    config = dd.LLMConfig()
    assert config.io_threads is None
    assert "llm.IoThreads" not in config.generate_options()
    config.io_threads = 3
    assert config.generate_options()["llm.IoThreads"] == "3"
    for bad in (0, 65):
        with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID):
            config.io_threads = bad
    with pytest.raises(TypeError):
        config.io_threads = "2"  # type: ignore[assignment]


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_fixed_number_of_io_threads_serves_every_link(group: PeerGroup, transport: str) -> None:
    decode = group.start("decode", dd.LLMRole.DECODER, DECODE, options={"io_threads": 2, "transport": transport})
    inbox = decode.allocate(blocks(16), blocks=True, model_id=7)
    prefills: list[Peer] = []
    for i in range(4):
        prefill = group.start(f"prefill{i}", dd.LLMRole.PROMPT, 10 + i, options={"transport": transport})
        assert prefill.link(decode) == (SUCCESS, [SUCCESS])
        prefills.append(prefill)
        names = settled_names(decode.pid, 2)
        assert names["dd-io"] == 2, names
        # No thread per link or connection: the count stays what it was with one link.
        assert names["dd-read"] == names["dd-write"] == 0, names
        if i == 0:
            first = sum(names.values())
        assert sum(names.values()) == first, (names, first)
    for i, prefill in enumerate(prefills):
        # Prefill i writes its blocks 0..3 into the decode's blocks 4i..4i+3.
        local = prefill.allocate(blocks(), blocks=True, model_id=1)
        sent = prefill.fill(local, seed=i)
        dst = [4 * i + k for k in range(4)]
        assert prefill.cm_async("push_blocks", inbox.blocks_key(), local, [0, 1, 2, 3], dst) == [SUCCESS]
        # The prefill reads them back: the decode's loop writes the data.
        back = prefill.allocate(blocks(), blocks=True)
        assert prefill.cm_async("pull_blocks", inbox.blocks_key(), back, dst, [4, 5, 6, 7]) == [SUCCESS]
        pulled = prefill.read(back)
        got = decode.read(inbox)
        for t in range(2):
            want = sent[t][: 4 * BLOCK]
            np.testing.assert_array_equal(got[t][dst[0] * BLOCK : (dst[-1] + 1) * BLOCK], want)
            np.testing.assert_array_equal(pulled[t][4 * BLOCK : 8 * BLOCK], want)
    names = thread_names(decode.pid)
    assert names["dd-io"] == 2, names

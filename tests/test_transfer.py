"""push_cache / push_blocks / pull_cache / pull_blocks between two linked processes.

Every test checks the bytes that arrived and that every other byte of the
destination kept what it held before. Process ``a`` opened the link to ``b``;
pushes go from ``a`` to ``b`` and pulls are made by ``b``, so both ends of the
link are exercised. The main cases run blocking, awaited under asyncio, and
awaited under uvloop in the child processes.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Optional

import numpy as np
import pytest

import datadist_aio as dd
from support.links import wait_for_path
from support.peer import HAVE_UCX, HAVE_UVLOOP, UCX_WHY, CacheRef, Peer, PeerGroup, raises_status

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
PARAM_INVALID = dd.LLMStatusCode.LLM_PARAM_INVALID
NOT_EXIST = dd.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
NOT_YET_LINK = dd.LLMStatusCode.LLM_NOT_YET_LINK
A, B, UNLINKED = 1, 2, 99

pytestmark = pytest.mark.timeout(60)

_model_ids = itertools.count(100)


class Pair(NamedTuple):
    a: Peer
    b: Peer
    via: str  # "sync": the blocking call; "async": the awaited X_async

    def move(self, peer: Peer, method: str, *args: Any, **kwargs: Any) -> None:
        """Runs a transfer that must succeed; awaited, it gives one LLM_SUCCESS."""
        result = peer.run(self.via, method, *args, **kwargs)
        assert result == ([SUCCESS] if self.via == "async" else None)


@pytest.fixture(scope="module")
def pairs() -> Iterator[dict[str, tuple[Peer, Peer]]]:
    """One linked pair of processes per event loop kind, shared by the module:
    on one host their bytes move by kernel copy; the "tcp" pair (asyncio) is
    told to use sockets, and the "ucx" pair (asyncio, where UCX is
    installed) UCX."""
    with PeerGroup() as group:
        made = {}
        for name in ["asyncio", "tcp"] + (["uvloop"] if HAVE_UVLOOP else []) + (["ucx"] if HAVE_UCX else []):
            loop = "asyncio" if name in ("tcp", "ucx") else name
            options = {"transport": name} if name in ("tcp", "ucx") else {}
            a = group.start(f"a-{name}", dd.LLMRole.PROMPT, A, loop=loop, options=options)
            b = group.start(f"b-{name}", dd.LLMRole.DECODER, B, loop=loop, options=options)
            assert a.link(b) == (SUCCESS, [SUCCESS])
            path = name if name in ("tcp", "ucx") else "same_host"
            assert a.datadist("link_transport", B) == path
            assert wait_for_path(b, A, path)
            made[name] = (a, b)
        yield made


def _pair(pairs: dict[str, tuple[Peer, Peer]], loop: str, via: str) -> Iterator[Pair]:
    a, b = pairs[loop]
    yield Pair(a, b, via)
    a.free_all()
    b.free_all()


@pytest.fixture(
    params=[
        pytest.param(("asyncio", "sync"), id="sync"),
        pytest.param(("asyncio", "async"), id="asyncio"),
        pytest.param(("uvloop", "async"), id="uvloop", marks=pytest.mark.skipif(not HAVE_UVLOOP, reason="no uvloop")),
        pytest.param(("tcp", "async"), id="tcp"),
        pytest.param(("ucx", "async"), id="ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason=f"no UCX: {UCX_WHY}")),
    ]
)
def pair(request, pairs) -> Iterator[Pair]:
    """The module's linked pair, in each way of calling; caches freed after the test."""
    yield from _pair(pairs, *request.param)


@pytest.fixture(
    params=["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(not HAVE_UVLOOP, reason="no uvloop"))]
)
def async_pair(request, pairs) -> Iterator[Pair]:
    """The pair of each event loop kind, awaited."""
    yield from _pair(pairs, request.param, "async")


@pytest.fixture(params=["sync", "async"])
def checked(request, pairs) -> Iterator[Pair]:
    """The asyncio pair, blocking and awaited, for the error cases."""
    yield from _pair(pairs, "asyncio", request.param)


@pytest.fixture
def group() -> Iterator[PeerGroup]:
    with PeerGroup() as peers:
        yield peers


# -- geometry and the expected bytes ---------------------------------------------------


def blocks_desc(num_tensors: int = 4, num_blocks: int = 32, block_elems: int = 128) -> dd.CacheDesc:
    """A blocks cache of float16 tensors; a block is ``2 * block_elems`` bytes."""
    return dd.CacheDesc(num_tensors, [num_blocks, 8, block_elems // 8], dd.DataType.DT_FLOAT16, dd.Placement.HOST)


def slots_desc(num_tensors: int = 4, batch: int = 4, slot_bytes: int = 512) -> dd.CacheDesc:
    return dd.CacheDesc(num_tensors, [batch, slot_bytes // 4], dd.DataType.DT_INT32, dd.Placement.HOST)


def make(peer: Peer, desc: dd.CacheDesc, registered: bool, blocks: bool, model_id: Optional[int] = None) -> CacheRef:
    if registered:
        return peer.register(desc, blocks=blocks, model_id=model_id)
    return peer.allocate(desc, blocks=blocks, model_id=model_id)


def expect_copy(
    before: Sequence[np.ndarray],
    source: Sequence[np.ndarray],
    slot_pairs: Sequence[tuple[int, int]],
    unit: int,
    src_range: Optional[range] = None,
    dst_range: Optional[range] = None,
    per_layer: int = 2,
) -> list[np.ndarray]:
    """``before`` after copying ``unit`` bytes at slot/block ``s * unit`` of source
    tensor ``sl * N + i`` to ``d * unit`` of tensor ``dl * N + i``, for every
    ``(s, d)`` in ``slot_pairs``, layer pair ``(sl, dl)`` and ``i < N``. A
    missing range means every layer of the source."""
    every_layer = range(len(source) // per_layer)
    src_layers, dst_layers = src_range or every_layer, dst_range or every_layer
    expected = [t.copy() for t in before]
    for src_layer, dst_layer in zip(src_layers, dst_layers, strict=True):
        for i in range(per_layer):
            src, dst = source[src_layer * per_layer + i], expected[dst_layer * per_layer + i]
            for s, d in slot_pairs:
                dst[d * unit : (d + 1) * unit] = src[s * unit : (s + 1) * unit]
    return expected


def assert_tensors(got: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for t, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(g, e, err_msg=f"tensor {t}")


def block_map(rng: np.random.Generator, num_blocks: int, runs: bool) -> tuple[list[int], list[int]]:
    """Distinct source and destination blocks: random ones, or runs of consecutive blocks."""
    if not runs:
        count = int(rng.integers(1, num_blocks // 2))
        src = rng.choice(num_blocks, count, replace=False)
        dst = rng.choice(num_blocks, count, replace=False)
        return [int(x) for x in src], [int(x) for x in dst]
    src, dst = [], []
    starts = rng.choice(num_blocks // 4, 3, replace=False) * 4
    targets = rng.permutation(num_blocks // 4)[:3] * 4
    for s, d in zip(starts, targets):
        length = int(rng.integers(1, 5))
        src += range(int(s), int(s) + length)
        dst += range(int(d), int(d) + length)
    return src, dst


# (num_tensors, tensor_num_per_layer, src_layer_range, dst_layer_range); None = default.
LAYER_CASES = [
    pytest.param(4, 2, None, None, id="default-N2"),
    pytest.param(4, 1, range(1, 3), range(2, 4), id="N1-shifted"),
    pytest.param(8, 4, range(0, 1), range(1, 2), id="N4-one-layer"),
    pytest.param(6, 2, range(0, 2), range(1, 3), id="N2-overlap"),
    pytest.param(6, 2, range(2, 3), range(0, 1), id="N2-down"),
]


def layer_kwargs(src_range: Optional[range], dst_range: Optional[range], per_layer: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"tensor_num_per_layer": per_layer}
    if src_range is not None:
        kwargs.update(src_layer_range=src_range, dst_layer_range=dst_range)
    return kwargs


# -- data movement ---------------------------------------------------------------------


@pytest.mark.parametrize("registered", [False, True], ids=["allocated", "registered"])
@pytest.mark.parametrize("runs", [False, True], ids=["random", "runs"])
@pytest.mark.parametrize("num_tensors, per_layer, src_range, dst_range", LAYER_CASES)
def test_push_blocks(pair, num_tensors, per_layer, src_range, dst_range, runs, registered):
    rng = np.random.default_rng([num_tensors, per_layer, int(runs), int(registered)])
    model_id = next(_model_ids)
    desc = blocks_desc(num_tensors)
    local = make(pair.a, desc, registered, True)
    remote = make(pair.b, desc, not registered, True, model_id)
    sent = pair.a.fill(local, 1)
    before = pair.b.fill(remote, 2)
    src_blocks, dst_blocks = block_map(rng, 32, runs)
    ranges = layer_kwargs(src_range, dst_range, per_layer)
    pair.move(pair.a, "push_blocks", remote.blocks_key(), local, src_blocks, dst_blocks, **ranges)
    block_pairs = list(zip(src_blocks, dst_blocks))
    expected = expect_copy(before, sent, block_pairs, desc.slot_size, src_range, dst_range, per_layer)
    assert_tensors(pair.b.read(remote), expected)
    assert_tensors(pair.a.read(local), sent)


@pytest.mark.parametrize("num_tensors, per_layer, src_range, dst_range", LAYER_CASES)
def test_push_cache(pair, num_tensors, per_layer, src_range, dst_range):
    # Batch sizes differ, slot sizes match.
    local = pair.a.allocate(slots_desc(num_tensors, batch=3))
    remote = pair.b.register(slots_desc(num_tensors, batch=5))
    sent = pair.a.fill(local, 3)
    before = pair.b.fill(remote, 4)
    pair.move(pair.a, "push_cache", remote.key(4), local, 2, **layer_kwargs(src_range, dst_range, per_layer))
    expected = expect_copy(before, sent, [(2, 4)], 512, src_range, dst_range, per_layer)
    assert_tensors(pair.b.read(remote), expected)


@pytest.mark.parametrize("num_tensors, per_layer, src_range, dst_range", LAYER_CASES)
def test_pull_cache(pair, num_tensors, per_layer, src_range, dst_range):
    remote = pair.a.register(slots_desc(num_tensors, batch=2))
    local = pair.b.allocate(slots_desc(num_tensors, batch=6))
    data = pair.a.fill(remote, 5)
    before = pair.b.fill(local, 6)
    pair.move(pair.b, "pull_cache", remote.key(1), local, 5, **layer_kwargs(src_range, dst_range, per_layer))
    expected = expect_copy(before, data, [(1, 5)], 512, src_range, dst_range, per_layer)
    assert_tensors(pair.b.read(local), expected)
    assert_tensors(pair.a.read(remote), data)


@pytest.mark.parametrize("given", ["src_layer_range", "dst_layer_range"])
def test_one_layer_range_stands_for_both(pair, given):
    # A deliberate difference (docs/differences.md): upstream defaulted the
    # missing range to every source layer and refused the call.
    model_id = next(_model_ids)
    local = pair.a.allocate(blocks_desc(6), blocks=True)
    remote = pair.b.allocate(blocks_desc(6), blocks=True, model_id=model_id)
    sent = pair.a.fill(local, 31)
    before = pair.b.fill(remote, 32)
    pair.move(pair.a, "push_blocks", remote.blocks_key(), local, [3, 4], [9, 1], **{given: range(1, 2)})
    assert_tensors(pair.b.read(remote), expect_copy(before, sent, [(3, 9), (4, 1)], 256, range(1, 2), range(1, 2)))
    back = pair.b.allocate(slots_desc(6))
    data = pair.a.allocate(slots_desc(6))
    sent = pair.a.fill(data, 33)
    before = pair.b.fill(back, 34)
    pair.move(pair.b, "pull_cache", data.key(2), back, 0, **{given: range(2, 3)})
    assert_tensors(pair.b.read(back), expect_copy(before, sent, [(2, 0)], 512, range(2, 3), range(2, 3)))


def test_pull_cache_first_bytes_of_a_slot(pair):
    remote = pair.a.allocate(slots_desc())
    local = pair.b.allocate(slots_desc())
    data = pair.a.fill(remote, 7)
    before = pair.b.fill(local, 8)
    pair.move(pair.b, "pull_cache", remote.key(2), local, 3, size=100)
    expected = [t.copy() for t in before]
    for t in range(4):
        expected[t][3 * 512 : 3 * 512 + 100] = data[t][2 * 512 : 2 * 512 + 100]
    assert_tensors(pair.b.read(local), expected)


@pytest.mark.parametrize("runs", [False, True], ids=["random", "runs"])
@pytest.mark.parametrize("num_tensors, per_layer, src_range, dst_range", LAYER_CASES)
def test_pull_blocks(pair, num_tensors, per_layer, src_range, dst_range, runs):
    rng = np.random.default_rng([num_tensors, per_layer, int(runs), 7])
    model_id = next(_model_ids)
    remote = pair.a.allocate(blocks_desc(num_tensors), blocks=True, model_id=model_id)
    local = pair.b.register(blocks_desc(num_tensors), blocks=True)
    data = pair.a.fill(remote, 9)
    before = pair.b.fill(local, 10)
    src_blocks, dst_blocks = block_map(rng, 32, runs)
    ranges = layer_kwargs(src_range, dst_range, per_layer)
    pair.move(pair.b, "pull_blocks", remote.blocks_key(), local, src_blocks, dst_blocks, **ranges)
    expected = expect_copy(before, data, list(zip(src_blocks, dst_blocks)), 256, src_range, dst_range, per_layer)
    assert_tensors(pair.b.read(local), expected)


def block_ranges_case(pair: Pair) -> tuple[CacheRef, CacheRef, list[np.ndarray], list[np.ndarray], np.ndarray]:
    """A remote blocks cache of 256-byte blocks and a local one of 1 KiB
    blocks, filled, and ranges between them of every kind: whole blocks,
    four remote blocks side by side in one local block, pieces at odd
    offsets, the last bytes of both."""
    model_id = next(_model_ids)
    remote = pair.a.allocate(blocks_desc(), blocks=True, model_id=model_id)
    local = pair.b.register(blocks_desc(num_blocks=8, block_elems=512), blocks=True)
    data = pair.a.fill(remote, 31)
    before = pair.b.fill(local, 32)
    rows = np.array(
        [(3, 0, 2, 0, 256), (4, 0, 2, 256, 256), (5, 0, 2, 512, 256), (6, 0, 2, 768, 256),
         (0, 10, 0, 1000, 24), (31, 255, 7, 1023, 1), (17, 100, 5, 3, 101)], dtype=np.uint64)
    return remote, local, data, before, rows


def expect_ranges(before: Sequence[np.ndarray], data: Sequence[np.ndarray], rows: np.ndarray,
                  tensors: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    expected = [t.copy() for t in before]
    for local_t, remote_t in tensors:
        for sb, so, db, do, n in rows.tolist():
            expected[local_t][db * 1024 + do : db * 1024 + do + n] = data[remote_t][sb * 256 + so : sb * 256 + so + n]
    return expected


def test_pull_block_ranges_between_different_block_sizes(pair):
    remote, local, data, before, rows = block_ranges_case(pair)
    pair.move(pair.b, "pull_block_ranges", remote.blocks_key(), local, rows)
    assert_tensors(pair.b.read(local), expect_ranges(before, data, rows, [(t, t) for t in range(4)]))


def test_pull_block_ranges_of_some_layers_from_a_list(pair):
    remote, local, data, before, rows = block_ranges_case(pair)
    listed = [tuple(int(v) for v in row) for row in rows[:3]]
    pair.move(pair.b, "pull_block_ranges", remote.blocks_key(), local, listed,
              src_layer_range=range(1, 2), dst_layer_range=range(0, 1), tensor_num_per_layer=2)
    assert_tensors(pair.b.read(local), expect_ranges(before, data, rows[:3], [(0, 2), (1, 3)]))


def expect_strided(before: Sequence[np.ndarray], data: Sequence[np.ndarray], rows: np.ndarray) -> list[np.ndarray]:
    """Rows of (src_block, src_offset, dst_block, dst_offset, length, count,
    src_stride, dst_stride), unrolled by hand."""
    expected = [t.copy() for t in before]
    for t in range(len(expected)):
        for sb, so, db, do, n, count, ss, ds in rows.tolist():
            for j in range(count):
                src, dst = sb * 256 + so + j * ss, db * 1024 + do + j * ds
                expected[t][dst : dst + n] = data[t][src : src + n]
    return expected


def test_pull_block_strided_ranges(pair):
    """Strided ranges as the layouts of the vLLM connector need them: four
    remote blocks of transposed rows interleaved into one local block (a
    key's rows of 16 tokens into rows of 64), a head's slice of every token
    (every third 8-byte piece), a plain range beside them, and rows of one
    byte across all of a local block."""
    model_id = next(_model_ids)
    remote = pair.a.allocate(blocks_desc(), blocks=True, model_id=model_id)  # 32 blocks of 256 bytes
    local = pair.b.register(blocks_desc(num_blocks=8, block_elems=512), blocks=True)  # 8 of 1 KiB
    data = pair.a.fill(remote, 51)
    before = pair.b.fill(local, 52)
    rows = np.array(
        [(3 + q, 0, 2, 16 * q, 16, 16, 16, 64) for q in range(4)]
        + [(9, 8, 4, 0, 8, 10, 24, 8), (11, 0, 4, 100, 50, 1, 0, 0)]
        + [(20 + q, 0, 6, q, 1, 256, 1, 4) for q in range(4)],
        dtype=np.uint64)
    pair.move(pair.b, "pull_block_ranges", remote.blocks_key(), local, rows)
    assert_tensors(pair.b.read(local), expect_strided(before, data, rows))


def test_pull_blocks_from_a_contiguous_slot(pair):
    # A slot of the remote contiguous cache is four blocks' worth of bytes.
    remote = pair.a.allocate(slots_desc(batch=3, slot_bytes=4 * 256))
    local = pair.b.allocate(blocks_desc(), blocks=True)
    data = pair.a.fill(remote, 11)
    before = pair.b.fill(local, 12)
    dst_blocks = [17, 3, 30, 4]
    pair.move(pair.b, "pull_blocks", remote.key(2), local, (), dst_blocks)
    expected = [t.copy() for t in before]
    for t in range(4):
        for j, block in enumerate(dst_blocks):
            expected[t][block * 256 : (block + 1) * 256] = data[t][2 * 1024 + j * 256 : 2 * 1024 + (j + 1) * 256]
    assert_tensors(pair.b.read(local), expected)


def test_cache_registered_after_use_is_reachable(pair):
    first = pair.b.allocate(slots_desc())
    local = pair.a.allocate(slots_desc())
    sent = pair.a.fill(local, 13)
    pair.move(pair.a, "push_cache", first.key(0), local, 0)  # the link has seen b's caches once
    model_id = next(_model_ids)
    later = pair.b.register(slots_desc(batch=2))
    later_blocks = pair.b.register(blocks_desc(), blocks=True, model_id=model_id)
    before = pair.b.fill(later, 14)
    pair.move(pair.a, "push_cache", later.key(1), local, 3)
    assert_tensors(pair.b.read(later), expect_copy(before, sent, [(3, 1)], 512))
    blocks = pair.a.allocate(blocks_desc(), blocks=True)
    blocks_sent = pair.a.fill(blocks, 15)
    blocks_before = pair.b.fill(later_blocks, 30)
    pair.move(pair.a, "push_blocks", later_blocks.blocks_key(), blocks, [5], [6])
    expected = expect_copy(blocks_before, blocks_sent, [(5, 6)], 256)
    assert_tensors(pair.b.read(later_blocks), expected)


def test_many_concurrent_transfers_on_one_link(async_pair):
    pair = async_pair
    desc = blocks_desc(num_blocks=128)
    local = pair.a.allocate(desc, blocks=True)
    remote = pair.b.allocate(desc, blocks=True, model_id=next(_model_ids))
    sent = pair.a.fill(local, 16)
    before = pair.b.fill(remote, 17)
    order = [int(block) for block in np.random.default_rng(18).permutation(128)]
    # 64 tasks, two blocks each: block s goes to order[s].
    pushes = [((remote.blocks_key(), local, [2 * i, 2 * i + 1], order[2 * i : 2 * i + 2]), {}) for i in range(64)]
    assert pair.a.gather("push_blocks", pushes) == [[SUCCESS]] * 64
    assert_tensors(pair.b.read(remote), expect_copy(before, sent, list(enumerate(order)), 256))
    # 64 pulls bring blocks 0..63 back, in place, into another cache.
    back = pair.a.allocate(desc, blocks=True)
    back_before = pair.a.fill(back, 19)
    pulls = [((remote.blocks_key(), back, [order[i]], [i]), {}) for i in range(64)]
    assert pair.a.gather("pull_blocks", pulls) == [[SUCCESS]] * 64
    assert_tensors(pair.a.read(back), expect_copy(back_before, sent, [(i, i) for i in range(64)], 256))


def _small_pushes(pair: Pair, count: int, seed: int) -> tuple[Any, ...]:
    """Caches of ``count`` 30 KiB blocks (two tensors: a push of one block is a
    60 KiB frame) filled on both sides, a random block order, and one
    ``push_blocks`` call per block: block s to order[s]."""
    desc = blocks_desc(num_tensors=2, num_blocks=count, block_elems=15360)
    local = pair.a.allocate(desc, blocks=True)
    remote = pair.b.allocate(desc, blocks=True, model_id=next(_model_ids))
    sent = pair.a.fill(local, seed)
    before = pair.b.fill(remote, seed + 1)
    order = [int(block) for block in np.random.default_rng(seed + 2).permutation(count)]
    pushes = [((remote.blocks_key(), local, [s], [order[s]]), {}) for s in range(count)]
    return desc, local, remote, sent, before, order, pushes


def test_hundreds_of_small_transfers_at_once_fill_the_socket(async_pair):
    """Small frames go out from the submitting thread while the connection is
    idle, and through the writer when it is not or the socket is full; a
    burst of them (more than the socket holds) arrives whole and in place."""
    pair = async_pair
    count = 384
    desc, local, remote, sent, before, order, pushes = _small_pushes(pair, count, 40)
    assert pair.a.gather("push_blocks", pushes) == [[SUCCESS]] * count
    assert_tensors(pair.b.read(remote), expect_copy(before, sent, list(enumerate(order)), 30720))
    back = pair.a.allocate(desc, blocks=True)
    back_before = pair.a.fill(back, 43)
    pulls = [((remote.blocks_key(), back, [order[s]], [s]), {}) for s in range(count)]
    assert pair.a.gather("pull_blocks", pulls) == [[SUCCESS]] * count
    assert_tensors(pair.a.read(back), expect_copy(back_before, sent, [(s, s) for s in range(count)], 30720))


def test_small_transfers_wait_out_a_stalled_peer(async_pair):
    """With the peer stopped, the socket fills under a burst of small pushes:
    what the submitting thread could not send, the writer sends once the
    peer runs again, every byte in place."""
    pair = async_pair
    count = 256
    _, _, remote, sent, before, order, pushes = _small_pushes(pair, count, 50)
    os.kill(pair.b.pid, signal.SIGSTOP)
    resume = threading.Timer(1.0, os.kill, (pair.b.pid, signal.SIGCONT))
    resume.start()
    try:
        assert pair.a.gather("push_blocks", pushes) == [[SUCCESS]] * count
    finally:
        resume.join()
        os.kill(pair.b.pid, signal.SIGCONT)
    assert_tensors(pair.b.read(remote), expect_copy(before, sent, list(enumerate(order)), 30720))


def test_first_cache_of_a_process_is_id_1(group):
    a = group.start("a", dd.LLMRole.PROMPT, 5)
    b = group.start("b", dd.LLMRole.DECODER, 6)
    remote = b.allocate(slots_desc())
    assert remote.cache_id == 1
    assert a.link(b) == (SUCCESS, [SUCCESS])
    local = a.allocate(slots_desc())
    sent = a.fill(local, 19)
    a.cm("push_cache", dd.CacheKeyByIdAndIndex(6, 1, 0), local, 0)
    np.testing.assert_array_equal(b.read(remote, 3)[:512], sent[3][:512])


# -- refused requests -----------------------------------------------------------------


def outcome(call: Any, *args: Any, **kwargs: Any) -> Any:
    """What ``call`` did: None, an exception kind, or the status of an LLMException."""
    try:
        call(*args, **kwargs)
    except dd.LLMException as exc:
        return exc.status_code
    except (TypeError, ValueError) as exc:
        return type(exc)
    return None


Case = tuple[Any, tuple[Any, ...], dict[str, Any]]  # (expected outcome, args, kwargs)


def assert_refused(peer: Peer, via: str, method: str, cases: Sequence[Case]) -> None:
    """Every ``(expected, args, kwargs)`` case of ``method`` fails as expected."""
    wrong = []
    for expected, args, kwargs in cases:
        got = outcome(peer.run, via, method, *args, **kwargs)
        if got != expected:
            wrong.append(f"{method}(*{args!r}, **{kwargs!r}): expected {expected}, got {got}")
    assert not wrong, "\n".join(wrong)


def test_push_cache_checks(checked):
    a, b = checked.a, checked.b
    src = a.allocate(slots_desc(batch=3))
    dst = b.allocate(slots_desc(batch=5))
    blocks = a.allocate(blocks_desc(), blocks=True)
    key = dst.key(0)
    assert_refused(a, checked.via, "push_cache", [
        (TypeError, (dd.CacheKey(B, 1), src), {}),
        (TypeError, (dd.BlocksCacheKey(B, 0), src), {}),
        (TypeError, (None, src), {}),
        (TypeError, (key, "cache"), {}),
        (TypeError, (key, None), {}),
        (TypeError, (key, src, 1.5), {}),
        (TypeError, (key, src, "0"), {}),
        (ValueError, (key, src, -1), {}),
        (ValueError, (key, src, 2**32), {}),
        (PARAM_INVALID, (key, blocks), {}),
        (TypeError, (key, src), {"tensor_num_per_layer": "2"}),
        (TypeError, (key, src), {"tensor_num_per_layer": None}),
        (ValueError, (key, src), {"tensor_num_per_layer": -1}),
        (ValueError, (key, src), {"tensor_num_per_layer": 2**32}),
        (PARAM_INVALID, (key, src), {"tensor_num_per_layer": 0}),
        (TypeError, (key, src), {"src_layer_range": [0, 1], "dst_layer_range": range(0, 1)}),
        (TypeError, (key, src), {"src_layer_range": range(0, 1), "dst_layer_range": (0, 1)}),
        (PARAM_INVALID, (key, src), {"src_layer_range": range(0, 2, 2), "dst_layer_range": range(0, 1)}),
        (PARAM_INVALID, (key, src), {"src_layer_range": range(1, 1), "dst_layer_range": range(1, 1)}),
        (PARAM_INVALID, (key, src), {"src_layer_range": range(0, 1), "dst_layer_range": range(0, 2)}),
        (TypeError, (key, src), {"size": 1.5}),
        (ValueError, (key, src), {"size": 2**63}),
        (PARAM_INVALID, (key, src), {"size": 0}),
        (PARAM_INVALID, (key, src), {"size": 512}),
        # Decided with the geometry of both caches.
        (PARAM_INVALID, (key, src, 3), {}),  # past the local batch
        (PARAM_INVALID, (key, src), {"tensor_num_per_layer": 3}),  # 4 tensors are not whole layers of 3
        (PARAM_INVALID, (key, src), {"src_layer_range": range(2, 3), "dst_layer_range": range(0, 1)}),
        (NOT_EXIST, (dd.CacheKeyByIdAndIndex(B, 10**6), src), {}),
        (NOT_YET_LINK, (dd.CacheKeyByIdAndIndex(UNLINKED, dst.cache_id), src), {}),
    ])


def test_pull_cache_checks(checked):
    a, b = checked.a, checked.b
    src = a.allocate(slots_desc(batch=3))
    dst = b.allocate(slots_desc(batch=5))
    blocks = b.allocate(blocks_desc(), blocks=True)
    key = src.key(0)
    assert_refused(b, checked.via, "pull_cache", [
        (TypeError, (dd.CacheKey(A, 1), dst), {}),  # remote-cache-accessible mode takes ids only
        (TypeError, (dd.BlocksCacheKey(A, 0), dst), {}),
        (TypeError, (None, dst), {}),
        (TypeError, (key, "cache"), {}),
        (TypeError, (key, None), {}),
        (TypeError, (key, dst, "0"), {}),
        (ValueError, (key, dst, -1), {}),
        (TypeError, (key, dst, 0, 1.5), {}),
        (ValueError, (key, dst, 0, 2**63), {}),
        (PARAM_INVALID, (key, dst, 0, 0), {}),
        (PARAM_INVALID, (key, dst, 0, -2), {}),
        (PARAM_INVALID, (key, blocks), {}),
        (TypeError, (key, dst), {"tensor_num_per_layer": "2"}),
        (ValueError, (key, dst), {"tensor_num_per_layer": -1}),
        (PARAM_INVALID, (key, dst), {"tensor_num_per_layer": 0}),
        (TypeError, (key, dst), {"src_layer_range": [0, 1], "dst_layer_range": range(0, 1)}),
        (PARAM_INVALID, (key, dst), {"src_layer_range": range(0, 2, 2), "dst_layer_range": range(0, 1)}),
        # Decided with the geometry of both caches.
        (PARAM_INVALID, (key, dst, 5), {}),  # past the local batch
        (PARAM_INVALID, (src.key(3), dst), {}),  # past the remote batch
        (PARAM_INVALID, (key, dst, 0, 513), {}),  # more than a slot
        (NOT_EXIST, (dd.CacheKeyByIdAndIndex(A, 10**6), dst), {}),
        (NOT_YET_LINK, (dd.CacheKeyByIdAndIndex(UNLINKED, src.cache_id), dst), {}),
        (PARAM_INVALID, (dd.CacheKeyByIdAndIndex(B, dst.cache_id), dst), {}),  # from itself
    ])


def test_push_blocks_checks(checked):
    a, b = checked.a, checked.b
    model_id = next(_model_ids)
    src = a.allocate(blocks_desc(), blocks=True)
    b.allocate(blocks_desc(), blocks=True, model_id=model_id)
    contiguous = a.allocate(slots_desc())
    key = dd.BlocksCacheKey(B, model_id)
    assert_refused(a, checked.via, "push_blocks", [
        (TypeError, (dd.CacheKeyByIdAndIndex(B, 1), src, [0], [0]), {}),
        (TypeError, (dd.CacheKey(B, 1), src, [0], [0]), {}),
        (TypeError, (key, "cache", [0], [0]), {}),
        (TypeError, (key, None, [0], [0]), {}),
        (TypeError, (key, src, "0", [0]), {}),
        (TypeError, (key, src, [0.0], [0]), {}),
        (TypeError, (key, src, [0], {0}), {}),
        (TypeError, (key, src, [0], ["0"]), {}),
        (PARAM_INVALID, (key, contiguous, [0], [0]), {}),
        (PARAM_INVALID, (key, src, [0], []), {}),
        (PARAM_INVALID, (key, src, [0]), {}),  # dst_blocks defaults to ()
        (TypeError, (key, src, [0], [0]), {"tensor_num_per_layer": None}),
        (ValueError, (key, src, [0], [0]), {"tensor_num_per_layer": -1}),
        (PARAM_INVALID, (key, src, [0], [0]), {"tensor_num_per_layer": 0}),
        (TypeError, (key, src, [0], [0]), {"src_layer_range": 1, "dst_layer_range": range(0, 1)}),
        (PARAM_INVALID, (key, src, [0], [0]), {"src_layer_range": range(0, 2, 2), "dst_layer_range": range(0, 1)}),
        (PARAM_INVALID, (key, src, [0], [0]), {"src_layer_range": range(0, 2), "dst_layer_range": range(0, 1)}),
        # Decided with the geometry of both caches.
        (PARAM_INVALID, (key, src, [0, 1], [0]), {}),  # lengths differ
        (PARAM_INVALID, (key, src, [], [0]), {}),
        (PARAM_INVALID, (key, src, [32], [0]), {}),  # past the local blocks
        (PARAM_INVALID, (key, src, [0], [0]), {"tensor_num_per_layer": 3}),
        (NOT_EXIST, (dd.BlocksCacheKey(B, next(_model_ids)), src, [0], [0]), {}),
        (NOT_YET_LINK, (dd.BlocksCacheKey(UNLINKED, model_id), src, [0], [0]), {}),
    ])


def test_pull_blocks_checks(checked):
    a, b = checked.a, checked.b
    model_id = next(_model_ids)
    a.allocate(blocks_desc(), blocks=True, model_id=model_id)
    contiguous_remote = a.allocate(slots_desc(slot_bytes=4 * 256))
    dst = b.allocate(blocks_desc(), blocks=True)
    contiguous = b.allocate(slots_desc())
    key = dd.BlocksCacheKey(A, model_id)
    assert_refused(b, checked.via, "pull_blocks", [
        (TypeError, ("key", dst, [0], [0]), {}),
        (TypeError, (key, "cache", [0], [0]), {}),
        (TypeError, (key, dst, "0", [0]), {}),
        (TypeError, (key, dst, [0], [1.0]), {}),
        (PARAM_INVALID, (key, contiguous, [0], [0]), {}),
        (PARAM_INVALID, (key, dst, [0], []), {}),
        (PARAM_INVALID, (key, dst, [], [0]), {}),  # a BlocksCacheKey names blocks
        (PARAM_INVALID, (contiguous_remote.key(0), dst, [0], [0]), {}),  # a slot has no blocks to name
        (PARAM_INVALID, (dd.CacheKey(A, 2**64 - 1), dst, [], [0]), {}),  # no valid id in the key
        (PARAM_INVALID, (key, dst, [0], [0]), {"tensor_num_per_layer": 0}),
        (PARAM_INVALID, (key, dst, [0], [0]), {"src_layer_range": range(0, 2, 2), "dst_layer_range": range(0, 1)}),
        # Decided with the geometry of both caches.
        (PARAM_INVALID, (key, dst, [0, 1], [0]), {}),  # lengths differ
        (PARAM_INVALID, (key, dst, [0], [32]), {}),  # past the local blocks
        (NOT_EXIST, (dd.BlocksCacheKey(A, next(_model_ids)), dst, [0], [0]), {}),
        (NOT_YET_LINK, (dd.BlocksCacheKey(UNLINKED, model_id), dst, [0], [0]), {}),
    ])


def test_pull_block_ranges_checks(checked):
    a, b = checked.a, checked.b
    model_id = next(_model_ids)
    a.allocate(blocks_desc(), blocks=True, model_id=model_id)  # 32 blocks of 256 bytes
    dst = b.allocate(blocks_desc(num_blocks=8, block_elems=512), blocks=True)  # 8 of 1 KiB
    before = b.fill(dst, 41)
    contiguous = b.allocate(slots_desc())
    key = dd.BlocksCacheKey(A, model_id)
    ok = [(0, 0, 0, 0, 256)]
    assert_refused(b, checked.via, "pull_block_ranges", [
        (TypeError, (dd.CacheKey(A, 1), dst, ok), {}),
        (TypeError, (key, "cache", ok), {}),
        (TypeError, (key, dst, [(0, 0, 0, 0, 1.5)]), {}),
        (TypeError, (key, dst, np.zeros((1, 5), np.float32)), {}),
        (ValueError, (key, dst, [(0, 0, 0, 0, -1)]), {}),
        (PARAM_INVALID, (key, dst, [(0, 0, 0), (1, 1)]), {}),  # ragged
        (PARAM_INVALID, (key, dst, []), {}),
        (PARAM_INVALID, (key, dst, [(0, 0, 0, 0)]), {}),
        (PARAM_INVALID, (key, contiguous, ok), {}),
        (PARAM_INVALID, (key, dst, ok), {"tensor_num_per_layer": 0}),
        # Decided by this side, with its own geometry.
        (PARAM_INVALID, (key, dst, [(0, 0, 8, 0, 1)]), {}),  # past the local blocks
        (PARAM_INVALID, (key, dst, [(0, 0, 0, 1000, 25)]), {}),  # leaves the local block
        (PARAM_INVALID, (key, dst, [(0, 0, 0, 0, 0)]), {}),  # empty
        (PARAM_INVALID, (key, dst, [(0, 0, 1, 0, 200), (1, 0, 1, 199, 10)]), {}),  # overlap
        (PARAM_INVALID, (key, dst, [(0, 2**64 - 1, 0, 0, 2)]), {}),  # overflows
        # Strided rows, checked row by row.
        (PARAM_INVALID, (key, dst, np.zeros((1, 6), np.uint64)), {}),  # neither 5 nor 8 columns
        (PARAM_INVALID, (key, dst, [(0, 0, 0, 0, 8, 0, 8, 8)]), {}),  # no rows
        (PARAM_INVALID, (key, dst, [(0, 0, 0, 0, 8, 2, 8, 4)]), {}),  # rows overlap here
        (PARAM_INVALID, (key, dst, [(0, 0, 0, 0, 8, 2, 4, 8)]), {}),  # rows overlap there
        (PARAM_INVALID, (key, dst, [(0, 0, 0, 0, 8, 129, 1, 8)]), {}),  # the last row leaves the local block
        (PARAM_INVALID, (key, dst, [(0, 0, 0, 0, 8, 2**16 + 1, 8, 8)]), {}),  # too many rows
        (PARAM_INVALID, (key, dst, [(0, 0, 0, 0, 8, 2, 2**63, 8)]), {}),  # source offsets overflow
        (PARAM_INVALID, (key, dst, [(0, 0, 0, 0, 8, 4, 8, 16), (1, 0, 0, 36, 8, 1, 0, 0)]), {}),  # a row overlaps
        (PARAM_INVALID, (key, dst, [(0, 0, 0, 0, 8, 4, 100, 8)]), {}),  # the peer's last row leaves its block
        # Decided by the peer, with its geometry: nothing lands here.
        (PARAM_INVALID, (key, dst, [(0, 250, 0, 0, 7)]), {}),  # leaves the peer's block
        (PARAM_INVALID, (key, dst, [(32, 0, 0, 0, 1)]), {}),  # past the peer's blocks
        (NOT_EXIST, (dd.BlocksCacheKey(A, next(_model_ids)), dst, ok), {}),
        (NOT_YET_LINK, (dd.BlocksCacheKey(UNLINKED, model_id), dst, ok), {}),
    ])
    assert_tensors(b.read(dst), before)  # a refused range wrote no byte


@pytest.mark.parametrize(
    "method, blocks",
    [("push_blocks", True), ("pull_blocks", True), ("push_cache", False), ("pull_cache", False)],
)
def test_block_or_slot_size_mismatch(checked, method, blocks):
    a, b = checked.a, checked.b
    model_id = next(_model_ids)
    if blocks:
        local = a.allocate(blocks_desc(), blocks=True)
        remote = b.allocate(blocks_desc(block_elems=256), blocks=True, model_id=model_id)  # 512-byte blocks
        args = (remote.blocks_key(), local, [1], [2])  # the same for push and pull
    else:
        local = a.allocate(slots_desc())
        remote = b.allocate(slots_desc(slot_bytes=1024))
        args = (remote.key(1), local, 0)
    before = b.fill(remote, 20)
    local_before = a.fill(local, 21)
    with raises_status(PARAM_INVALID):
        a.run(checked.via, method, *args)
    assert_tensors(b.read(remote), before)
    assert_tensors(a.read(local), local_before)


@pytest.mark.parametrize(
    "case",
    ["block", "last-block", "layer"],
)
def test_push_blocks_out_of_remote_range_writes_nothing(checked, case):
    a, b = checked.a, checked.b
    model_id = next(_model_ids)
    local = a.allocate(blocks_desc(num_tensors=6), blocks=True)
    remote = b.allocate(blocks_desc(num_tensors=4, num_blocks=16), blocks=True, model_id=model_id)  # 2 layers
    a.fill(local, 22)
    before = b.fill(remote, 23)
    kwargs: dict[str, Any] = {}
    if case == "block":
        src_blocks, dst_blocks = [0, 1, 2], [16, 1, 2]
        kwargs = {"src_layer_range": range(0, 2), "dst_layer_range": range(0, 2)}
    elif case == "last-block":  # every pair but the last fits
        src_blocks, dst_blocks = [0, 1, 2, 3], [4, 5, 6, 40]
        kwargs = {"src_layer_range": range(0, 2), "dst_layer_range": range(0, 2)}
    else:  # remote layer 2 does not exist; layer 1 would fit
        src_blocks, dst_blocks = [0, 1], [2, 3]
        kwargs = {"src_layer_range": range(0, 2), "dst_layer_range": range(1, 3)}
    with raises_status(PARAM_INVALID):
        a.run(checked.via, "push_blocks", remote.blocks_key(), local, src_blocks, dst_blocks, **kwargs)
    assert_tensors(b.read(remote), before)


@pytest.mark.parametrize("case", ["batch", "layer"])
def test_push_cache_out_of_remote_range_writes_nothing(checked, case):
    a, b = checked.a, checked.b
    local = a.allocate(slots_desc(num_tensors=6))
    remote = b.allocate(slots_desc(num_tensors=4, batch=2))
    a.fill(local, 24)
    before = b.fill(remote, 25)
    if case == "batch":
        args, kwargs = (remote.key(2), local), {"src_layer_range": range(0, 2), "dst_layer_range": range(0, 2)}
    else:
        args, kwargs = (remote.key(1), local), {"src_layer_range": range(0, 2), "dst_layer_range": range(1, 3)}
    with raises_status(PARAM_INVALID):
        a.run(checked.via, "push_cache", *args, **kwargs)
    assert_tensors(b.read(remote), before)


def test_pull_blocks_out_of_remote_range_writes_nothing(checked):
    a, b = checked.a, checked.b
    model_id = next(_model_ids)
    a.allocate(blocks_desc(num_blocks=16), blocks=True, model_id=model_id)
    local = b.allocate(blocks_desc(), blocks=True)
    before = b.fill(local, 26)
    with raises_status(PARAM_INVALID):
        b.run(checked.via, "pull_blocks", dd.BlocksCacheKey(A, model_id), local, [0, 1, 16], [0, 1, 2])
    assert_tensors(b.read(local), before)


def test_not_remote_accessible_caches_are_refused(checked):
    a, b = checked.a, checked.b
    hidden_remote = b.register(slots_desc(), remote_accessible=False)
    visible_remote = b.register(slots_desc())
    hidden_local = a.register(slots_desc(), remote_accessible=False)
    local = a.allocate(slots_desc())
    a.fill(local, 27)
    a.fill(hidden_local, 28)
    before = b.fill(hidden_remote, 29)
    with raises_status(PARAM_INVALID):
        a.run(checked.via, "push_cache", hidden_remote.key(0), local)
    assert_tensors(b.read(hidden_remote), before)
    with raises_status(PARAM_INVALID):
        a.run(checked.via, "push_cache", visible_remote.key(0), hidden_local)


def test_push_needs_remote_cache_accessible_mode(group):
    plain = group.start("plain", dd.LLMRole.PROMPT, 7, listen=False, options={"enable_remote_cache_accessible": False})
    contiguous = plain.allocate(slots_desc())
    blocks = plain.allocate(blocks_desc(), blocks=True)
    for call in (plain.cm, plain.cm_async):
        with raises_status(PARAM_INVALID):
            call("push_cache", dd.CacheKeyByIdAndIndex(B, 1), contiguous)
        with raises_status(PARAM_INVALID):
            call("push_blocks", dd.BlocksCacheKey(B, 0), blocks, [0], [0])
    # Without that mode pull_cache also takes a CacheKey (here: no link yet).
    with raises_status(NOT_YET_LINK):
        plain.cm("pull_cache", dd.CacheKey(B, 1), contiguous)


@pytest.mark.parametrize("case", ["last-block", "last-layer"])
def test_operation_over_many_frames_is_refused_whole(checked, case):
    """16 MiB go out as several frames; only the last part falls outside the
    peer's cache, and still no frame of the operation lands."""
    a, b = checked.a, checked.b
    model_id = next(_model_ids)
    desc = blocks_desc(num_tensors=4, num_blocks=64, block_elems=32 * 1024)  # 64 KiB blocks
    local = a.allocate(desc, blocks=True)
    remote = b.allocate(desc, blocks=True, model_id=model_id)
    a.fill(local, 27)
    before = b.fill(remote, 28)
    if case == "last-block":
        blocks = (list(range(64)), list(range(63)) + [64])
        kwargs: dict[str, Any] = {}
    else:  # source layers 0..1 to remote layers 1..2: there is no remote layer 2
        blocks = (list(range(64)), list(range(64)))
        kwargs = {"src_layer_range": range(0, 2), "dst_layer_range": range(1, 3)}
    with raises_status(PARAM_INVALID):
        a.run(checked.via, "push_blocks", remote.blocks_key(), local, *blocks, **kwargs)
    assert_tensors(b.read(remote), before)


def test_pull_through_a_key_releases_it(group):
    """A key is released once a peer has pulled every tensor through it
    (here in two layer-wise pulls); keys of registered caches stay."""
    owner = group.start("owner", dd.LLMRole.PROMPT, 31, options={"enable_remote_cache_accessible": False})
    puller = group.start("puller", dd.LLMRole.DECODER, 32, listen=False, options={"enable_remote_cache_accessible": False})
    assert puller.link(owner) == (SUCCESS, [SUCCESS])
    allocated = owner.allocate(slots_desc(), keys=[dd.CacheKey(31, 7), dd.CacheKey(31, 8)])
    registered = owner.register(slots_desc(), keys=[dd.CacheKey(31, 9)])
    sent = owner.fill(allocated, 40)
    owner.fill(registered, 41)
    local = puller.allocate(slots_desc())
    first_half = {"src_layer_range": range(0, 1), "dst_layer_range": range(0, 1)}
    second_half = {"src_layer_range": range(1, 2), "dst_layer_range": range(1, 2)}
    puller.cm("pull_cache", dd.CacheKey(31, 7), local, 2, **first_half)
    puller.cm("pull_cache", dd.CacheKey(31, 7), local, 2, **first_half)  # layer 1 not read yet: still bound
    puller.cm("pull_cache", dd.CacheKey(31, 7), local, 2, **second_half)
    with raises_status(NOT_EXIST):
        puller.cm("pull_cache", dd.CacheKey(31, 7), local, 2)
    got = puller.read(local)
    slot = slots_desc().size // 4
    for t in range(4):
        np.testing.assert_array_equal(got[t][2 * slot : 3 * slot], sent[t][:slot])
    puller.cm("pull_cache", dd.CacheKey(31, 8), local, 1)  # the other key is still bound
    for _ in range(2):
        puller.cm("pull_cache", dd.CacheKey(31, 9), local, 0)

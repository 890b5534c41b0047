"""Mapping KV blocks between a prefill and a decode instance of different
shapes (tensor-parallel sizes, block sizes), without an engine.

Every case builds the prompt's KV once, as the model computes it (a value per
token, head and channel), lays it out in each prefill rank's blocks as that
rank holds it, applies the byte ranges the mapping gives to zeroed decode
blocks, and compares with the same KV laid out as the decode rank holds it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from datadist_aio.integrations.vllm.layout import (
    GroupShape,
    LayoutError,
    WorkerLayout,
    heads_of,
    map_heads,
    plan_ranges,
)
from support.block_ranges import apply_rows

CHANNELS = 8  # K and V side by side, 4 each
DTYPE = "torch.float32"


def layout(tp: int, rank: int, heads: int, block: int, interior: str = "HNC", layers: int = 2) -> WorkerLayout:
    local = len(heads_of(rank, tp, heads))
    shape = {"NC": (block, CHANNELS), "NHC": (block, local, CHANNELS)}.get(interior, (local, block, CHANNELS))
    return WorkerLayout(tp, rank, 1 if interior == "NC" else heads, block,
                        (GroupShape(DTYPE, shape, 1, layers, interior),))


def blocks_of(kv: np.ndarray, table: list[int], num_blocks: int, block: int, heads: range,
              interior: str) -> np.ndarray:
    """The prompt's ``kv`` ([tokens, heads, channels]) in a rank's blocks ``table``.

    ``HKTV`` as vLLM's CPU backend keeps it: per head the keys (first half of
    the channels) transposed, ``[half, tokens]``, then the values ``[tokens, half]``.
    """
    if interior == "NC":
        out = np.zeros((num_blocks, block, CHANNELS), np.float32)
        for t in range(kv.shape[0]):
            out[table[t // block], t % block] = kv[t, 0]
        return out
    if interior == "NHC":
        out = np.zeros((num_blocks, block, len(heads), CHANNELS), np.float32)
        for t in range(kv.shape[0]):
            out[table[t // block], t % block] = kv[t, heads.start:heads.stop]
        return out
    out = np.zeros((num_blocks, len(heads), block, CHANNELS), np.float32)
    half = CHANNELS // 2
    slices = out.reshape(num_blocks, len(heads), 2, block * half)
    for t in range(kv.shape[0]):
        own = kv[t, heads.start:heads.stop]
        if interior == "HKTV":
            keys = slices[table[t // block], :, 0].reshape(len(heads), half, block)
            keys[:, :, t % block] = own[:, :half]
            values = slices[table[t // block], :, 1].reshape(len(heads), block, half)
            values[:, t % block] = own[:, half:]
        else:
            out[table[t // block], :, t % block] = own
    return out


def transfer(tp_p: int, tp_d: int, heads: int, n_p: int, n_d: int, tokens: int, first_token: int = 0,
             interior: str = "HNC") -> None:
    rng = np.random.default_rng(tp_p * 1000 + tp_d * 100 + n_p + n_d + tokens)
    latent = interior == "NC"
    kv = rng.standard_normal((tokens, 1 if latent else heads, CHANNELS)).astype(np.float32)
    nb_p, nb_d = -(-tokens // n_p), -(-tokens // n_d)
    src_table = [int(b) for b in rng.permutation(nb_p + 5)[:nb_p]]
    dst_all = [int(b) for b in rng.permutation(nb_d + 5)[:nb_d]]
    skip = first_token // n_d
    dst_table = dst_all[skip:]
    for r in range(tp_d):
        mine = layout(tp_d, r, heads, n_d, interior)
        mine_heads = heads_of(r, tp_d, heads)
        expected = blocks_of(kv, dst_all, nb_d + 5, n_d, mine_heads, interior)
        got = np.zeros_like(expected)
        maps = map_heads(mine, layout(tp_p, 0, heads, n_p, interior))
        read_heads: list[int] = []
        for q, head_map in maps.items():
            theirs = layout(tp_p, q, heads, n_p, interior)
            src = blocks_of(kv, src_table, nb_p + 5, n_p, heads_of(q, tp_p, heads), interior)
            rows = plan_ranges(head_map, 0, mine, theirs, src_table, dst_table, first_token)
            assert rows is not None and rows.dtype == np.uint64
            apply_rows(rows, src, got)
            for _s, d, count in head_map.runs[0]:
                read_heads += range(d, d + count)
        assert sorted(read_heads) == list(range(1 if latent else len(mine_heads))), "each head read exactly once"
        # The tokens before first_token were found locally: not written.
        for block in dst_all[:skip]:
            assert not got[block].any()
            got[block] = expected[block]
        np.testing.assert_array_equal(got, expected, err_msg=f"decode rank {r}")


@pytest.mark.parametrize("interior", ["HNC", "HKTV", "NHC"])
@pytest.mark.parametrize("tp_p, tp_d", [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4), (2, 2)])
@pytest.mark.parametrize("heads", [4, 2, 1])
def test_every_tp_ratio_moves_each_head_to_its_rank(tp_p: int, tp_d: int, heads: int, interior: str) -> None:
    transfer(tp_p, tp_d, heads, 16, 16, tokens=50, interior=interior)


@pytest.mark.parametrize("interior", ["HNC", "HKTV", "NHC"])
@pytest.mark.parametrize("n_p, n_d", [(16, 32), (32, 16), (32, 64), (64, 16), (16, 16)])
@pytest.mark.parametrize("tp_p, tp_d", [(1, 1), (2, 1), (1, 2)])
def test_block_sizes_that_divide_each_other(n_p: int, n_d: int, tp_p: int, tp_d: int, interior: str) -> None:
    for tokens in (1, 31, 64, 100):
        transfer(tp_p, tp_d, 2, n_p, n_d, tokens, interior=interior)


@pytest.mark.parametrize("interior", ["HNC", "HKTV", "NHC"])
@pytest.mark.parametrize("n_p, n_d", [(16, 32), (32, 16), (16, 16)])
def test_a_local_prefix_hit_loads_only_the_rest(n_p: int, n_d: int, interior: str) -> None:
    for first in range(0, 96, n_d):
        transfer(2, 1, 2, n_p, n_d, tokens=100, first_token=first, interior=interior)


@pytest.mark.parametrize("tp_p, tp_d", [(2, 1), (1, 2), (4, 2)])
def test_mla_latent_is_read_from_one_prefill_rank(tp_p: int, tp_d: int) -> None:
    transfer(tp_p, tp_d, 1, 16, 32, tokens=70, interior="NC")
    for r in range(tp_d):
        maps = map_heads(layout(tp_d, r, 1, 32, "NC"), layout(tp_p, 0, 1, 16, "NC"))
        assert len(maps) == 1


def test_same_shape_maps_whole_blocks_and_ranges_stay_few() -> None:
    same = map_heads(layout(2, 1, 4, 16), layout(2, 0, 4, 16))
    assert list(same) == [1] and same[1].whole == (True,)
    # Prefill TP=2 into decode TP=1: one range per block from each rank, not one per token.
    mine = layout(1, 0, 4, 16)
    maps = map_heads(mine, layout(2, 0, 4, 16))
    assert sorted(maps) == [0, 1] and maps[0].runs[0] == ((0, 0, 2),) and maps[1].runs[0] == ((0, 2, 2),)
    rows = plan_ranges(maps[1], 0, mine, layout(2, 1, 4, 16), list(range(10)), list(range(10, 20)), 0)
    assert rows is not None and len(rows) == 10
    assert rows[0].tolist() == [0, 0, 10, 2 * 16 * CHANNELS * 4, 2 * 16 * CHANNELS * 4, 1, 0, 0]


def test_a_share_of_heads_or_of_tokens_is_one_strided_range() -> None:
    """Where the pieces of a chunk are evenly spaced, they travel as one
    strided row: a head share of token-major blocks (a piece of each token),
    HKTV's keys between block sizes (a piece of each of a head's rows)."""
    head = CHANNELS * 4
    # NHC, prefill TP=2 into decode TP=1, 4 heads: rank 1's 2 heads are a
    # piece of every token of the decode's block.
    mine = layout(1, 0, 4, 16, "NHC")
    maps = map_heads(mine, layout(2, 0, 4, 16, "NHC"))
    rows = plan_ranges(maps[1], 0, mine, layout(2, 1, 4, 16, "NHC"), [7], [3], 0)
    assert rows is not None and rows.tolist() == [[7, 0, 3, 2 * head, 2 * head, 16, 2 * head, 4 * head]]
    # HKTV, blocks of 16 into 32, one head: per chunk one row of values and
    # one strided row of the keys' CHANNELS // 2 rows.
    mine = layout(1, 0, 1, 32, "HKTV")
    maps = map_heads(mine, layout(1, 0, 1, 16, "HKTV"))
    rows = plan_ranges(maps[0], 0, mine, layout(1, 0, 1, 16, "HKTV"), [5, 6], [2], 0)
    assert rows is not None
    half = CHANNELS // 2 * 4
    assert rows.tolist() == [
        [5, 16 * half, 2, 32 * half, 16 * half, 1, 16 * 2 * half, 32 * 2 * half],
        [6, 16 * half, 2, 32 * half + 16 * half, 16 * half, 1, 16 * 2 * half, 32 * 2 * half],
        [5, 0, 2, 0, 16 * 4, CHANNELS // 2, 16 * 4, 32 * 4],
        [6, 0, 2, 16 * 4, 16 * 4, CHANNELS // 2, 16 * 4, 32 * 4],
    ]


@pytest.mark.parametrize(
    "theirs, words",
    [
        (layout(1, 0, 4, 24), "neither divides"),
        (layout(1, 0, 8, 16), "8 KV heads against 4"),
        (WorkerLayout(1, 0, 4, 16, (GroupShape("torch.float16", (4, 16, CHANNELS), 1, 2, "HNC"),)), "dtypes"),
        (WorkerLayout(1, 0, 4, 16, (GroupShape(DTYPE, (16, 4, CHANNELS), 1, 2, "NHC"),)), "interiors NHC and HNC"),
        (WorkerLayout(1, 0, 4, 16, (GroupShape(DTYPE, (4, 16 * CHANNELS), 1, 2, "opaque"),)), "interiors opaque"),
    ],
)
def test_layouts_that_do_not_map_name_both_sides(theirs: WorkerLayout, words: str) -> None:
    mine = layout(1, 0, 4, 16)
    with pytest.raises(LayoutError, match=words) as info:
        map_heads(mine, theirs)
    assert theirs.describe() in str(info.value) and mine.describe() in str(info.value)


def test_wire_form_round_trips_and_refuses_garbage() -> None:
    for tp, rank, interior in itertools.product((1, 2), (0, 1), ("HNC", "NC")):
        if rank < tp:
            mine = layout(tp, rank, 4, 32, interior)
            assert WorkerLayout.from_wire(mine.to_wire()) == mine
    good = layout(2, 1, 4, 16).to_wire()
    for bad in ({**good, "tp_rank": 2}, {**good, "block_size": 0}, {**good, "groups": []},
                {**good, "groups": [{**good["groups"][0], "dtype": "torch.complex64"}]},
                {**good, "groups": [{**good["groups"][0], "block_shape": [1, -3]}]}, [], {**good, "tp_size": True}):
        with pytest.raises(ValueError):
            WorkerLayout.from_wire(bad)


def test_heads_are_shared_out_as_vllm_shares_them() -> None:
    # vLLM's QKVParallelLinear: with fewer KV heads than ranks, rank r holds
    # head r // (tp_size // kv_heads); with more, a contiguous equal share.
    assert [list(heads_of(r, 4, 2)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(heads_of(r, 8, 2)) for r in range(8)] == [[0]] * 4 + [[1]] * 4
    assert [list(heads_of(r, 2, 8)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_ranks_restrict_which_holder_is_read() -> None:
    # One KV head on both prefill ranks: by default decode rank 1 of 4 reads it from
    # prefill rank 1; restricted to rank 0 (a peer's own rank mapping), from rank 0.
    mine, theirs = layout(4, 1, 1, 16, "NHC"), layout(2, 0, 1, 16, "NHC")
    assert list(map_heads(mine, theirs)) == [1]
    assert list(map_heads(mine, theirs, ranks=[0])) == [0]
    assert list(map_heads(layout(1, 0, 1, 16, "NC"), layout(2, 0, 1, 16, "NC"), ranks=[1])) == [1]
    with pytest.raises(LayoutError, match="none of the prefill ranks"):
        map_heads(layout(2, 1, 2, 16, "NHC"), layout(2, 0, 2, 16, "NHC"), ranks=[0])

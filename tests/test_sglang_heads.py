"""The SGLang backend between differing attention TP sizes: which heads a
decode rank reads from which prefill rank, as byte ranges of SGLang's pages.

A KV page of one layer is ``[page_size, heads, head]`` (the rank's share
of the model's KV heads); MLA's ``[page_size, latent]``, the same on every
rank. Every case lays one prompt's KV out in each prefill rank's pages as
that rank holds it, plans each decode rank's pulls chunk by chunk from the
prefill ranks SGLang pairs it with (``BufferLayout.pair_with``,
``Pairing.pulls``), and checks the decode's buffers hold exactly its heads
of every token. By hand over many TP ratios; by real engines in separate
processes (a decode rank pulling from one or two prefill ranks) for TP
1 into 2, 2 into 1 and MLA's 2 into 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import pytest

import datadist_aio as dd
from datadist_aio.integrations.sglang.buffers import BufferLayout, LayoutMismatch, Pull, group_buffers, paired_ranks
from datadist_aio.integrations.vllm.layout import heads_of
from support.block_ranges import apply_rows
from support.peer import Peer, PeerGroup

HEAD = 12  # bytes of one head of one token
LATENT = 20  # bytes of one token's latent vector (MLA)
LAYERS = 2
AUX = (8, 24)  # item lengths of the two aux buffers
ITEMS = 40  # pages in each side's pool
AUX_ROWS = 6


def layout(tp: int, rank: int, kv_heads: int, page: int, latent: bool = False) -> BufferLayout:
    """A rank's buffers as SGLang lists them: K of every layer then V (MLA: one latent buffer per layer), aux."""
    local = 1 if latent else len(heads_of(rank, tp, kv_heads))
    item = page * (LATENT if latent else local * HEAD)
    count = LAYERS if latent else 2 * LAYERS
    kv = group_buffers("kv", [0x1000 * (i + 1) for i in range(count)], [item * ITEMS] * count, [item] * count)
    aux = group_buffers("aux", [0x100000, 0x200000], [n * AUX_ROWS for n in AUX], list(AUX))
    return BufferLayout(page, tp, rank, kv_heads, tuple(kv + aux), latent)


def buffers_of(lay: BufferLayout, kv: np.ndarray, table: list[int], aux: Optional[tuple[int, list[bytes]]]
               ) -> list[np.ndarray]:
    """Per group ``[buffers, items, item_len]`` bytes: the prompt's ``kv`` ([buffers, tokens,
    heads, head bytes]) in pages ``table`` as rank ``lay`` holds it; ``aux``: a row and its bytes."""
    heads = range(1) if lay.latent else heads_of(lay.tp_rank, lay.tp_size, lay.kv_heads)
    out = [np.zeros((len(g.members), g.items, g.item_len), np.uint8) for g in lay.groups]
    for index, group in lay.of_kind("kv"):
        pages = out[index].reshape(len(group.members), group.items, lay.page_size, len(heads), -1)
        for t in range(kv.shape[1]):
            pages[:, table[t // lay.page_size], t % lay.page_size] = kv[:, t, heads.start:heads.stop]
    if aux is not None:
        for (index, _), row in zip(lay.of_kind("aux"), aux[1]):
            out[index][:, aux[0]] = np.frombuffer(row, np.uint8)
    return out


def apply(pulls: list[Pull], src: list[np.ndarray], dst: list[np.ndarray]) -> None:
    """The pulls done by hand: whole pages, or ``apply_rows`` on each buffer of the group."""
    for pull in pulls:
        if pull.rows is None:
            assert not dst[pull.group][:, list(pull.dst_blocks)].any(), "a page written twice"
            dst[pull.group][:, list(pull.dst_blocks)] = src[pull.group][:, list(pull.src_blocks)]
        else:
            for member in range(src[pull.group].shape[0]):
                apply_rows(pull.rows, src[pull.group][member], dst[pull.group][member])


def chunks(pages: int, per_chunk: int) -> list[slice]:
    return [slice(start, min(start + per_chunk, pages)) for start in range(0, pages, per_chunk)]


class Prompt:
    """One prompt's KV and page tables: per prefill rank its own pages, per decode rank its own."""

    def __init__(self, tp_p: int, tp_d: int, kv_heads: int, page: int, tokens: int, latent: bool) -> None:
        rng = np.random.default_rng(tp_p * 100 + tp_d * 10 + kv_heads + page + tokens)
        width = (1, LATENT) if latent else (kv_heads, HEAD)
        self.kv = rng.integers(0, 256, (LAYERS if latent else 2 * LAYERS, tokens, *width), dtype=np.uint8)
        self.pages = -(-tokens // page)
        self.src = [[int(p) for p in rng.permutation(ITEMS)[:self.pages]] for _ in range(tp_p)]
        self.dst = [[int(p) for p in rng.permutation(ITEMS)[:self.pages]] for _ in range(tp_d)]
        self.src_aux = [int(r) for r in rng.integers(0, AUX_ROWS, tp_p)]
        self.dst_aux = [int(r) for r in rng.integers(0, AUX_ROWS, tp_d)]
        self.aux_rows = [rng.bytes(n) for n in AUX]


def transfer_by_hand(tp_p: int, tp_d: int, kv_heads: int, page: int = 4, tokens: int = 37, per_chunk: int = 3,
                     latent: bool = False) -> None:
    prompt = Prompt(tp_p, tp_d, kv_heads, page, tokens, latent)
    prefills = [layout(tp_p, q, kv_heads, page, latent) for q in range(tp_p)]
    held = [buffers_of(p, prompt.kv, prompt.src[q], (prompt.src_aux[q], prompt.aux_rows))
            for q, p in enumerate(prefills)]
    for r in range(tp_d):
        mine = layout(tp_d, r, kv_heads, page, latent)
        got = [np.zeros((len(g.members), g.items, g.item_len), np.uint8) for g in mine.groups]
        senders = paired_ranks(tp_d, r, tp_p)
        if latent:
            senders = senders[:1]  # SGLang sends the others dummy requests: no chunk from them
        read_from = set()
        aux_pulled = False
        for q in senders:
            pairing = mine.pair_with(prefills[q])
            assert pairing.sources <= set(senders)
            if pairing.head_map is not None:
                read_from.add(q)
            for part in chunks(prompt.pages, per_chunk):
                last = part.stop == prompt.pages
                aux = (prompt.src_aux[q], prompt.dst_aux[r]) if last and not aux_pulled else None
                aux_pulled = aux_pulled or aux is not None
                apply(pairing.pulls(prompt.src[q][part], prompt.dst[r][part], aux), held[q], got)
            assert read_from <= pairing.sources
        assert read_from == set(pairing.sources), "every source sent its chunks"
        want = buffers_of(mine, prompt.kv, prompt.dst[r], (prompt.dst_aux[r], prompt.aux_rows))
        for index, (a, b) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(a, b, err_msg=f"decode rank {r}, group {index}")


@pytest.mark.parametrize("tp_p, tp_d", [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (2, 2)])
@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
def test_each_decode_rank_gets_its_heads_of_every_token(tp_p: int, tp_d: int, kv_heads: int) -> None:
    transfer_by_hand(tp_p, tp_d, kv_heads)


@pytest.mark.parametrize("page, tokens, per_chunk", [(1, 9, 4), (16, 100, 4), (16, 16, 1), (4, 1, 2)])
@pytest.mark.parametrize("tp_p, tp_d", [(1, 2), (2, 1)])
def test_page_sizes_and_chunks(page: int, tokens: int, per_chunk: int, tp_p: int, tp_d: int) -> None:
    transfer_by_hand(tp_p, tp_d, 2, page, tokens, per_chunk)


@pytest.mark.parametrize("tp_p, tp_d", [(2, 1), (1, 2), (4, 2), (2, 4), (2, 2)])
def test_mla_reads_whole_pages_from_one_prefill_rank(tp_p: int, tp_d: int) -> None:
    transfer_by_hand(tp_p, tp_d, 1, latent=True)
    for r in range(tp_d):
        pairing = layout(tp_d, r, 1, 4, True).pair_with(layout(tp_p, paired_ranks(tp_d, r, tp_p)[0], 1, 4, True))
        assert pairing.sources == {paired_ranks(tp_d, r, tp_p)[0]}
        assert all(pull.rows is None for pull in pairing.pulls([1, 2], [3, 4]))


def test_a_share_of_the_heads_is_one_strided_range_per_page() -> None:
    """TP 1 into 2, two heads: decode rank 1 reads head 1 of each token, one row per page;
    TP 2 into 1: each prefill rank's head is its place in every token of the decode's page."""
    mine = layout(2, 1, 2, 16)
    pairing = mine.pair_with(layout(1, 0, 2, 16))
    kv = [pull for pull in pairing.pulls([7, 8], [3, 5]) if pull.group == 0]
    assert len(kv) == 1 and kv[0].rows is not None
    assert kv[0].rows.tolist() == [[7, HEAD, 3, 0, HEAD, 16, 2 * HEAD, HEAD], [8, HEAD, 5, 0, HEAD, 16, 2 * HEAD, HEAD]]
    assert kv[0].nbytes == 2 * 16 * HEAD * 2 * LAYERS
    pairing = layout(1, 0, 2, 16).pair_with(layout(2, 1, 2, 16))
    rows = pairing.pulls([7], [3])[0].rows
    assert rows is not None and rows.tolist() == [[7, 0, 3, HEAD, HEAD, 16, HEAD, 2 * HEAD]]
    assert pairing.sources == {0, 1}
    # The same TP: whole pages, as before.
    same = layout(2, 1, 2, 16).pair_with(layout(2, 1, 2, 16))
    assert [(p.group, p.rows) for p in same.pulls([7], [3], (1, 2))] == [(0, None), (1, None), (2, None)]


def test_sglang_pairs_ranks_as_its_common_receiver_does() -> None:
    assert [list(paired_ranks(2, r, 1)) for r in range(2)] == [[0], [0]]
    assert [list(paired_ranks(4, r, 2)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(paired_ranks(1, 0, 2))] == [[0, 1]]
    assert [list(paired_ranks(2, r, 4)) for r in range(2)] == [[0, 1], [2, 3]]
    # Replicated heads (one KV head, prefill TP 2 into decode TP 4): each decode rank reads
    # from the prefill rank SGLang pairs it with, though both hold the head.
    for r in range(4):
        pairing = layout(4, r, 1, 4).pair_with(layout(2, r // 2, 1, 4))
        assert pairing.sources == {r // 2} and pairing.head_map is not None


@pytest.mark.parametrize("theirs, words", [
    (layout(3, 0, 6, 4), "TP sizes 3 and 2: neither divides"),
    (layout(1, 0, 4, 4), "4 KV heads against 2"),
    (layout(1, 0, 2, 8), "page sizes 8 and 4"),
    (layout(1, 0, 2, 4, latent=True), "one is MLA"),
    (BufferLayout(4, 1, 0, 2, layout(1, 0, 2, 4).groups[:1] + layout(1, 0, 2, 4).groups[2:]), "buffer groups"),
])
def test_layouts_that_cannot_pair_name_both(theirs: BufferLayout, words: str) -> None:
    mine = layout(2, 0, 2, 4)
    with pytest.raises(LayoutMismatch, match=words) as caught:
        mine.pair_with(theirs)
    assert theirs.describe() in str(caught.value) and mine.describe() in str(caught.value)


def test_heads_of_another_width_do_not_pair() -> None:
    """The same heads and TP ratio but a head of 16 bytes against 12: refused, not mapped."""
    theirs = layout(1, 0, 2, 4)
    kv = group_buffers("kv", [0x1000 * (i + 1) for i in range(4)], [4 * 16 * ITEMS] * 4, [4 * 16] * 4)
    mine = BufferLayout(4, 2, 0, 2, (kv[0],) + theirs.groups[1:])
    with pytest.raises(LayoutMismatch, match="head widths differ"):
        mine.pair_with(theirs)


# -- real engines: a decode rank's process pulls the planned pulls from prefill ranks' processes ----------------


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, list[Peer]]]:
    """Two prefill ranks and two decode ranks, each its own engine and process; every decode linked to
    every prefill."""
    with PeerGroup() as group:
        prefill = [group.start(f"prefill-{q}", dd.LLMRole.PROMPT, 10 + q) for q in range(2)]
        decode = [group.start(f"decode-{r}", dd.LLMRole.DECODER, 20 + r) for r in range(2)]
        for d in decode:
            for p in prefill:
                status, _ = d.link(p)
                assert status == dd.LLMStatusCode.LLM_SUCCESS
        yield {"prefill": prefill, "decode": decode}


@pytest.fixture
def ranks(engines: dict[str, list[Peer]]) -> Iterator[dict[str, list[Peer]]]:
    """The module's engines; every cache a test registered freed after it."""
    yield engines
    for peer in engines["prefill"] + engines["decode"]:
        peer.free_all()


def _register(peer: Peer, lay: BufferLayout, seed: Optional[int]) -> tuple[list[Any], list[np.ndarray]]:
    """Each group as a blocks cache (model id: its index); filled from ``seed``, else zeroed."""
    refs, data = [], []
    for index, group in enumerate(lay.groups):
        desc = dd.CacheDesc(len(group.members), [group.items, group.item_len], dd.DataType.DT_UINT8,
                            dd.Placement.HOST)
        ref = peer.register(desc, blocks=True, model_id=index)
        refs.append(ref)
        filled = peer.fill(ref, seed + index) if seed is not None else [np.zeros(desc.size, np.uint8)] * len(
            group.members)
        data.append(np.stack(filled).reshape(len(group.members), group.items, group.item_len))
    return refs, data


@pytest.mark.parametrize("tp_p, tp_d, latent", [(1, 2, False), (2, 1, False), (2, 1, True)],
                         ids=["tp1-into-tp2", "tp2-into-tp1", "mla-tp2-into-tp1"])
def test_real_pulls_land_each_head_where_it_belongs(ranks: dict[str, list[Peer]], tp_p: int, tp_d: int,
                                                    latent: bool) -> None:
    """Random bytes in the prefill ranks' pages; each decode rank pulls its chunks (strided
    ranges, or whole pages) with its engine; its buffers hold what the hand-made transfer of
    the same pulls gives, and every head of every token of its share."""
    kv_heads, page = (1 if latent else 2), 4
    prompt = Prompt(tp_p, tp_d, kv_heads, page, tokens=37, latent=latent)
    prefills = [layout(tp_p, q, kv_heads, page, latent) for q in range(tp_p)]
    held = []
    for q, lay in enumerate(prefills):
        refs, data = _register(ranks["prefill"][q], lay, seed=1000 * q + 7)
        held.append((refs, data))
    for r in range(tp_d):
        mine = layout(tp_d, r, kv_heads, page, latent)
        peer = ranks["decode"][r]
        local, _ = _register(peer, mine, seed=None)
        by_hand = [np.zeros((len(g.members), g.items, g.item_len), np.uint8) for g in mine.groups]
        senders = paired_ranks(tp_d, r, tp_p)[:1] if latent else paired_ranks(tp_d, r, tp_p)
        nbytes = 0
        for n, q in enumerate(senders):
            pairing = mine.pair_with(prefills[q])
            refs, data = held[q]
            for part in chunks(prompt.pages, 3):
                aux = (prompt.src_aux[q], prompt.dst_aux[r]) if part.stop == prompt.pages and n == 0 else None
                pulls = pairing.pulls(prompt.src[q][part], prompt.dst[r][part], aux)
                for pull in pulls:
                    key = refs[pull.group].blocks_key()
                    if pull.rows is None:
                        peer.cm("pull_blocks", key, local[pull.group], list(pull.src_blocks), list(pull.dst_blocks))
                    else:
                        peer.cm("pull_block_ranges", key, local[pull.group], pull.rows)
                    nbytes += pull.nbytes
                apply(pulls, data, by_hand)
        landed = [np.stack(peer.read(ref)).reshape(a.shape) for ref, a in zip(local, by_hand)]
        for index, (a, b) in enumerate(zip(landed, by_hand)):
            np.testing.assert_array_equal(a, b, err_msg=f"decode rank {r}, group {index}")
        # Every byte of the decode's share of the prompt's pages arrived, none other.
        kv_groups = [index for index, _ in mine.of_kind("kv")]
        share = sum(landed[i][:, prompt.dst[r]].size for i in kv_groups)
        assert nbytes == share + sum(g.item_len * len(g.members) for _, g in mine.of_kind("aux"))
        _check_heads(mine, prefills, [data for _, data in held], landed, prompt, r)


def _check_heads(mine: BufferLayout, prefills: list[BufferLayout], held: list[list[np.ndarray]],
                 landed: list[np.ndarray], prompt: Prompt, r: int) -> None:
    """Independently of the plan: token ``t``, local head ``j`` of decode rank ``r`` holds what the
    prefill rank holding that head keeps there (with two heads and TP up to 2, one rank holds each)."""
    for index, group in mine.of_kind("kv"):
        dst = landed[index].reshape(len(group.members), group.items, mine.page_size, -1, HEAD if not mine.latent
                                    else LATENT)
        mine_heads = range(1) if mine.latent else heads_of(r, mine.tp_size, mine.kv_heads)
        for j, head in enumerate(mine_heads):
            q = 0 if mine.latent else next(p.tp_rank for p in prefills if head in heads_of(p.tp_rank, p.tp_size,
                                                                                          p.kv_heads))
            theirs = prefills[q]
            start = 0 if mine.latent else heads_of(q, theirs.tp_size, theirs.kv_heads).start
            src = held[q][index].reshape(len(group.members), -1, mine.page_size, dst.shape[3] if mine.latent
                                         else len(heads_of(q, theirs.tp_size, theirs.kv_heads)), dst.shape[4])
            for i in range(prompt.pages):
                np.testing.assert_array_equal(dst[:, prompt.dst[r][i], :, j], src[:, prompt.src[q][i], :, head - start],
                                              err_msg=f"decode rank {r}, head {head}, page {i}")

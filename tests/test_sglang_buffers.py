"""The SGLang backend's pieces that need no SGLang: buffer groups, layouts, the Enum member."""

from __future__ import annotations

import dataclasses
import enum
import pickle

import pytest

from datadist_aio.integrations.sglang.buffers import BufferLayout, LayoutMismatch, group_buffers
from datadist_aio.integrations.sglang.plugin import add_backend_member


def _layout(item_len: int = 4096, kv_items: int = 100, page_size: int = 1, tp: tuple[int, int] = (1, 0),
            layers: int = 2) -> BufferLayout:
    kv = group_buffers("kv", [0x1000 * (i + 1) for i in range(2 * layers)], [item_len * kv_items] * 2 * layers,
                       [item_len] * 2 * layers)
    aux = group_buffers("aux", [0x100000, 0x200000, 0x300000], [64 * 8, 64 * 8, 256 * 8], [8, 8, 256])
    return BufferLayout(page_size, tp[0], tp[1], 2, tuple(kv + aux))


def test_groups_by_item_length_and_count_in_order() -> None:
    groups = group_buffers("aux", [10, 20, 30, 40], [80, 4096, 160, 80], [8, 16, 16, 8])
    assert [(g.item_len, g.items, g.members) for g in groups] == [(8, 10, (0, 3)), (16, 256, (1,)), (16, 10, (2,))]


@pytest.mark.parametrize(("addresses", "lengths", "item_lens", "message"), [
    ([1, 2], [8], [8, 8], "2 addresses, 1 lengths"),
    ([1], [12], [8], "not a whole number"),
    ([1], [8], [0], "positive int"),
    ([0], [8], [8], "address must be"),
])
def test_bad_buffers_are_refused_with_the_reason(addresses: list[int], lengths: list[int], item_lens: list[int],
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=message):
        group_buffers("kv", addresses, lengths, item_lens)


def test_layout_round_trips_and_pairs_with_another_pool_size() -> None:
    prefill, decode = _layout(kv_items=100), _layout(kv_items=300)
    assert BufferLayout.from_wire(prefill.to_wire()) == prefill
    pairing = decode.pair_with(prefill)  # only the item counts differ
    assert pairing.sources == {0} and all(pull.rows is None for pull in pairing.pulls([1, 2], [3, 4], (0, 1)))


@pytest.mark.parametrize(("theirs", "message"), [
    (_layout(page_size=16), "page sizes 16 and 1"),
    (_layout(tp=(3, 1), item_len=2048), "2 KV heads do not share out over TP 3"),
    (_layout(item_len=2048), "of 2048 B items"),
    (_layout(layers=3), "kv buffers"),
])
def test_layouts_that_do_not_pair_name_both(theirs: BufferLayout, message: str) -> None:
    with pytest.raises(LayoutMismatch, match=message) as caught:
        _layout().pair_with(theirs)
    assert "the prefill's buffers (TP" in str(caught.value) and "this decode worker's (TP" in str(caught.value)


@pytest.mark.parametrize("wire", [
    None, [], {"page_size": 1, "tp_size": 1, "tp_rank": 1, "groups": []},
    {"page_size": 1, "tp_size": 1, "tp_rank": 0, "groups": [{"kind": "x", "item_len": 1, "items": 1, "members": [0]}]},
    {"page_size": 1, "tp_size": 1, "tp_rank": 0, "groups": [{"kind": "kv", "item_len": -1, "items": 1, "members": [0]}]},
    {"page_size": "1", "tp_size": 1, "tp_rank": 0, "groups": []},
    {**_layout().to_wire(), "kv_heads": 0},
    {**_layout().to_wire(), "latent": 1},
])
def test_malformed_layouts_are_refused(wire: object) -> None:
    with pytest.raises(ValueError):
        BufferLayout.from_wire(wire)


class _Backend(enum.Enum):
    ONE = "one"
    TWO = "two"


def test_backend_member_answers_every_lookup_and_only_those() -> None:
    member = add_backend_member(_Backend, "EXTRA", "extra")
    assert _Backend("extra") is member and _Backend["EXTRA"] is member and _Backend.EXTRA is member  # type: ignore[attr-defined]
    assert member.name == "EXTRA" and member.value == "extra" and isinstance(member, _Backend)
    assert member != _Backend.ONE and member == _Backend("extra")
    assert pickle.loads(pickle.dumps(member)) is member
    assert add_backend_member(_Backend, "EXTRA", "extra") is member  # idempotent
    assert list(_Backend) == [_Backend.ONE, _Backend.TWO]
    with pytest.raises(ValueError, match="already has 'one'"):
        add_backend_member(_Backend, "ANOTHER", "one")
    with pytest.raises(ValueError, match="named TWO"):
        add_backend_member(_Backend, "TWO", "three")
    with pytest.raises(TypeError):
        add_backend_member(dict)


def _hybrid(tp: tuple[int, int] = (1, 0), swa_items: int = 50, heads_share: int = 1) -> BufferLayout:
    """A hybrid SWA model's worker: 2 full layers' K and V (kv), the aux rows, 2 sliding-window
    layers' K and V (swa, a pool of their own); pages of 4 tokens of 2 KV heads of 16 B,
    ``heads_share`` of them on this rank."""
    item = 4 * 16 * heads_share
    kv = group_buffers("kv", [0x1000 * (i + 1) for i in range(4)], [item * 100] * 4, [item] * 4)
    aux = group_buffers("aux", [0x100000], [64 * 8], [8])
    swa = group_buffers("swa", [0x900000 + 0x1000 * i for i in range(4)], [item * swa_items] * 4, [item] * 4)
    return BufferLayout(4, tp[0], tp[1], 2, tuple(kv + aux + swa))


def test_sliding_window_pages_move_with_their_own_indices() -> None:
    decode, prefill = _hybrid(swa_items=80), _hybrid()
    assert BufferLayout.from_wire(prefill.to_wire()) == prefill
    pulls = decode.pair_with(prefill).pulls([1, 2, 3], [7, 8, 9], (0, 5), swa=([40, 41], [3, 4]))
    by_kind = {decode.groups[p.group].kind: p for p in pulls}
    assert (by_kind["kv"].src_blocks, by_kind["kv"].dst_blocks) == ((1, 2, 3), (7, 8, 9))
    assert (by_kind["swa"].src_blocks, by_kind["swa"].dst_blocks) == ((40, 41), (3, 4))
    assert by_kind["swa"].nbytes == 2 * 64 * 4 and by_kind["swa"].rows is None
    assert (by_kind["aux"].src_blocks, by_kind["aux"].dst_blocks) == ((0,), (5,))
    # Chunks before the last carry no window: no sliding-window pull.
    assert [decode.groups[p.group].kind for p in decode.pair_with(prefill).pulls([1], [7])] == ["kv"]
    with pytest.raises(ValueError, match="2 prefill sliding-window pages against 1 decode"):
        decode.pair_with(prefill).pulls([1], [7], swa=([40, 41], [3]))


def test_sliding_window_layers_must_pair_too() -> None:
    hybrid = _hybrid()
    full_only = BufferLayout(4, 1, 0, 2, tuple(g for g in hybrid.groups if g.kind != "swa"))
    with pytest.raises(LayoutMismatch, match="3 buffer groups against 2"):
        full_only.pair_with(hybrid)


def test_sliding_window_pages_follow_the_head_mapping_across_tp_sizes() -> None:
    """A decode of TP 1 (both heads) reads its window pages from two prefill ranks of TP 2, each
    giving its head of every token, as for the full layers' pages."""
    decode = _hybrid(heads_share=2)
    for rank in (0, 1):
        prefill = _hybrid(tp=(2, rank))
        pulls = decode.pair_with(prefill).pulls([1], [7], swa=([40], [3]))
        swa = [p for p in pulls if decode.groups[p.group].kind == "swa"]
        assert len(swa) == 1 and swa[0].rows is not None
        rows = swa[0].rows
        # Every token of the page: 16 B of the rank's head into its place among the decode's two.
        assert set(rows[:, 0]) == {40} and set(rows[:, 2]) == {3}
        assert int((rows[:, 4] * rows[:, 5]).sum()) == 4 * 16
        assert set(rows[:, 3] % 32) == {16 * rank}


# -- pipeline stages: a prefill stage's buffers among a decode's that holds every layer


def _stage(rank: int, stages: int, start: int, layers: int, latent: bool = False, tp: tuple[int, int] = (1, 0),
           item_len: int = 4096) -> BufferLayout:
    per_layer = 1 if latent else 2
    kv = group_buffers("kv", [0x1000 * (i + 1) for i in range(per_layer * layers)],
                       [item_len * 100] * per_layer * layers, [item_len] * per_layer * layers)
    aux = group_buffers("aux", [0x100000, 0x200000, 0x300000], [64 * 8, 64 * 8, 256 * 8], [8, 8, 256])
    return BufferLayout(1, tp[0], tp[1], 2, tuple(kv + aux), latent, pp_rank=rank, pp_size=stages, start_layer=start)


@pytest.mark.parametrize("latent", [False, True], ids=["k-and-v", "mla-latent"])
def test_a_prefill_stage_pulls_into_its_layers_of_the_decode(latent: bool) -> None:
    """Stage 1 of 2 holds layers 3 to 5 of 6: its K buffers go to the decode's K buffers 3 to 5,
    its V buffers to the decode's V buffers 3 to 5 (9 to 11), a pull per run; the aux row whole."""
    decode = _stage(0, 1, 0, 6, latent)
    pairing = decode.pair_with(_stage(1, 2, 3, 3, latent))
    kv, *aux = pairing.pulls([1, 2], [5, 6], (0, 1))
    assert kv.spans == (((0, 3, 3),) if latent else ((0, 3, 3), (3, 9, 3)))
    assert kv.nbytes == 2 * 4096 * (3 if latent else 6) and aux and all(pull.spans is None for pull in aux)
    # Stage 0 holds layers 0 to 2.
    kv0, *_ = decode.pair_with(_stage(0, 2, 0, 3, latent)).pulls([1, 2], [5, 6], (0, 1))
    assert kv0.spans == (((0, 0, 3),) if latent else ((0, 0, 3), (3, 6, 3)))
    # A decode with the same stages reads its own stage's buffers tensor for tensor.
    same = _stage(1, 2, 3, 3, latent).pair_with(_stage(1, 2, 3, 3, latent))
    assert all(pull.spans is None for pull in same.pulls([1], [2], (0, 1)))


def test_a_prefill_stage_of_another_tp_size_reads_each_ranks_heads_of_its_layers() -> None:
    decode = _stage(0, 1, 0, 4, tp=(2, 1), item_len=2048)
    pulls = decode.pair_with(_stage(1, 2, 2, 2, tp=(1, 0))).pulls([1, 2], [5, 6])
    assert len(pulls) == 1 and pulls[0].rows is not None and pulls[0].spans == ((0, 2, 2), (2, 6, 2))


@pytest.mark.parametrize(("decode", "prefill", "message"), [
    (_stage(0, 1, 0, 6), _stage(1, 2, 4, 3), "do not fall within this worker's 6"),
    (_stage(0, 1, 0, 6), _stage(1, 2, 2, 3), "does not begin or end"),
    (_stage(0, 1, 0, 6), _stage(0, 2, 1, 3), "does not begin or end"),
    (_stage(0, 2, 0, 3), _stage(1, 2, 3, 3), "stage 1 of 2 against stage 0 of 2"),
    (_stage(0, 1, 0, 6), _stage(0, 1, 0, 3), "kv buffers"),  # no stages: fewer layers is another model
])
def test_stages_that_do_not_cover_the_decodes_layers_are_refused(decode: BufferLayout, prefill: BufferLayout,
                                                                 message: str) -> None:
    with pytest.raises(LayoutMismatch, match=message) as caught:
        decode.pair_with(prefill)
    assert "PP" in str(caught.value) or "kv buffers" in str(caught.value)


def test_sliding_window_buffers_of_a_stage_are_refused() -> None:
    hybrid = _hybrid()
    stage = dataclasses.replace(hybrid, pp_rank=1, pp_size=2, start_layer=1)
    with pytest.raises(LayoutMismatch, match="sliding-window buffers of a prefill with pipeline stages"):
        hybrid.pair_with(stage)


def test_stage_fields_round_trip_and_default_for_a_peer_without_them() -> None:
    stage = _stage(1, 2, 3, 3)
    assert BufferLayout.from_wire(stage.to_wire()) == stage
    old = {k: v for k, v in _layout().to_wire().items() if k not in ("pp_rank", "pp_size", "start_layer")}
    assert BufferLayout.from_wire(old) == _layout()
    with pytest.raises(ValueError):
        BufferLayout.from_wire({**stage.to_wire(), "pp_rank": 2})

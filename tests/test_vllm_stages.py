"""Pipeline parallelism in the vLLM connector's mapping, without vLLM or an engine.

A prefill and a decode instance may split the model's layers into stages
(``pipeline_parallel_size``), each stage's TP ranks holding the KV heads as
without stages. Every case builds each layer's prompt KV once, lays it out in
every prefill worker's blocks as that worker (stage, TP rank) holds it,
applies what ``map_stages`` and ``plan_ranges`` give to zeroed decode blocks
layer by layer, and compares with the same KV laid out as each decode worker
holds it: each decode worker reads each of its layers from the stage and TP
rank that hold it, every head once.

Then the worker side in processes of its own, through the engine: a prefill
of two stages (one ``WorkerSide`` per stage over numpy arrays named as
vLLM's layers) read by a decode of one stage and by one of two stages, every
byte compared; a stage killed after the link fails the load within its
timeout, and the other stage's blocks are released.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.resource_tracker
import time
from typing import Any

import numpy as np
import pytest

from datadist_aio.integrations.vllm.groups import CacheGroup, model_layer, worker_layout
from datadist_aio.integrations.vllm.layout import GroupShape, LayoutError, WorkerLayout, heads_of, map_stages, plan_ranges
from datadist_aio.integrations.vllm.routes import Route, Source, port_of
from datadist_aio.integrations.vllm.worker import WorkerSettings, cluster_id_for
from support.block_ranges import apply_rows
from datadist_aio.integrations.vllm.metadata import LoadSpec, StepPlan
from datadist_aio.integrations.vllm.worker import WorkerSide
from test_vllm_layout import CHANNELS, DTYPE, blocks_of
from test_vllm_worker_side import FakeTensor, _stop
from vllm_pd import free_port_run

multiprocessing.resource_tracker.ensure_running()


def split(layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """An even split of ``layers`` over ``pp`` stages, the remainder on the first ones."""
    share, extra = divmod(layers, pp)
    sizes = [share + (1 if s < extra and s < pp - 1 else 0) for s in range(pp)]
    if sum(sizes) < layers:
        sizes[0] += layers - sum(sizes)
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return tuple(bounds)


def stage_layout(tp: int, rank: int, pp: int, stage: int, heads: int, block: int, layers: int,
                 interior: str = "HKTV") -> WorkerLayout:
    """One worker's layout: its stage's layers (every layer without stages)."""
    local = len(heads_of(rank, tp, heads))
    shape = (block, local, CHANNELS) if interior == "NHC" else (local, block, CHANNELS)
    bounds = split(layers, pp)
    held = tuple(range(*bounds[stage]))
    group = GroupShape(DTYPE, shape, 1, len(held), interior, (0,), held if pp > 1 else ())
    return WorkerLayout(tp, rank, heads, block, (group,), pp_size=pp, pp_rank=stage,
                        stages=bounds if pp > 1 else ())


def transfer(pp_p: int, tp_p: int, pp_d: int, tp_d: int, *, layers: int = 5, heads: int = 2, n_p: int = 16,
             n_d: int = 16, tokens: int = 70, first_token: int = 0, interior: str = "HKTV") -> None:
    rng = np.random.default_rng(pp_p * 1000 + tp_p * 100 + pp_d * 10 + tp_d + layers)
    kv = rng.standard_normal((layers, tokens, heads, CHANNELS)).astype(np.float32)
    nb_p, nb_d = -(-tokens // n_p), -(-tokens // n_d)
    src_table = [int(b) for b in rng.permutation(nb_p + 3)[:nb_p]]
    dst_all = [int(b) for b in rng.permutation(nb_d + 3)[:nb_d]]
    skip = first_token // n_d
    prefill_bounds = split(layers, pp_p)
    for ds in range(pp_d):
        for dr in range(tp_d):
            mine = stage_layout(tp_d, dr, pp_d, ds, heads, n_d, layers, interior)
            mine_layers = mine.groups[0].layer_ids()
            mine_heads = heads_of(dr, tp_d, heads)
            expected = [blocks_of(kv[x], dst_all, nb_d + 3, n_d, mine_heads, interior) for x in mine_layers]
            got = [np.zeros_like(e) for e in expected]
            stages = {s: stage_layout(tp_p, dr % tp_p, pp_p, s, heads, n_p, layers, interior) for s in range(pp_p)}
            maps = map_stages(mine, stages)
            read: dict[int, list[int]] = {}  # this worker's layer index: heads read into it
            for (s, q), head_map in maps.items():
                theirs = stage_layout(tp_p, q, pp_p, s, heads, n_p, layers, interior)
                assert head_map.stage == s
                runs = head_map.layers[0] if head_map.layers is not None else ((0, 0, len(mine_layers)),)
                rows = plan_ranges(head_map, 0, mine, theirs, src_table, dst_all[skip:], first_token)
                assert rows is not None
                for src, dst, count in runs:
                    for k in range(count):
                        model = theirs.groups[0].layer_ids()[src + k]
                        assert model == mine_layers[dst + k], "a layer read into another"
                        assert prefill_bounds[s][0] <= model < prefill_bounds[s][1] or pp_p == 1
                        src_blocks = blocks_of(kv[model], src_table, nb_p + 3, n_p, heads_of(q, tp_p, heads),
                                               interior)
                        apply_rows(rows, src_blocks, got[dst + k])
                        for _s, d, n in head_map.runs[0]:
                            read.setdefault(dst + k, []).extend(range(d, d + n))
            assert sorted(read) == list(range(len(mine_layers))), "every layer read"
            for heads_read in read.values():
                assert sorted(heads_read) == list(range(len(mine_heads))), "each head read exactly once"
            for layer, (g, e) in enumerate(zip(got, expected)):
                for block in dst_all[:skip]:
                    assert not g[block].any()
                    g[block] = e[block]
                np.testing.assert_array_equal(g, e, err_msg=f"decode stage {ds} rank {dr} layer {layer}")


@pytest.mark.parametrize("pp_p, pp_d", [(2, 1), (2, 2), (1, 2), (4, 2), (2, 4), (3, 1)])
@pytest.mark.parametrize("tp_p, tp_d", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_each_layer_comes_from_the_stage_and_rank_that_hold_it(pp_p: int, pp_d: int, tp_p: int, tp_d: int) -> None:
    transfer(pp_p, tp_p, pp_d, tp_d, layers=5)
    transfer(pp_p, tp_p, pp_d, tp_d, layers=4)


@pytest.mark.parametrize("interior", ["HKTV", "HNC", "NHC"])
def test_stages_with_other_block_sizes_and_a_prefix_hit(interior: str) -> None:
    transfer(2, 2, 1, 1, n_p=16, n_d=32, tokens=100, first_token=32, interior=interior)
    transfer(2, 1, 2, 2, n_p=32, n_d=16, tokens=100, first_token=48, interior=interior)


def test_reads_per_stage_are_one_run_of_layers_each() -> None:
    # Prefill PP 2 (layers 0-1 and 2-4 of 5, as vLLM splits them) into decode PP 1.
    mine = stage_layout(1, 0, 1, 0, 2, 16, 5)
    stages = {s: stage_layout(1, 0, 2, s, 2, 16, 5) for s in range(2)}
    assert split(5, 2) == ((0, 3), (3, 5))
    maps = map_stages(mine, stages)
    assert sorted(maps) == [(0, 0), (1, 0)]
    assert maps[(0, 0)].layers == (((0, 0, 3),),) and maps[(1, 0)].layers == (((0, 3, 2),),)
    # Stages whose layers interleave: one run per layer.
    odd = {s: dataclasses.replace(stages[s], stages=(), groups=(dataclasses.replace(
        stages[s].groups[0], tensors=2, layers=(s, s + 2)),)) for s in range(2)}
    maps = map_stages(stage_layout(1, 0, 1, 0, 2, 16, 4), odd)
    assert maps[(0, 0)].layers == (((0, 0, 1), (1, 2, 1)),) and maps[(1, 0)].layers == (((0, 1, 1), (1, 3, 1)),)
    # Decode PP 2 from prefill PP 1: stage 1 reads layers 3-4 of the one stage into its 0-1.
    maps = map_stages(stage_layout(1, 0, 2, 1, 2, 16, 5), {0: stage_layout(1, 0, 1, 0, 2, 16, 5)})
    assert list(maps) == [(0, 0)] and maps[(0, 0)].layers == (((3, 0, 2),),)
    # Both PP 2, split alike: stage s reads stage s only, its layers as they are.
    for s in range(2):
        maps = map_stages(stage_layout(2, 1, 2, s, 2, 16, 5), {t: stage_layout(2, 1, 2, t, 2, 16, 5) for t in range(2)})
        assert list(maps) == [(s, 1)] and maps[(s, 1)].whole == (True,)
        assert maps[(s, 1)].layers == (((0, 0, len(range(*split(5, 2)[s]))),),)


def test_without_stages_the_mapping_is_as_before() -> None:
    mine = stage_layout(1, 0, 1, 0, 2, 16, 4)
    maps = map_stages(mine, {0: stage_layout(2, 0, 1, 0, 2, 16, 4)})
    assert sorted(maps) == [(0, 0), (0, 1)]
    assert all(m.layers is None and m.stage == 0 for m in maps.values())


def _refused(mine: WorkerLayout, stages: dict[int, WorkerLayout], words: str) -> None:
    with pytest.raises(LayoutError, match=words) as info:
        map_stages(mine, stages)
    message = str(info.value)
    assert mine.describe() in message, "the decode's layout is named"
    assert "PP stage" in message and "cannot map the prefill's KV layout" in message, "the prefill's stages named"


def test_stages_that_cannot_pair_are_refused_naming_both_layouts() -> None:
    mine = stage_layout(1, 0, 1, 0, 2, 16, 4)
    two = {s: stage_layout(1, 0, 2, s, 2, 16, 4) for s in range(2)}
    _refused(mine, {0: two[0]}, "layouts came from stages")
    _refused(mine, {0: two[0], 1: dataclasses.replace(two[1], pp_rank=0)}, "says PP stage 0")
    _refused(mine, {0: two[0], 1: dataclasses.replace(two[1], tp_size=2)}, "with TP 2")
    # Another model: 6 layers on the prefill, 4 here.
    _refused(mine, {s: stage_layout(1, 0, 2, s, 2, 16, 6) for s in range(2)}, "0-5, this worker 0-3")
    _refused(stage_layout(1, 0, 2, 1, 2, 16, 4), {s: stage_layout(1, 0, 2, s, 2, 16, 6) for s in range(2)},
             "6 layers, this worker's 4")
    # A layer held twice, or by none.
    overlap = dataclasses.replace(two[1], groups=(dataclasses.replace(two[1].groups[0], layers=(1, 2)),))
    _refused(mine, {0: two[0], 1: overlap}, "model layer 1 is held by stages 0 and 1")
    gap = dataclasses.replace(two[1], groups=(dataclasses.replace(two[1].groups[0], tensors=1, layers=(3,)),))
    _refused(stage_layout(1, 0, 2, 1, 2, 16, 4), {0: two[0], 1: gap}, "model layer 2 of this worker is held by no")
    # A hybrid model (several KV cache groups over the tensors) with stages.
    hybrid = {s: dataclasses.replace(v, groups=(dataclasses.replace(v.groups[0], kv_groups=(0, 1)),))
              for s, v in two.items()}
    _refused(dataclasses.replace(mine, groups=(dataclasses.replace(mine.groups[0], kv_groups=(0, 1)),)), hybrid,
             "hybrid")
    # The heads still have to map, stage by stage.
    with pytest.raises(LayoutError, match="8 KV heads against 2"):
        map_stages(mine, {s: stage_layout(1, 0, 2, s, 8, 16, 4) for s in range(2)})


def test_the_wire_form_names_the_stages_and_is_unchanged_without_them() -> None:
    plain = stage_layout(2, 1, 1, 0, 2, 16, 4)
    wire = plain.to_wire()
    assert set(wire) == {"tp_size", "tp_rank", "kv_heads", "block_size", "groups"}
    assert set(wire["groups"][0]) == {"dtype", "block_shape", "per_layer", "tensors", "interior", "kv_groups"}
    assert WorkerLayout.from_wire(wire) == plain
    staged = stage_layout(2, 1, 2, 1, 2, 16, 5)
    wire = staged.to_wire()
    assert (wire["pp_size"], wire["pp_rank"], wire["stages"]) == (2, 1, [[0, 3], [3, 5]])
    assert wire["groups"][0]["layers"] == [3, 4]
    assert WorkerLayout.from_wire(wire) == staged
    assert "PP stage 1/2 holding model layers 3-4 (stages: 0-2, 3-4)" in staged.describe()
    for bad in ({**wire, "pp_rank": 2}, {**wire, "pp_size": 0}, {**wire, "stages": [[0, 3]]},
                {**wire, "stages": [[0, 3], [4, 5]]}, {**wire, "pp_rank": "1"},
                {**wire, "groups": [{**wire["groups"][0], "layers": [3]}]},
                {**wire, "groups": [{**wire["groups"][0], "layers": [3, 3]}]},
                {**wire, "groups": [{**wire["groups"][0], "layers": [3, -1]}]}):
        with pytest.raises(ValueError):
            WorkerLayout.from_wire(bad)


def test_ports_and_cluster_ids_are_unique_per_stage_and_rank() -> None:
    seen_ports, seen_ids = set(), set()
    for pp, tp in ((1, 1), (1, 2), (2, 1), (2, 2), (4, 2)):
        indices = set()
        for stage in range(pp):
            for rank in range(tp):
                settings = WorkerSettings(engine_id="e", rank=rank, tp_size=tp, pp_size=pp, pp_rank=stage)
                indices.add(settings.worker_index)
                assert port_of(100, tp, stage, rank) == 100 + settings.worker_index
                seen_ids.add((pp, tp, cluster_id_for("e", settings.worker_index)))
        assert indices == set(range(pp * tp)), "one port per worker, no gap"
        seen_ports |= {(pp, tp, i) for i in indices}
    assert len(seen_ids) == len(seen_ports)
    # Without stages: the TP rank, as before.
    assert WorkerSettings(engine_id="e", rank=1, tp_size=2).worker_index == 1
    with pytest.raises(ValueError, match="pp_rank 2"):
        WorkerSettings(engine_id="e", pp_size=2, pp_rank=2)
    with pytest.raises(ValueError, match="push_layerwise"):
        WorkerSettings(engine_id="e", pp_size=2, transfer_mode="push_layerwise")


def test_a_stage_reads_its_layers_off_vllm_layer_names() -> None:
    assert model_layer("model.layers.7.self_attn.attn") == 7
    assert model_layer("language_model.model.layers.12.attn") == 12
    assert model_layer("attn") is None and model_layer("a.1.b.2") is None
    group = CacheGroup(DTYPE, [2, 16, CHANNELS], 8, 1, addresses=[1, 2], layers=[2, 3])
    settings = WorkerSettings(engine_id="e", pp_size=2, pp_rank=1, stages=((0, 2), (2, 4)), kv_heads=2,
                              block_size=16)
    mine = worker_layout([group], settings)
    assert (mine.pp_size, mine.pp_rank, mine.stages, mine.groups[0].layers) == (2, 1, ((0, 2), (2, 4)), (2, 3))
    assert worker_layout([group], WorkerSettings(engine_id="e", kv_heads=2, block_size=16)).groups[0].layers == ()
    with pytest.raises(ValueError, match="layer name"):
        worker_layout([dataclasses.replace(group, layers=[2, None])], settings)


def test_a_decode_first_expect_goes_to_the_last_stage_read() -> None:
    mine = stage_layout(1, 0, 1, 0, 2, 16, 4)
    stages = {s: stage_layout(2, 0, 2, s, 2, 16, 4) for s in range(2)}
    maps = map_stages(mine, stages)
    sources = tuple(Source(port_of(10, 2, s, q), 0, m, stages[s], None)  # type: ignore[arg-type]
                    for (s, q), m in maps.items())
    route = Route(sources, mine)
    assert route.staged and route.notice_source.head_map.stage == 1 and route.notice_source.port == 12
    plain = map_stages(mine, {0: stage_layout(2, 0, 1, 0, 2, 16, 4)})
    route = Route(tuple(Source(10 + q, 0, m, mine, None) for (_s, q), m in plain.items()), mine)  # type: ignore[arg-type]
    assert not route.staged and route.notice_source.port == 10


# -- the worker side through the engine ----------------------------------------

MODEL_LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 5, 16, 2, 16, 32
SHAPE = (BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)


def layer_array(layer: int, seed: int) -> np.ndarray:
    """Model layer ``layer``'s KV tensor on the prefill (``seed`` 1) or zeroed (0)."""
    if not seed:
        return np.zeros(SHAPE, np.float32)
    return np.random.default_rng(1000 + layer).standard_normal(SHAPE).astype(np.float32)


def _settings(engine: str, pp: int, stage: int, **more: Any) -> WorkerSettings:
    return WorkerSettings(engine_id=engine, pp_size=pp, pp_rank=stage, stages=split(MODEL_LAYERS, pp) if pp > 1 else (),
                          load_timeout_s=4.0, **more)


def _arrays(pp: int, stage: int, seed: int, layers: int = MODEL_LAYERS) -> dict[str, np.ndarray]:
    return {f"model.layers.{x}.self_attn.attn": layer_array(x, seed) for x in range(*split(layers, pp)[stage])}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _stage(conn: Any, stage: int, base: int) -> None:
    arrays = _arrays(2, stage, 1)
    side = WorkerSide(_settings("prefill", 2, stage, is_consumer=False, side_channel_port=base + stage))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    conn.send(side.side_channel_port)
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            if conn.poll(0.02):
                command, value = conn.recv()
                if command == "lease":
                    side.start_loads(StepPlan(leases={r: time.monotonic() + 60 for r in value},
                                              lease_tokens={r: "t-" + r for r in value}))
                    conn.send("ok")
                elif command == "stop":
                    break
            freed, _, _ = side.get_finished()
            if freed:
                conn.send(("freed", sorted(freed)))
    finally:
        side.shutdown()


def _decode(conn: Any, base: int, pp: int, stage: int, first_contact_ms: float = 50.0,
            layers: int = MODEL_LAYERS) -> None:
    warnings = _Warnings()
    logging.getLogger("datadist_aio.integrations.vllm.worker").addHandler(warnings)
    arrays = _arrays(pp, stage, 0, layers)
    side = WorkerSide(_settings("decode", pp, stage, is_producer=False, first_contact_ms=first_contact_ms))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    while True:
        command, value = conn.recv()
        if command == "stop":
            break
        req, local, remote = value
        start = time.monotonic()
        side.start_loads(StepPlan(loads={req: LoadSpec(req, local, remote, "prefill", "127.0.0.1", base, req,
                                                       lease_token="t-" + req)}))
        assert side._router is not None
        routed_in_start = bool(side._router.routes)
        done: set[str] = set()
        failed: set[str] = set()
        errors: set[int] = set()
        while req not in done and time.monotonic() - start < 30:
            _, recving, fail = side.get_finished()
            done |= recving
            failed |= fail
            errors |= side.load_errors()
            time.sleep(0.005)
        assert side._router is not None
        conn.send({"done": sorted(done), "failed": sorted(failed), "errors": sorted(errors),
                   "elapsed": time.monotonic() - start, "arrays": dict(arrays), "inflight": len(side._inflight),
                   "routed_in_start": routed_in_start, "warnings": list(warnings.messages),
                   "records": [(r.nbytes, r.ok) for r in side.take_records()],
                   "sources": sorted(source.port for route in side._router.routes.values() for source in route.sources)})
    side.shutdown()
    conn.send("closed")


def _spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    child.close()
    return process, parent


def _freed(conn: Any, req: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.05) and req in conn.recv()[1]:
            return True
    return False


def _check_bytes(arrays: dict[str, np.ndarray], local: list[int], remote: list[int]) -> None:
    for name, got in arrays.items():
        want = layer_array(model_layer(name) or 0, 1)
        np.testing.assert_array_equal(got[local], want[remote], err_msg=name)
        others = [b for b in range(BLOCKS) if b not in local]
        assert not got[others].any(), f"{name}: a block not asked for was written"


@pytest.mark.parametrize("decode_pp, first_contact_ms", [(1, 50.0), (1, 0.0), (2, 50.0)])
def test_a_prefill_of_two_stages_into_a_decode_byte_for_byte(decode_pp: int, first_contact_ms: float) -> None:
    """The first contact made by the thread that starts the load, or by the loop thread (0 ms)."""
    base = free_port_run(2)
    stages = [_spawn(_stage, s, base) for s in range(2)]
    decodes = [_spawn(_decode, base, decode_pp, s, first_contact_ms) for s in range(decode_pp)]
    try:
        for _process, conn in stages:
            assert conn.poll(60) and conn.recv() in (base, base + 1)
            conn.send(("lease", ["r1"]))
            assert conn.recv() == "ok"
        local, remote = [3, 9, 4], [7, 2, 11]
        for s, (_process, conn) in enumerate(decodes):
            conn.send(("load", ("r1", local, remote)))
        results = [conn.recv() if conn.poll(60) else pytest.fail("the decode did not answer")
                   for _process, conn in decodes]
        for s, result in enumerate(results):
            assert result["done"] == ["r1"] and not result["failed"] and not result["errors"], result
            _check_bytes(result["arrays"], local, remote)
            held = range(*split(MODEL_LAYERS, decode_pp)[s]) if decode_pp > 1 else range(MODEL_LAYERS)
            assert result["records"] == [(len(held) * 3 * HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 4, True)]
            # Decode PP 1 reads both stages; a decode stage only the prefill stage holding its layers.
            assert result["sources"] == ([base, base + 1] if decode_pp == 1 else [base + s])
            if not first_contact_ms:
                assert not result["routed_in_start"], "the loop thread made the first contact"
        # Every decode worker tells every stage: each frees the request once all have.
        for _process, conn in stages:
            assert _freed(conn, "r1"), "a stage kept the request's blocks"
    finally:
        for process, conn in decodes + stages:
            _stop(process, conn)


def test_a_stage_that_dies_after_the_link_fails_the_load_in_time() -> None:
    base = free_port_run(2)
    stages = [_spawn(_stage, s, base) for s in range(2)]
    decode, dconn = _spawn(_decode, base, 1, 0)
    try:
        for _process, conn in stages:
            assert conn.poll(60) and conn.recv() in (base, base + 1)
            conn.send(("lease", ["r1", "r2"]))
            assert conn.recv() == "ok"
        dconn.send(("load", ("r1", [1, 2], [5, 6])))
        first = dconn.recv()
        assert first["done"] == ["r1"] and not first["failed"]
        _check_bytes(first["arrays"], [1, 2], [5, 6])
        stages[1][0].kill()  # stage 1 dies with its link up
        stages[1][0].join()
        dconn.send(("load", ("r2", [8, 9, 10], [3, 4, 6])))
        assert dconn.poll(30), "the decode did not answer"
        second = dconn.recv()
        assert second["done"] == ["r2"] and second["failed"] == ["r2"], second
        assert second["errors"] == [8, 9, 10], "the load's blocks are reported"
        assert second["elapsed"] < 4.0 + 1.5, "failed within the load timeout"
        assert second["inflight"] == 0, "nothing of the load left in flight"
        assert second["records"] == [(0, False)]
        # The live stage is told the request is done and frees its blocks.
        assert _freed(stages[0][1], "r2")
    finally:
        for process, conn in [(decode, dconn), *stages]:
            _stop(process, conn)


def test_a_decode_of_another_model_is_refused_at_the_hello_naming_both_layouts() -> None:
    """A decode of six layers against a prefill of five in two stages: the load fails at once."""
    base = free_port_run(2)
    stages = [_spawn(_stage, s, base) for s in range(2)]
    decode, dconn = _spawn(_decode, base, 1, 0, 50.0, MODEL_LAYERS + 1)
    try:
        for _process, conn in stages:
            assert conn.poll(60) and conn.recv() in (base, base + 1)
            conn.send(("lease", ["r1"]))
            assert conn.recv() == "ok"
        dconn.send(("load", ("r1", [1, 2], [5, 6])))
        assert dconn.poll(30), "the decode did not answer"
        result = dconn.recv()
        assert result["failed"] == ["r1"] and result["errors"] == [1, 2]
        assert result["elapsed"] < 2.0, "refused at the hello, not at the load timeout"
        assert not any(a.any() for a in result["arrays"].values()), "nothing landed"
        (warning,) = [m for m in result["warnings"] if "r1" in m]
        assert "layout: cannot map the prefill's KV layout (PP stage 0/2 holding model layers 0-2 (stages: 0-2, 3-4)" \
            in warning, warning
        assert "onto this decode worker's (TP 0/1" in warning and "x6]" in warning
        assert "the prefill holds model layers 0-4, this worker 0-5: not the same model" in warning
    finally:
        for process, conn in [(decode, dconn), *stages]:
            _stop(process, conn)

"""Decode-first pushes under vLLM's hybrid KV cache manager, without vLLM:
a decode process and a prefill process, each one ``WorkerSide`` over numpy
arrays laid out as the manager lays out a model of sliding-window layers
beside full-attention ones.

Four layers over two tensors: layers 0 and 2 (KV cache group 1, a sliding
window) and layers 1 and 3 (group 0, full attention) overlay them, tensor
``t`` written by the ``t``-th layer of each group, one tensor per layer as
vLLM's CPU backend has it (so a transfer layer is both tensors). Each group's
blocks go into the decode's blocks of that group as a transfer of its own,
once the last of its layers was saved: the sliding window's after layer 2,
while layer 3 still computes. The sliding window's blocks go only where
the decode's window keeps them (its tail, aligned to the prompt's end).
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import numpy as np
import pytest

from datadist_aio.integrations.vllm.metadata import LoadSpec, SaveSpec, StepPlan
from datadist_aio.integrations.vllm.worker import WorkerSettings, WorkerSide
from test_vllm_push import SHAPE, _ask, _commands, _start, wait_loaded
from test_vllm_worker_side import FakeTensor, _stop

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
GROUPS = {NAMES[0]: 1, NAMES[1]: 0, NAMES[2]: 1, NAMES[3]: 0}
TENSOR_OF = [0, 0, 1, 1]  # each layer's tensor
WINDOW = 2  # the sliding-window group's trailing blocks
BLOCK_BYTES = 2 * int(np.prod(SHAPE[1:])) * 4  # one block of both tensors


def _tensors(seed: int) -> list[np.ndarray]:
    if seed < 0:
        return [np.zeros(SHAPE, np.float32) for _ in range(2)]
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2)]


def _register(side: WorkerSide, tensors: list[np.ndarray]) -> None:
    side.register({name: FakeTensor(tensors[TENSOR_OF[i]]) for i, name in enumerate(NAMES)}, layer_groups=GROUPS)


def _decode(conn: Any) -> None:
    tensors = _tensors(-1)
    side = WorkerSide(WorkerSettings(engine_id="decode", is_producer=False, load_timeout_s=5.0,
                                     notify_timeout_s=1.0))
    _register(side, tensors)
    conn.send(side.side_channel_port)
    try:
        for command, value in _commands(conn):
            if command == "begin":
                spec = LoadSpec("a", value["full"], [], "prefill", "127.0.0.1", value["port"], "",
                                more_groups=[(value["window"], [], 0)], window_blocks=[0, WINDOW],
                                transfer_id="x-a")
                side.start_loads(StepPlan(loads={"a": spec}))
                conn.send("ok")
            elif command == "wait":
                done, failed = wait_loaded(side, 20)
                conn.send({"done": done, "failed": failed,
                           "records": [(r.nbytes, r.ok) for r in side.take_records()],
                           "tensors": [t.copy() for t in tensors]})
    finally:
        side.shutdown()


def _prefill(conn: Any) -> None:
    tensors, source = _tensors(7), _tensors(7)
    side = WorkerSide(WorkerSettings(engine_id="prefill", is_consumer=False, load_timeout_s=5.0))
    _register(side, tensors)
    conn.send(side.side_channel_port)
    assert side.pusher is not None
    directs = side.pusher.directs._directs
    try:
        for command, value in _commands(conn):
            if command == "forward":
                # The step's blocks hold nothing before the forward; each
                # layer writes its group's blocks of its tensor as it is saved.
                plan = StepPlan(saves={s.req_id: s for s in value["saves"]})
                computing = [sorted({b for s in value["saves"] for b in ([*s.block_ids], *s.more_block_ids)[g]})
                             for g in range(2)]
                for tensor in tensors:
                    tensor[computing[0] + computing[1]] = 0
                side.begin_step(plan)
                for index, name in enumerate(NAMES):
                    time.sleep(value["layer_s"])
                    blocks = computing[GROUPS[name]]
                    tensors[TENSOR_OF[index]][blocks] = source[TENSOR_OF[index]][blocks]
                    side.save_layer(name)
                side.start_loads(plan)
                side.finish_step()
                conn.send(([(r.nbytes, r.ok) for r in side.take_records()], side.take_push_steps()))
            elif command == "expected":
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and not (value in directs and directs[value].expected):
                    time.sleep(0.005)
                conn.send(value in directs and directs[value].expected and directs[value].readers[0].direct)
    finally:
        side.shutdown()


@pytest.fixture
def pair() -> Any:
    ctx = multiprocessing.get_context("spawn")
    prefill, pconn, pport = _start(ctx, _prefill)
    try:
        decode, dconn, _ = _start(ctx, _decode)
    except BaseException:
        _stop(prefill, pconn)
        raise
    try:
        yield dconn, pconn, pport
    finally:
        _stop(decode, dconn)
        _stop(prefill, pconn)


# The prompt: five blocks. The prefill's blocks of group 0 and group 1; the
# decode's, its sliding-window group holding the window's tail only (the
# null block, 0, before it, as vLLM's block table has it).
PREFILL_FULL, PREFILL_WINDOW = [3, 9, 4, 11, 12], [15, 16, 17, 18, 19]
DECODE_FULL, DECODE_WINDOW = [5, 1, 7, 13, 14], [0, 0, 0, 20, 21]


def _check_landed(tensors: list[np.ndarray]) -> None:
    source = _tensors(7)
    written = DECODE_FULL + DECODE_WINDOW[-WINDOW:]
    for index, tensor in enumerate(tensors):
        np.testing.assert_array_equal(tensor[DECODE_FULL], source[index][PREFILL_FULL])
        np.testing.assert_array_equal(tensor[DECODE_WINDOW[-WINDOW:]], source[index][PREFILL_WINDOW[-WINDOW:]])
        others = [block for block in range(tensor.shape[0]) if block not in written]
        assert not tensor[others].any(), "a block outside the groups' destinations was written (the null block?)"


@pytest.mark.parametrize("chunks", [1, 2], ids=["one step", "chunked"])
def test_each_kv_cache_group_lands_in_its_decode_blocks_layer_by_layer(pair: Any, chunks: int) -> None:
    """The decode expects the request first; each step's blocks of each group
    go into the decode's blocks of that group, the sliding window's tail
    only, and the sliding window's transfer starts before the forward's last
    layer is saved."""
    dconn, pconn, pport = pair
    assert _ask(dconn, "begin", {"port": pport, "full": DECODE_FULL, "window": DECODE_WINDOW}) == "ok"
    assert _ask(pconn, "expected", "x-a"), "the prefill pushes a hybrid decode-first request itself"
    cuts = [0, 5] if chunks == 1 else [0, 3, 5]
    records: list[Any] = []
    steps: list[Any] = []
    for first, stop in zip(cuts, cuts[1:]):
        save = SaveSpec("p-a", PREFILL_FULL[first:stop], first, 5, stop == 5, "x-a",
                        more_block_ids=[PREFILL_WINDOW[first:stop]])
        step_records, step_steps = _ask(pconn, "forward", {"saves": [save], "layer_s": 0.05})
        records += step_records
        steps += step_steps
    result = _ask(dconn, "wait", None, timeout=60)
    assert result["done"] == ["a"] and result["failed"] == []
    _check_landed(result["tensors"])
    assert all(ok for _, ok in records) and sum(n for n, _ in records) == (5 + WINDOW) * BLOCK_BYTES, records
    # The step that moves the window's tail starts it after layer 2, while
    # layer 3 computes. (Group 0's one transfer layer holds layer 3's
    # tensor: it goes after the last save whatever the step.)
    assert len(steps) == chunks and not any(s.aborted for s in steps) and steps[-1].overlapped, steps
    assert [n for n, _ in result["records"]] == [(5 + WINDOW) * BLOCK_BYTES], "the bytes the decode reports"


def test_a_hybrid_request_computed_before_the_expect_goes_when_it_comes(pair: Any) -> None:
    """The forward comes first: every group's blocks are owed, and go whole
    once the decode's expect names where."""
    dconn, pconn, pport = pair
    save = SaveSpec("p-a", PREFILL_FULL, 0, 5, True, "x-a", more_block_ids=[PREFILL_WINDOW])
    records, _steps = _ask(pconn, "forward", {"saves": [save], "layer_s": 0.0})
    assert records == []
    assert _ask(dconn, "begin", {"port": pport, "full": DECODE_FULL, "window": DECODE_WINDOW}) == "ok"
    result = _ask(dconn, "wait", None, timeout=60)
    assert result["done"] == ["a"] and result["failed"] == []
    _check_landed(result["tensors"])

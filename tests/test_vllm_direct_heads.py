"""Decode-first pushes between TP sizes that differ, without vLLM: each
prefill rank writes, layer by layer, its share of the KV heads straight into
the blocks of each decode rank that holds them.

Prefill and decode ranks are ``WorkerSide``s in processes of their own,
over numpy arrays shaped as vLLM's CPU KV tensors (two KV heads in all).
Each prefill rank's blocks hold nothing before the forward and each layer's
bytes only once it is saved, so a layer sent early would land zeros. The
decode's blocks are checked head by head against what the prefill ranks
computed, every other block untouched.
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from typing import Any

import numpy as np
import pytest

from datadist_aio.integrations.vllm.metadata import LoadSpec, SaveSpec, StepPlan
from datadist_aio.integrations.vllm.worker import WorkerSettings, WorkerSide
from test_vllm_push import BLOCK_SIZE, BLOCKS, HEAD_DIM, HEADS, NAMES, _ask, _commands, _start, wait_loaded
from test_vllm_worker_side import FakeTensor, _stop

PREFILL_BLOCKS, DECODE_BLOCKS = [3, 9, 4], [5, 1, 7]


def _source() -> list[np.ndarray]:
    """The model's KV of the request: every layer, both heads, per block."""
    rng = np.random.default_rng(11)
    return [rng.standard_normal((BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)).astype(np.float32) for _ in NAMES]


def _heads(rank: int, tp_size: int) -> slice:
    share = HEADS // tp_size
    return slice(rank * share, (rank + 1) * share)


def _settings(engine: str, rank: int, tp_size: int, **more: Any) -> WorkerSettings:
    return WorkerSettings(engine_id=engine, rank=rank, tp_size=tp_size, kv_heads=HEADS, block_size=BLOCK_SIZE,
                          load_timeout_s=5.0, **more)


def _decode(conn: Any, rank: int, tp_size: int) -> None:
    arrays = {name: np.zeros((BLOCKS, HEADS // tp_size, BLOCK_SIZE, 2 * HEAD_DIM), np.float32) for name in NAMES}
    side = WorkerSide(_settings("decode", rank, tp_size, is_producer=False, notify_timeout_s=1.0))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    conn.send(side.side_channel_port)
    try:
        for command, value in _commands(conn):
            if command == "begin":
                spec = LoadSpec("a", DECODE_BLOCKS, [], "prefill", "127.0.0.1", value["port"], "",
                                remote_tp_size=value["tp_size"], transfer_id="x-a")
                side.start_loads(StepPlan(loads={"a": spec}))
                conn.send("ok")
            elif command == "wait":  # value: seconds to wait for the load (it may not end)
                done, failed = wait_loaded(side, value)
                conn.send({"done": done, "failed": failed,
                           "arrays": {name: a.copy() for name, a in arrays.items()}})
    finally:
        side.shutdown()


def _prefill(conn: Any, rank: int, tp_size: int, port: int, mode: str) -> None:
    source = [layer[:, _heads(rank, tp_size)] for layer in _source()]
    arrays = {name: np.zeros_like(source[0]) for name in NAMES}
    side = WorkerSide(_settings("prefill", rank, tp_size, is_consumer=False, side_channel_port=port,
                                transfer_mode=mode))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    conn.send(side.side_channel_port)
    assert side.pusher is not None
    directs = side.pusher.directs._directs
    try:
        for command, value in _commands(conn):
            if command == "forward":
                plan = StepPlan(saves={s.req_id: s for s in value["saves"]})
                side.begin_step(plan)
                for index, name in enumerate(NAMES):
                    time.sleep(value["layer_s"])
                    arrays[name][PREFILL_BLOCKS] = source[index][PREFILL_BLOCKS]
                    side.save_layer(name)
                side.start_loads(plan)
                side.finish_step()
                conn.send(([(r.nbytes, r.ok) for r in side.take_records()], side.take_push_steps()))
            elif command == "expected":  # the decode ranks that expect the request, once ``value`` of them do
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and len(getattr(directs.get("x-a"), "readers", [])) < value:
                    time.sleep(0.005)
                readers = getattr(directs.get("x-a"), "readers", [])
                conn.send([(r.direct, r.templates is not None) for r in readers])
    finally:
        side.shutdown()


def _two_free_ports() -> int:
    """A port whose next one is free too (a prefill of TP 2 listens on both)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
                return base
    raise RuntimeError("no two free ports in a row")


@pytest.fixture
def instances(request: pytest.FixtureRequest) -> Any:
    """``(prefill TP size, decode TP size, a prefill rank that cannot push or
    -1)``: a process per rank of each."""
    prefill_tp, decode_tp, pulled = request.param
    ctx = multiprocessing.get_context("spawn")
    base = _two_free_ports()
    started: list[tuple[Any, Any]] = []
    try:
        prefills = []
        for rank in range(prefill_tp):
            process, conn, _port = _start(ctx, _prefill, rank, prefill_tp, base + rank,
                                          "pull" if rank == pulled else "auto")
            started.append((process, conn))
            prefills.append(conn)
        decodes = []
        for rank in range(decode_tp):
            process, conn, _port = _start(ctx, _decode, rank, decode_tp)
            started.append((process, conn))
            decodes.append(conn)
        yield {"prefills": prefills, "decodes": decodes, "port": base, "tp": (prefill_tp, decode_tp),
               "pulled": pulled}
    finally:
        for process, conn in started:
            _stop(process, conn)


@pytest.mark.parametrize("instances", [(1, 2, -1), (2, 1, -1), (2, 1, 1)], indirect=True,
                         ids=["tp1-into-tp2", "tp2-into-tp1", "tp2-into-tp1-one-rank-pulled"])
def test_each_prefill_rank_pushes_its_heads_into_each_decode_rank_that_holds_them(instances: Any) -> None:
    """Each rank's share of every block lands where the decode's ranks hold
    those heads; a load is done only once every prefill rank it expects has
    pushed. Where one rank cannot push (its mode is pull), it says to pull
    once the prompt is computed, and the decode pulls every rank's heads."""
    prefill_tp, decode_tp = instances["tp"]
    for conn in instances["decodes"]:
        assert _ask(conn, "begin", {"port": instances["port"], "tp_size": prefill_tp}) == "ok"
    # Each prefill rank is expected by every decode rank holding one of its heads.
    readers = max(1, decode_tp // prefill_tp)
    for rank, conn in enumerate(instances["prefills"]):
        pushes = rank != instances["pulled"]
        assert _ask(conn, "expected", readers) == [(pushes, True)] * readers, "pushed by ranges of each block"
    save = SaveSpec("p-a", PREFILL_BLOCKS, 0, len(PREFILL_BLOCKS), True, "x-a", "t-a")
    for rank, conn in enumerate(instances["prefills"]):
        conn.send(("forward", {"saves": [save], "layer_s": 0.05}))
        assert conn.poll(30), "a prefill rank's step did not end"
        records, steps = conn.recv()
        if rank + 1 < prefill_tp:
            # One rank's heads landed, not the other's: the load is not done.
            early = _ask(instances["decodes"][0], "wait", 0.5)
            assert early["done"] == [] and early["failed"] == [], "done before every rank pushed its heads"
        if rank == instances["pulled"]:
            assert records == [], "a rank in pull mode pushed"
            continue
        assert records and all(ok for _, ok in records), records
        # Each rank moved its share of every block: its heads, to each reader.
        head_bytes = BLOCK_SIZE * 2 * HEAD_DIM * 4 * len(NAMES)
        assert sum(n for n, _ in records) == len(PREFILL_BLOCKS) * head_bytes * (HEADS // max(prefill_tp, decode_tp)) \
            * readers
        assert len(steps) == 1 and steps[0].overlapped and not steps[0].aborted, steps
    source = _source()
    for rank, conn in enumerate(instances["decodes"]):
        result = _ask(conn, "wait", 20, timeout=60)
        assert result["done"] == ["a"] and result["failed"] == []
        for index, name in enumerate(NAMES):
            got = result["arrays"][name]
            np.testing.assert_array_equal(got[DECODE_BLOCKS], source[index][PREFILL_BLOCKS][:, _heads(rank, decode_tp)])
            others = [block for block in range(BLOCKS) if block not in DECODE_BLOCKS]
            assert not got[others].any(), "a block nobody expected was written"

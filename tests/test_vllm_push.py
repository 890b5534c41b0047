"""The connector's layer-wise push and its inbox, without vLLM.

The inbox and the layer release are checked alone; then a decode process
(lending an inbox) and a prefill process (pushing into it), each one
``WorkerSide`` over numpy arrays shaped like vLLM's CPU KV tensors: a pushed
request is copied out of the inbox byte for byte, a request the share cannot
hold is pulled instead, and a prefill frozen in the middle of a push fails the
load within its timeout, never with a wrong byte.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import socket
import time
from typing import Any

import numpy as np
import pytest

from datadist_aio.integrations.vllm.inbox import CLAIMED, COMMITTED, IN_USE, Inbox, Share
from datadist_aio.integrations.vllm.metadata import LoadSpec, SaveSpec, StepPlan
from datadist_aio.integrations.vllm.groups import CacheGroup, release_layers
from datadist_aio.integrations.vllm.push import LayerRelease, ReleaseView
from datadist_aio.integrations.vllm.worker import WorkerSettings, WorkerSide
from test_vllm_worker_side import FakeTensor, _stop

multiprocessing.resource_tracker.ensure_running()

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 4, 24, 2, 32, 64
SHAPE = (BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
# MLA (DeepSeek-V2 on vLLM's CPU_MLA backend): one latent tensor per layer,
# [num_blocks, block_size 16, kv_lora_rank 512 + rope 64].
MLA_SHAPE = (BLOCKS, 16, 512 + 64)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the inbox alone ------------------------------------------------------------


def test_inbox_shares_do_not_overlap_and_run_out() -> None:
    inbox = Inbox(10, 4)
    assert inbox.grant("p1", 8) == (0, 4)
    assert inbox.grant("p2", 3) == (4, 3)
    assert inbox.grant("p3", 9) == (7, 3)
    assert inbox.grant("p4", 1) == (10, 0)
    assert inbox.grant("p1", 2) == (0, 4), "a peer asking again keeps its range"
    with pytest.raises(ValueError, match="inbox_blocks"):
        Inbox(0, 4)


def test_inbox_claims_only_free_blocks_of_the_peers_share() -> None:
    clock = Clock()
    inbox = Inbox(8, 4, clock)
    inbox.grant("p1", 4)
    inbox.grant("p2", 4)
    assert not inbox.claim("p1", "r0", [4], 60), "a block of another peer's share"
    assert not inbox.claim("p1", "r0", [1, 1], 60), "the same block twice"
    assert inbox.claim("p1", "r1", [0, 1], 60)
    assert not inbox.claim("p1", "r2", [1, 2], 60), "block 1 is held by r1"
    assert not inbox.claim("p1", "r1", [2], 60), "r1 already holds a claim"
    assert inbox.state("p1", "r1") == CLAIMED
    assert inbox.take("p1", "r1") is None, "not committed yet"
    assert inbox.commit("p1", "r1") and inbox.state("p1", "r1") == COMMITTED
    assert inbox.take("p1", "r1") == [0, 1] and inbox.state("p1", "r1") == IN_USE
    clock.now += 1000
    assert not inbox.claim("p1", "r3", [0], 60), "blocks being copied out never expire"
    inbox.finish("p1", "r1")
    assert inbox.held() == 0 and inbox.claim("p1", "r3", [0], 60)


def test_inbox_drops_aborted_and_expired_claims_but_keeps_a_landing_push() -> None:
    clock = Clock()
    inbox = Inbox(8, 8, clock)
    inbox.grant("p", 8)
    assert inbox.claim("p", "a", [0, 1], 5) and inbox.claim("p", "b", [2], 5)
    inbox.abort("p", "a")
    assert inbox.state("p", "a") is None and inbox.held() == 1
    inbox.finish("p", "b")
    assert inbox.state("p", "b") == CLAIMED, "its bytes may still land: only the hold time frees it"
    clock.now += 6
    assert inbox.claim("p", "c", [2], 5), "b's hold ran out"
    assert inbox.state("p", "b") is None
    assert inbox.grant("p", 8) == (0, 8) and inbox.held() == 0, "a re-granted share starts empty"


def test_share_hands_out_each_block_once() -> None:
    share = Share(10, 4)
    first = share.allocate(3)
    assert first is not None and sorted(first) == [10, 11, 12]
    assert share.allocate(2) is None and share.available() == 1
    share.free(first)
    assert sorted(share.allocate(4) or []) == [10, 11, 12, 13]


async def test_layer_release_waits_for_every_model_layer_of_a_transfer_layer() -> None:
    loop = asyncio.get_running_loop()
    release = LayerRelease(loop, 4)
    # One tensor per model layer: a transfer layer is two model layers, let go after the later one.
    fused = ReleaseView(release, release_layers(_group(4, per_layer=1), 0) or [])
    waiter = asyncio.ensure_future(fused.synchronize_layer(0, None))
    release.saved(1)  # out of order: layer 0 is not saved yet
    await asyncio.sleep(0.01)
    assert not waiter.done()
    release.saved(0)
    assert await asyncio.wait_for(waiter, 1)
    second = asyncio.ensure_future(fused.synchronize_layer(1, None))
    release.saved(2)
    await asyncio.sleep(0.01)
    assert not second.done() and not release.complete
    release.saved(3)
    assert await asyncio.wait_for(second, 1) and release.complete
    assert release.first_handed is not None and release.first_handed < release.last_saved, \
        "layer 0 went before the last save"
    split = LayerRelease(loop, 2)  # K and V apart: a transfer layer is a model layer
    split.saved(0)
    assert await asyncio.wait_for(ReleaseView(split, release_layers(_group(2, per_layer=2), 0) or []
                                              ).synchronize_layer(0, None), 1)


def _group(layers: int, per_layer: int, kv_groups: int = 1) -> CacheGroup:
    """A cache group of ``layers`` vLLM layers, one tensor per ``kv_groups`` of
    them (the hybrid manager's overlay: tensor t written by layer t of each
    group, the groups' layers interleaved), split into ``per_layer`` parts."""
    tensors = layers // kv_groups
    group = CacheGroup("torch.float32", [4], 8, per_layer, kv_groups=tuple(range(kv_groups)))
    for tensor in range(tensors):
        group.addresses += [0] * per_layer
        group.writers.append({kv_group: tensor * kv_groups + kv_group for kv_group in range(kv_groups)})
    return group


def test_each_kv_cache_group_goes_after_the_last_of_its_layers_writing_a_transfer_layer() -> None:
    # Four layers over two tensors, alternating two KV cache groups (layers
    # 0 and 2 sliding, 1 and 3 full, say), one tensor per layer: one
    # transfer layer, which holds group 0's bytes after layer 2, group 1's after 3.
    overlay = _group(4, per_layer=1, kv_groups=2)
    assert release_layers(overlay, 0) == [2] and release_layers(overlay, 1) == [3]
    # K and V apart: each tensor is a transfer layer of its own.
    apart = _group(4, per_layer=2, kv_groups=2)
    assert release_layers(apart, 0) == [0, 2] and release_layers(apart, 1) == [1, 3]
    # Tensors that do not split into transfer layers, or two layers of one group on one tensor: none.
    assert release_layers(_group(3, per_layer=1), 0) is None
    shared = _group(2, per_layer=2)
    shared.writers[0][0] = -1
    assert release_layers(shared, 0) is None


async def test_an_aborted_release_refuses_the_layers_it_had_not_released() -> None:
    loop = asyncio.get_running_loop()
    release = LayerRelease(loop, 4)
    release.saved(0)
    release.saved(1)
    release.abort()
    assert release.aborted and not release.complete
    release.saved(2)  # a save after the abort releases nothing
    results = [await asyncio.wait_for(release.synchronize_layer(layer, None), 1) for layer in range(4)]
    assert results == [True, True, False, False]
    whole = LayerRelease(loop, 2)
    whole.saved(0)
    whole.saved(1)
    whole.abort()  # every layer had gone: nothing to refuse, but the push is still aborted
    assert whole.aborted and whole.complete
    assert await asyncio.wait_for(whole.synchronize_layer(1, None), 1)


# -- two processes ------------------------------------------------------------------


def prefill_arrays(shape: tuple[int, ...] = SHAPE) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {name: rng.standard_normal(shape).astype(np.float32) for name in NAMES}


def _commands(conn: Any) -> Any:
    """(command, value) pairs from the test until it says stop."""
    while True:
        command, value = conn.recv()
        if command == "stop":
            return
        yield command, value


def _decode(conn: Any, share_blocks: int, timeout_s: float, shape: tuple[int, ...]) -> None:
    arrays = {name: np.zeros(shape, np.float32) for name in NAMES}
    side = WorkerSide(WorkerSettings(engine_id="decode", is_producer=False, transfer_mode="push_layerwise",
                                     inbox_blocks=16, inbox_share_blocks=share_blocks, load_timeout_s=timeout_s))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    conn.send(side.side_channel_port)
    try:
        for _command, value in _commands(conn):
            loads = {req: LoadSpec(req, local, remote, "prefill", "127.0.0.1", value["port"], "p-" + req)
                     for req, local, remote in value["specs"]}
            assert side._inbox is not None
            states = {req: side._inbox.state("prefill", "p-" + req) for req in loads}
            start = time.monotonic()
            side.start_loads(StepPlan(loads=loads))
            done: set[str] = set()
            failed: set[str] = set()
            errors: set[int] = set()
            while done != set(loads) and time.monotonic() - start < timeout_s + 20:
                _, recving, fail = side.get_finished()
                done |= recving
                failed |= fail
                errors |= side.load_errors()
                time.sleep(0.005)
            assert side._inbox is not None
            conn.send({
                "done": sorted(done), "failed": sorted(failed), "errors": sorted(errors),
                "elapsed": time.monotonic() - start,
                "records": [(r.blocks, r.ok) for r in side.take_records()],
                "inbox_held": side._inbox.held(),
                "states": states,
                "arrays": {name: a.copy() for name, a in arrays.items()},
            })
    finally:
        side.shutdown()


def _prefill(conn: Any, decode_port: int, shape: tuple[int, ...]) -> None:
    arrays = prefill_arrays(shape)
    side = WorkerSide(WorkerSettings(engine_id="prefill", is_consumer=False, transfer_mode="push_layerwise",
                                     push_port=decode_port, load_timeout_s=5.0))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    conn.send(side.side_channel_port)
    try:
        for command, value in _commands(conn):
            if command == "lease":
                side.start_loads(StepPlan(leases={req: time.monotonic() + 60 for req in value}))
                conn.send("ok")
            elif command == "step":  # one forward: saves, each layer saved in turn, then wait_for_save
                side.begin_step(StepPlan(saves={s.req_id: s for s in value}))
                for name in NAMES:
                    side.save_layer(name)
                side.finish_step()
                conn.send([(r.blocks, r.ok) for r in side.take_records()])
            elif command == "linked":  # once the prefill has its share and its link (it asks as it starts)
                deadline = time.monotonic() + 10
                while (side.pusher is None or side.pusher._decode is None) and time.monotonic() < deadline:
                    time.sleep(0.005)
                conn.send(side.pusher is not None and side.pusher._decode is not None)
            elif command == "forward":  # as vLLM orders a step; each layer takes `layer_s` to compute
                plan = StepPlan(saves={s.req_id: s for s in value["saves"]})
                side.begin_step(plan)  # bind_connector_metadata, before the forward
                for name in NAMES[:value["layers"]]:
                    if value.get("spin"):  # computing in Python, the GIL held
                        until = time.perf_counter() + value["layer_s"]
                        while time.perf_counter() < until:
                            pass
                    else:
                        time.sleep(value["layer_s"])
                    side.save_layer(name)
                if value["raise"]:
                    try:
                        try:
                            raise RuntimeError("the forward failed")
                        finally:  # vLLM's runner calls wait_for_save from a finally
                            side.start_loads(plan)
                            side.finish_step(forward_failed=True)
                    except RuntimeError:
                        pass
                else:
                    side.start_loads(plan)  # start_load_kv, after the forward since vLLM 0.32
                    side.finish_step()
                conn.send(([(r.blocks, r.ok) for r in side.take_records()], side.take_push_steps()))
            elif command == "begin":  # a step that stops before its layers are saved, once its claims are granted
                side.begin_step(StepPlan(saves={s.req_id: s for s in value}))
                assert side.pusher is not None
                deadline = time.monotonic() + 10
                while not {s.req_id for s in value} <= side.pusher._pushing and time.monotonic() < deadline:
                    time.sleep(0.005)
                conn.send("ok" if {s.req_id for s in value} <= side.pusher._pushing else "not granted")
            elif command == "freed":
                freed = wait_freed(side, value)
                assert side.pusher is not None and side.pusher._decode is not None
                conn.send((freed, side.pusher._decode.share.available()))
    finally:
        side.shutdown()


def wait_loaded(side: WorkerSide, timeout_s: float) -> tuple[list[str], list[str]]:
    """The loads ``get_finished`` reported within ``timeout_s`` (done, and of
    those failed), once any was."""
    deadline = time.monotonic() + timeout_s
    done: set[str] = set()
    failed: set[str] = set()
    while not done and time.monotonic() < deadline:
        _, recving, fail = side.get_finished()
        done |= recving
        failed |= fail
        time.sleep(0.005)
    return sorted(done), sorted(failed)


def wait_freed(side: WorkerSide, req_ids: list[str], timeout_s: float = 10.0) -> list[str]:
    """The prefill requests ``get_finished`` freed within ``timeout_s``, once all of ``req_ids`` were."""
    deadline = time.monotonic() + timeout_s
    freed: set[str] = set()
    while time.monotonic() < deadline and not set(req_ids) <= freed:
        freed |= side.get_finished()[0]
        time.sleep(0.01)
    return sorted(freed)


def _start(ctx: Any, target: Any, *args: Any) -> tuple[Any, Any, int]:
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    child.close()
    assert parent.poll(60), "a worker process did not start"
    return process, parent, parent.recv()


def _ask(conn: Any, command: str, value: Any, timeout: float = 30) -> Any:
    conn.send((command, value))
    assert conn.poll(timeout), f"no answer to {command}"
    return conn.recv()


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Any:
    ctx = multiprocessing.get_context("spawn")
    share_blocks, timeout_s, shape = getattr(request, "param", (8, 3.0, SHAPE))
    decode, dconn, dport = _start(ctx, _decode, share_blocks, timeout_s, shape)
    try:
        prefill, pconn, pport = _start(ctx, _prefill, dport, shape)
    except BaseException:
        _stop(decode, dconn)
        raise
    try:
        yield {"decode": (decode, dconn), "prefill": (prefill, pconn), "pport": pport}
    finally:
        _stop(prefill, pconn)
        _stop(decode, dconn)


def _load(pair: Any, specs: list[Any]) -> dict[str, Any]:
    return _ask(pair["decode"][1], "load", {"port": pair["pport"], "specs": specs}, timeout=60)


def test_pushed_request_is_copied_from_the_inbox_exactly(pair: Any) -> None:
    pconn = pair["prefill"][1]
    # Request "a" (5 prompt blocks) in two chunks: blocks 0-2 (the third
    # partly filled), then 2-4; request "b" (2 blocks) in one step.
    records = _ask(pconn, "step", [SaveSpec("p-a", [3, 9, 4], 0, 5, False), SaveSpec("p-b", [11, 12], 0, 2, True)])
    assert records == [(5, True)]
    assert _ask(pconn, "step", [SaveSpec("p-a", [4, 20, 21], 2, 5, True)]) == [(3, True)]
    assert _ask(pconn, "lease", ["p-a", "p-b"]) == "ok"
    specs = [("a", [1, 2, 5, 6, 7], [3, 9, 4, 20, 21]), ("b", [14, 15], [11, 12])]
    result = _load(pair, specs)
    assert result["done"] == ["a", "b"] and result["failed"] == [] and result["errors"] == []
    assert sorted(result["records"]) == [(2, True), (5, True)]
    assert result["inbox_held"] == 0, "copied-out blocks go back to the share"
    source = prefill_arrays()
    for name, array in result["arrays"].items():
        for _req, local, remote in specs:
            np.testing.assert_array_equal(array[local], source[name][remote])
        untouched = [b for b in range(BLOCKS) if b not in (1, 2, 5, 6, 7, 14, 15)]
        assert not array[untouched].any(), "a block nobody asked for was written"
    freed, available = _ask(pconn, "freed", ["p-a", "p-b"])
    assert freed == ["p-a", "p-b"] and available == 8, "the decode side's release freed the prefill's share"


@pytest.mark.parametrize("layer_s,spin", [(0.1, False), (0.0005, True)],
                         ids=["layers of 100 ms", "layers of 0.5 ms holding the GIL"])
def test_the_push_leaves_while_the_forward_computes(pair: Any, layer_s: float, spin: bool) -> None:
    """vLLM's order: the step's metadata bound, the forward saving its layers
    one by one, start_load_kv after the forward, then wait_for_save. The
    push starts at the bind, so its first layer is on its way before the
    forward has saved its last; the commit comes once all have landed. The
    forward starts only once the push's claim was answered and its transfer
    watches the layers, so even a forward far shorter than that round trip
    is overlapped."""
    pconn = pair["prefill"][1]
    assert _ask(pconn, "linked", None) is True
    saves = [SaveSpec("p-a", [3, 9, 4], 0, 3, True)]
    records, steps = _ask(pconn, "forward", {"saves": saves, "layers": LAYERS, "layer_s": layer_s, "spin": spin,
                                              "raise": False})
    assert records == [(3, True)]
    assert len(steps) == 1 and steps[0].overlapped and not steps[0].aborted, steps
    assert 0 <= steps[0].tail_seconds < 5
    assert _ask(pconn, "lease", ["p-a"]) == "ok"
    specs = [("a", [1, 2, 5], [3, 9, 4])]
    result = _load(pair, specs)
    assert result["states"] == {"a": COMMITTED}, "the push was committed"
    assert result["done"] == ["a"] and result["failed"] == []
    source = prefill_arrays()
    for name, array in result["arrays"].items():
        np.testing.assert_array_equal(array[[1, 2, 5]], source[name][[3, 9, 4]])


@pytest.mark.parametrize("forward", ["raised", "saved half"])
def test_a_forward_that_fails_never_commits_its_push(pair: Any, forward: str) -> None:
    """A forward that raises (vLLM still calls wait_for_save, from its
    finally), or that ends without saving every layer: the layers not yet
    sent are refused, nothing is committed, and the decode side pulls the
    request whole from the prefill's blocks."""
    pconn = pair["prefill"][1]
    saves = [SaveSpec("p-a", [3, 9, 4], 0, 3, True)]
    layers = LAYERS if forward == "raised" else LAYERS // 2
    records, steps = _ask(pconn, "forward", {"saves": saves, "layers": layers, "layer_s": 0.05,
                                             "raise": forward == "raised"})
    assert records == [(3, False)], records
    assert len(steps) == 1 and steps[0].aborted, steps
    assert _ask(pconn, "lease", ["p-a"]) == "ok"
    result = _load(pair, [("a", [1, 2, 5], [3, 9, 4])])
    assert result["states"] == {"a": None}, "the aborted claim is gone from the inbox"
    assert result["done"] == ["a"] and result["failed"] == [] and result["inbox_held"] == 0
    source = prefill_arrays()
    for name, array in result["arrays"].items():
        np.testing.assert_array_equal(array[[1, 2, 5]], source[name][[3, 9, 4]])


@pytest.mark.parametrize("pair", [(8, 3.0, SHAPE), (8, 3.0, MLA_SHAPE)], indirect=True, ids=["kv", "mla-latent"])
def test_request_the_share_cannot_hold_is_pulled(pair: Any) -> None:
    pconn = pair["prefill"][1]
    # A 6-block request does not fit the free part of an 8-block share
    # while a 4-block one holds it: it is pulled at load time.
    assert _ask(pconn, "step", [SaveSpec("p-big", [0, 1, 2, 3], 0, 4, True)]) == [(4, True)]
    assert _ask(pconn, "step", [SaveSpec("p-late", [5, 6, 7, 8, 10, 13], 0, 6, True)]) == []
    assert _ask(pconn, "lease", ["p-big", "p-late"]) == "ok"
    specs = [("big", [1, 2, 3, 4], [0, 1, 2, 3]), ("late", [8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 10, 13])]
    result = _load(pair, specs)
    assert result["failed"] == [] and result["done"] == ["big", "late"]
    source = prefill_arrays(next(iter(result["arrays"].values())).shape)
    for name, array in result["arrays"].items():
        for _req, local, remote in specs:
            np.testing.assert_array_equal(array[local], source[name][remote])


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
@pytest.mark.parametrize("pair", [(8, 2.0, SHAPE)], indirect=True)
def test_prefill_frozen_mid_push_fails_the_load_within_the_timeout(pair: Any) -> None:
    prefill, pconn = pair["prefill"]
    # The claim goes out, then the prefill stops before its layers are saved.
    assert _ask(pconn, "begin", [SaveSpec("p-a", [3, 4], 0, 2, True)]) == "ok"
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        result = _load(pair, [("a", [1, 2], [3, 4])])
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    assert result["done"] == ["a"] and result["failed"] == ["a"]
    assert result["errors"] == [1, 2]
    assert result["elapsed"] < 2.0 + 3, f"the load took {result['elapsed']:.1f} s to fail"
    assert not result["arrays"][NAMES[0]][[1, 2]].any(), "nothing of the unfinished push reached the blocks"


def test_a_silent_decode_side_bounds_the_step_then_steps_go_unpushed_at_once() -> None:
    """A decode side that accepts connections and never answers: the first
    step's push gives up within its timeout; the next steps do not wait on it
    again for a while (their requests are pulled instead)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        arrays = prefill_arrays()
        side = WorkerSide(WorkerSettings(engine_id="prefill", is_consumer=False, transfer_mode="push_layerwise",
                                         push_port=silent.getsockname()[1], load_timeout_s=1.0))
        side.register({name: FakeTensor(a) for name, a in arrays.items()})
        said: list[str] = []

        class Said(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                said.append(record.getMessage())

        handler = Said(logging.WARNING)
        logging.getLogger("datadist_aio.integrations.vllm.push").addHandler(handler)
        try:
            for index in range(3):
                side.begin_step(StepPlan(saves={f"r{index}": SaveSpec(f"r{index}", [index], 0, 1, True)}))
                for name in NAMES:
                    side.save_layer(name)
                side.finish_step()
            # Each step ended without a push, the first at its timeout, the
            # next at once without trying the silent side again.
            skipped = [message for message in said if "no push this step" in message]
            assert len(skipped) == 3, said
            assert "TimeoutError" in skipped[0], skipped
            assert all("unreachable a moment ago" in message for message in skipped[1:]), skipped
            assert side.take_records() == []
        finally:
            logging.getLogger("datadist_aio.integrations.vllm.push").removeHandler(handler)
            side.shutdown()

"""Decode-first pushes (``direct.py``), without vLLM: a decode process and a
prefill process, each one ``WorkerSide`` over numpy arrays shaped like
vLLM's CPU KV tensors.

The decode says where a request's blocks are (``expect``); the prefill
writes each layer straight into them as its forward saves it, or once the
expect comes where its forward was first, or tells the decode to pull where
it cannot push. A prefill frozen or too slow past the decode's deadline
never writes into the blocks after the decode gave them back.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from datadist_aio.integrations.vllm.metadata import LoadSpec, SaveSpec, StepPlan
from datadist_aio import LLMException
from datadist_aio.integrations.vllm.worker import WorkerSettings, WorkerSide, cluster_id_for
from test_vllm_push import NAMES, SHAPE, _ask, _commands, _start, prefill_arrays, wait_freed
from test_vllm_worker_side import FakeTensor, _stop

BLOCK_SIZE = SHAPE[2]


def _linked(side: WorkerSide, cluster_id: int) -> bool:
    """Whether the side's engine has a link to ``cluster_id`` now."""
    assert side._datadist is not None
    try:
        side._datadist.link_transport(cluster_id)
        return True
    except LLMException:
        return False


def _decode(conn: Any, timeout_s: float) -> None:
    arrays = {name: np.zeros(SHAPE, np.float32) for name in NAMES}
    side = WorkerSide(WorkerSettings(engine_id="decode", is_producer=False, load_timeout_s=timeout_s,
                                     notify_timeout_s=1.0))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    conn.send(side.side_channel_port)
    begun: set[str] = set()
    # Whether the engine still had its link to the prefill as each failed
    # load was reported to vLLM (its blocks given back).
    linked_at_failure: list[bool] = []
    settle = side._settle

    def settle_noting(load: Any) -> bool:
        ok = settle(load)
        if not ok:
            linked_at_failure.append(_linked(side, cluster_id_for("prefill", 0)))
        return ok

    side._settle = settle_noting  # type: ignore[method-assign]
    try:
        for command, value in _commands(conn):
            if command == "begin":  # the decode's step after vLLM allocated the requests' blocks
                loads = {req: LoadSpec(req, local, [], "prefill", "127.0.0.1", value["port"], "",
                                       first_token=first, transfer_id=transfer_id)
                         for req, local, first, transfer_id in value["specs"]}
                begun |= set(loads)
                side.start_loads(StepPlan(loads=loads))
                conn.send("ok")
            elif command == "wait":
                start = time.monotonic()
                done: set[str] = set()
                failed: set[str] = set()
                while done != begun and time.monotonic() - start < timeout_s + 20:
                    _, recving, fail = side.get_finished()
                    done |= recving
                    failed |= fail
                    time.sleep(0.005)
                begun = set()
                noted, linked_at_failure[:] = list(linked_at_failure), []
                conn.send({"done": sorted(done), "failed": sorted(failed), "elapsed": time.monotonic() - start,
                           "linked_at_failure": noted,
                           "records": [(r.nbytes, r.ok) for r in side.take_records()],
                           "arrays": {name: a.copy() for name, a in arrays.items()}})
            elif command == "arrays":
                conn.send({name: a.copy() for name, a in arrays.items()})
    finally:
        side.shutdown()


def _prefill(conn: Any, mode: str) -> None:
    arrays = prefill_arrays()
    side = WorkerSide(WorkerSettings(engine_id="prefill", is_consumer=False, load_timeout_s=5.0, transfer_mode=mode))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    conn.send(side.side_channel_port)
    assert side.pusher is not None
    directs = side.pusher.directs._directs
    try:
        for command, value in _commands(conn):
            if command == "forward":  # one step as vLLM orders it, each layer taking layer_s
                plan = StepPlan(saves={s.req_id: s for s in value["saves"]})
                # "compute": the step's blocks hold nothing before the
                # forward, and each layer's bytes only as it is saved.
                computing = sorted({b for s in value["saves"] for b in s.block_ids}) if value.get("compute") else []
                for array in arrays.values():
                    array[computing] = 0
                side.begin_step(plan)
                for name in NAMES:
                    time.sleep(value["layer_s"])
                    arrays[name][computing] = prefill_arrays()[name][computing]
                    side.save_layer(name)
                side.start_loads(plan)
                side.finish_step()
                conn.send(([(r.nbytes, r.ok) for r in side.take_records()], side.take_push_steps()))
            elif command == "expected":  # waits until the decode's expect for a transfer came
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and not (value in directs and directs[value].expected):
                    time.sleep(0.005)
                conn.send(value in directs and directs[value].expected)
            elif command == "finished":  # the requests finished: leased, their params announced
                side.start_loads(StepPlan(leases={req: time.monotonic() + 60 for req in value["tokens"]},
                                          lease_tokens=value["tokens"], announce=value["announce"]))
                conn.send("ok")
            elif command == "freed":
                conn.send(wait_freed(side, value))
    finally:
        side.shutdown()


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Any:
    ctx = multiprocessing.get_context("spawn")
    timeout_s, mode = getattr(request, "param", (4.0, "auto"))
    prefill, pconn, pport = _start(ctx, _prefill, mode)
    try:
        decode, dconn, _ = _start(ctx, _decode, timeout_s)
    except BaseException:
        _stop(prefill, pconn)
        raise
    try:
        yield {"decode": (decode, dconn), "prefill": (prefill, pconn), "pport": pport, "timeout_s": timeout_s}
    finally:
        _stop(decode, dconn)
        _stop(prefill, pconn)


def _begin(pair: Any, specs: list[Any]) -> None:
    assert _ask(pair["decode"][1], "begin", {"port": pair["pport"], "specs": specs}) == "ok"


def _wait(pair: Any) -> dict[str, Any]:
    return _ask(pair["decode"][1], "wait", None, timeout=60)


def _assert_blocks(arrays: dict[str, np.ndarray], local: list[int], remote: list[int]) -> None:
    source = prefill_arrays()
    for name, array in arrays.items():
        np.testing.assert_array_equal(array[local], source[name][remote])


def _assert_untouched(arrays: dict[str, np.ndarray], written: list[int]) -> None:
    for name, array in arrays.items():
        others = [block for block in range(array.shape[0]) if block not in written]
        assert not array[others].any(), f"{name}: a block nobody expected was written"


def _assert_a_late_push_lands_nowhere(pair: Any, written: list[int]) -> None:
    """The thawed prefill computes request a: its push fails, and no block
    of the decode but ``written`` holds a byte."""
    records, _steps = _ask(pair["prefill"][1], "forward", {
        "saves": [SaveSpec("p-a", [3, 9, 4], 0, 3, True, "x-a")], "layer_s": 0.01})
    assert all(not ok for _, ok in records), records
    time.sleep(0.5)
    _assert_untouched(_ask(pair["decode"][1], "arrays", None), written)


def test_each_layer_lands_in_the_decodes_blocks_as_the_forward_saves_it(pair: Any) -> None:
    """The decode expects the request before the prefill computes it: the
    step's push starts at the bind and writes into the decode's own blocks
    (no inbox, no second copy); landed follows the last layer."""
    pconn = pair["prefill"][1]
    _begin(pair, [("a", [5, 1, 7], 0, "x-a")])
    assert _ask(pconn, "expected", "x-a")
    records, steps = _ask(pconn, "forward", {"saves": [SaveSpec("p-a", [3, 9, 4], 0, 3, True, "x-a")],
                                             "layer_s": 0.1})
    assert [ok for _, ok in records] == [True]
    assert len(steps) == 1 and steps[0].overlapped and not steps[0].aborted, steps
    result = _wait(pair)
    assert result["done"] == ["a"] and result["failed"] == []
    _assert_blocks(result["arrays"], [5, 1, 7], [3, 9, 4])
    _assert_untouched(result["arrays"], [5, 1, 7])
    assert _ask(pconn, "finished", {"tokens": {"p-a": "t-a"}, "announce": {}}) == "ok"
    assert _ask(pconn, "freed", ["p-a"]) == ["p-a"], "the decode's done names the prefill's request"


def test_an_expect_that_comes_during_the_forward_joins_its_layers(pair: Any) -> None:
    """The prefill's forward starts before the decode's expect: the expect
    joins the step, its saved layers go at once and the rest as they are
    saved, still inside the forward."""
    pconn = pair["prefill"][1]
    answer: list[Any] = []
    waited: list[Any] = []
    forward = threading.Thread(target=lambda: answer.append(_ask(pconn, "forward", {
        "saves": [SaveSpec("p-a", [3, 9, 4], 0, 3, True, "x-a")], "layer_s": 0.4})))
    forward.start()
    waiter = threading.Thread(target=lambda: waited.append(_wait(pair)))
    try:
        time.sleep(0.5)  # layer 0 is saved, three more to come
        _begin(pair, [("a", [5, 1, 7], 0, "x-a")])
        waiter.start()  # the decode's blocks are read the moment the load is reported done
    finally:
        forward.join(timeout=60)
        if waiter.is_alive() or waiter.ident is not None:
            waiter.join(timeout=60)
    records, steps = answer[0]
    assert [ok for _, ok in records] == [True]
    assert len(steps) == 1 and steps[0].overlapped, steps
    result = waited[0]
    assert result["done"] == ["a"] and result["failed"] == []
    _assert_blocks(result["arrays"], [5, 1, 7], [3, 9, 4])


def test_chunks_prefix_hits_and_a_late_expect(pair: Any) -> None:
    """Request a: two chunks (the first's partial block goes again with the
    second); its decode found the first block in its own prefix cache, so
    only blocks 1 to 3 move. Request b: computed before its decode expects
    it; its blocks go whole once the expect comes."""
    pconn = pair["prefill"][1]
    _begin(pair, [("a", [11, 12, 13], BLOCK_SIZE, "x-a")])
    assert _ask(pconn, "expected", "x-a")
    _ask(pconn, "forward", {"saves": [SaveSpec("p-a", [2, 6, 8], 0, 4, False, "x-a"),
                                      SaveSpec("p-b", [14, 15], 0, 2, True, "x-b")], "layer_s": 0.02})
    _ask(pconn, "forward", {"saves": [SaveSpec("p-a", [8, 10], 2, 4, True, "x-a")], "layer_s": 0.02})
    first = _wait(pair)
    assert first["done"] == ["a"] and first["failed"] == []
    _assert_blocks(first["arrays"], [11, 12, 13], [6, 8, 10])
    _assert_untouched(first["arrays"], [11, 12, 13])
    _begin(pair, [("b", [20, 21], 0, "x-b")])  # the late expect
    second = _wait(pair)
    assert second["done"] == ["b"] and second["failed"] == []
    _assert_blocks(second["arrays"], [20, 21], [14, 15])
    _assert_untouched(second["arrays"], [11, 12, 13, 20, 21])


@pytest.mark.parametrize("pair, first", [((4.0, "auto"), BLOCK_SIZE + 3), ((4.0, "pull"), BLOCK_SIZE)],
                         indirect=["pair"], ids=["prefix-inside-a-block", "prefill-mode-pull"])
def test_where_it_cannot_push_the_prefill_says_pull(pair: Any, first: int) -> None:
    """A decode whose cached prefix ends inside a block cannot take whole
    blocks, and a prefill in transfer mode "pull" pushes nothing: the
    prefill names its blocks once its request finished, and the decode pulls
    them under the request's lease."""
    pconn = pair["prefill"][1]
    _begin(pair, [("a", [1, 2], first, "x-a")])
    assert _ask(pconn, "expected", "x-a")
    records, _steps = _ask(pconn, "forward", {"saves": [SaveSpec("p-a", [3, 9, 4], 0, 3, True, "x-a", "t-a")],
                                              "layer_s": 0.01})
    assert records == [], "nothing was pushed"
    # The prompt's blocks and the token its lease will have came with its
    # step: the decode pulls before the prefill's next step (an idle engine
    # steps again only with new work), and its claim holds the blocks.
    result = _wait(pair)
    assert _ask(pconn, "finished", {"tokens": {"p-a": "t-a"}, "announce": {}}) == "ok"
    assert result["done"] == ["a"] and result["failed"] == []
    source = prefill_arrays()
    skip = first - BLOCK_SIZE
    for name, array in result["arrays"].items():
        # The tokens after the first `first`: block 1 from token `skip` of the prefill's block 1 on.
        flat = source[name][[9, 4]].transpose(1, 0, 2, 3).reshape(SHAPE[1], -1, SHAPE[3])
        got = array[[1, 2]].transpose(1, 0, 2, 3).reshape(SHAPE[1], -1, SHAPE[3])
        np.testing.assert_array_equal(got[:, skip:], flat[:, skip:])
    assert _ask(pconn, "freed", ["p-a"]) == ["p-a"]


@pytest.mark.parametrize("pair", [(4.0, "pull")], indirect=True)
def test_a_decode_told_to_pull_during_the_forward_reads_the_computed_blocks(pair: Any) -> None:
    """The expect comes while the prefill computes the request's last step
    (where it cannot push): the decode is told to pull only once the forward
    is over, so it reads every layer as computed, never the blocks as they
    were before."""
    pconn = pair["prefill"][1]
    answer: list[Any] = []
    forward = threading.Thread(target=lambda: answer.append(_ask(pconn, "forward", {
        "saves": [SaveSpec("p-a", [3, 9, 4], 0, 3, True, "x-a", "t-a")], "layer_s": 0.4, "compute": True})))
    forward.start()
    try:
        time.sleep(0.5)  # layer 0 is computed, three more to come
        _begin(pair, [("a", [5, 1, 7], 0, "x-a")])
        result = _wait(pair)
    finally:
        forward.join(timeout=60)
    assert answer and answer[0][0] == [], "nothing was pushed"
    assert _ask(pconn, "finished", {"tokens": {"p-a": "t-a"}, "announce": {}}) == "ok"
    assert result["done"] == ["a"] and result["failed"] == []
    _assert_blocks(result["arrays"], [5, 1, 7], [3, 9, 4])
    assert _ask(pconn, "freed", ["p-a"]) == ["p-a"]


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
@pytest.mark.parametrize("pair", [(2.0, "auto")], indirect=True)
def test_a_frozen_prefill_never_writes_after_the_decode_gave_up(pair: Any) -> None:
    """The prefill freezes after taking the expect. At its deadline the
    decode asks it to stop, gets no answer, drops its link and fails the
    load. Thawed, the prefill computes the request: none of it lands."""
    prefill, pconn = pair["prefill"]
    _begin(pair, [("a", [1, 2, 3], 0, "x-a")])
    assert _ask(pconn, "expected", "x-a")
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        result = _wait(pair)
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    assert result["done"] == ["a"] and result["failed"] == ["a"]
    assert result["linked_at_failure"] == [False], "the link was dropped before the load was reported failed"
    assert result["elapsed"] < 2.0 + 1.0 + 0.5 + 3, f"the load took {result['elapsed']:.1f} s to fail"
    _assert_a_late_push_lands_nowhere(pair, [])


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
@pytest.mark.parametrize("pair", [(3.0, "auto")], indirect=True)
def test_a_prefill_frozen_before_the_expect_never_writes_after_the_decode_gave_up(pair: Any) -> None:
    """The expect reaches a frozen prefill and is not answered: the decode
    drops the link before it fails the load. Thawed, the prefill reads the
    stale expect and computes the request: none of it lands."""
    prefill, pconn = pair["prefill"]
    # A first request links the pair, so the second's expect goes out at once.
    _begin(pair, [("w", [7], 0, "x-w")])
    assert _ask(pconn, "expected", "x-w")
    _ask(pconn, "forward", {"saves": [SaveSpec("p-w", [12], 0, 1, True, "x-w")], "layer_s": 0.01})
    assert _wait(pair)["failed"] == []
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        _begin(pair, [("a", [1, 2, 3], 0, "x-a")])
        result = _wait(pair)
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    assert result["done"] == ["a"] and result["failed"] == ["a"]
    assert result["linked_at_failure"] == [False], "the link was dropped before the load was reported failed"
    # Bounded by the load's timeout, the cancel's and the grace after the link dropped.
    assert result["elapsed"] < 3.0 + 1.0 + 0.5 + 2, f"the load took {result['elapsed']:.1f} s to fail"
    assert _ask(pconn, "expected", "x-a"), "the thawed prefill took the stale expect"
    _assert_a_late_push_lands_nowhere(pair, [7])


@pytest.mark.parametrize("pair", [(1.5, "auto")], indirect=True)
def test_a_slow_prefill_is_stopped_before_the_decode_gives_its_blocks_back(pair: Any) -> None:
    """The prefill has not computed the request by the decode's deadline: the
    decode's cancel is answered, the load fails, and the prefill, computing
    it afterwards, pushes none of it."""
    pconn = pair["prefill"][1]
    _begin(pair, [("a", [1, 2, 3], 0, "x-a")])
    assert _ask(pconn, "expected", "x-a")
    result = _wait(pair)
    assert result["done"] == ["a"] and result["failed"] == ["a"]
    assert result["elapsed"] < 1.5 + 3
    records, _steps = _ask(pconn, "forward", {"saves": [SaveSpec("p-a", [3, 9, 4], 0, 3, True, "x-a")],
                                              "layer_s": 0.01})
    assert records == [], "a cancelled request is not pushed"
    _assert_untouched(_ask(pair["decode"][1], "arrays", None), [])


def test_a_decode_that_died_mid_push_frees_the_prefills_request(pair: Any) -> None:
    """The decode dies after its expect: the push fails on the dropped link,
    the prefill cannot tell the decode to pull, and frees the request's
    blocks at once instead of at the end of its lease."""
    decode = pair["decode"][0]
    pconn = pair["prefill"][1]
    _begin(pair, [("a", [1, 2, 3], 0, "x-a")])
    assert _ask(pconn, "expected", "x-a")
    decode.kill()
    decode.join(timeout=10)
    records, _steps = _ask(pconn, "forward", {"saves": [SaveSpec("p-a", [3, 9, 4], 0, 3, True, "x-a")],
                                              "layer_s": 0.05})
    assert all(not ok for _, ok in records), records
    params = {"do_remote_prefill": True, "remote_block_ids": [3, 9, 4], "lease_token": "t-a",
              "remote_engine_id": "prefill", "remote_host": "127.0.0.1", "remote_port": pair["pport"],
              "remote_request_id": "p-a", "tp_size": 1}
    started = time.monotonic()
    assert _ask(pconn, "finished", {"tokens": {"p-a": "t-a"}, "announce": {"x-a": params}}) == "ok"
    assert _ask(pconn, "freed", ["p-a"]) == ["p-a"], "the lease (60 s) was not what freed it"
    assert time.monotonic() - started < 10

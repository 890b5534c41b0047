"""The vLLM connector's worker side between two processes, without vLLM.

Each process holds one ``WorkerSide`` over numpy arrays shaped like the KV
tensors of vLLM's CPU backend (``[num_blocks, kv_heads, block_size,
2 * head_dim]`` per layer). The decode side reads a request's blocks from
the prefill side through the library and the test compares every byte; the
prefill side frees blocks on the decode side's confirmation or its lease.
Failures (no prefill, a frozen prefill) must settle within the load timeout
and name the blocks that did not load.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import socket
import time
from typing import Any, Optional

import numpy as np
import pytest

from datadist_aio.integrations.vllm.metadata import LoadSpec, StepPlan
from datadist_aio.integrations.vllm.side_channel import SideChannelPortError
from datadist_aio.integrations.vllm.worker import WorkerSettings, WorkerSide, describe_kv_caches

# Spawning starts multiprocessing's resource tracker once per process and keeps
# a descriptor to it; starting it now keeps it out of the per-test fd check.
multiprocessing.resource_tracker.ensure_running()

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 3, 24, 2, 32, 64
SHAPE = (BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)


class FakeTensor:
    """The few tensor attributes the connector reads, over a numpy array."""

    device = None
    dtype = "torch.float32"

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape = array.shape

    def is_contiguous(self) -> bool:
        return bool(self.array.flags["C_CONTIGUOUS"])

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def __getitem__(self, index: int) -> "FakeTensor":
        return FakeTensor(self.array[index])


def layer_arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"model.layers.{i}.self_attn.attn": rng.standard_normal(SHAPE).astype(np.float32) for i in range(LAYERS)}


def _prefill(conn: Any, lease_s: float) -> None:
    arrays = layer_arrays(1)
    side = WorkerSide(WorkerSettings(engine_id="prefill", is_consumer=False, load_timeout_s=5.0))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    conn.send(side.side_channel_port)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if conn.poll(0.05):
                command, value = conn.recv()
                if command == "lease":
                    # Request ids, or (request id, lease token[, lease seconds]).
                    items = [item if isinstance(item, tuple) else (item, "") for item in value]
                    now = time.monotonic()
                    side.start_loads(StepPlan(
                        leases={item[0]: now + (item[2] if len(item) > 2 else lease_s) for item in items},
                        lease_tokens={item[0]: item[1] for item in items}))
                    conn.send("ok")
                elif command == "stop":
                    break
            freed, _, _ = side.get_finished()
            if freed:
                conn.send(("freed", sorted(freed)))
    finally:
        side.shutdown()


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _decode(conn: Any, port: int, specs: list[tuple[Any, ...]], timeout_s: float,
            shape: tuple[int, ...] = SHAPE, engine: str = "prefill", first_contact_ms: Optional[float] = None,
            access: str = "", transport: str = "") -> None:
    warnings = _Warnings()
    logging.getLogger("datadist_aio.integrations.vllm.worker").addHandler(warnings)
    # The first contacts vLLM's thread gave up on (logged at debug).
    given_up = _Warnings()
    given_up.setLevel(logging.DEBUG)
    routes_log = logging.getLogger("datadist_aio.integrations.vllm.routes")
    routes_log.setLevel(logging.DEBUG)
    routes_log.addHandler(given_up)
    arrays = {name: np.zeros(shape, np.float32) for name in layer_arrays(0)}
    extra = {} if first_contact_ms is None else {"first_contact_ms": first_contact_ms}
    side = WorkerSide(WorkerSettings(engine_id="decode", is_producer=False, load_timeout_s=timeout_s, access=access,
                                     transport=transport, **extra))
    side.register({name: FakeTensor(a) for name, a in arrays.items()})
    # (request, local blocks, remote blocks[, lease token])
    loads = {
        req: LoadSpec(req, local, remote, engine, "127.0.0.1", port, "p-" + req, lease_token=token[0] if token else "")
        for req, local, remote, *token in specs
    }
    start = time.monotonic()
    side.start_loads(StepPlan(loads=loads))
    start_s = time.monotonic() - start
    # Whether the route to the prefill was made by start_loads itself (its
    # first contact on this thread), not left to the loop thread.
    assert side._router is not None
    routed_in_start = bool(side._router.routes)
    done: set[str] = set()
    failed: set[str] = set()
    errors: set[int] = set()
    expected = {req for req, spec in loads.items() if spec.local_block_ids}
    while done != expected and time.monotonic() - start < timeout_s + 20:
        _, recving, fail = side.get_finished()
        done |= recving
        failed |= fail
        errors |= side.load_errors()
        time.sleep(0.01)
    elapsed = time.monotonic() - start
    records = side.take_records()
    answers = side.take_answer_counts()
    # The path each route's links took (link_transport).
    assert side._router is not None and side._datadist is not None
    transports = sorted({side._datadist.link_transport(source.cluster_id)
                         for route in side._router.routes.values() for source in route.sources})
    side.shutdown()  # after the release notices already sent went out
    conn.send(
        {
            "done": sorted(done),
            "failed": sorted(failed),
            "errors": sorted(errors),
            "elapsed": elapsed,
            "start_s": start_s,
            "routed_in_start": routed_in_start,
            "records": [(r.nbytes, r.blocks, r.ok) for r in records],
            "answers": answers,
            "transports": transports,
            "arrays": {name: a for name, a in arrays.items()},
            "warnings": warnings.messages,
            "contacts_given_up": len([m for m in given_up.messages if "left to the loop thread" in m]),
        }
    )


@pytest.fixture
def ctx() -> Any:
    return multiprocessing.get_context("spawn")


def _start_prefill(ctx: Any, lease_s: float = 60.0) -> tuple[Any, Any, int]:
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_prefill, args=(child, lease_s), daemon=True)
    process.start()
    child.close()
    assert parent.poll(60), "the prefill process did not start"
    return process, parent, parent.recv()


def _run_decode(ctx: Any, port: int, specs: list[Any], timeout_s: float = 5.0,
                shape: tuple[int, ...] = SHAPE, engine: str = "prefill",
                first_contact_ms: Optional[float] = None, access: str = "", transport: str = "") -> dict[str, Any]:
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_decode,
                          args=(child, port, specs, timeout_s, shape, engine, first_contact_ms, access, transport),
                          daemon=True)
    process.start()
    child.close()
    try:
        assert parent.poll(timeout_s + 60), "the decode process did not answer"
        result = parent.recv()
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
        parent.close()
    return result


def _stop(process: Any, conn: Any) -> None:
    try:
        conn.send(("stop", None))
    except OSError:
        pass
    process.join(timeout=15)
    if process.is_alive():
        process.kill()
        process.join()
    process.close()
    conn.close()


def test_describe_groups_layers_and_splits_kv_pairs() -> None:
    fused = {f"l{i}": FakeTensor(np.zeros(SHAPE, np.float32)) for i in range(2)}
    (group,) = describe_kv_caches(fused, BLOCKS)
    assert (group.per_layer, len(group.addresses), group.block_shape) == (1, 2, [HEADS, BLOCK_SIZE, 2 * HEAD_DIM])
    assert group.block_bytes == 2 * HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 4
    latent = {f"l{i}": FakeTensor(np.zeros((BLOCKS, 16, 576), np.float32)) for i in range(2)}  # MLA
    (group,) = describe_kv_caches(latent, BLOCKS)
    assert (group.per_layer, len(group.addresses), group.block_shape) == (1, 2, [16, 576])
    split = {"l0": FakeTensor(np.zeros((2, BLOCKS, 4, 8), np.float32))}
    (group,) = describe_kv_caches(split, BLOCKS)
    assert group.per_layer == 2 and group.block_shape == [4, 8]
    shared = np.zeros(SHAPE, np.float32)
    assert len(describe_kv_caches({"a": FakeTensor(shared), "b": FakeTensor(shared)}, BLOCKS)[0].addresses) == 1
    with pytest.raises(ValueError, match="block dimension"):
        describe_kv_caches({"l0": FakeTensor(np.zeros((5, 7), np.float32))}, BLOCKS)


@pytest.mark.parametrize("transport", ["", "tcp"])
def test_decode_reads_exact_blocks_and_releases_the_prefill(ctx: Any, transport: str) -> None:
    prefill, conn, port = _start_prefill(ctx)
    try:
        conn.send(("lease", ["p-a", "p-b", "p-c"]))
        assert conn.poll(10) and conn.recv() == "ok"
        # "c" has nothing to read (a local prefix hit): it only releases the prefill.
        specs = [("a", [5, 6, 7], [0, 1, 2]), ("b", [10, 12], [20, 3]), ("c", [], [])]
        # Owner-served, so that each pull is answered (one-sided pulls have no answer to count).
        result = _run_decode(ctx, port, specs, access="owner", transport=transport)
        # The setting's transport: the same-host path by default, sockets with "tcp".
        assert result["transports"] == [transport or "same_host"], result["transports"]
        assert result["done"] == ["a", "b"]
        assert result["failed"] == [] and result["errors"] == []
        block_bytes = LAYERS * HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 4
        assert sorted(result["records"]) == [(2 * block_bytes, 2, True), (3 * block_bytes, 3, True)]
        read, by_sweep = result["answers"]
        if not transport:  # answers on the same-host link's answer socket, counted as read
            assert read >= 2 and 0 <= by_sweep <= read, "the answers of both pulls were counted"
        source = layer_arrays(1)
        for name, array in result["arrays"].items():
            for _req, local, remote in specs:
                np.testing.assert_array_equal(array[local], source[name][remote])
            untouched = [b for b in range(BLOCKS) if b not in (5, 6, 7, 10, 12)]
            assert not array[untouched].any(), "a block nobody asked for was written"
        freed: list[str] = []
        deadline = time.monotonic() + 10
        while sorted(freed) != ["p-a", "p-b", "p-c"] and time.monotonic() < deadline:
            if conn.poll(0.1):
                message = conn.recv()
                freed += message[1]
        assert sorted(freed) == ["p-a", "p-b", "p-c"], "the decode side's confirmations did not free the blocks"
    finally:
        _stop(prefill, conn)


@pytest.mark.parametrize("first_contact_ms", [60_000.0, 0.0, 1e-6])
def test_first_contact_on_the_loading_thread_or_the_loop_thread(ctx: Any, first_contact_ms: float) -> None:
    """With a budget it can keep, the thread that starts the load makes the
    first contact itself and the pulls start before start_loads returns;
    with none (0), or one spent before the first hello (1e-6 ms), the loop
    thread makes it; the bytes are the same."""
    prefill, conn, port = _start_prefill(ctx)
    try:
        conn.send(("lease", ["p-a"]))
        assert conn.poll(10) and conn.recv() == "ok"
        result = _run_decode(ctx, port, [("a", [5, 6, 7], [0, 1, 2])], first_contact_ms=first_contact_ms)
        assert result["done"] == ["a"] and result["failed"] == [] and result["errors"] == []
        assert result["routed_in_start"] is (first_contact_ms > 1)
        source = layer_arrays(1)
        for name, array in result["arrays"].items():
            np.testing.assert_array_equal(array[[5, 6, 7]], source[name][[0, 1, 2]])
        assert _freed(conn, {"p-a"}) == {"p-a"}, "the decode side's confirmation did not free the blocks"
    finally:
        _stop(prefill, conn)


def test_lease_frees_blocks_nobody_reads(ctx: Any) -> None:
    prefill, conn, _port = _start_prefill(ctx, lease_s=0.5)
    try:
        conn.send(("lease", ["p-x"]))
        assert conn.poll(10) and conn.recv() == "ok"
        assert conn.poll(10)
        assert conn.recv() == ("freed", ["p-x"])
    finally:
        _stop(prefill, conn)


def test_no_prefill_fails_the_load_with_its_blocks(ctx: Any) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = _run_decode(ctx, port, [("a", [1, 2], [3, 4])], timeout_s=3.0)
    assert result["done"] == ["a"] and result["failed"] == ["a"]
    assert result["errors"] == [1, 2]
    assert result["records"] == [(0, 2, False)]
    assert result["elapsed"] < 3.0 + 2


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
@pytest.mark.parametrize("linked_before", [False, True])
def test_frozen_prefill_fails_within_the_timeout(ctx: Any, linked_before: bool) -> None:
    prefill, conn, port = _start_prefill(ctx)
    try:
        if linked_before:
            conn.send(("lease", ["p-warm"]))
            assert conn.poll(10) and conn.recv() == "ok"
            result = _run_decode(ctx, port, [("warm", [0], [0])], timeout_s=3.0)
            assert result["failed"] == []
        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            specs = [("a", [1, 2, 3], [4, 5, 6]), ("b", [7], [8])]
            result = _run_decode(ctx, port, specs, timeout_s=2.0, first_contact_ms=200)
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
        assert result["done"] == ["a", "b"] and result["failed"] == ["a", "b"]
        assert result["errors"] == [1, 2, 3, 7]
        assert result["elapsed"] < 2.0 + 3, f"the load took {result['elapsed']:.1f} s to fail"
        # The first contact on vLLM's thread gave up at its budget, once for
        # the step's two loads: the step was not held for the load's timeout.
        assert not result["routed_in_start"]
        assert result["contacts_given_up"] == 1
        assert result["start_s"] < 2.0, f"start_loads took {result['start_s']:.1f} s"
    finally:
        _stop(prefill, conn)


def _freed(conn: Any, wanted: set[str], timeout: float = 15.0) -> set[str]:
    """The prefill's requests freed until ``wanted`` all were, or the timeout."""
    freed: set[str] = set()
    deadline = time.monotonic() + timeout
    while not wanted <= freed and time.monotonic() < deadline:
        if conn.poll(0.1):
            kind, reqs = conn.recv()
            assert kind == "freed"
            freed.update(reqs)
    return freed


def test_a_read_after_the_lease_ran_out_fails_and_names_why(ctx: Any) -> None:
    """The prefill freed the request's blocks when its lease ran out (vLLM may
    give them to another request): the decode's read of them must never be
    taken for the request's KV. Its claim is refused, the load fails with its
    blocks, and the prefill's other leased request still loads."""
    prefill, conn, port = _start_prefill(ctx, lease_s=0.5)
    try:
        conn.send(("lease", [("p-old", "t-old")]))
        assert conn.poll(10) and conn.recv() == "ok"
        assert _freed(conn, {"p-old"}) == {"p-old"}, "the lease did not run out"
        conn.send(("lease", [("p-new", "t-new", 60.0)]))
        assert conn.poll(10) and conn.recv() == "ok"
        specs = [("old", [1, 2], [3, 4], "t-old"), ("new", [5], [6], "t-new")]
        # A load timeout longer than the test waits: the refusal, not the timeout, settles the load.
        result = _run_decode(ctx, port, specs, timeout_s=60.0)
        assert result["done"] == ["new", "old"]
        assert result["failed"] == ["old"] and result["errors"] == [1, 2]
        (warning,) = [w for w in result["warnings"] if "load of old" in w]
        assert "no longer holds the blocks of request p-old" in warning, warning
        assert sorted(result["records"]) == [(0, 2, False), (LAYERS * HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 4, 1, True)]
        source = layer_arrays(1)
        for name, array in result["arrays"].items():
            np.testing.assert_array_equal(array[5], source[name][6])
    finally:
        _stop(prefill, conn)


def test_a_read_naming_another_lease_token_fails(ctx: Any) -> None:
    """Same request id, another token (a restarted prefill, another request
    that reused the id): refused; the right token loads."""
    prefill, conn, port = _start_prefill(ctx)
    try:
        conn.send(("lease", [("p-a", "right"), ("p-b", "right-b")]))
        assert conn.poll(10) and conn.recv() == "ok"
        result = _run_decode(ctx, port, [("a", [1], [2], "wrong"), ("b", [3], [4], "right-b")], timeout_s=5.0)
        assert result["failed"] == ["a"] and result["errors"] == [1]
        assert result["done"] == ["a", "b"]
        # The right token, but the request of another prefill instance (one
        # that ran at this address before): nothing of it is held here.
        result = _run_decode(ctx, port, [("b", [3], [4], "right-b")], timeout_s=5.0, engine="before-restart")
        assert result["failed"] == ["b"] and result["errors"] == [3]
    finally:
        _stop(prefill, conn)


def test_a_claim_before_its_lease_is_granted_and_the_lease_still_frees(ctx: Any) -> None:
    """The prefill's worker learns a lease with vLLM's next step, which may
    come after the decode side read (an idle engine steps only with new
    work): blocks it has not heard of are still held, so the read counts; the
    decode's done, come first, frees the request once its lease comes."""
    prefill, conn, port = _start_prefill(ctx)
    try:
        result = _run_decode(ctx, port, [("late", [1, 2], [7, 8], "t")], timeout_s=5.0)
        assert result["done"] == ["late"] and result["failed"] == [], result["warnings"]
        source = layer_arrays(1)
        for name, array in result["arrays"].items():
            np.testing.assert_array_equal(array[[1, 2]], source[name][[7, 8]])
        conn.send(("lease", [("p-late", "t")]))
        assert conn.poll(10) and conn.recv() == "ok"
        assert _freed(conn, {"p-late"}) == {"p-late"}
    finally:
        _stop(prefill, conn)


@pytest.mark.parametrize("listens", ["producer", "inbox"])
def test_side_channel_port_taken_names_the_address_and_the_settings(listens: str) -> None:
    """A prefill side (or a decode side lending an inbox) whose side-channel
    port is taken fails registration with an error that says where and why,
    and leaves no engine, loop or thread behind."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if listens == "producer":
            settings = WorkerSettings(engine_id="clash", rank=0, is_consumer=False, side_channel_port=port)
        else:
            settings = WorkerSettings(engine_id="clash", rank=0, is_producer=False, side_channel_port=port,
                                      transfer_mode="push_layerwise", inbox_blocks=8, inbox_share_blocks=4)
        side = WorkerSide(settings)
        arrays = layer_arrays(0)
        with pytest.raises(SideChannelPortError) as raised:
            side.register({name: FakeTensor(a) for name, a in arrays.items()})
    error = raised.value
    assert isinstance(error, OSError) and error.errno == errno.EADDRINUSE
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.EADDRINUSE
    message = str(error)
    for part in (f"127.0.0.1:{port}", 'kv_connector_extra_config["side_channel_port"]', "kv_transfer_config.kv_port",
                 "TP rank"):
        assert part in message, message
    assert side._loop is None and side._thread is not None and not side._thread.is_alive()
    assert side.take_answer_counts() == (0, 0)


class _Pull:
    """A pull's CacheTask as get_finished sees it: done or not, then successful."""

    def __init__(self) -> None:
        self.finished = False
        self.completed_at: Optional[float] = None  # as the engine stamps a CacheTask

    def done(self) -> bool:
        return self.finished

    def get_results(self, timeout: int = 0) -> list[Any]:
        import datadist_aio as dd

        return [dd.LLMStatusCode.LLM_SUCCESS]

    def cancel(self) -> bool:
        return False


def _held_side(wait_ms: float) -> tuple[WorkerSide, Any]:
    """A decode WorkerSide with no engine: loads are put in flight by hand."""
    import asyncio

    side = WorkerSide(WorkerSettings(engine_id="decode", is_producer=False, load_batch_wait_ms=wait_ms))
    side._loop = loop = asyncio.new_event_loop()  # not running: the releases only queue on it
    return side, loop


def _in_flight(side: WorkerSide, req: str, step: int, error: str = "", start: Optional[float] = None) -> _Pull:
    from datadist_aio.integrations.vllm.loads import Load

    pull = _Pull()
    spec = LoadSpec(req, [1], [2], "prefill", "127.0.0.1", 1, "p-" + req)
    now = time.perf_counter() if start is None else start
    # A load refused before it started has no task, only its error.
    side._inflight.append(Load(spec, now, now + 60, tasks=[] if error else [pull], error=error, step=step))
    return pull


def test_loads_of_one_step_reach_vllm_together() -> None:
    side, loop = _held_side(wait_ms=10_000)
    try:
        a, b = _in_flight(side, "a", 1), _in_flight(side, "b", 1)
        other = _in_flight(side, "c", 2)
        a.finished = other.finished = True
        # "a" waits for "b" of its step; "c", alone in its step, goes at once.
        assert side.get_finished()[1] == {"c"}
        assert side.get_finished()[1] == set()
        b.finished = True
        assert side.get_finished()[1] == {"a", "b"}
        assert side.get_finished()[1] == set()
        assert [record.ok for record in side.take_records()] == [True, True, True]
    finally:
        loop.close()


def test_a_held_load_goes_when_the_wait_is_over() -> None:
    side, loop = _held_side(wait_ms=50)
    try:
        start = time.perf_counter() - 1.0  # begun a second ago...
        a, _b = _in_flight(side, "a", 1, start=start), _in_flight(side, "b", 1)
        _in_flight(side, "f", 1, error="link: refused")
        a.finished = True
        side._inflight[0].posted = start + 0.1  # its reads posted 0.1 s after it began (a first contact)...
        a.completed_at = start + 0.25  # ...and completed by the engine 0.15 s after that
        # A failed load is never held; a finished one only up to the wait.
        first_look = time.perf_counter()
        assert side.get_finished()[1:] == ({"f"}, {"f"})
        looked = time.perf_counter()
        assert side.get_finished()[1] == set()
        time.sleep(0.06)
        assert side.get_finished()[1] == {"a"}
        # Its transfer ran from posting its reads until the engine completed
        # them (NIXL's span), the contact before it is its setup; vLLM first
        # saw it done at the first look, not when the hold let it go.
        (record,) = [r for r in side.take_records() if r.ok]
        assert record.seconds == pytest.approx(0.15, abs=1e-9), record
        assert record.setup_seconds == pytest.approx(0.1, abs=1e-9), record
        assert first_look - start <= record.seen_seconds <= looked - start, record
    finally:
        loop.close()


def test_no_wait_reports_each_load_as_it_finishes() -> None:
    side, loop = _held_side(wait_ms=0)
    try:
        a, _b = _in_flight(side, "a", 1), _in_flight(side, "b", 1)
        a.finished = True
        assert side.get_finished()[1] == {"a"}
    finally:
        loop.close()


def test_decode_with_twice_the_block_size_reads_tokens_into_place(ctx: Any) -> None:
    """Prefill blocks of 32 tokens into decode blocks of 64: decode block k
    holds, per head, the tokens of prefill blocks 2k and 2k + 1."""
    prefill, conn, port = _start_prefill(ctx)
    try:
        conn.send(("lease", ["p-a"]))
        assert conn.poll(10) and conn.recv() == "ok"
        wide = (BLOCKS, HEADS, 2 * BLOCK_SIZE, 2 * HEAD_DIM)
        remote, local = [4, 9, 2, 17, 11], [6, 1, 3]  # 5 prefill blocks (160 tokens) into 3 of 64
        result = _run_decode(ctx, port, [("a", local, remote)], shape=wide)
        assert result["done"] == ["a"] and result["failed"] == [] and result["warnings"] == []
        source = layer_arrays(1)
        for name, array in result["arrays"].items():
            for k, block in enumerate(local):
                halves = [remote[i] for i in (2 * k, 2 * k + 1) if i < len(remote)]
                expected = np.concatenate([source[name][b] for b in halves], axis=1)
                np.testing.assert_array_equal(array[block][:, : expected.shape[1]], expected)
            assert not array[[b for b in range(BLOCKS) if b not in local]].any()
    finally:
        _stop(prefill, conn)


def test_a_layout_that_cannot_map_fails_the_load_at_once_and_names_both(ctx: Any) -> None:
    prefill, conn, port = _start_prefill(ctx)
    try:
        conn.send(("lease", ["p-a"]))
        assert conn.poll(10) and conn.recv() == "ok"
        odd = (BLOCKS, HEADS, 48, 2 * HEAD_DIM)  # 48-token blocks: 32 does not divide them
        # A load timeout longer than the test waits: the refusal, not the timeout, settles the load.
        result = _run_decode(ctx, port, [("a", [1, 2], [3, 4])], timeout_s=60.0, shape=odd)
        assert result["done"] == ["a"] and result["failed"] == ["a"] and result["errors"] == [1, 2]
        assert result["records"] == [(0, 2, False)]
        (warning,) = [w for w in result["warnings"] if "load of a" in w]
        assert "no answer within" not in warning, warning
        assert "127.0.0.1:%d" % port in warning
        assert "block size 32" in warning and "block size 48" in warning and "neither divides" in warning
        assert not any(a.any() for a in result["arrays"].values())
    finally:
        _stop(prefill, conn)

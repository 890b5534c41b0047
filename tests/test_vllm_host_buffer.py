"""Host-buffer mode (device KV blocks staged through registered host memory), on CPU.

There is no GPU here: torch tensors on the ``cpu`` device play vLLM's device
tensors, and the block-copy function has the signature vLLM hands to
``set_host_xfer_buffer_ops`` (``copy_kv_blocks``) with the CUDA platform's
index copies inside. What is checked is the connector's logic: which blocks
are copied when, into which host blocks, and back on the decode side.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.resource_tracker
import time
from typing import Any

import pytest

pytestmark = pytest.mark.vllm_venv

torch = pytest.importorskip("torch")

from datadist_aio.integrations.vllm.host_buffer import HostBuffer, needs_host_buffer  # noqa: E402
from datadist_aio.integrations.vllm.metadata import LoadSpec, SaveSpec, StepPlan  # noqa: E402
from datadist_aio.integrations.vllm.worker import WorkerSettings, WorkerSide  # noqa: E402

multiprocessing.resource_tracker.ensure_running()

LAYERS, BLOCKS = 4, 16
SHAPE = (BLOCKS, 2, 32, 128)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def copy_kv_blocks(src: dict[str, Any], dst: dict[str, Any], src_ids: list[int], dst_ids: list[int],
                   direction: str) -> None:
    """vLLM's copy op, as its CUDA platform runs it (index copies, layer by layer)."""
    assert direction in ("h2d", "d2h")
    for name in src:
        dst[name][torch.tensor(dst_ids)] = src[name][torch.tensor(src_ids)].to(dst[name].device)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[int], str]] = []

    def __call__(self, src: dict[str, Any], dst: dict[str, Any], src_ids: list[int], dst_ids: list[int],
                 direction: str) -> None:
        assert src_ids == dst_ids, "a block keeps its id in the host buffer"
        self.calls.append((sorted(src), list(src_ids), direction))
        copy_kv_blocks(src, dst, src_ids, dst_ids, direction)


class OnDevice:
    """A tensor that says it lives on a GPU (only ``device`` is read)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def device_tensors(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(SHAPE, generator=generator) for name in NAMES}


def test_host_buffer_only_for_device_tensors_and_only_to_the_cpu() -> None:
    assert not needs_host_buffer(device_tensors(0), "cpu")
    assert needs_host_buffer({"l0": OnDevice("cuda:0")}, "cpu")
    assert not needs_host_buffer({"l0": OnDevice("cuda:0")}, "cuda"), "CUDA tensors are registered in place"
    with pytest.raises(ValueError, match="kv_buffer_device='cpu'"):
        needs_host_buffer({"l0": OnDevice("xpu:0")}, "cuda")


def test_saves_copy_each_layer_out_as_it_is_saved_then_the_rest() -> None:
    device = device_tensors(1)
    buffer = HostBuffer(device)
    recorder = Recorder()
    buffer.copy = recorder
    buffer.begin_step([5, 2])
    buffer.save_layer(NAMES[0])
    buffer.save_layer(NAMES[0])  # once per layer and step
    assert recorder.calls == [([NAMES[0]], [5, 2], "d2h")]
    buffer.finish_step()
    assert recorder.calls[1] == (sorted(NAMES[1:]), [5, 2], "d2h")
    for name in NAMES:
        assert torch.equal(buffer.host[name][[5, 2]], device[name][[5, 2]])
    buffer.finish_step()  # a step that saved nothing copies nothing
    buffer.save_layer(NAMES[1])
    assert len(recorder.calls) == 2
    # Loaded blocks as a transfer leaves them in the host buffer (set here:
    # the buffer's other rows are uninitialised memory, which may hold NaNs).
    for i, name in enumerate(NAMES):
        buffer.host[name][[3, 7]] = torch.full_like(buffer.host[name][[3, 7]], float(i + 1))
    buffer.load([3, 7])
    assert recorder.calls[2] == (sorted(NAMES), [3, 7], "h2d")
    for i, name in enumerate(NAMES):
        assert torch.equal(device[name][[3, 7]], torch.full_like(device[name][[3, 7]], float(i + 1)))


def test_a_copy_without_vllms_op_says_what_is_missing() -> None:
    buffer = HostBuffer(device_tensors(0))
    buffer.begin_step([1])
    with pytest.raises(RuntimeError, match="set_host_xfer_buffer_ops"):
        buffer.save_layer(NAMES[0])


# -- two processes: the worker sides in host-buffer mode ---------------------------


def _decode(conn: Any, mode: str) -> None:
    device = {name: torch.zeros(SHAPE) for name in NAMES}
    side = WorkerSide(WorkerSettings(engine_id="decode", is_producer=False, transfer_mode=mode,
                                     host_buffer=True, load_timeout_s=5.0, inbox_blocks=8, inbox_share_blocks=8))
    side.register(device)
    side.set_copy_blocks(copy_kv_blocks)
    conn.send(side.side_channel_port)
    try:
        command, (port, specs) = conn.recv()
        loads = {req: LoadSpec(req, local, remote, "prefill", "127.0.0.1", port, "p-" + req)
                 for req, local, remote in specs}
        side.start_loads(StepPlan(loads=loads))
        done: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + 20
        while done != set(loads) and time.monotonic() < deadline:
            _, recving, fail = side.get_finished()
            done |= recving
            failed |= fail
            time.sleep(0.005)
        conn.send({"done": sorted(done), "failed": sorted(failed), "device": {n: t.clone() for n, t in device.items()}})
        conn.recv()
    finally:
        side.shutdown()


def _prefill(conn: Any, mode: str, decode_port: int) -> None:
    device = device_tensors(3)
    side = WorkerSide(WorkerSettings(engine_id="prefill", is_consumer=False, transfer_mode=mode,
                                     push_port=decode_port, host_buffer=True, load_timeout_s=5.0))
    side.register(device)
    recorder = Recorder()
    side.set_copy_blocks(recorder)
    conn.send(side.side_channel_port)
    try:
        _, saves = conn.recv()
        plan = StepPlan(saves={spec.req_id: spec for spec in saves})
        side.begin_step(plan)
        for name in NAMES:
            side.save_layer(name)
        side.start_loads(plan)
        side.finish_step()
        conn.send(recorder.calls)
        conn.recv()
    finally:
        side.shutdown()


@pytest.mark.parametrize("mode", ["pull", "push_layerwise"])
def test_decode_device_blocks_equal_the_prefills_through_both_host_buffers(mode: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    processes, conns = [], []
    try:
        dconn, child = ctx.Pipe()
        processes.append(ctx.Process(target=_decode, args=(child, mode), daemon=True))
        processes[-1].start()
        conns.append(dconn)
        assert dconn.poll(120)
        decode_port = dconn.recv()
        pconn, child = ctx.Pipe()
        processes.append(ctx.Process(target=_prefill, args=(child, mode, decode_port), daemon=True))
        processes[-1].start()
        conns.append(pconn)
        assert pconn.poll(120)
        prefill_port = pconn.recv()
        pconn.send(("step", [SaveSpec("p-a", [4, 9, 1], 0, 3, True)]))
        assert pconn.poll(60)
        calls = pconn.recv()
        assert calls == [([name], [4, 9, 1], "d2h") for name in NAMES], "one copy per layer, as it was saved"
        dconn.send(("load", (prefill_port, [("a", [2, 3, 6], [4, 9, 1])])))
        assert dconn.poll(60)
        result = dconn.recv()
        assert result["done"] == ["a"] and result["failed"] == []
        source = device_tensors(3)
        for name in NAMES:
            assert torch.equal(result["device"][name][[2, 3, 6]], source[name][[4, 9, 1]])
            others = [b for b in range(BLOCKS) if b not in (2, 3, 6)]
            assert not result["device"][name][others].any(), "a device block nobody asked for was written"
    finally:
        for conn in conns:
            try:
                conn.send(("stop", None))
            except OSError:
                pass
        for process in processes:
            process.join(timeout=20)
            if process.is_alive():
                process.kill()
                process.join()
            process.close()
        for conn in conns:
            conn.close()

"""Pipeline parallelism end to end: vLLM instances of several stages joined by DatadistAioConnector.

Real vLLM engines (the CPU build, every worker a process) on the tiny Llama
of ``vllm_model`` (4 layers, 2 KV heads): a prefill of two pipeline stages
(layers 0-1 and 2-3) into a decode of one stage, into a decode of two, and
into a decode of one stage and TP 2. Each decode worker reads each of its
layers from the prefill stage and TP rank that hold it. Each pairing is
checked token by token against the prefill computing alone, prefill-first
and decode-first, with the swap control (``test_vllm_layouts.run_layout``).
Then a prefill stage killed while the decode's load waits on it: every
request fails on the decode within the load timeout, no wrong token, and the
decode serves on.

vLLM 0.32's CPU build runs a pipeline stage only with compilation on
(``enforce_eager=False``): eager, its second stage's worker fails its first
step at ``assert self.intermediate_tensors is not None``
(``gpu_model_runner.sync_and_gather_intermediate_tensors``), the buffer a
warm-up would have made. Instances with stages run compiled here.

Marked ``vllm``: run with ``pytest -m vllm`` where vLLM is installed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("vllm")

from test_vllm_layouts import FAILED, MAX_TOKENS, XFERS, run_decode_first, run_layout, start_pair  # noqa: E402
from vllm_pd import Engine, delta, model_dir, prompts_of_lengths  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

STAGES = {"pipeline_parallel_size": 2, "enforce_eager": False}
LOAD_TIMEOUT_S = 5.0  # the decode's, as start_pair sets it


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="module")
def pp2_into_pp1(model: Path) -> Iterator[dict[str, Engine]]:
    with start_pair(model, STAGES, {}) as pair:
        yield pair


def test_prefill_pp2_into_decode_pp1(pp2_into_pp1: dict[str, Engine]) -> None:
    run_layout(pp2_into_pp1)
    run_decode_first(pp2_into_pp1, 1, pushed=False)


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid``, read off ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stage_worker(engine: Engine, stage: int) -> int:
    """The process of the engine's worker of pipeline stage ``stage`` (vLLM names it ``..._PP<stage>``)."""
    for pid in _descendants(engine.process.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"PP{stage}" in title:
            return pid
    raise AssertionError(f"no worker process of stage {stage} under {engine.process.pid}")


def test_a_stage_that_dies_mid_transfer_fails_the_request_in_time(pp2_into_pp1: dict[str, Engine]) -> None:
    """Runs last on this pair: its prefill ends with one stage dead."""
    prefill, decode = pp2_into_pp1["prefill"], pp2_into_pp1["decode"]
    prompts = prompts_of_lengths([230, 470], seed=21)
    reference = [r["tokens"] for r in prefill.generate(prompts, MAX_TOKENS)["results"]]
    params = [r["kv_transfer_params"] for r in
              prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))["results"]]
    worker = _stage_worker(prefill, 1)
    before = decode.metrics()
    # Stage 1 frozen, its link up (the pair has loaded before): the decode's
    # reads from it wait until it is killed, a second later.
    os.kill(worker, signal.SIGSTOP)
    killer = threading.Timer(1.0, os.kill, (worker, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    try:
        run = decode.generate(prompts, MAX_TOKENS, params, timeout=120)
    finally:
        killer.join()
    elapsed = time.monotonic() - start
    after = decode.metrics()
    for result, ref in zip(run["results"], reference):
        assert result["finish_reason"] == "error", result
        assert result["tokens"] == ref[: len(result["tokens"])], "a failed request produced a wrong token"
    assert elapsed < LOAD_TIMEOUT_S + 15, f"the decode took {elapsed:.1f} s"
    assert delta(after, before, FAILED) == len(prompts) and delta(after, before, XFERS) == 0
    # Nothing of the failed loads is left holding the decode: it computes a
    # prompt of its own, exactly.
    (alone,) = (r["tokens"] for r in decode.generate(prompts[:1], MAX_TOKENS)["results"])
    assert alone == reference[0]


def test_prefill_pp2_into_decode_pp2(model: Path) -> None:
    with start_pair(model, STAGES, STAGES) as pair:
        run_layout(pair)
        run_decode_first(pair, 1, pushed=False)


def test_prefill_pp2_into_decode_tp2(model: Path) -> None:
    """Each of the decode's TP ranks reads its KV head from both prefill stages."""
    with start_pair(model, STAGES, {"tensor_parallel_size": 2}) as pair:
        run_layout(pair)
        run_decode_first(pair, 1, pushed=False)

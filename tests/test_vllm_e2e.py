"""A prefill vLLM and a decode vLLM joined by DatadistAioConnector, token for token.

The model is a tiny Llama (``vllm_model/config.json``: 4 layers, GQA 4:2,
head_dim 64) whose weights are generated from a fixed seed and saved as
safetensors; prompts are token ids (no tokenizer), the block size is 32 and
decoding is greedy. Marked ``vllm``: run with ``pytest -m vllm`` in an
environment with vLLM (the CPU build is enough).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("vllm")

from vllm_pd import (  # noqa: E402
    Engine,
    close_engines,
    connector_config,
    delta,
    free_port_run,
    model_dir,
    prompts_of_lengths,
    start_engines,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

LOAD_TIMEOUT_S = 3.0
MAX_TOKENS = 8
XFERS = "vllm:datadist_aio_num_transfers"
FAILED = "vllm:datadist_aio_num_failed_transfers"
REMOTE_HITS = "vllm:external_prefix_cache_hits"
ANSWERS = "vllm:datadist_aio_answers_read"
ANSWERS_BY_SWEEP = "vllm:datadist_aio_answers_read_by_sweep"


def free_port() -> int:
    return free_port_run(1)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("vllm-model"))


def started(*engines: tuple[str, Callable[[], Engine]], in_order: bool = False) -> Iterator[dict[str, Any]]:
    """Starts the engines side by side (``in_order``: each once the one
    before is ready), yields them by name, and closes them (where one fails
    to start, those started are closed and its failure raised)."""
    if in_order:
        running: dict[str, Any] = {}
        try:
            for item in engines:
                running.update(start_engines([item]))
        except BaseException:
            close_engines(list(running.values()))
            raise
    else:
        running = start_engines(list(engines))
    try:
        yield running
    finally:
        close_engines(list(running.values()))


@pytest.fixture(scope="module")
def pair(model: Path) -> Iterator[dict[str, Any]]:
    """A prefill instance and a decode instance (policy ``recompute``)."""
    yield from started(
        ("prefill", lambda: Engine(model, connector_config("datadist", "kv_producer", free_port()))),
        ("decode", lambda: Engine(model, connector_config("datadist", "kv_consumer", 0, load_timeout_s=LOAD_TIMEOUT_S),
                                  policy="recompute")),
    )


def tokens(run: dict[str, Any]) -> list[list[int]]:
    return [result["tokens"] for result in run["results"]]


def prefill_params(prefill: Engine, prompts: list[list[int]]) -> list[dict[str, Any]]:
    run = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [result["kv_transfer_params"] for result in run["results"]]
    for p in params:
        assert p["do_remote_prefill"] is True and p["remote_block_ids"], p
    return params


def test_disaggregated_output_equals_single_instance(pair: dict[str, Any]) -> None:
    prefill, decode = pair["prefill"], pair["decode"]
    prompts = prompts_of_lengths([17, 32, 95, 256, 731, 1500, 3001], seed=1)
    reference = tokens(prefill.generate(prompts, MAX_TOKENS))  # one instance, no connector involved
    assert all(len(t) == MAX_TOKENS for t in reference)
    assert len({tuple(t) for t in reference}) == len(prompts), "the model should not answer every prompt alike"
    before = decode.metrics()
    params = prefill_params(prefill, prompts)
    got = tokens(decode.generate(prompts, MAX_TOKENS, params))
    after = decode.metrics()
    assert got == reference
    assert delta(after, before, XFERS) == len(prompts), "every prompt's KV was read through the connector"
    assert delta(after, before, FAILED) == 0
    assert delta(after, before, REMOTE_HITS) == sum(len(p) for p in prompts)
    # The worker side looks at its loads every step (get_finished: done()),
    # so the answers of its pulls are read there or by the event loop, never
    # left to the engine's housekeeping sweep, which would delay each load
    # by up to the sweep's period. (A one-sided pull, the default on one
    # host, has no answer: only pulls made before the prefill's grant came
    # are answered; test_vllm_worker_side.py counts an owner-served pull's.)
    assert delta(after, before, ANSWERS_BY_SWEEP) == 0, (
        f"{delta(after, before, ANSWERS_BY_SWEEP):g} of {delta(after, before, ANSWERS):g} answers waited for the sweep"
    )


def test_swap_control_decode_follows_the_transferred_kv(pair: dict[str, Any]) -> None:
    """Prompt A's tokens with prompt B's KV: the output is B's, not A's."""
    prefill, decode = pair["prefill"], pair["decode"]
    a, b = prompts_of_lengths([300, 300], seed=2)
    a[-1] = b[-1]  # the decode side recomputes the last token itself: same for both
    ref_a, ref_b = tokens(prefill.generate([a, b], MAX_TOKENS))
    assert ref_a != ref_b
    (params_b,) = prefill_params(prefill, [b])
    (got,) = tokens(decode.generate([a], MAX_TOKENS, [params_b]))
    assert got == ref_b
    assert got != ref_a


def _timed(engine: Engine, prompts: list[list[int]], params: list[Any]) -> tuple[dict[str, Any], float]:
    start = time.monotonic()
    run = engine.generate(prompts, MAX_TOKENS, params, timeout=120)
    return run, time.monotonic() - start


def _assert_errors(run: dict[str, Any], reference: list[list[int]], engine: Engine, before: dict[str, float]) -> None:
    """Every request failed, with no wrong token; the message of a request
    that did not fail says what the decode's connector counted."""
    after = engine.metrics()
    counted = f"transfers {delta(after, before, XFERS):g}, failed {delta(after, before, FAILED):g}"
    for result, ref in zip(run["results"], reference):
        assert result["finish_reason"] == "error", (result, counted)
        assert result["tokens"] == ref[: len(result["tokens"])], "a failed request produced a wrong token"


def test_prefill_failures_recompute_or_fail_within_the_timeout(pair: dict[str, Any], model: Path) -> None:
    prefill, decode = pair["prefill"], pair["decode"]
    prompts = prompts_of_lengths([200, 450], seed=3)
    reference = tokens(prefill.generate(prompts, MAX_TOKENS))
    limit = LOAD_TIMEOUT_S + 15  # the load timeout plus two short engine steps on a loaded machine

    # 1. recompute, linked before, prefill frozen with its sockets open.
    params = prefill_params(prefill, prompts)
    before = decode.metrics()
    prefill.stop_signal()
    try:
        run, elapsed = _timed(decode, prompts, params)
    finally:
        prefill.cont_signal()
    assert tokens(run) == reference
    assert elapsed < limit, f"decode took {elapsed:.1f} s"
    assert delta(decode.metrics(), before, FAILED) == len(prompts)

    failing = Engine(
        model,
        connector_config("datadist", "kv_consumer", 0, load_timeout_s=LOAD_TIMEOUT_S),
        policy="fail",
    )
    try:
        # 2. fail, never linked, prefill frozen.
        params = prefill_params(prefill, prompts)
        before = failing.metrics()
        prefill.stop_signal()
        try:
            run, elapsed = _timed(failing, prompts, params)
        finally:
            prefill.cont_signal()
        _assert_errors(run, reference, failing, before)
        assert elapsed < limit, f"decode took {elapsed:.1f} s"

        # 3. fail, linked (one good transfer first), prefill killed during the load.
        warm = prompts_of_lengths([64], seed=4)
        (warm_ref,) = tokens(prefill.generate(warm, MAX_TOKENS))
        assert tokens(failing.generate(warm, MAX_TOKENS, prefill_params(prefill, warm))) == [warm_ref]
        # Prompts this decode side has never seen: nothing of them can come
        # from its own prefix cache, so each one needs its load.
        prompts = prompts_of_lengths([210, 460], seed=5)
        reference = tokens(prefill.generate(prompts, MAX_TOKENS))
        params = prefill_params(prefill, prompts)
        dead_params = params
        before = failing.metrics()
        prefill.stop_signal()  # holds the load in flight until the kill
        killer = threading.Timer(1.0, prefill.kill)
        killer.start()
        try:
            run, elapsed = _timed(failing, prompts, params)
        finally:
            killer.join()
        _assert_errors(run, reference, failing, before)
        assert elapsed < limit, f"decode took {elapsed:.1f} s"
        assert not prefill.process.is_alive()
    finally:
        failing.close()

    # 4. recompute, linked before, prefill dead before the load.
    run, elapsed = _timed(decode, prompts, dead_params)
    assert tokens(run) == reference
    assert elapsed < limit

    # 5. recompute, never linked: nobody listens where the params point.
    stray = [dict(p, remote_port=free_port(), remote_engine_id="gone") for p in dead_params]
    run, elapsed = _timed(decode, prompts, stray)
    assert tokens(run) == reference
    assert elapsed < limit


# -- layer-wise push (transfer_mode "push_layerwise") ------------------------------

SHARE_BLOCKS = 64  # of the decode side's inbox, for its one prefill: prompts up to 2048 tokens
BLOCK_BYTES = 4 * 2 * 32 * 2 * 64 * 4  # layers x kv heads x block size x (K and V) x head_dim x float32


def push_engines(model: Path, inbox_blocks: int, share_blocks: int, **prefill_extra: Any) -> Iterator[dict[str, Any]]:
    """A prefill that pushes layer by layer into the inbox of its decode (policy ``recompute``)."""
    decode_port = free_port()
    yield from started(
        ("decode", lambda: Engine(
            model,
            connector_config("datadist", "kv_consumer", decode_port, load_timeout_s=LOAD_TIMEOUT_S,
                             transfer_mode="push_layerwise", inbox_blocks=inbox_blocks, inbox_share_blocks=share_blocks),
            policy="recompute",
        )),
        ("prefill", lambda: Engine(model, connector_config("datadist", "kv_producer", free_port(),
                                                           transfer_mode="push_layerwise", push_port=decode_port,
                                                           **prefill_extra))),
        in_order=True,  # the prefill links to the decode's inbox as it starts
    )


def assert_push_overlapped(before: dict[str, float], after: dict[str, float]) -> None:
    """The prefill's own counters: at least 90 % of its steps that pushed
    handed their first layer to the engine before the forward saved its last
    layer, and none was aborted."""
    steps = delta(after, before, "vllm:datadist_aio_push_steps")
    overlapped = delta(after, before, "vllm:datadist_aio_push_steps_overlapped")
    assert steps >= 1 and delta(after, before, "vllm:datadist_aio_push_steps_aborted") == 0
    assert overlapped >= 0.9 * steps, f"{overlapped:g} of {steps:g} pushed steps overlapped their forward"


@pytest.fixture(scope="module")
def push_pair(model: Path) -> Iterator[dict[str, Any]]:
    yield from push_engines(model, 2 * SHARE_BLOCKS, SHARE_BLOCKS, load_timeout_s=LOAD_TIMEOUT_S)


def test_push_layerwise_output_equals_single_instance(push_pair: dict[str, Any]) -> None:
    prefill, decode = push_pair["prefill"], push_pair["decode"]
    prompts = prompts_of_lengths([17, 95, 731, 1100], seed=11)  # 62 blocks: all fit the share at once
    reference = tokens(prefill.generate(prompts, MAX_TOKENS))
    before_p, before_d = prefill.metrics(), decode.metrics()
    params = prefill_params(prefill, prompts)
    got = tokens(decode.generate(prompts, MAX_TOKENS, params))
    after_p, after_d = prefill.metrics(), decode.metrics()
    assert got == reference
    assert delta(after_d, before_d, XFERS) == len(prompts) and delta(after_d, before_d, FAILED) == 0
    assert delta(after_d, before_d, REMOTE_HITS) == sum(len(p) for p in prompts)
    # Every prompt block went through the prefill's pushes (a chunk's partial block may go twice).
    assert delta(after_p, before_p, FAILED) == 0 and delta(after_p, before_p, XFERS) >= 1
    pushed = delta(after_p, before_p, "vllm:datadist_aio_bytes_transferred_sum")
    assert pushed >= sum(-(-len(p) // 32) for p in prompts) * BLOCK_BYTES
    assert_push_overlapped(before_p, after_p)

    # Swap control: prompt A's ids with prompt B's pushed KV give B's output.
    a, b = prompts_of_lengths([300, 300], seed=12)
    a[-1] = b[-1]
    ref_a, ref_b = tokens(prefill.generate([a, b], MAX_TOKENS))
    assert ref_a != ref_b
    (params_b,) = prefill_params(prefill, [b])
    assert tokens(decode.generate([a], MAX_TOKENS, [params_b])) == [ref_b]


def test_push_layerwise_killed_prefill(push_pair: dict[str, Any]) -> None:
    """After the prefill dies, a request it pushed is served from the inbox;
    one too large for its share (so never pushed) fails its pull within the
    timeout and is recomputed; neither yields a wrong token."""
    prefill, decode = push_pair["prefill"], push_pair["decode"]
    prompts = prompts_of_lengths([400, 32 * SHARE_BLOCKS + 100], seed=13)
    reference = tokens(prefill.generate(prompts, MAX_TOKENS))
    params = prefill_params(prefill, prompts)
    prefill.kill()
    before = decode.metrics()
    run, elapsed = _timed(decode, prompts, params)
    after = decode.metrics()
    assert tokens(run) == reference
    assert elapsed < LOAD_TIMEOUT_S + 15, f"decode took {elapsed:.1f} s"
    assert delta(after, before, XFERS) == 1, "the pushed prompt loads from the inbox"
    assert delta(after, before, FAILED) == 1, "the prompt that was not pushed fails its pull"


@pytest.fixture(scope="module")
def mla_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The tiny DeepSeek-V2 (multi-head latent attention) as a pushing prefill and its decode."""
    yield from push_engines(model_dir(tmp_path_factory.mktemp("vllm-mla"), "mla"), 32, 32)


def test_mla_latent_cache_pushed_and_pulled(mla_pair: dict[str, Any]) -> None:
    """DeepSeek-V2 attention (vLLM's CPU_MLA backend: one latent tensor per
    layer, blocks of 16 tokens): a prompt that fits the share is pushed, one
    that does not is pulled, and every load succeeds.

    Tokens are not compared with a single instance here: on this backend a
    disaggregated pair does not reproduce one whichever connector moves the
    cache (vLLM's NixlConnector gives the same tokens as this one, request
    for request; see docs/vllm.md); the bytes themselves are compared in
    ``test_vllm_push.py`` (the ``mla-latent`` case)."""
    prefill, decode = mla_pair["prefill"], mla_pair["decode"]
    prompts = prompts_of_lengths([17, 300, 700], seed=21)  # 2 + 19 blocks pushed; 44 do not fit
    before_p, before_d = prefill.metrics(), decode.metrics()
    run = decode.generate(prompts, MAX_TOKENS, prefill_params(prefill, prompts))
    after_p, after_d = prefill.metrics(), decode.metrics()
    assert [result["finish_reason"] for result in run["results"]] == ["length"] * len(prompts)
    assert delta(after_d, before_d, XFERS) == len(prompts) and delta(after_d, before_d, FAILED) == 0
    assert delta(after_d, before_d, REMOTE_HITS) == sum(len(p) for p in prompts)
    latent_block = 2 * 16 * (512 + 64) * 4  # layers x block size x latent width x float32
    pushed = delta(after_p, before_p, "vllm:datadist_aio_bytes_transferred_sum")
    assert pushed == 21 * latent_block, "the two prompts that fit were pushed, the third was not"

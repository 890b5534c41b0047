"""Prefill and decode instances of different shapes, joined by DatadistAioConnector.

Each layout runs real vLLM engines (the CPU build; TP above 1 with worker
processes) on the tiny Llama of ``vllm_model`` (2 KV heads, 4 layers) and
checks the decode's output token by token against the prefill instance
computing alone. Instances with another TP size sum in another order, so a
token may differ where the reference's two best candidates are within
``NEAR_TIE`` of each other: the check names the prompt and the margin. The
control hands the decode another prompt's KV: its output must follow that KV.

Marked ``vllm``: run with ``pytest -m vllm`` where vLLM is installed.
"""

from __future__ import annotations

import contextlib
import multiprocessing.resource_tracker
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm")

from vllm_pd import (  # noqa: E402
    EXPECT_LEAD_S,
    Engine,
    close_engines,
    connector_config,
    delta,
    decode_first,
    free_port_run,
    model_dir,
    parting,
    prompts_of_lengths,
    start_engines,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

# vLLM's TP workers share memory through multiprocessing, whose resource
# tracker then starts and keeps a descriptor: started now, it stays out of
# the per-test descriptor check.
multiprocessing.resource_tracker.ensure_running()

MAX_TOKENS = 8
NEAR_TIE = 0.05  # nats between the reference's best and second-best token
XFERS = "vllm:datadist_aio_num_transfers"
FAILED = "vllm:datadist_aio_num_failed_transfers"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("vllm-model"))


@contextlib.contextmanager
def start_pair(model: Path, prefill: dict[str, Any], decode: dict[str, Any]) -> Iterator[dict[str, Engine]]:
    port = free_port_run(4)
    engines = start_engines([
        ("prefill", lambda: Engine(model, connector_config("datadist", "kv_producer", port), **prefill)),
        ("decode", lambda: Engine(model, connector_config("datadist", "kv_consumer", 0, load_timeout_s=5.0),
                                  policy="fail", **decode)),
    ])
    try:
        yield engines
    finally:
        close_engines(list(engines.values()))


def check_outputs(got: list[list[int]], reference: list[dict[str, Any]]) -> None:
    """Token-exact, but for a near tie of the reference where they part."""
    wrong = []
    for index, (tokens, ref) in enumerate(zip(got, reference)):
        parted = parting(tokens, ref)
        if parted is not None and parted[1] > NEAR_TIE:
            wrong.append(f"prompt {index} parts from the reference at token {parted[0]} by {parted[1]:.3g} nats: "
                         f"{tokens} against {ref['tokens']}")
    assert not wrong, "\n".join(wrong)


def run_layout(pair: dict[str, Engine]) -> None:
    # The prefill is the reference (without kv_transfer_params it computes
    # alone); the decode never sees a prompt before its KV arrives, so no
    # local prefix hit hides the transfer.
    prefill, decode = pair["prefill"], pair["decode"]
    reference_engine = prefill
    prompts = prompts_of_lengths([50, 200, 333, 600], seed=5)
    reference = reference_engine.generate(prompts, MAX_TOKENS, logprobs=5)["results"]
    assert len({tuple(r["tokens"]) for r in reference}) == len(prompts)
    before = decode.metrics()
    params = [r["kv_transfer_params"] for r in prefill.generate(prompts, 1, [{"do_remote_decode": True}] * 4)["results"]]
    got = [r["tokens"] for r in decode.generate(prompts, MAX_TOKENS, params)["results"]]
    after = decode.metrics()
    check_outputs(got, reference)
    assert delta(after, before, FAILED) == 0
    assert delta(after, before, XFERS) >= len(prompts), "every prompt's KV was read through the connector"
    # Those four were the pair's first: every decode rank linked to every
    # prefill rank it reads while the others' loads waited for the same
    # links. Now eight more at once on the links made, none may fail.
    more = prompts_of_lengths([40, 90, 150, 260, 410, 520, 700, 950], seed=9)
    more_reference = reference_engine.generate(more, MAX_TOKENS, logprobs=5)["results"]
    params = [r["kv_transfer_params"] for r in
              prefill.generate(more, 1, [{"do_remote_decode": True}] * len(more))["results"]]
    before = decode.metrics()
    check_outputs([r["tokens"] for r in decode.generate(more, MAX_TOKENS, params)["results"]], more_reference)
    assert delta(decode.metrics(), before, FAILED) == 0
    # The control: prompt a's tokens with prompt b's KV give b's output.
    a, b = prompts_of_lengths([300, 300], seed=6)
    a[-1] = b[-1]  # the decode computes the last token itself
    ref_a, ref_b = (r["tokens"] for r in reference_engine.generate([a, b], MAX_TOKENS)["results"])
    assert ref_a != ref_b
    params_b = prefill.generate([b], 1, [{"do_remote_decode": True}])["results"][0]["kv_transfer_params"]
    (control,) = (r["tokens"] for r in decode.generate([a], MAX_TOKENS, [params_b])["results"])
    assert control != ref_a, "the decode computed prompt a itself: the KV did not arrive"
    assert control[:2] == ref_b[:2]


def run_decode_first(pair: dict[str, Engine], prefill_tp: int, pushed: bool = True) -> None:
    """Decode-first across TP sizes: each prefill rank writes, layer by
    layer, its share of the KV heads into the blocks of each decode rank
    that holds them (the ranges the pull would read); with pipeline stages
    (``pushed`` False) the decode pulls."""
    prefill, decode = pair["prefill"], pair["decode"]
    prompts = prompts_of_lengths([70, 260, 480], seed=7)
    reference = prefill.generate(prompts, MAX_TOKENS, logprobs=5)["results"]
    before, before_p = decode.metrics(), prefill.metrics()
    got = decode_first([(prefill, prefill.side_channel_port, decode, p, p) for p in prompts], MAX_TOKENS, prefill_tp,
                       decode_lead_s=EXPECT_LEAD_S)
    check_outputs(got, reference)
    after = decode.metrics()
    assert delta(after, before, FAILED) == 0
    # Pushed, not pulled: what the prefill's ranks pushed is what landed in
    # the decode's blocks (a push that ended after the prefill's last step is
    # reported with a step of its own), and a push overlapped its forward
    # (all three prompts are one step per rank: the decode's requests went
    # first, so that its expects were there before that step's few
    # milliseconds of forward).
    landed = delta(after, before, BYTES)
    assert landed >= sum(len(p) for p in prompts) * TOKEN_BYTES
    if not pushed:
        prefill.generate(prompts_of_lengths([8], seed=9), 1)
        assert delta(prefill.metrics(), before_p, BYTES) == 0, "a prefill with stages pushed"
        return
    deadline = time.monotonic() + 20
    while True:
        prefill.generate(prompts_of_lengths([8], seed=9), 1)
        after_p = prefill.metrics()
        if delta(after_p, before_p, BYTES) >= landed or time.monotonic() > deadline:
            break
    assert delta(after_p, before_p, BYTES) == landed
    assert delta(after_p, before_p, "vllm:datadist_aio_push_steps_overlapped") >= 1
    assert delta(after_p, before_p, "vllm:datadist_aio_push_steps_aborted") == 0
    a, b = prompts_of_lengths([300, 300], seed=8)
    a[-1] = b[-1]
    ref_a, ref_b = (r["tokens"] for r in prefill.generate([a, b], MAX_TOKENS)["results"])
    (control,) = decode_first([(prefill, prefill.side_channel_port, decode, b, a)], MAX_TOKENS, prefill_tp)
    assert control != ref_a and control[:2] == ref_b[:2], "the decode's prompt a with the prefill's KV of b"


def test_prefill_tp2_into_decode_tp1(model: Path) -> None:
    with start_pair(model, {"tensor_parallel_size": 2}, {}) as pair:
        run_layout(pair)
        run_decode_first(pair, 2)


def test_prefill_tp1_into_decode_tp2(model: Path) -> None:
    with start_pair(model, {}, {"tensor_parallel_size": 2}) as pair:
        run_layout(pair)
        run_decode_first(pair, 1)


BYTES = "vllm:datadist_aio_bytes_transferred_sum"
TOKEN_BYTES = 4 * 2 * 128 * 4  # 4 layers of 2 KV heads, K and V of 64 floats each


def test_block_size_32_into_64_and_a_local_prefix_hit(model: Path) -> None:
    with start_pair(model, {"block_size": 32}, {"block_size": 64, "enable_prefix_caching": True}) as pair:
        run_layout(pair)
        prefill, decode = pair["prefill"], pair["decode"]
        (prompt,) = prompts_of_lengths([500], seed=7)
        decode.generate([prompt[:200]], 1)  # the decode now holds 3 blocks of 64: tokens 0 to 191
        (reference,) = prefill.generate([prompt], MAX_TOKENS, logprobs=5)["results"]
        params = prefill.generate([prompt], 1, [{"do_remote_decode": True}])["results"][0]["kv_transfer_params"]
        before = decode.metrics()
        (got,) = (r["tokens"] for r in decode.generate([prompt], MAX_TOKENS, [params])["results"])
        after = decode.metrics()
        check_outputs([got], [reference])
        # Only tokens 192 to 511 (the decode's last 5 blocks) moved.
        assert delta(after, before, BYTES) == (512 - 192) * TOKEN_BYTES


def test_block_size_64_into_32(model: Path) -> None:
    with start_pair(model, {"block_size": 64}, {"block_size": 32}) as pair:
        run_layout(pair)


def test_a_layout_that_cannot_map_fails_every_load_at_once(model: Path) -> None:
    port = free_port_run(1)
    with contextlib.ExitStack() as stack:
        prefill = Engine(model, connector_config("datadist", "kv_producer", port), block_size=64)
        stack.callback(prefill.close)
        # A load timeout far past the decode's own bound (120 s): only a load
        # that fails at the hello lets the decode answer at all.
        decode = Engine(model, connector_config("datadist", "kv_consumer", 0, load_timeout_s=600.0),
                        policy="recompute", block_size=96)
        stack.callback(decode.close)
        prompts = prompts_of_lengths([100, 300, 700], seed=8)
        reference = prefill.generate(prompts, MAX_TOKENS, logprobs=5)["results"]
        params = [r["kv_transfer_params"] for r in prefill.generate(prompts, 1, [{"do_remote_decode": True}] * 3)["results"]]
        before = decode.metrics()
        run = decode.generate(prompts, MAX_TOKENS, params, timeout=120.0)
        after = decode.metrics()
        # Refused at the hello, recomputed by the decode: right tokens, every
        # load counted failed, and no wait for the load timeout.
        check_outputs([r["tokens"] for r in run["results"]], reference)
        assert delta(after, before, FAILED) == len(prompts)
        assert delta(after, before, XFERS) == 0

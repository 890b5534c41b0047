"""A hybrid model (sliding-window layers beside full attention) through
DatadistAioConnector with vLLM's hybrid KV cache manager on.

The tiny Llama of ``vllm_model/sliding`` alternates sliding-window (64
tokens) and full-attention layers: vLLM gives it two KV cache groups, whose
layers overlay the same tensors, each group with its own block table, and
the sliding-window group keeps only the blocks its window still needs. The
connector declares ``SupportsHMA``, so vLLM keeps the manager on (checked),
and moves each group's blocks: the sliding-window group's in-window tail
only (checked by the bytes moved). Outputs are token-exact against the
prefill computing alone (fp32; another TP size may part at a near tie of
the reference), prompts cover the window's block
boundaries, and the control hands the decode another prompt's KV.

Marked ``vllm``: run with ``pytest -m vllm`` where vLLM is installed.
"""

from __future__ import annotations

import contextlib
import multiprocessing.resource_tracker
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm")

from test_vllm_e2e import assert_push_overlapped  # noqa: E402
from vllm_pd import (  # noqa: E402
    EXPECT_LEAD_S,
    Engine,
    close_engines,
    connector_config,
    decode_first,
    delta,
    free_port_run,
    model_dir,
    parting,
    prompts_of_lengths,
    start_engines,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

multiprocessing.resource_tracker.ensure_running()

MAX_TOKENS = 8
NEAR_TIE = 0.05  # nats: another TP size sums in another order
FAILED = "vllm:datadist_aio_num_failed_transfers"
XFERS = "vllm:datadist_aio_num_transfers"
BYTES = "vllm:datadist_aio_bytes_transferred_sum"
BLOCK = 32
# One block of one KV cache group: 2 tensors (layers 0+1 and 2+3 overlay
# each other) of 2 KV heads x 32 tokens x (K and V of 32 floats).
GROUP_BLOCK_BYTES = 2 * 2 * BLOCK * 64 * 4
WINDOW_BLOCKS = 64 // BLOCK + 1
# Around the window's block boundaries, and long prompts the window clips.
LENGTHS = [40, 63, 65, 95, 96, 97, 127, 301, 700]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("vllm-hybrid"), "sliding")


@contextlib.contextmanager
def start_pair(model: Path, prefill: dict[str, Any], decode: dict[str, Any]) -> Iterator[tuple[Engine, Engine]]:
    port = free_port_run(4)
    engines = start_engines([
        ("prefill", lambda: Engine(model, connector_config("datadist", "kv_producer", port), block_size=BLOCK,
                                   **prefill)),
        ("decode", lambda: Engine(model, connector_config("datadist", "kv_consumer", 0), policy="fail",
                                  block_size=BLOCK, **decode)),
    ])
    try:
        yield engines["prefill"], engines["decode"]
    finally:
        close_engines(list(engines.values()))


def run_hybrid(prefill: Engine, decode: Engine, overlap_share: bool) -> None:
    assert prefill.kv_groups() == decode.kv_groups() == ["SlidingWindowSpec", "FullAttentionSpec"], \
        "vLLM turned its hybrid KV cache manager off"
    prompts = prompts_of_lengths(LENGTHS, seed=21)
    references = prefill.generate(prompts, MAX_TOKENS, logprobs=5)["results"]
    reference = [r["tokens"] for r in references]
    assert len({tuple(r) for r in reference}) == len(prompts)

    def check(got: list[int], index: int) -> None:
        parted = parting(got, references[index])
        assert parted is None or parted[1] <= NEAR_TIE, \
            f"a prompt of {len(prompts[index])} tokens parts at token {parted[0]}: {got} against {reference[index]}"

    # One at a time: the bytes each moved.
    for index, prompt in enumerate(prompts):
        before = decode.metrics()
        params = prefill.generate([prompt], 1, [{"do_remote_decode": True}])["results"][0]["kv_transfer_params"]
        sliding, full = params["remote_block_ids"]
        assert len(sliding) == min(WINDOW_BLOCKS, -(-len(prompt) // BLOCK)) and len(full) == -(-len(prompt) // BLOCK)
        (got,) = (r["tokens"] for r in decode.generate([prompt], MAX_TOKENS, [params])["results"])
        after = decode.metrics()
        check(got, index)
        assert delta(after, before, FAILED) == 0 and delta(after, before, XFERS) >= 1
        moved = delta(after, before, BYTES)
        # The whole of the full-attention group, at most the window of the other.
        assert len(full) * GROUP_BLOCK_BYTES < moved <= (len(full) + WINDOW_BLOCKS) * GROUP_BLOCK_BYTES, moved
    # All at once, then the control: prompt a's tokens with prompt b's KV give b's output.
    params = [r["kv_transfer_params"] for r in
              prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))["results"]]
    before = decode.metrics()
    for index, result in enumerate(decode.generate(prompts, MAX_TOKENS, params)["results"]):
        check(result["tokens"], index)
    assert delta(decode.metrics(), before, FAILED) == 0
    a, b = prompts_of_lengths([300, 300], seed=22)
    a[-1] = b[-1]  # the decode computes the last token itself
    ref_a, ref_b = (r["tokens"] for r in prefill.generate([a, b], MAX_TOKENS)["results"])
    assert ref_a != ref_b
    params_b = prefill.generate([b], 1, [{"do_remote_decode": True}])["results"][0]["kv_transfer_params"]
    (control,) = (r["tokens"] for r in decode.generate([a], MAX_TOKENS, [params_b])["results"])
    assert control != ref_a, "the decode computed prompt a itself: the KV did not arrive"
    assert control[:2] == ref_b[:2]

    # Decode-first (the request to both at once): the prefill writes each
    # group's blocks into the decode's own (with another TP size, each decode
    # rank's heads of them), the sliding window's once its last layer was
    # saved (while the full-attention layer after it computes), its
    # in-window tail only.
    # Prompts the decode has not seen (no prefix hits there: every block moves).
    fresh = prompts_of_lengths(LENGTHS, seed=24)
    references = prefill.generate(fresh, MAX_TOKENS, logprobs=5)["results"]
    reference = [r["tokens"] for r in references]
    before, before_p = decode.metrics(), prefill.metrics()
    got = decode_first([(prefill, prefill.side_channel_port, decode, p, p) for p in fresh], MAX_TOKENS,
                       decode_lead_s=EXPECT_LEAD_S if overlap_share else 0.0)
    for index, tokens in enumerate(got):
        check(tokens, index)
    after = decode.metrics()
    assert delta(after, before, FAILED) == 0 and delta(after, before, XFERS) >= len(fresh)
    # A push that ended after the prefill's last step is reported with its next one.
    prefill.generate(prompts_of_lengths([8], seed=23), 1)
    after_p = prefill.metrics()
    blocks = [-(-len(p) // BLOCK) for p in fresh]
    # Every prompt block of the full-attention group, and of the other at
    # least one, at most the window, per prompt (the tail the decode's window
    # holds, as a pull reads it), the decode's ranks' shares together.
    pushed_bytes = delta(after_p, before_p, BYTES)
    assert (sum(blocks) + len(blocks)) * GROUP_BLOCK_BYTES <= pushed_bytes \
        <= sum(b + min(b, WINDOW_BLOCKS) for b in blocks) * GROUP_BLOCK_BYTES, pushed_bytes
    if overlap_share:
        assert_push_overlapped(before_p, after_p)
    else:  # one step, which an expect coming after the tiny model's forward misses (test_vllm_layouts.py)
        assert delta(after_p, before_p, "vllm:datadist_aio_push_steps_aborted") == 0
    (control,) = decode_first([(prefill, prefill.side_channel_port, decode, b, a)], MAX_TOKENS)
    assert control != ref_a and control[:2] == ref_b[:2], "the decode's prompt a with the prefill's KV of b"


def test_hybrid_kv_groups_tp1_into_tp1(model: Path) -> None:
    with start_pair(model, {}, {}) as (prefill, decode):
        run_hybrid(prefill, decode, overlap_share=True)


def test_hybrid_kv_groups_tp1_into_tp2(model: Path) -> None:
    with start_pair(model, {}, {"tensor_parallel_size": 2}) as (prefill, decode):
        # Each decode rank reads its own KV head: every byte once in all.
        run_hybrid(prefill, decode, overlap_share=False)

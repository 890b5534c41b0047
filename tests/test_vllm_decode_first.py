"""Decode-first through real vLLM engines: two prefills and two decodes (2P2D).

Each request goes to a decode and a prefill with the same ``transfer_id``
(as a decode-first proxy sends it; where the overlap is checked, the
decode's a moment before the prefill's): the decode allocates its
blocks and tells the prefill where they are, and the prefill writes each
layer into them as its forward saves it. Checked against one instance token
for token, with the KV-swap control, on a prefill that chunks its prompts
and on one that does not, with prefix hits on a decode (only the tail
moves), and with the prefills' own counters: their pushes overlapped their
forwards and nothing was aborted. Marked ``vllm``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm")

from test_vllm_e2e import (  # noqa: E402
    FAILED,
    MAX_TOKENS,
    XFERS,
    assert_push_overlapped,
    free_port,
    model,  # noqa: F401  (the module's fixture)
    started,
    tokens,
)
from vllm_pd import BLOCK_SIZE, EXPECT_LEAD_S, Engine, connector_config, delta, prompts_of_lengths  # noqa: E402
from vllm_pd import decode_first as run_decode_first  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

LOAD_TIMEOUT_S = 20.0
BLOCK_BYTES = 4 * 2 * BLOCK_SIZE * 2 * 64 * 4  # layers x kv heads x block size x (K and V) x head_dim x float32
PUSHED = "vllm:datadist_aio_bytes_transferred_sum"


@pytest.fixture(scope="module")
def instances(model: Path) -> Iterator[dict[str, Any]]:  # noqa: F811
    """Prefill p0 chunks its prompts (at most 128 tokens a step), p1 does
    not; both decodes keep a prefix cache (policy ``fail``: a load that
    failed shows)."""
    ports = {"p0": free_port(), "p1": free_port()}
    for running in started(
        ("p0", lambda: Engine(model, connector_config("datadist", "kv_producer", ports["p0"]),
                              max_num_batched_tokens=128)),
        ("p1", lambda: Engine(model, connector_config("datadist", "kv_producer", ports["p1"]))),
        ("d0", lambda: Engine(model, connector_config("datadist", "kv_consumer", 0, load_timeout_s=LOAD_TIMEOUT_S),
                              policy="fail", enable_prefix_caching=True)),
        ("d1", lambda: Engine(model, connector_config("datadist", "kv_consumer", 0, load_timeout_s=LOAD_TIMEOUT_S),
                              policy="fail", enable_prefix_caching=True)),
    ):
        instances = {**running, "ports": ports}
        # Each decode's first contact with each prefill (hello, link) before anything is measured.
        warm = prompts_of_lengths([40], seed=30)[0]
        decode_first(instances, [(p, d, warm, warm) for p in ("p0", "p1") for d in ("d0", "d1")])
        yield instances


def decode_first(instances: dict[str, Any], jobs: list[tuple[str, str, list[int], list[int]]],
                 decode_lead_s: float = 0.0) -> list[list[int]]:
    """``(prefill, decode, prefill's prompt, decode's prompt)`` by instance name (``vllm_pd.decode_first``)."""
    return run_decode_first([(instances[p], instances["ports"][p], instances[d], pp, dp) for p, d, pp, dp in jobs],
                            MAX_TOKENS, decode_lead_s=decode_lead_s)


def _metrics(instances: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {name: instances[name].metrics() for name in ("p0", "p1", "d0", "d1")}


def _settled_metrics(engine: Engine, before: dict[str, float], name: str, at_least: float) -> dict[str, float]:
    """The engine's metrics once ``name`` grew by ``at_least`` since ``before``
    (at most 20 s): a push that ended between the prefill's steps is reported
    with its next step, which its lease brings."""
    deadline = time.monotonic() + 20
    while True:
        after = engine.metrics()
        if delta(after, before, name) >= at_least or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def test_two_prefills_into_two_decodes_token_exact(instances: dict[str, Any]) -> None:
    prompts = prompts_of_lengths([17, 95, 300, 731, 1100, 40, 512, 900], seed=31)
    reference = tokens(instances["p1"].generate(prompts, MAX_TOKENS))
    assert len({tuple(t) for t in reference}) == len(prompts)
    pairs = [("p0", "d0"), ("p1", "d1"), ("p0", "d1"), ("p1", "d0")]
    jobs = [(*pairs[i % 4], prompt, prompt) for i, prompt in enumerate(prompts)]
    before = _metrics(instances)
    # The decodes' requests first: their expects are there before the
    # prefills' forwards, whose pushes then overlap them.
    got = decode_first(instances, jobs, decode_lead_s=EXPECT_LEAD_S)
    after = _metrics(instances)
    for prefill in ("p0", "p1"):
        blocks = sum(-(-len(p) // BLOCK_SIZE) for (name, _, p, _) in jobs if name == prefill)
        after[prefill] = _settled_metrics(instances[prefill], before[prefill], PUSHED, blocks * BLOCK_BYTES)
    assert got == reference
    for decode in ("d0", "d1"):
        assert delta(after[decode], before[decode], XFERS) == 4 and delta(after[decode], before[decode], FAILED) == 0
    pushed = sum(delta(after[p], before[p], PUSHED) for p in ("p0", "p1"))
    blocks = sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
    # Every prompt block went once; a chunk's partly filled block goes again with the next chunk.
    assert blocks * BLOCK_BYTES <= pushed <= (blocks + sum(len(p) // 128 for p in prompts)) * BLOCK_BYTES
    for prefill in ("p0", "p1"):
        assert_push_overlapped(before[prefill], after[prefill])

    # Swap control: the decode's prompt A with the KV the prefill computed for B gives B's output.
    a, b = prompts_of_lengths([300, 300], seed=32)
    a[-1] = b[-1]
    ref_a, ref_b = tokens(instances["p1"].generate([a, b], MAX_TOKENS))
    assert ref_a != ref_b
    assert decode_first(instances, [("p0", "d1", b, a)]) == [ref_b]


def test_a_prefix_hit_on_the_decode_moves_only_the_tail(instances: dict[str, Any]) -> None:
    first, = prompts_of_lengths([400], seed=33)
    second = first[:6 * BLOCK_SIZE] + prompts_of_lengths([150], seed=34)[0]  # six blocks in common
    reference = tokens(instances["p1"].generate([first, second], MAX_TOKENS))
    start = instances["p1"].metrics()
    assert decode_first(instances, [("p1", "d0", first, first)]) == reference[:1]
    # A push that ended after the prefill's last step is reported with its
    # next one: a request of its own brings it.
    instances["p1"].generate(prompts_of_lengths([8], seed=35), 1)
    before = _settled_metrics(instances["p1"], start, PUSHED, -(-len(first) // BLOCK_SIZE) * BLOCK_BYTES)
    assert delta(before, start, PUSHED) == -(-len(first) // BLOCK_SIZE) * BLOCK_BYTES
    assert decode_first(instances, [("p1", "d0", second, second)]) == reference[1:]
    instances["p1"].generate(prompts_of_lengths([8], seed=36), 1)
    tail_blocks = -(-len(second) // BLOCK_SIZE) - 6
    after = _settled_metrics(instances["p1"], before, PUSHED, tail_blocks * BLOCK_BYTES)
    assert delta(after, before, PUSHED) == tail_blocks * BLOCK_BYTES, "the decode's cached blocks did not move"

"""A decode that reads after the prefill's lease ran out never gets another request's KV.

The prefill holds a finished request's blocks for ``lease_timeout_s``; past
it, it frees them, and vLLM gives them to the next prompts. A decode whose
load comes later (here: held back past a 2 s lease while the prefill serves
other prompts in a KV cache of 40 blocks, so they take the freed blocks)
must not take those bytes for the request's KV: its claim on the lease is
refused, the load counts as failed in ``vllm:datadist_aio_num_failed_transfers``,
and ``kv_load_failure_policy`` decides: ``recompute`` gives the exact
output, ``fail`` fails the request.

Marked ``vllm``: run with ``pytest -m vllm`` where vLLM is installed.
"""

from __future__ import annotations

import multiprocessing.resource_tracker
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_pd import Engine, connector_config, delta, free_port_run, model_dir, prompts_of_lengths  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# Spawning starts multiprocessing's resource tracker, which keeps a
# descriptor: started now, it stays out of the per-test descriptor check.
multiprocessing.resource_tracker.ensure_running()

FAILED = "vllm:datadist_aio_num_failed_transfers"
XFERS = "vllm:datadist_aio_num_transfers"
LEASE_S = 2.0
# A KV cache of 40 blocks of 32 tokens: a prompt of 1000 tokens takes 32 of
# them, so the next one takes the first's freed blocks.
SMALL_CACHE = {"num_gpu_blocks_override": 40, "max_model_len": 1024, "max_num_batched_tokens": 1024}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_load_after_the_lease_ran_out_is_failed_never_wrong(tmp_path: Path, policy: str) -> None:
    model = model_dir(tmp_path)
    port = free_port_run(1)
    prefill = Engine(model, connector_config("datadist", "kv_producer", port, lease_timeout_s=LEASE_S),
                     enable_prefix_caching=False, **SMALL_CACHE)
    try:
        decode = Engine(model, connector_config("datadist", "kv_consumer", 0), policy=policy, **SMALL_CACHE)
        try:
            late, *others = prompts_of_lengths([1000, 1000, 1000], seed=31)
            (reference,) = prefill.generate([late], 8)["results"]
            params = prefill.generate([late], 1, [{"do_remote_decode": True}])["results"][0]["kv_transfer_params"]
            time.sleep(LEASE_S + 0.5)  # the lease runs out...
            for prompt in others:  # ...and the prefill's next steps free the blocks and give them to others
                prefill.generate([prompt], 1)
            before = decode.metrics()
            (result,) = decode.generate([late], 8, [params])["results"]
            after = decode.metrics()
            if policy == "recompute":
                assert result["tokens"] == reference["tokens"], "a wrong token: another request's KV was taken"
            else:
                assert result["finish_reason"] == "error", result
            assert delta(after, before, FAILED) == 1, "the late load was not counted failed"
            assert delta(after, before, XFERS) == 0
            # A request read in time still loads.
            (prompt,) = prompts_of_lengths([500], seed=32)
            (expected,) = prefill.generate([prompt], 8)["results"]
            params = prefill.generate([prompt], 1, [{"do_remote_decode": True}])["results"][0]["kv_transfer_params"]
            before = decode.metrics()
            (result,) = decode.generate([prompt], 8, [params])["results"]
            after = decode.metrics()
            assert result["tokens"] == expected["tokens"]
            assert delta(after, before, FAILED) == 0 and delta(after, before, XFERS) == 1
        finally:
            decode.close()
    finally:
        prefill.close()

"""A pipeline-parallel SGLang prefill into a decode of as many stages, through
sglang-router (``pytest -m sglang``; left to a hand run, see README "CI").

A prefill server of two pipeline stages (``--pp-size 2``: stage 0 holds
layers 0 and 1 of the tiny Llama's 4, stage 1 layers 2 and 3, each only its
own layers' KV buffers), a decode server of two stages, a reference server
with no disaggregation, and a router. Each decode stage reads the prefill
stage of its own rank, buffer for buffer. Checked token for token against
the reference, prompts across the prefill's chunks of 64, with the control.
The prefill of two stages into a decode of one runs in test_sglang_e2e.py.

Needs SGLang's CPU environment (``.ci/run`` builds it in build/venv-sglang).
"""

from __future__ import annotations

import random
import time
from typing import Any, Iterator

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang_router")

from sglang_pd import (  # noqa: E402
    Router,
    Server,
    assert_stages_token_exact,
    free_port_run,
    model_dir,
    stop_all,
    tp_env,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

NEW_TOKENS = 8
LENGTHS = [5, 64, 65, 190]
PAGE_SIZE = 16
PP_EXTRA = ["--pp-size", "2", "--sleep-on-idle"]  # asleep when idle


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("sglang-pp")
    model = model_dir(root)
    base = free_port_run(9)  # the last three: the servers' rendezvous ports
    started: list[Any] = []
    try:
        reference = Server(model, "null", base, root, nccl_port=base + 6)
        prefill = Server(model, "prefill", base + 1, root, nccl_port=base + 7, bootstrap_port=base + 2,
                         page_size=PAGE_SIZE, extra=["--chunked-prefill-size", "64", *PP_EXTRA], env=tp_env(2))
        decode = Server(model, "decode", base + 3, root, nccl_port=base + 8, page_size=PAGE_SIZE, extra=PP_EXTRA,
                        env=tp_env(2))
        started += [reference, prefill, decode]
        deadline = time.monotonic() + 600
        for server in started:
            server.ready(deadline)
        router = Router(prefill, decode, base + 4, root, base + 5)
        started.append(router)
        router.ready(time.monotonic() + 300)
        yield {"reference": reference, "prefill": prefill, "decode": decode, "router": router}
    finally:
        stop_all(list(reversed(started)))


def test_pp2_into_pp2_token_exact(servers: dict[str, Any]) -> None:
    rng = random.Random(41)
    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in LENGTHS]
    assert_stages_token_exact(servers["reference"], servers["router"], servers["prefill"], servers["decode"],
                              prompts, NEW_TOKENS)

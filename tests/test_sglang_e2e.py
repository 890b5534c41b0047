"""Real SGLang servers with the datadist_aio transfer backend (``pytest -m sglang``).

One module-wide set of servers on loopback, started together: a server with
no disaggregation (the reference), a prefill server and a decode server
with ``--disaggregation-transfer-backend datadist_aio``, and sglang-router
in ``--pd-disaggregation`` mode in front of the pair. The tiny random Llama
of the vLLM tests, token ids in and out, greedy.

Needs SGLang's CPU environment (``.ci/run`` builds it in build/venv-sglang).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang_router")

from sglang_pd import Router, Server, free_port_run, generate, model_dir, pd_generate  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

NEW_TOKENS = 12
LENGTHS = [3, 17, 64, 65, 200, 511]


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 1024) for _ in range(length)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("sglang")
    model = model_dir(root)
    base = free_port_run(8)
    started: list[Any] = []
    try:
        reference = Server(model, "null", base, root)
        started.append(reference)
        prefill = Server(model, "prefill", base + 1, root, bootstrap_port=base + 2)
        started.append(prefill)
        decode = Server(model, "decode", base + 3, root)
        started.append(decode)
        deadline = time.monotonic() + 600
        for server in (prefill, decode, reference):
            server.ready(deadline)
        router = Router(prefill, decode, base + 4, root)
        started.append(router)
        router.ready(time.monotonic() + 120)
        yield {"reference": reference, "prefill": prefill, "decode": decode, "router": router, "root": root}
    finally:
        for process in reversed(started):
            process.stop()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(33)
    return [_prompt(rng, n) for n in LENGTHS]


@pytest.fixture(scope="module")
def references(servers: dict[str, Any], prompts: list[list[int]]) -> list[list[int]]:
    return [generate(servers["reference"].url, p, NEW_TOKENS)["output_ids"] for p in prompts]


def test_router_outputs_token_exact(servers: dict[str, Any], prompts: list[list[int]],
                                    references: list[list[int]]) -> None:
    """Every prompt through the router and the disaggregated pair: the single server's tokens."""
    outputs = [generate(servers["router"].url, p, NEW_TOKENS)["output_ids"] for p in prompts]
    for length, got, want in zip(LENGTHS, outputs, references):
        assert len(want) == NEW_TOKENS
        assert got == want, f"prompt of {length} tokens: {got} != {want}"
    # The decode server's transfers went through this backend and linked to the prefill.
    log = Path(servers["decode"].log_path).read_text(errors="replace")
    assert "datadist_aio: linked to the prefill" in log


def test_concurrent_requests_token_exact(servers: dict[str, Any], prompts: list[list[int]],
                                         references: list[list[int]]) -> None:
    """The same prompts all at once: batches on both servers, pulls in flight together."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(lambda p: generate(servers["router"].url, p, NEW_TOKENS)["output_ids"], prompts))
    assert outputs == references


def test_control_decode_follows_the_kv_it_was_handed(servers: dict[str, Any]) -> None:
    """A decode handed another prompt's KV continues that prompt, not its own: the bytes moved."""
    rng = random.Random(7)
    mine, theirs = _prompt(rng, 48), _prompt(rng, 48)
    want_mine = generate(servers["reference"].url, mine, NEW_TOKENS)["output_ids"]
    want_theirs = generate(servers["reference"].url, theirs, NEW_TOKENS)["output_ids"]
    assert want_mine != want_theirs
    _, decoded = pd_generate(servers["prefill"], servers["decode"], theirs, mine, rng.randrange(1 << 62),
                             NEW_TOKENS)
    assert decoded["output_ids"] == want_theirs

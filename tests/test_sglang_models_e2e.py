"""Real SGLang servers moving other models' KV than plain MHA (``pytest -m sglang``).

Per model, one set of servers on loopback (``two_prefills_into_one_decode``):
a server with no disaggregation (the reference), a prefill server of TP 1
and one of TP 2 (prefill chunks of 64 tokens), one decode server with
``--disaggregation-transfer-backend datadist_aio``, and a router in front
of each prefill and the decode. Token ids in and out, greedy.

- ``minicpm3``: multi-head latent attention (MLA). SGLang's CPU build runs
  MiniCPM3's latent attention with its ``torch_native`` backend
  (DeepSeek-V2's needs CPU kernels the published wheels lack): every
  layer's KV is one latent buffer, ``[page_size, kv_lora_rank + rope
  dim]``, the same on every attention TP rank, so the decode reads every
  page from the one prefill rank SGLang pairs it with. Pages of 4 tokens
  (the other module's pairs use 16).
- ``mellum``: a hybrid sliding-window model, layers of sliding-window
  attention (a window of 32 tokens) and of full attention, which SGLang
  keeps in two pools. The full layers' pages move chunk by chunk; the
  window layers' pages (the state SGLang hands a backend as
  ``StateType.SWA``: the last window's pages of each side's window pool)
  move with the last chunk; at TP 2 each prefill rank gives its KV head of
  every page. Pages of 16 tokens. Every request stays within the first
  window page-wise (prompt and new tokens under 48 positions): SGLang
  0.5.23's CPU attention (``torch_native``) reads the window layers' KV at
  the full pool's indices, right only while the two pools' indices
  coincide, and a disaggregated decode's part once a request's window has
  left its first page, whatever moved the bytes (SGLang's Mooncake backend
  gives the same tokens as this one there; docs/sglang.md).

Needs SGLang's CPU environment (``.ci/run`` builds it in build/venv-sglang).
"""

from __future__ import annotations

import concurrent.futures
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang_router")

from sglang_pd import (  # noqa: E402
    PAIRS,
    assert_decode_follows_handed_kv,
    generate,
    model_dir,
    two_prefills_into_one_decode,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

NEW_TOKENS = 12


@dataclass(frozen=True)
class Model:
    variant: str
    page_size: int
    lengths: tuple[int, ...]  # the prompts' lengths
    control_length: int
    registered: str  # what each engine's "registered" log line shows of the layout


MODELS = {
    "mla": Model("minicpm3", 4, (3, 17, 64, 65, 200, 511), 48, "page size 4, MLA latent"),
    # Within the window of 32 and just past it (the window's first page still holds all).
    "swa": Model("mellum", 16, (3, 17, 31, 35), 30, "; swa 4x"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest) -> Model:
    return MODELS[request.param]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, model: Model) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp(f"sglang-{model.variant}")
    with two_prefills_into_one_decode(model_dir(root, model.variant), root, model.page_size) as started:
        yield started


@pytest.fixture(scope="module")
def prompts(model: Model) -> list[list[int]]:
    rng = random.Random(41)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in model.lengths]


@pytest.fixture(scope="module")
def references(servers: dict[str, Any], prompts: list[list[int]]) -> list[list[int]]:
    return [generate(servers["reference"].url, p, NEW_TOKENS)["output_ids"] for p in prompts]


@pytest.mark.parametrize("pair", list(PAIRS))
def test_token_exact(servers: dict[str, Any], model: Model, prompts: list[list[int]],
                     references: list[list[int]], pair: str) -> None:
    """Every prompt through the pair's router, one at a time: the single server's tokens; every
    engine of the pair registered the model's buffers as such."""
    outputs = [generate(servers[pair].url, p, NEW_TOKENS)["output_ids"] for p in prompts]
    for length, got, want in zip(model.lengths, outputs, references):
        assert len(want) == NEW_TOKENS
        assert got == want, f"{model.variant}, {pair}, prompt of {length} tokens: {got} != {want}"
    for name in (PAIRS[pair], "decode"):
        log = Path(servers[name].log_path).read_text(errors="replace")
        registered = [line for line in log.splitlines() if "datadist_aio: " in line and " registered " in line]
        assert registered and all(model.registered in line for line in registered), registered


def test_concurrent_token_exact(servers: dict[str, Any], prompts: list[list[int]],
                                references: list[list[int]]) -> None:
    """Every prompt through both routers at once: the decode pulls from both prefills together."""
    jobs = [(pair, p) for pair in PAIRS for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outputs = list(pool.map(lambda job: generate(servers[job[0]].url, job[1], NEW_TOKENS)["output_ids"], jobs))
    assert outputs == references * len(PAIRS)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_control(servers: dict[str, Any], model: Model, pair: str) -> None:
    """A decode handed another prompt's KV continues that prompt: the bytes moved."""
    assert_decode_follows_handed_kv(servers["reference"], servers[PAIRS[pair]], servers["decode"], 43, NEW_TOKENS,
                                    length=model.control_length)

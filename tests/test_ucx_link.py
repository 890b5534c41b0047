"""Links with transport "ucx": what each end says when UCX is missing or the
peer does not speak it, and the inline path for device memory.

The transfer, layer-wise and peer-failure suites run over UCX too (their
"ucx" cases, and test_netns_ucx.py across namespaces); these are the cases
of their own. Skipped where UCX is not installed, but the first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import datadist_aio as dd
from support.peer import HAVE_UCX, UCX_WHY, PeerGroup, raises_status
from support.links import small_desc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cuda_standin.build import build  # noqa: E402

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINK_FAILED = dd.LLMStatusCode.LLM_LINK_FAILED
needs_ucx = pytest.mark.skipif(not HAVE_UCX, reason=f"no UCX: {UCX_WHY}")

INIT_WITHOUT_UCX = """
import datadist_aio as dd
config = dd.LLMConfig()
config.enable_cache_manager = True
config.transport = "ucx"
datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, 1)
try:
    datadist.init(config.generate_options())
except dd.LLMException as e:
    print(e.status_code.name)
    print(e)
else:
    print("initialised")
"""


def test_transport_ucx_without_ucx_refuses_init_and_says_why(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATADIST_AIO_UCX_")}
    env["DATADIST_AIO_UCX_PLUGIN"] = str(tmp_path / "libdatadist_ucx.so")
    done = subprocess.run([sys.executable, "-c", INIT_WITHOUT_UCX], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    status, message = done.stdout.strip().splitlines()[:2]
    assert status == "LLM_FEATURE_NOT_ENABLED"
    assert 'transport "ucx": UCX not found: there is no UCX plugin at ' + str(tmp_path) in message


def test_an_unknown_transport_is_refused() -> None:
    config = dd.LLMConfig()
    with raises_status(dd.LLMStatusCode.LLM_PARAM_INVALID) as refused:
        config.transport = "rdma"
    assert "'auto', 'tcp' or 'ucx'" in str(refused.value)


@needs_ucx
@pytest.mark.timeout(60)
@pytest.mark.parametrize("ucx_end", ["initiator", "acceptor"])
def test_a_ucx_end_links_only_with_a_ucx_peer(ucx_end: str) -> None:
    """Either end saying "ucx" to one that does not: the link is refused, and
    nothing is left half made (a link between two UCX ends works after)."""
    with PeerGroup() as group:
        ucx = {"transport": "ucx"}
        a = group.start("a", dd.LLMRole.PROMPT, 1, options=ucx if ucx_end == "initiator" else {})
        b = group.start("b", dd.LLMRole.DECODER, 2, options=ucx if ucx_end == "acceptor" else {})
        status, statuses = a.link(b)
        assert status == LINK_FAILED and statuses == [LINK_FAILED], (status, statuses)
        with raises_status(dd.LLMStatusCode.LLM_NOT_YET_LINK):
            a.datadist("link_transport", 2)
        c = group.start("c", dd.LLMRole.DECODER, 3, options=ucx)
        if ucx_end == "initiator":
            assert a.link(c) == (SUCCESS, [SUCCESS])
            assert a.datadist("link_transport", 3) == "ucx"


@pytest.fixture
def standin_env(tmp_path: Path) -> Iterator[str]:
    """The CUDA driver stand-in for the processes started in the test."""
    driver = build(tmp_path / "standin")
    saved = {k: os.environ.get(k) for k in ("DATADIST_AIO_CUDA_DRIVER", "STANDIN_CUDA_DEVICES")}
    os.environ["DATADIST_AIO_CUDA_DRIVER"] = str(driver)
    os.environ["STANDIN_CUDA_DEVICES"] = "1"
    yield str(driver)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@needs_ucx
@pytest.mark.timeout(60)
def test_device_memory_of_the_owner_goes_inline(standin_env: str) -> None:
    """The owner's cache in device memory (the CUDA driver stand-in), which
    its UCX does not reach: each UCX frame is answered so, sent again inline
    and staged there; every byte arrives both ways."""
    with PeerGroup() as group:
        ucx = {"transport": "ucx"}
        a = group.start("a", dd.LLMRole.PROMPT, 1, options=ucx)
        b = group.start("b", dd.LLMRole.DECODER, 2, options=ucx)
        assert a.link(b) == (SUCCESS, [SUCCESS])
        host = small_desc()
        device = dd.CacheDesc(host.num_tensors, host.shape, host.data_type, dd.Placement.DEVICE)
        local = a.allocate(host, blocks=True)
        remote = b.allocate(device, blocks=True, model_id=4)
        sent = a.fill(local, 7)
        assert a.cm_async("push_blocks", remote.blocks_key(), local, [1, 2, 7], [15, 0, 3]) == [SUCCESS]
        back = a.allocate(host, blocks=True)
        assert a.cm_async("pull_blocks", remote.blocks_key(), back, [15, 0, 3], [4, 5, 6]) == [SUCCESS]
        got = a.read(back)
        for t in range(2):
            for s, d in [(1, 4), (2, 5), (7, 6)]:
                np.testing.assert_array_equal(got[t][d * 256 : (d + 1) * 256], sent[t][s * 256 : (s + 1) * 256])
        stats = a.engine("link_stats", 2)
        assert stats["ucx_frames"] == 2 and stats["ucx_fallbacks"] == 2, stats
        assert b.engine("link_stats", 1)["ucx_bytes_served"] == 0

"""UCX links between "hosts": peers in network and PID namespaces of their own
(tests/support/netns.py), every end with ``transport`` "ucx".

The transfer and layer-wise cases of test_transfer.py and test_layerwise.py
run again on such links (collected here with this module's fixtures): the
owner reads or writes the initiator's memory with UCX through the veth pair,
and every case also checks that UCX moved the bytes. A peer killed
mid-transfer fails the transfer and is linked again once it is back. Skipped
where UCX or namespaces are missing.

UCX reads the routing table once per process, at its first reachability
check (UCX 1.22's netlink route cache), and a veth made after that has no
route in its copy: a process that has linked over UCX before (an earlier
test's engine) finds a newer namespace's peer unreachable ("no route to
10.213.N.2") from the very device it is pinned to. The peers here are
processes started after their veth; the prefill side of
test_each_kind_over_ucx is the test's own process, so those cases run in a
fresh pytest process of their own, and each case here reports its twin's
outcome there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

import datadist_aio as dd
from support.links import assert_blocks_push, small_desc, wait_for_path
from support.netns import NetnsGroup, NetnsPeer, Subnet, peer_killed_mid_transfer, unavailable
from support.peer import HAVE_UCX, UCX_WHY, Peer, raises_status
from test_layerwise import Prefill, each_kind, prefill_side
from test_layerwise import KINDS
from test_transfer import A, B, Pair
from test_transfer import test_many_concurrent_transfers_on_one_link as test_many_concurrent_transfers_on_one_link  # noqa: F401
from test_transfer import test_pull_blocks as test_pull_blocks  # noqa: F401
from test_transfer import test_pull_cache as test_pull_cache  # noqa: F401
from test_transfer import test_push_blocks as test_push_blocks  # noqa: F401
from test_transfer import test_push_cache as test_push_cache  # noqa: F401

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINKED = (SUCCESS, [SUCCESS])
LINK_LOST = (dd.LLMStatusCode.LLM_LINK_FAILED, dd.LLMStatusCode.LLM_TIMEOUT)
UCX = {"transport": "ucx"}
# Set in the fresh pytest process that runs test_each_kind_over_ucx's cases.
OWN_PROCESS_ENV = "DATADIST_AIO_TEST_UCX_OWN_PROCESS"
IN_OWN_PROCESS = os.environ.get(OWN_PROCESS_ENV) == "1"

pytestmark = [
    pytest.mark.skipif(unavailable() is not None, reason=f"no namespaces: {unavailable()}"),
    pytest.mark.skipif(not HAVE_UCX, reason=f"no UCX: {UCX_WHY}"),
    pytest.mark.timeout(60),
]


def _ucx_counts(a: Peer, b: Peer) -> tuple[int, int]:
    """Bytes UCX moved on the link (either end serving) and frames sent inline instead."""
    sa, sb = a.engine("link_stats", b.cluster_id), b.engine("link_stats", a.cluster_id)
    return sa["ucx_bytes_served"] + sb["ucx_bytes_served"], sa["ucx_fallbacks"] + sb["ucx_fallbacks"]


@pytest.fixture(scope="module", autouse=True)
def _ucx_over_the_veth() -> Iterator[None]:
    """UCX's TCP transport only, as between two hosts without RDMA: its shared
    memory would otherwise find the other end on this kernel."""
    saved = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp"
    yield
    if saved is None:
        del os.environ["UCX_TLS"]
    else:
        os.environ["UCX_TLS"] = saved


# -- the transfer cases of test_transfer.py ----------------------------------------------


@pytest.fixture(scope="module")
def netns_pair() -> Iterator[tuple[Peer, Peer]]:
    """A (cluster A) on this side of a veth pair, B in a namespace, linked by A over UCX."""
    with Subnet() as subnet, NetnsGroup() as group:
        a = group.start("a", dd.LLMRole.PROMPT, A, host=subnet.host_ip, options=UCX)
        b = group.start_in(subnet, "b", dd.LLMRole.DECODER, B, options=UCX)
        assert a.link(b) == LINKED
        assert a.datadist("link_transport", B) == "ucx"
        assert wait_for_path(b, A, "ucx")
        yield a, b


@pytest.fixture(params=["sync", "async"])
def pair(request, netns_pair) -> Iterator[Pair]:
    a, b = netns_pair
    moved, _ = _ucx_counts(a, b)
    yield Pair(a, b, request.param)
    now, inline = _ucx_counts(a, b)
    assert now > moved and inline == 0, (moved, now, inline)
    a.free_all()
    b.free_all()


@pytest.fixture
def async_pair(netns_pair) -> Iterator[Pair]:
    a, b = netns_pair
    yield Pair(a, b, "async")
    a.free_all()
    b.free_all()


# -- the layer-wise cases of test_layerwise.py -------------------------------------------


@pytest.fixture(scope="module")
def netns_decoders() -> Iterator[Optional[tuple[Subnet, NetnsPeer, NetnsPeer]]]:
    """The decode processes B and C over UCX in one network namespace, each in
    a PID namespace of its own; None outside the process of its own."""
    if not IN_OWN_PROCESS:
        yield None
        return
    with Subnet() as subnet, NetnsGroup() as group:
        b = group.start_in(subnet, "b", dd.LLMRole.DECODER, 2, options=UCX)
        c = group.start_in(subnet, "c", dd.LLMRole.DECODER, 3, options=UCX)
        yield subnet, b, c


@pytest.fixture(params=["key", "raw"])
def ucx_prefill(request: pytest.FixtureRequest, netns_decoders) -> Iterator[Optional[Prefill]]:
    """This process as the prefill side, linked to B and C over UCX, its UCX
    on this side's veth (as every peer of support/peer.py pins its own: a
    UCX before the wheel's may pick another namespace's address otherwise).
    None outside the process of its own (the module's docstring says why)."""
    if netns_decoders is None:
        yield None
        return
    subnet, b, c = netns_decoders
    saved = os.environ.get("UCX_NET_DEVICES")
    os.environ["UCX_NET_DEVICES"] = subnet.host_link
    try:
        with prefill_side(request.param + "-ucx", [b, c], local=subnet.host_ip) as side:
            yield side
    finally:
        if saved is None:
            del os.environ["UCX_NET_DEVICES"]
        else:
            os.environ["UCX_NET_DEVICES"] = saved


@pytest.fixture(scope="module")
def own_process_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Runs every case of test_each_kind_over_ucx in a fresh pytest process;
    returns each case's outcome there ("passed", "failure", "error" or
    "skipped") and its message, by the case's name."""
    report = tmp_path_factory.mktemp("ucx-own-process") / "junit.xml"
    here = Path(__file__).resolve()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               f"{here}::test_each_kind_over_ucx"]
    done = subprocess.run(command, cwd=here.parent.parent, env=os.environ | {OWN_PROCESS_ENV: "1"},
                          capture_output=True, text=True, timeout=540)
    output = (done.stdout + done.stderr)[-4000:]
    outcomes: dict[str, tuple[str, str]] = {}
    try:
        cases = list(ET.parse(report).iter("testcase"))
    except (OSError, ET.ParseError):
        cases = []  # every case then fails with the process's output
    for case in cases:
        for verdict in case:
            if verdict.tag in ("failure", "error", "skipped"):
                text = f"{verdict.get('message', '')}\n{verdict.text or ''}"
                outcomes[case.get("name", "")] = (verdict.tag, text)
                break
        else:
            outcomes.setdefault(case.get("name", ""), ("passed", ""))
    outcomes[""] = (f"exit {done.returncode}", output)
    return outcomes


# In the process of its own, each case's own limit; here, the first case waits for all of them.
@pytest.mark.timeout(60 if IN_OWN_PROCESS else 600)
@pytest.mark.parametrize("kind", list(KINDS))
async def test_each_kind_over_ucx(request: pytest.FixtureRequest, ucx_prefill: Optional[Prefill],
                                  kind: str) -> None:
    if ucx_prefill is None:
        outcomes = request.getfixturevalue("own_process_outcomes")
        name = request.node.name
        if name not in outcomes:
            pytest.fail(f"its own process did not run {name} ({outcomes[''][0]}):\n{outcomes[''][1]}", pytrace=False)
        verdict, message = outcomes[name]
        if verdict == "skipped":
            pytest.skip(f"in its own process: {message.strip()}")
        if verdict != "passed":
            pytest.fail(f"in its own process ({verdict}): {message}", pytrace=False)
        return
    await each_kind(ucx_prefill, kind)
    stats = ucx_prefill.datadist._engine.link_stats(B)
    assert stats["ucx_frames"] > 0 and stats["ucx_fallbacks"] == 0, stats


# -- a peer killed mid-transfer ------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("direction", ["push", "pull"])
def test_peer_killed_mid_transfer(direction):
    peer_killed_mid_transfer(direction, UCX, UCX, "ucx")


def test_a_peer_killed_between_operations_fails_the_next_and_links_again():
    """The peer dies with nothing in flight: the next operation toward it
    fails at once (the link's connections tell before UCX does), a
    bystander's link is untouched, and the cluster links again once back."""
    with Subnet() as subnet, NetnsGroup() as group:
        survivor = group.start("survivor", dd.LLMRole.PROMPT, 1, host=subnet.host_ip,
                               options=UCX | {"sync_kv_timeout": 3000})
        victim = group.start_in(subnet, "victim", dd.LLMRole.DECODER, 2, options=UCX)
        third = group.start_in(subnet, "third", dd.LLMRole.DECODER, 3, options=UCX)
        assert survivor.link(victim) == LINKED
        assert survivor.link(third) == LINKED
        assert_blocks_push(survivor, victim, 6, 1)
        local, remote = survivor.allocate(small_desc(), blocks=True), victim.allocate(small_desc(), blocks=True, model_id=9)
        survivor.fill(local, 2)
        victim.kill()
        started = time.monotonic()
        # The link failed, or is already gone once its connections told.
        with raises_status(*LINK_LOST, dd.LLMStatusCode.LLM_NOT_YET_LINK):
            survivor.cm_async("push_blocks", remote.blocks_key(), local, [0], [1])
        assert time.monotonic() - started < 3 + 10  # sync_kv_timeout, and slack for a loaded host
        assert_blocks_push(survivor, third, 7, 2)
        again = group.start_in(subnet, "victim-again", dd.LLMRole.DECODER, 2, options=UCX)
        assert survivor.link(again) == LINKED
        assert survivor.datadist("link_transport", 2) == "ucx"
        assert_blocks_push(survivor, again, 8, 3)
        assert_blocks_push(again, survivor, 9, 4)
        assert again.engine("link_stats", 1)["ucx_bytes_served"] > 0
        assert survivor.engine("link_stats", 2)["ucx_bytes_served"] > 0


# -- transport "auto" -----------------------------------------------------------------------


def _rdma_here() -> bool:
    return any(not name.startswith(".") for name in (os.listdir("/sys/class/infiniband")
                                                     if os.path.isdir("/sys/class/infiniband") else []))


@pytest.mark.parametrize("offered", ["1", None])
def test_auto_takes_ucx_to_another_host_where_both_offer_it(monkeypatch, offered):
    """Transport "auto" (every end here): the same-host path to a peer on
    this host, UCX to one in other namespaces where both ends offer UCX
    (DATADIST_AIO_UCX_AUTO=1 makes them offer it over tcp; by default only
    over RDMA), and TCP otherwise; the bytes arrive whichever it is."""
    if offered is None:
        if _rdma_here():
            pytest.skip("this host has an RDMA device: auto offers UCX by default")
        monkeypatch.delenv("DATADIST_AIO_UCX_AUTO", raising=False)
    else:
        monkeypatch.setenv("DATADIST_AIO_UCX_AUTO", offered)
    with Subnet() as subnet, NetnsGroup() as group:
        # Each end's UCX on its end of the pair only: a UCX worker's address
        # names every interface its process saw, the veths of other subnets
        # too, and UCX 1.13 gives up on the first it cannot reach.
        monkeypatch.setenv("UCX_NET_DEVICES", subnet.host_link)
        a = group.start("a", dd.LLMRole.PROMPT, 1, host=subnet.host_ip)
        monkeypatch.setenv("UCX_NET_DEVICES", subnet.peer_link)
        far = group.start_in(subnet, "far", dd.LLMRole.DECODER, 2)
        monkeypatch.setenv("UCX_NET_DEVICES", subnet.host_link)
        near = group.start("near", dd.LLMRole.DECODER, 3, host=subnet.host_ip)
        assert a.link(far) == LINKED
        assert a.link(near) == LINKED
        expected = "ucx" if offered else "tcp"
        assert a.datadist("link_transport", 2) == expected
        assert wait_for_path(far, 1, expected)
        assert a.datadist("link_transport", 3) == "same_host"
        before, _ = _ucx_counts(a, far)
        assert_blocks_push(a, far, 6, 1)
        assert_blocks_push(a, near, 7, 2)
        moved, inline = _ucx_counts(a, far)
        assert (moved > before) == (offered is not None) and inline == 0, (before, moved, inline)

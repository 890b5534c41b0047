"""Links between "hosts": peers in network and PID namespaces of their own (tests/support/netns.py).

A peer in another PID namespace fails the same-host proof, so every link
here runs over TCP through a veth pair even with ``transport`` left at
"auto". The transfer and layer-wise cases of test_transfer.py and
test_layerwise.py run again on such links (collected here with this
module's fixtures), and a peer killed mid-transfer fails the transfer and is
linked again once it is back.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

import datadist_aio as dd
from support.links import wait_for_path
from support.netns import NetnsGroup, NetnsPeer, Subnet, peer_killed_mid_transfer, unavailable
from support.peer import Peer, PeerError
from test_layerwise import Prefill, prefill_side
from test_layerwise import test_each_kind as test_each_kind  # noqa: F401
from test_layerwise import test_fan_out_to_two_decode_processes as test_fan_out_to_two_decode_processes  # noqa: F401
from test_transfer import A, B, Pair
from test_transfer import test_many_concurrent_transfers_on_one_link as test_many_concurrent_transfers_on_one_link  # noqa: F401
from test_transfer import test_pull_blocks as test_pull_blocks  # noqa: F401
from test_transfer import test_pull_cache as test_pull_cache  # noqa: F401
from test_transfer import test_push_blocks as test_push_blocks  # noqa: F401
from test_transfer import test_push_cache as test_push_cache  # noqa: F401

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINKED = (SUCCESS, [SUCCESS])
LINK_LOST = (dd.LLMStatusCode.LLM_LINK_FAILED, dd.LLMStatusCode.LLM_TIMEOUT)

pytestmark = [
    pytest.mark.skipif(unavailable() is not None, reason=f"no namespaces: {unavailable()}"),
    pytest.mark.timeout(60),
]


def _gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie its new parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _ns(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


# -- the transfer cases of test_transfer.py ----------------------------------------------


@pytest.fixture(scope="module")
def netns_pair() -> Iterator[tuple[Peer, Peer]]:
    """A (cluster A) on this side of a veth pair, B in a namespace, linked by A
    with ``transport`` at "auto": TCP at both ends."""
    with Subnet() as subnet, NetnsGroup() as group:
        a = group.start("a", dd.LLMRole.PROMPT, A, host=subnet.host_ip, options={"transport": "auto"})
        b = group.start_in(subnet, "b", dd.LLMRole.DECODER, B, options={"transport": "auto"})
        assert a.link(b) == LINKED
        assert a.datadist("link_transport", B) == "tcp"
        assert wait_for_path(b, A, "tcp")
        yield a, b


@pytest.fixture(params=["sync", "async"])
def pair(request, netns_pair) -> Iterator[Pair]:
    a, b = netns_pair
    yield Pair(a, b, request.param)
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
def netns_decoders() -> Iterator[tuple[Subnet, NetnsPeer, NetnsPeer]]:
    """The decode processes B and C in one network namespace, each in a PID namespace of its own."""
    with Subnet() as subnet, NetnsGroup() as group:
        b = group.start_in(subnet, "b", dd.LLMRole.DECODER, 2)
        c = group.start_in(subnet, "c", dd.LLMRole.DECODER, 3)
        yield subnet, b, c


@pytest.fixture
def prefill(request: pytest.FixtureRequest, netns_decoders) -> Iterator[Prefill]:
    """This process as the prefill side, linked to B and C over TCP whatever the mode asks."""
    subnet, b, c = netns_decoders
    with prefill_side(getattr(request, "param", "key"), [b, c], local=subnet.host_ip, path="tcp") as side:
        yield side


# -- the harness ---------------------------------------------------------------------------


def test_peer_runs_in_namespaces_of_its_own(netns_pair):
    a, b = netns_pair
    assert _ns(b.pid, "net") != _ns(os.getpid(), "net")
    assert _ns(b.pid, "pid") != _ns(os.getpid(), "pid")
    assert _ns(a.pid, "net") == _ns(os.getpid(), "net")
    # B's link to A is the same link, seen from the accepting end.
    assert b.datadist("link_transport", A) == "tcp"


def test_everything_is_removed_when_a_test_fails():
    subnet = Subnet()
    peers = NetnsGroup()
    with pytest.raises(RuntimeError, match="the test failed"):
        with subnet, peers:
            peer = peers.start_in(subnet, "doomed", dd.LLMRole.DECODER, 9)
            pid = peer.pid
            assert subnet.exists() and os.path.exists(f"/proc/{pid}")
            raise RuntimeError("the test failed")
    assert not subnet.exists()
    assert _gone(pid)
    with pytest.raises(PeerError, match="not running"):
        peer.listen_port


def test_closing_a_namespace_kills_what_runs_in_it():
    with Subnet() as subnet, NetnsPeer(subnet, "orphan") as peer:
        peer.start(dd.LLMRole.DECODER, 9)
        pid = peer.pid
        subnet.close()
        assert not subnet.exists()
        deadline = time.monotonic() + 5
        while peer._process.is_alive():
            assert time.monotonic() < deadline, "the peer outlived its namespace"
            time.sleep(0.01)
        assert _gone(pid)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert subnet.name not in listed


# -- a peer killed mid-transfer ------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("direction", ["push", "pull"])
def test_peer_killed_mid_transfer(direction):
    peer_killed_mid_transfer(direction, {"transport": "auto"}, {}, "tcp")



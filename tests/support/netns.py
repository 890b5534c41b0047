"""Peers on another "host": a network namespace and a PID namespace of their own.

``Subnet`` makes a network namespace joined to the caller's by a veth pair
with two addresses of a private /24 (``host_ip`` on the caller's side,
``peer_ip`` inside). ``NetnsPeer`` is ``peer.Peer`` with its child in that
namespace and in a new PID namespace, so that its links with the caller's
side fail the same-host proof (the process id it announces names no process
here) and run over TCP through the veth pair, as between two machines.

The child is ``ip netns exec NS unshare --pid --kill-child --mount-proc
python -c ...`` running ``netns.child(FD)``, the same ``peer._child_main`` over a socket pair;
it is SIGKILLed when the test process dies (``setpriv --pdeathsig``, then
``unshare --kill-child``). ``Subnet.close`` kills whatever still runs in the
namespace and deletes it, which deletes the veth pair; namespaces left by a
process that no longer exists are deleted by the next ``Subnet``. Needs
root, ``ip``, ``unshare`` and ``setpriv``; ``unavailable()`` says why not.

``Joined`` makes two namespaces joined to each other (not to this one) by a
veth pair, and ``spawn_in_netns`` starts a child in either of them, for two
peers that both run on another "host" (benchmarks/bench_vllm_link.py).
"""

from __future__ import annotations

import ipaddress
import itertools
import multiprocessing.connection
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Optional

import datadist_aio as dd
from support.links import assert_blocks_push, kill_mid_transfer
from support.peer import MiB, Peer, PeerGroup, pool_cfg

__all__ = ["Joined", "NetnsGroup", "NetnsPeer", "Subnet", "peer_killed_mid_transfer", "spawn_in", "spawn_in_netns",
           "unavailable"]

# 10.213.N.0/24, N from 1 to 254: one subnet per namespace.
_PREFIX = "10.213"
_NAME = re.compile(r"^ddaio-(\d+)-(\d+)$")
_counter = itertools.count()
_TOOL_TIMEOUT = 60.0  # generous: `ip` once took over 10 s at a load of 20 on 2 cores
_unavailable: Optional[str] = None
_probed = False


def _ip(*args: str, netns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=_TOOL_TIMEOUT)
    if check and result.returncode != 0:
        raise OSError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here (a skip reason), or None if they can.

    Decided once per process: a namespace and a veth pair are made and deleted.
    """
    global _unavailable, _probed
    if not _probed:
        _probed = True
        _unavailable = _probe()
    return _unavailable


def _probe() -> Optional[str]:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces and veth pairs needs root"
    missing = [tool for tool in ("ip", "unshare", "setpriv") if shutil.which(tool) is None]
    if missing:
        return f"not installed: {', '.join(missing)}"
    try:
        with Subnet():
            pass
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot make a network namespace with a veth pair: {exc}"
    return None


def _sweep() -> None:
    """Deletes the namespaces (and veth pairs) of processes that no longer exist."""
    listed = _ip("netns", "list", check=False).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _kill_inside(name)
            _ip("netns", "delete", name, check=False)
    links = _ip("-o", "link", "show", check=False).stdout
    for link, pid in re.findall(r"^\d+: (ddv(\d+)x\d+h)@", links, re.MULTILINE):
        if not os.path.exists(f"/proc/{pid}"):
            _ip("link", "delete", link, check=False)


def _kill_inside(netns: str) -> None:
    """SIGKILLs every process in the namespace and waits (bounded) until none is left."""
    deadline = time.monotonic() + _TOOL_TIMEOUT
    while True:
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise OSError(f"processes {pids} in {netns} survived SIGKILL for {_TOOL_TIMEOUT:g} s")
        time.sleep(0.01)


class Subnet:
    """A network namespace joined to this one by a veth pair; a context manager that deletes it.

    Attributes:
        name: The namespace's name (``ip netns``).
        host_ip: The address on this side of the pair.
        peer_ip: The address inside the namespace.
    """

    def __init__(self) -> None:
        _sweep()
        k = next(_counter)
        self.name = f"ddaio-{os.getpid()}-{k}"
        self._link = f"ddv{os.getpid()}x{k}h"
        self._inner = f"ddv{os.getpid()}x{k}n"
        network = self._free_network(k)
        self.host_ip, self.peer_ip = str(network[1]), str(network[2])
        self._closed = False
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self._link, "type", "veth", "peer", "name", self._inner)
            _ip("link", "set", self._inner, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self._link)
            _ip("link", "set", self._link, "up")
            _ip("addr", "add", f"{self.peer_ip}/24", "dev", self._inner, netns=self.name)
            _ip("link", "set", self._inner, "up", netns=self.name)
            _ip("link", "set", "lo", "up", netns=self.name)
        except BaseException:
            self.close()
            raise

    @property
    def host_link(self) -> str:
        """The name of this side's end of the veth pair."""
        return self._link

    @property
    def peer_link(self) -> str:
        """The name of the end inside the namespace."""
        return self._inner

    @staticmethod
    def _free_network(k: int) -> ipaddress.IPv4Network:
        taken = _ip("-4", "-o", "addr", "show", check=False).stdout
        start = (os.getpid() + k) % 254
        for i in range(254):
            network = ipaddress.IPv4Network(f"{_PREFIX}.{(start + i) % 254 + 1}.0/24")
            if f" {_PREFIX}.{network.network_address.packed[2]}." not in taken:
                return network
        raise OSError(f"every subnet of {_PREFIX}.0.0/16 is in use")

    def close(self) -> None:
        """Kills every process in the namespace and deletes it and the veth pair; safe to repeat."""
        if self._closed:
            return
        self._closed = True
        try:
            _kill_inside(self.name)
        finally:
            # Deleting one end of the pair deletes both at once; the
            # namespace's own teardown is deferred by the kernel.
            _ip("link", "delete", self._link, check=False)
            _ip("netns", "delete", self.name, check=False)

    def exists(self) -> bool:
        """Whether the namespace or this side of the veth pair is still there."""
        listed = _ip("netns", "list", check=False).stdout.split()
        return self.name in listed or _ip("link", "show", self._link, check=False).returncode == 0

    def __enter__(self) -> "Subnet":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class Joined:
    """Two network namespaces joined to each other by one veth pair, and to
    nothing else; a context manager that deletes both.

    The pair is made inside the namespaces (never in this one), so deleting
    them deletes it; namespaces left by a process that no longer exists are
    deleted by the next ``Subnet`` or ``Joined`` (their names are a
    ``Subnet``'s).

    Attributes:
        names: The two namespaces' names (``ip netns``).
        ips: The address of each namespace's end of the pair.
        links: The name of each namespace's end of the pair.
    """

    def __init__(self) -> None:
        _sweep()
        first, second = next(_counter), next(_counter)
        pid = os.getpid()
        self.names = (f"ddaio-{pid}-{first}", f"ddaio-{pid}-{second}")
        self.links = (f"ddv{pid}x{first}a", f"ddv{pid}x{first}b")
        network = Subnet._free_network(first)
        self.ips = (str(network[1]), str(network[2]))
        self._made: list[str] = []
        try:
            for name in self.names:
                _ip("netns", "add", name)
                self._made.append(name)
            _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1], "netns", self.names[1],
                netns=self.names[0])
            for name, link, address in zip(self.names, self.links, self.ips):
                _ip("addr", "add", f"{address}/24", "dev", link, netns=name)
                _ip("link", "set", link, "up", netns=name)
                _ip("link", "set", "lo", "up", netns=name)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kills every process in both namespaces and deletes them (and the pair); safe to repeat."""
        made, self._made = self._made, []
        try:
            for name in made:
                _kill_inside(name)
        finally:
            for name in made:
                _ip("netns", "delete", name, check=False)

    def __enter__(self) -> "Joined":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class _Launched:
    """The ``multiprocessing.Process`` face of the ``unshare`` process that runs the child.

    ``pid`` is the child's (in this PID namespace), the one to signal; the
    sentinel is ready once ``unshare`` has exited, which it does when the
    child does.
    """

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.sentinel = os.pidfd_open(popen.pid)
        self._child: Optional[int] = None

    @property
    def pid(self) -> int:
        if self._child is None:
            try:
                with open(f"/proc/{self._popen.pid}/task/{self._popen.pid}/children") as children:
                    found = children.read().split()
            except OSError:
                found = []
            if not found:  # not forked yet, or gone: unshare takes the child with it
                return self._popen.pid
            self._child = int(found[0])
        return self._child

    @property
    def exitcode(self) -> Optional[int]:
        return self._popen.returncode

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()

    def close(self) -> None:
        """Closes the sentinel; safe to repeat."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def spawn_in(subnet: Subnet, argv: list[str]) -> tuple[_Launched, multiprocessing.connection.Connection]:
    """Runs ``python *argv FD`` in ``subnet``'s network namespace and a new PID
    namespace; FD is the child's end of a socket pair (for
    ``multiprocessing.connection.Connection``). Returns the process and this
    side's connection."""
    return spawn_in_netns(subnet.name, argv)


def spawn_in_netns(netns: str, argv: list[str]) -> tuple[_Launched, multiprocessing.connection.Connection]:
    """``spawn_in`` for the network namespace named ``netns`` (one of ``Joined``'s)."""
    ours, theirs = socket.socketpair()
    command = [
        "setpriv", "--pdeathsig", "KILL", "--",
        "ip", "netns", "exec", netns,
        "unshare", "--pid", "--kill-child", "--mount-proc",
        sys.executable, *argv, str(theirs.fileno()),
    ]  # fmt: skip
    try:
        popen = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return _Launched(popen), multiprocessing.connection.Connection(ours.detach())


class NetnsPeer(Peer):
    """``Peer`` with its child in ``subnet``'s network namespace and a PID namespace of its own.

    It listens on ``subnet.peer_ip``; peers on this side that link with it
    must listen on (and link from) ``subnet.host_ip``.
    """

    def __init__(self, subnet: Subnet, name: str = "peer", command_timeout: float = 30.0) -> None:
        super().__init__(name, command_timeout)
        self.subnet = subnet

    def start(self, role: dd.LLMRole, cluster_id: int, **kwargs: Any) -> "NetnsPeer":
        kwargs.setdefault("host", self.subnet.peer_ip)
        super().start(role, cluster_id, **kwargs)
        return self

    def _spawn(self, args: tuple[Any, ...]) -> tuple[Any, multiprocessing.connection.Connection]:
        tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = f"import sys; sys.path.insert(0, {tests!r}); from support import netns; netns.child(int(sys.argv[1]))"
        launched, conn = spawn_in(self.subnet, ["-c", code])
        conn.send(args)
        return launched, conn


class NetnsGroup(PeerGroup):
    """``PeerGroup`` that also starts peers in namespaces (``start_in``)."""

    def start_in(self, subnet: Subnet, name: str, role: dd.LLMRole, cluster_id: int, **kwargs: Any) -> NetnsPeer:
        peer = NetnsPeer(subnet, name)
        self.peers.append(peer)
        return peer.start(role, cluster_id, **kwargs)


def child(fd: int) -> None:
    """A NetnsPeer's process: serves the peer's commands on descriptor ``fd``."""
    from support import peer

    conn = multiprocessing.connection.Connection(fd)
    peer._child_main(conn, *conn.recv())


# -- a scenario both namespace suites run --------------------------------------------------

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINKED = (SUCCESS, [SUCCESS])


def peer_killed_mid_transfer(direction: str, survivor_options: dict, peer_options: dict, path: str) -> None:
    """A push or pull from this side of the veth killed by its peer's death:
    it fails within the timeout, a bystander's link carries on, and the
    cluster links again once back (each link on ``path``)."""
    timeout_ms = 3000
    big = {"host_mem_pool_cfg": pool_cfg(288 * MiB)}
    with Subnet() as subnet, NetnsGroup() as group:
        options = big | survivor_options | {"sync_kv_timeout": timeout_ms}
        survivor = group.start("survivor", dd.LLMRole.PROMPT, 1, host=subnet.host_ip, options=options)
        victim = group.start_in(subnet, "victim", dd.LLMRole.DECODER, 2, options=big | peer_options)
        third = group.start_in(subnet, "third", dd.LLMRole.DECODER, 3, options=peer_options)
        assert survivor.link(victim) == LINKED
        assert survivor.link(third) == LINKED
        assert survivor.datadist("link_transport", 2) == path
        assert survivor.datadist("link_transport", 3) == path
        kill_mid_transfer(survivor, victim, third, direction, timeout_ms)

        # The same cluster comes back in the namespace on another port and is linked again.
        again = group.start_in(subnet, "victim-again", dd.LLMRole.DECODER, 2, options=peer_options)
        assert survivor.link(again) == LINKED
        assert survivor.datadist("link_transport", 2) == path
        assert_blocks_push(survivor, again, 7, 3)
        assert_blocks_push(again, survivor, 8, 4)


"""How a decode worker reaches the prefill instances it reads from.

On a prefill instance's first use the decode worker says hello to one of its
ranks over the side channel (who it is, its KV layout), and with pipeline
stages to one rank of every further stage, maps those layouts onto its own
(``layout.map_stages``: another TP size, another block size, another split
of the layers), and links to each rank it reads from. The worker of stage
``s`` and TP rank ``r`` of a prefill of TP size ``T`` listens on the base
port plus ``s * T + r``. The result, a ``Route``, is the same
for every later load from that instance. Everything here runs on the
connector's loop thread, but ``contact_now`` (below) and ``poll_claims``.

Several loads may need the same prefill rank at once (a step's loads, or
two steps' loads while the first link is still being made): each rank's
hello and link are made once, under that rank's lock, and every load waits
for the same result. A failure drops the rank's peer only if it is still
the one the failed load used: a load that failed on an old link never tears
down the link a later load made.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import datadist_aio as dd

from ..message_guard import UNSEALED, MessageGuard
from .claims import ClaimChannel
from .layout import HeadMap, LayoutError, WorkerLayout, map_stages
from .side_channel import SideChannelClient, ask

__all__ = ["Peer", "Route", "Router", "Source", "instance_of", "port_of"]

log = logging.getLogger(__name__)

# A prefill instance: host, base side-channel port (its rank 0's), TP size.
Instance = tuple[str, int, int]


def instance_of(host: str, port: int, tp_size: int) -> Instance:
    return host, port, max(1, tp_size)


@dataclass
class Peer:
    """A prefill worker this decode side reads from."""

    client: SideChannelClient
    lock: asyncio.Lock
    cluster_id: int = 0
    listen_port: int = 0
    layout: Optional[WorkerLayout] = None
    cluster: Optional[dd.LLMClusterInfo] = None
    linked: bool = False
    # Where the reads' lease claims go (claims.py), opened with the link.
    claims: Optional[ClaimChannel] = None


@dataclass(frozen=True)
class Source:
    """One prefill rank this decode worker reads from, and what it reads."""

    port: int
    cluster_id: int
    head_map: HeadMap
    layout: WorkerLayout
    peer: Peer


@dataclass(frozen=True)
class Route:
    """How this decode worker reads a prefill instance: the same for every load."""

    sources: tuple[Source, ...]
    mine: WorkerLayout

    @property
    def staged(self) -> bool:
        """Whether either instance has pipeline stages (each source then moves a slice of the layers)."""
        return any(source.head_map.layers is not None for source in self.sources)

    @property
    def notice_source(self) -> Source:
        """The rank a decode-first request's expect (and cancel) goes to: the first of the last stage read,
        whose forward of a request ends after every earlier stage's (without stages, the first source)."""
        last = max(source.head_map.stage for source in self.sources)
        return next(source for source in self.sources if source.head_map.stage == last)


def port_of(base: int, tp_size: int, stage: int, rank: int) -> int:
    """The side channel of a prefill's stage ``stage``, TP rank ``rank``."""
    return base + stage * tp_size + rank


class Router:
    """The prefill ranks a decode worker knows, and the routes to their instances.

    ``routes`` is read from vLLM's worker thread (a dict lookup) and written
    on the loop thread, or by ``contact_now`` on the worker thread for an
    instance the loop thread is not contacting.
    """

    def __init__(self, datadist: dd.LLMDataDist, mine: WorkerLayout, *, hello_timeout_s: float,
                 link_timeout_ms: int, guard: MessageGuard = UNSEALED) -> None:
        self._datadist = datadist
        self.guard: MessageGuard = guard
        self._mine = mine
        self._hello_timeout_s = hello_timeout_s
        self._link_timeout_ms = link_timeout_ms
        self.peers: dict[tuple[str, int], Peer] = {}
        self.routes: dict[Instance, Route] = {}
        # The instances whose first contact is under way on the loop thread
        # (how many route() calls), and the one contact_now is making.
        self._guard = threading.Lock()
        self._contacting: dict[Instance, int] = {}
        # The instances contact_now gave up on, until the loop thread's
        # route() for them ends: the other loads of the step wait for that
        # one, none spends its own budget again.
        self._given_up: set[Instance] = set()
        # Each instance's pipeline stages, once a hello said (kept after a
        # failure: its releases still go to every stage).
        self._stages: dict[Instance, int] = {}

    def ports(self, key: Instance) -> list[int]:
        """The side channels of every worker of the prefill instance ``key`` (its stages where known)."""
        host, base, ranks = key
        return [base + index for index in range(ranks * self._stages.get(key, 1))]

    async def route(self, key: Instance) -> Route:
        """How to read the prefill instance ``key``: hello to one of its ranks,
        the mapping of its layout onto this worker's, a link to each rank it
        names. ``LayoutError`` where the layouts do not map."""
        route = self.routes.get(key)
        if route is not None:
            return route
        with self._guard:
            self._contacting[key] = self._contacting.get(key, 0) + 1
        try:
            return await self._route(key)
        finally:
            with self._guard:
                self._contacting[key] -= 1
                if not self._contacting[key]:
                    del self._contacting[key]
                self._given_up.discard(key)

    def _stage_layouts(self, key: Instance, first: WorkerLayout) -> int:
        """Checks the first hello's layout against the instance's key; how many stages it has."""
        host, base, ranks = key
        if first.tp_size != ranks:
            raise LayoutError(f"{host}:{base} announced TP size {ranks} but its rank {first.tp_rank} "
                              f"says {first.tp_size}")
        if first.pp_rank != 0:
            raise LayoutError(f"{host}:{base} is the base port of a prefill, whose worker there is of stage 0; "
                              f"it says PP stage {first.pp_rank} of {first.pp_size}")
        self._stages[key] = first.pp_size
        return first.pp_size

    @staticmethod
    def _check_rank(host: str, base: int, stage: WorkerLayout, rank: int, layout: Optional[WorkerLayout]) -> None:
        if layout != dataclasses.replace(stage, tp_rank=rank):
            raise LayoutError(f"rank {rank} of stage {stage.pp_rank} of the prefill at {host}:{base} "
                              f"({layout.describe() if layout else 'no layout'}) differs from its rank "
                              f"{stage.tp_rank} ({stage.describe()})")

    async def _route(self, key: Instance) -> Route:
        host, base, ranks = key
        mine = self._mine
        first = await self.peer(host, base + mine.tp_rank % ranks, link=False)
        assert first.layout is not None
        stages = {0: first.layout}
        for stage in range(1, self._stage_layouts(key, first.layout)):
            peer = await self.peer(host, port_of(base, ranks, stage, mine.tp_rank % ranks), link=False)
            assert peer.layout is not None
            stages[stage] = peer.layout
        maps = map_stages(mine, stages)
        sources = []
        for (stage, rank), head_map in maps.items():
            port = port_of(base, ranks, stage, rank)
            peer = await self.peer(host, port)
            self._check_rank(host, base, stages[stage], rank, peer.layout)
            assert peer.layout is not None
            sources.append(Source(port, peer.cluster_id, head_map, peer.layout, peer))
        route = self.routes[key] = Route(tuple(sources), mine)
        return route

    def contact_now(self, key: Instance, budget_s: float) -> Optional[Route]:
        """The route to ``key`` made in the calling thread within ``budget_s``
        (hellos, links, claim channels), where nothing of that instance is
        known yet and the loop thread is not contacting it; None otherwise,
        past the budget, or on any failure (what it made is undone: the loop
        thread's ``route`` then contacts the instance and reports why; until
        it has, this returns None at once for that instance)."""
        host, base, ranks = key
        ports = self.ports(key)
        with self._guard:
            route = self.routes.get(key)
            if (route is not None or key in self._contacting or key in self._given_up
                    or any((host, port) in self.peers for port in ports)):
                return route
            self._contacting[key] = 1
        deadline = time.monotonic() + budget_s
        peers: dict[int, Peer] = {}
        linked: list[dd.LLMClusterInfo] = []
        try:
            mine = self._mine

            def left() -> float:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"first contact over its budget of {budget_s * 1e3:g} ms")
                return remaining

            def hello(port: int) -> Peer:
                answer = ask(host, port, {"op": "hello"}, left(), self.guard)
                cluster_id, listen_port = answer.get("cluster_id"), answer.get("port")
                if not isinstance(cluster_id, int) or not isinstance(listen_port, int):
                    raise ValueError(f"{host}:{port} answered hello with {answer!r:.200}")
                peer = Peer(SideChannelClient(host, port, self.guard), asyncio.Lock(), cluster_id, listen_port,
                            WorkerLayout.from_wire(answer.get("layout")))
                peers[port] = peer
                return peer

            first_rank = mine.tp_rank % ranks
            first = hello(base + first_rank)
            assert first.layout is not None
            stages = {0: first.layout}
            for stage in range(1, self._stage_layouts(key, first.layout)):
                layout = hello(port_of(base, ranks, stage, first_rank)).layout
                assert layout is not None
                stages[stage] = layout
            maps = {port_of(base, ranks, stage, rank): (stages[stage], rank, head_map)
                    for (stage, rank), head_map in map_stages(mine, stages).items()}
            for port, (stage_layout, rank, _head_map) in maps.items():
                peer = peers.get(port) or hello(port)
                self._check_rank(host, base, stage_layout, rank, peer.layout)
            clusters = []
            for port in maps:
                cluster = dd.LLMClusterInfo()
                cluster.remote_cluster_id = peers[port].cluster_id
                cluster.append_local_ip_info("0.0.0.0", 0)
                cluster.append_remote_ip_info(host, peers[port].listen_port)
                clusters.append(cluster)
            # Every rank at once (the engine links them side by side).
            _status, codes = self._datadist.link_clusters(clusters, max(1, int(left() * 1000)))
            linked = [cluster for cluster, code in zip(clusters, codes) if code == dd.LLMStatusCode.LLM_SUCCESS]
            if len(linked) != len(clusters):
                raise dd.LLMException(f"link to {host}:{base} failed", status_code=next(
                    code for code in codes if code != dd.LLMStatusCode.LLM_SUCCESS))
            sources = []
            for (port, (_stage, _rank, head_map)), cluster in zip(maps.items(), clusters):
                peer = peers[port]
                peer.cluster, peer.linked = cluster, True
                peer.claims = ClaimChannel(host, port, left(), self.guard)
                assert peer.layout is not None
                sources.append(Source(port, peer.cluster_id, head_map, peer.layout, peer))
            route = Route(tuple(sources), mine)
        except Exception as exc:  # TimeoutError, OSError, ProtocolError, LayoutError, LLMException, ...
            log.debug("datadist_aio connector: first contact with %s:%d left to the loop thread: %s: %s",
                      host, base, type(exc).__name__, exc)
            for peer in peers.values():
                if peer.claims is not None:
                    peer.claims.close()
            if linked:
                try:
                    self._datadist.unlink_clusters(linked, timeout=100, force=True)
                except Exception as unlink_exc:  # the link may already be gone
                    log.debug("unlink after a first contact: %s", unlink_exc)
            with self._guard:
                del self._contacting[key]
                self._given_up.add(key)
            return None
        with self._guard:
            for port, peer in peers.items():
                self.peers[(host, port)] = peer
            self.routes[key] = route
            del self._contacting[key]
        return route

    def client(self, host: str, port: int) -> SideChannelClient:
        """The side-channel client of the rank at ``host:port`` (made on first use)."""
        return self._known(host, port).client

    def _known(self, host: str, port: int) -> Peer:
        peer = self.peers.get((host, port))
        if peer is None:
            peer = self.peers[(host, port)] = Peer(SideChannelClient(host, port, self.guard), asyncio.Lock())
        return peer

    async def peer(self, host: str, port: int, link: bool = True) -> Peer:
        """The peer at ``host:port`` (its side channel): its hello, then the link (on first use)."""
        peer = self._known(host, port)
        async with peer.lock:
            if peer.linked or (peer.layout is not None and not link):
                return peer
            if peer.layout is None:
                hello = await peer.client.request({"op": "hello"}, self._hello_timeout_s)
                cluster_id, listen_port = hello.get("cluster_id"), hello.get("port")
                if not isinstance(cluster_id, int) or not isinstance(listen_port, int):
                    raise ValueError(f"{host}:{port} answered hello with {hello!r:.200}")
                layout = WorkerLayout.from_wire(hello.get("layout"))
                peer.cluster_id, peer.listen_port, peer.layout = cluster_id, listen_port, layout
            if not link:
                return peer
            await self._link(peer, host)
            if peer.claims is None:
                peer.claims = await asyncio.get_running_loop().run_in_executor(
                    None, ClaimChannel, host, port, self._hello_timeout_s, self.guard)
            return peer

    async def _link(self, peer: Peer, host: str) -> None:
        cluster = dd.LLMClusterInfo()
        cluster.remote_cluster_id = peer.cluster_id
        cluster.append_local_ip_info("0.0.0.0", 0)  # any local address: the kernel picks the route
        cluster.append_remote_ip_info(host, peer.listen_port)
        loop = asyncio.get_running_loop()
        datadist = self._datadist
        status, per_cluster = await loop.run_in_executor(None, datadist.link_clusters, [cluster],
                                                         self._link_timeout_ms)
        code = per_cluster[0]
        if code == dd.LLMStatusCode.LLM_ALREADY_LINK and not self._have_link(peer.cluster_id):
            # The prefill still holds an older link from this worker (one
            # this end dropped, whose close it has not seen yet): it probes
            # that one and drops it. Link again once, after the probe's time.
            log.info("datadist_aio connector: %s:%d still holds an old link from this worker; linking again",
                     host, peer.listen_port)
            status, per_cluster = await loop.run_in_executor(None, datadist.link_clusters, [cluster],
                                                             self._link_timeout_ms)
            code = per_cluster[0]
            if code == dd.LLMStatusCode.LLM_ALREADY_LINK and not self._have_link(peer.cluster_id):
                code = dd.LLMStatusCode.LLM_LINK_FAILED
        if code not in (dd.LLMStatusCode.LLM_SUCCESS, dd.LLMStatusCode.LLM_ALREADY_LINK):
            raise dd.LLMException(f"link to {host}:{peer.listen_port} failed", status_code=code)
        peer.cluster, peer.linked = cluster, True

    def _have_link(self, cluster_id: int) -> bool:
        try:
            self._datadist.link_transport(cluster_id)
        except dd.LLMException:
            return False
        return True

    def forget(self, host: str, port: int, used: Optional[Peer] = None) -> None:
        """Drops the rank at ``host:port`` after a failure, so the next load links
        afresh; with ``used``, only if that is still the peer known there."""
        peer = self.peers.get((host, port))
        if peer is None or (used is not None and peer is not used):
            return
        del self.peers[(host, port)]
        for key, route in list(self.routes.items()):
            if any(source.peer is peer for source in route.sources):
                del self.routes[key]
        peer.client.close()
        if peer.claims is not None:
            peer.claims.close()
        if peer.cluster is not None:
            try:
                self._datadist.unlink_clusters([peer.cluster], timeout=100, force=True)
            except Exception as exc:  # the link may already be gone
                log.debug("unlink after failure: %s", exc)

    def close(self) -> None:
        for peer in self.peers.values():
            peer.client.close()
            if peer.claims is not None:
                peer.claims.close()

    def poll_claims(self) -> None:
        """Reads the claims' answers that have come (any thread; never blocks)."""
        for peer in list(self.peers.values()):
            if peer.claims is not None:
                peer.claims.poll()

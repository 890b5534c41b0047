"""How a decode worker reaches the prefill instances it reads from.

On a prefill instance's first use the decode worker says hello to one of its
ranks over the side channel (who it is, its KV layout), maps that layout
onto its own (``layout.map_heads``: another TP size, another block size),
and links to each rank it reads from. The result, a ``Route``, is the same
for every later load from that instance. Everything here runs on the
connector's loop thread.

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
from dataclasses import dataclass
from typing import Optional

import datadist_aio as dd

from .claims import ClaimChannel
from .layout import HeadMap, LayoutError, WorkerLayout, map_heads
from .side_channel import SideChannelClient

__all__ = ["Peer", "Route", "Router", "Source", "instance_of"]

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


class Router:
    """The prefill ranks a decode worker knows, and the routes to their instances.

    ``routes`` is read from vLLM's worker thread (a dict lookup) and written
    on the loop thread.
    """

    def __init__(self, datadist: dd.LLMDataDist, mine: WorkerLayout, *, hello_timeout_s: float,
                 link_timeout_ms: int) -> None:
        self._datadist = datadist
        self._mine = mine
        self._hello_timeout_s = hello_timeout_s
        self._link_timeout_ms = link_timeout_ms
        self.peers: dict[tuple[str, int], Peer] = {}
        self.routes: dict[Instance, Route] = {}

    async def route(self, key: Instance) -> Route:
        """How to read the prefill instance ``key``: hello to one of its ranks,
        the mapping of its layout onto this worker's, a link to each rank it
        names. ``LayoutError`` where the layouts do not map."""
        route = self.routes.get(key)
        if route is not None:
            return route
        host, base, ranks = key
        mine = self._mine
        first = await self.peer(host, base + mine.tp_rank % ranks, link=False)
        assert first.layout is not None
        if first.layout.tp_size != ranks:
            raise LayoutError(f"{host}:{base} announced TP size {ranks} but its rank {first.layout.tp_rank} "
                              f"says {first.layout.tp_size}")
        maps = map_heads(mine, first.layout)
        sources = []
        for rank, head_map in maps.items():
            peer = await self.peer(host, base + rank)
            assert peer.layout is not None
            if peer.layout != dataclasses.replace(first.layout, tp_rank=rank):
                raise LayoutError(f"rank {rank} of the prefill at {host}:{base} ({peer.layout.describe()}) "
                                  f"differs from its rank {first.layout.tp_rank} ({first.layout.describe()})")
            sources.append(Source(base + rank, peer.cluster_id, head_map, peer.layout, peer))
        route = self.routes[key] = Route(tuple(sources), mine)
        return route

    def client(self, host: str, port: int) -> SideChannelClient:
        """The side-channel client of the rank at ``host:port`` (made on first use)."""
        return self._known(host, port).client

    def _known(self, host: str, port: int) -> Peer:
        peer = self.peers.get((host, port))
        if peer is None:
            peer = self.peers[(host, port)] = Peer(SideChannelClient(host, port), asyncio.Lock())
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
                    None, ClaimChannel, host, port, self._hello_timeout_s)
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

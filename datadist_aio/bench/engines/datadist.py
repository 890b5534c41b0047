"""datadist_aio itself: push_blocks, pull_blocks and a layer-wise
transfer_cache_async, each awaited on the event loop the variant names.

Both sides register their benchmark memory as a blocks cache (as a serving
framework registers the KV tensors it already has); the target's cache
carries the blocks key the initiator addresses.

Variant settings: ``loop``, ``transport`` (the library's default when
absent), ``connections``, and with ``transport="ucx"`` the ``ucx_tls`` of
``base.UCX_TLS``, set in the process's environment before the engine starts
UCX (with ``UCX_NET_DEVICES=lo`` on loopback, as for NIXL). A library that
refuses ``"ucx"`` makes the variant unavailable, with the library's words as
the reason; a link that ends up on another transport fails the run.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any, ClassVar, Optional

import numpy as np

from ...cache import Cache
from ...cache_desc import CacheDesc
from ...cache_key import BlocksCacheKey
from ...cache_manager import CacheManager
from ...cache_task import CacheTask
from ...cluster_info import LLMClusterInfo
from ...config import LLMConfig
from ...data_type import DataType
from ...enums import LLMRole, Placement
from ...layer_synchronizer import LayerSynchronizer
from ...llm_datadist import LLMDataDist
from ...status import LLMException, LLMStatusCode
from ...transfer_config import TransferWithCacheKeyConfig
from ..layout import Layout
from ..loops import loop_runner
from .base import LAYERWISE, PULL, PUSH, Memory, Unavailable, set_ucx_tls

INITIATOR_ID, TARGET_ID = 1, 2
KEY = BlocksCacheKey(TARGET_ID, 0)


def options(pool_bytes: int, listen: Optional[str] = None, sync_kv_timeout_ms: int = 120000,
            connections: Optional[int] = None, transport: Optional[str] = None,
            auth_key: Optional[str] = None) -> dict[str, str]:
    """Options of an instance in remote-cache-accessible mode, with a host pool
    of ``pool_bytes``, listening on ``listen`` (an IP; port chosen by the
    kernel) when given, on ``transport`` (the library's default when None)."""
    config = LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.host_mem_pool_cfg = f'{{"memory_size": {pool_bytes}}}'
    config.sync_kv_timeout = sync_kv_timeout_ms
    if connections is not None:
        config.tcp_connections_per_peer = connections
    if transport is not None:
        config.transport = transport
    if auth_key is not None:
        config.auth_key = auth_key
    if listen is not None:
        config.listen_ip_info = f"{listen}:0"
    return config.generate_options()


def _datadist(role: LLMRole, cluster_id: int, variant: dict[str, Any], listen: Optional[str],
              peer_host: str) -> LLMDataDist:
    transport = variant.get("transport")
    if "ucx_tls" in variant:
        if transport != "ucx":
            raise ValueError(f"datadist_aio: ucx_tls needs transport='ucx', not {transport!r}")
        set_ucx_tls(variant["ucx_tls"], peer_host)
    # The benchmark registers its own memory: the pool stays small.
    connections = int(variant["connections"]) if "connections" in variant else None
    try:
        settings = options(16 << 20, listen, connections=connections, transport=transport,
                           auth_key=variant.get("link_secret"))
    except LLMException as exc:
        if transport == "ucx":
            raise Unavailable(f"this datadist_aio refuses transport 'ucx': {exc}") from None
        raise
    datadist = LLMDataDist(role, cluster_id)
    datadist.init(settings)
    return datadist


class _Registered(Memory):
    """Memory registered as the blocks cache of one layout (under ``key`` on the target)."""

    def __init__(self, datadist: LLMDataDist, key: Optional[BlocksCacheKey]) -> None:
        super().__init__()
        self.datadist = datadist
        self.key = key
        self.cache: Optional[Cache] = None

    def register(self, layout: Layout) -> None:
        desc = CacheDesc(layout.tensors, [layout.blocks, layout.block_size], DataType.DT_UINT8, Placement.HOST)
        self.cache = self.datadist.cache_manager.register_blocks_cache(desc, list(self.views), self.key)

    def registered(self) -> Cache:
        """The cache of the current layout."""
        if self.cache is None:
            raise RuntimeError("no layout is prepared")
        return self.cache

    def unregister(self) -> None:
        if self.cache is not None:
            self.datadist.cache_manager.unregister_cache(self.cache.cache_id)
            self.cache = None


class Target:
    def __init__(self, variant: dict[str, Any], host: str) -> None:
        self.host = host
        self.datadist: LLMDataDist = _datadist(LLMRole.DECODER, TARGET_ID, variant, host, host)
        self.memory: _Registered = _Registered(self.datadist, KEY)

    def open(self) -> Any:
        return self.host, self.datadist.listen_port

    def prepare(self, layout: Layout) -> Any:
        self.memory.prepare(layout)
        return None

    def tensors(self) -> list[np.ndarray]:
        return self.memory.views

    def close(self) -> None:
        self.memory.release()
        self.datadist.finalize()


class _Ready(LayerSynchronizer):
    """Every layer is ready at once: the layer-wise path at full speed."""

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        return True


class Initiator:
    ops: ClassVar[tuple[str, ...]] = (PUSH, PULL, LAYERWISE)

    def __init__(self, variant: dict[str, Any], opened: Any) -> None:
        try:
            self.runner: asyncio.Runner = loop_runner(variant.get("loop", "asyncio"))
        except ImportError:
            raise Unavailable("uvloop is not installed (pip install 'datadist_aio[uvloop]')") from None
        except ValueError as exc:
            raise Unavailable(str(exc)) from None
        host, port = opened
        self.datadist: LLMDataDist = _datadist(LLMRole.PROMPT, INITIATOR_ID, variant, None, host)
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = TARGET_ID
        cluster.append_local_ip_info(host if host != "0.0.0.0" else "127.0.0.1", 0)
        cluster.append_remote_ip_info(host, port)
        status, per_cluster = self.datadist.link_clusters([cluster], 10000)
        if status is not LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link to {host}:{port} failed: {status} {per_cluster}")
        if variant.get("transport") == "ucx" and (path := self.datadist.link_transport(TARGET_ID)) != "ucx":
            raise RuntimeError(f"the link to {host}:{port} moves bytes over {path!r}, not over UCX")
        self.cm: CacheManager = self.datadist.cache_manager
        self.memory: _Registered = _Registered(self.datadist, None)
        self.layers: int = 0
        self.blocks: list[int] = []
        self.submit_seconds: list[float] = []  # of the last latency run: the call, before the await

    def prepare(self, layout: Layout, prepared: Any) -> None:
        self.memory.prepare(layout)
        self.layers = layout.tensors // 2
        self.blocks = list(range(layout.blocks))

    def tensors(self) -> list[np.ndarray]:
        return self.memory.views

    async def _move(self, op: str, table: list[int]) -> None:
        cache = self.memory.registered()
        if op == PUSH:
            await self.cm.push_blocks_async(KEY, cache, self.blocks, table)
        elif op == PULL:
            await self.cm.pull_blocks_async(KEY, cache, table, self.blocks)
        else:
            config = TransferWithCacheKeyConfig(KEY, range(self.layers), range(self.layers))
            await self.cm.transfer_cache_async(cache, _Ready(), [config], self.blocks, table)

    def batch(self, op: str, table: list[int]) -> None:
        self.runner.run(self._move(op, table))

    def latency(self, ops: int) -> list[float]:
        cache = self.memory.registered()

        async def sample() -> list[float]:
            seconds, submits = [], []
            for _ in range(ops):
                start = time.perf_counter()
                task = self.cm.push_blocks_async(KEY, cache, [0], [0], tensor_num_per_layer=1)
                submitted = time.perf_counter()
                await task
                end = time.perf_counter()
                seconds.append(end - start)
                submits.append(submitted - start)
            self.submit_seconds = submits
            return seconds

        return self.runner.run(sample())

    def submit_parts(self, ops: int) -> dict[str, float]:
        """Median µs of the pieces of the submit call, each timed on its own:
        the whole call with an engine that starts nothing (argument checks
        and the task), the task's creation alone, and the engine's own submit
        (argument plan, frames handed to the link), waited for untimed."""
        cache = self.memory.registered()
        engine = self.datadist._engine
        dispatcher = self.datadist._dispatcher
        assert dispatcher is not None
        request = engine.create_request(1)
        request.release(0, 0)  # already complete: a stand-in for the stub engine to return

        class _NoTransfer:
            def __getattr__(self, name: str) -> Any:
                return getattr(engine, name)

            def push_blocks(self, *args: Any) -> tuple[int, Any]:
                return 0, request

        stub = CacheManager(_NoTransfer(), dispatcher, remote_cache_accessible=True)
        rounds = max(10, min(ops, 1000))
        python_side, task_alone, native = [], [], []
        for _ in range(rounds):
            start = time.perf_counter()
            stub.push_blocks_async(KEY, cache, [0], [0], tensor_num_per_layer=1)
            python_side.append(time.perf_counter() - start)
            start = time.perf_counter()
            CacheTask(request, dispatcher, "push_blocks")
            task_alone.append(time.perf_counter() - start)
            start = time.perf_counter()
            status, started = engine.push_blocks(cache.cache_id, TARGET_ID, KEY.model_id, [0], [0], (0, 0, 1, 1))
            native.append(time.perf_counter() - start)
            if status != 0:
                raise RuntimeError(f"push_blocks refused: {status:#x}")
            started.wait(-1)
        checks = statistics.median(python_side) - statistics.median(task_alone)
        return {"checks_us": checks * 1e6, "task_us": statistics.median(task_alone) * 1e6,
                "native_submit_us": statistics.median(native) * 1e6}

    def close(self) -> None:
        self.memory.release()
        self.datadist.finalize()
        self.runner.close()

"""The connector's worker side: registers vLLM's KV memory, reads and releases blocks.

One ``LLMDataDist`` per worker process. vLLM's worker thread starts each
read itself (``pull_blocks_async`` returns at once) and looks at the tasks
when vLLM asks for finished transfers, once per step: no thread per request,
no polling of its own, and no hop through another thread on the hot path.
One event loop, run by one thread, does the rest: the side channel, release
notices, and the first contact with a prefill instance where vLLM's worker
thread did not make it itself within ``first_contact_ms`` (it holds the GIL
that the loop thread would wait for at every step of it).

- Registration (``groups.py``): each distinct KV tensor vLLM allocated is
  registered in place (``register_blocks_cache`` on its address, no copy).
  Tensors of the same shape and dtype that serve the same vLLM KV cache
  groups form one blocks cache; the block dimension and the tensors per
  layer are read off the tensors.
- Prefill side: listens for links, answers the side channel (who it is, its
  layout; which requests a decode side holds and has finished reading) and
  frees a request's blocks when its decode side confirms or its lease runs
  out (``leases.py``: a read counts only while the request holds its blocks).
- Decode side: on a prefill instance's first use, says hello to its ranks,
  maps their KV layout onto its own (``layout.py``: another TP size, another
  block size) and links to the ranks it reads from (``routes.py``; then
  reuses all of it); it reads each request's blocks, KV cache group by KV
  cache group, with ``pull_blocks_async``, or the byte ranges inside them
  with ``pull_block_ranges_async`` where the layouts differ, claims the
  request's lease beside the reads, and tells every prefill rank when it
  is done. A load that fails, whose claim is refused, or that exceeds
  ``load_timeout_s`` is cancelled in the engine and reported only once it
  has settled (no byte lands afterwards), with its blocks in
  ``load_errors``; it never blocks the step.
- Layer-wise push (``transfer_mode="push_layerwise"``): a decode side lends
  inbox blocks (``inbox.py``), a prefill side pushes each step's blocks into
  them as its layers are saved (``push.py``); the decode side's load is then
  a local copy from its inbox, or the pull above where nothing was pushed.
- Device memory: CUDA KV tensors with ``kv_buffer_device="cuda"`` (vLLM's
  default) are registered in place as device memory (``Placement.DEVICE``,
  ``LLMConfig.device_id`` their device): the engine moves their blocks
  device to device (CUDA IPC between processes of one host, pinned host
  buffers over TCP), and to or from a peer's host memory. The inbox is then
  device memory the engine allocates, and a layer-wise push releases each
  layer on a CUDA event recorded on the model's stream when it was saved.
- Host buffer (``host_buffer.py``): with ``kv_buffer_device="cpu"`` device
  KV tensors are staged through registered host copies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import datadist_aio as dd

from ..message_guard import MessageGuard
from .answers import SideChannelAnswers
from .direct import PushSpan
from .groups import DATATYPES, CacheGroup, describe_kv_caches, release_layers, worker_layout
from .host_buffer import HostBuffer, kv_placement
from .inbox import CLAIMED, COMMITTED, Inbox
from .layout import LayoutError, WorkerLayout, plan_ranges
from .leases import Leases
from .loads import Load, completed_at, posted_at, start_pulls
from .metadata import LoadSpec, StepPlan
from .push import INBOX_MODEL_ID, Pusher, PushSettings
from .routes import Route, Router, instance_of
from .scheduler import pair_groups
from .side_channel import SideChannelClient, SideChannelPortError, SideChannelServer
from .stats import AnswerCounter, PushStep, TransferRecord

__all__ = ["CacheGroup", "WorkerSettings", "WorkerSide", "cluster_id_for", "describe_kv_caches"]

log = logging.getLogger(__name__)

_MODEL_ID_BASE = 0
TRANSFER_MODES = ("auto", "pull", "push_layerwise")
_FENCE_GRACE_S = 0.5  # after dropping a silent prefill's link, for a frame its handler was writing


def _instance(spec: LoadSpec) -> tuple[str, int, int]:
    """The prefill instance a load reads: host, base side-channel port (its rank 0's), TP size."""
    return instance_of(spec.remote_host, spec.remote_port, spec.remote_tp_size)


def _expected_groups(spec: LoadSpec, block_size: int) -> list[dict[str, Any]]:
    """A decode-first load's blocks per KV cache group as its expect names
    them: a full-attention group's from its first block not found locally
    (``skip``), a sliding-window group's in-window tail (``tail``: they end
    at the prompt's last block), as ``pair_groups`` pairs them for a pull."""
    windows = spec.window_blocks or [0]
    groups: list[dict[str, Any]] = []
    for index, (local, _remote, _first) in enumerate(spec.kv_groups()):
        window = windows[index] if index < len(windows) else 0
        if window:
            groups.append({"blocks": local[-min(len(local), window):] if local else [], "tail": True})
        else:
            groups.append({"blocks": local, "skip": spec.first_token // block_size})
    return groups


def _block_rows(route: Route, source: Any) -> Optional[list[Optional[list[list[int]]]]]:
    """What ``source`` pushes of each of its blocks into one of this
    worker's, per cache group, as the rows of one block pair (block 0 on
    both sides): None for a group whose blocks map whole (the same heads),
    None for all where every group's do."""
    if all(source.head_map.whole):
        return None
    rows: list[Optional[list[list[int]]]] = []
    for index, whole in enumerate(source.head_map.whole):
        if whole:
            rows.append(None)
            continue
        planned = plan_ranges(source.head_map, index, route.mine, source.layout, [0], [0], 0)
        rows.append([] if planned is None else [[int(v) for v in row] for row in planned.tolist()])
    return rows


def _tuple(layers: Optional[list[int]]) -> Optional[tuple[int, ...]]:
    return None if layers is None else tuple(layers)


def cluster_id_for(engine_id: str, rank: int) -> int:
    """A stable 63-bit cluster id for one worker of one engine."""
    digest = hashlib.blake2b(f"{engine_id}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class WorkerSettings:
    """How one worker of a connector behaves."""

    engine_id: str
    rank: int = 0
    # The instance's shape: TP size, the model's KV heads (0: read off the
    # tensors), tokens per block (0: read off the tensors), MLA (one latent
    # tensor per layer).
    tp_size: int = 1
    kv_heads: int = 0
    block_size: int = 0
    mla: bool = False
    # Pipeline parallelism: the instance's stages, this worker's (``rank`` is
    # its TP rank within the stage), and every stage's model layers [start,
    # end) where known.
    pp_size: int = 1
    pp_rank: int = 0
    stages: tuple[tuple[int, int], ...] = ()
    # How a [heads, tokens, channels] block is read: "HNC" (as shaped), or
    # "HKTV" (vLLM's CPU attention: per head, the keys transposed, then
    # the values). "" takes HNC.
    head_major: str = ""
    is_producer: bool = True
    is_consumer: bool = True
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    load_timeout_s: float = 10.0
    link_timeout_ms: int = 3000
    # How long vLLM's worker thread may spend on the first contact with a
    # prefill instance itself (hello, link, claim channel) before it leaves
    # the rest to the loop thread (0: always the loop thread).
    first_contact_ms: float = 50.0
    notify_timeout_s: float = 2.0
    # Loads that one step started reach vLLM together: a finished one waits
    # at most this long for the rest of its step (0: each as it finishes).
    load_batch_wait_ms: float = 5.0
    # "auto": decode-first requests are pushed straight into the decode's
    # blocks, the others pulled. "pull": every request is pulled (a
    # decode-first one once its prefill finished). "push_layerwise": as
    # "auto", and a consumer lends an inbox, a producer with push_port pushes
    # the other requests into the inbox of the decode side listening there.
    transfer_mode: str = "auto"
    inbox_blocks: int = 512
    inbox_share_blocks: int = 256
    push_host: str = "127.0.0.1"
    push_port: int = 0
    lease_timeout_s: float = 120.0
    # Host-buffer mode: True stages the tensors wherever they are; otherwise
    # kv_buffer_device decides for device tensors ("cuda" or None: registered
    # in place; "cpu": staged).
    host_buffer: Optional[bool] = None
    kv_buffer_device: Optional[str] = None
    # Device memory, layer-wise push: records an event on the model's current
    # stream and returns it (a torch.cuda.Event or a CUevent int); None: a
    # torch.cuda.Event on torch's current stream.
    record_event: Optional[Callable[[], Any]] = None
    # Link encryption, "off" or "tls" ("": DATADIST_AIO_LINK_ENCRYPTION, else
    # "off"). The side channel's messages are sealed under the link secret
    # (DATADIST_AIO_AUTH_KEY), and encrypted too with "tls".
    link_encryption: str = ""
    # Who moves the bytes on one host, "one_sided" or "owner" ("": the
    # engine's default, one-sided; LLMConfig.access).
    access: str = ""
    # The links' transport, "auto" or "tcp" ("": the engine's default, "auto";
    # LLMConfig.transport).
    transport: str = ""

    def __post_init__(self) -> None:
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode must be one of {TRANSFER_MODES}, got {self.transfer_mode!r}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} is not a stage of pp_size {self.pp_size}")
        if self.pp_size > 1 and self.transfer_mode == "push_layerwise":
            raise ValueError("transfer_mode 'push_layerwise' does not serve pipeline parallelism (each stage holds "
                             "a slice of the layers, the inbox all of them): use \"auto\" or \"pull\"")

    @property
    def worker_index(self) -> int:
        """This worker among the instance's: ``pp_rank * tp_size + rank`` (its TP rank without stages). Its
        side channel listens on the base port plus this, and its cluster id is drawn from it."""
        return self.pp_rank * self.tp_size + self.rank

    @property
    def workers(self) -> int:
        """The instance's workers, every stage's TP ranks."""
        return self.pp_size * self.tp_size

    @property
    def lends_inbox(self) -> bool:
        return self.transfer_mode == "push_layerwise" and self.is_consumer

    @property
    def pushes(self) -> bool:
        return self.transfer_mode == "push_layerwise" and self.is_producer and self.push_port > 0


class WorkerSide:
    """Worker-side state of one ``DatadistAioConnector``.

    Thread rules: ``register``, ``begin_step``, ``save_layer``,
    ``finish_step``, ``start_loads``, ``get_finished``,
    ``load_errors``, ``take_records``, ``take_answer_counts`` and
    ``shutdown`` are called from vLLM's worker thread; the coroutines run on
    the loop thread; ``_begin`` runs on either.
    """

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.cluster_id: int = cluster_id_for(settings.engine_id, settings.worker_index)
        # Seals every side-channel message this worker sends and opens those
        # it takes (ValueError for an encryption it cannot have).
        self.guard: MessageGuard = MessageGuard.from_environment(settings.link_encryption or None)
        self.groups: list[CacheGroup] = []
        self.layout: Optional[WorkerLayout] = None
        self.side_channel_port: int = 0
        self._datadist: Optional[dd.LLMDataDist] = None
        self._caches: list[dd.Cache] = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._server: Optional[SideChannelServer] = None
        # Decode side: the prefill ranks and routes (made on the loop thread).
        self._router: Optional[Router] = None
        self._linking: set[asyncio.Task[None]] = set()
        # Release notices on their way to prefills (loop thread).
        self._notices: set[asyncio.Task[None]] = set()
        # Prefill side: the requests whose blocks wait for decode sides.
        self.leases: Leases = Leases()
        # Shared between the loop thread and vLLM's worker thread.
        self._lock = threading.Lock()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._records: list[TransferRecord] = []
        self._inflight: list[Load] = []
        self._expecting: dict[str, Load] = {}  # decode-first loads by transfer id
        self._step = 0  # start_loads calls that began loads
        # vLLM's worker thread only.
        self._answers = AnswerCounter()
        self._host: Optional[HostBuffer] = None
        # The CUDA device whose memory the KV tensors are (registered in
        # place); None: host memory.
        self.device: Optional[int] = None
        self._layer_names: list[str] = []
        # Layer-wise push: the decode side's inbox, the prefill side's pusher.
        self._inbox: Optional[Inbox] = None
        self._inbox_caches: list[dd.Cache] = []
        self._inbox_memory: list[Any] = []
        self.pusher: Optional[Pusher] = None

    # -- set-up and tear-down (worker thread) -----------------------------------

    def register(self, kv_caches: Mapping[str, Any], num_blocks: Optional[int] = None,
                 layer_groups: Optional[Mapping[str, int]] = None) -> None:
        """Registers vLLM's KV tensors (or their host copies) and starts the loop thread.

        ``layer_groups``: each layer's vLLM KV cache group, where there are
        several (the hybrid KV cache manager); None: one. ValueError for
        tensors the connector cannot register (``kv_placement``), and for a
        mode that serves one KV cache group with several.
        """
        kv_group_count = len(set(layer_groups.values())) if layer_groups else 1
        placement, device = "host_buffer", None
        if not self.settings.host_buffer:
            placement, device = kv_placement(kv_caches, self.settings.kv_buffer_device)
        if placement == "host_buffer":
            if kv_group_count > 1:
                raise ValueError(
                    f"the host buffer (device KV tensors staged through host memory) serves one KV cache group; this "
                    f"model has {kv_group_count} (vLLM's hybrid KV cache manager): register the tensors in place "
                    "(kv_buffer_device=\"cuda\") or start vLLM with --disable-hybrid-kv-cache-manager"
                )
            self._host = HostBuffer(kv_caches)
            kv_caches = self._host.host
        elif placement == "device":
            self.device = device
        self._layer_names = list(kv_caches)
        self.groups = describe_kv_caches(kv_caches, num_blocks, layer_groups)
        self.layout = worker_layout(self.groups, self.settings)
        if self.settings.transfer_mode == "push_layerwise":
            if kv_group_count > 1:
                raise ValueError(
                    f"push_layerwise serves one KV cache group; this model has {kv_group_count} (vLLM's hybrid KV "
                    "cache manager): use the pull mode, or start vLLM with --disable-hybrid-kv-cache-manager"
                )
            if len(self.groups) != 1 or len(self.groups[0].addresses) != len(kv_caches) * self.groups[0].per_layer:
                raise ValueError(
                    "push_layerwise needs one KV tensor (or one K and one V) per layer, all of one shape and "
                    f"dtype; this model has {len(self.groups)} cache groups: use the pull mode"
                )
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=self._run_loop, args=(loop,), name="datadist-aio-vllm", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), loop).result(timeout=60)
        except BaseException:
            self.shutdown()  # the engine, the loop and its thread go; the error reaches vLLM
            raise

    def set_copy_blocks(self, copy: Any) -> None:
        """vLLM's block-copy function, for the host-buffer mode."""
        if self._host is not None:
            self._host.copy = copy

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.run_forever()

    async def _start(self) -> None:
        config = dd.LLMConfig()
        config.enable_cache_manager = True
        config.sync_kv_timeout = max(1, int(self.settings.load_timeout_s * 1000))
        if self.device is not None:
            config.device_id = self.device
        if self.settings.link_encryption:  # the links as the side channel (unset: the environment's, for both)
            config.link_encryption = self.settings.link_encryption
        if self.settings.access:
            config.access = self.settings.access
        if self.settings.transport:
            config.transport = self.settings.transport
        if self.settings.is_producer or self.settings.lends_inbox:
            config.listen_ip_info = f"{self.settings.host}:0"
        if self.settings.is_producer:  # it pushes: into an inbox, or straight into decode-first decodes' blocks
            config.enable_remote_cache_accessible = True
        role = dd.LLMRole.MIX
        if not self.settings.is_consumer:
            role = dd.LLMRole.PROMPT
        elif not self.settings.is_producer:
            role = dd.LLMRole.DECODER
        datadist = dd.LLMDataDist(role, self.cluster_id)
        datadist.init(config.generate_options())
        self._datadist = datadist
        assert self.layout is not None
        self._router = Router(datadist, self.layout, hello_timeout_s=self.settings.load_timeout_s,
                              link_timeout_ms=self.settings.link_timeout_ms, guard=self.guard)
        for index, group in enumerate(self.groups):
            desc = dd.CacheDesc(
                num_tensors=len(group.addresses),
                shape=[group.num_blocks, *group.block_shape],
                data_type=DATATYPES[group.dtype],
                placement=self._placement,
            )
            key = dd.BlocksCacheKey(self.cluster_id, _MODEL_ID_BASE + index)
            self._caches.append(datadist.cache_manager.register_blocks_cache(desc, list(group.addresses), key))
        if self.settings.lends_inbox:
            self._register_inbox(datadist)
        if self.settings.is_producer:
            spans = [PushSpan(cache, _MODEL_ID_BASE + index, kv_group, _tuple(release_layers(group, kv_group)),
                              group.block_bytes, index, len(group.addresses))
                     for index, (cache, group) in enumerate(zip(self._caches, self.groups))
                     for kv_group in group.kv_groups]
            self.pusher = Pusher(
                PushSettings(
                    engine_id=self.settings.engine_id,
                    decode_host=self.settings.push_host,
                    decode_port=self.settings.push_port if self.settings.pushes else 0,
                    share_blocks=self.settings.inbox_share_blocks,
                    hold_s=self.settings.lease_timeout_s,
                    timeout_s=self.settings.load_timeout_s,
                    link_timeout_ms=self.settings.link_timeout_ms,
                ),
                datadist, spans, [g.layout() for g in self.groups], self._layer_names, asyncio.get_running_loop(),
                record_event=self._record_event() if self.device is not None else None,
                # A stage's decode-first requests are pulled.
                capable=self.settings.transfer_mode != "pull" and self.settings.pp_size == 1,
                # A decode-first request whose decode died is freed now, not at its lease's end.
                unreachable=lambda req_id: self.leases.done([req_id], 1),
                guard=self.guard,
            )
            self.pusher.start()
        # A prefill answers hellos, leases and decode-first expects; a decode
        # hears the notices of its decode-first requests (on any free port
        # where it has none of its own: it names the port in its expect).
        handlers: dict[str, Any] = {}
        if self.pusher is not None:
            handlers.update(expect=self.pusher.directs.expect, cancel=self.pusher.directs.cancel)
        if self.settings.is_consumer:
            handlers.update(landed=self._landed, pull=self._pull_instead)
        answers = SideChannelAnswers(
            engine_id=self.settings.engine_id, cluster_id=self.cluster_id,
            listen_port=lambda: datadist.listen_port, layout=self.layout,
            group_layouts=[group.layout() for group in self.groups], leases=self.leases, inbox=self._inbox,
            handlers=handlers)
        self._server = SideChannelServer(answers, guard=self.guard)
        self.side_channel_port = await self._listen(self._server)

    async def _listen(self, server: SideChannelServer) -> int:
        """Starts the side channel's server; a port it cannot bind raises ``SideChannelPortError``."""
        host, port = self.settings.host, self.settings.side_channel_port
        try:
            return await server.start(host, port)
        except OSError as exc:
            self._server = None
            reason = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
            settings = self.settings
            if settings.pp_size == 1:
                error = SideChannelPortError(
                    f"datadist_aio connector: the side channel of TP rank {settings.rank} cannot listen on "
                    f"{host}:{port} ({reason}). Its port is kv_connector_extra_config[\"side_channel_port\"], or "
                    "kv_transfer_config.kv_port where that is not set, plus the TP rank; two vLLM instances on one "
                    "host that both listen (kv_producer, kv_both, or a push_layerwise kv_consumer) need their own "
                    "base ports, at least tensor_parallel_size apart"
                )
            else:
                error = SideChannelPortError(
                    f"datadist_aio connector: the side channel of pipeline stage {settings.pp_rank}, TP rank "
                    f"{settings.rank} cannot listen on {host}:{port} ({reason}). Its port is "
                    "kv_connector_extra_config[\"side_channel_port\"], or kv_transfer_config.kv_port where that is "
                    "not set, plus stage * tensor_parallel_size + TP rank; two vLLM instances on one host that both "
                    "listen need their own base ports, at least tensor_parallel_size * pipeline_parallel_size apart"
                )
            error.errno = exc.errno
            raise error from exc

    @property
    def _placement(self) -> dd.Placement:
        return dd.Placement.DEVICE if self.device is not None else dd.Placement.HOST

    def _record_event(self) -> Callable[[], Any]:
        """How a saved layer is marked on the model's stream (device memory)."""
        if self.settings.record_event is not None:
            return self.settings.record_event

        def record() -> Any:
            import torch  # pyright: ignore[reportMissingImports]  (vLLM installs it)

            event = torch.cuda.Event()
            event.record()  # on the current stream: the forward's
            return event

        return record

    def _register_inbox(self, datadist: dd.LLMDataDist) -> None:
        """The staging blocks prefill sides push into: one blocks cache per group,
        where the KV tensors are (host memory of numpy's, or device memory the
        engine allocates on the KV tensors' device)."""
        import numpy as np

        blocks = self.settings.inbox_blocks
        self._inbox = Inbox(blocks, self.settings.inbox_share_blocks)
        for index, group in enumerate(self.groups):
            desc = dd.CacheDesc(
                num_tensors=len(group.addresses),
                shape=[blocks, *group.block_shape],
                data_type=DATATYPES[group.dtype],
                placement=self._placement,
            )
            key = dd.BlocksCacheKey(self.cluster_id, INBOX_MODEL_ID + index)
            if self.device is not None:
                self._inbox_caches.append(datadist.cache_manager.allocate_blocks_cache(desc, key))
                continue
            per_tensor = group.block_bytes // len(group.addresses)
            memory = [np.zeros(blocks * per_tensor, np.uint8) for _ in group.addresses]
            self._inbox_memory.append(memory)
            addresses = [int(array.ctypes.data) for array in memory]
            self._inbox_caches.append(datadist.cache_manager.register_blocks_cache(desc, addresses, key))

    def shutdown(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), loop).result(timeout=30)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            log.warning("datadist_aio connector: shutdown did not finish cleanly: %s", exc)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not loop.is_running():
            loop.close()
        self._loop = None

    async def _stop(self) -> None:
        for task in list(self._linking):
            task.cancel()
        if self._linking:
            await asyncio.wait(list(self._linking), timeout=self.settings.load_timeout_s + 5)
        if self._notices:
            # The releases already sent go out: a prefill is not left to hold
            # the blocks until their lease runs out (each is bounded by
            # notify_timeout_s).
            await asyncio.wait(list(self._notices), timeout=self.settings.notify_timeout_s + 1)
        with self._lock:
            loads, self._inflight = self._inflight, []
        for load in loads:
            for cache_task in load.tasks:
                cache_task.cancel()
        for load in loads:
            for cache_task in load.tasks:
                cache_task.synchronize(int(self.settings.load_timeout_s * 1000) + 5000)
        if self._router is not None:
            self._router.close()
        if self.pusher is not None:
            await self.pusher.close()
        if self._server is not None:
            await self._server.close()
        if self._datadist is not None:
            self._datadist.finalize()
            self._datadist = None

    # -- per step (worker thread) ---------------------------------------------------

    def begin_step(self, plan: StepPlan) -> None:
        """The step's plan, bound before its forward: starts the step's saves
        (the host buffer's copies out, the push), which then follow the
        forward layer by layer (``save_layer``) until ``finish_step``."""
        if self._host is not None and plan.saves:
            self._host.begin_step([block for spec in plan.saves.values() for block in spec.block_ids])
        if self.pusher is not None:
            self.pusher.begin_step(plan.saves)

    def start_loads(self, plan: StepPlan) -> None:
        """Starts the reads the scheduler planned; returns at once. The step's
        saves began with ``begin_step``."""
        if plan.leases:
            self.leases.add(plan.leases, plan.lease_tokens)
        if plan.announce and self.pusher is not None:
            self.pusher.announce(plan.announce)
        if not plan.loads:
            return
        assert self._loop is not None, "register_kv_caches was not called"
        self._step += 1
        begun: list[Load] = []
        for spec in plan.loads.values():
            if not spec.local_block_ids:
                # Nothing to read (a local prefix hit or an abort): only release the prefill.
                if spec.transfer_id:
                    self._loop.call_soon_threadsafe(self._spawn, self._cancel_push(spec))
                    continue
                if self._inbox is not None:
                    self._inbox.finish(spec.remote_engine_id, spec.remote_request_id)
                self._loop.call_soon_threadsafe(self._spawn_notify, spec)
                continue
            start = time.perf_counter()
            if spec.error:
                self._begin(spec, None, start, error=spec.error, step=self._step)
                continue
            if spec.transfer_id:
                self._begin_expect(spec, start, self._step)
                continue
            state = self._inbox.state(spec.remote_engine_id, spec.remote_request_id) if self._inbox else None
            if state == COMMITTED and self._begin_local(spec, start, self._step):
                continue
            if state == CLAIMED:
                self._loop.call_soon_threadsafe(self._spawn_wait_commit, spec, start)
                continue
            load = self._begin_pull(spec, start, self._step, contact=True)
            if load is not None and load.route is not None:
                begun.append(load)
        if begun:
            # The claims on the prefills' leases, sent beside the reads: one
            # message per prefill rank for the step.
            self._send_claims(begun)

    def _begin_pull(self, spec: LoadSpec, start: float, step: int = -1, contact: bool = False) -> Optional["Load"]:
        """Pulls one load from its prefill, linking first where needed (either
        thread); the load if it began here, None if it waits for a link.
        ``contact`` (vLLM's worker thread): a first contact with the prefill
        instance is tried here first, within ``first_contact_ms``."""
        assert self._loop is not None and self._router is not None
        key = _instance(spec)
        route = self._router.routes.get(key)
        if route is None and contact and self.settings.first_contact_ms > 0:
            route = self._router.contact_now(key, self.settings.first_contact_ms / 1000.0)
        if route is not None:
            return self._begin(spec, route, start, step=step)
        self._loop.call_soon_threadsafe(self._spawn_link, spec, start)
        return None

    def _begin_local(self, spec: LoadSpec, start: float, step: int = -1) -> bool:
        """Copies a pushed request from the inbox into its blocks; False if it is not there."""
        assert self._inbox is not None and self._datadist is not None
        key = (spec.remote_engine_id, spec.remote_request_id)
        blocks = self._inbox.take(*key)
        if blocks is None:
            return False
        local = spec.local_block_ids
        if len(local) > len(blocks):
            self._inbox.finish(*key)
            return False
        # Local prefix-cache hits cover the leading blocks: copy only the tail.
        mapping = dict(zip(blocks[len(blocks) - len(local):], local))
        load = Load(spec, start, start + self.settings.load_timeout_s, local=True, step=step)
        try:
            for inbox, cache, group in zip(self._inbox_caches, self._caches, self.groups):
                load.tasks.append(self._datadist.cache_manager.swap_blocks_async(inbox, cache, mapping))
                load.nbytes += group.block_bytes * len(local)
        except Exception as exc:
            load.error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._inflight.append(load)
        return True

    def save_layer(self, name: str) -> None:
        """vLLM's forward has written layer ``name`` of this step."""
        if self._host is not None:
            self._host.save_layer(name)
        if self.pusher is not None:
            self.pusher.save_layer(name)

    def finish_step(self, forward_failed: bool = False) -> None:
        """The forward is over: finishes the step's copies and pushes (a
        failed forward's push is never committed)."""
        if self._host is not None:
            self._host.finish_step()
        if self.pusher is not None:
            self.pusher.finish_step(forward_failed)

    def _begin(self, spec: LoadSpec, route: Optional[Route], start: float, error: str = "",
               step: int = -1) -> Load:
        """Starts the pulls of one load from every prefill rank it reads (or
        records why it could not start); its claims are the caller's to send
        (``_send_claims``)."""
        load = Load(spec, start, start + self.settings.load_timeout_s, error=error, step=step)
        if route is not None and not error:
            load.route = route
            load.holds_pending = len(route.sources)
            load.posted = time.perf_counter()
            try:
                self._start_pulls(load, route)
            except Exception as exc:  # refused before any byte moved (a dropped link, ...)
                load.error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._inflight.append(load)
        return load

    def _start_pulls(self, load: Load, route: Route) -> None:
        assert self._datadist is not None
        start_pulls(load, route, self._datadist.cache_manager, self._caches, self.groups, _MODEL_ID_BASE)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(prefill requests whose blocks may be freed, loads settled, loads failed).

        A load past its deadline is cancelled here and reported once it has
        settled. A load that finished while others of its step are still
        under way is held for them, up to ``load_batch_wait_ms``: the
        scheduler then computes the step's requests in one forward, where
        one reported early would start a forward that the rest, and their
        copies, wait behind.
        """
        now = time.perf_counter()
        settled: list[Load] = []
        wait = self.settings.load_batch_wait_ms / 1000.0
        if self._router is not None:
            self._router.poll_claims()
        with self._lock:
            # Done: its reads settled, and every claim answered (or it failed).
            done = [not load.awaiting and all(task.done() for task in load.tasks)
                    and (load.holds_pending <= 0 or bool(load.error)) for load in self._inflight]
            open_steps = {load.step for load, ok in zip(self._inflight, done) if not ok and load.step >= 0}
            for load, ok in zip(self._inflight, done):
                if ok:
                    load.seen_done = load.seen_done or now
                    if load.step in open_steps and not load.error and now - load.seen_done < wait:
                        continue
                    settled.append(load)
                elif now >= load.deadline and not load.cancelled:
                    load.cancelled = True
                    if load.awaiting:  # decode-first: the prefill's push is stopped first
                        assert self._loop is not None
                        self._loop.call_soon_threadsafe(self._spawn, self._stop_push(load))
                        continue
                    load.error = f"no answer within {self.settings.load_timeout_s:g} s"
                    for task in load.tasks:
                        task.cancel()
            if settled:
                self._inflight = [load for load in self._inflight if load not in settled]
        if settled:
            forget = [load for load in settled if not self._settle(load) and not load.local and not load.stale]
            # One wake-up of the loop thread for the whole batch: the
            # releases go to the prefills, the failed peers are dropped.
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._spawn_after_settle, [load.spec for load in settled], forget)
        with self._lock:
            recving, self._finished_recving = self._finished_recving, set()
            failed, self._failed_recving = self._failed_recving, set()
        sending = self.leases.collect()
        if self.pusher is not None and sending:
            self.pusher.freed(sending)
        return sending, recving, failed

    def _settle(self, load: Load) -> bool:
        """Records a finished load; True if its bytes arrived."""
        spec = load.spec
        if not load.error:
            for task in load.tasks:
                bad = [status for status in task.get_results(0) if status is not dd.LLMStatusCode.LLM_SUCCESS]
                if bad:
                    load.error = f"pull failed: {bad[0].name}"
                    break
        if not load.error and self._host is not None:
            try:
                self._host.load(spec.local_block_ids)
            except Exception as exc:
                load.error = f"copy to the device: {type(exc).__name__}: {exc}"
        if self._inbox is not None:
            self._inbox.finish(spec.remote_engine_id, spec.remote_request_id)
        ok = not load.error
        if not ok:
            log.warning("datadist_aio connector: load of %s from %s:%d failed: %s",
                        spec.req_id, spec.remote_host, spec.remote_port, load.error)
        blocks = spec.all_local_blocks()
        with self._lock:
            if not ok:
                self._invalid_blocks.update(blocks)
                self._failed_recving.add(spec.req_id)
            self._finished_recving.add(spec.req_id)
            seen = load.seen_done - load.start
            posted = posted_at(load)
            self._records.append(TransferRecord(completed_at(load) - posted if ok else seen,
                                                load.nbytes if ok else 0, len(blocks), ok, seen,
                                                posted - load.start))
        return ok

    @property
    def hybrid(self) -> bool:
        """Whether the tensors serve several vLLM KV cache groups: vLLM then takes
        a failed load by request (``failed_recving``), not by block."""
        return self.layout is not None and self.layout.hybrid

    def load_errors(self) -> set[int]:
        with self._lock:
            blocks, self._invalid_blocks = self._invalid_blocks, set()
        return blocks

    def take_answer_counts(self) -> tuple[int, int]:
        """(answers of same-host links read, of those by the engine's timer
        sweep) since the last call; (0, 0) before registration or after
        shutdown. Called from vLLM's worker thread after ``get_finished``, so
        the answers of every load it reported are counted."""
        datadist = self._datadist
        if datadist is None:
            return 0, 0
        try:
            counts = datadist.answer_counts()
        except RuntimeError:  # finalized meanwhile
            return 0, 0
        return self._answers.delta(counts)

    def take_records(self) -> list[TransferRecord]:
        with self._lock:
            records, self._records = self._records, []
        if self.pusher is not None:
            records.extend(self.pusher.take_records())
        return records

    def take_push_steps(self) -> list[PushStep]:
        """The steps pushed since the last call, with their overlap (prefill side)."""
        return self.pusher.take_steps() if self.pusher is not None else []

    # -- prefill side (loop thread) -------------------------------------------------

    # -- decode side (loop thread) ---------------------------------------------------

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._linking.add(task)
        task.add_done_callback(self._linking.discard)

    def _begin_expect(self, spec: LoadSpec, start: float, step: int) -> None:
        """A decode-first load: its prefill is told where to push (worker thread)."""
        assert self._loop is not None
        load = Load(spec, start, start + self.settings.load_timeout_s, step=step, awaiting=True)
        with self._lock:
            self._inflight.append(load)
            self._expecting[spec.transfer_id] = load
        self._loop.call_soon_threadsafe(self._spawn, self._expect(load))

    def _end_expect(self, load: Load, error: str = "") -> None:
        """The load waits no more: done (``error`` empty) or failed."""
        with self._lock:
            if self._expecting.get(load.spec.transfer_id) is load:
                del self._expecting[load.spec.transfer_id]
            if error and not load.error:
                load.error = error
            load.awaiting = False

    async def _expect(self, load: Load) -> None:
        """Links to the prefill (as for a pull) and tells its rank where this
        request's blocks are; its push, or its word to pull, comes as a notice."""
        assert self._router is not None
        spec = load.spec
        try:
            async with asyncio.timeout(max(0.0, load.deadline - time.perf_counter())):
                route = await self._router.route(_instance(spec))
        except LayoutError as exc:
            self._end_expect(load, f"layout: {exc}")
            return
        except (Exception, TimeoutError) as exc:
            self._end_expect(load, f"link: {type(exc).__name__}: {exc}")
            for port in self._router.ports(_instance(spec)):
                self._router.forget(spec.remote_host, port)
            return
        load.route = route
        block_size = route.mine.block_size
        # Each prefill rank this worker reads pushes its share of the heads
        # into its blocks (equal block sizes, whole blocks after the prefix
        # hits, no stages). Elsewhere one rank is told, and it says to pull:
        # with pipeline stages, one of the last stage read, whose forward of a
        # request ends after every earlier stage's.
        direct = (spec.first_token % block_size == 0 and not route.staged
                  and all(source.layout.block_size == block_size for source in route.sources))
        sources = route.sources if direct else (route.notice_source,)
        base = {
            "op": "expect", "transfer_id": spec.transfer_id, "cluster_id": self.cluster_id,
            "host": self.settings.host, "port": self.side_channel_port,
            "layout": [group.layout() for group in self.groups], "blocks": spec.local_block_ids,
            "skip": spec.first_token // block_size, "groups": _expected_groups(spec, block_size), "direct": direct,
        }
        load.expected = sources
        load.posted = time.perf_counter()
        errors = await asyncio.gather(*(self._expect_from(load, source, {
            **base, "rows": _block_rows(route, source) if direct else None,
            "deadline_s": max(0.001, load.deadline - time.perf_counter())}) for source in sources))
        if any(errors):
            # The ranks that took the request stop their pushes before its blocks go back.
            took = [source for source, error in zip(sources, errors) if not error]
            await asyncio.gather(*(self._cancel_from(load, source) for source in took))
            self._end_expect(load, next(error for error in errors if error))

    async def _expect_from(self, load: Load, source: Any, message: dict[str, Any]) -> str:
        """Tells one prefill rank where to push; why it did not take it ("" where it did)."""
        spec = load.spec
        try:
            await source.peer.client.request(message, self.settings.notify_timeout_s)
            return ""
        except (Exception, TimeoutError) as exc:
            # The prefill may hold the expect unanswered (frozen): it loses the
            # link before the blocks go back, as at the deadline.
            await self._drop_link(spec, source)
            return (f"the prefill at {spec.remote_host}:{source.port} did not take the request: "
                    f"{type(exc).__name__}: {exc}")

    async def _cancel_from(self, load: Load, source: Any) -> bool:
        """Stops one prefill rank's push of a decode-first load: whether it had
        landed. One that does not answer loses the link."""
        message = {"op": "cancel", "transfer_id": load.spec.transfer_id, "cluster_id": self.cluster_id}
        try:
            answer = await source.peer.client.request(message, self.settings.notify_timeout_s)
            return bool(answer.get("landed"))
        except (Exception, TimeoutError):
            await self._drop_link(load.spec, source)
            return False

    async def _drop_link(self, spec: LoadSpec, source: Any) -> None:
        """Fences a prefill that may still push into a decode-first load's
        blocks: its link goes, then a moment for a frame being written as it went."""
        assert self._router is not None
        self._router.forget(spec.remote_host, source.port, source.peer)
        await asyncio.sleep(_FENCE_GRACE_S)

    def _landed_bytes(self, spec: LoadSpec) -> int:
        """The bytes a prefill's push wrote into a decode-first load's blocks:
        each KV cache group's blocks, through each blocks cache serving it."""
        assert self.layout is not None
        counts = [len(group["blocks"]) for group in _expected_groups(spec, self.layout.block_size)]
        return sum(group.block_bytes * counts[kv_group] for group in self.groups for kv_group in group.kv_groups
                   if kv_group < len(counts))

    async def _landed(self, message: dict[str, Any]) -> dict[str, Any]:
        """The prefill pushed a decode-first request's prompt into its blocks."""
        transfer_id, req_id = message.get("transfer_id"), message.get("remote_request_id")
        if not isinstance(transfer_id, str) or not isinstance(req_id, str) or len(req_id) > 1024:
            raise ValueError("landed names a transfer_id and the prefill's remote_request_id")
        load = self._expecting.get(transfer_id)
        if load is not None and not load.cancelled:
            load.spec.remote_request_id = req_id
            load.landed += 1
            if load.landed >= len(load.expected):  # every rank told pushed its share
                load.nbytes = self._landed_bytes(load.spec)
                self._end_expect(load)
        return {"ok": True}

    async def _pull_instead(self, message: dict[str, Any]) -> dict[str, Any]:
        """The prefill could not push a decode-first request: it names its
        blocks as for a pull (the prefill-first params), and the load pulls."""
        transfer_id, params = message.get("transfer_id"), message.get("params")
        if not isinstance(transfer_id, str) or not isinstance(params, dict):
            raise ValueError("pull names a transfer_id and the prefill's params")
        blocks, token = params.get("remote_block_ids"), params.get("lease_token", "")
        req_id, engine_id = params.get("remote_request_id"), params.get("remote_engine_id")
        flat = [block for group in blocks for block in (group if isinstance(group, list) else [group])] \
            if isinstance(blocks, list) else None
        if (flat is None or not all(type(block) is int for block in flat) or not isinstance(token, str)
                or len(token) > 64 or not isinstance(req_id, str) or not isinstance(engine_id, str)):
            raise ValueError("the params must hold remote_block_ids (a list, or one per KV cache group), a "
                             "lease_token, remote_request_id and remote_engine_id")
        load = self._expecting.get(transfer_id)
        if load is None or load.cancelled or load.route is None:
            return {"ok": True}
        spec = load.spec
        groups, error = pair_groups([local for local, _, _ in spec.kv_groups()], blocks,
                                    spec.window_blocks or [0], spec.first_token)
        if error:
            self._end_expect(load, error)
            return {"ok": True}
        (spec.local_block_ids, spec.remote_block_ids, spec.first_token), *spec.more_groups = groups
        spec.lease_token, spec.remote_request_id, spec.remote_engine_id = token, req_id, engine_id
        load.holds_pending = len(load.route.sources)
        load.posted = time.perf_counter()
        try:
            self._start_pulls(load, load.route)
        except Exception as exc:
            load.error = f"{type(exc).__name__}: {exc}"
        self._end_expect(load)
        if not load.error:
            self._send_claims([load])
        return {"ok": True}

    async def _stop_push(self, load: Load) -> None:
        """A decode-first load past its deadline. Its prefill is asked to stop
        the push and answers once nothing of it is under way; a prefill that
        does not answer loses the link, so nothing of its push lands any more
        (then a moment for a frame being written as the link went). Only then
        is the load reported, and its blocks given back to vLLM."""
        spec = load.spec
        landed = bool(load.expected) and all(
            await asyncio.gather(*(self._cancel_from(load, source) for source in load.expected)))
        if landed and load.awaiting:
            load.nbytes = self._landed_bytes(spec)
            self._end_expect(load)
        else:
            self._end_expect(load, f"no push within {self.settings.load_timeout_s:g} s")

    async def _cancel_push(self, spec: LoadSpec) -> None:
        """A decode-first request with nothing to load (aborted): its prefill need not push it."""
        assert self._router is not None
        route = self._router.routes.get(_instance(spec))
        if route is None:
            return
        message = {"op": "cancel", "transfer_id": spec.transfer_id, "cluster_id": self.cluster_id}
        for source in route.sources:
            try:
                await source.peer.client.request(message, self.settings.notify_timeout_s)
            except (Exception, TimeoutError) as exc:
                log.debug("datadist_aio connector: cancel of %s not confirmed: %s", spec.transfer_id, exc)

    def _spawn_link(self, spec: LoadSpec, start: float) -> None:
        task = asyncio.get_running_loop().create_task(self._link_then_begin(spec, start))
        self._linking.add(task)
        task.add_done_callback(self._linking.discard)

    def _spawn_wait_commit(self, spec: LoadSpec, start: float) -> None:
        task = asyncio.get_running_loop().create_task(self._wait_commit(spec, start))
        self._linking.add(task)
        task.add_done_callback(self._linking.discard)

    async def _wait_commit(self, spec: LoadSpec, start: float) -> None:
        """A request claimed but not yet committed: waits for its push, else pulls it."""
        assert self._inbox is not None
        deadline = start + self.settings.load_timeout_s
        while self._inbox.state(spec.remote_engine_id, spec.remote_request_id) == CLAIMED:
            if time.perf_counter() >= deadline:
                break
            await asyncio.sleep(0.002)
        if not self._begin_local(spec, start):
            self._begin_pull(spec, start)

    def _spawn_notify(self, spec: LoadSpec) -> None:
        task = asyncio.get_running_loop().create_task(self._notify(spec))
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    def _spawn_after_settle(self, released: list[LoadSpec], forget: list[Load]) -> None:
        """After loads settled (loop thread): drops the links failed reads used, tells the prefills."""
        assert self._router is not None
        for load in forget:
            if load.route is not None:
                for source in load.route.sources:
                    self._router.forget(load.spec.remote_host, source.port, source.peer)
        for spec in released:
            self._spawn_notify(spec)

    async def _link_then_begin(self, spec: LoadSpec, start: float) -> None:
        """First use of a prefill instance: its route, then the pulls and their claims."""
        assert self._router is not None
        try:
            remaining = max(0.0, start + self.settings.load_timeout_s - time.perf_counter())
            async with asyncio.timeout(remaining):
                route = await self._router.route(_instance(spec))
        except LayoutError as exc:
            # Found at the first hello, and again at each load's: every load fails at once.
            self._begin(spec, None, start, error=f"layout: {exc}")
            return
        except (Exception, TimeoutError) as exc:
            self._begin(spec, None, start, error=f"link: {type(exc).__name__}: {exc}")
            for port in self._router.ports(_instance(spec)):
                self._router.forget(spec.remote_host, port)
            return
        self._send_claims([self._begin(spec, route, start)])

    def _send_claims(self, loads: list[Load]) -> None:
        """Claims the leases of loads whose reads began: one message per prefill
        rank (either thread; the answers are read by ``get_finished``)."""
        by_peer: dict[int, tuple[Any, list[Load]]] = {}
        for load in loads:
            if load.route is None:
                continue
            for source in load.route.sources:
                by_peer.setdefault(id(source.peer), (source.peer, []))[1].append(load)
        timeout = self.settings.load_timeout_s
        for peer, group in by_peer.values():
            items = [(load.spec.remote_request_id, self._claim_settler(load)) for load in group]
            if peer.claims is None:
                for _req_id, settle in items:
                    settle("no lease claim channel to the prefill", False)
                continue
            peer.claims.send({
                "op": "hold",
                "requests": {load.spec.remote_request_id: load.spec.lease_token for load in group},
                "engine_id": group[0].spec.remote_engine_id,
                # Held past this side's own deadline, by which it has cancelled the read.
                "hold_s": timeout + 5.0,
            }, items)

    def _claim_settler(self, load: Load) -> Callable[[str, bool], None]:
        def settle(why: str, refused: bool) -> None:
            with self._lock:
                load.holds_pending -= 1
                if why and not load.error:
                    # A refusal says nothing against the link; no answer does.
                    load.error, load.stale = why, refused
                    for task in load.tasks:
                        task.cancel()
        return settle

    async def _notify(self, spec: LoadSpec) -> None:
        """Tells every rank of the prefill instance that this rank is done with the request."""
        if not spec.remote_request_id:
            return  # decode-first, never heard of by its prefill: its lease frees it
        # Every decode rank tells every prefill rank, which frees the request
        # once all of them have (whether or not a rank read from it).
        assert self._router is not None
        message = {"op": "done", "req_ids": [spec.remote_request_id], "readers": self.settings.workers}
        await asyncio.gather(*(self._tell(spec.remote_host, port, message, spec)
                               for port in self._router.ports(_instance(spec))))

    async def _tell(self, host: str, port: int, message: dict[str, Any], spec: LoadSpec) -> None:
        assert self._router is not None
        known = (host, port) in self._router.peers
        client = self._router.client(host, port) if known else SideChannelClient(host, port, self.guard)
        try:
            await client.request(message, self.settings.notify_timeout_s)
        except (Exception, TimeoutError) as exc:
            log.debug("datadist_aio connector: release of %s by %s:%d not confirmed: %s",
                      spec.remote_request_id, host, port, exc)
        finally:
            if not known:
                client.close()

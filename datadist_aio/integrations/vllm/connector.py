"""``DatadistAioConnector``: vLLM's ``KVConnectorBase_V1`` on datadist_aio.

A thin adapter: the scheduler role delegates to ``SchedulerSide``, the worker
role to ``WorkerSide``; this module only translates vLLM's types. Load it with

    --kv-transfer-config '{"kv_connector": "DatadistAioConnector",
                           "kv_connector_module_path": "datadist_aio.integrations.vllm",
                           "kv_role": "kv_producer"}'        # kv_consumer on the decode side

Settings (``kv_connector_extra_config``): ``side_channel_host`` (default
127.0.0.1; the address the decode side reaches the prefill at),
``side_channel_port`` (default ``kv_port``; each tensor-parallel rank adds
its rank, and with pipeline parallelism each stage ``s`` adds ``s *
tensor_parallel_size`` too; with ``kv_both`` on one host give each instance
its own: a port already taken fails ``register_kv_caches`` with
``SideChannelPortError``),
``load_timeout_s`` (10), ``load_batch_wait_ms`` (5: how long a finished load
waits for the others its step started, so vLLM gets them together),
``lease_timeout_s`` (120), ``link_timeout_ms`` (3000), ``first_contact_ms``
(50: how long vLLM's worker thread may spend on the first contact with a
prefill instance before the connector's own thread takes it over),
``transfer_mode`` (``"auto"``, the default: requests a decode-first proxy
sends are pushed layer by layer straight into the decode's blocks, the
others pulled; ``"pull"``: every request pulled; ``"push_layerwise"``: as
``"auto"``, and the other requests pushed into the decode's inbox). With
``push_layerwise`` a decode instance lends ``inbox_blocks`` (512) staging
blocks, at most ``inbox_share_blocks`` (256) to each prefill, and listens on
its side channel port; a prefill instance pushes to the decode instance whose
side channel is ``push_host`` (127.0.0.1) : ``push_port`` (plus its rank).
``link_encryption`` (``"off"`` or ``"tls"``; unset: the environment's
``DATADIST_AIO_LINK_ENCRYPTION``): with ``"tls"`` the engine's links
(``LLMConfig.link_encryption``) and the side channel's messages are
encrypted. ``access`` (``"one_sided"``, the default, or ``"owner"``;
``LLMConfig.access``): on one host, whether a worker moves the bytes of its
reads and pushes itself under the peer's grant, or the peer's engine does.
``transport`` (``"auto"``, the default, or ``"tcp"``; ``LLMConfig.transport``):
``"tcp"`` keeps the workers' links on sockets even on one host (each byte
then crosses the link, encrypted with ``"tls"``).
The side channel's messages are authenticated
under the link secret (``DATADIST_AIO_AUTH_KEY``, which the engine's links
prove too) wherever one is set: every worker of a pair needs the same.
With KV tensors on a CUDA device, ``kv_transfer_config.kv_buffer_device``
chooses how they move: ``"cuda"`` (vLLM's default on a CUDA build) registers
them in place as device memory, ``"cpu"`` stages their blocks through a host
buffer.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch  # noqa: F401  (vLLM's own dependency; the tensors come from it)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from . import stats
from .metadata import StepPlan
from .scheduler import ScheduledChunk, SchedulerSide, SideSettings
from .worker import WorkerSettings, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["DatadistAioConnector", "DatadistAioConnectorMetadata", "DatadistAioStats", "DatadistAioPromMetrics"]

log = logging.getLogger(__name__)

_NO_SLEEP_MODE = (
    "DatadistAioConnector does not support sleep mode (--enable-sleep-mode): the engine holds the KV "
    "tensors' registrations, and peers hold leases and inbox blocks on them, which a sleep would free; "
    "start vLLM without --enable-sleep-mode"
)


@dataclass
class DatadistAioConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler side to the worker side."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class DatadistAioStats(KVConnectorStats):
    """Per-request transfer observations; ``data`` is ``stats.empty()``-shaped."""

    def __post_init__(self) -> None:
        if not self.data:
            self.data = stats.empty()

    def reset(self) -> None:
        self.data = stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.reduce(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


class DatadistAioPromMetrics(KVConnectorPromMetrics):
    """``vllm:datadist_aio_*`` histograms and counters, one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        time_buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
        byte_buckets = [2 ** (10 + i) for i in range(0, 25, 2)]
        histogram, counter = self._histogram_cls, self._counter_cls

        def seconds(name: str, documentation: str) -> dict[int, Any]:
            return self._per_engine(histogram(name=name, documentation=documentation, buckets=time_buckets,
                                              labelnames=labelnames))

        def count(name: str, documentation: str) -> dict[int, Any]:
            return self._per_engine(counter(name=name, documentation=documentation, labelnames=labelnames))

        self._xfer_time = seconds(
            "vllm:datadist_aio_xfer_time_seconds",
            "Time of each request's KV load through datadist_aio, from posting its reads until the engine "
            "completed them.")
        self._seen_time = seconds(
            "vllm:datadist_aio_load_seen_seconds",
            "Time from each request's KV load start until vLLM's step found it done (the transfer and the wait "
            "for that step).")
        self._setup_time = seconds(
            "vllm:datadist_aio_load_setup_seconds",
            "Time from each request's KV load start until its reads were posted (the first contact with a "
            "prefill instance: hello, authenticated link, claims' channel).")
        self._bytes = self._per_engine(histogram(
            name="vllm:datadist_aio_bytes_transferred",
            documentation="Bytes of KV cache each request's load moved through datadist_aio.",
            buckets=byte_buckets,
            labelnames=labelnames,
        ))
        self._transfers = count(
            "vllm:datadist_aio_num_transfers",
            "KV loads through datadist_aio that succeeded.")
        self._failures = count(
            "vllm:datadist_aio_num_failed_transfers",
            "KV loads through datadist_aio that failed or timed out.")
        self._answers = count(
            "vllm:datadist_aio_answers_read",
            "Answers of datadist_aio's same-host links read, by any reader.")
        self._push_tail = seconds(
            "vllm:datadist_aio_push_tail_seconds",
            "Layer-wise push, each prefill step: time from the forward's last saved layer until the step's push "
            "was committed (the push's part that the forward did not hide).")
        self._push_steps = count(
            "vllm:datadist_aio_push_steps",
            "Prefill steps whose blocks were pushed layer by layer through datadist_aio.")
        self._push_overlapped = count(
            "vllm:datadist_aio_push_steps_overlapped",
            "Pushed prefill steps whose first layer went to the engine before the forward saved its "
            "last layer (the push overlapped the forward).")
        self._push_aborted = count(
            "vllm:datadist_aio_push_steps_aborted",
            "Pushed prefill steps whose forward failed or saved fewer than all its layers: their push "
            "was stopped and never committed.")
        self._answers_by_sweep = count(
            "vllm:datadist_aio_answers_read_by_sweep",
            "Answers of datadist_aio's same-host links read by the engine's timer sweep "
            "(nobody looked at the task in time); expected to stay 0.")

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {index: metric.labels(*values) for index, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for seconds in transfer_stats_data.get("transfer_duration", ()):
            self._xfer_time[engine_idx].observe(seconds)
        for seconds in transfer_stats_data.get("seen_duration", ()):
            self._seen_time[engine_idx].observe(seconds)
        for seconds in transfer_stats_data.get("setup_duration", ()):
            self._setup_time[engine_idx].observe(seconds)
        for nbytes in transfer_stats_data.get("bytes_transferred", ()):
            self._bytes[engine_idx].observe(nbytes)
        if transfer_stats_data.get("num_successful_transfers"):
            self._transfers[engine_idx].inc(transfer_stats_data["num_successful_transfers"])
        if transfer_stats_data.get("num_failed_transfers"):
            self._failures[engine_idx].inc(transfer_stats_data["num_failed_transfers"])
        if transfer_stats_data.get("answers_read"):
            self._answers[engine_idx].inc(transfer_stats_data["answers_read"])
        if transfer_stats_data.get("answers_read_by_sweep"):
            self._answers_by_sweep[engine_idx].inc(transfer_stats_data["answers_read_by_sweep"])
        for seconds in transfer_stats_data.get("push_tail_duration", ()):
            self._push_tail[engine_idx].observe(seconds)
        for key, metric in (("push_steps", self._push_steps), ("push_steps_overlapped", self._push_overlapped),
                            ("push_steps_aborted", self._push_aborted)):
            if transfer_stats_data.get(key):
                metric[engine_idx].inc(transfer_stats_data[key])


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, RuntimeError, AttributeError):
        return 0


def _tp_size(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)


def _pp_size(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)


def _pp_rank(pp_size: int) -> int:
    """This worker's pipeline stage (0 without pipeline parallelism)."""
    if pp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_pp_group

    return int(get_pp_group().rank_in_group)


def _stages(vllm_config: Any, pp_size: int) -> tuple[tuple[int, int], ...]:
    """Every pipeline stage's model layers [start, end), as vLLM splits them (empty without stages)."""
    if pp_size == 1:
        return ()
    from vllm.distributed.utils import get_pp_indices

    layers = int(vllm_config.model_config.get_total_num_hidden_layers())
    return tuple(get_pp_indices(layers, stage, pp_size) for stage in range(pp_size))


def _kv_heads(vllm_config: Any) -> int:
    """The model's KV heads, all ranks together (0 where vLLM does not say)."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return 0


def _on_cpu() -> bool:
    """Whether vLLM runs on the CPU, whose attention reads a block
    ``[heads, tokens, 2 * head_dim]`` as each head's keys, then its values."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except (ImportError, AttributeError):
        return False


def _on_device() -> bool:
    """Whether this vLLM keeps its KV cache off the host (a GPU build)."""
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type) != "cpu"
    except (ImportError, AttributeError):
        return False


def _first_group(block_ids: Any) -> Optional[list[int]]:
    return list(block_ids[0]) if block_ids else None


def _other_groups(block_ids: Any) -> tuple[list[int], ...]:
    """New blocks of the KV cache groups after the first (vLLM's hybrid KV cache manager)."""
    return tuple(list(group) for group in block_ids[1:]) if block_ids else ()


def _window_blocks(kv_cache_config: Any) -> tuple[int, ...]:
    """Per vLLM KV cache group, the trailing blocks a sliding-window group
    needs (0: all, full attention); ``(0,)`` where vLLM does not say."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    windows = []
    for group in groups:
        spec = group.kv_cache_spec
        window = int(getattr(spec, "sliding_window", 0) or 0)
        # The blocks its window spans, one more where it straddles a block boundary.
        windows.append(-(-window // int(spec.block_size)) + 1 if window else 0)
    return tuple(windows) or (0,)


def _layer_groups(kv_cache_config: Any) -> Optional[dict[str, int]]:
    """Each layer's vLLM KV cache group, where there are several; None otherwise."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if len(groups) < 2:
        return None
    return {name: index for index, group in enumerate(groups) for name in group.layer_names}


def scheduled_chunks(output: "SchedulerOutput") -> list[ScheduledChunk]:
    """This step's requests, as the scheduler side reads them."""
    counts = output.num_scheduled_tokens
    chunks = [
        ScheduledChunk(new.req_id, _first_group(new.block_ids), True, new.num_computed_tokens, counts.get(new.req_id, 0),
                       _other_groups(new.block_ids))
        for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    for index, req_id in enumerate(cached.req_ids):
        chunks.append(ScheduledChunk(
            req_id,
            _first_group(cached.new_block_ids[index]),
            req_id in cached.resumed_req_ids,
            cached.num_computed_tokens[index],
            counts.get(req_id, 0),
            _other_groups(cached.new_block_ids[index]),
        ))
    return chunks


class DatadistAioConnector(KVConnectorBase_V1, SupportsHMA):
    """Moves each request's prompt KV from a prefill vLLM to a decode vLLM.

    Serves vLLM's hybrid KV cache manager (``SupportsHMA``): several KV
    cache groups, sliding-window ones beside full attention, each with its
    own block table; a sliding-window group moves only the blocks its window
    needs.
    """

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
            # vLLM 0.33 asks supports_sleep_mode() itself; 0.32 does not.
            raise ValueError(_NO_SLEEP_MODE)
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        engine_id = str(transfer.engine_id)
        host = str(extra.get("side_channel_host", getattr(transfer, "kv_ip", None) or "127.0.0.1"))
        base_port = int(extra.get("side_channel_port", transfer.kv_port))
        mode = str(extra.get("transfer_mode", "auto"))
        push = mode == "push_layerwise"
        buffer_device = getattr(transfer, "kv_buffer_device", None)
        # Saves are planned on every prefill (the push, the host buffer's
        # copies out, decode-first requests, which are pushed in any mode).
        self._plan_saves = bool(transfer.is_kv_producer)
        self.scheduler_side: Optional[SchedulerSide] = None
        self.worker_side: Optional[WorkerSide] = None
        self._stats = stats.empty()
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(
                SideSettings(
                    engine_id=engine_id,
                    host=host,
                    port=base_port,
                    lease_timeout_s=float(extra.get("lease_timeout_s", 120.0)),
                    tp_size=_tp_size(vllm_config),
                    plan_saves=self._plan_saves,
                    block_size=int(vllm_config.cache_config.block_size) if self._plan_saves else 16,
                    window_blocks=_window_blocks(kv_cache_config),
                )
            )
        else:
            rank = _tp_rank()
            pp_size = _pp_size(vllm_config)
            pp_rank = _pp_rank(pp_size)
            # Each worker's side channel: the base port plus its place among
            # the instance's workers, stage by stage.
            worker_index = pp_rank * _tp_size(vllm_config) + rank
            push_port = int(extra.get("push_port", 0))
            if push and transfer.is_kv_producer and not transfer.is_kv_consumer and push_port <= 0:
                raise ValueError(
                    "transfer_mode 'push_layerwise' on a prefill instance needs push_port in "
                    "kv_connector_extra_config: the decode instance's side_channel_port"
                )
            listens = bool(transfer.is_kv_producer) or (push and bool(transfer.is_kv_consumer))
            self.worker_side = WorkerSide(
                WorkerSettings(
                    engine_id=engine_id,
                    rank=rank,
                    tp_size=_tp_size(vllm_config),
                    pp_size=pp_size,
                    pp_rank=pp_rank,
                    stages=_stages(vllm_config, pp_size),
                    kv_heads=_kv_heads(vllm_config),
                    block_size=int(getattr(vllm_config.cache_config, "block_size", 0) or 0),
                    mla=bool(getattr(vllm_config.model_config, "use_mla", False)),
                    head_major="HKTV" if _on_cpu() else "",
                    is_producer=bool(transfer.is_kv_producer),
                    is_consumer=bool(transfer.is_kv_consumer),
                    host=host,
                    side_channel_port=base_port + worker_index if listens else 0,
                    load_timeout_s=float(extra.get("load_timeout_s", 10.0)),
                    load_batch_wait_ms=float(extra.get("load_batch_wait_ms", 5.0)),
                    link_timeout_ms=int(extra.get("link_timeout_ms", 3000)),
                    first_contact_ms=float(extra.get("first_contact_ms", 50.0)),
                    transfer_mode=mode,
                    inbox_blocks=int(extra.get("inbox_blocks", 512)),
                    inbox_share_blocks=int(extra.get("inbox_share_blocks", 256)),
                    push_host=str(extra.get("push_host", "127.0.0.1")),
                    push_port=push_port + rank if push_port > 0 else 0,
                    lease_timeout_s=float(extra.get("lease_timeout_s", 120.0)),
                    kv_buffer_device=buffer_device,
                    link_encryption=str(extra.get("link_encryption", "") or ""),
                    access=str(extra.get("access", "") or ""),
                    transport=str(extra.get("transport", "") or ""),
                )
            )

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: the engine registers the KV tensors' addresses and peers hold
        leases and inbox blocks on them, which a sleep would free under them.
        vLLM (0.33 and later) then refuses ``--enable-sleep-mode`` at
        start-up; on earlier versions the constructor does."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """The layer-wise push needs vLLM to call ``save_kv_layer`` after
        every layer, which a full CUDA graph's replay skips."""
        return str((extra_config or {}).get("transfer_mode", "pull")) == "push_layerwise"

    # -- scheduler side ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        local: Any = []
        if num_external_tokens > 0:
            groups = blocks.get_unhashed_block_ids_all_groups()
            local = groups[0] if len(groups) == 1 else groups
        self.scheduler_side.update_state_after_alloc(request, local, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        chunks = scheduled_chunks(scheduler_output) if self._plan_saves else ()
        return DatadistAioConnectorMetadata(self.scheduler_side.build_plan(chunks))

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.blocks_freed(connector_output.finished_sending)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler_side is not None and bool(self.scheduler_side.held)

    # -- worker side --------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_side is not None
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        self.worker_side.register(kv_caches, num_blocks, _layer_groups(self._kv_cache_config))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # vLLM binds the step's metadata before its forward (and, since 0.32,
        # calls start_load_kv after it): the step's saves start here, so that
        # each layer leaves as the forward saves it.
        if self.worker_side is not None and isinstance(connector_metadata, DatadistAioConnectorMetadata):
            self.worker_side.begin_step(connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker_side is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, DatadistAioConnectorMetadata)
        self.worker_side.start_loads(metadata.plan)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        assert self.worker_side is not None
        self.worker_side.set_copy_blocks(copy_operation)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs only once its load settled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self.worker_side is not None
        self.worker_side.save_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self.worker_side is not None
        # vLLM's model runner calls this from a ``finally``: an exception in
        # flight means the forward failed, and its push is never committed.
        self.worker_side.finish_step(forward_failed=sys.exc_info()[1] is not None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker_side is not None
        sending, recving, failed = self.worker_side.get_finished()
        for item in self.worker_side.take_records():
            stats.record(self._stats, item)
        for step in self.worker_side.take_push_steps():
            stats.record_push(self._stats, step)
        read, by_sweep = self.worker_side.take_answer_counts()
        if read or by_sweep:
            stats.add_answers(self._stats, read, by_sweep)
        # Block ids are unique only within a KV cache group: with several,
        # vLLM takes failed loads by request.
        hybrid = self.worker_side.hybrid
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed if hybrid else set())

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker_side is not None
        blocks = self.worker_side.load_errors()
        return set() if self.worker_side.hybrid else blocks

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if stats.is_empty(self._stats):
            return None
        data, self._stats = self._stats, stats.empty()
        return DatadistAioStats(data=data)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # -- metrics (class level, in vLLM's logger process) ---------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return DatadistAioStats(data=stats.merge(stats.empty(), data) if data else stats.empty())

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return DatadistAioPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

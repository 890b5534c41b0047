"""The SGLang transfer backend: KV manager, sender, receiver and bootstrap server.

Built on SGLang's common backend classes (``sglang.srt.disaggregation.common``:
the bootstrap server, the rank discovery, the control sockets, the
heartbeat) and on datadist_aio's public API for the bytes.

The decode side pulls. SGLang's decode allocates a request's pages before
the prefill computes it and sends their indices (``send_metadata``); each
``send`` of the prefill (one per prefill chunk) then tells the decode
worker which of its own pages hold that chunk, and the decode worker
starts one pull per blocks cache at once, every layer together, while
the prefill computes its next chunk: ``pull_blocks_async`` where both
sides hold the same heads, ``pull_block_ranges_async`` with the heads it
needs where their attention TP sizes differ (``buffers.Pairing``). The
last chunk adds
the aux row (the first output token and its metadata). When every pull
has landed, the decode worker's ``poll`` reports Success and tells the
prefill, whose ``poll`` then reports Success and frees its pages.

Why pull: the decode worker is then the initiator of every transfer, so a
prefill that dies or freezes fails the decode's own tasks
(``LLM_LINK_FAILED``, or ``LLM_TIMEOUT`` after the engine's
``sync_kv_timeout``), reported by its ``poll`` with the reason; and the
decode never has to open its memory to writes by a peer. It costs no
extra message on the path to the first token (the prefill's "pull this"
replaces the push backends' "done"); the decode's "done" back to the
prefill only frees the prefill's pages.

The control messages between the workers (SGLang's and this backend's) are
sealed under the link secret where one is set (``sealed_messages.py``):
one without a valid seal is dropped unread, and logged once per sender.

Thread rules: SGLang's scheduler thread calls the sender's and receiver's
methods and ``check_status``; one control thread per manager reads the
control socket and starts the pulls (decode) or records decode metadata
and confirmations (prefill). ``_rooms`` is shared between them under
``_rooms_lock``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import numpy.typing as npt

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import NetworkAddress

import datadist_aio as dd

from ..message_guard import MessageGuard
from . import sealed_messages
from .buffers import BufferLayout, LayoutMismatch, Pairing, group_buffers

__all__ = [
    "DatadistAioKVBootstrapServer",
    "DatadistAioKVManager",
    "DatadistAioKVReceiver",
    "DatadistAioKVSender",
]

log: logging.Logger = logging.getLogger(__name__)

PULL_TAG = b"DDA_PULL"
DONE_TAG = b"DDA_DONE"
_REGISTER = b"None"  # SGLang's common receiver sends its registration under this room

# The engine's deadline for one pull (a frozen prefill fails it), and how
# long a prefill waits for the decode's confirmation after its last chunk.
TIMEOUT_ENV = "DATADIST_AIO_SGLANG_TIMEOUT_S"
CONFIRM_TIMEOUT_ENV = "DATADIST_AIO_SGLANG_CONFIRM_TIMEOUT_S"
_LINK_TIMEOUT_MS = 5000


def _total_kv_heads(args: KVArgs, server_args: ServerArgs, latent: bool) -> int:
    """The model's KV heads, all ranks together (1 for MLA). SGLang's prefill sets
    ``KVArgs.total_kv_head_num``; its decode does only for staging buffers: read from
    the model's config there."""
    if latent:
        return 1
    total = int(getattr(args, "total_kv_head_num", 0) or 0)
    if total > 0:
        return total
    from sglang.srt.configs.model_config import ModelConfig

    return int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not 0 < seconds <= 3600:
        raise ValueError(f"{name} must be from 0 to 3600 seconds, got {value!r}")
    return seconds


def _swa_state(args: KVArgs) -> Optional[Tuple[List[int], List[int], List[int]]]:
    """The sliding-window layers' buffers of a hybrid SWA model (``StateType.SWA``: pages like
    the KV's, of a pool of their own), as (addresses, lengths, item lengths), or None. Every other
    kind of state buffer is refused, named."""
    types = [getattr(t, "value", t) for t in (getattr(args, "state_types", None) or [])]
    pointers = list(getattr(args, "state_data_ptrs", None) or [])
    present = [(kind, index) for index, kind in enumerate(types) if index < len(pointers) and pointers[index]]
    others = [kind for kind, _ in present if kind != "swa"]
    if others or len(pointers) > len(types) or len(present) > 1:
        raise NotImplementedError(
            "the datadist_aio transfer backend moves the sliding-window state of hybrid SWA models only, "
            f"not state types {others or types}")
    if not present:
        return None
    index = present[0][1]
    return ([int(a) for a in pointers[index]], [int(n) for n in args.state_data_lens[index]],
            [int(n) for n in args.state_item_lens[index]])


def _swa_indices(state_indices: Optional[List[Any]]) -> Optional[npt.NDArray[np.int32]]:
    """This side's sliding-window pages in SGLang's ``state_indices`` (one entry per state
    type, this backend's one being SWA), or None."""
    for component in state_indices or []:
        if component is not None:
            return np.asarray(component, dtype=np.int32).reshape(-1)
    return None


@dataclass
class _TransferInfo:
    """One decode worker's destination for one request (prefill side)."""

    room: int
    endpoint: str
    dst_port: int
    session: str
    dst_kv_indices: npt.NDArray[np.int32]
    dst_aux_index: Optional[int]
    required_dst_info_num: int
    is_dummy: bool
    decode_prefix_len: int = 0
    dst_swa_indices: Optional[npt.NDArray[np.int32]] = None  # the decode's sliding-window pages

    @classmethod
    def from_zmq(cls, msg: List[bytes]) -> "_TransferInfo":
        is_dummy = msg[4] == b"" and msg[5] == b""
        return cls(
            room=int(msg[0].decode("ascii")),
            endpoint=msg[1].decode("ascii"),
            dst_port=int(msg[2].decode("ascii")),
            session=msg[3].decode("ascii"),
            dst_kv_indices=np.frombuffer(msg[4], dtype=np.int32) if not is_dummy else np.zeros(0, np.int32),
            dst_aux_index=int(msg[5].decode("ascii")) if not is_dummy else None,
            required_dst_info_num=int(msg[7].decode("ascii")),
            is_dummy=is_dummy,
            decode_prefix_len=int(msg[8].decode("ascii")) if len(msg) > 8 and msg[8] else 0,
            dst_swa_indices=np.frombuffer(msg[6], dtype=np.int32) if msg[6] else None,
        )


@dataclass
class _RoomPulls:
    """The pulls of one request (decode side)."""

    tasks: List[Tuple[dd.CacheTask, str, int]] = field(default_factory=list)  # task, what, prefill cluster
    last_from: set = field(default_factory=set)  # prefill ranks whose last chunk arrived
    prefills: Dict[int, Tuple[str, int]] = field(default_factory=dict)  # rank -> control endpoint
    # rank -> the prefill engine's cluster id and where it listens, for the link's liveness
    engines: Dict[int, Tuple[int, str]] = field(default_factory=dict)
    # The prefill attention-TP ranks whose KV this worker reads, and those whose last chunk arrived.
    sources: set = field(default_factory=set)
    sources_done: set = field(default_factory=set)
    aux_pulled: bool = False  # the aux row comes from one prefill rank
    nbytes: int = 0
    error: str = ""
    # Each prefill rank's pulls, and the ranks told their part landed: a rank (a
    # pipeline stage) whose last chunk was pulled frees its pages without
    # waiting for the others.
    rank_tasks: Dict[int, List[dd.CacheTask]] = field(default_factory=dict)
    told: set = field(default_factory=set)


@dataclass
class _Peer:
    cluster_id: int
    host: str
    port: int
    pairing: Pairing
    cluster: Any = None


class DatadistAioKVManager(CommonKVManager):
    """One per scheduler rank: registers SGLang's buffers in place and runs the control thread."""

    # The prefill's status messages are tagged and carry the failure's reason.
    kv_status_msg_tag = b"DDA_STATUS"
    kv_status_msg_carries_reason = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: Optional[bool] = False,
    ):
        swa = _swa_state(args)
        # Seals the control messages this worker sends, opens those it takes
        # (ValueError for link encryption without a secret).
        self._guard = MessageGuard.from_environment()
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._stopped = False
        self._worker_threads: List[threading.Thread] = []
        self.timeout_s: float = _env_seconds(TIMEOUT_ENV, 30.0)
        self.confirm_timeout_s: float = _env_seconds(CONFIRM_TIMEOUT_ENV, 300.0)
        groups = group_buffers("kv", args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)
        groups += group_buffers("aux", args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
        if swa is not None:
            groups += group_buffers("swa", *swa)
        latent = bool(is_mla_backend)
        # With pipeline stages, where this stage's layers begin (a prefill's; SGLang sets it).
        start_layer = getattr(args, "prefill_start_layer", 0) if self.disaggregation_mode == DisaggregationMode.PREFILL \
            else 0
        self.layout: BufferLayout = BufferLayout(int(args.page_size), int(self.attn_tp_size), int(self.attn_tp_rank),
                                                 _total_kv_heads(args, server_args, latent), tuple(groups), latent,
                                                 pp_rank=int(self.pp_rank), pp_size=int(self.pp_size),
                                                 start_layer=int(start_layer or 0))
        self.cluster_id: int = int.from_bytes(os.urandom(8), "little") >> 1
        self._rooms: Dict[int, _RoomPulls] = {}
        self._rooms_lock = threading.Lock()
        self._peers: Dict[int, _Peer] = {}
        self._stale: set = set()  # prefill clusters whose pulls failed: unlinked by the control thread
        self._unlinked: set = set()  # prefill clusters this worker unlinked itself (until linked again)
        self._last_sent: Dict[int, float] = {}
        self._confirmed: Dict[int, set] = {}
        self._datadist = self._start_engine(args, server_args, swa[0] if swa else [])
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self._start_thread(self._control_loop, "datadist-aio-prefill", self._on_prefill_message)
        elif self.disaggregation_mode == DisaggregationMode.DECODE:
            self._start_thread(self._control_loop, "datadist-aio-decode", self._on_decode_message)
            self._worker_threads.append(self._start_heartbeat_checker_thread())

    # -- set-up ---------------------------------------------------------------------

    def _start_engine(self, args: KVArgs, server_args: ServerArgs, swa_ptrs: List[int]) -> dd.LLMDataDist:
        """The engine, every buffer group registered in place as one blocks cache."""
        on_host = str(getattr(server_args, "device", "cpu") or "cpu").startswith("cpu")
        config = dd.LLMConfig()
        config.enable_cache_manager = True
        config.sync_kv_timeout = int(self.timeout_s * 1000)
        if not on_host:
            config.device_id = int(args.gpu_id)
        prefill = self.disaggregation_mode == DisaggregationMode.PREFILL
        if prefill:
            config.listen_ip_info = f"{self.local_ip}:0"
        datadist = dd.LLMDataDist(dd.LLMRole.PROMPT if prefill else dd.LLMRole.DECODER, self.cluster_id)
        datadist.init(config.generate_options())
        placement = dd.Placement.HOST if on_host else dd.Placement.DEVICE
        self._caches: List[dd.Cache] = []
        try:
            buffers = {"kv": args.kv_data_ptrs, "aux": args.aux_data_ptrs, "swa": swa_ptrs}
            for index, group in enumerate(self.layout.groups):
                pointers = buffers[group.kind]
                desc = dd.CacheDesc(num_tensors=len(group.members), shape=[group.items, group.item_len],
                                    data_type=dd.DataType.DT_UINT8, placement=placement)
                key = dd.BlocksCacheKey(self.cluster_id, index)
                addresses = [int(pointers[m]) for m in group.members]
                self._caches.append(datadist.cache_manager.register_blocks_cache(desc, addresses, key))
        except BaseException:
            datadist.finalize()
            raise
        log.info("datadist_aio: %s registered %s in place (cluster %d, port %s)",
                 "prefill" if prefill else "decode", self.layout.describe(), self.cluster_id, datadist.listen_port)
        return datadist

    def _start_thread(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, name=name, args=args, daemon=True)
        thread.start()
        self._worker_threads.append(thread)

    def _control_loop(self, handle: Any) -> None:
        """The control thread: each message of the control socket to ``handle``."""
        recv = self._open_next if self._guard.enabled else self._make_worker_recv(self.server_socket)
        while not self._stopped:
            msg = recv()
            if msg is None:
                continue
            try:
                handle(msg)
            except Exception:  # a malformed message must not end the control thread
                log.exception("datadist_aio: dropping a control message of %d frames", len(msg))

    def _open_next(self) -> Optional[List[bytes]]:
        """The next message the guard opens (None after half a second without one)."""
        received = sealed_messages.receive(self.server_socket, 500)
        if received is None:
            return None
        msg, sender = received
        parts = sealed_messages.open_parts(self._guard, msg, int(self.rank_port), sender)
        if parts is None:
            return None
        if getattr(self, "deferred_bootstrap", None) is not None and self._handle_bootstrap_message(parts):
            return None
        return parts

    def _send_multipart_locked(self, endpoint: str, parts: List[bytes], is_ipv6: bool = False) -> None:
        """Every control message this worker sends, sealed for the socket it goes to."""
        sealed = sealed_messages.seal_parts(self._guard, parts, sealed_messages.port_of(endpoint))
        super()._send_multipart_locked(endpoint, sealed, is_ipv6=is_ipv6)

    def _session(self) -> str:
        return f"{self.local_ip}:{self.rank_port}"

    # -- messages the common receiver sends (decode side builds them) ---------------

    def build_receiver_registration_message(self) -> List[bytes]:
        return [_REGISTER, self.local_ip.encode("ascii"), str(self.rank_port).encode("ascii"),
                self._session().encode("ascii"), json.dumps(self.layout.to_wire()).encode("utf-8")]

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: npt.NDArray[np.int32],
        aux_index: Optional[int],
        state_indices: Optional[List],
        decode_prefix_len: Optional[int],
        is_dummy: bool,
        device_kv_indices: Optional[npt.NDArray[np.int32]] = None,
    ) -> List[bytes]:
        swa_pages = _swa_indices(state_indices) if not is_dummy else None
        return [
            str(bootstrap_room).encode("ascii"),
            self.local_ip.encode("ascii"),
            str(self.rank_port).encode("ascii"),
            self._session().encode("ascii"),
            np.asarray(kv_indices, dtype=np.int32).tobytes() if not is_dummy else b"",
            str(aux_index).encode("ascii") if not is_dummy else b"",
            swa_pages.tobytes() if swa_pages is not None else b"",
            str(required_dst_info_num).encode("ascii"),
            str(decode_prefix_len or 0).encode("ascii"),
        ]

    # -- prefill side -----------------------------------------------------------------

    def _on_prefill_message(self, msg: List[bytes]) -> None:
        if msg[0] == ABORT_TAG:
            notification = AbortNotification.from_zmq(msg)
            if notification is not None:
                room = notification.room
                if self.request_status.get(room) not in (None, KVPoll.Success):
                    self.record_failure(room, "Aborted by the decode side")
                    self.update_status(room, KVPoll.Failed)
            return
        if msg[0] == DONE_TAG:
            room, status = int(msg[1].decode("ascii")), int(msg[2].decode("ascii"))
            reason, session = msg[3].decode("utf-8", "replace"), msg[4].decode("ascii")
            self._on_done(room, status, reason, session)
            return
        if msg[0] == b"BOOTSTRAP":  # the "prefill_complete" allocation policy's, which this backend does not use
            return
        if msg[0] == _REGISTER:
            log.debug("datadist_aio: decode %s registered: %s", msg[3].decode("ascii"), msg[4][:200])
            return
        info = _TransferInfo.from_zmq(msg)
        infos = self.transfer_infos.setdefault(info.room, {})
        infos[info.session] = info
        if len(infos) == info.required_dst_info_num:
            self.req_to_decode_prefix_len[info.room] = max(i.decode_prefix_len for i in infos.values())
            self.update_status(info.room, KVPoll.WaitingForInput)

    def _on_done(self, room: int, status: int, reason: str, session: str) -> None:
        if room not in self.request_status:
            return
        if status != KVPoll.Success:
            self.record_failure(room, f"decode {session}: {reason or 'transfer failed'}")
            self.update_status(room, KVPoll.Failed)
            return
        confirmed = self._confirmed.setdefault(room, set())
        confirmed.add(session)
        wanted = {s for s, info in self.transfer_infos.get(room, {}).items() if not info.is_dummy}
        if wanted <= confirmed:
            self._confirmed.pop(room, None)
            self._last_sent.pop(room, None)
            self.update_status(room, KVPoll.Success)

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: npt.NDArray[np.int32],
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        num_kv_tokens: Optional[int] = None,
        **_: Any,
    ) -> None:
        """The sender's ``send``: tells each decode worker to pull this chunk (prefill side)."""
        room = bootstrap_room
        if room not in self.request_status or self.check_status(room) == KVPoll.Failed:
            return
        src_swa = _swa_indices(state_indices) if is_last_chunk else None
        infos = [info for info in self.transfer_infos.get(room, {}).values() if not info.is_dummy]
        src = np.asarray(kv_indices, dtype=np.int32)
        for info in infos:
            dst = info.dst_kv_indices[index_slice]
            why = ""
            if len(dst) != len(src):
                why = f"chunk of {len(src)} pages at {index_slice.start} but the decode {info.session} gave " \
                      f"{len(dst)} pages there"
            elif src_swa is not None and (info.dst_swa_indices is None or len(info.dst_swa_indices) != len(src_swa)):
                theirs = "none" if info.dst_swa_indices is None else len(info.dst_swa_indices)
                why = f"{len(src_swa)} sliding-window pages but the decode {info.session} gave {theirs}"
            if why:
                self.conclude_failure(bootstrap_room=room, failure_reason=why)
                return
            frames = [
                PULL_TAG, str(room).encode("ascii"), str(self._prefill_unique_rank()).encode("ascii"),
                str(self.cluster_id).encode("ascii"), self.local_ip.encode("ascii"),
                str(self._datadist.listen_port).encode("ascii"), str(self.rank_port).encode("ascii"),
                src.tobytes(), dst.tobytes(), b"1" if is_last_chunk else b"0",
                str(aux_index).encode("ascii") if is_last_chunk and aux_index is not None else b"",
                str(info.dst_aux_index).encode("ascii") if is_last_chunk and info.dst_aux_index is not None else b"",
                json.dumps(self.layout.to_wire()).encode("utf-8"),
                src_swa.tobytes() if src_swa is not None else b"",
                info.dst_swa_indices.tobytes() if src_swa is not None and info.dst_swa_indices is not None else b"",
            ]
            na = NetworkAddress(info.endpoint, info.dst_port)
            try:
                self._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
            except Exception as exc:
                self.conclude_failure(bootstrap_room=room,
                                      failure_reason=f"cannot reach the decode {info.session}: {exc}")
                return
        self.update_status(room, KVPoll.Transferring)
        if is_last_chunk:
            if infos:
                self._last_sent[room] = time.monotonic()
            else:
                self.update_status(room, KVPoll.Success)

    # -- decode side --------------------------------------------------------------------

    def _on_decode_message(self, msg: List[bytes]) -> None:
        if msg[0] == PULL_TAG:
            self._on_pull(msg)
            return
        parsed = self.parse_kv_status_message(msg)
        if parsed is not None:
            room, status, prefill_rank, reason = parsed
            self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=prefill_rank,
                                      failure_reason=reason)

    def _peer(self, cluster_id: int, host: str, port: int, layout_json: bytes) -> _Peer:
        """The prefill worker ``cluster_id``: its layout paired with this worker's, linked on first
        use (control thread)."""
        peer = self._peers.get(cluster_id)
        if peer is not None:
            return peer
        layout = BufferLayout.from_wire(json.loads(layout_json.decode("utf-8")))
        pairing = self.layout.pair_with(layout)
        cluster = dd.LLMClusterInfo()
        cluster.remote_cluster_id = cluster_id
        cluster.append_local_ip_info("0.0.0.0", 0)
        cluster.append_remote_ip_info(host, port)
        _, per_cluster = self._datadist.link_clusters([cluster], _LINK_TIMEOUT_MS)
        if per_cluster[0] not in (dd.LLMStatusCode.LLM_SUCCESS, dd.LLMStatusCode.LLM_ALREADY_LINK):
            raise dd.LLMException(f"link to the prefill at {host}:{port} failed", status_code=per_cluster[0])
        peer = self._peers[cluster_id] = _Peer(cluster_id, host, port, pairing, cluster)
        with self._rooms_lock:
            self._unlinked.discard(cluster_id)
        log.info("datadist_aio: linked to the prefill at %s:%d (%s)", host, port, layout.describe())
        return peer

    def _forget(self, cluster_id: int) -> None:
        """Drops a prefill worker after a failure; a restarted one comes back under a new cluster id."""
        peer = self._peers.pop(cluster_id, None)
        if peer is not None and peer.cluster is not None:
            with self._rooms_lock:  # not a dropped link for the requests still waiting on it
                self._unlinked.add(cluster_id)
            try:
                self._datadist.unlink_clusters([peer.cluster], timeout=100, force=True)
            except Exception as exc:
                log.debug("datadist_aio: unlink after failure: %s", exc)

    def _on_pull(self, msg: List[bytes]) -> None:
        room = int(msg[1].decode("ascii"))
        prefill_rank = int(msg[2].decode("ascii"))
        cluster_id = int(msg[3].decode("ascii"))
        host, port, control_port = msg[4].decode("ascii"), int(msg[5].decode("ascii")), int(msg[6].decode("ascii"))
        src, dst = np.frombuffer(msg[7], dtype=np.int32), np.frombuffer(msg[8], dtype=np.int32)
        is_last = msg[9] == b"1"
        src_aux = int(msg[10].decode("ascii")) if msg[10] else None
        dst_aux = int(msg[11].decode("ascii")) if msg[11] else None
        swa = (np.frombuffer(msg[13], dtype=np.int32).tolist(), np.frombuffer(msg[14], dtype=np.int32).tolist()) \
            if len(msg) > 14 and msg[13] else None
        if room not in self.request_status or self.request_status[room] == KVPoll.Failed:
            # Aborted or failed here already: the prefill may free the request's pages now.
            self._send_done((host, control_port), room, KVPoll.Failed, "the decode no longer waits for this request")
            return
        with self._rooms_lock:
            stale, self._stale = self._stale, set()
        for dropped in stale:
            self._forget(dropped)
        where = f"the prefill at {host}:{port}"
        with self._rooms_lock:
            pulls = self._rooms.setdefault(room, _RoomPulls())
            pulls.prefills[prefill_rank] = (host, control_port)
        try:
            peer = self._peer(cluster_id, host, port, msg[12])
        except LayoutMismatch as exc:
            self._fail_room(room, str(exc))
            return
        except Exception as exc:
            self._forget(cluster_id)
            self._fail_room(room, f"cannot link to {where}: {type(exc).__name__}: {exc}")
            return
        pairing = peer.pairing
        with self._rooms_lock:
            aux = (src_aux, dst_aux) if is_last and src_aux is not None and dst_aux is not None \
                and not pulls.aux_pulled else None
            pulls.aux_pulled = pulls.aux_pulled or aux is not None
            pulls.sources |= pairing.sources
            pulls.engines[prefill_rank] = (cluster_id, where)  # linked: its link is watched from now on
        manager = self._datadist.cache_manager
        tasks: List[Tuple[dd.CacheTask, str, int]] = []
        nbytes = 0
        try:
            for pull in pairing.pulls(src.tolist(), dst.tolist(), aux, swa):
                key, cache = dd.BlocksCacheKey(peer.cluster_id, pull.group), self._caches[pull.group]
                # A prefill stage's tensors go to their layers among ours: a pull per run of them.
                layers: List[dict[str, Any]] = [{}] if pull.spans is None else [
                    {"src_layer_range": range(first, first + count), "dst_layer_range": range(at, at + count),
                     "tensor_num_per_layer": 1} for first, at, count in pull.spans]
                for span in layers:
                    if pull.rows is None:
                        task = manager.pull_blocks_async(key, cache, list(pull.src_blocks), list(pull.dst_blocks),
                                                         **span)
                    else:
                        task = manager.pull_block_ranges_async(key, cache, pull.rows, **span)
                    tasks.append((task, f"{self.layout.groups[pull.group].kind} pages from {where}", cluster_id))
                nbytes += pull.nbytes
        except Exception as exc:  # refused before any byte moved (a dropped link, ...)
            self._forget(cluster_id)
            error = f"pull from {where} refused: {type(exc).__name__}: {exc}"
        else:
            error = ""
        with self._rooms_lock:
            pulls.tasks.extend(tasks)
            pulls.rank_tasks.setdefault(prefill_rank, []).extend(task for task, _, _ in tasks)
            pulls.nbytes += nbytes
            if is_last:
                pulls.last_from.add(prefill_rank)
                pulls.sources_done.add(pairing.theirs.tp_rank)
        if error:
            self._fail_room(room, error)

    def _fail_room(self, room: int, reason: str) -> None:
        log.warning("datadist_aio: request %s failed: %s", room, reason)
        with self._rooms_lock:
            pulls = self._rooms.get(room)
            if pulls is not None and not pulls.error:
                pulls.error = reason
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)
        self._tell_prefills(room, KVPoll.Failed, reason)

    def _tell_prefills(self, room: int, status: int, reason: str = "") -> None:
        """Tells every prefill rank of the request how it ended here (a failure: those not told
        already that their part landed)."""
        with self._rooms_lock:
            pulls = self._rooms.get(room)
            targets = [target for rank, target in pulls.prefills.items()
                       if status == KVPoll.Success or rank not in pulls.told] if pulls is not None else []
        for target in targets:
            self._send_done(target, room, status, reason)

    def _tell_ranks_done(self, room: int) -> None:
        """While a request waits for other ranks (pipeline stages), tells each rank whose last
        chunk was pulled, every pull of it complete, that its part landed: its pages go free,
        and SGLang's measure of its transfer ends there, not at the last stage's."""
        with self._rooms_lock:
            pulls = self._rooms.get(room)
            if pulls is None:
                return
            ready = [rank for rank in pulls.last_from - pulls.told
                     if all(task.done() and all(s is dd.LLMStatusCode.LLM_SUCCESS for s in task.get_results(0))
                            for task in pulls.rank_tasks.get(rank, []))]
            pulls.told.update(ready)
            targets = [pulls.prefills[rank] for rank in ready if rank in pulls.prefills]
        for target in targets:
            self._send_done(target, room, KVPoll.Success)

    def _send_done(self, target: Tuple[str, int], room: int, status: int, reason: str = "") -> None:
        """Tells a prefill worker's control socket how a request ended here (it frees its pages)."""
        frames = [DONE_TAG, str(room).encode("ascii"), str(int(status)).encode("ascii"),
                  reason[:512].encode("utf-8"), self._session().encode("ascii")]
        na = NetworkAddress(*target)
        try:
            self._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
        except Exception as exc:
            log.debug("datadist_aio: could not tell %s:%d about request %s: %s", target[0], target[1], room, exc)

    def check_status(self, bootstrap_room: int) -> KVPoll:
        status = self.request_status[bootstrap_room]
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            sent = self._last_sent.get(bootstrap_room)
            if status == KVPoll.Transferring and sent is not None and time.monotonic() - sent > self.confirm_timeout_s:
                self._last_sent.pop(bootstrap_room, None)
                self.record_failure(bootstrap_room, f"the decode did not confirm the transfer within "
                                                    f"{self.confirm_timeout_s:g} s")
                self.update_status(bootstrap_room, KVPoll.Failed)
                return KVPoll.Failed
            return status
        if status in (KVPoll.Success, KVPoll.Failed):
            return status
        with self._rooms_lock:
            pulls = self._rooms.get(bootstrap_room)
            if pulls is None:
                return status
            tasks, complete = list(pulls.tasks), len(pulls.last_from)
            missing = sorted(pulls.sources - pulls.sources_done)
            awaited = [engine for rank, engine in pulls.engines.items() if rank not in pulls.last_from]
        error = ""
        for task, what, cluster_id in tasks:
            if not task.done():
                return KVPoll.Transferring
            bad = [s for s in task.get_results(0) if s is not dd.LLMStatusCode.LLM_SUCCESS]
            if bad and not error:
                error = f"pull of {what} failed: {bad[0].name}"
                with self._rooms_lock:
                    self._stale.add(cluster_id)
        if error:
            self._fail_room(bootstrap_room, error)
            return KVPoll.Failed
        required = self.required_prefill_response_num_table.get(bootstrap_room, 1)
        if complete < required:
            dropped = self._dropped(awaited)
            if dropped:
                self._fail_room(bootstrap_room, dropped)
                return KVPoll.Failed
            self._tell_ranks_done(bootstrap_room)
            self.update_status(bootstrap_room, KVPoll.Transferring)
            return KVPoll.Transferring
        if missing:  # SGLang's rank mapping and this worker's head mapping disagree: never a wrong token
            self._fail_room(bootstrap_room, f"no KV came from the prefill ranks {missing}, which hold heads of this "
                                            f"decode worker ({self.layout.describe()})")
            return KVPoll.Failed
        self.update_status(bootstrap_room, KVPoll.Success)
        self._tell_prefills(bootstrap_room, KVPoll.Success)
        with self._rooms_lock:
            self._rooms.pop(bootstrap_room, None)
        return KVPoll.Success

    def _dropped(self, engines: List[Tuple[int, str]]) -> str:
        """Why a request waiting on more chunks from these prefill engines cannot get them: the
        link to one is gone (its process died: the engine drops a link whose connection closes),
        or "" (decode side). Found at the next poll, before SGLang's heartbeat would; a frozen
        prefill keeps its link, and the heartbeat or the pull's deadline finds it."""
        for cluster_id, where in engines:
            with self._rooms_lock:
                if cluster_id in self._unlinked:
                    continue  # unlinked here after a failed pull, linked again at its next chunk
            try:
                self._datadist.link_transport(cluster_id)
            except dd.LLMException as exc:
                if exc.status_code is not dd.LLMStatusCode.LLM_NOT_YET_LINK:
                    continue  # not an answer about the link (the engine is stopping): the deadlines stand
                with self._rooms_lock:
                    self._stale.add(cluster_id)
                return f"the link to {where} dropped before its last chunk came (LLM_LINK_FAILED)"
        return ""

    def forget_room(self, room: int) -> None:
        """Drops what the prefill side kept of a request SGLang has cleared."""
        self._last_sent.pop(room, None)
        self._confirmed.pop(room, None)

    def settle_room(self, room: int) -> None:
        """Cancels a request's pulls and waits until none can write any more (decode side)."""
        with self._rooms_lock:
            pulls = self._rooms.pop(room, None)
        if pulls is None:
            return
        for task, _, _ in pulls.tasks:
            if not task.done():
                task.cancel()
        for task, _, _ in pulls.tasks:
            task.synchronize(int(self.timeout_s * 1000) + 5000)

    def teardown(self) -> None:
        self._stopped = True
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self._heartbeat_shutdown.set()
        self._datadist.finalize()


class DatadistAioKVSender(CommonKVSender):
    """SGLang's prefill-side handle of one request; ``send`` goes to ``add_transfer_request``."""

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_room(self.bootstrap_room)


class _SealingSocket:
    """A receiver's socket to a prefill's control socket: what SGLang's
    receiver sends on it (registration, metadata, aborts) goes sealed."""

    def __init__(self, sock: Any, guard: MessageGuard, port: int) -> None:
        self._sock = sock
        self._guard = guard
        self._port = port

    def send_multipart(self, parts: List[bytes], *args: Any, **kwargs: Any) -> Any:
        return self._sock.send_multipart(sealed_messages.seal_parts(self._guard, list(parts), self._port),
                                         *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class DatadistAioKVReceiver(CommonKVReceiver):
    """SGLang's decode-side handle of one request: an abort cancels its pulls before SGLang frees its pages."""

    def _connect_to_bootstrap_server(self, bootstrap_info: dict) -> Tuple[Any, Any]:  # type: ignore[override]
        sock, lock = super()._connect_to_bootstrap_server(bootstrap_info)
        guard: MessageGuard = self.kv_mgr._guard
        if not guard.enabled:
            return sock, lock
        return _SealingSocket(sock, guard, int(bootstrap_info["rank_port"])), lock

    def abort(self) -> None:
        super().abort()
        self.kv_mgr.settle_room(self.bootstrap_room)

    def _clear(self) -> None:
        self.kv_mgr.settle_room(self.bootstrap_room)
        super()._clear()


class DatadistAioKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's common bootstrap server: prefill ranks register, decode ranks look them up."""

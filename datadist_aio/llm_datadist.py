"""LLMDataDist: the per-process entry point, as in LLM-DataDist v2."""

from __future__ import annotations

import atexit
import logging
import threading
from types import TracebackType
from typing import Any, ClassVar, Optional, Union

from . import _logging, _native
from ._checks import (
    check_int32,
    check_isinstance,
    check_uint64,
    parse_listen_ip_info,
    raise_if_false,
    raise_if_true,
)
from .cache_manager import CacheManager
from .cluster_info import LLMClusterInfo, int_to_ipv4
from .completions import CompletionDispatcher
from .enums import LLMRole, RegisterMemStatus
from .rank_table import comm_members
from .status import LLMException, LLMStatusCode, code_from_native, raise_for_status

__all__ = ["LLMDataDist"]

_log = logging.getLogger("datadist_aio")  # names: datadist_aio/_logging.py

_ROLE_OPTION = {LLMRole.PROMPT: "Prompt", LLMRole.DECODER: "Decoder", LLMRole.MIX: "Mix"}
_OPT_ROLE = "llm.Role"
_OPT_CACHE_MANAGER = "llm.EnableCacheManager"
_OPT_REMOTE_ACCESSIBLE = "llm.EnableRemoteCacheAccessible"
_OPT_LOCAL_COMM_RES = "llm.LocalCommRes"
_OPT_LISTEN_IP_INFO = "llm.listenIpInfo"
_OPT_FLOW_GRAPH_MEM = "ge.flowGraphMemMaxSize"



class LinkTransport(str):
    """The path of a link (a str, as ``link_transport`` always returned),
    with how the link is protected."""

    encrypted: bool
    cipher: str
    kernel_tls: bool

    def __new__(
        cls, name: str, *, encrypted: bool = False, cipher: str = "", kernel_tls: bool = False
    ) -> "LinkTransport":
        self = super().__new__(cls, name)
        self.encrypted = encrypted
        self.cipher = cipher
        self.kernel_tls = kernel_tls
        return self

class LLMDataDist:
    """One KV-cache endpoint of a disaggregated server, identified by ``cluster_id``.

    Only one instance may be initialised per process at a time. Use
    ``init(options)`` / ``finalize()``, or the instance as a context manager
    (``finalize`` on exit).
    """

    _live: ClassVar[Optional["LLMDataDist"]] = None
    _live_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole, allow_none=False)
        check_uint64("cluster_id", cluster_id)
        _logging.start()
        self._role = role
        self._cluster_id = cluster_id
        self._engine: Any = None
        self._dispatcher: Optional[CompletionDispatcher] = None
        self._cache_manager: Optional[CacheManager] = None
        self._local_comm_res = False

    def __repr__(self) -> str:
        state = "initialized" if self._engine is not None else "not initialized"
        return f"<LLMDataDist {self._role.name} cluster_id={self._cluster_id} {state}>"

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def role(self) -> LLMRole:
        return self._role

    def _check_init(self) -> None:
        if self._engine is None:
            raise RuntimeError("llm datadist is not initialized")

    def init(self, options: dict[str, str]) -> None:
        """Starts the engine with ``options`` (usually ``LLMConfig().generate_options()``).

        Only cache-manager mode exists here: ``llm.EnableCacheManager`` must be
        ``"1"`` (``LLMConfig.enable_cache_manager = True``).
        """
        if self._engine is not None:
            return
        with LLMDataDist._live_lock:
            raise_if_true(
                LLMDataDist._live is not None,
                "another LLMDataDist is initialized in this process; finalize it first",
                status_code=LLMStatusCode.LLM_FAILED,
            )
            self._init_locked(options)
            LLMDataDist._live = self

    def _init_locked(self, options: dict[str, str]) -> None:
        check_isinstance("options", options, dict, allow_none=False)
        flow_graph_mem = options.get(_OPT_FLOW_GRAPH_MEM)
        if flow_graph_mem is not None:
            check_isinstance(_OPT_FLOW_GRAPH_MEM, flow_graph_mem, str)
            raise_if_true("," in flow_graph_mem, f"{_OPT_FLOW_GRAPH_MEM} must be a single number")
            raise_if_false(flow_graph_mem.isdigit(), f"{_OPT_FLOW_GRAPH_MEM} must be all digits")
        options[_OPT_ROLE] = _ROLE_OPTION[self._role]
        if _OPT_LOCAL_COMM_RES in options:
            options.setdefault(_OPT_CACHE_MANAGER, "1")
            options.setdefault(_OPT_REMOTE_ACCESSIBLE, "1")
        cache_manager_mode = options.get(_OPT_CACHE_MANAGER) == "1"
        raise_if_true(
            _OPT_LOCAL_COMM_RES in options and not cache_manager_mode,
            f"{_OPT_LOCAL_COMM_RES} needs cache-manager mode",
        )
        raise_if_false(
            cache_manager_mode,
            "only cache-manager mode is available: set LLMConfig.enable_cache_manager = True",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )
        _add_listen_options(options)
        self._local_comm_res = bool(options.get(_OPT_LOCAL_COMM_RES))
        engine = _native.Engine(self._cluster_id)
        native_options = {str(k): str(v) for k, v in options.items()}
        raise_for_status(engine.initialize(native_options), "initialize the engine")
        self._engine = engine
        self._dispatcher = CompletionDispatcher(engine)
        self._cache_manager = CacheManager(
            engine, self._dispatcher, remote_cache_accessible=options.get(_OPT_REMOTE_ACCESSIBLE) == "1"
        )

    def finalize(self) -> None:
        """Stops the engine. Work still in flight is stopped and its tasks fail
        with ``LLM_ENGINE_FINALIZED`` once everything they started has settled.
        A no-op when not initialised."""
        engine = self._engine
        if engine is None:
            return
        assert self._cache_manager is not None
        self._cache_manager._abandon_transfers()
        engine.finalize()
        assert self._dispatcher is not None and self._cache_manager is not None
        self._dispatcher.close()
        self._cache_manager._invalidate()
        self._engine = None
        with LLMDataDist._live_lock:
            if LLMDataDist._live is self:
                LLMDataDist._live = None

    @property
    def listen_port(self) -> Optional[int]:
        """The port this instance accepts links on (``listen_ip_info`` with
        port 0 picks a free one), or None when it does not listen."""
        self._check_init()
        port = self._engine.listen_port
        return port or None

    def link_transport(self, remote_cluster_id: int) -> "LinkTransport":
        """How transfers this instance starts toward ``remote_cluster_id`` move
        their bytes: ``"same_host"`` (the peer copies them with one kernel call,
        or device to device through CUDA IPC for device memory), ``"ucx"`` or
        ``"tcp"``. The str also says how the link is protected:
        ``.encrypted`` (its TCP connections carry TLS, see
        ``LLMConfig.link_encryption``), ``.cipher`` (the TLS cipher suite, or
        ``""``) and ``.kernel_tls`` (the kernel carries the records).

        Raises:
            LLMException: ``LLM_NOT_YET_LINK`` without a link to that cluster.
        """
        self._check_init()
        check_uint64("remote_cluster_id", remote_cluster_id)
        code, name, encrypted, cipher, kernel_tls = self._engine.link_security(remote_cluster_id)
        raise_for_status(code, f"link_transport({remote_cluster_id})")
        return LinkTransport(name, encrypted=encrypted, cipher=cipher, kernel_tls=kernel_tls)

    def answer_counts(self) -> dict[str, int]:
        """How many answers of same-host links each kind of reader has read
        (not in upstream's API; a diagnostic): ``"drain"`` an event loop
        woken by the completion fd, ``"look"`` a thread asking a task
        (``done()``, ``get_results(0)``), ``"thread"`` the engine's answer
        thread on behalf of a blocking wait, ``"sweep"`` the engine's
        housekeeping for answers nobody waited for, ``"link"`` a link
        settling its operations as it goes down. See docs/design.md, "Who reads
        an answer".
        """
        self._check_init()
        return {str(name): int(count) for name, count in self._engine.answer_counts().items()}

    def _check_clusters(self, clusters: Any, timeout: Any) -> None:
        check_int32("timeout", timeout)
        raise_if_false(timeout > 0, f"timeout must be > 0, got {timeout}")
        check_isinstance("clusters", clusters, (list, tuple), LLMClusterInfo, allow_none=False)
        for cluster in clusters:
            if cluster.remote_cluster_id is None:
                raise TypeError("remote_cluster_id of every cluster must be set")

    def link_clusters(
        self, clusters: Union[list[LLMClusterInfo], tuple[LLMClusterInfo, ...]], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Links to every cluster in ``clusters`` (at most ``timeout`` ms each).

        Does not raise for link failures: returns the overall status and one
        status per cluster (``LLM_ALREADY_LINK``, ``LLM_LINK_FAILED``,
        ``LLM_TIMEOUT``, ``LLM_PARAM_INVALID`` ...).
        """
        self._check_init()
        self._check_clusters(clusters, timeout)
        if not self._local_comm_res:
            for cluster in clusters:
                raise_if_false(
                    len(cluster.local_ip_info_list) > 0,
                    f"cluster {cluster.remote_cluster_id} has no local ip info",
                )
        statuses: list[Optional[LLMStatusCode]] = [None] * len(clusters)
        targets, where = [], []
        for index, cluster in enumerate(clusters):
            if len(cluster.remote_ip_info_list) != 1 or len(cluster.local_ip_info_list) > 1:
                statuses[index] = LLMStatusCode.LLM_PARAM_INVALID
                continue
            remote_ip, remote_port = cluster.remote_ip_info_list[0]
            local_ip = int_to_ipv4(cluster.local_ip_info_list[0][0]) if cluster.local_ip_info_list else ""
            targets.append((cluster.remote_cluster_id, int_to_ipv4(remote_ip), remote_port, local_ip))
            where.append(index)
        return self._collect(statuses, where, self._engine.link_clusters(targets, timeout) if targets else None)

    def unlink_clusters(
        self,
        clusters: Union[list[LLMClusterInfo], tuple[LLMClusterInfo, ...]],
        timeout: int = 3000,
        force: bool = False,
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Removes the links to ``clusters``. Without ``force`` each peer is asked
        to drop its end and the call returns once it has (``LLM_UNLINK_FAILED``
        if it did not answer within ``timeout`` ms; the local end is gone anyway).

        Same return convention as ``link_clusters``.
        """
        self._check_init()
        self._check_clusters(clusters, timeout)
        check_isinstance("force", force, bool, allow_none=False)
        statuses: list[Optional[LLMStatusCode]] = [None] * len(clusters)
        peers, where = [], []
        for index, cluster in enumerate(clusters):
            if not force and len(cluster.remote_ip_info_list) != 1:
                statuses[index] = LLMStatusCode.LLM_PARAM_INVALID
                continue
            peers.append(cluster.remote_cluster_id)
            where.append(index)
        return self._collect(statuses, where, self._engine.unlink_clusters(peers, force, timeout) if peers else None)

    @staticmethod
    def _collect(
        statuses: list[Optional[LLMStatusCode]], where: list[int], native: Optional[tuple[int, list[int]]]
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        if native is not None:
            for index, code in zip(where, native[1]):
                statuses[index] = code_from_native(code)
        final = [s if s is not None else LLMStatusCode.LLM_PARAM_INVALID for s in statuses]
        if not final:
            return LLMStatusCode.LLM_PARAM_INVALID, final
        failed = [s for s in final if s is not LLMStatusCode.LLM_SUCCESS]
        return (failed[0] if failed else LLMStatusCode.LLM_SUCCESS), final

    def switch_role(self, role: LLMRole, switch_options: Optional[dict[str, str]] = None) -> None:
        """Changes the role label and the listening state.

        With ``llm.listenIpInfo`` in ``switch_options`` the instance listens
        there (the same address keeps the current listener); without it, it
        stops listening. Raises ``LLMException(LLM_EXIST_LINK)`` while links exist.
        """
        self._check_init()
        check_isinstance("role", role, LLMRole, allow_none=False)
        check_isinstance("switch_options", switch_options, dict)
        options = dict(switch_options or {})
        _add_listen_options(options)
        ip = options.get("llm.ListenIp")
        port = int(options.get("llm.ListenPort", "0"))
        raise_for_status(self._engine.switch_role(_ROLE_OPTION[role], ip, port), f"switch_role to {role.name}")
        self._role = role

    # -- two-sided links over a rank table --------------------------------------

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Links the members of a rank table to each other and returns the
        comm id at once; the links come up in the background.

        Every member calls ``link`` with the same ``cluster_rank_info``
        (cluster id to rank, ranks ascending, 2 to 4 members) and
        ``rank_table`` (see ``datadist_aio.rank_table``), at about the same
        time: the member with the lower rank accepts, the higher connects.
        ``query_register_mem_status(comm_id)`` is ``PREPARING`` until every
        link of the comm is up, then ``OK``, or ``FAILED`` once
        ``link_total_time`` has passed (``llm.LinkTotalTime``, seconds;
        default 120). Transfers then work as after ``link_clusters``.

        The comm keeps its links: one lost to a dead peer or to
        ``sync_kv_timeout`` is made again the same way, within
        ``link_total_time``; meanwhile the status is ``PREPARING`` and a
        transfer to that peer raises ``LLM_PROCESSING_LINK``, a code to retry on.

        A member that must accept and does not listen yet starts listening at
        its own entry of the table (``device_ip``, ``device_port``).
        Raises ``LLMException(LLM_PARAM_INVALID)`` for malformed arguments or
        tables and unknown ranks, and ``LLMException(LLM_ALREADY_LINK)`` when
        a live comm has the same name or shares a peer with this one.
        """
        self._check_init()
        members = comm_members(self._cluster_id, comm_name, cluster_rank_info, rank_table)
        status, comm_id = self._engine.link_comm(comm_name, members)
        raise_for_status(status, f"link {comm_name!r}")
        return comm_id

    def unlink(self, comm_id: int) -> None:
        """Removes the links of comm ``comm_id`` on both ends (a member still
        linking stops). Every member calls it; the peer that unlinks second
        finds its end already gone, which is no error.
        Raises ``LLMException(LLM_PARAM_INVALID)`` for an unknown comm id."""
        self._check_init()
        check_uint64("comm_id", comm_id)
        raise_for_status(self._engine.unlink_comm(comm_id), f"unlink comm {comm_id}")

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """``PREPARING`` while comm ``comm_id``'s links are being made, then
        ``OK`` or ``FAILED``. Raises ``LLMException(LLM_PARAM_INVALID)`` for an
        unknown comm id."""
        self._check_init()
        check_uint64("comm_id", comm_id)
        status, state = self._engine.comm_state(comm_id)
        raise_for_status(status, f"query comm {comm_id}")
        try:
            return RegisterMemStatus(state)
        except ValueError:
            return RegisterMemStatus.FAILED

    # -- upstream surface that has no meaning here --------------------------------

    @property
    def kv_cache_manager(self) -> Any:
        """Legacy (non cache-manager) mode only: ``LLMException`` here, as upstream
        in cache-manager mode."""
        self._check_init()
        raise LLMException("kv_cache_manager exists only in the legacy mode; use cache_manager",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)

    def check_link_status(self, remote_cluster_id: int) -> None:
        """Legacy (non cache-manager) mode only: ``LLMException``, as upstream in
        cache-manager mode."""
        self._check_init()
        raise LLMException("check_link_status exists only in the legacy mode",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)

    @property
    def cache_manager(self) -> CacheManager:
        self._check_init()
        assert self._cache_manager is not None
        return self._cache_manager

    def __enter__(self) -> "LLMDataDist":
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.finalize()


def _add_listen_options(options: dict[str, str]) -> None:
    """Splits ``llm.listenIpInfo`` ("ip:port") into the engine's ip and port options."""
    listen = options.get(_OPT_LISTEN_IP_INFO)
    if listen is not None:
        ip, port = parse_listen_ip_info(_OPT_LISTEN_IP_INFO, str(listen))
        options["llm.ListenIp"] = ip
        options["llm.ListenPort"] = str(port)


@atexit.register
def _finalize_at_exit() -> None:
    live = LLMDataDist._live
    if live is None:
        return
    try:
        live.finalize()
    except LLMException:
        _log.exception("finalize at exit failed")

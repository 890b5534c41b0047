"""Builder of the options dict passed to `LLMDataDist.init`."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from ._checks import (
    UINT32_MAX,
    check_dict,
    check_int32,
    check_isinstance,
    check_uint32,
    parse_listen_ip_info,
    raise_if_false,
)
from .cluster_info import ipv4_to_int

__all__ = ["LLMConfig", "LlmConfig"]

DeviceId = Union[int, list[int], tuple[int, ...]]


def _flag(value: bool) -> str:
    return "1" if value else "0"


def _check_int_in(name: str, value: Any, low: int, high: int) -> None:
    check_isinstance(name, value, int, allow_none=False)
    raise_if_false(low <= value <= high, "{} must be in [{}, {}], got {}", name, low, high, value)


class LLMConfig:
    """Collects engine options; every setter validates its value at once.

    `generate_options()` returns one dict that accumulates across calls:
    `ge_options` first, then every option that is set. A key, once emitted,
    stays in the dict.
    """

    def __init__(self) -> None:
        self._options: dict[str, str] = {}
        self._ge_options: dict[str, str] = {}
        self._listen_ip_info = ""
        self._device_id: Optional[DeviceId] = None
        self._sync_kv_timeout: Optional[Union[int, str]] = None
        self._mem_pool_cfg = ""
        self._host_mem_pool_cfg = ""
        self._enable_cache_manager: Optional[bool] = None
        self._enable_remote_cache_accessible: Optional[bool] = None
        self._local_comm_res: Optional[str] = None
        self._link_total_time: Optional[int] = None
        self._link_retry_count: Optional[int] = None
        self._rdma_traffic_class: Optional[int] = None
        self._rdma_service_level: Optional[int] = None
        self._deploy_res_path = ""
        self._buf_pool_cfg = ""
        self._cluster_info = ""
        self._cluster_info_json = ""
        self._output_max_size: Optional[int] = None
        self._enable_switch_role = False
        self._mem_utilization = 0.95
        self._tcp_connections_per_peer: Optional[int] = None
        self._engine_threads: Optional[int] = None
        self._io_threads: Optional[int] = None
        self._transport: Optional[str] = None
        self._auth_key: Optional[str] = None
        self._link_encryption: Optional[str] = None
        self._access: Optional[str] = None
        self._allow_unencrypted_ucx: Optional[bool] = None
        self._tls_files: dict[str, str] = {}  # option name -> path, of the certificate files set
        self._handshake_timeout_ms: Optional[int] = None
        self._answer_sweep_ms: Optional[int] = None

    @property
    def ge_options(self) -> dict[str, str]:
        """Extra engine options (str to str), merged verbatim before the others."""
        return self._ge_options

    @ge_options.setter
    def ge_options(self, value: dict[str, str]) -> None:
        check_dict("ge_options", value, str, str)
        self._ge_options = dict(value)

    @property
    def listen_ip_info(self) -> str:
        """Listen address `"ip:port"` of a server; emits `llm.listenIpInfo`.

        Raises:
            TypeError: If not a str.
            LLMException: `LLM_PARAM_INVALID` unless `"ip:port"` (or empty).
            ValueError: If the port is not an integer in [0, 65535].
        """
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, value: str) -> None:
        check_isinstance("listen_ip_info", value, str, allow_none=False)
        if value:
            parse_listen_ip_info("listen_ip_info", value)
        self._listen_ip_info = value

    @property
    def device_id(self) -> Optional[DeviceId]:
        """Device of this process: an int, or a non-empty list/tuple of int.

        An int emits `ge.exec.deviceId` and `ge.session_device_id`; a list
        emits the first id as `ge.session_device_id` and all ids joined by
        `;` as `ge.exec.deviceId`.

        Raises:
            TypeError: If not an int or a list/tuple of int.
            LLMException: `LLM_PARAM_INVALID` for an empty list or a
                negative id.
            ValueError: If an id is outside int32.
        """
        return self._device_id

    @device_id.setter
    def device_id(self, value: DeviceId) -> None:
        check_isinstance("device_id", value, (int, list, tuple), allow_none=False)
        if isinstance(value, int):
            named = [("device_id", value)]
        else:
            check_isinstance("device_id", value, (list, tuple), int)
            raise_if_false(value, "device_id must not be an empty {}", type(value).__name__)
            named = [(f"device_id[{index}]", device) for index, device in enumerate(value)]
        for name, device in named:
            raise_if_false(device >= 0, "{} must be >= 0, got {}", name, device)
            check_int32(name, device)
        self._device_id = value if isinstance(value, int) else list(value)

    @property
    def sync_kv_timeout(self) -> Optional[Union[int, str]]:
        """Per-transfer timeout in ms (engine default 1000); emits `llm.SyncKvCacheWaitTime`.

        Raises:
            TypeError: If not an int or str.
            LLMException: `LLM_PARAM_INVALID` for a str that is not all
                digits, or a value <= 0.
            ValueError: If the value is outside int32.
        """
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, value: Union[int, str]) -> None:
        check_isinstance("sync_kv_timeout", value, (int, str), allow_none=False)
        number: int = value if isinstance(value, int) else 0
        if isinstance(value, str):
            raise_if_false(
                value.isascii() and value.isdigit(),
                "sync_kv_timeout must be all digits, got {!r}",
                value,
            )
            number = int(value)
        raise_if_false(number > 0, "sync_kv_timeout must be > 0, got {}", value)
        check_int32("sync_kv_timeout", number)
        self._sync_kv_timeout = value

    @property
    def mem_pool_cfg(self) -> str:
        """Device pool JSON (`memory_size`, optional `page_shift`); emits `llm.MemPoolConfig`."""
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, value: str) -> None:
        check_isinstance("mem_pool_cfg", value, str, allow_none=False)
        self._mem_pool_cfg = value

    @property
    def host_mem_pool_cfg(self) -> str:
        """Host pool JSON (`memory_size`, optional `page_shift`); emits `llm.HostMemPoolConfig`."""
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, value: str) -> None:
        check_isinstance("host_mem_pool_cfg", value, str, allow_none=False)
        self._host_mem_pool_cfg = value

    @property
    def enable_cache_manager(self) -> bool:
        """Cache-manager (v2) mode; emits `llm.EnableCacheManager` once set."""
        return bool(self._enable_cache_manager)

    @enable_cache_manager.setter
    def enable_cache_manager(self, value: bool) -> None:
        check_isinstance("enable_cache_manager", value, bool, allow_none=False)
        self._enable_cache_manager = value

    @property
    def enable_remote_cache_accessible(self) -> bool:
        """Remote-cache-accessible (push) mode; emits `llm.EnableRemoteCacheAccessible` once set."""
        return bool(self._enable_remote_cache_accessible)

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, value: bool) -> None:
        check_isinstance("enable_remote_cache_accessible", value, bool, allow_none=False)
        self._enable_remote_cache_accessible = value

    @property
    def local_comm_res(self) -> str:
        """Local communication resource JSON; emits `llm.LocalCommRes` once set, even empty."""
        return self._local_comm_res or ""

    @local_comm_res.setter
    def local_comm_res(self, value: str) -> None:
        check_isinstance("local_comm_res", value, str, allow_none=False)
        self._local_comm_res = value

    @property
    def link_total_time(self) -> int:
        """Link-establishment timeout in s, [0, 2**32 - 1]; emits `llm.LinkTotalTime` once set."""
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, value: int) -> None:
        _check_int_in("link_total_time", value, 0, UINT32_MAX)
        self._link_total_time = value

    @property
    def link_retry_count(self) -> int:
        """Link retries, [1, 100]; emits `llm.LinkRetryCount` once set."""
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, value: int) -> None:
        _check_int_in("link_retry_count", value, 1, 100)
        self._link_retry_count = value

    @property
    def rdma_traffic_class(self) -> Optional[int]:
        """RDMA traffic class, a multiple of 4 in [0, 255]; emits `llm.RdmaTrafficClass`.

        Raises:
            TypeError: If not an int.
            ValueError: If outside uint32.
            LLMException: `LLM_PARAM_INVALID` if outside [0, 255] or not a
                multiple of 4.
        """
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, value: int) -> None:
        check_uint32("rdma_traffic_class", value)
        raise_if_false(
            value <= 255 and value % 4 == 0,
            "rdma_traffic_class must be a multiple of 4 in [0, 255], got {}",
            value,
        )
        self._rdma_traffic_class = value

    @property
    def rdma_service_level(self) -> Optional[int]:
        """RDMA service level in [0, 7]; emits `llm.RdmaServiceLevel`.

        Raises:
            TypeError: If not an int.
            ValueError: If outside uint32.
            LLMException: `LLM_PARAM_INVALID` if outside [0, 7].
        """
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, value: int) -> None:
        check_uint32("rdma_service_level", value)
        raise_if_false(value <= 7, "rdma_service_level must be in [0, 7], got {}", value)
        self._rdma_service_level = value

    @property
    def deploy_res_path(self) -> str:
        """Legacy deployment path; emits `llm.deployResPath` if non-empty."""
        return self._deploy_res_path

    @deploy_res_path.setter
    def deploy_res_path(self, value: str) -> None:
        check_isinstance("deploy_res_path", value, str, allow_none=False)
        self._deploy_res_path = value

    @property
    def buf_pool_cfg(self) -> str:
        """Legacy buffer-pool config; emits `llm.BufPoolCfg` if non-empty."""
        return self._buf_pool_cfg

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, value: str) -> None:
        check_isinstance("buf_pool_cfg", value, str, allow_none=False)
        self._buf_pool_cfg = value

    @property
    def cluster_info(self) -> str:
        """Legacy cluster JSON; emits `llm.ClusterInfo` if non-empty.

        String ips in its `listen_ip_info` list are encoded as by
        `ipv4_to_int` in the emitted JSON.

        Raises:
            TypeError: If not a str, or the JSON is not an object.
            json.JSONDecodeError: If the JSON is malformed.
            RuntimeError: If an ip is not a dotted IPv4 address.
        """
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, value: str) -> None:
        check_isinstance("cluster_info", value, str, allow_none=False)
        encoded = ""
        if value:
            data = json.loads(value)
            check_isinstance("cluster_info JSON", data, dict, allow_none=False)
            for endpoint in data.get("listen_ip_info", ()):
                if isinstance(endpoint, dict) and isinstance(endpoint.get("ip"), str):
                    endpoint["ip"] = ipv4_to_int(endpoint["ip"])
            encoded = json.dumps(data)
        self._cluster_info = value
        self._cluster_info_json = encoded

    @property
    def output_max_size(self) -> Union[int, str]:
        """Legacy output size limit; `""` until set; emits `llm.OutputMaxSize` once set."""
        return "" if self._output_max_size is None else self._output_max_size

    @output_max_size.setter
    def output_max_size(self, value: int) -> None:
        check_isinstance("output_max_size", value, int, allow_none=False)
        self._output_max_size = value

    @property
    def enable_switch_role(self) -> bool:
        """Legacy switch-role enable; emits `llm.EnableSwitchRole = "1"` only when True."""
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, value: bool) -> None:
        check_isinstance("enable_switch_role", value, bool, allow_none=False)
        self._enable_switch_role = value

    @property
    def mem_utilization(self) -> float:
        """Legacy memory share, a float in [0.0, 1.0]; `llm.MemoryUtilization` is always emitted.

        Raises:
            TypeError: If not a float (an int is rejected).
            LLMException: `LLM_PARAM_INVALID` if outside [0.0, 1.0].
        """
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, value: float) -> None:
        check_isinstance("mem_utilization", value, float, allow_none=False)
        raise_if_false(0.0 <= value <= 1.0, "mem_utilization must be in [0.0, 1.0], got {}", value)
        self._mem_utilization = value

    @property
    def tcp_connections_per_peer(self) -> Optional[int]:
        """TCP connections opened to each linked peer, in [1, 64].

        Transfers over one link are spread across these connections. Emits
        `llm.TcpConnectionsPerPeer`; unset leaves the engine default.

        Raises:
            TypeError: If not an int.
            LLMException: `LLM_PARAM_INVALID` if outside [1, 64].
        """
        return self._tcp_connections_per_peer

    @tcp_connections_per_peer.setter
    def tcp_connections_per_peer(self, value: int) -> None:
        _check_int_in("tcp_connections_per_peer", value, 1, 64)
        self._tcp_connections_per_peer = value

    @property
    def handshake_timeout_ms(self) -> Optional[int]:
        """Time in ms an accepted connection has to finish its handshake, and a
        link to bring all its connections, in [1, 600000] (engine default 5000).

        A connection still short of it is closed, however it trickles its
        bytes. Emits `llm.HandshakeTimeoutMs`; unset leaves the engine default.

        Raises:
            TypeError: If not an int.
            LLMException: `LLM_PARAM_INVALID` if outside [1, 600000].
        """
        return self._handshake_timeout_ms

    @handshake_timeout_ms.setter
    def handshake_timeout_ms(self, value: int) -> None:
        _check_int_in("handshake_timeout_ms", value, 1, 600000)
        self._handshake_timeout_ms = value

    @property
    def answer_sweep_ms(self) -> Optional[int]:
        """Time in ms an answer of a same-host link may wait with nobody
        reading it before the engine's housekeeping reads it, in [0, 600000]
        (engine default 100; 0: never); emits `llm.AnswerSweepMs`.

        Every way of waiting for a task reads its own answers: an awaiting
        loop, a blocking ``synchronize``, a poll of ``done()``, a callback.
        The sweep is for tasks nobody waits for; with it off, they settle at
        the next look or at ``sync_kv_timeout``.

        Raises:
            TypeError: If not an int.
            LLMException: `LLM_PARAM_INVALID` if outside [0, 600000].
        """
        return self._answer_sweep_ms

    @answer_sweep_ms.setter
    def answer_sweep_ms(self, value: int) -> None:
        _check_int_in("answer_sweep_ms", value, 0, 600000)
        self._answer_sweep_ms = value

    @property
    def io_threads(self) -> Optional[int]:
        """The transport's I/O threads, in [1, 64]; emits `llm.IoThreads`.

        A fixed number of threads writes the frames of every link, however
        many links there are. Unset: one per core.

        Raises:
            TypeError: If not an int.
            LLMException: `LLM_PARAM_INVALID` if outside [1, 64].
        """
        return self._io_threads

    @io_threads.setter
    def io_threads(self, value: int) -> None:
        _check_int_in("io_threads", value, 1, 64)
        self._io_threads = value

    @property
    def engine_threads(self) -> Optional[int]:
        """Engine worker threads for local copies, in [1, 64]; emits `llm.EngineThreads`.

        Unset leaves the engine default (2).

        Raises:
            TypeError: If not an int.
            LLMException: `LLM_PARAM_INVALID` if outside [1, 64].
        """
        return self._engine_threads

    @engine_threads.setter
    def engine_threads(self, value: int) -> None:
        _check_int_in("engine_threads", value, 1, 64)
        self._engine_threads = value

    @property
    def transport(self) -> Optional[str]:
        """How links move bytes: ``"auto"``, ``"tcp"`` or ``"ucx"``; emits `llm.Transport`.

        ``"auto"`` (the engine default) moves the bytes of a link between two
        processes on one host with one kernel copy (``process_vm_readv`` /
        ``process_vm_writev``) once the handshake has proven that each can
        reach the other's memory, and over TCP otherwise; ``"tcp"`` always uses
        sockets. ``"ucx"`` moves them with UCX (RDMA where UCX finds a NIC,
        else its shared memory or TCP, as ``UCX_TLS`` allows): the owner reads
        or writes the initiator's host caches with UCX's one-sided operations;
        device caches go over the link's sockets, staged. Both ends must say
        ``"ucx"``, and ``init`` fails with `LLM_FEATURE_NOT_ENABLED` where UCX
        is not installed (``pip install 'datadist_aio[ucx]'`` or the system's
        UCX). The owner of a cache checks every range either way.

        Raises:
            TypeError: If not a str.
            LLMException: `LLM_PARAM_INVALID` for any other value.
        """
        return self._transport

    @transport.setter
    def transport(self, value: str) -> None:
        check_isinstance("transport", value, str, allow_none=False)
        raise_if_false(value in ("auto", "tcp", "ucx"), "transport must be 'auto', 'tcp' or 'ucx', got {!r}", value)
        self._transport = value

    @property
    def auth_key(self) -> Optional[str]:
        """A secret shared by the peers that may link to each other; emits `llm.AuthKey`.

        With a secret, every connection of a link proves it in both
        directions before anything else is accepted (an HMAC-SHA256
        challenge-response over the whole handshake, with fresh nonces from
        both sides; the secret never crosses the wire), and a peer without it
        is refused with ``LLM_AUTH_FAILED``. Unset, the engine reads the
        environment variable ``DATADIST_AIO_AUTH_KEY``; with neither, links are
        not authenticated and a warning says so once. The secret decides who
        may link, read and write remote-accessible caches; it does not hide
        or protect the bytes on the wire (see docs/security.md).

        Raises:
            TypeError: If not a str.
            LLMException: `LLM_PARAM_INVALID` if empty.
        """
        return self._auth_key

    @auth_key.setter
    def auth_key(self, value: str) -> None:
        check_isinstance("auth_key", value, str, allow_none=False)
        raise_if_false(len(value) > 0, "auth_key must not be empty")
        self._auth_key = value

    @property
    def link_encryption(self) -> Optional[str]:
        """``"off"`` or ``"tls"``: whether links encrypt their TCP connections; emits `llm.LinkEncryption`.

        With ``"tls"``, every TCP connection of a link runs TLS 1.3 once its
        handshake has proven the link secret, so nothing on the wire between
        hosts can be read or altered: the keys come from ``auth_key`` (an
        external PSK derived per connection, no certificates), with
        TLS_AES_128_GCM_SHA256, handed to the kernel (kTLS) where it offers
        that. A same-host link that moved to Unix sockets and copies with the
        kernel crosses no wire and is not encrypted. Both ends of a link must
        say the same, else ``link_clusters`` fails with `LLM_LINK_FAILED`
        naming both settings. Unset, the engine reads the environment variable
        ``DATADIST_AIO_LINK_ENCRYPTION``; with neither, ``"off"``. ``init``
        fails with `LLM_PARAM_INVALID` for ``"tls"`` without a link secret, and
        with `LLM_FEATURE_NOT_ENABLED` where OpenSSL's libssl cannot be
        loaded. Certificates may authenticate the TLS instead of the secret
        (``tls_cert_file``). See docs/security.md.

        Raises:
            TypeError: If not a str.
            LLMException: `LLM_PARAM_INVALID` for any other value.
        """
        return self._link_encryption

    @link_encryption.setter
    def link_encryption(self, value: str) -> None:
        check_isinstance("link_encryption", value, str, allow_none=False)
        raise_if_false(value in ("off", "tls"), "link_encryption must be 'off' or 'tls', got {!r}", value)
        self._link_encryption = value

    @property
    def access(self) -> Optional[str]:
        """``"one_sided"`` or ``"owner"``: who moves an operation's bytes; emits `llm.Access`.

        ``"one_sided"`` (the default): where a linked peer on the same host
        reaches this process's memory (the same-host path), this engine grants
        it each remotely accessible host-memory cache once (its addresses and
        geometry), and an engine of the same setting moves the bytes of its
        pushes and pulls on caches it names by id or by a blocks key itself:
        its own kernel copies, every range checked against the grant, with no
        frame to the owner and none of the owner's threads. Deallocating,
        unregistering or finalizing revokes a cache's grants before its memory
        can be reused. Over UCX (transport ``"ucx"``), where a peer's endpoint
        reads and writes this process's memory by itself (RDMA, or a
        shared-memory transport of this host, from UCX 1.14 on), it is
        granted each such cache's tensors as UCX keys and moves the bytes
        with its own gets and puts. Reads through a cache key, device memory
        over UCX, TCP, and UCX over its ``tcp`` stay served by the owner. ``"owner"``: the owner of the memory moves
        every byte, as each operation's frame arrives. A link's ends may
        differ: one-sided needs both. Unset, the engine reads the environment
        variable ``DATADIST_AIO_ACCESS``; with neither, ``"one_sided"``.
        ``link_stats`` counts the bytes each way moved. See docs/security.md.

        Raises:
            TypeError: If not a str.
            LLMException: `LLM_PARAM_INVALID` for any other value.
        """
        return self._access

    @access.setter
    def access(self, value: str) -> None:
        check_isinstance("access", value, str, allow_none=False)
        raise_if_false(value in ("one_sided", "owner"), "access must be 'one_sided' or 'owner', got {!r}", value)
        self._access = value

    @property
    def allow_unencrypted_ucx(self) -> Optional[bool]:
        """Let UCX move bytes unencrypted while links are encrypted; emits `llm.AllowUnencryptedUcx`.

        TLS covers a link's TCP connections only; UCX moves bytes outside
        them. With ``link_encryption = "tls"``, ``transport = "ucx"`` is
        refused at ``init`` (`LLM_PARAM_INVALID`) and ``"auto"`` does not use
        UCX between hosts, unless this is True: then UCX carries the caches'
        bytes in the clear (the links' control frames stay in TLS).

        Raises:
            TypeError: If not a bool.
        """
        return self._allow_unencrypted_ucx

    @allow_unencrypted_ucx.setter
    def allow_unencrypted_ucx(self, value: bool) -> None:
        check_isinstance("allow_unencrypted_ucx", value, bool, allow_none=False)
        self._allow_unencrypted_ucx = value

    @property
    def tls_cert_file(self) -> Optional[str]:
        """This end's certificate chain (a PEM file), for link encryption
        authenticated by certificates; emits `llm.TlsCertFile`.

        Sites with a PKI may authenticate links' TLS with certificates
        instead of keys from ``auth_key``: set ``tls_cert_file``,
        ``tls_key_file`` (its private key) and ``tls_ca_file`` (the CA bundle
        every peer's chain must verify against), all three, with
        ``link_encryption = "tls"``. Both ends present their certificates
        (mutual TLS), and a link is made only with a peer whose chain the CA
        signed (any such certificate: names are not checked) and that uses
        certificates too. ``auth_key`` may then be left unset; set, it still
        authenticates the links' own handshake first. ``init`` fails with
        `LLM_PARAM_INVALID` naming the file where one cannot be loaded, where
        the key is not the certificate's, where one of the three is missing,
        or where encryption is off.

        Raises:
            TypeError: If not a str.
            LLMException: `LLM_PARAM_INVALID` if empty.
        """
        return self._tls_files.get("llm.TlsCertFile")

    @tls_cert_file.setter
    def tls_cert_file(self, value: str) -> None:
        self._set_tls_file("tls_cert_file", "llm.TlsCertFile", value)

    @property
    def tls_key_file(self) -> Optional[str]:
        """The private key of ``tls_cert_file`` (a PEM file); emits `llm.TlsKeyFile`.

        Raises:
            TypeError: If not a str.
            LLMException: `LLM_PARAM_INVALID` if empty.
        """
        return self._tls_files.get("llm.TlsKeyFile")

    @tls_key_file.setter
    def tls_key_file(self, value: str) -> None:
        self._set_tls_file("tls_key_file", "llm.TlsKeyFile", value)

    @property
    def tls_ca_file(self) -> Optional[str]:
        """The CA bundle (a PEM file) every peer's certificate chain must
        verify against, with ``tls_cert_file``; emits `llm.TlsCaFile`.

        Raises:
            TypeError: If not a str.
            LLMException: `LLM_PARAM_INVALID` if empty.
        """
        return self._tls_files.get("llm.TlsCaFile")

    @tls_ca_file.setter
    def tls_ca_file(self, value: str) -> None:
        self._set_tls_file("tls_ca_file", "llm.TlsCaFile", value)

    def _set_tls_file(self, name: str, option: str, value: str) -> None:
        check_isinstance(name, value, str, allow_none=False)
        raise_if_false(len(value) > 0, f"{name} must name a file")
        self._tls_files[option] = value

    def generate_options(self) -> dict[str, str]:
        """Writes the configured options into the accumulated dict and returns it.

        Returns:
            The same dict object on every call.
        """
        options = self._options
        options.update(self._ge_options)
        if self._listen_ip_info:
            options["llm.listenIpInfo"] = self._listen_ip_info
        if isinstance(self._device_id, int):
            options["ge.exec.deviceId"] = options["ge.session_device_id"] = str(
                int(self._device_id)
            )
        elif self._device_id is not None:
            options["ge.session_device_id"] = str(int(self._device_id[0]))
            options["ge.exec.deviceId"] = ";".join(str(int(d)) for d in self._device_id)
        if self._sync_kv_timeout is not None:
            options["llm.SyncKvCacheWaitTime"] = (
                self._sync_kv_timeout
                if isinstance(self._sync_kv_timeout, str)
                else str(int(self._sync_kv_timeout))
            )
        if self._mem_pool_cfg:
            options["llm.MemPoolConfig"] = self._mem_pool_cfg
        if self._host_mem_pool_cfg:
            options["llm.HostMemPoolConfig"] = self._host_mem_pool_cfg
        if self._enable_cache_manager is not None:
            options["llm.EnableCacheManager"] = _flag(self._enable_cache_manager)
        if self._enable_remote_cache_accessible is not None:
            options["llm.EnableRemoteCacheAccessible"] = _flag(
                self._enable_remote_cache_accessible
            )
        if self._local_comm_res is not None:
            options["llm.LocalCommRes"] = self._local_comm_res
        for key, value in (
            ("llm.LinkTotalTime", self._link_total_time),
            ("llm.LinkRetryCount", self._link_retry_count),
            ("llm.RdmaTrafficClass", self._rdma_traffic_class),
            ("llm.RdmaServiceLevel", self._rdma_service_level),
            ("llm.OutputMaxSize", self._output_max_size),
            ("llm.TcpConnectionsPerPeer", self._tcp_connections_per_peer),
            ("llm.HandshakeTimeoutMs", self._handshake_timeout_ms),
            ("llm.AnswerSweepMs", self._answer_sweep_ms),
            ("llm.EngineThreads", self._engine_threads),
            ("llm.IoThreads", self._io_threads),
        ):
            if value is not None:
                options[key] = str(int(value))
        if self._deploy_res_path:
            options["llm.deployResPath"] = self._deploy_res_path
        if self._buf_pool_cfg:
            options["llm.BufPoolCfg"] = self._buf_pool_cfg
        if self._cluster_info_json:
            options["llm.ClusterInfo"] = self._cluster_info_json
        if self._enable_switch_role:
            options["llm.EnableSwitchRole"] = "1"
        if self._transport is not None:
            options["llm.Transport"] = self._transport
        if self._auth_key is not None:
            options["llm.AuthKey"] = self._auth_key
        if self._link_encryption is not None:
            options["llm.LinkEncryption"] = self._link_encryption
        if self._access is not None:
            options["llm.Access"] = self._access
        if self._allow_unencrypted_ucx is not None:
            options["llm.AllowUnencryptedUcx"] = _flag(self._allow_unencrypted_ucx)
        options.update(self._tls_files)
        options["llm.MemoryUtilization"] = str(self._mem_utilization)
        return options

    gen_options = generate_options


LlmConfig = LLMConfig

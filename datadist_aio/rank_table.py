"""Rank tables: who the members of a two-sided link (``LLMDataDist.link``) are.

A rank table is upstream's JSON (HCCL rank table, versions 1.0 and 1.2)::

    {"version": "1.2", "server_count": "2", "status": "completed",
     "server_list": [
        {"server_id": "node-a",
         "device": [{"device_id": "0", "device_ip": "10.0.0.1", "rank_id": "0"}]},
        {"server_id": "node-b",
         "device": [{"device_id": "0", "device_ip": "10.0.0.2", "rank_id": "1",
                     "device_port": 26000}]}],
     "super_pod_list": [{"super_pod_id": "0",
                         "server_list": [{"server_id": "node-a"}, {"server_id": "node-b"}]}]}

A member is reached at its entry's ``device_ip`` and ``device_port``.
``device_port`` is this library's extension of the format: an entry without
it is taken to listen on the same port as the calling member's own
``listen_ip_info``.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any, NamedTuple, NoReturn

from ._checks import UINT32_MAX, check_isinstance, check_uint32, check_uint64, raise_if_false, raise_if_true
from .status import LLMException, LLMStatusCode

__all__ = ["MAX_MEMBERS", "RankEntry", "parse_rank_table", "comm_members"]

#: Members of one comm at most, as upstream.
MAX_MEMBERS = 4
_MAX_COMM_NAME = 128


class RankEntry(NamedTuple):
    """One device entry of a rank table."""

    rank_id: int
    device_id: str
    device_ip: str
    device_port: int  # 0: the calling member's own listen port
    server_id: str


def _fail(message: str) -> NoReturn:
    raise LLMException(f"malformed rank table: {message}", status_code=LLMStatusCode.LLM_PARAM_INVALID)


def _int_field(entry: dict[str, Any], name: str, where: str, high: int, required: bool = True) -> int:
    value = entry.get(name)
    if value is None:
        raise_if_true(required, f"malformed rank table: {where} has no {name}")
        return 0
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    raise_if_false(
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= high,
        f"malformed rank table: {where}: {name} must be an integer in [0, {high}], got {entry.get(name)!r}",
    )
    assert isinstance(value, int)  # checked above
    return value


def _text_field(entry: dict[str, Any], name: str, where: str) -> str:
    value = entry.get(name)
    raise_if_false(
        isinstance(value, (str, int)) and not isinstance(value, bool) and str(value) != "",
        f"malformed rank table: {where} needs a non-empty {name}",
    )
    return str(value)


def parse_rank_table(rank_table: str) -> dict[int, RankEntry]:
    """Parses a rank table into its device entries by rank id.

    Raises ``LLMException(LLM_PARAM_INVALID)`` for anything malformed: not
    JSON, no ``server_list``, a device without ``device_id``, ``device_ip``
    (IPv4) or ``rank_id``, a rank named twice, a ``device_port`` outside
    [1, 65535], a ``server_count`` that does not match, or a malformed
    ``super_pod_list``.
    """
    try:
        table = json.loads(rank_table)
    except ValueError as exc:
        _fail(f"not JSON ({exc})")
    raise_if_false(isinstance(table, dict), "malformed rank table: not a JSON object")
    servers = table.get("server_list")
    raise_if_false(isinstance(servers, list) and len(servers) > 0, "malformed rank table: no server_list")
    count = table.get("server_count")
    if count is not None:
        raise_if_false(
            str(count).isdigit() and int(count) == len(servers),
            f"malformed rank table: server_count {count!r} but {len(servers)} servers listed",
        )
    entries: dict[int, RankEntry] = {}
    for s, server in enumerate(servers):
        raise_if_false(isinstance(server, dict), f"malformed rank table: server_list[{s}] is not an object")
        devices = server.get("device")
        raise_if_false(
            isinstance(devices, list) and len(devices) > 0, f"malformed rank table: server_list[{s}] has no device"
        )
        server_id = str(server.get("server_id", s))
        for d, device in enumerate(devices):
            where = f"server_list[{s}].device[{d}]"
            raise_if_false(isinstance(device, dict), f"malformed rank table: {where} is not an object")
            rank = _int_field(device, "rank_id", where, UINT32_MAX)
            device_id = _text_field(device, "device_id", where)
            device_ip = _text_field(device, "device_ip", where)
            try:
                ipaddress.IPv4Address(device_ip)
            except ValueError:
                _fail(f"{where}: device_ip {device_ip!r} is not an IPv4 address")
            port = _int_field(device, "device_port", where, 65535, required=False)
            raise_if_true("device_port" in device and port == 0, f"malformed rank table: {where}: device_port 0")
            raise_if_true(rank in entries, f"malformed rank table: rank_id {rank} appears twice")
            entries[rank] = RankEntry(rank, device_id, device_ip, port, server_id)
    pods = table.get("super_pod_list")
    if pods is not None:
        ok = isinstance(pods, list) and all(
            isinstance(pod, dict) and "super_pod_id" in pod and isinstance(pod.get("server_list"), list)
            for pod in pods
        )
        raise_if_false(ok, "malformed rank table: super_pod_list needs super_pod_id and server_list per pod")
    return entries


def comm_members(
    own_cluster_id: int, comm_name: Any, cluster_rank_info: Any, rank_table: Any
) -> list[tuple[int, int, str, int]]:
    """Checks ``link``'s arguments as upstream does and returns the comm's
    members as ``(cluster_id, rank, device_ip, device_port)``."""
    check_isinstance("comm_name", comm_name, str, allow_none=False)
    raise_if_false(0 < len(comm_name) < _MAX_COMM_NAME, f"comm_name must have 1 to {_MAX_COMM_NAME - 1} characters")
    check_isinstance("cluster_rank_info", cluster_rank_info, dict, allow_none=False)
    check_isinstance("rank_table", rank_table, str, allow_none=False)
    for cluster_id, rank in cluster_rank_info.items():
        check_uint64("cluster_rank_info key", cluster_id)
        check_uint32("cluster_rank_info value", rank)
    raise_if_false(
        1 < len(cluster_rank_info) <= MAX_MEMBERS,
        f"cluster_rank_info must name 2 to {MAX_MEMBERS} clusters, got {len(cluster_rank_info)}",
    )
    ranks = list(cluster_rank_info.values())
    raise_if_false(
        all(a < b for a, b in zip(ranks, ranks[1:])), f"cluster_rank_info ranks must be ascending, got {ranks}"
    )
    raise_if_false(
        own_cluster_id in cluster_rank_info,
        f"cluster_rank_info does not name this instance's cluster_id {own_cluster_id}",
    )
    entries = parse_rank_table(rank_table)
    members = []
    for cluster_id, rank in cluster_rank_info.items():
        entry = entries.get(rank)
        raise_if_true(entry is None, f"rank {rank} (cluster {cluster_id}) is not in the rank table")
        assert entry is not None
        members.append((cluster_id, rank, entry.device_ip, entry.device_port))
    return members

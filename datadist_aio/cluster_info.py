"""Addresses of a peer cluster for `link_clusters` / `unlink_clusters`."""

from __future__ import annotations

import ipaddress
from typing import Optional, Union

from ._checks import check_isinstance, check_uint16, check_uint32, check_uint64
from .enums import LLMRole

__all__ = ["LLMClusterInfo", "int_to_ipv4", "ipv4_to_int"]


def ipv4_to_int(ip: str) -> int:
    """Encodes a dotted IPv4 address as the engine does: first octet in the low byte.

    Args:
        ip: Address such as `"1.2.3.4"`.

    Returns:
        The encoded address (`"1.2.3.4"` gives `0x04030201`).

    Raises:
        RuntimeError: If `ip` is not a dotted-quad IPv4 address.
    """
    try:
        packed = ipaddress.IPv4Address(ip).packed
    except ValueError:
        raise RuntimeError(
            f"ip {ip!r} is not a dotted-quad IPv4 address "
            "(IPv6 addresses and host names are not supported)"
        ) from None
    return int.from_bytes(packed, "little")


def int_to_ipv4(value: int) -> str:
    """The dotted form of an address encoded by `ipv4_to_int`."""
    return str(ipaddress.IPv4Address(value.to_bytes(4, "little")))


class LLMClusterInfo:
    """A peer to link with: its cluster id and the IP endpoints on both sides."""

    def __init__(self) -> None:
        self._remote_cluster_id: Optional[int] = None
        self._remote_role_type: Optional[Union[LLMRole, int]] = None
        self._local_ip_info_list: list[tuple[int, int]] = []
        self._remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> Optional[int]:
        """Cluster id of the peer; `None` until set."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        check_uint64("remote_cluster_id", value)
        self._remote_cluster_id = value

    @property
    def remote_role_type(self) -> Optional[Union[LLMRole, int]]:
        """Role of the peer; informational only, not sent in cache-manager mode."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: Union[LLMRole, int]) -> None:
        check_isinstance("remote_role_type", value, (LLMRole, int), allow_none=False)
        self._remote_role_type = value

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        """A copy of the local `(ip, port)` endpoints, ip encoded as by `ipv4_to_int`."""
        return list(self._local_ip_info_list)

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        """A copy of the remote `(ip, port)` endpoints, ip encoded as by `ipv4_to_int`."""
        return list(self._remote_ip_info_list)

    def append_local_ip_info(self, ip: Union[str, int], port: int) -> None:
        """Adds a local endpoint.

        Args:
            ip: Dotted IPv4 string, or an already encoded uint32.
            port: TCP port (uint16).

        Raises:
            TypeError: If `ip` is not str/int or `port` is not int.
            ValueError: If an int ip or the port is out of range.
            RuntimeError: If a string ip is not a dotted IPv4 address.
        """
        self._local_ip_info_list.append(_endpoint(ip, port))

    def append_remote_ip_info(self, ip: Union[str, int], port: int) -> None:
        """Adds a remote endpoint; arguments and errors as `append_local_ip_info`."""
        self._remote_ip_info_list.append(_endpoint(ip, port))

    def __repr__(self) -> str:
        return (
            f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
            f"local_ip_info_list={self._local_ip_info_list}, "
            f"remote_ip_info_list={self._remote_ip_info_list})"
        )


def _endpoint(ip: Union[str, int], port: int) -> tuple[int, int]:
    check_isinstance("ip", ip, (str, int), allow_none=False)
    check_uint16("port", port)
    if isinstance(ip, str):
        return ipv4_to_int(ip), port
    check_uint32("ip", ip)
    return ip, port

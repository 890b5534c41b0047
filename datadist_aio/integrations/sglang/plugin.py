"""Registers the datadist_aio transfer backend with SGLang, without touching SGLang's files.

SGLang runs every function of the ``sglang.srt.plugins`` entry-point group
early in each of its processes (before it parses arguments, and in every
scheduler). ``register`` then:

1. adds ``datadist_aio`` to the choices of ``--disaggregation-transfer-backend``
   (``add_disagg_transfer_backend_choices``);
2. makes ``TransferBackend("datadist_aio")`` a member of SGLang's
   ``TransferBackend`` Enum (``add_backend_member``): SGLang converts the
   flag's string with that call in several places, and the Enum has no API
   for new members;
3. wraps ``sglang.srt.disaggregation.utils.get_kv_class`` with an AROUND
   hook (SGLang's ``HookRegistry``) that answers this backend's classes
   and leaves every other backend to the original.

Each step is idempotent: a process that loads plugins twice registers once.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable

__all__ = ["BACKEND", "MEMBER_NAME", "add_backend_member", "register"]

BACKEND = "datadist_aio"
MEMBER_NAME = "DATADIST_AIO"


def add_backend_member(enum_cls: Any, name: str = MEMBER_NAME, value: str = BACKEND) -> Any:
    """Makes ``enum_cls(value)`` and ``enum_cls[name]`` answer a new member; returns it.

    Only the lookups are extended (by value, by name, as an attribute):
    iterating the Enum still lists its own members alone. TypeError if
    ``enum_cls`` is not an Enum; ValueError if ``name`` or ``value`` already
    belongs to another member.
    """
    if not (isinstance(enum_cls, type) and issubclass(enum_cls, Enum)):
        raise TypeError(f"add_backend_member needs an Enum class, got {enum_cls!r}")
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        if existing.name != name:
            raise ValueError(f"{enum_cls.__name__} already has {value!r} as {existing.name}")
        return existing
    if name in enum_cls._member_map_:
        raise ValueError(f"{enum_cls.__name__} already has a member named {name}")
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    setattr(member, "__objclass__", enum_cls)
    enum_cls._value2member_map_[value] = member
    enum_cls._member_map_[name] = member
    type.__setattr__(enum_cls, name, member)  # EnumType.__setattr__ refuses new members
    return member


def _get_kv_class_hook(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType  # pyright: ignore[reportMissingImports]

    if getattr(transfer_backend, "value", None) != BACKEND or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from . import conn

    return {
        KVClassType.MANAGER: conn.DatadistAioKVManager,
        KVClassType.SENDER: conn.DatadistAioKVSender,
        KVClassType.RECEIVER: conn.DatadistAioKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.DatadistAioKVBootstrapServer,
    }[class_type]


def register() -> None:
    """The ``sglang.srt.plugins`` entry point."""
    from sglang.srt.disaggregation.utils import TransferBackend  # pyright: ignore[reportMissingImports]
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # pyright: ignore[reportMissingImports]
    from sglang.srt.server_args import add_disagg_transfer_backend_choices  # pyright: ignore[reportMissingImports]
    from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES  # pyright: ignore[reportMissingImports]

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    add_backend_member(TransferBackend)
    target = "sglang.srt.disaggregation.utils.get_kv_class"
    hooks = getattr(HookRegistry, "_hooks", {}).get(target, [])
    if not any(hook is _get_kv_class_hook for _, hook, _ in hooks):
        HookRegistry.register(target, _get_kv_class_hook, HookType.AROUND)

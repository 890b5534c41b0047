"""Argument validation shared by the whole package.

Kinds follow LLM-DataDist: a wrong Python type raises `TypeError`, an int
outside its C range raises `ValueError`, and a semantic check raises
`LLMException` (by default with `LLM_PARAM_INVALID`). `bool` is an `int`, so
it passes every integer check.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Optional, Union, cast

from .status import LLMException, LLMStatusCode

__all__ = [
    "UINT8_MAX",
    "UINT16_MAX",
    "UINT32_MAX",
    "UINT64_MAX",
    "logger",
    "check_isinstance",
    "check_uint8",
    "check_uint16",
    "check_uint32",
    "check_uint64",
    "check_int32",
    "check_int64",
    "check_list_uint64",
    "check_list_int64",
    "check_dict",
    "raise_if_false",
    "raise_if_true",
    "check_layer_range",
    "parse_listen_ip_info",
]

logger = logging.getLogger("datadist_aio")

UINT8_MAX = (1 << 8) - 1
UINT16_MAX = (1 << 16) - 1
UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1

ClassInfo = Union[type, tuple[type, ...]]


def _type_names(classes: ClassInfo) -> str:
    if isinstance(classes, type):
        return classes.__name__
    return " or ".join(cls.__name__ for cls in classes)


def _normalize(classes: Union[type, Iterable[type]]) -> ClassInfo:
    return classes if isinstance(classes, type) else tuple(classes)


def check_isinstance(
    name: str,
    value: Any,
    classes: Union[type, Iterable[type]],
    inner_class: Optional[Union[type, Iterable[type]]] = None,
    allow_none: bool = True,
) -> None:
    """Checks the type of `value` and, optionally, of each of its elements.

    Args:
        name: Argument name used in the message.
        value: The value to check.
        classes: Accepted type or types.
        inner_class: If given, the accepted type or types of every element.
        allow_none: Whether `None` passes without further checks.

    Raises:
        TypeError: On a type mismatch.
    """
    if value is None and allow_none:
        return
    if not isinstance(classes, (type, tuple)):  # on the submit path: no call when already normalized
        classes = tuple(classes)
    if not isinstance(value, classes):
        raise TypeError(
            f"{name} must be {_type_names(classes)}, got {type(value).__name__}"
        )
    if inner_class is None:
        return
    if not isinstance(inner_class, (type, tuple)):
        inner_class = tuple(inner_class)
    for index, item in enumerate(cast(Iterable[Any], value)):
        if not isinstance(item, inner_class):
            raise TypeError(
                f"{name}[{index}] must be {_type_names(inner_class)}, "
                f"got {type(item).__name__}"
            )


def _check_int(name: str, value: Any, low: int, high: int, kind: str) -> None:
    if not isinstance(value, int):
        raise TypeError(f"{name} must be int ({kind}), got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be a {kind} in [{low}, {high}], got {value}")


def check_uint8(name: str, value: Any) -> None:
    """Checks that `value` is an int in [0, 2**8 - 1] (TypeError/ValueError)."""
    _check_int(name, value, 0, UINT8_MAX, "uint8")


def check_uint16(name: str, value: Any) -> None:
    """Checks that `value` is an int in [0, 2**16 - 1] (TypeError/ValueError)."""
    _check_int(name, value, 0, UINT16_MAX, "uint16")


def check_uint32(name: str, value: Any) -> None:
    """Checks that `value` is an int in [0, 2**32 - 1] (TypeError/ValueError)."""
    _check_int(name, value, 0, UINT32_MAX, "uint32")


def check_uint64(name: str, value: Any) -> None:
    """Checks that `value` is an int in [0, 2**64 - 1] (TypeError/ValueError)."""
    _check_int(name, value, 0, UINT64_MAX, "uint64")


def check_int32(name: str, value: Any) -> None:
    """Checks that `value` is an int in [-2**31, 2**31 - 1] (TypeError/ValueError)."""
    _check_int(name, value, -(1 << 31), (1 << 31) - 1, "int32")


def check_int64(name: str, value: Any) -> None:
    """Checks that `value` is an int in [-2**63, 2**63 - 1] (TypeError/ValueError)."""
    _check_int(name, value, -(1 << 63), (1 << 63) - 1, "int64")


def check_list_uint64(name: str, values: Iterable[Any]) -> None:
    """Applies `check_uint64` to every element, named `name[i]`."""
    for index, value in enumerate(values):
        check_uint64(f"{name}[{index}]", value)


def check_list_int64(name: str, values: Iterable[Any]) -> None:
    """Applies `check_int64` to every element, named `name[i]`."""
    for index, value in enumerate(values):
        check_int64(f"{name}[{index}]", value)


def check_dict(
    name: str,
    value: Any,
    key_class: Union[type, Iterable[type]],
    value_class: Union[type, Iterable[type]],
    value_inner_class: Optional[Union[type, Iterable[type]]] = None,
) -> None:
    """Checks that `value` is a dict with typed keys and values.

    Args:
        name: Argument name used in the message.
        value: The dict to check; `None` is rejected.
        key_class: Accepted key type or types.
        value_class: Accepted value type or types.
        value_inner_class: If given, the accepted type or types of the
            elements of every value.

    Raises:
        TypeError: On a type mismatch.
    """
    check_isinstance(name, value, dict, allow_none=False)
    for key, item in value.items():
        check_isinstance(f"key {key!r} of {name}", key, key_class, allow_none=False)
        check_isinstance(f"{name}[{key!r}]", item, value_class, value_inner_class, allow_none=False)


def _fail(fmt: str, args: tuple[Any, ...], status_code: LLMStatusCode) -> None:
    # Raised to the caller, so not logged as well.
    message = fmt.format(*args) if args else fmt
    raise LLMException(message, status_code=status_code)


def raise_if_false(
    condition: Any,
    fmt: str,
    *args: Any,
    status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID,
) -> None:
    """Raises `LLMException` unless `condition` holds.

    Args:
        condition: Tested for truth.
        fmt: `str.format` template of the message.
        *args: Values substituted into `fmt`.
        status_code: Code of the raised exception.

    Raises:
        LLMException: When `condition` is false.
    """
    if not condition:
        _fail(fmt, args, status_code)


def raise_if_true(
    condition: Any,
    fmt: str,
    *args: Any,
    status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID,
) -> None:
    """Raises `LLMException` when `condition` holds.

    Args:
        condition: Tested for truth.
        fmt: `str.format` template of the message.
        *args: Values substituted into `fmt`.
        status_code: Code of the raised exception.

    Raises:
        LLMException: When `condition` is true.
    """
    if condition:
        _fail(fmt, args, status_code)


def check_layer_range(name: str, value: Any, allow_none: bool = True) -> None:
    """Checks a half-open layer range: a `range` with step 1 and 0 <= start < stop.

    Args:
        name: Argument name used in the message.
        value: The range to check.
        allow_none: Whether `None` passes.

    Raises:
        TypeError: If `value` is not a `range` (or is `None` when not allowed).
        LLMException: `LLM_PARAM_INVALID` on a bad step or bounds.
    """
    check_isinstance(name, value, range, allow_none=allow_none)
    if value is None:
        return
    raise_if_false(value.step == 1, "{} must have step 1, got {}", name, value)
    raise_if_false(
        0 <= value.start < value.stop, "{} must satisfy 0 <= start < stop, got {}", name, value
    )


def parse_listen_ip_info(name: str, value: str) -> tuple[str, int]:
    """Splits an `"ip:port"` listen address.

    Args:
        name: Argument name used in the message.
        value: The address; exactly one `:` separates ip and port.

    Returns:
        The ip string and the port.

    Raises:
        LLMException: `LLM_PARAM_INVALID` unless there are exactly two parts.
        ValueError: If the port is not an integer in [0, 65535].
    """
    parts = value.split(":")
    raise_if_false(len(parts) == 2, "{} must be 'ip:port', got {!r}", name, value)
    ip, port_text = parts
    if not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"port of {name} must be a decimal integer, got {port_text!r}")
    port = int(port_text)
    check_uint16(f"port of {name}", port)
    return ip, port

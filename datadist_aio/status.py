"""Status codes, the package exception, and the native-code mapping.

`code_from_native` and `raise_for_status` are the only place where integer
codes coming from the engine become `LLMStatusCode` members.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

__all__ = [
    "LLMStatusCode",
    "LLMException",
    "Status",
    "code_from_native",
    "raise_for_status",
]

_BASE = 0x5010B000


class LLMStatusCode(enum.Enum):
    """Status codes; values equal the engine's native codes."""

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = _BASE + 0x01
    LLM_KV_CACHE_NOT_EXIST = _BASE + 0x02
    LLM_REPEAT_REQUEST = _BASE + 0x03
    LLM_REQUEST_ALREADY_COMPLETED = _BASE + 0x04
    LLM_PARAM_INVALID = _BASE + 0x05
    LLM_ENGINE_FINALIZED = _BASE + 0x06
    LLM_NOT_YET_LINK = _BASE + 0x07
    LLM_ALREADY_LINK = _BASE + 0x08
    LLM_LINK_FAILED = _BASE + 0x09
    LLM_UNLINK_FAILED = _BASE + 0x0A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _BASE + 0x0B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _BASE + 0x0C
    LLM_PROCESSING_LINK = _BASE + 0x0D
    LLM_DEVICE_OUT_OF_MEMORY = _BASE + 0x0E
    LLM_PREFIX_ALREADY_EXIST = _BASE + 0x0F
    LLM_PREFIX_NOT_EXIST = _BASE + 0x10
    LLM_SEQ_LENOVERLIMIT = _BASE + 0x11
    LLM_NO_FREE_BLOCK = _BASE + 0x12
    LLM_BLOCKS_OUT_OF_MEMORY = _BASE + 0x13
    LLM_EXIST_LINK = _BASE + 0x18
    LLM_FEATURE_NOT_ENABLED = _BASE + 0x19
    LLM_TIMEOUT = _BASE + 0x1A
    LLM_LINK_BUSY = _BASE + 0x1B
    LLM_OUT_OF_MEMORY = _BASE + 0x1C
    LLM_AUTH_FAILED = _BASE + 0x80  # not upstream: a link's shared secret was missing or did not match
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1


_FROM_NATIVE: dict[int, LLMStatusCode] = {
    member.value: member
    for member in LLMStatusCode
    if member is not LLMStatusCode.LLM_UNKNOWN_ERROR
}


class LLMException(RuntimeError):
    """Error raised by the library, carrying an `LLMStatusCode`.

    Args:
        *args: Message arguments, as for `RuntimeError`.
        status_code: The status this error reports.
    """

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS) -> None:
        if not isinstance(status_code, LLMStatusCode):
            raise TypeError(
                f"status_code must be an LLMStatusCode, got {type(status_code).__name__}"
            )
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        """The status this error reports."""
        return self._status_code

    def __str__(self) -> str:
        message = super().__str__()
        name = self._status_code.name
        return f"{message} [{name}]" if message else f"[{name}]"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_exception, (type(self), self.args, self._status_code))


def _rebuild_exception(
    cls: type[LLMException], args: tuple[Any, ...], status_code: LLMStatusCode
) -> LLMException:
    return cls(*args, status_code=status_code)


class Status:
    """An `LLMStatusCode` wrapped with an `is_ok()` test.

    Args:
        status: The wrapped code.
    """

    def __init__(self, status: LLMStatusCode) -> None:
        if not isinstance(status, LLMStatusCode):
            raise TypeError(f"status must be an LLMStatusCode, got {type(status).__name__}")
        self._status_code = status

    @property
    def status_code(self) -> LLMStatusCode:
        """The wrapped code."""
        return self._status_code

    def is_ok(self) -> bool:
        """True if the code is `LLM_SUCCESS`."""
        return self._status_code is LLMStatusCode.LLM_SUCCESS

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Status):
            return self._status_code is other._status_code
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._status_code)

    def __repr__(self) -> str:
        return f"Status({self._status_code})"


def code_from_native(code: int) -> LLMStatusCode:
    """Maps an engine status code to its member.

    Codes are read as uint32, so a negative int32 such as -1 is 0xFFFFFFFF.
    Codes without a member map to `LLM_FAILED`; `LLM_UNKNOWN_ERROR` is never
    produced.

    Args:
        code: The native code.

    Returns:
        The matching member, or `LLM_FAILED`.
    """
    return _FROM_NATIVE.get(_as_uint32(code), LLMStatusCode.LLM_FAILED)


def raise_for_status(code: int, message: str, detail: Optional[str] = None) -> None:
    """Raises `LLMException` for a non-zero native code.

    Call it right after the engine call that returned ``code``, on the same
    thread: without ``detail`` it appends the engine's reason for the
    refusal (which argument, index or size), or the native code when the
    engine gave none.

    Args:
        code: The native code.
        message: What failed.
        detail: Why, when the caller knows better than the engine.

    Raises:
        LLMException: With `code_from_native(code)` when `code != 0`.
    """
    if code == 0:
        return
    if detail is None:
        from . import _native

        detail = _native.last_error_message() or f"native code {_as_uint32(code):#x}"
    raise LLMException(f"{message}: {detail}", status_code=code_from_native(code))


def _as_uint32(code: int) -> int:
    return code & 0xFFFFFFFF if -(1 << 31) <= code < 0 else code

"""AES-256-GCM from OpenSSL's libcrypto, the library the engine's links load.

Reached through ``ctypes`` and libcrypto's EVP interface, so encrypting the
side channels needs no package beyond OpenSSL itself (``libcrypto.so.3``, or
1.1). The library is loaded on first use; where it cannot be,
``AeadUnavailable`` says so. Each call makes and frees its own cipher
context: any thread may call, and ctypes releases the GIL around libcrypto.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional

__all__ = ["AeadUnavailable", "KEY_BYTES", "IV_BYTES", "TAG_BYTES", "open_sealed", "seal"]

KEY_BYTES = 32
IV_BYTES = 12
TAG_BYTES = 16

_CTRL_GCM_GET_TAG = 0x10  # EVP_CTRL_AEAD_GET_TAG
_CTRL_GCM_SET_TAG = 0x11  # EVP_CTRL_AEAD_SET_TAG

_lock = threading.Lock()
_lib: Optional[Any] = None
_load_error = ""


class AeadUnavailable(RuntimeError):
    """OpenSSL's libcrypto cannot be loaded, or lacks AES-256-GCM."""


def _libcrypto() -> Any:
    global _lib, _load_error
    with _lock:
        if _lib is not None:
            return _lib
        if _load_error:
            raise AeadUnavailable(_load_error)
        for name in ("libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so"):
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            try:
                _declare(lib)
            except AttributeError:
                continue
            _lib = lib
            return lib
        _load_error = ("OpenSSL's libcrypto (libcrypto.so.3 or .so.1.1, with AES-256-GCM) cannot be loaded: "
                       "install OpenSSL to encrypt the side channels")
        raise AeadUnavailable(_load_error)


def _declare(lib: Any) -> None:
    vp, ip, cp = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
    lib.EVP_CIPHER_CTX_new.restype = vp
    lib.EVP_CIPHER_CTX_new.argtypes = []
    lib.EVP_CIPHER_CTX_free.restype = None
    lib.EVP_CIPHER_CTX_free.argtypes = [vp]
    lib.EVP_aes_256_gcm.restype = vp
    lib.EVP_aes_256_gcm.argtypes = []
    lib.EVP_CIPHER_CTX_ctrl.restype = ip
    lib.EVP_CIPHER_CTX_ctrl.argtypes = [vp, ip, ip, vp]
    for direction in ("Encrypt", "Decrypt"):
        init = getattr(lib, f"EVP_{direction}Init_ex")
        init.restype = ip
        init.argtypes = [vp, vp, vp, cp, cp]
        update = getattr(lib, f"EVP_{direction}Update")
        update.restype = ip
        update.argtypes = [vp, vp, ctypes.POINTER(ip), cp, ip]
        final = getattr(lib, f"EVP_{direction}Final_ex")
        final.restype = ip
        final.argtypes = [vp, vp, ctypes.POINTER(ip)]


def _check_sizes(key: bytes, iv: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise ValueError(f"an AES-256-GCM key is {KEY_BYTES} bytes, got {len(key)}")
    if len(iv) != IV_BYTES:
        raise ValueError(f"an AES-256-GCM IV is {IV_BYTES} bytes here, got {len(iv)}")


def seal(key: bytes, iv: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """``plaintext`` encrypted under ``key`` and ``iv`` (never reuse an IV
    with one key), followed by the 16-byte tag over it and ``aad``."""
    _check_sizes(key, iv)
    lib = _libcrypto()
    ctx = lib.EVP_CIPHER_CTX_new()
    if not ctx:
        raise MemoryError("EVP_CIPHER_CTX_new failed")
    try:
        out = ctypes.create_string_buffer(len(plaintext) + TAG_BYTES)
        written = ctypes.c_int(0)
        ok = lib.EVP_EncryptInit_ex(ctx, lib.EVP_aes_256_gcm(), None, key, iv)
        ok = ok and (not aad or lib.EVP_EncryptUpdate(ctx, None, ctypes.byref(written), aad, len(aad)))
        total = 0
        if ok and plaintext:
            ok = lib.EVP_EncryptUpdate(ctx, out, ctypes.byref(written), plaintext, len(plaintext))
            total = written.value
        ok = ok and lib.EVP_EncryptFinal_ex(ctx, ctypes.byref(out, total), ctypes.byref(written))
        total += written.value if ok else 0
        tag = ctypes.create_string_buffer(TAG_BYTES)
        ok = ok and lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_GET_TAG, TAG_BYTES, tag)
        if not ok or total != len(plaintext):
            raise RuntimeError("libcrypto's AES-256-GCM failed to encrypt")
        return out.raw[:total] + tag.raw
    finally:
        lib.EVP_CIPHER_CTX_free(ctx)


def open_sealed(key: bytes, iv: bytes, sealed: bytes, aad: bytes) -> Optional[bytes]:
    """The plaintext of ``seal``'s output, or None where the tag does not
    prove it (another key, IV or AAD, or altered bytes)."""
    _check_sizes(key, iv)
    if len(sealed) < TAG_BYTES:
        return None
    lib = _libcrypto()
    ciphertext, tag = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
    ctx = lib.EVP_CIPHER_CTX_new()
    if not ctx:
        raise MemoryError("EVP_CIPHER_CTX_new failed")
    try:
        out = ctypes.create_string_buffer(len(ciphertext) + TAG_BYTES)
        written = ctypes.c_int(0)
        ok = lib.EVP_DecryptInit_ex(ctx, lib.EVP_aes_256_gcm(), None, key, iv)
        ok = ok and (not aad or lib.EVP_DecryptUpdate(ctx, None, ctypes.byref(written), aad, len(aad)))
        total = 0
        if ok and ciphertext:
            ok = lib.EVP_DecryptUpdate(ctx, out, ctypes.byref(written), ciphertext, len(ciphertext))
            total = written.value
        ok = ok and lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_SET_TAG, TAG_BYTES, ctypes.c_char_p(tag))
        if not ok:
            raise RuntimeError("libcrypto's AES-256-GCM failed to start a decryption")
        if lib.EVP_DecryptFinal_ex(ctx, ctypes.byref(out, total), ctypes.byref(written)) != 1:
            return None  # the tag does not match
        total += written.value
        return out.raw[:total]
    finally:
        lib.EVP_CIPHER_CTX_free(ctx)

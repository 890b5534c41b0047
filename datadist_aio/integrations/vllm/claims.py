"""The decode side's claims on prefill leases, sent and read without the event loop.

A load's claims (see ``leases.py``) go beside its pulls, and the load is
reported only once they are answered: their round trip must not outlast
the pulls. The side channel's client runs on the connector's loop thread,
which in a busy vLLM worker gets the GIL only between the worker thread's
switch intervals, so every frame through it costs milliseconds. A
``ClaimChannel`` is a plain non-blocking socket to one prefill rank's side
channel: claims are written at once by the thread that starts the loads
(vLLM's worker thread, or the loop thread for a load that waited for its
link), and the answers are read by whoever polls (``get_finished`` on vLLM's
worker thread, each step). The prefill's server answers a connection's
frames in order, so each answer settles the oldest batch sent.

Frames are those of ``side_channel``: a 4-byte big-endian length, then a
UTF-8 JSON object, sealed by the guard where a link secret is set (each
answer must then be bound to the claim it answers).
"""

from __future__ import annotations

import json
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ..message_guard import UNSEALED, MessageGuard, Refused
from .side_channel import MAX_FRAME, encode_body, frame

__all__ = ["ClaimChannel"]

# Called once per claimed item: ("", False) granted; (why, True) refused (the
# prefill no longer holds the blocks); (why, False) no answer (the channel failed).
Settle = Callable[[str, bool], None]


class ClaimChannel:
    """Claims to one prefill rank: ``send`` from any thread, ``poll`` to read the answers."""

    def __init__(self, host: str, port: int, timeout_s: float, guard: MessageGuard = UNSEALED) -> None:
        self.where: str = f"{host}:{port}"
        self._port = port
        self._guard = guard
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setblocking(False)
        self._lock = threading.Lock()
        self._out = bytearray()
        self._in = bytearray()
        # Per batch sent and not answered yet: its request's nonce, each request id's settle.
        self._waiting: deque[tuple[bytes, list[tuple[str, Settle]]]] = deque()
        self._broken = ""

    def send(self, message: dict[str, Any], items: list[tuple[str, Settle]]) -> None:
        """Sends one claim message; ``items``: (request id, settle) of what it claims."""
        body, nonce = self._guard.seal_request(encode_body(message), self._port)
        sealed = frame(body)
        fail: list[tuple[str, Settle]] = []
        with self._lock:
            if self._broken:
                fail = items
            else:
                self._waiting.append((nonce, items))
                self._out += sealed
                self._flush_locked()
                if self._broken:
                    fail = self._drop_locked()
        for _req_id, settle in fail:
            settle(f"lease claim at {self.where}: {self._broken}", False)

    def poll(self) -> None:
        """Reads what has come and settles the batches it answers (never blocks)."""
        settled: list[tuple[Settle, str, bool]] = []
        with self._lock:
            if not self._waiting:
                return
            self._flush_locked()
            while not self._broken:
                try:
                    chunk = self._sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    self._broken = f"{type(exc).__name__}: {exc}"
                    break
                if not chunk:
                    self._broken = "the prefill closed its side channel"
                    if self._guard.enabled:
                        self._broken += (" (it refuses a claim it cannot authenticate: another link secret or "
                                         "encryption setting, or clocks apart; its log names this address)")
                    break
                self._in += chunk
            while len(self._in) >= 4 and self._waiting:
                length = int.from_bytes(self._in[:4], "big")
                if not 0 < length <= MAX_FRAME:
                    self._broken = f"a frame of {length} bytes"
                    break
                if len(self._in) < 4 + length:
                    break
                body = bytes(self._in[4:4 + length])
                del self._in[:4 + length]
                nonce, batch = self._waiting.popleft()
                try:
                    answer = json.loads(self._guard.open_answer(body, nonce).decode("utf-8"))
                except Refused as exc:
                    # Not the prefill's word: nothing it says is taken, and the channel goes.
                    self._broken = f"an answer refused: {exc}"
                    self._waiting.appendleft((nonce, batch))
                    break
                except (UnicodeDecodeError, ValueError):
                    answer = None
                if not isinstance(answer, dict) or not answer.get("ok"):
                    why = answer.get("error") if isinstance(answer, dict) else "an answer that is not JSON"
                    settled.extend((settle, f"lease claim at {self.where} refused: {why}", False) for _, settle in batch)
                    continue
                granted = set(answer.get("granted") or ())
                for req_id, settle in batch:
                    if req_id in granted:
                        settled.append((settle, "", False))
                    else:
                        settled.append((settle, f"the prefill at {self.where} no longer holds the blocks of request "
                                                f"{req_id} (its lease ran out, or they were freed): the read is not used",
                                        True))
            failed = self._drop_locked() if self._broken else []
        for settle, why, refused in settled:
            settle(why, refused)
        for _req_id, settle in failed:
            settle(f"lease claim at {self.where}: {self._broken}", False)

    def close(self) -> None:
        with self._lock:
            if not self._broken:
                self._broken = "closed"
            failed = self._drop_locked()
            self._sock.close()
        for _req_id, settle in failed:
            settle(f"lease claim at {self.where}: closed", False)

    def _flush_locked(self) -> None:
        while self._out and not self._broken:
            try:
                sent = self._sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._broken = f"{type(exc).__name__}: {exc}"
                return
            del self._out[:sent]

    def _drop_locked(self) -> list[tuple[str, Settle]]:
        items = [item for _nonce, batch in self._waiting for item in batch]
        self._waiting.clear()
        return items

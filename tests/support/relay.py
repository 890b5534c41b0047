"""An on-path relay between two engines on loopback: every byte of every
connection is forwarded, recorded per direction, and may be altered.

The initiator links to the relay's port as if it were the acceptor's; the
relay opens a connection to the acceptor for each one it accepts and pumps
both ways on threads of its own. ``flip_at`` alters one byte of the
initiator-to-acceptor stream (``flip_to_initiator``: of the other way's):
the byte at that offset of the first connection whose stream gets that
far (once in all).
"""

from __future__ import annotations

import socket
import threading
from typing import Optional

LOOPBACK = "127.0.0.1"


class Relay:
    def __init__(self, target_port: int, flip_at: Optional[int] = None, flip_to_initiator: bool = False) -> None:
        self.target_port = target_port
        self.flip_at = flip_at
        self.flip_to_initiator = flip_to_initiator
        self.flipped = False
        # Per connection, in the order accepted: the bytes each way.
        self.to_acceptor: list[bytearray] = []
        self.to_initiator: list[bytearray] = []
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._accepter = threading.Thread(target=self._accept, name="relay-accept", daemon=True)
        self._accepter.start()

    def __enter__(self) -> "Relay":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stream_to_acceptor(self) -> bytes:
        with self._lock:
            return b"".join(bytes(b) for b in self.to_acceptor)

    def _accept(self) -> None:
        while True:
            try:
                inbound, _ = self._listener.accept()
            except OSError:
                return
            try:
                outbound = socket.create_connection((LOOPBACK, self.target_port), timeout=10)
                outbound.settimeout(None)
            except OSError:
                inbound.close()
                continue
            with self._lock:
                if self._closed:
                    inbound.close()
                    outbound.close()
                    return
                up, down = bytearray(), bytearray()
                self.to_acceptor.append(up)
                self.to_initiator.append(down)
                self._sockets += [inbound, outbound]
                ways = (
                    (inbound, outbound, up, not self.flip_to_initiator),
                    (outbound, inbound, down, self.flip_to_initiator),
                )
                for src, dst, record, alter in ways:
                    thread = threading.Thread(
                        target=self._pump, args=(src, dst, record, alter), name="relay-pump", daemon=True
                    )
                    self._threads.append(thread)
                    thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray, alter: bool) -> None:
        while True:
            try:
                chunk = src.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            with self._lock:
                start = len(record)
                if alter and self.flip_at is not None and not self.flipped and start + len(chunk) > self.flip_at:
                    changed = bytearray(chunk)
                    changed[self.flip_at - start] ^= 0x01
                    chunk = bytes(changed)
                    self.flipped = True
                record += chunk
            try:
                dst.sendall(chunk)
            except OSError:
                break
        # One side ended: so does the other, as a connection through no relay would.
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = list(self._sockets)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accepter.join(timeout=10)
        for thread in list(self._threads):
            thread.join(timeout=10)
        for sock in sockets:
            sock.close()

"""A one-line progress bar on stderr (a line per phase when stderr is not a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Progress over ``total`` steps, drawn on ``stream``."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 28) -> None:
        self.total: int = max(1, total)
        self.done: int = 0
        self.phase: str = ""
        self.stream: TextIO = stream
        self.width: int = width
        self.start: float = time.monotonic()
        self.tty: bool = stream.isatty()

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if self.tty:
            self._draw()
        else:
            print(f"[{self._percent():3d}%] {phase}", file=self.stream, flush=True)

    def advance(self, steps: int = 1) -> None:
        self.done = min(self.total, self.done + steps)
        if self.tty:
            self._draw()

    def note(self, text: str) -> None:
        """A line of its own above the bar."""
        if self.tty:
            self.stream.write("\r\033[K")
        print(text, file=self.stream, flush=True)
        if self.tty:
            self._draw()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def _percent(self) -> int:
        return 100 * self.done // self.total

    def _draw(self) -> None:
        filled = self.width * self.done // self.total
        elapsed = time.monotonic() - self.start
        eta = ""
        if 0 < self.done < self.total:
            eta = f" eta {elapsed * (self.total - self.done) / self.done:4.0f}s"
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {self._percent():3d}% {elapsed:4.0f}s{eta}  {self.phase}"
        self.stream.write("\r\033[K" + line[: 160])
        self.stream.flush()

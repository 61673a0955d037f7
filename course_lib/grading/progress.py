"""A progress bar over submissions on stderr; one plain line per submission when not a terminal."""

from __future__ import annotations

import threading
from typing import TextIO

__all__ = ["Progress"]

WIDTH = 24


class Progress:
    """Thread-safe: `--jobs N` grades several submissions at once."""

    def __init__(self, total: int, stream: TextIO | None):
        self.total, self.done, self.stream = total, 0, stream
        self.live = bool(stream is not None and stream.isatty())
        self._lock = threading.Lock()

    def _bar(self) -> str:
        filled = WIDTH * self.done // max(self.total, 1)
        return f"[{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total}"

    def start(self, name: str) -> None:
        with self._lock:
            self._start(name)

    def _start(self, name: str) -> None:
        if self.live:
            self.stream.write(f"\r\x1b[K{self._bar()} grading {name} ...")
            self.stream.flush()

    def advance(self, name: str, outcome: str) -> None:
        with self._lock:
            self._advance(name, outcome)

    def _advance(self, name: str, outcome: str) -> None:
        self.done += 1
        if self.stream is None:
            return
        if self.live:
            self.stream.write(f"\r\x1b[K{self._bar()} {name}: {outcome}")
        else:
            self.stream.write(f"{self._bar()} {name}: {outcome}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()

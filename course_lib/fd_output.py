"""What a persistent rank writes below Python: C++ warnings, `os.write(1, ...)`, subprocesses.

A worker replaces `sys.stdout`/`sys.stderr` to send a cell's prints to the
kernel, but writes to file descriptors 1 and 2 bypass those objects and land
in torchrun's per-rank log files (`--redirects 3`). `RankFdOutput` reads each
file from where the previous read stopped, so a `%%dist` cell shows them too.
We read torchrun's files rather than pipe the descriptors through a thread:
a file keeps the last words of a rank that aborts (a pipe's unread bytes die
with the process), and reading an unchanged file costs microseconds.
"""

from __future__ import annotations

import codecs
import pathlib

__all__ = ["RankFdOutput"]


class _Tail:
    """One file, read incrementally; decodes UTF-8 across read boundaries."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.handle = None
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def skip_to_end(self) -> None:
        if self._open():
            self.handle.seek(0, 2)

    def read(self) -> str:
        if not self._open():
            return ""
        return self.decoder.decode(self.handle.read())

    def _open(self) -> bool:
        if self.handle is None:
            try:
                self.handle = open(self.path, "rb")  # noqa: SIM115 - kept open between cells, closed by close()
            except FileNotFoundError:
                return False
        return True

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class RankFdOutput:
    """Rank `rank`'s stdout.log and stderr.log under torchrun's `log_dir`, read incrementally."""

    def __init__(self, log_dir: pathlib.Path, rank: int):
        self.log_dir, self.rank = log_dir, rank
        self.tails: dict[str, _Tail] = {}

    def _tail(self, stream: str) -> _Tail | None:
        if stream not in self.tails:
            # torchrun writes <log_dir>/<run id>/attempt_<n>/<rank>/<stream>.log; a pool has one attempt.
            paths = sorted(self.log_dir.glob(f"*/attempt_*/{self.rank}/{stream}.log"))
            if not paths:
                return None
            self.tails[stream] = _Tail(paths[-1])
        return self.tails[stream]

    def skip_to_end(self) -> None:
        """Forget what was written so far (start-up output) so that cells show only their own."""
        for stream in ("stdout", "stderr"):
            tail = self._tail(stream)
            if tail is not None:
                tail.skip_to_end()

    def read(self) -> list[tuple[str, str]]:
        """[(stream, text)] written since the previous read; empty texts left out."""
        new = []
        for stream in ("stdout", "stderr"):
            tail = self._tail(stream)
            text = tail.read() if tail is not None else ""
            if text:
                new.append((stream, text))
        return new

    def close(self) -> None:
        for tail in self.tails.values():
            tail.close()

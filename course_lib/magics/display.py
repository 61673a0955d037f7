"""What a multi-rank cell shows in the notebook: a header, a live view while it runs, rank-ordered blocks after.

Shared by `%%torchrun` (one-shot) and `%%dist` (persistent ranks); how a
cell ends (errors, `cl.results`) is in cell_end.py.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Callable, TypeVar

from IPython import get_ipython
from IPython.display import display

from ..launcher.diagnosis import STARTING_UP
from ..launcher.rank_output import rank_block, readable_stack

__all__ = ["LiveView", "print_diagnosis", "print_rank_blocks", "run_live", "save_stacks", "someone_is_watching"]

LIVE_LINES = 30  # lines kept in the live view while a cell runs
LIVE_REFRESH_S = 0.2

T = TypeVar("T")


def someone_is_watching() -> bool:
    """True when the cell was sent by an interactive front-end (JupyterLab, Notebook, VS Code).

    Those send `allow_stdin=True` (they can answer `input()`); batch runners
    (nbconvert/nbclient, which store the lessons' outputs, and nbval) send
    False. Nobody sees a live view in a batch run, and the empty display it
    ends as would be stored in the notebook, so batch runs get none.
    """
    kernel = getattr(get_ipython(), "kernel", None)
    return bool(getattr(kernel, "_allow_stdin", False))


class LiveView:
    """A display that shows the latest rank lines while the cell runs, and is empty after.

    It starts and ends empty: it only matters while the cell runs, and the
    rank-ordered blocks printed after it carry every line.
    """

    def __init__(self):
        self.handle = display({"text/plain": ""}, raw=True, display_id=True)
        self.lines: list[str] = []
        self.partial: dict[tuple[int, str], str] = {}
        self.last = 0.0
        self.dirty = False

    def add(self, rank: int, stream: str, text: str) -> None:
        buf = self.partial.get((rank, stream), "") + text
        *complete, self.partial[(rank, stream)] = buf.split("\n")
        self.lines.extend(f"[rank {rank}] {line}" for line in complete)
        del self.lines[:-LIVE_LINES]
        self.dirty = self.dirty or bool(complete)
        self.refresh()

    def refresh(self) -> None:
        """Show new lines, at most every LIVE_REFRESH_S; called on every poll so none stays hidden."""
        now = time.monotonic()
        if self.dirty and now - self.last >= LIVE_REFRESH_S and self.handle is not None:
            self.handle.update({"text/plain": "\n".join(self.lines)}, raw=True)
            self.last = now
            self.dirty = False

    def close(self) -> None:
        if self.handle is not None:
            self.handle.update({"text/plain": ""}, raw=True)


def run_live(header: str, run: Callable[..., T]) -> T:
    """Print the cell's first line, then `run(on_output=..., on_poll=...)` under a live view.

    `run` is `run_torchrun` or `Pool.run` with its other arguments bound: both
    call `on_output(rank, stream, text)` as ranks write and `on_poll()` while waiting.
    """
    # One write: print() writes the text and its newline apart, and the kernel may send them as two
    # outputs; a notebook would then store an output that is only "\n".
    sys.stdout.write(header + "\n")
    sys.stdout.flush()
    if not someone_is_watching():
        return run(on_output=lambda rank, stream, text: None, on_poll=lambda: None)
    live = LiveView()
    try:
        return run(on_output=live.add, on_poll=live.refresh)
    finally:
        live.close()


def print_rank_blocks(stdout: dict[int, str], stderr: dict[int, str], first: int | None = None) -> None:
    """Print stdout blocks in rank order, then stderr blocks (rank `first`, e.g. the failing one, first)."""
    order = sorted(stderr)
    if first is not None and first in stderr:
        order = [first] + [r for r in order if r != first]
    out = "".join(rank_block(r, stdout[r]) for r in sorted(stdout))
    err = "".join(rank_block(r, stderr[r]) for r in order)
    if out:
        sys.stdout.write(out)
        sys.stdout.flush()
    if err:
        sys.stderr.write(err)
        sys.stderr.flush()


def print_diagnosis(lines: list[str], stacks: dict[int, str]) -> None:
    """Where stuck ranks were (stdout), then their Python stacks (stderr, innermost call first).

    Ranks still importing before their first collective are only slow: their line is not called stuck.
    """
    stuck = [line for line in lines if STARTING_UP not in line]
    if stuck:
        print("stuck: " + "; ".join(stuck))
    slow = [line for line in lines if STARTING_UP in line]
    if slow:
        print("; ".join(slow))
    for rank in sorted(stacks):
        if stacks[rank].strip():
            stack = readable_stack(stacks[rank])
            sys.stderr.write(rank_block(rank, "Python stack (most recent call first):\n" + stack))
    sys.stderr.flush()


def save_stacks(stacks: dict[int, str]) -> str | None:
    """Write the ranks' full Python stacks to a new file of this user's (kept: the run's folder is deleted
    after the cell); its path, or None when there is no stack to keep."""
    kept = {rank: text for rank, text in sorted(stacks.items()) if text.strip()}
    if not kept:
        return None
    fd, path = tempfile.mkstemp(prefix="course_lib_stacks_", suffix=".txt")  # mode 0600
    with os.fdopen(fd, "w") as handle:
        for rank, text in kept.items():
            handle.write(f"rank {rank}, Python stack (most recent call first):\n{text.rstrip()}\n\n")
    return path

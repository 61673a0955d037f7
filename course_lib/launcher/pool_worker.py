"""A persistent rank: runs notebook cells sent by the kernel, keeping its state between them.

Started by `%dist start` through torchrun (`torchrun ... -m course_lib.launcher.pool_worker`).
It connects to the kernel over loopback, authenticates with the session's
secret (multiprocessing.connection's HMAC challenge, in both directions,
before any pickled message is read), starts the process group, then loops:

    kernel -> worker: ("run", cell_id, source)   run a cell in this rank's namespace
                      ("stop",)                  leave the loop and exit
    worker -> kernel: ("hello", rank, pid)       once, after connecting
                      ("ready", error)           once, after starting the process group
                      ("out", cell_id, stream, text)   what the cell prints, as it prints it
                      ("done", cell_id, error, published)   error: None or (kind, traceback text)
"""

from __future__ import annotations

import linecache
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Client
from typing import Any

from .. import rank as rank_env
from ..rank import ledger
from ..rank.contract import CELL_LABEL, ENV_POOL_ADDRESS, ENV_POOL_INIT, ENV_POOL_KEYFILE
from ..rank.process_exit import c_stdio_flusher, exit_without_finalizing
from .messages import receive, send

__all__ = ["main"]


class _ConnectionWriter:
    """A text stream that forwards each write to the kernel as ("out", cell_id, stream, text)."""

    def __init__(self, conn, lock: threading.Lock, stream: str):
        self.conn, self.lock, self.stream = conn, lock, stream
        self.cell_id = 0

    def write(self, text: str) -> int:
        if text:
            _send_whole(self.conn, self.lock, ("out", self.cell_id, self.stream, text))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class _Interrupts:
    """SIGINT raises KeyboardInterrupt in the cell, but never while the main thread is halfway
    through sending a message: the kernel would then wait forever for the rest of it. An
    interrupt that arrives during a send is raised right after it."""

    sending = False
    pending = False

    @classmethod
    def handler(cls, signum, frame):
        if cls.sending:
            cls.pending = True
            return
        raise KeyboardInterrupt


def _send_whole(conn, lock: threading.Lock, message: Any) -> None:
    main = threading.current_thread() is threading.main_thread()
    with lock:  # cells may print from several threads
        if main:
            _Interrupts.sending = True
        try:
            send(conn, message)
        finally:
            if main:
                _Interrupts.sending = False
    if main and _Interrupts.pending:
        _Interrupts.pending = False
        raise KeyboardInterrupt


def _format_error(exc: BaseException) -> tuple[str, str]:
    """(exception name, traceback text with the learner's frames only).

    Left out: this module's frames, wherever they are (the loop that runs the
    cell, the print that sends its text, the SIGINT handler that raised
    KeyboardInterrupt), and the collective ledger's wrapper (rank/ledger.py).
    """
    ledger.hide_frames(exc, also=lambda code: code.co_filename == __file__)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return type(exc).__name__, text


def _connect():
    host, port = os.environ[ENV_POOL_ADDRESS].rsplit(":", 1)
    with open(os.environ[ENV_POOL_KEYFILE], "rb") as handle:
        key = handle.read()
    return Client((host, int(port)), authkey=key)


def main() -> None:
    signal.signal(signal.SIGINT, _Interrupts.handler)
    conn = _connect()
    lock = threading.Lock()
    rank = int(os.environ["RANK"])
    send(conn, ("hello", rank, os.getpid()))

    published: dict[str, Any] = {}
    rank_env.set_publish_hook(published.__setitem__)
    # The ledger records every collective of every cell, wrapped the moment torch.distributed
    # loads, exactly as on line 1 of a %%torchrun cell (so both modes record the same calls).
    # Imported here, not at the top: importing the hook installs it, and the kernel imports
    # this module (for its name) without wanting the hook.
    from ..rank import cell_hook  # noqa: F401 - installs itself
    ready_error = None
    if os.environ.get(ENV_POOL_INIT) == "1":
        try:
            rank_env.init()
        except Exception as exc:  # noqa: BLE001 - reported to the kernel, which stops the pool
            ready_error = _format_error(exc)
    send(conn, ("ready", ready_error))
    if ready_error is not None:
        return

    out = _ConnectionWriter(conn, lock, "stdout")
    err = _ConnectionWriter(conn, lock, "stderr")
    sys.stdout, sys.stderr = out, err
    namespace: dict[str, Any] = {"__name__": "__main__"}
    flush_c_stdio = c_stdio_flusher()  # C prints reach the log (rank_output.RankFdOutput) with their cell

    while True:
        try:
            message = receive(conn)
        except KeyboardInterrupt:  # an interrupt that arrived between cells
            continue
        except EOFError:  # the kernel is gone
            break
        if message[0] == "stop":
            break
        _, cell_id, source = message
        out.cell_id = err.cell_id = cell_id
        published.clear()
        error = None
        # One blank line first: the cell's line 1 is the %%dist line. linecache lets
        # tracebacks show the cell's source lines.
        text = "\n" + source
        linecache.cache[CELL_LABEL] = (len(text), None, text.splitlines(keepends=True), CELL_LABEL)
        try:
            exec(compile(text, CELL_LABEL, "exec"), namespace)
        except BaseException as exc:  # noqa: BLE001 - report everything, including KeyboardInterrupt
            error = _format_error(exc)
        if flush_c_stdio is not None:
            flush_c_stdio(None)
        try:
            _send_whole(conn, lock, ("done", cell_id, error, dict(published)))
        except KeyboardInterrupt:  # the cell has finished: a late interrupt has nothing to stop
            pass

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing(0)  # not into finalization, where a gloo thread can abort the rank (rank/process_exit.py)

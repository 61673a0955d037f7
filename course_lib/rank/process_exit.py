"""End a rank's process the way Python does, minus the interpreter's finalization, which torch can abort.

The upstream bug (torch 2.13 and 2.15 on Python 3.11, gloo; tests/test_process_exit.py makes it
certain): a gloo worker thread (`pt_gloo_runloop`) runs a future's Python callback, such as a DDP
comm hook's `fut.then(...)`, and so takes the GIL. If it asks for the GIL while the interpreter is
finalizing (the main program has ended, its globals are being torn down), CPython ends that thread
with `pthread_exit`; the unwinding meets a C++ frame that may not throw, and the process aborts with
"terminate called without an active exception" (SIGABRT) after printing correct results. It needs
the thread to be late, so it is rare: it ended lesson 02's comm-hook cell once in a CI run, under load,
and 0 of 320 runs of that cell beside two busy processes (its stack was not captured; this is the one
way we know that gloo's threads abort a finished program with that line). pytorch/pytorch#179291
describes the same abort; its fix, destroying the groups at exit, was abandoned.

`exit_without_finalizing(status)` does what Python does at the end of a program, in the same
order, and then leaves with `os._exit`, as multiprocessing ends a child process: threading's
shutdown (joins the program's non-daemon threads and runs the functions registered for it, such
as concurrent.futures' pools), the atexit functions (a forgotten process group is destroyed there:
`rank.destroy_process_group_at_exit`), then Python's and C's buffered output is flushed. Module
globals are never torn down, so no torch thread meets a finalizing interpreter.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

__all__ = ["c_stdio_flusher", "exit_status", "exit_without_finalizing"]


def exit_status(exc: SystemExit) -> int:
    """The exit status Python gives `sys.exit(code)`: None is 0, an int is itself, anything else is printed and 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def c_stdio_flusher():
    """The C library's `fflush`, ready to call as `flush(None)` (all streams), or None where it cannot be
    loaded: what C code printed but the C library still buffers, which os._exit would drop (and which a pool
    worker flushes after each cell, so C output is shown with the cell that made it)."""
    try:
        import ctypes

        flush = ctypes.CDLL(None).fflush
        flush.argtypes = [ctypes.c_void_p]
        return flush
    except (OSError, AttributeError):
        return None


def _flush_c_stdio() -> None:
    flush = c_stdio_flusher()
    if flush is not None:
        flush(None)


def exit_without_finalizing(status: int = 0) -> NoReturn:
    """Join the non-daemon threads, run the atexit functions, flush all output, then `os._exit(status)`."""
    shutdown = getattr(threading, "_shutdown", None)  # what Python's own exit runs first (CPython 3.8+)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by the program: nothing to flush
            pass
    _flush_c_stdio()
    os._exit(status)

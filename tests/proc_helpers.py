"""Shared helpers for the launcher and magic tests: launch with a process ledger, find leftovers.

Every process a test starts inherits an environment variable with a value
unique to that launch (or kernel). Processes are found again by that mark,
so a leftover is caught even after its parent died and it was re-parented to
PID 1, where `psutil.Process().children()` no longer sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import psutil

from course_lib.launcher.torchrun import LaunchResult, run_torchrun

MARK_VAR = "COURSE_LIB_TEST_MARK"
SAMPLE_S = 0.05  # how often the ledger records descendants during a launch


def torch_import_s() -> float:
    """Seconds a fresh interpreter takes to `import torch.distributed` on this machine, now (under its current load)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=True, timeout=300)
    return time.monotonic() - started


def startup_deadline_s(imports: int = 1) -> float:
    """A deadline by which torchrun's ranks have surely reached their own code: torchrun's agent imports
    torch, and so does each rank `imports` times in a row (0: the rank imports only course_lib). Twice
    the measured time plus a second, never below 3 s: tests must not assume `import torch` is fast."""
    return max(3.0, 2 * torch_import_s() * (1 + imports) + 1.0)


def new_mark() -> str:
    return uuid.uuid4().hex


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie; False when the PID now names another process."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def marked_processes(mark: str, *, exclude: set[int] = frozenset()) -> list[psutil.Process]:
    """Living processes whose environment carries this mark (zombies count as gone)."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid in exclude or proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(MARK_VAR) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def still_alive(procs, timeout_s: float = 2.0) -> list[psutil.Process]:
    """The processes of `procs` still running after waiting up to `timeout_s` for them to go."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in procs if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    return left


def describe(procs) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return out


def kill_quietly(procs) -> None:
    """Clean up after a test that found leftovers, so later tests start from nothing."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(list(procs), timeout=3)


@contextlib.contextmanager
def env_var(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class DescendantLedger:
    """Records every descendant of `root_pid` seen while it runs (a background sampler)."""

    def __init__(self, root_pid: int | None = None):
        self.root = psutil.Process(root_pid or os.getpid())
        self.seen: dict[int, psutil.Process] = {}
        self.names: dict[int, str] = {}  # last name seen: a dead process has none
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in self.root.children(recursive=True):
                self.seen.setdefault(child.pid, child)
                # Taken again each time: right after fork a helper still has its parent's name.
                with contextlib.suppress(psutil.Error):
                    self.names[child.pid] = child.name()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(SAMPLE_S)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)


@dataclasses.dataclass
class Launch:
    """One real torchrun launch and what the test saw around it."""

    result: LaunchResult
    elapsed_s: float  # measured by the test, around run_torchrun
    seen: dict[int, psutil.Process]  # every descendant seen while it ran
    names: dict[int, str]  # their process names
    chunks: list[tuple[int, str, str]]  # what on_output received, in order
    leftovers: list[str]  # processes of this launch alive afterwards (killed by the helper)
    timeout_s: float = 60.0  # the launch's deadline


def launch(script: str, nproc: int, *, timeout_s: float = 60.0, backend: str = "gloo", cwd: str | None = None) -> Launch:
    """run_torchrun with a ledger of descendants and a leftover check by environment mark."""
    mark = new_mark()
    chunks: list[tuple[int, str, str]] = []
    with env_var(MARK_VAR, mark), DescendantLedger() as ledger:
        started = time.monotonic()
        result = run_torchrun(
            textwrap.dedent(script),
            nproc,
            backend=backend,
            timeout_s=timeout_s,
            on_output=lambda rank, stream, text: chunks.append((rank, stream, text)),
            cwd=cwd,
        )
        elapsed = time.monotonic() - started
    candidates = {**ledger.seen, **{p.pid: p for p in marked_processes(mark)}}
    left = still_alive(list(candidates.values()), timeout_s=1.0)
    leftovers = describe(left)
    kill_quietly(left)
    return Launch(result, elapsed, dict(ledger.seen), dict(ledger.names), chunks, leftovers, timeout_s)


@contextlib.contextmanager
def no_new_children():
    """Fail if a child of this (pytest) process started during the block survives it."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    new = [p for p in me.children(recursive=True) if p.pid not in before]
    left = still_alive(new)
    if left:
        names = describe(left)
        kill_quietly(left)
        raise AssertionError(f"processes started by this test survived it: {names}")


# A rank raises after init while the others wait outside any collective, so
# torchrun sees that one failure first and ends the others with SIGTERM.
RAISING_SCRIPT = """\
import time
import course_lib as cl
info = cl.init(timeout_s=30)
print(f"rank {info.rank} ready", flush=True)
if info.rank == info.world_size - 1:
    raise ValueError(f"rank {info.rank} gives up")
time.sleep(60)
"""
# The `raise` is script line 6; tracebacks say 7 because run_torchrun puts its
# hook import on line 1, as a notebook cell has its magic there.
RAISING_LINE = 7

_raising_launches: dict[int, Launch] = {}


def raising_launch(nproc: int) -> Launch:
    """One real launch per world size where the last rank raises; shared by test modules."""
    if nproc not in _raising_launches:
        _raising_launches[nproc] = launch(RAISING_SCRIPT, nproc, timeout_s=90)
    return _raising_launches[nproc]

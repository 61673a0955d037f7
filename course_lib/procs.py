"""Track and end the processes a launch started, by PID, never by name.

torchrun starts each rank in a session of its own, so killing torchrun's
process group does not reach the ranks. We therefore remember every
descendant we have seen (psutil guards against PID reuse by checking each
process's creation time before signalling it) and kill those.
"""

from __future__ import annotations

import os
import signal

import psutil

__all__ = ["ProcessTree"]


class ProcessTree:
    """Every process ever seen below one root process we started."""

    def __init__(self, root_pid: int):
        self.root = psutil.Process(root_pid)
        self.seen: dict[int, psutil.Process] = {root_pid: self.root}

    def refresh(self) -> None:
        """Record the root's current descendants (cheap: reads /proc once per process)."""
        try:
            for child in self.root.children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass
        # Children of ranks we already know survive their parent's death as orphans.
        for proc in list(self.seen.values()):
            try:
                for child in proc.children(recursive=True):
                    self.seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass

    def ranks(self) -> dict[int, psutil.Process]:
        """Living rank processes by global rank (read from each one's RANK env variable)."""
        found: dict[int, psutil.Process] = {}
        for proc in self.seen.values():
            if proc is self.root:
                continue
            try:
                env = proc.environ()
                if proc.ppid() == self.root.pid and "RANK" in env:
                    found[int(env["RANK"])] = proc
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def alive(self) -> list[psutil.Process]:
        out = []
        for proc in self.seen.values():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(proc)
            except psutil.NoSuchProcess:
                continue
        return out

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process seen (and the rank sessions' groups), then reap."""
        self.refresh()
        for proc in self.seen.values():
            try:
                if not proc.is_running():  # also false when the PID now names another process
                    continue
                if proc is not self.root and os.getpgid(proc.pid) == proc.pid:
                    # A rank leads its own process group: take its helpers with it.
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
            except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                continue
        psutil.wait_procs(list(self.seen.values()), timeout=timeout_s)

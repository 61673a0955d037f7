"""Track and end the processes a launch started, by PID, never by name.

torchrun starts each rank in a session of its own, so killing torchrun's
process group does not reach the ranks. We therefore remember every
descendant we have seen (psutil guards against PID reuse by checking each
process's creation time before signalling it), and at the end also look for
processes carrying this launch's mark: a unique value in an environment
variable every process of the launch inherits. The mark finds what sampling
missed, such as a helper a rank started just before it exited, which was
then re-parented away from our tree.
"""

from __future__ import annotations

import os
import signal
import uuid

import psutil

from ..rank.contract import ENV_LAUNCH_MARK

__all__ = ["ProcessTree", "kill_marked", "new_mark"]


def new_mark() -> str:
    return uuid.uuid4().hex


def _marked(mark: str) -> list[psutil.Process]:
    """Every living process, other than this one, whose environment carries `mark`."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(ENV_LAUNCH_MARK) == mark:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_marked(mark: str, timeout_s: float = 5.0) -> None:
    """SIGKILL every process carrying `mark` (a launch that has no process tree yet), then reap."""
    kill_and_reap(_marked(mark), timeout_s)


def kill_and_reap(procs: list[psutil.Process], timeout_s: float = 5.0) -> None:
    """SIGKILL each of `procs` (found by PID, never by name; one already gone is skipped), then wait for them."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)


def processes_of_uid(uid: int) -> list[psutil.Process]:
    """Every living process (zombies excluded) whose real uid is `uid`, with its cmdline in `info`: a hub's
    learner, whose processes outlive nothing of theirs (launch/hub/)."""
    return [proc for proc in psutil.process_iter(["uids", "status", "cmdline"])
            if proc.info["uids"] and proc.info["uids"].real == uid and proc.info["status"] != psutil.STATUS_ZOMBIE]


class ProcessTree:
    """Every process ever seen below one root process we started, or carrying its mark."""

    def __init__(self, root_pid: int, mark: str | None = None):
        self.root = psutil.Process(root_pid)
        self.mark = mark
        self.seen: dict[int, psutil.Process] = {root_pid: self.root}

    def refresh(self) -> None:
        """Record the root's current descendants (one scan of the process table).

        Processes re-parented away from the tree (a rank's helper whose rank
        died) are not found here but by `find_marked` when we kill.
        """
        try:
            for child in self.root.children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def find_marked(self) -> None:
        """Record every living process whose environment carries this launch's mark."""
        if self.mark is None:
            return
        for proc in _marked(self.mark):
            self.seen.setdefault(proc.pid, proc)

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

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process seen or marked (and the rank sessions' groups), then reap."""
        self.refresh()
        self.find_marked()
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

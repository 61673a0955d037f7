"""The ranks that grade one submission: started once, reused for every run, restarted after a failure.

A check used to be one torchrun launch per run (about 6 s here, most of it
importing torch in every rank). A `RankSet` instead forks `size` ranks from a
server that imported torch once (multiprocessing's forkserver), and gives each
run to ranks 0..nproc-1 (rank_runner.py): they start a gloo process group of
that size over a TCP store this process hosts (one key prefix per run), run the
learner's function, write their outputs, and destroy the group. A run whose
ranks all report "done" leaves the set ready for the next; a rank that raises,
exits or hangs past the deadline ends the run (the others are killed at once,
as torchrun does), and the next run gets a fresh set.

Each run comes back as a `LaunchResult`, as a torchrun launch would, so the
checker judges both alike. Messages from the ranks are JSON, never pickles: the
learner's code shares those processes.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import pathlib
import shutil
import tempfile
import time
import uuid
from multiprocessing.connection import wait

import psutil

from ..backend_choice import BackendChoice
from ..launcher.diagnosis import collect, describe_stuck, lost_peer
from ..launcher.processes import ProcessTree
from ..launcher.torchrun import LaunchResult
from ..rank.contract import ledger_file
from ..rank.ledger import LedgerReader
from . import rank_runner
from .spec import Limits

__all__ = ["RankSet"]

START_TIMEOUT_S = 60.0  # the first set of a process waits for the server to import torch
# After a rank dies, how long the others get to end on their own: when several raise the same
# error, the report must name the same rank every time (the lowest), not whichever ended first.
SETTLE_S = 0.3
GLOO = BackendChoice("gloo", "cpu", "grading ranks")


def _context():
    """Forkserver where the platform has it (ranks start in ~0.1 s, torch already imported); else spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([rank_runner.__name__])
    return ctx


class RankSet:
    """`size` grading ranks; `run(job_dir, ...)` any number of times; `close()` (or use `with`)."""

    def __init__(self, size: int, limits: Limits = Limits(), *, cpu_s: float = 600.0):
        self.size, self.limits, self.cpu_s = size, limits, cpu_s
        self.set_dir = pathlib.Path(tempfile.mkdtemp(prefix="course_ranks_"))  # mode 0700
        self.mark = uuid.uuid4().hex
        self.runs = 0
        self.starts = 0  # how many times ranks were started (1 + restarts), for tests and bench/
        self._store = None
        self._ranks: list = []  # multiprocessing Process objects
        self._jobs: list = []  # our ends of the job pipes
        self._status: list = []  # our ends of the status pipes
        self._readers: dict[int, LedgerReader] = {}

    def __enter__(self) -> RankSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- starting and ending ranks ----------------------------------------------------------------
    def _start(self) -> None:
        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=60))
        ctx = _context()
        limits = {"cpu_s": self.cpu_s, "memory_bytes": self.limits.memory_bytes,
                  "file_bytes": self.limits.file_bytes}
        for rank in range(self.size):
            jobs_out, jobs_in = ctx.Pipe(duplex=False)[::-1]
            status_in, status_out = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=rank_runner.serve, name=f"grading-rank-{rank}", daemon=True, args=(
                rank, jobs_in, status_out, str(self.set_dir), self._store.port, limits, self.mark, os.getpid()))
            proc.start()
            jobs_in.close()
            status_out.close()
            self._ranks.append(proc)
            self._jobs.append(jobs_out)
            self._status.append(status_in)
        self.starts += 1
        self._readers = {r: LedgerReader(str(self.set_dir / ledger_file(r))) for r in range(self.size)}
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = set(range(self.size))
        while waiting:
            ready = wait([self._status[r] for r in waiting] + [self._ranks[r].sentinel for r in waiting],
                         timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._kill()
                raise RuntimeError(f"grading ranks did not start within {START_TIMEOUT_S:g} s")
            for rank in list(waiting):
                if self._ranks[rank].sentinel in ready:
                    code = self._ranks[rank].exitcode
                    self._kill()
                    raise RuntimeError(f"grading rank {rank} ended while starting (exit code {code})")
                if self._status[rank] in ready:
                    self._status[rank].recv_bytes()
                    waiting.discard(rank)

    def _kill(self) -> None:
        """SIGKILL every rank and whatever it started (by PID, and by the set's mark), and forget them."""
        tree = None
        for proc in self._ranks:
            try:
                if tree is None:
                    tree = ProcessTree(proc.pid, self.mark)  # its kill_all also finds the set's marked processes
                else:
                    tree.seen[proc.pid] = psutil.Process(proc.pid)
                    tree.seen.update((child.pid, child) for child in tree.seen[proc.pid].children(recursive=True))
            except (psutil.NoSuchProcess, TypeError):  # TypeError: a rank that never started has no pid
                continue
        if tree is not None:
            tree.kill_all()
        for proc in self._ranks:
            proc.join(timeout=5)
        for conn in self._jobs + self._status:
            conn.close()
        self._ranks, self._jobs, self._status = [], [], []

    def close(self) -> None:
        """End the ranks (closing their job pipes lets healthy ones exit) and remove the set's folder."""
        for conn in self._jobs:
            conn.close()
        for proc in self._ranks:
            proc.join(timeout=2)
        self._jobs = []
        self._kill()
        shutil.rmtree(self.set_dir, ignore_errors=True)

    # --- one run ----------------------------------------------------------------------------------
    def run(self, job: dict, nproc: int, timeout_s: float) -> LaunchResult:
        """Give `job` (see rank_runner) to ranks 0..nproc-1; wait for them, at most `timeout_s`."""
        if nproc > self.size:
            raise ValueError(f"a run on {nproc} ranks in a set of {self.size}")
        if not self._ranks:
            self._start()
        self.runs += 1
        started = time.monotonic()
        job_dir = pathlib.Path(job["job_dir"])
        message = json.dumps({**job, "run": self.runs, "world_size": nproc, "timeout_s": timeout_s}).encode()
        for rank in range(nproc):
            self._jobs[rank].send_bytes(message)

        pending, exit_codes, first_dead = set(range(nproc)), {}, None
        timed_out = interrupted = False
        try:
            while pending and first_dead is None:
                left = started + timeout_s - time.monotonic()
                ready = wait([self._status[r] for r in pending] + [self._ranks[r].sentinel for r in pending],
                             timeout=max(0.0, left)) if left > 0 else []
                if not ready:
                    timed_out = True
                    break
                for rank in sorted(pending):
                    if self._status[rank] in ready and self._done(rank):
                        pending.discard(rank)
                        exit_codes[rank] = 0
                    elif self._ranks[rank].sentinel in ready:
                        self._ranks[rank].join()
                        exit_codes[rank] = self._ranks[rank].exitcode
                        pending.discard(rank)
                        first_dead = rank if first_dead is None else first_dead
        except KeyboardInterrupt:
            interrupted = True

        if first_dead is not None:
            self._settle(pending, exit_codes)
        root = self._root_cause(exit_codes, job_dir) if first_dead is not None else None
        stacks, diagnosis = {}, []
        if timed_out or interrupted:
            stuck = {r: self._ranks[r].pid for r in pending}
            all_ledgers, stacks = collect(self.set_dir, nproc, stuck)
            diagnosis = describe_stuck(self._this_run(all_ledgers, started), stacks)
        ledgers = self._this_run({r: self._readers[r].read() for r in range(nproc)}, started)
        failed = timed_out or interrupted or first_dead is not None
        if failed:
            self._kill()  # the others may be waiting for the rank that failed: start afresh next run
        for rank in pending:
            exit_codes.setdefault(rank, None)
        if interrupted:
            raise KeyboardInterrupt
        return LaunchResult(
            nproc=nproc, choice=GLOO,
            stdout={r: self._read(job_dir / f"stdout.rank{r}.txt") for r in range(nproc)},
            stderr={r: self._read(job_dir / f"stderr.rank{r}.txt") for r in range(nproc)},
            exit_codes=exit_codes, not_started=[], root_cause=root,
            timed_out=timed_out, interrupted=False, agent_output="",
            agent_exit_code=None if timed_out else (1 if failed else 0),
            results={}, elapsed_s=time.monotonic() - started,
            ledgers=ledgers, stacks=stacks, diagnosis=diagnosis,
        )

    def _settle(self, pending: set[int], exit_codes: dict) -> None:
        """Let the other ranks of a failed run end on their own for SETTLE_S, recording their exit codes."""
        deadline = time.monotonic() + SETTLE_S
        while pending and time.monotonic() < deadline:
            wait([self._ranks[r].sentinel for r in pending], timeout=max(0.0, deadline - time.monotonic()))
            for rank in sorted(pending):
                if not self._ranks[rank].is_alive():
                    exit_codes[rank] = self._ranks[rank].exitcode
                    pending.discard(rank)

    def _root_cause(self, exit_codes: dict, job_dir: pathlib.Path) -> int:
        """The lowest failed rank whose own error is not a peer's disappearance (else the lowest failed)."""
        failed = sorted(r for r, code in exit_codes.items() if code not in (0, None))
        own = [r for r in failed if not lost_peer(self._read(job_dir / f"stderr.rank{r}.txt"))]
        return (own or failed)[0]

    def _done(self, rank: int) -> bool:
        """Whether the rank's message says it finished this run (anything else is the learner's noise)."""
        try:
            return json.loads(self._status[rank].recv_bytes(4096)).get("done") == self.runs
        except (EOFError, OSError, ValueError, AttributeError):
            return False

    @staticmethod
    def _this_run(ledgers: dict[int, list[dict]], started: float) -> dict[int, list[dict]]:
        return {r: [e for e in entries if e["start"] >= started] for r, entries in ledgers.items()}

    @staticmethod
    def _read(path: pathlib.Path) -> str:
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

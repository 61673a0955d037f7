"""The ranks that grade one submission: started once, reused for every run, restarted after a failure.

A check used to be one torchrun launch per run (about 6 s here, most of it
importing torch in every rank). A `RankSet` instead forks `size` ranks from a
server that imported torch once (rank_server.py), and gives each run to ranks
0..nproc-1 (rank_runner.py), over a socket each rank connects back on: they
start a gloo process group of that size over a TCP store this process hosts
(one key prefix per run), run the learner's function, write their outputs, and
destroy the group. A run whose
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
import os
import pathlib
import secrets
import shutil
import socket
import tempfile
import time
import uuid
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait

import psutil

from ..backend_choice import BackendChoice
from ..launcher.diagnosis import collect, first_failure
from ..launcher.processes import ProcessTree
from ..launcher.torchrun import LaunchResult
from ..rank.contract import ledger_file
from ..rank.ledger import LedgerReader
from .rank_server import RankServer
from .spec import Limits
from .rank_runner import BUSY_EXTENSIONS
from .stuck import describe_check_hang, read_phases

__all__ = ["RankSet"]

START_TIMEOUT_S = 60.0  # ranks connect and set up (TCP store, ledger) once the server has forked them
# After a rank dies, how long the others get to end on their own: when several raise the same
# error, the report must name the same rank every time (the lowest), not whichever ended first.
SETTLE_S = 0.3
BUSY_SAMPLE_S = 0.5  # how long the ranks' CPU time is watched at a deadline
BUSY_CPU_S = 0.02  # CPU seconds in that window (4 % of a core) that count as still computing
GLOO = BackendChoice("gloo", "cpu", "grading ranks")


class RankSet:
    """`size` grading ranks; `run(job_dir, ...)` any number of times; `close()` (or use `with`)."""

    def __init__(self, size: int, limits: Limits = Limits(), *, cpu_s: float = 600.0,
                 server: RankServer | None = None, preload: tuple[str, ...] = ()):
        self.size, self.limits, self.cpu_s, self.preload = size, limits, cpu_s, tuple(preload)
        self.set_dir = pathlib.Path(tempfile.mkdtemp(prefix="course_ranks_"))  # mode 0700
        self.mark = uuid.uuid4().hex
        self.runs = 0
        self.starts = 0  # how many times ranks were started (1 + restarts), for tests and bench/
        self._server, self._own_server = server, server is None
        self._store = None
        self._pids: list[int] = []  # by rank
        self._conns: list[Connection] = []  # by rank: jobs go out, "ready"/"done" come back
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
        if self._server is None:
            self._server = RankServer(self.preload)
        key = secrets.token_bytes(32)
        address = str(self.set_dir / f"ranks{self.starts}.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(address)
        listener.listen(self.size)
        request = {"address": address, "authkey": key.hex(), "set_dir": str(self.set_dir),
                   "store_port": self._store.port, "mark": self.mark, "grader_pid": os.getpid(),
                   "limits": {"cpu_s": self.cpu_s, "memory_bytes": self.limits.memory_bytes,
                              "file_bytes": self.limits.file_bytes}}
        self.starts += 1
        self._pids = [self._server.fork({**request, "rank": rank}) for rank in range(self.size)]
        self._readers = {r: LedgerReader(str(self.set_dir / ledger_file(r))) for r in range(self.size)}
        conns: dict[int, Connection] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while len(conns) < self.size:
                listener.settimeout(max(0.01, deadline - time.monotonic()))
                sock, _ = listener.accept()
                sock.setblocking(True)  # a Connection reads its descriptor directly: it must block
                conn = Connection(sock.detach())
                deliver_challenge(conn, key)  # both sides prove they know the key before anything is read
                answer_challenge(conn, key)
                conns[int(json.loads(conn.recv_bytes(4096))["ready"])] = conn
        except (OSError, EOFError, ValueError, KeyError) as exc:  # socket.timeout is an OSError
            self._conns = list(conns.values())
            self._kill()
            dead = {r: self._server.exit_code(pid, 0.1) for r, pid in enumerate(self._pids)}
            ended = {r: code for r, code in dead.items() if code is not None}
            raise RuntimeError(f"grading ranks did not start ({type(exc).__name__}"
                               f"{f'; exit codes {ended}' if ended else ''})") from None
        finally:
            listener.close()
        self._conns = [conns[r] for r in range(self.size)]

    def _kill(self) -> None:
        """SIGKILL every rank and whatever it started (by PID, and by the set's mark), and forget them."""
        tree = None
        for pid in self._pids:
            try:
                if tree is None:
                    tree = ProcessTree(pid, self.mark)  # its kill_all also finds the set's marked processes
                else:
                    tree.seen[pid] = psutil.Process(pid)
                    tree.seen.update((child.pid, child) for child in tree.seen[pid].children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        if tree is not None:
            tree.kill_all()
        for pid in self._pids:
            self._server.exit_code(pid, timeout_s=2)  # reaped by the server
        for conn in self._conns:
            conn.close()
        self._pids, self._conns = [], []

    def close(self) -> None:
        """End the ranks (closing their connections lets healthy ones exit), the own server, the set's folder."""
        for conn in self._conns:
            conn.close()
        for pid in self._pids:
            self._server.exit_code(pid, timeout_s=2)
        self._conns = []
        if self._server is not None:
            self._kill()
            if self._own_server:
                self._server.stop()
                self._server = None
        shutil.rmtree(self.set_dir, ignore_errors=True)

    # --- one run ----------------------------------------------------------------------------------
    def run(self, job: dict, nproc: int, timeout_s: float) -> LaunchResult:
        """Give `job` (see rank_runner) to ranks 0..nproc-1; wait for them, at most `timeout_s`."""
        if nproc > self.size:
            raise ValueError(f"a run on {nproc} ranks in a set of {self.size}")
        if not self._conns:
            self._start()
        self.runs += 1
        started = time.monotonic()
        job_dir = pathlib.Path(job["job_dir"])
        message = json.dumps({**job, "run": self.runs, "world_size": nproc, "timeout_s": timeout_s}).encode()
        for rank in range(nproc):
            self._conns[rank].send_bytes(message)

        pending, exit_codes, first_dead = set(range(nproc)), {}, None
        timed_out = interrupted = False
        deadline, extensions = started + timeout_s, 0
        try:
            while pending and first_dead is None:
                left = deadline - time.monotonic()
                ready = wait([self._conns[r] for r in pending], timeout=max(0.0, left)) if left > 0 else []
                if not ready:
                    if extensions < BUSY_EXTENSIONS and self._still_computing(pending):
                        extensions += 1
                        deadline += timeout_s
                        continue
                    timed_out = True
                    break
                for rank in sorted(pending):
                    if self._conns[rank] not in ready:
                        continue
                    message = self._message(rank)
                    if message is None:  # the connection closed: the rank ended
                        exit_codes[rank] = self._server.exit_code(self._pids[rank])
                        pending.discard(rank)
                        first_dead = rank if first_dead is None else first_dead
                    elif message.get("done") == self.runs:
                        exit_codes[rank] = 0
                        pending.discard(rank)
        except KeyboardInterrupt:
            interrupted = True

        if first_dead is not None:
            self._settle(pending, exit_codes)
        stderr = {r: self._read(job_dir / f"stderr.rank{r}.txt") for r in range(nproc)}
        # Several ranks may fail with the same error: name the lowest whose error is its own, not a lost peer.
        root = first_failure(exit_codes, stderr, reported=None) if first_dead is not None else None
        stacks, diagnosis = {}, []
        if timed_out or interrupted:
            stuck = {r: self._pids[r] for r in pending}
            all_ledgers, stacks = collect(self.set_dir, nproc, stuck)
            # In the learner's terms: which waits are in their function, which in the checker's own calls.
            diagnosis = describe_check_hang(self._this_run(all_ledgers, started), stacks,
                                            read_phases(job_dir, sorted(pending)))
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
            stderr=stderr,
            exit_codes=exit_codes, not_started=[], root_cause=root,
            timed_out=timed_out, interrupted=False, agent_output="",
            agent_exit_code=None if timed_out else (1 if failed else 0),
            results={}, elapsed_s=time.monotonic() - started,
            ledgers=ledgers, stacks=stacks, diagnosis=diagnosis,
        )

    def _still_computing(self, pending: set[int]) -> bool:
        """Whether an unfinished rank is runnable or used CPU over the next BUSY_SAMPLE_S (slow), or all are
        blocked (a hang). On a heavily loaded machine a computing rank may get little CPU but is runnable."""
        procs = []
        for rank in pending:
            try:
                procs.append(psutil.Process(self._pids[rank]))
            except psutil.Error:
                continue

        def sample() -> tuple[float, bool]:
            total, runnable = 0.0, False
            for proc in procs:
                try:
                    times = proc.cpu_times()
                    total += times.user + times.system
                    runnable |= proc.status() == psutil.STATUS_RUNNING
                except psutil.Error:
                    pass
            return total, runnable

        before, runnable = sample()
        for _ in range(5):
            time.sleep(BUSY_SAMPLE_S / 5)
            after, now_runnable = sample()
            runnable |= now_runnable
        return runnable or after - before >= BUSY_CPU_S

    def _settle(self, pending: set[int], exit_codes: dict) -> None:
        """Let the other ranks of a failed run end on their own for SETTLE_S, recording their exit codes."""
        deadline = time.monotonic() + SETTLE_S
        while pending and time.monotonic() < deadline:
            ready = wait([self._conns[r] for r in pending], timeout=max(0.0, deadline - time.monotonic()))
            for rank in sorted(pending):
                if self._conns[rank] in ready and self._message(rank) is None:
                    exit_codes[rank] = self._server.exit_code(self._pids[rank])
                    pending.discard(rank)

    def _message(self, rank: int) -> dict | None:
        """The rank's next message ({} if it is not JSON: the learner's noise); None once it has ended."""
        try:
            data = self._conns[rank].recv_bytes(4096)
        except (EOFError, OSError):
            return None
        try:
            message = json.loads(data)
        except ValueError:
            return {}
        return message if isinstance(message, dict) else {}

    @staticmethod
    def _this_run(ledgers: dict[int, list[dict]], started: float) -> dict[int, list[dict]]:
        return {r: [e for e in entries if e["start"] >= started] for r, entries in ledgers.items()}

    @staticmethod
    def _read(path: pathlib.Path) -> str:
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

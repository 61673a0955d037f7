"""Persistent ranks: N workers started once by torchrun, running notebook cells on demand.

The kernel listens on a loopback port; each worker (pool_worker.py)
connects and both sides prove they know the session's secret (HMAC challenge,
multiprocessing.connection) before any pickled message is read. A cell is
sent to the chosen ranks; their output streams back as it is printed; the
kernel waits on the connections themselves (`multiprocessing.connection.wait`),
so a trivial cell costs one round trip, not a polling interval.

A deadline, an interrupt that the ranks do not answer, or a dead rank leaves
the pool broken: every process is killed by PID and `Pool.broken` says why;
the cell's result has each dead rank's exit code, read from torchrun's output.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from typing import Any, Callable

from ..backend_choice import BackendChoice
from ..rank.contract import ENV_POOL_ADDRESS, ENV_POOL_INIT, ENV_POOL_KEYFILE, ledger_file, log_files
from ..rank.ledger import LedgerReader
from . import pool_worker
from .diagnosis import collect, describe_stuck
from .messages import receive, send
from .rank_output import RankFdOutput, parse_torchrun_failures
from .torchrun import TorchrunProcess, resolve_backend

__all__ = ["CellResult", "Pool", "PoolError"]

START_TIMEOUT_S = 120.0
INTERRUPT_GRACE_S = 3.0  # how long ranks get to answer an interrupt before the pool is killed
WAKE_S = 0.25  # the longest wait between live-view refreshes while a cell runs
HANDSHAKE_S = 5.0  # the longest a connecting peer may take to prove it knows the secret


class PoolError(RuntimeError):
    """The pool could not start, or is not running."""


@dataclasses.dataclass
class CellResult:
    ranks: list[int]
    stdout: dict[int, str]
    stderr: dict[int, str]
    errors: dict[int, tuple[str, str]]  # rank -> (exception name, traceback text)
    published: dict[str, dict[int, Any]]
    timed_out: bool = False
    interrupted: bool = False
    unfinished: list[int] = dataclasses.field(default_factory=list)  # ranks that never reported back
    dead: list[int] = dataclasses.field(default_factory=list)  # ranks whose process ended during the cell
    # Each dead rank's exit code as torchrun reported it (negative: the signal); None if it did not say.
    exit_codes: dict[int, int | None] = dataclasses.field(default_factory=dict)
    ledgers: dict[int, list[dict]] = dataclasses.field(default_factory=dict)  # every rank's ledger so far
    stacks: dict[int, str] = dataclasses.field(default_factory=dict)  # Python stacks of ranks that never reported
    diagnosis: list[str] = dataclasses.field(default_factory=list)  # who was stuck where

    @property
    def ok(self) -> bool:
        return not (self.errors or self.timed_out or self.interrupted or self.unfinished or self.dead)


class Pool:
    """N persistent ranks. `start()`, then `run(source)` any number of times, then `stop()`."""

    def __init__(self, nproc: int, backend: str | BackendChoice = "auto", *, init: bool = True,
                 cwd: str | None = None):
        self.nproc = nproc
        # Decided once: a restart passes this choice to the next pool (see launcher.torchrun.resolve_backend).
        self.choice: BackendChoice = resolve_backend(nproc, backend)
        self.init = init
        self.cwd = cwd
        self.conns: dict[int, Connection] = {}
        self.pids: dict[int, int] = {}
        self.launch: TorchrunProcess | None = None
        self.run_dir: pathlib.Path | None = None
        self.broken: str | None = None  # why the pool can no longer run cells
        self.ledger_readers: dict[int, LedgerReader] = {}
        self.fd_outputs: dict[int, RankFdOutput] = {}
        self.cell_id = 0

    # ------------------------------------------------------------------ start / stop

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Launch the workers and wait until every one has connected and started its process group."""
        self.run_dir = pathlib.Path(tempfile.mkdtemp(prefix="course_lib_pool_"))  # mode 0700
        key = secrets.token_bytes(32)
        keyfile = self.run_dir / "key"
        fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(key)
        server = socket.create_server(("127.0.0.1", 0))  # loopback only
        try:
            extra_env = {
                ENV_POOL_ADDRESS: f"127.0.0.1:{server.getsockname()[1]}",
                ENV_POOL_KEYFILE: str(keyfile),
                ENV_POOL_INIT: "1" if self.init else "0",
            }
            self.launch = TorchrunProcess(["-m", pool_worker.__name__], self.nproc, self.choice, self.run_dir,
                                          cwd=self.cwd, extra_env=extra_env)
            self.ledger_readers = {r: LedgerReader(str(self.launch.results_dir / ledger_file(r)))
                                   for r in range(self.nproc)}
            self._accept_workers(server, key, time.monotonic() + timeout_s)
            self._wait_ready(time.monotonic() + timeout_s)
            self.fd_outputs = {r: RankFdOutput(self.launch.log_dir, r) for r in range(self.nproc)}
            for fd_output in self.fd_outputs.values():
                fd_output.skip_to_end()  # start-up chatter is not the first cell's output
        except BaseException:
            self.kill()
            raise
        finally:
            server.close()

    def _accept_workers(self, server: socket.socket, key: bytes, deadline: float) -> None:
        server.settimeout(WAKE_S)
        while len(self.conns) < self.nproc:
            self._check_starting(deadline, "connect")
            try:
                sock, _ = server.accept()
            except socket.timeout:
                continue
            conn = self._authenticate(sock, key, min(HANDSHAKE_S, max(deadline - time.monotonic(), 0.1)))
            if conn is None:
                continue
            kind, rank, pid = receive(conn)
            assert kind == "hello"
            self.conns[rank] = conn
            self.pids[rank] = pid

    @staticmethod
    def _authenticate(sock: socket.socket, key: bytes, timeout_s: float) -> Connection | None:
        """The HMAC challenge both ways, bounded in time: a peer that stays silent cannot stall start."""
        sock.setblocking(True)
        conn = Connection(os.dup(sock.fileno()))  # `sock` stays ours, to cut the handshake short
        outcome: list[bool] = []

        def handshake() -> None:
            try:
                # Same order as multiprocessing's Listener: we challenge first, then answer.
                deliver_challenge(conn, key)
                answer_challenge(conn, key)
                outcome.append(True)
            except Exception:  # noqa: BLE001 - a peer without the secret, or cut off below
                outcome.append(False)

        thread = threading.Thread(target=handshake, daemon=True)
        thread.start()
        thread.join(timeout_s)
        if not outcome or not outcome[0]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a handshake blocked in a read
            except OSError:
                pass
            thread.join(1.0)
            sock.close()
            conn.close()
            return None  # nothing from this peer was unpickled
        sock.close()
        return conn

    def _wait_ready(self, deadline: float) -> None:
        waiting = dict(self.conns)
        while waiting:
            self._check_starting(deadline, "start their process group")
            for conn in wait(list(waiting.values()), timeout=WAKE_S):
                rank = self._rank_of(conn)
                try:
                    kind, error = receive(conn)
                except EOFError:
                    raise PoolError(f"rank {rank} exited while starting: {self._tail_of_logs()}") from None
                assert kind == "ready"
                if error is not None:
                    raise PoolError(f"rank {rank} could not start its process group: {error[1].strip().splitlines()[-1]}")
                del waiting[rank]

    def _check_starting(self, deadline: float, doing: str) -> None:
        if self.launch.proc.poll() is not None:
            raise PoolError(f"torchrun exited while the ranks were starting: {self._tail_of_logs()}")
        if time.monotonic() > deadline:
            missing = sorted(set(range(self.nproc)) - set(self.conns))
            raise PoolError(f"the ranks did not {doing} in time (ranks still missing: {missing or 'none'})")

    def _tail_of_logs(self) -> str:
        lines = [ln for ln in self.launch.agent_output().splitlines() if ln.strip()]
        for path in log_files(self.launch.log_dir, stream="stderr"):
            lines += [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else "no output"

    def _forward_fd_output(self, result: CellResult, on_output) -> None:
        """Add what the cell's ranks wrote below Python (rank_output.RankFdOutput) since the last look."""
        for rank in result.ranks:
            for stream, text in self.fd_outputs[rank].read():
                getattr(result, stream)[rank] += text
                if on_output is not None:
                    on_output(rank, stream, text)

    def _rank_of(self, conn: Connection) -> int:
        return next(rank for rank, c in self.conns.items() if c is conn)

    @property
    def running(self) -> bool:
        if self.launch is not None and self.broken is None and self.launch.proc.poll() is not None:
            self.broken = "the ranks exited between cells"  # e.g. a rank was killed from outside
        return self.launch is not None and self.broken is None

    def stop(self, grace_s: float = 5.0) -> None:
        """Ask every rank to leave (destroying its process group), then make sure all are gone."""
        if self.launch is not None and self.broken is None:
            for conn in self.conns.values():
                try:
                    send(conn, ("stop",))
                except OSError:
                    pass
            try:
                self.launch.proc.wait(timeout=grace_s)
            except Exception:  # noqa: BLE001 - any reason to stop waiting: kill below
                pass
        self.kill()

    def kill(self) -> None:
        """Kill every process of the pool by PID and forget it."""
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        for fd_output in self.fd_outputs.values():
            fd_output.close()
        self.fd_outputs = {}
        if self.launch is not None:
            self.launch.kill()
            self.launch = None
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None
        self.broken = self.broken or "stopped"

    # ------------------------------------------------------------------ cells

    def run(
        self,
        source: str,
        ranks: list[int] | None = None,
        *,
        timeout_s: float = 120.0,
        on_output: Callable[[int, str, str], None] | None = None,
        on_poll: Callable[[], None] | None = None,
    ) -> CellResult:
        """Run `source` on `ranks` (default: all); return when each has reported back.

        A KeyboardInterrupt is passed on to the ranks as SIGINT; the result says
        so (`interrupted`) instead of raising.
        """
        if not self.running:
            raise PoolError(f"the pool is not running ({self.broken or 'not started'})")
        ranks = sorted(range(self.nproc)) if ranks is None else sorted(ranks)
        self.cell_id += 1
        cell_id = self.cell_id
        result = CellResult(ranks, {r: "" for r in ranks}, {r: "" for r in ranks}, {}, {})
        started = time.monotonic()
        for rank in ranks:
            send(self.conns[rank], ("run", cell_id, source))
        pending = set(ranks)
        deadline = started + timeout_s
        try:
            self._collect(cell_id, pending, deadline, result, on_output, on_poll)
        except KeyboardInterrupt:
            result.interrupted = True
            for rank in pending:
                try:
                    os.kill(self.pids[rank], signal.SIGINT)  # the worker raises KeyboardInterrupt in the cell
                except ProcessLookupError:
                    pass
            self._collect(cell_id, pending, time.monotonic() + INTERRUPT_GRACE_S, result, on_output, on_poll)
        result.unfinished = sorted(pending - set(result.dead))
        if result.unfinished:
            stuck = {r: self.pids[r] for r in result.unfinished}
            result.ledgers, result.stacks = collect(self.launch.results_dir, self.nproc, stuck)
            result.diagnosis = describe_stuck(result.ledgers, result.stacks)
        else:
            # Incremental: a cell parses only the entries added since the previous one.
            result.ledgers = {r: list(reader.read()) for r, reader in self.ledger_readers.items()}
        if result.dead:
            # Give torchrun a moment to notice and report how the rank ended.
            try:
                self.launch.proc.wait(timeout=2)
            except Exception:  # noqa: BLE001 - still running: killed below
                pass
        # The rest of what ranks wrote below Python, e.g. the C++ message of a rank that aborted.
        self._forward_fd_output(result, on_output)
        if result.timed_out or result.unfinished or result.dead:
            launch = self.launch
            reason = ("deadline" if result.timed_out else f"rank {result.dead[0]} died" if result.dead
                      else "interrupt not answered")
            self.kill()  # also waits for torchrun's output to be read to its end
            self.broken = reason
            if result.dead:
                codes, _ = parse_torchrun_failures(launch.agent_output())
                result.exit_codes = {r: codes.get(r) for r in result.dead}
        return result

    def _collect(self, cell_id, pending, deadline, result, on_output, on_poll) -> None:
        """Read messages of cell `cell_id` until no rank is pending, a rank dies, or the deadline."""
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                result.timed_out = not result.interrupted
                return
            for conn in wait([self.conns[r] for r in pending], timeout=min(remaining, WAKE_S)):
                rank = self._rank_of(conn)
                try:
                    message = receive(conn)
                except (EOFError, OSError):
                    result.dead.append(rank)
                    pending.discard(rank)
                    continue
                kind, msg_cell = message[0], message[1]
                if msg_cell != cell_id:
                    continue  # late output of an earlier, interrupted cell
                if kind == "out":
                    _, _, stream, text = message
                    getattr(result, stream)[rank] += text
                    if on_output is not None:
                        on_output(rank, stream, text)
                elif kind == "done":
                    _, _, error, published = message
                    if error is not None:
                        result.errors[rank] = error
                    for name, value in published.items():
                        result.published.setdefault(name, {})[rank] = value
                    pending.discard(rank)
            self._forward_fd_output(result, on_output)
            if on_poll is not None:
                on_poll()
            if result.dead:
                # A dead rank breaks the process group: the others may wait for it forever.
                return

"""`%dist` and `%%dist`: persistent ranks that keep their state between cells.

    %dist start -n 4 [--backend auto|gloo|nccl] [--no-init]
    %%dist [--ranks 0,2] [--timeout SECONDS] [--expect-failure]
    %dist status | restart | stop

`%dist start` launches N workers with real torchrun (launcher/pool_worker.py);
each starts the default process group unless `--no-init`. A `%%dist` cell runs
on every rank (or on `--ranks`), in a namespace that persists on each rank
like a kernel of its own. Output streams live, then shows in rank order. An
exception on a rank is shown with its traceback and the pool stays up. At a
deadline, an unanswered interrupt or a dead rank, every worker is killed by
PID, the cell says where each stuck rank was, and the next `%%dist` cell
starts a fresh pool (with the same settings) and says so.
"""

from __future__ import annotations

import argparse
import atexit
import functools

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, argument_group, kwds, magic_arguments

from ..backend_choice import BACKEND_CHOICES, BackendChoice, BackendError, choose_backend
from ..launcher.diagnosis import consequences
from ..launcher.pool import CellResult, Pool, PoolError
from ..launcher.rank_output import describe_exit, ranks_phrase, short_frames
from .args import DEFAULT_NPROC, MAX_NPROC, CellInterrupted, parse_line, positive_seconds, rank_count
from .cell_end import CellEnd, finish
from .display import run_live

__all__ = ["DEFAULT_CELL_TIMEOUT_S", "DistMagics", "cell_end"]

DEFAULT_CELL_TIMEOUT_S = 60.0
COMMANDS = ("start", "status", "restart", "stop")

# One parser serves both forms (so that `%dist?` lists every option): options
# of the other form are refused by name. Names as argparse gives them in errors.
START_OPTIONS = {"nproc": "-n/--nproc/--nproc-per-node", "backend": "--backend", "no_init": "--no-init"}
CELL_OPTIONS = {"ranks": "--ranks", "timeout": "--timeout", "expect_failure": "--expect-failure"}


def _refuse(name: str, given: dict, options: dict[str, str], belongs_to: str) -> None:
    for dest in given:
        if dest in options:
            raise UsageError(f"{name}: {options[dest]} is an option of {belongs_to}")


def _parse_ranks(text: str | None, nproc: int) -> list[int] | None:
    if text is None:
        return None
    try:
        ranks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"%%dist: --ranks takes numbers separated by commas, e.g. 0,2; got {text!r}") from None
    bad = [r for r in ranks if not 0 <= r < nproc]
    if not ranks or bad:
        raise UsageError(f"%%dist: --ranks {text}: the pool has ranks 0 to {nproc - 1}")
    return ranks


def _header(pool: Pool, ranks: list[int] | None) -> str:
    everyone = "1 rank" if pool.nproc == 1 else f"{pool.nproc} ranks"
    who = everyone if ranks is None else f"ranks {', '.join(map(str, ranks))} of {pool.nproc}"
    return f"[dist] {who}, backend {pool.choice.backend} on {pool.choice.device_type}"


def _exit_words(code: int | None) -> str:
    if code is None:
        return "exited"
    return f"exit code {code}" if code >= 0 else describe_exit(code)


def _failure_message(result: CellResult, timeout_s: float) -> str:
    restart = "the ranks were stopped; the next %%dist cell starts new ones (their variables are gone)"
    if result.timed_out:
        return f"deadline of {timeout_s:g} s passed; still running: {ranks_phrase(result.unfinished)}; {restart}"
    if result.dead:
        how = ", ".join(f"rank {r} ({_exit_words(result.exit_codes.get(r))})" for r in result.dead)
        return f"{how} ended during the cell; {restart}"
    if result.interrupted and result.unfinished:
        return f"{ranks_phrase(result.unfinished)} did not answer the interrupt; {restart}"
    first = min(result.errors)
    kind, text = result.errors[first]
    last = text.strip().splitlines()[-1] if text.strip() else kind
    others = sorted(set(result.errors) - {first})
    also = f" (also on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
    return f"rank {first} raised {last}{also}; the ranks are still running"


def cell_end(result: CellResult, timeout_s: float, *, pool_running: bool) -> CellEnd:
    """How a cell on the pool ends: each rank's traceback after what it printed, the first failing rank first,
    and whose errors follow from a rank that died."""
    stderr = {r: short_frames(text + (result.errors[r][1] if r in result.errors else ""))
              for r, text in result.stderr.items()}
    end = CellEnd(result.stdout, stderr, result.published, result.ledgers,
                  all_well="every rank finished without error",
                  first=min(result.errors) if result.errors else None,
                  diagnosis=result.diagnosis, stacks=result.stacks)
    end.consequences = consequences({r: text for r, (_, text) in result.errors.items()}, result.dead, result.ledgers)
    if result.interrupted:
        end.interrupted = "interrupted" + ("" if pool_running else "; " + _failure_message(result, timeout_s))
    elif not result.ok:
        end.failure = _failure_message(result, timeout_s)
    return end


@magics_class
class DistMagics(Magics):
    def __init__(self, shell=None, **kwargs):
        super().__init__(shell, **kwargs)
        self.pool: Pool | None = None  # this kernel's ranks (None before `%dist start`)
        atexit.register(self._stop_at_exit)  # kernel shutdown: leave no worker behind

    def _stop_at_exit(self) -> None:
        if self.pool is not None:
            self.pool.stop(grace_s=2)

    @magic_arguments()
    # argparse %-formats usage and help texts: "%%" there prints "%".
    @kwds(usage="dist start [-n N] [--backend auto|gloo|nccl] [--no-init] | status | restart | stop\n"
                "  %%%%dist [--ranks 0,2] [--timeout SECONDS] [--expect-failure]",
          argument_default=argparse.SUPPRESS)  # an option not given is absent: see _refuse
    @argument("command", nargs="?", metavar="start|status|restart|stop",
              help="%%dist on a line of its own: start the ranks, say how they are, start new ones, stop them")
    @argument_group("%dist start")
    @argument("-n", "--nproc", "--nproc-per-node", type=rank_count, metavar="N",
              help=f"number of ranks, 1 to {MAX_NPROC} (default {DEFAULT_NPROC})")
    @argument("--backend", choices=BACKEND_CHOICES,
              help="auto (default): nccl when this machine has a GPU per rank, else gloo on CPU")
    @argument("--no-init", action="store_true", help="do not start the default process group")
    @argument_group("%%dist cells")
    @argument("--ranks", metavar="0,2", help="run the cell on these ranks only (default: every rank)")
    @argument("--timeout", type=positive_seconds, metavar="SECONDS",
              help=f"deadline: then the ranks are stopped (default {DEFAULT_CELL_TIMEOUT_S:g})")
    @argument("--expect-failure", action="store_true",
              help="the cell is meant to fail: say so without an error; raise if every rank finishes without one")
    @line_cell_magic
    def dist(self, line: str, cell: str | None = None):
        """Persistent ranks: `%dist start -n 2`, then `%%dist` cells run on every rank and keep their variables.

        A rank's exception keeps the ranks running; a deadline, an unanswered
        interrupt or a dead rank stops them, and the next %%dist cell starts new ones.
        """
        if cell is None:
            self._line(line)
        else:
            self._cell(line, cell)

    def _start(self, nproc: int, choice: BackendChoice, init: bool) -> Pool:
        """Stop this kernel's pool, if any, and start another."""
        if self.pool is not None:
            self.pool.stop()
        pool = Pool(nproc, choice, init=init)
        try:
            pool.start()
        except PoolError as exc:
            self.pool = None
            raise UsageError(f"%dist start: {exc}") from None
        except KeyboardInterrupt:  # Pool.start killed what it had started
            print("[dist] interrupted while the ranks were starting; none is running")
            raise CellInterrupted from None
        self.pool = pool
        return pool

    def _line(self, line: str) -> None:
        """%dist start -n N [--backend ...] [--no-init] | status | restart | stop"""
        first = line.split(maxsplit=1)[0] if line.strip() else ""
        name = f"%dist {first}" if first in COMMANDS else "%dist"
        given = vars(parse_line(DistMagics.dist, line, name))
        command = given.pop("command", None)
        if command not in COMMANDS:
            raise UsageError(f"%dist: expected start, status, restart or stop, got {command or 'nothing'!r}")
        _refuse(name, given, CELL_OPTIONS, "%%dist cells")
        if command != "start":
            _refuse(name, given, START_OPTIONS, "%dist start")
        if command == "start":
            nproc = given.get("nproc", DEFAULT_NPROC)
            try:
                choice = choose_backend(nproc, given.get("backend", "auto"))  # before any pool is stopped
            except BackendError as exc:
                raise UsageError(f"%dist start: {exc}") from None
            pool = self._start(nproc, choice, init=not given.get("no_init", False))
            print(pool.choice.header(pool.nproc, tag="dist") + ": started")
        elif command == "status":
            if self.pool is None:
                print("[dist] no ranks running: start them with %dist start -n 2")
            else:
                state = "running" if self.pool.running else f"stopped ({self.pool.broken})"
                print(f"{_header(self.pool, None)}: {state}, {self.pool.cell_id} cells run")
        elif command == "restart":
            if self.pool is None:
                raise UsageError("%dist restart: no ranks to restart; start them with %dist start -n 2")
            pool = self._start(self.pool.nproc, self.pool.choice, self.pool.init)
            print(f"{_header(pool, None)}: restarted (every rank's variables are gone)")
        else:
            if self.pool is not None:
                self.pool.stop()
            print("[dist] stopped")

    def _cell(self, line: str, cell: str) -> None:
        """Run this cell on the persistent ranks (see module docstring)."""
        given = vars(parse_line(DistMagics.dist, line, "%%dist"))
        if "command" in given:
            raise UsageError(f"%%dist: unrecognized arguments: {given['command']}")
        _refuse("%%dist", given, START_OPTIONS, "%dist start")
        if self.pool is None:
            raise UsageError("%%dist: no ranks running: start them first with %dist start -n 2")
        ranks = _parse_ranks(given.get("ranks"), self.pool.nproc)
        timeout_s = given.get("timeout", DEFAULT_CELL_TIMEOUT_S)
        try:
            compile("\n" + cell, "<cell>", "exec")
        except SyntaxError as exc:
            raise UsageError(f"%%dist: the cell does not parse: line {exc.lineno}: {exc.msg}") from None
        pool = self.pool
        if not pool.running:
            reason = pool.broken
            pool = self._start(pool.nproc, pool.choice, pool.init)  # the same settings, decided at %dist start
            print(f"[dist] the ranks had been stopped ({reason}); started {pool.nproc} new ones: "
                  "earlier variables are gone")
        result = run_live(_header(pool, ranks), functools.partial(pool.run, cell, ranks, timeout_s=timeout_s))
        finish(cell_end(result, timeout_s, pool_running=pool.running),
               expect_failure=given.get("expect_failure", False))

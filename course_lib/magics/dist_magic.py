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

import atexit

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..backend_choice import BACKEND_CHOICES, BackendError
from ..launcher.pool import CellResult, Pool, PoolError
from ..launcher.rank_output import describe_exit, parse_torchrun_failures, ranks_phrase
from ..results import ledgers, results
from .args import MagicParser, RankFailure, parse_line, positive_seconds, rank_count
from .display import LiveView, print_diagnosis, print_rank_blocks

__all__ = ["DEFAULT_CELL_TIMEOUT_S", "DistMagics", "current_pool"]

DEFAULT_CELL_TIMEOUT_S = 60.0

_pool: Pool | None = None


def current_pool() -> Pool | None:
    """The pool of this kernel (None before `%dist start`)."""
    return _pool


def _stop_at_exit() -> None:
    if _pool is not None:
        _pool.stop(grace_s=2)


atexit.register(_stop_at_exit)  # kernel shutdown: leave no worker behind


def _start_parser() -> MagicParser:
    parser = MagicParser(prog="%dist start", add_help=False)
    parser.add_argument("-n", "--nproc", "--nproc-per-node", type=rank_count, default=2)
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")
    parser.add_argument("--no-init", action="store_true", help="do not start the default process group")
    return parser


def _cell_parser() -> MagicParser:
    parser = MagicParser(prog="%%dist", add_help=False)
    parser.add_argument("--ranks", default=None)
    parser.add_argument("--timeout", type=positive_seconds, default=DEFAULT_CELL_TIMEOUT_S)
    parser.add_argument("--expect-failure", action="store_true")
    return parser


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
    who = f"{pool.nproc} ranks" if ranks is None else f"ranks {', '.join(map(str, ranks))} of {pool.nproc}"
    return f"[dist] {who}, backend {pool.choice.backend} on {pool.choice.device_type}"


def _start(nproc: int, backend: str, init: bool) -> Pool:
    global _pool
    try:
        pool = Pool(nproc, backend, init=init)  # checks the backend before anything is stopped
    except BackendError as exc:
        raise UsageError(f"%dist start: {exc}") from None
    if _pool is not None:
        _pool.stop()
    try:
        pool.start()
    except PoolError as exc:
        _pool = None
        raise UsageError(f"%dist start: {exc}") from None
    _pool = pool
    return pool


def _exit_words(code: int | None) -> str:
    if code is None:
        return "exited"
    return f"exit code {code}" if code >= 0 else describe_exit(code)


def _failure_message(result: CellResult, pool: Pool, timeout_s: float) -> str:
    restart = "the ranks were stopped; the next %%dist cell starts new ones (their variables are gone)"
    if result.timed_out:
        return f"deadline of {timeout_s:g} s passed; still running: {ranks_phrase(result.unfinished)}; {restart}"
    if result.dead:
        codes, _ = parse_torchrun_failures(result.agent_output)
        how = ", ".join(f"rank {r} ({_exit_words(codes.get(r))})" for r in result.dead)
        return f"{how} ended during the cell; {restart}"
    if result.interrupted and result.unfinished:
        return f"{ranks_phrase(result.unfinished)} did not answer the interrupt; {restart}"
    first = min(result.errors)
    kind, text = result.errors[first]
    last = text.strip().splitlines()[-1] if text.strip() else kind
    others = sorted(set(result.errors) - {first})
    also = f" (also on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
    return f"rank {first} raised {last}{also}; the ranks are still running"


@magics_class
class DistMagics(Magics):
    @line_cell_magic
    def dist(self, line: str, cell: str | None = None):
        """%dist start|status|restart|stop, or %%dist [--ranks ...] [--timeout S] to run a cell on the ranks."""
        if cell is None:
            _dist_line(line)
        else:
            _dist_cell(line, cell)


def _dist_line(line: str) -> None:
    """%dist start -n N [--backend ...] [--no-init] | status | restart | stop"""
    words = line.split(maxsplit=1)
    command, rest = (words[0], words[1] if len(words) > 1 else "") if words else ("", "")
    if command == "start":
        args = parse_line(_start_parser(), rest)
        pool = _start(args.nproc, args.backend, not args.no_init)
        print(pool.choice.header(pool.nproc, tag="dist") + ": started")
    elif command == "status":
        if _pool is None:
            print("[dist] no ranks running: start them with %dist start -n 2")
        else:
            state = "running" if _pool.running else f"stopped ({_pool.broken})"
            print(f"{_header(_pool, None)}: {state}, {_pool.cell_id} cells run")
    elif command == "restart":
        if _pool is None:
            raise UsageError("%dist restart: no ranks to restart; start them with %dist start -n 2")
        pool = _start(_pool.nproc, _pool.backend, _pool.init)
        print(f"{_header(pool, None)}: restarted (every rank's variables are gone)")
    elif command == "stop":
        if _pool is not None:
            _pool.stop()
        print("[dist] stopped")
    else:
        raise UsageError(f"%dist: expected start, status, restart or stop, got {command or 'nothing'!r}")


def _dist_cell(line: str, cell: str) -> None:
    """Run this cell on the persistent ranks (see module docstring)."""
    args = parse_line(_cell_parser(), line)
    if _pool is None:
        raise UsageError("%%dist: no ranks running: start them first with %dist start -n 2")
    ranks = _parse_ranks(args.ranks, _pool.nproc)
    try:
        compile("\n" + cell, "<cell>", "exec")
    except SyntaxError as exc:
        raise UsageError(f"%%dist: the cell does not parse: line {exc.lineno}: {exc.msg}") from None
    pool = _pool
    if not pool.running:
        reason = pool.broken
        pool = _start(pool.nproc, pool.backend, pool.init)
        print(f"[dist] the ranks had been stopped ({reason}); started {pool.nproc} new ones: earlier variables are gone")
    print(_header(pool, ranks), flush=True)
    live = LiveView()
    try:
        result = pool.run(cell, ranks, timeout_s=args.timeout, on_output=live.add, on_poll=live.refresh)
    finally:
        live.close()
    for name, by_rank in result.published.items():
        results[name] = dict(sorted(by_rank.items()))
    ledgers.clear()
    ledgers.update(result.ledgers)
    first = min(result.errors) if result.errors else None
    for rank, (_, traceback_text) in result.errors.items():
        result.stderr[rank] += traceback_text  # the rank's traceback, after what it printed
    print_rank_blocks(result.stdout, result.stderr, first=first)
    print_diagnosis(result.diagnosis, result.stacks)
    if result.interrupted:
        print("interrupted" + ("" if pool.running else "; " + _failure_message(result, pool, args.timeout)))
        raise KeyboardInterrupt
    if result.ok and args.expect_failure:
        raise RankFailure("--expect-failure was given, but every rank finished without error")
    if not result.ok:
        message = _failure_message(result, pool, args.timeout)
        if args.expect_failure:
            print(f"as expected, {message}")
        else:
            raise RankFailure(message)

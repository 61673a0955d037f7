"""The `%%torchrun` cell magic: run the cell as a script on N real ranks.

    %load_ext course_lib
    %%torchrun -n 2 [--backend auto|gloo|nccl] [--timeout SECONDS] [--max-restarts K] [--expect-failure]

The first output line names world size, backend, device and why; rank output
appears live while the cell runs, then as rank-ordered `[rank N]` blocks
(stdout, then stderr) that are the same on every run, so nbval can compare
them. Bad input raises a one-line `UsageError`; a failed, timed-out or
interrupted run says which ranks did what.
"""

from __future__ import annotations

import functools

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..backend_choice import BACKEND_CHOICES, BackendError, choose_backend
from ..launcher.diagnosis import consequences, ended_first, first_failure, rank_where
from ..launcher.rank_output import describe_exit, exit_summary
from ..launcher.torchrun import LaunchResult, run_torchrun
from .args import DEFAULT_NPROC, MAX_NPROC, parse_line, positive_seconds, rank_count, restart_count
from .cell_end import CellEnd, finish
from .display import run_live

__all__ = ["DEFAULT_TIMEOUT_S", "TorchrunMagics", "cell_end"]

DEFAULT_TIMEOUT_S = 120.0


def _failure_message(result: LaunchResult, timeout_s: float, first: int | None) -> str:
    if result.timed_out:
        stuck = ", ".join(map(str, result.unfinished)) or "none"
        message = f"deadline of {timeout_s:g} s passed; ranks still running: {stuck}"
        if result.not_started:
            message += f"; not started yet: {', '.join(map(str, result.not_started))}"
        return message + "; every process of this cell was killed"
    if result.failed:
        last_line = next((ln for ln in reversed(result.stderr.get(first, "").splitlines()) if ln.strip()), "")
        why = f": {last_line.strip()}" if last_line else ""
        code = result.exit_codes[first]
        how = f"exit code {code}" if code >= 0 else f"signal {describe_exit(code)}"
        return f"rank {first} failed with {how}{why}"
    detail = result.agent_output.strip().splitlines()[-1:] or ["no output"]
    return f"torchrun exited with code {result.agent_exit_code}: {detail[0]}"


def _where_each_rank(result: LaunchResult) -> list[str]:
    """After an interrupt, one line per rank: "rank 2: starting up (importing torch at cell line 2)"."""
    lines = []
    for rank in range(result.nproc):
        if rank in result.not_started:
            where = "not started yet"
        elif rank in result.unfinished:
            where = rank_where(result.ledgers.get(rank, []), result.stacks.get(rank))
        else:
            code = result.exit_codes.get(rank)
            where = "had finished" if code == 0 else f"had failed ({describe_exit(code)})"
        lines.append(f"rank {rank}: {where}")
    return lines


def cell_end(result: LaunchResult, timeout_s: float) -> CellEnd:
    """How a launch ends as a cell: the failing rank's stderr first and, unless every rank exited 0,
    every rank's exit, whose errors follow from another rank's exit, and why the cell failed."""
    first = result.root_cause
    if result.failed and not (result.timed_out or result.interrupted):
        first = first_failure(result.exit_codes, result.stderr, result.root_cause)
    end = CellEnd(result.stdout, result.stderr, result.results, result.ledgers, all_well="every rank exited 0",
                  first=first, diagnosis=result.diagnosis, stacks=result.stacks,
                  earlier_attempts=result.earlier_attempts)
    if result.ok:
        return end
    if result.interrupted:
        # Stop was pressed on purpose: where each rank was replaces the exits and the stuck ranks' lines.
        end.diagnosis = []
        end.interrupted = "interrupted; every process of this cell was killed. Where each rank was:"
        end.where = _where_each_rank(result)
        return end
    end.exit_line = exit_summary(result.exit_codes, result.not_started)
    failed_errors = {r: result.stderr.get(r, "") for r in result.failed}
    gone = ended_first(result.exit_codes, failed_errors, result.ledgers, first)
    end.consequences = consequences(failed_errors, gone, result.ledgers)
    end.failure = _failure_message(result, timeout_s, first)
    return end


@magics_class
class TorchrunMagics(Magics):
    @magic_arguments("%torchrun")  # the usage line then reads "%%torchrun ..."
    @argument("-n", "--nproc", "--nproc-per-node", type=rank_count, default=DEFAULT_NPROC, metavar="N",
              help=f"number of ranks, 1 to {MAX_NPROC} (default {DEFAULT_NPROC})")
    @argument("--backend", choices=BACKEND_CHOICES, default="auto",
              help="auto (default): nccl when this machine has a GPU per rank, else gloo on CPU")
    @argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
              help=f"deadline, counted from when every rank's process group is up: then every process of "
                   f"the cell is killed (default {DEFAULT_TIMEOUT_S:g})")
    @argument("--max-restarts", type=restart_count, default=0, metavar="K",
              help="torchrun restarts every rank after one fails, at most K times (default 0); "
                   "the deadline covers every attempt")
    # For lessons that demonstrate a failure: report it without raising, so
    # "Run All" goes on; a run that unexpectedly succeeds raises instead.
    @argument("--expect-failure", action="store_true",
              help="the cell is meant to fail: say so without an error; raise if every rank exits 0")
    @line_cell_magic
    def torchrun(self, line: str, cell: str | None = None):
        """Run this cell as a script on N ranks with real torchrun.

        The first line names world size, backend, device and why; the ranks'
        output then shows live, and after the run in rank order. A failed,
        timed-out or interrupted run says which ranks did what.
        """
        if cell is None:
            raise UsageError("%torchrun is a cell magic: put %%torchrun -n 2 on the first line of a cell")
        args = parse_line(TorchrunMagics.torchrun, line, "%%torchrun")
        if not cell.strip():
            raise UsageError("%%torchrun: the cell is empty; write the script each rank runs below the magic line")
        try:
            compile(cell, "<cell>", "exec")
        except SyntaxError as exc:
            # +1: the learner counts the %%torchrun line as line 1 of the cell.
            raise UsageError(f"%%torchrun: the cell does not parse: line {(exc.lineno or 0) + 1}: {exc.msg}") from None
        try:
            choice = choose_backend(args.nproc, args.backend)  # decided here once, passed down as is
        except BackendError as exc:
            raise UsageError(f"%%torchrun: {exc}") from None

        result = run_live(choice.header(args.nproc), functools.partial(
            run_torchrun,
            cell,
            args.nproc,
            backend=choice,
            timeout_s=args.timeout,
            max_restarts=args.max_restarts,
            first_line=f"%%torchrun {line.strip()}".strip(),  # tracebacks then count lines as the cell does
        ))
        finish(cell_end(result, args.timeout), expect_failure=args.expect_failure)

"""The `%%torchrun` cell magic: run the cell as a script on N real ranks.

    %load_ext course_lib
    %%torchrun -n 2 [--backend auto|gloo|nccl] [--timeout SECONDS] [--expect-failure]

The first output line names world size, backend, device and why; rank output
appears live while the cell runs, then as rank-ordered `[rank N]` blocks
(stdout, then stderr) that are the same on every run, so nbval can compare
them. Bad input raises a one-line `UsageError`; a failed, timed-out or
interrupted run says which ranks did what.
"""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..backend_choice import BACKEND_CHOICES, BackendError, choose_backend
from ..launcher.rank_output import describe_exit, exit_summary
from ..launcher.torchrun import LaunchResult, run_torchrun
from ..results import ledgers, results
from .args import MagicParser, RankFailure, parse_line, positive_seconds, rank_count
from .display import LiveView, print_diagnosis, print_rank_blocks

__all__ = ["RankFailure", "TorchrunMagics", "last_result", "parse_torchrun_args", "report"]

DEFAULT_TIMEOUT_S = 120.0


def _make_parser() -> MagicParser:
    parser = MagicParser(prog="%%torchrun", add_help=False)
    parser.add_argument("-n", "--nproc", "--nproc-per-node", type=rank_count, default=2)
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")
    parser.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT_S)
    # For lessons that demonstrate a failure: report it without raising, so
    # "Run All" goes on; a run that unexpectedly succeeds raises instead.
    parser.add_argument("--expect-failure", action="store_true")
    return parser


def parse_torchrun_args(line: str) -> argparse.Namespace:
    """Parse the magic's line; raise a one-line UsageError on bad input."""
    return parse_line(_make_parser(), line)


def _failure_message(result: LaunchResult, timeout_s: float) -> str:
    if result.timed_out:
        stuck = ", ".join(map(str, result.unfinished)) or "none"
        message = f"deadline of {timeout_s:g} s passed; ranks still running: {stuck}"
        if result.not_started:
            message += f"; not started yet: {', '.join(map(str, result.not_started))}"
        return message + "; every process of this cell was killed"
    if result.failed:
        first = result.root_cause if result.root_cause is not None else result.failed[0]
        last_line = next((ln for ln in reversed(result.stderr.get(first, "").splitlines()) if ln.strip()), "")
        why = f": {last_line.strip()}" if last_line else ""
        code = result.exit_codes[first]
        how = f"exit code {code}" if code >= 0 else f"signal {describe_exit(code)}"
        return f"rank {first} failed with {how}{why}"
    detail = result.agent_output.strip().splitlines()[-1:] or ["no output"]
    return f"torchrun exited with code {result.agent_exit_code}: {detail[0]}"


def report(result: LaunchResult) -> None:
    """Print rank-ordered output (the failing rank's stderr first) and, on failure, every rank's exit
    and, for ranks stuck at a deadline or interrupt, where they were."""
    print_rank_blocks(result.stdout, result.stderr, first=result.root_cause)
    if not result.ok:
        print(exit_summary(result.exit_codes, result.not_started))
    print_diagnosis(result.diagnosis, result.stacks)


@magics_class
class TorchrunMagics(Magics):
    @line_cell_magic
    def torchrun(self, line: str, cell: str | None = None):
        """Run this cell as a script on N ranks with real torchrun (see module docstring)."""
        if cell is None:
            raise UsageError("%torchrun is a cell magic: put %%torchrun -n 2 on the first line of a cell")
        args = parse_torchrun_args(line)
        if not cell.strip():
            raise UsageError("%%torchrun: the cell is empty; write the script each rank runs below the magic line")
        try:
            compile(cell, "<cell>", "exec")
        except SyntaxError as exc:
            # +1: the learner counts the %%torchrun line as line 1 of the cell.
            raise UsageError(f"%%torchrun: the cell does not parse: line {(exc.lineno or 0) + 1}: {exc.msg}") from None
        try:
            choice = choose_backend(args.nproc, args.backend)
        except BackendError as exc:
            raise UsageError(f"%%torchrun: {exc}") from None

        print(choice.header(args.nproc), flush=True)
        live = LiveView()
        try:
            result = run_torchrun(
                cell,
                args.nproc,
                backend=args.backend,
                timeout_s=args.timeout,
                on_output=live.add,
                on_poll=live.refresh,
                first_line=f"%%torchrun {line.strip()}".strip(),  # tracebacks then count lines as the cell does
            )
        finally:
            live.close()
        results.update(result.results)
        ledgers.clear()
        ledgers.update(result.ledgers)
        global _last_result
        _last_result = result
        report(result)
        if result.interrupted:
            running = ", ".join(map(str, result.unfinished)) or "none"
            print(f"interrupted; ranks still running were killed: {running}")
            raise KeyboardInterrupt
        if result.ok and args.expect_failure:
            raise RankFailure("--expect-failure was given, but every rank exited 0")
        if not result.ok:
            if args.expect_failure:
                print(f"as expected, {_failure_message(result, args.timeout)}")
            else:
                raise RankFailure(_failure_message(result, args.timeout))


_last_result: LaunchResult | None = None


def last_result() -> LaunchResult | None:
    """The LaunchResult of the most recent %%torchrun cell in this kernel (for tests and graders)."""
    return _last_result

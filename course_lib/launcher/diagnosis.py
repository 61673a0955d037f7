"""Say which rank is stuck where, from the ranks' collective ledgers and Python stacks.

At a deadline the kernel asks each stuck rank for its stack (SIGUSR1, which
`rank.instrument()` tied to faulthandler), reads every rank's ledger, and
turns them into lines such as

    ranks 0, 2, 3 are waiting in all_reduce #7 (4 KiB, world group)
    rank 1 last completed broadcast #6 (world group) and is running Python at cell line 12
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import time

from ..rank import ledger
from ..rank.contract import CELL_LABEL, SCRIPT_NAME, ledger_file, stacks_file
from ..units import binary_bytes
from . import pool_worker
from .rank_output import ranks_phrase

__all__ = ["cell_line", "collect", "describe_stuck"]

STACK_WAIT_S = 0.5  # time for faulthandler to write the stacks after SIGUSR1


def _module_path(module) -> str:
    """`course_lib/rank/ledger.py` for course_lib.rank.ledger: how its frames end, wherever it is installed."""
    return "/".join(module.__name__.split(".")) + ".py"


# Frames that are this library's, not the learner's: the ledger's wrapper, the pool worker's loop, runpy.
_OURS = re.compile(r'File "(?:[^"]*/(?:%s)|<frozen runpy>)"' % "|".join(
    re.escape(_module_path(m)) for m in (ledger, pool_worker)))
_CELL_FRAME = re.compile(r'File "(?:%s|[^"]*%s)", line (\d+)' % (re.escape(CELL_LABEL), re.escape(SCRIPT_NAME)))


def collect(results_dir: pathlib.Path, nproc: int, stuck_pids: dict[int, int]) -> tuple[dict, dict]:
    """({rank: ledger entries}, {rank: stack text}); asks the stuck ranks for their stacks first.

    Only instrumented ranks (see `course_lib.rank.instrument`) have a stack; the others are left out.
    """
    if hasattr(signal, "SIGUSR1"):
        for pid in stuck_pids.values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if stuck_pids:
            time.sleep(STACK_WAIT_S)
    ledgers = {r: ledger.read_ledger(str(results_dir / ledger_file(r))) for r in range(nproc)}
    stacks = {}
    for rank in stuck_pids:
        path = results_dir / stacks_file(rank)
        if not path.exists():
            continue  # this rank never called rank.instrument() (e.g. no cl.init()): nothing to say
        text = path.read_text(errors="replace")
        # Frames of this library (the ledger's wrapper, the worker's loop, runpy) are not the
        # learner's: leave them out, and the thread's address, which changes every run.
        kept = [ln for ln in text.splitlines(keepends=True) if not _OURS.search(ln)]
        stacks[rank] = re.sub(r"(Current thread|Thread) 0x[0-9a-f]+", r"\1", "".join(kept))
    return ledgers, stacks


def cell_line(stack: str) -> int | None:
    """The innermost cell line of the main thread in a faulthandler dump (most recent call first)."""
    main = stack.split("Current thread", 1)[-1] if "Current thread" in stack else stack
    match = _CELL_FRAME.search(main)
    return int(match.group(1)) if match else None


def _what(entry: dict) -> str:
    size = f"{binary_bytes(entry['bytes'])}, " if entry.get("bytes") else ""
    return f"{entry['op']} #{entry['seq']} ({size}{entry['group']} group)"


def _state(ledger: list[dict], stack: str) -> str:
    """What one rank is doing; "{be}" stands for "is" or "are"."""
    waiting = [e for e in ledger if e["end"] is None and not e["async"]]
    if waiting:
        return f"{{be}} waiting in {_what(waiting[-1])}"
    line = cell_line(stack)
    where = f"running Python at cell line {line}" if line is not None else "running Python"
    if ledger and ledger[-1].get("error"):
        return f"{{be}} {where}, after {_what(ledger[-1])} raised {ledger[-1]['error']}"
    done = [e for e in ledger if e["end"] is not None]
    if done:
        return f"last completed {_what(done[-1])} and {{be}} {where}"
    return f"{{be}} {where}, before any collective"


def describe_stuck(ledgers: dict[int, list[dict]], stacks: dict[int, str]) -> list[str]:
    """One line per state shared by stuck ranks, e.g. "ranks 0, 2 are waiting in all_reduce #7 (...)".

    `stacks` names the stuck ranks; a rank's cell line is counted as the learner
    sees it (the magic line is line 1: both launchers number the script so).
    """
    by_state: dict[str, list[int]] = {}
    for rank in sorted(stacks):
        by_state.setdefault(_state(ledgers.get(rank, []), stacks[rank]), []).append(rank)
    lines = []
    for state, ranks in by_state.items():
        lines.append(f"{ranks_phrase(ranks)} {state.format(be='is' if len(ranks) == 1 else 'are')}")
    return lines

"""How a multi-rank cell ends, the same for `%%torchrun` and `%%dist`.

Each magic turns its launcher's result into a `CellEnd` (what differs: which
rank failed first, its failure sentence, its interrupt line); `finish` then
updates `cl.results` and `cl.ledgers` (marked stale after an interrupt: course_lib/results.py), prints the ranks' output in rank order,
and raises or not: CellInterrupted (a KeyboardInterrupt shown as one line) after
an interrupt, RankFailure after a failure unless `--expect-failure` was given,
RankFailure after a success if it was. A failure the cell expects (`--expect-failure`) whose other ranks
only lost their peer shows the course's one-line explanation first, those ranks' tracebacks cut to their
last line (`rank_output.cut_traceback`).

An interrupt is the learner's own doing: the cell says in one line per rank
where each was, and leaves the ranks' Python stacks in a file it names
(a deadline or a hang prints them: there they are the evidence).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..launcher.diagnosis import lost_peer
from ..launcher.rank_output import cut_traceback
from ..results import mark_stale, record_run
from .args import CellInterrupted, RankFailure
from .display import print_diagnosis, print_rank_blocks, save_stacks

__all__ = ["CellEnd", "finish"]


@dataclasses.dataclass
class CellEnd:
    stdout: dict[int, str]  # rank -> what it printed
    stderr: dict[int, str]  # rank -> what it wrote to stderr, its traceback included
    published: dict[str, dict[int, Any]]  # cl.publish(name, value): name -> {rank: value}
    ledgers: dict[int, list[dict]]  # rank -> its collectives so far (rank/ledger.py)
    all_well: str  # how success reads after "--expect-failure was given, but "
    first: int | None = None  # the rank that failed first: its stderr comes first
    exit_line: str | None = None  # "exit: ..." for each rank, after a failed launch
    consequences: list[str] = dataclasses.field(default_factory=list)  # errors that follow from a peer's exit
    diagnosis: list[str] = dataclasses.field(default_factory=list)  # who was stuck where
    stacks: dict[int, str] = dataclasses.field(default_factory=dict)  # stuck ranks' Python stacks
    interrupted: str | None = None  # the line printed before CellInterrupted; None: not interrupted
    where: list[str] = dataclasses.field(default_factory=list)  # after an interrupt: "rank 0: at cell line 3, ..."
    failure: str | None = None  # why the cell failed, one sentence; None: it did not
    # Attempts torchrun restarted after (--max-restarts): (how it ended, {rank: stdout}), shown first.
    earlier_attempts: list[tuple[str, dict[int, str]]] = dataclasses.field(default_factory=list)


def finish(end: CellEnd, *, expect_failure: bool) -> None:
    """Record what the ranks sent back, show what they wrote, then raise as the cell ended (see module docstring)."""
    # A run a reveal may measure: not interrupted, and either all well or failing as the cell expects (its
    # ledger says where it failed: lessons read it). A run that failed unexpectedly may have published from
    # some ranks only (a rank lost at init), so its names are left without a record, like an interrupted run's.
    measurable = end.interrupted is None and (end.failure is None or expect_failure)
    record_run(end.published, end.ledgers, finished=measurable)
    mark_stale("was interrupted before its ranks finished" if end.interrupted is not None else None)
    for ended, stdout in end.earlier_attempts:
        print_rank_blocks(stdout, {})
        print(ended)
    stderr, explained = end.stderr, []
    if expect_failure and end.consequences:
        # The failure is the lesson's point: the explanation first, the peers' "connection closed" walls cut.
        stderr = {r: cut_traceback(text) if r != end.first and lost_peer(text) else text for r, text in stderr.items()}
        explained = end.consequences
    print_rank_blocks(end.stdout, {})
    for line in explained:
        print(line, flush=True)  # before the ranks' stderr, which is written unbuffered
    print_rank_blocks({}, stderr, first=end.first)
    if end.exit_line is not None:
        print(end.exit_line)
    for line in end.consequences:
        if line not in explained:
            print(line)
    if end.interrupted is not None:
        print_diagnosis(end.diagnosis, {})
        print(end.interrupted)
        for line in end.where:
            print(line)
        saved = save_stacks(end.stacks)
        if saved is not None:
            print(f"(the ranks' Python stacks, for whoever debugs the course: {saved})")
        raise CellInterrupted
    print_diagnosis(end.diagnosis, end.stacks)
    if end.failure is None:
        if expect_failure:
            raise RankFailure(f"--expect-failure was given, but {end.all_well}")
    elif expect_failure:
        print(f"as expected, {end.failure}")
    else:
        raise RankFailure(end.failure)

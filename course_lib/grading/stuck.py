"""Who waits where when a check's run passes its deadline, in the learner's terms.

The ledger records every collective a grading rank makes, the checker's own
included: the barrier before the learner's function runs, the barrier after
it (rank_runner.py, step 6) and a driver's collectives on what the function
returned (drivers.process_groups). Each rank's phase file says when it entered
and left the learner's function, so each collective can be put down to the
learner or to the checker, and a line says which:

    rank 1 finished your function and waits in the checker's barrier (world group)
    rank 0 is still in your function: it is waiting in recv #1 (40 B, world group)

The learner's calls are numbered among the learner's own (the checker's
barrier before them is not their #1).
"""

from __future__ import annotations

import pathlib

from ..launcher.diagnosis import lines_by_state, rank_state
from .rank_runner import PHASES, phase_file

__all__ = ["describe_check_hang", "read_phases"]


def read_phases(job_dir: pathlib.Path, ranks: list[int]) -> dict[int, list[tuple[float, str]]]:
    """{rank: [(time.monotonic(), phase), ...]} from the ranks' phase files in a run's folder."""
    phases: dict[int, list[tuple[float, str]]] = {}
    for rank in ranks:
        try:
            text = (job_dir / phase_file(rank)).read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        marks = []
        for line in text.splitlines():
            at, _, phase = line.partition(" ")
            try:
                marks.append((float(at), phase))
            except ValueError:  # a line cut short by a kill, or the learner's writing
                continue
        phases[rank] = [(at, phase) for at, phase in marks if phase in PHASES]
    return phases


def _phase_at(marks: list[tuple[float, str]], when: float) -> str:
    """The phase a rank was in at `when` ("before" until its first mark)."""
    phase = "before"
    for at, name in marks:
        if at > when:
            break
        phase = name
    return phase


def _learners(ledger: list[dict], marks: list[tuple[float, str]]) -> list[dict]:
    """The entries made inside the learner's function, numbered among themselves per group."""
    seqs: dict[str, int] = {}
    kept = []
    for entry in ledger:
        if _phase_at(marks, entry["start"]) == "function":
            seqs[entry["group"]] = seqs.get(entry["group"], 0) + 1
            kept.append({**entry, "seq": seqs[entry["group"]]})
    return kept


def _state(ledger: list[dict], stack: str, marks: list[tuple[float, str]]) -> str:
    """One rank's line after its rank(s): "{be}" for is/are, "{it}" for it/they, "{waits}" for waits/wait."""
    phase = marks[-1][1] if marks else "before"
    if phase == "function":
        return "{be} still in your function: {it} " + rank_state(_learners(ledger, marks), stack)
    waiting = [e for e in ledger if e["end"] is None and not e["async"]]
    if waiting:
        where = f"{{waits}} in the checker's {waiting[-1]['op']} ({waiting[-1]['group']} group)"
    else:
        where = "{be} in the checker's code"
    if phase == "before":
        return f"{where}, before your function runs"
    return f"finished your function and {where}"


def describe_check_hang(ledgers: dict[int, list[dict]], stacks: dict[int, str],
                        phases: dict[int, list[tuple[float, str]]]) -> list[str]:
    """One line per state shared by the stuck ranks (the keys of `phases`), lowest rank first."""
    return lines_by_state({rank: _state(ledgers.get(rank, []), stacks.get(rank, ""), phases[rank]) for rank in phases})

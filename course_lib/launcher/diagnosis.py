"""Say which rank is stuck where, and which rank's error only follows from another rank's exit.

At a deadline the kernel asks each stuck rank for its stack (SIGUSR1, which
`rank.instrument()` tied to faulthandler), reads every rank's ledger, and
turns them into lines such as

    ranks 0, 2, 3 are waiting in all_reduce #7 (4 KiB, world group)
    rank 1 last completed broadcast #6 (world group) and is running Python at cell line 12

A rank still importing before its first collective is "still starting up", not stuck.
After an interrupt (the learner's Stop) `rank_where` gives one rank's place instead:

    starting up (importing torch at cell line 2)
    at cell line 12, waiting in all_reduce #7 (4 KiB, world group)

When a rank exits early, its peers' next collective fails with the backend's
raw words ("Connection closed by peer"). `first_failure` names the rank to
blame and `consequences` says that the others' errors follow from it:

    rank 0's error is a consequence of rank 1 exiting first: its all_reduce #1 (8 B, world group) found a peer
    gone ("Connection closed by peer")
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import time

from ..rank import ledger, rehearsal
from ..rank.contract import CELL_LABEL, SCRIPT_NAME, ledger_file, stacks_file
from ..units import binary_bytes
from . import pool_worker
from .rank_output import ranks_phrase, short_frames

__all__ = ["STARTING_UP", "cell_line", "collect", "consequences", "describe_stuck", "ended_first", "first_failure",
           "importing", "lines_by_state", "lost_peer", "rank_state", "rank_where"]

STACK_WAIT_S = 0.5  # time for faulthandler to write the stacks after SIGUSR1


def _module_path(module) -> str:
    """`course_lib/rank/ledger.py` for course_lib.rank.ledger: how its frames end, wherever it is installed."""
    return "/".join(module.__name__.split(".")) + ".py"


# Frames that are this library's, not the learner's: the ledger's wrapper, the pool worker's loop, runpy.
_OURS = re.compile(r'File "(?:(?:[^"]*/)?(?:%s)|<frozen runpy>)"' % "|".join(
    re.escape(_module_path(m)) for m in (ledger, pool_worker, rehearsal)))
_CELL_FRAME = re.compile(r'File "(?:%s|[^"]*%s)", line (\d+)' % (re.escape(CELL_LABEL), re.escape(SCRIPT_NAME)))


def collect(results_dir: pathlib.Path, nproc: int, stuck_pids: dict[int, int],
            attempt: int = 0) -> tuple[dict, dict]:
    """({rank: ledger entries}, {rank: stack text}); asks the stuck ranks for their stacks first.

    Only instrumented ranks (see `course_lib.rank.instrument`) have a stack; the others are left out.
    `attempt`: whose ledgers, after torchrun restarted the ranks (the running attempt's).
    """
    if hasattr(signal, "SIGUSR1"):
        for pid in stuck_pids.values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if stuck_pids:
            time.sleep(STACK_WAIT_S)
    ledgers = {r: ledger.read_ledger(str(results_dir / ledger_file(r, attempt))) for r in range(nproc)}
    stacks = {}
    for rank in stuck_pids:
        path = results_dir / stacks_file(rank)
        if not path.exists():
            continue  # this rank never called rank.instrument() (e.g. no cl.init()): nothing to say
        text = path.read_text(errors="replace")
        # Frames of this library (the ledger's wrapper, the worker's loop, runpy) are not the
        # learner's: leave them out, and the thread's address, which changes every run.
        kept = [ln for ln in text.splitlines(keepends=True) if not _OURS.search(ln)]
        stacks[rank] = short_frames(re.sub(r"(Current thread|Thread) 0x[0-9a-f]+", r"\1", "".join(kept)))
    return ledgers, stacks


def _main_thread(stack: str) -> str:
    return stack.split("Current thread", 1)[-1] if "Current thread" in stack else stack


# A grader's driver that wraps torch's Work.wait (C++, no frame of its own) in Python: lessons' drivers.py.
_INNERMOST_WAIT = re.compile(r'File "[^"]*/grading/lessons/lesson\d+/drivers\.py", line \d+ in wait\n')


def _in_wait(stack: str) -> bool:
    """The main thread's innermost frame is a grader driver's wrapper of torch's Work.wait (not any Python
    function named wait, such as threading's)."""
    frames = _main_thread(stack).split("(most recent call first):", 1)[-1].lstrip("\n")
    return bool(_INNERMOST_WAIT.match(frames.lstrip()))


def cell_line(stack: str) -> int | None:
    """The innermost cell line of the main thread in a faulthandler dump (most recent call first)."""
    match = _CELL_FRAME.search(_main_thread(stack))
    return int(match.group(1)) if match else None


_IMPORT_FRAME = re.compile(r'File "<frozen importlib\._bootstrap')
_MODULE_FRAME = re.compile(r'File "([^"<>]+)\.py", line \d+ in <module>')


def _module_name(path: str) -> str:
    """`torch` for torch/__init__.py, `numpy.lib` for numpy/lib/__init__.py (frames named by short_frames),
    `helpers` for /any/folder/helpers.py."""
    path = path.removesuffix("/__init__")
    return path.rsplit("/", 1)[-1] if path.startswith("/") else path.replace("/", ".")


def importing(stack: str) -> str | None:
    """The module the innermost cell line is importing, e.g. "torch" ("" before Python has found its file);
    None when that line is not running an import."""
    frames = _main_thread(stack).splitlines()
    at = next((i for i, line in enumerate(frames) if _CELL_FRAME.search(line)), None)
    if not at or not _IMPORT_FRAME.search(frames[at - 1]):  # what the cell line called: the import machinery
        return None
    # The outermost module being executed above the cell's frame is the one the cell line names.
    outer = (_MODULE_FRAME.search(line) for line in reversed(frames[:at]))
    return next((_module_name(m.group(1)) for m in outer if m), "")


def _importing_at(module: str, line: int | None) -> str:
    return f"importing {module or 'a module'}" + (f" at cell line {line}" if line is not None else "")


def _what(entry: dict) -> str:
    size = f"{binary_bytes(entry['bytes'])}, " if entry.get("bytes") else ""
    return f"{entry['op']} #{entry['seq']} ({size}{entry['group']} group)"


STARTING_UP = "still starting up"  # a rank importing before its first collective: not stuck, only slow


def rank_state(ledger: list[dict], stack: str) -> str:
    """What one rank is doing, "{be}" standing for "is" or "are": "{be} waiting in recv #2 (4 B, world group)"."""
    waiting = [e for e in ledger if e["end"] is None and not e["async"]]
    if waiting:
        return f"{{be}} waiting in {_what(waiting[-1])}"
    line = cell_line(stack)
    module = importing(stack)
    if module is not None and not ledger:
        return f"{{be}} {STARTING_UP} ({_importing_at(module, line)})"
    where = f"running Python at cell line {line}" if line is not None else "running Python"
    posted = [e for e in ledger if e["end"] is not None and e["async"]]
    if posted and _in_wait(stack):  # a grader's driver wraps Work.wait in Python (lesson 09): its frame shows
        at = f" at cell line {line}" if line is not None else ""
        return f"{{be}} waiting in wait(){at}, on a transfer posted by {_what(posted[-1])} or earlier"
    if module is not None:
        where = _importing_at(module, line)
    if ledger and ledger[-1].get("error"):
        return f"{{be}} {where}, after {_what(ledger[-1])} raised {ledger[-1]['error']}"
    done = [e for e in ledger if e["end"] is not None]
    if done:
        return f"last completed {_what(done[-1])} and {{be}} {where}"
    return f"{{be}} {where}, before any collective"


def rank_where(ledger: list[dict], stack: str | None) -> str:
    """Where one rank was when its cell was interrupted, e.g. "at cell line 12, waiting in all_reduce #3 (world
    group)" or "starting up (importing torch at cell line 2)"; `stack` None: the rank had no stack to give."""
    stack = stack or ""
    if not stack.strip() and not ledger:
        return "starting up (before the cell's first line)"
    line = cell_line(stack)
    module = importing(stack)
    if module is not None and not ledger:
        return f"starting up ({_importing_at(module, line)})"
    if line is not None:
        at = f"at cell line {line}"
    else:
        at = "outside the cell (before its first line or after its last)" if stack.strip() else "at a line unknown"
    waiting = [e for e in ledger if e["end"] is None and not e["async"]]
    if waiting:
        return f"{at}, waiting in {_what(waiting[-1])}"
    doing = f", importing {module or 'a module'}" if module is not None else ""
    if ledger and ledger[-1].get("error"):
        return f"{at}{doing}, after {_what(ledger[-1])} raised {ledger[-1]['error']}"
    done = [e for e in ledger if e["end"] is not None]
    return f"{at}{doing}, " + (f"after {_what(done[-1])}" if done else "before any collective")


def describe_stuck(ledgers: dict[int, list[dict]], stacks: dict[int, str]) -> list[str]:
    """One line per state shared by stuck ranks, e.g. "ranks 0, 2 are waiting in all_reduce #7 (...)".

    `stacks` names the stuck ranks; a rank's cell line is counted as the learner
    sees it (the magic line is line 1: both launchers number the script so).
    """
    return lines_by_state({rank: rank_state(ledgers.get(rank, []), stacks[rank]) for rank in stacks})


def lines_by_state(states: dict[int, str]) -> list[str]:
    """One line per state shared by ranks, lowest rank first: "ranks 0, 2 are waiting in ...".

    A state's "{be}", "{it}" and "{waits}" become "is"/"are", "it"/"they", "waits"/"wait".
    """
    by_state: dict[str, list[int]] = {}
    for rank in sorted(states):
        by_state.setdefault(states[rank], []).append(rank)
    lines = []
    for state, ranks in by_state.items():
        one = len(ranks) == 1
        words = {"be": "is" if one else "are", "it": "it" if one else "they", "waits": "waits" if one else "wait"}
        lines.append(f"{ranks_phrase(ranks)} {state.format(**words)}")
    return lines


# What a rank's error says when a peer it was talking to had already exited: gloo's TCP pair
# ("Connection closed by peer" on reading; reset or broken pipe on writing) and NCCL.
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|"
                        r"remote process exited or there was a network error")


def lost_peer(text: str) -> str | None:
    """The words in a rank's error output that say a peer had gone, e.g. "Connection closed by peer"; else None."""
    match = _PEER_GONE.search(text)
    return match.group(0) if match else None


def _own_error(rank: int, exit_codes: dict[int, int | None], errors: dict[int, str]) -> bool:
    """Whether `rank` failed of its own accord: not with a "peer gone" error, and, if torchrun ended
    it (SIGTERM, sent to every rank after the first failure), only if it had printed a traceback."""
    text = errors.get(rank, "")
    if exit_codes.get(rank) in (0, None) or lost_peer(text):
        return False
    return exit_codes[rank] != -signal.SIGTERM or "Traceback (most recent call last)" in text


def first_failure(exit_codes: dict[int, int | None], errors: dict[int, str], reported: int | None) -> int | None:
    """The failed rank to name first: `reported` (torchrun's root cause), unless another rank
    failed of its own accord and `reported` did not (see `_own_error`).

    torchrun compares failure times in whole seconds and, on a tie, names the
    lowest rank; and a rank that raised can be ended by torchrun's SIGTERM while
    it exits, after its peer's "Connection closed by peer" was counted as the
    first failure. Either way the peer is named before the rank that caused it.
    """
    failed = sorted(r for r, code in exit_codes.items() if code not in (0, None))
    causes = [r for r in failed if _own_error(r, exit_codes, errors)]
    if reported is not None and (reported in causes or not causes):
        return reported
    return causes[0] if causes else (failed[0] if failed else None)


def _failed_call(ledger: list[dict]) -> dict | None:
    failed = [e for e in ledger if e.get("error")]
    return failed[-1] if failed else None


def _never_joined(rank: int, call: dict, ledgers: dict[int, list[dict]]) -> bool:
    """Whether `rank` is a member of `call`'s group and has no entry for it (same group, same seq)."""
    group = call["group"]
    if group.startswith("ranks ") and str(rank) not in group[len("ranks "):].split(","):
        return False
    return not any(e["group"] == group and e["seq"] == call["seq"] for e in ledgers.get(rank, []))


def ended_first(exit_codes: dict[int, int | None], errors: dict[int, str], ledgers: dict[int, list[dict]],
                first: int | None) -> list[int]:
    """The ranks whose exit the others' "peer gone" errors follow from.

    The first failure, if it failed of its own accord. Else the ranks that
    ended without an error of their own (exit 0, or SIGTERM from torchrun while
    they were exiting) and never joined the collective that failed, by the
    ledgers; without a ledger, the ranks that exited 0.
    """
    if first is not None and _own_error(first, exit_codes, errors):
        return [first]
    lost = [r for r in errors if lost_peer(errors[r])]
    quiet = [r for r, code in sorted(exit_codes.items()) if code in (0, -signal.SIGTERM) and r not in lost]
    gone: set[int] = set()
    for rank in lost:
        call = _failed_call(ledgers.get(rank, []))
        if call is None:
            gone.update(r for r in quiet if exit_codes[r] == 0)
        else:
            gone.update(r for r in quiet if _never_joined(r, call, ledgers))
    return sorted(gone)


def consequences(errors: dict[int, str], gone: list[int], ledgers: dict[int, list[dict]]) -> list[str]:
    """One line per rank whose error says a peer had gone, naming the ranks `gone` that ended first; [] if none.

    `errors` holds the failed ranks' error output; `ledgers` their collectives, to name the one that failed.
    """
    if not gone:
        return []
    lines = []
    for rank in sorted(errors):
        words = lost_peer(errors[rank])
        if rank in gone or words is None:
            continue
        call = _failed_call(ledgers.get(rank, []))
        what = f"its {_what(call)}" if call else "it"
        lines.append(f"rank {rank}'s error is a consequence of {ranks_phrase(gone)} exiting first: "
                     f'{what} found a peer gone ("{words}")')
    return lines

"""Run an exercise's checks on a learner's cell: real ranks, then judged in this process.

`check_exercise(exercise, source)` gives each of the exercise's runs to a set of
grading ranks (rank_set.py: real processes, a gloo group per run, its own
deadline; one set serves every run of a submission), loads what the
ranks sent back (`torch.load(weights_only=True)`: data only, never the
learner's objects), splits each rank's collective ledger by case, and lets
every item's judge compare against the reference it computes here. A run
that hangs, crashes or exits early scores 0 on each of its items, with a
reason naming the rank; the next run goes on.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import signal
import tempfile

from ..launcher.torchrun import LaunchResult
from .cells import is_stub_error
from .rank_runner import CASE_MARK, EXIT_NO_FUNCTION, phase_file
from .rank_server import RankServer
from .rank_set import RankSet
from ..units import binary_bytes
from .spec import CaseResult, Exercise, ItemResult, Limits, RunOutcome, RunSpec

__all__ = ["check_exercise", "not_written_yet", "preload_for", "rank_set_for", "submission_source"]

DID_NOT_FINISH = "did not finish within"  # how a run stopped at its deadline is reported
MAX_OUTPUT_CHARS = 2000  # of a rank's own prints kept in a report (Gradescope shows it)


def submission_source(cell_source: str) -> str:
    """A `%%exercise` cell as a module: the magic line becomes a comment, keeping line numbers."""
    first, _, rest = cell_source.partition("\n")
    if first.lstrip().startswith("%%"):
        first = "# " + first
    return f"{first}\n{rest}"


def preload_for(exercises) -> tuple[str, ...]:
    """The modules a rank server should import for `exercises` (the union of their `preload`), sorted."""
    return tuple(sorted({name for found in exercises for name in found.preload}))


def rank_set_for(exercises: list[Exercise], limits: Limits = Limits(), server: RankServer | None = None) -> RankSet:
    """A set of ranks big enough for every run of `exercises`, its CPU budget the sum of their deadlines.

    `server`: the rank server to fork them from (the grader shares one); by default the set starts its
    own, which imports what the exercises preload.
    """
    runs = [run for found in exercises for run in found.runs]
    return RankSet(max((run.nproc for run in runs), default=1), limits,
                   cpu_s=sum(limits.run_timeout_s or run.timeout_s for run in runs), server=server,
                   preload=preload_for(exercises))


def check_exercise(exercise: Exercise, cell_source: str, *, limits: Limits = Limits(),
                   on_item=None, ranks: RankSet | None = None) -> list[ItemResult]:
    """Every item of every run of `exercise` on the learner's cell, in order.

    `ranks`: a set to run in (the grader passes one per submission); by default one for this exercise.
    """
    if ranks is None:
        with rank_set_for([exercise], limits) as own:
            return check_exercise(exercise, cell_source, limits=limits, on_item=on_item, ranks=own)
    results: list[ItemResult] = []
    hung: ItemResult | None = None  # the first item of a run that did not finish in time
    for run in exercise.runs:
        if hung is None:
            items = _check_run(exercise, run, cell_source, limits, ranks)
            if items and items[0].message.startswith(DID_NOT_FINISH):
                hung = items[0]
                # One diagnosis per check: the run's other items point to it.
                items[1:] = [_same_failure(item, hung) for item in items[1:]]
        else:
            # An answer that hangs once hangs again: the later runs would only add their deadlines.
            items = [ItemResult(item.name, 0.0, item.points, f'not run: an earlier run did not finish (see '
                                f'"{hung.name}")', "", run.hidden) for item in run.items]
        for item in items:
            results.append(item)
            if on_item is not None:
                on_item(item)
    return results


def _same_failure(item: ItemResult, first: ItemResult) -> ItemResult:
    return ItemResult(item.name, 0.0, item.max_score, f'the same run as "{first.name}": it did not finish',
                      "", item.hidden)


def _check_run(exercise: Exercise, run: RunSpec, cell_source: str, limits: Limits,
               ranks: RankSet) -> list[ItemResult]:
    import torch

    inputs = run.make_inputs(run.nproc)
    timeout_s = limits.run_timeout_s or run.timeout_s
    job_dir = pathlib.Path(tempfile.mkdtemp(prefix="course_check_"))  # mode 0700
    try:
        (job_dir / "submission.py").write_text(submission_source(cell_source))
        for rank in range(run.nproc):
            torch.save([case[rank] for case in inputs], job_dir / f"inputs.rank{rank}.pt")
        job = {
            "job_dir": str(job_dir),
            "exercise": exercise.id,
            "function": exercise.function,
            "driver": exercise.driver,
            "allowed_ops": sorted(exercise.allowed_ops) if exercise.allowed_ops is not None else None,
        }
        (job_dir / "job.json").write_text(json.dumps(job))  # for the record: the ranks get it by pipe
        (job_dir / "work").mkdir()  # the ranks' working directory: whatever they write lands here
        launch = ranks.run(job, run.nproc, timeout_s)
        output = _trimmed_output(launch)
        failure = _launch_failure(exercise, run, launch, timeout_s, limits, job_dir, len(inputs))
        outcome = None if failure else _load_outcome(job_dir, run, inputs, launch)
        if outcome is None and not failure:
            failure = "the ranks finished but did not all send their results back"
        if outcome is not None:
            failure = _rule_broken(exercise, outcome)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)

    items = []
    for item in run.items:
        if failure:
            items.append(ItemResult(item.name, 0.0, item.points, failure, output, run.hidden))
            continue
        try:
            problems = item.judge(outcome)
        except Exception as exc:  # noqa: BLE001 - output of a shape the judge did not foresee
            problems = [f"could not judge the result ({type(exc).__name__}: {exc})"]
        message = ""
        if problems:
            more = len(problems) - 1
            message = problems[0] + (f" (and {more} more like it)" if more else "")
        items.append(ItemResult(item.name, 0.0 if problems else item.points, item.points, message, output, run.hidden))
    return items


def _load_outcome(job_dir: pathlib.Path, run: RunSpec, inputs, launch: LaunchResult) -> RunOutcome | None:
    import torch

    results: list[dict[int, CaseResult]] = [{} for _ in inputs]
    for rank in range(run.nproc):
        path = job_dir / f"outputs.rank{rank}.pt"
        try:
            saved = torch.load(path, weights_only=True)
            outputs, spans = saved["outputs"], saved["spans"]
        except Exception:  # noqa: BLE001 - missing, or not plain data
            return None
        ledger = launch.ledgers.get(rank, [])
        for case, (output, (start, end)) in enumerate(zip(outputs, spans)):
            in_case = [e for e in ledger if start <= e["start"] <= end]
            results[case][rank] = CaseResult(output, in_case)
    return RunOutcome(run.nproc, inputs, results)


def _rule_broken(exercise: Exercise, outcome: RunOutcome) -> str:
    """The exercise's rules, read from the ledgers: no forbidden call, every required one made."""
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            ops = {entry["op"] for entry in result.ledger}
            if exercise.allowed_ops is not None and ops - exercise.allowed_ops:
                return (f"rank {rank} called {', '.join(sorted(ops - exercise.allowed_ops))}, which "
                        f"{exercise.id} does not allow (only {', '.join(sorted(exercise.allowed_ops))})")
            if exercise.required_ops and not ops & exercise.required_ops:
                return (f"rank {rank}, case {case + 1}: no {' or '.join(sorted(exercise.required_ops))} call "
                        "was recorded, so its result did not come from the messages this exercise is about")
    return ""


_CELL_LINE = re.compile(r'File "<cell>", line (\d+)')


def _launch_failure(exercise: Exercise, run: RunSpec, launch: LaunchResult, timeout_s: float,
                    limits: Limits, job_dir: pathlib.Path | None = None, cases: int = 0) -> str:
    """Why a run did not finish normally, in one line naming the rank ("" if it did); a rank a signal ended is
    named with the case it was in (from its phase file in `job_dir`), since a signal leaves no traceback."""
    if launch.timed_out:
        stuck = "; ".join(launch.diagnosis) if launch.diagnosis else "ranks " + ", ".join(map(str, launch.unfinished))
        # The rank set extends a deadline while the ranks still compute (a loaded machine): say how long they had.
        extended = f", nor in {launch.elapsed_s:.0f} s while still computing" if launch.elapsed_s > 1.5 * timeout_s else ""
        return (f"{DID_NOT_FINISH} {timeout_s:g} s{extended} on {run.nproc} ranks ({stuck})"
                f"{_maybe_busy(launch.diagnosis)}")
    if launch.ok:
        return ""
    rank = launch.root_cause if launch.root_cause is not None else (launch.failed or [0])[0]
    code = launch.exit_codes.get(rank)
    err = launch.stderr.get(rank, "")
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    if code == EXIT_NO_FUNCTION and lines:
        return lines[-1]
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        why = {"SIGXCPU": " (used more than its CPU time)",
               "SIGKILL": " (killed, perhaps for memory)",
               "SIGABRT": _gloo_abort(lines)}.get(name, "")
        return f"rank {rank} was ended by {name}{_in_case(job_dir, rank, cases)}{why}"
    where = _CELL_LINE.findall(err)
    at = f" at cell line {where[-1]}" if where else ""
    last = lines[-1] if lines else "no error message"
    raised = "Traceback (most recent call last):" in err
    if raised:
        last = _raised(err) or last
    last = _gloo_timeout(last)
    if "[Errno 27] File too large" in last:  # RLIMIT_FSIZE: Python ignores SIGXFSZ, so writes fail
        last += f" (a rank may write at most {binary_bytes(limits.file_bytes)}: print less)"
    if "can't allocate memory" in last or last.startswith("MemoryError"):  # RLIMIT_DATA: allocations fail
        last += f" (memory limit: a rank may use at most {binary_bytes(limits.memory_bytes)})"
    if raised:
        if is_stub_error(last, exercise.id):
            return f"rank {rank} raised{at}: {not_written_yet(exercise.id)}"
        return f"rank {rank} raised{at}: {last}"
    return f"rank {rank} exited with code {code}: {last}"


def _in_case(job_dir: pathlib.Path | None, rank: int, cases: int) -> str:
    """" in case 3 of 3": the last case `rank` started, from its phase file ("" if it started none)."""
    if job_dir is None:
        return ""
    try:
        text = (job_dir / phase_file(rank)).read_text(errors="replace")
    except OSError:
        return ""
    started = [int(words[2]) for words in (line.split() for line in text.splitlines())
               if len(words) == 3 and words[1] == CASE_MARK and words[2].isdigit()]
    return f" in case {started[-1] + 1} of {cases}" if started else ""


_GLOO_TIMEOUT = re.compile(r"\[[^\]]*\] Timed out waiting (\d+)ms for (send|recv) operation to complete")


def _gloo_timeout(message: str) -> str:
    """gloo's timeout of a point-to-point transfer, with its source path, as one sentence of what to check."""
    found = _GLOO_TIMEOUT.search(message)
    if not found:
        return message
    what = {"recv": "a receive", "send": "a send"}[found.group(2)]
    return (message[:found.start()] + f"{what} never completed in the process group's "
            f"{int(found.group(1)) / 1000:g} s: was every transfer waited for (wait() on its Work), and does "
            "its peer post the matching send or receive?")


def not_written_yet(exercise_id: str) -> str:
    """How an item reads when its run raised the stub's NotImplementedError (after "rank N raised at ...: ")."""
    return f"NotImplementedError: this part of {exercise_id} is not written yet"


def _maybe_busy(diagnosis: list[str]) -> str:
    """When no stuck rank waited in a collective, the deadline may have come from a busy machine, not a hang."""
    if not diagnosis or any(" waiting in " in line or " wait in " in line or " waits in " in line
                            for line in diagnosis):
        return ""
    return ("; no rank was waiting for another: unless your code loops, the machine may have been busy, "
            "so check again")


def _gloo_abort(lines: list[str]) -> str:
    """What gloo said before it aborted the process, without its source path: the ranks' calls do not match
    (another collective or another size; for send and recv, a receive buffer unlike the tensor sent)."""
    said = next((line for line in reversed(lines) if "enforce fail" in line or "what():" in line), "")
    if not said:
        return ""
    said = re.sub(r"\[enforce fail at [^\]]*\]\s*", "", said.split("what():", 1)[-1]).strip()
    if len(said) > 200:
        said = said[:200] + " ..."
    sizes = re.search(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)", said)
    arrived = (f" {sizes[1]} bytes arrived where the receiver expected {sizes[2]}." if sizes else "")
    said = said.rstrip(" .") if said.endswith((".", " ")) else said
    ending = "" if said.endswith(("?", "!", " ...")) else "."
    return (f" (gloo aborted the process: {said}{ending}{arrived} gloo aborts when the ranks' calls do not "
            "match: another collective or another size on some rank; for send and recv, a receive buffer smaller "
            "than the tensor sent (a larger one gloo fills from its start without complaint))")


MAX_ERROR_CHARS = 500  # of an exception's message in a report


def _raised(err: str) -> str:
    """The exception the last traceback in `err` ends with, its message's lines joined into one:
    `TypeError: Invalid function argument. ... but got <class 'NoneType'> instead.` ("" if none)."""
    lines = err.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return ""
    # After the header come the frames, indented; the exception starts at the first line that is not.
    body = lines[starts[-1] + 1:]
    first = next((i for i, line in enumerate(body) if line and not line[0].isspace()), None)
    if first is None:
        return ""
    text = " ".join(line.strip() for line in body[first:] if line.strip())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ..."


def _trimmed_output(launch: LaunchResult) -> str:
    parts = []
    for rank in sorted(launch.stdout):
        text = launch.stdout[rank]
        if text.strip():
            if len(text) > MAX_OUTPUT_CHARS:
                text = text[:MAX_OUTPUT_CHARS] + f"\n... ({len(text) - MAX_OUTPUT_CHARS} more characters)\n"
            parts.append("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    return "".join(parts)

"""Exercise notebooks are generated from solution notebooks; this module does it.

    python -m course_lib.grading.authoring            # rewrite exercises/ from solutions/
    python -m course_lib.grading.authoring --check    # exit 1 if exercises/ is stale

`solutions/NN_topic.ipynb` is the only place an answer is written. An answer
cell is a code cell whose first line is `%%exercise NN.name`; inside it, each
answer region

    ### BEGIN SOLUTION
    ...the answer...
    ### END SOLUTION

becomes one line at the BEGIN marker's indentation:

    raise NotImplementedError("01.ring_allreduce: your code here")

A stub holds no recipe: `### BEGIN SOLUTION hint: ...` is refused. Hints are the
exercise's (`Exercise.hints` in course_lib/grading/lessons/), shown by the check
after a failure, one level at a time. Cells tagged `solution-only` (answers'
explanations, the summary of what the exercises taught) are dropped.

Answer cells and cells that call
`cl.check(` lose their outputs and get the `nbval-ignore-output` tag; every
other cell is copied unchanged. The layout follows nbgrader's BEGIN/END
SOLUTION convention.
"""

from __future__ import annotations

import argparse
import copy
import io
import re
import sys
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from .cells import EXERCISE_ID, MAX_STUB_MESSAGE, stub_message

__all__ = ["MarkerError", "exercise_from_solution", "generate_all", "main"]

REPO_ROOT = Path(__file__).resolve().parents[2]  # course_lib/grading/authoring.py -> repo
NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
SOLUTION_ONLY_TAG = "solution-only"
IGNORE_OUTPUT_TAG = "nbval-ignore-output"
CHECK_CALL = "cl.check("


class MarkerError(ValueError):
    """A solution notebook's `%%exercise` cells or SOLUTION markers are malformed."""


def _fail(where: str, line: int | None, problem: str) -> MarkerError:
    """The one-line error: notebook and cell (`where`), 1-based line in the cell, problem."""
    at = f"{where}, line {line}" if line is not None else where
    return MarkerError(f"{at}: {problem}")


def _source(cell: NotebookNode) -> str:
    # A notebook read from disk has str sources; one built by hand may hold a list.
    return cell.source if isinstance(cell.source, str) else "".join(cell.source)


def _exercise_id(cell: NotebookNode, where: str) -> str | None:
    """The id named on a code cell's `%%exercise <id>` first line, or None for other cells."""
    if cell.cell_type != "code":
        return None
    first = _source(cell).split("\n", 1)[0].strip()
    words = first.split()
    if not words or words[0] != "%%exercise":
        return None
    if len(words) != 2 or not EXERCISE_ID.fullmatch(words[1]):
        raise _fail(where, 1, f"bad %%exercise line {first!r}: expected '%%exercise NN.name' "
                              f"(name in a-z, 0-9, _)")
    return words[1]


def _marker(line: str, where: str, number: int) -> str | None:
    """"begin", "end" or None for one source line."""
    text = line.strip()
    if text.startswith(BEGIN):
        if text.startswith(f"{BEGIN} hint:"):
            raise _fail(where, number, "a stub holds no hint: put hints in the exercise's Exercise.hints "
                                       "(course_lib/grading/lessons/), which the check shows after a failure")
        if text != BEGIN:
            raise _fail(where, number, f"malformed marker {text!r}: expected '{BEGIN}'")
        return "begin"
    if text.startswith(END):
        if text != END:
            raise _fail(where, number, f"malformed marker {text!r}: expected '{END}'")
        return "end"
    return None


def _py_string(text: str) -> str:
    """`text` as a Python string literal, in double quotes unless it contains one."""
    literal = repr(text)
    if '"' not in text and literal.startswith("'"):
        # repr only escapes the quote it delimits with, so the body needs no change.
        return '"' + literal[1:-1] + '"'
    return literal


def _stub(begin_line: str, exercise_id: str, where: str) -> str:
    """The `raise NotImplementedError(...)` line that replaces one region."""
    indent = begin_line[: len(begin_line) - len(begin_line.lstrip())]
    ending = begin_line[len(begin_line.rstrip("\r\n")):]  # keep the cell's own line ending
    message = stub_message(exercise_id)
    if len(message) > MAX_STUB_MESSAGE:
        raise _fail(where, None, f"exercise id {exercise_id} is too long: its stub's message would have "
                                 f"{len(message)} characters (at most {MAX_STUB_MESSAGE})")
    return f"{indent}raise NotImplementedError({_py_string(message)}){ending}"


def _strip_regions(source: str, exercise_id: str, where: str) -> str:
    """An answer cell's source with every SOLUTION region replaced by its stub."""
    out: list[str] = []
    begin_at: int | None = None  # 1-based line of the open BEGIN, None outside a region
    regions = 0
    for number, line in enumerate(source.splitlines(keepends=True), start=1):
        kind = _marker(line, where, number)
        if kind == "begin":
            if begin_at is not None:
                raise _fail(where, number, f"nested {BEGIN} (the region opened on line "
                                           f"{begin_at} has no {END} before it)")
            begin_at = number
            out.append(_stub(line, exercise_id, where))
        elif kind == "end":
            if begin_at is None:
                raise _fail(where, number, f"{END} without {BEGIN}")
            begin_at = None
            regions += 1
        elif begin_at is None:
            out.append(line)
    if begin_at is not None:
        raise _fail(where, begin_at, f"{BEGIN} without {END}")
    if regions == 0:
        raise _fail(where, None, f"%%exercise {exercise_id} cell has no {BEGIN} ... {END} region")
    return "".join(out)


def _reject_markers(cell: NotebookNode, where: str) -> None:
    """Raise if a cell that is not an answer cell holds a SOLUTION marker (it would leak)."""
    for number, line in enumerate(_source(cell).splitlines(), start=1):
        if _marker(line, where, number) is not None:
            raise _fail(where, number, "SOLUTION marker in a cell that is not a %%exercise "
                                       "code cell (its first line must be '%%exercise NN.name')")


def _ignore_output(cell: NotebookNode) -> None:
    """Clear a code cell's outputs and tag it so nbval does not compare them."""
    cell.outputs = []
    cell.execution_count = None
    tags = cell.metadata.setdefault("tags", [])
    if IGNORE_OUTPUT_TAG not in tags:
        tags.append(IGNORE_OUTPUT_TAG)


def exercise_from_solution(nb: NotebookNode, *, name: str = "notebook") -> NotebookNode:
    """The exercise notebook generated from solution notebook `nb` (nbformat v4).

    Pure: `nb` is not modified. `name` only labels errors. Raises `MarkerError`
    (a ValueError) naming the notebook, the cell index and the problem.
    """
    out = copy.deepcopy(nb)
    cells = []
    first_cell_of: dict[str, int] = {}  # exercise id -> index of the cell that defines it
    for index, cell in enumerate(out.cells):
        if SOLUTION_ONLY_TAG in cell.metadata.get("tags", []):
            continue
        where = f"{name}, cell {index}"
        exercise_id = _exercise_id(cell, where)
        if exercise_id is not None:
            if exercise_id in first_cell_of:
                raise _fail(where, 1, f"exercise id {exercise_id} already used by "
                                      f"cell {first_cell_of[exercise_id]}")
            first_cell_of[exercise_id] = index
            cell.source = _strip_regions(_source(cell), exercise_id, where)
            _ignore_output(cell)
        else:
            _reject_markers(cell, where)
            # A check's output is the grader's verdict on the solution, not the learner's.
            if cell.cell_type == "code" and CHECK_CALL in _source(cell):
                _ignore_output(cell)
        cells.append(cell)
    out.cells = cells
    return out


def _notebook_text(nb: NotebookNode) -> str:
    """Exactly what `nbformat.write(nb, path)` puts in the file."""
    buffer = io.StringIO()
    nbformat.write(nb, buffer)
    return buffer.getvalue()


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies below it (shorter messages)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def exercise_name(solution_name: str) -> str:
    """`NN_topic_solutions.ipynb` -> `NN_topic_exercises.ipynb`: distinct names, so a lesson
    (`NN_topic.ipynb`), its exercises and its solutions never share a JupyterLab tab title."""
    stem = solution_name.removesuffix(".ipynb")
    return f"{stem.removesuffix('_solutions')}_exercises.ipynb" if stem.endswith("_solutions") else solution_name


def generate_all(solutions_dir: Path | str, exercises_dir: Path | str, *,
                 check: bool = False) -> list[str]:
    """Regenerate `exercises_dir/NN_*.ipynb` from `solutions_dir/NN_*.ipynb`.

    Each `NN_topic_solutions.ipynb` writes `NN_topic_exercises.ipynb` (`exercise_name`).
    Returns the exercise file names whose notebook differed from the generated
    one (missing, stale, or without a solution). With `check=True` nothing is
    written; otherwise stale ones are rewritten and ones without a solution removed.
    """
    solutions_dir, exercises_dir = Path(solutions_dir), Path(exercises_dir)
    differing = []
    sources = sorted(solutions_dir.glob(NOTEBOOK_GLOB))
    for source in sources:
        exercise = exercise_from_solution(nbformat.read(source, as_version=4), name=_shown(source))
        nbformat.validate(exercise)
        target = exercises_dir / exercise_name(source.name)
        text = _notebook_text(exercise)
        if target.is_file() and target.read_text(encoding="utf-8") == text:
            continue
        differing.append(target.name)
        if not check:
            exercises_dir.mkdir(parents=True, exist_ok=True)
            nbformat.write(exercise, target)
    names = {exercise_name(source.name) for source in sources}
    for orphan in sorted(exercises_dir.glob(NOTEBOOK_GLOB)):
        # A renamed or deleted solution leaves a generated notebook nobody maintains.
        if orphan.name not in names:
            differing.append(orphan.name)
            if not check:
                orphan.unlink()
    return differing


def main(argv: list[str] | None = None) -> int:
    """Command line: regenerate exercises (exit 0), or `--check` them (exit 1 if stale).

    Malformed markers print one line to stderr and exit 2.
    """
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.authoring",
                                     description="Generate exercise notebooks from solutions.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if any exercise notebook is out of date")
    parser.add_argument("--solutions", type=Path, default=REPO_ROOT / "solutions")
    parser.add_argument("--exercises", type=Path, default=REPO_ROOT / "exercises")
    args = parser.parse_args(argv)
    try:
        names = generate_all(args.solutions, args.exercises, check=args.check)
    except MarkerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for name in names:
        shown = _shown(args.exercises / name)
        if args.check:
            print(f"{shown} is out of date: run make exercises")
        elif name in {exercise_name(source.name) for source in args.solutions.glob(NOTEBOOK_GLOB)}:
            print(f"wrote {shown}")
        else:
            print(f"removed {shown} (no solution notebook)")
    return 1 if args.check and names else 0


if __name__ == "__main__":
    sys.exit(main())

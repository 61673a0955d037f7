"""Grade submitted notebooks: every exercise's checks (public + hidden), results written as they come.

`python -m course_lib.grade SUBMISSIONS... [--hidden DIR] [--out DIR] [--jobs N]`
(see `main`). For each submission: read its `%%exercise` cells, run each
exercise's checks (checker.py: one set of real ranks per submission, reused
from run to run, one deadline per run), put back any grader file the
submission's code touched (guard.py), then write `OUT/<name>/results.json` and
rewrite `OUT/grades.csv`, each atomically. `--jobs N` grades N submissions at
once (parallel.py). A result already on disk for the same file and the same
checks is kept, so an interrupted grading resumes where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import pathlib
import sys

from ..torch_support import unsupported_torch_message
from .cells import exercise_cells
from .checker import check_exercise, preload_for, rank_set_for
from .gradescope import results_json, write_atomically, write_csv
from .guard import FileGuard
from .parallel import grade_in_parallel, grade_one_at_a_time
from .progress import Progress
from .rank_server import RankServer
from .registry import UnknownExercise, exercise, exercises_of_lesson, load_hidden, public_exercises
from .spec import ItemResult, Limits

__all__ = ["grade", "main"]

PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]


def _submission_files(paths: list[str]) -> list[pathlib.Path]:
    files = []
    for given in paths:
        path = pathlib.Path(given)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"no such submission file or folder: {given}")
    return files


def _names(files: list[pathlib.Path]) -> dict[pathlib.Path, str]:
    """A results folder name per file: its stem, or parent_stem where stems repeat."""
    stems = [f.stem for f in files]
    return {f: f.stem if stems.count(f.stem) == 1 else f"{f.parent.name}_{f.stem}" for f in files}


def _exercise_ids(cells: dict[str, str], path: pathlib.Path, wanted: list[str] | None) -> list[str]:
    """Which exercises to grade: those asked for, else the lesson(s) of the file name or of its cells."""
    if wanted:
        ids = []
        for want in wanted:
            ids += exercises_of_lesson(want) if want.isdigit() else [exercise(want).id]
        return ids
    lessons = [path.name[:2]] if path.name[:2].isdigit() and path.name[2:3] == "_" else []
    lessons = lessons or sorted({i.split(".")[0] for i in cells})
    ids = [i for lesson in lessons for i in exercises_of_lesson(lesson)]
    return ids or list(public_exercises())


def _zero(exercise_id: str, hidden: dict, message: str) -> list[ItemResult]:
    found = exercise(exercise_id, hidden)
    return [ItemResult(item.name, 0.0, item.points, message, hidden=run.hidden)
            for run in found.runs for item in run.items]


def grade_submission(path: pathlib.Path, wanted: list[str] | None, hidden: dict,
                     limits: Limits, server: RankServer | None = None) -> tuple[dict[str, list[ItemResult]], str]:
    """{exercise id: item results} for one notebook, and a note for the learner ("" if none)."""
    import nbformat

    note = ""
    try:
        cells = exercise_cells(nbformat.read(str(path), as_version=4))
    except Exception as exc:  # noqa: BLE001 - not JSON, not a notebook: every check scores 0
        cells, note = {}, f"could not read the notebook: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    graded = {}
    ids = _exercise_ids(cells, path, wanted)
    answered = [exercise(i, hidden) for i in ids if i in cells]
    # One set of ranks for the whole submission: started once, restarted only after a run that failed.
    with rank_set_for(answered, limits, server) as ranks:
        for exercise_id in ids:
            if exercise_id not in cells:
                graded[exercise_id] = _zero(exercise_id, hidden, f"no answer: the notebook has no cell that starts "
                                                                 f"with %%exercise {exercise_id}")
            else:
                graded[exercise_id] = check_exercise(exercise(exercise_id, hidden), cells[exercise_id],
                                                     limits=limits, ranks=ranks)
    return graded, note


def _package_version() -> str:
    try:
        return importlib.metadata.version("course_lib")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing it
        return "unknown"


def _checks_key(hidden_dir: pathlib.Path | None, wanted: list[str] | None) -> str:
    """Identifies the checks a result was computed with (for resuming)."""
    digest = hashlib.sha256(f"course_lib {_package_version()}; {wanted}".encode())
    if hidden_dir is not None:
        for path in sorted(hidden_dir.rglob("*.py")):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _kept(path: pathlib.Path, sha: str, key: str) -> dict | None:
    try:
        result = json.loads(path.read_text())
        extra = result["extra_data"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return result if extra.get("submission_sha256") == sha and extra.get("checks") == key else None


def grade(files: list[pathlib.Path], out: pathlib.Path, *, hidden_dir: pathlib.Path | None = None,
          wanted: list[str] | None = None, force: bool = False, limits: Limits = Limits(),
          progress: Progress | None = None, jobs: int = 1) -> dict[str, dict]:
    """Grade every submission file (see `_submission_files`), `jobs` at a time; return {name: results.json}."""
    hidden = load_hidden(hidden_dir) if hidden_dir is not None else {}
    public_exercises()  # import every judge before any learner code runs
    key = _checks_key(hidden_dir, wanted)
    out.mkdir(parents=True, exist_ok=True)
    guard = FileGuard([out, PACKAGE_DIR] + ([hidden_dir] if hidden_dir is not None else []))
    progress = progress or Progress(len(files), stream=None)
    names = _names(files)
    results: dict[str, dict] = {}
    todo: list[tuple[pathlib.Path, str, str]] = []
    for path, name in names.items():
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        kept = None if force else _kept(out / name / "results.json", sha, key)
        if kept is not None:
            results[name] = kept
            progress.advance(name, "kept")
        else:
            todo.append((path, name, sha))

    # Imports torch (and what any exercise preloads) once; every submission's ranks are forked from it.
    server = RankServer(preload_for(public_exercises().values())) if todo else None

    def grade_one(item: tuple[pathlib.Path, str, str]) -> tuple[dict[str, list[ItemResult]], str]:
        progress.start(item[1])
        return grade_submission(item[0], wanted, hidden, limits, server)

    def record(item: tuple[pathlib.Path, str, str], graded_note: tuple, touched: list[str]) -> None:
        (path, name, sha), (graded, note) = item, graded_note
        if touched:
            note = (f"0 points: your code changed the grader's files ({touched[0]}"
                    f"{f' and {len(touched) - 1} more' if len(touched) > 1 else ''}); they were put back")
            graded = {i: [ItemResult(it.name, 0.0, it.max_score, "grader files were changed", hidden=it.hidden)
                          for it in items] for i, items in graded.items()}
        first_hints = {i: exercise(i).hints[0] for i in graded if exercise(i).hints}  # the section to reread
        result = results_json(graded, note=note, hints=first_hints, extra={
            "submission": path.name, "submission_sha256": sha, "checks": key})
        write_atomically(out / name / "results.json", json.dumps(result, indent=1) + "\n")
        results[name] = result
        write_csv(out / "grades.csv", results)
        progress.advance(name, f"{result['score']:g}/{result['extra_data']['max_score']:g}")

    try:
        if jobs > 1 and len(todo) > 1:
            grade_in_parallel(todo, grade_one, guard, record, jobs)
        else:
            grade_one_at_a_time(todo, grade_one, guard, record)
    finally:
        if server is not None:
            server.stop()
    results = {name: results[name] for name in names.values()}  # in the order the files were given
    write_csv(out / "grades.csv", results)
    progress.close()
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.grade",
        description="Grade exercise notebooks on real ranks (gloo); write Gradescope results.json and a CSV.")
    parser.add_argument("submissions", nargs="+", help="notebook files, or folders searched for *.ipynb")
    parser.add_argument("--out", default="grades", help="results folder (default: grades)")
    parser.add_argument("--hidden", help="folder of instructor-only checks (*.py with HIDDEN_RUNS)")
    parser.add_argument("--exercises", help="comma-separated exercise ids or lesson numbers, e.g. 01 or "
                                            "01.ring_allreduce (default: the lesson of each notebook)")
    parser.add_argument("--results-json", help="also write the (single) submission's results.json here, "
                                               "e.g. /autograder/results/results.json on Gradescope")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="grade N submissions at once, each on its own ranks (default: 1)")
    parser.add_argument("--force", action="store_true", help="grade again even where a result is kept")
    parser.add_argument("--run-timeout", type=float, help="deadline of every run in seconds, replacing each "
                                                          "run's own (20-30 s); raise it on slow machines")
    parser.add_argument("--memory-gib", type=float, default=Limits.memory_bytes / 2**30,
                        help="memory a rank may use, heap and private mappings (default: %(default)g)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    too_old = unsupported_torch_message()
    if too_old:
        print(too_old, file=sys.stderr)
    wanted = [w.strip() for w in args.exercises.split(",") if w.strip()] if args.exercises else None
    try:
        files = _submission_files(args.submissions)
        if args.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
        if args.results_json and len(files) != 1:
            raise ValueError("--results-json needs exactly one submission")
        for want in wanted or []:
            if not want.isdigit():
                exercise(want)
        results = grade(files, pathlib.Path(args.out),
                        hidden_dir=pathlib.Path(args.hidden) if args.hidden else None, wanted=wanted,
                        force=args.force, limits=Limits(memory_bytes=int(args.memory_gib * 2**30), run_timeout_s=args.run_timeout),
                        progress=Progress(len(files), stream=sys.stderr), jobs=args.jobs)
    except (FileNotFoundError, UnknownExercise, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.results_json:
        (result,) = results.values()
        write_atomically(pathlib.Path(args.results_json), json.dumps(result, indent=1) + "\n")
    for name, result in sorted(results.items()):
        print(f"{name}: {result['score']:g}/{result['extra_data']['max_score']:g}")
    print(f"wrote {pathlib.Path(args.out) / 'grades.csv'}")
    return 0

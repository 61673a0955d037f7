"""The checks every lesson's exercise tests make (tests/test_0N_*.py): a solution scores full marks, a
stub scores zero and Gradescope's results show the exercise's first hint once, a hanging answer is stopped at its deadline naming the rank
and the collective. Each runs `check_exercise` on real ranks (`ranks`: the module's shared rank set,
or None for a fresh one per run)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from course_lib.grading.checker import check_exercise, rank_set_for
from course_lib.grading.gradescope import results_json
from course_lib.grading.registry import exercise
from course_lib.grading.report import item_line
from course_lib.grading.spec import Limits


# A decimal number in a message (`:g` prints 6 significant digits): its last digits move with the CPU and
# BLAS path (MKL picks kernels by CPU and alignment), so phrases compare such numbers within REL_DIGITS.
_DECIMAL = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?|-?\d+e[-+]?\d+")
REL_DIGITS = 1e-4


def shared_ranks(ids: list[str]):
    """A module-scoped `ranks` fixture: one set of grading ranks for all of `ids`, as the grader gives one
    to a submission. In a test module: `ranks = shared_ranks(IDS)`."""

    @pytest.fixture(scope="module")
    def ranks():
        with rank_set_for([exercise(i) for i in ids]) as shared:
            yield shared

    return ranks


def phrase_in(phrase: str, message: str) -> bool:
    """`phrase` appears in `message`, its decimal numbers matching within a relative REL_DIGITS (integers exactly)."""
    parts = _DECIMAL.split(phrase)
    wanted = [float(n) for n in _DECIMAL.findall(phrase)]
    if not wanted:
        return phrase in message
    pattern = f"({_DECIMAL.pattern})".join(re.escape(part) for part in parts)
    for found in re.finditer(pattern, message):
        got = [float(found.group(i + 1)) for i in range(len(wanted))]
        if all(abs(g - w) <= REL_DIGITS * max(abs(w), 1e-3) for g, w in zip(got, wanted)):
            return True
    return False


def failed_items(items) -> dict[str, str]:
    """{item name: message} of the items that did not pass."""
    return {item.name: item.message for item in items if not item.passed}


def assert_full_marks(exercise_id: str, answer: str, ranks=None) -> None:
    items = check_exercise(exercise(exercise_id), answer, ranks=ranks)
    assert all(item.passed for item in items), "\n".join(map(item_line, items))
    assert sum(item.score for item in items) == exercise(exercise_id).points > 0


def assert_loses_exactly(exercise_id: str, source: str, lost: dict, ranks=None) -> dict[str, str]:
    """`source` fails exactly the items named in `lost` ({item: phrase, or a tuple of phrases}), each
    message holding its phrases; returns {item: message} of the failed items for further checks."""
    items = check_exercise(exercise(exercise_id), source, ranks=ranks)
    got = failed_items(items)
    assert sorted(got) == sorted(lost), "\n".join(map(item_line, items))
    for name, phrases in lost.items():
        for phrase in phrases if isinstance(phrases, tuple) else (phrases,):
            assert phrase_in(phrase, got[name]), f"{name}: {got[name]!r} lacks {phrase!r}"
    return got


def assert_stub_scores_zero_with_its_first_hint_once(exercise_id: str, stub: str, ranks=None) -> None:
    """Every item fails on the stub's NotImplementedError, named by rank, with no hint in its message;
    Gradescope's results show the exercise's first hint (the lesson's section) once."""
    found = exercise(exercise_id)
    assert len(found.hints) == 3, f"{exercise_id}: hints are three levels (section, API, approach)"
    items = check_exercise(found, stub, ranks=ranks)
    assert sum(item.score for item in items) == 0
    for item in items:
        assert f"NotImplementedError: this part of {exercise_id} is not written yet" in item.message, item.message
        assert item.message.startswith("rank "), item.message  # names the rank that raised
        assert not any(hint in item.message for hint in found.hints)
    tests = results_json({exercise_id: items}, extra={}, hints={exercise_id: found.hints[0]})["tests"]
    assert [found.hints[0] in test["output"] for test in tests] == [True] + [False] * (len(tests) - 1)


_NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


def assert_section_states_the_check(exercise_id: str, text: str, case_phrases=None) -> None:
    """The exercise's section (`text`) says what its check enforces, as the learner reads it: how many runs,
    each run's ranks and deadline, each case (the phrases `case_phrases(exercise_id, case)` gives, if
    given), and which torch.distributed calls it allows (rank_runner blocks the others)."""
    found = exercise(exercise_id)
    runs = len(found.runs)
    assert re.search(rf"\*\*Graded on\*\* ({runs}|{_NUMBER_WORDS[runs]}) runs?\b", text), \
        f"{exercise_id}: no '**Graded on** {runs} run(s)'"
    for run in found.runs:
        assert re.search(rf"deadline (of )?{run.timeout_s:g} s", text), f"{exercise_id}: no deadline {run.timeout_s:g} s"
        assert f"{run.nproc} ranks" in text, f"{exercise_id}: no '{run.nproc} ranks'"
        for case in (run.make_inputs(run.nproc) if case_phrases else []):
            for phrase in case_phrases(exercise_id, case):
                assert phrase in text, f"{exercise_id}: no {phrase!r}"
    if found.allowed_ops is None:
        assert "Any torch.distributed call" in text, f"{exercise_id}: does not say every call is allowed"
    else:
        for op in sorted(found.allowed_ops):
            assert f"`dist.{op}`" in text, f"{exercise_id}: does not allow `dist.{op}`"
        assert "collective or point-to-point call" in text  # ... raises inside the check
        assert "`dist.get_rank()`" in text  # not a communication: never blocked


def assert_deadline_message(message: str, timeout_s: float, nproc: int) -> None:
    """`message` is the checker's deadline line for `nproc` ranks: "did not finish within 4 s on 2 ranks (...".
    On a loaded machine (CI) a rank may still be starting up at the first deadline, so the rank set extends it
    and the line says so ("..., nor in 9 s while still computing on 2 ranks (..."): both are the same verdict."""
    pattern = rf"did not finish within {timeout_s:g} s(, nor in \d+ s while still computing)? on {nproc} ranks \("
    assert re.match(pattern, message), message


def assert_hang_is_named(exercise_id: str, source: str, phrases: list[str], ranks, hang_s: float) -> None:
    """On 2 ranks with a deadline of `hang_s`: zero points, and every item says which rank waits where."""
    found = exercise(exercise_id)
    first_run = dataclasses.replace(found, runs=found.runs[:1])  # 2 ranks
    items = check_exercise(first_run, source, limits=Limits(run_timeout_s=hang_s), ranks=ranks)
    assert [item.score for item in items] == [0] * len(items)
    first, *others = items  # the diagnosis is said once, by the run's first item
    assert_deadline_message(first.message, hang_s, 2)
    for phrase in phrases:
        assert phrase in first.message, first.message
    for item in others:
        assert item.message == f'the same run as "{first.name}": it did not finish', item.message

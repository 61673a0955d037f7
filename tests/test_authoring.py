"""Exercise notebooks generated from solution notebooks (course_lib.grading.authoring).

Fast, single-process: small notebooks are built here with nbformat's v4 helpers.
The last test checks that the committed exercises/ matches solutions/.
"""

import copy
import textwrap

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from course_lib.grading.authoring import REPO_ROOT, MarkerError, exercise_from_solution, generate_all, main

RING_CELL = textwrap.dedent('''\
    %%exercise 01.ring_allreduce
    import torch


    def ring_allreduce(x):
        """Sum x over ranks."""
        rank = 0  # kept: outside the region
        ### BEGIN SOLUTION
        for step in range(3):
            x = x + step
        ### END SOLUTION
        return x
''')


def _answer_cell(source=RING_CELL):
    output = new_output("stream", name="stdout", text="solution output\n")
    return new_code_cell(source, execution_count=3, outputs=[output])


def _notebook(*cells):
    return new_notebook(cells=list(cells), metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})


def _exercise_cell(source, **kwargs):
    """The single cell of the exercise generated from a one-cell solution."""
    return exercise_from_solution(_notebook(new_code_cell(source)), **kwargs).cells[0]


def _run_stub(cell_source, function_name, *args):
    """Execute an answer cell minus its %%exercise line, then call the function it defines."""
    namespace = {}
    exec(cell_source.split("\n", 1)[1], namespace)
    return namespace[function_name](*args)


# --- regions become stubs ---------------------------------------------------------------

def test_region_becomes_stub_at_begin_indentation_without_a_hint():
    source = _exercise_cell(RING_CELL).source
    assert source == textwrap.dedent('''\
        %%exercise 01.ring_allreduce
        import torch


        def ring_allreduce(x):
            """Sum x over ranks."""
            rank = 0  # kept: outside the region
            raise NotImplementedError("01.ring_allreduce: your code here")
            return x
    ''')


def test_a_hint_in_a_stub_is_refused_in_one_line():
    source = "%%exercise 02.fsdp\ndef f():\n    ### BEGIN SOLUTION hint: use dist.send\n    return 1\n    ### END SOLUTION\n"
    with pytest.raises(MarkerError, match=r"^nb, cell 0, line 3: a stub holds no hint: put hints in the exercise's Exercise.hints"):
        _exercise_cell(source, name="nb")


def test_an_id_whose_stub_message_would_pass_62_characters_is_refused():
    long_id = "02." + "x" * 50
    source = f"%%exercise {long_id}\ndef f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n"
    with pytest.raises(MarkerError, match="at most 62"):
        _exercise_cell(source)


def test_two_regions_in_one_cell_keep_the_code_between_them():
    source = textwrap.dedent("""\
        %%exercise 03.two_parts
        def first():
            ### BEGIN SOLUTION
            return 1
            ### END SOLUTION

        SHARED = 'kept verbatim'

        def second():
            if True:
                ### BEGIN SOLUTION
                return 2
                ### END SOLUTION
    """)
    assert _exercise_cell(source).source == textwrap.dedent("""\
        %%exercise 03.two_parts
        def first():
            raise NotImplementedError("03.two_parts: your code here")

        SHARED = 'kept verbatim'

        def second():
            if True:
                raise NotImplementedError("03.two_parts: your code here")
    """)


def test_stub_raises_not_implemented_with_its_id_when_called():
    source = _exercise_cell(RING_CELL).source
    with pytest.raises(NotImplementedError, match=r"^01\.ring_allreduce: your code here$"):
        _run_stub(source, "ring_allreduce", 1)
    # The solution cell itself runs: the stub replaced working code, not broken code.
    assert _run_stub(RING_CELL, "ring_allreduce", 1) == 4


# --- which cells are kept, cleared, tagged ------------------------------------------------

def _lesson():
    kept_output = new_output("execute_result", data={"text/plain": "42"}, execution_count=1)
    check_output = new_output("stream", name="stdout", text="PASS 01.ring_allreduce\n")
    return _notebook(
        new_markdown_cell("# Ring all-reduce"),
        new_code_cell("6 * 7", execution_count=1, outputs=[kept_output]),
        _answer_cell(),
        new_code_cell("cl.check('01.ring_allreduce', ring_allreduce)", execution_count=4,
                      outputs=[check_output], metadata={"tags": ["keep-me", "nbval-ignore-output"]}),
        new_code_cell("print('the reference run')", metadata={"tags": ["solution-only"]}),
        new_markdown_cell("## Summary"),
    )


def test_solution_only_cells_are_dropped_and_no_cells_added():
    exercise = exercise_from_solution(_lesson())
    assert [c.source.split("\n")[0] for c in exercise.cells] == [
        "# Ring all-reduce", "6 * 7", "%%exercise 01.ring_allreduce",
        "cl.check('01.ring_allreduce', ring_allreduce)", "## Summary"]


def test_answer_and_check_cells_lose_outputs_and_get_ignore_tag_once():
    _, _, answer, check, _ = exercise_from_solution(_lesson()).cells
    assert answer.outputs == [] and answer.execution_count is None
    assert answer.metadata.tags == ["nbval-ignore-output"]
    assert check.outputs == []
    assert check.metadata.tags == ["keep-me", "nbval-ignore-output"]  # kept, not duplicated


def test_other_cells_and_notebook_metadata_are_copied_exactly():
    solution = _lesson()
    exercise = exercise_from_solution(solution)
    assert exercise.cells[0] == solution.cells[0]
    assert exercise.cells[1] == solution.cells[1]  # outputs and execution_count kept
    assert exercise.cells[4] == solution.cells[5]
    assert exercise.metadata == solution.metadata
    nbformat.validate(exercise)


def test_input_notebook_is_not_modified():
    solution = _lesson()
    before = copy.deepcopy(solution)
    exercise_from_solution(solution)
    assert solution == before


# --- malformed solutions ------------------------------------------------------------------

BAD_SOLUTIONS = {
    "begin without end": ("%%exercise 05.x\n### BEGIN SOLUTION\nx = 1\n",
                          r"cell 0, line 2: ### BEGIN SOLUTION without ### END SOLUTION"),
    "end without begin": ("%%exercise 05.x\nx = 1\n### END SOLUTION\n",
                          r"cell 0, line 3: ### END SOLUTION without ### BEGIN SOLUTION"),
    "nested begin": ("%%exercise 05.x\n### BEGIN SOLUTION\n  ### BEGIN SOLUTION\n### END SOLUTION\n",
                     r"cell 0, line 3: nested ### BEGIN SOLUTION"),
    "marker outside exercise cell": ("x = 1\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION\n",
                                     r"cell 0, line 2: SOLUTION marker in a cell that is not a %%exercise"),
    "exercise cell without region": ("%%exercise 05.x\nx = 1\n",
                                     r"cell 0: %%exercise 05.x cell has no ### BEGIN SOLUTION"),
    "bad exercise id": ("%%exercise Ring\n### BEGIN SOLUTION\n### END SOLUTION\n",
                        r"cell 0, line 1: bad %%exercise line"),
    "malformed marker": ("%%exercise 05.x\n### BEGIN SOLUTION please\n### END SOLUTION\n",
                         r"cell 0, line 2: malformed marker"),
}


@pytest.mark.parametrize("source, message", BAD_SOLUTIONS.values(), ids=BAD_SOLUTIONS.keys())
def test_malformed_solution_raises_value_error_naming_notebook_cell_and_problem(source, message):
    with pytest.raises(ValueError, match=r"^solutions/05_x\.ipynb, " + message) as raised:
        exercise_from_solution(_notebook(new_code_cell(source)), name="solutions/05_x.ipynb")
    assert "\n" not in str(raised.value)


def test_marker_in_markdown_cell_is_rejected():
    nb = _notebook(new_markdown_cell("### BEGIN SOLUTION\nthe answer\n### END SOLUTION"))
    with pytest.raises(ValueError, match=r"^nb, cell 0, line 1: SOLUTION marker"):
        exercise_from_solution(nb, name="nb")


def test_same_exercise_id_in_two_cells_is_rejected():
    nb = _notebook(_answer_cell(), new_markdown_cell("again"), _answer_cell())
    with pytest.raises(ValueError, match=r"^nb, cell 2, line 1: exercise id 01\.ring_allreduce already "
                                         r"used by cell 0$"):
        exercise_from_solution(nb, name="nb")


# --- files and command line ---------------------------------------------------------------

def _write_solution(solutions, name="01_ring.ipynb", nb=None):
    solutions.mkdir(exist_ok=True)
    nbformat.write(nb or _lesson(), solutions / name)


def _dirs(tmp_path):
    return ["--solutions", str(tmp_path / "solutions"), "--exercises", str(tmp_path / "exercises")]


def test_check_fails_when_missing_or_stale_and_passes_after_generating(tmp_path, capsys):
    _write_solution(tmp_path / "solutions")
    assert main(["--check", *_dirs(tmp_path)]) == 1  # missing
    assert "01_ring.ipynb is out of date: run make exercises" in capsys.readouterr().out
    assert not (tmp_path / "exercises").exists()  # --check writes nothing

    assert main(_dirs(tmp_path)) == 0
    assert "01_ring.ipynb" in capsys.readouterr().out
    assert main(["--check", *_dirs(tmp_path)]) == 0

    exercise_file = tmp_path / "exercises" / "01_ring.ipynb"
    stale = nbformat.read(exercise_file, as_version=4)
    stale.cells[0].source = "# edited by hand"
    nbformat.write(stale, exercise_file)
    assert main(["--check", *_dirs(tmp_path)]) == 1


def test_generation_is_byte_stable_and_writes_what_exercise_from_solution_returns(tmp_path):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    _write_solution(solutions)
    assert generate_all(solutions, exercises) == ["01_ring.ipynb"]
    first = (exercises / "01_ring.ipynb").read_bytes()
    assert generate_all(solutions, exercises) == []
    assert (exercises / "01_ring.ipynb").read_bytes() == first
    written = nbformat.read(exercises / "01_ring.ipynb", as_version=4)
    nbformat.validate(written)
    assert written == exercise_from_solution(nbformat.read(solutions / "01_ring.ipynb", as_version=4))


def test_exercise_without_solution_is_reported_then_removed(tmp_path):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    exercises.mkdir()
    nbformat.write(_notebook(), exercises / "07_orphan.ipynb")
    (exercises / "README.md").write_text("not a notebook: left alone\n")
    assert generate_all(solutions, exercises, check=True) == ["07_orphan.ipynb"]
    assert (exercises / "07_orphan.ipynb").exists()
    assert generate_all(solutions, exercises) == ["07_orphan.ipynb"]
    assert sorted(p.name for p in exercises.iterdir()) == ["README.md"]


def test_bad_markers_exit_2_with_one_line_on_stderr(tmp_path, capsys):
    bad = _notebook(new_code_cell("%%exercise 01.x\n### BEGIN SOLUTION\n"))
    _write_solution(tmp_path / "solutions", nb=bad)
    assert main(_dirs(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "01_ring.ipynb, cell 0, line 2: ### BEGIN SOLUTION without" in err
    assert not (tmp_path / "exercises").exists()


def test_committed_exercises_match_solutions():
    stale = generate_all(REPO_ROOT / "solutions", REPO_ROOT / "exercises", check=True)
    assert stale == [], f"exercises/ is out of date for {stale}: run make exercises"


def test_a_solutions_notebook_writes_an_exercises_notebook_of_another_name(tmp_path):
    from course_lib.grading.authoring import exercise_name

    assert exercise_name("05_fsdp2_solutions.ipynb") == "05_fsdp2_exercises.ipynb"
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    exercises.mkdir()
    _write_solution(solutions, name="01_ring_solutions.ipynb")
    assert generate_all(solutions, exercises) == ["01_ring_exercises.ipynb"]
    assert sorted(p.name for p in exercises.iterdir()) == ["01_ring_exercises.ipynb"]
    assert generate_all(solutions, exercises, check=True) == []

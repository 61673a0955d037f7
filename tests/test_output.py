"""course_lib.launcher.rank_output: pure helpers that turn rank output and exit codes into stable text.

The ChildFailedError text is produced by torch's own formatter (the same code
torchrun runs), and once by a real failing launch, so a change of format in a
new torch version shows up here.
"""

import json
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from course_lib.launcher.rank_output import (
    MAX_LINES_PER_RANK,
    clean_paths,
    describe_exit,
    exit_summary,
    parse_torchrun_failures,
    rank_block,
)
from proc_helpers import raising_launch

# ---------------------------------------------------------------- parse_torchrun_failures


def _failure(local_rank, exitcode, *, timestamp, error_file="/nonexistent/error.json", pid=None):
    failure = ProcessFailure(local_rank=local_rank, pid=pid or 1000 + local_rank, exitcode=exitcode, error_file=error_file)
    failure.timestamp = timestamp  # decides which one torch calls the root cause
    return failure


def _agent_output(failures: dict) -> str:
    """What torchrun prints when ranks fail: its log lines, a traceback, then the summary."""
    error = ChildFailedError(name="/tmp/course_lib_abc123/cell.py", failures=failures)
    return (
        "E1121 10:10:44.974000 3687 torch/distributed/elastic/multiprocessing/api.py:1002] "
        "failed (exitcode: 1) local_rank: 1 (pid: 1001) of binary: /usr/bin/python\n"
        "Traceback (most recent call last):\n"
        '  File "torch/distributed/launcher/api.py", line 383, in launch_agent\n'
        "    raise ChildFailedError(\n"
        f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: {error}\n"
    )


def test_parse_one_failure_and_one_rank_ended_by_torchrun():
    text = _agent_output({
        1: _failure(1, 1, timestamp=100),
        0: _failure(0, -signal.SIGTERM, timestamp=101),
    })
    assert "Root Cause" in text and "(SIGTERM)" in text  # really torch's format
    assert parse_torchrun_failures(text) == ({0: -15, 1: 1}, 1)


def test_parse_root_cause_is_the_earliest_failure_not_the_lowest_rank():
    text = _agent_output({
        0: _failure(0, -signal.SIGTERM, timestamp=105),
        2: _failure(2, -signal.SIGTERM, timestamp=105),
        3: _failure(3, 7, timestamp=100),
        1: _failure(1, -signal.SIGKILL, timestamp=104),
    })
    assert parse_torchrun_failures(text) == ({0: -15, 1: -9, 2: -15, 3: 7}, 3)


def test_parse_global_ranks_differ_from_local_ranks():
    # Second node of a 2 x 8 job: global rank 12 is local rank 4.
    text = _agent_output({12: _failure(4, 3, timestamp=100)})
    assert parse_torchrun_failures(text) == ({12: 3}, 12)


def test_parse_failure_with_an_error_file_and_a_multiline_traceback(tmp_path):
    # What a rank decorated with @record leaves: torch indents its traceback into the summary.
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {
        "message": "ValueError: bad",
        "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"x.py\"\nValueError: bad", "timestamp": "100"},
    }}))
    text = _agent_output({
        0: _failure(0, -signal.SIGTERM, timestamp=200),
        1: ProcessFailure(local_rank=1, pid=1001, exitcode=1, error_file=str(error_file)),
    })
    assert "ValueError: bad" in text
    assert parse_torchrun_failures(text) == ({0: -15, 1: 1}, 1)


@pytest.mark.parametrize("text", ["", "hello\n", "W1121 Sending process 3698 closing signal SIGTERM\n"])
def test_parse_without_failures(text):
    assert parse_torchrun_failures(text) == ({}, None)


@pytest.fixture(scope="module")
def real_failure():
    """One real launch (shared with test_torchrun): rank 1 raises, torchrun ends rank 0."""
    return raising_launch(2)


def test_parse_real_torchrun_output(real_failure):
    result = real_failure.result
    assert parse_torchrun_failures(result.agent_output) == ({0: -15, 1: 1}, 1)
    assert result.exit_codes == {0: -15, 1: 1}
    assert result.root_cause == 1
    assert exit_summary(result.exit_codes) == "exit: rank 0 -> SIGTERM; rank 1 -> 1"
    assert real_failure.leftovers == []


def test_real_agent_output_names_the_cell_not_the_temp_path(real_failure):
    agent = real_failure.result.agent_output
    assert "<cell> FAILED" in agent
    assert "course_lib_" not in agent and "cell.py" not in agent


# ---------------------------------------------------------------- clean_paths


def test_clean_paths_replaces_every_occurrence():
    path = "/tmp/course_lib_x1y2/cell.py"
    text = f'  File "{path}", line 3, in <module>\n  File "{path}", line 9, in f\n{path} FAILED\n'
    assert clean_paths(text, path) == '  File "<cell>", line 3, in <module>\n  File "<cell>", line 9, in f\n<cell> FAILED\n'


def test_clean_paths_custom_label_and_untouched_text():
    assert clean_paths("x /a/b.py y", "/a/b.py", label="<script>") == "x <script> y"
    assert clean_paths("nothing to see\n", "/a/b.py") == "nothing to see\n"


# ---------------------------------------------------------------- rank_block


def test_rank_block_prefixes_every_line():
    assert rank_block(3, "a\nb\n") == "[rank 3] a\n[rank 3] b\n"


def test_rank_block_ends_an_unfinished_last_line():
    assert rank_block(0, "loss 0.5") == "[rank 0] loss 0.5\n"


def test_rank_block_keeps_blank_lines_and_is_empty_for_no_output():
    assert rank_block(1, "a\n\nb\n") == "[rank 1] a\n[rank 1] \n[rank 1] b\n"
    assert rank_block(1, "") == ""


def test_rank_block_at_the_limit_keeps_everything():
    text = "".join(f"line {i}\n" for i in range(MAX_LINES_PER_RANK))
    assert rank_block(0, text).count("\n") == MAX_LINES_PER_RANK
    assert "omitted" not in rank_block(0, text)


def test_rank_block_default_limit_truncates_the_middle():
    n = MAX_LINES_PER_RANK + 50
    out = rank_block(2, "".join(f"line {i}\n" for i in range(n))).splitlines()
    half = MAX_LINES_PER_RANK // 2
    assert out[0] == "[rank 2] line 0"
    assert out[half - 1] == f"[rank 2] line {half - 1}"
    assert out[half] == "[rank 2] ... 50 lines omitted ..."
    assert out[half + 1] == f"[rank 2] line {n - half}"
    assert out[-1] == f"[rank 2] line {n - 1}"
    assert len(out) == 2 * half + 1


def test_rank_block_truncates_small_limit():
    out = rank_block(0, "".join(f"{i}\n" for i in range(10)), max_lines=4)
    assert out == "[rank 0] 0\n[rank 0] 1\n[rank 0] ... 6 lines omitted ...\n[rank 0] 8\n[rank 0] 9\n"


@pytest.mark.parametrize("max_lines", [
    1, 2, 3, 5, 8,
])
def test_rank_block_truncation_accounts_for_every_line(max_lines):
    n = 20
    out = rank_block(0, "".join(f"{i}\n" for i in range(n)), max_lines=max_lines).splitlines()
    assert len(out) <= max_lines + 1  # the kept lines plus one "omitted" line
    marker = [line for line in out if "omitted" in line]
    assert len(marker) == 1
    omitted = int(marker[0].split("... ")[1].split()[0])
    assert omitted + len(out) - 1 == n


# ---------------------------------------------------------------- describe_exit / exit_summary


@pytest.mark.parametrize(("code", "text"), [
    (0, "0"),
    (1, "1"),
    (3, "3"),
    (None, "still running, killed"),
    (-signal.SIGTERM, "SIGTERM"),
    (-signal.SIGKILL, "SIGKILL"),
    (-signal.SIGSEGV, "SIGSEGV"),
    (-signal.SIGABRT, "SIGABRT"),  # gloo's answer to mismatched shapes
    (-99, "signal 99"),
])
def test_describe_exit_names_signals(code, text):
    assert describe_exit(code) == text


def test_exit_summary_groups_ranks_in_rank_order():
    codes = {3: -15, 1: 1, 2: 0, 0: 0}
    assert exit_summary(codes) == "exit: ranks 0, 2 -> 0; rank 1 -> 1; rank 3 -> SIGTERM"


def test_exit_summary_after_a_deadline():
    assert exit_summary({0: None, 1: None}) == "exit: ranks 0, 1 -> still running, killed"


def test_exit_summary_is_one_line():
    summary = exit_summary({r: (r % 3) - 1 or None for r in range(8)})
    assert "\n" not in summary and summary.startswith("exit: ")


def test_frames_are_named_from_their_package_down_for_installed_and_editable_course_lib():
    import pathlib

    import course_lib
    from course_lib.launcher.rank_output import clean_paths, short_frames

    here = pathlib.Path(course_lib.__file__).resolve().parent  # an editable install: the clone's own folder
    text = (f'  File "{here}/measure/memory.py", line 12, in measure_step\n'
            '  File "/home/me/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 3, in f\n'
            '  File "/tmp/x/cell.py", line 4, in <module>\n')
    short = short_frames(text)
    assert 'File "course_lib/measure/memory.py", line 12' in short
    assert 'File "torch/nn/modules/module.py", line 3' in short
    assert str(here) not in short and "site-packages" not in short
    assert 'File "<cell>", line 4' in clean_paths(text, "/tmp/x/cell.py")


def test_the_cell_runners_frames_leave_a_stack_whether_its_path_is_absolute_or_short():
    from course_lib.launcher.torchrun import _RUNNER_FRAME

    for path in ("/home/me/course/course_lib/rank/cell_runner.py", "course_lib/rank/cell_runner.py"):
        stack = f'  File "<cell>", line 27 in <module>\n  File "{path}", line 142 in main\n'
        assert _RUNNER_FRAME.sub("", stack) == '  File "<cell>", line 27 in <module>\n'


def test_standard_library_frames_are_named_without_this_machines_folder():
    import sysconfig

    from course_lib.launcher.rank_output import short_frames

    stdlib = sysconfig.get_paths()["stdlib"]
    text = f'  File "{stdlib}/dataclasses.py", line 1021 in _process_class\n'
    assert short_frames(text) == '  File "dataclasses.py", line 1021 in _process_class\n'


def test_readable_stack_drops_the_import_machinery_and_keeps_every_other_frame():
    from course_lib.launcher.rank_output import readable_stack

    stack = ('Current thread (most recent call first):\n'
             '  File "<frozen importlib._bootstrap_external>", line 1659 in _fill_cache\n'
             '  File "torch/__init__.py", line 445 in <module>\n'
             '  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load\n'
             '  File "<cell>", line 2 in <module>\n')
    assert readable_stack(stack) == ('Current thread (most recent call first):\n'
                                     '  File "torch/__init__.py", line 445 in <module>\n'
                                     '  File "<cell>", line 2 in <module>\n')


def test_deadline_diagnosis_calls_only_waiting_ranks_stuck_and_prints_readable_stacks(capsys):
    from course_lib.magics.display import print_diagnosis

    print_diagnosis(["rank 0 is waiting in all_reduce #1 (4 B, world group)",
                     "rank 1 is still starting up (importing torch at cell line 2)"],
                    {1: '  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load\n'
                        '  File "<cell>", line 2 in <module>\n'})
    out, err = capsys.readouterr()
    assert out.splitlines() == ["stuck: rank 0 is waiting in all_reduce #1 (4 B, world group)",
                                "rank 1 is still starting up (importing torch at cell line 2)"]
    assert err.splitlines() == ["[rank 1] Python stack (most recent call first):",
                                '[rank 1]   File "<cell>", line 2 in <module>']

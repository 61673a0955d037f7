"""`%dist` / `%%dist` as a learner meets them: a real IPython kernel driven by jupyter_client.

One kernel serves the module, as one notebook would. Its pool outlives cells,
so cells run through `DistKernel`, the `Kernel` of test_magic_kernel with one
difference: processes alive after a cell are listed in `cell.leftovers`
instead of being waited for and killed. After a fault, the tests check
themselves that no process the kernel started is left (every one carries the
kernel's environment mark, see proc_helpers), and that the next cell works.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import signal
import time
from unittest import mock

import psutil
import pytest

import test_magic_kernel
from course_lib.backend_choice import choose_backend, gpu_count
from course_lib.launcher.pool import INTERRUPT_GRACE_S
from proc_helpers import describe, kill_quietly, marked_processes, still_alive
from test_magic_kernel import Cell, Kernel

MARGIN_S = 5.0  # a fault ends within its deadline (or the interrupt grace) plus this
STARTED = choose_backend(2).header(2, tag="dist") + ": started"
HEADER = "[dist] 2 ranks, backend gloo on cpu"
HEADER_4 = "[dist] 4 ranks, backend gloo on cpu"
RESTARTED = re.compile(r"\[dist\] the ranks had been stopped \((.*)\); started 2 new ones: earlier variables are gone")
STOPPED = ("the ranks were stopped; the next %%dist cell starts new ones (their variables are gone)")

POOL = "get_ipython().magics_manager.registry['DistMagics'].pool"  # the kernel's pool, read in the kernel

PRE = "import os, time, torch\nimport torch.distributed as dist\nimport course_lib as cl\nrank = dist.get_rank()\n"
PRE_LINES = 4  # cell lines taken by PRE (the magic line comes before them)


def _alive_now(procs, timeout_s: float = 0.0) -> list[psutil.Process]:
    """still_alive without the wait: a pool is meant to outlive the cell."""
    return still_alive(procs, timeout_s=0)


class DistKernel(Kernel):
    def execute(self, code: str, *, timeout_s: float = 60, during=None, allow_stdin: bool = True) -> Cell:
        """Kernel.execute; processes alive after the cell (a pool) are listed in leftovers, not killed."""
        with mock.patch.object(test_magic_kernel, "still_alive", _alive_now), \
             mock.patch.object(test_magic_kernel, "kill_quietly", lambda procs: None):
            return super().execute(code, timeout_s=timeout_s, during=during, allow_stdin=allow_stdin)

    def processes(self) -> list[psutil.Process]:
        """Every living process this kernel started (by mark, and below it)."""
        procs = {p.pid: p for p in self.cell_processes()}
        try:
            procs.update({p.pid: p for p in psutil.Process(self.pid).children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
        return still_alive(list(procs.values()), timeout_s=0)

    def assert_nothing_left(self) -> None:
        left = still_alive(self.processes(), timeout_s=3)
        names = describe(left)
        kill_quietly(left)
        assert names == []

    def value(self, expression: str):
        cell = self.execute(expression, timeout_s=20)
        assert cell.status == "ok", cell.outputs
        return cell.of_type("execute_result")[0]["data"]["text/plain"]


def start_kernel(path: pathlib.Path) -> DistKernel:
    k = DistKernel(path)
    k.load_ext = k.execute("%load_ext course_lib", timeout_s=30)
    assert k.load_ext.status == "ok" and k.load_ext.outputs == []
    return k


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = start_kernel(tmp_path_factory.mktemp("dist_kernel") / "kernel.log")
    try:
        yield k
    finally:
        k.shutdown()
        kill_quietly(k.cell_processes())


def one_error_line(cell: Cell, ename: str) -> dict:
    errors = cell.of_type("error")
    assert len(errors) == 1, cell.outputs
    assert errors[0]["ename"] == ename
    assert errors[0]["traceback"] == [f"{ename}: {errors[0]['evalue']}"]
    return errors[0]


def lines(cell: Cell, stream: str = "stdout") -> list[str]:
    return cell.text(stream).splitlines()


def next_seq(kernel: DistKernel, rank: int) -> int:
    """The `seq` of this rank's next world-group collective (cl.ledgers lists every one so far)."""
    assert kernel.execute("%%dist\npass").status == "ok"
    return int(kernel.value(f"import course_lib as cl\nsum(e['group'] == 'world' for e in cl.ledgers[{rank}]) + 1"))


def fault(kernel: DistKernel, code: str, timeout_s: float, **kwargs) -> tuple[Cell, dict]:
    """A cell that must end the pool: in time, with one RankFailure line, leaving no process."""
    cell = kernel.execute(code, timeout_s=timeout_s + 30, **kwargs)
    assert cell.elapsed_s < timeout_s + MARGIN_S, cell.elapsed_s
    error = one_error_line(cell, "RankFailure")
    kernel.assert_nothing_left()
    return cell, error


def assert_next_cell_restarts(kernel: DistKernel, reason: str | None = None) -> None:
    cell = kernel.execute("%%dist\nprint('next', flush=True)", timeout_s=60)
    assert cell.status == "ok", cell.outputs
    out = lines(cell)
    match = RESTARTED.fullmatch(out[0])
    assert match, out
    if reason is not None:
        assert match.group(1) == reason
    assert out[1:] == [HEADER, "[rank 0] next", "[rank 1] next"]
    assert cell.text("stderr") == ""


def assert_one_line_interrupt(cell: Cell) -> None:
    """An interrupted cell ends in error with one line, not a traceback through run_cell_magic and course_lib."""
    assert [(e["ename"], e["traceback"]) for e in cell.of_type("error")] == [("CellInterrupted", ["KeyboardInterrupt"])]


def assert_usage_error(cell: Cell, says: str) -> None:
    assert cell.status == "error"
    # Only stderr text: one line, though the kernel may send it in pieces (the notebook joins them).
    assert {(o["output_type"], o.get("name")) for o in cell.outputs} == {("stream", "stderr")}, cell.outputs
    text = cell.text("stderr")
    assert text.endswith("\n") and text.count("\n") == 1, text
    assert text.startswith("UsageError: ") and says in text, text
    assert "Traceback" not in text and "course_lib/" not in text


# ---------------------------------------------------------------- bad input before any pool


@pytest.mark.parametrize(("code", "says"), [
    ("%dist", "%dist: expected start, status, restart or stop, got 'nothing'"),
    ("%dist bogus", "%dist: expected start, status, restart or stop, got 'bogus'"),
    ("%dist start -n 0", "%dist start: argument -n/--nproc/--nproc-per-node: number of ranks must be between 1 and 64, got 0"),
    ("%dist start -n x", "%dist start: argument -n/--nproc/--nproc-per-node: expected a whole number of ranks, got 'x'"),
    ("%dist start --backend bogus", "%dist start: argument --backend: invalid choice: 'bogus'"),
    pytest.param("%dist start --backend nccl", "%dist start: --backend nccl needs one GPU per rank: 2 ranks asked, 0 GPUs found",
                 marks=pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU")),
    ("%dist start -n 2 --bogus", "%dist start: unrecognized arguments: --bogus"),
    ("%dist start -n 2 extra", "%dist start: unrecognized arguments: extra"),
    ("%dist -n 2", "%dist: expected start, status, restart or stop, got 'nothing'"),
    # One parser serves both forms (for %dist?): an option of the other form is refused by name.
    ("%dist start --timeout 5", "%dist start: --timeout is an option of %%dist cells"),
    ("%dist status -n 4", "%dist status: -n/--nproc/--nproc-per-node is an option of %dist start"),
    ("%dist stop --ranks 0", "%dist stop: --ranks is an option of %%dist cells"),
    ("%%dist -n 4\nprint(1)", "%%dist: -n/--nproc/--nproc-per-node is an option of %dist start"),
    ("%%dist --no-init\nprint(1)", "%%dist: --no-init is an option of %dist start"),
    ("%%dist start\nprint(1)", "%%dist: unrecognized arguments: start"),
    ('%%dist --ranks "0\nprint(1)', "%%dist: No closing quotation"),
    ("%dist restart", "%dist restart: no ranks to restart; start them with %dist start -n 2"),
    ("%%dist\nprint(1)", "%%dist: no ranks running: start them first with %dist start -n 2"),
    ("%%dist --ranks 0\nprint(1)", "%%dist: no ranks running: start them first with %dist start -n 2"),
])
def test_bad_input_before_start_is_one_usage_error_line(kernel, code, says):
    cell = kernel.execute(code, timeout_s=20)
    assert_usage_error(cell, says)
    assert cell.seen == {}  # not one process started
    assert kernel.processes() == []


def test_help_lists_the_options_of_both_forms():
    """What `%dist?` and `%%dist?` show: the help text magic_arguments builds from the declared options."""
    from course_lib.magics.dist_magic import DistMagics

    help_text = DistMagics.dist.__doc__
    assert help_text.splitlines()[2:4] == [
        "  %dist start [-n N] [--backend auto|gloo|nccl] [--no-init] | status | restart | stop",
        "  %%dist [--ranks 0,2] [--timeout SECONDS] [--expect-failure]",
    ]
    for option in ("start|status|restart|stop", "-n N, --nproc N, --nproc-per-node N", "--backend", "--no-init",
                   "--ranks <0,2>", "--timeout SECONDS", "--expect-failure"):
        assert option in help_text
    start_options, cell_options = help_text.split("\n%dist start:\n")[1].split("\n%%dist cells:\n")
    assert "--no-init" in start_options and "--ranks" not in start_options
    assert "--ranks" in cell_options and "--no-init" not in cell_options


@pytest.mark.parametrize("code", ["%dist?", "%%dist?"])
def test_question_mark_shows_the_options(kernel, code):
    cell = kernel.execute(code, timeout_s=20)
    assert cell.status == "ok" and cell.outputs == [] and len(cell.pages) == 1
    for option in ("%dist start [-n N]", "%%dist [--ranks 0,2]", "--no-init", "--ranks", "--expect-failure"):
        assert option in cell.pages[0]


def test_status_before_start(kernel):
    assert lines(kernel.execute("%dist status")) == ["[dist] no ranks running: start them with %dist start -n 2"]


# ---------------------------------------------------------------- a pool that works


def test_interrupted_start_is_one_line_and_leaves_nothing(kernel):
    def interrupt_once_torchrun_runs(outputs, updates, elapsed):
        if not at and any("torch.distributed.run" in p.cmdline() for p in kernel.processes()):
            kernel.km.interrupt_kernel()
            at.append(time.monotonic())

    at: list[float] = []
    cell = kernel.execute("%dist start -n 2", timeout_s=60, during=interrupt_once_torchrun_runs)
    assert at, "torchrun never started"
    assert cell.status == "error"
    assert_one_line_interrupt(cell)
    assert lines(cell) == ["[dist] interrupted while the ranks were starting; none is running"]
    kernel.assert_nothing_left()
    assert lines(kernel.execute("%dist status")) == ["[dist] no ranks running: start them with %dist start -n 2"]


def test_start(kernel):
    cell = kernel.execute("%dist start -n 2", timeout_s=60)
    assert cell.status == "ok"
    assert lines(cell) == [STARTED]
    assert cell.text("stderr") == ""
    ranks = [p for p in kernel.processes() if p.cmdline()[-2:] == ["-m", "course_lib.launcher.pool_worker"]
             and "torch.distributed.run" not in p.cmdline()]  # torchrun's own command line ends so too
    assert sorted(p.pid for p in ranks) == sorted(ast.literal_eval(kernel.value(f"list({POOL}.pids.values())")))
    assert len(ranks) == 2


@pytest.mark.parametrize(("code", "says"), [
    ("%%dist --ranks 7\nprint(1)", "%%dist: --ranks 7: the pool has ranks 0 to 1"),
    ("%%dist --ranks a,b\nprint(1)", "%%dist: --ranks takes numbers separated by commas, e.g. 0,2; got 'a,b'"),
    ("%%dist --timeout 0\nprint(1)", "%%dist: argument --timeout: timeout must be a positive number of seconds, got 0"),
    ("%%dist --timeout nan\nprint(1)", "timeout must be a positive number of seconds, got nan"),
    ("%%dist --bogus\nprint(1)", "%%dist: unrecognized arguments: --bogus"),
    # Line numbers as the learner counts them: the %%dist line is line 1.
    ("%%dist\nx = 1\n  y = 2\n", "%%dist: the cell does not parse: line 3: unexpected indent"),
    ("%%dist --ranks 0\nprint('a'\n", "%%dist: the cell does not parse: line 2: '(' was never closed"),
])
def test_bad_cell_input_is_one_usage_error_line_and_the_pool_is_untouched(kernel, code, says):
    before = sorted(p.pid for p in kernel.processes())
    cell = kernel.execute(code, timeout_s=20)
    assert_usage_error(cell, says)
    assert sorted(p.pid for p in kernel.processes()) == before
    assert lines(kernel.execute("%dist status"))[0].startswith(HEADER + ": running")


def test_state_persists_and_output_is_rank_ordered(kernel):
    first = kernel.execute("%%dist\n" + PRE + "x = 10 * rank\n")
    assert first.status == "ok"
    assert lines(first) == [HEADER] and first.text("stderr") == ""
    # Rank 1 prints first; the blocks still come in rank order, stdout before stderr.
    cell = kernel.execute("%%dist\nimport sys\nif rank == 0:\n    time.sleep(0.3)\n"
                          "print(f'x = {x}', flush=True)\nprint(f'warn {rank}', file=sys.stderr)\n")
    assert cell.status == "ok"
    assert lines(cell) == [HEADER, "[rank 0] x = 0", "[rank 1] x = 10"]
    assert lines(cell, "stderr") == ["[rank 0] warn 0", "[rank 1] warn 1"]
    # Header, then the live view: an empty display that showed rank lines and ends empty. (A loaded
    # kernel may send the header's text and its newline as two stream messages: merge runs of streams.)
    kinds = [kind for i, kind in enumerate(o["output_type"] for o in cell.outputs)
             if kind != "stream" or i == 0 or cell.outputs[i - 1]["output_type"] != "stream"]
    assert kinds[:2] == ["stream", "display_data"]
    assert cell.of_type("display_data")[0]["data"] == {"text/plain": ""}
    assert cell.updates and cell.updates[-1] == ""
    # Sent as nbclient and nbval send cells (nobody watching): no live view, so none is stored.
    batch = kernel.execute("%%dist\nprint(f'x = {x}')\n", allow_stdin=False)
    assert {o["output_type"] for o in batch.outputs} == {"stream"} and not batch.updates
    assert lines(batch) == [HEADER, "[rank 0] x = 0", "[rank 1] x = 10"]


def test_publish_fills_results_and_ledgers_list_the_collectives(kernel):
    seq = next_seq(kernel, 0)
    cell = kernel.execute("%%dist\n" + PRE +
                          "t = torch.full((3,), float(rank + 1))\n"
                          "dist.all_reduce(t)\n"
                          "dist.broadcast(torch.zeros(4, dtype=torch.float64), src=1)\n"
                          "cl.publish('total', t)\n"
                          "cl.publish('who', f'r{rank}')\n")
    assert cell.status == "ok", cell.outputs
    assert ast.literal_eval(kernel.value("{r: v.tolist() for r, v in cl.results['total'].items()}, cl.results['who']")) == \
        ({0: [3.0, 3.0, 3.0], 1: [3.0, 3.0, 3.0]}, {0: "r0", 1: "r1"})
    ledger_tail = kernel.value("[[(e['op'], e['seq'], e['bytes'], e['shapes'], e['dtype'], e['end'] is not None)"
                               " for e in cl.ledgers[r][-2:]] for r in sorted(cl.ledgers)]")
    assert ast.literal_eval(ledger_tail) == [[("all_reduce", seq, 12, [[3]], "float32", True),
                                              ("broadcast", seq + 1, 32, [[4]], "float64", True)]] * 2


# ---------------------------------------------------------------- an exception keeps the pool


def test_exception_on_a_rank_keeps_the_pool(kernel):
    assert kernel.execute("%%dist\nkept = 'before'").status == "ok"
    pids = sorted(p.pid for p in kernel.processes())
    cell = kernel.execute("%%dist\n"
                          "if rank == 1:\n"
                          "    raise ValueError(f'bad value on rank {rank}')\n"
                          "print('fine')\n")
    error = one_error_line(cell, "RankFailure")
    assert error["evalue"] == "rank 1 raised ValueError: bad value on rank 1; the ranks are still running"
    assert lines(cell) == [HEADER, "[rank 0] fine"]
    assert lines(cell, "stderr") == [
        "[rank 1] Traceback (most recent call last):",
        '[rank 1]   File "<cell>", line 3, in <module>',
        "[rank 1]     raise ValueError(f'bad value on rank {rank}')",
        "[rank 1] ValueError: bad value on rank 1",
    ]
    assert sorted(p.pid for p in kernel.processes()) == pids
    after = kernel.execute("%%dist\nprint(kept)")
    assert after.status == "ok" and lines(after) == [HEADER, "[rank 0] before", "[rank 1] before"]


def test_failing_collective_shows_the_learners_frames_and_is_recorded(kernel):
    """A wrong argument fails inside torch, under the ledger's wrapper (rank/ledger.py): the traceback
    goes from the cell's line into torch, with neither the wrapper's frame nor the worker's."""
    cell = kernel.execute("%%dist\n" + PRE + "dist.all_reduce([1.0, 2.0])\n")
    assert one_error_line(cell, "RankFailure")["evalue"].startswith("rank 0 raised ")
    for rank in (0, 1):
        err = [line[len(f"[rank {rank}] "):] for line in lines(cell, "stderr") if line.startswith(f"[rank {rank}] ")]
        assert err[:3] == ["Traceback (most recent call last):", f'  File "<cell>", line {PRE_LINES + 2}, in <module>',
                           "    dist.all_reduce([1.0, 2.0])"]
        assert any("distributed_c10d.py" in line for line in err)  # torch's frames stay: the learner called torch
        assert not any("course_lib" in line for line in err), err
        assert err[-2].startswith("TypeError: Invalid function argument.")
    assert kernel.value("import course_lib as cl\n[cl.ledgers[r][-1]['error'] for r in (0, 1)]") == "['TypeError', 'TypeError']"
    assert lines(kernel.execute("%dist status"))[0].startswith(HEADER + ": running")


def test_expect_failure(kernel):
    cell = kernel.execute("%%dist --expect-failure\nif rank == 0:\n    raise KeyError('k')\n")
    assert cell.status == "ok" and cell.of_type("error") == []
    assert lines(cell)[-1] == "as expected, rank 0 raised KeyError: 'k'; the ranks are still running"
    cell = kernel.execute("%%dist --expect-failure\npass")
    assert one_error_line(cell, "RankFailure")["evalue"] == "--expect-failure was given, but every rank finished without error"


# ---------------------------------------------------------------- faults that end the pool


def test_mismatched_ops_name_what_each_rank_waits_in(kernel):
    """gloo pairs rank 0's all_reduce with rank 1's broadcast (same size): both wait until the deadline."""
    s0, s1 = next_seq(kernel, 0), next_seq(kernel, 1)
    cell, error = fault(kernel, "%%dist --timeout 1\n" + PRE +
                        "t = torch.ones(2)\n"
                        "if rank == 0:\n"
                        "    dist.all_reduce(t)\n"
                        "else:\n"
                        "    dist.broadcast(t, src=0)\n", 1)
    assert error["evalue"] == f"deadline of 1 s passed; still running: ranks 0, 1; {STOPPED}"
    assert lines(cell)[1:] == [f"stuck: rank 0 is waiting in all_reduce #{s0} (8 B, world group); "
                               f"rank 1 is waiting in broadcast #{s1} (8 B, world group)"]
    err = lines(cell, "stderr")
    assert f'[rank 0]   File "<cell>", line {PRE_LINES + 4} in <module>' in err
    assert f'[rank 1]   File "<cell>", line {PRE_LINES + 6} in <module>' in err
    assert_next_cell_restarts(kernel, "deadline")


def test_mismatched_shapes_the_larger_rank_waits(kernel):
    """Measured on gloo: all_reduce of 2 vs 3 elements returns on the 2-element rank, with the sum
    of the first two elements and no error, and leaves the 3-element rank waiting."""
    seq = next_seq(kernel, 1)
    cell, error = fault(kernel, "%%dist --timeout 1\n" + PRE +
                        "t = torch.arange(2 if rank == 0 else 3, dtype=torch.float32) + 10 * rank\n"
                        "dist.all_reduce(t)\n"
                        "print(t.tolist(), flush=True)\n", 1)
    assert error["evalue"] == f"deadline of 1 s passed; still running: rank 1; {STOPPED}"
    assert lines(cell)[1:] == ["[rank 0] [10.0, 12.0]",
                               f"stuck: rank 1 is waiting in all_reduce #{seq} (12 B, world group)"]
    assert_next_cell_restarts(kernel, "deadline")


def test_a_rank_skipping_a_collective(kernel):
    seq = next_seq(kernel, 1)
    cell, error = fault(kernel, "%%dist --timeout 1\n" + PRE +
                        "if rank == 1:\n"
                        "    dist.all_reduce(torch.ones(3))\n"
                        "print('past it', flush=True)\n", 1)
    assert error["evalue"] == f"deadline of 1 s passed; still running: rank 1; {STOPPED}"
    assert lines(cell)[1:] == ["[rank 0] past it", f"stuck: rank 1 is waiting in all_reduce #{seq} (12 B, world group)"]
    assert_next_cell_restarts(kernel, "deadline")


def test_deadline_on_a_slow_cell_names_the_cell_line(kernel):
    seq = next_seq(kernel, 0)
    cell, error = fault(kernel, "%%dist --timeout 1.5\n" + PRE +
                        "dist.all_reduce(torch.ones(1))\n"
                        "print('sleeping', flush=True)\n"
                        "time.sleep(30)\n", 1.5)
    assert cell.elapsed_s >= 1.5
    assert error["evalue"] == f"deadline of 1.5 s passed; still running: ranks 0, 1; {STOPPED}"
    assert lines(cell)[1:] == ["[rank 0] sleeping", "[rank 1] sleeping",
                               f"stuck: ranks 0, 1 last completed all_reduce #{seq} (4 B, world group) "
                               f"and are running Python at cell line {PRE_LINES + 4}"]
    assert f'[rank 1]   File "<cell>", line {PRE_LINES + 4} in <module>' in lines(cell, "stderr")
    assert_next_cell_restarts(kernel, "deadline")


@pytest.mark.parametrize(("how", "says"), [
    ("os._exit(1)", r"rank 1 \((exit code )?1\)"),
    ("os.kill(os.getpid(), 9)", r"rank 1 \(SIGKILL\)"),
    ("dist.all_reduce(torch.ones(1000))  # 1000 vs 2000 elements: gloo aborts this rank", r"rank 1 \(SIGABRT\)"),
], ids=["os_exit", "sigkill", "cpp_abort"])
def test_a_rank_that_dies_is_named_and_the_next_cell_restarts(kernel, how, says):
    cell, error = fault(kernel, "%%dist --timeout 20\n" + PRE +
                        f"if rank == 1:\n    {how}\n"
                        "dist.all_reduce(torch.ones(2000))\n", 20)
    assert cell.elapsed_s < 5  # a death is noticed at once, not at the deadline
    assert re.fullmatch(says + re.escape(f" ended during the cell; {STOPPED}"), error["evalue"]), error["evalue"]
    assert_next_cell_restarts(kernel)


def test_restart_message_after_a_death_names_it(kernel):
    cell, error = fault(kernel, "%%dist --timeout 20\n" + PRE + "if rank == 1:\n    os._exit(3)\ntime.sleep(30)\n", 20)
    assert error["evalue"] == f"rank 1 (exit code 3) ended during the cell; {STOPPED}"
    assert_next_cell_restarts(kernel, "rank 1 died")


def test_ranks_that_died_between_cells_are_restarted_with_a_reason(kernel):
    assert kernel.execute("%%dist\npass").status == "ok"
    pid = int(kernel.value(f"{POOL}.pids[1]"))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and kernel.value(f"{POOL}.launch.proc.poll() is None") == "True":
        time.sleep(0.1)
    cell = kernel.execute("%%dist\nprint('next', flush=True)", timeout_s=60)
    assert cell.status == "ok"
    reason = RESTARTED.fullmatch(lines(cell)[0]).group(1)
    assert reason != "None"


# ---------------------------------------------------------------- interrupts (Ctrl-C / the stop button)


def _interrupt_when(kernel: DistKernel, *needed: str):
    """A `during` callback that interrupts the kernel once the live view shows every `needed` line."""
    at: list[float] = []

    def during(outputs, updates, elapsed):
        if not at and updates and all(n in updates[-1] for n in needed):
            kernel.km.interrupt_kernel()
            at.append(time.monotonic())

    return during, at


def test_interrupt_answered_by_every_rank_keeps_the_pool(kernel):
    assert kernel.execute("%%dist\nkept = 'still here'").status == "ok"
    pids = sorted(p.pid for p in kernel.processes())
    during, at = _interrupt_when(kernel, "[rank 0] started", "[rank 1] started")
    cell = kernel.execute("%%dist\nimport time\nprint('started', flush=True)\ntime.sleep(30)\n",
                          timeout_s=40, during=during)
    assert at, "the ranks never printed"
    assert time.monotonic() - at[0] < 2.0
    assert cell.status == "error"
    assert_one_line_interrupt(cell)
    assert lines(cell) == [HEADER, "[rank 0] started", "[rank 1] started", "interrupted"]
    # Each rank's traceback ends in the cell: not in the worker's SIGINT handler (launcher/pool_worker.py).
    assert lines(cell, "stderr") == [line for rank in (0, 1) for line in (
        f"[rank {rank}] Traceback (most recent call last):",
        f'[rank {rank}]   File "<cell>", line 4, in <module>',
        f"[rank {rank}]     time.sleep(30)",
        f"[rank {rank}] KeyboardInterrupt",
    )]
    assert sorted(p.pid for p in kernel.processes()) == pids
    after = kernel.execute("%%dist\nprint(kept)")
    assert after.status == "ok" and lines(after) == [HEADER, "[rank 0] still here", "[rank 1] still here"]


def test_interrupt_not_answered_inside_a_collective_kills_the_pool(kernel):
    seq = next_seq(kernel, 0)
    during, at = _interrupt_when(kernel, "[rank 1] started")
    cell = kernel.execute("%%dist\n" + PRE +
                          "if rank == 0:\n"
                          "    dist.all_reduce(torch.ones(2))\n"
                          "else:\n"
                          "    time.sleep(0.5)\n"
                          "    print('started', flush=True)\n"
                          "    time.sleep(30)\n", timeout_s=40, during=during)
    assert at, "rank 1 never printed"
    assert time.monotonic() - at[0] < INTERRUPT_GRACE_S + MARGIN_S
    assert cell.status == "error"
    assert_one_line_interrupt(cell)
    out = lines(cell)
    assert out[-3] == f"stuck: rank 0 is waiting in all_reduce #{seq} (8 B, world group)"
    # ("ranks 0 did not answer": the wording bug has its own test below)
    assert re.fullmatch(r"interrupted; ranks? 0 did not answer the interrupt; " + re.escape(STOPPED), out[-2]), out[-2]
    # Rank 0's stack goes to a file the cell names, not into the cell.
    saved = re.fullmatch(r"\(the ranks' Python stacks, for whoever debugs the course: (\S+)\)", out[-1])
    assert saved, out[-1]
    assert 'File "<cell>"' in pathlib.Path(saved.group(1)).read_text()
    pathlib.Path(saved.group(1)).unlink()
    assert "[rank 1] KeyboardInterrupt" in lines(cell, "stderr")  # rank 1 did answer
    assert not any("Python stack" in line for line in lines(cell, "stderr"))
    kernel.assert_nothing_left()
    assert_next_cell_restarts(kernel, "interrupt not answered")


def test_unanswered_interrupt_message_says_rank_for_one_rank():
    from course_lib.magics.dist_magic import _failure_message
    from course_lib.launcher.pool import CellResult

    result = CellResult([0, 1], {0: "", 1: ""}, {0: "", 1: ""}, {}, {}, interrupted=True, unfinished=[0])
    assert _failure_message(result, 60).startswith("rank 0 did not answer the interrupt")


# ---------------------------------------------------------------- status, restart, stop


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU")
def test_failed_start_keeps_the_running_pool(kernel):
    assert kernel.execute("%%dist\nkept = 1", timeout_s=60).status == "ok"
    pids = sorted(p.pid for p in kernel.processes())
    assert_usage_error(kernel.execute("%dist start --backend nccl"), "needs one GPU per rank")
    assert sorted(p.pid for p in kernel.processes()) == pids
    assert lines(kernel.execute("%dist status"))[0].startswith(HEADER + ": running")


def test_four_ranks_cell_on_some_ranks_only(kernel):
    cell = kernel.execute("%dist start -n 4", timeout_s=60)
    assert lines(cell) == [choose_backend(4).header(4, tag="dist") + ": started"]
    assert kernel.execute("%%dist\nimport torch.distributed as dist\nr = dist.get_rank()\nmark = 'no'").status == "ok"
    cell = kernel.execute("%%dist --ranks 0,2\nmark = 'yes'\nprint(r, dist.get_world_size())")
    assert cell.status == "ok"
    assert lines(cell) == ["[dist] ranks 0, 2 of 4, backend gloo on cpu", "[rank 0] 0 4", "[rank 2] 2 4"]
    cell = kernel.execute("%%dist\nprint(mark)")
    assert lines(cell) == [HEADER_4, "[rank 0] yes", "[rank 1] no", "[rank 2] yes", "[rank 3] no"]


def test_status_restart_stop(kernel):
    assert kernel.execute("%%dist\ngone = 'soon'").status == "ok"
    status = lines(kernel.execute("%dist status"))
    assert len(status) == 1 and re.fullmatch(re.escape(HEADER_4) + r": running, \d+ cells run", status[0])
    old = kernel.processes()
    assert len(old) >= 6  # watchdog, torchrun, four ranks
    cell = kernel.execute("%dist restart", timeout_s=60)
    assert lines(cell) == [HEADER_4 + ": restarted (every rank's variables are gone)"]
    assert still_alive(old, timeout_s=1) == []
    assert len(kernel.processes()) >= 6
    cell = kernel.execute("%%dist\nprint(gone)")
    assert cell.status == "error" and "NameError: name 'gone' is not defined" in cell.text("stderr")
    assert lines(kernel.execute("%dist stop")) == ["[dist] stopped"]
    kernel.assert_nothing_left()
    assert re.fullmatch(re.escape(HEADER_4) + r": stopped \(stopped\), \d+ cells run", lines(kernel.execute("%dist status"))[0])


# ---------------------------------------------------------------- two notebooks, kernel shutdown and death


@pytest.fixture(scope="module")
def second_kernel(tmp_path_factory):
    k = start_kernel(tmp_path_factory.mktemp("dist_kernel2") / "kernel.log")
    try:
        yield k
    finally:
        k.shutdown()
        kill_quietly(k.cell_processes())


def test_two_kernels_run_their_own_pools(kernel, second_kernel):
    a, b = kernel, second_kernel
    assert lines(a.execute("%dist start -n 2", timeout_s=60)) == [STARTED]
    assert lines(b.execute("%dist start -n 2", timeout_s=60)) == [STARTED]
    a_pids, b_pids = {p.pid for p in a.processes()}, {p.pid for p in b.processes()}
    assert a_pids and b_pids and a_pids.isdisjoint(b_pids)
    cell = "%%dist\nimport torch, torch.distributed as dist\nt = torch.tensor([float(dist.get_rank() + {base})])\n" \
           "dist.all_reduce(t)\nhistory = globals().get('history', []) + [int(t.item())]\nprint(history)"
    for round_ in (1, 2):
        out_a = a.execute(cell.format(base=1))
        out_b = b.execute(cell.format(base=10))
        assert lines(out_a)[1:] == [f"[rank {r}] {[3] * round_}" for r in (0, 1)]
        assert lines(out_b)[1:] == [f"[rank {r}] {[21] * round_}" for r in (0, 1)]
    for k in (a, b):
        assert lines(k.execute("%dist stop")) == ["[dist] stopped"]
        k.assert_nothing_left()


def test_kernel_killed_while_a_pool_runs_leaves_nothing(second_kernel):
    """A kernel that dies (here SIGKILL) cannot stop its pool: the pool's watchdog does."""
    k = second_kernel
    assert lines(k.execute("%dist start -n 2", timeout_s=60)) == [STARTED]
    procs = k.cell_processes()
    assert len(procs) >= 4  # watchdog, torchrun, two ranks
    run_dir = pathlib.Path(k.value(f"str({POOL}.run_dir)").strip("'"))
    assert run_dir.is_dir()
    os.kill(k.pid, signal.SIGKILL)
    assert still_alive(procs, timeout_s=10) == []
    assert marked_processes(k.mark) == []
    deadline = time.monotonic() + 5
    while run_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not run_dir.exists()


def test_kernel_shutdown_while_a_pool_runs_leaves_nothing(kernel):
    assert lines(kernel.execute("%dist start -n 2", timeout_s=60)) == [STARTED]
    procs = kernel.cell_processes()
    assert len(procs) >= 4
    kernel_proc = psutil.Process(kernel.pid)
    kernel.shutdown()
    assert still_alive([kernel_proc], timeout_s=10) == []
    assert still_alive(procs, timeout_s=5) == []
    assert marked_processes(kernel.mark) == []


def test_header_counts_one_rank_in_the_singular():
    from types import SimpleNamespace

    from course_lib.backend_choice import BackendChoice
    from course_lib.magics.dist_magic import _header

    pool = SimpleNamespace(nproc=1, choice=BackendChoice("nccl", "cuda", "1 GPU found, one per rank"))
    assert _header(pool, None) == "[dist] 1 rank, backend nccl on cuda"
    assert _header(SimpleNamespace(nproc=4, choice=pool.choice), [0, 2]) == "[dist] ranks 0, 2 of 4, backend nccl on cuda"

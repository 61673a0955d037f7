"""The `%%torchrun` magic as a learner meets it: a real IPython kernel driven by jupyter_client.

One kernel serves the whole module, as one notebook would; after every
failure the next cell must still work in it. Every process a cell starts
carries the kernel's environment mark, so leftovers are found by it, and a
ledger records the kernel's descendants while each cell runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import queue
import time

import psutil
import pytest
from IPython.core.error import UsageError
from jupyter_client import KernelManager

from course_lib.backend_choice import choose_backend, gpu_count
from course_lib.magics.args import parse_line
from course_lib.magics.torchrun_magic import DEFAULT_TIMEOUT_S, TorchrunMagics
from proc_helpers import (
    MARK_VAR, DescendantLedger, describe, kill_quietly, marked_processes, new_mark, no_new_children, startup_deadline_s,
    still_alive,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER_2 = choose_backend(2).header(2)


@dataclasses.dataclass
class Cell:
    """Everything one execute request produced, in the order nbval would see it."""

    status: str  # the execute_reply status: "ok" or "error"
    outputs: list[dict]  # {"output_type": ..., **content} for stream/display_data/execute_result/error
    updates: list[str]  # text/plain of each update_display_data, in order
    elapsed_s: float
    seen: dict[int, psutil.Process]  # kernel descendants seen while it ran
    names: dict[int, str]
    leftovers: list[str]  # cell processes alive after it finished (killed by the helper)
    pages: list[str] = dataclasses.field(default_factory=list)  # what `?` shows (the reply's "page" payloads)

    def text(self, name: str) -> str:
        return "".join(o["text"] for o in self.outputs if o["output_type"] == "stream" and o["name"] == name)

    def of_type(self, output_type: str) -> list[dict]:
        return [o for o in self.outputs if o["output_type"] == output_type]


class Kernel:
    def __init__(self, log_path: pathlib.Path):
        self.mark = new_mark()
        self.log = open(log_path, "wb")  # the kernel's own stdout/stderr, for post-mortems
        self.km = KernelManager(kernel_name="python3")
        env = dict(os.environ, **{MARK_VAR: self.mark, "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
        self.km.start_kernel(env=env, cwd=str(ROOT), stdout=self.log, stderr=self.log)
        self.pid = self.km.provisioner.process.pid
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.load_ext: Cell | None = None  # the module's first cell, `%load_ext course_lib`

    def execute(self, code: str, *, timeout_s: float = 60, during=None, allow_stdin: bool = True) -> Cell:
        """Run one cell; `during(cell_so_far)` is called about every 0.1 s while it runs.

        allow_stdin=False sends the cell as batch runners (nbclient, nbval) do.
        """
        msg_id = self.kc.execute(code, allow_stdin=allow_stdin)
        started = time.monotonic()
        outputs: list[dict] = []
        updates: list[str] = []
        with DescendantLedger(self.pid) as ledger:
            while True:
                left = timeout_s - (time.monotonic() - started)
                if left <= 0:
                    raise TimeoutError(f"cell did not finish in {timeout_s} s: {code[:60]!r}")
                try:
                    msg = self.kc.get_iopub_msg(timeout=min(left, 0.1))
                except queue.Empty:
                    msg = None
                if msg is not None and msg["parent_header"].get("msg_id") == msg_id:
                    kind, content = msg["msg_type"], msg["content"]
                    if kind == "status" and content["execution_state"] == "idle":
                        break
                    if (kind == "stream" and outputs and outputs[-1]["output_type"] == "stream"
                            and outputs[-1]["name"] == content["name"]):
                        # The kernel flushes a stream in pieces when a write straddles its flush timer;
                        # a notebook shows (and stores) consecutive pieces of one stream as one output.
                        outputs[-1] = {**outputs[-1], "text": outputs[-1]["text"] + content["text"]}
                    elif kind in ("stream", "display_data", "execute_result", "error"):
                        outputs.append({"output_type": kind, **content})
                    elif kind == "update_display_data":
                        updates.append(content["data"]["text/plain"])
                if during is not None:
                    during(outputs, updates, time.monotonic() - started)
            elapsed = time.monotonic() - started
        # The reply to this request, matched by its parent's id: other replies may come first (wait_for_ready
        # asks for kernel_info every second until one answer comes, and a busy kernel answers late).
        reply = self.kc.get_shell_msg(timeout=10)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=10)
        left = still_alive(list(ledger.seen.values()) + self.cell_processes(), timeout_s=1.0)
        leftovers = describe(left)
        kill_quietly(left)
        pages = [p["data"]["text/plain"] for p in reply["content"].get("payload", []) if p.get("source") == "page"]
        return Cell(reply["content"]["status"], outputs, updates, elapsed, dict(ledger.seen), dict(ledger.names), leftovers,
                    pages)

    def cell_processes(self) -> list[psutil.Process]:
        return marked_processes(self.mark, exclude={self.pid})

    def assert_still_works(self) -> None:
        cell = self.execute("1+1", timeout_s=20)
        assert cell.status == "ok"
        assert [o["data"]["text/plain"] for o in cell.of_type("execute_result")] == ["2"]

    def shutdown(self) -> None:
        if self.km.has_kernel:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)
        self.log.close()


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = Kernel(tmp_path_factory.mktemp("kernel") / "kernel.log")
    try:
        k.load_ext = k.execute("%load_ext course_lib", timeout_s=30)
        yield k
    finally:
        k.shutdown()


@pytest.fixture(autouse=True)
def _no_child_survives_a_test():
    with no_new_children():
        yield


def _single_line_traceback(cell: Cell, ename: str) -> dict:
    errors = cell.of_type("error")
    assert len(errors) == 1, cell.outputs
    error = errors[0]
    assert error["ename"] == ename
    assert error["traceback"] == [f"{ename}: {error['evalue']}"]
    return error


# ---------------------------------------------------------------- argument parsing (no kernel)


def parse_torchrun_args(line: str):
    return parse_line(TorchrunMagics.torchrun, line, "%%torchrun")


def test_parse_defaults():
    args = parse_torchrun_args("")
    assert (args.nproc, args.backend, args.timeout) == (2, "auto", DEFAULT_TIMEOUT_S)


@pytest.mark.parametrize(("line", "nproc", "backend", "timeout"), [
    ("-n 4 --backend gloo --timeout 2.5", 4, "gloo", 2.5),
    ("--nproc 3", 3, "auto", DEFAULT_TIMEOUT_S),
    ("--nproc-per-node=1 --backend=nccl", 1, "nccl", DEFAULT_TIMEOUT_S),
])
def test_parse_accepts(line, nproc, backend, timeout):
    args = parse_torchrun_args(line)
    assert (args.nproc, args.backend, args.timeout) == (nproc, backend, timeout)


@pytest.mark.parametrize("line", [
    "--timeout 0",
    "--timeout -1",
    "--timeout nan",
])
def test_parse_rejects_timeouts_that_are_not_positive_numbers(line):
    with pytest.raises(UsageError, match="^%%torchrun: argument --timeout: "):
        parse_torchrun_args(line)


@pytest.mark.parametrize(("line", "restarts"), [("", 0), ("--max-restarts 1", 1), ("--max-restarts=10", 10)])
def test_parse_max_restarts(line, restarts):
    assert parse_torchrun_args(line).max_restarts == restarts


@pytest.mark.parametrize("line", ["--max-restarts -1", "--max-restarts 11", "--max-restarts one"])
def test_parse_rejects_restart_counts_out_of_range(line):
    with pytest.raises(UsageError, match="^%%torchrun: argument --max-restarts: "):
        parse_torchrun_args(line)


def test_help_lists_every_option():
    """What `%%torchrun?` shows: the help text magic_arguments builds from the declared options."""
    help_text = TorchrunMagics.torchrun.__doc__
    assert help_text.splitlines()[2].startswith("  %%torchrun [-n N] [--backend {auto,gloo,nccl}]")
    for option in ("-n N, --nproc N, --nproc-per-node N", "--backend", "--timeout SECONDS", "--max-restarts K",
                   "--expect-failure"):
        assert option in help_text
    assert "Run this cell as a script on N ranks" in help_text


# ---------------------------------------------------------------- a cell that works


def test_load_ext_is_silent(kernel):
    assert kernel.load_ext.status == "ok"
    assert kernel.load_ext.outputs == []


@pytest.fixture(scope="module")
def ok_cell(kernel):
    return kernel.execute(
        "%%torchrun -n 2\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        "import course_lib as cl\n"
        "info = cl.init()\n"
        "t = torch.tensor([float(info.rank + 1)])\n"
        "dist.all_reduce(t)\n"
        'print(f"rank {info.rank}: sum {t.item():g}")\n'
        'cl.publish("total", t)\n'
        'cl.publish("word", f"r{info.rank}")\n'
        "dist.destroy_process_group()\n",
        timeout_s=90,
    )


def test_ok_cell_prints_header_then_rank_ordered_lines(ok_cell):
    assert ok_cell.status == "ok"
    assert ok_cell.text("stdout").splitlines() == [HEADER_2, "[rank 0] rank 0: sum 3", "[rank 1] rank 1: sum 3"]
    assert ok_cell.text("stderr") == ""
    assert ok_cell.of_type("error") == []


def test_ok_cell_live_view_is_an_empty_display_that_ends_empty(ok_cell):
    kinds = [o["output_type"] for o in ok_cell.outputs]
    assert kinds[:2] == ["stream", "display_data"]  # header first, then the live view
    displays = ok_cell.of_type("display_data")
    assert len(displays) == 1
    assert displays[0]["data"] == {"text/plain": ""}
    # While running it showed rank lines; the last update empties it again.
    assert any(u.startswith("[rank ") for u in ok_cell.updates)
    assert ok_cell.updates[-1] == ""


def test_ok_cell_results_readable_in_the_next_cell(kernel, ok_cell):
    cell = kernel.execute(
        "import course_lib as cl\n"
        'cl.results["word"], cl.results["total"][1].tolist(), sorted(cl.ledgers), cl.ledgers[0][0]["op"]'
    )
    assert cell.status == "ok"
    assert cell.of_type("execute_result")[0]["data"]["text/plain"] == "({0: 'r0', 1: 'r1'}, [3.0], [0, 1], 'all_reduce')"


def test_ok_cell_leaves_no_process(ok_cell):
    assert ok_cell.leftovers == []
    assert len(ok_cell.seen) >= 3  # the ledger did see torchrun and both ranks
    assert still_alive(ok_cell.seen.values(), timeout_s=0.5) == []


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(("code", "says"), [
    ("%%torchrun -n 0\nprint(1)", "%%torchrun: argument -n/--nproc/--nproc-per-node: number of ranks must be between 1 and 64, got 0"),
    ("%%torchrun -n 65\nprint(1)", "number of ranks must be between 1 and 64, got 65"),
    ("%%torchrun -n abc\nprint(1)", "expected a whole number of ranks, got 'abc'"),
    ("%%torchrun --backend bogus\nprint(1)", "%%torchrun: argument --backend: invalid choice: 'bogus'"),
    pytest.param("%%torchrun -n 2 --backend nccl\nprint(1)", "needs one GPU per rank: 2 ranks asked, 0 GPUs found",
                 marks=pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU")),
    ("%%torchrun -n 2\n", "empty"),  # IPython itself answers a cell magic with no body
    ("%%torchrun -n 2\n   \n\n", "the cell is empty"),
    ("%torchrun -n 2", "%torchrun is a cell magic"),
    ("%%torchrun -n 2\nx = (\n", "the cell does not parse"),
    ("%%torchrun -n 2\nprint('a')\n  print('b')\n", "the cell does not parse: line 3"),  # counted as in the cell: the magic is line 1
    ("%%torchrun -n 2 --bogus\nprint(1)", "%%torchrun: unrecognized arguments: --bogus"),
    ("%%torchrun -h\nprint(1)", "%%torchrun: unrecognized arguments: -h"),  # the options are under %%torchrun?
    ("%%torchrun -n 2 --timeout 0\nprint(1)", "timeout must be a positive number of seconds"),
    ('%%torchrun -n "2\nprint(1)', "%%torchrun: No closing quotation"),
])
def test_bad_input_is_one_usage_error_line(kernel, code, says):
    cell = kernel.execute(code, timeout_s=20)
    assert cell.status == "error"
    assert [o["output_type"] for o in cell.outputs] == ["stream"]  # no header: nothing was launched
    text = cell.text("stderr")
    assert text.endswith("\n") and text.count("\n") == 1, text
    assert text.startswith("UsageError: ")
    assert says in text
    assert "Traceback" not in text and "course_lib/" not in text
    assert cell.seen == {}  # not one process started


def test_question_mark_shows_the_options(kernel):
    cell = kernel.execute("%%torchrun?", timeout_s=20)
    assert cell.status == "ok" and cell.outputs == [] and len(cell.pages) == 1
    for option in ("%%torchrun [-n N]", "--nproc-per-node N", "--backend", "--timeout SECONDS", "--expect-failure"):
        assert option in cell.pages[0]


def test_kernel_works_after_bad_input(kernel):
    kernel.assert_still_works()


# ---------------------------------------------------------------- failures


@pytest.fixture(scope="module")
def failing_cell(kernel):
    return kernel.execute(
        "%%torchrun -n 2\n"
        "import os, time\n"
        "import course_lib as cl; cl.init()  # torch then prefixes tracebacks with [rank1]:\n"
        'print("before the error", flush=True)\n'
        'if os.environ["RANK"] == "1":\n'
        '    raise RuntimeError("rank 1 failed on purpose")\n'
        "time.sleep(60)\n",
        timeout_s=60,
    )


def test_failing_cell_raises_rank_failure_with_one_line(failing_cell):
    assert failing_cell.status == "error"
    error = _single_line_traceback(failing_cell, "RankFailure")
    assert error["evalue"] == "rank 1 failed with exit code 1: RuntimeError: rank 1 failed on purpose"


def test_failing_cell_shows_the_rank_traceback_and_exit_summary(failing_cell):
    out = failing_cell.text("stdout").splitlines()
    assert out == [HEADER_2, "[rank 0] before the error", "[rank 1] before the error", "exit: rank 0 -> SIGTERM; rank 1 -> 1"]
    err = failing_cell.text("stderr").splitlines()
    assert err[0] == "[rank 1] Traceback (most recent call last):"
    # Line 6 of the cell as the learner counts it, the %%torchrun line being line 1.
    assert err[1] == '[rank 1]   File "<cell>", line 6, in <module>'
    assert "[rank1]:" not in failing_cell.text("stderr")  # torch's own prefix is dropped: we add ours
    assert err[2] == '[rank 1]     raise RuntimeError("rank 1 failed on purpose")'
    assert err[-1] == "[rank 1] RuntimeError: rank 1 failed on purpose"
    assert all(line.startswith("[rank 1] ") for line in err)  # rank 0 was ended quietly
    assert "course_lib_" not in failing_cell.text("stderr")


def test_failing_cell_leaves_no_process_and_kernel_works(kernel, failing_cell):
    assert failing_cell.leftovers == []
    kernel.assert_still_works()


def test_deadline_cell_returns_in_time_naming_the_ranks(kernel):
    deadline = math.ceil(startup_deadline_s(imports=0))  # the ranks reach line 4 by then, even on a busy machine
    cell = kernel.execute(
        f"%%torchrun -n 2 --timeout {deadline}\n"
        "import time\n"
        'print("started", flush=True)\n'
        "time.sleep(60)\n",
        timeout_s=deadline + 30,
    )
    assert cell.elapsed_s < deadline + 5
    error = _single_line_traceback(cell, "RankFailure")
    assert error["evalue"] == (f"deadline of {deadline} s passed; ranks still running: 0, 1; "
                               "every process of this cell was killed")
    # The cell never imports course_lib, yet its stacks say where each rank is (the hook on line 1).
    assert cell.text("stdout").splitlines()[-2:] == [
        "exit: ranks 0, 1 -> still running, killed",
        "stuck: ranks 0, 1 are running Python at cell line 4, before any collective",
    ]
    assert cell.leftovers == []
    kernel.assert_still_works()


def test_interrupt_kills_every_process_of_the_cell(kernel):
    interrupted_at = []

    def interrupt_once_ranks_run(outputs, updates, elapsed):
        # Each rank prints after starting its helper: interrupt once the live view shows both lines.
        if not interrupted_at and updates and updates[-1].count("started") >= 2:
            kernel.km.interrupt_kernel()
            interrupted_at.append(time.monotonic())

    cell = kernel.execute(
        "%%torchrun -n 2\n"
        "import subprocess, time\n"
        'helper = subprocess.Popen(["sleep", "300"])\n'
        'print("started", flush=True)\n'
        "time.sleep(60)\n",
        timeout_s=40,
        during=interrupt_once_ranks_run,
    )
    assert interrupted_at, "the ranks never printed"
    assert time.monotonic() - interrupted_at[0] < 10
    assert cell.status == "error"  # so that "Run All" stops here
    # The summary, then one line as Python ends an interrupt: no traceback through run_cell_magic and course_lib.
    assert [(e["ename"], e["traceback"]) for e in cell.of_type("error")] == [("CellInterrupted", ["KeyboardInterrupt"])]
    out = cell.text("stdout").splitlines()
    # One line per rank saying where it was (time.sleep is cell line 5), no stack dump; the stacks in a file.
    at = out.index("interrupted; every process of this cell was killed. Where each rank was:")
    assert out[at + 1:at + 3] == [f"rank {r}: at cell line 5, before any collective" for r in (0, 1)]
    assert cell.text("stderr") == ""
    assert out[at + 3].startswith("(the ranks' Python stacks, for whoever debugs the course: ")
    pathlib.Path(out[at + 3].rsplit(" ", 1)[-1].rstrip(")")).unlink()
    # Ranks, their helpers and torchrun were all seen, and are all gone.
    assert sorted(cell.names.values()).count("sleep") == 2
    assert still_alive(cell.seen.values(), timeout_s=0.5) == []
    assert cell.leftovers == []
    # A later cell that reads the cut-off run is told so in one line (it was a raw IndexError).
    read = kernel.execute("import course_lib as cl\ncl.ledgers[0][-1]")
    assert [(e["ename"], e["traceback"]) for e in read.of_type("error")] == [("StaleResults", [
        "StaleResults: cl.results and cl.ledgers: the last multi-rank cell was interrupted before its ranks "
        "finished: run it again"])]
    kernel.assert_still_works()


def test_expect_failure_reports_the_failure_without_raising(kernel):
    cell = kernel.execute(
        "%%torchrun -n 2 --expect-failure\n"
        "import os, time\n"
        'if os.environ["RANK"] == "1":\n'
        '    raise RuntimeError("rank 1 failed on purpose")\n'
        "time.sleep(60)\n",
        timeout_s=60,
    )
    assert cell.status == "ok"
    assert cell.of_type("error") == []
    assert cell.text("stdout").splitlines()[-2:] == [
        "exit: rank 0 -> SIGTERM; rank 1 -> 1",
        "as expected, rank 1 failed with exit code 1: RuntimeError: rank 1 failed on purpose",
    ]
    assert cell.text("stderr").splitlines()[-1] == "[rank 1] RuntimeError: rank 1 failed on purpose"
    assert cell.leftovers == []


def test_expect_failure_raises_when_every_rank_succeeds(kernel):
    cell = kernel.execute("%%torchrun -n 2 --expect-failure\nprint('fine')\n", timeout_s=60)
    error = _single_line_traceback(cell, "RankFailure")
    assert error["evalue"] == "--expect-failure was given, but every rank exited 0"
    assert cell.text("stdout").splitlines() == [HEADER_2, "[rank 0] fine", "[rank 1] fine"]
    assert cell.leftovers == []
    kernel.assert_still_works()


# ---------------------------------------------------------------- regressions (bugs found by these tests)


def test_live_view_shows_a_line_soon_after_it_is_printed(kernel):
    shown = {}

    def watch(outputs, updates, elapsed):
        for name in ("line 1", "line 2"):
            if name not in shown and updates and name in updates[-1]:
                shown[name] = elapsed

    kernel.execute(
        "%%torchrun -n 1\n"
        "import time\n"
        'print("line 1", flush=True)\n'
        "time.sleep(0.05)\n"
        'print("line 2", flush=True)\n'
        "time.sleep(3)\n",
        timeout_s=30,
        during=watch,
    )
    assert "line 1" in shown
    assert "line 2" in shown and shown["line 2"] - shown["line 1"] < 1.5, shown


# ---------------------------------------------------------------- the end


def test_kernel_shutdown_leaves_nothing(kernel):
    kernel.assert_still_works()
    kernel_proc = psutil.Process(kernel.pid)
    kernel.shutdown()
    assert still_alive([kernel_proc], timeout_s=10) == []
    assert marked_processes(kernel.mark) == []


def test_kernel_killed_mid_cell_leaves_no_process(tmp_path):
    """A kernel restarted (killed) while ranks run: the launch's watchdog ends them."""
    k = Kernel(tmp_path / "kernel.log")
    try:
        k.execute("%load_ext course_lib", timeout_s=30)
        k.kc.execute("%%torchrun -n 2\nimport time\nprint('up', flush=True)\ntime.sleep(300)\n")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(k.cell_processes()) < 4:  # watchdog, torchrun, 2 ranks
            time.sleep(0.2)
        assert len(k.cell_processes()) >= 3, describe(k.cell_processes())
        # The ranks run <run dir>/cell.py: the watchdog must remove that folder too.
        scripts = {arg for p in k.cell_processes() for arg in p.cmdline() if arg.endswith("cell.py")}
        assert len(scripts) == 1, scripts
        run_dir = pathlib.Path(scripts.pop()).parent
        os.kill(k.pid, 9)
        assert still_alive(k.cell_processes(), timeout_s=10) == []
        deadline = time.monotonic() + 5
        while run_dir.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not run_dir.exists()
    finally:
        kill_quietly(k.cell_processes())
        k.km.cleanup_resources()
        k.log.close()

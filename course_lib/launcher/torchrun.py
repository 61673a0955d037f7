"""Run a script on N real ranks with `torchrun --standalone` and collect everything.

`run_torchrun(script, nproc)` writes the script to a private temporary
folder, launches it with real torchrun, follows each rank's stdout/stderr
log file (torchrun's `--redirects 3 --log-dir`), enforces a deadline, and
returns a `LaunchResult`: per-rank output, per-rank exit codes, which ranks
were still running when the deadline hit, and the values ranks published.
Each rank runs the script through `course_lib.rank.cell_runner`, so that
processes the script spawns do not run it again.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from ..backend_choice import BackendChoice, choose_backend
from ..rank.contract import (CELL_HOOK_MODULE, CELL_RUNNER_MODULE, ENV_BACKEND, ENV_DEVICE, ENV_LAUNCH_MARK,
                             ENV_RESULTS_DIR, PUBLISHED_GLOB, SCRIPT_NAME, ledger_file, parse_published,
                             ready_file)
from ..rank.ledger import read_ledger
from . import watchdog
from .diagnosis import collect, describe_stuck
from .processes import ProcessTree, kill_marked, new_mark
from ..rank.rehearsal import ENV_REHEARSE
from .rank_output import (LogFollower, attempt_failures, clean_paths, clean_rank_text, describe_exit,
                          parse_torchrun_failures, without_rehearsal)

__all__ = ["LaunchResult", "TorchrunProcess", "resolve_backend", "run_torchrun", "torchrun_command"]

POLL_S = 0.05  # how often we look at the log files and the deadline
# A cell's deadline counts from the moment every rank's `init_process_group` has returned (its ready file
# exists: rank.mark_ready_after_init), not from the launch: importing torch takes 2 s on a quiet laptop and
# 15 s on a loaded 2-core machine, and a hang shown with a 15 s deadline must not become "killed while
# importing". A cell that imports torch but whose ranks never all get there (no process group, a rank that
# never calls init, a hang before it) gets STARTUP_ALLOWANCE_S more; a cell without torch counts from the launch.
STARTUP_ALLOWANCE_S = 60.0
_IMPORTS_TORCH = re.compile(r"^\s*(?:import|from)\s+torch\b", re.M)
TREE_REFRESH_S = 1.0  # how often we record new descendant processes (each refresh scans the process table)

OutputCallback = Callable[[int, str, str], None]  # (rank, "stdout"|"stderr", text)
PollCallback = Callable[[], None]  # called every poll, e.g. to refresh a live view


@dataclasses.dataclass
class LaunchResult:
    nproc: int
    choice: BackendChoice
    stdout: dict[int, str]
    stderr: dict[int, str]
    exit_codes: dict[int, int | None]  # None: killed by us at the deadline/interrupt, or never started
    not_started: list[int]  # ranks torchrun had not started when the deadline/interrupt came
    root_cause: int | None  # the rank torchrun saw fail first
    timed_out: bool
    interrupted: bool
    agent_output: str  # torchrun's own stdout+stderr
    agent_exit_code: int | None
    results: dict[str, dict[int, Any]]
    elapsed_s: float
    # Seconds from the launch until every rank's init_process_group had returned, where the deadline starts
    # (None: the script imports no torch, or its ranks never all got there: counted from the launch).
    ready_s: float | None = None
    ledgers: dict[int, list[dict]] = dataclasses.field(default_factory=dict)  # collectives per rank (ledger.py)
    stacks: dict[int, str] = dataclasses.field(default_factory=dict)  # Python stacks of ranks stuck at the deadline
    diagnosis: list[str] = dataclasses.field(default_factory=list)  # who is stuck where, one line per state
    # After torchrun's restarts (--max-restarts): each earlier attempt's (how it ended, {rank: stdout}).
    # stdout, stderr, exit codes and ledgers above are the last attempt's; `results` holds what any attempt
    # published, a later attempt's value replacing an earlier one's under the same name.
    earlier_attempts: list[tuple[str, dict[int, str]]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.timed_out or self.interrupted) and self.agent_exit_code == 0

    @property
    def unfinished(self) -> list[int]:
        """Ranks that were still running when the deadline or interrupt came (and were killed)."""
        return sorted(r for r, code in self.exit_codes.items() if code is None and r not in self.not_started)

    @property
    def failed(self) -> list[int]:
        return sorted(r for r, code in self.exit_codes.items() if code not in (0, None))


def resolve_backend(nproc: int, backend: str | BackendChoice) -> BackendChoice:
    """A BackendChoice made by the caller (e.g. the magic, which printed it) is used as is;
    a name, "auto", "gloo" or "nccl", is decided here (BackendError if it cannot run)."""
    return backend if isinstance(backend, BackendChoice) else choose_backend(nproc, backend)


def torchrun_command(target: list[str], nproc: int, log_dir: str | None = None, max_restarts: int = 0) -> list[str]:
    """The command line: `python -m torch.distributed.run` is the `torchrun` entry point.

    `target` is `[script.py, args...]` or `["-m", "module", args...]`, as for torchrun.
    `max_restarts`: how many times torchrun starts every rank again after one fails.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    if log_dir is not None:
        cmd += [f"--log-dir={log_dir}", "--redirects=3"]
    return cmd + list(target)


def _child_env(choice: BackendChoice, results_dir: pathlib.Path, mark: str) -> dict[str, str]:
    env = dict(os.environ)
    env[ENV_LAUNCH_MARK] = mark  # inherited by every process of this launch: see processes.py
    env.setdefault("OMP_NUM_THREADS", "1")  # also silences torchrun's 4-line warning
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the log files (and the live view) at once
    env[ENV_BACKEND] = choice.backend
    if choice.requested == "gloo":
        # A cell that asks for gloo keeps its tensors on the CPU on purpose, on a GPU node too:
        # nothing to rehearse (rank/rehearsal.py).
        env.pop(ENV_REHEARSE, None)
    env[ENV_DEVICE] = choice.device_type
    env[ENV_RESULTS_DIR] = str(results_dir)
    # Ranks import the same course_lib as the kernel, installed or not.
    package_parent = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    return env


def _start_watchdog(mark: str, run_dir: pathlib.Path, env: dict[str, str]) -> subprocess.Popen:
    """Kills this launch's processes if this (kernel) process dies first: see watchdog.py."""
    # Run as a file, not with -m: importing the package would cost it ~50 ms of CPU.
    return subprocess.Popen(
        [sys.executable, watchdog.__file__, str(os.getpid()), ENV_LAUNCH_MARK, mark, str(run_dir)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C in the kernel must not end it
    )


def _read_results(results_dir: pathlib.Path) -> dict[str, dict[int, Any]]:
    import torch

    results: dict[str, dict[int, Any]] = {}
    for path in sorted(results_dir.glob(PUBLISHED_GLOB)):
        name, rank = parse_published(path)
        # Written by the ranks we started, in a folder only this user can read.
        results.setdefault(name, {})[rank] = torch.load(path, weights_only=False)
    return {name: dict(sorted(by_rank.items())) for name, by_rank in results.items()}


CELL_HOOK_IMPORT = f"import {CELL_HOOK_MODULE}"


def _with_cell_hook(script: str, first_line: str) -> str:
    """The script's file: the hook import (and `# first_line`) on line 1, then the script.

    The cell runner installs the hook itself; line 1 keeps the script's line
    numbers those of a cell whose first line is the magic, and leaves a file
    that plain torchrun could run too.
    """
    if "from __future__" in script:
        return f"# {first_line}\n{script}"  # a __future__ import must come first in a file
    return f"{CELL_HOOK_IMPORT}  # {first_line}\n{script}" if first_line else f"{CELL_HOOK_IMPORT}\n{script}"


def _cell_target(script_path: pathlib.Path) -> list[str]:
    """What torchrun runs on each rank: the cell runner, with the script's file (see cell_runner.py)."""
    return ["-m", CELL_RUNNER_MODULE, str(script_path)]


# A stack's frames of the runner, which calls the cell: `File ".../course_lib/rank/cell_runner.py", line 9 in main`
# (or `File "course_lib/rank/cell_runner.py"` once named from the package down: rank_output.short_frames).
_RUNNER_FRAME = re.compile(r'^.*File "(?:[^"]*/)?%s".*\n?' % re.escape(CELL_RUNNER_MODULE.replace(".", "/") + ".py"),
                           re.MULTILINE)


def _as_the_cell(result: LaunchResult) -> LaunchResult:
    """What torchrun ran is the runner module, but the learner knows the program as the cell: say so."""
    result.agent_output = clean_paths(result.agent_output, CELL_RUNNER_MODULE)  # "<cell> FAILED"
    result.stacks = {rank: without_rehearsal(_RUNNER_FRAME.sub("", stack)) for rank, stack in result.stacks.items()}
    return result


def run_torchrun(
    script: str,
    nproc: int,
    *,
    backend: str | BackendChoice = "auto",
    timeout_s: float = 120.0,
    on_output: OutputCallback | None = None,
    on_poll: PollCallback | None = None,
    cwd: str | None = None,
    first_line: str = "",
    max_restarts: int = 0,
) -> LaunchResult:
    """Run `script` on `nproc` ranks; return when all exit, the deadline passes, or on Ctrl-C.

    On a deadline or a KeyboardInterrupt every process this launch started is
    killed by PID and the result says which ranks had not finished; the
    interrupt is reported through `result.interrupted`, not re-raised.
    Each rank runs the script as its `__main__` through `course_lib.rank.cell_runner`,
    which installs `course_lib.rank.cell_hook` first (collective ledger and stack
    dumps, even if the script never calls `cl.init()`) and lets processes the
    script spawns (mp.spawn, DataLoader workers) import only its definitions.
    Line 1 of the script's file is the hook import with `first_line` as a comment
    after it: the script starts on line 2, so line numbers in tracebacks match a
    notebook cell whose first line is the magic.
    `backend` is a BackendChoice (used as is) or a name (see `resolve_backend`).
    `max_restarts`: torchrun's `--max-restarts`; every attempt's output is shown, in order, and the
    deadline covers them all.
    """
    choice = resolve_backend(nproc, backend)
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="course_lib_"))  # mode 0700
    try:
        script_path = run_dir / SCRIPT_NAME
        script_path.write_text(_with_cell_hook(script, first_line))
        return _as_the_cell(_launch_and_follow(script_path, nproc, choice, timeout_s, on_output, on_poll, cwd,
                                               max_restarts))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


class TorchrunProcess:
    """One torchrun agent we started: its own output, its process tree, and its watchdog.

    `target` is what torchrun runs: `[script.py]` or `["-m", "module"]`.
    Every process below it carries a fresh launch mark (see processes.py), and a
    watchdog kills them all if this (kernel) process dies first.
    """

    def __init__(self, target: list[str], nproc: int, choice: BackendChoice, run_dir: pathlib.Path,
                 *, cwd: str | None = None, extra_env: dict[str, str] | None = None, max_restarts: int = 0):
        self.mark = new_mark()
        self.log_dir = run_dir / "logs"
        self.results_dir = run_dir / "results"
        self.results_dir.mkdir(exist_ok=True)
        env = _child_env(choice, self.results_dir, self.mark) | (extra_env or {})
        self.watchdog = _start_watchdog(self.mark, run_dir, {k: v for k, v in env.items() if k != ENV_LAUNCH_MARK})
        try:
            self.proc = subprocess.Popen(
                torchrun_command(target, nproc, str(self.log_dir), max_restarts),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,  # Ctrl-C in the kernel must not reach torchrun: we end it ourselves
            )
            self.tree = ProcessTree(self.proc.pid, self.mark)
            self._agent_chunks: list[bytes] = []
            self._reader = threading.Thread(target=self._read_agent, daemon=True)
            self._reader.start()
        except BaseException:
            # A Ctrl-C here (a %dist start interrupted as torchrun starts) leaves the caller nothing to
            # kill: end whatever of this launch did start, found by its mark, and the watchdog.
            kill_marked(self.mark)
            self.watchdog.kill()
            self.watchdog.wait()
            raise

    def _read_agent(self) -> None:
        for chunk in iter(lambda: self.proc.stdout.read1(65536), b""):
            self._agent_chunks.append(chunk)

    def kill(self) -> None:
        """Kill every process of this launch (after a normal exit: whatever the ranks left behind)."""
        self.tree.kill_all()
        self.proc.wait()
        self.watchdog.kill()
        self.watchdog.wait()
        self._reader.join(timeout=5)
        if not self._reader.is_alive():  # else the reader still uses the pipe (a grandchild holds it open)
            self.proc.stdout.close()

    def agent_output(self) -> str:
        return b"".join(self._agent_chunks).decode("utf-8", errors="replace")


class _Deadline:
    """`timeout_s` after every rank's process group is up (when the script imports torch), else after the
    launch; a script that imports torch but whose ranks never all start a group gets STARTUP_ALLOWANCE_S more."""

    def __init__(self, timeout_s: float, started: float, nproc: int, results_dir: pathlib.Path, script: str):
        self.timeout_s, self.started = timeout_s, started
        self.waits_for_torch = _IMPORTS_TORCH.search(script) is not None
        self.ready = [results_dir / ready_file(rank) for rank in range(nproc)]
        self.ready_at: float | None = None

    def passed(self, now: float) -> bool:
        if not self.waits_for_torch:
            return now - self.started >= self.timeout_s
        if self.ready_at is None and all(path.exists() for path in self.ready):
            self.ready_at = now
        if self.ready_at is not None:
            return now - self.ready_at >= self.timeout_s
        return now - self.started >= self.timeout_s + STARTUP_ALLOWANCE_S


def _launch_and_follow(script_path, nproc, choice, timeout_s, on_output, on_poll, cwd, max_restarts=0):
    started = time.monotonic()
    launch = TorchrunProcess(_cell_target(script_path), nproc, choice, script_path.parent, cwd=cwd,
                             max_restarts=max_restarts)
    proc, tree = launch.proc, launch.tree
    follower = LogFollower(launch.log_dir, nproc)
    timed_out = interrupted = False
    unfinished: list[int] = []
    last_refresh = 0.0
    deadline = _Deadline(timeout_s, started, nproc, launch.results_dir, script_path.read_text())

    def forward(chunks):
        if on_output is not None:
            for rank, stream, text in chunks:
                on_output(rank, stream, clean_rank_text(rank, text, str(script_path)))

    try:
        while proc.poll() is None:
            forward(follower.poll())
            if on_poll is not None:
                on_poll()
            now = time.monotonic()
            if now - last_refresh >= TREE_REFRESH_S:
                tree.refresh()
                last_refresh = now
            if deadline.passed(now):
                timed_out = True
                break
            try:
                proc.wait(timeout=POLL_S)  # returns as soon as torchrun exits, unlike a sleep
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        interrupted = True
    stacks: dict[int, str] = {}
    if timed_out or interrupted:
        tree.refresh()
        stuck = tree.ranks()
        unfinished = sorted(stuck)
        _, stacks = collect(launch.results_dir, nproc, {r: p.pid for r, p in stuck.items()},
                            attempt=max(follower.attempts(), default=0))
    launch.kill()
    forward(follower.poll())
    last = max(follower.attempts(), default=0)  # after torchrun's restarts, the last attempt is the result
    ledgers = {r: read_ledger(str(launch.results_dir / ledger_file(r, last))) for r in range(nproc)}
    stacks = {r: clean_paths(text, str(script_path)) for r, text in stacks.items()}
    follower.close()
    not_started = sorted(set(range(nproc)) - follower.started(last)) if (timed_out or interrupted) else []

    agent_output = launch.agent_output()
    failures, root = parse_torchrun_failures(agent_output)
    earlier = _earlier_attempts(follower, agent_output, max_restarts, str(script_path))
    exit_codes: dict[int, int | None] = {}
    for r in range(nproc):
        if r in unfinished or r in not_started:
            exit_codes[r] = None
        else:
            # A rank that ended before a deadline ended with 0: had it failed,
            # torchrun would have stopped the run and listed it in `failures`.
            exit_codes[r] = failures.get(r, 0)
    return LaunchResult(
        nproc=nproc,
        choice=choice,
        stdout={r: clean_rank_text(r, t, str(script_path)) for r, t in follower.joined("stdout").items()},
        stderr={r: clean_rank_text(r, t, str(script_path)) for r, t in follower.joined("stderr").items()},
        exit_codes=exit_codes,
        not_started=not_started,
        root_cause=None if (timed_out or interrupted) else root,
        timed_out=timed_out,
        interrupted=interrupted,
        agent_output=clean_paths(agent_output, str(script_path)),
        agent_exit_code=None if (timed_out or interrupted) else proc.returncode,
        results=_read_results(launch.results_dir),
        elapsed_s=time.monotonic() - started,
        ready_s=None if deadline.ready_at is None else deadline.ready_at - started,
        ledgers=ledgers,
        stacks=stacks,
        diagnosis=describe_stuck(ledgers, stacks),
        earlier_attempts=earlier,
    )


def _earlier_attempts(follower: LogFollower, agent_output: str, max_restarts: int,
                      script: str) -> list[tuple[str, dict[int, str]]]:
    """Each attempt before the last: one line on how it ended, and what each rank printed.

    Its stderr is left out: whether a surviving rank raised (its peer gone) or was stopped first by
    torchrun varies from run to run; the line names the rank that failed first."""
    attempts = follower.attempts()
    seen = attempt_failures(agent_output)
    earlier = []
    for attempt in attempts[:-1]:
        if attempt < len(seen):
            rank, code = seen[attempt]
            how = f"exit code {code}" if code >= 0 else f"signal {describe_exit(code)}"
            ended = f"rank {rank} failed with {how}"
        else:
            ended = "a rank failed"
        line = (f"attempt {attempt} ended: {ended}; torchrun stopped the other ranks and started every rank "
                f"again (restart {attempt + 1} of at most {max_restarts})")
        stdout = {r: clean_rank_text(r, t, script) for r, t in follower.joined("stdout", attempt).items()}
        earlier.append((line, stdout))
    return earlier

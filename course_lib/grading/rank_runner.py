"""One grading rank: a process that runs one check after another on the learner's cell.

The checker's rank set (rank_set.py) starts these once per submission, forked
from a server that has already imported torch (rank_server.py), and sends each
a job per run over its connection.
Order matters in each run, because from step 5 on the learner's code shares
this process:

1. read this rank's inputs and delete the file;
2. start a gloo process group of the run's size (world_size may be smaller
   than the set: the other ranks sit the run out);
3. barrier: no rank goes on before every rank has deleted its inputs (so the
   learner's code cannot read another rank's inputs instead of communicating);
4. block the torch.distributed calls the exercise does not allow (put back after the run);
5. run the cell, find the function, call it through the exercise's driver per
   case, timing each case so the checker can split the ledger by case;
6. put the blocked calls back and wait in a barrier until every rank has
   finished the learner's function, so a rank that finished early cannot leave
   (destroy the group) while a peer still waits for its messages: that peer
   would fail with gloo's "Connection closed by peer" and be blamed for it;
7. write the outputs with torch.save (atomically) for the checker, which loads
   them with weights_only=True; destroy the group and report "done".

Each rank appends to `phase.rank<N>.txt` in the run's folder when it enters and
leaves the learner's function, so that at a deadline the checker can tell the
learner's collectives from its own (stuck.py), and when it starts each case
("case <i>", 0-based), so that a rank a signal ended is named with its case.

Resource limits (CPU seconds, memory, bytes written to any file, which also caps
output) are set once, before any learner code runs, for the process's life: a
hard limit cannot be raised again. A learner's exception or exit ends the process
like a script's would (traceback on stderr, exit code); the checker then starts a
fresh set. Expected values never come here: the checker computes them itself.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import json
import os
import resource
import signal
import sys
import threading
import time
import traceback
import types

import psutil
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..rank import ledger
from ..rank.contract import CELL_LABEL, ENV_LAUNCH_MARK, ledger_file, stacks_file
from .drivers import driver_for

__all__ = ["CASE_MARK", "EXIT_NO_FUNCTION", "PHASES", "phase_file", "serve"]

# A deadline that comes while the unfinished ranks are still using CPU is extended (at most this many times,
# each by the run's own deadline: rank_set.RankSet.run): on a loaded machine a correct answer is slow, not stuck.
# Ranks blocked in a collective use none, so a hang is still reported at the first deadline.
BUSY_EXTENSIONS = 2

EXIT_NO_FUNCTION = 3  # the cell ran but defines no function of the expected name
# Where a rank is in a run: the checker's set-up, the learner's function, the checker's code after it.
PHASES = ("before", "function", "after")
CASE_MARK = "case"  # a phase file's line "<time> case <i>": the rank started case i (0-based); not a phase
PARENT_CHECK_S = 0.5  # how often a rank checks that its grader still runs


def _limit(kind: int, value: int, grace: int = 0) -> None:
    """Set the soft limit to `value` and the hard one `grace` above it: an unprivileged process cannot raise
    a hard limit again."""
    soft, hard = resource.getrlimit(kind)
    top = value + grace
    if hard != resource.RLIM_INFINITY:
        value, top = min(value, hard), min(top, hard)
    resource.setrlimit(kind, (value, top))


def _apply_limits(limits: dict) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used_cpu = int(usage.ru_utime + usage.ru_stime) + 1
    # The soft limit sends SIGXCPU, which the checker names as CPU time; at an equal hard limit Linux sends
    # SIGKILL first, which reads like the memory killer. A few seconds of grace keep the two apart.
    _limit(resource.RLIMIT_CPU, used_cpu + int(limits["cpu_s"]), grace=5)
    # Memory a rank really uses (RLIMIT_DATA: heap and private writable mappings), not its address
    # space: a CUDA build of torch reserves tens of GiB it never touches (PROT_NONE), and under
    # RLIMIT_AS every rank died before the learner's code ran.
    _limit(resource.RLIMIT_DATA, int(limits["memory_bytes"]))
    _limit(resource.RLIMIT_FSIZE, int(limits["file_bytes"]))


def _die_with_grader(grader_pid: int) -> None:
    """End this rank when the grader that asked for it ends, even a grader killed by SIGKILL.

    The rank server (rank_server.py) kills its ranks when the grader goes; this
    covers a server that was itself killed.
    """
    grader = psutil.Process(grader_pid)  # remembers the start time: a reused PID is not the grader

    def alive() -> bool:
        try:  # a killed grader stays a zombie until its parent reaps it: dead all the same
            return grader.is_running() and grader.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def watch() -> None:
        while alive():
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="course-grader-watch").start()


_stack_file = None  # kept open: faulthandler writes to its descriptor from a signal handler


def _instrument(rank: int, set_dir: str) -> None:
    """Ledger of collectives and stacks on SIGUSR1, in the set's folder (diagnosis.py reads both)."""
    global _stack_file
    path = os.path.join(set_dir, ledger_file(rank))
    if os.path.exists(path):
        os.unlink(path)  # a restarted rank: the ledger of the killed one is not this one's
    ledger.install(path)
    _stack_file = open(os.path.join(set_dir, stacks_file(rank)), "w")
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def _redirect_output(job_dir: str, rank: int) -> None:
    """This run's stdout and stderr (the C library's too) go to files in the run's folder."""
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        stream.flush()
        name = "stdout" if fd == 1 else "stderr"
        target = os.open(os.path.join(job_dir, f"{name}.rank{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)


class _BlockedOps:
    """Replace each torch.distributed call the exercise does not allow by one that says so; `restore()` undoes it.

    Covers `dist.*`, `distributed_c10d.*` and the C++ group methods behind them
    (`vocabulary.PROCESS_GROUP_METHODS`: a learner could call those directly), except
    the methods an allowed call needs; not torch.ops.c10d.* (dispatcher ops), which
    the checker's ledger rules catch instead (checker.py).
    """

    def __init__(self, exercise_id: str, allowed: list[str]):
        from torch._C import _distributed_c10d as cpp

        from ..vocabulary import PROCESS_GROUP_METHODS, RECORDED_OPS, process_group_methods

        self.saved: list[tuple[object, str, object]] = []
        allowed_text = ", ".join(allowed)

        def refusal(name: str):
            def refused(*args, **kwargs):
                raise RuntimeError(f"{exercise_id} may use only {allowed_text}: {name} is not allowed here")

            return refused

        for name in RECORDED_OPS:
            if name not in allowed:
                self._replace(c10d, name, refusal(f"dist.{name}"))
                if hasattr(dist, name):
                    self._replace(dist, name, refusal(f"dist.{name}"))
        needed = {method for name in allowed for method in process_group_methods(name)}
        for cls in (cpp.ProcessGroup, cpp.Backend):
            for method in (m for methods in PROCESS_GROUP_METHODS.values() for m in methods):
                if method not in needed and hasattr(cls, method):
                    self._replace(cls, method, refusal(f"ProcessGroup.{method}"))

    def _replace(self, owner: object, name: str, value: object) -> None:
        self.saved.append((owner, name, owner.__dict__.get(name, getattr(owner, name, None))))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, value in reversed(self.saved):
            setattr(owner, name, value)


def _load_function(path: str, function: str, exercise_id: str):
    with open(path) as handle:
        source = handle.read()
    module = types.ModuleType("submission")
    module.__file__ = CELL_LABEL
    sys.modules["submission"] = module
    exec(compile(source, CELL_LABEL, "exec"), module.__dict__)
    fn = module.__dict__.get(function)
    if not callable(fn):
        print(f"{exercise_id}: the cell defines no function named {function}", file=sys.stderr, flush=True)
        os._exit(EXIT_NO_FUNCTION)
    return fn


def phase_file(rank: int) -> str:
    """Name of the file, in a run's folder, of `rank`'s phases: lines "<time.monotonic()> <phase>"."""
    return f"phase.rank{rank}.txt"


class _Phases:
    """Appends this rank's phase changes to its phase file, unbuffered: the record survives a hang."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def mark(self, phase: str) -> None:
        try:
            os.write(self.fd, f"{time.monotonic()!r} {phase}\n".encode())
        except OSError:  # the learner's code closed it or filled the disk quota: only a diagnosis is lost
            pass

    @contextlib.contextmanager
    def learner_code(self):
        """Marks "function" on entry and "after" on exit (returning or raising)."""
        self.mark("function")
        try:
            yield
        finally:
            self.mark("after")

    def around(self, fn):
        """`fn`, marking "function" when it is entered and "after" when it returns or raises.

        The wrapper keeps `fn`'s name and signature (functools.wraps; `inspect.unwrap` gives `fn`
        back), so a driver that registers it or looks at it sees the learner's function. A driver
        whose answer is a class (its methods run later, called by torch) wraps the whole block that
        uses it in `wrapper.learner_code()` instead, and calls `inspect.unwrap(wrapper)`.
        """
        @functools.wraps(fn)
        def learner_function(*args, **kwargs):
            with self.learner_code():
                return fn(*args, **kwargs)

        learner_function.learner_code = self.learner_code
        return learner_function

    def close(self) -> None:
        try:
            os.close(self.fd)  # a rank serves run after run: one descriptor per run would pile up
        except OSError:  # closed already, by the learner's code
            pass


def _set_rank_environment(rank: int, world_size: int) -> None:
    """What torchrun would have set: learners' code may read RANK or WORLD_SIZE."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))


def _run_check(job: dict, rank: int, store) -> None:
    """One run of one exercise on this rank (steps 1-7 of the module's docstring)."""
    job_dir = job["job_dir"]
    _redirect_output(job_dir, rank)
    phases = _Phases(os.path.join(job_dir, phase_file(rank)))
    phases.mark("before")
    inputs_path = os.path.join(job_dir, f"inputs.rank{rank}.pt")
    cases = torch.load(inputs_path, weights_only=True)
    os.unlink(inputs_path)

    _set_rank_environment(rank, job["world_size"])
    os.chdir(os.path.join(job_dir, "work"))  # whatever the learner's code writes lands here
    dist.init_process_group("gloo", store=dist.PrefixStore(f"run{job['run']}/", store), rank=rank,
                            world_size=job["world_size"],
                            # Longer than the run, however often a busy machine extends its deadline: the checker's
                            # deadline, which says who waits where, comes first.
                            timeout=datetime.timedelta(seconds=(2 + BUSY_EXTENSIONS) * job["timeout_s"] + 10))
    dist.barrier()
    blocked = _BlockedOps(job["exercise"], job["allowed_ops"]) if job["allowed_ops"] is not None else None

    fn = phases.around(_load_function(os.path.join(job_dir, "submission.py"), job["function"], job["exercise"]))
    driver = driver_for(job["exercise"], job["driver"])
    outputs, spans = [], []
    for case, args in enumerate(cases):
        phases.mark(f"{CASE_MARK} {case}")
        started = time.monotonic()
        outputs.append(driver(fn, *args))
        spans.append((started, time.monotonic()))

    if blocked is not None:
        blocked.restore()  # the barrier below is the checker's, whatever the exercise allows
    if dist.is_initialized():  # the learner's code may have destroyed the group, as a script ends
        dist.barrier()
    phases.close()
    final = os.path.join(job_dir, f"outputs.rank{rank}.pt")
    torch.save({"outputs": outputs, "spans": spans}, final + ".tmp")
    os.replace(final + ".tmp", final)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def _end_like_a_script(exc: BaseException) -> None:
    """What the interpreter does when a script raises or exits: traceback or message, then the exit code."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
        status = code if isinstance(code, int) else (0 if code is None else 1)
    else:
        traceback.print_exception(exc)
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # the output file is full (the learner printed too much): nothing more to say
        pass
    os._exit(status)  # not sys.exit: no atexit and no C++ destructors of a group the learner broke


def serve(rank: int, jobs, status, set_dir: str, store_port: int, limits: dict, mark: str,
          grader_pid: int) -> None:
    """Run jobs from `jobs` (a Connection of JSON messages) until it closes; report each on `status`."""
    _die_with_grader(grader_pid)
    os.environ[ENV_LAUNCH_MARK] = mark  # processes the learner's code starts carry the set's mark
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # as torchrun's ranks: N ranks share the machine's cores
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
    _instrument(rank, set_dir)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=60))
    _apply_limits(limits)
    status.send_bytes(json.dumps({"ready": rank}).encode())
    while True:
        try:
            job = json.loads(jobs.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        try:
            _run_check(job, rank, store)
        except BaseException as exc:  # noqa: BLE001 - the learner's error ends this rank, as in a script
            _end_like_a_script(exc)
        status.send_bytes(json.dumps({"done": job["run"]}).encode())
